//! The instruction dependency graph of a module's body, as a petgraph graph: node `i` is
//! instruction `i`, and an edge runs from each operand to the instruction reading it. Every
//! question the compiler asks about the order of instructions goes through it: what the output
//! depends on (`dce`), whether one instruction reads another's result through any chain
//! (the wafer checker's colour rule), a topological order, and the longest path under
//! per-instruction costs (the distance bound, `wafer::distance_bound_cycles`).
//!
//! A verified module lists operands before their readers, so its body order is already
//! topological; the graph does not rely on it (an unverified module with a forward or
//! self-reference is reported as a cycle, not walked forever).

use petgraph::algo::{toposort, DfsSpace};
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::{Dfs, NodeFiltered, Reversed};
use petgraph::Direction;

use crate::module::Module;
use crate::op::Op;

/// Operands to readers over a module's instructions (see the module documentation).
pub struct DependencyGraph {
    graph: DiGraph<(), ()>,
}

impl DependencyGraph {
    /// The graph of `module`'s body; an operand naming no instruction is left out (the verifier
    /// reports it).
    pub fn new(module: &Module) -> DependencyGraph {
        let n = module.body.len();
        let mut graph = DiGraph::with_capacity(n, n * 2);
        for _ in 0..n {
            graph.add_node(());
        }
        for (handle, instr) in module.body.iter() {
            for operand in instr.op.operands() {
                if operand.index() < n {
                    graph.add_edge(NodeIndex::new(operand.index()), NodeIndex::new(handle.index()), ());
                }
            }
        }
        DependencyGraph { graph }
    }

    /// Number of instructions.
    pub fn len(&self) -> usize {
        self.graph.node_count()
    }

    pub fn is_empty(&self) -> bool {
        self.graph.node_count() == 0
    }

    /// The instructions `instr` reads directly (each once per operand use).
    pub fn operands(&self, instr: usize) -> impl Iterator<Item = usize> + '_ {
        self.graph.neighbors_directed(NodeIndex::new(instr), Direction::Incoming).map(|n| n.index())
    }

    /// An order of the instructions in which every operand comes before its readers, or
    /// `Err(instr)` naming an instruction on a cycle.
    pub fn topological_order(&self) -> Result<Vec<usize>, usize> {
        toposort(&self.graph, None)
            .map(|order| order.into_iter().map(|n| n.index()).collect())
            .map_err(|cycle| cycle.node_id().index())
    }

    /// Per instruction, the end of the longest chain of operands leading to it and including it,
    /// where instruction `i` lasts `own(i)`: it starts when its last operand ends. `Err(instr)`
    /// names an instruction on a cycle.
    pub fn longest_path_ends(&self, own: impl Fn(usize) -> u64) -> Result<Vec<u64>, usize> {
        self.longest_path_ends_with(own, |_, _| None)
    }

    /// [`DependencyGraph::longest_path_ends`], where `start(i, ends)` may say when `i` starts
    /// instead (from the ends of the instructions before it in topological order): an MoE
    /// expert whose PEs have their inputs before the inputs' multicasts end.
    pub fn longest_path_ends_with(
        &self,
        own: impl Fn(usize) -> u64,
        start: impl Fn(usize, &[u64]) -> Option<u64>,
    ) -> Result<Vec<u64>, usize> {
        let mut end = vec![0u64; self.len()];
        for i in self.topological_order()? {
            let begin = start(i, &end).unwrap_or_else(|| self.operands(i).map(|u| end[u]).max().unwrap_or(0));
            end[i] = begin + own(i);
        }
        Ok(end)
    }

    /// Which instructions `instr` depends on, itself included: what it reaches going back over
    /// operands.
    pub fn depended_on_by(&self, instr: usize) -> Vec<bool> {
        let mut reached = vec![false; self.len()];
        if instr < self.len() {
            let back = Reversed(&self.graph);
            let mut walk = Dfs::new(back, NodeIndex::new(instr));
            while let Some(node) = walk.next(back) {
                reached[node.index()] = true;
            }
        }
        reached
    }

    /// A search for chains of operands: [`Reads::transitively`] asks whether one instruction
    /// reads another's result through any chain, reusing its visited set between questions.
    pub fn reads(&self) -> Reads<'_> {
        Reads { graph: self, space: DfsSpace::new(&self.graph) }
    }
}

/// See [`DependencyGraph::reads`].
pub struct Reads<'g> {
    graph: &'g DependencyGraph,
    space: DfsSpace<NodeIndex, <DiGraph<(), ()> as petgraph::visit::Visitable>::Map>,
}

impl Reads<'_> {
    /// Whether `reader` depends on `source` through a chain of operands (false for `reader ==
    /// source`). The search goes back from `reader` and only through instructions after
    /// `source` when the body is in order (a verified module): an operand chain to `source`
    /// cannot pass below it.
    pub fn transitively(&mut self, reader: usize, source: usize) -> bool {
        let n = self.graph.len();
        if reader == source || reader >= n || source >= n {
            return false;
        }
        let back = NodeFiltered::from_fn(Reversed(&self.graph.graph), |node: NodeIndex| node.index() >= source);
        // The walk starts at `reader` and visits what it reads; `source` is found only through
        // an operand edge, since `reader != source`.
        petgraph::algo::has_path_connecting(
            &back,
            NodeIndex::new(reader),
            NodeIndex::new(source),
            Some(&mut self.space),
        )
    }
}

/// Which values' data each instruction reads, looking through the views that move no data
/// (`slice`, `expert_dispatch`).
pub struct DataReaders {
    /// The value whose data an instruction's result is: itself, or for a view its `x`'s source.
    pub source: Vec<u32>,
    /// Per value (by source): the instructions other than views reading it, in program order,
    /// each once.
    pub readers: Vec<Vec<u32>>,
}

impl DataReaders {
    /// Over `module`'s body; an operand that names no earlier instruction is left out (the
    /// verifier reports it).
    pub fn new(module: &Module) -> DataReaders {
        let n = module.body.len();
        let mut source: Vec<u32> = (0..n as u32).collect();
        let mut readers = vec![Vec::new(); n];
        for (handle, instr) in module.body.iter() {
            let i = handle.index();
            let earlier = instr.op.operands().into_iter().map(|o| o.index()).filter(|&o| o < i);
            match &instr.op {
                Op::Slice { x, .. } | Op::ExpertDispatch { x, .. } if x.index() < i => {
                    source[i] = source[x.index()];
                }
                Op::Slice { .. } | Op::ExpertDispatch { .. } => {}
                _ => {
                    for operand in earlier {
                        let list: &mut Vec<u32> = &mut readers[source[operand] as usize];
                        if list.last() != Some(&(i as u32)) {
                            list.push(i as u32);
                        }
                    }
                }
            }
        }
        DataReaders { source, readers }
    }
}

/// Per instruction, the MoE expert it computes for: an `expert_dispatch`'s expert, then that of
/// any instruction reading such a value (through its first operand that has one); an
/// `expert_combine` reads them all but belongs to none, nor does what reads only dense values.
pub fn experts(module: &Module) -> Vec<Option<u32>> {
    let mut expert: Vec<Option<u32>> = vec![None; module.body.len()];
    for (handle, instr) in module.body.iter() {
        expert[handle.index()] = match &instr.op {
            Op::ExpertDispatch { expert, .. } => Some(*expert),
            Op::ExpertCombine { .. } => None,
            op => op.operands().into_iter().find_map(|o| expert.get(o.index()).copied().flatten()),
        };
    }
    expert
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::siblings;

    #[test]
    fn topological_order_puts_operands_first() {
        let graph = DependencyGraph::new(&siblings());
        let order = graph.topological_order().unwrap();
        let position = |i: usize| order.iter().position(|&x| x == i).unwrap();
        assert_eq!(order.len(), 6);
        for i in 0..6 {
            for u in graph.operands(i) {
                assert!(position(u) < position(i), "%{u} before %{i} in {order:?}");
            }
        }
    }

    #[test]
    fn longest_path_takes_the_slower_sibling() {
        let graph = DependencyGraph::new(&siblings());
        // %2 costs 10, %1 costs 3: %3 starts at 1 + 10.
        let own = [1u64, 3, 10, 2, 1, 5];
        let end = graph.longest_path_ends(|i| own[i]).unwrap();
        assert_eq!(end, vec![1, 4, 11, 13, 14, 19]);
    }

    #[test]
    fn reads_and_depended_on_by_follow_operand_chains_only() {
        let graph = DependencyGraph::new(&siblings());
        let mut reads = graph.reads();
        assert!(reads.transitively(3, 1) && reads.transitively(3, 2) && reads.transitively(5, 0));
        assert!(!reads.transitively(2, 1) && !reads.transitively(1, 2), "siblings");
        assert!(!reads.transitively(1, 3), "a source does not read its reader");
        assert!(!reads.transitively(4, 4));
        assert_eq!(graph.depended_on_by(3), vec![true, true, true, true, false, false]);
        assert_eq!(graph.depended_on_by(2), vec![true, false, true, false, false, false]);
    }

    #[test]
    fn a_forward_reference_is_a_cycle_not_a_hang() {
        let mut module = siblings();
        // %1 made to read %3, which reads %1.
        module.body[crate::Handle::new(1)].op = crate::Op::Add { a: crate::Handle::new(3), b: crate::Handle::new(0) };
        let graph = DependencyGraph::new(&module);
        let on_cycle = graph.topological_order().unwrap_err();
        assert!(on_cycle == 1 || on_cycle == 3, "{on_cycle}");
        assert!(graph.longest_path_ends(|_| 1).is_err());
    }
}
