//! `waferc run ARTIFACT (--prompt TEXT... | --tokens IDS | --prompts FILE) [--sequences N]
//! [--max-new-tokens N] [--force-tokens IDS] [--validate] [--logits FILE] [--json] [--timing-only]
//! [--trace FILE]`: the compiled program on the bundled executor, optionally checked bit for bit
//! against the reference decoder.
//!
//! Several prompts are several sequences, up to `--sequences N` in flight at once. Each has its
//! own KV blocks (an executor of its own: values never mix), its own tokens and its own
//! validation against the reference decoder run on that prompt alone; the timing of the run is
//! the pipeline model's (`executor::pipeline`) over every sequence's modeled steps.

use std::path::PathBuf;

use anyhow::{bail, Context};
use serde_json::json;
use waferc_ir::wafer::artifact;
use waferc_runtime::executor::{
    self, ExecError, ExecOptions, Executor, PipelineTiming, SequenceCosts, StepCost, StepTiming, TimingReport,
    ValidationOptions,
};
use waferc_runtime::{argmax, ReferenceDecoder};

use crate::frontend::tokenizer::Tokenizer;

use super::session::{self, GenerateArgs, PromptsArgs};
use super::trace;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// An artifact written by `waferc compile`.
    pub artifact: PathBuf,
    #[command(flatten)]
    pub prompt: PromptsArgs,
    /// Sequences in flight at once (at most the artifact's `compile --max-sequences`; default:
    /// as many as that allows). With a single prompt, N copies of it run.
    #[arg(long)]
    pub sequences: Option<usize>,
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
#[derive(Clone)]
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
    let mut prompts = args.prompt.ids(tokenizer.as_ref(), vocab)?;
    if let Some(forced) = &args.generate.force_tokens {
        session::check_ids("--force-tokens", forced, vocab)?;
    }
    let capacity = program.max_sequences as usize;
    let in_flight = args.sequences.unwrap_or(prompts.len().min(capacity)).max(1);
    if in_flight > capacity {
        bail!(
            "{}: --sequences {in_flight}, but the artifact has KV capacity for {capacity} sequence(s) (compile with --max-sequences {in_flight})",
            args.artifact.display()
        );
    }
    if prompts.len() == 1 && in_flight > 1 {
        prompts = vec![prompts[0].clone(); in_flight];
    }
    if prompts.len() > 1 && (args.logits.is_some() || args.trace.is_some()) {
        bail!("--logits and --trace take a single sequence; {} prompts were given", prompts.len());
    }
    let max_new =
        if args.timing_only { args.generate.max_new_tokens.unwrap_or(1) } else { args.generate.max_new_tokens() };
    for prompt in &prompts {
        let needed = prompt.len() + max_new;
        if needed > program.max_context as usize {
            bail!(
                "{}: the prompt ({} tokens) plus {max_new} new tokens needs {needed} positions, but the artifact was compiled for {} (compile with a larger --max-context)",
                args.artifact.display(),
                prompt.len(),
                program.max_context
            );
        }
    }
    if !args.timing_only && !program.weights_present {
        bail!("{}: compiled shape-only (no weights): only --timing-only can run it", args.artifact.display());
    }

    let mut outcomes: Vec<Outcome> = Vec::with_capacity(prompts.len());
    for (index, prompt) in prompts.iter().enumerate() {
        // Timing only, a step's timing depends on the prompt's tokens and positions alone, so
        // a repeated prompt reuses its twin's run.
        if args.timing_only {
            if let Some(twin) = prompts[..index].iter().position(|p| p == prompt) {
                outcomes.push(outcomes[twin].clone());
                continue;
            }
        }
        let execution = Execution {
            artifact: &args.artifact,
            prompt,
            max_new_tokens: max_new,
            force_tokens: args.generate.force_tokens.as_deref().unwrap_or(&[]),
            stop_tokens: args.generate.stop_tokens(&module.meta.eos_token_ids),
            validate: args.validate,
            timing_only: args.timing_only,
        };
        let outcome = match execute(&compiled, &execution) {
            Err(e) if prompts.len() > 1 => return Err(e.context(format!("sequence {index}"))),
            other => other?,
        };
        outcomes.push(outcome);
    }
    let pipelined = pipeline_timing(&prompts, &outcomes, in_flight, program.target.clock_hz);
    let outcome = &outcomes[0];
    let prompt = &prompts[0];
    if let Some(path) = &args.logits {
        session::write_logits(path, &outcome.tokens, &outcome.logits)?;
    }
    if let Some(path) = &args.trace {
        let events = trace::chrome_trace(program, &outcome.steps);
        super::write_atomically(path, |out| Ok(serde_json::to_writer(out, &events)?))
            .with_context(|| format!("writing the trace to {}", path.display()))?;
    }
    let text_of = |tokens: &[u32]| -> anyhow::Result<Option<String>> {
        match (&tokenizer, args.timing_only) {
            (Some(t), false) => Ok(Some(t.decode(tokens)?)),
            _ => Ok(None),
        }
    };
    let r = &outcome.report;
    if args.json {
        let mut sequences = Vec::with_capacity(prompts.len());
        for ((prompt, outcome), timing) in prompts.iter().zip(&outcomes).zip(&pipelined.sequences) {
            let mut object = json!({
                "prompt_tokens": prompt,
                "tokens": outcome.tokens,
                "text": text_of(&outcome.tokens)?,
                "modeled_tok_s": timing.modeled_tok_s,
                "modeled_ttft_us": timing.modeled_ttft_us,
            });
            if args.validate {
                object["bit_exact"] = json!(true);
            }
            sequences.push(object);
        }
        let mut object = json!({
            "artifact": args.artifact,
            "target": r.target,
            "sequences": sequences,
            "sequences_in_flight": in_flight,
            "aggregate_modeled_tok_s": pipelined.aggregate_modeled_tok_s,
            "pes_used": r.pes_used,
        });
        if prompts.len() == 1 {
            let single = json!({
                "prompt_tokens": prompt,
                "tokens": outcome.tokens,
                "text": text_of(&outcome.tokens)?,
                "modeled_decode_tok_s": r.modeled_decode_tok_s,
                "modeled_ttft_us": r.modeled_ttft_us,
                "modeled_ttft_prefill_us": r.modeled_ttft_prefill_us,
                "prefill": r.prefill,
                "cycles_per_token": r.cycles_per_token,
                "layers": r.layers,
                "mean_layer": r.mean_layer,
                "costliest_steps": r.costliest_steps,
                "busiest_pes": r.busiest_pes,
                "busiest_links": r.busiest_links,
            });
            for (key, value) in single.as_object().expect("an object") {
                object[key] = value.clone();
            }
            if args.validate {
                object["bit_exact"] = json!(true);
            }
        }
        println!("{object}");
    } else {
        if !args.timing_only {
            for outcome in &outcomes {
                match text_of(&outcome.tokens)? {
                    Some(text) => println!("{text}"),
                    None => println!("{}", outcome.tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(",")),
                }
            }
        }
        if args.validate {
            for (prompt, outcome) in prompts.iter().zip(&outcomes) {
                eprintln!(
                    "validated: all {} steps bit-identical to the reference decoder",
                    prompt.len() + outcome.tokens.len().saturating_sub(1)
                );
            }
        }
        eprintln!("{}", describe_timing(r));
        if prompts.len() > 1 {
            eprintln!("{}", describe_pipeline(&pipelined, in_flight));
        }
    }
    Ok(())
}

/// The pipeline model over every sequence's modeled steps.
fn pipeline_timing(prompts: &[Vec<u32>], outcomes: &[Outcome], in_flight: usize, clock_hz: f64) -> PipelineTiming {
    let costs: Vec<SequenceCosts> = prompts
        .iter()
        .zip(outcomes)
        .map(|(prompt, outcome)| SequenceCosts {
            prompt_tokens: prompt.len(),
            new_tokens: outcome.tokens.len(),
            steps: outcome.steps.iter().map(StepCost::of).collect(),
        })
        .collect();
    executor::pipeline(&costs, in_flight, clock_hz)
}

fn describe_pipeline(p: &PipelineTiming, in_flight: usize) -> String {
    let mut text = format!(
        "{} sequences, up to {in_flight} in flight: {:.0} tokens/s aggregate (modeled)",
        p.sequences.len(),
        p.aggregate_modeled_tok_s
    );
    for (index, s) in p.sequences.iter().enumerate() {
        text += &format!(
            "\n  sequence {index}: {:.0} tokens/s, time to first token {:.1} us",
            s.modeled_tok_s, s.modeled_ttft_us
        );
    }
    text
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
