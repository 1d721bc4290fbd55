//! Cutting a chain of units (layers, with the prologue and epilogue joined to the first and the
//! last) into consecutive runs, one per wafer, as a path problem on a petgraph DAG.
//!
//! Node `(b, k)`: the first `b` units are placed on wafers `0..k`. An edge `(b, k) -> (b', k + 1)`
//! (`b' > b`) puts units `b..b'` on wafer `k`; its weight is their load. A path from `(0, 0)` to
//! some `(n, k)` (`k <= wafers`) is a partition. Every cut of a decoder's layer chain carries the
//! same bytes (the residual vector crosses once, whatever the layer), so the inter-wafer traffic
//! is the same for every partition using the same number of wafers and is left out; what
//! differs is how the load is spread.
//!
//! The partition minimises the heaviest wafer's load (the bottleneck path: petgraph's A* with
//! a path cost that combines by `max`, which is monotone, so the search is exact; no estimate),
//! and among those, the sum of the squared loads (a shortest path over the edges within that
//! bottleneck), which spreads the rest evenly and uses every wafer it can. The result is the
//! optimal contiguous partition, deterministic, in O(units^2 x wafers) edges (a 126-layer model
//! on four wafers: about 32k).

use std::ops::Add;

use petgraph::algo::astar;
use petgraph::graph::{DiGraph, NodeIndex};

/// The load of a path: its heaviest edge.
#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd)]
struct Bottleneck(u64);

impl Add for Bottleneck {
    type Output = Bottleneck;

    fn add(self, other: Bottleneck) -> Bottleneck {
        Bottleneck(self.0.max(other.0))
    }
}

/// The cut graph of `loads` over at most `wafers` wafers, edges above `capacity` left out.
struct Cuts {
    graph: DiGraph<(usize, u16), u64>,
    /// Node of `(b, k)`, at `b * (wafers + 1) + k`.
    nodes: Vec<NodeIndex>,
    units: usize,
    wafers: u16,
}

impl Cuts {
    fn new(loads: &[u64], wafers: u16, capacity: u64) -> Cuts {
        let (units, wafers) = (loads.len(), wafers.max(1));
        let mut graph = DiGraph::new();
        let mut nodes = Vec::with_capacity((units + 1) * (wafers as usize + 1));
        for b in 0..=units {
            for k in 0..=wafers {
                nodes.push(graph.add_node((b, k)));
            }
        }
        let at = |b: usize, k: u16| nodes[b * (wafers as usize + 1) + k as usize];
        for b in 0..units {
            for k in 0..wafers {
                let mut load = 0u64;
                for end in b + 1..=units {
                    load = load.saturating_add(loads[end - 1]);
                    if load > capacity {
                        break;
                    }
                    graph.add_edge(at(b, k), at(end, k + 1), load);
                }
            }
        }
        Cuts { graph, nodes, units, wafers }
    }

    fn start(&self) -> NodeIndex {
        self.nodes[0]
    }

    /// The wafer of each unit along `path` (nodes from the start to a goal).
    fn wafers_of(&self, path: &[NodeIndex]) -> Vec<u16> {
        let mut wafer_of = vec![0u16; self.units];
        for pair in path.windows(2) {
            let ((from, k), (to, _)) = (self.graph[pair[0]], self.graph[pair[1]]);
            wafer_of[from..to].fill(k);
        }
        wafer_of
    }

    /// The least heaviest-wafer load of any partition, with the partition.
    fn bottleneck(&self) -> Option<(u64, Vec<NodeIndex>)> {
        let units = self.units;
        astar(&self.graph, self.start(), |n| self.graph[n].0 == units, |e| Bottleneck(*e.weight()), |_| Bottleneck(0))
            .map(|(Bottleneck(load), path)| (load, path))
    }
}

/// The wafer of each unit: consecutive units, each wafer's load at most `capacity`, the heaviest
/// wafer as light as possible and the rest spread evenly (module documentation). `None` when no
/// such partition exists.
pub(super) fn partition(loads: &[u64], wafers: u16, capacity: u64) -> Option<Vec<u16>> {
    if loads.is_empty() {
        return Some(Vec::new());
    }
    let (heaviest, _) = Cuts::new(loads, wafers, capacity).bottleneck()?;
    let cuts = Cuts::new(loads, wafers, heaviest);
    let units = cuts.units;
    let squared = |e: petgraph::graph::EdgeReference<'_, u64>| (*e.weight() as u128).pow(2);
    let (_, path) = astar(&cuts.graph, cuts.start(), |n| cuts.graph[n].0 == units, squared, |_| 0u128)?;
    debug_assert!(cuts.wafers_of(&path).iter().all(|&w| w < cuts.wafers));
    Some(cuts.wafers_of(&path))
}

/// The heaviest wafer of the best partition of `loads` over `wafers` wafers with no capacity,
/// and its load (the first of equals): what an overflow error names.
pub(super) fn heaviest_wafer(loads: &[u64], wafers: u16) -> (u16, u64) {
    let wafer_of = partition(loads, wafers, u64::MAX).unwrap_or_else(|| vec![0; loads.len()]);
    let mut used = vec![0u64; wafers.max(1) as usize];
    for (load, &w) in loads.iter().zip(&wafer_of) {
        used[w as usize] += load;
    }
    used.iter().enumerate().fold((0, 0), |best, (w, &load)| if load > best.1 { (w as u16, load) } else { best })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every contiguous partition of `loads` over at most `wafers` wafers, by brute force: the
    /// least heaviest load.
    fn brute_force_bottleneck(loads: &[u64], wafers: u16) -> u64 {
        fn go(loads: &[u64], wafers: u16) -> u64 {
            if loads.is_empty() {
                return 0;
            }
            if wafers == 1 {
                return loads.iter().sum();
            }
            (1..=loads.len())
                .map(|first| loads[..first].iter().sum::<u64>().max(go(&loads[first..], wafers - 1)))
                .min()
                .unwrap()
        }
        go(loads, wafers)
    }

    fn heaviest(loads: &[u64], wafer_of: &[u16]) -> u64 {
        let mut used = [0u64; 8];
        for (load, &w) in loads.iter().zip(wafer_of) {
            used[w as usize] += load;
        }
        used.into_iter().max().unwrap()
    }

    #[test]
    fn the_partition_is_contiguous_and_its_heaviest_wafer_is_optimal() {
        let cases: [(&[u64], u16); 6] = [
            (&[10, 10, 10, 10], 2),
            (&[30, 10, 10, 10, 10, 10, 40], 3),
            (&[5, 1, 1, 1, 1, 1, 1, 1, 9], 4),
            (&[7], 3),
            (&[3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 12], 4),
            (&[1, 100, 1, 1, 100, 1], 2),
        ];
        for (loads, wafers) in cases {
            let wafer_of = partition(loads, wafers, u64::MAX).unwrap();
            assert!(wafer_of.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1), "{wafer_of:?}");
            assert_eq!(wafer_of[0], 0);
            assert!(wafer_of.iter().all(|&w| w < wafers));
            assert_eq!(heaviest(loads, &wafer_of), brute_force_bottleneck(loads, wafers), "{loads:?} {wafer_of:?}");
        }
    }

    #[test]
    fn ties_are_spread_evenly_over_every_wafer() {
        // Heaviest 40 either way; the squares prefer 30/30/40 to 40/20/40-like splits.
        assert_eq!(partition(&[10, 10, 10, 10, 10, 10, 40], 3, u64::MAX).unwrap(), vec![0, 0, 0, 1, 1, 1, 2]);
        assert_eq!(partition(&[1, 1, 1, 1], 4, u64::MAX).unwrap(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn capacity_is_respected_or_there_is_no_partition() {
        let split = partition(&[6, 6, 6], 2, 12).unwrap();
        assert!(split == [0, 0, 1] || split == [0, 1, 1], "{split:?}");
        assert_eq!(partition(&[8, 4, 2], 2, 12).unwrap(), vec![0, 1, 1]);
        assert_eq!(partition(&[9, 2, 2, 9], 3, 11).unwrap(), vec![0, 1, 1, 2]);
        assert_eq!(partition(&[6, 6, 6], 2, 11), None);
        assert_eq!(heaviest_wafer(&[6, 6, 6], 2).1, 12);
        assert_eq!(heaviest_wafer(&[1, 2, 20], 2), (1, 20));
    }
}
