//! Column-aligned vectors: the MeshGEMV discipline inside the stacked plan.
//!
//! A matvec tiled in `P` interleaved panels needs its input's column block `c` on the `P`
//! adjacent PE columns from `c * P` of its area and nowhere else. A vector segment that sits in
//! one of those columns reaches its tiles by one multicast along its row inside them and down
//! them, which meets no multicast of another column block's segments. So a vector that feeds such matvecs (directly, or through the elementwise ops and
//! norms that run in place on it) can be cut as finely as the column blocks, and a few segments
//! finer per column, without its multicasts crossing: the elementwise ops and norms on it then
//! take a few dozen elements per PE instead of hundreds. Across two units (the residual stream
//! at a layer's end) the segments keep their column, so they cross to the next region on
//! parallel paths instead of queueing on one link.

use rustc_hash::FxHashSet as HashSet;
use std::collections::VecDeque;
use std::ops::Range;

use waferc_ir::wafer::{Pe, RegionKind, ResultLayout, Segment, VectorLayout};
use waferc_ir::Op;

use super::grid::Grid;
use super::{nearest_first, Stacked, CHUNK, F32, MAX_SEGMENTS};
use crate::wafer::place::unsupported;
use crate::wafer::place::Request;
use crate::wafer::WaferError;

/// The most segments of one vector per column block: each multicasts down all of the block's
/// columns, so they take a colour each there.
pub(super) const SEGMENTS_PER_COLUMN: u64 = 4;
/// The shortest segment of a matvec's result that reaches matvecs through elementwise ops alone
/// (a quarter chunk; an expert's, [`MIN_EXPERT_ELEMENTWISE_SEGMENT`]). A norm's partial sums must be whole chunks of the chunk tree, and an
/// attention output's collects crowd its KV band's colours, so only these get it: SiLU (13
/// flops an element) and the product before the down projection then run on up to four times
/// the PEs. Never shorter than the matvec's row block, whose root would otherwise feed several
/// segments (the 8B's gate/up collect went from 130 to 2,989 cycles).
const MIN_ELEMENTWISE_SEGMENT: u64 = CHUNK / 4;
/// [`SEGMENTS_PER_COLUMN`] for those segments: SmolLM2's SiLU on 8 elements instead of 16 saves
/// 105 cycles a layer.
const ELEMENTWISE_SEGMENTS_PER_COLUMN: u64 = 8;
/// [`MIN_ELEMENTWISE_SEGMENT`] for an expert's matvec (also at [`ELEMENTWISE_SEGMENTS_PER_COLUMN`]
/// a column): the experts of a layer share the columns, so their segments' routes crowd the
/// routers' colours (Qwen3-30B-A3B ran out of them with a quarter chunk). Eight half-chunk
/// segments a column halve Mixtral's SiLU (832 to 416 cycles a layer).
const MIN_EXPERT_ELEMENTWISE_SEGMENT: u64 = CHUNK / 2;
/// The fewest rows an expert's lane needs for its vectors to be column-aligned: each segment
/// takes a PE of its column in the lane, and a lane of a few rows (many experts, or a small
/// area) runs out of them; there the expert's vectors keep the general layout.
const MIN_ALIGNED_LANE_ROWS: u64 = 8;
/// How many values a search for a vector's consumers looks through before it gives up.
const SEARCH_LIMIT: usize = 64;

/// A matvec reading elements `base..base + cols` of a vector as its input, in column blocks
/// `width` elements wide, tiled as `grid`.
#[derive(Clone, Debug)]
struct Consumer {
    base: u64,
    cols: u64,
    width: u64,
    grid: Grid,
}

/// What reads a vector, looking through the elementwise ops and norms that run in place on it.
struct Consumers {
    matvecs: Vec<Consumer>,
    /// Whether a norm reads it on the way.
    through_norm: bool,
}

/// The vector ops that run on their operand's segments (elementwise ops and norms).
fn runs_in_place(op: &Op) -> bool {
    matches!(op, Op::Silu { .. } | Op::Mul { .. } | Op::Add { .. } | Op::SwiGlu { .. } | Op::RmsNorm { .. })
}

/// Column `j` (of [`MAX_SEGMENTS`], from the west edge) of an area `width` wide where the few
/// segments of a vector crossing regions go: evenly spread, and where
/// [`Stacked::balance_columns`] has the grids leave room for them.
pub(super) fn landing_column(j: u64, width: u64) -> u64 {
    (2 * j + 1) * width / (2 * MAX_SEGMENTS)
}

/// Which row of its column each segment of an aligned layout takes
/// ([`Stacked::aligned_layout`]), and for `Landing` which column.
pub(super) enum SegmentRows {
    /// The area's middle row: a norm on the segments then reduces and broadcasts along one row.
    Middle,
    /// The row its operand's data comes from when that row crosses the area (a region beside
    /// this one: the data moves straight along rows), else the middle row (a region above or
    /// below: the data moves straight down the columns).
    Arrival,
    /// Segment `k` of `n` at the middle of the `k`-th of `n` equal parts of these rows (from the
    /// area's north edge), rows the region beside shares, so each segment's multicast to it runs
    /// along a row of its own; and in a landing column ([`landing_column`]), where the grids
    /// left room, not its cut's column (its readers are in the other region). In one row, the
    /// 70B's `stacked:5` residual crossing to the next strip sent its 16 segments down the same
    /// links, 7.2k cycles of waiting.
    Landing(Range<u64>),
}

impl Stacked<'_> {
    /// The matvecs that read instruction `i`'s result, looking through the elementwise ops and
    /// norms that run in place on it (in `i`'s unit and the next), each with the elements it
    /// reads. `None` when something else reads it too (rope, attention, an expert, a router's
    /// top-k): then the vector keeps the plan's general layout.
    fn consumers(&mut self, i: usize) -> Option<Consumers> {
        let (module, analysis) = (self.placer.module, self.placer.analysis);
        let unit = self.unit_of[i];
        let mut found = Vec::new();
        // (value, where its element 0 lies in `i`'s result)
        let mut frontier = VecDeque::from([(i, 0u64)]);
        let mut seen = HashSet::default();
        let mut through_norm = false;
        while let Some((value, base)) = frontier.pop_front() {
            if !seen.insert((value, base)) {
                continue;
            }
            if seen.len() > SEARCH_LIMIT {
                return None;
            }
            for &reader in &analysis.readers[value] {
                let r = reader as usize;
                if self.unit_of[r] > unit + 1 {
                    continue;
                }
                let op = &module.body[waferc_ir::Handle::new(r)].op;
                let at = |operand: waferc_ir::Handle<waferc_ir::Instr>| {
                    (analysis.source[operand.index()] as usize == value)
                        .then(|| base + analysis.offset[operand.index()])
                };
                match op {
                    // The LM head laid side by side takes its input on a diagonal, not by its
                    // column blocks: a value aligned to them (the last residual add, through the
                    // final norm) spread its segments over the head's width, and the deliveries
                    // into it ran out of colours (the 8B's `stacked:4`).
                    Op::MatVec { .. } if self.lm_head_side_by_side(r) => return None,
                    op if runs_in_place(op) => {
                        through_norm |= matches!(op, Op::RmsNorm { .. });
                        for operand in op.operands() {
                            frontier.extend(at(operand).map(|b| (r, b)));
                        }
                    }
                    // An expert's matvecs read only its own vectors, inside its lane, when the
                    // lane has rows to spare for them.
                    Op::MatVec { x, weight, .. }
                        if analysis.expert[r] == analysis.expert[i]
                            && analysis.router[r] == analysis.router[i]
                            && (analysis.expert[r].is_none()
                                || self.area_of(r, self.unit_of[r]).0.h as u64 >= MIN_ALIGNED_LANE_ROWS) =>
                    {
                        let b = at(*x)?;
                        let (_, g) = self.matvec_grid(r, self.unit_of[r]).ok()?;
                        let cols = module.weights[*weight].ty.shape[1];
                        found.push(Consumer { base: b, cols, width: g.chunks_per_tile * CHUNK, grid: g });
                    }
                    _ => return None,
                }
            }
        }
        Some(Consumers { matvecs: found, through_norm })
    }

    /// Whether residual add `i` keeps its result in its region's middle row: when a norm reads
    /// it on the way to matvecs in this region. The norm's reduction and broadcast then run
    /// along one row instead of the region's diagonal, and its deliveries down the columns cover
    /// half the height; the add's matvec operand comes down its own column to it. Not at a
    /// region's last layer, whose residual crosses to the next region, nor at an add whose
    /// result the next residual add would have to fetch back from the middle row.
    pub(super) fn residual_in_middle_row(&mut self, i: usize) -> bool {
        let is_add = |r: usize| matches!(self.placer.module.body[waferc_ir::Handle::new(r)].op, Op::Add { .. });
        is_add(i)
            && !self.hosts_a_crossing(i)
            && self.placer.analysis.readers[i]
                .iter()
                .all(|&r| !is_add(r as usize) || !self.hosts_a_crossing(r as usize))
            && self.consumers(i).is_some_and(|c| c.through_norm)
    }

    /// Whether instruction `i`'s result reaches an MoE layer's experts (whose matvecs read it
    /// through `expert_dispatch`, which `readers` looks through) by the residual add and norm
    /// that run in place on it, in its own unit (see `central_diagonal`).
    pub(super) fn feeds_experts(&self, i: usize) -> bool {
        let (module, analysis) = (self.placer.module, self.placer.analysis);
        let mut stack = vec![i];
        let mut seen = HashSet::default();
        while let Some(value) = stack.pop() {
            if !seen.insert(value) || seen.len() > SEARCH_LIMIT {
                continue;
            }
            for &reader in &analysis.readers[value] {
                let r = reader as usize;
                if self.unit_of[r] != self.unit_of[i] {
                    continue;
                }
                match &module.body[waferc_ir::Handle::new(r)].op {
                    Op::MatVec { .. } if analysis.expert[r].is_some() => return true,
                    Op::Add { .. } | Op::RmsNorm { .. } => stack.push(r),
                    _ => {}
                }
            }
        }
        false
    }

    /// Whether norm `i` takes segments of its own in its region's middle row: when it reads a
    /// residual add of its own region that stays on its matvec's diagonal (the add before a
    /// region's last residual add, see [`Stacked::residual_in_middle_row`]). The add's result
    /// then comes along its columns to the norm, one more multicast per segment in a column of
    /// its own, and the norm reduces, broadcasts and delivers from one row instead of the
    /// diagonal (SmolLM2 at one layer a region: the second norm of a layer went from 410 to
    /// about 290 cycles).
    pub(super) fn norm_in_middle_row(&mut self, i: usize) -> bool {
        let module = self.placer.module;
        let Op::RmsNorm { x, .. } = &module.body[waferc_ir::Handle::new(i)].op else { return false };
        let source = self.placer.analysis.source[x.index()] as usize;
        self.unit_of[source] == self.unit_of[i]
            && matches!(module.body[waferc_ir::Handle::new(source)].op, Op::Add { .. })
            && !self.residual_in_middle_row(source)
    }

    /// Whether instruction `i`'s segments, or those of the vector ops that run in place on them
    /// (each on its newest operand's segments), are read in another unit: the residual stream
    /// at a region's last layer, which crosses to the next region.
    fn hosts_a_crossing(&self, i: usize) -> bool {
        let analysis = self.placer.analysis;
        let unit = self.unit_of[i];
        let mut stack = vec![i];
        let mut seen = HashSet::default();
        while let Some(value) = stack.pop() {
            if !seen.insert(value) {
                continue;
            }
            // A search that gives up answers as a crossing would: keep the general layout.
            if seen.len() > SEARCH_LIMIT {
                return true;
            }
            for &reader in &analysis.readers[value] {
                let r = reader as usize;
                if self.unit_of[r] != unit {
                    return true;
                }
                let hosted = self.placer.host_operand(r).is_some_and(|h| analysis.source[h] as usize == value);
                if hosted && runs_in_place(&self.placer.module.body[waferc_ir::Handle::new(r)].op) {
                    stack.push(r);
                }
            }
        }
        false
    }

    /// Instruction `i`'s `len`-element result cut to suit the matvecs that read it: segments of
    /// a column block, or a [`SEGMENTS_PER_COLUMN`]th of one (at least a chunk), each with its
    /// PE column in the area ([`Grid::chunk_column`] of its first chunk). A matvec's result that
    /// no norm reads is cut in an [`ELEMENTWISE_SEGMENTS_PER_COLUMN`]th, at least
    /// [`MIN_ELEMENTWISE_SEGMENT`] and the matvec's `row_block` rows (0 for other results). The
    /// first consumer (in program order, nearest first) that reads an element decides its
    /// segment. `None` when the result does not feed only matvecs, or some element feeds none.
    pub(super) fn aligned_cut(&mut self, i: usize, len: u64, row_block: u64) -> Option<Vec<(Range<u64>, u64)>> {
        let Consumers { matvecs: consumers, through_norm, .. } = self.consumers(i)?;
        let from_matvec = matches!(self.placer.module.body[waferc_ir::Handle::new(i)].op, Op::MatVec { .. });
        let expert = self.placer.analysis.expert[i].is_some();
        let (shortest, per_column) = match (from_matvec && !through_norm, expert) {
            (true, false) => {
                (MIN_ELEMENTWISE_SEGMENT.max(row_block.next_power_of_two()), ELEMENTWISE_SEGMENTS_PER_COLUMN)
            }
            (true, true) => (MIN_EXPERT_ELEMENTWISE_SEGMENT, ELEMENTWISE_SEGMENTS_PER_COLUMN),
            (false, _) => (CHUNK, SEGMENTS_PER_COLUMN),
        };
        let mut cut = Vec::new();
        let mut at = 0;
        while at < len {
            let c = consumers.iter().find(|c| c.base <= at && at < c.base + c.cols)?;
            let per_column = per_column.min(c.width / shortest).max(1);
            let piece = c.width / per_column;
            let offset = at - c.base;
            let end = (c.base + (offset / piece + 1) * piece).min(c.base + c.cols).min(len);
            cut.push((at..end, c.grid.chunk_column(offset / CHUNK, c.cols.div_ceil(CHUNK))));
            at = end;
        }
        Some(cut)
    }

    /// A PE in column `dx` of the unit's area with room for `bytes` more, not in `taken`: row
    /// `row` (clamped into the area) if it has room, else the nearest row of the column that
    /// has, else the same in the nearest column that has (on a tight wafer a column's tiles
    /// may leave no PE of it room for a long segment).
    pub(super) fn column_pe(
        &mut self,
        i: usize,
        unit: usize,
        dx: u64,
        row: u64,
        bytes: u64,
        taken: &HashSet<Pe>,
    ) -> Result<Pe, WaferError> {
        // An expert's vectors stay in its lane.
        let area = self.area_of(i, unit).0;
        let dx = dx % area.w as u64;
        for x in nearest_first(dx, area.w as u64) {
            for dy in nearest_first(row, area.h as u64) {
                let pe = area.at(x, dy);
                if self.claim_vector(pe, bytes, taken) {
                    return Ok(pe);
                }
            }
        }
        Err(unsupported(
            self.placer.module,
            i,
            format!("no PE of its {}x{} area has {bytes} bytes free (sought from column {dx})", area.w, area.h),
        ))
    }

    /// Fresh segments for `cut` (from [`Stacked::aligned_cut`]), each in its column, in the row
    /// `rows` gives it (see [`SegmentRows`]).
    pub(super) fn aligned_layout(
        &mut self,
        i: usize,
        unit: usize,
        cut: Vec<(Range<u64>, u64)>,
        rows: SegmentRows,
        extra: &dyn Fn(&Range<u64>) -> Vec<Request>,
    ) -> Result<VectorLayout, WaferError> {
        let area = self.area_of(i, unit).0;
        let mut layout = VectorLayout::default();
        let mut taken = HashSet::default();
        let count = cut.len() as u64;
        for (k, (seg, dx)) in cut.into_iter().enumerate() {
            let row = match &rows {
                SegmentRows::Middle => area.h as u64 / 2,
                SegmentRows::Arrival => self
                    .operand_pe(i, seg.start)
                    .filter(|pe| pe.wafer == area.wafer && (area.y..area.y + area.h).contains(&pe.y))
                    .map_or(area.h as u64 / 2, |pe| (pe.y - area.y) as u64),
                SegmentRows::Landing(shared) => {
                    shared.start + (2 * k as u64 + 1) * (shared.end - shared.start) / (2 * count.max(1))
                }
            };
            let dx = match &rows {
                SegmentRows::Landing(_) => landing_column(k as u64 * MAX_SEGMENTS / count.max(1), area.w as u64),
                _ => dx,
            };
            let mut requests = vec![(RegionKind::Output { elements: seg.clone() }, (seg.end - seg.start) * F32)];
            requests.extend(extra(&seg));
            let bytes = requests.iter().map(|(_, b)| b).sum();
            let pe = self.column_pe(i, unit, dx, row, bytes, &taken)?;
            taken.insert(pe);
            self.placer.fill(pe, i as u32, requests)?;
            layout.segments.push(Segment { pe, elements: seg });
        }
        Ok(layout)
    }

    /// The rows (from its area's north edge) that instruction `i`'s region shares with a
    /// reader's region beside it on the same wafer, if it has such a reader and they share any.
    pub(super) fn rows_shared_with_reader_beside(&self, i: usize) -> Option<Range<u64>> {
        let own = self.regions[self.unit_of[i]].as_ref()?.area;
        self.placer.analysis.readers[i].iter().find_map(|&r| {
            let other = self.regions[self.unit_of[r as usize]].as_ref()?.area;
            let (top, bottom) = (own.y.max(other.y), (own.y + own.h).min(other.y + other.h));
            (own.beside(&other) && top < bottom).then(|| (top - own.y) as u64..(bottom - own.y) as u64)
        })
    }

    /// Whether instruction `i` reads a value placed in an earlier unit whose region lies beside
    /// its own (the residual stream arriving along rows from the previous region).
    pub(super) fn reads_from_beside(&self, i: usize) -> bool {
        let (module, analysis) = (self.placer.module, self.placer.analysis);
        let unit = self.unit_of[i];
        let Some(own) = self.regions[unit].as_ref().map(|r| r.area) else { return false };
        module.body[waferc_ir::Handle::new(i)].op.operands().into_iter().any(|operand| {
            let from = self.unit_of[analysis.source[operand.index()] as usize];
            let Some(other) = self.regions[from].as_ref().map(|r| r.area) else { return false };
            from < unit && own.beside(&other)
        })
    }

    /// The PE holding element `element` of instruction `i`'s first vector operand from an
    /// earlier unit, else of its first vector operand.
    pub(super) fn operand_pe(&self, i: usize, element: u64) -> Option<Pe> {
        let (module, analysis) = (self.placer.module, self.placer.analysis);
        let mut operands = module.body[waferc_ir::Handle::new(i)].op.operands();
        let unit = self.unit_of[i];
        operands.sort_by_key(|operand| self.unit_of[analysis.source[operand.index()] as usize] >= unit);
        operands.into_iter().find_map(|operand| {
            let source = analysis.source[operand.index()] as usize;
            let at = element + analysis.offset[operand.index()];
            match &self.placer.placements.get(source)?.result {
                ResultLayout::Vector(layout) => layout.overlapping(at..at + 1).next().map(|(s, _)| s.pe),
                ResultLayout::Routing { .. } => None,
            }
        })
    }
}
