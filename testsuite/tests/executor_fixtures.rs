//! Every Hugging Face fixture (Llama, GQA bf16, Qwen2 biases, Qwen3 q/k norms, Mixtral and
//! Qwen3-MoE experts), compiled for a grid and validated against the reference decoder bit for
//! bit, prompt and greedy generation; then every fixture again with its weights quantised to each
//! of the `quantize` pass's formats, and with one format per part.

mod executor_common;

use executor_common::{compile_for, compile_with, pack_tile_blob};
use waferc_passes::wafer::CompileOptions;
use waferc_passes::{registry, PassManager};
use waferc_runtime::executor::{validate, ValidationOptions};
use waferc_testsuite::fixtures_dir;

fn check_fixture(name: &str) {
    check_fixture_on(name, "grid:32x32")
}

fn check_fixture_on(name: &str, target: &str) {
    check_fixture_with(name, target, "", 64, 6)
}

/// `name` after the pass pipeline `passes`, compiled for `target` with KV room for
/// `max_context` positions, `new_tokens` generated.
fn check_fixture_with(name: &str, target: &str, passes: &str, max_context: u32, new_tokens: usize) {
    check_fixture_planned(name, target, passes, CompileOptions::new(max_context), new_tokens)
}

/// As [`check_fixture_with`], compiled with `options` (a plan of its own, say).
fn check_fixture_planned(name: &str, target: &str, passes: &str, options: CompileOptions, new_tokens: usize) {
    let model = waferc::frontend::load(&fixtures_dir().join("hf").join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let pipeline = registry::parse_pipeline(passes).unwrap();
    let (module, _) = PassManager::new(pipeline).run(model.module).unwrap_or_else(|e| panic!("{name}, {passes}: {e}"));
    let module = &module;
    let program = compile_with(module, target, options);
    let blob = pack_tile_blob(&program, module);
    let vocab = module.meta.vocab_size;
    let prompt: Vec<u32> = [1, 17, 5, 42].iter().map(|t| t % vocab).collect();
    let options = ValidationOptions { max_new_tokens: new_tokens, ..ValidationOptions::default() };
    let validation =
        validate(&program, module, Some(&blob), &prompt, &options).unwrap_or_else(|e| panic!("{name}, {passes}: {e}"));
    assert_eq!(validation.steps, prompt.len() + new_tokens - 1, "{name}, {passes}");
}

/// gpt-oss (sinks, sliding window 8, YaRN, clamped SwiGLU, biases): 18 positions, so the
/// sliding layers' rings wrap twice; on several grids, and with a long context whose full
/// layers spread their KV cache over several blocks (the sinks join reductions across PEs).
#[test]
fn gpt_oss_tiny_bf16() {
    for target in ["grid:32x32", "grid:48x40", "grid:64x64"] {
        check_fixture_with("gpt-oss-tiny-bf16", target, "", 64, 15);
    }
    check_fixture_with("gpt-oss-tiny-bf16", "grid:64x64", "", 2048, 15);
}

/// gpt-oss on the stacked plan with each KV block spread over PEs by lane: the sliding layers'
/// rings overwrite rows of every lane group, and the sinks join on the first block of the
/// first lanes.
#[test]
fn gpt_oss_tiny_bf16_with_kv_blocks_by_lane() {
    for (plan, max_context) in
        [("stacked:1,100,spread2", 64), ("stacked:1,100,spread8", 64), ("stacked:2,100,spread4", 2048)]
    {
        let options = CompileOptions { plan: plan.parse().unwrap(), ..CompileOptions::new(max_context) };
        check_fixture_planned("gpt-oss-tiny-bf16", "grid:64x64", "", options, 40);
    }
}

#[test]
fn gpt_oss_tiny_mxfp4() {
    for target in ["grid:32x32", "grid:64x64"] {
        check_fixture_with("gpt-oss-tiny-mxfp4", target, "", 64, 15);
    }
    check_fixture_with("gpt-oss-tiny-mxfp4", "grid:64x64", "", 2048, 15);
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

/// The same gpt-oss weights compiled from both layouts: the MXFP4 release's expert weight tiles
/// take about a quarter of the bf16 ones' bytes (17 bytes per 32 weights against 64), the rest
/// of the model the same.
#[test]
fn gpt_oss_mxfp4_expert_tiles_are_a_quarter_of_bf16() {
    let expert_tile_bytes = |name: &str| -> (u64, u64) {
        let model = waferc::frontend::load(&fixtures_dir().join("hf").join(name)).unwrap();
        let program = compile_for(&model.module, "grid:32x32", 64);
        let (mut experts, mut rest) = (0, 0);
        for region in program.pes.iter().flat_map(|pe| &pe.regions) {
            if let waferc_ir::wafer::RegionKind::Weight { weight, .. } = &region.kind {
                let w = &model.module.weights[waferc_ir::Handle::new(*weight as usize)];
                match w.name.contains(".mlp.experts.") && w.name.ends_with("_proj.weight") {
                    true => experts += region.bytes as u64,
                    false => rest += region.bytes as u64,
                }
            }
        }
        (experts, rest)
    };
    let (bf16_experts, bf16_rest) = expert_tile_bytes("gpt-oss-tiny-bf16");
    let (mxfp4_experts, mxfp4_rest) = expert_tile_bytes("gpt-oss-tiny-mxfp4");
    assert_eq!(bf16_rest, mxfp4_rest, "only the experts differ");
    assert_eq!(mxfp4_experts * 64, bf16_experts * 17, "17 bytes per 32 MXFP4 weights, 64 in bf16");
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
        check_fixture_with(name, target, &passes, 64, 6);
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
        check_fixture_with(name, target, "quantize q4_1:layers q8_0:embedding+lm_head", 64, 6);
    }
}

/// A 32x32 grid whose routers have only `colours` colours (WSE-3 has 24).
fn few_colour_grid(colours: u8) -> waferc_targets::Target {
    let mut target = waferc_targets::Target::grid(32, 32);
    target.name = format!("grid:32x32 with {colours} colours");
    target.colours_per_pe.value = colours;
    target
}

/// Colouring under a small budget (routes of one instruction sent in different steps share a
/// colour; detours round saturated routers): the dense GQA and the Mixtral fixture compile on a
/// 32x32 grid with 3 colours per router, use no more, and run bit-exact against the reference;
/// with 2 colours the compile fails with an error naming the PE that ran out, not a panic.
#[test]
fn fixtures_compile_bit_exact_with_three_colours_on_32x32() {
    for name in ["llama31-gqa-bf16", "mixtral-tiny"] {
        let module = waferc::frontend::load(&fixtures_dir().join("hf").join(name)).unwrap().module;
        let options = waferc_passes::wafer::CompileOptions::new(64);
        let program = waferc_passes::wafer::compile(&module, &few_colour_grid(3), &options)
            .unwrap_or_else(|e| panic!("{name} on 32x32 with 3 colours: {e}"));
        let most = program.routes.iter().map(|r| r.colour).max().expect("the program routes something");
        assert!(most < 3, "{name}: colour {most} used with 3 per router");
        waferc_passes::wafer::check(&program, &module).unwrap_or_else(|e| panic!("{name}: {e}"));
        let blob = pack_tile_blob(&program, &module);
        let prompt: Vec<u32> = [1, 17, 5, 42].iter().map(|t| t % module.meta.vocab_size).collect();
        let options = ValidationOptions { max_new_tokens: 4, ..ValidationOptions::default() };
        let validation =
            validate(&program, &module, Some(&blob), &prompt, &options).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(validation.steps, prompt.len() + 3, "{name}");

        let options = waferc_passes::wafer::CompileOptions::new(64);
        let err = waferc_passes::wafer::compile(&module, &few_colour_grid(2), &options)
            .expect_err("2 colours are too few for these fixtures on 32x32");
        let text = err.to_string();
        assert!(text.contains("needs a colour") && text.contains("PE(w0"), "{name}: {text}");
        // It names the routes along the failed route's path that hold the colours.
        assert!(text.contains("its path meets routes") && text.contains(" of %"), "{name}: {text}");
    }
}
