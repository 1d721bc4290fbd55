//! When a reader's inputs reach it. A multicast's cost is its latency to the farthest PE it
//! reaches, but a reader near the source has its copy earlier. The *lead* of an input is how
//! many cycles before the multicast's end the reader's farthest PE receives it (the route's
//! latency minus that PE's depth along the route's path), so a reader starts when its own
//! inputs have arrived, and placement nearer the source shows in the modeled time: per
//! `expert_dispatch`, over the expert's PEs, for the layer's normed input and the router's
//! decision, which are multicast to every expert ([`dispatch_leads`]); per other reader and
//! producer, over the reader's PEs ([`reader_leads`]: the router beside the norm that feeds every
//! lane). The timing model (`runtime::executor`) and the distance bound
//! ([`super::distance_bound_cycles`]) take the leads from here, so the bound subtracts exactly
//! what the model does.

use rustc_hash::FxHashMap as HashMap;

use super::{InstrIndex, InstrPlacement, Pe, PeGrid, ResultLayout, Route, RouteId, TargetParams, WaferProgram, Work};
use crate::module::Module;
use crate::op::Op;

/// Every instruction's [`InstrPlacement::compute_pes`], by instruction index. The analyses here
/// take it from their caller, which builds it once: a matvec's list has a PE per tile (about
/// 100,000 on the 8B), sorted, and the executor built it three times.
pub fn compute_pes_by_instr(program: &WaferProgram) -> Vec<Vec<Pe>> {
    program.instrs.iter().map(InstrPlacement::compute_pes).collect()
}

/// Per `expert_dispatch` instruction: `(lead of x, lead of the routing)` in cycles. `pes` is
/// [`compute_pes_by_instr`].
pub fn dispatch_leads(program: &WaferProgram, module: &Module, pes: &[Vec<Pe>]) -> HashMap<InstrIndex, (u64, u64)> {
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
    for (placement, its_pes) in program.instrs.iter().zip(pes) {
        if let Some(expert) = placement.expert {
            expert_pes.entry((placement.layer, expert)).or_default().extend_from_slice(its_pes);
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

/// Per reader and producer `(reader, producer)` (value indices; producers followed through
/// slices), how many cycles before the producer's `Deliver` ends the reader's own PEs have the
/// whole of its result they read: over the producer's deliveries that reach a PE of the reader,
/// the least of each one's latency minus the depth of the reader's farthest PE along it
/// ([`multicast_depths`]). A reader near the source (an MoE router beside the norm that feeds
/// every lane) starts while the multicasts still travel to readers farther out. Only pairs
/// with a lead are listed. Expert instructions are left out (their `expert_dispatch` has its
/// own leads, [`dispatch_leads`]), as are replicated experts' copies, whose inputs come on
/// routes of their own. `pes` is [`compute_pes_by_instr`].
///
/// The lead never makes a reader start before its copy arrives: a delivery's message reaches a
/// PE at depth `d` its latency minus `d` before the delivery ends, and every other delivery
/// that reaches the reader ends no later than the last.
pub fn reader_leads(
    program: &WaferProgram,
    module: &Module,
    pes: &[Vec<Pe>],
) -> HashMap<(InstrIndex, InstrIndex), u64> {
    let replicated = super::replica_slots(program);
    // Readers through slices, expert instructions left out.
    let readers: Vec<Vec<usize>> = crate::dependency::DataReaders::new(module)
        .readers
        .into_iter()
        .map(|list| {
            let in_expert = |r: usize| program.instrs.get(r).is_none_or(|p| p.expert.is_some());
            list.into_iter().map(|r| r as usize).filter(|&r| !in_expert(r)).collect()
        })
        .collect();
    // Membership of the reader's PEs by dense grid index: a delivery's path is checked PE by PE,
    // and a matvec reader has a PE per tile.
    let grid = PeGrid::of(&program.target);
    let mut marked = vec![false; grid.len()];
    let mut depths = DepthGrid::new(&program.target);
    let mut leads = HashMap::default();
    for (producer, its_readers) in readers.iter().enumerate() {
        let Some(made) = program.instrs.get(producer) else { continue };
        if its_readers.is_empty() || made.deliveries.is_empty() || replicated.get(producer).is_some_and(Option::is_some)
        {
            continue;
        }
        // Per delivery, its latency and the depth of each grid PE its path reaches.
        let reached: Vec<(u64, Vec<(usize, u64)>)> = made
            .deliveries
            .iter()
            .filter_map(|&id| program.routes.get(id as usize))
            .filter_map(|route| depths.reached(&program.target, route))
            .collect();
        // Per reader, the least lead over the deliveries reaching it.
        let mut least: Vec<Option<u64>> = vec![None; its_readers.len()];
        for (&reader, least) in its_readers.iter().zip(&mut least) {
            let on: Vec<usize> =
                pes.get(reader).map_or_else(Vec::new, |p| p.iter().filter_map(|&pe| grid.index(pe)).collect());
            on.iter().for_each(|&i| marked[i] = true);
            for (full, depth) in &reached {
                if let Some(farthest) = depth.iter().filter(|(i, _)| marked[*i]).map(|&(_, d)| d).max() {
                    let lead = full.saturating_sub(farthest);
                    *least = Some(least.map_or(lead, |l| l.min(lead)));
                }
            }
            on.iter().for_each(|&i| marked[i] = false);
        }
        for (&reader, lead) in its_readers.iter().zip(least) {
            if let Some(lead) = lead.filter(|&l| l > 0) {
                leads.insert((reader as InstrIndex, producer as InstrIndex), lead);
            }
        }
    }
    leads
}

/// [`multicast_depths`] on a dense grid: one array for many routes and a list of the PEs each
/// set, instead of a hash map per route (one entry per PE of its path). [`reader_leads`] walks
/// every delivery with one, and the timing model every route's latency.
pub struct DepthGrid {
    grid: PeGrid,
    /// Per grid PE, the cycle the message reaches it (`u64::MAX`: not yet).
    depth: Vec<u64>,
    /// The grid PEs set so far, each once.
    touched: Vec<usize>,
    /// PEs off the grid (none in a checked program) that a run may still start from.
    outside: HashMap<Pe, u64>,
}

impl DepthGrid {
    pub fn new(params: &TargetParams) -> DepthGrid {
        let grid = PeGrid::of(params);
        DepthGrid { grid, depth: vec![u64::MAX; grid.len()], touched: Vec::new(), outside: HashMap::default() }
    }

    /// `route`'s latency, as [`multicast_depths`] gives it (`Err(index)` likewise).
    pub fn latency(&mut self, params: &TargetParams, route: &Route) -> Result<u64, usize> {
        let latency = walk_multicast(params, route, self);
        self.clear();
        latency
    }

    /// `route`'s latency and the depth of each grid PE its path reaches (by grid index), as
    /// [`multicast_depths`] gives them (`None` where that fails), in the order first reached.
    fn reached(&mut self, params: &TargetParams, route: &Route) -> Option<(u64, Vec<(usize, u64)>)> {
        let reached = walk_multicast(params, route, self)
            .ok()
            .map(|full| (full, self.touched.iter().map(|&i| (i, self.depth[i])).collect()));
        self.clear();
        reached
    }

    fn clear(&mut self) {
        for &i in &self.touched {
            self.depth[i] = u64::MAX;
        }
        self.touched.clear();
        self.outside.clear();
    }
}

impl Arrivals for DepthGrid {
    fn arrival(&self, pe: Pe) -> Option<u64> {
        match self.grid.index(pe) {
            Some(i) => Some(self.depth[i]).filter(|&d| d != u64::MAX),
            None => self.outside.arrival(pe),
        }
    }

    fn reach(&mut self, pe: Pe, cycle: u64) {
        match self.grid.index(pe) {
            Some(i) => {
                if self.depth[i] == u64::MAX {
                    self.touched.push(i);
                }
                self.depth[i] = self.depth[i].min(cycle);
            }
            None => self.outside.reach(pe, cycle),
        }
    }
}

/// Per reader (by value index), the producers it reads in place: those whose deliveries (the
/// routes of their `Deliver` step) it takes no part in. No delivery starts or ends on a PE of
/// the reader, so the part
/// of the result it reads already lies on its PEs when the producer's steps before the
/// `Deliver` end, and its PEs are idle during the `Deliver`. The timing model starts such a
/// reader then, and the distance bound ([`super::distance_bound_ends`]) likewise. Producers are
/// followed through slices; readers that compute nothing (`expert_dispatch`, `slice`) and
/// replicated experts' instructions (whose copies get inputs on routes of their own) are left
/// out. `pes` is [`compute_pes_by_instr`].
pub fn in_place_readers(program: &WaferProgram, module: &Module, pes: &[Vec<Pe>]) -> Vec<Vec<InstrIndex>> {
    let source = producers(module);
    let replicated = super::replica_slots(program);
    let mut in_place = vec![Vec::new(); module.body.len()];
    for (handle, instr) in module.body.iter() {
        let reader = handle.index();
        let Some(pes) = pes.get(reader) else { continue };
        if replicated.get(reader).is_some_and(Option::is_some) {
            continue;
        }
        // Sorted.
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
    let full = walk_multicast(params, route, &mut depth)?;
    Ok((full, depth))
}

/// Where a multicast's walk ([`walk_multicast`]) keeps the cycle its message reaches each PE: a
/// map for one route ([`multicast_depths`]), a dense grid for many ([`DepthGrid`]).
trait Arrivals {
    /// When the message reaches `pe`, if it does yet.
    fn arrival(&self, pe: Pe) -> Option<u64>;
    /// Lowers `pe`'s arrival to `cycle` (sets it where it had none).
    fn reach(&mut self, pe: Pe, cycle: u64);
}

impl Arrivals for HashMap<Pe, u64> {
    fn arrival(&self, pe: Pe) -> Option<u64> {
        self.get(&pe).copied()
    }

    fn reach(&mut self, pe: Pe, cycle: u64) {
        self.entry(pe).and_modify(|d| *d = (*d).min(cycle)).or_insert(cycle);
    }
}

/// Walks `route`'s path from its sources, recording each PE's arrival in `arrivals`, and returns
/// the latest: the route's latency (see [`multicast_depths`]).
fn walk_multicast(params: &TargetParams, route: &Route, arrivals: &mut impl Arrivals) -> Result<u64, usize> {
    route.sources.iter().for_each(|&pe| arrivals.reach(pe, 0));
    let mut full = 0;
    for (index, run) in route.path.iter().enumerate() {
        let Some(start) = arrivals.arrival(run.from) else { return Err(index) };
        if run.is_inter_wafer() {
            let end = start + params.inter_wafer_latency_cycles;
            arrivals.reach(run.to, end);
            full = full.max(end);
        } else {
            for (k, (_, pe)) in run.hops().enumerate() {
                let end = start + (k as u64 + 1) * params.hop_latency_cycles as u64;
                arrivals.reach(pe, end);
                full = full.max(end);
            }
        }
    }
    Ok(full)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wafer::{RouteKind, Run};

    fn params() -> TargetParams {
        TargetParams {
            name: "grid:8x8, two wafers".into(),
            grid_cols: 8,
            grid_rows: 8,
            wafers: 2,
            sram_bytes_per_pe: 48 * 1024,
            code_reserve_bytes: 0,
            clock_hz: 1e9,
            link_bytes_per_cycle: 4,
            hop_latency_cycles: 2,
            colours_per_pe: 24,
            f32_fma_per_cycle: 1.0,
            inter_wafer_latency_cycles: 50,
            inter_wafer_bytes_per_cycle: 1.0,
        }
    }

    fn multicast(sources: Vec<Pe>, runs: &[(Pe, Pe)]) -> Route {
        Route {
            id: 0,
            instr: 0,
            kind: RouteKind::Operand { value: 0, elements: 0..1 },
            colour: 0,
            sources,
            destinations: Vec::new(),
            path: runs.iter().map(|&(from, to)| Run { from, to, messages: 1 }).collect(),
            message_bytes: 4,
        }
    }

    /// The dense grid holds what `multicast_depths`' map does, latency and depths: a PE reached
    /// twice keeps the earlier arrival, an inter-wafer run costs its latency, and a run from a PE
    /// nothing reached fails at its index.
    #[test]
    fn the_dense_depth_walk_agrees_with_multicast_depths() {
        let p = params();
        let pe = Pe::new;
        let cases = [
            // (5, 3) and (5, 4) are reached again the long way round.
            multicast(
                vec![pe(0, 0, 0)],
                &[
                    (pe(0, 0, 0), pe(0, 5, 0)),
                    (pe(0, 5, 0), pe(0, 5, 4)),
                    (pe(0, 0, 0), pe(0, 0, 6)),
                    (pe(0, 0, 6), pe(0, 5, 6)),
                    (pe(0, 5, 6), pe(0, 5, 3)),
                    (pe(0, 5, 4), pe(1, 5, 4)),
                    (pe(1, 5, 4), pe(1, 7, 4)),
                ],
            ),
            // Two sources whose paths meet: the nearer one's arrival counts.
            multicast(vec![pe(0, 1, 1), pe(0, 6, 6)], &[(pe(0, 1, 1), pe(0, 6, 1)), (pe(0, 6, 6), pe(0, 6, 1))]),
            multicast(vec![pe(0, 0, 0)], &[(pe(0, 0, 0), pe(0, 2, 0)), (pe(0, 4, 4), pe(0, 4, 6))]),
        ];
        let (mut depths, grid) = (DepthGrid::new(&p), PeGrid::of(&p));
        for route in &cases {
            let expected = multicast_depths(&p, route);
            assert_eq!(depths.latency(&p, route), expected.as_ref().map(|(latency, _)| *latency).map_err(|&i| i));
            match (expected, depths.reached(&p, route)) {
                (Ok((full, want)), Some((latency, got))) => {
                    assert_eq!(latency, full);
                    let mut got: Vec<(Pe, u64)> = got.into_iter().map(|(i, d)| (grid.pe(i), d)).collect();
                    let mut want: Vec<(Pe, u64)> = want.into_iter().collect();
                    got.sort_unstable();
                    want.sort_unstable();
                    assert_eq!(got, want);
                }
                (Err(index), None) => assert_eq!(index, 1),
                (expected, reached) => panic!("multicast_depths gave {expected:?}, the dense walk {reached:?}"),
            }
        }
    }
}
