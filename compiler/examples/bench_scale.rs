//! The compiler and the timing model at full scale: synthesises shape-only checkpoints of the
//! published models, compiles each for the wafer target it needs, times one decode token without
//! values, and prints a table of wall times, peak memory and modeled decode speed beside the
//! published speed and the plan's distance bound.
//!
//! cargo run --release -p waferc --example bench_scale [-- PRESET...]
//!
//! Without arguments it runs llama3.1-8b, llama3.1-70b, mixtral-8x7b and qwen3-30b-a3b; name
//! presets to run only those.
//!
//! Targets for the table (2 cores): compile <= 10 s and <= 2 GiB peak, one timed token <= 30 s.
//!
//! # The distance bound
//!
//! A lower bound on one token's latency that only the placement determines (wafer-facts.md,
//! "Bounds worth printing"): every route's *hop span*, the hops its farthest destination is from
//! a source along its path (a reduction or a gather: the farthest source from the destination,
//! as the crow flies on the mesh), at `hop_latency_cycles` a hop and `inter_wafer_latency_cycles`
//! an inter-wafer hop. A schedule step lasts at least its longest route's span; an instruction
//! at least the sum of its steps (they are dependent: reduce, then broadcast, then collect, then
//! deliver); it starts no earlier than its operands end. The bound is the longest such chain
//! through the program: no arithmetic, no serialisation, no contention, no synchronisation, only
//! distance. Its tok/s is `clock_hz` over that many cycles.
//!
//! # Sequences in flight
//!
//! For Llama-3.1-8B (wse3) and Llama-3.1-70B (wse3x4) a second table: the timed token of the
//! table above through the pipeline model (`executor::pipeline`) with 1, 4 and 16 sequences in
//! flight: aggregate modeled tok/s and each sequence's. The KV capacity of the extra sequences is
//! *not* reserved: `--max-sequences N` keeps N copies of a KV block on its PE, and at head_dim
//! 128 even two copies of the smallest block (32 positions) exceed a PE's SRAM; giving each
//! sequence blocks of its own is unfinished.

use std::error::Error;
use std::path::Path;
use std::time::Instant;

use waferc::synth::{synth, Preset};
use waferc_ir::wafer::{Pe, Route, RouteKind, WaferProgram};
use waferc_ir::Module;
use waferc_passes::wafer::{compile, CompileOptions, WaferError};
use waferc_runtime::executor::{pipeline, ExecOptions, Executor, SequenceCosts, StepCost};
use waferc_targets::Target;

/// A preset, the targets to try in order, and the decode speed Cerebras published for it.
struct Case {
    preset: &'static str,
    targets: &'static [&'static str],
    published: Option<(f64, &'static str)>,
}

const CASES: [Case; 4] = [
    Case { preset: "llama3.1-8b", targets: &["wse3"], published: Some((1800.0, "one CS-3, Aug 2024")) },
    Case { preset: "llama3.1-70b", targets: &["wse3x4"], published: Some((450.0, "four CS-3, 2024")) },
    Case { preset: "mixtral-8x7b", targets: &["wse3", "wse3x4"], published: None },
    Case { preset: "qwen3-30b-a3b", targets: &["wse3", "wse3x4"], published: None },
];

const KV_CAPACITY: u32 = 4096;

/// The models and targets of the sequences table.
const SEQUENCE_CASES: [(&str, &str); 2] = [("llama3.1-8b", "wse3"), ("llama3.1-70b", "wse3x4")];
const IN_FLIGHT: [usize; 3] = [1, 4, 16];

/// One row of the sequences table.
struct SequenceRow {
    model: String,
    target: String,
    in_flight: usize,
    aggregate: f64,
    per_sequence: f64,
}

/// One row of the table.
struct Row {
    model: String,
    target: String,
    pes: usize,
    compile_s: f64,
    peak_mib: f64,
    token_s: f64,
    modeled: f64,
    bound: f64,
    published: String,
}

fn main() -> Result<(), Box<dyn Error>> {
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    let scratch = std::env::temp_dir().join(format!("waferc-bench-scale-{}", std::process::id()));
    let result = run(&wanted, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

fn run(wanted: &[String], scratch: &Path) -> Result<(), Box<dyn Error>> {
    let mut rows = Vec::new();
    let mut sequence_rows = Vec::new();
    let mut notes = Vec::new();
    for case in CASES.iter().filter(|c| wanted.is_empty() || wanted.iter().any(|w| w == c.preset)) {
        let dir = scratch.join(case.preset);
        synth(&Preset::by_name(case.preset)?, &dir, true)?;
        let module = waferc::frontend::load(&dir)?.module;
        std::fs::remove_dir_all(&dir)?;
        let mut placed = false;
        for &name in case.targets {
            let target = Target::resolve(name)?;
            reset_peak_rss();
            let start = Instant::now();
            let program = match compile(&module, &target, &CompileOptions::new(KV_CAPACITY)) {
                Ok(program) => program,
                Err(WaferError::DoesNotFit(not_fit)) => {
                    notes.push(format!("{} does not fit {name}: {not_fit}", case.preset));
                    continue;
                }
                Err(other) => return Err(format!("{} on {name}: {other}", case.preset).into()),
            };
            let compile_s = start.elapsed().as_secs_f64();
            let peak_mib = peak_rss_mib();
            eprintln!("{} on {name}: compiled in {compile_s:.2} s, timing a token", case.preset);
            let start = Instant::now();
            let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
            let mut executor = Executor::new(&program, &module, None, options)?;
            let step = executor.step(module.meta.bos_token_id.unwrap_or(0))?;
            let token_s = start.elapsed().as_secs_f64();
            let report = executor.timing_report(0).ok_or("a step ran, so there is a report")?;
            if SEQUENCE_CASES.contains(&(case.preset, name)) {
                sequences_in_flight(&program, &step, case.preset, &mut sequence_rows);
            }
            rows.push(Row {
                model: case.preset.to_string(),
                target: name.to_string(),
                pes: program.pes.len(),
                compile_s,
                peak_mib,
                token_s,
                modeled: report.modeled_decode_tok_s,
                bound: program.target.clock_hz / distance_bound_cycles(&program, &module) as f64,
                published: case.published.map_or("-".into(), |(tok_s, how)| format!("{tok_s:.0} ({how})")),
            });
            placed = true;
            break;
        }
        if !placed {
            notes.push(format!("{}: no target tried fits; see above for what would", case.preset));
        }
    }
    print_table(&rows);
    if !sequence_rows.is_empty() {
        println!("\nsequences in flight (the timed token above, pipeline model; extra sequences' KV not reserved):");
        println!("model         target  in flight  aggregate tok/s  per-sequence tok/s");
        for r in &sequence_rows {
            println!(
                "{:<13} {:<7} {:>9}  {:>15.0}  {:>18.0}",
                r.model, r.target, r.in_flight, r.aggregate, r.per_sequence
            );
        }
    }
    for note in notes {
        println!("note: {note}");
    }
    Ok(())
}

fn print_table(rows: &[Row]) {
    let header = [
        "model",
        "target",
        "PEs",
        "compile s",
        "peak MiB",
        "token s",
        "modeled tok/s",
        "distance bound tok/s",
        "published tok/s",
    ];
    let cells: Vec<[String; 9]> = rows
        .iter()
        .map(|r| {
            [
                r.model.clone(),
                r.target.clone(),
                r.pes.to_string(),
                format!("{:.2}", r.compile_s),
                format!("{:.0}", r.peak_mib),
                format!("{:.2}", r.token_s),
                format!("{:.0}", r.modeled),
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

/// The longest chain of route spans through the program, in cycles (module documentation).
fn distance_bound_cycles(program: &WaferProgram, module: &Module) -> u64 {
    let mut own = vec![0u64; program.instrs.len()];
    for step in &program.schedule {
        let span = step.routes.iter().map(|&id| route_span(program, &program.routes[id as usize])).max();
        own[step.instr as usize] += span.unwrap_or(0);
    }
    let mut end = vec![0u64; program.instrs.len()];
    for (handle, instr) in module.body.iter() {
        let i = handle.index();
        let start = instr.op.operands().iter().map(|v| end[v.index()]).max().unwrap_or(0);
        end[i] = start + own[i];
    }
    end.iter().copied().max().unwrap_or(0).max(1)
}

/// Cycles from a route's sources to its farthest destination, distance only.
fn route_span(program: &WaferProgram, route: &Route) -> u64 {
    let params = &program.target;
    let hop = params.hop_latency_cycles as u64;
    match route.kind {
        // Many sources into one destination: the farthest source's distance.
        RouteKind::Reduce { .. } | RouteKind::Collect { .. } => {
            let destination = route.destinations.first().copied();
            route
                .sources
                .iter()
                .filter_map(|&source| destination.map(|d| pe_distance(program, source, d)))
                .max()
                .unwrap_or(0)
        }
        // One source, a multicast: depth along the path to the farthest PE reached.
        RouteKind::Operand { .. } | RouteKind::Statistic { .. } | RouteKind::Routing => {
            let mut depth: std::collections::HashMap<Pe, u64> = route.sources.iter().map(|&pe| (pe, 0)).collect();
            let mut farthest = 0;
            for run in &route.path {
                let start = depth.get(&run.from).copied().unwrap_or(0);
                if run.is_inter_wafer() {
                    let reached = start + params.inter_wafer_latency_cycles;
                    depth.entry(run.to).or_insert(reached);
                    farthest = farthest.max(reached);
                } else {
                    for (k, pe) in run.pes().into_iter().enumerate().skip(1) {
                        let reached = start + k as u64 * hop;
                        depth.entry(pe).or_insert(reached);
                        farthest = farthest.max(reached);
                    }
                }
            }
            farthest
        }
    }
}

/// Cycles between two PEs by distance alone: Manhattan hops on one wafer; across wafers, to the
/// gateway (0, 0), the inter-wafer hops, and from the next wafer's gateway.
fn pe_distance(program: &WaferProgram, from: Pe, to: Pe) -> u64 {
    let params = &program.target;
    let hop = params.hop_latency_cycles as u64;
    match from.distance(to) {
        Some(hops) => hops as u64 * hop,
        None => {
            let gateway = |pe: Pe| Pe::new(pe.wafer, 0, 0);
            let wafers = (from.wafer as i64 - to.wafer as i64).unsigned_abs();
            let local = from.distance(gateway(from)).unwrap_or(0) + to.distance(gateway(to)).unwrap_or(0);
            local as u64 * hop + wafers * params.inter_wafer_latency_cycles
        }
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

/// Runs the pipeline model over the timed `step` with each of [`IN_FLIGHT`] sequences in flight.
fn sequences_in_flight(
    program: &WaferProgram,
    step: &waferc_runtime::executor::StepResult,
    preset: &str,
    rows: &mut Vec<SequenceRow>,
) {
    let cost = StepCost::of(&step.timing);
    for in_flight in IN_FLIGHT {
        // Each sequence: a one-token prompt whose step gives its first token, then 31 more
        // decode steps costed like it.
        let sequence = SequenceCosts { prompt_tokens: 1, new_tokens: 32, steps: vec![cost; 32] };
        let timing = pipeline(&vec![sequence; in_flight], in_flight, program.target.clock_hz);
        rows.push(SequenceRow {
            model: preset.to_string(),
            target: program.target.name.clone(),
            in_flight,
            aggregate: timing.aggregate_modeled_tok_s,
            per_sequence: timing.sequences[0].modeled_tok_s,
        });
    }
}
