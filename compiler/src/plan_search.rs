//! Plan search: `compile --plan auto` lowers the module with every candidate plan, times one
//! decode step of each on the executor's timing model, and keeps the fastest that fits and that
//! the placement checker accepts.
//!
//! The candidates are the default tiled plan and the stacked plan at a few group sizes and wafer
//! shares (a small model's layers run faster on small regions, whose collectives are short; a
//! large one needs the whole wafer's SRAM). A candidate whose weights cannot fit the PEs it may
//! use is skipped without lowering. The search is deterministic: candidates are evaluated one
//! after another, and the winner is the one with the fewest modeled cycles, ties going to the
//! earlier candidate. A candidate faster than every one so far is handed at once to the caller's
//! `keep`, which runs the placement checker on it (the compile command writes its artifact
//! meanwhile, beside the checker) and says whether the checker accepted it, so no lowered program
//! is held while the next candidate lowers: memory holds one program at a time.
//!
//! The stacked plans close to the fastest are then tried with each KV head's cache in copies.
//! In an MoE model (where "close" is wider) the fastest plan of each group size among them is
//! then tried with its experts' lanes shared by two, four, ... experts while each doubling is
//! faster. A search timed deep in the context (`compile --search-position`), where attention's
//! work is every candidate's alike and their cycles bunch up, also tries KV copies on the
//! fastest plan of each wafer share, and last tries each share's fastest plan with each KV
//! block spread over two, four, ... PEs by lane while each doubling is faster.
//!
//! On a tight wafer (the weights fill it beyond the tiles' usual share, as the 70B's fill four
//! WSE-3s), when the largest group size is the fastest, the search then tries larger groups
//! that split every wafer's layers evenly, while each is faster.
//!
//! Where no plan with KV copies fits, the fastest stacked plan is then tried with each KV head's
//! cache in two, four, ... slices of its head dimension while each doubling is faster.
//!
//! Each candidate is lowered from the module for its plan kind ([`Modules`]): the compile
//! driver runs a plan-dependent pipeline (the default one, whose `rewrite` fuses matvecs only
//! where the plan's cost says so) once per kind, so tiled candidates get the module costed for
//! the tiled plan and stacked ones the module costed for the stacked plan.
use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;
use waferc_ir::wafer::{Plan, WaferProgram, LANES};
use waferc_ir::Module;
use waferc_passes::wafer::{self as lowering, stacked_tiles_estimate, CheckError, CompileOptions, STACKED_TILE_SHARE};
use waferc_passes::PlanKind;
use waferc_runtime::executor::{ExecOptions, Executor};
use waferc_targets::Target;

/// Group sizes (layers per region) the search tries for the stacked plan.
const LAYERS_PER_REGION: [u16; 3] = [1, 2, 4];
/// Shares of the wafer (percent) the search tries for the stacked plan.
const WAFER_PERCENTS: [u8; 3] = [100, 35, 12];

/// Stacked plans whose modeled cycles are within this factor of the fastest are tried again
/// with KV heads held in copies, at most [`REFINED_PLANS`] of them.
const REFINE_WITHIN: f64 = 1.03;
const REFINED_PLANS: usize = 3;
/// [`REFINE_WITHIN`] in an MoE model, whose plans are then also tried with their experts'
/// lanes shared, which gains a group size far more than KV copies do: qwen3-30b-a3b on wse3x4,
/// `stacked:2` 1,135 tok/s against `stacked:4`'s 1,231, but 1,517 with `kv8,share4` against
/// `stacked:4,100,kv8,share2`'s 1,452.
const MOE_REFINE_WITHIN: f64 = 1.25;

/// The most matvec tiles (`stacked_tiles_estimate`) of a stacked candidate the search lowers.
/// A stacked lowering holds a hundred-odd bytes per tile (tile, SRAM regions, routes), and the
/// count grows with the group size, since every PE of a region holds a tile of each of its
/// layers' matvecs. Measured pinned peaks at 5f3b451: llama3.1-8b `stacked:4,100,kv2` on wse3
/// (about 15 million tiles) 1.85 GB; mixtral-8x7b `stacked:2,100,kv4` on wse3x4 (about 32
/// million) 4.3 GB; qwen3-30b-a3b `stacked:2,100,kv8,share2` (about 46 million, its experts'
/// tiles twice `stacked:2`'s) 5.8 GB, and `share4` (about 74 million) 8.7 GB. The searches
/// under this bound peak at 9.9 GB (Qwen3, 16 minutes at f2db40e, `share4` chosen) and 12.5 GB
/// (Mixtral, 21 minutes at aba4932, `stacked:4,100,kv4,share2` chosen). Qwen3's
/// `stacked:2,100,kv8,share8` (about 131 million) peaks at 14.1 GB pinned (at 5f931e2) and is
/// the fastest of its plans (1,811 tok/s against `share4`'s 1,746), so the bound takes it in:
/// the Qwen3 search then picks it, peaking at 15.1 GB (35 minutes beside other runs, 6b6e955).
/// Larger candidates (Qwen3's `stacked:4,100,kv8,share4`, about 144 million; Mixtral's
/// `stacked:4,100,kv4,share4`, about 145 million) are not tried; `--plan` pins one. (Mixtral's
/// `stacked:2,...,share8`, about 131 million, is under the bound, but its search stops at
/// `share4`, which runs out of colours.)
const MAX_STACKED_TILES: u64 = 135_000_000;
/// [`MAX_STACKED_TILES`] for a dense model, whose lowering holds less per tile (no lanes, no
/// expert copies): llama3.1-70b `stacked:4` on wse3x4 (about 60 million tiles) peaks at 8.4 GB
/// in the search (1fc34e0), and `stacked:5` (about 74 million) at 10.6 GB pinned (b7eaed9);
/// `stacked:10` (about 145 million) is not tried.
const MAX_DENSE_STACKED_TILES: u64 = 80_000_000;

/// The most experts the search puts in one MoE lane (`Plan::Stacked::experts_per_lane`).
const MAX_EXPERTS_PER_LANE: u8 = 8;

/// The module each candidate plan is lowered from.
#[derive(Clone, Copy)]
pub enum Modules<'a> {
    /// One module for every plan.
    One(&'a Module),
    /// A module per plan kind: the pass pipeline run with its choices costed for each.
    PerKind { tiled: &'a Module, stacked: &'a Module },
}

impl<'a> Modules<'a> {
    /// The module `plan` is lowered from.
    pub fn for_plan(&self, plan: &Plan) -> &'a Module {
        match (self, PlanKind::of(plan)) {
            (Modules::One(module), _) => module,
            (Modules::PerKind { tiled, .. }, PlanKind::Tiled) => tiled,
            (Modules::PerKind { stacked, .. }, PlanKind::Stacked) => stacked,
        }
    }

    /// Which module `plan` is lowered from, when there are several.
    fn label(&self, plan: &Plan) -> Option<PlanKind> {
        matches!(self, Modules::PerKind { .. }).then(|| PlanKind::of(plan))
    }
}

/// One plan the search considered, and what became of it.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    /// The `--plan` spelling, to pin this candidate.
    pub plan: String,
    /// The plan kind whose module this candidate was lowered from (`None`: one module for all).
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "kind_name")]
    pub module: Option<PlanKind>,
    /// Modeled cycles of one decode step (position 0), when the plan lowered.
    pub cycles_per_token: Option<u64>,
    pub modeled_tok_s: Option<f64>,
    pub pes_used: Option<usize>,
    /// Wall time of lowering and timing this candidate.
    pub seconds: f64,
    pub chosen: bool,
    /// Why a candidate that was not chosen lost: slower (by how much), did not fit, or could
    /// not be lowered (the lowering's error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lost_because: Option<String>,
}

fn kind_name<S: serde::Serializer>(kind: &Option<PlanKind>, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(kind.map_or("", PlanKind::name))
}

/// A candidate's record, with the lowering's error when it failed.
type Record = (Candidate, Option<anyhow::Error>);

/// The plans `--plan auto` tries for `module` on `target`, in order of preference on a tie.
pub fn candidates(module: &Module) -> Vec<Plan> {
    let layers = module.meta.num_layers.max(1);
    let mut plans = vec![Plan::Tiled];
    for k in LAYERS_PER_REGION.into_iter().filter(|&k| k as u32 <= layers) {
        for wafer_percent in WAFER_PERCENTS {
            plans.push(Plan::Stacked {
                layers_per_region: k,
                wafer_percent,
                kv_copies: 1,
                experts_per_lane: 1,
                kv_spread: 1,
                kv_slices: 1,
            });
        }
    }
    plans
}

/// What the search found: the chosen program (or what `keep` made of it) and every candidate's
/// record.
pub struct Found<T = WaferProgram> {
    pub program: T,
    pub plan: Plan,
    pub candidates: Vec<Candidate>,
}

/// What `keep` made of a candidate faster than all before it: what it holds, or why the
/// placement checker rejected the program.
pub enum Checked<T> {
    Accepted(T),
    Rejected(CheckError),
}

/// The plain `keep`: checks `program` and holds it when the checker accepts it.
pub fn checked(program: WaferProgram, module: &Module) -> anyhow::Result<Checked<WaferProgram>> {
    Ok(match lowering::check(&program, module) {
        Ok(()) => Checked::Accepted(program),
        Err(e) => Checked::Rejected(e),
    })
}

/// Lowers `module` with each candidate plan (the other options as in `base`), times each at
/// position 0, and returns the fastest the checker accepts. Fails with the first candidate's
/// error when none lowers.
pub fn search(module: &Module, target: &Target, base: &CompileOptions) -> anyhow::Result<Found> {
    search_keeping(Modules::One(module), target, base, 0, checked)
}

/// [`search`] over `modules`, timing each candidate's decode step at `position` (0: the first
/// token; deeper, where attention reads every filled position of its KV blocks, for plans
/// suited to long contexts), handing each candidate that is faster than all before it to `keep`
/// (with the module it was lowered from) at once, and holding only what `keep` returns for the
/// programs the checker accepted (the last such is the winner's). `keep` must run the checker
/// ([`checked`] does only that); it may do more beside it, as the compile command writes the
/// artifact while the checker runs.
pub fn search_keeping<T>(
    modules: Modules,
    target: &Target,
    base: &CompileOptions,
    position: u32,
    mut keep: impl FnMut(WaferProgram, &Module) -> anyhow::Result<Checked<T>>,
) -> anyhow::Result<Found<T>> {
    let mut plans = candidates(modules.for_plan(&Plan::Tiled));
    let params = target.params();
    let wafer_bytes = params.grid_cols as u64 * params.grid_rows as u64 * params.usable_bytes_per_pe() as u64;
    let max_tiles = match modules.for_plan(&plans[0]).has_moe() {
        true => MAX_STACKED_TILES,
        false => MAX_DENSE_STACKED_TILES,
    };

    struct Kept<T> {
        index: usize,
        cycles: u64,
        kept: T,
    }
    // One candidate at a time; a program is dropped once it is timed, or once `keep` has it
    // (a lowered 8B program is gigabytes). The last candidates go first: the stacked plan's
    // larger groups are the largest lowerings, and usually the fastest, so later candidates are
    // rarely faster and rarely checked. The order changes nothing else: the winner is the least
    // (cycles, index) that the checker accepts.
    let mut records: Vec<Option<Record>> = (0..plans.len()).map(|_| None).collect();
    let mut best: Option<Kept<T>> = None;
    let mut run = |index: usize,
                   plan: Plan,
                   records: &mut Vec<Option<Record>>,
                   best: &mut Option<Kept<T>>|
     -> anyhow::Result<()> {
        let start = Instant::now();
        let module = modules.for_plan(&plan);
        let weight_bytes = weight_bytes_of(module);
        let mut candidate = Candidate {
            plan: plan.to_string(),
            module: modules.label(&plan),
            cycles_per_token: None,
            modeled_tok_s: None,
            pes_used: None,
            seconds: 0.0,
            chosen: false,
            lost_because: None,
        };
        let mut error = None;
        let share = match plan {
            Plan::Stacked { wafer_percent, .. } => wafer_percent as f64 / 100.0,
            _ => 1.0,
        };
        // A share whose SRAM cannot hold the weights is not tried. (Weights beyond the tiles' usual
        // share of it make a tight wafer, which the stacked plan lays out with rules of its own:
        // the 70B's 141 GB on wse3x4's 166 GB.)
        let room = share * wafer_bytes as f64 * params.wafers as f64;
        // The PEs a stacked candidate's regions span, and the tiles it would lay over them.
        let tiles = match plan {
            Plan::Stacked { layers_per_region, experts_per_lane, .. } => {
                let pes = share * (params.grid_cols as u64 * params.grid_rows as u64 * params.wafers as u64) as f64;
                stacked_tiles_estimate(module, layers_per_region, experts_per_lane, pes as u64)
            }
            _ => 0,
        };
        if matches!(plan, Plan::Stacked { .. }) && weight_bytes as f64 > room {
            candidate.lost_because = Some(format!(
                "not tried: {:.1} GB of weights exceed the SRAM of its {}% of the wafer ({:.1} GB)",
                weight_bytes as f64 / 1e9,
                (share * 100.0).round(),
                room / 1e9
            ));
        } else if tiles > max_tiles {
            candidate.lost_because = Some(format!(
                "not tried: about {:.0} million matvec tiles, more than the search lowers ({:.0} million)",
                tiles as f64 / 1e6,
                max_tiles as f64 / 1e6
            ));
        } else {
            match evaluate(module, target, base, plan, position) {
                Ok((program, cycles)) => {
                    candidate.cycles_per_token = Some(cycles);
                    candidate.modeled_tok_s = Some(params.clock_hz / cycles.max(1) as f64);
                    candidate.pes_used = Some(program.pes.len());
                    // A tie goes to the earlier candidate.
                    if best.as_ref().is_none_or(|b| (cycles, index) < (b.cycles, b.index)) {
                        match keep(program, module)? {
                            Checked::Accepted(kept) => *best = Some(Kept { index, cycles, kept }),
                            Checked::Rejected(e) => {
                                candidate.lost_because = Some(format!("rejected by the placement checker: {e}"));
                                error = Some(anyhow::Error::new(e));
                            }
                        }
                    }
                }
                Err(e) => {
                    candidate.lost_because = Some(format!("did not lower: {e:#}"));
                    error = Some(e);
                }
            }
        }
        candidate.seconds = start.elapsed().as_secs_f64();
        records[index] = Some((candidate, error));
        Ok(())
    };
    for (index, &plan) in plans.iter().enumerate().rev() {
        run(index, plan, &mut records, &mut best)?;
    }
    // Then the stacked plans within `REFINE_WITHIN` (`MOE_REFINE_WITHIN`) of the fastest, with
    // each KV head's cache in copies (more SRAM for KV, less attention work per block): each
    // copy count is a lowering as large as its plan's, so only the few best plans are refined.
    let moe = modules.for_plan(&plans[0]).has_moe();
    let within = if moe { MOE_REFINE_WITHIN } else { REFINE_WITHIN };
    let fastest = best.as_ref().map_or(0, |b| b.cycles);
    // (cycles, index) of the candidates that lowered within `within` of `fastest`.
    let close_to_fastest = |records: &[Option<Record>]| -> Vec<(u64, usize)> {
        lowered(records).filter(|&(cycles, _)| cycles as f64 <= fastest as f64 * within).collect()
    };
    let mut close = close_to_fastest(&records);
    close.sort_unstable();
    close.truncate(REFINED_PLANS);
    // Deep in the context attention's work is every candidate's alike, so their cycles bunch up
    // (SmolLM2 at position 1,024: nine stacked plans within 6%) and the closest few say little of
    // which refines best: there the fastest plan of each wafer share is refined too.
    let deep = position >= LANES as u32;
    if deep {
        for start in fastest_by(&plans, lowered(&records), wafer_share) {
            if !close.iter().any(|&(_, index)| index == start.1) {
                close.push(start);
            }
        }
    }
    for (_, index) in close {
        let Plan::Stacked { kv_copies: 1, .. } = plans[index] else {
            continue;
        };
        for copies in kv_copy_counts(modules.for_plan(&plans[index])) {
            let mut plan = plans[index];
            if let Plan::Stacked { kv_copies, .. } = &mut plan {
                *kv_copies = copies;
            }
            plans.push(plan);
            records.push(None);
            run(plans.len() - 1, plan, &mut records, &mut best)?;
        }
    }
    // Lowers `double(plan)` from the plan at `index` (`cycles`) on, for as long as each is faster.
    let mut double_while_faster = |(mut cycles, mut index): (u64, usize),
                                   double: &dyn Fn(Plan) -> Option<Plan>,
                                   plans: &mut Vec<Plan>,
                                   records: &mut Vec<Option<Record>>,
                                   best: &mut Option<Kept<T>>|
     -> anyhow::Result<()> {
        while let Some(plan) = double(plans[index]).filter(|plan| !plans.contains(plan)) {
            plans.push(plan);
            records.push(None);
            run(plans.len() - 1, plan, records, best)?;
            match records[plans.len() - 1].as_ref().and_then(|r| r.0.cycles_per_token) {
                Some(faster) if faster < cycles => (cycles, index) = (faster, plans.len() - 1),
                _ => break,
            }
        }
        Ok(())
    };
    // Then, on a tight wafer, where the largest group size tried is the fastest, larger groups
    // that split each wafer's layers evenly, while each is faster. There only large groups fit
    // (the 70B's `stacked:1` and `stacked:2` overflow a PE), a layer's share of a region's PEs
    // is what its arithmetic runs on, and the growth stops where the longer collectives cost
    // more: llama3.1-70b on wse3x4, `stacked:4,100,slice4` 1,502,116 cycles a token,
    // `stacked:5,100,slice4` 1,417,052 (b7eaed9); on PEs of 56 KiB, `stacked:10` 1,434,391
    // against `stacked:5`'s 1,380,277.
    let tight = weight_bytes_of(modules.for_plan(&plans[0])) as f64
        > STACKED_TILE_SHARE * wafer_bytes as f64 * params.wafers.max(1) as f64;
    let largest = LAYERS_PER_REGION[LAYERS_PER_REGION.len() - 1];
    let fastest_base = lowered(&records).filter(|&(_, index)| group_size(&plans[index]).is_some()).min();
    if let Some(start) = fastest_base.filter(|&(_, index)| tight && group_size(&plans[index]) == Some(largest)) {
        let layers = modules.for_plan(&plans[0]).meta.num_layers;
        let growing = |plan| larger_group(plan, layers, params.wafers.max(1) as u32);
        double_while_faster(start, &growing, &mut plans, &mut records, &mut best)?;
    }
    // Then, where no plan with KV copies lowered (their SRAM does not fit), the fastest stacked
    // plan with each KV head's cache in twice as many slices of its head dimension, for as long
    // as that is faster: the slices split a step's scores and weighted values at a position as
    // copies split them by query head, on the same PEs and SRAM, but their score sums carry a
    // block's rows, which a long context and a batched prompt pay for. llama3.1-70b on wse3x4
    // (no SRAM for copies): `stacked:4` 1,663,924 cycles a token, `slice4` 1,506,173. Where
    // copies fit they are the better trade: llama3.1-8b on wse3, `stacked:4,100,slice4` 3,312
    // modeled tok/s at position 0 against `kv2`'s 3,186, but 626 at position 1,024 against
    // 1,090, and a 1,024-token prompt's first token in 35.2 ms against 16.2.
    let copies_fit =
        lowered(&records).any(|(_, index)| matches!(plans[index], Plan::Stacked { kv_copies, .. } if kv_copies > 1));
    let fastest_stacked = lowered(&records).filter(|&(_, index)| group_size(&plans[index]).is_some()).min();
    if let Some(start) = fastest_stacked.filter(|_| !copies_fit) {
        let most_slices = max_kv_slices(modules.for_plan(&plans[0]));
        let slicing = |plan| slicing_twice(plan, most_slices);
        double_while_faster(start, &slicing, &mut plans, &mut records, &mut best)?;
    }
    // Then, in an MoE model, the fastest plan of each group size within `MOE_REFINE_WITHIN`
    // (KV copies included), with its experts' lanes shared by twice as many experts, for as long
    // as that is faster: each expert computes on more PEs, while two chosen experts of one lane
    // run one after the other (the timing model's picks decide how often). Each doubling is a
    // lowering with twice the experts' tiles. Every such group size gets its own doublings: a
    // smaller group gives each expert fewer PEs, so sharing gains it more.
    if moe {
        for start in fastest_by(&plans, close_to_fastest(&records), group_size) {
            double_while_faster(start, &sharing_twice, &mut plans, &mut records, &mut best)?;
        }
    }
    // Then, for a step deep in the context (every lane of a block's first chunk holds a row),
    // the fastest plan of each wafer share (KV copies included) with each KV block spread over
    // twice as many PEs by lane, for as long as that is faster: a full block's scores and
    // weighted values are split between its PEs, which the KV strip takes from the tiles, so a
    // larger share gains more from it (SmolLM2 at 1,024: `stacked:1,35,kv3` goes from 267,981
    // to 197,379 cycles at `spread4` and no further, `stacked:1,100,kv3` from 275,507 to 182,583
    // at `spread8`). At position 0 a block has one row, so it never helps.
    if deep {
        for start in fastest_by(&plans, lowered(&records), wafer_share) {
            double_while_faster(start, &spread_twice, &mut plans, &mut records, &mut best)?;
        }
    }
    let mut records: Vec<Record> = records.into_iter().map(|r| r.expect("every plan ran")).collect();
    let Some(best) = best else {
        let rejected = records.iter().any(|(c, _)| c.lost_because.as_ref().is_some_and(|w| w.starts_with("rejected")));
        let first = records.iter_mut().find_map(|(_, e)| e.take());
        return Err(match (first, rejected) {
            (Some(e), true) => e.context("the placement checker rejected every candidate plan that lowered"),
            (Some(e), false) => e,
            (None, _) => anyhow::anyhow!("no candidate plan fits {}", target.name),
        });
    };
    for (i, (c, _)) in records.iter_mut().enumerate() {
        if i == best.index {
            c.chosen = true;
        } else if c.lost_because.is_none() {
            let cycles = c.cycles_per_token.unwrap_or(u64::MAX);
            c.lost_because = Some(format!(
                "slower: {cycles} cycles per token, {:.2}x the chosen plan's {}",
                cycles as f64 / best.cycles.max(1) as f64,
                best.cycles
            ));
        }
    }
    Ok(Found { program: best.kept, plan: plans[best.index], candidates: records.into_iter().map(|(c, _)| c).collect() })
}

/// (cycles, index) of each candidate in `records` that lowered.
fn lowered(records: &[Option<Record>]) -> impl Iterator<Item = (u64, usize)> + '_ {
    records.iter().enumerate().filter_map(|(i, r)| Some((r.as_ref()?.0.cycles_per_token?, i)))
}

/// Among `candidates` ((cycles, index)), the fastest of each value of `key` over the stacked
/// plans (its group size, its wafer share), fastest first.
fn fastest_by(
    plans: &[Plan],
    candidates: impl IntoIterator<Item = (u64, usize)>,
    key: fn(&Plan) -> Option<u16>,
) -> Vec<(u64, usize)> {
    let mut fastest: BTreeMap<u16, (u64, usize)> = BTreeMap::new();
    for (cycles, index) in candidates {
        if let Some(k) = key(&plans[index]) {
            let start = fastest.entry(k).or_insert((cycles, index));
            *start = (*start).min((cycles, index));
        }
    }
    let mut starts: Vec<(u64, usize)> = fastest.into_values().collect();
    starts.sort_unstable();
    starts
}

/// `plan` with the next larger group whose regions split `layers` evenly over `wafers` (each
/// wafer then holds whole groups alike); `None` when there is none, or for a plan that is not
/// stacked.
fn larger_group(mut plan: Plan, layers: u32, wafers: u32) -> Option<Plan> {
    let Plan::Stacked { layers_per_region, .. } = &mut plan else { return None };
    let even = |k: u32| layers.is_multiple_of(k) && (layers / k).is_multiple_of(wafers);
    *layers_per_region = (*layers_per_region as u32 + 1..=layers).find(|&k| even(k))?.try_into().ok()?;
    Some(plan)
}

/// The bytes of `module`'s weights.
fn weight_bytes_of(module: &Module) -> u64 {
    module.weights.iter().filter_map(|(_, w)| w.ty.bytes()).sum()
}

/// A stacked plan's layers per region.
fn group_size(plan: &Plan) -> Option<u16> {
    match *plan {
        Plan::Stacked { layers_per_region, .. } => Some(layers_per_region),
        _ => None,
    }
}

/// A stacked plan's share of the wafer.
fn wafer_share(plan: &Plan) -> Option<u16> {
    match *plan {
        Plan::Stacked { wafer_percent, .. } => Some(wafer_percent as u16),
        _ => None,
    }
}

/// `plan` with its experts' lanes shared by twice as many experts; `None` past
/// [`MAX_EXPERTS_PER_LANE`] or for a plan that is not stacked.
fn sharing_twice(mut plan: Plan) -> Option<Plan> {
    let Plan::Stacked { experts_per_lane, .. } = &mut plan else { return None };
    *experts_per_lane = experts_per_lane.checked_mul(2).filter(|&e| e <= MAX_EXPERTS_PER_LANE)?;
    Some(plan)
}

/// `plan` with each KV block spread over twice as many PEs; `None` past a chunk's [`LANES`] or
/// for a plan that is not stacked or cuts its KV heads in slices.
fn spread_twice(mut plan: Plan) -> Option<Plan> {
    let Plan::Stacked { kv_spread, kv_slices: 1, .. } = &mut plan else { return None };
    *kv_spread = kv_spread.checked_mul(2).filter(|&l| l as usize <= LANES)?;
    Some(plan)
}

/// `plan` with each KV head's cache in twice as many slices of its head dimension; `None` past
/// `most` or for a plan that is not stacked or spreads its KV blocks.
fn slicing_twice(mut plan: Plan, most: u8) -> Option<Plan> {
    let Plan::Stacked { kv_slices, kv_spread: 1, .. } = &mut plan else { return None };
    *kv_slices = kv_slices.checked_mul(2).filter(|&d| d <= most)?;
    Some(plan)
}

/// The most slices the module's attentions can cut their head dimension in: each an aligned
/// power-of-two run of whole 32-element chunks, at most 8 (1 with attention sinks, which the
/// sliced placement does not take, or without attention).
fn max_kv_slices(module: &Module) -> u8 {
    let attentions = module.body.iter().filter_map(|(_, instr)| match &instr.op {
        waferc_ir::Op::Attention { cache, sinks, .. } => Some((module.caches[*cache].head_dim, sinks.is_some())),
        _ => None,
    });
    attentions
        .map(|(head_dim, sinks)| {
            let chunks = head_dim / 32;
            match !sinks && head_dim.is_multiple_of(32) && chunks.is_power_of_two() {
                true => chunks.min(8) as u8,
                false => 1,
            }
        })
        .min()
        .unwrap_or(1)
}

/// The copy counts of each KV head's cache the search tries beyond one: the smallest that
/// divides the query heads per KV head, and one copy per query head (none without attention or
/// with one query head per KV head).
fn kv_copy_counts(module: &Module) -> Vec<u8> {
    let group = module.body.iter().find_map(|(_, instr)| match &instr.op {
        waferc_ir::Op::Attention { cache, heads, .. } => Some(heads / module.caches[*cache].kv_heads.max(1)),
        _ => None,
    });
    let Some(group) = group.filter(|&g| g > 1 && g <= u8::MAX as u32) else { return Vec::new() };
    let smallest = (2..=group).find(|d| group % d == 0).unwrap_or(group);
    let mut counts = vec![smallest as u8, group as u8];
    counts.dedup();
    counts
}

/// Lowers `module` with `plan` and times one decode step (position 0, token 0) on the
/// executor's timing model.
fn evaluate(
    module: &Module,
    target: &Target,
    base: &CompileOptions,
    plan: Plan,
    position: u32,
) -> anyhow::Result<(WaferProgram, u64)> {
    let program = lowering::compile(module, target, &CompileOptions { plan, ..base.clone() })?;
    let options = ExecOptions { timing_only: true, record_values: false };
    // The step's cycles are the timing report's cycles per token for a one-token run; the
    // report's other views (prefill, busiest links) are not needed to rank plans.
    let mut executor = Executor::new(&program, module, None, options)?;
    executor.seek(position)?;
    let cycles = executor.step(0)?.timing.cycles.max(1);
    Ok((program, cycles))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past four layers a region, the 70B (80 layers on four wafers) tries 5, 10, 20 and
    /// stops: 40 would leave two wafers without a region. 32 layers on one wafer skip 5.
    #[test]
    fn larger_groups_split_every_wafers_layers_evenly() {
        let sizes = |layers, wafers| {
            let mut plan = Plan::stacked(4);
            std::iter::from_fn(|| {
                plan = larger_group(plan, layers, wafers)?;
                group_size(&plan)
            })
            .collect::<Vec<_>>()
        };
        assert_eq!(sizes(80, 4), [5, 10, 20]);
        assert_eq!(sizes(32, 1), [8, 16, 32]);
        assert_eq!(larger_group(Plan::Tiled, 80, 4), None);
    }
}
