//! `waferc profile MODEL --prompts FILE -o PROFILE.json`: routing statistics of the model's MoE
//! layers over some prompts, from the reference decoder, for `compile --profile`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use waferc_ir::wafer::RoutingProfile;
use waferc_ir::Module;

use crate::frontend::tokenizer::Tokenizer;

use super::session;

#[derive(clap::Args, Debug)]
pub struct ProfileArgs {
    /// A Hugging Face checkpoint directory or a .gguf file.
    pub model: PathBuf,
    /// Prompts, one per line: comma-separated token ids, or text for the model's tokenizer.
    #[arg(long)]
    pub prompts: PathBuf,
    /// The profile to write (JSON).
    #[arg(short, long)]
    pub output: PathBuf,
}

pub fn run(args: ProfileArgs) -> anyhow::Result<()> {
    let loaded = session::load_model(&args.model)?;
    let profile = record(&loaded.module, loaded.tokenizer.as_ref(), &args.prompts)?;
    write(&args.output, &profile)?;
    println!("{}", describe(&profile));
    println!("wrote {}", args.output.display());
    Ok(())
}

/// Runs the reference decoder over the prompts in `prompts` and counts the routers' picks.
pub fn record(module: &Module, tokenizer: Option<&Tokenizer>, prompts: &Path) -> anyhow::Result<RoutingProfile> {
    let ids = session::read_prompts(prompts, tokenizer, module.meta.vocab_size)?;
    if !module.weights.iter().all(|(_, w)| w.data.is_present()) {
        bail!("{}: a shape-only model has no weights to route with, so it cannot be profiled", prompts.display());
    }
    let bar = session::spinner(format!("profiling over {} prompts", ids.len()));
    let profile = waferc_runtime::profile::record_profile(module, &ids, &prompts.display().to_string());
    bar.finish_and_clear();
    let profile = profile.context("running the reference decoder over the prompts")?;
    if profile.layers.is_empty() {
        bail!("the model has no MoE layers: there is no routing to profile");
    }
    Ok(profile)
}

pub fn write(path: &Path, profile: &RoutingProfile) -> anyhow::Result<()> {
    super::write_atomically(path, |out| Ok(serde_json::to_writer_pretty(out, profile)?))
        .with_context(|| format!("writing the profile to {}", path.display()))
}

/// Reads a profile written by `waferc profile` (or by hand, in its format).
pub fn read(path: &Path) -> anyhow::Result<RoutingProfile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading the routing profile {}", path.display()))?;
    let profile: RoutingProfile =
        serde_json::from_str(&text).with_context(|| format!("{}: not a routing profile", path.display()))?;
    if let Some(problem) = profile.problem() {
        bail!("{}: {problem}", path.display());
    }
    Ok(profile)
}

/// One line per layer: tokens seen and the hottest experts' shares.
pub fn describe(profile: &RoutingProfile) -> String {
    let mut text = format!("routing profile from {}:", profile.source);
    for layer in &profile.layers {
        let mut experts: Vec<u32> = (0..layer.experts).collect();
        experts.sort_by(|&a, &b| layer.picks[b as usize].cmp(&layer.picks[a as usize]).then(a.cmp(&b)));
        let hottest: Vec<String> =
            experts.iter().take(4).map(|&e| format!("{e} {:.1}%", 100.0 * layer.heat(e))).collect();
        text += &format!(
            "\n  layer {}: {} tokens, top {} of {} experts; hottest: {}",
            layer.layer,
            layer.tokens,
            layer.top_k,
            layer.experts,
            hottest.join(", ")
        );
    }
    text
}
