//! Which instructions of a decode step are never active at the same time.
//!
//! Instruction `a` *precedes* `b` when `a` is a transitive operand of `b`: the executor lets an
//! instruction send only once its operands' routes are over (their deliveries included; a reader
//! may start computing on its own copy earlier, `executor::timing`, `Timeline::routes_clear`), so
//! every message on `a`'s routes is over before any of `b`'s begins. Routes of two
//! such instructions may share a colour on a PE (the router's configuration for that colour is
//! switched between them); the colouring and the checker both ask this.
//!
//! A decoder's residual stream makes the question cheap: an instruction `p` that no operand edge
//! jumps over (no `u < p < v` with `u` an operand of `v`) is a *cut*: every earlier instruction is
//! an ancestor of `p` and every later one a descendant (each earlier instruction has a reader, all
//! readers lie at or before `p`; an instruction with no reader never closes a cut). Cuts split the
//! body into epochs (each ends at its cut): instructions of different epochs are ordered, and
//! inside an epoch (one attention or FFN block, a few hundred instructions even for a 128-expert
//! MoE layer) ancestry is a bitset per instruction.

use waferc_ir::Module;

/// Precedence between a module's instructions (see the module documentation).
pub(crate) struct Precedence {
    /// Epoch of each instruction.
    epoch: Vec<u32>,
    /// Index of each instruction within its epoch.
    slot: Vec<u32>,
    /// Per instruction, its ancestors within its epoch, as a bitset over the epoch's slots.
    ancestors: Vec<Vec<u64>>,
}

impl Precedence {
    pub(crate) fn new(module: &Module) -> Precedence {
        let n = module.body.len();
        // The furthest reader of each instruction (`n` for one with none but the output).
        let mut reach: Vec<usize> = (0..n).map(|i| if i + 1 == n { i } else { n }).collect();
        let mut seen_reader = vec![false; n];
        for (handle, instr) in module.body.iter() {
            for operand in instr.op.operands() {
                let u = operand.index();
                reach[u] = if seen_reader[u] { reach[u].max(handle.index()) } else { handle.index() };
                seen_reader[u] = true;
            }
        }
        // An instruction without operands (the embedding) descends from nothing, so no cut
        // may come before it.
        let last_source =
            module.body.iter().filter(|(_, instr)| instr.op.operands().is_empty()).map(|(h, _)| h.index()).max();
        let (mut epoch, mut slot) = (vec![0u32; n], vec![0u32; n]);
        // `furthest`: the furthest reader of any instruction before `i`; `i` is a cut when it
        // is not past `i` (edges leaving `i` itself do not jump over it).
        let (mut current, mut start, mut furthest) = (0u32, 0usize, last_source.unwrap_or(0));
        for i in 0..n {
            epoch[i] = current;
            slot[i] = (i - start) as u32;
            let cut = furthest <= i;
            furthest = furthest.max(reach[i]);
            if cut {
                current += 1;
                start = i + 1;
            }
        }
        let mut ancestors: Vec<Vec<u64>> = Vec::with_capacity(n);
        for (handle, instr) in module.body.iter() {
            let i = handle.index();
            let mut bits = vec![0u64; (slot[i] as usize).div_ceil(64)];
            for operand in instr.op.operands() {
                let u = operand.index();
                if epoch[u] != epoch[i] {
                    continue;
                }
                let s = slot[u] as usize;
                bits[s / 64] |= 1 << (s % 64);
                for (word, inherited) in bits.iter_mut().zip(&ancestors[u]) {
                    *word |= inherited;
                }
            }
            ancestors.push(bits);
        }
        Precedence { epoch, slot, ancestors }
    }

    /// The epoch of instruction `i`: instructions of different epochs are always ordered.
    pub(crate) fn epoch(&self, i: usize) -> u32 {
        self.epoch[i]
    }

    /// Whether instructions `a` and `b` are never active at the same time: one precedes the other.
    pub(crate) fn ordered(&self, a: usize, b: usize) -> bool {
        if a == b {
            return false;
        }
        let (early, late) = if a < b { (a, b) } else { (b, a) };
        if self.epoch[early] != self.epoch[late] {
            return true;
        }
        let s = self.slot[early] as usize;
        self.ancestors[late].get(s / 64).is_some_and(|word| word & (1 << (s % 64)) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_residual_block_orders_its_layers_and_leaves_siblings_unordered() {
        let module = waferc_ir::test_support::siblings();
        let p = Precedence::new(&module);
        // %1 and %2 read the same input and run side by side.
        assert!(!p.ordered(1, 2));
        assert!(p.ordered(1, 3) && p.ordered(2, 3));
        // %0 is read by %4, past %1..%3, so they share an epoch with it, but each is its ancestor.
        assert!(p.ordered(0, 1) && p.ordered(0, 4));
        assert!(p.ordered(1, 5) && p.ordered(3, 5));
        assert!(!p.ordered(3, 3));
        // The embedding, the block and the head are epochs of their own: the residual edge
        // %0 -> %4 ends at the block's cut, it does not jump over it.
        let epochs: Vec<u32> = (0..6).map(|i| p.epoch(i)).collect();
        assert_eq!(epochs, [0, 1, 1, 1, 1, 2]);
    }
}
