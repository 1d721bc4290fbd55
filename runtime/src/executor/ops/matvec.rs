//! Matrix-vector product: per-tile dot products, row-block reductions and broadcasts, then the
//! bias and the collect into result segments.

use rustc_hash::FxHashMap as HashMap;
use waferc_ir::wafer::{wide, MatVecPlacement, Pe, Phase, Route, RouteKind, Segment};
use waferc_ir::BLOCK;

use super::check_count;
use crate::executor::by_pe::ByPe;
use crate::executor::fabric::{route_kind_error, single_source, Payload};
use crate::executor::sram::{region_row, weight_name};
use crate::executor::{intersect, relative, span, Data, ExecError, Executor, Held, InstrIndex, InstrRun, StepState};
use crate::kernels;

impl Executor<'_> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matvec(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        x: InstrIndex,
        weight: u32,
        bias: Option<u32>,
        p: &MatVecPlacement,
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        if p.row_blocks == 0 || p.col_blocks == 0 {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!("{} x {} tile blocks", p.row_blocks, p.col_blocks),
            });
        }
        let tile_count = p.row_blocks as usize * p.col_blocks as usize;
        check_count(run, "tiles", p.tiles.len(), tile_count)?;
        check_count(run, "collect routes", p.collects.len(), segments.len())?;
        let dtype = self.weight_dtype(weight);

        run.begin(Phase::Compute);
        let mut partials: Vec<Data> = Vec::with_capacity(tile_count);
        for tile in &p.tiles {
            let (tile_rows, chunks) = (wide(&tile.rows), wide(&tile.chunks));
            let cols = (chunks.start * BLOCK as u64).min(p.cols)..(chunks.end * BLOCK as u64).min(p.cols);
            let x_part = self.operand(state, run, tile.pe, x, cols.clone())?;
            let rows = tile_rows.end - tile_rows.start;
            let partial = if self.options.timing_only {
                Data::Shape(rows as usize)
            } else {
                let region = tile.region as usize;
                let (held_weight, held_rows, held_cols, bytes) = self.weight_region(run, tile.pe, region)?;
                if held_weight != weight || held_rows != tile_rows || held_cols != cols {
                    return Err(self.region_error(
                        run,
                        tile.pe,
                        region,
                        &format!(
                            "the tile needs weight {}, rows {:?}, elements {cols:?}",
                            weight_name(self.module, weight),
                            tile.rows
                        ),
                    ));
                }
                let mut out = Vec::with_capacity(rows as usize);
                for row in 0..rows {
                    let view = region_row(dtype, bytes, row, span(&cols))
                        .ok_or_else(|| self.region_error(run, tile.pe, region, "its bytes do not match its shape"))?;
                    out.push(kernels::dot(x_part.values(), view));
                }
                Data::Values(out)
            };
            run.compute(tile.pe, self.costs.fma(rows * span(&cols)));
            partials.push(partial);
        }

        // Where each row block's running total is: its first tile until a reduction moves it.
        let mut total_at: Vec<usize> = (0..p.row_blocks as usize).map(|r| r * p.col_blocks as usize).collect();
        let tiles_by_pe = TilesByPe::new(p);
        run.begin(Phase::Reduce);
        for &id in &p.reductions {
            let route = self.route(run, id)?;
            let row_block = reduction_row_block(run, route, p, &tiles_by_pe)?;
            let site = run.site.clone();
            let tile_on = |pe: Pe| -> Result<usize, ExecError> {
                tiles_by_pe.in_row_block(p, row_block, pe).ok_or_else(|| ExecError::MalformedOnPe {
                    site: site.clone(),
                    pe,
                    problem: format!("reduction route {id} reaches it, but it holds no tile of row block {row_block}"),
                })
            };
            let leaf_tiles = route.sources.iter().map(|&pe| tile_on(pe)).collect::<Result<Vec<_>, _>>()?;
            let leaves = leaf_tiles.iter().map(|&t| partials[t].clone()).collect();
            let (at, total) = self.reduce(state, run, id, leaves)?;
            let tile = tile_on(at)?;
            partials[tile] = total;
            total_at[row_block] = tile;
        }

        run.begin(Phase::Broadcast);
        // The first row block whose total is on each PE (what a broadcast's root sends).
        let mut total_on: HashMap<Pe, usize> = HashMap::default();
        if !p.broadcasts.is_empty() {
            for (row_block, &t) in total_at.iter().enumerate() {
                total_on.entry(p.tiles[t].pe).or_insert(row_block);
            }
        }
        for &id in &p.broadcasts {
            let route = self.route(run, id)?;
            let RouteKind::Statistic { elements } = route.kind else {
                return Err(route_kind_error(run, route, "a broadcast of reduced rows"));
            };
            let root = single_source(run, route)?;
            let row_block = total_on.get(&root).copied().ok_or_else(|| ExecError::MalformedOnPe {
                site: run.site.clone(),
                pe: root,
                problem: format!("broadcast route {id} starts here, but no row block's total is here"),
            })?;
            self.send(state, run, id, root, Payload::Data(partials[total_at[row_block]].clone()))?;
            for &pe in &route.destinations {
                self.receive_data(state, run, id, root, pe, elements as usize)?;
            }
        }

        run.begin(Phase::Collect);
        let mut held = Vec::with_capacity(segments.len());
        for (segment, &id) in segments.iter().zip(&p.collects) {
            let mut parts = Vec::new();
            for (row_block, &tile_index) in total_at.iter().enumerate() {
                let tile = &p.tiles[tile_index];
                let Some(overlap) =
                    intersect(&wide(&p.tiles[row_block * p.col_blocks as usize].rows), &segment.elements)
                else {
                    continue;
                };
                let rows = relative(&overlap, tile.rows.start as u64);
                let total = partials[tile_index].slice(rows);
                let data = match bias {
                    Some(bias) if !self.options.timing_only => {
                        let region = self.find_weight_region(run, tile.pe, bias, 0, &overlap)?;
                        let bias_part = self.widen_from_region(run, tile.pe, region, 0, overlap.clone())?;
                        Data::Values(kernels::add(total.values(), &bias_part))
                    }
                    _ => total,
                };
                if bias.is_some() {
                    run.compute(tile.pe, self.costs.flops(span(&overlap)));
                }
                self.send(state, run, id, tile.pe, Payload::Data(data))?;
                parts.push((tile.pe, overlap));
            }
            held.push(self.assemble(state, run, id, segment, parts)?);
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }
}

/// A matvec's tile indices by PE, in tile order per PE: the reductions look tiles up by PE for
/// every leaf.
struct TilesByPe(ByPe<usize>);

impl TilesByPe {
    fn new(p: &MatVecPlacement) -> Self {
        TilesByPe(ByPe::new(p.tiles.iter().enumerate().map(|(t, tile)| (tile.pe, t))))
    }

    /// The tiles on `pe`, in tile order.
    fn on(&self, pe: Pe) -> impl Iterator<Item = usize> + '_ {
        self.0.on(pe).iter().copied()
    }

    /// The first tile of row block `row_block` on `pe`.
    fn in_row_block(&self, p: &MatVecPlacement, row_block: usize, pe: Pe) -> Option<usize> {
        let cols = p.col_blocks as usize;
        let tiles = self.0.on(pe);
        let at = tiles.partition_point(|&t| t < row_block * cols);
        tiles.get(at).copied().filter(|&t| t < (row_block + 1) * cols)
    }
}

/// The row block a matvec reduction combines: the first one with a tile on every source (and,
/// with sources, one of the row blocks of the first source's tiles).
fn reduction_row_block(
    run: &InstrRun,
    route: &Route,
    p: &MatVecPlacement,
    tiles_by_pe: &TilesByPe,
) -> Result<usize, ExecError> {
    let elements = match route.kind {
        RouteKind::Reduce { elements, .. } => elements as u64,
        _ => return Err(route_kind_error(run, route, "a reduction")),
    };
    let cols = p.col_blocks as usize;
    let fits = |r: usize| {
        let first = &p.tiles[r * cols];
        u64::from(first.rows.end - first.rows.start) == elements
            && route.sources.iter().all(|&pe| tiles_by_pe.in_row_block(p, r, pe).is_some())
    };
    let found = match route.sources.first() {
        Some(&pe) => tiles_by_pe.on(pe).map(|t| t / cols).find(|&r| fits(r)),
        None => (0..p.row_blocks as usize).find(|&r| fits(r)),
    };
    found.ok_or_else(|| ExecError::Malformed {
        site: run.site.clone(),
        problem: format!("reduction route {} does not match the tiles of any row block", route.id),
    })
}
