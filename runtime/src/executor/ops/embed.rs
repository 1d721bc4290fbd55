//! Embedding lookup: the blocks holding the token's row send their elements to the result segments.

use waferc_ir::wafer::{EmbedBlock, Phase, RouteId, Segment};

use super::check_count;
use crate::executor::fabric::Payload;
use crate::executor::{intersect, span, Data, ExecError, Executor, Held, InstrRun, StepState};

impl Executor<'_> {
    pub(super) fn embed(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        table: u32,
        blocks: &[EmbedBlock],
        collects: &[RouteId],
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        let rows = self.module.weights[waferc_ir::Handle::new(table as usize)].ty.shape[0];
        let token = state.token as u64;
        if token >= rows {
            return Err(ExecError::TokenOutOfRange { site: run.site.clone(), token: state.token, rows });
        }
        check_count(run, "collect routes", collects.len(), segments.len())?;
        run.begin(Phase::Gather);
        let mut held = Vec::with_capacity(segments.len());
        for (segment, &id) in segments.iter().zip(collects) {
            let mut parts = Vec::new();
            for block in blocks.iter().filter(|b| b.rows.contains(&token)) {
                let Some(overlap) = intersect(&block.elements, &segment.elements) else { continue };
                let data = if self.options.timing_only {
                    Data::Shape(span(&overlap) as usize)
                } else {
                    let region = self.find_weight_region(run, block.pe, table, token, &block.elements)?;
                    Data::Values(self.widen_from_region(run, block.pe, region, token, overlap.clone())?)
                };
                run.compute(block.pe, self.costs.flops(span(&overlap)));
                self.send(state, run, id, block.pe, Payload::Data(data))?;
                parts.push((block.pe, overlap));
            }
            held.push(self.assemble(state, run, id, segment, parts)?);
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }
}
