//! Mixture of experts: the router's top-k decision, and the weighted combine of the chosen
//! experts' outputs.

use waferc_ir::wafer::profile::timing_picks;
use waferc_ir::wafer::{InstrIndex, Pe, Phase, ResultLayout, RouteId, Segment};
use waferc_ir::ValueType;

use super::check_count;
use crate::executor::fabric::Payload;
use crate::executor::{intersect, relative, span, timing, ExecError, Executor, Held, InstrRun, StepState};
use crate::kernels::{self, Routing};

impl Executor<'_> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn router(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        logits: InstrIndex,
        top_k: u32,
        normalize: bool,
        pe: Pe,
        route: RouteId,
    ) -> Result<(), ExecError> {
        let experts = match &self.module.body[waferc_ir::Handle::new(logits as usize)].ty {
            ValueType::Tensor(t) => t.elements(),
            ValueType::Routing { .. } => 0,
        };
        run.begin(Phase::Compute);
        let x = self.operand(state, run, pe, logits, 0..experts)?;
        let routing = if self.options.timing_only {
            // No values: the routing profile's expected picks for this layer and position (a
            // uniform router's without a profile), equally weighted; which experts are picked
            // decides how far their outputs travel to the combine, and which PEs they share.
            let weight = 1.0 / top_k as f32;
            let profile = self.program.routing_profile.as_ref();
            let layer = run.site.layer.unwrap_or(0);
            let chosen = timing_picks(profile, layer, experts as u32, top_k, self.position);
            Routing { experts: experts as usize, chosen: chosen.into_iter().map(|e| (e, weight)).collect() }
        } else {
            if top_k == 0 || top_k as u64 > experts {
                return Err(ExecError::Malformed {
                    site: run.site.clone(),
                    problem: format!("top {top_k} of {experts} experts"),
                });
            }
            kernels::router_topk(x.values(), top_k as usize, normalize)
        };
        // A scan of the logits for the top k, then an exponential and a division per weight:
        // for the chosen experts only when normalising (`kernels::router_topk`).
        let weights = if normalize { top_k as u64 } else { experts };
        run.compute(pe, self.costs.flops(experts + weights * (timing::EXP_FLOPS + timing::DIVIDE_FLOPS)));
        state.held[run.instr as usize] = Held::Routing(routing.clone());
        run.begin(Phase::Deliver);
        // The expert copies serving this step learn the decision on their own routes.
        for (id, copies) in self.copy_inputs.get(&run.instr).map_or(&[][..], Vec::as_slice) {
            if self.serves(copies) {
                self.send(state, run, *id, pe, Payload::Routing(routing.clone()))?;
            }
        }
        self.send(state, run, route, pe, Payload::Routing(routing))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn combine_experts(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        routing_value: InstrIndex,
        experts: &[waferc_ir::Value],
        routing_route: RouteId,
        collects: &[RouteId],
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        check_count(run, "collect routes", collects.len(), segments.len())?;
        let ResultLayout::Routing { pe: router } = self.program.instrs[routing_value as usize].result else {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: "its routing operand is not a routing".into(),
            });
        };
        run.begin(Phase::Gather);
        // The experts' PEs send what they hold (unchosen experts hold nothing and stay silent).
        for (segment, &id) in segments.iter().zip(collects) {
            for &expert_value in experts {
                let value = expert_value.index();
                let (Held::Segments(held), ResultLayout::Vector(layout)) =
                    (&state.held[value], &self.placement(value as InstrIndex).result)
                else {
                    continue;
                };
                let held = held.clone();
                for (source, data) in layout.segments.iter().zip(&held) {
                    if let Some(overlap) = intersect(&source.elements, &segment.elements) {
                        let part = data.slice(relative(&overlap, source.elements.start));
                        self.send(state, run, id, source.pe, Payload::Data(part))?;
                        let (ready, _) = self.done_cycle(state, value as InstrIndex, run.instr);
                        run.reached(id, source.pe, self.costs.hop_latency(source.pe, segment.pe), ready);
                    }
                }
            }
        }
        let mut held = Vec::with_capacity(segments.len());
        let mut received = Vec::with_capacity(segments.len());
        for (segment, &id) in segments.iter().zip(collects) {
            let routing = self.receive_routing(state, run, routing_route, router, segment.pe)?.clone();
            let mut weighted = Vec::with_capacity(routing.chosen.len());
            for &(expert, weight) in &routing.chosen {
                let value = experts.get(expert as usize).ok_or_else(|| ExecError::Malformed {
                    site: run.site.clone(),
                    problem: format!("the routing chose expert {expert} of {}", experts.len()),
                })?;
                let ResultLayout::Vector(layout) = &self.placement(value.index() as InstrIndex).result else {
                    return Err(ExecError::Malformed {
                        site: run.site.clone(),
                        problem: format!("expert {expert}'s output is not a vector"),
                    });
                };
                let parts = layout
                    .overlapping(segment.elements.clone())
                    .map(|(source, overlap)| (source.pe, overlap))
                    .collect();
                weighted.push((weight, self.assemble(state, run, id, segment, parts)?));
            }
            received.push((routing, weighted));
        }
        run.begin(Phase::Compute);
        for (segment, (routing, weighted)) in segments.iter().zip(received) {
            let n = span(&segment.elements) as usize;
            held.push(self.compute_data(n, || {
                let inputs: Vec<(f32, &[f32])> = weighted.iter().map(|(w, d)| (*w, d.values())).collect();
                let mut out = vec![0.0; n];
                kernels::expert_combine(&inputs, &mut out);
                out
            }));
            run.compute(segment.pe, self.costs.fma((routing.chosen.len() * n) as u64));
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }
}
