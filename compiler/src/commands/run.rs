//! `waferc run ARTIFACT (--prompt TEXT... | --tokens IDS | --prompts FILE) [--sequences N]
//! [--max-new-tokens N] [--force-tokens IDS] [--validate] [--logits FILE] [--json] [--timing-only
//! [--from-position P]] [--trace FILE]`: the compiled program on the bundled executor, optionally
//! checked bit for bit against the reference decoder.
//!
//! Several prompts are several sequences, up to `--sequences N` in flight at once on one
//! executor, their steps interleaved. Each has its own KV blocks (a sequence slot of the
//! artifact's `--max-sequences`), its own tokens and its own validation against the reference
//! decoder run on that prompt alone; the timing of the run is the pipeline model's
//! (`executor::pipeline`) over every sequence's modeled steps.

use std::path::PathBuf;

use anyhow::{bail, Context};
use serde_json::json;
use waferc_ir::wafer::{artifact, WaferProgram};
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
    /// With --timing-only: feed the prompt from position P, as though P positions were already
    /// in the KV cache (a timing-only run holds no values, so only how many positions each KV
    /// block holds matters): the decode speed deep into a context without running the whole
    /// prompt. The batched prefill estimates need a run from position 0 and are left out.
    #[arg(long, value_name = "P", requires = "timing_only")]
    pub from_position: Option<u32>,
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
    /// The position the prompt starts at (timing only, `Executor::seek`); 0 otherwise.
    pub from_position: u32,
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
    let from_position = args.from_position.unwrap_or(0);
    for prompt in &prompts {
        let needed = from_position as usize + prompt.len() + max_new;
        if needed > program.max_context as usize {
            let from = from_text(from_position);
            bail!(
                "{}: the prompt ({} tokens){from} plus {max_new} new tokens needs {needed} positions, but the artifact was compiled for {} (compile with a larger --max-context)",
                args.artifact.display(),
                prompt.len(),
                program.max_context
            );
        }
    }
    if !args.timing_only && !program.weights_present {
        bail!("{}: compiled shape-only (no weights): only --timing-only can run it", args.artifact.display());
    }

    let stop_tokens = args.generate.stop_tokens(&module.meta.eos_token_ids);
    let executions: Vec<Execution> = prompts
        .iter()
        .map(|prompt| Execution {
            artifact: &args.artifact,
            prompt,
            max_new_tokens: max_new,
            force_tokens: args.generate.force_tokens.as_deref().unwrap_or(&[]),
            stop_tokens: stop_tokens.clone(),
            validate: args.validate,
            timing_only: args.timing_only,
            from_position,
        })
        .collect();
    // Executor errors name the instruction and PE; this names the artifact they came from.
    let outcomes = execute_in_flight(&compiled, &executions, in_flight)
        .with_context(|| format!("running {}", args.artifact.display()))?;
    let pipelined = pipeline_timing(&prompts, &outcomes, in_flight, program);
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
                "first_position": r.first_position,
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
fn pipeline_timing(
    prompts: &[Vec<u32>],
    outcomes: &[Outcome],
    in_flight: usize,
    program: &WaferProgram,
) -> PipelineTiming {
    let costs: Vec<SequenceCosts> = prompts
        .iter()
        .zip(outcomes)
        .map(|(prompt, outcome)| SequenceCosts {
            prompt_tokens: prompt.len(),
            new_tokens: outcome.tokens.len(),
            steps: outcome.steps.iter().map(|step| StepCost::of(step, &program.plan)).collect(),
        })
        .collect();
    executor::pipeline(&costs, in_flight, program.target.clock_hz)
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
    let mut outcomes = execute_in_flight(compiled, std::slice::from_ref(run), 1)?;
    Ok(outcomes.remove(0))
}

/// Runs several sequences on one executor, up to `in_flight` at once, each in a sequence slot
/// of its own (its own KV blocks, `Executor::select_sequence`), their steps interleaved round
/// robin; a finished sequence's slot takes the next waiting one. Each is validated against a
/// reference decoder of its own.
pub(super) fn execute_in_flight(
    compiled: &artifact::Artifact,
    runs: &[Execution],
    in_flight: usize,
) -> anyhow::Result<Vec<Outcome>> {
    let (program, module) = (&compiled.program, &compiled.module);
    let timing_only = runs.first().is_some_and(|r| r.timing_only);
    let options = ExecOptions { timing_only, record_values: false };
    let mut wafer = Executor::new(program, module, compiled.tiles.bytes(), options)?;
    let with_index = |index: usize, e: anyhow::Error| match runs.len() {
        1 => e,
        _ => e.context(format!("sequence {index}")),
    };
    let bar = session::spinner("running");
    let mut outcomes: Vec<Option<Outcome>> = vec![None; runs.len()];
    let mut slots: Vec<Option<(usize, SequenceRun)>> = (0..in_flight).map(|_| None).collect();
    let mut waiting = 0..runs.len();
    loop {
        let mut stepped = false;
        for (slot, held) in slots.iter_mut().enumerate() {
            wafer.select_sequence(slot as u32)?;
            if held.is_none() {
                if let Some(index) = waiting.next() {
                    wafer.reset_sequence();
                    if runs[index].from_position > 0 {
                        wafer.seek(runs[index].from_position)?;
                    }
                    *held = Some((index, SequenceRun::new(compiled, &runs[index]).map_err(|e| with_index(index, e))?));
                }
            }
            let Some((index, sequence)) = held.as_mut() else { continue };
            stepped = true;
            let done = sequence.advance(compiled, &mut wafer).map_err(|e| with_index(*index, e));
            if done.inspect_err(|_| bar.finish_and_clear())? {
                let report = wafer.timing_report(sequence.run.prompt.len()).context("the executor ran no step")?;
                let (index, sequence) = held.take().expect("a sequence is held");
                outcomes[index] = Some(sequence.finish(report));
            }
        }
        bar.set_message(format!("running: {} of {} sequences done", outcomes.iter().flatten().count(), runs.len()));
        if !stepped {
            break;
        }
    }
    bar.finish_and_clear();
    Ok(outcomes.into_iter().map(|o| o.expect("every sequence ran to its end")).collect())
}

/// One sequence on the executor: its reference decoder (validating), what it has fed and
/// generated so far.
struct SequenceRun<'a> {
    run: &'a Execution<'a>,
    reference: Option<ReferenceDecoder>,
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    steps: Vec<StepTiming>,
    /// The next token to feed, and how many tokens were fed.
    feed: u32,
    fed: usize,
}

impl<'a> SequenceRun<'a> {
    fn new(compiled: &'a artifact::Artifact, run: &'a Execution<'a>) -> anyhow::Result<Self> {
        let reference = match run.validate {
            true => Some(ReferenceDecoder::new(&compiled.module, compiled.program.max_context as usize)?),
            false => None,
        };
        let feed = *run.prompt.first().context("the prompt is empty")?;
        Ok(SequenceRun { run, reference, tokens: Vec::new(), logits: Vec::new(), steps: Vec::new(), feed, fed: 0 })
    }

    /// Feeds the next token to `wafer` (this sequence selected); true when the sequence is done.
    fn advance(&mut self, compiled: &artifact::Artifact, wafer: &mut Executor) -> anyhow::Result<bool> {
        let run = self.run;
        let position = wafer.position();
        let step = wafer.step(self.feed)?;
        if let Some(reference) = self.reference.as_mut() {
            let expected = reference.step(self.feed)?;
            let same = step.logits.as_ref().is_some_and(|got| bits_equal(got, &expected));
            if !same {
                return Err(explain_mismatch(run.artifact, compiled, run.prompt, &self.tokens, position));
            }
        }
        self.steps.push(step.timing);
        self.fed += 1;
        if self.fed < run.prompt.len() {
            self.feed = run.prompt[self.fed];
            return Ok(false);
        }
        if self.tokens.len() == run.max_new_tokens {
            return Ok(true);
        }
        let next = match (run.force_tokens.get(self.tokens.len()), &step.logits) {
            (Some(&token), _) => token,
            (None, Some(logits)) => argmax(logits),
            (None, None) => *run.prompt.last().expect("prompt is not empty"),
        };
        self.tokens.push(next);
        if let Some(row) = step.logits {
            self.logits.push(row);
        }
        if run.stop_tokens.contains(&next) || self.tokens.len() == run.max_new_tokens {
            return Ok(true);
        }
        self.feed = next;
        Ok(false)
    }

    fn finish(self, report: TimingReport) -> Outcome {
        Outcome { tokens: self.tokens, logits: self.logits, steps: self.steps, report }
    }
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

/// ` from position P` for a prompt fed from position `P` past 0 (`--from-position`).
fn from_text(position: u32) -> String {
    match position {
        0 => String::new(),
        p => format!(" from position {p}"),
    }
}

pub(super) fn describe_timing(r: &TimingReport) -> String {
    let from = from_text(r.first_position);
    let mut text = format!(
        "modeled on {}: {} cycles per token, {:.0} tokens/s decode, time to first token {:.1} us ({} prompt tokens{from}), {} PEs",
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
