//! Small modules for unit tests, shared across crates: ir's dependency-graph tests and
//! passes' precedence and colouring tests build the same module, and a crate's unit tests
//! cannot import another crate's test code. (Compiled always rather than behind a feature: a
//! dev-dependency feature on ir would build every crate above it twice, once for `cargo build`
//! and once for `cargo test --workspace`.) Integration tests keep their larger builders in
//! each crate's `tests/common`.

use crate::Module;

/// One layer whose two matvecs `%1` and `%2` read the embedding `%0` side by side; `%3` adds
/// them, `%4` adds the residual `%0`, and `%5` is the head over `%4`.
pub fn siblings() -> Module {
    crate::text::parse(
        "module architecture=test vocab_size=8 num_layers=1\n\
         weight @table : bf16[8, 32]\nweight @a : bf16[32, 32]\nweight @b : bf16[32, 32]\n\
         weight @head : bf16[8, 32]\n\
         %0 = embed @table : f32[32]\n\
         layer 0 {\n  %1 = matvec %0, @a : f32[32]\n  %2 = matvec %0, @b : f32[32]\n  \
         %3 = add %1, %2 : f32[32]\n  %4 = add %3, %0 : f32[32]\n}\n\
         %5 = matvec %4, @head : f32[8]\noutput %5\n",
    )
    .expect("the test module parses")
}
