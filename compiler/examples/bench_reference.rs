//! Decode throughput of the reference CPU decoder on a real checkpoint (SmolLM2-135M-Instruct
//! GGUF, say): loads and lowers it, feeds a chat prompt one step per token, then decodes greedily
//! for `new_tokens` steps (past the end-of-turn token, so every run times the same work).
//!
//! cargo run --release -p waferc --example bench_reference -- PATH.gguf [new_tokens]
//! (threads: RAYON_NUM_THREADS, default one per core)

use std::error::Error;
use std::path::PathBuf;

use waferc_runtime::{generate, ReferenceDecoder};

const QUESTION: &str = "What is the capital of France?";

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().ok_or("usage: bench_reference CHECKPOINT [new_tokens]")?);
    let new_tokens: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(64);
    let model = waferc::frontend::load(&path)?;
    let tokenizer = model.tokenizer.as_ref().ok_or("the checkpoint has no tokenizer")?;
    // SmolLM2's chat format; other models still get a valid (if unidiomatic) prompt.
    let text = format!("<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n");
    let prompt = tokenizer.encode(&text)?;
    let eos = &model.module.meta.eos_token_ids;

    let mut decoder = ReferenceDecoder::new(&model.module, prompt.len() + new_tokens)?;
    generate(&mut decoder, &prompt[..1], 1, None, &[], |_| {})?; // warm-up: page in the weights
    let run = generate(&mut decoder, &prompt, new_tokens, None, &[], |_| {})?;

    let answer_end = run.tokens.iter().position(|t| eos.contains(t)).map_or(run.tokens.len(), |i| i + 1);
    println!("{}", tokenizer.decode(&run.tokens[..answer_end])?);
    println!(
        "{}: {} threads, prompt {} tokens in {:.3} s ({:.1} tokens/s), decode {} steps in {:.3} s = {:.1} tokens/s",
        path.display(),
        rayon_threads(),
        prompt.len(),
        run.prefill.as_secs_f64(),
        prompt.len() as f64 / run.prefill.as_secs_f64(),
        run.decode_steps,
        run.decode.as_secs_f64(),
        run.decode_tokens_per_second()
    );
    Ok(())
}

/// The thread count rayon's global pool uses (`RAYON_NUM_THREADS`, else the core count).
fn rayon_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
