//! Extraction: which equivalent form of each e-class the rewritten block uses, chosen by what
//! it costs on the wafer under the plan the module will be lowered with ([`PlanKind`]).
//!
//! The cost of a block is the sum, over the distinct computations it keeps (a DAG, not a tree:
//! a fused matvec read by three slices is paid once), of each computation's own cost, in units
//! of one route (one colour on the links it crosses). What a form needs depends on how the plan
//! lays matvecs out.
//!
//! Under the stacked plan every matvec of a region is tiled over all of the region's PEs, so
//! matvecs run one after another:
//!
//! - a `matvec`: [`MATVEC_STEP`] for its place in the schedule (its activation multicast,
//!   compute, reduction and collect phases each wait for their slowest route, so a matvec costs
//!   several routes' latency however small it is), plus one collect route per result segment
//!   of [`SEGMENT`] elements;
//! - a `slice`: nothing when both of its ends fall on result segment boundaries (its consumers
//!   read whole segments of the fused result, so no data moves), one route otherwise (the
//!   segment holding a boundary is multicast to both sides' consumers: more link bytes);
//!
//! so fusing `n` matvecs saves `n - 1` schedule steps.
//!
//! Under the tiled plan (and MeshGEMV's, which places the same way) every matvec has PEs of its
//! own, and matvecs that read one input run side by side: fused or not, they take one step of
//! the block's critical path, so no step is charged (it is the same in every form):
//!
//! - a `matvec`: one collect route per result segment;
//! - a `slice`: [`TILED_SLICE_DELIVERY`]. The tiled placer puts a vector op on its operand's PEs
//!   only when the operand is a whole result of the op's length (`wafer::place`,
//!   `host_layout`), so every reader of a slice sits on PEs of its own and the fused result is
//!   multicast to them in a delivery phase after its collect. Unfused, each result is collected
//!   straight onto the PEs of the op that reads it. (SmolLM2 on wse3, layer 1: the fused q|k|v
//!   reaches the rope 1.29 us later than the unfused q, the fused gate|up reaches SiLU 3.19 us
//!   later: 883 modeled tok/s fused against 950 unfused.)
//!
//! so fusing there only adds deliveries and is declined.
//!
//! Every other op costs [`OTHER_OP`] under both (the same in every form, so it only makes dead
//! code cost).
//!
//! The search: egg's tree extractor with a slice charged its share (`len / rows`) of the matvec
//! it reads gives a first choice, in which the slices of one fusion agree; then, until nothing
//! improves, any change that lowers the DAG cost is taken: another node for one class, in id
//! order (this undoes a fusion only one side of which paid off), then, fused value by fused
//! value, all of its slices taken or undone together (one class at a time cannot undo a fusion
//! that does not pay as a whole: while one slice stays, the fused matvec stays too).

use std::collections::BTreeMap;

use egg::{CostFunction, EGraph, Extractor, Id, Language};

use super::lang::{BlockAnalysis, BlockLang, Facts};
use super::PlanKind;

/// Result segment length the placer uses for large vectors (elements); slices aligned to it
/// alias whole segments.
pub const SEGMENT: u32 = 1024;
/// A matvec's schedule phases (multicast in, compute, reduce, collect), in route units.
pub const MATVEC_STEP: f64 = 8.0;
/// Any other computation.
pub const OTHER_OP: f64 = 1.0;
/// A slice under the tiled plan: the route delivering its part of the fused result to its
/// readers, and the phase that adds after the collect (one route's latency each).
pub const TILED_SLICE_DELIVERY: f64 = 2.0;

/// The cost of `node` itself under `plan`, children not included.
pub fn own_cost(egraph: &EGraph<BlockLang, BlockAnalysis>, node: &BlockLang, plan: PlanKind) -> f64 {
    match node {
        BlockLang::MatVec([_, _, _]) => {
            let rows = match egraph[node.children()[0]].data {
                Facts::Weights { rows, .. } => rows,
                _ => 0,
            };
            let collects = rows.div_ceil(SEGMENT).max(1) as f64;
            match plan {
                PlanKind::Stacked => MATVEC_STEP + collects,
                PlanKind::Tiled => collects,
            }
        }
        BlockLang::Slice(_) if plan == PlanKind::Tiled => TILED_SLICE_DELIVERY,
        BlockLang::Slice([offset, len, x]) => {
            let get = |id: &Id| match egraph[*id].data {
                Facts::Num(n) => Some(n),
                _ => None,
            };
            let total = match egraph[*x].data {
                Facts::Value { len } => len,
                _ => None,
            };
            let (Some(offset), Some(len)) = (get(offset), get(len)) else { return 1.0 };
            let end = offset + len;
            let aligned = |at: u32| at.is_multiple_of(SEGMENT) || Some(at) == total;
            // A tiny charge even when aligned, so that a slice never ties with the computation
            // it could replace.
            if aligned(offset) && aligned(end) {
                0.01
            } else {
                1.0
            }
        }
        BlockLang::Other(_, args) if !args.is_empty() => OTHER_OP,
        _ => 0.0,
    }
}

/// Tree cost with a slice charged its share of what it slices: the first guess.
struct SharedCost<'a> {
    egraph: &'a EGraph<BlockLang, BlockAnalysis>,
    plan: PlanKind,
}

impl CostFunction<BlockLang> for SharedCost<'_> {
    type Cost = f64;

    fn cost<C>(&mut self, enode: &BlockLang, mut costs: C) -> f64
    where
        C: FnMut(Id) -> f64,
    {
        let own = own_cost(self.egraph, enode, self.plan);
        match enode {
            BlockLang::Slice([_, len, x]) => {
                let share = match (&self.egraph[*len].data, &self.egraph[*x].data) {
                    (Facts::Num(len), Facts::Value { len: Some(total) }) if *total > 0 => *len as f64 / *total as f64,
                    _ => 1.0,
                };
                own + share * costs(*x)
            }
            _ => enode.fold(own, |sum, id| sum + costs(id)),
        }
    }
}

/// The chosen node of every class reachable from `roots`.
pub struct Choice {
    pub nodes: BTreeMap<Id, BlockLang>,
    pub cost: f64,
}

/// Chooses a node per class by its cost under `plan`; see the module documentation.
pub fn extract(egraph: &EGraph<BlockLang, BlockAnalysis>, roots: &[Id], plan: PlanKind) -> Choice {
    let extractor = Extractor::new(egraph, SharedCost { egraph, plan });
    let mut choice: BTreeMap<Id, BlockLang> = BTreeMap::new();
    for class in egraph.classes() {
        choice.insert(egraph.find(class.id), extractor.find_best_node(class.id).clone());
    }
    let mut best = dag_cost(egraph, &choice, roots, plan).unwrap_or(f64::INFINITY);
    let classes: Vec<Id> = choice.keys().copied().collect();
    // The slices of each class, by class: a fusion is taken or undone whole through these (one
    // class at a time cannot: while one slice of a fused matvec stays, dropping another saves
    // nothing, and the first guess, sharing the input's cost, leans to fusing).
    let mut slices_of: BTreeMap<Id, Vec<(Id, BlockLang)>> = BTreeMap::new();
    for &class in &classes {
        for node in &egraph[class].nodes {
            if let BlockLang::Slice([_, _, x]) = node {
                slices_of.entry(egraph.find(*x)).or_default().push((class, node.clone()));
            }
        }
    }
    // Applies `changes` if they lower the cost.
    let mut try_move = |choice: &mut BTreeMap<Id, BlockLang>, changes: Vec<(Id, BlockLang)>| -> bool {
        let previous: Vec<(Id, BlockLang)> = changes
            .into_iter()
            .map(|(class, node)| (class, choice.insert(class, node).expect("every class has a choice")))
            .collect();
        match dag_cost(egraph, choice, roots, plan) {
            Some(cost) if cost < best - 1e-9 => {
                best = cost;
                true
            }
            _ => {
                for (class, node) in previous.into_iter().rev() {
                    choice.insert(class, node);
                }
                false
            }
        }
    };
    // Each accepted change lowers the cost by a positive amount and there are finitely many
    // choices, so this ends; the bound only caps pathological inputs.
    for _round in 0..16 {
        let mut improved = false;
        for &class in &classes {
            let nodes = &egraph[class].nodes;
            if nodes.len() < 2 {
                continue;
            }
            for node in nodes {
                if choice.get(&class) != Some(node) {
                    improved |= try_move(&mut choice, vec![(class, node.clone())]);
                }
            }
        }
        for slices in slices_of.values() {
            // Every class that can be a slice of `source` takes that form...
            let take: Vec<(Id, BlockLang)> =
                slices.iter().filter(|(class, node)| choice.get(class) != Some(node)).cloned().collect();
            if !take.is_empty() {
                improved |= try_move(&mut choice, take);
            }
            // ... or every class that is one takes its cheapest form that is not a slice.
            let undo: Vec<(Id, BlockLang)> = slices
                .iter()
                .filter(|(class, node)| choice.get(class) == Some(node))
                .filter_map(|&(class, _)| {
                    let own = |n: &BlockLang| own_cost(egraph, n, plan);
                    let other = egraph[class]
                        .nodes
                        .iter()
                        .filter(|n| !matches!(n, BlockLang::Slice(_)))
                        .min_by(|a, b| own(a).total_cmp(&own(b)))?;
                    Some((class, other.clone()))
                })
                .collect();
            if !undo.is_empty() {
                improved |= try_move(&mut choice, undo);
            }
        }
        if !improved {
            break;
        }
    }
    let reachable = reachable(egraph, &choice, roots).unwrap_or_default();
    choice.retain(|class, _| reachable.contains(class));
    Choice { nodes: choice, cost: best }
}

/// Classes reachable from `roots` under `choice`, or `None` if the choice has a cycle.
fn reachable(
    egraph: &EGraph<BlockLang, BlockAnalysis>,
    choice: &BTreeMap<Id, BlockLang>,
    roots: &[Id],
) -> Option<std::collections::BTreeSet<Id>> {
    // Depth-first with an explicit stack; `on_path` detects a cycle.
    let mut done = std::collections::BTreeSet::new();
    let mut on_path = std::collections::BTreeSet::new();
    for &root in roots {
        let mut stack = vec![(egraph.find(root), false)];
        while let Some((class, leaving)) = stack.pop() {
            if leaving {
                on_path.remove(&class);
                done.insert(class);
                continue;
            }
            if done.contains(&class) {
                continue;
            }
            if !on_path.insert(class) {
                return None;
            }
            stack.push((class, true));
            for &child in choice.get(&class)?.children() {
                let child = egraph.find(child);
                if on_path.contains(&child) {
                    return None;
                }
                stack.push((child, false));
            }
        }
    }
    Some(done)
}

/// The DAG cost of a choice under `plan`, `None` if it has a cycle.
pub fn dag_cost(
    egraph: &EGraph<BlockLang, BlockAnalysis>,
    choice: &BTreeMap<Id, BlockLang>,
    roots: &[Id],
    plan: PlanKind,
) -> Option<f64> {
    let classes = reachable(egraph, choice, roots)?;
    Some(classes.iter().map(|class| own_cost(egraph, &choice[class], plan)).sum())
}
