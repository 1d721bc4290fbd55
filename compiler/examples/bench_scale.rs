//! The compiler and the timing model at full scale: synthesises shape-only checkpoints of the
//! published models, compiles each for the wafer target it needs, times one decode token without
//! values, and prints a table of wall times, peak memory and modeled decode speed beside the
//! published speed and the plan's distance bound.
//!
//! cargo run --release -p waferc --example bench_scale [-- PRESET...]
//!
//! Without arguments it runs llama3.1-8b, llama3.1-70b, mixtral-8x7b, qwen3-30b-a3b, gpt-oss-20b and
//! gpt-oss-120b (MXFP4 experts, as released), then the
//! capacity cases: llama3.1-70b at q8_0 on two WSE-3s (targets/files/wse3x2.toml) and at q4_0 on
//! one, llama3.1-8b at q4_0 on one with a 131,072-position KV cache. Name presets to run only
//! their cases. A case that does not fit prints by how much and a lower bound.
//!
//! Targets for the table (2 cores): compile <= 10 s and <= 2 GiB peak, one timed token <= 30 s.
//!
//! Beside the decode speed it prints the mean decoder layer's critical-path cycles split into
//! compute, communication and waiting for links, and the modeled time to first token of a
//! 1,024- and an 8,192-token prompt prefilled as a batch (the KV capacity is 8,192 positions so
//! the longer prompt fits); see `waferc_runtime::executor::timing`. And the decode speed deep in
//! the context: the step at position 1,024 (the token after a 1,024-token prompt) and at the KV
//! cache's last position (8,191 but in the capacity cases), each timed after `Executor::seek` (timing only, a KV block's cost depends
//! only on how many of its positions are filled), since attention's work grows with the
//! positions a KV block holds while position 0 attends one.
//!
//! The distance bound (`waferc_ir::wafer::distance_bound_cycles`) is the longest chain of route
//! spans through the program: only distance, no arithmetic, serialisation or contention; its
//! tok/s is `clock_hz` over that many cycles.
//!
//! # Sequences in flight
//!
//! For Llama-3.1-8B (wse3) and Llama-3.1-70B (wse3x4) a second table, with 1, 4 and 16
//! sequences in flight: each N compiled with KV capacity for N sequences (`max_sequences`, every
//! sequence's KV blocks on PEs of their own) at the case's KV capacity, after `compile`'s default
//! passes (`rewrite, dce`), under the plan the search picks for one sequence (the search runs once, at N = 1; larger N pin its plan, since every
//! search lowers several full-size candidates), one timing-only token timed in every sequence
//! slot (their KV blocks sit in different places), and those steps through the pipeline model
//! (`executor::pipeline`, 32 tokens per sequence): aggregate modeled tok/s and the slowest and
//! fastest sequence's. A case that does not fit says by how much.
//!
//! `-- --sequences-only [PRESET...]` prints only this table.

use std::error::Error;
use std::path::Path;
use std::time::Instant;

use waferc::plan_search;
use waferc::synth::{synth, Preset};
use waferc_ir::wafer::distance_bound_cycles;
use waferc_ir::wafer::profile::timing_only_experts;
use waferc_ir::Module;
use waferc_passes::quantize::Quantize;
use waferc_passes::wafer::{compile, CompileOptions, WaferError};
use waferc_passes::Pass;
use waferc_runtime::executor::{pipeline, ExecOptions, Executor, SequenceCosts, StepCost};
use waferc_targets::Target;

/// A preset, the targets to try in order, and the decode speed Cerebras published for it.
struct Case {
    preset: &'static str,
    targets: &'static [&'static str],
    published: Option<(f64, &'static str)>,
    /// Capacity cases: the `quantize` pass's arguments, and the KV capacity (else [`KV_CAPACITY`]).
    quantize: Option<(&'static str, u32)>,
}

/// The checked-in two-wafer target file (targets/files/wse3x2.toml).
const WSE3X2: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../targets/files/wse3x2.toml");

const CASES: [Case; 9] = [
    Case { preset: "llama3.1-8b", targets: &["wse3"], published: Some((1800.0, "one CS-3, Aug 2024")), quantize: None },
    Case { preset: "llama3.1-70b", targets: &["wse3x4"], published: Some((450.0, "four CS-3, 2024")), quantize: None },
    Case { preset: "mixtral-8x7b", targets: &["wse3", "wse3x4"], published: None, quantize: None },
    Case { preset: "qwen3-30b-a3b", targets: &["wse3", "wse3x4"], published: None, quantize: None },
    // gpt-oss (issue 10): the release's MXFP4 experts, kept packed in the PE tiles.
    Case { preset: "gpt-oss-20b", targets: &["wse3", "wse3x4"], published: None, quantize: None },
    Case {
        preset: "gpt-oss-120b",
        targets: &["wse3", "wse3x4"],
        published: Some((3000.0, "Cerebras, Aug 2025")),
        quantize: None,
    },
    // Capacity (issue 8): weights quantised in the PE tiles.
    Case { preset: "llama3.1-70b", targets: &[WSE3X2], published: None, quantize: Some(("q8_0:all", 4096)) },
    Case { preset: "llama3.1-70b", targets: &["wse3"], published: None, quantize: Some(("q4_0:all", 4096)) },
    Case { preset: "llama3.1-8b", targets: &["wse3"], published: None, quantize: Some(("q4_0:all", 131_072)) },
];

const KV_CAPACITY: u32 = 8192;

/// The models and targets of the sequences table, with the KV capacity per sequence (16
/// sequences' blocks must fit beside the weights: the 70B's weights leave room for little KV).
const SEQUENCE_CASES: [(&str, &str, u32); 2] = [("llama3.1-8b", "wse3", 1024), ("llama3.1-70b", "wse3x4", 256)];
const IN_FLIGHT: [usize; 3] = [1, 4, 16];

/// One row of the sequences table.
struct SequenceRow {
    model: String,
    target: String,
    /// The plan: the search's pick for one sequence.
    plan: String,
    kv: u32,
    in_flight: usize,
    pes: usize,
    aggregate: f64,
    /// The slowest and the fastest sequence's tok/s.
    per_sequence: (f64, f64),
}

/// One row of the table.
struct Row {
    model: String,
    target: String,
    /// The plan the search chose.
    plan: String,
    pes: usize,
    /// Wafers the placement occupies (of the target's).
    wafers: usize,
    compile_s: f64,
    peak_mib: f64,
    token_s: f64,
    modeled: f64,
    /// The mean decoder layer on the critical path: total, compute, communication, waiting.
    layer: [u64; 4],
    /// Modeled time to first token (ms) of 1,024 and 8,192 prompt tokens.
    ttft_ms: [Option<f64>; 2],
    /// Modeled decode tok/s of the step at position 1,024 and at the KV cache's last position.
    deep: [f64; 2],
    bound: f64,
    published: String,
}

fn main() -> Result<(), Box<dyn Error>> {
    let mut wanted: Vec<String> = std::env::args().skip(1).collect();
    let sequences_only = wanted.iter().any(|w| w == "--sequences-only");
    wanted.retain(|w| w != "--sequences-only");
    let scratch = std::env::temp_dir().join(format!("waferc-bench-scale-{}", std::process::id()));
    let result = run(&wanted, &scratch, sequences_only);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

fn run(wanted: &[String], scratch: &Path, sequences_only: bool) -> Result<(), Box<dyn Error>> {
    let mut rows = Vec::new();
    let mut sequence_rows = Vec::new();
    let mut notes = Vec::new();
    let cases = CASES.iter().filter(|c| !sequences_only || SEQUENCE_CASES.iter().any(|s| s.0 == c.preset));
    for case in cases.filter(|c| wanted.is_empty() || wanted.iter().any(|w| w == c.preset)) {
        let dir = scratch.join(case.preset);
        synth(&Preset::by_name(case.preset)?, &dir, true)?;
        let mut module = waferc::frontend::load(&dir)?.module;
        std::fs::remove_dir_all(&dir)?;
        let (label, kv_capacity) = match case.quantize {
            Some((args, kv)) => {
                Quantize::from_args(&args.split_whitespace().collect::<Vec<_>>())?.run(&mut module)?;
                (format!("{} {args} KV {kv}", case.preset), kv)
            }
            None => (case.preset.to_string(), KV_CAPACITY),
        };
        let mut placed = false;
        for &name in case.targets {
            let target = Target::resolve(name)?;
            // The sequences table compiles its own KV capacities, whether or not this one fits.
            if let (Some(&(_, _, kv)), None) =
                (SEQUENCE_CASES.iter().find(|c| (c.0, c.1) == (case.preset, name)), case.quantize)
            {
                sequences_in_flight(&module, &target, case.preset, kv, &mut sequence_rows, &mut notes)?;
            }
            if sequences_only {
                placed = true;
                break;
            }
            reset_peak_rss();
            let start = Instant::now();
            // The plan `compile` would choose: the search over candidate plans.
            let program = match plan_search::search(&module, &target, &CompileOptions::new(kv_capacity)) {
                Ok(found) => found.program,
                Err(e) => match e.downcast::<WaferError>() {
                    Ok(WaferError::DoesNotFit(not_fit)) => {
                        notes.push(format!("{label} does not fit {}: {not_fit}", target.name));
                        notes.push(lower_bound_note(&label, &module, kv_capacity, &target));
                        continue;
                    }
                    Ok(other) => return Err(format!("{label} on {}: {other}", target.name).into()),
                    Err(other) => return Err(format!("{label} on {}: {other:#}", target.name).into()),
                },
            };
            let compile_s = start.elapsed().as_secs_f64();
            let peak_mib = peak_rss_mib();
            eprintln!("{label} on {}: compiled in {compile_s:.2} s, timing a token", target.name);
            let start = Instant::now();
            let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
            let mut executor = Executor::new(&program, &module, None, options)?;
            executor.step(module.meta.bos_token_id.unwrap_or(0))?;
            let token_s = start.elapsed().as_secs_f64();
            let report = executor.timing_report(0).ok_or("a step ran, so there is a report")?;
            let layer = report.mean_layer.clone().unwrap_or_default();
            let ttft = |tokens: u32| {
                let prefill = report.prefill.iter().find(|p| p.prompt_tokens == tokens);
                prefill.and_then(|p| p.ttft_us).map(|us| us / 1000.0)
            };
            let mut deep = [0.0; 2];
            for (tok_s, position) in deep.iter_mut().zip([1024, kv_capacity - 1]) {
                executor.seek(position)?;
                executor.step(module.meta.bos_token_id.unwrap_or(0))?;
                *tok_s = executor.timing_report(0).ok_or("a step ran")?.modeled_decode_tok_s;
            }
            // The experts the timing-only step chose, as the bound assumes.
            let chosen = timing_only_experts(&module, program.routing_profile.as_ref(), 0);
            let bound = distance_bound_cycles(&program, &module, 0, chosen);
            rows.push(Row {
                model: label.clone(),
                target: target.name.clone(),
                plan: program.plan.to_string(),
                pes: program.pes.len(),
                wafers: program.pes.iter().map(|image| image.pe.wafer).max().map_or(0, |w| w as usize + 1),
                compile_s,
                peak_mib,
                token_s,
                modeled: report.modeled_decode_tok_s,
                layer: [layer.cycles, layer.compute_cycles, layer.comm_cycles, layer.wait_cycles],
                ttft_ms: [ttft(1024), ttft(8192)],
                deep,
                bound: program.target.clock_hz / bound as f64,
                published: case.published.map_or("-".into(), |(tok_s, how)| format!("{tok_s:.0} ({how})")),
            });
            placed = true;
            break;
        }
        if !placed {
            notes.push(format!("{label}: no target tried fits; see above for what would"));
        }
    }
    if !sequences_only {
        print_table(&rows);
    }
    if !sequence_rows.is_empty() {
        println!(
            "\nsequences in flight (each sequence's KV on PEs of its own; a token timed per slot, pipeline model):"
        );
        println!(
            "model         target  plan        KV    in flight        PEs  aggregate tok/s  per-sequence tok/s (slowest-fastest)"
        );
        for r in &sequence_rows {
            println!(
                "{:<13} {:<7} {:<11} {:<5} {:>9}  {:>9}  {:>15.0}  {:>9.0}-{:.0}",
                r.model, r.target, r.plan, r.kv, r.in_flight, r.pes, r.aggregate, r.per_sequence.0, r.per_sequence.1
            );
        }
    }
    for note in notes {
        println!("note: {note}");
    }
    if sequences_only {
        return Ok(());
    }
    rewrite_effect(wanted, scratch)
}

/// The `rewrite` pass's effect (issue 8): routes, colours and modeled decode speed of the
/// frontend's module and of `rewrite, dce`'s, on the same target, each under the plan the search
/// picks for it (what `compile` does with and without `--skip-pass rewrite`: with it, each
/// candidate is lowered from the module whose `rewrite` was costed for its plan kind).
fn rewrite_effect(wanted: &[String], scratch: &Path) -> Result<(), Box<dyn Error>> {
    const CASES: [(&str, &str); 2] = [("llama3.1-8b", "wse3"), ("mixtral-8x7b", "wse3x4")];
    let mut lines = Vec::new();
    for (preset, target) in CASES.iter().filter(|(p, _)| wanted.is_empty() || wanted.iter().any(|w| w == p)) {
        let dir = scratch.join(format!("{preset}-rewrite"));
        synth(&Preset::by_name(preset)?, &dir, true)?;
        let original = waferc::frontend::load(&dir)?.module;
        std::fs::remove_dir_all(&dir)?;
        let start = Instant::now();
        let [tiled, stacked] = default_pipeline_per_kind(&original)?;
        let rewrite_s = start.elapsed().as_secs_f64();
        let target = Target::resolve(target)?;
        let cases = [
            ("without", plan_search::Modules::One(&original)),
            ("with", plan_search::Modules::PerKind { tiled: &tiled, stacked: &stacked }),
        ];
        for (label, modules) in cases {
            let program = plan_search::search_keeping(
                modules,
                &target,
                &CompileOptions::new(KV_CAPACITY),
                0,
                plan_search::checked,
            )
            .map_err(|e| format!("{preset} {label} rewrite on {}: {e:#}", target.name))?
            .program;
            let module = modules.for_plan(&program.plan);
            let colours = program.routes.iter().map(|r| r.colour).max().map_or(0, |c| c as u32 + 1);
            let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
            let mut executor = Executor::new(&program, module, None, options)?;
            executor.step(module.meta.bos_token_id.unwrap_or(0))?;
            let report = executor.timing_report(0).ok_or("a step ran, so there is a report")?;
            let matvecs = module.body.iter().filter(|(_, i)| matches!(i.op, waferc_ir::Op::MatVec { .. })).count();
            lines.push(format!(
                "| {preset} | {} | {} | {label} | {matvecs} | {} | {} | {colours} | {:.0} |",
                target.name,
                program.plan,
                module.body.len(),
                program.routes.len(),
                report.modeled_decode_tok_s
            ));
        }
        eprintln!("{preset}: rewrite, dce (once per plan kind) took {rewrite_s:.2} s");
    }
    if !lines.is_empty() {
        println!();
        println!("| model | target | plan | rewrite | matvecs | instrs | routes | colours | modeled tok/s |");
        println!("|---|---|---|---|---|---|---|---|---|");
        for line in lines {
            println!("{line}");
        }
    }
    Ok(())
}

/// `module` after the default pipeline costed for the tiled and for the stacked plan.
fn default_pipeline_per_kind(module: &Module) -> Result<[Module; 2], Box<dyn Error>> {
    let run = |kind| -> Result<Module, Box<dyn Error>> {
        let passes =
            waferc_passes::registry::parse_pipeline_for(waferc_passes::registry::DEFAULT_PIPELINE, Some(kind))?;
        Ok(waferc_passes::PassManager::new(passes).run(module.clone())?.0)
    };
    Ok([run(waferc_passes::PlanKind::Tiled)?, run(waferc_passes::PlanKind::Stacked)?])
}

fn print_table(rows: &[Row]) {
    let header = [
        "model",
        "target",
        "plan",
        "PEs",
        "wafers",
        "compile s",
        "peak MiB",
        "token s",
        "modeled tok/s",
        "cycles/layer",
        "compute",
        "comm",
        "wait",
        "TTFT 1k ms",
        "TTFT 8k ms",
        "tok/s at 1,024",
        "tok/s at KV end",
        "distance bound tok/s",
        "published tok/s",
    ];
    let cells: Vec<[String; 19]> = rows
        .iter()
        .map(|r| {
            [
                r.model.clone(),
                r.target.clone(),
                r.plan.clone(),
                r.pes.to_string(),
                r.wafers.to_string(),
                format!("{:.2}", r.compile_s),
                format!("{:.0}", r.peak_mib),
                format!("{:.2}", r.token_s),
                format!("{:.0}", r.modeled),
                r.layer[0].to_string(),
                r.layer[1].to_string(),
                r.layer[2].to_string(),
                r.layer[3].to_string(),
                r.ttft_ms[0].map_or("-".into(), |ms| format!("{ms:.2}")),
                r.ttft_ms[1].map_or("-".into(), |ms| format!("{ms:.2}")),
                format!("{:.0}", r.deep[0]),
                format!("{:.0}", r.deep[1]),
                format!("{:.0}", r.bound),
                r.published.clone(),
            ]
        })
        .collect();
    let widths: Vec<usize> =
        (0..header.len()).map(|i| cells.iter().map(|c| c[i].len()).max().unwrap_or(0).max(header[i].len())).collect();
    let line = |fields: Vec<&str>| {
        let padded: Vec<String> = fields
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (f, w))| if i < 2 { format!("{f:<w$}") } else { format!("{f:>w$}") })
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.to_vec());
    line(widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().iter().map(String::as_str).collect());
    for row in &cells {
        line(row.iter().map(String::as_str).collect());
    }
}

/// Starts a new peak for [`peak_rss_mib`] (Linux: writing 5 to clear_refs resets VmHWM), so each
/// compile's peak is its own, not an earlier, larger model's.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The process's peak resident memory since [`reset_peak_rss`] (VmHWM), in MiB; 0 where /proc is
/// unavailable.
fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Compiles `module` for each of [`IN_FLIGHT`] sequences in flight (KV capacity for all of
/// them) under the plan the search picks for one, times a token in every sequence slot and runs
/// the pipeline model over those steps.
fn sequences_in_flight(
    module: &Module,
    target: &Target,
    preset: &str,
    kv: u32,
    rows: &mut Vec<SequenceRow>,
    notes: &mut Vec<String>,
) -> Result<(), Box<dyn Error>> {
    // The modules `compile` lowers: after the default passes (`rewrite, dce`) costed for each
    // plan kind, under which the search's pick can differ from the frontend module's (the 8B:
    // `stacked:4` against `stacked:2`).
    let [tiled, stacked] = default_pipeline_per_kind(module)?;
    let modules = plan_search::Modules::PerKind { tiled: &tiled, stacked: &stacked };
    let mut plan = None;
    for in_flight in IN_FLIGHT {
        let options = CompileOptions { max_sequences: in_flight as u32, ..CompileOptions::new(kv) };
        let start = Instant::now();
        let compiled = match plan {
            None => plan_search::search_keeping(modules, target, &options, 0, plan_search::checked)
                .map(|found| {
                    for c in &found.candidates {
                        let rate = c.modeled_tok_s.map_or("-".into(), |r| format!("{r:.0} tok/s"));
                        let verdict = c.lost_because.as_deref().unwrap_or("chosen");
                        eprintln!("  plan search, {preset} KV {kv}: {} {rate}: {verdict}", c.plan);
                    }
                    found.program
                })
                .map_err(|e| match e.downcast::<WaferError>() {
                    Ok(e) => e,
                    Err(e) => WaferError::Options(format!("{e:#}")),
                }),
            Some(plan) => compile(modules.for_plan(&plan), target, &CompileOptions { plan, ..options }),
        };
        let program = match compiled {
            Ok(program) => program,
            Err(WaferError::DoesNotFit(not_fit)) => {
                notes.push(format!("{preset}, {in_flight} sequences in flight, KV {kv}: {not_fit}"));
                continue;
            }
            // The one-sequence pick may not hold more sequences' KV blocks (its KV copies on a
            // PE's tiles): a row of the table that does not exist, not a failed benchmark.
            Err(other) if plan.is_some() => {
                let pick = plan.as_ref().map(ToString::to_string).unwrap_or_default();
                notes.push(format!(
                    "{preset}, {in_flight} sequences in flight, KV {kv}: {pick} does not lower: {other}"
                ));
                continue;
            }
            Err(other) => return Err(format!("{preset}, {in_flight} sequences: {other}").into()),
        };
        plan.get_or_insert(program.plan);
        let module = modules.for_plan(&program.plan);
        eprintln!(
            "{preset} with {in_flight} sequences in flight: {} plan compiled in {:.0} s; timing a token in each slot",
            program.plan,
            start.elapsed().as_secs_f64()
        );
        let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
        let mut executor = Executor::new(&program, module, None, options)?;
        let mut sequences = Vec::with_capacity(in_flight);
        for slot in 0..in_flight as u32 {
            executor.select_sequence(slot)?;
            let cost = StepCost::of(&executor.step(module.meta.bos_token_id.unwrap_or(0))?.timing, &program.plan);
            // A one-token prompt whose step gives the first token, then 31 more decode steps
            // costed like it.
            sequences.push(SequenceCosts { prompt_tokens: 1, new_tokens: 32, steps: vec![cost; 32] });
        }
        let timing = pipeline(&sequences, in_flight, program.target.clock_hz);
        let rates = timing.sequences.iter().map(|s| s.modeled_tok_s);
        rows.push(SequenceRow {
            model: preset.to_string(),
            target: program.target.name.clone(),
            plan: program.plan.to_string(),
            kv,
            in_flight,
            pes: program.pes.len(),
            aggregate: timing.aggregate_modeled_tok_s,
            per_sequence: (rates.clone().fold(f64::INFINITY, f64::min), rates.fold(0.0, f64::max)),
        });
    }
    Ok(())
}

/// What no placement can beat: the weights as stored plus the f32 KV cache, packed into every
/// PE's usable SRAM with nothing else (no activation slices, partial sums or vector ops), beside
/// the PEs the target has.
fn lower_bound_note(label: &str, module: &Module, kv_capacity: u32, target: &Target) -> String {
    let weights: u64 = module.weights.iter().map(|(_, w)| w.ty.bytes().unwrap_or(0)).sum();
    let kv: u64 =
        module.caches.iter().map(|(_, c)| 2 * 4 * c.kv_heads as u64 * c.head_dim as u64 * kv_capacity as u64).sum();
    let params = target.params();
    let usable = params.usable_bytes_per_pe() as u64;
    let pes = |bytes: u64| bytes.div_ceil(usable);
    let available = params.grid_cols as u64 * params.grid_rows as u64 * params.wafers as u64;
    format!(
        "{label} on {}: lower bound {} PEs = weights {:.2} GB ({} PEs) + f32 KV cache {:.2} GB ({} PEs) at {usable} usable bytes per PE, of {available} PEs ({:+.1}% of them)",
        target.name,
        pes(weights) + pes(kv),
        weights as f64 / 1e9,
        pes(weights),
        kv as f64 / 1e9,
        pes(kv),
        100.0 * ((pes(weights) + pes(kv)) as f64 / available as f64 - 1.0)
    )
}
