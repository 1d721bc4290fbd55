//! Attention in the stacked plan: each KV head's cache in blocks in the region's KV strip
//! (a band of rows per KV head, copies and slices in rows and columns of their own), and the
//! rows of the queries, keys and values that go to them.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::ops::Range;

use waferc_ir::wafer::{
    AttentionPlacement, KvBlock, KvHeadPlacement, Lanes, Pe, Plan, RegionKind, ResultLayout, Segment, VectorLayout,
    Work,
};
use waferc_ir::{Module, Op};

use super::regions::Rect;
use super::{merge_pieces, nearest_first, Stacked, CHUNK, F32, MAX_ALIGNED_PER_BAND};
use crate::wafer::place::{kv_block_requests, slices_suit, unsupported, KvBlockShape};
use crate::wafer::size::kv_block_bytes;
use crate::wafer::{CompileOptions, WaferError};

/// How an attention's KV cache is cut into blocks.
#[derive(Clone, Copy, Debug)]
pub(super) struct KvShape {
    pub(super) kv_heads: u64,
    pub(super) head_dim: u64,
    pub(super) q_per_kv: u64,
    /// Copies of each head's cache (`Plan::Stacked::kv_copies`), each serving an equal share of
    /// its query heads.
    pub(super) copies: u64,
    /// Slices of each copy's head dimension (`Plan::Stacked::kv_slices`), each on blocks of its
    /// own holding `head_dim / slices` elements of every position.
    pub(super) slices: u64,
    /// Positions the cache keeps: the capacity, or the window when it is shorter.
    pub(super) positions: u64,
    pub(super) positions_per_block: u64,
    /// PEs each block's positions are spread over by lane (`Plan::Stacked::kv_spread`):
    /// a block of 32 positions on each, holding `32 / spread` of them.
    pub(super) spread: u64,
    /// Sequences in flight, each with blocks of its own.
    pub(super) sequences: u64,
}

impl KvShape {
    /// `None` when 32 positions of a head do not fit one PE.
    pub(super) fn of(module: &Module, i: usize, options: &CompileOptions, usable: u64) -> Option<KvShape> {
        let Op::Attention { cache, heads, window, .. } = &module.body[waferc_ir::Handle::new(i)].op else {
            return None;
        };
        let c = &module.caches[*cache];
        let (head_dim, q_per_kv) = (c.head_dim as u64, (*heads / c.kv_heads) as u64);
        // A count that does not divide the query heads is refused when the attention is placed.
        let (copies, spread, slices) = match options.plan {
            Plan::Stacked { kv_copies, kv_spread, kv_slices, .. } => {
                ((kv_copies as u64).max(1), (kv_spread as u64).max(1), (kv_slices as u64).max(1))
            }
            _ => (1, 1, 1),
        };
        // Slices that do not cut the head in whole chunks are refused when the attention is placed.
        let dims = (head_dim / slices).max(1);
        // A windowed cache keeps only the window's rows.
        let positions = window.map_or(options.max_context as u64, |w| (w as u64).min(options.max_context as u64));
        let queries = (q_per_kv / copies).max(1);
        // Lane groups cut one chunk each (`Lanes`).
        let positions_per_block = match spread {
            1 => max_positions_per_block(dims, queries, positions, usable)?,
            _ => (kv_block_bytes(CHUNK / spread, dims, queries) <= usable).then_some(CHUNK)?,
        };
        Some(KvShape {
            kv_heads: c.kv_heads as u64,
            head_dim,
            q_per_kv,
            copies,
            slices,
            positions,
            positions_per_block,
            spread,
            sequences: options.max_sequences.max(1) as u64,
        })
    }

    /// The shape with blocks of `positions` (at most [`max_positions_per_block`]'s). A head cut in
    /// slices takes blocks of at least 32 positions a slice, so its slices take no more PEs than
    /// its whole head would: each block holds a slice's dims of `slices` times the positions.
    pub(super) fn with_block(self, positions: u64) -> KvShape {
        let positions = positions.max(CHUNK * self.slices).min(self.positions_per_block);
        KvShape { positions_per_block: positions, ..self }
    }

    /// Blocks of each head's copy: its chunk runs, each cut in its lane groups.
    pub(super) fn blocks_per_head(&self) -> u64 {
        self.positions.div_ceil(self.positions_per_block) * self.spread
    }

    /// The rows block `b` of a head's copy holds: its chunk run and lanes.
    pub(super) fn block(&self, b: u64) -> (Range<u32>, Lanes) {
        let (run, group) = (b / self.spread, b % self.spread);
        let per = self.positions_per_block;
        let positions = (run * per) as u32..((run + 1) * per).min(self.positions) as u32;
        (positions, Lanes::group(group as u8, self.spread as u8))
    }

    /// The query heads each copy serves.
    pub(super) fn queries_per_copy(&self) -> u64 {
        self.q_per_kv / self.copies
    }

    /// Elements of each head vector a slice holds.
    pub(super) fn slice_dims(&self) -> u64 {
        self.head_dim / self.slices
    }

    /// Bytes of one head's blocks, over its copies, slices and sequences.
    pub(super) fn head_bytes(&self) -> u64 {
        let block = kv_block_bytes(self.positions_per_block / self.spread, self.slice_dims(), self.queries_per_copy());
        self.sequences * self.copies * self.slices * self.blocks_per_head() * block
    }

    /// Columns of a KV strip `height` rows high holding every head's blocks (of every sequence,
    /// copy and slice) in a band of its own, each copy in rows of its own where the band has a
    /// row for each ([`KvShape::row_copies`]), each slice in columns of its own
    /// ([`KvShape::group_rect`]).
    pub(super) fn columns(&self, height: u64) -> Option<u64> {
        let band = height / self.kv_heads.max(1);
        let row_copies = self.row_copies(band);
        let rows = band / row_copies;
        (rows > 0)
            .then(|| self.slices * (self.sequences * self.copies / row_copies * self.blocks_per_head()).div_ceil(rows))
    }

    /// The copies of a head's cache that get rows of their own in its `band`-row band: all of
    /// them where the band has a row for each, else one (the copies then follow one another in
    /// the band's walk). Each copy's query heads then enter its own rows, at their top and
    /// bottom, and reach only its blocks. With the copies one after another in the band's
    /// columns, the query heads entering at one edge went down the same columns one after
    /// another, and the key behind them: the 8B's `stacked:4,100,kv2` delivered its queries
    /// with 128 cycles waiting and its keys with 256, in rows of their own with none and 128
    /// (351,057 -> 346,241 cycles a token; SmolLM2 `stacked:1,35,kv3` 109,810 -> 107,398;
    /// Qwen3-30B-A3B `stacked:2,100,kv8,share4` 725,150 -> 716,174).
    pub(super) fn row_copies(&self, band: u64) -> u64 {
        match band >= self.copies {
            true => self.copies,
            false => 1,
        }
    }

    /// The rows of a head's `band` that hold copy `copy`'s blocks ([`KvShape::row_copies`]).
    pub(super) fn copy_rows(&self, band: Rect, copy: u64) -> Rect {
        let row_copies = self.row_copies(band.h as u64);
        band.band(copy % row_copies, row_copies)
    }

    /// Where slice `slice` of copy `copy` sits in a head's `band`: the copy's rows, cut in
    /// columns, a slice to each. Block `b` of every slice then sits at the same place in its
    /// columns, so the sum of its slices' score parts runs along one row, beside the other rows'
    /// (slices in rows of their own put the sums of a column's blocks on one line, and a strip
    /// of the 70B's ran out of colours).
    pub(super) fn group_rect(&self, band: Rect, copy: u64, slice: u64) -> Rect {
        self.copy_rows(band, copy).column(slice, self.slices)
    }

    /// The blocks of a slice in a copy's rows (in a band of `band_rows`), walked from
    /// [`KvShape::first_block_row`].
    fn block_cells(&self, band_rows: u64) -> u64 {
        self.sequences * self.copies / self.row_copies(band_rows) * self.blocks_per_head()
    }

    /// How many of a copy's query heads enter its sliced blocks from above, and how many from
    /// below ([`KvShape::query_row`]).
    fn query_sides(&self) -> (u64, u64) {
        let per_copy = self.queries_per_copy().max(1);
        (per_copy / 2, per_copy - per_copy / 2)
    }

    /// The row (from the top of a copy's `rows` rows, in a band of `band_rows`) of each slice's
    /// first block, where its reductions end and its output leaves; the others follow it down
    /// the column, wrapping to the top. The middle row, so the first block has rows both ways;
    /// for a head cut in slices, as near it as leaves a row below the blocks for each query
    /// head that enters them from below ([`KvShape::query_row`]), where the rows allow: in the
    /// 70B's first two and last two regions (which share their wafers with the embedding and the
    /// LM head) the bands are under 72 rows, whose middle left fewer than four rows below 32
    /// blocks, and their queries' deliveries waited as before the split (865-1,014 cycles against
    /// about 530).
    pub(super) fn first_block_row(&self, rows: u64, band_rows: u64) -> u64 {
        let middle = rows / 2;
        let (upper, lower) = self.query_sides();
        let cells = self.block_cells(band_rows);
        match self.slices > 1 && upper > 0 && upper + cells + lower <= rows {
            true => middle.min(rows - cells - lower),
            false => middle,
        }
    }

    /// Where the segment of query head `query` of a copy's group sits, for a head cut in slices:
    /// the row preferred and, where the queries split, the rows of its side (both from the top of
    /// the copy's `rows` rows, in a band of `band_rows`). Every block of a slice receives every
    /// query head's dims along its slice's columns, so a column's links carry all the queries
    /// entering from one side. Where the blocks ([`KvShape::first_block_row`]) fill less than
    /// the rest of their column and both sides have a row for each of their queries, half the
    /// queries sit above the blocks and half below, spread over those rows, and each column link
    /// carries half of them (the 70B's `stacked:5,100,slice4`: eight query heads of 64 elements a
    /// multicast down one column, 512 cycles of one link, and 607 cycles of its key's delivery
    /// waiting). Else they spread over all the rows.
    pub(super) fn query_row(&self, rows: u64, band_rows: u64, query: u64) -> (u64, Option<Range<u64>>) {
        let spread =
            |side: &Range<u64>, nth: u64, of: u64| side.start + (side.end - side.start) * (2 * nth + 1) / (2 * of);
        let cells = self.block_cells(band_rows);
        let first_block = self.first_block_row(rows, band_rows);
        let (above, below) = (0..first_block, (first_block + cells).min(rows)..rows);
        let (upper, lower) = self.query_sides();
        let split = upper > 0
            && first_block + cells <= rows
            && above.end - above.start >= upper
            && below.end - below.start >= lower;
        match (split, query < upper) {
            (true, true) => (spread(&above, query, upper), Some(above)),
            (true, false) => (spread(&below, query - upper, lower), Some(below)),
            (false, _) => (spread(&(0..rows), query, upper + lower), None),
        }
    }

    /// The copy whose blocks serve query head `query` of a KV head's group.
    pub(super) fn copy_serving(&self, query: u64) -> u64 {
        query / self.queries_per_copy().max(1)
    }
}

/// The most positions a KV block may hold: the largest aligned power-of-two run of 32-position
/// chunks (the numerics contract's chunk tree) that fits a PE beside nothing else and that the
/// cache fills. `None` when even 32 positions do not fit a PE.
pub(super) fn max_positions_per_block(head_dim: u64, q_per_kv: u64, max_context: u64, usable: u64) -> Option<u64> {
    let max_positions = CHUNK * max_context.div_ceil(CHUNK).next_power_of_two();
    let mut positions = CHUNK;
    if kv_block_bytes(positions, head_dim, q_per_kv) > usable {
        return None;
    }
    while positions * 2 <= max_positions && kv_block_bytes(positions * 2, head_dim, q_per_kv) <= usable {
        positions *= 2;
    }
    Some(positions)
}

/// The positions per KV block of a region `w x h` holding `attentions` (each at most its own
/// largest): the fewest (from 32, doubling) whose strip takes at most [`MAX_KV_STRIP_SHARE`] of
/// the width, else the largest.
pub(super) fn block_for_region(attentions: &[KvShape], w: u64, h: u64) -> u64 {
    let largest = attentions.iter().map(|kv| kv.positions_per_block).max().unwrap_or(CHUNK);
    let columns = |p: u64| -> Option<u64> { attentions.iter().map(|kv| kv.with_block(p).columns(h)).sum() };
    std::iter::successors(Some(CHUNK), |p| Some(p * 2))
        .take_while(|&p| p < largest)
        .find(|&p| columns(p).is_some_and(|cols| cols as f64 <= MAX_KV_STRIP_SHARE * w as f64))
        .unwrap_or(largest)
}

/// The most of a region's width its KV strip may take when a larger block would make it
/// narrower: a block's attention work grows with the positions it holds (a score and a
/// weighted value each), and deep into a context every block is full, so blocks of 32
/// positions spread that work over the most PEs; but the strip's PEs hold no tiles, so on a
/// region too small for it the blocks grow until the strip takes at most this share. SmolLM2
/// (`stacked:1,35,kv3`, head_dim 64): 64-position blocks, what fits a PE, decoded 2,759 tok/s
/// at position 1,024; 32-position blocks, 4,105, and 10,364 instead of 10,261 at position 0.
pub(super) const MAX_KV_STRIP_SHARE: f64 = 0.25;

/// Rows of a matvec's result that an attention reads ([`Stacked::attention_head`]).
pub(super) struct HeadRows {
    pub(super) attention: usize,
    pub(super) kv_heads: u64,
    /// The KV head they belong to.
    pub(super) head: u64,
    /// Queries (with, for rows within one query head, its index in its KV head's group), keys
    /// or values.
    pub(super) role: HeadRole,
}

/// Which of an attention's operands rows are.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum HeadRole {
    Query(Option<u64>),
    Key,
    Value,
}

/// Where [`Stacked::band_pe`] looks for a PE: band `band` of `bands` of a unit's area, a PE with
/// room for `bytes` more, its columns walked westward from `west` columns west of the area's east
/// edge, each from the band row nearest area row `row`.
pub(super) struct BandSeek {
    pub(super) band: u64,
    pub(super) bands: u64,
    pub(super) bytes: u64,
    pub(super) west: u64,
    pub(super) row: u64,
}

impl Stacked<'_> {
    /// Attention `i`'s KV shape in `unit`'s region, with the region's blocks
    /// (`block_for_region`). `None` when 32 positions of a head do not fit a PE.
    pub(super) fn kv_shape(&mut self, i: usize, unit: usize) -> Option<KvShape> {
        let usable = self.placer.params.usable_bytes_per_pe() as u64;
        let kv = KvShape::of(self.placer.module, i, self.placer.options, usable)?;
        Some(kv.with_block(self.region(unit).kv_block))
    }

    /// Band `band` of `bands` of the unit's area, with the band row nearest area row `row` and
    /// the band's top row in the area.
    fn band_rows(&mut self, unit: usize, seek: &BandSeek) -> (Rect, u64, u64) {
        let area = self.region(unit).area;
        let rows = area.band(seek.band, seek.bands);
        let top = (rows.y - area.y) as u64;
        (rows, seek.row.saturating_sub(top), top)
    }

    /// A PE in the band `seek` names with room for its bytes more, not in `taken`: the band's
    /// columns walked westward from its `west` columns west of the area's east edge (beside the
    /// KV strip), each from the band row nearest its area row.
    pub(super) fn band_pe(
        &mut self,
        i: usize,
        unit: usize,
        seek: BandSeek,
        taken: &HashSet<Pe>,
    ) -> Result<Pe, WaferError> {
        let (rows, near, _) = self.band_rows(unit, &seek);
        let (w, h) = (rows.w as u64, rows.h as u64);
        for step in 0..w {
            let dx = w - 1 - (seek.west + step) % w;
            for dy in nearest_first(near, h) {
                let pe = rows.at(dx, dy);
                if self.claim_vector(pe, seek.bytes, taken) {
                    return Ok(pe);
                }
            }
        }
        let BandSeek { band, bands, bytes, .. } = seek;
        Err(unsupported(
            self.placer.module,
            i,
            format!("no PE of band {band} of {bands} of its {}x{} area has {bytes} bytes free", rows.w, rows.h),
        ))
    }

    /// [`Stacked::band_pe`] on a row of its own: on the area rows `within`, the row nearest the
    /// one `seek` names that holds none of `taken`, each row's columns walked westward. A
    /// segment's multicast runs along its row to the KV strip, so two on one row share those
    /// links. `None` when no such row has room.
    fn band_pe_on_own_row(
        &mut self,
        unit: usize,
        seek: &BandSeek,
        taken: &HashSet<Pe>,
        within: Range<u64>,
    ) -> Option<Pe> {
        let (rows, near, band_top) = self.band_rows(unit, seek);
        let (w, h) = (rows.w as u64, rows.h as u64);
        for dy in nearest_first(near, h).filter(|dy| within.contains(&(band_top + dy))) {
            if taken.iter().any(|pe| pe.wafer == rows.wafer && pe.y as u64 == rows.y as u64 + dy) {
                continue;
            }
            for step in 0..w {
                let pe = rows.at(w - 1 - (seek.west + step) % w, dy);
                if self.claim_vector(pe, seek.bytes, taken) {
                    return Some(pe);
                }
            }
        }
        None
    }

    /// The attention that reads rows `rows` of matvec `i`'s result as queries, keys or values
    /// (directly, or through slices and the ops of [`Stacked::in_place_chain`]), with its KV
    /// head count and the KV head those rows belong to.
    pub(super) fn attention_head(&self, i: usize, rows: &Range<u64>) -> Option<HeadRows> {
        let (module, analysis) = (self.placer.module, self.placer.analysis);
        for (value, base) in self.in_place_chain(i) {
            for &reader in &analysis.readers[value] {
                let Op::Attention { q, k, v, cache, heads, .. } =
                    &module.body[waferc_ir::Handle::new(reader as usize)].op
                else {
                    continue;
                };
                let c = &module.caches[*cache];
                let (hd, kv_heads) = (c.head_dim as u64, c.kv_heads as u64);
                let q_per_kv = (*heads / c.kv_heads) as u64;
                for (role, operand) in [q, k, v].into_iter().enumerate() {
                    if analysis.source[operand.index()] as usize != value {
                        continue;
                    }
                    let start = base + analysis.offset[operand.index()];
                    let head_len = if role == 0 { q_per_kv * hd } else { hd };
                    let end = start + kv_heads * head_len;
                    if start <= rows.start && rows.end <= end {
                        let head = (rows.start - start) / head_len;
                        if (rows.end - 1 - start) / head_len == head {
                            let within = (rows.start - start) % head_len / hd;
                            let role = match role {
                                0 => HeadRole::Query(
                                    ((rows.end - 1 - start) % head_len / hd == within).then_some(within),
                                ),
                                1 => HeadRole::Key,
                                _ => HeadRole::Value,
                            };
                            return Some(HeadRows { attention: reader as usize, kv_heads, head, role });
                        }
                    }
                }
            }
        }
        None
    }

    pub(super) fn attention(
        &mut self,
        i: usize,
        unit: usize,
        cache: waferc_ir::Handle<waferc_ir::KvCache>,
        heads: u32,
        len: u64,
    ) -> Result<(ResultLayout, Work), WaferError> {
        let module = self.placer.module;
        let c = &module.caches[cache];
        let kv = self.kv_shape(i, unit).ok_or_else(|| {
            unsupported(module, i, format!("32 positions of a KV head (head_dim {}) do not fit one PE", c.head_dim))
        })?;
        if kv.copies > kv.q_per_kv || kv.q_per_kv % kv.copies != 0 {
            return Err(unsupported(
                module,
                i,
                format!("{} copies of a KV head cannot share its {} query heads evenly", kv.copies, kv.q_per_kv),
            ));
        }
        slices_suit(module, i, kv.slices, kv.spread)?;
        // The attention's own columns of the strip, a band of rows per KV head: the head's
        // reductions, its q/k/v deliveries and its collect stay inside the band (its q, k and v
        // segments sit in the same rows, see `attention_head`), so no two heads' routes meet.
        let region = self.region(unit);
        let strip = region.kv.ok_or_else(|| unsupported(module, i, "internal: no KV strip".into()))?;
        let columns = kv.columns(strip.h as u64).unwrap_or(1) as u16;
        let strip = Rect { x: strip.x + region.kv_column, w: columns, ..strip };
        region.kv_column += columns;
        let mut placed = Vec::with_capacity((kv.sequences * kv.kv_heads) as usize);
        // Each sequence in flight, and each copy and slice, gets blocks of its own, in its head's
        // band: each copy in rows of its own where the band has enough (`KvShape::row_copies`),
        // else the copies' blocks one after another in its columns; each slice in columns of its
        // own (`KvShape::group_rect`).
        let queries = kv.queries_per_copy() as u32;
        let dims = kv.slice_dims() as u32;
        for sequence in 0..kv.sequences {
            for h in 0..kv.kv_heads {
                let band = strip.band(h, kv.kv_heads);
                let row_copies = kv.row_copies(band.h as u64);
                for copy in 0..kv.copies {
                    let query_heads = copy as u32 * queries..(copy as u32 + 1) * queries;
                    let (in_rows, of_rows) = (copy / row_copies, kv.copies / row_copies);
                    for slice in 0..kv.slices {
                        let rows = kv.group_rect(band, copy, slice);
                        let slice_dims = slice as u32 * dims..(slice as u32 + 1) * dims;
                        let mut blocks = Vec::new();
                        for b in 0..kv.blocks_per_head() {
                            let (positions, lanes) = kv.block(b);
                            // The slice's place walked column by column from its first block's
                            // row (`KvShape::first_block_row`); other sequences' (and copies')
                            // blocks follow on.
                            let cell = ((sequence * of_rows + in_rows) * kv.blocks_per_head()) + b;
                            let pe = rows.walk_from(cell, kv.first_block_row(rows.h as u64, band.h as u64));
                            let block = KvBlockShape {
                                kv_head: h,
                                query_heads: query_heads.clone(),
                                positions: positions.clone(),
                                lanes,
                                dims: slice_dims.clone(),
                            };
                            let index = self.placer.fill(pe, i as u32, kv_block_requests(module, i, &block))?[0];
                            blocks.push(KvBlock { pe, positions, lanes, region: index });
                        }
                        placed.push(KvHeadPlacement::unrouted(
                            h as u32,
                            sequence as u32,
                            query_heads.clone(),
                            slice_dims,
                            blocks,
                        ));
                    }
                }
            }
        }
        let piece = kv.q_per_kv * kv.head_dim;
        // An output that feeds matvecs only is cut for them (`columns`), each KV head's segments
        // on rows of their own in the head's band, nearest its root block's row (the middle row,
        // `KvShape::first_block_row`) first: the collects from the root leave north, south and
        // west and run along those rows, side by side.
        // Too fine a cut for the bands' colours is merged into whole query heads, each in its
        // first piece's column (Qwen3-30B-A3B: 32 pieces a band become its 8 heads).
        let most = MAX_ALIGNED_PER_BAND * kv.kv_heads;
        let cut = self.aligned_cut(i, len, 0).map(|cut| match cut.len() as u64 > most {
            true => merge_pieces(cut, kv.head_dim),
            false => cut,
        });
        let cut = cut.filter(|cut| cut.len() as u64 <= most);
        if let Some(cut) = cut {
            let area = self.region(unit).area;
            let mut layout = VectorLayout::default();
            let mut taken = HashSet::default();
            let mut in_band: HashMap<(u64, u64), u64> = HashMap::default();
            for (seg, column) in cut {
                let h = seg.start / piece;
                // With copies in rows of their own, a segment goes to the rows of the copy
                // serving its (first) query head, nearest their middle (that copy's root): near
                // the band's middle, the copies' collects converged on it and queued
                // (Qwen3-30B-A3B `kv8`: 332 cycles waiting; 708,794 -> 692,726 cycles a token).
                let whole = area.band(h, kv.kv_heads);
                let band = kv.copy_rows(whole, kv.copy_serving(seg.start % piece / kv.head_dim));
                let slot = in_band.entry((h, band.y as u64)).or_default();
                let root = kv.first_block_row(band.h as u64, whole.h as u64);
                let middle = nearest_first(root, band.h as u64).nth((*slot % band.h as u64) as usize);
                let row = (band.y - area.y) as u64 + middle.unwrap_or(0);
                *slot += 1;
                let bytes = (seg.end - seg.start) * F32;
                let pe = self.column_pe(i, unit, column, row, bytes, &taken)?;
                taken.insert(pe);
                self.placer.fill(pe, i as u32, vec![(RegionKind::Output { elements: seg.clone() }, bytes)])?;
                layout.segments.push(Segment { pe, elements: seg });
            }
            return Ok((ResultLayout::Vector(layout), Work::Attention(self.attention_placement(cache, heads, placed))));
        }
        // Else one result segment per KV head (its query heads' outputs), in the head's band
        // beside the strip: the collect from the head's root is a short run inside the band.
        let mut layout = VectorLayout::default();
        let mut taken = HashSet::default();
        for h in 0..kv.kv_heads {
            let elements = h * piece..((h + 1) * piece).min(len);
            let bytes = (elements.end - elements.start) * F32;
            let seek = BandSeek { band: h, bands: kv.kv_heads, bytes, west: 0, row: 0 };
            let pe = self.band_pe(i, unit, seek, &taken)?;
            taken.insert(pe);
            self.placer.fill(pe, i as u32, vec![(RegionKind::Output { elements: elements.clone() }, bytes)])?;
            layout.segments.push(Segment { pe, elements });
        }
        Ok((ResultLayout::Vector(layout), Work::Attention(self.attention_placement(cache, heads, placed))))
    }

    pub(super) fn attention_placement(
        &self,
        cache: waferc_ir::Handle<waferc_ir::KvCache>,
        heads: u32,
        kv_heads_placed: Vec<KvHeadPlacement>,
    ) -> AttentionPlacement {
        let c = &self.placer.module.caches[cache];
        AttentionPlacement { heads, kv_heads: c.kv_heads, head_dim: c.head_dim, kv_heads_placed, collects: Vec::new() }
    }

    /// The PE of a matvec result segment holding rows of a KV head's queries, key or value: in
    /// the head's band of rows (see [`Stacked::attention`]), each in a column of its own and as
    /// near its rows' tiles as the band allows, so their collects run side by side. `in_band`
    /// counts the segments placed in each head's band so far.
    #[allow(clippy::too_many_arguments)] // one segment: where, its bytes, its head, and the PEs taken
    pub(super) fn head_segment_pe(
        &mut self,
        i: usize,
        unit: usize,
        seg: &Range<u64>,
        bytes: u64,
        HeadRows { attention, kv_heads, head, role }: HeadRows,
        in_band: &mut HashMap<u64, u64>,
        taken: &HashSet<Pe>,
    ) -> Result<Pe, WaferError> {
        // Slots interleave the bands, so no two segments share a column.
        let slot = in_band.entry(head).or_default();
        *slot += 1;
        // Alternately the top and bottom row of the band (or, for a
        // query, of its copy's rows in the band: `KvShape::row_copies`):
        // every PE of the blocks it goes to receives the segment, and
        // one from the top row reaches them down the columns while
        // one from the bottom row comes up, so the two share no link.
        let whole = self.region(unit).area;
        let mut band = whole.band(head, kv_heads);
        let mut nth = *slot - 1;
        let kv = self.kv_shape(attention, unit);
        if let Some(kv) = kv.filter(|kv| kv.row_copies(band.h as u64) > 1) {
            // Copies in rows of their own: a copy's queries alternate
            // from its rows' top; the key (which goes to every copy)
            // comes from the side fewer queries leave from, the band's
            // bottom when each copy has one, so it meets none
            // (Qwen3-30B-A3B `stacked:2,100,kv8,share4`: its delivery
            // waited 128 cycles; 716,174 -> 708,794 cycles a token).
            let per_copy = kv.queries_per_copy().max(1);
            nth = match role {
                HeadRole::Query(Some(q)) => {
                    band = kv.copy_rows(band, kv.copy_serving(q));
                    q % per_copy
                }
                HeadRole::Query(None) => nth,
                HeadRole::Key => per_copy % 2,
                HeadRole::Value => (per_copy + 1) % 2,
            };
        }
        let top = (band.y - whole.y) as u64;
        let mut row = if nth.is_multiple_of(2) { top } else { top + band.h as u64 - 1 };
        // A head cut in slices takes a multicast per query head and
        // slice, each along its query's row to its slice's columns:
        // each on a row of its own, half above the blocks and half
        // below where the band has the rows (`KvShape::query_row`),
        // so no two share a row's links and each column's carry
        // half of them (from the band's top and bottom rows, 32 of
        // the 70B's met at one PE and ran out of colours).
        let mut side = None;
        if let (Some(kv), HeadRole::Query(Some(q))) = (kv.filter(|kv| kv.slices > 1), role) {
            let per_copy = kv.queries_per_copy().max(1);
            let band_rows = whole.band(head, kv_heads).h as u64;
            let (within, rows) = kv.query_row(band.h as u64, band_rows, q % per_copy);
            row = top + within;
            side = rows.map(|rows| top + rows.start..top + rows.end);
        }
        // With room for the rope and norm that run in place on it: on a row of its own on its
        // side if one has room (a tight wafer's tiles fill most PEs), else the nearest.
        let room = bytes + self.in_place_bytes(i, seg);
        let west = (*slot - 1) * kv_heads + head;
        let seek = BandSeek { band: head, bands: kv_heads, bytes: room, west, row };
        let on_side = side.and_then(|rows| self.band_pe_on_own_row(unit, &seek, taken, rows));
        let pe = match on_side {
            Some(pe) => pe,
            None => self.band_pe(i, unit, seek, taken)?,
        };
        *self.vector_bytes.entry(pe).or_default() -= room - bytes;
        Ok(pe)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A head cut in slices puts half its query heads' segments above its blocks and half below
    /// where both sides have a row for each: the 70B's eight query heads, 32 blocks from the
    /// middle row of a 73-row band, four over the 36 rows above and four over the 5 below; in a
    /// 65-row band the blocks start higher to leave the lower four their rows. Where the rows
    /// are too few, they spread over all of them.
    #[test]
    fn sliced_heads_queries_enter_their_blocks_from_both_sides() {
        let shape = KvShape {
            kv_heads: 8,
            head_dim: 128,
            q_per_kv: 8,
            copies: 1,
            slices: 4,
            positions: 4096,
            positions_per_block: 128,
            spread: 1,
            sequences: 1,
        };
        assert_eq!(shape.blocks_per_head(), 32);
        let rows: Vec<_> = (0..8).map(|q| shape.query_row(73, 73, q)).collect();
        assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), [4, 13, 22, 31, 68, 69, 71, 72]);
        assert!(rows[..4].iter().all(|r| r.1 == Some(0..36)));
        assert!(rows[4..].iter().all(|r| r.1 == Some(68..73)));
        assert_eq!(shape.first_block_row(73, 73), 36, "the middle row");
        // 65 rows: from the middle row the blocks would leave one row below, so they start
        // higher, at row 29, and leave four.
        assert_eq!(shape.first_block_row(65, 65), 29);
        let moved: Vec<_> = (0..8).map(|q| shape.query_row(65, 65, q)).collect();
        assert!(moved[..4].iter().all(|r| r.1 == Some(0..29)));
        assert!(moved[4..].iter().all(|r| r.1 == Some(61..65)));
        // 39 rows hold the blocks and the queries below but not those above: the blocks stay on
        // the middle row and the queries spread over all the rows.
        assert_eq!(shape.first_block_row(39, 39), 19);
        let spread: Vec<_> = (0..8).map(|q| shape.query_row(39, 39, q)).collect();
        assert_eq!(spread.iter().map(|r| r.0).collect::<Vec<_>>(), [2, 7, 12, 17, 21, 26, 31, 36]);
        assert!(spread.iter().all(|r| r.1.is_none()));
        // Whole heads keep their blocks from the middle row.
        let whole = KvShape { slices: 1, positions_per_block: 32, ..shape };
        assert_eq!(whole.first_block_row(65, 65), 32);
    }

    /// A region's KV blocks are as small as its strip allows. Three KV heads in three copies
    /// (SmolLM2's), 4,096 positions: with head_dim 64 a PE holds up to 64 positions, and a
    /// 60 x 110 region takes 32-position blocks in an 11-column strip. With head_dim 32 (up to
    /// 128 positions) on a 60 x 46 region, 32-position blocks would take 26 columns, more than a
    /// quarter of 60: the blocks grow to 64 (13 columns); on 60 x 40 even those take 16, so the
    /// blocks are the largest. The attentions of a region's layers share its strip.
    #[test]
    fn kv_blocks_are_the_smallest_whose_strip_leaves_the_tiles_three_quarters() {
        let usable = 47_104;
        let shape = |head_dim| KvShape {
            kv_heads: 3,
            head_dim,
            q_per_kv: 3,
            copies: 3,
            slices: 1,
            positions: 4096,
            positions_per_block: max_positions_per_block(head_dim, 1, 4096, usable).unwrap(),
            spread: 1,
            sequences: 1,
        };
        let (smol, narrow) = (shape(64), shape(32));
        assert_eq!((smol.positions_per_block, narrow.positions_per_block), (64, 128));
        assert_eq!(block_for_region(&[smol], 60, 110), 32);
        assert_eq!(smol.with_block(32).columns(110), Some(11));
        assert_eq!(narrow.with_block(32).columns(46), Some(26));
        assert_eq!(block_for_region(&[narrow], 60, 46), 64);
        assert_eq!(narrow.with_block(64).columns(46), Some(13));
        assert_eq!(narrow.with_block(64).columns(40), Some(16));
        assert_eq!(block_for_region(&[narrow], 60, 40), 128);
        // Two layers' attentions share one strip: 22 columns at 32 positions, 12 at 64.
        assert_eq!(block_for_region(&[smol, smol], 60, 110), 64);
        assert_eq!(block_for_region(&[], 60, 110), CHUNK, "no attention");
    }
}
