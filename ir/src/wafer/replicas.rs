//! Replicas of hot MoE experts: extra copies of an expert's instructions on PEs the main
//! placement left free, holding identical weight tiles, so several sequences in flight that pick
//! the same hot expert can be served by different copies.
//!
//! Copy 0 of an expert is its placements in [`WaferProgram::instrs`]; copies `1..` are in
//! [`WaferProgram::replicas`], each a full set of placements of the expert's instructions (tiles,
//! segments, its own routes). The layer's input multicast, the router's routing multicast and
//! the combine's gather reach every copy; which copy serves a token is [`serving_copy`], the one
//! rule the executor's functional run and its timing model both use (through
//! [`WaferProgram::placement`]). Every copy computes the same bits, so the reference decoder does
//! not know about copies.
//!
//! Artifacts: the replica table is not part of the bincode header's `WaferProgram`; the writer
//! appends it after the header only when there are replicas, so an artifact without replicas is
//! byte for byte what it was before replicas existed.

use serde::{Deserialize, Serialize};

use super::{InstrIndex, InstrPlacement, WaferProgram};

/// The extra copies of one expert.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertReplicas {
    pub layer: u32,
    pub expert: u32,
    /// The layer's router.
    pub router: InstrIndex,
    /// The expert's instructions, in program order (copy 0's placements are `instrs[i]`).
    pub instrs: Vec<InstrIndex>,
    /// Copies `1..`: each the placements of `instrs`, in the same order.
    pub copies: Vec<Vec<InstrPlacement>>,
}

impl ExpertReplicas {
    /// Copies in all, the original included.
    pub fn count(&self) -> u32 {
        self.copies.len() as u32 + 1
    }
}

/// The copy of an expert with `copies` copies that serves sequence slot `sequence`:
/// `sequence mod copies`. A lone sequence (slot 0) always uses the original, which the placer
/// put nearest the layer's dispatch and gather points, so replicas cost one sequence nothing;
/// sequences in flight spread evenly over the copies, whatever their positions.
pub fn serving_copy(sequence: u32, copies: u32) -> u32 {
    sequence % copies.max(1)
}

/// Where each instruction's copies are: per instruction, `(index in replicas, index in the
/// replica's instrs)` for an instruction of a replicated expert.
pub fn replica_slots(program: &WaferProgram) -> Vec<Option<(u32, u32)>> {
    replica_slots_in(&program.replicas, program.instrs.len())
}

/// [`replica_slots`] of a replica table over `instrs` instructions.
pub fn replica_slots_in(replicas: &[ExpertReplicas], instrs: usize) -> Vec<Option<(u32, u32)>> {
    let mut slots = vec![None; instrs];
    for (r, replica) in replicas.iter().enumerate() {
        for (m, &instr) in replica.instrs.iter().enumerate() {
            if let Some(slot) = slots.get_mut(instr as usize) {
                *slot = Some((r as u32, m as u32));
            }
        }
    }
    slots
}

impl WaferProgram {
    /// The placement of `instr` that serves sequence slot `sequence`: its copy
    /// [`serving_copy`] when it belongs to a replicated expert, else `instrs[instr]`. `slots` is
    /// [`replica_slots`] of this program.
    pub fn placement(&self, slots: &[Option<(u32, u32)>], instr: InstrIndex, sequence: u32) -> &InstrPlacement {
        match slots.get(instr as usize).copied().flatten() {
            Some((r, m)) => {
                let replicas = &self.replicas[r as usize];
                match serving_copy(sequence, replicas.count()) {
                    0 => &self.instrs[instr as usize],
                    c => &replicas.copies[c as usize - 1][m as usize],
                }
            }
            None => &self.instrs[instr as usize],
        }
    }

    /// Every placement of `instr`: the original, then its copies.
    pub fn placements_of(
        &self,
        slots: &[Option<(u32, u32)>],
        instr: InstrIndex,
    ) -> impl Iterator<Item = &InstrPlacement> {
        let copies = slots
            .get(instr as usize)
            .copied()
            .flatten()
            .map(|(r, m)| self.replicas[r as usize].copies.iter().map(move |copy| &copy[m as usize]));
        std::iter::once(&self.instrs[instr as usize]).chain(copies.into_iter().flatten())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_sequence_uses_the_original_and_sequences_spread_evenly() {
        assert_eq!(serving_copy(0, 3), 0);
        let served: Vec<u32> = (0..6).map(|s| serving_copy(s, 3)).collect();
        assert_eq!(served, [0, 1, 2, 0, 1, 2]);
        assert_eq!(serving_copy(5, 1), 0);
    }
}
