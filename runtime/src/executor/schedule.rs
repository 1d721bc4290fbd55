//! The schedule as the executor walks it: cut into per-instruction runs of steps (consecutive,
//! in phase order), and the bookkeeping of one run (current phase, per-step compute and sends)
//! that the timing model reads.

use std::collections::HashMap;
use std::ops::Range;

use waferc_ir::wafer::{InstrIndex, Pe, Phase, RouteId, Step, WaferProgram, Work};

use super::{site_of, ExecError, InstrSite};

/// What one schedule step did: compute cycles per PE, and the routes it sent on (in first-send
/// order) with their message counts.
#[derive(Clone, Debug, Default)]
pub(crate) struct StepWork {
    pub(crate) compute: HashMap<Pe, u64>,
    pub(crate) routes: Vec<(RouteId, u32)>,
    /// Collect routes whose senders are only some of their sources (an MoE combine gathering
    /// the chosen experts): the latency from the farthest sender that did send.
    pub(crate) reach: Vec<(RouteId, u64)>,
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
}

impl InstrRun {
    pub(super) fn new(program: &WaferProgram, instr: InstrIndex, steps: Range<usize>) -> Self {
        let steps: Vec<(usize, Step)> = steps.map(|i| (i, program.schedule[i].clone())).collect();
        let work = vec![StepWork::default(); steps.len()];
        InstrRun {
            instr,
            site: site_of(program, instr),
            steps,
            phase: Phase::Compute,
            current: None,
            work,
            orphan: HashMap::new(),
        }
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
        self.current.is_some_and(|c| self.steps[c].1.routes.contains(&route))
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
            match routes.iter_mut().find(|(id, _)| *id == route) {
                Some((_, messages)) => *messages += 1,
                None => routes.push((route, 1)),
            }
        }
    }

    /// Records that a sender `latency` cycles away sent on `route` in the current step.
    pub(super) fn reached(&mut self, route: RouteId, latency: u64) {
        if let Some(c) = self.current {
            let reach = &mut self.work[c].reach;
            match reach.iter_mut().find(|(id, _)| *id == route) {
                Some((_, farthest)) => *farthest = (*farthest).max(latency),
                None => reach.push((route, latency)),
            }
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
                if phase_rank(previous.phase) >= phase_rank(step.phase) {
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

fn phase_rank(phase: Phase) -> u8 {
    match phase {
        Phase::Gather => 0,
        Phase::Compute => 1,
        Phase::Reduce => 2,
        Phase::Broadcast => 3,
        Phase::Finish => 4,
        Phase::AttentionMax => 5,
        Phase::AttentionSum => 6,
        Phase::AttentionOut => 7,
        Phase::Collect => 8,
        Phase::Deliver => 9,
    }
}
