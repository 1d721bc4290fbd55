//! What the model-running commands share: loading a checkpoint with progress, turning
//! `--prompt`/`--tokens` into ids, and writing a `--logits` file.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};

use crate::frontend::tokenizer::Tokenizer;
use crate::frontend::{self, LoadedModel};

/// `--prompt TEXT` or `--tokens 1,2,3`: exactly one is required.
#[derive(clap::Args, Debug, Clone)]
#[group(required = true, multiple = false)]
pub struct PromptArgs {
    /// Prompt text, encoded with the checkpoint's tokenizer (no special tokens added).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u32>>,
}

/// Several prompts: repeated `--prompt TEXT`, `--tokens IDS`, or `--prompts FILE`.
#[derive(clap::Args, Debug, Clone)]
#[group(required = true, multiple = false)]
pub struct PromptsArgs {
    /// Prompt text, encoded with the checkpoint's tokenizer (no special tokens added);
    /// repeatable, one sequence each.
    #[arg(long)]
    pub prompt: Vec<String>,
    /// Prompt token ids, comma-separated (one sequence).
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u32>>,
    /// A file of prompts, one per line: comma-separated token ids, or text for the tokenizer.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
}

impl PromptsArgs {
    /// The prompts' token ids, each checked against the vocabulary.
    pub fn ids(&self, tokenizer: Option<&Tokenizer>, vocab_size: u32) -> anyhow::Result<Vec<Vec<u32>>> {
        if let Some(path) = &self.prompts {
            return read_prompts(path, tokenizer, vocab_size);
        }
        if let Some(ids) = &self.tokens {
            let single = PromptArgs { prompt: None, tokens: Some(ids.clone()) };
            return Ok(vec![prompt_ids(&single, tokenizer, vocab_size)?]);
        }
        self.prompt
            .iter()
            .map(|text| prompt_ids(&PromptArgs { prompt: Some(text.clone()), tokens: None }, tokenizer, vocab_size))
            .collect()
    }
}

/// A prompt file: one prompt per non-empty line, either comma-separated token ids or text
/// encoded with `tokenizer`. Errors name the file and line.
pub fn read_prompts(path: &Path, tokenizer: Option<&Tokenizer>, vocab_size: u32) -> anyhow::Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading prompts from {}", path.display()))?;
    let mut prompts = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), number + 1);
        let is_ids = line.chars().all(|c| c.is_ascii_digit() || c == ',' || c == ' ');
        let ids = if is_ids {
            line.split(',')
                .map(|t| t.trim().parse::<u32>().with_context(|| format!("{}: {t:?} is not a token id", at())))
                .collect::<anyhow::Result<Vec<u32>>>()?
        } else {
            let Some(tokenizer) = tokenizer else {
                bail!("{}: a text prompt needs a tokenizer, and this model has none: write token ids instead", at())
            };
            tokenizer.encode(line).with_context(at)?
        };
        if ids.is_empty() {
            bail!("{}: the prompt encodes to no tokens", at());
        }
        check_ids(&at(), &ids, vocab_size)?;
        prompts.push(ids);
    }
    if prompts.is_empty() {
        bail!("{}: no prompts (one per line)", path.display());
    }
    Ok(prompts)
}

/// Options for how many tokens to produce and which.
#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    /// Tokens to generate after the prompt (default: 32, or the number of --force-tokens).
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    /// Feed these ids as the continuation instead of the argmax (teacher forcing), recording
    /// logits as usual; generation does not stop at an end-of-sequence token.
    #[arg(long, value_delimiter = ',')]
    pub force_tokens: Option<Vec<u32>>,
    /// Keep generating past an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
}

impl GenerateArgs {
    pub fn max_new_tokens(&self) -> usize {
        self.max_new_tokens.unwrap_or_else(|| self.force_tokens.as_ref().map_or(32, Vec::len))
    }

    pub fn stop_tokens(&self, eos: &[u32]) -> Vec<u32> {
        if self.ignore_eos || self.force_tokens.is_some() {
            Vec::new()
        } else {
            eos.to_vec()
        }
    }
}

/// A spinner on stderr for work that may take over a second; invisible when stderr is not a
/// terminal.
pub fn spinner(message: impl Into<String>) -> ProgressBar {
    let bar = ProgressBar::new_spinner().with_message(message.into());
    bar.set_style(ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("a valid template"));
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// Loads and lowers a checkpoint, with a spinner; says how long it took when that was long.
pub fn load_model(path: &Path) -> anyhow::Result<LoadedModel> {
    let start = Instant::now();
    let bar = spinner(format!("loading {}", path.display()));
    let loaded = frontend::load(path);
    bar.finish_and_clear();
    let loaded = loaded?;
    if start.elapsed() > Duration::from_secs(1) {
        eprintln!("loaded {} in {:.1} s", path.display(), start.elapsed().as_secs_f64());
    }
    Ok(loaded)
}

/// The prompt's token ids, checked against the vocabulary.
pub fn prompt_ids(args: &PromptArgs, tokenizer: Option<&Tokenizer>, vocab_size: u32) -> anyhow::Result<Vec<u32>> {
    let ids = match (&args.tokens, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => {
            let Some(tokenizer) = tokenizer else {
                bail!("--prompt needs a tokenizer, and this checkpoint has none (no tokenizer.json beside it): pass --tokens instead")
            };
            tokenizer.encode(text)?
        }
        (None, None) => bail!("give --prompt TEXT or --tokens IDS"),
    };
    if ids.is_empty() {
        bail!("the prompt is empty: at least one token is needed");
    }
    check_ids("--tokens", &ids, vocab_size)?;
    Ok(ids)
}

/// Every id must index the vocabulary.
pub fn check_ids(flag: &str, ids: &[u32], vocab_size: u32) -> anyhow::Result<()> {
    if let Some(bad) = ids.iter().find(|&&id| id >= vocab_size) {
        bail!("{flag}: token id {bad} is outside the vocabulary of {vocab_size}");
    }
    Ok(())
}

/// Writes `tokens` (i64 `[steps]`) and `logits` (f32 `[steps, vocab]`) as a safetensors file.
pub fn write_logits(path: &Path, tokens: &[u32], logits: &[Vec<f32>]) -> anyhow::Result<()> {
    use safetensors::tensor::{Dtype, TensorView};
    let vocab = logits.first().map_or(0, Vec::len);
    let logit_bytes: Vec<u8> = logits.iter().flatten().flat_map(|v| v.to_le_bytes()).collect();
    let token_bytes: Vec<u8> = tokens.iter().flat_map(|&t| (t as i64).to_le_bytes()).collect();
    let views = [
        ("logits", TensorView::new(Dtype::F32, vec![logits.len(), vocab], &logit_bytes)?),
        ("tokens", TensorView::new(Dtype::I64, vec![tokens.len()], &token_bytes)?),
    ];
    let bytes = safetensors::serialize(views, None).context("serialising logits")?;
    super::write_atomically(path, |out| Ok(out.write_all(&bytes)?))
        .with_context(|| format!("writing logits to {}", path.display()))
}
