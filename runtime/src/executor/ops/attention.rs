//! Attention over the KV cache blocks: scores, then the maximum, the exponentials' sum and the
//! weighted values, each reduced across a KV head's blocks.

use waferc_ir::wafer::{AttentionPlacement, InstrIndex, Lanes, Pe, Phase, RegionKind, RouteId, Segment};

use super::check_count;
use crate::executor::fabric::Payload;
use crate::executor::sram::pe_image;
use crate::executor::{
    intersect, relative, timing, Data, ExecError, Executor, Held, InstrRun, KvBlockState, StepState,
};
use crate::kernels;

impl Executor<'_> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &mut self,
        state: &mut StepState,
        run: &mut InstrRun,
        [q, k, v]: [InstrIndex; 3],
        scale: f32,
        window: Option<u32>,
        sinks: Option<u32>,
        p: &AttentionPlacement,
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        if p.kv_heads == 0 || p.heads % p.kv_heads != 0 {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!("{} heads do not share {} KV heads evenly", p.heads, p.kv_heads),
            });
        }
        let group = (p.heads / p.kv_heads) as usize;
        let dim = p.head_dim as usize;
        let position = self.position;
        // A windowed cache is a ring of `window` rows: position t lives in row t % window.
        let capacity = window.unwrap_or(u32::MAX);
        let row = position % capacity;
        let rows_filled = position.saturating_add(1).min(capacity);
        // Per KV head placement, per block: its query heads and scores, then exps, then outputs.
        struct BlockWork {
            pe: Pe,
            /// Rows the block holds this step: its slots `0..held`.
            held: usize,
            /// The lanes of its chunk it holds: its sums are their subtree of the lane combine.
            lanes: Lanes,
            scores: Vec<Vec<f32>>,
            local: Data,
        }
        let mut heads_out: Vec<(Pe, Data)> = Vec::with_capacity(p.kv_heads as usize);

        // The step's sequence attends over its own KV blocks only.
        for (h_index, kh) in p.heads_of(self.sequence) {
            let h = kh.kv_head as u64;
            // The query heads these blocks serve: the whole group, or a copy's share of it.
            let queries = kh.query_count() as usize;
            if queries == 0 || kh.query_heads.end as usize > group {
                return Err(ExecError::Malformed {
                    site: run.site.clone(),
                    problem: format!("KV head {} serves query heads {:?} of its group", kh.kv_head, kh.query_heads),
                });
            }
            let q_range = kh.query_elements(group as u64, dim as u64);
            let kv_range = h * dim as u64..(h + 1) * dim as u64;

            run.begin(Phase::Compute);
            let mut blocks = Vec::with_capacity(kh.blocks.len());
            for (b_index, block) in kh.blocks.iter().enumerate() {
                let region =
                    pe_image(self.program, block.pe).and_then(|(_, image)| image.regions.get(block.region as usize));
                match region.map(|r| &r.kind) {
                    Some(RegionKind::KvCache { kv_head, positions, lanes })
                        if *kv_head == kh.kv_head && *positions == block.positions && *lanes == block.lanes => {}
                    _ => {
                        return Err(ExecError::MalformedOnPe {
                            site: run.site.clone(),
                            pe: block.pe,
                            problem: format!(
                                "region {} is not the KV cache of KV head {} positions {:?} {}",
                                block.region, kh.kv_head, block.positions, block.lanes
                            ),
                        })
                    }
                }
                let q_block = self.operand(state, run, block.pe, q, q_range.clone())?;
                // Only the block whose rows hold this step's row appends.
                if block.holds(row) {
                    let k_new = self.operand(state, run, block.pe, k, kv_range.clone())?;
                    let v_new = self.operand(state, run, block.pe, v, kv_range.clone())?;
                    let cache = self.kv.entry((run.instr, h_index, b_index)).or_default();
                    let slot = block.slot(row);
                    if self.options.timing_only {
                    } else if position < capacity {
                        cache.keys.truncate(slot * dim);
                        cache.values.truncate(slot * dim);
                        cache.keys.extend_from_slice(k_new.values());
                        cache.values.extend_from_slice(v_new.values());
                    } else {
                        // The ring wrapped: overwrite the oldest row.
                        cache.keys[slot * dim..(slot + 1) * dim].copy_from_slice(k_new.values());
                        cache.values[slot * dim..(slot + 1) * dim].copy_from_slice(v_new.values());
                    }
                    run.compute(block.pe, self.costs.flops(2 * dim as u64));
                }
                let n = block.held_below(rows_filled) as usize;
                let scores: Vec<Vec<f32>> = if self.options.timing_only {
                    Vec::new()
                } else {
                    let empty = KvBlockState::default();
                    let cache = self.kv.get(&(run.instr, h_index, b_index)).unwrap_or(&empty);
                    (0..queries)
                        .map(|head| {
                            let q_head = &q_block.values()[head * dim..(head + 1) * dim];
                            (0..n)
                                .map(|t| kernels::attention_score(q_head, &cache.keys[t * dim..(t + 1) * dim], scale))
                                .collect()
                        })
                        .collect()
                };
                let local = self.compute_data(queries, || {
                    scores.iter().map(|s| s.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect()
                });
                run.compute(
                    block.pe,
                    self.costs.fma((n * queries * dim) as u64) + self.costs.flops((n * queries) as u64),
                );
                blocks.push(BlockWork { pe: block.pe, held: n, lanes: block.lanes, scores, local });
            }

            // Blocks holding a position this step (they come first, in position order); the rest
            // compute nothing and send nothing: the reductions skip them (bit-exact).
            let sending = blocks.iter().take_while(|b| b.held > 0).count().max(1);
            // The maximum, then the exponentials and their sum, then the weighted values: each a
            // tree reduction over the blocks (none with a single block) and, for the first two,
            // a broadcast of the result back to every block.
            let statistic = |state: &mut StepState,
                             run: &mut InstrRun,
                             phase: Phase,
                             reduce: Option<RouteId>,
                             broadcast: Option<RouteId>,
                             blocks: &[BlockWork],
                             at_root: &dyn Fn(Data) -> Data|
             -> Result<Vec<Data>, ExecError> {
                run.begin(phase);
                let mut leaves: Vec<Data> = blocks.iter().map(|b| b.local.clone()).collect();
                match (reduce, broadcast) {
                    (None, None) if blocks.len() == 1 => {
                        let only = leaves.remove(0);
                        Ok(vec![at_root(only)])
                    }
                    (Some(reduce), Some(broadcast)) => {
                        let (root, total) = self.reduce_leading(state, run, reduce, leaves, sending)?;
                        let total = at_root(total);
                        self.send(state, run, broadcast, root, Payload::Data(total.clone()))?;
                        blocks
                            .iter()
                            .map(|b| match b.pe == root {
                                true => Ok(total.clone()),
                                false => self.receive_data(state, run, broadcast, root, b.pe, queries),
                            })
                            .collect()
                    }
                    _ => Err(ExecError::Malformed {
                        site: run.site.clone(),
                        problem: format!(
                            "KV head {} has {} blocks but its {phase:?} routes are {reduce:?} and {broadcast:?}",
                            kh.kv_head,
                            blocks.len()
                        ),
                    }),
                }
            };
            // The sinks of this KV head's query heads, held by its first block (the reductions'
            // root): they join the maximum before it is broadcast, and the sum likewise. A
            // timing-only run has no SRAM to read them from (nor values to join them to), but
            // the placement must still hold them.
            let sink_values = match (sinks, blocks.first()) {
                (Some(weight), Some(first)) => {
                    let cols = kh.query_range(group as u64);
                    let region = self.find_weight_region(run, first.pe, weight, 0, &cols)?;
                    Some(match self.options.timing_only {
                        true => Vec::new(),
                        false => self.widen_from_region(run, first.pe, region, 0, cols)?,
                    })
                }
                _ => None,
            };
            let with_sink_max = |m: Data| match &sink_values {
                Some(sinks) => self.compute_data(queries, || {
                    m.values().iter().zip(sinks).map(|(&m, &s)| kernels::sink_max(m, s)).collect()
                }),
                None => m,
            };
            let maxima =
                statistic(state, run, Phase::AttentionMax, kh.max_reduce, kh.max_broadcast, &blocks, &with_sink_max)?;

            let mut numerators: Vec<Vec<Vec<f32>>> = Vec::with_capacity(blocks.len());
            for (block, max) in blocks.iter_mut().zip(&maxima) {
                let e: Vec<Vec<f32>> = if self.options.timing_only {
                    Vec::new()
                } else {
                    block.scores.iter().zip(max.values()).map(|(s, &m)| kernels::softmax_numerators(s, m)).collect()
                };
                let lanes = block.lanes;
                block.local =
                    self.compute_data(queries, || e.iter().map(|e| kernels::tree_sum_lanes(e, lanes)).collect());
                numerators.push(e);
            }
            // Charge the exponentials and the local sums to the AttentionSum phase.
            let sums = {
                run.begin(Phase::AttentionSum);
                for block in &blocks {
                    let n = (block.held * queries) as u64;
                    run.compute(block.pe, self.costs.flops(n * timing::EXP_FLOPS + n));
                }
                let root_max = maxima[0].clone();
                let with_sink_sum = |z: Data| match &sink_values {
                    Some(sinks) => self.compute_data(queries, || {
                        (z.values().iter().zip(sinks).zip(root_max.values()))
                            .map(|((&z, &s), &m)| kernels::sink_denominator(z, s, m))
                            .collect()
                    }),
                    None => z,
                };
                statistic(state, run, Phase::AttentionSum, kh.sum_reduce, kh.sum_broadcast, &blocks, &with_sink_sum)?
            };

            run.begin(Phase::AttentionOut);
            let mut outs = Vec::with_capacity(blocks.len());
            for (b_index, (block, (e, z))) in blocks.iter().zip(numerators.into_iter().zip(&sums)).enumerate() {
                let n = block.held;
                let out = self.compute_data(queries * dim, || {
                    let empty = KvBlockState::default();
                    let cache = self.kv.get(&(run.instr, h_index, b_index)).unwrap_or(&empty);
                    let mut out = vec![0.0; queries * dim];
                    for (head, (e, &z)) in e.into_iter().zip(z.values()).enumerate() {
                        let p = kernels::softmax_normalize(e, z);
                        let values = &cache.values[..p.len() * dim];
                        kernels::weighted_sum_lanes(&p, values, block.lanes, &mut out[head * dim..(head + 1) * dim]);
                    }
                    out
                });
                run.compute(
                    block.pe,
                    self.costs.flops((n * queries) as u64 * timing::DIVIDE_FLOPS)
                        + self.costs.fma((n * queries * dim) as u64),
                );
                outs.push(out);
            }
            let (root, total) = match kh.out_reduce {
                Some(id) => self.reduce_leading(state, run, id, outs, sending)?,
                None if blocks.len() == 1 => (blocks[0].pe, outs.swap_remove(0)),
                None => {
                    return Err(ExecError::Malformed {
                        site: run.site.clone(),
                        problem: format!("KV head {} has {} blocks but no output reduction", kh.kv_head, blocks.len()),
                    })
                }
            };
            heads_out.push((root, total));
        }

        run.begin(Phase::Collect);
        let collects = self.attention_collects.get(&run.instr).cloned().unwrap_or_default();
        check_count(run, "collect routes", collects.len(), segments.len())?;
        let mut held = Vec::with_capacity(segments.len());
        for (segment, &id) in segments.iter().zip(&collects) {
            let mut parts = Vec::new();
            for ((_, kh), (root, total)) in p.heads_of(self.sequence).zip(&heads_out) {
                let served = kh.query_elements(group as u64, dim as u64);
                let first = served.start;
                let Some(overlap) = intersect(&served, &segment.elements) else {
                    continue;
                };
                self.send(state, run, id, *root, Payload::Data(total.slice(relative(&overlap, first))))?;
                parts.push((*root, overlap));
            }
            held.push(self.assemble(state, run, id, segment, parts)?);
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }
}
