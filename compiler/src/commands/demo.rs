//! `waferc demo [--dir DIR] [--target T]`: the whole pipeline on a built-in model, with nothing
//! to fetch: write a small MoE checkpoint, compile it for a small grid, run it on the executor
//! with every step validated bit for bit against the reference decoder, and show the placement
//! and the modeled speed.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use waferc_ir::wafer::artifact;
use waferc_passes::wafer::{self as lowering, CompileOptions};
use waferc_targets::Target;

use super::run::{describe_timing, execute, Execution};
use crate::inspect::{self, ColourBy, Filter};
use crate::synth::{synth, Preset};

/// The demo's model: a two-layer Qwen3-MoE (8 experts, top 2, q/k norms) with random weights.
const PRESET: &str = "tiny-qwen3-moe";
/// A prompt of token ids (the synthetic model has no tokenizer).
const PROMPT: [u32; 8] = [17, 42, 101, 7, 230, 64, 5, 199];
const NEW_TOKENS: usize = 16;

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Keep the checkpoint, artifact and placement picture in this directory (which must not
    /// exist yet); by default they go to a temporary directory that is removed afterwards.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The target to compile for.
    #[arg(long, default_value = "grid:24x24")]
    pub target: String,
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let target = Target::resolve(&args.target)?;
    let (dir, temporary) = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            (dir.clone(), false)
        }
        None => (std::env::temp_dir().join(format!("waferc-demo-{}", std::process::id())), true),
    };
    let result = demo(&dir, &target);
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn demo(dir: &Path, target: &Target) -> anyhow::Result<()> {
    let checkpoint = dir.join("checkpoint");
    let report = synth(&Preset::by_name(PRESET)?, &checkpoint, false)?;
    println!(
        "1. wrote a {PRESET} checkpoint ({} tensors, {} parameters) to {}",
        report.tensors,
        report.parameters,
        checkpoint.display()
    );

    let start = Instant::now();
    let loaded = crate::frontend::load(&checkpoint)?;
    let options = CompileOptions::new((PROMPT.len() + NEW_TOKENS) as u32);
    let program = lowering::compile(&loaded.module, target, &options)?;
    lowering::check(&program, &loaded.module).context("the placement checker rejected the demo's program")?;
    let path = dir.join("model.wafer");
    artifact::write(&path, &artifact::Artifact::new(program, loaded.module))?;
    let compiled = artifact::read(&path)?;
    println!(
        "2. compiled it for {} in {:.2} s: {} PEs, {} routes, checked; artifact {}",
        target.name,
        start.elapsed().as_secs_f64(),
        compiled.program.pes.len(),
        compiled.program.routes.len(),
        path.display()
    );

    let execution = Execution {
        artifact: &path,
        prompt: &PROMPT,
        max_new_tokens: NEW_TOKENS,
        force_tokens: &[],
        stop_tokens: Vec::new(),
        validate: true,
        timing_only: false,
        from_position: 0,
    };
    let outcome = execute(&compiled, &execution)?;
    let ids = |ids: &[u32]| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    println!(
        "3. ran it on the executor: prompt {} -> generated {}; all {} steps bit-identical to the reference decoder",
        ids(&PROMPT),
        ids(&outcome.tokens),
        PROMPT.len() + outcome.tokens.len() - 1
    );

    let svg = dir.join("placement.svg");
    let picture = inspect::placement_svg(&compiled.program, Some(&compiled.module), &Filter::all(), ColourBy::Expert);
    super::write_atomically(&svg, |out| Ok(out.write_all(picture.as_bytes())?))?;
    println!("4. placement (picture: {}):\n", svg.display());
    let speed = format!(
        "{:.0} tokens/s decode, {} cycles per token (modeled)",
        outcome.report.modeled_decode_tok_s, outcome.report.cycles_per_token
    );
    print!("{}", inspect::summary_text(&compiled.program, Some(&compiled.module), &Filter::all(), Some(&speed)));
    println!("\n{}", describe_timing(&outcome.report));
    Ok(())
}
