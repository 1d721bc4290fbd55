//! The subcommands of `waferc`, one module each. Every command reports failures as errors that
//! name the file, tensor or field involved; `main` prints them and exits non-zero.

mod compile;
mod demo;
mod inspect;
mod output;
mod profile;
mod reference;
mod run;
mod session;
mod synth;
mod targets;
mod trace;

use clap::{Parser, Subcommand};

pub use output::write_atomically;

#[derive(Parser, Debug)]
#[command(name = "waferc", version, about = "A dataflow compiler for wafer-scale LLM inference")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Compile a checkpoint for a wafer target into an artifact.
    Compile(compile::CompileArgs),
    /// The whole pipeline on a built-in MoE model: synth, compile, run validated, show placement and speed.
    Demo(demo::DemoArgs),
    /// Record how often each MoE expert (and pair of experts) is picked over some prompts, for `compile --profile`.
    Profile(profile::ProfileArgs),
    /// Greedy decoding on the reference CPU decoder (the oracle the executor is checked against).
    Reference(reference::ReferenceArgs),
    /// Show a compiled placement: summary and map, full JSON, or an SVG picture.
    Inspect(inspect::InspectArgs),
    /// Run a compiled artifact on the bundled wafer executor (optionally validated bit for bit).
    Run(run::RunArgs),
    /// Write a checkpoint directory of a known shape in the Hugging Face layout.
    Synth(synth::SynthArgs),
    /// List the built-in wafer targets, or describe one, with every parameter's source.
    Targets(targets::TargetsArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Compile(args) => compile::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Profile(args) => profile::run(args),
        Command::Reference(args) => reference::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Run(args) => run::run(args),
        Command::Synth(args) => synth::run(args),
        Command::Targets(args) => targets::run(args),
    }
}
