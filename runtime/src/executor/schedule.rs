//! The schedule as the executor walks it: cut into per-instruction runs of steps (consecutive,
//! in phase order), and the bookkeeping of one run (current phase, per-step compute and sends)
//! that the timing model reads.

use std::collections::hash_map::Entry;
use std::sync::OnceLock;

use rustc_hash::FxHashMap as HashMap;
use std::ops::Range;

use waferc_ir::wafer::{InstrIndex, InstrPlacement, Pe, Phase, RouteId, Step, WaferProgram, Work};

use super::by_pe::ByPe;
use super::{site_of, ExecError, InstrSite};

/// What one schedule step did: compute cycles per PE, and the routes it sent on (in first-send
/// order) with their message counts.
#[derive(Clone, Debug, Default)]
pub(crate) struct StepWork {
    pub(crate) compute: HashMap<Pe, u64>,
    pub(crate) routes: Vec<(RouteId, u32)>,
    /// Collect routes whose senders are only some of their sources (an MoE combine gathering
    /// the chosen experts): each sender that did send, in send order. The route holds the links
    /// their messages cross.
    pub(crate) senders: Vec<Sender>,
    /// Routes whose messages this step carried fewer elements than the route is sized for,
    /// with the elements each message carried: an attention's sums of its slices' score parts,
    /// whose messages hold the scores of the rows a block holds so far.
    pub(crate) carried: Vec<(RouteId, u32)>,
}

/// One sender of a collect whose senders are only some of its sources ([`StepWork::senders`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sender {
    pub(crate) route: RouteId,
    pub(crate) pe: Pe,
    /// Cycles from the sender to the route's destination.
    pub(crate) latency: u64,
    /// The cycle the sent value was done: its message may leave then, before the step starts
    /// (an MoE combine's early expert, while a later one still computes).
    pub(crate) ready: u64,
}

/// One instruction's consecutive steps while it executes: which phase is current, what each
/// step computed and sent (for the timing model).
pub(crate) struct InstrRun {
    pub(crate) instr: InstrIndex,
    pub(crate) site: InstrSite,
    /// `(schedule index, step)` of the instruction's steps.
    pub(crate) steps: Vec<(usize, Step)>,
    pub(super) phase: Phase,
    current: Option<usize>,
    /// What each step did.
    pub(crate) work: Vec<StepWork>,
    /// Compute in a phase the schedule has no step for, charged to the next step.
    orphan: HashMap<Pe, u64>,
    /// Per PE, the instruction's operand routes reaching it, in `operand_routes` order (built on
    /// first use: a scan of every operand route per operand read is quadratic on wide plans).
    operand_routes_to: OnceLock<ByPe<RouteId>>,
    /// Per step, where each route it sent on sits in its `StepWork::routes`.
    route_slots: Vec<HashMap<RouteId, usize>>,
    /// Per step, the routes the schedule lists for it, each with its place in the list.
    listed: Vec<HashMap<RouteId, usize>>,
    /// The copy of a replicated expert's instruction that runs (0: the original).
    pub(crate) copy: u32,
}

impl InstrRun {
    pub(super) fn new(program: &WaferProgram, instr: InstrIndex, steps: Range<usize>) -> Self {
        let steps: Vec<(usize, Step)> = steps.map(|i| (i, program.schedule[i].clone())).collect();
        let work = vec![StepWork::default(); steps.len()];
        let listed = steps.iter().map(|(_, s)| s.routes.iter().enumerate().map(|(k, &id)| (id, k)).collect()).collect();
        InstrRun {
            instr,
            site: site_of(program, instr),
            route_slots: vec![HashMap::default(); steps.len()],
            listed,
            steps,
            phase: Phase::Compute,
            current: None,
            work,
            orphan: HashMap::default(),
            operand_routes_to: OnceLock::new(),
            copy: 0,
        }
    }

    /// The instruction's operand routes with `pe` among their destinations, in the order the
    /// placement lists them (a route listed twice, twice). `destinations` is each route's
    /// destinations, sorted.
    pub(super) fn operand_routes_to(
        &self,
        placement: &InstrPlacement,
        destinations: &[impl AsRef<[Pe]>],
        pe: Pe,
    ) -> &[RouteId] {
        let index = self.operand_routes_to.get_or_init(|| {
            // Each (destination, route) pair; a destination a route names twice, once.
            ByPe::new(placement.operand_routes.iter().flat_map(|&id| {
                let to = destinations.get(id as usize).map_or(&[][..], |to| to.as_ref());
                to.iter().enumerate().filter(|&(i, pe)| i == 0 || to[i - 1] != *pe).map(move |(_, &pe)| (pe, id))
            }))
        });
        index.on(pe)
    }

    pub(super) fn begin(&mut self, phase: Phase) {
        self.phase = phase;
        self.current = self.steps.iter().position(|(_, s)| s.phase == phase);
        if let Some(current) = self.current {
            for (pe, cycles) in std::mem::take(&mut self.orphan) {
                *self.work[current].compute.entry(pe).or_insert(0) += cycles;
            }
        }
    }

    pub(super) fn current_lists(&self, route: RouteId) -> bool {
        self.current.is_some_and(|c| self.listed[c].contains_key(&route))
    }

    /// Puts each step's sent routes in the order the schedule lists them: the order they claim
    /// links in (`timing`), whatever order the executor sent them in.
    pub(crate) fn sort_sent_as_listed(&mut self) {
        for ((work, listed), slots) in self.work.iter_mut().zip(&self.listed).zip(&mut self.route_slots) {
            work.routes.sort_by_key(|(id, _)| listed[id]);
            for (k, (id, _)) in work.routes.iter().enumerate() {
                slots.insert(*id, k);
            }
        }
    }

    pub(super) fn compute(&mut self, pe: Pe, cycles: u64) {
        let target = match self.current {
            Some(c) => &mut self.work[c].compute,
            None => &mut self.orphan,
        };
        *target.entry(pe).or_insert(0) += cycles;
    }

    pub(super) fn sent(&mut self, route: RouteId) {
        if let Some(c) = self.current {
            let routes = &mut self.work[c].routes;
            match self.route_slots[c].entry(route) {
                Entry::Occupied(slot) => routes[*slot.get()].1 += 1,
                Entry::Vacant(slot) => {
                    slot.insert(routes.len());
                    routes.push((route, 1));
                }
            }
        }
    }

    /// Records that every message on `route` in the current step carries `elements` elements,
    /// fewer than the route is sized for ([`StepWork::carried`]).
    pub(super) fn carried(&mut self, route: RouteId, elements: u32) {
        if let Some(c) = self.current {
            let carried = &mut self.work[c].carried;
            match carried.iter_mut().find(|(id, _)| *id == route) {
                Some((_, held)) => *held = elements,
                None => carried.push((route, elements)),
            }
        }
    }

    /// Records that `pe`, `latency` cycles away, sent on `route` in the current step a value
    /// done at cycle `ready`.
    pub(super) fn reached(&mut self, route: RouteId, pe: Pe, latency: u64, ready: u64) {
        if let Some(c) = self.current {
            self.work[c].senders.push(Sender { route, pe, latency, ready });
        }
    }

    /// Compute charged to no step yet (a trailing phase without a step goes to the last step).
    pub(crate) fn take_orphan(&mut self) -> HashMap<Pe, u64> {
        std::mem::take(&mut self.orphan)
    }
}

/// Cuts the schedule into instructions, checking each instruction's steps are consecutive, in
/// phase order, one per phase, and that every non-dispatch instruction has steps.
pub(super) fn schedule_runs(program: &WaferProgram) -> Result<Vec<(InstrIndex, Range<usize>)>, ExecError> {
    let mut runs: Vec<(InstrIndex, Range<usize>)> = Vec::new();
    let mut seen = vec![false; program.instrs.len()];
    for (i, step) in program.schedule.iter().enumerate() {
        if step.instr as usize >= program.instrs.len() {
            return Err(ExecError::Schedule {
                problem: format!(
                    "step {i} names %{}, but the program has {} instructions",
                    step.instr,
                    program.instrs.len()
                ),
            });
        }
        match runs.last_mut() {
            Some((instr, range)) if *instr == step.instr => {
                let previous = &program.schedule[i - 1];
                if previous.phase >= step.phase {
                    return Err(ExecError::Schedule {
                        problem: format!(
                            "step {i} of %{} is {:?} after {:?}: phases must be in order, one step each",
                            step.instr, step.phase, previous.phase
                        ),
                    });
                }
                range.end = i + 1;
            }
            _ => {
                if seen[step.instr as usize] {
                    return Err(ExecError::Schedule {
                        problem: format!("the steps of %{} are not consecutive (step {i})", step.instr),
                    });
                }
                seen[step.instr as usize] = true;
                runs.push((step.instr, i..i + 1));
            }
        }
    }
    for (placement, seen) in program.instrs.iter().zip(&seen) {
        if !seen && !matches!(placement.work, Work::Dispatch { .. }) {
            return Err(ExecError::Schedule {
                problem: format!("%{} = {} has no step in the schedule", placement.instr, placement.op),
            });
        }
    }
    Ok(runs)
}
