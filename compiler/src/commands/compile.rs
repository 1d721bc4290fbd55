//! `waferc compile MODEL --target T [--max-context N] [--max-sequences N] -o OUT [--passes P]
//! [--plan PLAN] [--search-position P] [--profile PROFILE.json | --calibrate PROMPTS] [--expert-order profile|index]
//! [--expert-replicas auto|off|always] [--dump-ir DIR] [--print-after PASS] [--time-passes] [--json]`

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::json;
use waferc_ir::wafer::{artifact, Plan, RegionKind, WaferProgram};
use waferc_ir::{DType, Handle, Module};
use waferc_passes::wafer::{self as lowering, CheckError, CompileOptions, ExpertOrder};
use waferc_passes::{registry, PassManager, PassRecord, PassReport, PlanKind};
use waferc_targets::Target;

use super::session;
use crate::plan_search::{self, Candidate, Checked};
use crate::replica_choice::{self, ReplicaChoice, ReplicaMode};

#[derive(clap::Args, Debug)]
pub struct CompileArgs {
    /// A Hugging Face checkpoint directory or a .gguf file.
    pub model: PathBuf,
    /// A built-in target (`waferc targets`), grid:RxC, or a .toml target file.
    #[arg(long)]
    pub target: String,
    /// KV cache capacity in positions: the longest prompt plus generated tokens a run may use.
    #[arg(long, default_value_t = 4096)]
    pub max_context: u32,
    /// Sequences in flight at once (`run --sequences`): KV capacity is reserved for this many.
    #[arg(long, default_value_t = 1)]
    pub max_sequences: u32,
    /// Place MoE experts by this routing profile (written by `waferc profile`).
    #[arg(long, conflicts_with = "calibrate")]
    pub profile: Option<PathBuf>,
    /// Profile the model on these prompts (one per line, as for `waferc profile`) and place
    /// its experts by the result.
    #[arg(long)]
    pub calibrate: Option<PathBuf>,
    /// How experts are ordered in a layer's region: by the profile, or by index (the baseline).
    #[arg(long, value_enum, default_value_t = ExpertOrderArg::Profile)]
    pub expert_order: ExpertOrderArg,
    /// Copies of hot experts on free PEs, for sequences in flight that pick the same expert:
    /// `auto` only where the pipeline model says a sequence would wait for an expert, `off`
    /// none, `always` as many as the free PEs hold (tiled plan, with a profile and
    /// --max-sequences above 1).
    #[arg(long, value_enum, default_value_t = ReplicaMode::Auto)]
    pub expert_replicas: ReplicaMode,
    /// The artifact file to write.
    #[arg(short, long)]
    pub output: PathBuf,
    /// IR passes to run before lowering, comma-separated with their arguments
    /// (e.g. "quantize q8_0, dce"): `verify`, `rewrite [plan=tiled|stacked]` (its fusion choices
    /// costed for that plan kind; by default for the plan being lowered), `dce`,
    /// `interleave-experts` (an MoE block's experts in program order stage by stage),
    /// `quantize FORMAT[:WHAT]...` (FORMAT q8_0|q4_0|q4_1; WHAT layers, embedding, lm_head joined
    /// by +, or all; a bare FORMAT is every matvec weight but a tied LM head).
    /// Without it, the default pipeline runs: `rewrite, dce, interleave-experts`.
    #[arg(long)]
    pub passes: Option<String>,
    /// Leave this pass out of the pipeline (default or `--passes`); repeatable.
    #[arg(long)]
    pub skip_pass: Vec<String>,
    /// The plan: `auto` (default: lower with every candidate plan, time one decode step of each,
    /// keep the fastest that fits and passes the checker; `--json` lists the candidates; a pipeline
    /// whose choices depend on the plan, like the default `rewrite`, runs once per plan kind and
    /// each candidate is lowered from its kind's module), or
    /// `tiled` (each matrix on its own tile grid, spread to fill the target), or
    /// `meshgemv:P,G` (WaferLLM: P x P blocks per matrix, two-level all-reduce with G groups), or
    /// `stacked:K[,P][,kvC][,shareE][,spreadL][,sliceD]` (K consecutive layers per region,
    /// every matvec tiled over the whole region; the regions span P percent of each wafer,
    /// default 100; each KV head's cache is held in C copies, each serving an equal share of its
    /// query heads, default 1; an MoE layer's experts share lanes E at a time, default 1; each
    /// 32-position KV block is spread over L = 1, 2, 4 or 8 PEs by position mod 8, default 1;
    /// each KV head's cache is cut in D = 1, 2, 4 or 8 slices of its head dimension, each slice's
    /// blocks computing its part of every score, default 1).
    #[arg(long, default_value = "auto")]
    pub plan: String,
    /// The position at which the plan search times each candidate's decode step: 0 (default)
    /// times the first token; a position deep in the context times attention over that many
    /// filled positions, where plans differ most (KV copies, KV blocks spread over PEs, block
    /// placement), for a workload of long prompts; from position 8 the search also tries KV
    /// copies on the fastest plan of each wafer share, and then each share's fastest with KV
    /// blocks spread (`spreadL`). Must be below --max-context.
    #[arg(long, value_name = "P", default_value_t = 0)]
    pub search_position: u32,
    /// Write the IR after every pass into DIR (00-frontend.ir, 01-<pass>.ir, ...).
    #[arg(long)]
    pub dump_ir: Option<PathBuf>,
    /// Print the IR after this pass (or `frontend`) to stdout; repeatable.
    #[arg(long)]
    pub print_after: Vec<String>,
    /// Print wall time and peak memory of every pass and lowering stage to stderr.
    #[arg(long)]
    pub time_passes: bool,
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertOrderArg {
    Profile,
    Index,
}

/// Parses `--plan`: `None` for `auto` (search).
pub fn parse_plan_choice(text: &str) -> anyhow::Result<Option<Plan>> {
    match text {
        "auto" => Ok(None),
        _ => parse_plan(text).map(Some),
    }
}

/// Parses a pinned `--plan` ([`Plan`]'s spelling).
pub fn parse_plan(text: &str) -> anyhow::Result<Plan> {
    text.parse().map_err(|e| anyhow::anyhow!("--plan {text:?}: {e}"))
}

pub fn run(args: CompileArgs) -> anyhow::Result<()> {
    let start = Instant::now();
    let target = Target::resolve(&args.target)?;
    let plan = parse_plan_choice(&args.plan)?;
    if args.search_position > 0 && plan.is_some() {
        bail!(
            "--search-position {} times the plan search's candidates, but --plan {} pins one",
            args.search_position,
            args.plan
        );
    }
    if args.search_position >= args.max_context {
        bail!(
            "--search-position {}: the KV capacity (--max-context {}) holds positions 0 to {}",
            args.search_position,
            args.max_context,
            args.max_context.saturating_sub(1)
        );
    }
    let spec = args.passes.as_deref().unwrap_or(registry::DEFAULT_PIPELINE);
    // The plan kinds to run the pipeline for: the pinned plan's; under the search both, when the
    // pipeline's choices depend on the plan (the default `rewrite`), each candidate then being
    // lowered from its kind's module; otherwise one run for every candidate.
    let kinds: Vec<Option<PlanKind>> = match &plan {
        Some(plan) => vec![Some(PlanKind::of(plan))],
        None if registry::depends_on_plan(spec, &args.skip_pass)? => PlanKind::ALL.map(Some).to_vec(),
        None => vec![None],
    };
    let passes = registry::without_passes(registry::parse_pipeline_for(spec, kinds[0])?, &args.skip_pass)?;
    for name in &args.print_after {
        let known = name == waferc_passes::INPUT_LABEL || passes.iter().any(|p| p.name() == name);
        if !known {
            bail!("--print-after {name}: no such pass in this pipeline (passes: frontend{})", pipeline_names(&passes));
        }
    }

    let loaded = session::load_model(&args.model)?;
    let tokenizer_json = loaded.tokenizer.as_ref().map(|t| t.to_json()).transpose()?;
    let profile = match (&args.profile, &args.calibrate) {
        (Some(path), _) => Some(super::profile::read(path)?),
        (None, Some(prompts)) => Some(super::profile::record(&loaded.module, loaded.tokenizer.as_ref(), prompts)?),
        (None, None) => None,
    };
    // One run dumps and prints its steps as it goes; with a run per kind that waits until the
    // search has chosen, and shows the run whose module the chosen plan was lowered from.
    let several = kinds.len() > 1;
    let mut runs: Vec<PipelineRun> = Vec::with_capacity(kinds.len());
    for &kind in &kinds {
        match run_pipeline(&args, spec, kind, loaded.module.clone(), !several) {
            Ok(run) => runs.push(run),
            Err(e) if several => {
                // Run it again showing its steps, so that the broken output is dumped and printed.
                let shown = run_pipeline(&args, spec, kind, loaded.module.clone(), true).err().unwrap_or(e);
                let kind = kind.map_or("any", PlanKind::name);
                return Err(shown.context(format!("the pass pipeline costed for the {kind} plan")));
            }
            Err(e) => return Err(e),
        }
    }
    drop(loaded.module);

    let expert_order = match args.expert_order {
        ExpertOrderArg::Profile => ExpertOrder::Profile,
        ExpertOrderArg::Index => ExpertOrder::Index,
    };
    let base = CompileOptions {
        max_context: args.max_context,
        max_sequences: args.max_sequences,
        profile,
        expert_order,
        expert_replicas: args.expert_replicas.policy(),
        ..CompileOptions::default()
    };
    let (summary, candidates, chosen, report) = match plan {
        Some(plan) => {
            let run = &runs[0];
            let (module, mut report) = (&run.module, run.report.clone());
            let options = CompileOptions { plan, ..base };
            let bar = session::spinner(format!("lowering onto {}", target.name));
            let (program, record) = timed("wafer-lowering", || lowering::compile(module, &target, &options));
            bar.finish_and_clear();
            let program = program?;
            report.records.push(record);
            let (chosen, record) = timed("expert-replicas", || {
                replica_choice::apply(program, module, &target, &options, args.expert_replicas)
            });
            let (program, replicas) = chosen?;
            report.records.push(record);
            let summary = Summary::of(&program, module, &args, replicas);
            let compiled = artifact::Artifact::new(program, module.clone()).with_tokenizer(tokenizer_json);
            // The artifact goes to a file beside the output, renamed over it once the checker
            // has accepted the program.
            let pending = pending_file(&args.output, "check");
            let ((checked, check_record), (written, write_record)) = check_beside_write(&compiled, module, &pending);
            let accepted = written.map_err(anyhow::Error::new).and_then(|()| {
                checked
                    .with_context(|| format!("the placement checker rejected the compiled program for {}", target.name))
            });
            if let Err(e) = accepted.and_then(|()| rename_onto(&pending, &args.output)) {
                let _ = std::fs::remove_file(&pending);
                return Err(e);
            }
            report.records.push(check_record);
            report.records.push(write_record);
            (summary, Vec::new(), 0, report)
        }
        None => {
            // Each candidate faster than all before it is checked at once while it is written to
            // a file of its own beside the output (so no lowered program is held while the next
            // one lowers); an accepted one's file replaces the last accepted one's, and the
            // winner's is renamed to the output at the end.
            let pending = pending_file(&args.output, "plan-search");
            let candidate_file = pending_file(&args.output, "plan-search-candidate");
            // The checks and writes are timed on their own row (all of them, when several
            // candidates were the fastest so far in turn), and taken out of the search's row.
            let mut write_record: Option<PassRecord> = None;
            let write_candidate = |program: WaferProgram, module: &Module| -> anyhow::Result<Checked<Summary>> {
                let (program, replicas) = replica_choice::apply(program, module, &target, &base, args.expert_replicas)?;
                let summary = Summary::of(&program, module, &args, replicas);
                let compiled = artifact::Artifact::new(program, module.clone()).with_tokenizer(tokenizer_json.clone());
                let (((checked, _), (written, _)), mut record) =
                    timed("check and write-artifact", || check_beside_write(&compiled, module, &candidate_file));
                if let Some(earlier) = &write_record {
                    record.wall += earlier.wall;
                }
                write_record = Some(record);
                let kept = match (written, checked) {
                    (Err(e), _) => Err(e.into()),
                    (Ok(()), Ok(())) => rename_onto(&candidate_file, &pending).map(|()| Checked::Accepted(summary)),
                    (Ok(()), Err(e)) => Ok(Checked::Rejected(e)),
                };
                if !matches!(kept, Ok(Checked::Accepted(_))) {
                    let _ = std::fs::remove_file(&candidate_file);
                }
                kept
            };
            let module_of = |kind| runs.iter().find(|r| r.kind == Some(kind)).map(|r| &r.module);
            let modules = match (module_of(PlanKind::Tiled), module_of(PlanKind::Stacked)) {
                (Some(tiled), Some(stacked)) if several => plan_search::Modules::PerKind { tiled, stacked },
                _ => plan_search::Modules::One(&runs[0].module),
            };
            let bar = session::spinner(format!("searching plans for {}", target.name));
            let (found, mut record) = timed("plan-search", || {
                plan_search::search_keeping(modules, &target, &base, args.search_position, write_candidate)
            });
            bar.finish_and_clear();
            let found = match found {
                Ok(found) => found,
                Err(e) => {
                    let _ = std::fs::remove_file(&pending);
                    return Err(e);
                }
            };
            if let Some(write) = &write_record {
                record.wall = record.wall.saturating_sub(write.wall);
            }
            let kind = PlanKind::of(&found.plan);
            let chosen = runs.iter().position(|r| r.kind.is_none_or(|k| k == kind)).expect("a run per kind");
            let mut report = runs[chosen].report.clone();
            if runs.len() > 1 {
                report.emit(args.dump_ir.as_deref(), &args.print_after, &mut std::io::stdout())?;
                // The other module's pipeline took time too: one row for all of it.
                for other in runs.iter().filter(|r| r.kind != Some(kind)) {
                    report.records.push(other.summary_record());
                }
            }
            report.records.push(record);
            report.records.extend(write_record);
            if let Err(e) = rename_onto(&pending, &args.output) {
                let _ = std::fs::remove_file(&pending);
                return Err(e);
            }
            (found.program, found.candidates, chosen, report)
        }
    };

    if args.time_passes {
        eprint!("{}", report.time_table());
    }
    let modules = runs.iter().enumerate().map(|(i, run)| ModuleUse::of(run, i == chosen)).collect();
    let summary = summary.finish(&args, &report, start.elapsed(), candidates, modules);
    if args.json {
        println!("{}", summary.json());
    } else {
        println!("{}", summary.text());
    }
    Ok(())
}

/// One run of the pass pipeline: the plan kind its choices were costed for (`None` when they
/// depend on none), the module it made and what it measured.
struct PipelineRun {
    kind: Option<PlanKind>,
    module: Module,
    report: PassReport,
}

impl PipelineRun {
    /// One `--time-passes` row for the whole run, for a run whose module was not chosen.
    fn summary_record(&self) -> PassRecord {
        let records = &self.report.records;
        PassRecord {
            name: format!("passes costed for {} (module not chosen)", self.kind.map_or("any plan", PlanKind::name)),
            wall: records.iter().map(|r| r.wall).sum(),
            verify_wall: records.iter().map(|r| r.verify_wall).sum(),
            peak_rss: records.last().and_then(|r| r.peak_rss),
            peak_rss_growth: None,
            text: None,
            changes: None,
        }
    }
}

/// Runs `spec` (without the `--skip-pass`es) on `module`, its choices costed for `kind`. With
/// `emit` its steps are dumped and printed as it runs, as `--dump-ir` and `--print-after` ask;
/// otherwise their text is kept (when those options want it) for [`PassReport::emit`].
fn run_pipeline(
    args: &CompileArgs,
    spec: &str,
    kind: Option<PlanKind>,
    module: Module,
    emit: bool,
) -> anyhow::Result<PipelineRun> {
    let passes = registry::without_passes(registry::parse_pipeline_for(spec, kind)?, &args.skip_pass)?;
    let mut manager = PassManager::new(passes);
    if emit {
        manager = manager.with_print_after(args.print_after.clone()).with_print_sink(std::io::stdout());
        if let Some(dir) = &args.dump_ir {
            manager = manager.with_dump_dir(dir);
        }
    } else if args.dump_ir.is_some() || !args.print_after.is_empty() {
        manager = manager.with_kept_text();
    }
    let (module, report) = manager.run(module)?;
    Ok(PipelineRun { kind, module, report })
}

/// What one pipeline run's module is, for the report: the plan kind it was costed for, whether
/// the chosen plan was lowered from it, its passes' changes and the matvecs `rewrite` fused.
struct ModuleUse {
    costed_for: Option<PlanKind>,
    chosen: bool,
    passes: Vec<serde_json::Value>,
    /// The fused weights (named by their parts joined with `+`) its matvecs read.
    fused_weights: Vec<String>,
    matvecs: usize,
}

impl ModuleUse {
    fn of(run: &PipelineRun, chosen: bool) -> ModuleUse {
        let mut fused_weights: Vec<String> = Vec::new();
        let mut matvecs = 0;
        for (_, instr) in run.module.body.iter() {
            if let waferc_ir::Op::MatVec { weight, .. } = &instr.op {
                matvecs += 1;
                let name = &run.module.weights[*weight].name;
                if name.contains('+') && !fused_weights.contains(name) {
                    fused_weights.push(name.clone());
                }
            }
        }
        ModuleUse { costed_for: run.kind, chosen, passes: pass_records_json(&run.report), fused_weights, matvecs }
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "costed_for": self.costed_for.map(PlanKind::name),
            "chosen": self.chosen,
            "matvecs": self.matvecs,
            "fused_weights": self.fused_weights,
            "passes": self.passes,
        })
    }
}

/// Pass records as `--json` lists them.
fn pass_records_json(report: &PassReport) -> Vec<serde_json::Value> {
    report
        .records
        .iter()
        .map(|r| {
            let changes = r.changes.map(|c| {
                json!({
                    "instrs": [c.instrs.0, c.instrs.1],
                    "matvecs": [c.matvecs.0, c.matvecs.1],
                    "weight_bytes": [c.weight_bytes.0, c.weight_bytes.1],
                })
            });
            json!({
                "name": r.name,
                "wall_seconds": (r.wall + r.verify_wall).as_secs_f64(),
                "peak_rss_bytes": r.peak_rss,
                "changes": changes,
            })
        })
        .collect()
}

/// Where an artifact waits until it may become the output (the plan search's best candidate so
/// far, or a pinned plan's while the checker runs): a temporary file beside the output (the
/// same file system, so the final rename is atomic), named like the artifact writer's own
/// temporary files, for `stage`.
fn pending_file(output: &std::path::Path, stage: &str) -> PathBuf {
    let mut name = output.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}-{stage}", std::process::id()));
    output.with_file_name(name)
}

/// Runs the placement checker on `compiled`'s program while writing it to `file`: both only read
/// the program, so they run side by side (the 8B's `stacked:4,100,kv2`: a 6.2 s check beside a
/// 4.4 s write). Returns each with its timing.
fn check_beside_write(
    compiled: &artifact::Artifact,
    module: &Module,
    file: &std::path::Path,
) -> (Timed<Verdict>, Timed<Written>) {
    std::thread::scope(|scope| {
        let checker = scope.spawn(|| timed("check", || lowering::check(&compiled.program, module)));
        // Named apart: the two rows overlap in time, and the report's total sums them.
        let written = timed("write-artifact (beside check)", || artifact::write(file, compiled));
        let checked = checker.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (checked, written)
    })
}

/// Moves the finished artifact `pending` onto `output`.
fn rename_onto(pending: &std::path::Path, output: &std::path::Path) -> anyhow::Result<()> {
    std::fs::rename(pending, output)
        .with_context(|| format!("could not move the compiled artifact {} to {}", pending.display(), output.display()))
}

fn pipeline_names(passes: &[Box<dyn waferc_passes::Pass>]) -> String {
    passes.iter().map(|p| format!(", {}", p.name())).collect()
}

/// A stage's result and its measurement.
type Timed<T> = (T, PassRecord);
/// The placement checker's verdict, and the artifact writer's.
type Verdict = Result<(), CheckError>;
type Written = Result<(), artifact::ArtifactError>;

/// Runs one lowering stage and measures it like a pass, so `--time-passes` shows it too.
fn timed<T>(name: &str, stage: impl FnOnce() -> T) -> Timed<T> {
    let before = waferc_passes::peak_rss();
    let start = Instant::now();
    let result = stage();
    let wall = start.elapsed();
    let after = waferc_passes::peak_rss();
    let growth = before.zip(after).map(|(b, a)| a.saturating_sub(b));
    (
        result,
        PassRecord {
            name: name.into(),
            wall,
            verify_wall: Duration::ZERO,
            peak_rss: after,
            peak_rss_growth: growth,
            text: None,
            changes: None,
        },
    )
}

/// What `compile` tells the user.
struct Summary {
    output: PathBuf,
    target: String,
    plan: String,
    max_context: u32,
    max_sequences: u32,
    /// The position the plan search timed its candidates at (`None` with `--plan`).
    search_position: Option<u32>,
    /// How experts were placed (`None` for a model without MoE layers).
    expert_placement: Option<String>,
    /// What `--expert-replicas` did (`None` for a model without MoE layers).
    expert_replicas: Option<ReplicaChoice>,
    pes_used: usize,
    grid_pes: u64,
    routes: usize,
    tile_bytes: u64,
    weights_present: bool,
    artifact_bytes: u64,
    seconds: f64,
    passes: Vec<serde_json::Value>,
    formats: Vec<FormatUse>,
    pes_without_weights: usize,
    /// The plan search's candidates (empty when `--plan` pinned one).
    candidates: Vec<Candidate>,
    /// The pass pipeline's runs: one, or one per plan kind under the search.
    modules: Vec<ModuleUse>,
}

/// What one weight storage format takes in a compiled program.
struct FormatUse {
    dtype: DType,
    /// Weights of the module stored in it.
    weights: usize,
    /// Their bytes as stored (packed blocks for a quantised format).
    bytes: u64,
    /// Bytes of their tiles on the wafer (more than `bytes` when a weight is placed twice, as a
    /// table tied to the LM head is: once for `embed`, once for the head's matvec).
    tile_bytes: u64,
    /// PEs holding at least one tile of them (a PE holding two formats counts for each).
    pes: usize,
    /// Those PEs as a share of one wafer.
    wafers: f64,
}

/// Per storage format: the module's weights in it and the PEs its tiles occupy, in
/// [`DType::ALL`] order; also the PEs that hold no weight tile (KV caches, vectors).
fn weight_formats(program: &WaferProgram, module: &Module) -> (Vec<FormatUse>, usize) {
    let wafer_pes = (program.target.grid_cols as u64 * program.target.grid_rows as u64).max(1) as f64;
    let dtype_of = |weight: u32| module.weights.get(Handle::new(weight as usize)).map(|w| w.ty.dtype);
    let mut pes_without_weights = 0;
    let mut pes_per_dtype = vec![0usize; DType::ALL.len()];
    let mut tile_bytes = vec![0u64; DType::ALL.len()];
    for image in &program.pes {
        let mut held = vec![false; DType::ALL.len()];
        for region in &image.regions {
            if let RegionKind::Weight { weight, .. } = &region.kind {
                if let Some(index) = dtype_of(*weight).and_then(|d| DType::ALL.iter().position(|&x| x == d)) {
                    held[index] = true;
                    tile_bytes[index] += region.bytes as u64;
                }
            }
        }
        if !held.contains(&true) {
            pes_without_weights += 1;
        }
        for (count, held) in pes_per_dtype.iter_mut().zip(held) {
            *count += usize::from(held);
        }
    }
    let formats = DType::ALL
        .iter()
        .zip(pes_per_dtype)
        .zip(tile_bytes)
        .filter_map(|((&dtype, pes), tile_bytes)| {
            let stored: Vec<u64> = module
                .weights
                .iter()
                .filter(|(_, w)| w.ty.dtype == dtype)
                .map(|(_, w)| w.ty.bytes().unwrap_or(0))
                .collect();
            (!stored.is_empty()).then(|| FormatUse {
                dtype,
                weights: stored.len(),
                bytes: stored.iter().sum(),
                tile_bytes,
                pes,
                wafers: pes as f64 / wafer_pes,
            })
        })
        .collect();
    (formats, pes_without_weights)
}

impl Summary {
    /// What the program tells (the rest is filled in by [`Summary::finish`] once it is written).
    fn of(program: &WaferProgram, module: &Module, args: &CompileArgs, replicas: ReplicaChoice) -> Summary {
        let t = &program.target;
        let has_experts = program.instrs.iter().any(|p| p.expert.is_some());
        let (formats, pes_without_weights) = weight_formats(program, module);
        Summary {
            output: args.output.clone(),
            target: t.name.clone(),
            plan: program.plan.to_string(),
            max_context: program.max_context,
            max_sequences: program.max_sequences,
            search_position: None,
            expert_placement: expert_placement(program, args, &replicas),
            expert_replicas: has_experts.then_some(replicas),
            pes_used: program.pes.len(),
            grid_pes: t.grid_cols as u64 * t.grid_rows as u64 * t.wafers as u64,
            routes: program.routes.len(),
            tile_bytes: program.tile_blob_len,
            weights_present: program.weights_present,
            artifact_bytes: 0,
            seconds: 0.0,
            passes: Vec::new(),
            formats,
            pes_without_weights,
            candidates: Vec::new(),
            modules: Vec::new(),
        }
    }

    /// The summary with the written artifact's size, the passes' records, the time taken, the
    /// plan search's candidates and the pipeline runs' modules.
    fn finish(
        self,
        args: &CompileArgs,
        report: &PassReport,
        elapsed: Duration,
        candidates: Vec<Candidate>,
        modules: Vec<ModuleUse>,
    ) -> Summary {
        Summary {
            artifact_bytes: std::fs::metadata(&args.output).map(|m| m.len()).unwrap_or(0),
            seconds: elapsed.as_secs_f64(),
            passes: pass_records_json(report),
            // Candidates exist only when the search ran.
            search_position: (!candidates.is_empty()).then_some(args.search_position),
            candidates,
            modules,
            ..self
        }
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "artifact": self.output,
            "target": self.target,
            "plan": self.plan,
            "max_context": self.max_context,
            "max_sequences": self.max_sequences,
            "search_position": self.search_position,
            "expert_placement": self.expert_placement,
            "expert_replicas": self.expert_replicas,
            "pes_used": self.pes_used,
            "grid_pes": self.grid_pes,
            "routes": self.routes,
            "tile_bytes": self.tile_bytes,
            "weights_present": self.weights_present,
            "artifact_bytes": self.artifact_bytes,
            "compile_seconds": self.seconds,
            "passes": self.passes,
            "weight_formats": self.formats.iter().map(|f| json!({
                "dtype": f.dtype.name(),
                "weights": f.weights,
                "bytes": f.bytes,
                "tile_bytes": f.tile_bytes,
                "pes": f.pes,
                "wafers": f.wafers,
            })).collect::<Vec<_>>(),
            "pes_without_weights": self.pes_without_weights,
            "plan_search": self.candidates,
            "modules": self.modules.iter().map(ModuleUse::json).collect::<Vec<_>>(),
        })
    }

    fn text(&self) -> String {
        let mut formats = String::new();
        for f in &self.formats {
            formats.push_str(&format!(
                "\n  {:<5} {:>5} weights {:>10.2} MB, tiles {:>10.2} MB on {:>9} PEs ({:.3} wafers)",
                f.dtype.name(),
                f.weights,
                f.bytes as f64 / 1e6,
                f.tile_bytes as f64 / 1e6,
                f.pes,
                f.wafers
            ));
        }
        formats.push_str(&format!(
            "\n  no weight tile (KV caches, vectors only) {:>22} on {:>9} PEs",
            "", self.pes_without_weights
        ));
        let sequences = match self.max_sequences {
            1 => String::new(),
            n => format!(" x {n} sequences"),
        };
        let experts = self.expert_placement.as_ref().map(|e| format!("\n{e}")).unwrap_or_default();
        let mut search = String::new();
        if !self.candidates.is_empty() {
            let at = match self.search_position {
                Some(p) if p > 0 => format!(" at position {p}"),
                _ => String::new(),
            };
            search.push_str(&format!("plan search (one decode step{at} of each candidate on the timing model):"));
            for c in &self.candidates {
                let rate = c.modeled_tok_s.map_or("-".to_string(), |r| format!("{r:.0} tok/s"));
                let verdict = match (&c.lost_because, c.chosen) {
                    (_, true) => "chosen".to_string(),
                    (Some(why), false) => why.clone(),
                    (None, false) => String::new(),
                };
                search.push_str(&format!("\n  {:<14} {:>12} {:>7.2} s  {verdict}", c.plan, rate, c.seconds));
            }
            search.push('\n');
            if self.modules.len() > 1 {
                search
                    .push_str("each candidate was lowered from the module whose passes were costed for its plan kind:");
                for m in &self.modules {
                    let kind = m.costed_for.map_or("any plan", PlanKind::name);
                    search.push_str(&format!(
                        "\n  {kind:<8} {} matvecs, {} of them fused{}",
                        m.matvecs,
                        m.fused_weights.len(),
                        if m.chosen { " (the chosen plan's)" } else { "" }
                    ));
                }
                search.push('\n');
            }
        }
        format!(
            "{search}compiled for {} ({} plan, KV capacity {} positions{sequences}): {} of {} PEs ({:.1}%), {} routes, {:.2} MB of weight tiles{}{experts}\nweights by storage format (a PE holding two formats counts for each):{}\nwrote {} ({:.2} MB) in {:.2} s",
            self.target,
            self.plan,
            self.max_context,
            self.pes_used,
            self.grid_pes,
            100.0 * self.pes_used as f64 / self.grid_pes.max(1) as f64,
            self.routes,
            self.tile_bytes as f64 / 1e6,
            if self.weights_present { "" } else { " (shape-only: no weight bytes packed)" },
            formats,
            self.output.display(),
            self.artifact_bytes as f64 / 1e6,
            self.seconds
        )
    }
}

/// The copies of hot experts the placer added, per MoE layer, and why it added no more.
fn replica_summary(
    program: &WaferProgram,
    profile: &waferc_ir::wafer::RoutingProfile,
    choice: &ReplicaChoice,
) -> String {
    let sequences = program.max_sequences;
    if sequences < 2 {
        return "no replicas of hot experts: with --max-sequences 1 a copy would serve no sequence".into();
    }
    if matches!(program.plan, waferc_ir::wafer::Plan::Stacked { .. }) {
        return format!(
            "no replicas of hot experts: the {} plan does not place them (the tiled plan does)",
            program.plan
        );
    }
    match (choice.mode, &choice.decision) {
        (ReplicaMode::Off, _) => return "no replicas of hot experts (--expert-replicas off)".into(),
        (ReplicaMode::Auto, Some(decision)) if choice.copies == 0 => {
            return format!("no replicas of hot experts (--expert-replicas auto): {decision}")
        }
        _ => {}
    }
    let mut per_layer: std::collections::BTreeMap<u32, usize> = std::collections::BTreeMap::new();
    for replica in &program.replicas {
        *per_layer.entry(replica.layer).or_insert(0) += replica.copies.len();
    }
    let copies: usize = per_layer.values().sum();
    let listed = profile
        .layers
        .iter()
        .map(|l| format!("{}:+{}", l.layer, per_layer.get(&l.layer).copied().unwrap_or(0)))
        .collect::<Vec<_>>()
        .join(" ");
    // Every picked expert already has a copy per sequence slot, or the free PEs ran out.
    let picked: usize = profile.layers.iter().map(|l| l.picks.iter().filter(|&&p| p > 0).count()).sum();
    let capped = program.replicas.iter().filter(|r| r.count() >= sequences).count();
    let free = (program.target.grid_cols as u64 * program.target.grid_rows as u64 * program.target.wafers as u64)
        .saturating_sub(program.pes.len() as u64);
    let why = if let (ReplicaMode::Auto, Some(decision)) = (choice.mode, &choice.decision) {
        format!("--expert-replicas auto placed {decision}")
    } else if capped == picked {
        format!("every picked expert has {sequences} copies, one per sequence slot (--max-sequences)")
    } else {
        let size = program.replicas.first().and_then(|r| r.copies.first()).map(|copy| {
            let mut pes: Vec<_> = copy.iter().flat_map(|p| p.compute_pes()).collect();
            pes.sort_unstable();
            pes.dedup();
            pes.len()
        });
        match size {
            Some(size) => format!("the free PEs ran out ({free} left; a copy takes about {size} plus shelf alignment)"),
            None => format!("the free PEs ran out ({free} left, too few for one copy)"),
        }
    };
    format!(
        "{copies} extra copies of hot experts on free PEs (sequence slot s runs copy s mod copies), per layer {listed}; no more because {why}"
    )
}

/// How the experts were placed, for the report (`None` without MoE layers).
fn expert_placement(program: &WaferProgram, args: &CompileArgs, replicas: &ReplicaChoice) -> Option<String> {
    if !program.instrs.iter().any(|p| p.expert.is_some()) {
        return None;
    }
    Some(match (&program.routing_profile, args.expert_order) {
        (None, _) => "experts placed in index order: no routing profile, so uniform routing is assumed \
                      (give --profile or --calibrate)"
            .to_string(),
        (Some(profile), ExpertOrderArg::Index) => {
            format!("experts placed in index order (--expert-order index); routing profile from {} stored", profile.source)
        }
        (Some(profile), ExpertOrderArg::Profile) => format!(
            "experts placed by the routing profile from {} ({} MoE layers): hottest beside the combine, co-picked experts adjacent; {}",
            profile.source,
            profile.layers.len(),
            replica_summary(program, profile, replicas)
        ),
    })
}
