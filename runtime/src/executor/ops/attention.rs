//! Attention over the KV cache blocks: scores, then the maximum, the exponentials' sum and the
//! weighted values, each reduced across a KV head's blocks. A KV head held in slices of its head
//! dimension ([`KvHeadPlacement::dims`]) computes each slice's part of every score on the slice's
//! blocks and sums the parts across the slices, block by block, before the softmax, which every
//! slice then runs on the same scores; each slice's weighted values are its dims of the output.

use std::ops::Range;

use waferc_ir::wafer::{
    wide, AttentionPlacement, InstrIndex, KvHeadPlacement, Lanes, Pe, Phase, RegionKind, RouteId, Segment,
};

use super::check_count;
use crate::executor::fabric::Payload;
use crate::executor::sram::pe_image;
use crate::executor::{intersect, timing, Data, ExecError, Executor, Held, InstrRun, KvBlockState, StepState};
use crate::kernels;

/// One KV block's work in a step: its scores per query head it serves (whole, or a slice's parts
/// until they are summed), then their maximum.
struct BlockWork {
    pe: Pe,
    /// Rows the block holds this step: its slots `0..held`.
    held: usize,
    /// The lanes of its chunk it holds: its sums are their subtree of the lane combine.
    lanes: Lanes,
    scores: Vec<Vec<f32>>,
    local: Data,
}

/// Where this step's row goes: the cache's ring row, and how many rows are filled.
#[derive(Clone, Copy)]
struct Rows {
    position: u32,
    capacity: u32,
    row: u32,
    filled: u32,
}

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
        let position = self.position;
        // A windowed cache is a ring of `window` rows: position t lives in row t % window.
        let capacity = window.unwrap_or(u32::MAX);
        let rows =
            Rows { position, capacity, row: position % capacity, filled: position.saturating_add(1).min(capacity) };
        let mut heads_out: Vec<(Pe, Data, &KvHeadPlacement)> = Vec::with_capacity(p.kv_heads as usize);

        // The step's sequence attends over its own KV blocks only; a head's slices (placements of
        // the same KV head and query heads, one after another) run together.
        let placed: Vec<(usize, &KvHeadPlacement)> = p.heads_of(self.sequence).collect();
        for slices in placed.chunk_by(|(_, a), (_, b)| a.same_head(b)) {
            let mut slice_blocks = Vec::with_capacity(slices.len());
            for &head in slices {
                slice_blocks.push(self.block_scores(state, run, [q, k, v], head, p, rows, scale)?);
            }
            if slices.len() > 1 {
                self.sum_score_parts(state, run, slices, &mut slice_blocks, scale)?;
            }
            for (&(h_index, kh), mut blocks) in slices.iter().zip(slice_blocks) {
                let queries = kh.query_count() as usize;
                let dim = (kh.dims.end - kh.dims.start) as usize;
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
                let maxima = statistic(
                    state,
                    run,
                    Phase::AttentionMax,
                    kh.max_reduce,
                    kh.max_broadcast,
                    &blocks,
                    &with_sink_max,
                )?;

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
                    statistic(
                        state,
                        run,
                        Phase::AttentionSum,
                        kh.sum_reduce,
                        kh.sum_broadcast,
                        &blocks,
                        &with_sink_sum,
                    )?
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
                            kernels::weighted_sum_lanes(
                                &p,
                                values,
                                block.lanes,
                                &mut out[head * dim..(head + 1) * dim],
                            );
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
                            problem: format!(
                                "KV head {} has {} blocks but no output reduction",
                                kh.kv_head,
                                blocks.len()
                            ),
                        })
                    }
                };
                heads_out.push((root, total, kh));
            }
        }

        run.begin(Phase::Collect);
        let collects = self.attention_collects.get(&run.instr).cloned().unwrap_or_default();
        check_count(run, "collect routes", collects.len(), segments.len())?;
        let mut held = Vec::with_capacity(segments.len());
        for (segment, &id) in segments.iter().zip(&collects) {
            let mut parts = Vec::new();
            for (root, total, kh) in &heads_out {
                // A root sends one message: its pieces of the segment, in order (a slice holds its
                // dims of each query head).
                let dims = wide(&kh.dims);
                let width = dims.end - dims.start;
                let mut sent: Vec<Range<u64>> = Vec::new();
                for (j, piece) in kh.query_pieces(group as u64, p.head_dim as u64).enumerate() {
                    let Some(overlap) = intersect(&piece, &segment.elements) else { continue };
                    let at = j as u64 * width + (overlap.start - piece.start);
                    sent.push(at..at + (overlap.end - overlap.start));
                    parts.push((*root, overlap));
                }
                if !sent.is_empty() {
                    let message = self.compute_data(sent.iter().map(|r| (r.end - r.start) as usize).sum(), || {
                        sent.iter().flat_map(|r| total.values()[r.start as usize..r.end as usize].to_vec()).collect()
                    });
                    self.send(state, run, id, *root, Payload::Data(message))?;
                }
            }
            held.push(self.assemble(state, run, id, segment, parts)?);
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }

    /// The Compute phase of one KV head placement (`h_index` in `kv_heads_placed`): each block
    /// appends this step's key and value if it holds the row, then computes its scores (a
    /// slice: their parts over its dims, unscaled until summed) and, for whole heads, their
    /// maximum per query head.
    #[allow(clippy::too_many_arguments)]
    fn block_scores(
        &mut self,
        state: &mut StepState,
        run: &mut InstrRun,
        [q, k, v]: [InstrIndex; 3],
        (h_index, kh): (usize, &KvHeadPlacement),
        p: &AttentionPlacement,
        rows: Rows,
        scale: f32,
    ) -> Result<Vec<BlockWork>, ExecError> {
        let group = (p.heads / p.kv_heads) as u64;
        let head_dim = p.head_dim as u64;
        let h = kh.kv_head as u64;
        // The query heads these blocks serve: the whole group, or a copy's share of it.
        let queries = kh.query_count() as usize;
        let dims = wide(&kh.dims);
        let dim = (dims.end - dims.start) as usize;
        let whole = kh.whole_dims(head_dim);
        if queries == 0 || kh.query_heads.end as u64 > group || dim == 0 || dims.end > head_dim {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!(
                    "KV head {} serves query heads {:?} of its group with dims {:?} of {head_dim}",
                    kh.kv_head, kh.query_heads, kh.dims
                ),
            });
        }
        let kv_range = h * head_dim + dims.start..h * head_dim + dims.end;

        run.begin(Phase::Compute);
        let mut blocks = Vec::with_capacity(kh.blocks.len());
        for (b_index, block) in kh.blocks.iter().enumerate() {
            let region =
                pe_image(self.program, block.pe).and_then(|(_, image)| image.regions.get(block.region as usize));
            match region.map(|r| &r.kind) {
                Some(RegionKind::KvCache { kv_head, positions, lanes, dims })
                    if *kv_head == kh.kv_head
                        && *positions == block.positions
                        && *lanes == block.lanes
                        && *dims == kh.dims => {}
                _ => {
                    return Err(ExecError::MalformedOnPe {
                        site: run.site.clone(),
                        pe: block.pe,
                        problem: format!(
                            "region {} is not the KV cache of KV head {} positions {:?} {} dims {:?}",
                            block.region, kh.kv_head, block.positions, block.lanes, kh.dims
                        ),
                    })
                }
            }
            // The query heads it serves: whole, or its dims of each, head by head.
            let q_block: Vec<f32> = match whole {
                true => self.operand(state, run, block.pe, q, kh.query_elements(group, head_dim))?.values().to_vec(),
                false => {
                    let mut q_block = Vec::new();
                    for piece in kh.query_pieces(group, head_dim) {
                        q_block.extend_from_slice(self.operand(state, run, block.pe, q, piece)?.values());
                    }
                    q_block
                }
            };
            // Only the block whose rows hold this step's row appends.
            if block.holds(rows.row) {
                let k_new = self.operand(state, run, block.pe, k, kv_range.clone())?;
                let v_new = self.operand(state, run, block.pe, v, kv_range.clone())?;
                let cache = self.kv.entry((run.instr, h_index, b_index)).or_default();
                let slot = block.slot(rows.row);
                if self.options.timing_only {
                } else if rows.position < rows.capacity {
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
            let n = block.held_below(rows.filled) as usize;
            let scores: Vec<Vec<f32>> = if self.options.timing_only {
                Vec::new()
            } else {
                let empty = KvBlockState::default();
                let cache = self.kv.get(&(run.instr, h_index, b_index)).unwrap_or(&empty);
                (0..queries)
                    .map(|head| {
                        let q_head = &q_block[head * dim..(head + 1) * dim];
                        let key = |t: usize| &cache.keys[t * dim..(t + 1) * dim];
                        match whole {
                            true => (0..n).map(|t| kernels::attention_score(q_head, key(t), scale)).collect(),
                            false => (0..n).map(|t| kernels::attention_score_part(q_head, key(t))).collect(),
                        }
                    })
                    .collect()
            };
            // A slice's maximum waits for the summed scores (`sum_score_parts`).
            let local = match whole {
                true => self.compute_data(queries, || {
                    scores.iter().map(|s| s.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect()
                }),
                false => Data::Shape(0),
            };
            let scaling = if whole { self.costs.flops((n * queries) as u64) } else { 0 };
            run.compute(block.pe, self.costs.fma((n * queries * dim) as u64) + scaling);
            blocks.push(BlockWork { pe: block.pe, held: n, lanes: block.lanes, scores, local });
        }
        Ok(blocks)
    }

    /// The AttentionScore phase of a KV head held in `slices`: per block holding a position, the
    /// slices' parts of its scores summed across them by the chunk tree in dims order (each
    /// message the block's scores at the rows it holds so far) to the first slice's block,
    /// which sends the sums back to the others; every slice's block then scales them and takes
    /// their maximum per query head, as a whole head's block does.
    fn sum_score_parts(
        &mut self,
        state: &mut StepState,
        run: &mut InstrRun,
        slices: &[(usize, &KvHeadPlacement)],
        blocks: &mut [Vec<BlockWork>],
        scale: f32,
    ) -> Result<(), ExecError> {
        let first = slices[0].1;
        let queries = first.query_count() as usize;
        if first.score_reduce.len() != first.blocks.len() || first.score_broadcast.len() != first.blocks.len() {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!(
                    "KV head {} in {} slices has {} score sums and {} broadcasts for {} blocks",
                    first.kv_head,
                    slices.len(),
                    first.score_reduce.len(),
                    first.score_broadcast.len(),
                    first.blocks.len()
                ),
            });
        }
        run.begin(Phase::AttentionScore);
        for b in 0..first.blocks.len() {
            let held = blocks[0][b].held;
            if held == 0 {
                continue;
            }
            // The messages carry the rows held so far: a query head's parts at each, head by head
            // (`reduce_leading_carrying` refuses more than the route is sized for).
            let carried = queries * held;
            let leaves: Vec<Data> =
                blocks.iter().map(|slice| self.compute_data(carried, || slice[b].scores.concat())).collect();
            let (sum, broadcast) = (first.score_reduce[b], first.score_broadcast[b]);
            let (root, total) =
                self.reduce_leading_carrying(state, run, sum, leaves, slices.len(), Some(carried as u32))?;
            self.send(state, run, broadcast, root, Payload::Data(total.clone()))?;
            run.carried(broadcast, carried as u32);
            for slice in blocks.iter_mut() {
                let block = &mut slice[b];
                let sums = match block.pe == root {
                    true => total.clone(),
                    false => self.receive_data(state, run, broadcast, root, block.pe, carried)?,
                };
                if !self.options.timing_only {
                    block.scores = sums
                        .values()
                        .chunks(held)
                        .map(|row| row.iter().map(|&dot| kernels::scaled_score(dot, scale)).collect())
                        .collect();
                }
                let scores = &block.scores;
                block.local = self.compute_data(queries, || {
                    scores.iter().map(|s| s.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect()
                });
                run.compute(block.pe, self.costs.flops((held * queries) as u64));
            }
        }
        // Blocks holding no position yet keep empty scores; their maximum is unused (they send
        // nothing), but every block has one.
        for slice in blocks.iter_mut() {
            for block in slice.iter_mut().filter(|b| b.held == 0) {
                block.local = self.compute_data(queries, || vec![f32::NEG_INFINITY; queries]);
            }
        }
        Ok(())
    }
}
