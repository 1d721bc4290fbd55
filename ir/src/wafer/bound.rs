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
//! only the blocks holding positions; an unchosen expert's instructions take no time.

use std::collections::HashMap;

use super::{Pe, Route, RouteId, RouteKind, WaferProgram, Work};
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
    let active = active_attention_sources(program, position);
    let mut own = vec![0u64; program.instrs.len()];
    for step in &program.schedule {
        let span = step
            .routes
            .iter()
            .filter_map(|&id| program.routes.get(id as usize))
            .map(|route| route_span(program, route, active.get(&route.id).copied()))
            .max();
        own[step.instr as usize] += span.unwrap_or(0);
    }
    let runs = |i: usize| match (&module.body[Handle::new(i)].op, program.instrs.get(i)) {
        (Op::ExpertDispatch { .. }, _) => true,
        (_, Some(placement)) => match (placement.layer, placement.expert) {
            (Some(layer), Some(expert)) => expert_runs(layer, expert),
            _ => true,
        },
        (_, None) => true,
    };
    // Each instruction starts no earlier than its operands end: the longest path through the
    // dependency graph. A placed program's module is verified, so it has no cycle; a cycle
    // would leave no bound but the trivial one.
    let end = DependencyGraph::new(module)
        .longest_path_ends(|i| if runs(i) { own.get(i).copied().unwrap_or(0) } else { 0 })
        .unwrap_or_default();
    end.iter().copied().max().unwrap_or(0).max(1)
}

/// Attention's reductions over KV blocks at `position`: how many leading sources (blocks, in
/// position order) hold a position and so send.
fn active_attention_sources(program: &WaferProgram, position: u32) -> HashMap<RouteId, usize> {
    let mut active = HashMap::new();
    for placement in &program.instrs {
        let Work::Attention(attention) = &placement.work else { continue };
        for head in &attention.kv_heads_placed {
            let holding = head.blocks.iter().take_while(|b| b.positions.start <= position).count().max(1);
            for id in [head.max_reduce, head.sum_reduce, head.out_reduce].into_iter().flatten() {
                active.insert(id, holding);
            }
        }
    }
    active
}

/// Cycles from a route's sources to its farthest destination, distance only; a reduction counts
/// only its first `active` sources when given.
fn route_span(program: &WaferProgram, route: &Route, active: Option<usize>) -> u64 {
    let params = &program.target;
    let hop = params.hop_latency_cycles as u64;
    match route.kind {
        // Many sources into one destination: the farthest sending source's distance.
        RouteKind::Reduce { .. } | RouteKind::Collect { .. } => {
            let Some(&destination) = route.destinations.first() else { return 0 };
            let sending = active.unwrap_or(route.sources.len());
            route
                .sources
                .iter()
                .take(sending)
                .map(|&source| pe_distance(program, source, destination))
                .max()
                .unwrap_or(0)
        }
        // One source, a multicast: depth along the path to the farthest PE reached.
        RouteKind::Operand { .. } | RouteKind::Statistic { .. } | RouteKind::Routing => {
            let mut depth: HashMap<Pe, u64> = route.sources.iter().map(|&pe| (pe, 0)).collect();
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
