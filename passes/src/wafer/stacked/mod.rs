//! The stacked plan ([`Plan::Stacked`]): every PE of a layer group's region works in every phase.
//!
//! At batch 1 a decoder runs its layers one after another, so a plan that gives each matrix PEs
//! of its own leaves almost all of them idle at any moment. Here the module is cut into *units*
//! (the prologue before the first layer, groups of `layers_per_region` consecutive layers, the
//! epilogue after the last), each unit gets one rectangle of PEs (at least what holds its bytes,
//! and beyond that a share growing with its arithmetic: `area_shares`), and inside a unit's
//! rectangle:
//!
//! * **every matvec is tiled over the whole tile area** (the rectangle less its KV strip), so
//!   each PE holds a slice of every matrix of its layers and the q/k/v, o, gate/up and down
//!   phases each use all of the area's PEs. A tile grid of `C` column blocks is folded into
//!   `P` panels (as many as the area's width holds) whose columns interleave: tile `(r, c)`
//!   sits in column `c * P + p` of panel `p`, so a row block's reduction is a straight run along
//!   a PE row, and column block `c`'s copies are the `P` adjacent columns from `c * P`: its
//!   activation slice is one multicast along a row inside those columns and down them, which
//!   meets no other column block's (see `columns`). An expert's matvec reading the MoE layer's
//!   input (segments on a diagonal, each with a row and a column of its own) lays its panels
//!   side by side instead, so the row blocks of a PE row reduce on links of their own
//!   ([`PanelLayout`]). A result that feeds matvecs puts
//!   consecutive row blocks side by side (panel `r % P`, row `r / P`), so its elements run down
//!   the area in order and its segments lie along one diagonal (short norm reductions); other
//!   results (queries, keys and values) fill a panel's rows first (panel `r / h`, row `r % h`),
//!   so each row holds one root of a head's rows and its collect does not queue along a row.
//!   The chunks per tile (hence `C`) are chosen per matrix by a small cost estimate: arithmetic
//!   of the busiest tile, the reduction tree's depth and span, and the multicast's span.
//!   MoE experts are spread the same way over *lanes* (bands of the area cut across into as
//!   many columns of lanes as the experts' tilings' cost picks: `lanes`), one per expert, so the
//!   chosen experts run side by side and the routes of experts that may run together meet only
//!   where their lanes' paths cross.
//! * **vectors are cut in small segments spread over the area**: a matvec's result segments are
//!   whole row blocks on their roots (32 elements or a head, so norms and rope can run on them in
//!   place); elementwise ops run on their operand's segments, except the residual adds inside a
//!   region, whose results sit in its middle row so the norms on them reduce and broadcast along
//!   one row and deliver half the height (`columns`); other vectors take PEs from a walk over
//!   the area.
//! * **KV blocks sit in a strip at the area's east side** (a block of 32 positions of one KV head
//!   is tens of KiB, more than a tile share), one block per PE, a band of rows per KV head and
//!   each copy of a head's cache in rows of its own in the band (`KvShape::row_copies`).
//!
//! Grouping trades arithmetic for distance: a larger group has more PEs per layer (less
//! arithmetic per PE) but longer collectives. The plan search (`super::search`) picks the group
//! size by the timing model. Routes, colours and the schedule are the shared placer's
//! ([`Placer::finish`]).

mod columns;
mod lanes;

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::ops::Range;
use std::rc::Rc;

use waferc_ir::wafer::{
    narrow, rope_twin, AttentionPlacement, EmbedBlock, InstrPlacement, KvBlock, KvHeadPlacement, Lanes,
    MatVecPlacement, NormPlacement, Pe, Plan, RegionKind, ResultLayout, Segment, TargetParams, Tile, VectorLayout,
    WaferProgram, Work,
};
use waferc_ir::{Module, Op, ValueType, BLOCK};

use super::place::{
    embed_block_requests, kv_block_requests, norm_requests, operand_requests, slices_suit, tile_requests, unsupported,
    KvBlockShape, Placer, Request, MAX_QUERY_ROUTES,
};
use super::size::{kv_block_bytes, Analysis};
use super::{CompileOptions, WaferError};

const CHUNK: u64 = BLOCK as u64;
const F32: u64 = 4;
/// The share of a PE's usable SRAM the matvec tiles of its unit may take together; the rest
/// holds vector segments, norm weights and receive buffers.
pub const TILE_SHARE: f64 = 0.6;
/// How much larger than its base (see `Stacked::packed_grid`) a matvec's tile may be on a tight
/// wafer, whose PEs have no share left to spread: the 70B's gate/up projection then takes four
/// chunks a tile, 25 rows deep, instead of two chunks and 50 rows (56 bytes more, 0.8%): its
/// reduction runs at half the depth in rows, and SiLU and the product run on 32-element
/// segments instead of 64 (`stacked:4` on wse3x4: 612.0 -> 635.7 tok/s).
const TIGHT_TILE_GROWTH: f64 = 0.02;
/// The share the tiles may take when every matvec takes its input leader's tiling: beyond
/// [`TILE_SHARE`], since a vector whose readers share one tiling has one alignment and moves
/// straight down its columns, while two alignments of one residual stream shift it along a
/// row (every segment on the same links).
const LED_TILE_SHARE: f64 = 0.72;
/// The most column-aligned segments of an attention output in one KV head's band: each goes
/// along its own row out of the band and down its column, across the rows of the band's other
/// segments, so their routes cross one another's; beyond this (Qwen3-30B-A3B's 32 a band) they
/// run out of colours, and the output keeps one segment per KV head.
const MAX_ALIGNED_PER_BAND: u64 = 16;
/// The most 32-element chunks a tile spans. A column block's input arrives in at most
/// [`columns::SEGMENTS_PER_COLUMN`] multicasts whatever its chunks, so a wider tile costs no
/// colours; it halves the column blocks, so a wide matrix folds into more panels over a narrow
/// area (Mixtral's down projection, 448 chunks over an expert lane 181 columns wide: 56 blocks
/// in three panels at eight chunks, 7.3k cycles a tile at four: 917 -> 995 tok/s).
const MAX_CHUNKS_PER_TILE: u64 = 8;
/// The most segments a vector that does not feed matvecs only (see `columns`) is cut in. Every
/// segment is one multicast to the PEs that read it, and multicasts to readers spread over the
/// area cross each other, so they need a colour each.
const MAX_SEGMENTS: u64 = 16;
/// The most panels a tile grid is folded into: a PE row holds a row block of each panel, their
/// reductions interleaved along it, and the reductions of sibling matvecs (separate q, k and v)
/// run at the same time, so each panel costs a colour per sibling on every PE of the row.
const MAX_PANELS: u64 = 8;
/// The most panels unless the matrices reading an input are deep (see [`DEEP_TILE_ROWS`]).
const NARROW_PANELS: u64 = 4;
/// Tiles at least this many rows deep at [`NARROW_PANELS`] panels may fold into up to
/// [`MAX_PANELS`]: their arithmetic shrinks with every panel, while a shallow tile saves a row
/// or two and pays in longer interleaved reductions and in wider segments for the vector ops on
/// the input (SmolLM2's matrices lose 7% of the speed at eight panels; the 8B's gate/up
/// projection gains 12%).
const DEEP_TILE_ROWS: u64 = 8;
/// The longest segment (2 KiB of f32): only the logits are long enough to need more than
/// [`MAX_SEGMENTS`] of these, and they take [`OUTPUT_SEGMENT_ELEMENTS`].
const MAX_SEGMENT_ELEMENTS: u64 = 512;
/// The segment of a matvec's result that nothing on the wafer reads (the logits), unless the
/// matvec's row blocks are longer: each segment receives its rows' pieces one after another, so
/// its length is the collect's serialisation, and no multicast leaves it. SmolLM2's 49,152
/// logits collect in 572 cycles in segments of 64 elements, in 1,007 in 512. A segment shorter
/// than a row block has its root feed several segments, and Qwen3-30B-A3B's 151,936 logits ran
/// out of colours so.
const OUTPUT_SEGMENT_ELEMENTS: u64 = 64;
/// The most segments the embedding's result is cut in: each is gathered from its own band of
/// the table, and all of an instruction's routes need distinct colours where they meet. Its
/// delivery to the first layer serialises a segment per route: SmolLM2's 576 elements in 18
/// segments deliver in 190 cycles, in 6 in 252.
const EMBED_SEGMENTS: u64 = 18;

/// How steeply a unit's area grows with its arithmetic ([`area_shares`]). A square root would
/// minimise the units' summed arithmetic time (`fmas / area`, at a fixed total area), but a
/// layer's time is mostly latency that more area does not shorten, while an LM head's
/// reduction messages shrink with its area as its arithmetic does. Measured on SmolLM2
/// (`stacked:1,35,kv3`, wse3): exponent 0.5 gives 110,341 cycles a token, 0.6 110,296, 0.75
/// 109,945, 1.0 114,025.
const ARITHMETIC_SHARE_EXPONENT: f64 = 0.75;

/// The share of a PE's usable SRAM a unit's weights and KV take on average at the fewest PEs
/// [`area_shares`] gives it: below [`TILE_SHARE`], since tiles are uneven (a row block or a
/// chunk more on some PEs) and vectors need room beside them (the 8B's `stacked:4` overflowed a
/// PE with its floors at [`TILE_SHARE`]). A model whose bytes fill its block beyond this (the
/// 8B on one WSE-3) gets areas in proportion to bytes.
const FLOOR_FILL: f64 = 0.4;

/// The share of a PE's usable SRAM an embedding table's blocks may take on average: a row-block
/// cut serves every band of the table ([`Stacked::embed`]), and the smallest band may have half
/// the rows of the others.
const EMBED_TABLE_SHARE: f64 = TILE_SHARE / 2.0;

/// The SRAM a router's logits matvec may take for its tile on a PE of its host expert's lane
/// (see `Stacked::matvec_grid`) where its share of the unit's tile SRAM is less. Its rows are
/// the experts (8 to 128), so its tiles are a few hundred bytes on a few hundred PEs, taken from
/// the room beside the tiles that vector segments use (`Stacked::vector_cap`, kilobytes); its
/// share by weight bytes is tens of bytes.
const ROUTER_TILE_ROOM: u64 = 1024;

/// Flops an element of a matvec's input takes in the vector ops before it (a norm, a residual
/// add, SiLU and a product), for the tiling's cost estimate.
const VECTOR_FLOPS_PER_ELEMENT: u64 = 8;

/// A rectangle of PEs on one wafer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rect {
    wafer: u16,
    x: u16,
    y: u16,
    w: u16,
    h: u16,
}

impl Rect {
    fn pes(&self) -> u64 {
        self.w as u64 * self.h as u64
    }

    /// The PE `dx` columns and `dy` rows from the north-west corner.
    fn at(&self, dx: u64, dy: u64) -> Pe {
        Pe::new(self.wafer, self.x + dx as u16, self.y + dy as u16)
    }

    /// Cell `cell` of a column-major walk (down a column, then the next), wrapping around.
    fn walk(&self, cell: u64) -> Pe {
        let cell = cell % self.pes().max(1);
        self.at(cell / self.h as u64, cell % self.h as u64)
    }

    /// [`Rect::walk`] with each column's cells starting at its middle row (and wrapping to its
    /// top).
    fn walk_from_middle(&self, cell: u64) -> Pe {
        let h = self.h as u64;
        let cell = cell % self.pes().max(1);
        self.at(cell / h, (cell + h / 2) % h)
    }

    /// Column `index` of `count` vertical strips.
    fn column(&self, index: u64, count: u64) -> Rect {
        let w = self.w as u64;
        let (left, right) = (w * index / count, w * (index + 1) / count);
        Rect { x: self.x + left as u16, w: (right - left).max(1) as u16, ..*self }
    }

    /// Band `index` of `count` horizontal bands.
    fn band(&self, index: u64, count: u64) -> Rect {
        let h = self.h as u64;
        let (top, bottom) = (h * index / count, h * (index + 1) / count);
        Rect { y: self.y + top as u16, h: (bottom - top).max(1) as u16, ..*self }
    }
}

/// A run of instructions placed together, and what it holds.
struct Unit {
    instrs: Range<usize>,
    /// Weight bytes plus KV bytes: what the unit's rectangle must hold.
    bytes: u64,
    /// Multiply-adds of its matvecs (every expert's, not only those a token picks): the
    /// arithmetic its rectangle shares out.
    fmas: u64,
    /// The fewest PEs that hold its bytes with room for vectors ([`area_shares`]).
    floor_pes: f64,
    /// The fewest PEs its rectangle may have: one instruction's result segments sit on
    /// distinct PEs (a PE sends one message per route), so the most segments any of its
    /// instructions is cut in.
    min_pes: u64,
    /// Per attention, its KV heads and blocks per head (one PE per block).
    attentions: Vec<KvShape>,
}

/// How an attention's KV cache is cut into blocks.
#[derive(Clone, Copy, Debug)]
struct KvShape {
    kv_heads: u64,
    head_dim: u64,
    q_per_kv: u64,
    /// Copies of each head's cache (`Plan::Stacked::kv_copies`), each serving an equal share of
    /// its query heads.
    copies: u64,
    /// Slices of each copy's head dimension (`Plan::Stacked::kv_slices`), each on blocks of its
    /// own holding `head_dim / slices` elements of every position.
    slices: u64,
    /// Positions the cache keeps: the capacity, or the window when it is shorter.
    positions: u64,
    positions_per_block: u64,
    /// PEs each block's positions are spread over by lane (`Plan::Stacked::kv_spread`):
    /// a block of 32 positions on each, holding `32 / spread` of them.
    spread: u64,
    /// Sequences in flight, each with blocks of its own.
    sequences: u64,
}

impl KvShape {
    /// `None` when 32 positions of a head do not fit one PE.
    fn of(module: &Module, i: usize, options: &CompileOptions, usable: u64) -> Option<KvShape> {
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
    fn with_block(self, positions: u64) -> KvShape {
        let positions = positions.max(CHUNK * self.slices).min(self.positions_per_block);
        KvShape { positions_per_block: positions, ..self }
    }

    /// Blocks of each head's copy: its chunk runs, each cut in its lane groups.
    fn blocks_per_head(&self) -> u64 {
        self.positions.div_ceil(self.positions_per_block) * self.spread
    }

    /// The rows block `b` of a head's copy holds: its chunk run and lanes.
    fn block(&self, b: u64) -> (Range<u32>, Lanes) {
        let (run, group) = (b / self.spread, b % self.spread);
        let per = self.positions_per_block;
        let positions = (run * per) as u32..((run + 1) * per).min(self.positions) as u32;
        (positions, Lanes::group(group as u8, self.spread as u8))
    }

    /// The query heads each copy serves.
    fn queries_per_copy(&self) -> u64 {
        self.q_per_kv / self.copies
    }

    /// Elements of each head vector a slice holds.
    fn slice_dims(&self) -> u64 {
        self.head_dim / self.slices
    }

    /// Bytes of one head's blocks, over its copies, slices and sequences.
    fn head_bytes(&self) -> u64 {
        let block = kv_block_bytes(self.positions_per_block / self.spread, self.slice_dims(), self.queries_per_copy());
        self.sequences * self.copies * self.slices * self.blocks_per_head() * block
    }

    /// Columns of a KV strip `height` rows high holding every head's blocks (of every sequence,
    /// copy and slice) in a band of its own, each copy in rows of its own where the band has a
    /// row for each ([`KvShape::row_copies`]), each slice in columns of its own
    /// ([`KvShape::group_rect`]).
    fn columns(&self, height: u64) -> Option<u64> {
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
    fn row_copies(&self, band: u64) -> u64 {
        match band >= self.copies {
            true => self.copies,
            false => 1,
        }
    }

    /// The rows of a head's `band` that hold copy `copy`'s blocks ([`KvShape::row_copies`]).
    fn copy_rows(&self, band: Rect, copy: u64) -> Rect {
        let row_copies = self.row_copies(band.h as u64);
        band.band(copy % row_copies, row_copies)
    }

    /// Where slice `slice` of copy `copy` sits in a head's `band`: the copy's rows, cut in
    /// columns, a slice to each. Block `b` of every slice then sits at the same place in its
    /// columns, so the sum of its slices' score parts runs along one row, beside the other rows'
    /// (slices in rows of their own put the sums of a column's blocks on one line, and a strip
    /// of the 70B's ran out of colours).
    fn group_rect(&self, band: Rect, copy: u64, slice: u64) -> Rect {
        self.copy_rows(band, copy).column(slice, self.slices)
    }

    /// The copy whose blocks serve query head `query` of a KV head's group.
    fn copy_serving(&self, query: u64) -> u64 {
        query / self.queries_per_copy().max(1)
    }
}

/// Matvec `i` and the ops that run in place on its result (rope and a per-head norm, Qwen3's q
/// and k norms, through slices), each with where its element 0 lies in `i`'s result.
fn in_place_chain(module: &Module, analysis: &Analysis, i: usize) -> Vec<(usize, u64)> {
    let mut chain = vec![(i, 0u64)];
    let mut next = 0;
    while let Some(&(value, base)) = chain.get(next) {
        next += 1;
        for &reader in &analysis.readers[value] {
            let r = reader as usize;
            let (Op::Rope { x, .. } | Op::RmsNorm { x, .. }) = &module.body[waferc_ir::Handle::new(r)].op else {
                continue;
            };
            if analysis.source[x.index()] as usize == value {
                chain.push((r, base + analysis.offset[x.index()]));
            }
        }
    }
    chain
}

/// The ropes that read matvec `i`'s result directly (through slices only), when they all do,
/// share one head dimension whose half is more than a chunk, and the attentions reading them
/// take at most [`MAX_QUERY_ROUTES`] query multicasts a KV head so (one per query head and chunk
/// pair: Llama-3.1-8B's 4 query heads a KV head, 4 pairs each; the 70B's 8 ran out of colours):
/// such a result is cut in chunks placed in pairs ([`Stacked::segment_cut`]). `None` when a rope
/// reads it through a per-head norm (Qwen3's q and k norms: the norm's group would span PEs), or
/// nothing rotates it.
fn rope_pairs(module: &Module, analysis: &Analysis, i: usize) -> Option<RopePairs> {
    let mut pairs: Option<RopePairs> = None;
    for (r, start) in in_place_chain(module, analysis, i).into_iter().skip(1) {
        let ir = &module.body[waferc_ir::Handle::new(r)];
        let Op::Rope { head_dim, x, .. } = &ir.op else { return None };
        let head_dim = *head_dim as u64;
        let direct = analysis.source[x.index()] as usize == i;
        let fits = analysis.readers[r].iter().all(|&a| match &module.body[waferc_ir::Handle::new(a as usize)].op {
            Op::Attention { cache, heads, .. } => {
                let q_per_kv = (*heads / module.caches[*cache].kv_heads.max(1)) as u64;
                q_per_kv * (head_dim / CHUNK) <= MAX_QUERY_ROUTES
            }
            _ => true,
        });
        let halves = head_dim / 2 > CHUNK && (head_dim / 2).is_multiple_of(CHUNK);
        if !(direct && fits && halves) || pairs.as_ref().is_some_and(|p| p.head_dim != head_dim) {
            return None;
        }
        let len = ir.ty.tensor().map_or(0, |t| t.elements());
        pairs.get_or_insert(RopePairs { head_dim, rotated: Vec::new() }).rotated.push(start..start + len);
    }
    pairs
}

/// Whether a stacked placement cuts matvec results in rope pairs ([`rope_pairs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RopePairing {
    Allowed,
    /// Whole heads: the pairs' extra query multicasts ran a band out of colours.
    Off,
}

/// The ropes that read a matvec's result directly, in chunk pairs ([`Stacked::rope_pairs`]):
/// their head dimension and the rows of the result they rotate.
struct RopePairs {
    head_dim: u64,
    rotated: Vec<Range<u64>>,
}

/// Rows of a matvec's result that an attention reads ([`Stacked::attention_head`]).
struct HeadRows {
    attention: usize,
    kv_heads: u64,
    /// The KV head they belong to.
    head: u64,
    /// Queries (with, for rows within one query head, its index in its KV head's group), keys
    /// or values.
    role: HeadRole,
}

/// Which of an attention's operands rows are.
#[derive(Clone, Copy, PartialEq, Eq)]
enum HeadRole {
    Query(Option<u64>),
    Key,
    Value,
}

/// A unit's rectangle, split into the tile area (west) and the KV strip (east).
struct Region {
    area: Rect,
    kv: Option<Rect>,
    /// Positions per KV block (`block_for_region`).
    kv_block: u64,
    /// Next cell of the area's walk for a vector that has no host.
    cursor: u64,
    /// Next free column of the KV strip (each attention takes columns of its own).
    kv_column: u16,
    /// Whether the region's wafer is cut in [`exact_rectangles`] (its units' bytes fill it
    /// beyond the tiles' share), so its PEs have no room to spare.
    tight: bool,
}

/// The segment length of an `len`-element vector: a power-of-two run of chunks cutting it in at
/// most [`MAX_SEGMENTS`] pieces, at most [`MAX_SEGMENT_ELEMENTS`] long.
fn vector_cut(len: u64) -> u64 {
    len.div_ceil(MAX_SEGMENTS).next_power_of_two().clamp(CHUNK, MAX_SEGMENT_ELEMENTS)
}

/// `0..len` from `near` (clamped into it) outward: `near`, `near + 1`, `near - 1`, `near + 2`, ...
fn nearest_first(near: u64, len: u64) -> impl Iterator<Item = u64> {
    let near = near.min(len.saturating_sub(1));
    (0..2 * len)
        .map(move |k| if k % 2 == 0 { near.checked_add(k / 2) } else { near.checked_sub(k / 2 + 1) })
        .filter_map(move |i| i.filter(|&i| i < len))
}

/// The most positions a KV block may hold: the largest aligned power-of-two run of 32-position
/// chunks (the numerics contract's chunk tree) that fits a PE beside nothing else and that the
/// cache fills. `None` when even 32 positions do not fit a PE.
fn max_positions_per_block(head_dim: u64, q_per_kv: u64, max_context: u64, usable: u64) -> Option<u64> {
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
fn block_for_region(attentions: &[KvShape], w: u64, h: u64) -> u64 {
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
const MAX_KV_STRIP_SHARE: f64 = 0.25;

/// Bytes of a 2-D or 1-D weight at its storage type.
fn weight_bytes(module: &Module, weight: waferc_ir::Handle<waferc_ir::Weight>) -> u64 {
    let w = &module.weights[weight];
    let cols = *w.ty.shape.last().unwrap_or(&0);
    let rows: u64 = w.ty.shape.iter().rev().skip(1).product();
    rows * w.ty.dtype.row_bytes(cols).unwrap_or(cols * F32)
}

/// The prologue, the layer groups and the epilogue, with their bytes.
fn units(module: &Module, options: &CompileOptions, usable: u64, layers_per_region: u16) -> Vec<Unit> {
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

/// The segments instruction `i`'s result is cut in: one per head for rope (whose operand, a
/// matvec's result, is cut the same way), else [`vector_cut`]'s.
fn result_segments(module: &Module, i: usize) -> u64 {
    let ir = &module.body[waferc_ir::Handle::new(i)];
    let ValueType::Tensor(t) = &ir.ty else { return 1 };
    let len = t.elements();
    match &ir.op {
        Op::Rope { head_dim, .. } => len.div_ceil((*head_dim as u64).max(1)),
        _ => len.div_ceil(vector_cut(len)),
    }
}

/// The columns and rows of the block of `wafer_percent` of a wafer (both sides scaled alike).
fn block_size(params: &TargetParams, wafer_percent: u8) -> (u64, u64) {
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
fn area_shares(units: &[&Unit], pes: u64) -> Vec<u64> {
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
fn unit_wafers(units: &[Unit], wafers: u16) -> Vec<u16> {
    let bytes: Vec<u64> = units.iter().map(|u| u.bytes).collect();
    super::partition::partition(&bytes, wafers, u64::MAX).unwrap_or_else(|| vec![0; units.len()])
}

/// How many vertical strips a `cols x rows` block is cut in for `units` units: strips about as
/// wide as a unit's square side.
fn strip_count(cols: u64, rows: u64, units: usize) -> u64 {
    let typical = (cols * rows) / units.max(1) as u64;
    ((cols as f64 / (typical as f64).sqrt()).round() as u64).clamp(1, cols)
}

/// Rectangles for the units of one wafer, areas in proportion to their `shares`
/// ([`area_shares`]): the block of `wafer_percent` of the wafer at its north-west corner (both
/// sides scaled alike) is cut into vertical strips about as wide as a unit's square side, and
/// units fill the strips in a snake (down the first, up the next), so consecutive units are
/// neighbours; the units of a strip then share the rows it has left. A unit gets at least the
/// rows that hold its `min_pes`. `None` when the units do not fit the block.
fn rectangles(
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
fn exact_rectangles(
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
fn stretch_strips(rects: &mut [Rect], rows: u64) {
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

/// The tiling of a `rows x cols` matvec over `area`.
#[derive(Clone, Debug)]
struct Grid {
    rows_per_tile: u64,
    chunks_per_tile: u64,
    row_blocks: u64,
    col_blocks: u64,
    /// Copies of each column block side by side (see the module documentation).
    panels: u64,
    /// The area's height in PEs.
    height: u64,
    /// Whether consecutive row blocks sit side by side in one PE row (else down a panel).
    rows_across_panels: bool,
    layout: PanelLayout,
    /// The area's columns an interleaved grid's blocks take, in order (`col_blocks * panels` of
    /// them, see [`Stacked::balance_columns`]); `None`: packed from the west edge, the columns
    /// left idle at the east edge.
    used_columns: Option<Rc<[u16]>>,
}

/// How a tile grid's panels share its area's width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PanelLayout {
    /// The panels' columns interleave: column block `c`'s copies are the `P` adjacent columns
    /// from `c * P`, so an input cut by column blocks reaches them in one short multicast per
    /// segment; but a PE row's `P` row blocks reduce over the same links, one message each per
    /// level of their trees.
    Interleaved,
    /// Panel `p` is the `C` adjacent columns from `p * C`: a row block's reduction runs over
    /// adjacent PEs and shares no link with another panel's. Its input's column block is then
    /// spread over the area's width, which suits an input whose segments each have a row and a
    /// column of their own (an MoE layer's input on its diagonal, `central_diagonal`): their
    /// runs to the copies cross but share no link. Mixtral's gate/up reduction waited 800 of
    /// its 1,555 cycles interleaved in five panels, here 0 of 631.
    SideBySide,
}

/// Where a matvec may be tiled: its area, the most panels its grid folds into, and how they lie.
#[derive(Clone, Copy, Debug)]
struct Span {
    area: Rect,
    max_panels: u64,
    layout: PanelLayout,
}

impl Grid {
    /// The tiling over `area` with `chunks_per_tile` chunks per tile, if its column blocks fit
    /// the area's width.
    fn over(rows: u64, cols: u64, span: Span, chunks_per_tile: u64) -> Option<Grid> {
        let Span { area, max_panels, layout } = span;
        let col_blocks = cols.div_ceil(CHUNK).div_ceil(chunks_per_tile);
        let panels = (area.w as u64 / col_blocks).min(max_panels);
        if panels == 0 {
            return None;
        }
        let rows_per_tile = rows.div_ceil(panels * area.h as u64);
        Some(Grid {
            rows_per_tile,
            chunks_per_tile,
            row_blocks: rows.div_ceil(rows_per_tile),
            col_blocks,
            panels,
            height: area.h as u64,
            rows_across_panels: false,
            layout,
            used_columns: None,
        })
    }

    /// The tilings the plan considers: 1, 2, 4, ... up to [`MAX_CHUNKS_PER_TILE`] chunks per tile,
    /// over `span`.
    fn candidates(rows: u64, cols: u64, span: Span) -> impl Iterator<Item = Grid> {
        let runs = cols.div_ceil(CHUNK).next_power_of_two().min(MAX_CHUNKS_PER_TILE);
        (0..)
            .map(|j| 1u64 << j)
            .take_while(move |&run| run <= runs)
            .filter_map(move |run| Grid::over(rows, cols, span, run))
    }

    /// Row block `r`'s (panel, row from the area's north edge) in this grid's own order.
    fn slot(&self, r: u64) -> (u64, u64) {
        let panel = match self.rows_across_panels {
            true => r % self.panels,
            false => r / self.height,
        };
        (panel, self.row(r))
    }

    /// The PE row (from the area's north edge) of row block `r`.
    fn row(&self, r: u64) -> u64 {
        match self.rows_across_panels {
            true => r / self.panels,
            false => r % self.height,
        }
    }

    /// The PE column (from the area's west edge) of input chunk `chunk`'s first copy, spreading
    /// a column block's chunks over its copies: the same for every tiling of the same input
    /// width and panel span, so vectors read by several such matvecs suit them all.
    fn chunk_column(&self, chunk: u64, chunks: u64) -> u64 {
        let packed = chunk * self.col_blocks * self.interleaved_panels() / chunks.max(1);
        match self.layout {
            PanelLayout::Interleaved => self.column(packed / self.panels, packed % self.panels),
            PanelLayout::SideBySide => packed,
        }
    }

    /// The PE column (from the area's west edge) of column block `c`'s copy in `panel`.
    fn column(&self, c: u64, panel: u64) -> u64 {
        match (self.layout, &self.used_columns) {
            (PanelLayout::Interleaved, Some(used)) => used[(c * self.panels + panel) as usize] as u64,
            (PanelLayout::Interleaved, None) => c * self.panels + panel,
            (PanelLayout::SideBySide, _) => panel * self.col_blocks + c,
        }
    }

    /// The columns (from the area's west edge) this grid's tiles take.
    fn columns_taken(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.col_blocks).flat_map(move |c| (0..self.panels).map(move |p| self.column(c, p)))
    }

    /// How many row blocks' reductions share a PE row's links: the panels, when they interleave.
    fn interleaved_panels(&self) -> u64 {
        match self.layout {
            PanelLayout::Interleaved => self.panels,
            PanelLayout::SideBySide => 1,
        }
    }

    /// The levels of a row block's reduction tree over the column blocks.
    fn depth(&self) -> u64 {
        64 - (self.col_blocks - 1).leading_zeros() as u64
    }

    /// The estimated cycles of the tiling over `area`: the busiest tile's multiply-adds, the
    /// reduction tree (its span along a row over its panel's columns, interleaved or not, and per
    /// level one message and one add of a row block, plus the queueing of interleaved panels:
    /// each level puts one message of a row block per panel on the row's links), the activation
    /// multicast (along a row inside a block's columns and down them), and the vector work on the
    /// input's segments (as fine as a quarter column block, see `columns`: the elementwise ops and
    /// norms that produce the input run on them, a few flops an element). The queueing term was
    /// the experts' lanes' own (`lanes`) until it moved here: SmolLM2's LM head then takes
    /// another tiling (2-chunk tiles in 8 panels), 10,006.6 -> 10,017.3 tok/s; the other
    /// models' grids are unchanged.
    fn cost(&self, area: Rect) -> u64 {
        let depth = self.depth();
        let segment = (self.chunks_per_tile * CHUNK / columns::SEGMENTS_PER_COLUMN).max(CHUNK);
        self.rows_per_tile * self.chunks_per_tile * CHUNK
            + self.interleaved_panels() * self.col_blocks
            + 2 * depth * self.rows_per_tile
            + self.interleaved_panels() * depth * self.rows_per_tile
            + self.panels
            + area.h as u64
            + VECTOR_FLOPS_PER_ELEMENT * segment
    }
}

/// Where segment `j` of `count` of a vector that reaches an MoE layer's experts sits in `area`
/// (`(dx, dy)` from its north-west corner), for layer `local` of the `k` of a region. The
/// experts' lanes lie side by side, so the vector cannot be column-aligned for all of them
/// (`columns`), and each segment multicasts to every lane: one row and one column per segment
/// keeps those multicasts off each other's links. A diagonal of adjacent PEs at the area's
/// centre does that while the norm on the vector reduces and broadcasts over a few dozen hops
/// (on its matvec's tiles the diagonal spans the region: Mixtral's post-attention norm took
/// 966 and 364 cycles, here 28 and 34, 1,283 -> 1,338 tok/s). The layers of a region continue
/// one diagonal, so no PE holds two layers' segments.
fn central_diagonal(area: Rect, j: u64, count: u64, (local, k): (u64, u64)) -> (u64, u64) {
    let (along, length) = (local * count + j, count * k);
    let dx = (area.w as u64 / 2 + along).saturating_sub(length / 2);
    let dy = (area.h as u64 / 2 + along).saturating_sub(length / 2);
    (dx, dy)
}

/// The offsets [`Stacked::beside_residual`] tries, nearest first: east and west first, since
/// the residual's diagonal holds the PEs north-west and south-east of each segment's.
const BESIDE: [(i64, i64); 8] = [(1, 0), (-1, 0), (0, 1), (0, -1), (2, 0), (-2, 0), (0, 2), (0, -2)];

/// The most panels a matrix of `rows` rows folds into over an area `height` rows high:
/// [`MAX_PANELS`] when its tiles are [`DEEP_TILE_ROWS`] deep at [`NARROW_PANELS`] panels, else
/// [`NARROW_PANELS`].
fn panel_cap(rows: u64, height: u64) -> u64 {
    match rows >= DEEP_TILE_ROWS * NARROW_PANELS * height {
        true => MAX_PANELS,
        false => NARROW_PANELS,
    }
}

/// The tiling over `span` with the least [`Grid::cost`] (ties: fewer chunks per tile) among those
/// whose tile fits `budget` bytes, only `chunks_per_tile` chunks per tile if given.
fn grid(
    rows: u64,
    cols: u64,
    span: Span,
    tile_bytes: &dyn Fn(u64, u64) -> Option<u64>,
    budget: u64,
    chunks_per_tile: Option<u64>,
) -> Option<Grid> {
    Grid::candidates(rows, cols, span)
        .filter(|g| chunks_per_tile.is_none_or(|run| run == g.chunks_per_tile))
        .filter(|g| tile_bytes(g.rows_per_tile, (g.chunks_per_tile * CHUNK).min(cols)).is_some_and(|b| b <= budget))
        .min_by_key(|g| g.cost(span.area))
}

/// The bytes a matvec's tile may take: its `base` tile and its `spread` of the unit's slack. On
/// a tight wafer the tiles alone exceed the tiles' share, so there is no slack to spread, and a
/// tile may still grow by [`TIGHT_TILE_GROWTH`] for a cheaper tiling.
fn tile_budget(base: u64, spread: u64, tight: bool) -> u64 {
    let budget = base.saturating_add(spread);
    match tight {
        true => budget.max(base.saturating_add((base as f64 * TIGHT_TILE_GROWTH) as u64)),
        false => budget,
    }
}

/// The smallest tile any tiling of a `rows x cols` matvec over `span` needs.
fn smallest_tile(rows: u64, cols: u64, span: Span, tile_bytes: &dyn Fn(u64, u64) -> Option<u64>) -> u64 {
    Grid::candidates(rows, cols, span)
        .map(|g| tile_bytes(g.rows_per_tile, (g.chunks_per_tile * CHUNK).min(cols)).unwrap_or(u64::MAX))
        .min()
        .unwrap_or(u64::MAX)
}

/// About how many matvec tiles the stacked plan with `layers_per_region` lays over `pes` PEs,
/// without lowering. Every PE of a unit's area holds a tile of every matvec of the unit (an
/// expert's matvecs cover only the expert's lane), unless the matrix has fewer row-by-chunk
/// blocks than that; a unit's area is taken as its layers' share of `pes`. The lowered
/// program's size grows with it (the plan search keeps it bounded).
pub fn tiles_estimate(module: &Module, layers_per_region: u16, experts_per_lane: u8, pes: u64) -> u64 {
    let analysis = Analysis::new(module);
    let layers = module.meta.num_layers.max(1) as u64;
    let unit_pes = (pes * layers_per_region.max(1) as u64 / layers).clamp(1, pes.max(1));
    // Distinct experts per layer: an expert's lane is its share of the unit's area.
    let mut experts: std::collections::BTreeMap<u32, HashSet<u32>> = Default::default();
    for (handle, instr) in module.body.iter() {
        if let (Some(layer), Some(expert)) = (instr.layer, analysis.expert[handle.index()]) {
            experts.entry(layer).or_default().insert(expert);
        }
    }
    let mut tiles = 0;
    for (handle, instr) in module.body.iter() {
        let Op::MatVec { weight, .. } = &instr.op else { continue };
        let shape = &module.weights[*weight].ty.shape;
        let blocks = shape[0] * shape[1].div_ceil(CHUNK);
        // The LM head's epilogue is sized by its bytes: at most every PE.
        let area = match (instr.layer, analysis.expert[handle.index()]) {
            (None, _) => pes,
            (Some(layer), Some(_)) => {
                let experts = experts.get(&layer).map_or(1, |e| e.len() as u64);
                unit_pes / experts.div_ceil(experts_per_lane.max(1) as u64).max(1)
            }
            (Some(_), None) => unit_pes,
        };
        tiles += blocks.min(area);
    }
    tiles
}

/// Places `module` with the stacked plan: with rope pairs where [`rope_pairs`] allows them, and
/// again with whole heads if a route then finds no colour (a pair's chunks take a query
/// multicast each, and a small region's bands have few rows for them: Mixtral's `stacked:1`).
pub(super) fn place(
    module: &Module,
    analysis: &Analysis,
    params: &TargetParams,
    options: &CompileOptions,
    layers_per_region: u16,
    wafer_percent: u8,
) -> Result<WaferProgram, WaferError> {
    let place = |pairing| place_with(module, analysis, params, options, (layers_per_region, wafer_percent), pairing);
    let paired = (0..module.body.len()).any(|i| {
        matches!(module.body[waferc_ir::Handle::new(i)].op, Op::MatVec { .. })
            && rope_pairs(module, analysis, i).is_some()
    });
    match place(RopePairing::Allowed) {
        Err(WaferError::Colours { .. }) if paired => place(RopePairing::Off),
        placed => placed,
    }
}

fn place_with(
    module: &Module,
    analysis: &Analysis,
    params: &TargetParams,
    options: &CompileOptions,
    (layers_per_region, wafer_percent): (u16, u8),
    rope_pairing: RopePairing,
) -> Result<WaferProgram, WaferError> {
    let usable = params.usable_bytes_per_pe() as u64;
    let units = units(module, options, usable, layers_per_region);
    let wafer_of_unit = unit_wafers(&units, params.wafers.max(1));
    let mut regions: Vec<Option<Region>> = (0..units.len()).map(|_| None).collect();
    for wafer in 0..params.wafers {
        let on: Vec<usize> = (0..units.len()).filter(|&u| wafer_of_unit[u] == wafer).collect();
        if on.is_empty() {
            continue;
        }
        let on_units: Vec<&Unit> = on.iter().map(|&u| &units[u]).collect();
        let (cols, rows) = block_size(params, wafer_percent);
        let shares = area_shares(&on_units, cols * rows);
        let min_pes: Vec<u64> = on.iter().map(|&u| units[u].min_pes).collect();
        // Units whose bytes fill the block beyond the tiles' share need every PE of their own
        // share: the snake's equal strips give the units of a fuller strip less (the 70B's
        // `stacked:4` put three 4-layer units in one strip and two in the other of a wafer,
        // 147k and 221k PEs, and the smaller ones' weights alone overflowed).
        let bytes: u64 = on_units.iter().map(|u| u.bytes).sum();
        let exact = bytes as f64 > TILE_SHARE * usable as f64 * (cols * rows) as f64;
        let rects = match exact {
            true => exact_rectangles(params, wafer_percent, wafer, &shares, &min_pes),
            false => rectangles(params, wafer_percent, wafer, &shares, &min_pes),
        };
        let rects = rects.ok_or_else(|| {
            WaferError::Options(format!(
                "{}: {} regions do not fit wafer {wafer} of {}",
                options.plan,
                on.len(),
                params.name
            ))
        })?;
        for (&u, rect) in on.iter().zip(rects) {
            let kv_block = block_for_region(&units[u].attentions, rect.w as u64, rect.h as u64);
            let kv_cols: Option<u64> =
                units[u].attentions.iter().map(|kv| kv.with_block(kv_block).columns(rect.h as u64)).sum();
            let kv_cols = match kv_cols {
                Some(cols) if cols < rect.w as u64 => cols,
                _ => {
                    return Err(WaferError::Options(format!(
                        "{}: the KV blocks of a region of {}x{} PEs (a band of rows per KV head) leave no PE \
                         for tiles",
                        options.plan, rect.w, rect.h
                    )))
                }
            };
            let area = Rect { w: rect.w - kv_cols as u16, ..rect };
            let kv = (kv_cols > 0).then(|| Rect { x: rect.x + area.w, w: kv_cols as u16, ..rect });
            // Vectors without a host start in the middle column: multicasts from there reach the
            // area's corners soonest, and column 0 already holds the panels' row roots.
            let cursor = (area.w as u64 / 2) * area.h as u64;
            regions[u] = Some(Region { area, kv, kv_block, cursor, kv_column: 0, tight: exact });
        }
    }
    let mut placer = Placer::new(module, analysis, params, options, super::place::Cells::new(params));
    // Regions are rectangles: a multicast runs along its source's row, then up and down the
    // destination columns, with no shelves to stay inside.
    placer.route_band = params.grid_rows;
    placer.host_slices = true;
    let unit_weight_bytes = units
        .iter()
        .map(|u| {
            u.instrs
                .clone()
                .map(|i| match &module.body[waferc_ir::Handle::new(i)].op {
                    Op::MatVec { weight, .. } => weight_bytes(module, *weight),
                    _ => 0,
                })
                .sum()
        })
        .collect();
    let mut stacked = Stacked {
        placer,
        regions,
        unit_weight_bytes,
        unit_slack: Vec::new(),
        unit_led_tiles: Vec::new(),
        expert_pes: HashMap::default(),
        lane_cursors: HashMap::default(),
        lane_columns: HashMap::default(),
        layers_per_region: layers_per_region.max(1) as u64,
        rope_pairing,
        experts_per_lane: match options.plan {
            Plan::Stacked { experts_per_lane, .. } => experts_per_lane.max(1) as u64,
            _ => 1,
        },
        vector_bytes: HashMap::default(),
        unit_of: units.iter().enumerate().flat_map(|(u, unit)| unit.instrs.clone().map(move |_| u)).collect(),
        input_leaders: HashMap::default(),
        placed_tiles: HashMap::default(),
        grid_columns: HashMap::default(),
    };
    let limit = (TILE_SHARE * usable as f64) as u64;
    for (u, unit) in units.iter().enumerate() {
        let (mut smallest, mut led) = (0, 0);
        for i in unit.instrs.clone() {
            if let Some(tiles) = stacked.base_tiles(i, u) {
                smallest += tiles.smallest / tiles.lanes;
                led += tiles.led / tiles.lanes;
            }
        }
        // Every matvec starts from its leader's tiling when they all fit so, else from its
        // smallest tile; what is left of the share is spread by weight bytes.
        let fits_led = led as f64 <= LED_TILE_SHARE * usable as f64;
        stacked.unit_led_tiles.push(fits_led);
        stacked.unit_slack.push(limit.saturating_sub(if fits_led { led } else { smallest }));
    }
    for u in 0..units.len() {
        if stacked.regions[u].as_ref().is_some_and(|r| r.tight) {
            stacked.balance_columns(u)?;
        }
    }
    for (u, unit) in units.iter().enumerate() {
        for i in unit.instrs.clone() {
            if matches!(module.body[waferc_ir::Handle::new(i)].op, Op::MatVec { .. }) {
                let tiles = stacked.place_tiles(i, u)?;
                stacked.placed_tiles.insert(i, tiles);
            }
        }
        for i in unit.instrs.clone() {
            let placement = stacked.place_instr(i, u)?;
            stacked.placer.placements.push(placement);
        }
    }
    stacked.placer.finish()
}

/// `cut` (consecutive pieces, each with its PE column) merged into runs of whole `unit`s: each
/// run ends where a unit does, and keeps its first piece's column.
fn merge_pieces(cut: Vec<(Range<u64>, u64)>, unit: u64) -> Vec<(Range<u64>, u64)> {
    let mut merged: Vec<(Range<u64>, u64)> = Vec::new();
    for (piece, column) in cut {
        match merged.last_mut() {
            Some((run, _)) if !run.end.is_multiple_of(unit) => run.end = piece.end,
            _ => merged.push((piece, column)),
        }
    }
    merged
}

/// Chooses the PE of a result segment (its elements, its bytes, the PEs taken so far).
type SegmentPicker<'p, S> = dyn FnMut(&mut S, &Range<u64>, u64, &HashSet<Pe>) -> Result<Pe, WaferError> + 'p;

/// A matvec's row blocks in row order, each with its grid slot (panel, row from the area's north
/// edge).
type RowBlocks = Vec<(Range<u64>, (u64, u64))>;

/// A matvec's tiles as [`Stacked::place_tiles`] laid them: its area and grid, its result's
/// column-aligned cut (if any), the halves an elementwise product reads, and its row blocks
/// with their grid slots.
struct PlacedTiles {
    area: Rect,
    grid: Grid,
    aligned: Option<Vec<(Range<u64>, u64)>>,
    halves: Option<u64>,
    blocks: RowBlocks,
    tiles: Vec<Tile>,
}

/// `rows` cut in row blocks of at most `rows_per_tile` rows. With `(slots, Some((j, n)))` (a
/// tight wafer) they are `slots` blocks (fewer when `rows` has fewer rows) of about equal length,
/// so every slot of the grid holds a tile and none a longer one than it needs: blocks of
/// `rows_per_tile` leave the last slots idle (the 70B's o and down projections on a 416x390
/// area: 8-row blocks filled 342 of its 390 rows, so the rest held a tile of each). The longer
/// blocks lie where `k * r / count + j / n` reaches a new integer (`r` the rows left over), so
/// the grids of a unit's `n` layers, at phases `j / n`, put them in different slots. Blocks of
/// `rows_per_tile` when that cannot keep within it.
fn row_runs(rows: Range<u64>, rows_per_tile: u64, (slots, even): (u64, Option<(u64, u64)>)) -> Vec<Range<u64>> {
    let len = rows.end - rows.start;
    let count = slots.min(len).max(1);
    match even {
        Some((j, n)) if len.div_ceil(count) <= rows_per_tile => {
            let (q, r) = (len / count, len % count);
            // Rows before block `k`: `k * q` plus the longer blocks among the first `k`.
            let start = |k: u64| rows.start + k * q + (k * r * n + j * count) / (count * n);
            (0..count).map(|k| start(k)..start(k + 1)).collect()
        }
        _ => (rows.start..rows.end)
            .step_by(rows_per_tile.max(1) as usize)
            .map(|start| start..(start + rows_per_tile).min(rows.end))
            .collect(),
    }
}

/// The columns (of an area `load.len()` wide) a grid taking `taken` of them uses, in order: all
/// but those whose tiles so far weigh most (ties: spread in the order of [`spread_rank`]).
fn lightest_columns(load: &[u64], taken: usize) -> Rc<[u16]> {
    let mut by_load: Vec<usize> = (0..load.len()).collect();
    by_load.sort_by_key(|&x| (std::cmp::Reverse(load[x]), spread_rank(x as u64)));
    let mut idle = vec![false; load.len()];
    by_load[..load.len().saturating_sub(taken)].iter().for_each(|&x| idle[x] = true);
    (0..load.len()).filter(|&x| !idle[x]).map(|x| x as u16).collect()
}

/// A column's place in the order [`Stacked::balance_columns`] breaks ties by: `x` times the
/// golden ratio's fractional part, modulo 1 (scaled to 32 bits), so any run of consecutive
/// places is spread evenly over the columns.
fn spread_rank(x: u64) -> u64 {
    (x * 2_654_435_769) % (1 << 32)
}

/// What a matvec's tile budget starts from ([`Stacked::base_tiles`]).
#[derive(Clone, Copy)]
struct BaseTiles {
    smallest: u64,
    led: u64,
    /// The lanes its area is squeezed into (an expert's), over which its tiles' SRAM spreads.
    lanes: u64,
}

/// A matvec's weight shape as (rows, columns); `None` for other ops.
fn matvec_shape(module: &Module, j: usize) -> Option<(u64, u64)> {
    match &module.body[waferc_ir::Handle::new(j)].op {
        Op::MatVec { weight, .. } => Some((module.weights[*weight].ty.shape[0], module.weights[*weight].ty.shape[1])),
        _ => None,
    }
}

struct Stacked<'a> {
    placer: Placer<'a>,
    regions: Vec<Option<Region>>,
    /// Matvec weight bytes per unit (what the tile budgets are shares of).
    unit_weight_bytes: Vec<u64>,
    /// Per unit, the tile SRAM per PE left once every matvec has its smallest tile: shared out
    /// by weight bytes, so every PE's tiles fit together.
    unit_slack: Vec<u64>,
    /// Per unit, whether every matvec's tile at its input leader's tiling fits the tile share
    /// together: then each budget starts from that tile, so the matvecs reading one vector
    /// share a tiling (and the vector one alignment) even where a wider tile costs a matvec
    /// more SRAM than its own smallest.
    unit_led_tiles: Vec<bool>,
    /// Per router, the PEs holding its experts' matvec results.
    expert_pes: HashMap<u32, HashSet<Pe>>,
    /// The walk's next cell in each expert lane, by the lane's corner.
    lane_cursors: HashMap<(u16, u16, u16), u64>,
    /// Per MoE block (its router's value), the columns of lanes its experts' lanes are cut in.
    lane_columns: HashMap<u32, u64>,
    layers_per_region: u64,
    rope_pairing: RopePairing,
    /// Experts sharing each MoE lane (`Plan::Stacked::experts_per_lane`).
    experts_per_lane: u64,
    /// Bytes of vectors placed on fresh PEs (`fresh_pe`, `band_pe`) per PE, kept under
    /// [`Stacked::vector_cap`] so the tiles placed later still fit.
    vector_bytes: HashMap<Pe, u64>,
    /// The unit of each instruction.
    unit_of: Vec<usize>,
    /// Per unit and input width, the matvec whose tiling the others of that width share
    /// ([`Stacked::input_leader`]).
    input_leaders: HashMap<(usize, u64), usize>,
    /// Matvecs whose tiles are placed ahead of the unit's other instructions, by instruction.
    placed_tiles: HashMap<usize, PlacedTiles>,
    /// The columns each matvec's interleaved grid takes on a tight wafer
    /// ([`Stacked::balance_columns`]).
    grid_columns: HashMap<usize, Rc<[u16]>>,
}

impl Stacked<'_> {
    fn region(&mut self, unit: usize) -> &mut Region {
        self.regions[unit].as_mut().expect("every unit has a region")
    }

    /// Attention `i`'s KV shape in `unit`'s region, with the region's blocks
    /// (`block_for_region`). `None` when 32 positions of a head do not fit a PE.
    fn kv_shape(&mut self, i: usize, unit: usize) -> Option<KvShape> {
        let usable = self.placer.params.usable_bytes_per_pe() as u64;
        let kv = KvShape::of(self.placer.module, i, self.placer.options, usable)?;
        Some(kv.with_block(self.region(unit).kv_block))
    }

    /// The most bytes of fresh vectors a PE takes: tiles placed later take up to their share of
    /// it too, so fresh vectors keep to half of what the tiles leave (the other half is for the
    /// ops that run on them in place).
    fn vector_cap(&self) -> u64 {
        ((1.0 - TILE_SHARE) * self.placer.params.usable_bytes_per_pe() as f64 / 2.0) as u64
    }

    /// Takes `bytes` of `pe` for a vector segment if it has them: SRAM room now, room under
    /// [`Stacked::vector_cap`], and not in `taken`.
    fn claim_vector(&mut self, pe: Pe, bytes: u64, taken: &HashSet<Pe>) -> bool {
        let limit = self.placer.params.sram_bytes_per_pe as u64;
        let used = self.placer.used_bytes(pe).max(self.placer.params.code_reserve_bytes as u64);
        let vectors = self.vector_bytes.get(&pe).copied().unwrap_or(0);
        let fits = used + bytes <= limit && vectors + bytes <= self.vector_cap() && !taken.contains(&pe);
        if fits {
            *self.vector_bytes.entry(pe).or_default() += bytes;
        }
        fits
    }

    /// The next PE of the unit's walk with room for `bytes` more, not in `taken` (a PE sends at
    /// most one message per route, so one instruction's segments sit on distinct PEs).
    fn fresh_pe(&mut self, i: usize, unit: usize, bytes: u64, taken: &HashSet<Pe>) -> Result<Pe, WaferError> {
        // An expert's vectors stay in its lane, each lane walked from its middle column.
        let area = self.area_of(i, unit).0;
        let in_lane = self.in_lane(i);
        let start = (area.w as u64 / 2) * area.h as u64;
        for _ in 0..area.pes() {
            let cursor = match in_lane {
                false => &mut self.region(unit).cursor,
                true => self.lane_cursors.entry((area.x, area.y, area.wafer)).or_insert(start),
            };
            let pe = area.walk(*cursor);
            *cursor += 1;
            if self.claim_vector(pe, bytes, taken) {
                return Ok(pe);
            }
        }
        Err(unsupported(
            self.placer.module,
            i,
            format!("no PE of its {}x{} region has {bytes} bytes free", area.w, area.h),
        ))
    }

    /// A PE in band `band` of `bands` of the unit's area with room for `bytes` more, not in
    /// `taken`: the band's columns walked westward from `west` columns west of the area's east
    /// edge (beside the KV strip), each from the band row nearest area row `row`.
    #[allow(clippy::too_many_arguments)]
    fn band_pe(
        &mut self,
        i: usize,
        unit: usize,
        (band, bands): (u64, u64),
        bytes: u64,
        taken: &HashSet<Pe>,
        west: u64,
        row: u64,
    ) -> Result<Pe, WaferError> {
        let area = self.region(unit).area;
        let rows = area.band(band, bands);
        let (w, h) = (rows.w as u64, rows.h as u64);
        let near = (row + area.y as u64).saturating_sub(rows.y as u64);
        for step in 0..w {
            let dx = w - 1 - (west + step) % w;
            for dy in nearest_first(near, h) {
                let pe = rows.at(dx, dy);
                if self.claim_vector(pe, bytes, taken) {
                    return Ok(pe);
                }
            }
        }
        Err(unsupported(
            self.placer.module,
            i,
            format!("no PE of band {band} of {bands} of its {}x{} area has {bytes} bytes free", rows.w, rows.h),
        ))
    }

    /// The row blocks of matvec `i` (`rows` rows, tiled as `g` over `area`), each with its
    /// (panel, row), when its result is an attention's queries, keys and values: every head's
    /// rows cut in blocks of at most the grid's rows per tile (no block spans two heads), each
    /// block in its KV head's band of rows, filling the band's rows of one panel before the
    /// next. The head's result segment sits in that band too (beside the KV blocks it goes to),
    /// so a head's roots are a run of the band's rows near its segment and the collects of
    /// different bands share no link; in the grid's own order a head's roots lie anywhere down a
    /// panel, often bands away, and the collects into one band queue on its columns. `None` when
    /// the result does not feed an attention, or a band's blocks outnumber its PEs in the grid's
    /// panels.
    fn band_blocks(&self, i: usize, rows: u64, g: &Grid, area: Rect) -> Option<RowBlocks> {
        let mut placed: Vec<u64> = Vec::new();
        let mut blocks = Vec::with_capacity(g.row_blocks as usize);
        for head_rows in super::size::segments(rows, self.segment_cut(i, rows, g.rows_per_tile)) {
            let HeadRows { kv_heads, head, .. } = self.attention_head(i, &head_rows)?;
            if placed.is_empty() {
                placed = vec![0; kv_heads as usize];
            }
            let band = area.band(head, placed.len() as u64);
            let (top, height) = ((band.y - area.y) as u64, band.h as u64);
            let mut start = head_rows.start;
            while start < head_rows.end {
                let k = placed.get_mut(head as usize)?;
                if *k / height >= g.panels {
                    return None;
                }
                let end = (start + g.rows_per_tile).min(head_rows.end);
                blocks.push((start..end, (*k / height, top + *k % height)));
                *k += 1;
                start = end;
            }
        }
        Some(blocks)
    }

    /// Half the length of dense matvec `i`'s `len`-long result when an elementwise product reads
    /// its two halves, the first through SiLU (a fused gate and up projection read as
    /// `silu(gate) * up`): then each segment of the second half sits on its twin's PE in the
    /// first, SiLU runs there and the product finds both operands in place, so neither needs a
    /// delivery.
    fn multiplied_halves(&self, i: usize, len: u64) -> Option<u64> {
        let (module, analysis) = (self.placer.module, self.placer.analysis);
        // An expert's lane is a few rows: its twins' collects would crowd the colours of one
        // row of PEs (Mixtral runs out of them).
        if analysis.expert[i].is_some() {
            return None;
        }
        let half = len / 2;
        // Where operand `v`'s data lies in `i`'s result, when it is `i`'s (through slices).
        let offset_in_i = |v: waferc_ir::Handle<waferc_ir::Instr>| {
            (analysis.source[v.index()] as usize == i).then(|| analysis.offset[v.index()])
        };
        let half_long = |v: waferc_ir::Handle<waferc_ir::Instr>| match &module.body[v].ty {
            ValueType::Tensor(t) => t.elements() == half,
            ValueType::Routing { .. } => false,
        };
        let product = analysis.readers[i].iter().any(|&r| {
            let Op::Mul { a, b } = &module.body[waferc_ir::Handle::new(r as usize)].op else { return false };
            let Op::Silu { x } = &module.body[*a].op else { return false };
            half_long(*x) && half_long(*b) && offset_in_i(*x) == Some(0) && offset_in_i(*b) == Some(half)
        });
        (len.is_multiple_of(2) && product).then_some(half)
    }

    /// [`rope_pairs`] of matvec `i`, unless this placement keeps whole heads.
    fn rope_pairs(&self, i: usize) -> Option<RopePairs> {
        match self.rope_pairing {
            RopePairing::Allowed => rope_pairs(self.placer.module, self.placer.analysis, i),
            RopePairing::Off => None,
        }
    }

    /// For a chunk `seg` of matvec `i`'s result in the second half of a head a rope reads
    /// directly ([`Stacked::rope_pairs`]), the PE of its twin half a head away when that PE has
    /// room for `room` more bytes (the chunk and the rope on it): the rope then runs in place.
    fn rope_partner_pe(&mut self, i: usize, seg: &Range<u64>, layout: &VectorLayout, room: u64) -> Option<Pe> {
        let pairs = self.rope_pairs(i)?;
        // Only rows a rope rotates (the queries and keys, not the values beside them).
        if !pairs.rotated.iter().any(|rows| rows.start <= seg.start && seg.end <= rows.end) {
            return None;
        }
        let twin = rope_twin(seg, pairs.head_dim).filter(|twin| twin.start < seg.start)?;
        let pe = layout.segments.iter().find(|s| s.elements == twin)?.pe;
        self.claim_vector(pe, room, &HashSet::default()).then_some(pe)
    }

    /// The PE of `seg`'s twin in the first half (see [`Stacked::multiplied_halves`]) when `seg`
    /// lies in the second half of a result read as multiplied `halves` and the twin's PE has
    /// room for `bytes` more.
    fn partner_pe(&mut self, halves: Option<u64>, seg: &Range<u64>, layout: &VectorLayout, bytes: u64) -> Option<Pe> {
        let half = halves.filter(|&half| seg.start >= half)?;
        let twin = seg.start - half..seg.end - half;
        let pe = layout.segments.iter().find(|s| s.elements == twin)?.pe;
        self.claim_vector(pe, bytes, &HashSet::default()).then_some(pe)
    }

    /// [`in_place_chain`] of matvec `i`.
    fn in_place_chain(&self, i: usize) -> Vec<(usize, u64)> {
        in_place_chain(self.placer.module, self.placer.analysis, i)
    }

    /// The bytes the ops that run in place on rows `rows` of matvec `i`'s result take on its
    /// segment's PE ([`Stacked::in_place_chain`]). On a tight wafer a head's segment found a PE
    /// with room for itself alone, and the 70B's rope then went to a fresh PE bands away from
    /// its KV blocks (its deliveries crossed the others' and ran out of colours).
    fn in_place_bytes(&self, i: usize, rows: &Range<u64>) -> u64 {
        let module = self.placer.module;
        self.in_place_chain(i)
            .into_iter()
            .skip(1)
            .filter_map(|(r, start)| {
                let ir = &module.body[waferc_ir::Handle::new(r)];
                let len = ir.ty.tensor().map_or(0, |t| t.elements());
                (start <= rows.start && rows.end <= start + len)
                    .then(|| super::size::vector_bytes(module, &ir.op, rows.end - rows.start))
            })
            .sum()
    }

    /// The attention that reads rows `rows` of matvec `i`'s result as queries, keys or values
    /// (directly, or through slices and the ops of [`Stacked::in_place_chain`]), with its KV
    /// head count and the KV head those rows belong to.
    fn attention_head(&self, i: usize, rows: &Range<u64>) -> Option<HeadRows> {
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

    /// Result segments on fresh PEs of the unit's (or the expert lane's) walk.
    fn fresh_layout(
        &mut self,
        i: usize,
        unit: usize,
        segments: &[Range<u64>],
        extra: &dyn Fn(&Range<u64>) -> Vec<Request>,
    ) -> Result<VectorLayout, WaferError> {
        self.layout_on(i, segments, extra, &mut |s, _, bytes, taken| s.fresh_pe(i, unit, bytes, taken))
    }

    /// An MoE combine's layout: each segment beside the residual stream's segment of the same
    /// elements (`beside_residual`), else in the column of its first expert's output for those
    /// elements (every expert's lane puts that segment of its result in the same column), in a
    /// row of its own, so the chosen experts' messages come up and down that column alone and no
    /// two segments' gathers share a link (on fresh PEs down one column, every gather queued on
    /// that column's links); on a fresh PE where there is no such column. Each segment also
    /// holds the `top_k` chosen experts' parts of it and their weights.
    fn combine_layout(&mut self, i: usize, unit: usize, top_k: u64, len: u64) -> Result<VectorLayout, WaferError> {
        let area = self.region(unit).area;
        let segments = super::size::segments(len, vector_cut(len));
        let count = segments.len() as u64;
        let scratch = |seg: &Range<u64>| vec![(RegionKind::Scratch, top_k * (seg.end - seg.start) * F32 + top_k * 8)];
        let residual = self.combined_residual(i);
        self.layout_on(i, &segments, &scratch, &mut |s, seg, bytes, taken| {
            let beside = residual.as_ref().and_then(|r| r.segments.iter().find(|r| r.elements == *seg));
            // Room for the residual add's result too, which runs in place on the segment.
            let room = bytes + (seg.end - seg.start) * F32;
            if let Some(pe) = beside.and_then(|r| s.beside_residual(r.pe, area, room, taken)) {
                return Ok(pe);
            }
            let column = s
                .operand_pe(i, seg.start)
                .filter(|pe| pe.wafer == area.wafer && (area.x..area.x + area.w).contains(&pe.x))
                .map(|pe| (pe.x - area.x) as u64);
            // Segment `j` of `count` in row `(2j + 1) h / 2count`: one row each down the area, so
            // their deliveries (the result's consumers lie in other columns) run along rows of
            // their own instead of queueing along one.
            let j = seg.start * count / len.max(1);
            let row = (2 * j + 1) * area.h as u64 / (2 * count.max(1));
            match column {
                Some(dx) => s.column_pe(i, unit, dx, row, bytes, taken),
                None => s.fresh_pe(i, unit, bytes, taken),
            }
        })
    }

    /// The layout of the residual stream that MoE combine `i`'s result is added to (the other
    /// operand of the residual add reading it), once placed.
    fn combined_residual(&self, i: usize) -> Option<VectorLayout> {
        let (module, analysis) = (self.placer.module, self.placer.analysis);
        analysis.readers[i].iter().find_map(|&r| {
            let Op::Add { a, b } = &module.body[waferc_ir::Handle::new(r as usize)].op else { return None };
            let other = if a.index() == i { *b } else { *a };
            match &self.placer.placements[analysis.source[other.index()] as usize].result {
                ResultLayout::Vector(v) => Some(v.clone()),
                ResultLayout::Routing { .. } => None,
            }
        })
    }

    /// A PE of `area` next to `pe` (the nearest of [`BESIDE`]) with room for `bytes` more, not in
    /// `taken`. A combine's segment goes beside its residual's (the MoE input's diagonal, at the
    /// region's centre): the residual add after the combine then receives the residual over one
    /// hop instead of across the region, and the post-attention norm, which runs on the
    /// residual's PEs, no longer waits for that delivery; the experts' lanes surround the centre,
    /// so their gathers are short too (Mixtral: the residual's delivery 708 -> 257 cycles, the
    /// gather 1,009 -> 777, 1,461 -> 1,524 tok/s). Not on the residual's own PE: with the
    /// experts' tiles beside the MoE input, a combine's two experts' parts and the add's result
    /// do not fit there (48.4 KB of Mixtral's 49.2).
    fn beside_residual(&mut self, pe: Pe, area: Rect, bytes: u64, taken: &HashSet<Pe>) -> Option<Pe> {
        if pe.wafer != area.wafer {
            return None;
        }
        BESIDE.iter().find_map(|&(dx, dy)| {
            let (x, y) = (pe.x as i64 + dx, pe.y as i64 + dy);
            let inside = (area.x as i64..(area.x + area.w) as i64).contains(&x)
                && (area.y as i64..(area.y + area.h) as i64).contains(&y);
            let next = Pe::new(pe.wafer, x as u16, y as u16);
            (inside && self.claim_vector(next, bytes, taken)).then_some(next)
        })
    }

    /// Instruction `i`'s result segments, each with its output and `extra` requests on a
    /// distinct PE that `pick` chooses for the segment and its bytes.
    fn layout_on(
        &mut self,
        i: usize,
        segments: &[Range<u64>],
        extra: &dyn Fn(&Range<u64>) -> Vec<Request>,
        pick: &mut SegmentPicker<'_, Self>,
    ) -> Result<VectorLayout, WaferError> {
        let mut layout = VectorLayout::default();
        let mut taken = HashSet::default();
        for seg in segments {
            let mut requests = vec![(RegionKind::Output { elements: seg.clone() }, (seg.end - seg.start) * F32)];
            requests.extend(extra(seg));
            let bytes = requests.iter().map(|(_, b)| b).sum();
            let pe = pick(self, seg, bytes, &taken)?;
            taken.insert(pe);
            self.placer.fill(pe, i as u32, requests)?;
            layout.segments.push(Segment { pe, elements: seg.clone() });
        }
        Ok(layout)
    }

    /// A vector op's layout: on its operand's segments if they suit, else fresh `unit`-element
    /// segments (the smallest multiple of 32 that is a whole number of `unit`s).
    fn vector_layout(
        &mut self,
        i: usize,
        unit: usize,
        len: u64,
        cut: u64,
        requests: &dyn Fn(&Range<u64>) -> Vec<Request>,
    ) -> Result<VectorLayout, WaferError> {
        // Only a host in this unit's own region: a vector of the previous unit stays there.
        let region = self.region(unit);
        let whole = Rect { w: region.area.w + region.kv.map_or(0, |kv| kv.w), ..region.area };
        let inside = |pe: Pe| {
            pe.wafer == whole.wafer
                && (whole.x..whole.x + whole.w).contains(&pe.x)
                && (whole.y..whole.y + whole.h).contains(&pe.y)
        };
        // A vector read in another region goes there one multicast per segment. To another
        // wafer (each turning to a crossing row of its own and west along it, `route::multicast`),
        // or on a tight wafer down the columns of a region whose rows do not line up, the
        // multicasts cross one another, each with a colour of its own: there it takes at
        // most `MAX_SEGMENTS` segments where its usual layout would have more (the 70B's
        // residual at a region's last layer ran in place on its down projection's 256 segments,
        // and their routes ran out of the router's 24 colours both ways). Elsewhere the
        // multicasts run side by side along rows, and more segments are faster (SmolLM2's
        // `stacked:1` 10,017 -> 7,654 tok/s with 16).
        if self.crosses_regions_in_few_segments(i) && self.cut_too_fine_to_cross(i, len) {
            let fewest = len.div_ceil(MAX_SEGMENTS);
            return match self.aligned_cut(i, len, 0) {
                Some(cut) => self.aligned_layout(i, unit, merge_pieces(cut, fewest), false, requests),
                None => self.fresh_layout(i, unit, &super::size::segments(len, cut.max(fewest)), requests),
            };
        }
        // The LM head's input: few segments on a diagonal at the centre of its area, whose
        // multicasts to the head's side-by-side panels ([`Stacked::panel_layout`]) cross but
        // share no link (each crosses every other, so each takes a colour).
        if self.feeds_logits_only(i) {
            let cut = vector_cut(len);
            let segments = super::size::segments(len, cut);
            let count = segments.len() as u64;
            let area = self.region(unit).area;
            return self.layout_on(i, &segments, requests, &mut |s, seg, bytes, taken| {
                let (dx, dy) = central_diagonal(area, seg.start / cut, count, (0, 1));
                s.column_pe(i, unit, dx, dy, bytes, taken)
            });
        }
        // An op reading the vector of the region beside sits in the rows that vector arrives
        // on, so its deliveries run straight along rows, side by side (`columns`).
        let across = self.reads_from_beside(i);
        // The residual stream inside a region runs along its middle row, or else the norm on
        // it does (`columns`).
        if !across && (self.residual_in_middle_row(i) || self.norm_in_middle_row(i)) {
            if let Some(cut) = self.aligned_cut(i, len, 0) {
                return self.aligned_layout(i, unit, cut, true, requests);
            }
        }
        if !across {
            if let Some(layout) = self.placer.host_layout(i, &inside, len, requests) {
                return Ok(layout);
            }
        }
        if let Some(cut) = self.aligned_cut(i, len, 0) {
            return self.aligned_layout(i, unit, cut, false, requests);
        }
        if across {
            if let Some(layout) = self.placer.host_layout(i, &inside, len, requests) {
                return Ok(layout);
            }
        }
        self.fresh_layout(i, unit, &super::size::segments(len, cut), requests)
    }

    /// Whether every reader of instruction `i` is an LM head laid side by side
    /// ([`Stacked::lm_head_side_by_side`]).
    fn feeds_logits_only(&self, i: usize) -> bool {
        let readers = &self.placer.analysis.readers[i];
        !readers.is_empty() && readers.iter().all(|&r| self.lm_head_side_by_side(r as usize))
    }

    /// Whether instruction `i` is a matvec whose result nothing reads (the LM head) with its
    /// panels side by side: in an MoE model (whose last residual add lies on its combine's few
    /// segments) and off a tight wafer. In a dense model the last add runs in place on its down
    /// projection's segments, cut for the head's column blocks through the final norm; off them
    /// it cost more than the head's reduction gained (the 8B's search: `stacked:4,100,kv2`
    /// 345,217 -> 349,861 cycles). On a tight wafer the input arrives down columns that do not
    /// line up with the region before, and on a diagonal its multicasts queued along the
    /// residual's row (the 70B's last add waited 7.6k cycles; its head's reduction had 3.3k).
    fn lm_head_side_by_side(&self, i: usize) -> bool {
        let module = self.placer.module;
        module.has_moe()
            && matches!(module.body[waferc_ir::Handle::new(i)].op, Op::MatVec { .. })
            && self.placer.analysis.readers[i].is_empty()
            && self.regions[self.unit_of[i]].as_ref().is_some_and(|r| !r.tight)
    }

    /// Whether vector op `i` (`len` elements), laid out as usual, would have more than
    /// [`MAX_SEGMENTS`] segments: its aligned cut has more pieces, or an operand it may run in
    /// place on has more segments.
    fn cut_too_fine_to_cross(&mut self, i: usize, len: u64) -> bool {
        if self.aligned_cut(i, len, 0).is_some_and(|cut| cut.len() as u64 > MAX_SEGMENTS) {
            return true;
        }
        let analysis = self.placer.analysis;
        self.placer.module.body[waferc_ir::Handle::new(i)].op.operands().into_iter().any(|operand| {
            let source = analysis.source[operand.index()] as usize;
            match self.placer.placements.get(source).map(|p| &p.result) {
                Some(ResultLayout::Vector(layout)) => layout.segments.len() as u64 > MAX_SEGMENTS,
                _ => false,
            }
        })
    }

    /// Whether instruction `i`'s value goes to its readers through few long segments (see
    /// `vector_layout`): when it is read on another wafer, or on a tight wafer in another region
    /// (there `exact_rectangles` does not line regions' rows up, so the segments' multicasts to
    /// the region beside turn down its columns and cross one another).
    fn crosses_regions_in_few_segments(&self, i: usize) -> bool {
        let unit = self.unit_of[i];
        let Some(own) = self.regions[unit].as_ref() else { return false };
        self.placer.analysis.readers[i].iter().any(|&r| {
            let other = self.unit_of[r as usize];
            let wafer = self.regions[other].as_ref().map(|o| o.area.wafer);
            other != unit && (own.tight || wafer != Some(own.area.wafer))
        })
    }

    /// The tile area of instruction `i` and how many lanes its area is cut into: the unit's area,
    /// or its expert's lane (see `lanes`).
    fn area_of(&mut self, i: usize, unit: usize) -> (Rect, u64) {
        let area = self.region(unit).area;
        let analysis = self.placer.analysis;
        let (Some(expert), Some(router)) = (analysis.expert[i], analysis.router[i]) else { return (area, 1) };
        // A lane per `experts_per_lane` experts (`lanes`): experts of different lanes run side by
        // side and never share a PE.
        let experts = match self.placer.module.body[waferc_ir::Handle::new(router as usize)].ty {
            ValueType::Routing { experts, .. } => (experts as u64).div_ceil(self.experts_per_lane),
            _ => 1,
        };
        let across = match self.lane_columns.get(&router) {
            Some(&across) => across,
            None => {
                // The block's experts share shapes: the first one met stands for them all.
                let shapes: Vec<(u64, u64, PanelLayout)> = self
                    .unit_instrs(unit)
                    .filter(|&j| analysis.router[j] == Some(router) && analysis.expert[j] == Some(expert))
                    .filter_map(|j| matvec_shape(self.placer.module, j).map(|(r, c)| (r, c, self.panel_layout(j))))
                    .collect();
                let across = lanes::lane_columns(area, experts, &shapes);
                self.lane_columns.insert(router, across);
                across
            }
        };
        lanes::lane(area, experts, across, expert as u64)
    }

    /// The most panels matvec `i`'s tiling may fold into: [`MAX_PANELS`] when the matvec leading
    /// its input width (an expert: itself) has tiles [`DEEP_TILE_ROWS`] deep at
    /// [`NARROW_PANELS`] panels, else [`NARROW_PANELS`]. One cap per input width, so the
    /// matvecs sharing a tiling fold alike.
    fn max_panels(&mut self, i: usize, unit: usize) -> u64 {
        let area = self.area_of(i, unit).0;
        let leader = self.leader_of(i, unit);
        matvec_shape(self.placer.module, leader).map_or(NARROW_PANELS, |(rows, _)| panel_cap(rows, area.h as u64))
    }

    /// Where matvec `i` is tiled: its area, its most panels and their layout.
    fn span(&mut self, i: usize, unit: usize) -> Span {
        Span { area: self.area_of(i, unit).0, max_panels: self.max_panels(i, unit), layout: self.panel_layout(i) }
    }

    /// Side-by-side panels for a matvec reading an MoE layer's input (through its expert's
    /// `expert_dispatch`) and for an MoE model's LM head off a tight wafer (its input then sits
    /// on a diagonal, see `vector_layout`), else interleaved ones (see [`PanelLayout`]).
    /// Interleaved, the head's panels reduced their long row blocks over the same links of each
    /// PE row: Mixtral-8x7B's 493-row blocks in five panels waited 11.3k of the reduction's
    /// 22.3k cycles.
    fn panel_layout(&self, i: usize) -> PanelLayout {
        let module = self.placer.module;
        let operands = module.body[waferc_ir::Handle::new(i)].op.operands();
        match self.lm_head_side_by_side(i)
            || operands.iter().any(|o| matches!(module.body[*o].op, Op::ExpertDispatch { .. }))
        {
            true => PanelLayout::SideBySide,
            false => PanelLayout::Interleaved,
        }
    }

    /// The matvec whose tiling matvec `i` shares: the leader of its input width in its unit
    /// (`input_leader`), or itself for an expert's (its lane holds only its own tiles).
    fn leader_of(&mut self, i: usize, unit: usize) -> usize {
        match (self.in_lane(i), matvec_shape(self.placer.module, i)) {
            (false, Some((_, cols))) => self.input_leader(unit, cols),
            _ => i,
        }
    }

    /// Whether instruction `i` is an MoE expert's, placed in its expert's lane ([`Stacked::area_of`]).
    fn in_lane(&self, i: usize) -> bool {
        let analysis = self.placer.analysis;
        analysis.expert[i].is_some() && analysis.router[i].is_some()
    }

    /// Matvec `i`'s tile area (the unit's, or its expert's lane) and its tiling there. Each
    /// matvec's tiles get SRAM in proportion to its weight's share of the unit's (times the lanes
    /// it is squeezed into), so every PE's tiles fit together.
    fn matvec_grid(&mut self, i: usize, unit: usize) -> Result<(Rect, Grid), WaferError> {
        let (area, mut g) = self.packed_grid(i, unit)?;
        g.used_columns = self.grid_columns.get(&i).cloned();
        Ok((area, g))
    }

    /// Chooses the columns of each interleaved grid of `unit` that leaves some idle, so every
    /// column's tiles weigh about the same. Only on a tight wafer (see [`exact_rectangles`]),
    /// where a PE's weights are most of its SRAM: packed grids leave the same east columns idle
    /// in every matrix, so the west columns hold a tile of each (the 70B's `stacked:4` 10% over
    /// the mean), while balanced ones cost the reductions a longer span. Grids are taken from
    /// the heaviest tile down; each leaves idle the columns whose tiles so far weigh most (ties:
    /// spread in the golden-ratio order, `spread_rank`), and takes the others in order. A
    /// column's weight counts every tile of the column as if in one PE: a unit's matvecs cover
    /// nearly all rows, so its busiest PEs hold a tile of each grid over their column. Grids in
    /// an expert's lane keep their packed columns and are not counted (no MoE model is tight).
    fn balance_columns(&mut self, unit: usize) -> Result<(), WaferError> {
        let module = self.placer.module;
        let area = self.region(unit).area;
        let mut grids: Vec<(u64, usize, Grid)> = Vec::new();
        for i in self.unit_instrs(unit) {
            let Op::MatVec { weight, .. } = &module.body[waferc_ir::Handle::new(i)].op else { continue };
            let (tile_area, g) = self.packed_grid(i, unit)?;
            if tile_area != area {
                continue;
            }
            let w = &module.weights[*weight].ty;
            let width = (g.chunks_per_tile * CHUNK).min(w.shape[1]);
            let bytes = w.dtype.row_bytes(width).map_or(0, |row| g.rows_per_tile * row);
            grids.push((bytes, i, g));
        }
        grids.sort_by_key(|&(bytes, i, _)| (std::cmp::Reverse(bytes), i));
        let width = area.w as usize;
        let mut load = vec![0u64; width];
        // The segments of a vector crossing to another region are few and long (see
        // `vector_layout`): [`MAX_SEGMENTS`] evenly spread columns start with their bytes, so the
        // grids leave those columns idle more often and the segments find room there.
        let landing = self
            .unit_instrs(unit)
            .filter(|&i| self.crosses_regions_in_few_segments(i))
            .map(|i| {
                let ir = &module.body[waferc_ir::Handle::new(i)];
                let len = ir.ty.tensor().map_or(0, |t| t.elements());
                super::size::vector_bytes(module, &ir.op, len.div_ceil(MAX_SEGMENTS))
            })
            .max()
            .unwrap_or(0);
        for j in 0..MAX_SEGMENTS.min(width as u64) {
            load[((2 * j + 1) * width as u64 / (2 * MAX_SEGMENTS)) as usize] += landing;
        }
        for (bytes, i, g) in grids {
            let taken = (g.col_blocks * g.panels) as usize;
            if g.layout == PanelLayout::Interleaved && taken < width {
                self.grid_columns.insert(i, lightest_columns(&load, taken));
            }
            let (_, g) = self.matvec_grid(i, unit)?;
            g.columns_taken().for_each(|x| load[x as usize] += bytes);
        }
        Ok(())
    }

    /// Matvec `i`'s tiling with its column blocks packed from the area's west edge.
    fn packed_grid(&mut self, i: usize, unit: usize) -> Result<(Rect, Grid), WaferError> {
        let module = self.placer.module;
        let Op::MatVec { weight, bias, .. } = &module.body[waferc_ir::Handle::new(i)].op else {
            return Err(unsupported(module, i, "internal: a tile grid for an instruction that is not a matvec".into()));
        };
        let w = &module.weights[*weight];
        let (rows, cols) = (w.ty.shape[0], w.ty.shape[1]);
        let (area, lanes) = self.area_of(i, unit);
        let span = self.span(i, unit);
        let bias_dtype = bias.map(|b| module.weights[b].ty.dtype);
        let tile = |r, width| super::size::tile_bytes(w.ty.dtype, bias_dtype, r, width);
        let share = weight_bytes(module, *weight) as f64 / self.unit_weight_bytes[unit].max(1) as f64;
        let slack = self.unit_slack[unit] as f64;
        let base = match self.base_tiles(i, unit) {
            Some(t) if self.unit_led_tiles[unit] => t.led,
            Some(t) => t.smallest,
            None => smallest_tile(rows, cols, span, &tile),
        };
        // `base` is `u64::MAX` when no tiling's column blocks fit the area's width at all.
        let budget = tile_budget(base, (share * lanes as f64 * slack) as u64, self.region(unit).tight);
        // A router's logits matvec takes its host expert's column blocks, in that expert's lane
        // (`host_expert`): the MoE input multicasts to every lane's columns anyway, and in other
        // columns its segments' runs to the router queued behind one another's (Mixtral's
        // post-attention norm delivered in 1,455 cycles, 726 of them waiting; in the lane's, 729:
        // 1,338 -> 1,375 tok/s). Its tile may take [`ROUTER_TILE_ROOM`] where its share is less;
        // where the expert's tile is larger, a block of interleaved panels is split in `s` (fewer
        // chunks, `s` times fewer panels), so each piece still sits in a column of its block's.
        if let Some(expert) = self.host_expert(i, unit, cols) {
            let (lane, led) = self.matvec_grid(expert, unit)?;
            let room = budget.max(ROUTER_TILE_ROOM);
            let fits =
                |g: &Grid| tile(g.rows_per_tile, (g.chunks_per_tile * CHUNK).min(cols)).is_some_and(|b| b <= room);
            let splits = match led.layout {
                PanelLayout::Interleaved => led.chunks_per_tile,
                PanelLayout::SideBySide => 1,
            };
            let split = (0..)
                .map(|j| 1u64 << j)
                .take_while(|&s| s <= splits && led.panels.is_multiple_of(s))
                .filter_map(|s| {
                    let span = Span { area: lane, max_panels: led.panels / s, layout: led.layout };
                    Grid::over(rows, cols, span, led.chunks_per_tile / s)
                })
                .find(fits);
            if let Some(g) = split {
                return Ok((lane, g));
            }
        }
        // Matvecs that read inputs of one width share the tiling of the largest of them, so a
        // vector read by several suits them all (`columns`); one whose share of a PE cannot take
        // that tiling picks its own.
        let leader = self.leader_of(i, unit);
        let led = match leader == i {
            true => None,
            false => Some(self.matvec_grid(leader, unit)?.1.chunks_per_tile),
        };
        let g = led.and_then(|run| grid(rows, cols, span, &tile, budget, Some(run)));
        let g = g.or_else(|| grid(rows, cols, span, &tile, budget, None)).ok_or_else(|| {
            let why = match Grid::candidates(rows, cols, span).next() {
                Some(_) => format!("fits its {budget}-byte share of a PE"),
                None => format!(
                    "fits: its {} chunks need at least {} columns at {MAX_CHUNKS_PER_TILE} chunks a tile",
                    cols.div_ceil(CHUNK),
                    cols.div_ceil(CHUNK).div_ceil(MAX_CHUNKS_PER_TILE)
                ),
            };
            unsupported(
                module,
                i,
                format!("no tile of weight {} ({}) over a {}x{} area {why}", w.name, w.ty, area.w, area.h),
            )
        })?;
        Ok((area, g))
    }

    /// For a router's logits matvec `i` (read by a `router_topk`), the matvec of that router's
    /// experts reading an input as wide (`cols`) whose lane's north-west corner, where the
    /// router's few row blocks go, is nearest the area's centre (ties: the lower expert). The
    /// MoE input's diagonal and so the router's input sit at the centre, and the top-k decision
    /// leaves from the router (`RouterTopK` in `place_instr`) to every lane: from expert 0's
    /// corner lane it crossed the region (Mixtral's took 777 cycles, from the centre 496).
    fn host_expert(&mut self, i: usize, unit: usize, cols: u64) -> Option<usize> {
        let (module, analysis) = (self.placer.module, self.placer.analysis);
        let topk = analysis.readers[i]
            .iter()
            .find(|&&r| matches!(module.body[waferc_ir::Handle::new(r as usize)].op, Op::RouterTopK { .. }))?;
        let readers_alike: Vec<usize> = self
            .unit_instrs(unit)
            .filter(|&j| {
                analysis.router[j] == Some(*topk)
                    && analysis.expert[j].is_some()
                    && matvec_shape(module, j).is_some_and(|(_, c)| c == cols)
            })
            .collect();
        let area = self.region(unit).area;
        let centre = (area.x as i64 + area.w as i64 / 2, area.y as i64 + area.h as i64 / 2);
        readers_alike.into_iter().min_by_key(|&j| {
            let lane = self.area_of(j, unit).0;
            ((lane.x as i64 - centre.0).abs() + (lane.y as i64 - centre.1).abs(), analysis.expert[j])
        })
    }

    /// Matvec `i`'s smallest tile, and its tile at its input leader's least-cost tiling (the
    /// leader's own when `i` leads, its smallest when it cannot take the leader's chunks per
    /// tile; an expert's is its smallest: its lane holds only its own tiles). `None` for other
    /// ops.
    fn base_tiles(&mut self, i: usize, unit: usize) -> Option<BaseTiles> {
        let module = self.placer.module;
        let tiling = |i: usize| {
            let Op::MatVec { weight, bias, .. } = &module.body[waferc_ir::Handle::new(i)].op else { return None };
            let w = &module.weights[*weight];
            let bias_dtype = bias.map(|b| module.weights[b].ty.dtype);
            let (rows, cols) = (w.ty.shape[0], w.ty.shape[1]);
            Some((rows, cols, move |r, width| super::size::tile_bytes(w.ty.dtype, bias_dtype, r, width)))
        };
        let (rows, cols, tile) = tiling(i)?;
        let lanes = self.area_of(i, unit).1;
        let span = self.span(i, unit);
        let smallest = smallest_tile(rows, cols, span, &tile);
        let led = match self.in_lane(i) {
            false if self.input_followed(unit, cols) => {
                let leader = self.input_leader(unit, cols);
                let (l_rows, l_cols, l_tile) = tiling(leader)?;
                let run = grid(l_rows, l_cols, span, &l_tile, u64::MAX, None).map(|g| g.chunks_per_tile);
                run.and_then(|run| grid(rows, cols, span, &tile, u64::MAX, Some(run)))
                    .and_then(|g| tile(g.rows_per_tile, (g.chunks_per_tile * CHUNK).min(cols)))
                    .unwrap_or(smallest)
            }
            _ => smallest,
        };
        Some(BaseTiles { smallest, led, lanes })
    }

    /// Whether the dense matvecs of `unit` reading an input `cols` wide differ in shape (so the
    /// smaller ones follow their leader's tiling rather than their own smallest; matvecs of one
    /// shape, as every layer's down projection, have one smallest tiling anyway).
    fn input_followed(&self, unit: usize, cols: u64) -> bool {
        let mut rows = self.dense_readers(unit, cols).map(|(_, rows)| rows);
        let first = rows.next();
        rows.any(|r| Some(r) != first)
    }

    /// The dense matvec of `unit` with the most rows (the first of them) among those whose input
    /// is `cols` wide.
    fn input_leader(&mut self, unit: usize, cols: u64) -> usize {
        if let Some(&leader) = self.input_leaders.get(&(unit, cols)) {
            return leader;
        }
        let leader = self
            .dense_readers(unit, cols)
            .max_by_key(|&(j, rows)| (rows, std::cmp::Reverse(j)))
            .map_or(usize::MAX, |(j, _)| j);
        self.input_leaders.insert((unit, cols), leader);
        leader
    }

    /// The instructions of `unit`.
    fn unit_instrs(&self, unit: usize) -> Range<usize> {
        self.unit_of.partition_point(|&u| u < unit)..self.unit_of.partition_point(|&u| u <= unit)
    }

    /// The dense (not an expert's) matvecs of `unit` whose input is `cols` wide, with their rows.
    fn dense_readers(&self, unit: usize, cols: u64) -> impl Iterator<Item = (usize, u64)> + '_ {
        let (module, analysis) = (self.placer.module, self.placer.analysis);
        self.unit_instrs(unit)
            .filter(move |&j| analysis.expert[j].is_none())
            .filter_map(move |j| matvec_shape(module, j).filter(|&(_, width)| width == cols).map(|(rows, _)| (j, rows)))
    }

    /// Lays matvec `i`'s tile grid over its area and takes each tile's SRAM. A unit's tiles are
    /// placed before any of its vectors (see [`place`]), so a vector segment looking for room
    /// sees the tiles that will share its PE: placed in program order, the 70B's first layers'
    /// vectors took the room its later layers' tiles needed on the busiest PEs.
    fn place_tiles(&mut self, i: usize, unit: usize) -> Result<PlacedTiles, WaferError> {
        let module = self.placer.module;
        let instr = i as u32;
        let Op::MatVec { weight, .. } = &module.body[waferc_ir::Handle::new(i)].op else {
            return Err(unsupported(module, i, "internal: tiles for an instruction that is not a matvec".into()));
        };
        let (rows, cols) = (module.weights[*weight].ty.shape[0], module.weights[*weight].ty.shape[1]);
        let (area, mut g) = self.matvec_grid(i, unit)?;
        let aligned = self.aligned_cut(i, rows, g.rows_per_tile);
        // Side-by-side panels keep row blocks down a panel: each panel then holds a run of
        // the result that the aligned segments' columns put over that panel's columns
        // (they spread a vector over the width in order), so the roots stay near them.
        g.rows_across_panels = aligned.is_some() && g.layout == PanelLayout::Interleaved;
        let width_of = |c: u64| (c * g.chunks_per_tile * CHUNK)..((c + 1) * g.chunks_per_tile * CHUNK).min(cols);
        // Multiplied halves (see `multiplied_halves`) are cut in row blocks each, block
        // `j` of the two side by side (grid slots `2j` and `2j + 1`), so twins' roots
        // share a PE row with the segment they both go to.
        let rpt = g.rows_per_tile;
        let halves = self.multiplied_halves(i, rows).filter(|&half| 2 * half.div_ceil(rpt) <= g.panels * g.height);
        let blocks = aligned.is_none().then(|| self.band_blocks(i, rows, &g, area)).flatten();
        // On a tight wafer every slot of the grid takes a block (see `row_runs`), at a phase of
        // its own per layer of the unit.
        let local = module.body[waferc_ir::Handle::new(i)].layer.map_or(0, |l| l as u64 % self.layers_per_region);
        let even = self.region(unit).tight.then_some((local, self.layers_per_region));
        let blocks = blocks.unwrap_or_else(|| {
            let cuts = match halves {
                Some(half) => [0..half, half..rows],
                None => [0..rows, rows..rows],
            };
            let cuts = &cuts[..1 + halves.is_some() as usize];
            let sides = cuts.len() as u64;
            let slots = (g.panels * g.height / sides, even);
            let mut blocks = Vec::new();
            for (side, cut) in cuts.iter().enumerate() {
                for (j, run) in row_runs(cut.clone(), rpt, slots).into_iter().enumerate() {
                    blocks.push((run, g.slot(j as u64 * sides + side as u64)));
                }
            }
            blocks
        });
        let mut tiles = Vec::with_capacity(blocks.len() * g.col_blocks as usize);
        for (tile_rows, (panel, y)) in &blocks {
            for c in 0..g.col_blocks {
                let pe = area.at(g.column(c, *panel), *y);
                let tile_cols = width_of(c);
                let requests = tile_requests(module, i, tile_rows.clone(), tile_cols.clone(), c == 0)?;
                let region = self.placer.fill(pe, instr, requests)?[0];
                let chunks = tile_cols.start / CHUNK..tile_cols.end.div_ceil(CHUNK);
                tiles.push(Tile { pe, rows: narrow(tile_rows.clone()), chunks: narrow(chunks), region });
            }
        }
        Ok(PlacedTiles { area, grid: g, aligned, halves, blocks, tiles })
    }

    /// A PE for segment `j` of `count` of an expert's result, spread over its lane's width: in
    /// column `(2j + 1) w / 2count` of `area`, as near its tile's row (`tile`) as has room for
    /// `bytes`. `None`: that column has no room.
    #[allow(clippy::too_many_arguments)]
    fn spread_pe(
        &mut self,
        i: usize,
        unit: usize,
        area: Rect,
        (j, count): (u64, u64),
        tile: Pe,
        bytes: u64,
        taken: &HashSet<Pe>,
    ) -> Option<Pe> {
        let dx = (2 * j + 1) * area.w as u64 / (2 * count.max(1));
        let dy = (tile.y - area.y) as u64;
        self.column_pe(i, unit, dx, dy, bytes, taken).ok()
    }

    fn place_instr(&mut self, i: usize, unit: usize) -> Result<InstrPlacement, WaferError> {
        let module = self.placer.module;
        let ir = &module.body[waferc_ir::Handle::new(i)];
        let instr = i as u32;
        let len = match &ir.ty {
            ValueType::Tensor(t) => t.elements(),
            ValueType::Routing { .. } => 0,
        };
        let (result, work) = match &ir.op {
            Op::MatVec { weight, bias, .. } => {
                let (rows, cols) = (module.weights[*weight].ty.shape[0], module.weights[*weight].ty.shape[1]);
                let PlacedTiles { area, grid: g, aligned, halves, blocks, tiles } =
                    self.placed_tiles.remove(&i).ok_or_else(|| {
                        unsupported(module, i, "internal: a matvec whose tiles were not placed first".into())
                    })?;
                // The grid slot of the row block holding `row`.
                let slot_of = |row: u64| blocks[blocks.partition_point(|(rows, _)| rows.end <= row)].1;
                // Result segments of `vector_cut` elements (whole heads when rope reads the
                // result), so norms and rope run in place.
                let mut layout = VectorLayout::default();
                // An expert's result segments avoid the PEs of its layer's other experts' (lanes
                // repeat tile positions): a combine's gather takes one message per sending PE.
                let router = self.placer.analysis.router[i].filter(|_| self.placer.analysis.expert[i].is_some());
                let mut taken = router.map(|r| self.expert_pes.entry(r).or_default().clone()).unwrap_or_default();
                match aligned {
                    // A result that feeds one-panel matvecs only is cut by their column blocks,
                    // each segment in its block's column (`columns`), in the row of its rows' tiles.
                    Some(cut) => {
                        for (seg, dx) in cut {
                            let row = slot_of((seg.start + seg.end - 1) / 2).1;
                            let bytes = (seg.end - seg.start) * F32;
                            let pe = match self.partner_pe(halves, &seg, &layout, bytes) {
                                Some(pe) => pe,
                                None => self.column_pe(i, unit, dx, row, bytes, &taken)?,
                            };
                            taken.insert(pe);
                            if let Some(r) = router {
                                self.expert_pes.entry(r).or_default().insert(pe);
                            }
                            self.placer.fill(pe, instr, vec![(RegionKind::Output { elements: seg.clone() }, bytes)])?;
                            layout.segments.push(Segment { pe, elements: seg });
                        }
                    }
                    // Else each segment sits in the middle tile row of its rows, in a column of
                    // its own (segments spread over the panel's columns), not all on the row
                    // roots. The layers of a group interleave their columns.
                    None => {
                        let segments = super::size::segments(rows, self.segment_cut(i, rows, g.rows_per_tile));
                        let count = segments.len() as u64;
                        let (k, local) = match ir.layer {
                            Some(l) => (self.layers_per_region, l as u64 % self.layers_per_region),
                            None => (1, 0),
                        };
                        // Per KV head band, the segments placed in it so far.
                        let mut in_band: HashMap<u64, u64> = HashMap::default();
                        let feeds_experts = self.feeds_experts(i);
                        // An expert's output whose column blocks are fewer than its segments
                        // would put several segments in one column, and the combine takes each
                        // segment's column from them (`combine_layout`): its gathers then queue
                        // down that column. Those segments spread over the lane's width instead,
                        // one column each (Qwen3-30B-A3B's down projection, three column blocks
                        // for 16 segments: the gather waited 2.0k of its 3.6k cycles a layer).
                        // So do the segments whose tile has no room left: the next free PEs
                        // of the region's walk run down one column, and the expert's collects
                        // queued there (Qwen3-30B-A3B `share4`, whose lanes hold four experts'
                        // tiles: 1.4k cycles a collect).
                        let combined = self.placer.analysis.expert[i].is_some()
                            && self.placer.analysis.readers[i].iter().any(|&r| {
                                matches!(module.body[waferc_ir::Handle::new(r as usize)].op, Op::ExpertCombine { .. })
                            });
                        let spread = g.col_blocks < count && combined;
                        for (j, seg) in segments.into_iter().enumerate() {
                            let middle = (seg.start + seg.end - 1) / 2;
                            let r = blocks.partition_point(|(rows, _)| rows.end <= middle) as u64;
                            let c = ((j as u64 * k + local) * g.col_blocks / (count * k).max(1)) % g.col_blocks;
                            let bytes = (seg.end - seg.start) * F32;
                            // Queries, keys and values sit in their KV head's band of rows (see
                            // `attention`), each in a column of its own and as near its rows'
                            // tiles as the band allows, so their collects run side by side.
                            let rope_room = self.in_place_bytes(i, &seg);
                            let partner = match self.rope_partner_pe(i, &seg, &layout, bytes + rope_room) {
                                Some(pe) => {
                                    *self.vector_bytes.entry(pe).or_default() -= rope_room;
                                    Some(pe)
                                }
                                None => self.partner_pe(halves, &seg, &layout, bytes),
                            };
                            let tile = tiles.get((r * g.col_blocks + c) as usize);
                            let pe = match (partner, self.attention_head(i, &seg), tile) {
                                (Some(pe), _, _) => pe,
                                (None, Some(HeadRows { attention, kv_heads, head, role }), _) => {
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
                                    // the queries spread over the band's rows, so those running
                                    // past other slices' columns do not all share one row (from
                                    // its top and bottom rows, 32 of the 70B's met at one PE
                                    // and ran out of colours).
                                    if let (Some(kv), HeadRole::Query(Some(q))) = (kv.filter(|kv| kv.slices > 1), role)
                                    {
                                        let per_copy = kv.queries_per_copy().max(1);
                                        row = top + band.h as u64 * (2 * (q % per_copy) + 1) / (2 * per_copy);
                                    }
                                    // With room for the rope and norm that run in place on it.
                                    let room = bytes + self.in_place_bytes(i, &seg);
                                    let pe = self.band_pe(
                                        i,
                                        unit,
                                        (head, kv_heads),
                                        room,
                                        &taken,
                                        (*slot - 1) * kv_heads + head,
                                        row,
                                    )?;
                                    *self.vector_bytes.entry(pe).or_default() -= room - bytes;
                                    pe
                                }
                                (None, None, Some(tile)) if spread => {
                                    match self.spread_pe(i, unit, area, (j as u64, count), tile.pe, bytes, &taken) {
                                        Some(pe) => pe,
                                        // A column without room (a lane of few rows): its tile's.
                                        None if self.claim_vector(tile.pe, bytes, &taken) => tile.pe,
                                        None => self.fresh_pe(i, unit, bytes, &taken)?,
                                    }
                                }
                                (None, None, _) if feeds_experts => {
                                    let (dx, dy) = central_diagonal(area, j as u64, count, (local, k));
                                    self.column_pe(i, unit, dx, dy, bytes, &taken)?
                                }
                                (None, None, Some(tile)) if self.claim_vector(tile.pe, bytes, &taken) => tile.pe,
                                (None, None, Some(tile)) if combined => {
                                    match self.spread_pe(i, unit, area, (j as u64, count), tile.pe, bytes, &taken) {
                                        Some(pe) => pe,
                                        None => self.fresh_pe(i, unit, bytes, &taken)?,
                                    }
                                }
                                _ => self.fresh_pe(i, unit, bytes, &taken)?,
                            };
                            taken.insert(pe);
                            if let Some(r) = router {
                                self.expert_pes.entry(r).or_default().insert(pe);
                            }
                            self.placer.fill(pe, instr, vec![(RegionKind::Output { elements: seg.clone() }, bytes)])?;
                            layout.segments.push(Segment { pe, elements: seg });
                        }
                    }
                }
                let placement = MatVecPlacement::unrouted(
                    rows,
                    cols,
                    blocks.len() as u32,
                    g.col_blocks as u32,
                    tiles,
                    bias.map(|b| b.index() as u32),
                );
                (ResultLayout::Vector(layout), Work::MatVec(placement))
            }
            Op::RmsNorm { weight, .. } => {
                let g = module.weights[*weight].ty.shape[0];
                // Whole groups per segment when groups are small (per-head norms), else chunks.
                let cut = if g < len { g.max(vector_cut(len)) } else { vector_cut(len) };
                let layout = self.vector_layout(i, unit, len, cut, &|seg| norm_requests(module, i, seg, len))?;
                (ResultLayout::Vector(layout), Work::RmsNorm(NormPlacement { group_len: g, group_routes: Vec::new() }))
            }
            Op::Rope { head_dim, .. } => {
                let layout =
                    self.vector_layout(i, unit, len, *head_dim as u64, &|seg| operand_requests(module, i, seg))?;
                (ResultLayout::Vector(layout), Work::Elementwise)
            }
            Op::Silu { .. } | Op::Mul { .. } | Op::Add { .. } | Op::SwiGlu { .. } => {
                let layout =
                    self.vector_layout(i, unit, len, vector_cut(len), &|seg| operand_requests(module, i, seg))?;
                (ResultLayout::Vector(layout), Work::Elementwise)
            }
            Op::ExpertCombine { routing, .. } => {
                let top_k = match module.body[*routing].ty {
                    ValueType::Routing { top_k, .. } => top_k as u64,
                    _ => 0,
                };
                let layout = self.combine_layout(i, unit, top_k, len)?;
                (ResultLayout::Vector(layout), Work::Combine { routing: 0, collects: Vec::new() })
            }
            Op::Attention { cache, heads, .. } => self.attention(i, unit, *cache, *heads, len)?,
            Op::Embed { table } => self.embed(i, unit, *table, len)?,
            Op::RouterTopK { logits, top_k, .. } => {
                let experts = match &module.body[*logits].ty {
                    ValueType::Tensor(t) => t.elements(),
                    ValueType::Routing { .. } => 0,
                };
                let requests = vec![
                    (RegionKind::Operand { value: logits.index() as u32, elements: 0..experts }, experts * F32),
                    (RegionKind::Output { elements: 0..*top_k as u64 }, *top_k as u64 * 8),
                ];
                // On the logits' PE when they are one segment: no delivery between the two,
                // and the decision leaves from the host expert's corner (`host_expert`). In
                // several segments, on the one nearest the region's centre that has room: the
                // others come from the host's columns nearby, and the decision still leaves from
                // the centre. (On a fresh PE of the region's walk, Qwen3-30B-A3B's four segments
                // crossed to it in 357 cycles a layer.)
                let bytes = requests.iter().map(|(_, b)| b).sum();
                let area = self.region(unit).area;
                let centre = (area.x as i64 + area.w as i64 / 2, area.y as i64 + area.h as i64 / 2);
                let mut on_logits: Vec<Pe> = match &self.placer.placements[logits.index()].result {
                    ResultLayout::Vector(v) => v.segments.iter().map(|s| s.pe).collect(),
                    ResultLayout::Routing { .. } => Vec::new(),
                };
                on_logits.sort_by_key(|pe| (pe.x as i64 - centre.0).abs() + (pe.y as i64 - centre.1).abs());
                let pe = match on_logits.into_iter().find(|&pe| self.claim_vector(pe, bytes, &HashSet::default())) {
                    Some(pe) => pe,
                    None => self.fresh_pe(i, unit, bytes, &HashSet::default())?,
                };
                self.placer.fill(pe, instr, requests)?;
                (ResultLayout::Routing { pe }, Work::Router { routing: 0 })
            }
            Op::ExpertDispatch { .. } => {
                let source = self.placer.analysis.source[i] as usize;
                (self.placer.placements[source].result.clone(), Work::Dispatch { routing: 0 })
            }
            Op::Slice { len, .. } => (self.placer.slice_layout(i, *len as u64)?, Work::Slice),
        };
        Ok(self.instr_placement(i, result, work))
    }

    fn instr_placement(&self, i: usize, result: ResultLayout, work: Work) -> InstrPlacement {
        let ir = &self.placer.module.body[waferc_ir::Handle::new(i)];
        InstrPlacement {
            instr: i as u32,
            op: ir.op.name().to_string(),
            layer: ir.layer,
            expert: self.placer.analysis.expert[i],
            result,
            operand_routes: Vec::new(),
            deliveries: Vec::new(),
            work,
        }
    }

    /// The result cut of a matvec's `len` rows: when rope reads it, a chunk where rope reads it
    /// directly and a head's half is several chunks (each chunk's twin half a head away then
    /// goes to its PE, `rope_partner_pe`, so a head's rope runs on `head_dim / 64` PEs at once,
    /// in place), else a head (rope, a per-head norm before it, and attention then run on single
    /// heads); [`OUTPUT_SEGMENT_ELEMENTS`] (at least its `row_block` rows) when nothing reads it,
    /// else [`vector_cut`].
    fn segment_cut(&self, i: usize, len: u64, row_block: u64) -> u64 {
        if self.rope_pairs(i).is_some() {
            return CHUNK;
        }
        let module = self.placer.module;
        if self.placer.analysis.readers[i].is_empty() {
            return OUTPUT_SEGMENT_ELEMENTS.max(row_block.next_power_of_two());
        }
        let readers = &self.placer.analysis.readers;
        // Rope reads the result directly, or through a per-head norm (Qwen3's q and k norms),
        // which runs on the same segments.
        let through_norm = |r: u32| match &module.body[waferc_ir::Handle::new(r as usize)].op {
            Op::RmsNorm { .. } => readers[r as usize].as_slice(),
            _ => &[],
        };
        readers[i]
            .iter()
            .chain(readers[i].iter().flat_map(|&r| through_norm(r)))
            .filter_map(|&r| match &module.body[waferc_ir::Handle::new(r as usize)].op {
                Op::Rope { head_dim, .. } => Some(*head_dim as u64),
                _ => None,
            })
            .fold(None, |cut: Option<u64>, dim| Some(cut.map_or(dim, |c| c.max(dim))))
            .unwrap_or_else(|| vector_cut(len))
    }

    fn attention(
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
                            // The slice's place walked column by column from its middle row: its
                            // first block (where its reductions end and its output leaves) has
                            // rows both ways; other sequences' (and copies') blocks follow on.
                            let cell = ((sequence * of_rows + in_rows) * kv.blocks_per_head()) + b;
                            let pe = rows.walk_from_middle(cell);
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
        // on rows of their own in the head's band, nearest its middle row (where the head's root
        // block is) first: the collects from the root leave north, south and west and run along
        // those rows, side by side.
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
                let middle = nearest_first(band.h as u64 / 2, band.h as u64).nth((*slot % band.h as u64) as usize);
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
            let pe = self.band_pe(i, unit, (h, kv.kv_heads), bytes, &taken, 0, 0)?;
            taken.insert(pe);
            self.placer.fill(pe, i as u32, vec![(RegionKind::Output { elements: elements.clone() }, bytes)])?;
            layout.segments.push(Segment { pe, elements });
        }
        Ok((ResultLayout::Vector(layout), Work::Attention(self.attention_placement(cache, heads, placed))))
    }

    fn attention_placement(
        &self,
        cache: waferc_ir::Handle<waferc_ir::KvCache>,
        heads: u32,
        kv_heads_placed: Vec<KvHeadPlacement>,
    ) -> AttentionPlacement {
        let c = &self.placer.module.caches[cache];
        AttentionPlacement { heads, kv_heads: c.kv_heads, head_dim: c.head_dim, kv_heads_placed, collects: Vec::new() }
    }

    /// The table spread over the whole area: the result is cut in at most [`EMBED_SEGMENTS`]
    /// segments, each with a horizontal band of the area holding its table slice in row blocks
    /// as small as the band allows, and the segment on the band's next PE. Bands keep each
    /// segment's gather (from the block holding the token's row) apart from the others'.
    fn embed(
        &mut self,
        i: usize,
        unit: usize,
        table: waferc_ir::Handle<waferc_ir::Weight>,
        len: u64,
    ) -> Result<(ResultLayout, Work), WaferError> {
        let module = self.placer.module;
        let w = &module.weights[table];
        let rows = w.ty.shape[0];
        let Region { area, tight, .. } = *self.region(unit);
        let count = EMBED_SEGMENTS.min(len.div_ceil(CHUNK)).min(area.h as u64).max(1);
        // Where the PEs have no room to spare, segments of a power-of-two run of chunks: the
        // 70B's 8,192 elements in 18 cut 17 segments of 480 and one of 32, whose band's PEs held
        // little while the others' overflowed.
        let chunks = len.div_ceil(CHUNK).div_ceil(count);
        let chunks = if tight { chunks.next_power_of_two() } else { chunks };
        let segments = super::size::segments(len, chunks * CHUNK);
        let bands: Vec<Rect> = (0..segments.len() as u64).map(|j| area.band(j, segments.len() as u64)).collect();
        // One row-block cut for every segment (the table is a grid of row blocks x column
        // segments), as fine as the smallest band allows beside its segment's PE; where the PEs
        // have no room to spare, each band's own cut, as fine as its PEs allow.
        let smallest = bands.iter().map(Rect::pes).min().unwrap_or(1);
        let rows_per_block = |band: &Rect| {
            let pes = if tight { band.pes() } else { smallest };
            rows.div_ceil(pes.saturating_sub(1).max(1))
        };
        let mut blocks = Vec::new();
        let mut layout = VectorLayout::default();
        for (seg, band) in segments.iter().zip(bands) {
            let width = seg.end - seg.start;
            let row_bytes = w.ty.dtype.row_bytes(width).ok_or_else(|| {
                unsupported(module, i, format!("table {} ({}) cannot be cut at element {}", w.name, w.ty, seg.start))
            })?;
            let rows_per_block = rows_per_block(&band);
            let count = rows.div_ceil(rows_per_block);
            for b in 0..count {
                let block_rows = b * rows_per_block..((b + 1) * rows_per_block).min(rows);
                let pe = band.walk(b);
                self.placer.fill(pe, i as u32, embed_block_requests(table, &block_rows, seg, row_bytes))?;
                blocks.push(EmbedBlock { pe, rows: block_rows, elements: seg.clone() });
            }
            let pe = band.walk(count);
            self.placer.fill(pe, i as u32, vec![(RegionKind::Output { elements: seg.clone() }, width * F32)])?;
            layout.segments.push(Segment { pe, elements: seg.clone() });
        }
        Ok((ResultLayout::Vector(layout), Work::Embed { blocks, collects: Vec::new() }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// The 70B's 4-layer unit on a 315-column area: q/k/v, o, gate/up and down tiles of 1,344,
    /// 1,088, 7,296 and 4,352 weight bytes over 256, 256, 256 and 224 columns. Packed from the
    /// west edge, the west columns hold a tile of all sixteen grids (64,000 bytes against a
    /// mean of 44,003); balanced from the heaviest grid down, the busiest column is within the
    /// smallest tile of the mean.
    #[test]
    fn balanced_columns_keep_every_column_near_the_mean() {
        let width = 315;
        let shapes = [(7_296u64, 256usize), (4_352, 224), (1_344, 256), (1_088, 256)];
        let mut load = vec![0u64; width];
        for (bytes, taken) in shapes.iter().flat_map(|&shape| [shape; 4]) {
            let used = lightest_columns(&load, taken);
            assert_eq!(used.len(), taken);
            assert!(used.windows(2).all(|w| w[0] < w[1]), "columns out of order");
            used.iter().for_each(|&x| load[x as usize] += bytes);
        }
        let total: u64 = shapes.iter().map(|&(bytes, taken)| 4 * bytes * taken as u64).sum();
        let mean = total / width as u64;
        let busiest = *load.iter().max().unwrap();
        assert!(busiest < mean + 1_088, "busiest column {busiest} bytes, mean {mean}");
    }

    /// On a tight wafer a matvec takes a tile a little larger than its smallest when that tiling
    /// is cheaper: the 70B's gate/up projection over its 384 x 390 PEs takes four chunks a tile
    /// 25 rows deep (7,112 bytes) instead of two chunks 50 rows deep (7,056), with half the rows
    /// in each message of its reduction. Elsewhere the budget is the base and the spread.
    #[test]
    fn a_tight_wafer_lets_a_tile_grow_for_a_cheaper_grid() {
        let (rows, cols) = (57_344, 8_192);
        let area = Rect { wafer: 0, x: 0, y: 0, w: 384, h: 390 };
        let span = Span { area, max_panels: panel_cap(rows, area.h as u64), layout: PanelLayout::Interleaved };
        let tile = |r, width| super::super::size::tile_bytes(waferc_ir::DType::BF16, None, r, width);
        let base = smallest_tile(rows, cols, span, &tile);
        assert_eq!(base, 7_056);
        let chunks = |budget| grid(rows, cols, span, &tile, budget, None).map(|g| (g.chunks_per_tile, g.rows_per_tile));
        assert_eq!(chunks(tile_budget(base, 0, false)), Some((2, 50)));
        assert_eq!(chunks(tile_budget(base, 0, true)), Some((4, 25)));
        assert_eq!(tile_budget(base, 500, false), base + 500);
    }

    /// On a tight wafer a matvec's rows fill every slot of its grid, no block longer than the
    /// grid's rows per tile, and the grids of a unit's layers put their longer blocks in
    /// different slots: the 70B's o projection (8,192 rows over 3 panels of 390 rows) in
    /// 8-row blocks filled 1,024 of its 1,170 slots.
    #[test]
    fn tight_row_blocks_fill_every_slot() {
        let (rows, slots, rows_per_tile) = (8_192u64, 1_170u64, 8u64);
        assert_eq!(row_runs(0..rows, rows_per_tile, (slots, None)).len(), 1_024);
        let mut longer_slots = Vec::new();
        for j in 0..4 {
            let runs = row_runs(0..rows, rows_per_tile, (slots, Some((j, 4))));
            assert_eq!(runs.len() as u64, slots);
            assert!(runs.windows(2).all(|w| w[0].end == w[1].start), "runs leave a gap");
            assert_eq!((runs[0].start, runs[runs.len() - 1].end), (0, rows));
            assert!(runs.iter().all(|r| (7..=8).contains(&(r.end - r.start))));
            longer_slots.push(runs.iter().position(|r| r.end - r.start == 8).unwrap());
        }
        longer_slots.dedup();
        assert_eq!(longer_slots.len(), 4, "the layers' longer blocks share a slot: {longer_slots:?}");
        // Halves of a short matrix: fewer blocks than slots, one row each.
        assert_eq!(row_runs(10..14, 1, (8, Some((0, 1)))), vec![10..11, 11..12, 12..13, 13..14]);
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
