//! The reference decoder on every Hugging Face fixture (testsuite/fixtures/hf) against the golden
//! decodes transformers wrote: teacher-forced on the golden tokens, every logit within 1e-3 of
//! transformers' for all three prompts; free-running greedy, the golden tokens exactly for every
//! prompt whose smallest top-1 margin (golden.json) leaves room for a different summation order.

use std::path::Path;

use safetensors::SafeTensors;
use waferc_runtime::{generate, ReferenceDecoder};
use waferc_testsuite::fixtures_dir;

/// Largest |logit - golden| allowed, teacher-forced.
const LOGIT_TOLERANCE: f32 = 1e-3;
/// Below this top-1 margin two correct f32 implementations may pick different greedy tokens.
const MIN_MARGIN_FOR_TOKENS: f64 = 1e-3;

struct GoldenPrompt {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    /// `[tokens.len(), vocab]`, row-major.
    logits: Vec<f32>,
    min_top1_margin: f64,
}

fn read_goldens(dir: &Path) -> Vec<GoldenPrompt> {
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{}/{name}: {e}", dir.display()));
    let json: serde_json::Value = serde_json::from_slice(&read("golden.json")).expect("golden.json parses");
    let bytes = read("golden.safetensors");
    let tensors = SafeTensors::deserialize(&bytes).expect("golden.safetensors parses");
    let data = |name: &str| tensors.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}")).data().to_vec();
    let ids = |name: &str| -> Vec<u32> {
        data(name).chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect()
    };
    let prompts = json["prompts"].as_array().expect("golden.json lists prompts");
    (0..prompts.len())
        .map(|i| GoldenPrompt {
            prompt: ids(&format!("p{i}.prompt")),
            tokens: ids(&format!("p{i}.tokens")),
            logits: data(&format!("p{i}.logits"))
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            min_top1_margin: prompts[i]["min_top1_margin"].as_f64().expect("min_top1_margin"),
        })
        .collect()
}

fn check_fixture(name: &str) {
    let dir = fixtures_dir().join("hf").join(name);
    let model = waferc::frontend::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let goldens = read_goldens(&dir);
    assert_eq!(goldens.len(), 3, "{name}: three golden prompts");
    let mut worst_overall = 0f32;
    for (i, golden) in goldens.iter().enumerate() {
        let steps = golden.tokens.len();
        let vocab = golden.logits.len() / steps;
        assert_eq!(vocab, model.module.meta.vocab_size as usize, "{name} p{i}: golden logits width");
        let mut decoder = ReferenceDecoder::new(&model.module, golden.prompt.len() + steps).expect("decoder");

        let forced = generate(&mut decoder, &golden.prompt, steps, Some(&golden.tokens), &[], |_| {})
            .unwrap_or_else(|e| panic!("{name} p{i}: {e}"));
        assert_eq!(forced.logits.len(), steps);
        for (step, row) in forced.logits.iter().enumerate() {
            let want = &golden.logits[step * vocab..][..vocab];
            let (worst_at, worst) = row
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .enumerate()
                .fold((0, 0f32), |best, (j, d)| if d > best.1 || d.is_nan() { (j, d) } else { best });
            assert!(
                worst <= LOGIT_TOLERANCE,
                "{name} p{i} step {step}: logit {worst_at} is {} but transformers has {} (|diff| {worst})",
                row[worst_at],
                want[worst_at]
            );
            worst_overall = worst_overall.max(worst);
        }

        if golden.min_top1_margin >= MIN_MARGIN_FOR_TOKENS {
            let greedy = generate(&mut decoder, &golden.prompt, steps, None, &[], |_| {})
                .unwrap_or_else(|e| panic!("{name} p{i}: {e}"));
            assert_eq!(greedy.tokens, golden.tokens, "{name} p{i}: free-running greedy tokens");
        }
    }
    eprintln!("{name}: largest teacher-forced logit difference from transformers {worst_overall:e}");
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
fn qwen3_dense() {
    check_fixture("qwen3-dense");
}

#[test]
fn qwen2_bias() {
    check_fixture("qwen2-bias");
}

#[test]
fn mixtral_tiny() {
    check_fixture("mixtral-tiny");
}

#[test]
fn qwen3_moe_tiny() {
    check_fixture("qwen3-moe-tiny");
}

#[test]
fn mixtral_sharded_bf16() {
    check_fixture("mixtral-sharded-bf16");
}

#[test]
fn gpt_oss_tiny_bf16() {
    check_fixture("gpt-oss-tiny-bf16");
}

#[test]
fn gpt_oss_tiny_mxfp4() {
    check_fixture("gpt-oss-tiny-mxfp4");
}

/// Every fixture directory has a test above.
#[test]
fn every_fixture_is_checked() {
    let mut names: Vec<String> = std::fs::read_dir(fixtures_dir().join("hf"))
        .expect("fixtures/hf")
        .map(|e| e.expect("dir entry").file_name().to_string_lossy().into_owned())
        .filter(|n| fixtures_dir().join("hf").join(n).is_dir())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "gpt-oss-tiny-bf16",
            "gpt-oss-tiny-mxfp4",
            "llama-tiny-tok",
            "llama31-gqa-bf16",
            "mixtral-sharded-bf16",
            "mixtral-tiny",
            "qwen2-bias",
            "qwen3-dense",
            "qwen3-moe-tiny"
        ]
    );
}
