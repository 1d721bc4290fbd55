//! `waferc run ARTIFACT (--prompt TEXT | --tokens IDS) [--max-new-tokens N] [--force-tokens IDS]
//! [--validate] [--logits FILE] [--json] [--timing-only] [--trace FILE]`: the compiled program on
//! the bundled executor, optionally checked bit for bit against the reference decoder.

use std::path::PathBuf;

use anyhow::{bail, Context};
use serde_json::json;
use waferc_ir::wafer::artifact;
use waferc_runtime::executor::{self, ExecError, ExecOptions, Executor, StepTiming, TimingReport, ValidationOptions};
use waferc_runtime::{argmax, ReferenceDecoder};

use crate::frontend::tokenizer::Tokenizer;

use super::session::{self, GenerateArgs, PromptArgs};
use super::trace;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// An artifact written by `waferc compile`.
    pub artifact: PathBuf,
    #[command(flatten)]
    pub prompt: PromptArgs,
    #[command(flatten)]
    pub generate: GenerateArgs,
    /// Run the reference CPU decoder beside the executor and require every step's logits to be
    /// bit-identical; on a difference, name the first differing op, layer and PE.
    #[arg(long)]
    pub validate: bool,
    /// Write the logits of every generated step (`logits`, f32 [steps, vocab]) and the tokens
    /// (`tokens`, i64 [steps]) to this safetensors file.
    #[arg(long)]
    pub logits: Option<PathBuf>,
    /// Walk the schedule and routes without values (no weights needed): timing only. Each step
    /// after the prompt feeds the last prompt token again.
    #[arg(long, conflicts_with_all = ["validate", "logits"])]
    pub timing_only: bool,
    /// Write the executor's modeled timeline as a Chrome trace-event JSON file (Perfetto,
    /// chrome://tracing): one track per layer, a slice per op phase and collective.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    pub json: bool,
}

/// How to run an artifact: what `run`'s flags (or `demo`) ask for.
pub(super) struct Execution<'a> {
    pub artifact: &'a std::path::Path,
    pub prompt: &'a [u32],
    pub max_new_tokens: usize,
    pub force_tokens: &'a [u32],
    pub stop_tokens: Vec<u32>,
    pub validate: bool,
    pub timing_only: bool,
}

/// What the run produced.
pub(super) struct Outcome {
    pub tokens: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
    pub steps: Vec<StepTiming>,
    pub report: TimingReport,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let bar = session::spinner(format!("reading {}", args.artifact.display()));
    let compiled = artifact::read(&args.artifact);
    bar.finish_and_clear();
    let compiled = compiled?;
    let (program, module) = (&compiled.program, &compiled.module);
    let tokenizer = match &compiled.tokenizer_json {
        Some(text) => Some(Tokenizer::from_json(text, &args.artifact)?),
        None => None,
    };
    let vocab = module.meta.vocab_size;
    let prompt = session::prompt_ids(&args.prompt, tokenizer.as_ref(), vocab)?;
    if let Some(forced) = &args.generate.force_tokens {
        session::check_ids("--force-tokens", forced, vocab)?;
    }
    let max_new =
        if args.timing_only { args.generate.max_new_tokens.unwrap_or(1) } else { args.generate.max_new_tokens() };
    let needed = prompt.len() + max_new;
    if needed > program.max_context as usize {
        bail!(
            "{}: the prompt ({} tokens) plus {max_new} new tokens needs {needed} positions, but the artifact was compiled for {} (compile with a larger --max-context)",
            args.artifact.display(),
            prompt.len(),
            program.max_context
        );
    }
    if !args.timing_only && !program.weights_present {
        bail!("{}: compiled shape-only (no weights): only --timing-only can run it", args.artifact.display());
    }

    let execution = Execution {
        artifact: &args.artifact,
        prompt: &prompt,
        max_new_tokens: max_new,
        force_tokens: args.generate.force_tokens.as_deref().unwrap_or(&[]),
        stop_tokens: args.generate.stop_tokens(&module.meta.eos_token_ids),
        validate: args.validate,
        timing_only: args.timing_only,
    };
    let outcome = execute(&compiled, &execution)?;
    if let Some(path) = &args.logits {
        session::write_logits(path, &outcome.tokens, &outcome.logits)?;
    }
    if let Some(path) = &args.trace {
        let events = trace::chrome_trace(program, &outcome.steps);
        super::write_atomically(path, |out| Ok(serde_json::to_writer(out, &events)?))
            .with_context(|| format!("writing the trace to {}", path.display()))?;
    }
    let text = match (&tokenizer, args.timing_only) {
        (Some(t), false) => Some(t.decode(&outcome.tokens)?),
        _ => None,
    };
    let r = &outcome.report;
    if args.json {
        let mut object = json!({
            "artifact": args.artifact,
            "target": r.target,
            "prompt_tokens": prompt,
            "tokens": outcome.tokens,
            "text": text,
            "modeled_decode_tok_s": r.modeled_decode_tok_s,
            "modeled_ttft_us": r.modeled_ttft_us,
            "modeled_ttft_prefill_us": r.modeled_ttft_prefill_us,
            "prefill": r.prefill,
            "cycles_per_token": r.cycles_per_token,
            "layers": r.layers,
            "mean_layer": r.mean_layer,
            "costliest_steps": r.costliest_steps,
            "pes_used": r.pes_used,
            "busiest_pes": r.busiest_pes,
            "busiest_links": r.busiest_links,
        });
        if args.validate {
            object["bit_exact"] = json!(true);
        }
        println!("{object}");
    } else {
        if !args.timing_only {
            match &text {
                Some(text) => println!("{text}"),
                None => println!("{}", outcome.tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(",")),
            }
        }
        if args.validate {
            eprintln!(
                "validated: all {} steps bit-identical to the reference decoder",
                prompt.len() + outcome.tokens.len().saturating_sub(1)
            );
        }
        eprintln!("{}", describe_timing(r));
    }
    Ok(())
}

/// Runs the executor (and, validating, the reference decoder beside it) over the prompt and
/// the tokens it generates.
pub(super) fn execute(compiled: &artifact::Artifact, run: &Execution) -> anyhow::Result<Outcome> {
    let (program, module) = (&compiled.program, &compiled.module);
    let (prompt, max_new, forced, stop) = (run.prompt, run.max_new_tokens, run.force_tokens, &run.stop_tokens);
    let tiles = compiled.tiles.bytes();
    let options = ExecOptions { timing_only: run.timing_only, record_values: false };
    let mut wafer = Executor::new(program, module, tiles, options)?;
    let mut reference = match run.validate {
        true => Some(ReferenceDecoder::new(module, program.max_context as usize)?),
        false => None,
    };

    let bar = session::spinner("running");
    let (mut tokens, mut logits, mut steps) = (Vec::new(), Vec::new(), Vec::new());
    let mut feed = prompt[0];
    let mut fed = 0;
    loop {
        let position = wafer.position();
        let step = wafer.step(feed)?;
        if let Some(reference) = reference.as_mut() {
            let expected = reference.step(feed)?;
            let same = step.logits.as_ref().is_some_and(|got| bits_equal(got, &expected));
            if !same {
                bar.finish_and_clear();
                return Err(explain_mismatch(run.artifact, compiled, prompt, &tokens, position));
            }
        }
        steps.push(step.timing);
        fed += 1;
        bar.set_message(format!("running: position {fed}"));
        if fed < prompt.len() {
            feed = prompt[fed];
            continue;
        }
        if tokens.len() == max_new {
            break;
        }
        let next = match (forced.get(tokens.len()), &step.logits) {
            (Some(&token), _) => token,
            (None, Some(logits)) => argmax(logits),
            (None, None) => *prompt.last().expect("prompt is not empty"),
        };
        tokens.push(next);
        if let Some(row) = step.logits {
            logits.push(row);
        }
        if stop.contains(&next) || tokens.len() == max_new {
            break;
        }
        feed = next;
    }
    bar.finish_and_clear();
    let report = wafer.timing_report(prompt.len()).context("the executor ran no step")?;
    Ok(Outcome { tokens, logits, steps, report })
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The logits differed at `position`: rerun with per-instruction comparison to name the first
/// differing op, layer and PE.
fn explain_mismatch(
    path: &std::path::Path,
    compiled: &artifact::Artifact,
    prompt: &[u32],
    generated: &[u32],
    position: u32,
) -> anyhow::Error {
    let options = ValidationOptions {
        max_new_tokens: generated.len(),
        force_tokens: Some(generated.to_vec()),
        stop_tokens: Vec::new(),
    };
    let found = executor::validate(&compiled.program, &compiled.module, compiled.tiles.bytes(), prompt, &options);
    match found {
        Err(ExecError::Mismatch(mismatch)) => {
            anyhow::anyhow!("{}: validation failed: {mismatch}", path.display())
        }
        Err(other) => anyhow::Error::new(other).context(format!("{}: validation failed", path.display())),
        Ok(_) => anyhow::anyhow!(
            "{}: validation failed: the logits of position {position} differ from the reference decoder's, but no instruction's value does",
            path.display()
        ),
    }
}

pub(super) fn describe_timing(r: &TimingReport) -> String {
    let mut text = format!(
        "modeled on {}: {} cycles per token, {:.0} tokens/s decode, time to first token {:.1} us ({} prompt tokens), {} PEs",
        r.target, r.cycles_per_token, r.modeled_decode_tok_s, r.modeled_ttft_us, r.prompt_tokens, r.pes_used
    );
    if let Some(layer) = &r.mean_layer {
        text += &format!(
            "\nper layer (critical path, mean): {} cycles = {} compute + {} communication + {} waiting for links",
            layer.cycles, layer.compute_cycles, layer.comm_cycles, layer.wait_cycles
        );
    }
    for prefill in &r.prefill {
        if let Some(us) = prefill.ttft_us {
            text += &format!("\nprefill of {} prompt tokens (batched, pipelined): {us:.1} us", prefill.prompt_tokens);
        }
    }
    if let Some(link) = r.busiest_links.first() {
        text += &format!(
            "\nbusiest link: {} -> {}, {} bytes/token ({:.1}% busy)",
            link.from,
            link.to,
            link.bytes_per_token,
            100.0 * link.utilisation
        );
    }
    if let Some(pe) = r.busiest_pes.first() {
        text += &format!("\nbusiest PE: {}, {} compute cycles/token", pe.pe, pe.cycles);
    }
    text
}
