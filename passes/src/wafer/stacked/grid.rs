//! Tile grids: how a matvec is cut over its area (chunks per tile, column blocks, panels and
//! how they lie), chosen per matrix by a cost estimate within its SRAM budget, and the tiles
//! laid on the area's PEs.

use rustc_hash::FxHashSet as HashSet;
use std::ops::Range;
use std::rc::Rc;

use waferc_ir::wafer::{narrow, Tile};
use waferc_ir::{Module, Op};

use super::kv::HeadRows;
use super::regions::{weight_bytes, Rect};
use super::{columns, Stacked, CHUNK, MAX_SEGMENTS, ROUTER_TILE_ROOM};
use crate::wafer::place::{tile_requests, unsupported};
use crate::wafer::size::Analysis;
use crate::wafer::WaferError;

/// How much larger than its base (see `Stacked::packed_grid`) a matvec's tile may be on a tight
/// wafer, whose PEs have no share left to spread: the 70B's gate/up projection then takes four
/// chunks a tile, 25 rows deep, instead of two chunks and 50 rows (56 bytes more, 0.8%): its
/// reduction runs at half the depth in rows, and SiLU and the product run on 32-element
/// segments instead of 64 (`stacked:4` on wse3x4: 612.0 -> 635.7 tok/s). At 5% rather than 2%
/// its q/k/v projection takes two chunks a tile in two panels instead of one chunk in one, and
/// reduces in 544 cycles instead of 788 (`stacked:5,100,slice4`: 1,350,430 -> 1,328,544
/// cycles a token); 7% tiles it the same, and at 9% its o projection takes four chunks a tile
/// (1,304 bytes against a base of 1,208) and a PE of layers 10 to 14 overflows its SRAM.
pub(super) const TIGHT_TILE_GROWTH: f64 = 0.05;

/// The most 32-element chunks a tile spans. A column block's input arrives in at most
/// [`columns::SEGMENTS_PER_COLUMN`] multicasts whatever its chunks, so a wider tile costs no
/// colours; it halves the column blocks, so a wide matrix folds into more panels over a narrow
/// area (Mixtral's down projection, 448 chunks over an expert lane 181 columns wide: 56 blocks
/// in three panels at eight chunks, 7.3k cycles a tile at four: 917 -> 995 tok/s).
pub(super) const MAX_CHUNKS_PER_TILE: u64 = 8;

/// The most panels a tile grid is folded into: a PE row holds a row block of each panel, their
/// reductions interleaved along it, and the reductions of sibling matvecs (separate q, k and v)
/// run at the same time, so each panel costs a colour per sibling on every PE of the row.
pub(super) const MAX_PANELS: u64 = 8;

/// The most panels unless the matrices reading an input are deep (see [`DEEP_TILE_ROWS`]).
pub(super) const NARROW_PANELS: u64 = 4;

/// Tiles at least this many rows deep at [`NARROW_PANELS`] panels may fold into up to
/// [`MAX_PANELS`]: their arithmetic shrinks with every panel, while a shallow tile saves a row
/// or two and pays in longer interleaved reductions and in wider segments for the vector ops on
/// the input (SmolLM2's matrices lose 7% of the speed at eight panels; the 8B's gate/up
/// projection gains 12%).
pub(super) const DEEP_TILE_ROWS: u64 = 8;

/// Flops an element of a matvec's input takes in the vector ops before it (a norm, a residual
/// add, SiLU and a product), for the tiling's cost estimate.
pub(super) const VECTOR_FLOPS_PER_ELEMENT: u64 = 8;

/// The tiling of a `rows x cols` matvec over `area`.
#[derive(Clone, Debug)]
pub(super) struct Grid {
    pub(super) rows_per_tile: u64,
    pub(super) chunks_per_tile: u64,
    pub(super) col_blocks: u64,
    /// Copies of each column block side by side (see the module documentation).
    pub(super) panels: u64,
    /// The area's height in PEs.
    pub(super) height: u64,
    /// Whether consecutive row blocks sit side by side in one PE row (else down a panel).
    pub(super) rows_across_panels: bool,
    pub(super) layout: PanelLayout,
    /// The area's columns an interleaved grid's blocks take, in order (`col_blocks * panels` of
    /// them, see [`Stacked::balance_columns`]); `None`: packed from the west edge, the columns
    /// left idle at the east edge.
    pub(super) used_columns: Option<Rc<[u16]>>,
}

/// How a tile grid's panels share its area's width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PanelLayout {
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
pub(super) struct Span {
    pub(super) area: Rect,
    pub(super) max_panels: u64,
    pub(super) layout: PanelLayout,
}

impl Grid {
    /// The tiling over `area` with `chunks_per_tile` chunks per tile, if its column blocks fit
    /// the area's width.
    pub(super) fn over(rows: u64, cols: u64, span: Span, chunks_per_tile: u64) -> Option<Grid> {
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
    pub(super) fn candidates(rows: u64, cols: u64, span: Span) -> impl Iterator<Item = Grid> {
        let runs = cols.div_ceil(CHUNK).next_power_of_two().min(MAX_CHUNKS_PER_TILE);
        (0..)
            .map(|j| 1u64 << j)
            .take_while(move |&run| run <= runs)
            .filter_map(move |run| Grid::over(rows, cols, span, run))
    }

    /// Row block `r`'s (panel, row from the area's north edge) in this grid's own order.
    pub(super) fn slot(&self, r: u64) -> (u64, u64) {
        let panel = match self.rows_across_panels {
            true => r % self.panels,
            false => r / self.height,
        };
        (panel, self.row(r))
    }

    /// The PE row (from the area's north edge) of row block `r`.
    pub(super) fn row(&self, r: u64) -> u64 {
        match self.rows_across_panels {
            true => r / self.panels,
            false => r % self.height,
        }
    }

    /// The PE column (from the area's west edge) of input chunk `chunk`'s first copy, spreading
    /// a column block's chunks over its copies: the same for every tiling of the same input
    /// width and panel span, so vectors read by several such matvecs suit them all.
    pub(super) fn chunk_column(&self, chunk: u64, chunks: u64) -> u64 {
        let packed = chunk * self.col_blocks * self.interleaved_panels() / chunks.max(1);
        match self.layout {
            PanelLayout::Interleaved => self.column(packed / self.panels, packed % self.panels),
            PanelLayout::SideBySide => packed,
        }
    }

    /// The PE column (from the area's west edge) of column block `c`'s copy in `panel`.
    pub(super) fn column(&self, c: u64, panel: u64) -> u64 {
        match (self.layout, &self.used_columns) {
            (PanelLayout::Interleaved, Some(used)) => used[(c * self.panels + panel) as usize] as u64,
            (PanelLayout::Interleaved, None) => c * self.panels + panel,
            (PanelLayout::SideBySide, _) => panel * self.col_blocks + c,
        }
    }

    /// The columns (from the area's west edge) this grid's tiles take.
    pub(super) fn columns_taken(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.col_blocks).flat_map(move |c| (0..self.panels).map(move |p| self.column(c, p)))
    }

    /// How many row blocks' reductions share a PE row's links: the panels, when they interleave.
    pub(super) fn interleaved_panels(&self) -> u64 {
        match self.layout {
            PanelLayout::Interleaved => self.panels,
            PanelLayout::SideBySide => 1,
        }
    }

    /// The levels of a row block's reduction tree over the column blocks.
    pub(super) fn depth(&self) -> u64 {
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
    pub(super) fn cost(&self, area: Rect) -> u64 {
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

/// The most panels a matrix of `rows` rows folds into over an area `height` rows high:
/// [`MAX_PANELS`] when its tiles are [`DEEP_TILE_ROWS`] deep at [`NARROW_PANELS`] panels, else
/// [`NARROW_PANELS`].
pub(super) fn panel_cap(rows: u64, height: u64) -> u64 {
    match rows >= DEEP_TILE_ROWS * NARROW_PANELS * height {
        true => MAX_PANELS,
        false => NARROW_PANELS,
    }
}

/// The tiling over `span` with the least [`Grid::cost`] (ties: fewer chunks per tile) among those
/// whose tile fits `budget` bytes, only `chunks_per_tile` chunks per tile if given.
pub(super) fn grid(
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
pub(super) fn tile_budget(base: u64, spread: u64, tight: bool) -> u64 {
    let budget = base.saturating_add(spread);
    match tight {
        true => budget.max(base.saturating_add((base as f64 * TIGHT_TILE_GROWTH) as u64)),
        false => budget,
    }
}

/// The smallest tile any tiling of a `rows x cols` matvec over `span` needs.
pub(super) fn smallest_tile(rows: u64, cols: u64, span: Span, tile_bytes: &dyn Fn(u64, u64) -> Option<u64>) -> u64 {
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

/// A matvec's row blocks in row order, each with its grid slot (panel, row from the area's north
/// edge).
pub(super) type RowBlocks = Vec<(Range<u64>, (u64, u64))>;

/// A matvec's tiles as [`Stacked::place_tiles`] laid them: its area and grid, its result's
/// column-aligned cut (if any), the halves an elementwise product reads, and its row blocks
/// with their grid slots.
pub(super) struct PlacedTiles {
    pub(super) area: Rect,
    pub(super) grid: Grid,
    pub(super) aligned: Option<Vec<(Range<u64>, u64)>>,
    pub(super) halves: Option<u64>,
    pub(super) blocks: RowBlocks,
    pub(super) tiles: Vec<Tile>,
}

/// `rows` cut in row blocks of at most `rows_per_tile` rows. With `(slots, Some(rank))` (a
/// tight wafer) they are `slots` blocks (fewer when `rows` has fewer rows) of about equal length,
/// so every slot of the grid holds a tile and none a longer one than it needs: blocks of
/// `rows_per_tile` leave the last slots idle (the 70B's o and down projections on a 416x390
/// area: 8-row blocks filled 342 of its 390 rows, so the rest held a tile of each). The `r` rows
/// left over go one each to the `r` blocks of least `rank(k)` (see [`Stacked::longer_block_rank`]).
/// Blocks of `rows_per_tile` when that cannot keep within it.
pub(super) fn row_runs<K: Ord>(
    rows: Range<u64>,
    rows_per_tile: u64,
    (slots, rank): (u64, Option<&dyn Fn(u64) -> K>),
) -> Vec<Range<u64>> {
    let len = rows.end - rows.start;
    let count = slots.min(len).max(1);
    match rank {
        Some(rank) if len.div_ceil(count) <= rows_per_tile => {
            let (q, r) = (len / count, len % count);
            let mut by_rank: Vec<u64> = (0..count).collect();
            by_rank.sort_by_cached_key(|&k| (rank(k), k));
            let mut longer = vec![false; count as usize];
            by_rank[..r as usize].iter().for_each(|&k| longer[k as usize] = true);
            let mut start = rows.start;
            longer
                .into_iter()
                .map(|long| {
                    let run = start..start + q + long as u64;
                    start = run.end;
                    run
                })
                .collect()
        }
        _ => (rows.start..rows.end)
            .step_by(rows_per_tile.max(1) as usize)
            .map(|start| start..(start + rows_per_tile).min(rows.end))
            .collect(),
    }
}

/// The columns (of an area `load.len()` wide) a grid taking `taken` of them uses, in order: all
/// but those whose tiles so far weigh most (ties: spread in the order of [`spread_rank`]).
pub(super) fn lightest_columns(load: &[u64], taken: usize) -> Rc<[u16]> {
    let mut by_load: Vec<usize> = (0..load.len()).collect();
    by_load.sort_by_key(|&x| (std::cmp::Reverse(load[x]), spread_rank(x as u64)));
    let mut idle = vec![false; load.len()];
    by_load[..load.len().saturating_sub(taken)].iter().for_each(|&x| idle[x] = true);
    (0..load.len()).filter(|&x| !idle[x]).map(|x| x as u16).collect()
}

/// A column's place in the order [`Stacked::balance_columns`] breaks ties by: `x` times the
/// golden ratio's fractional part, modulo 1 (scaled to 32 bits), so any run of consecutive
/// places is spread evenly over the columns.
pub(super) fn spread_rank(x: u64) -> u64 {
    (x * 2_654_435_769) % (1 << 32)
}

/// What a matvec's tile budget starts from ([`Stacked::base_tiles`]).
#[derive(Clone, Copy)]
pub(super) struct BaseTiles {
    pub(super) smallest: u64,
    pub(super) led: u64,
    /// The lanes its area is squeezed into (an expert's), over which its tiles' SRAM spreads.
    pub(super) lanes: u64,
}

/// A matvec's weight shape as (rows, columns); `None` for other ops.
pub(super) fn matvec_shape(module: &Module, j: usize) -> Option<(u64, u64)> {
    match &module.body[waferc_ir::Handle::new(j)].op {
        Op::MatVec { weight, .. } => Some((module.weights[*weight].ty.shape[0], module.weights[*weight].ty.shape[1])),
        _ => None,
    }
}

impl Stacked<'_> {
    /// The most panels matvec `i`'s tiling may fold into: [`MAX_PANELS`] when the matvec leading
    /// its input width (an expert: itself) has tiles [`DEEP_TILE_ROWS`] deep at
    /// [`NARROW_PANELS`] panels, else [`NARROW_PANELS`]. One cap per input width, so the
    /// matvecs sharing a tiling fold alike.
    pub(super) fn max_panels(&mut self, i: usize, unit: usize) -> u64 {
        let area = self.area_of(i, unit).0;
        let leader = self.leader_of(i, unit);
        matvec_shape(self.placer.module, leader).map_or(NARROW_PANELS, |(rows, _)| panel_cap(rows, area.h as u64))
    }

    /// Where matvec `i` is tiled: its area, its most panels and their layout.
    pub(super) fn span(&mut self, i: usize, unit: usize) -> Span {
        Span { area: self.area_of(i, unit).0, max_panels: self.max_panels(i, unit), layout: self.panel_layout(i) }
    }

    /// Side-by-side panels for a matvec reading an MoE layer's input (through its expert's
    /// `expert_dispatch`) and for an MoE model's LM head off a tight wafer (its input then sits
    /// on a diagonal, see `vector_layout`), else interleaved ones (see [`PanelLayout`]).
    /// Interleaved, the head's panels reduced their long row blocks over the same links of each
    /// PE row: Mixtral-8x7B's 493-row blocks in five panels waited 11.3k of the reduction's
    /// 22.3k cycles.
    pub(super) fn panel_layout(&self, i: usize) -> PanelLayout {
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
    pub(super) fn leader_of(&mut self, i: usize, unit: usize) -> usize {
        match (self.in_lane(i), matvec_shape(self.placer.module, i)) {
            (false, Some((_, cols))) => self.input_leader(unit, cols),
            _ => i,
        }
    }

    /// Whether instruction `i` is an MoE expert's, placed in its expert's lane ([`Stacked::area_of`]).
    pub(super) fn in_lane(&self, i: usize) -> bool {
        let analysis = self.placer.analysis;
        analysis.expert[i].is_some() && analysis.router[i].is_some()
    }

    /// Matvec `i`'s tile area (the unit's, or its expert's lane) and its tiling there. Each
    /// matvec's tiles get SRAM in proportion to its weight's share of the unit's (times the lanes
    /// it is squeezed into), so every PE's tiles fit together.
    pub(super) fn matvec_grid(&mut self, i: usize, unit: usize) -> Result<(Rect, Grid), WaferError> {
        let (area, mut g) = self.packed_grid(i, unit)?;
        g.used_columns = self.grid_columns.get(&i).cloned();
        Ok((area, g))
    }

    /// Chooses the columns of each interleaved grid of `unit` that leaves some idle, so every
    /// column's tiles weigh about the same. Only on a tight wafer (see [`super::regions::exact_rectangles`]),
    /// where a PE's weights are most of its SRAM: packed grids leave the same east columns idle
    /// in every matrix, so the west columns hold a tile of each (the 70B's `stacked:4` 10% over
    /// the mean), while balanced ones cost the reductions a longer span. Grids are taken from
    /// the heaviest tile down; each leaves idle the columns whose tiles so far weigh most (ties:
    /// spread in the golden-ratio order, `spread_rank`), and takes the others in order. A
    /// column's weight counts every tile of the column as if in one PE: a unit's matvecs cover
    /// nearly all rows, so its busiest PEs hold a tile of each grid over their column. Grids in
    /// an expert's lane keep their packed columns and are not counted (no MoE model is tight).
    pub(super) fn balance_columns(&mut self, unit: usize) -> Result<(), WaferError> {
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
                crate::wafer::size::vector_bytes(module, &ir.op, len.div_ceil(MAX_SEGMENTS))
            })
            .max()
            .unwrap_or(0);
        for j in 0..MAX_SEGMENTS.min(width as u64) {
            load[columns::landing_column(j, width as u64) as usize] += landing;
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
    pub(super) fn packed_grid(&mut self, i: usize, unit: usize) -> Result<(Rect, Grid), WaferError> {
        let module = self.placer.module;
        let Op::MatVec { weight, bias, .. } = &module.body[waferc_ir::Handle::new(i)].op else {
            return Err(unsupported(module, i, "internal: a tile grid for an instruction that is not a matvec".into()));
        };
        let w = &module.weights[*weight];
        let (rows, cols) = (w.ty.shape[0], w.ty.shape[1]);
        let (area, lanes) = self.area_of(i, unit);
        let span = self.span(i, unit);
        let bias_dtype = bias.map(|b| module.weights[b].ty.dtype);
        let tile = |r, width| crate::wafer::size::tile_bytes(w.ty.dtype, bias_dtype, r, width);
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
    pub(super) fn host_expert(&mut self, i: usize, unit: usize, cols: u64) -> Option<usize> {
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
    pub(super) fn base_tiles(&mut self, i: usize, unit: usize) -> Option<BaseTiles> {
        let module = self.placer.module;
        let tiling = |i: usize| {
            let Op::MatVec { weight, bias, .. } = &module.body[waferc_ir::Handle::new(i)].op else { return None };
            let w = &module.weights[*weight];
            let bias_dtype = bias.map(|b| module.weights[b].ty.dtype);
            let (rows, cols) = (w.ty.shape[0], w.ty.shape[1]);
            Some((rows, cols, move |r, width| crate::wafer::size::tile_bytes(w.ty.dtype, bias_dtype, r, width)))
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
    pub(super) fn input_followed(&self, unit: usize, cols: u64) -> bool {
        let mut rows = self.dense_readers(unit, cols).map(|(_, rows)| rows);
        let first = rows.next();
        rows.any(|r| Some(r) != first)
    }

    /// The dense matvec of `unit` with the most rows (the first of them) among those whose input
    /// is `cols` wide.
    pub(super) fn input_leader(&mut self, unit: usize, cols: u64) -> usize {
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

    /// The dense (not an expert's) matvecs of `unit` whose input is `cols` wide, with their rows.
    pub(super) fn dense_readers(&self, unit: usize, cols: u64) -> impl Iterator<Item = (usize, u64)> + '_ {
        let (module, analysis) = (self.placer.module, self.placer.analysis);
        self.unit_instrs(unit)
            .filter(move |&j| analysis.expert[j].is_none())
            .filter_map(move |j| matvec_shape(module, j).filter(|&(_, width)| width == cols).map(|(rows, _)| (j, rows)))
    }

    /// Lays matvec `i`'s tile grid over its area and takes each tile's SRAM. A unit's tiles are
    /// placed before any of its vectors (see [`super::place`]), so a vector segment looking for room
    /// sees the tiles that will share its PE: placed in program order, the 70B's first layers'
    /// vectors took the room its later layers' tiles needed on the busiest PEs.
    pub(super) fn place_tiles(&mut self, i: usize, unit: usize) -> Result<PlacedTiles, WaferError> {
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
        // On a tight wafer every slot of the grid takes a block (see `row_runs`), the longer
        // ones where the PEs are emptiest so far.
        let local = module.body[waferc_ir::Handle::new(i)].layer.map_or(0, |l| l as u64 % self.layers_per_region);
        let tight = self.region(unit).tight;
        let blocks = blocks.unwrap_or_else(|| {
            let cuts = match halves {
                Some(half) => [0..half, half..rows],
                None => [0..rows, rows..rows],
            };
            let cuts = &cuts[..1 + halves.is_some() as usize];
            let sides = cuts.len() as u64;
            let mut blocks = Vec::new();
            for (side, cut) in cuts.iter().enumerate() {
                let slot = |k: u64| g.slot(k * sides + side as u64);
                let rank = |k: u64| self.longer_block_rank(&g, area, slot(k), local);
                let rank: Option<&dyn Fn(u64) -> _> = tight.then_some(&rank);
                for (j, run) in row_runs(cut.clone(), rpt, (g.panels * g.height / sides, rank)).into_iter().enumerate()
                {
                    blocks.push((run, slot(j as u64)));
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

    /// Where a tight grid's longer row blocks go first (least first, see [`row_runs`]): to the
    /// slots whose PEs (the block's row over its column blocks) hold the fewest bytes so far, so
    /// the unit's grids, placed one after another, even out their PEs' sums; ties by PE row,
    /// turned by `1/n` of the height in each of the unit's `n` layers. Over grid slots alone
    /// (a slot's position in grid order), a PE took the longer block in layer after layer by
    /// chance, since `balance_columns` gives each layer's grid columns of its own: the 70B's
    /// `stacked:5` overflowed a PE holding three 6-row down blocks where the mean is 5.3.
    pub(super) fn longer_block_rank(&self, g: &Grid, area: Rect, (panel, row): (u64, u64), layer: u64) -> (u64, u64) {
        let fullest = (0..g.col_blocks).map(|c| self.placer.used_bytes(area.at(g.column(c, panel), row))).max();
        let turn = layer * g.height / self.layers_per_region;
        (fullest.unwrap_or(0), ((row + g.height - turn % g.height) % g.height) * g.panels + panel)
    }

    /// The row blocks of matvec `i` (`rows` rows, tiled as `g` over `area`), each with its
    /// (panel, row), when its result is an attention's queries, keys and values: every head's
    /// rows cut in blocks of at most the grid's rows per tile (no block spans two heads), each
    /// block in its KV head's band of rows, filling the band's rows of one panel before the
    /// next. The head's result segment sits in that band too (beside the KV blocks it goes to),
    /// so a head's roots are a run of the band's rows near its segment and the collects of
    /// different bands share no link; in the grid's own order a head's roots lie anywhere down a
    /// panel, often bands away, and the collects into one band queue on its columns.
    ///
    /// Where a band's heads cut so outnumber its slots, each run of a band's rows (its queries,
    /// its key, its value) is cut evenly in the fewest blocks of at most the rows per tile, which
    /// may span two query heads: the 70B's q/k/v grid has one panel, a band of 73 rows, and its
    /// ten heads of 128 rows in blocks of 18 take 80, in runs 73. In grid order its keys' and
    /// values' roots lay at the area's bottom, and their collects ran up to 481 hops. `None`
    /// when the result does not feed an attention, or a band's blocks still outnumber its slots.
    pub(super) fn band_blocks(&self, i: usize, rows: u64, g: &Grid, area: Rect) -> Option<RowBlocks> {
        let mut pieces: Vec<(Range<u64>, u64)> = Vec::new();
        let mut kv_heads = 0;
        for head_rows in crate::wafer::size::segments(rows, self.segment_cut(i, rows, g.rows_per_tile)) {
            let HeadRows { kv_heads: bands, head, .. } = self.attention_head(i, &head_rows)?;
            kv_heads = bands;
            pieces.push((head_rows, head));
        }
        band_row_blocks(&pieces, kv_heads, (g.rows_per_tile, g.panels), area)
    }
}

/// [`Stacked::band_blocks`] of `pieces` (a result's heads in order, each with its KV head, one
/// of `kv_heads`) in a grid of `rows_per_tile` and `panels` over `area`: each head cut in blocks
/// of at most `rows_per_tile`, else each run of a band's heads cut evenly in the fewest such
/// blocks.
fn band_row_blocks(
    pieces: &[(Range<u64>, u64)],
    kv_heads: u64,
    (rows_per_tile, panels): (u64, u64),
    area: Rect,
) -> Option<RowBlocks> {
    let rpt = rows_per_tile.max(1);
    let by_head = |rows: Range<u64>| row_runs(rows, rpt, (u64::MAX, None::<&dyn Fn(u64) -> u64>));
    if let Some(blocks) = fill_bands(pieces, kv_heads, panels, area, by_head) {
        return Some(blocks);
    }
    let mut runs: Vec<(Range<u64>, u64)> = Vec::new();
    for (rows, head) in pieces.iter().cloned() {
        match runs.last_mut() {
            Some((run, band)) if *band == head && run.end == rows.start => run.end = rows.end,
            _ => runs.push((rows, head)),
        }
    }
    let alike = |_: u64| 0u64;
    let even = |rows: Range<u64>| {
        let fewest = (rows.end - rows.start).div_ceil(rpt);
        row_runs(rows, rpt, (fewest, Some(&alike as &dyn Fn(u64) -> u64)))
    };
    fill_bands(&runs, kv_heads, panels, area, even)
}

/// Row blocks of `pieces` (rows of a matvec's result, each with its KV head), each piece cut by
/// `cut` and its blocks laid in its head's band of `area` (one of `kv_heads`), filling the band's
/// rows of one of `panels` panels before the next. `None` when a band's blocks outnumber its
/// slots.
fn fill_bands(
    pieces: &[(Range<u64>, u64)],
    kv_heads: u64,
    panels: u64,
    area: Rect,
    cut: impl Fn(Range<u64>) -> Vec<Range<u64>>,
) -> Option<RowBlocks> {
    let mut placed = vec![0u64; kv_heads as usize];
    let mut blocks = Vec::new();
    for (rows, head) in pieces {
        let band = area.band(*head, kv_heads);
        let (top, height) = ((band.y - area.y) as u64, band.h as u64);
        for block in cut(rows.clone()) {
            let k = placed.get_mut(*head as usize)?;
            if *k / height >= panels {
                return None;
            }
            blocks.push((block, (*k / height, top + *k % height)));
            *k += 1;
        }
    }
    Some(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let tile = |r, width| crate::wafer::size::tile_bytes(waferc_ir::DType::BF16, None, r, width);
        let base = smallest_tile(rows, cols, span, &tile);
        assert_eq!(base, 7_056);
        let chunks = |budget| grid(rows, cols, span, &tile, budget, None).map(|g| (g.chunks_per_tile, g.rows_per_tile));
        assert_eq!(chunks(tile_budget(base, 0, false)), Some((2, 50)));
        assert_eq!(chunks(tile_budget(base, 0, true)), Some((4, 25)));
        assert_eq!(tile_budget(base, 500, false), base + 500);
    }

    /// The 70B's q/k/v grid (one panel of 585 rows, 18 rows a tile) puts each KV head's rows in
    /// its band of 73 rows: cut by head (eight query heads, a key and a value of 128 rows, eight
    /// blocks each) they take 80 slots, so each run of the band's rows is cut evenly instead
    /// (57 blocks for its queries, 8 each for its key and value), and every block stays in its
    /// band. Where the heads fit, each is cut on its own.
    #[test]
    fn a_bands_query_key_and_value_rows_stay_in_its_band() {
        let (kv_heads, q_per_kv, head_dim) = (8u64, 8u64, 128u64);
        let mut pieces = Vec::new();
        for h in 0..kv_heads {
            for q in 0..q_per_kv {
                let start = (h * q_per_kv + q) * head_dim;
                pieces.push((start..start + head_dim, h));
            }
        }
        for role in 1..3 {
            for h in 0..kv_heads {
                let start = kv_heads * q_per_kv * head_dim + ((role - 1) * kv_heads + h) * head_dim;
                pieces.push((start..start + head_dim, h));
            }
        }
        let area = Rect { wafer: 0, x: 0, y: 0, w: 300, h: 585 };
        let blocks = band_row_blocks(&pieces, kv_heads, (18, 1), area).expect("fits in runs");
        assert_eq!(blocks.len(), 8 * 73);
        assert!(blocks.iter().all(|(rows, _)| (16..=18).contains(&(rows.end - rows.start))));
        let total: u64 = blocks.iter().map(|(rows, _)| rows.end - rows.start).sum();
        assert_eq!(total, 10_240, "every row in one block");
        let head_of = |row: u64| pieces.iter().find(|(p, _)| p.contains(&row)).unwrap().1;
        for (rows, (panel, row)) in &blocks {
            let head = head_of(rows.start);
            assert_eq!(head_of(rows.end - 1), head, "rows {rows:?} span two KV heads");
            let band = area.band(head, kv_heads);
            assert_eq!(*panel, 0);
            assert!((band.y as u64..(band.y + band.h) as u64).contains(row), "rows {rows:?} at row {row}");
        }
        // With two panels each head gets blocks of its own.
        let by_head = band_row_blocks(&pieces, kv_heads, (18, 2), area).unwrap();
        assert_eq!(by_head.len(), 80 * 8);
        assert!(by_head.iter().all(|(rows, _)| rows.start / 128 == (rows.end - 1) / 128));
    }

    /// On a tight wafer a matvec's rows fill every slot of its grid, no block longer than the
    /// grid's rows per tile, and the rows left over go to the slots of least rank: the 70B's o
    /// projection (8,192 rows over 3 panels of 390 rows) in 8-row blocks filled 1,024 of its
    /// 1,170 slots.
    #[test]
    fn tight_row_blocks_fill_every_slot() {
        let (rows, slots, rows_per_tile) = (8_192u64, 1_170u64, 8u64);
        assert_eq!(row_runs(0..rows, rows_per_tile, (slots, None::<&dyn Fn(u64) -> u64>)).len(), 1_024);
        // Ranked by how full each slot's PEs are, here the slot's index backwards.
        let fullness = |k: u64| slots - k;
        let runs = row_runs(0..rows, rows_per_tile, (slots, Some(&fullness as &dyn Fn(u64) -> u64)));
        assert_eq!(runs.len() as u64, slots);
        assert!(runs.windows(2).all(|w| w[0].end == w[1].start), "runs leave a gap");
        assert_eq!((runs[0].start, runs[runs.len() - 1].end), (0, rows));
        assert!(runs.iter().all(|r| (7..=8).contains(&(r.end - r.start))));
        // 8,192 = 7 * 1,170 + 2: the two emptiest slots, the last two, take a row more.
        let longer: Vec<usize> = (0..runs.len()).filter(|&k| runs[k].end - runs[k].start == 8).collect();
        assert_eq!(longer, [1_168, 1_169]);
        // Halves of a short matrix: fewer blocks than slots, one row each.
        let any = |_: u64| 0u64;
        assert_eq!(row_runs(10..14, 1, (8, Some(&any as &dyn Fn(u64) -> u64))), vec![10..11, 11..12, 12..13, 13..14]);
    }
}
