//! The distance bound: a floor on one decode step's latency that only the placement determines
//! (wafer-facts.md, "Bounds worth printing beside any modeled figure"). The timing model
//! (`runtime::executor::timing`) must never model a step faster than this; `bench_scale` prints
//! it beside the modeled speed.
//!
//! Every route has a *hop span*: the hops its farthest destination is from a source along its
//! path (a reduction or a gather: the farthest sending source from the destination, as the crow
//! flies on the mesh), at `hop_latency_cycles` a hop and `inter_wafer_latency_cycles` an
//! inter-wafer hop. A schedule step lasts at least its longest route's span; an instruction at
//! least the sum of its steps (they are dependent: reduce, then broadcast, then collect, then
//! deliver); it starts no earlier than its operands end. The bound is the longest such chain
//! through the program: no arithmetic, no serialisation, no contention, no synchronisation, only
//! distance.
//!
//! What runs depends on the step, as in the executor: an attention KV block holding no position
//! yet (all its positions beyond the step's) sends nothing, so a reduction over the blocks spans
//! only the blocks holding positions; an unchosen expert's instructions take no time, and an MoE
//! combine's gather spans only the chosen experts' senders. A chosen expert starts when its own
//! PEs have the layer's input and the routing, which for an expert near the dispatch point is
//! before the multicasts reach their farthest PE: its `expert_dispatch` ends its inputs' *leads*
//! ([`super::arrival`]) before they do, the same leads the timing model subtracts. Any other
//! reader reached by a delivery likewise starts its lead before the producer ends
//! ([`super::arrival::reader_leads`]).

use rustc_hash::FxHashMap as HashMap;

use super::arrival::{compute_pes_by_instr, dispatch_leads, multicast_depths, reader_leads};
use super::{InstrIndex, Pe, Phase, ResultLayout, Route, RouteId, RouteKind, WaferProgram, Work};
use crate::dependency::DependencyGraph;
use crate::module::Module;
use crate::op::Op;
use crate::Handle;

/// The longest chain of route spans through `program` for a decode step at `position`, in
/// cycles (at least 1). `expert_runs(layer, expert)` says which experts the step's router
/// chooses (an expert's instructions that do not run take no time).
pub fn distance_bound_cycles(
    program: &WaferProgram,
    module: &Module,
    position: u32,
    expert_runs: impl Fn(u32, u32) -> bool,
) -> u64 {
    distance_bound_ends(program, module, position, expert_runs).into_iter().max().unwrap_or(0).max(1)
}

/// Per instruction (by value index), the earliest cycle at which it can end by distance alone:
/// the chain [`distance_bound_cycles`] takes the longest of. An instruction the step does not run
/// (an unchosen expert's) ends when its operands do.
pub fn distance_bound_ends(
    program: &WaferProgram,
    module: &Module,
    position: u32,
    expert_runs: impl Fn(u32, u32) -> bool,
) -> Vec<u64> {
    let mut senders = active_attention_sources(program, position);
    senders.extend(chosen_expert_senders(program, module, &expert_runs));
    let pes = compute_pes_by_instr(program);
    let leads = dispatch_leads(program, module, &pes);
    let reader_leads = reader_leads(program, module, &pes);
    let mut own = vec![0u64; program.instrs.len()];
    // Of which the `Deliver` steps': a reader in place does not wait for them.
    let mut delivering = vec![0u64; program.instrs.len()];
    for step in &program.schedule {
        let span = step
            .routes
            .iter()
            .filter_map(|&id| program.routes.get(id as usize))
            .map(|route| route_span(program, route, senders.get(&route.id)))
            .max();
        own[step.instr as usize] += span.unwrap_or(0);
        if step.phase == Phase::Deliver {
            delivering[step.instr as usize] += span.unwrap_or(0);
        }
    }
    let in_place = super::arrival::in_place_readers(program, module, &pes);
    let source = super::arrival::producers(module);
    let runs = |i: usize| match (&module.body[Handle::new(i)].op, program.instrs.get(i)) {
        (Op::ExpertDispatch { .. }, _) => true,
        (_, Some(placement)) => match (placement.layer, placement.expert) {
            (Some(layer), Some(expert)) => expert_runs(layer, expert),
            _ => true,
        },
        (_, None) => true,
    };
    // Each instruction starts no earlier than its operands end: the longest path through the
    // dependency graph. An expert's own PEs have its inputs their leads before the multicasts
    // end. A placed program's module is verified, so it has no cycle; a cycle would leave no
    // bound but the trivial one.
    // A reader in place starts when its producer's steps before the `Deliver` end.
    let early_start = |i: usize, end: &[u64]| match &module.body[Handle::new(i)].op {
        Op::ExpertDispatch { x, routing, .. } => {
            let (x_lead, routing_lead) = leads.get(&(i as u32)).copied().unwrap_or((0, 0));
            Some(end[x.index()].saturating_sub(x_lead).max(end[routing.index()].saturating_sub(routing_lead)))
        }
        op => {
            let operands = op.operands();
            let in_place = |o: &crate::Value| in_place[i].contains(&(source[o.index()] as InstrIndex));
            let lead =
                |o: &crate::Value| reader_leads.get(&(i as InstrIndex, source[o.index()] as InstrIndex)).copied();
            operands.iter().any(|o| in_place(o) || lead(o).is_some()).then(|| {
                let ready = |o: &crate::Value| match (in_place(o), lead(o)) {
                    (true, _) => end[source[o.index()]].saturating_sub(delivering[source[o.index()]]),
                    (false, Some(lead)) => end[source[o.index()]].saturating_sub(lead),
                    (false, None) => end[o.index()],
                };
                operands.iter().map(ready).max().unwrap_or(0)
            })
        }
    };
    DependencyGraph::new(module)
        .longest_path_ends_with(|i| if runs(i) { own.get(i).copied().unwrap_or(0) } else { 0 }, early_start)
        .unwrap_or_else(|_| vec![0; program.instrs.len()])
}

/// Which sources of a route send in a step, where not all do.
enum Senders {
    /// The first `n` (attention's reductions over KV blocks, in position order; none: the score
    /// sums of a block holding no position yet).
    Leading(usize),
    /// These PEs (an MoE combine's gathers: the chosen experts' result segments).
    Only(Vec<Pe>),
}

/// Attention's reductions over KV blocks at `position`: how many leading sources (blocks, in
/// position order) hold a position and so send.
fn active_attention_sources(program: &WaferProgram, position: u32) -> HashMap<RouteId, Senders> {
    let mut active = HashMap::default();
    for placement in &program.instrs {
        let Work::Attention(attention) = &placement.work else { continue };
        for head in &attention.kv_heads_placed {
            let holding = head.blocks.iter().take_while(|b| b.first_row() <= position).count().max(1);
            for id in [head.max_reduce, head.sum_reduce, head.out_reduce].into_iter().flatten() {
                active.insert(id, Senders::Leading(holding));
            }
            // A block holding no position yet sums no scores across its slices.
            let empty = head.blocks.iter().zip(head.score_reduce.iter().zip(&head.score_broadcast));
            for (_, (&sum, &broadcast)) in empty.filter(|(b, _)| b.first_row() > position) {
                active.insert(sum, Senders::Leading(0));
                active.insert(broadcast, Senders::Leading(0));
            }
        }
    }
    active
}

/// Each MoE combine's gathers: the PEs holding the chosen experts' result elements that the
/// gather's segment covers (unchosen experts send nothing).
fn chosen_expert_senders(
    program: &WaferProgram,
    module: &Module,
    expert_runs: &impl Fn(u32, u32) -> bool,
) -> HashMap<RouteId, Senders> {
    let mut senders = HashMap::default();
    for (handle, instr) in module.body.iter() {
        let (Op::ExpertCombine { experts, .. }, Some(layer)) = (&instr.op, instr.layer) else { continue };
        let Some(Work::Combine { collects, .. }) = program.instrs.get(handle.index()).map(|p| &p.work) else {
            continue;
        };
        for &id in collects {
            let Some(RouteKind::Collect { elements }) = program.routes.get(id as usize).map(|r| &r.kind) else {
                continue;
            };
            let mut pes = Vec::new();
            for (expert, value) in experts.iter().enumerate() {
                let Some(ResultLayout::Vector(layout)) = program.instrs.get(value.index()).map(|p| &p.result) else {
                    continue;
                };
                if expert_runs(layer, expert as u32) {
                    pes.extend(layout.overlapping(elements.clone()).map(|(segment, _)| segment.pe));
                }
            }
            senders.insert(id, Senders::Only(pes));
        }
    }
    senders
}

/// Cycles from a route's sources to its farthest destination, distance only; a reduction or a
/// gather counts only its sending sources when given.
fn route_span(program: &WaferProgram, route: &Route, senders: Option<&Senders>) -> u64 {
    if let Some(Senders::Leading(0)) = senders {
        return 0;
    }
    match route.kind {
        // Many sources into one destination: the farthest sending source's distance.
        RouteKind::Reduce { .. } | RouteKind::Collect { .. } | RouteKind::Gather { .. } => {
            let Some(&destination) = route.destinations.first() else { return 0 };
            let distance = |&source: &Pe| pe_distance(program, source, destination);
            match senders {
                Some(Senders::Only(pes)) => pes.iter().map(distance).max(),
                Some(Senders::Leading(n)) => route.sources.iter().take(*n).map(distance).max(),
                None => route.sources.iter().map(distance).max(),
            }
            .unwrap_or(0)
        }
        // One source, a multicast: depth along the path to the farthest PE reached.
        RouteKind::Operand { .. } | RouteKind::Statistic { .. } | RouteKind::Routing => {
            multicast_depths(&program.target, route).map_or(0, |(full, _)| full)
        }
    }
}

/// Cycles between two PEs by distance alone: Manhattan hops on one wafer; across wafers, to the
/// west edge (where traffic leaves a wafer, on any row), the inter-wafer hops, and from the
/// next wafer's west edge.
fn pe_distance(program: &WaferProgram, from: Pe, to: Pe) -> u64 {
    let params = &program.target;
    let hop = params.hop_latency_cycles as u64;
    match from.distance(to) {
        Some(hops) => hops as u64 * hop,
        None => {
            let wafers = (from.wafer as i64 - to.wafer as i64).unsigned_abs();
            (from.x as u64 + to.x as u64) * hop + wafers * params.inter_wafer_latency_cycles
        }
    }
}
