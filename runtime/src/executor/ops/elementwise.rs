//! Elementwise ops (silu, mul, add, swiglu, rope), each computed on its result segment's PE.

use waferc_ir::wafer::{rope_twin, InstrIndex, Phase, Segment};
use waferc_ir::Op;

use crate::executor::{relative, span, timing, ExecError, Executor, Held, InstrRun, StepState};
use crate::kernels::{self, RopeAngles};

impl Executor<'_> {
    pub(super) fn elementwise(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        op: &Op,
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        run.begin(Phase::Compute);
        let angles = self.rope_frequencies[run.instr as usize]
            .as_ref()
            .map(|freqs| RopeAngles::new(freqs, self.position as usize));
        let mut held = Vec::with_capacity(segments.len());
        for segment in segments {
            let n = span(&segment.elements) as usize;
            let (data, flops) = match op {
                Op::Silu { x } => {
                    let x = self.operand(state, run, segment.pe, x.index() as InstrIndex, segment.elements.clone())?;
                    (self.compute_data(n, || kernels::silu(x.values())), timing::SILU_FLOPS)
                }
                Op::Mul { a, b } | Op::Add { a, b } => {
                    let a = self.operand(state, run, segment.pe, a.index() as InstrIndex, segment.elements.clone())?;
                    let b = self.operand(state, run, segment.pe, b.index() as InstrIndex, segment.elements.clone())?;
                    let data = self.compute_data(n, || match op {
                        Op::Mul { .. } => kernels::mul(a.values(), b.values()),
                        _ => kernels::add(a.values(), b.values()),
                    });
                    (data, 1)
                }
                Op::SwiGlu { gate, up, alpha, limit } => {
                    let g =
                        self.operand(state, run, segment.pe, gate.index() as InstrIndex, segment.elements.clone())?;
                    let u = self.operand(state, run, segment.pe, up.index() as InstrIndex, segment.elements.clone())?;
                    let data = self.compute_data(n, || kernels::swiglu(g.values(), u.values(), *alpha, *limit));
                    // SiLU's cost plus the two clamps, the `+ 1` and the product.
                    (data, timing::SILU_FLOPS + 4)
                }
                Op::Rope { x, head_dim, .. } => {
                    let (dim, x) = (*head_dim as u64, x.index() as InstrIndex);
                    let data = match rope_twin(&segment.elements, dim) {
                        // A part of one half of a head: with its twin half a head away.
                        Some(twin) => {
                            let own = self.operand(state, run, segment.pe, x, segment.elements.clone())?;
                            let other = self.operand(state, run, segment.pe, x, twin)?;
                            self.compute_data(n, || {
                                let angles = angles.as_ref().expect("rope instructions have frequencies");
                                let mut out = vec![0.0; n];
                                let start = (segment.elements.start % dim) as usize;
                                kernels::rope_part(own.values(), other.values(), angles, start, &mut out);
                                out
                            })
                        }
                        // A head's halves rotate together: compute the whole heads the segment touches.
                        None => {
                            let heads = segment.elements.start / dim * dim..segment.elements.end.div_ceil(dim) * dim;
                            let x = self.operand(state, run, segment.pe, x, heads.clone())?;
                            self.compute_data(n, || {
                                let angles = angles.as_ref().expect("rope instructions have frequencies");
                                let mut out = vec![0.0; span(&heads) as usize];
                                kernels::rope(x.values(), angles, &mut out);
                                out[relative(&segment.elements, heads.start)].to_vec()
                            })
                        }
                    };
                    (data, timing::ROPE_FLOPS)
                }
                _ => unreachable!("elementwise() is only called for silu, mul, add, swiglu and rope"),
            };
            run.compute(segment.pe, self.costs.flops(n as u64 * flops));
            held.push(data);
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }
}
