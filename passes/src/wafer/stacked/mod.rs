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
mod grid;
mod kv;
mod lanes;
mod regions;

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::ops::Range;
use std::rc::Rc;

use waferc_ir::wafer::{
    rope_twin, EmbedBlock, InstrPlacement, MatVecPlacement, NormPlacement, Pe, Plan, RegionKind, ResultLayout, Segment,
    TargetParams, VectorLayout, WaferProgram, Work,
};
use waferc_ir::{Handle, Module, Op, Value, ValueType, Weight, BLOCK};

use super::place::{
    embed_block_requests, norm_requests, operand_requests, unsupported, Placer, Request, MAX_QUERY_ROUTES,
    MAX_SLICED_QUERY_ROUTES,
};
use super::size::Analysis;
use super::{CompileOptions, WaferError};
use columns::SegmentRows;
pub use grid::tiles_estimate;
use grid::{matvec_shape, PanelLayout, PlacedTiles};
use kv::block_for_region;
use regions::{
    area_shares, block_size, exact_rectangles, rectangles, unit_wafers, units, weight_bytes, CellRun, Rect, Unit,
    EMBED_TABLE_SHARE,
};

const CHUNK: u64 = BLOCK as u64;
const F32: u64 = 4;
/// The share of a PE's usable SRAM the matvec tiles of its unit may take together; the rest
/// holds vector segments, norm weights and receive buffers.
pub const TILE_SHARE: f64 = 0.6;
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
/// The most segments a vector that does not feed matvecs only (see `columns`) is cut in. Every
/// segment is one multicast to the PEs that read it, and multicasts to readers spread over the
/// area cross each other, so they need a colour each.
const MAX_SEGMENTS: u64 = 16;
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

/// The SRAM a router's logits matvec may take for its tile on a PE of its host expert's lane
/// (see `Stacked::matvec_grid`) where its share of the unit's tile SRAM is less. Its rows are
/// the experts (8 to 128), so its tiles are a few hundred bytes on a few hundred PEs, taken from
/// the room beside the tiles that vector segments use (`Stacked::vector_cap`, kilobytes); its
/// share by weight bytes is tens of bytes.
const ROUTER_TILE_ROOM: u64 = 1024;

/// Matvec `i` and the ops that run in place on its result (rope and a per-head norm, Qwen3's q
/// and k norms, through slices), each with where its element 0 lies in `i`'s result.
fn in_place_chain(module: &Module, analysis: &Analysis, i: usize) -> Vec<(usize, u64)> {
    let mut chain = vec![(i, 0u64)];
    let mut next = 0;
    while let Some(&(value, base)) = chain.get(next) {
        next += 1;
        for &reader in &analysis.readers[value] {
            let r = reader as usize;
            let (Op::Rope { x, .. } | Op::RmsNorm { x, .. }) = &module.body[Handle::new(r)].op else {
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
/// take at most [`MAX_QUERY_ROUTES`] query multicasts a KV head so (one per query head and
/// chunk: Llama-3.1-8B's 4 query heads a KV head, 4 chunks each; the 70B's 8 ran out of
/// colours), or [`MAX_SLICED_QUERY_ROUTES`] where the plan cuts KV heads in slices (`kv_sliced`):
/// a sliced head's query heads already send a multicast per slice, so chunks add none where
/// each slice is a chunk (the 70B's `stacked:5,100,slice4`: rope 384 -> 192 cycles a layer,
/// 1,357,688 -> 1,350,430 cycles a token). Such a result is cut in chunks placed in pairs
/// ([`Stacked::segment_cut`]). `None` when a rope reads it through a per-head norm (Qwen3's q
/// and k norms: the norm's group would span PEs), or nothing rotates it.
fn rope_pairs(module: &Module, analysis: &Analysis, i: usize, kv_sliced: bool) -> Option<RopePairs> {
    let bound = if kv_sliced { MAX_SLICED_QUERY_ROUTES } else { MAX_QUERY_ROUTES };
    let mut pairs: Option<RopePairs> = None;
    for (r, start) in in_place_chain(module, analysis, i).into_iter().skip(1) {
        let ir = &module.body[Handle::new(r)];
        let Op::Rope { head_dim, x, .. } = &ir.op else { return None };
        let head_dim = *head_dim as u64;
        let direct = analysis.source[x.index()] as usize == i;
        let fits = analysis.readers[r].iter().all(|&a| match &module.body[Handle::new(a as usize)].op {
            Op::Attention { cache, heads, .. } => {
                let q_per_kv = (*heads / module.caches[*cache].kv_heads.max(1)) as u64;
                q_per_kv * (head_dim / CHUNK) <= bound
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

/// Whether the plan cuts KV heads in slices of their head dimension.
fn kv_sliced(options: &CompileOptions) -> bool {
    matches!(options.plan, Plan::Stacked { kv_slices, .. } if kv_slices > 1)
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
        matches!(module.body[Handle::new(i)].op, Op::MatVec { .. })
            && rope_pairs(module, analysis, i, kv_sliced(options)).is_some()
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
                .map(|i| match &module.body[Handle::new(i)].op {
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
            if matches!(module.body[Handle::new(i)].op, Op::MatVec { .. }) {
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
            let Op::Mul { a, b } = &module.body[Handle::new(r as usize)].op else { return false };
            let Op::Silu { x } = &module.body[*a].op else { return false };
            half_long(*x) && half_long(*b) && offset_in_i(*x) == Some(0) && offset_in_i(*b) == Some(half)
        });
        (len.is_multiple_of(2) && product).then_some(half)
    }

    /// [`rope_pairs`] of matvec `i`, unless this placement keeps whole heads.
    fn rope_pairs(&self, i: usize) -> Option<RopePairs> {
        match self.rope_pairing {
            RopePairing::Allowed => {
                rope_pairs(self.placer.module, self.placer.analysis, i, kv_sliced(self.placer.options))
            }
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
                let ir = &module.body[Handle::new(r)];
                let len = ir.ty.tensor().map_or(0, |t| t.elements());
                (start <= rows.start && rows.end <= start + len)
                    .then(|| super::size::vector_bytes(module, &ir.op, rows.end - rows.start))
            })
            .sum()
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
    ///
    /// The segments are [`vector_cut`]'s (at most [`MAX_SEGMENTS`]), although a segment's gather
    /// is bound by its PE's ramp (Qwen3-30B-A3B: 8 x 128 elements, 1,142 cycles of its 11.7k a
    /// layer): each gather reaches every lane, so they all meet near the centre, and twice as
    /// many (64 elements each) ran out of colours there (31 of the combine's collects on one
    /// router of `stacked:2,100,kv8,share8`'s layer 44; Mixtral's 8 experts too, with each
    /// half segment beside its residual segment).
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
            let Op::Add { a, b } = &module.body[Handle::new(r as usize)].op else { return None };
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
        // `stacked:1` 10,017 -> 7,654 tok/s with 16). Bound for a region beside on a tight
        // wafer, the segments leave along rows of their own (`SegmentRows::Landing`), even
        // where the usual layout has few enough.
        let crosses = self.crosses_regions_in_few_segments(i);
        let beside = crosses.then(|| self.rows_shared_with_reader_beside(i)).flatten();
        if crosses && (beside.is_some() || self.cut_too_fine_to_cross(i, len)) {
            let fewest = len.div_ceil(MAX_SEGMENTS);
            let aligned = self.aligned_cut(i, len, 0).map(|cut| merge_pieces(cut, fewest));
            return match (aligned, beside) {
                (Some(cut), None) => self.aligned_layout(i, unit, cut, SegmentRows::Arrival, requests),
                (None, None) => self.fresh_layout(i, unit, &super::size::segments(len, cut.max(fewest)), requests),
                // `Landing` gives each segment its column too: the cut's are not used.
                (aligned, Some(shared)) => {
                    let cut = aligned.unwrap_or_else(|| {
                        super::size::segments(len, cut.max(fewest)).into_iter().map(|seg| (seg, 0)).collect()
                    });
                    self.aligned_layout(i, unit, cut, SegmentRows::Landing(shared), requests)
                }
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
                return self.aligned_layout(i, unit, cut, SegmentRows::Middle, requests);
            }
        }
        if !across {
            if let Some(layout) = self.placer.host_layout(i, &inside, len, requests) {
                return Ok(layout);
            }
        }
        if let Some(cut) = self.aligned_cut(i, len, 0) {
            return self.aligned_layout(i, unit, cut, SegmentRows::Arrival, requests);
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
            && matches!(module.body[Handle::new(i)].op, Op::MatVec { .. })
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
        self.placer.module.body[Handle::new(i)].op.operands().into_iter().any(|operand| {
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
        let experts = match self.placer.module.body[Handle::new(router as usize)].ty {
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

    /// The instructions of `unit`.
    fn unit_instrs(&self, unit: usize) -> Range<usize> {
        self.unit_of.partition_point(|&u| u < unit)..self.unit_of.partition_point(|&u| u <= unit)
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
        let ir = &module.body[Handle::new(i)];
        let len = match &ir.ty {
            ValueType::Tensor(t) => t.elements(),
            ValueType::Routing { .. } => 0,
        };
        let (result, work) = match &ir.op {
            Op::MatVec { weight, bias, .. } => self.matvec(i, unit, *weight, *bias)?,
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
            Op::RouterTopK { logits, top_k, .. } => self.router(i, unit, *logits, *top_k)?,
            Op::ExpertDispatch { .. } => {
                let source = self.placer.analysis.source[i] as usize;
                (self.placer.placements[source].result.clone(), Work::Dispatch { routing: 0 })
            }
            Op::Slice { len, .. } => (self.placer.slice_layout(i, *len as u64)?, Work::Slice),
        };
        Ok(self.instr_placement(i, result, work))
    }

    /// A matvec's result segments (its tiles are placed ahead: [`Stacked::place_tiles`]).
    fn matvec(
        &mut self,
        i: usize,
        unit: usize,
        weight: Handle<Weight>,
        bias: Option<Handle<Weight>>,
    ) -> Result<(ResultLayout, Work), WaferError> {
        let module = self.placer.module;
        let ir = &module.body[Handle::new(i)];
        let instr = i as u32;
        let (rows, cols) = (module.weights[weight].ty.shape[0], module.weights[weight].ty.shape[1]);
        let PlacedTiles { area, grid: g, aligned, halves, blocks, tiles } = self
            .placed_tiles
            .remove(&i)
            .ok_or_else(|| unsupported(module, i, "internal: a matvec whose tiles were not placed first".into()))?;
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
                    && self.placer.analysis.readers[i]
                        .iter()
                        .any(|&r| matches!(module.body[Handle::new(r as usize)].op, Op::ExpertCombine { .. }));
                let spread = g.col_blocks < count && combined;
                for (j, seg) in segments.into_iter().enumerate() {
                    let middle = (seg.start + seg.end - 1) / 2;
                    let r = blocks.partition_point(|(rows, _)| rows.end <= middle) as u64;
                    let c = ((j as u64 * k + local) * g.col_blocks / (count * k).max(1)) % g.col_blocks;
                    let bytes = (seg.end - seg.start) * F32;
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
                        (None, Some(rows), _) => {
                            self.head_segment_pe(i, unit, &seg, bytes, rows, &mut in_band, &taken)?
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
        Ok((ResultLayout::Vector(layout), Work::MatVec(placement)))
    }

    /// The router's top-k, on one PE.
    fn router(&mut self, i: usize, unit: usize, logits: Value, top_k: u32) -> Result<(ResultLayout, Work), WaferError> {
        let module = self.placer.module;
        let instr = i as u32;
        let experts = match &module.body[logits].ty {
            ValueType::Tensor(t) => t.elements(),
            ValueType::Routing { .. } => 0,
        };
        let requests = vec![
            (RegionKind::Operand { value: logits.index() as u32, elements: 0..experts }, experts * F32),
            (RegionKind::Output { elements: 0..top_k as u64 }, top_k as u64 * 8),
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
        Ok((ResultLayout::Routing { pe }, Work::Router { routing: 0 }))
    }

    fn instr_placement(&self, i: usize, result: ResultLayout, work: Work) -> InstrPlacement {
        let ir = &self.placer.module.body[Handle::new(i)];
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
        let through_norm = |r: u32| match &module.body[Handle::new(r as usize)].op {
            Op::RmsNorm { .. } => readers[r as usize].as_slice(),
            _ => &[],
        };
        readers[i]
            .iter()
            .chain(readers[i].iter().flat_map(|&r| through_norm(r)))
            .filter_map(|&r| match &module.body[Handle::new(r as usize)].op {
                Op::Rope { head_dim, .. } => Some(*head_dim as u64),
                _ => None,
            })
            .fold(None, |cut: Option<u64>, dim| Some(cut.map_or(dim, |c| c.max(dim))))
            .unwrap_or_else(|| vector_cut(len))
    }

    /// The table spread over the whole area: the result is cut in at most [`EMBED_SEGMENTS`]
    /// segments, each with a band of the area holding its table slice in row blocks as small as
    /// the band allows, and the segment on the band's next PE. Bands keep each segment's gather
    /// (from the block holding the token's row) apart from the others'. They are horizontal, or
    /// where the PEs have no room to spare runs of whole columns with as many PEs each
    /// ([`Rect::cell_run`]): every band holds the same bytes, and the 70B's `stacked:5` cut its
    /// 125-row area in bands of 7 and 8 rows, whose smaller ones' PEs overflowed.
    fn embed(
        &mut self,
        i: usize,
        unit: usize,
        table: Handle<Weight>,
        len: u64,
    ) -> Result<(ResultLayout, Work), WaferError> {
        let module = self.placer.module;
        let w = &module.weights[table];
        let rows = w.ty.shape[0];
        let Region { area, tight, .. } = *self.region(unit);
        // Bands of whole rows, all cut for the smallest, hold the table only at
        // `EMBED_TABLE_SHARE` of their PEs' SRAM or less. An area fuller than that (`full`) is cut
        // as on a tight wafer, as where the units' floors fill the block (their shares are then their
        // bytes): a 20x17 grid of 26 KiB PEs, not tight, overflowed `PE(w0, x0, y0)` (31,488
        // bytes) where one of 24 KiB, tight, compiled.
        let usable = self.placer.params.usable_bytes_per_pe() as f64;
        let full = tight || weight_bytes(module, table) as f64 > EMBED_TABLE_SHARE * usable * area.pes() as f64;
        let count = EMBED_SEGMENTS.min(len.div_ceil(CHUNK)).min(area.h as u64).max(1);
        // Where the PEs have no room to spare, segments of a power-of-two run of chunks: the
        // 70B's 8,192 elements in 18 cut 17 segments of 480 and one of 32, whose band's PEs held
        // little while the others' overflowed.
        let chunks = len.div_ceil(CHUNK).div_ceil(count);
        let chunks = if full { chunks.next_power_of_two() } else { chunks };
        let segments = super::size::segments(len, chunks * CHUNK);
        let n = segments.len() as u64;
        let bands: Vec<CellRun> =
            (0..n).map(|j| if full { area.cell_run(j, n) } else { area.band(j, n).cells() }).collect();
        // One row-block cut for every segment (the table is a grid of row blocks x column
        // segments), as fine as the smallest band allows beside its segment's PE; where the PEs
        // have no room to spare, each band's own cut, as fine as its PEs allow.
        let smallest = bands.iter().map(CellRun::pes).min().unwrap_or(1);
        let rows_per_block = |band: &CellRun| {
            let pes = if full { band.pes() } else { smallest };
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
