//! Experts that share a PE never run at the same time.
//!
//! The executor's timing model starts an instruction on a PE only once the instruction that last
//! computed there is done computing there, and lets it send only once that instruction's routes'
//! messages are over (`executor::timing`, `Timeline::routes_clear`). Two experts of one MoE layer
//! that share a lane (`Plan::Stacked::experts_per_lane`) share its PEs, so whichever order their
//! tokens pick them in, every route of one is over before any route of the other begins, and
//! their routes may share a colour on a PE as routes of ordered instructions do. The colouring
//! and the checker both ask [`SharedPes::share`].
//!
//! Only experts are asked about: neither reads the other, and they are where the pairs are (a
//! lane of eight experts of 128 in a layer). A program with expert copies is left out: a copy
//! runs on PEs of its own, beside the original it was copied from, under the same instruction.

use rustc_hash::FxHashMap as HashMap;
use std::cell::RefCell;

use super::{InstrPlacement, Pe};

/// A compute-PE set: its bounding box (x0, x1, y0, y1, wafer) and the PEs, sorted.
struct PeSet {
    bounds: (u16, u16, u16, u16, u16),
    pes: Vec<Pe>,
}

impl PeSet {
    fn new(pes: Vec<Pe>) -> Option<PeSet> {
        let first = *pes.first()?;
        // One wafer's PEs only: an expert spans no wafer boundary.
        if pes.iter().any(|pe| pe.wafer != first.wafer) {
            return None;
        }
        let (x0, x1) = (pes.iter().map(|p| p.x).min()?, pes.iter().map(|p| p.x).max()?);
        let (y0, y1) = (pes.iter().map(|p| p.y).min()?, pes.iter().map(|p| p.y).max()?);
        Some(PeSet { bounds: (x0, x1, y0, y1, first.wafer), pes })
    }

    fn meets(&self, other: &PeSet) -> bool {
        let ((ax0, ax1, ay0, ay1, aw), (bx0, bx1, by0, by1, bw)) = (self.bounds, other.bounds);
        if aw != bw || ax1 < bx0 || bx1 < ax0 || ay1 < by0 || by1 < ay0 {
            return false;
        }
        // Both lists are sorted: walk them together.
        let (mut i, mut j) = (0, 0);
        while i < self.pes.len() && j < other.pes.len() {
            match self.pes[i].cmp(&other.pes[j]) {
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
                std::cmp::Ordering::Equal => return true,
            }
        }
        false
    }
}

/// Which expert instructions share a compute PE (see the module documentation).
pub struct SharedPes {
    /// Per instruction: its compute PEs when it is an expert's.
    sets: Vec<Option<PeSet>>,
    known: RefCell<HashMap<(u32, u32), bool>>,
}

impl SharedPes {
    /// Over `instrs`, the placements indexed by instruction; `copies`: whether the program holds
    /// expert copies (then no pair is said to share).
    pub fn new(instrs: &[InstrPlacement], copies: bool) -> SharedPes {
        let sets = instrs
            .iter()
            .map(|p| match (p.expert, copies) {
                (Some(_), false) => PeSet::new(p.compute_pes()),
                _ => None,
            })
            .collect();
        SharedPes { sets, known: RefCell::new(HashMap::default()) }
    }

    /// Whether instructions `a` and `b` are experts computing on a common PE, so never run at
    /// the same time.
    pub fn share(&self, a: usize, b: usize) -> bool {
        let (Some(Some(sa)), Some(Some(sb))) = (self.sets.get(a), self.sets.get(b)) else { return false };
        let key = (a.min(b) as u32, a.max(b) as u32);
        *self.known.borrow_mut().entry(key).or_insert_with(|| sa.meets(sb))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(pes: &[(u16, u16)]) -> PeSet {
        let mut pes: Vec<Pe> = pes.iter().map(|&(x, y)| Pe::new(0, x, y)).collect();
        pes.sort_unstable();
        PeSet::new(pes).unwrap()
    }

    #[test]
    fn sets_meet_only_on_a_common_pe() {
        let lane = set(&[(0, 0), (1, 0), (0, 1), (1, 1)]);
        assert!(lane.meets(&set(&[(1, 1), (2, 2)])));
        // Overlapping boxes, no common PE.
        assert!(!lane.meets(&set(&[(2, 0), (1, 2)])));
        assert!(!set(&[(0, 0), (2, 2)]).meets(&set(&[(1, 1)])));
        // Disjoint boxes.
        assert!(!lane.meets(&set(&[(5, 5)])));
    }
}
