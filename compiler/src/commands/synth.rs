//! `waferc synth --preset NAME -o DIR [--shape-only]`

use std::path::PathBuf;

use crate::synth::{synth, Preset};

#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// One of: llama3.1-8b, llama3.1-70b, mixtral-8x7b, qwen3-30b-a3b, tiny-llama, tiny-mixtral, tiny-qwen3-moe.
    #[arg(long)]
    pub preset: String,
    /// The checkpoint directory to create (must not exist).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Write real safetensors headers over sparse files: full-size shapes at no disk cost.
    #[arg(long)]
    pub shape_only: bool,
}

pub fn run(args: SynthArgs) -> anyhow::Result<()> {
    let preset = Preset::by_name(&args.preset)?;
    let report = synth(&preset, &args.output, args.shape_only)?;
    println!(
        "wrote {} ({} tensors, {} parameters, {} bytes in {} files{})",
        args.output.display(),
        report.tensors,
        si(report.parameters),
        si(report.bytes),
        report.files.len(),
        if args.shape_only { ", shape-only: sparse" } else { "" }
    );
    Ok(())
}

/// `1234567` as `1.23 M`: counts in this tool span from tiny test models to 70B.
fn si(n: u64) -> String {
    let units = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")];
    match units.iter().find(|(scale, _)| n as f64 >= *scale) {
        Some((scale, unit)) => format!("{:.2} {unit}", n as f64 / scale),
        None => n.to_string(),
    }
}
