//! `waferc reference MODEL (--prompt TEXT | --tokens IDS) [--max-new-tokens N] [--force-tokens IDS]
//! [--logits FILE] [--json]`: greedy decoding on the reference CPU decoder.

use std::path::PathBuf;

use serde_json::json;
use waferc_runtime::{generate, ReferenceDecoder};

use super::session::{self, GenerateArgs, PromptArgs};

#[derive(clap::Args, Debug)]
pub struct ReferenceArgs {
    /// A Hugging Face checkpoint directory or a .gguf file.
    pub model: PathBuf,
    #[command(flatten)]
    pub prompt: PromptArgs,
    #[command(flatten)]
    pub generate: GenerateArgs,
    /// Write the logits of every generated step (`logits`, f32 [steps, vocab]) and the tokens
    /// (`tokens`, i64 [steps]) to this safetensors file.
    #[arg(long)]
    pub logits: Option<PathBuf>,
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: ReferenceArgs) -> anyhow::Result<()> {
    let loaded = session::load_model(&args.model)?;
    let meta = &loaded.module.meta;
    let prompt = session::prompt_ids(&args.prompt, loaded.tokenizer.as_ref(), meta.vocab_size)?;
    if let Some(forced) = &args.generate.force_tokens {
        session::check_ids("--force-tokens", forced, meta.vocab_size)?;
    }
    let max_new = args.generate.max_new_tokens();
    let stop = args.generate.stop_tokens(&meta.eos_token_ids);
    let mut decoder = ReferenceDecoder::new(&loaded.module, prompt.len() + max_new)?;

    let bar = session::spinner("decoding");
    let start = std::time::Instant::now();
    let generation = generate(&mut decoder, &prompt, max_new, args.generate.force_tokens.as_deref(), &stop, |_| {
        bar.inc(1);
        bar.set_message(format!("decoding: {} of {max_new} tokens", bar.position()));
    });
    bar.finish_and_clear();
    let generation = generation?;
    let wall = start.elapsed().as_secs_f64();

    if let Some(path) = &args.logits {
        session::write_logits(path, &generation.tokens, &generation.logits)?;
    }
    let text = match &loaded.tokenizer {
        Some(tokenizer) => Some(tokenizer.decode(&generation.tokens)?),
        None => None,
    };
    let tokens_per_second = generation.decode_tokens_per_second();
    if args.json {
        let report = json!({
            "model": args.model,
            "prompt_tokens": prompt,
            "tokens": generation.tokens,
            "text": text,
            "wall_seconds": wall,
            "prefill_seconds": generation.prefill.as_secs_f64(),
            "decode_seconds": generation.decode.as_secs_f64(),
            "tokens_per_second": tokens_per_second,
        });
        println!("{report}");
    } else {
        match &text {
            Some(text) => println!("{text}"),
            None => println!("{}", generation.tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(",")),
        }
        eprintln!(
            "{} prompt tokens, {} generated; prefill {:.3} s, decode {:.1} tokens/s",
            prompt.len(),
            generation.tokens.len(),
            generation.prefill.as_secs_f64(),
            tokens_per_second
        );
    }
    Ok(())
}
