//! When an MoE expert's inputs reach it. The layer's normed input and the router's decision
//! are multicast to every expert's PEs; a multicast's cost is its latency to the farthest PE it
//! reaches, but an expert near the source has its copy earlier. Per `expert_dispatch`, the
//! *lead* of each input is how many cycles before the multicast's end its farthest PE of that
//! expert receives it (the route's latency minus that PE's depth along the route's path), so a
//! chosen expert starts when its own inputs have arrived: placement nearer the dispatch point
//! shows in the modeled time.

use rustc_hash::FxHashMap as HashMap;

use waferc_ir::wafer::{InstrIndex, Pe, Route, RouteId, TargetParams, WaferProgram, Work};

/// Per `expert_dispatch` instruction: `(lead of x, lead of the routing)`.
pub(super) fn dispatch_leads(
    program: &WaferProgram,
    alias: &[InstrIndex],
    instr_pes: &[Vec<Pe>],
) -> HashMap<InstrIndex, (u64, u64)> {
    // The PEs of each (layer, expert).
    let mut expert_pes: HashMap<(Option<u32>, u32), Vec<Pe>> = HashMap::default();
    for (placement, pes) in program.instrs.iter().zip(instr_pes) {
        if let Some(expert) = placement.expert {
            expert_pes.entry((placement.layer, expert)).or_default().extend(pes);
        }
    }
    let mut depths: HashMap<RouteId, (u64, HashMap<Pe, u64>)> = HashMap::default();
    let mut lead = |id: RouteId, pes: &[Pe]| -> Option<u64> {
        let (full, depth) =
            depths.entry(id).or_insert_with(|| path_depths(&program.target, &program.routes[id as usize]));
        let farthest = pes.iter().filter_map(|pe| depth.get(pe)).max()?;
        Some(full.saturating_sub(*farthest))
    };
    let mut leads = HashMap::default();
    for placement in &program.instrs {
        let (Work::Dispatch { routing }, Some(expert)) = (&placement.work, placement.expert) else {
            continue;
        };
        let Some(pes) = expert_pes.get(&(placement.layer, expert)) else { continue };
        let x = alias[placement.instr as usize] as usize;
        let x_lead = program.instrs[x].deliveries.iter().filter_map(|&id| lead(id, pes)).min().unwrap_or(0);
        let routing_lead = lead(*routing, pes).unwrap_or(0);
        leads.insert(placement.instr, (x_lead, routing_lead));
    }
    leads
}

/// The cycles at which a route's message reaches each PE its path passes (from its sources,
/// hop by hop; an inter-wafer run costs the inter-wafer latency), and the largest of them. The
/// same walk as the timing model's route latency.
fn path_depths(params: &TargetParams, route: &Route) -> (u64, HashMap<Pe, u64>) {
    let mut depth: HashMap<Pe, u64> = route.sources.iter().map(|&pe| (pe, 0)).collect();
    let mut full = 0;
    for run in &route.path {
        let Some(&start) = depth.get(&run.from) else { continue };
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
    (full, depth)
}
