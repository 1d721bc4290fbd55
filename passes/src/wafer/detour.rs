//! Congestion-aware paths on the mesh, for routes that dimension-ordered routing cannot colour.
//!
//! The mesh of one wafer is an implicit graph ([`MeshView`]: PEs are nodes, the four neighbour
//! links are edges, PEs the caller closes are left out) read through petgraph's visit traits,
//! and a path is `petgraph::algo::astar` over it: each hop costs a base plus the colour
//! pressure of the PE it enters, so a detour goes round saturated routers, shortest first.

use std::collections::HashSet;

use petgraph::algo::astar;
use petgraph::visit::{Data, EdgeRef, GraphBase, GraphRef, IntoEdgeReferences, IntoEdges, IntoNeighbors, Visitable};
use waferc_ir::wafer::{Pe, Run};

/// Cost of one hop before pressure: pressure only breaks ties between paths of equal length
/// unless it is large (a PE with `HOP` colours in use costs as much as one more hop).
const HOP: u32 = 8;

/// One wafer's mesh as an implicit graph: PE nodes, links to the four neighbours, minus the PEs
/// `open` rejects.
#[derive(Clone, Copy)]
pub(super) struct MeshView<'a> {
    pub cols: u16,
    pub rows: u16,
    pub wafer: u16,
    pub open: &'a dyn Fn(Pe) -> bool,
}

/// A directed link between neighbouring PEs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Link {
    from: Pe,
    to: Pe,
}

impl EdgeRef for Link {
    type NodeId = Pe;
    type EdgeId = (Pe, Pe);
    type Weight = ();
    fn source(&self) -> Pe {
        self.from
    }
    fn target(&self) -> Pe {
        self.to
    }
    fn weight(&self) -> &() {
        &()
    }
    fn id(&self) -> (Pe, Pe) {
        (self.from, self.to)
    }
}

impl GraphBase for MeshView<'_> {
    type NodeId = Pe;
    type EdgeId = (Pe, Pe);
}

impl GraphRef for MeshView<'_> {}

impl Data for MeshView<'_> {
    type NodeWeight = ();
    type EdgeWeight = ();
}

impl Visitable for MeshView<'_> {
    type Map = HashSet<Pe>;
    fn visit_map(&self) -> HashSet<Pe> {
        HashSet::new()
    }
    fn reset_map(&self, map: &mut HashSet<Pe>) {
        map.clear();
    }
}

impl MeshView<'_> {
    /// The open neighbours of `pe`, east, west, south, north (a fixed order: deterministic).
    fn open_neighbours(&self, pe: Pe) -> Vec<Pe> {
        let mut out = Vec::with_capacity(4);
        let (x, y) = (pe.x, pe.y);
        let candidates = [
            (x + 1 < self.cols).then(|| Pe::new(self.wafer, x + 1, y)),
            x.checked_sub(1).map(|x| Pe::new(self.wafer, x, y)),
            (y + 1 < self.rows).then(|| Pe::new(self.wafer, x, y + 1)),
            y.checked_sub(1).map(|y| Pe::new(self.wafer, x, y)),
        ];
        out.extend(candidates.into_iter().flatten().filter(|n| (self.open)(*n)));
        out
    }
}

impl IntoNeighbors for MeshView<'_> {
    type Neighbors = std::vec::IntoIter<Pe>;
    fn neighbors(self, pe: Pe) -> Self::Neighbors {
        self.open_neighbours(pe).into_iter()
    }
}

impl IntoEdgeReferences for MeshView<'_> {
    type EdgeRef = Link;
    type EdgeReferences = std::vec::IntoIter<Link>;
    fn edge_references(self) -> Self::EdgeReferences {
        let mut links = Vec::new();
        for y in 0..self.rows {
            for x in 0..self.cols {
                let pe = Pe::new(self.wafer, x, y);
                if (self.open)(pe) {
                    links.extend(self.open_neighbours(pe).into_iter().map(|to| Link { from: pe, to }));
                }
            }
        }
        links.into_iter()
    }
}

impl IntoEdges for MeshView<'_> {
    type Edges = std::vec::IntoIter<Link>;
    fn edges(self, pe: Pe) -> Self::Edges {
        self.open_neighbours(pe).into_iter().map(|to| Link { from: pe, to }).collect::<Vec<_>>().into_iter()
    }
}

/// Paths for `legs` (`(from, to)` pairs, in order) through open PEs only: per leg the cheapest
/// A* path, each hop costing [`HOP`] plus the `pressure` of the PE it enters; each path's
/// straight stretches become runs, so the runs follow the legs in order. `None` when a leg
/// cannot be completed. Returns the runs and their total cost.
pub(super) fn paths_for_legs(
    mesh: MeshView<'_>,
    legs: &[(Pe, Pe)],
    pressure: &dyn Fn(Pe) -> u32,
) -> Option<(Vec<Run>, u64)> {
    let mut runs = Vec::new();
    let mut total = 0u64;
    for &(from, to) in legs {
        if from == to {
            continue;
        }
        let (cost, pes) = astar(
            mesh,
            from,
            |pe| pe == to,
            |link: Link| (HOP + pressure(link.to)) as u64,
            |pe: Pe| HOP as u64 * pe.distance(to).unwrap_or(0) as u64,
        )?;
        total += cost;
        straight_runs(&pes, &mut runs);
    }
    Some((runs, total))
}

/// The straight stretches of a path of neighbouring PEs, as runs of one message.
fn straight_runs(pes: &[Pe], runs: &mut Vec<Run>) {
    let Some(&first) = pes.first() else { return };
    let mut start = first;
    for window in pes.windows(3) {
        let (a, b, c) = (window[0], window[1], window[2]);
        let turns = (a.x == b.x) != (b.x == c.x);
        if turns {
            runs.push(Run { from: start, to: b, messages: 1 });
            start = b;
        }
    }
    if let Some(&last) = pes.last() {
        if last != start {
            runs.push(Run { from: start, to: last, messages: 1 });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pe(x: u16, y: u16) -> Pe {
        Pe::new(0, x, y)
    }

    #[test]
    fn an_open_mesh_gives_a_shortest_path_in_straight_runs() {
        let open = |_: Pe| true;
        let mesh = MeshView { cols: 4, rows: 4, wafer: 0, open: &open };
        let (runs, cost) = paths_for_legs(mesh, &[(pe(0, 0), pe(3, 0))], &|_| 0).expect("reachable");
        assert_eq!(runs, [Run { from: pe(0, 0), to: pe(3, 0), messages: 1 }]);
        assert_eq!(cost, 3 * HOP as u64);
    }

    #[test]
    fn a_path_goes_round_a_closed_pe() {
        // (1, 0) and (1, 1) are saturated: the path from (0, 0) to (3, 0) goes down to row 2.
        let open = |p: Pe| !(p.x == 1 && p.y <= 1);
        let mesh = MeshView { cols: 4, rows: 4, wafer: 0, open: &open };
        let (runs, cost) = paths_for_legs(mesh, &[(pe(0, 0), pe(3, 0))], &|_| 0).expect("reachable");
        let mut at = pe(0, 0);
        for run in &runs {
            assert_eq!(run.from, at, "runs are contiguous");
            assert!(run.from.x == run.to.x || run.from.y == run.to.y, "runs are straight");
            for (_, to) in run.hops() {
                assert!(open(to), "{to} is closed");
            }
            at = run.to;
        }
        assert_eq!(at, pe(3, 0));
        assert_eq!(cost, 7 * HOP as u64, "3 along, 2 down and 2 back up");
    }

    #[test]
    fn pressure_steers_between_paths_of_equal_length() {
        let open = |_: Pe| true;
        let mesh = MeshView { cols: 2, rows: 2, wafer: 0, open: &open };
        // (1, 0) is busy: go through (0, 1).
        let busy = |p: Pe| if p == pe(1, 0) { 5 } else { 0 };
        let (runs, _) = paths_for_legs(mesh, &[(pe(0, 0), pe(1, 1))], &busy).expect("reachable");
        assert_eq!(
            runs,
            [Run { from: pe(0, 0), to: pe(0, 1), messages: 1 }, Run { from: pe(0, 1), to: pe(1, 1), messages: 1 }]
        );
    }

    #[test]
    fn an_enclosed_destination_has_no_path() {
        let open = |p: Pe| p != pe(1, 0) && p != pe(0, 1);
        let mesh = MeshView { cols: 3, rows: 3, wafer: 0, open: &open };
        assert!(paths_for_legs(mesh, &[(pe(2, 2), pe(0, 0))], &|_| 0).is_none());
    }
}
