//! Every Hugging Face fixture (Llama, GQA bf16, Qwen2 biases, Qwen3 q/k norms, Mixtral and
//! Qwen3-MoE experts), compiled for a grid and validated against the reference decoder bit for
//! bit, prompt and greedy generation; then every fixture again with its weights quantised to each
//! of the `quantize` pass's formats, and with one format per part.

mod executor_common;

use executor_common::{compile_for, pack_tile_blob};
use waferc_passes::{registry, PassManager};
use waferc_runtime::executor::{validate, ValidationOptions};
use waferc_testsuite::fixtures_dir;

fn check_fixture(name: &str) {
    check_fixture_on(name, "grid:32x32")
}

fn check_fixture_on(name: &str, target: &str) {
    check_fixture_with(name, target, "")
}

/// `name` after the pass pipeline `passes`, on `target`.
fn check_fixture_with(name: &str, target: &str, passes: &str) {
    let model = waferc::frontend::load(&fixtures_dir().join("hf").join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let pipeline = registry::parse_pipeline(passes).unwrap();
    let (module, _) = PassManager::new(pipeline).run(model.module).unwrap_or_else(|e| panic!("{name}, {passes}: {e}"));
    let module = &module;
    let program = compile_for(module, target, 64);
    let blob = pack_tile_blob(&program, module);
    let vocab = module.meta.vocab_size;
    let prompt: Vec<u32> = [1, 17, 5, 42].iter().map(|t| t % vocab).collect();
    let options = ValidationOptions { max_new_tokens: 6, ..ValidationOptions::default() };
    let validation =
        validate(&program, module, Some(&blob), &prompt, &options).unwrap_or_else(|e| panic!("{name}, {passes}: {e}"));
    assert_eq!(validation.steps, prompt.len() + 5, "{name}, {passes}");
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

const FIXTURES: [(&str, &str); 7] = [
    ("llama-tiny-tok", "grid:32x32"),
    ("llama31-gqa-bf16", "grid:32x32"),
    ("qwen2-bias", "grid:32x32"),
    ("qwen3-dense", "grid:32x32"),
    ("mixtral-tiny", "grid:32x32"),
    ("qwen3-moe-tiny", "grid:64x64"),
    ("mixtral-sharded-bf16", "grid:32x32"),
];

/// Every fixture with every weight the pass can take (layers, embedding, LM head) in `format`.
fn check_every_fixture_at(format: &str) {
    for (name, target) in FIXTURES {
        let passes = format!("quantize {format}:all");
        check_fixture_with(name, target, &passes);
        // The pass really changed the module (a fixture it left alone would prove nothing).
        let model = waferc::frontend::load(&fixtures_dir().join("hf").join(name)).unwrap();
        let (module, _) = PassManager::new(registry::parse_pipeline(&passes).unwrap()).run(model.module).unwrap();
        assert!(module.weights.iter().any(|(_, w)| w.ty.dtype.name() == format), "{name}: no {format} weight");
    }
}

#[test]
fn every_fixture_at_q8_0() {
    check_every_fixture_at("q8_0");
}

#[test]
fn every_fixture_at_q4_0() {
    check_every_fixture_at("q4_0");
}

#[test]
fn every_fixture_at_q4_1() {
    check_every_fixture_at("q4_1");
}

#[test]
fn every_fixture_with_a_format_per_part() {
    for (name, target) in FIXTURES {
        check_fixture_with(name, target, "quantize q4_1:layers q8_0:embedding+lm_head");
    }
}
