//! One test per verifier rule: a module that breaks it is rejected, and the message names the
//! value, the op and the shapes involved.

mod common;

use waferc_ir::{
    verify, DType, Handle, Instr, IrError, KvCache, ModelMeta, Module, Op, Rope, RopeScaling, TensorType, Value,
    ValueType, Weight, WeightBytes,
};

/// `%0 = embed` (f32[64]), `%1` router logits (f32[4]), `%2 = router_topk` (routing[4, top2]),
/// `%3` the logits (f32[8], the output); one KV cache of 2 heads x 16.
fn base() -> Module {
    let meta = ModelMeta { architecture: "test".into(), vocab_size: 8, ..Default::default() };
    let mut m = Module::new(meta);
    let table = m.add_weight("table", TensorType::f32([8, 64]), WeightBytes::Absent);
    let gate = m.add_weight("gate", TensorType::f32([4, 64]), WeightBytes::Absent);
    let head = m.add_weight("head", TensorType::f32([8, 64]), WeightBytes::Absent);
    m.add_cache(KvCache { layer: 0, kv_heads: 2, head_dim: 16 });
    let x = m.push(Op::Embed { table }, None).unwrap();
    let logits = m.push(Op::MatVec { x, weight: gate, bias: None }, None).unwrap();
    m.push(Op::RouterTopK { logits, top_k: 2, normalize: false }, None).unwrap();
    m.output = Some(m.push(Op::MatVec { x, weight: head, bias: None }, None).unwrap());
    verify(&m).unwrap();
    m
}

fn x() -> Value {
    Handle::new(0)
}
fn router_logits() -> Value {
    Handle::new(1)
}
fn routing() -> Value {
    Handle::new(2)
}

fn f32_vec(n: u64) -> ValueType {
    ValueType::Tensor(TensorType::f32([n]))
}

fn weight(m: &mut Module, name: &str, shape: &[u64]) -> Handle<Weight> {
    m.add_weight(name, TensorType::f32(shape.to_vec()), WeightBytes::Absent)
}

/// Appends `op` with result type `ty` as `%4` without inference, and returns the verifier's
/// message. `Module::push` would refuse the op; a buggy pass or a hand-written file would not.
fn rejection(mut m: Module, op: Op, ty: ValueType) -> String {
    m.body.append(Instr { op, ty, layer: Some(0) });
    match verify(&m) {
        Err(e) => e.to_string(),
        Ok(()) => panic!("the verifier accepted a bad module"),
    }
}

#[test]
fn operands_must_be_defined_before_use() {
    let msg = rejection(base(), Op::Silu { x: Handle::new(4) }, f32_vec(64));
    assert_eq!(msg, "%4 = silu: operand %4 is not defined before use");
}

#[test]
fn weights_must_exist() {
    let msg = rejection(base(), Op::Embed { table: Handle::new(99) }, f32_vec(64));
    assert_eq!(msg, "%4 = embed: weight #99 does not exist");
}

#[test]
fn activations_must_be_f32_vectors() {
    let msg = rejection(base(), Op::Silu { x: routing() }, f32_vec(64));
    assert_eq!(msg, "%4 = silu: operand %2 must be an f32 vector, found routing[4, top2]");
}

#[test]
fn routings_must_come_from_a_router() {
    let msg = rejection(base(), Op::ExpertDispatch { x: x(), routing: router_logits(), expert: 0 }, f32_vec(64));
    assert_eq!(msg, "%4 = expert_dispatch: operand %1 must be a routing, found f32[4]");
}

#[test]
fn embedding_tables_are_two_dimensional() {
    let mut m = base();
    let table = weight(&mut m, "flat_table", &[512]);
    let msg = rejection(m, Op::Embed { table }, f32_vec(64));
    assert_eq!(msg, "%4 = embed: embedding table flat_table must be 2-D, found f32[512]");
}

#[test]
fn norm_weight_length_divides_the_input() {
    let mut m = base();
    let norm = weight(&mut m, "norm", &[24]);
    let msg = rejection(m, Op::RmsNorm { x: x(), weight: norm, eps: 1e-6 }, f32_vec(64));
    assert_eq!(
        msg,
        "%4 = rms_norm: norm weight norm is f32[24] but the input has 64 elements (need one group length dividing it)"
    );
}

#[test]
fn norm_epsilon_is_positive() {
    let mut m = base();
    let norm = weight(&mut m, "norm", &[64]);
    for eps in [0.0, -1e-6, f32::NAN] {
        let msg = rejection(m.clone(), Op::RmsNorm { x: x(), weight: norm, eps }, f32_vec(64));
        assert_eq!(msg, format!("%4 = rms_norm: eps must be positive, found {eps}"));
    }
}

#[test]
fn matvec_weight_columns_match_the_input() {
    let mut m = base();
    let w = weight(&mut m, "up", &[128, 32]);
    let msg = rejection(m, Op::MatVec { x: x(), weight: w, bias: None }, f32_vec(128));
    assert_eq!(msg, "%4 = matvec: weight up is f32[128, 32] but the input has 64 elements");
}

#[test]
fn matvec_bias_matches_the_rows() {
    let mut m = base();
    let w = weight(&mut m, "up", &[128, 64]);
    let b = weight(&mut m, "up_bias", &[64]);
    let msg = rejection(m, Op::MatVec { x: x(), weight: w, bias: Some(b) }, f32_vec(128));
    assert_eq!(msg, "%4 = matvec: bias up_bias is f32[64] but the weight has 128 rows");
}

#[test]
fn rope_head_dim_is_even_and_divides_the_input() {
    let rope = Rope { theta: 10000.0, scaling: RopeScaling::None };
    for head_dim in [0, 7, 24] {
        let msg = rejection(base(), Op::Rope { x: x(), head_dim, rope: rope.clone() }, f32_vec(64));
        assert_eq!(msg, format!("%4 = rope: head_dim {head_dim} must be even and divide the input's 64 elements"));
    }
}

fn attention(m: &mut Module, q: u64, kv: u64, cache: u32, heads: u32, scale: f32) -> Op {
    let wq = weight(m, "wq", &[q, 64]);
    let wkv = weight(m, "wkv", &[kv, 64]);
    let q = m.push(Op::MatVec { x: x(), weight: wq, bias: None }, None).unwrap();
    let k = m.push(Op::MatVec { x: x(), weight: wkv, bias: None }, None).unwrap();
    Op::Attention { q, k, v: k, cache: Handle::new(cache as usize), heads, scale, window: None, sinks: None }
}

/// Like `rejection`, for attention ops whose q and k take `%4` and `%5`: the op is `%6`.
fn attention_rejection(q: u64, kv: u64, cache: u32, heads: u32, scale: f32) -> String {
    let mut m = base();
    let op = attention(&mut m, q, kv, cache, heads, scale);
    rejection(m, op, f32_vec(q))
}

#[test]
fn attention_cache_must_exist() {
    let msg = attention_rejection(64, 32, 3, 4, 0.25);
    assert_eq!(msg, "%6 = attention: cache #3 does not exist");
}

#[test]
fn attention_query_heads_share_kv_heads_evenly() {
    let msg = attention_rejection(48, 32, 0, 3, 0.25);
    assert_eq!(msg, "%6 = attention: 3 query heads cannot share 2 KV heads evenly");
}

#[test]
fn attention_query_length_is_heads_times_head_dim() {
    let msg = attention_rejection(96, 32, 0, 4, 0.25);
    assert_eq!(msg, "%6 = attention: q has 96 elements, expected 4 heads x 16");
}

#[test]
fn attention_keys_and_values_fill_one_cache_row() {
    let msg = attention_rejection(64, 48, 0, 4, 0.25);
    assert_eq!(msg, "%6 = attention: k has 48 and v 48 elements, the cache holds 32 per position");
}

#[test]
fn attention_scale_is_finite() {
    let msg = attention_rejection(64, 32, 0, 4, f32::INFINITY);
    assert_eq!(msg, "%6 = attention: scale must be finite, found inf");
}

#[test]
fn elementwise_operands_have_equal_lengths() {
    let msg = rejection(base(), Op::Add { a: x(), b: router_logits() }, f32_vec(64));
    assert_eq!(msg, "%4 = add: operands have 64 and 4 elements");
    let msg = rejection(base(), Op::Mul { a: router_logits(), b: x() }, f32_vec(4));
    assert_eq!(msg, "%4 = mul: operands have 4 and 64 elements");
}

#[test]
fn router_top_k_is_between_one_and_the_expert_count() {
    for top_k in [0, 5] {
        let op = Op::RouterTopK { logits: router_logits(), top_k, normalize: true };
        let msg = rejection(base(), op, ValueType::Routing { experts: 4, top_k });
        assert_eq!(msg, format!("%4 = router_topk: top_k {top_k} must be between 1 and the 4 experts"));
    }
}

#[test]
fn dispatched_expert_exists() {
    let msg = rejection(base(), Op::ExpertDispatch { x: x(), routing: routing(), expert: 4 }, f32_vec(64));
    assert_eq!(msg, "%4 = expert_dispatch: expert 4 out of range for 4 experts");
}

#[test]
fn combine_takes_one_output_per_expert() {
    let msg = rejection(base(), Op::ExpertCombine { routing: routing(), experts: vec![x(); 3] }, f32_vec(64));
    assert_eq!(msg, "%4 = expert_combine: 3 expert outputs for a routing over 4 experts");
}

#[test]
fn combined_expert_outputs_have_equal_lengths() {
    let experts = vec![x(), x(), router_logits(), x()];
    let msg = rejection(base(), Op::ExpertCombine { routing: routing(), experts }, f32_vec(64));
    assert_eq!(msg, "%4 = expert_combine: expert outputs differ in length (64 vs 4)");
}

#[test]
fn recorded_types_equal_inferred_types() {
    let msg = rejection(base(), Op::Silu { x: x() }, f32_vec(65));
    assert_eq!(msg, "%4 = silu: recorded type f32[65] but operands give f32[64]");
    let msg = rejection(base(), Op::Silu { x: x() }, ValueType::Tensor(TensorType::new(DType::BF16, [64])));
    assert_eq!(msg, "%4 = silu: recorded type bf16[64] but operands give f32[64]");
}

#[test]
fn a_module_has_an_output() {
    let mut m = base();
    m.output = None;
    assert_eq!(verify(&m), Err(IrError::NoOutput));
    assert_eq!(IrError::NoOutput.to_string(), "module has no output value");
}

#[test]
fn the_output_is_a_vocabulary_row() {
    let mut m = base();
    m.output = Some(x());
    assert_eq!(
        verify(&m).unwrap_err().to_string(),
        "%0 = embed: output must be f32[8] (the vocabulary), found f32[64]"
    );
    m.output = Some(routing());
    assert_eq!(
        verify(&m).unwrap_err().to_string(),
        "%2 = router_topk: output must be f32[8] (the vocabulary), found routing[4, top2]"
    );
}

#[test]
fn the_output_names_an_instruction() {
    let mut m = base();
    m.output = Some(Handle::new(40));
    assert_eq!(verify(&m).unwrap_err().to_string(), "%40 = output: output names no instruction");
}

#[test]
fn the_shared_test_models_verify() {
    verify(&common::dense()).unwrap();
    verify(&common::moe()).unwrap();
}
