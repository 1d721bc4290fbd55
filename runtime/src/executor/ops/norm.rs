//! RMS norm: per-segment partial sums of squares, reduced and broadcast per group, then scaled.

use rustc_hash::FxHashMap as HashMap;
use std::ops::Range;

use waferc_ir::wafer::{InstrIndex, NormPlacement, Pe, Phase, Segment};

use crate::executor::fabric::Payload;
use crate::executor::{intersect, relative, span, timing, Data, ExecError, Executor, Held, InstrRun, StepState};
use crate::kernels;

impl Executor<'_> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        x: InstrIndex,
        weight: u32,
        eps: f32,
        p: &NormPlacement,
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        let g = p.group_len;
        let weight_len = self.module.weights[waferc_ir::Handle::new(weight as usize)].ty.elements();
        if g == 0 || g != weight_len {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!("group length {g}, but the norm weight has {weight_len} elements"),
            });
        }
        run.begin(Phase::Compute);
        // Per segment: its x, and per group it touches (group, elements, partial sum of squares).
        let mut xs = Vec::with_capacity(segments.len());
        let mut parts: Vec<Vec<(u64, Range<u64>, Data)>> = Vec::with_capacity(segments.len());
        for segment in segments {
            let x_seg = self.operand(state, run, segment.pe, x, segment.elements.clone())?;
            let mut seg_parts = Vec::new();
            for group in segment.elements.start / g..segment.elements.end.div_ceil(g) {
                let range = intersect(&(group * g..(group + 1) * g), &segment.elements).expect("the group overlaps");
                let part = x_seg.slice(relative(&range, segment.elements.start));
                let partial = self.compute_data(1, || vec![kernels::sum_squares(part.values())]);
                run.compute(segment.pe, self.costs.fma(span(&range)));
                seg_parts.push((group, range, partial));
            }
            xs.push(x_seg);
            parts.push(seg_parts);
        }
        let segments_of = |group: u64| -> Vec<usize> {
            (0..segments.len()).filter(|&s| parts[s].iter().any(|(gr, _, _)| *gr == group)).collect()
        };

        // `1/rms` per (segment, group), from the local sum or the group's reduce + broadcast.
        let mut inverse: HashMap<(usize, u64), Data> = HashMap::default();
        run.begin(Phase::Reduce);
        let mut totals: HashMap<u64, (Pe, Data)> = HashMap::default();
        for routes in &p.group_routes {
            let members = segments_of(routes.group);
            let route = self.route(run, routes.reduce)?;
            for (&s, &source) in members.iter().zip(&route.sources) {
                if segments[s].pe != source {
                    return Err(ExecError::MalformedOnPe {
                        site: run.site.clone(),
                        pe: source,
                        problem: format!(
                            "reduction route {} lists it as a source of group {}, which is on {}",
                            routes.reduce, routes.group, segments[s].pe
                        ),
                    });
                }
            }
            let leaves = members
                .iter()
                .map(|&s| parts[s].iter().find(|(gr, _, _)| *gr == routes.group).expect("member").2.clone())
                .collect();
            totals.insert(routes.group, self.reduce(state, run, routes.reduce, leaves)?);
        }
        run.begin(Phase::Broadcast);
        for routes in &p.group_routes {
            let (root, total) = totals.remove(&routes.group).ok_or_else(|| ExecError::Malformed {
                site: run.site.clone(),
                problem: format!("group {} has more than one pair of reduce and broadcast routes", routes.group),
            })?;
            let r = self.compute_data(1, || vec![kernels::rms_inverse(total.values()[0], g as usize, eps)]);
            run.compute(root, self.costs.flops(timing::RMS_INVERSE_FLOPS));
            self.send(state, run, routes.broadcast, root, Payload::Data(r.clone()))?;
            for s in segments_of(routes.group) {
                // The root computed the statistic; the other segments receive it.
                let r = match segments[s].pe == root {
                    true => r.clone(),
                    false => self.receive_data(state, run, routes.broadcast, root, segments[s].pe, 1)?,
                };
                inverse.insert((s, routes.group), r);
            }
        }

        run.begin(Phase::Finish);
        let mut held = Vec::with_capacity(segments.len());
        for (s, segment) in segments.iter().enumerate() {
            let mut out = Vec::with_capacity(span(&segment.elements) as usize);
            for (group, range, partial) in &parts[s] {
                let r = match inverse.get(&(s, *group)) {
                    Some(r) => r.clone(),
                    None if segments_of(*group).len() == 1 => {
                        run.compute(segment.pe, self.costs.flops(timing::RMS_INVERSE_FLOPS));
                        self.compute_data(1, || vec![kernels::rms_inverse(partial.values()[0], g as usize, eps)])
                    }
                    None => {
                        return Err(ExecError::MalformedOnPe {
                            site: run.site.clone(),
                            pe: segment.pe,
                            problem: format!(
                                "group {group} spans several segments but has no reduce and broadcast routes"
                            ),
                        })
                    }
                };
                let cols = range.start - group * g..range.end - group * g;
                run.compute(segment.pe, self.costs.flops(2 * span(range)));
                if self.options.timing_only {
                    continue;
                }
                let region = self.find_weight_region(run, segment.pe, weight, 0, &cols)?;
                let scale = self.widen_from_region(run, segment.pe, region, 0, cols)?;
                let x_part = &xs[s].values()[relative(range, segment.elements.start)];
                let mut y = vec![0.0; x_part.len()];
                kernels::rms_scale(x_part, r.values()[0], &scale, &mut y);
                out.extend_from_slice(&y);
            }
            held.push(if self.options.timing_only {
                Data::Shape(span(&segment.elements) as usize)
            } else {
                Data::Values(out)
            });
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }
}
