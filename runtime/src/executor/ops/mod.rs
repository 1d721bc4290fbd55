//! Each op's per-PE execution: one module per kind of [`Work`]. Every op reads its operands and
//! sends its results through the fabric, charges its compute to the current step, and leaves
//! what its result PEs hold in the step state.

mod attention;
mod elementwise;
mod embed;
mod matvec;
mod moe;
mod norm;

use waferc_ir::wafer::{InstrIndex, ResultLayout, Work};
use waferc_ir::Op;

use super::{ExecError, Executor, InstrRun, StepState};

impl Executor<'_> {
    /// Runs instruction `run.instr` on its PEs: the op's work as its placement lays it out.
    pub(super) fn execute(&mut self, state: &mut StepState, run: &mut InstrRun) -> Result<(), ExecError> {
        let instr = run.instr;
        let placement = self.placement(instr);
        let op = self.module.body[waferc_ir::Handle::new(instr as usize)].op.clone();
        let segments = match &placement.result {
            ResultLayout::Vector(layout) => layout.segments.clone(),
            ResultLayout::Routing { .. } => Vec::new(),
        };
        match (&op, &placement.work) {
            (Op::Embed { table }, Work::Embed { blocks, collects }) => {
                self.embed(state, run, table.index() as u32, blocks, collects, &segments)?
            }
            (Op::MatVec { x, weight, bias }, Work::MatVec(p)) => self.matvec(
                state,
                run,
                x.index() as InstrIndex,
                weight.index() as u32,
                bias.map(|b| b.index() as u32),
                p,
                &segments,
            )?,
            (Op::RmsNorm { x, weight, eps }, Work::RmsNorm(p)) => {
                self.rms_norm(state, run, x.index() as InstrIndex, weight.index() as u32, *eps, p, &segments)?
            }
            (Op::Attention { q, k, v, cache, heads, scale, window, sinks }, Work::Attention(p)) => {
                let spec = &self.module.caches[*cache];
                if p.heads != *heads || p.kv_heads != spec.kv_heads || p.head_dim != spec.head_dim {
                    return Err(ExecError::Malformed {
                        site: run.site.clone(),
                        problem: format!(
                            "placed for {} heads, {} KV heads of {}, but the op has {heads}, {} of {}",
                            p.heads, p.kv_heads, p.head_dim, spec.kv_heads, spec.head_dim
                        ),
                    });
                }
                let operands = [q, k, v].map(|v| v.index() as InstrIndex);
                let sinks = sinks.map(|s| s.index() as u32);
                self.attention(state, run, operands, *scale, *window, sinks, p, &segments)?
            }
            (
                Op::Silu { .. } | Op::Mul { .. } | Op::Add { .. } | Op::SwiGlu { .. } | Op::Rope { .. },
                Work::Elementwise,
            ) => self.elementwise(state, run, &op, &segments)?,
            (Op::RouterTopK { logits, top_k, normalize }, Work::Router { routing }) => {
                let ResultLayout::Routing { pe } = placement.result else {
                    return Err(ExecError::Malformed {
                        site: run.site.clone(),
                        problem: "a router's result must be a routing".into(),
                    });
                };
                self.router(state, run, logits.index() as InstrIndex, *top_k, *normalize, pe, *routing)?
            }
            // The result aliases `x`; the gate (checked before) decided whether it exists.
            (Op::ExpertDispatch { .. }, Work::Dispatch { .. }) => {}
            // The result names part of `x`'s segments: nothing to compute or move.
            (Op::Slice { .. }, Work::Slice) => {}
            (Op::ExpertCombine { routing, experts }, Work::Combine { routing: route, collects }) => {
                self.combine_experts(state, run, routing.index() as InstrIndex, experts, *route, collects, &segments)?
            }
            (_, work) => {
                return Err(ExecError::Malformed {
                    site: run.site.clone(),
                    problem: format!("its placement's work is {}", work_name(work)),
                })
            }
        }
        Ok(())
    }
}

fn check_count(run: &InstrRun, what: &str, found: usize, expected: usize) -> Result<(), ExecError> {
    if found == expected {
        return Ok(());
    }
    Err(ExecError::Malformed { site: run.site.clone(), problem: format!("{found} {what}, expected {expected}") })
}

fn work_name(work: &Work) -> &'static str {
    match work {
        Work::Embed { .. } => "Embed",
        Work::MatVec(_) => "MatVec",
        Work::Elementwise => "Elementwise",
        Work::Dispatch { .. } => "Dispatch",
        Work::Slice => "Slice",
        Work::RmsNorm(_) => "RmsNorm",
        Work::Attention(_) => "Attention",
        Work::Router { .. } => "Router",
        Work::Combine { .. } => "Combine",
    }
}
