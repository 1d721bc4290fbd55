//! When an MoE expert's inputs reach it. The layer's normed input and the router's decision
//! are multicast to every expert's PEs; a multicast's cost is its latency to the farthest PE it
//! reaches, but an expert near the source has its copy earlier. Per `expert_dispatch`, the
//! *lead* of each input is how many cycles before the multicast's end its farthest PE of that
//! expert receives it (the route's latency minus that PE's depth along the route's path), so a
//! chosen expert starts when its own inputs have arrived: placement nearer the dispatch point
//! shows in the modeled time. The timing model (`runtime::executor`) and the distance bound
//! ([`super::distance_bound_cycles`]) take the leads from here, so the bound subtracts exactly
//! what the model does.

use rustc_hash::FxHashMap as HashMap;

use super::{InstrIndex, InstrPlacement, Pe, ResultLayout, Route, RouteId, TargetParams, WaferProgram, Work};
use crate::module::Module;
use crate::op::Op;

/// Per `expert_dispatch` instruction: `(lead of x, lead of the routing)` in cycles.
pub fn dispatch_leads(program: &WaferProgram, module: &Module) -> HashMap<InstrIndex, (u64, u64)> {
    // The instruction whose deliveries carry each value (`expert_dispatch` and `slice` alias
    // their `x`).
    let mut alias: Vec<usize> = Vec::with_capacity(module.body.len());
    for (handle, instr) in module.body.iter() {
        alias.push(match &instr.op {
            Op::ExpertDispatch { x, .. } | Op::Slice { x, .. } => alias[x.index()],
            _ => handle.index(),
        });
    }
    // The PEs of each (layer, expert).
    let mut expert_pes: HashMap<(Option<u32>, u32), Vec<Pe>> = HashMap::default();
    for placement in &program.instrs {
        if let Some(expert) = placement.expert {
            expert_pes.entry((placement.layer, expert)).or_default().extend(placement.compute_pes());
        }
    }
    let mut depths: HashMap<RouteId, Option<Depths>> = HashMap::default();
    let mut lead = |id: RouteId, pes: &[Pe]| -> Option<u64> {
        let route = program.routes.get(id as usize)?;
        let (full, depth) =
            depths.entry(id).or_insert_with(|| multicast_depths(&program.target, route).ok()).as_ref()?;
        let farthest = pes.iter().filter_map(|pe| depth.get(pe)).max()?;
        Some(full.saturating_sub(*farthest))
    };
    let mut leads = HashMap::default();
    for placement in &program.instrs {
        let (Work::Dispatch { routing }, Some(expert)) = (&placement.work, placement.expert) else {
            continue;
        };
        let Some(pes) = expert_pes.get(&(placement.layer, expert)) else { continue };
        let Some(&x) = alias.get(placement.instr as usize) else { continue };
        let Some(producer) = program.instrs.get(x) else { continue };
        let x_lead = producer.deliveries.iter().filter_map(|&id| lead(id, pes)).min().unwrap_or(0);
        let routing_lead = lead(*routing, pes).unwrap_or(0);
        leads.insert(placement.instr, (x_lead, routing_lead));
    }
    leads
}

/// Per reader (by value index), the producers it reads in place: those whose deliveries (the
/// routes of their `Deliver` step) it takes no part in. No delivery starts or ends on a PE of
/// the reader, so the part
/// of the result it reads already lies on its PEs when the producer's steps before the
/// `Deliver` end, and its PEs are idle during the `Deliver`. The timing model starts such a
/// reader then, and the distance bound ([`super::distance_bound_ends`]) likewise. Producers are
/// followed through slices; readers that compute nothing (`expert_dispatch`, `slice`) and
/// replicated experts' instructions (whose copies get inputs on routes of their own) are left
/// out.
pub fn in_place_readers(program: &WaferProgram, module: &Module) -> Vec<Vec<InstrIndex>> {
    let source = producers(module);
    let replicated = super::replica_slots(program);
    let mut in_place = vec![Vec::new(); module.body.len()];
    for (handle, instr) in module.body.iter() {
        let reader = handle.index();
        let Some(placement) = program.instrs.get(reader) else { continue };
        if replicated.get(reader).is_some_and(Option::is_some) {
            continue;
        }
        // Sorted.
        let pes = placement.compute_pes();
        if pes.is_empty() {
            continue;
        }
        for operand in instr.op.operands() {
            let producer = source[operand.index()];
            let Some(made) = program.instrs.get(producer) else { continue };
            if made.deliveries.is_empty() || replicated.get(producer).is_some_and(Option::is_some) {
                continue;
            }
            let touches =
                made.deliveries.iter().filter_map(|&id| program.routes.get(id as usize)).any(|route| {
                    route.sources.iter().chain(&route.destinations).any(|pe| pes.binary_search(pe).is_ok())
                });
            if !touches && !in_place[reader].contains(&(producer as InstrIndex)) {
                in_place[reader].push(producer as InstrIndex);
            }
        }
    }
    in_place
}

/// Per value, the instruction whose result holds it: itself, or a slice's `x`'s (through
/// slices).
pub(crate) fn producers(module: &Module) -> Vec<usize> {
    let mut source: Vec<usize> = Vec::with_capacity(module.body.len());
    for (handle, instr) in module.body.iter() {
        source.push(match &instr.op {
            Op::Slice { x, .. } => source[x.index()],
            _ => handle.index(),
        });
    }
    source
}

/// A multicast's latency and the cycle its message reaches each PE (see [`multicast_depths`]).
pub type Depths = (u64, HashMap<Pe, u64>);

/// The cycles at which a multicast's message reaches each PE its path passes (from its sources,
/// hop by hop; an inter-wafer run costs the inter-wafer latency), and the largest of them: the
/// timing model's route latency. `Err(index)`: run `index` starts at a PE that no source or
/// earlier run reaches.
pub fn multicast_depths(params: &TargetParams, route: &Route) -> Result<Depths, usize> {
    // Sized at once for every PE the path visits (it grows to about that), so it never rehashes.
    let visits = route.sources.len() + route.path.iter().map(|run| run.hops().len()).sum::<usize>();
    let mut depth: HashMap<Pe, u64> = HashMap::with_capacity_and_hasher(visits, Default::default());
    depth.extend(route.sources.iter().map(|&pe| (pe, 0)));
    let mut full = 0;
    for (index, run) in route.path.iter().enumerate() {
        let Some(&start) = depth.get(&run.from) else { return Err(index) };
        if run.is_inter_wafer() {
            let end = start + params.inter_wafer_latency_cycles;
            depth.entry(run.to).and_modify(|d| *d = (*d).min(end)).or_insert(end);
            full = full.max(end);
        } else {
            for (k, pe) in run.pes().into_iter().enumerate().skip(1) {
                let end = start + k as u64 * params.hop_latency_cycles as u64;
                depth.entry(pe).and_modify(|d| *d = (*d).min(end)).or_insert(end);
                full = full.max(end);
            }
        }
    }
    Ok((full, depth))
}

impl InstrPlacement {
    /// The PEs that compute this instruction (its result segments, and its tiles, table blocks
    /// or KV blocks), sorted, deduplicated; none for `expert_dispatch` and `slice`, which only
    /// alias their input.
    pub fn compute_pes(&self) -> Vec<Pe> {
        let mut pes: Vec<Pe> = match &self.result {
            ResultLayout::Vector(layout) => layout.segments.iter().map(|s| s.pe).collect(),
            ResultLayout::Routing { pe } => vec![*pe],
        };
        match &self.work {
            Work::Embed { blocks, .. } => pes.extend(blocks.iter().map(|b| b.pe)),
            Work::MatVec(p) => pes.extend(p.tiles.iter().map(|t| t.pe)),
            Work::Attention(p) => pes.extend(p.kv_heads_placed.iter().flat_map(|kh| kh.blocks.iter().map(|b| b.pe))),
            Work::Dispatch { .. } | Work::Slice => pes.clear(),
            Work::Elementwise | Work::RmsNorm(_) | Work::Router { .. } | Work::Combine { .. } => {}
        }
        pes.sort_unstable();
        pes.dedup();
        pes
    }
}
