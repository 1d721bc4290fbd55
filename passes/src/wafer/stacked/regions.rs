//! Units and their rectangles: the module cut into the prologue, layer groups and epilogue
//! ([`units`]), and each unit's share of the wafer laid out as rectangles in strips
//! ([`rectangles`], or [`exact_rectangles`] on a wafer the weights fill).

use std::ops::Range;

use waferc_ir::wafer::{Pe, TargetParams};
use waferc_ir::{Module, Op, ValueType};

use super::kv::KvShape;
use super::{vector_cut, F32, TILE_SHARE};
use crate::wafer::CompileOptions;

/// How steeply a unit's area grows with its arithmetic ([`area_shares`]). A square root would
/// minimise the units' summed arithmetic time (`fmas / area`, at a fixed total area), but a
/// layer's time is mostly latency that more area does not shorten, while an LM head's
/// reduction messages shrink with its area as its arithmetic does. Measured on SmolLM2
/// (`stacked:1,35,kv3`, wse3): exponent 0.5 gives 110,341 cycles a token, 0.6 110,296, 0.75
/// 109,945, 1.0 114,025.
pub(super) const ARITHMETIC_SHARE_EXPONENT: f64 = 0.75;

/// The share of a PE's usable SRAM a unit's weights and KV take on average at the fewest PEs
/// [`area_shares`] gives it: below [`TILE_SHARE`], since tiles are uneven (a row block or a
/// chunk more on some PEs) and vectors need room beside them (the 8B's `stacked:4` overflowed a
/// PE with its floors at [`TILE_SHARE`]). A model whose bytes fill its block beyond this (the
/// 8B on one WSE-3) gets areas in proportion to bytes.
pub(super) const FLOOR_FILL: f64 = 0.4;

/// The share of a PE's usable SRAM an embedding table's blocks may take on average: a row-block
/// cut serves every band of the table ([`super::Stacked::embed`]), and the smallest band may
/// have half the rows of the others.
pub(super) const EMBED_TABLE_SHARE: f64 = TILE_SHARE / 2.0;

/// A rectangle of PEs on one wafer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Rect {
    pub(super) wafer: u16,
    pub(super) x: u16,
    pub(super) y: u16,
    pub(super) w: u16,
    pub(super) h: u16,
}

impl Rect {
    pub(super) fn pes(&self) -> u64 {
        self.w as u64 * self.h as u64
    }

    /// The PE `dx` columns and `dy` rows from the north-west corner.
    pub(super) fn at(&self, dx: u64, dy: u64) -> Pe {
        Pe::new(self.wafer, self.x + dx as u16, self.y + dy as u16)
    }

    /// Cell `cell` of a column-major walk (down a column, then the next), wrapping around.
    pub(super) fn walk(&self, cell: u64) -> Pe {
        let cell = cell % self.pes().max(1);
        self.at(cell / self.h as u64, cell % self.h as u64)
    }

    /// [`Rect::walk`] with each column's cells starting at row `first` (and wrapping to its
    /// top).
    pub(super) fn walk_from(&self, cell: u64, first: u64) -> Pe {
        let h = self.h as u64;
        let cell = cell % self.pes().max(1);
        self.at(cell / h, (cell + first) % h)
    }

    /// Column `index` of `count` vertical strips.
    pub(super) fn column(&self, index: u64, count: u64) -> Rect {
        let w = self.w as u64;
        let (left, right) = (w * index / count, w * (index + 1) / count);
        Rect { x: self.x + left as u16, w: (right - left).max(1) as u16, ..*self }
    }

    /// Band `index` of `count` horizontal bands.
    pub(super) fn band(&self, index: u64, count: u64) -> Rect {
        let h = self.h as u64;
        let (top, bottom) = (h * index / count, h * (index + 1) / count);
        Rect { y: self.y + top as u16, h: (bottom - top).max(1) as u16, ..*self }
    }

    /// Whether `other` lies beside this rectangle on the same wafer: their columns do not
    /// overlap.
    pub(super) fn beside(&self, other: &Rect) -> bool {
        other.wafer == self.wafer && (other.x + other.w <= self.x || self.x + self.w <= other.x)
    }

    /// Every cell of the rectangle, as one run of its walk.
    pub(super) fn cells(&self) -> CellRun {
        CellRun { area: *self, start: 0, len: self.pes() }
    }

    /// Run `index` of `count` runs cutting the rectangle's walk ([`Rect::walk`]) into shares
    /// whose PEs differ by one at most: whole columns with a part of one at either end. Whole
    /// rows cannot share out PEs so evenly (a band of 7 rows against one of 8 holds a seventh
    /// more on each PE where every band holds the same bytes).
    pub(super) fn cell_run(&self, index: u64, count: u64) -> CellRun {
        let pes = self.pes();
        let (start, end) = (pes * index / count, pes * (index + 1) / count);
        CellRun { area: *self, start, len: (end - start).max(1) }
    }
}

/// A run of consecutive cells of a rectangle's walk ([`Rect::walk`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CellRun {
    area: Rect,
    start: u64,
    len: u64,
}

impl CellRun {
    pub(super) fn pes(&self) -> u64 {
        self.len
    }

    /// Cell `cell` of the run, wrapping around.
    pub(super) fn walk(&self, cell: u64) -> Pe {
        self.area.walk(self.start + cell % self.len.max(1))
    }
}

/// A run of instructions placed together, and what it holds.
pub(super) struct Unit {
    pub(super) instrs: Range<usize>,
    /// Weight bytes plus KV bytes: what the unit's rectangle must hold.
    pub(super) bytes: u64,
    /// Multiply-adds of its matvecs (every expert's, not only those a token picks): the
    /// arithmetic its rectangle shares out.
    pub(super) fmas: u64,
    /// The fewest PEs that hold its bytes with room for vectors ([`area_shares`]).
    pub(super) floor_pes: f64,
    /// The fewest PEs its rectangle may have: one instruction's result segments sit on
    /// distinct PEs (a PE sends one message per route), so the most segments any of its
    /// instructions is cut in.
    pub(super) min_pes: u64,
    /// Per attention, its KV heads and blocks per head (one PE per block).
    pub(super) attentions: Vec<KvShape>,
}

/// The prologue, the layer groups and the epilogue, with their bytes.
pub(super) fn units(module: &Module, options: &CompileOptions, usable: u64, layers_per_region: u16) -> Vec<Unit> {
    let n = module.body.len();
    let first = module.body.iter().position(|(_, ins)| ins.layer.is_some()).unwrap_or(n);
    let last = module.body.iter().rposition(|(_, ins)| ins.layer.is_some()).map_or(n, |i| i + 1);
    let group_of = |i: usize| -> u64 {
        match module.body[waferc_ir::Handle::new(i)].layer {
            Some(l) => l as u64 / layers_per_region.max(1) as u64,
            None => u64::MAX,
        }
    };
    let mut bounds = vec![0];
    if first > 0 && first < n {
        bounds.push(first);
    }
    let mut group = None;
    for i in first..last {
        let g = group_of(i);
        if g != u64::MAX {
            if group.is_some_and(|prev| prev != g) {
                bounds.push(i);
            }
            group = Some(g);
        }
    }
    if last < n && last > 0 {
        bounds.push(last);
    }
    bounds.push(n);
    bounds.dedup();
    bounds
        .windows(2)
        .map(|w| {
            let instrs = w[0]..w[1];
            let (mut bytes, mut table_bytes, mut fmas, mut attentions, mut min_pes) = (0, 0, 0, Vec::new(), 1);
            for i in instrs.clone() {
                min_pes = min_pes.max(result_segments(module, i));
                match &module.body[waferc_ir::Handle::new(i)].op {
                    Op::MatVec { weight, bias, .. } => {
                        bytes += weight_bytes(module, *weight) + bias.map_or(0, |b| weight_bytes(module, b));
                        fmas += module.weights[*weight].ty.shape.iter().product::<u64>();
                    }
                    Op::Embed { table } => table_bytes += weight_bytes(module, *table),
                    Op::Attention { .. } => {
                        if let Some(kv) = KvShape::of(module, i, options, usable) {
                            bytes += kv.kv_heads * kv.head_bytes();
                            attentions.push(kv);
                        }
                    }
                    _ => {}
                }
            }
            let usable = usable as f64;
            let floor_pes = (table_bytes as f64 / (EMBED_TABLE_SHARE * usable) + bytes as f64 / (FLOOR_FILL * usable))
                .max(min_pes as f64);
            Unit { instrs, bytes: bytes + table_bytes, fmas, floor_pes, min_pes, attentions }
        })
        .collect()
}

/// Bytes of a 2-D or 1-D weight at its storage type.
pub(super) fn weight_bytes(module: &Module, weight: waferc_ir::Handle<waferc_ir::Weight>) -> u64 {
    let w = &module.weights[weight];
    let cols = *w.ty.shape.last().unwrap_or(&0);
    let rows: u64 = w.ty.shape.iter().rev().skip(1).product();
    rows * w.ty.dtype.row_bytes(cols).unwrap_or(cols * F32)
}

/// The segments instruction `i`'s result is cut in: one per head for rope (whose operand, a
/// matvec's result, is cut the same way), else [`vector_cut`]'s.
pub(super) fn result_segments(module: &Module, i: usize) -> u64 {
    let ir = &module.body[waferc_ir::Handle::new(i)];
    let ValueType::Tensor(t) = &ir.ty else { return 1 };
    let len = t.elements();
    match &ir.op {
        Op::Rope { head_dim, .. } => len.div_ceil((*head_dim as u64).max(1)),
        _ => len.div_ceil(vector_cut(len)),
    }
}

/// The columns and rows of the block of `wafer_percent` of a wafer (both sides scaled alike).
pub(super) fn block_size(params: &TargetParams, wafer_percent: u8) -> (u64, u64) {
    let side = (wafer_percent.clamp(1, 100) as f64 / 100.0).sqrt();
    let scaled = |n: u16| ((n as f64 * side).round() as u64).clamp(1, n as u64);
    (scaled(params.grid_cols), scaled(params.grid_rows))
}

/// How the `pes` of a block are shared out among `units` (in PEs, before [`rectangles`] fits
/// them): each unit gets at least its `floor_pes` (its bytes at [`FLOOR_FILL`] of a PE's usable
/// SRAM, an embedding table's at [`EMBED_TABLE_SHARE`]), and beyond that shares in proportion to
/// its multiply-adds to the power [`ARITHMETIC_SHARE_EXPONENT`]. So a unit of much arithmetic
/// (an LM head as large as SmolLM2's) gets more PEs than its bytes would give it, and an
/// embedding, which only gathers a row, no more than its table needs. When the floors fill the
/// block, the shares are the bytes: area in proportion to bytes, as the tile budgets assume.
pub(super) fn area_shares(units: &[&Unit], pes: u64) -> Vec<u64> {
    let floors: Vec<f64> = units.iter().map(|u| u.floor_pes).collect();
    let weights: Vec<f64> = units.iter().map(|u| (u.fmas as f64).powf(ARITHMETIC_SHARE_EXPONENT)).collect();
    let filled = |lambda: f64| -> f64 { floors.iter().zip(&weights).map(|(f, w)| f.max(lambda * w)).sum() };
    let pes = pes as f64;
    if filled(0.0) >= pes || weights.iter().all(|&w| w == 0.0) {
        return units.iter().map(|u| u.bytes).collect();
    }
    // `filled` grows with `lambda`: bisect for the one that shares out the whole block.
    let (mut low, mut high) = (0.0f64, pes / weights.iter().cloned().fold(f64::MIN_POSITIVE, f64::max));
    for _ in 0..64 {
        let mid = (low + high) / 2.0;
        if filled(mid) > pes {
            high = mid;
        } else {
            low = mid;
        }
    }
    floors.iter().zip(&weights).map(|(f, w)| f.max(low * w).ceil() as u64).collect()
}

/// Wafer of each unit: consecutive units, the heaviest wafer's bytes least (`partition`).
pub(super) fn unit_wafers(units: &[Unit], wafers: u16) -> Vec<u16> {
    let bytes: Vec<u64> = units.iter().map(|u| u.bytes).collect();
    crate::wafer::partition::partition(&bytes, wafers, u64::MAX).unwrap_or_else(|| vec![0; units.len()])
}

/// How many vertical strips a `cols x rows` block is cut in for `units` units: strips about as
/// wide as a unit's square side.
pub(super) fn strip_count(cols: u64, rows: u64, units: usize) -> u64 {
    let typical = (cols * rows) / units.max(1) as u64;
    ((cols as f64 / (typical as f64).sqrt()).round() as u64).clamp(1, cols)
}

/// Rectangles for the units of one wafer, areas in proportion to their `shares`
/// ([`area_shares`]): the block of `wafer_percent` of the wafer at its north-west corner (both
/// sides scaled alike) is cut into vertical strips about as wide as a unit's square side, and
/// units fill the strips in a snake (down the first, up the next), so consecutive units are
/// neighbours; the units of a strip then share the rows it has left. A unit gets at least the
/// rows that hold its `min_pes`. `None` when the units do not fit the block.
pub(super) fn rectangles(
    params: &TargetParams,
    wafer_percent: u8,
    wafer: u16,
    shares: &[u64],
    min_pes: &[u64],
) -> Option<Vec<Rect>> {
    let (cols, rows) = block_size(params, wafer_percent);
    let total: u64 = shares.iter().sum::<u64>().max(1);
    let strips = strip_count(cols, rows, shares.len());
    let width = |s: u64| cols * (s + 1) / strips - cols * s / strips;
    let start = |s: u64| cols * s / strips;
    // Shrink the heights until the snake fits the strips (units never straddle two strips).
    let mut scale = 1.0f64;
    for _ in 0..64 {
        let mut out = Vec::with_capacity(shares.len());
        let (mut strip, mut used) = (0u64, 0u64);
        let mut fits = true;
        for (&share, &least) in shares.iter().zip(min_pes) {
            let mut placed = false;
            while strip < strips {
                let w = width(strip);
                let h = ((scale * (share as f64 / total as f64) * (cols * rows) as f64 / w as f64).floor() as u64)
                    .max(least.div_ceil(w).max(1));
                if used + h <= rows {
                    let y = if strip % 2 == 0 { used } else { rows - used - h };
                    out.push(Rect { wafer, x: start(strip) as u16, y: y as u16, w: w as u16, h: h as u16 });
                    used += h;
                    placed = true;
                    break;
                }
                strip += 1;
                used = 0;
            }
            if !placed {
                fits = false;
                break;
            }
        }
        if fits {
            stretch_strips(&mut out, rows);
            return Some(out);
        }
        scale *= 0.97;
    }
    None
}

/// Rectangles for the units of one wafer with areas in proportion to their `shares`, as near
/// as whole PEs allow: the block is cut into as many vertical strips as [`rectangles`] would
/// cut, consecutive units fill them in a snake, each strip as wide as its units' shares make it
/// and each unit as high as its share of the strip. `None` when a unit would get fewer PEs than
/// its `min_pes`.
pub(super) fn exact_rectangles(
    params: &TargetParams,
    wafer_percent: u8,
    wafer: u16,
    shares: &[u64],
    min_pes: &[u64],
) -> Option<Vec<Rect>> {
    let (cols, rows) = block_size(params, wafer_percent);
    let total: u64 = shares.iter().sum::<u64>().max(1);
    let strips = strip_count(cols, rows, shares.len()).min(shares.len().max(1) as u64);
    // Unit `k` goes to the strip holding the middle of its share of the running total.
    let mut before = 0u64;
    let strip_of: Vec<u64> = shares
        .iter()
        .map(|&share| {
            let middle = 2 * before + share;
            before += share;
            (middle * strips / (2 * total)).min(strips - 1)
        })
        .collect();
    let strip_share = |s: u64| -> u64 { shares.iter().zip(&strip_of).filter(|(_, &t)| t == s).map(|(&v, _)| v).sum() };
    // Strip edges at the running share of the columns.
    let mut edges = vec![0u64];
    let mut running = 0u64;
    for s in 0..strips {
        running += strip_share(s);
        edges.push(running * cols / total);
    }
    let mut out = Vec::with_capacity(shares.len());
    for s in 0..strips {
        let (x, w) = (edges[s as usize], edges[s as usize + 1] - edges[s as usize]);
        let members: Vec<u64> = strip_of.iter().zip(shares).filter(|(&t, _)| t == s).map(|(_, &v)| v).collect();
        let in_strip: u64 = members.iter().sum::<u64>().max(1);
        let mut acc = 0u64;
        let mut tops = Vec::with_capacity(members.len());
        for share in &members {
            let top = acc * rows / in_strip;
            acc += share;
            tops.push((top, acc * rows / in_strip - top));
        }
        for (top, h) in tops {
            // Down the even strips, up the odd ones, so consecutive units are neighbours.
            let y = if s % 2 == 0 { top } else { rows - top - h };
            out.push(Rect { wafer, x: x as u16, y: y as u16, w: w as u16, h: h as u16 });
        }
    }
    out.iter().zip(min_pes).all(|(rect, &least)| rect.pes() >= least.max(1)).then_some(out)
}

/// Gives the rows a strip has left once the snake is laid (units never straddle strips, so a
/// strip may end short by up to a unit's height) to the strip's units, in proportion to their
/// heights, keeping the snake's order and direction: no row of the block is left idle.
pub(super) fn stretch_strips(rects: &mut [Rect], rows: u64) {
    let mut start = 0;
    while start < rects.len() {
        let x = rects[start].x;
        let end = start + rects[start..].iter().take_while(|r| r.x == x).count();
        let strip = &mut rects[start..end];
        let down = strip.len() < 2 || strip[1].y > strip[0].y;
        let used: u64 = strip.iter().map(|r| r.h as u64).sum::<u64>().max(1);
        let (mut before, mut stretched_before) = (0u64, 0u64);
        for r in strip.iter_mut() {
            before += r.h as u64;
            let stretched = before * rows / used;
            r.h = (stretched - stretched_before) as u16;
            r.y = match down {
                true => stretched_before,
                false => rows - stretched,
            } as u16;
            stretched_before = stretched;
        }
        start = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs of the walk share out a rectangle's PEs within one of each other, every PE in one
    /// run; bands of whole rows cannot (the 70B's `stacked:5` embedding area, 398x125 in 16:
    /// bands of 7 and 8 rows, 2,786 and 3,184 PEs).
    #[test]
    fn cell_runs_share_out_a_rectangle_evenly() {
        let area = Rect { wafer: 0, x: 3, y: 5, w: 398, h: 125 };
        let runs: Vec<CellRun> = (0..16).map(|j| area.cell_run(j, 16)).collect();
        let sizes: Vec<u64> = runs.iter().map(CellRun::pes).collect();
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{sizes:?}");
        let mut seen: Vec<Pe> = runs.iter().flat_map(|run| (0..run.pes()).map(|c| run.walk(c))).collect();
        assert_eq!(seen.len() as u64, area.pes());
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len() as u64, area.pes(), "a PE in two runs");
        assert!(seen.iter().all(|pe| (3..401).contains(&pe.x) && (5..130).contains(&pe.y)));
        let bands: Vec<u64> = (0..16).map(|j| area.band(j, 16).pes()).collect();
        assert_eq!((bands.iter().min(), bands.iter().max()), (Some(&2_786), Some(&3_184)));
    }

    /// On a tight wafer every unit gets its share of the block, whatever strip it falls in: the
    /// 70B's `stacked:4` put five 4-layer units in two equal strips, three in one, and those
    /// three got 147k PEs against the other two's 221k.
    #[test]
    fn exact_rectangles_give_each_unit_its_share() {
        let params = waferc_targets::Target::wse3().params();
        let shares = [2_101, 7_021, 7_021, 7_021, 7_021, 7_021];
        let rects = exact_rectangles(&params, 100, 0, &shares, &[1; 6]).unwrap();
        let (cols, rows) = block_size(&params, 100);
        let total: u64 = shares.iter().sum();
        assert_eq!(rects.iter().map(Rect::pes).sum::<u64>(), cols * rows, "the block is not covered");
        for (rect, share) in rects.iter().zip(shares) {
            let exact = (share * cols * rows) as f64 / total as f64;
            assert!((rect.pes() as f64 - exact).abs() / exact < 0.02, "{rect:?} for share {share}");
        }
        for (a, ra) in rects.iter().enumerate() {
            for rb in &rects[a + 1..] {
                let apart = ra.x + ra.w <= rb.x || rb.x + rb.w <= ra.x || ra.y + ra.h <= rb.y || rb.y + rb.h <= ra.y;
                assert!(apart, "{ra:?} and {rb:?} overlap");
            }
        }
    }
}
