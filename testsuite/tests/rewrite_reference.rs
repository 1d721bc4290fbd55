//! The `rewrite` pass keeps every bit: on every Hugging Face fixture, the reference decoder
//! running the rewritten module (`rewrite, dce`) gives the same logits bits, step for step, as
//! on the frontend's module, over each golden prompt followed by greedy decoding. Also checks
//! that the pass fused something on each fixture (else the comparison would prove nothing).

use waferc_ir::Op;
use waferc_passes::{registry, PassManager};
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
        let passes = registry::parse_pipeline("rewrite, dce").unwrap();
        let (rewritten, _) = PassManager::new(passes).run(model.module.clone()).unwrap();
        let slices = rewritten.body.iter().filter(|(_, i)| matches!(i.op, Op::Slice { .. })).count();
        assert!(slices > 0, "{name}: the rewrite fused nothing");

        for prompt in prompts(&dir) {
            let steps = prompt.len() + 8;
            let mut original = ReferenceDecoder::new(&model.module, steps).unwrap();
            let mut fused = ReferenceDecoder::new(&rewritten, steps).unwrap();
            let mut token = prompt[0];
            for step in 0..steps {
                let a = original.step(token).unwrap();
                let b = fused.step(token).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&a), bits(&b), "{name}, prompt {prompt:?}, step {step}: logits differ");
                token = prompt.get(step + 1).copied().unwrap_or_else(|| waferc_runtime::argmax(&a));
            }
        }
    }
}
