//! One-line tests of each `rewrite` rule, in the style of egg's `tests/math.rs`: saturate the
//! start term and prove the goal pattern is in the root's e-class (or, `should_panic`, that it
//! is not). Terms: `(w ROWS DTYPE INDEX)` a weight, `(matvec W B X)`, `(slice OFFSET LEN X)`.

use waferc_passes::rewrite::lang::rules;

egg::test_fn! {
    fuses_two_matvecs_reading_one_input, rules(),
    "(pair (matvec (w 4 f32 0) nobias x) (matvec (w 8 f32 1) nobias x))"
    => "(pair (slice 0 4 (matvec (cat (w 4 f32 0) (w 8 f32 1)) nobias x))
              (slice 4 8 (matvec (cat (w 4 f32 0) (w 8 f32 1)) nobias x)))"
}

egg::test_fn! {
    fuses_q_k_v_into_one_with_flat_slices, rules(),
    "(attention (matvec (w 4 bf16 0) nobias h) (matvec (w 2 bf16 1) nobias h) (matvec (w 2 bf16 2) nobias h))"
    => "(attention (slice 0 4 ?f) (slice 4 2 ?f) (slice 6 2 ?f))"
}

egg::test_fn! {
    stacks_in_module_weight_order, rules(),
    "(pair (matvec (w 4 f32 7) nobias x) (matvec (w 8 f32 3) nobias x))"
    => "(pair (slice 8 4 (matvec (cat (w 8 f32 3) (w 4 f32 7)) nobias x)) ?b)"
}

egg::test_fn! {
    stacks_biases_with_their_weights, rules(),
    "(pair (matvec (w 4 f32 0) (w 4 f32 9) x) (matvec (w 2 f32 1) (w 2 f32 10) x))"
    => "(pair (slice 0 4 (matvec (cat (w 4 f32 0) (w 2 f32 1)) (cat (w 4 f32 9) (w 2 f32 10)) x)) ?b)"
}

egg::test_fn! {
    #[should_panic(expected = "Could not prove goal 0")]
    does_not_fuse_different_inputs, rules(),
    "(pair (matvec (w 4 f32 0) nobias x) (matvec (w 4 f32 1) nobias y))"
    => "(pair (slice 0 4 ?f) ?b)"
}

egg::test_fn! {
    #[should_panic(expected = "Could not prove goal 0")]
    does_not_fuse_different_storage_types, rules(),
    "(pair (matvec (w 4 q8_0 0) nobias x) (matvec (w 4 f32 1) nobias x))"
    => "(pair (slice 0 4 ?f) ?b)"
}

egg::test_fn! {
    #[should_panic(expected = "Could not prove goal 0")]
    does_not_fuse_a_biased_with_an_unbiased_matvec, rules(),
    "(pair (matvec (w 4 f32 0) (w 4 f32 2) x) (matvec (w 4 f32 1) nobias x))"
    => "(pair (slice 0 4 ?f) ?b)"
}

egg::test_fn! {
    slices_of_slices_flatten, rules(),
    "(slice 1 2 (slice 4 8 y))" => "(slice 5 2 y)"
}

egg::test_fn! {
    duplicate_subexpressions_share_a_class, rules(),
    "(pair (silu (matvec (w 4 f32 0) nobias x)) (silu (matvec (w 4 f32 0) nobias x)))" => "(pair ?a ?a)"
}
