//! `waferc inspect ARTIFACT [--format text|json|svg] [-o FILE] [--layer N] [--region X,Y,W,H]
//! [--wafer W] [--colour-by layer|expert]`: what a compiled placement looks like.

use std::path::PathBuf;

use anyhow::Context;
use waferc_ir::wafer::artifact;
use waferc_runtime::executor::{ExecOptions, Executor};

use crate::inspect::{self, ColourBy, Filter, Rect};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A summary (PEs, SRAM, colours, routes, where each layer and expert went, modeled speed)
    /// and an ASCII map of the grid.
    Text,
    /// The full placement: every tile, KV block, segment and route (schema in the README).
    Json,
    /// A picture of the wafer: PEs coloured by layer or expert, a link-utilisation heat panel, a legend.
    Svg,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Colouring {
    Layer,
    Expert,
}

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// An artifact written by `waferc compile`.
    pub artifact: PathBuf,
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Write to this file instead of stdout.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Only this decoder layer's PEs, tiles and routes.
    #[arg(long)]
    pub layer: Option<u32>,
    /// Only PEs in this rectangle: column X, row Y, width W, height H.
    #[arg(long, value_name = "X,Y,W,H")]
    pub region: Option<Rect>,
    /// Only this wafer of a multi-wafer pipeline (numbered from 0).
    #[arg(long)]
    pub wafer: Option<u16>,
    /// What the SVG colours PEs by.
    #[arg(long, value_enum, default_value_t = Colouring::Layer)]
    pub colour_by: Colouring,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let compiled = artifact::read(&args.artifact)?;
    let (program, module) = (&compiled.program, &compiled.module);
    let filter = Filter { layer: args.layer, region: args.region, wafer: args.wafer };
    filter.check(program)?;

    let content = match args.format {
        Format::Text => {
            let speed = modeled_speed(&compiled).with_context(|| format!("modelling {}", args.artifact.display()))?;
            inspect::summary_text(program, Some(module), &filter, Some(&speed))
        }
        Format::Svg => {
            let colour_by = match args.colour_by {
                Colouring::Layer => ColourBy::Layer,
                Colouring::Expert => ColourBy::Expert,
            };
            inspect::placement_svg(program, Some(module), &filter, colour_by)
        }
        Format::Json => {
            return match &args.output {
                Some(path) => super::write_atomically(path, |out| {
                    Ok(inspect::write_placement_json(program, Some(module), &filter, out, true)?)
                }),
                None => {
                    let stdout = std::io::stdout();
                    let mut lock = stdout.lock();
                    inspect::write_placement_json(program, Some(module), &filter, &mut lock, true)?;
                    println!();
                    Ok(())
                }
            };
        }
    };
    match &args.output {
        Some(path) => super::write_atomically(path, |out| Ok(out.write_all(content.as_bytes())?))
            .with_context(|| format!("writing {}", path.display())),
        None => {
            print!("{content}");
            Ok(())
        }
    }
}

/// One timing-only decode step at position 0: the modeled speed line of the summary.
fn modeled_speed(compiled: &artifact::Artifact) -> anyhow::Result<String> {
    let options = ExecOptions { timing_only: true, record_values: false };
    let mut executor = Executor::new(&compiled.program, &compiled.module, None, options)?;
    executor.step(0)?;
    let report = executor.timing_report(1).context("the executor ran no step")?;
    let mut text = format!(
        "{:.0} tokens/s decode ({} cycles per token at position 0, timing-only)",
        report.modeled_decode_tok_s, report.cycles_per_token
    );
    text += "\n  critical path by layer (cycles: total = compute + communication + waiting for links):";
    for layer in &report.layers {
        let name = layer.layer.map_or("outside layers".to_string(), |l| format!("layer {l}"));
        text += &format!(
            "\n    {name}: {} = {} + {} + {}",
            layer.cycles, layer.compute_cycles, layer.comm_cycles, layer.wait_cycles
        );
    }
    text += "\n  the ten most expensive steps:";
    for span in &report.costliest_steps {
        let layer = span.layer.map_or("-".to_string(), |l| l.to_string());
        let held_by = match span.waited_on {
            Some(i) if i == span.instr => " (its routes queue on one another)".to_string(),
            Some(i) => format!(" (links held by %{i})"),
            None => String::new(),
        };
        text += &format!(
            "\n    step {} {} %{} {:?} (layer {layer}): {} cycles = {} + {} + {}{held_by}",
            span.step,
            span.op,
            span.instr,
            span.phase,
            span.duration_cycles,
            span.compute_cycles,
            span.comm_cycles,
            span.wait_cycles
        );
    }
    Ok(text)
}
