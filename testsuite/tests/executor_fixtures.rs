//! Every Hugging Face fixture (Llama, GQA bf16, Qwen2 biases, Qwen3 q/k norms, Mixtral and
//! Qwen3-MoE experts), compiled for a grid and validated against the reference decoder bit for
//! bit, prompt and greedy generation.

mod executor_common;

use executor_common::{compile_for, pack_tile_blob};
use waferc_runtime::executor::{validate, ValidationOptions};
use waferc_testsuite::fixtures_dir;

fn check_fixture(name: &str) {
    check_fixture_on(name, "grid:32x32")
}

fn check_fixture_on(name: &str, target: &str) {
    let model = waferc::frontend::load(&fixtures_dir().join("hf").join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let module = &model.module;
    let program = compile_for(module, target, 64);
    let blob = pack_tile_blob(&program, module);
    let vocab = module.meta.vocab_size;
    let prompt: Vec<u32> = [1, 17, 5, 42].iter().map(|t| t % vocab).collect();
    let options = ValidationOptions { max_new_tokens: 6, ..ValidationOptions::default() };
    let validation =
        validate(&program, module, Some(&blob), &prompt, &options).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(validation.steps, prompt.len() + 5, "{name}");
}

#[test]
fn llama_tiny_tok() {
    check_fixture("llama-tiny-tok");
}

#[test]
fn llama31_gqa_bf16() {
    check_fixture("llama31-gqa-bf16");
}

#[test]
fn qwen2_bias() {
    check_fixture("qwen2-bias");
}

#[test]
fn qwen3_dense() {
    check_fixture("qwen3-dense");
}

#[test]
fn mixtral_tiny() {
    check_fixture("mixtral-tiny");
}

#[test]
fn qwen3_moe_tiny() {
    check_fixture_on("qwen3-moe-tiny", "grid:64x64");
}

#[test]
fn mixtral_sharded_bf16() {
    check_fixture("mixtral-sharded-bf16");
}

/// The fixtures after `rewrite, dce` (q/k/v and gate/up fused, results split by `slice`s that
/// alias the fused layout): still bit-identical to the reference decoder on the original module.
#[test]
fn rewritten_fixtures_are_bit_exact() {
    for name in ["llama31-gqa-bf16", "qwen2-bias", "qwen3-dense", "mixtral-tiny"] {
        let model =
            waferc::frontend::load(&fixtures_dir().join("hf").join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let passes = waferc_passes::registry::parse_pipeline("rewrite, dce").unwrap();
        let (module, _) = waferc_passes::PassManager::new(passes).run(model.module.clone()).unwrap();
        assert!(module.body.iter().any(|(_, i)| matches!(i.op, waferc_ir::Op::Slice { .. })), "{name}: nothing fused");
        let program = compile_for(&module, "grid:32x32", 64);
        let blob = pack_tile_blob(&program, &module);
        let vocab = module.meta.vocab_size;
        let prompt: Vec<u32> = [1, 17, 5, 42].iter().map(|t| t % vocab).collect();
        let options = ValidationOptions { max_new_tokens: 6, ..ValidationOptions::default() };
        let validation =
            validate(&program, &module, Some(&blob), &prompt, &options).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(validation.steps, prompt.len() + 5, "{name}");
        // The executor ran the rewritten module; the reference on the original gives the same bits
        // (rewrite_reference.rs), so the placed fused program equals the unfused model.
    }
}
