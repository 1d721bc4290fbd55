//! The real SmolLM2-135M (GGUF, Q4_1 and Q8_0 weights) compiled for a WSE-3 and run on the
//! executor: every step of the golden prompt and the continuation bit-identical to the reference
//! decoder, whose tokens are transformers' (gguf_smollm2.rs checks that).

use waferc::frontend;
use waferc_ir::wafer::artifact::{self, Artifact};
use waferc_ir::wafer::Plan;
use waferc_passes::wafer::{check, compile, CompileOptions};
use waferc_runtime::executor::{validate, ValidationOptions};
use waferc_targets::Target;
use waferc_testsuite::{fixtures_dir, smollm2_gguf_path};

#[test]
fn smollm2_on_wse3_is_bit_exact_and_matches_the_transformers_tokens() {
    bit_exact_on_wse3(Plan::Tiled, false);
}

/// The stacked plan at the wafer share the plan search picks for this model.
#[test]
fn smollm2_stacked_on_wse3_is_bit_exact() {
    bit_exact_on_wse3(
        Plan::Stacked {
            layers_per_region: 1,
            wafer_percent: 35,
            kv_copies: 1,
            experts_per_lane: 1,
            kv_spread: 1,
            kv_slices: 1,
        },
        false,
    );
}

/// The default pipeline's module (q/k/v and gate/up fused), whose fused results the stacked plan
/// cuts part by part, at the plan the search picks for it: each KV head's cache in three copies,
/// one per query head.
#[test]
fn smollm2_rewritten_stacked_on_wse3_is_bit_exact() {
    bit_exact_on_wse3(
        Plan::Stacked {
            layers_per_region: 1,
            wafer_percent: 35,
            kv_copies: 3,
            experts_per_lane: 1,
            kv_spread: 1,
            kv_slices: 1,
        },
        true,
    );
}

/// The plan the search picks for this model at `--search-position 1024`: each KV block also
/// spread over four PEs by lane.
#[test]
fn smollm2_rewritten_stacked_spread_on_wse3_is_bit_exact() {
    bit_exact_on_wse3("stacked:1,35,kv3,spread4".parse().unwrap(), true);
}

fn bit_exact_on_wse3(plan: Plan, rewrite: bool) {
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures_dir().join("smollm2/golden.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    let prompt = ids(&golden["prompts"][0]["prompt"]);
    let expected = ids(&golden["prompts"][0]["tokens"]);
    let new_tokens = 6;

    let mut loaded = frontend::load(&smollm2_gguf_path()).unwrap();
    if rewrite {
        let passes = waferc_passes::registry::parse_pipeline("rewrite, dce").unwrap();
        let (module, _) = waferc_passes::PassManager::new(passes).run(loaded.module).unwrap();
        assert!(module.weights.iter().any(|(_, w)| w.name.contains('+')), "the rewrite fused something");
        loaded.module = module;
    }
    let options = CompileOptions { plan, ..CompileOptions::new((prompt.len() + new_tokens) as u32) };
    let program = compile(&loaded.module, &Target::resolve("wse3").unwrap(), &options).unwrap();
    check(&program, &loaded.module).unwrap();

    // Through the artifact file, as `waferc run` does.
    let dir = std::env::temp_dir().join(format!("waferc-smollm2-{}-{}-{rewrite}", std::process::id(), plan));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("smollm2.wafer");
    artifact::write(&path, &Artifact::new(program, loaded.module)).unwrap();
    let compiled = artifact::read(&path).unwrap();

    let run = ValidationOptions { max_new_tokens: new_tokens, force_tokens: None, stop_tokens: Vec::new() };
    let validation = validate(&compiled.program, &compiled.module, compiled.tiles.bytes(), &prompt, &run)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(validation.steps, prompt.len() + new_tokens - 1);
    assert_eq!(validation.tokens, expected[..new_tokens]);
    std::fs::remove_dir_all(&dir).unwrap();
}
