//! Sizing: the shape of every instruction's placement (tiles, blocks, segments) and its PE count,
//! and the split of layers over the wafers of a pipeline.

use std::ops::Range;

use waferc_ir::completion::Completion;
use waferc_ir::dependency::{experts, DataReaders};
use waferc_ir::wafer::{Plan, TargetParams};
use waferc_ir::{DType, Module, Op, ValueType, Weight, BLOCK};
use waferc_targets::Target;

use super::{CompileOptions, WaferError};

const CHUNK: u64 = BLOCK as u64;
/// The largest vector segment one PE holds (elements): 8 KiB of f32, so a PE can hold a result
/// segment, two operand segments and a norm weight slice with room to spare.
pub(super) const MAX_SEGMENT: u64 = 2048;
/// The segment cap of a spread placement ([`spread_tiles`]): vector ops (SiLU, products, norms,
/// rope) run on their result's segments and each segment is one message, so halving the cap
/// halves their busiest PE and their longest message; finer still runs out of colours where a
/// large FFN's segments are multicast into the down projection.
pub(super) const FINE_SEGMENT: u64 = 1024;
/// Bytes of one f32.
const F32: u64 = 4;

/// Facts about the module the placer needs beyond the IR itself.
pub(super) struct Analysis {
    /// The MoE expert an instruction computes for (through `expert_dispatch`), per instruction.
    pub expert: Vec<Option<u32>>,
    /// The value whose data an instruction's result is: itself, or for `expert_dispatch` and
    /// `slice` their `x`'s source.
    pub source: Vec<u32>,
    /// Where an instruction's data starts in its source's result (non-zero for a `slice`).
    pub offset: Vec<u64>,
    /// Per value (by source): the instructions reading it as an operand, in program order,
    /// `expert_dispatch` looked through (its readers read the dispatched `x`): see
    /// [`DataReaders`].
    pub readers: Vec<Vec<u32>>,
    /// Per instruction of an MoE block (experts, dispatch, combine): the router's value.
    pub router: Vec<Option<u32>>,
    /// Which instructions are done before a value exists: where operand buffers share SRAM.
    pub completion: Completion,
}

impl Analysis {
    pub fn new(module: &Module) -> Analysis {
        let n = module.body.len();
        let DataReaders { source, readers } = DataReaders::new(module);
        let expert = experts(module);
        let mut offset = vec![0u64; n];
        let mut router = vec![None; n];
        for (handle, instr) in module.body.iter() {
            let i = handle.index();
            match &instr.op {
                Op::ExpertDispatch { routing, .. } | Op::ExpertCombine { routing, .. } => {
                    router[i] = Some(routing.index() as u32)
                }
                Op::Slice { x, offset: start, .. } => {
                    offset[i] = offset[x.index()] + *start as u64;
                    router[i] = router[x.index()];
                }
                // An instruction computed from an expert's value belongs to that expert's router;
                // one reading only dense values, such as the residual add on a combine, to none.
                op => {
                    let from_expert = op.operands().into_iter().find(|o| expert[o.index()].is_some());
                    if let Some(operand) = from_expert {
                        router[i] = router[operand.index()];
                    }
                }
            }
        }
        Analysis { expert, source, offset, readers, router, completion: Completion::new(module) }
    }
}

/// The shape of one instruction's placement.
#[derive(Clone, Debug)]
pub(super) enum Shape {
    /// Table row blocks per result segment.
    Embed {
        segments: Vec<Range<u64>>,
        rows_per_block: Vec<u64>,
    },
    MatVec {
        rows_per_tile: u64,
        chunks_per_tile: u64,
        row_blocks: u32,
        col_blocks: u32,
        segments: Vec<Range<u64>>,
    },
    /// Elementwise ops, norms, rope, combine: result segments, one PE each.
    Vector {
        segments: Vec<Range<u64>>,
    },
    Attention {
        positions_per_block: u32,
        blocks_per_head: u32,
        segments: Vec<Range<u64>>,
    },
    Router,
    /// Aliases its `x` (`expert_dispatch`) or part of it (`slice`): no PEs.
    Alias,
}

pub(super) struct Sizes {
    pub shapes: Vec<Shape>,
    /// PEs per instruction.
    pub pes: Vec<u64>,
}

impl Sizes {
    pub fn total_pes(&self) -> u64 {
        self.pes.iter().sum()
    }
}

/// `len` elements cut into segments of `size` (the last may be short).
pub(super) fn segments(len: u64, size: u64) -> Vec<Range<u64>> {
    (0..len.div_ceil(size)).map(|i| i * size..((i + 1) * size).min(len)).collect()
}

/// The storage type a weight is sized with: its own, or the quantisation being tried for the
/// does-not-fit hint (only for 2-D weights whose rows are whole blocks and that it would shrink;
/// the `quantize` pass never requantises a weight already in a block format).
pub(super) fn effective_dtype(weight: &Weight, quantise: Option<DType>) -> DType {
    let own = weight.ty.dtype;
    match quantise {
        Some(q)
            if weight.ty.shape.len() == 2
                && weight.ty.shape[1].is_multiple_of(CHUNK)
                && !own.is_block_quantized()
                && q.row_bytes(CHUNK) < own.row_bytes(CHUNK) =>
        {
            q
        }
        _ => own,
    }
}

/// SRAM of one matvec tile: weight rows, the x slice, the partial sums and a receive buffer for
/// them, and the bias slice (held by roots; budgeted on every tile).
pub(super) fn tile_bytes(dtype: DType, bias: Option<DType>, rows: u64, width: u64) -> Option<u64> {
    let weight = rows * dtype.row_bytes(width)?;
    let bias = match bias {
        Some(b) => b.row_bytes(rows).unwrap_or(rows * F32),
        None => 0,
    };
    Some(weight + width * F32 + 2 * rows * F32 + bias)
}

/// SRAM of one KV block of `positions` positions: keys and values; the query heads (the same
/// buffer later receives the partials of the reductions, so it is sized for the larger); the new
/// key and value; the scores; and the block's own partial maximum, sum and weighted values.
pub(super) fn kv_block_bytes(positions: u64, head_dim: u64, q_per_kv: u64) -> u64 {
    positions * head_dim * 2 * F32
        + q_per_kv * (head_dim + 2) * F32
        + 2 * head_dim * F32
        + q_per_kv * positions * F32
        + q_per_kv * (head_dim + 2) * F32
}

/// SRAM of one vector-op segment PE holding `len` result elements.
pub(super) fn vector_bytes(module: &Module, op: &Op, len: u64) -> u64 {
    let operands = {
        let mut ops = op.operands();
        ops.dedup();
        ops.retain(|v| !matches!(module.body[*v].ty, ValueType::Routing { .. }));
        ops.len() as u64
    };
    let extra = match op {
        Op::RmsNorm { weight, .. } => {
            let w = &module.weights[*weight];
            let g = w.ty.shape[0];
            w.ty.dtype.row_bytes(len.min(g)).unwrap_or(len.min(g) * F32) + 2 * len.div_ceil(g.min(len)) * F32
        }
        Op::ExpertCombine { routing, .. } => match module.body[*routing].ty {
            // Every chosen expert's slice is held until all have arrived (combined in expert order).
            ValueType::Routing { top_k, .. } => top_k as u64 * len * F32 + top_k as u64 * 8,
            _ => 0,
        },
        _ => 0,
    };
    let operand_bytes = if matches!(op, Op::ExpertCombine { .. }) { 0 } else { operands * len * F32 };
    len * F32 + operand_bytes + extra
}

/// How finely sizing cuts the module.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Grain {
    /// SRAM bytes a [`Plan::Tiled`] matvec tile may use (`None`: all a PE has).
    pub tile_budget: Option<u64>,
    /// The largest vector segment, in elements.
    pub max_segment: u64,
}

impl Grain {
    /// SRAM-full tiles and [`MAX_SEGMENT`] segments: the fewest PEs.
    pub const DENSE: Grain = Grain { tile_budget: None, max_segment: MAX_SEGMENT };
}

/// Sizes every instruction for `params` at `grain`; `quantise` sizes matvec and embedding weights
/// as if quantised (for the does-not-fit hint).
pub(super) fn size_module(
    module: &Module,
    params: &TargetParams,
    options: &CompileOptions,
    quantise: Option<DType>,
    grain: Grain,
) -> Result<Sizes, WaferError> {
    let usable = params.usable_bytes_per_pe() as u64;
    let tile_budget = grain.tile_budget.map_or(usable, |b| b.min(usable));
    let max_segment = grain.max_segment;
    let mut shapes = Vec::with_capacity(module.body.len());
    let mut pes = Vec::with_capacity(module.body.len());
    for (handle, instr) in module.body.iter() {
        let i = handle.index() as u32;
        let unsupported =
            |message: String| WaferError::Unsupported { instr: i, op: instr.op.name(), layer: instr.layer, message };
        let len = match &instr.ty {
            ValueType::Tensor(t) => t.elements(),
            ValueType::Routing { .. } => 0,
        };
        let fits = |s: u64| vector_bytes(module, &instr.op, s) <= usable;
        let pow2_segments = |extra: &dyn Fn(u64) -> bool| -> Result<Vec<Range<u64>>, WaferError> {
            let mut size = max_segment;
            while size >= CHUNK {
                let s = size.min(len);
                if extra(size) && fits(s) {
                    return Ok(segments(len, s));
                }
                size /= 2;
            }
            Err(unsupported(format!("no segment of 32 to {max_segment} elements fits {usable} bytes of SRAM")))
        };
        let unit_segments = |unit: u64| -> Result<Vec<Range<u64>>, WaferError> {
            let mut multiple = (max_segment / unit).max(1);
            loop {
                let s = (unit * multiple).min(len);
                if fits(s) {
                    return Ok(segments(len, s));
                }
                if multiple == 1 {
                    return Err(unsupported(format!(
                        "a segment of {unit} elements does not fit {usable} bytes of SRAM"
                    )));
                }
                multiple /= 2;
            }
        };
        let shape = match &instr.op {
            Op::Embed { table } => {
                let w = &module.weights[*table];
                let dtype = effective_dtype(w, quantise);
                let rows = w.ty.shape[0];
                let segs = segments(len, max_segment);
                let mut rows_per_block = Vec::with_capacity(segs.len());
                for seg in &segs {
                    let width = seg.end - seg.start;
                    let row = dtype.row_bytes(width).ok_or_else(|| {
                        unsupported(format!("table {} ({}) cannot be cut at element {}", w.name, w.ty, seg.start))
                    })?;
                    let per_block = usable.saturating_sub(width * F32) / row;
                    if per_block == 0 {
                        return Err(unsupported(format!("one {width}-element row of {} does not fit a PE", w.name)));
                    }
                    let blocks = rows.div_ceil(per_block);
                    rows_per_block.push(rows.div_ceil(blocks));
                }
                // One row banding for every segment (a narrower last segment, as for a width of
                // 2880, takes the wider ones' bands), so each band of rows is held across its width.
                let band = rows_per_block.iter().copied().min().unwrap_or(rows);
                rows_per_block.iter_mut().for_each(|per| *per = band);
                Shape::Embed { segments: segs, rows_per_block }
            }
            Op::MatVec { weight, bias, .. } => {
                let w = &module.weights[*weight];
                let dtype = effective_dtype(w, quantise);
                let bias_dtype = bias.map(|b| module.weights[b].ty.dtype);
                let (rows, cols) = (w.ty.shape[0], w.ty.shape[1]);
                let tiling = match options.plan {
                    // The stacked plan tiles per region (`stacked`); its sizes here only estimate
                    // what fits, as the densest tiling does.
                    Plan::Tiled | Plan::Stacked { .. } => tile_for_sram(dtype, bias_dtype, rows, cols, tile_budget)
                        .or_else(|| tile_for_sram(dtype, bias_dtype, rows, cols, usable)),
                    Plan::MeshGemv { p, .. } => tile_mesh(dtype, bias_dtype, rows, cols, usable, p as u64),
                }
                .ok_or_else(|| {
                    unsupported(format!(
                        "no tile of weight {} ({}) fits {usable} bytes of SRAM{}",
                        w.name,
                        w.ty,
                        match options.plan {
                            Plan::MeshGemv { p, .. } => format!(" as {p} x {p} blocks or finer"),
                            Plan::Tiled | Plan::Stacked { .. } => String::new(),
                        }
                    ))
                })?;
                Shape::MatVec {
                    rows_per_tile: tiling.rows_per_tile,
                    chunks_per_tile: tiling.chunks_per_tile,
                    row_blocks: tiling.row_blocks,
                    col_blocks: tiling.col_blocks,
                    segments: pow2_segments(&|_| true)?,
                }
            }
            Op::RmsNorm { weight, .. } => {
                let g = module.weights[*weight].ty.shape[0];
                let segs = if g == len {
                    pow2_segments(&|_| true)?
                } else if g <= max_segment {
                    unit_segments(g)?
                } else {
                    pow2_segments(&|s| g.is_multiple_of(s))?
                };
                Shape::Vector { segments: segs }
            }
            Op::Rope { head_dim, .. } => Shape::Vector { segments: unit_segments(*head_dim as u64)? },
            Op::Silu { .. } | Op::Mul { .. } | Op::Add { .. } | Op::SwiGlu { .. } | Op::ExpertCombine { .. } => {
                Shape::Vector { segments: pow2_segments(&|_| true)? }
            }
            Op::Attention { window: Some(window), .. } if *window > options.max_context => {
                return Err(unsupported(format!(
                    "its sliding window of {window} positions is larger than the KV capacity (max context {}): \
                     raise the max context to at least {window}",
                    options.max_context
                )))
            }
            Op::Attention { cache, heads, window, .. } => {
                let c = &module.caches[*cache];
                let head_dim = c.head_dim as u64;
                let q_per_kv = (*heads / c.kv_heads) as u64;
                // A windowed cache keeps only the window's rows.
                let rows = window.map_or(options.max_context as u64, u64::from);
                let max_positions = CHUNK * rows.div_ceil(CHUNK).next_power_of_two();
                let mut positions = CHUNK;
                if kv_block_bytes(positions, head_dim, q_per_kv) > usable {
                    return Err(unsupported(format!(
                        "32 positions of a KV head (head_dim {head_dim}, {q_per_kv} query heads) need {} bytes, \
                         more than the {usable} usable bytes of a PE",
                        kv_block_bytes(positions, head_dim, q_per_kv)
                    )));
                }
                while positions * 2 <= max_positions && kv_block_bytes(positions * 2, head_dim, q_per_kv) <= usable {
                    positions *= 2;
                }
                let blocks = rows.div_ceil(positions);
                Shape::Attention {
                    positions_per_block: positions as u32,
                    blocks_per_head: blocks as u32,
                    segments: unit_segments(head_dim)?,
                }
            }
            Op::RouterTopK { logits, top_k, .. } => {
                let experts = match &module.body[*logits].ty {
                    ValueType::Tensor(t) => t.elements(),
                    ValueType::Routing { .. } => 0,
                };
                if experts * F32 + *top_k as u64 * 8 > usable {
                    return Err(unsupported(format!("{experts} router logits do not fit one PE")));
                }
                Shape::Router
            }
            Op::ExpertDispatch { .. } | Op::Slice { .. } => Shape::Alias,
        };
        let count = match (&shape, &instr.op) {
            // Every sequence in flight has blocks of its own.
            (Shape::Attention { blocks_per_head, segments, .. }, Op::Attention { cache, .. }) => {
                options.max_sequences as u64 * module.caches[*cache].kv_heads as u64 * *blocks_per_head as u64
                    + segments.len() as u64
            }
            (Shape::Embed { segments, rows_per_block }, Op::Embed { table }) => {
                let rows = module.weights[*table].ty.shape[0];
                segments.len() as u64 + rows_per_block.iter().map(|per| rows.div_ceil(*per)).sum::<u64>()
            }
            (Shape::MatVec { row_blocks, col_blocks, segments, .. }, _) => {
                // Whole stripes of `shelf` tile rows (grids shorter than a shelf are packed), a
                // column's slack for alignment, and a column per result segment at worst.
                let shelf = super::place::shelf_height(params.grid_rows as u64);
                let (rows, cols) = (*row_blocks as u64, *col_blocks as u64);
                if rows < shelf {
                    rows * cols + segments.len() as u64
                } else {
                    rows.div_ceil(shelf) * shelf * cols + (segments.len() as u64 + 1) * shelf
                }
            }
            (Shape::Vector { segments }, _) => segments.len() as u64,
            (Shape::Router, _) => 1,
            _ => 0,
        };
        shapes.push(shape);
        pes.push(count);
    }
    Ok(Sizes { shapes, pes })
}

/// The PEs of one sequence's KV blocks, over every attention.
pub(super) fn kv_block_pes(module: &Module, sizes: &Sizes) -> u64 {
    module
        .body
        .iter()
        .zip(&sizes.shapes)
        .map(|((_, instr), shape)| match (&instr.op, shape) {
            (Op::Attention { cache, .. }, Shape::Attention { blocks_per_head, .. }) => {
                module.caches[*cache].kv_heads as u64 * *blocks_per_head as u64
            }
            _ => 0,
        })
        .sum()
}

/// The share of a target's PEs the default plan fills when it spreads matvec tiles.
const FILL: f64 = 0.85;

/// [`Plan::Tiled`] on a target with PEs to spare: the sizes with segments of at most
/// `max_segment` elements and matvec tiles given less SRAM, so the module fills about [`FILL`] of
/// the target. At batch 1 only one layer computes at a time, and a matvec's time is its busiest
/// tile's weights, so spreading the tiles over PEs that would otherwise sit idle divides the
/// arithmetic of every step (the longer reductions cost far less). `None` when the dense sizes
/// (`full`) already fill the target.
pub(super) fn spread_tiles(
    module: &Module,
    params: &TargetParams,
    options: &CompileOptions,
    full: &Sizes,
    max_segment: u64,
) -> Option<Sizes> {
    let capacity = params.grid_cols as u64 * params.grid_rows as u64 * params.wafers as u64;
    let goal = (capacity as f64 * FILL) as u64;
    let usable = params.usable_bytes_per_pe() as u64;
    if full.total_pes() >= goal {
        return None;
    }
    // Matvec tiles hold most of the PEs: scale their budget by the shortfall, a few rounds, since
    // the other instructions' PEs do not scale; keep the fullest sizing within the goal.
    let (mut budget, mut total) = (usable, full.total_pes());
    let mut best: Option<Sizes> = None;
    for _ in 0..6 {
        budget = ((budget as f64 * total as f64 / goal as f64) as u64).clamp(usable / 64, usable);
        let sizes =
            size_module(module, params, options, None, Grain { tile_budget: Some(budget), max_segment }).ok()?;
        total = sizes.total_pes();
        if total <= goal && best.as_ref().is_none_or(|b| total > b.total_pes()) {
            best = Some(sizes);
        }
        if (goal as f64 * 0.95) as u64 <= total && total <= goal {
            break;
        }
    }
    best
}

pub(super) struct Tiling {
    pub rows_per_tile: u64,
    pub chunks_per_tile: u64,
    pub row_blocks: u32,
    pub col_blocks: u32,
}

/// The tiling needing the fewest PEs (ties: fewer tiles per row, so shorter reductions): every
/// power-of-two chunk run, with as many rows as fit beside it, rows then spread evenly.
fn tile_for_sram(dtype: DType, bias: Option<DType>, rows: u64, cols: u64, usable: u64) -> Option<Tiling> {
    let chunks = cols.div_ceil(CHUNK);
    let mut best: Option<(u64, Tiling)> = None;
    let mut run = 1;
    while run <= chunks.next_power_of_two() {
        let width = (run * CHUNK).min(cols);
        let per_row = tile_bytes(dtype, bias, 1, width)? - tile_bytes(dtype, bias, 0, width)?;
        let fixed = tile_bytes(dtype, bias, 0, width)?;
        let max_rows = usable.saturating_sub(fixed) / per_row.max(1);
        if max_rows > 0 {
            let row_blocks = rows.div_ceil(max_rows.min(rows));
            let col_blocks = chunks.div_ceil(run);
            let tiles = row_blocks * col_blocks;
            if best.as_ref().is_none_or(|(t, b)| tiles < *t || (tiles == *t && col_blocks < b.col_blocks as u64)) {
                let tiling = Tiling {
                    rows_per_tile: rows.div_ceil(row_blocks),
                    chunks_per_tile: run,
                    row_blocks: row_blocks as u32,
                    col_blocks: col_blocks as u32,
                };
                best = Some((tiles, tiling));
            }
        }
        run *= 2;
    }
    best.map(|(_, t)| t).map(|t| Tiling { row_blocks: rows.div_ceil(t.rows_per_tile) as u32, ..t })
}

/// WaferLLM's `p x p` blocks: `p` row blocks, and the columns in at most `p` aligned
/// power-of-two chunk runs. A matrix whose `p x p` blocks do not fit one PE each is cut finer
/// (the smallest `p' > p` whose blocks fit), as a wafer with too little SRAM per PE would force.
fn tile_mesh(dtype: DType, bias: Option<DType>, rows: u64, cols: u64, usable: u64, p: u64) -> Option<Tiling> {
    let chunks = cols.div_ceil(CHUNK);
    let mut side = p;
    loop {
        let run = chunks.div_ceil(side).next_power_of_two();
        let rows_per_tile = rows.div_ceil(side.min(rows));
        let width = (run * CHUNK).min(cols);
        if tile_bytes(dtype, bias, rows_per_tile, width)? <= usable {
            return Some(Tiling {
                rows_per_tile,
                chunks_per_tile: run,
                row_blocks: rows.div_ceil(rows_per_tile) as u32,
                col_blocks: chunks.div_ceil(run) as u32,
            });
        }
        if rows_per_tile == 1 && run == 1 {
            return None;
        }
        side += side.div_ceil(8);
    }
}

/// A pipeline split that does not fit: the wafer that overflows (if the total would fit) and
/// the PEs available (per wafer when `wafer` is set, in total otherwise).
pub(super) struct Overflow {
    pub wafer: Option<(u16, u64)>,
    pub available: u64,
}

/// The wafer of every instruction: the prologue (before the first layer) on wafer 0, the
/// epilogue on the last used wafer, whole layers in between, cut where the heaviest wafer's PE
/// count is least (`partition`: an optimal contiguous split, the rest spread evenly).
pub(super) fn assign_wafers(module: &Module, pes: &[u64], params: &TargetParams) -> Result<Vec<u16>, Overflow> {
    let per_wafer = params.grid_cols as u64 * params.grid_rows as u64;
    let wafers = params.wafers;
    let total: u64 = pes.iter().sum();
    if total > per_wafer * wafers as u64 {
        return Err(Overflow { wafer: None, available: per_wafer * wafers as u64 });
    }
    let units = units(module);
    let loads: Vec<u64> = units.iter().map(|u| pes[u.clone()].iter().sum()).collect();
    let chosen = super::partition::partition(&loads, wafers, per_wafer).ok_or_else(|| Overflow {
        wafer: Some(super::partition::heaviest_wafer(&loads, wafers)),
        available: per_wafer,
    })?;
    let mut wafer_of = vec![0u16; pes.len()];
    for (unit, range) in units.iter().enumerate() {
        wafer_of[range.clone()].fill(chosen[unit]);
    }
    Ok(wafer_of)
}

/// Runs of instructions that stay on one wafer: each layer, with the layer-less instructions
/// before the first layer joining it and any others joining the layer before them.
fn units(module: &Module) -> Vec<Range<usize>> {
    let mut units: Vec<Range<usize>> = Vec::new();
    let mut current: Option<Option<u32>> = None;
    for (handle, instr) in module.body.iter() {
        let i = handle.index();
        let joins = match (current, instr.layer) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(None), Some(_)) => true,
            (Some(Some(prev)), Some(l)) => prev == l,
        };
        if joins {
            units.last_mut().expect("a unit is open").end = i + 1;
        } else {
            units.push(i..i + 1);
        }
        if instr.layer.is_some() || current.is_none() {
            current = Some(instr.layer);
        }
    }
    units
}

/// Built-in targets on which the module fits as it is, then quantisations that make it fit
/// `target`: `wse3x4`, `q8_0 on wse3`.
pub(super) fn what_would_fit(module: &Module, target: &Target, options: &CompileOptions) -> Vec<String> {
    let mut fits = Vec::new();
    for other in waferc_targets::list() {
        if other.name == target.name {
            continue;
        }
        let params = other.params();
        if let Ok(sizes) = size_module(module, &params, options, None, Grain::DENSE) {
            if assign_wafers(module, &sizes.pes, &params).is_ok() {
                fits.push(other.name.clone());
            }
        }
    }
    let params = target.params();
    for quant in [DType::Q8_0, DType::Q4_0] {
        if let Ok(sizes) = size_module(module, &params, options, Some(quant), Grain::DENSE) {
            if assign_wafers(module, &sizes.pes, &params).is_ok() {
                fits.push(format!("{quant} on {}", target.name));
            }
        }
    }
    fits
}
