//! Placement (PEs and SRAM images), routes and the schedule, from the sizes.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::collections::BTreeMap;
use std::ops::Range;

use waferc_ir::completion::Completion;
use waferc_ir::wafer::covered_bytes;
use waferc_ir::wafer::serial::SharedPes;
use waferc_ir::wafer::{group_query_heads, narrow, replica_slots_in, rope_twin, wide, ExpertReplicas};
use waferc_ir::wafer::{
    AttentionPlacement, EmbedBlock, GroupRoutes, InstrPlacement, KvBlock, KvHeadPlacement, Lanes, MatVecPlacement,
    NormPlacement, Pe, PeGrid, PeImage, Phase, Plan, ReduceOp, Region, RegionKind, ResultLayout, Route, RouteId,
    RouteKind, Run, Segment, Step, TargetParams, Tile, VectorLayout, WaferProgram, Work,
};
use waferc_ir::{Module, Op, ValueType, BLOCK};

use super::experts::placement_sequence;
use super::route::{self, assign_colours};
use super::size::{Analysis, Shape, Sizes};
use super::{CompileOptions, WaferError};

const CHUNK: u64 = BLOCK as u64;
const F32: u64 = 4;
/// The most instructions a colour clash names as holding the colours (the rest are counted).
const MAX_HOLDERS_NAMED: usize = 8;

/// PEs are handed out in shelves: bands of `shelf` rows across a wafer, each filled column by
/// column (down a column, then the next column to the right), so consecutive allocations are
/// neighbours. A matvec takes whole columns instead: a stripe of `C` columns holds `shelf`
/// consecutive tile rows, so each tile row is a straight run along a PE row (its reduction) and
/// each tile column a straight run down a PE column (where its operand slice arrives).
pub(super) struct Cells {
    cols: u64,
    shelf: u64,
    capacity: u64,
    /// The next free cell, per wafer.
    next: Vec<u64>,
}

impl Cells {
    pub(super) fn new(params: &TargetParams) -> Cells {
        let shelf = shelf_height(params.grid_rows as u64);
        Cells {
            cols: params.grid_cols as u64,
            shelf,
            capacity: params.grid_cols as u64 * params.grid_rows as u64,
            next: vec![0; params.wafers as usize],
        }
    }

    fn pe(&self, wafer: u16, cell: u64) -> Pe {
        let per_shelf = self.cols * self.shelf;
        let within = cell % per_shelf;
        Pe::new(wafer, (within / self.shelf) as u16, ((cell / per_shelf) * self.shelf + within % self.shelf) as u16)
    }

    /// `count` consecutive cells; `None` when the wafer is full.
    fn take(&mut self, wafer: u16, count: u64) -> Option<u64> {
        let base = self.next[wafer as usize];
        (base + count <= self.capacity).then(|| {
            self.next[wafer as usize] = base + count;
            base
        })
    }

    /// One cell at `row` of the current column if that is still free, else the next cell.
    fn take_at_row(&mut self, wafer: u16, row: u64) -> Option<u64> {
        let next = self.next[wafer as usize];
        let wanted = next - next % self.shelf + row;
        let cell = wanted.max(next);
        (cell < self.capacity).then(|| {
            self.next[wafer as usize] = cell + 1;
            cell
        })
    }

    /// A stripe `width` columns wide starting at the next free column (in the next shelf if this
    /// one has too few columns left): its top-left PE.
    fn take_stripe(&mut self, wafer: u16, width: u64) -> Option<Pe> {
        let per_shelf = self.cols * self.shelf;
        let mut cell = self.next[wafer as usize].next_multiple_of(self.shelf);
        if (cell % per_shelf) / self.shelf + width > self.cols {
            cell = cell.next_multiple_of(per_shelf);
        }
        (width <= self.cols && cell + width * self.shelf <= self.capacity).then(|| {
            self.next[wafer as usize] = cell + width * self.shelf;
            self.pe(wafer, cell)
        })
    }
}

/// The row on which each segment of `layout` crosses to another wafer (`route::multicast`):
/// consecutive rows, one per segment, around the segments' middle row. Through the gateway of
/// the segments' own row, a value whose segments sit along one row (the residual stream of a
/// region: `stacked::columns`) queued on that row's links, one segment after another: the 70B's
/// residual crossed to the next wafer in 11.3k cycles, 7.7k of them waiting.
fn crossing_rows(layout: &VectorLayout, grid_rows: u16) -> Vec<u16> {
    let n = layout.segments.len() as u64;
    let mut rows: Vec<u64> = layout.segments.iter().map(|s| s.pe.y as u64).collect();
    rows.sort_unstable();
    let middle = rows.get(rows.len() / 2).copied().unwrap_or(0);
    let first = middle.saturating_sub(n / 2).min((grid_rows as u64).saturating_sub(n));
    (0..n).map(|k| ((first + k) as u16).min(grid_rows.saturating_sub(1))).collect()
}

/// Rows per shelf: the largest divisor of the grid's rows up to 8 (so shelves tile the wafer;
/// short shelves waste fewer PEs in the last, partly filled stripe of each matvec).
pub(super) fn shelf_height(grid_rows: u64) -> u64 {
    (1..=grid_rows.min(8)).rev().find(|h| grid_rows.is_multiple_of(*h)).unwrap_or(1)
}

/// Makes room for `extra` more regions in a PE's list, growing it by half rather than doubling:
/// hundreds of thousands of lists grow side by side, and their spare capacity is most of what
/// lowering the stacked plan holds at its peak (the lists shrink to fit once placement ends).
fn make_room(regions: &mut Vec<Region>, extra: usize) {
    let needed = regions.len() + extra;
    if needed > regions.capacity() {
        let grown = needed.max(regions.capacity() + regions.capacity() / 2);
        regions.reserve_exact(grown - regions.len());
    }
}

/// Where region `new` (its offset not yet set) goes in an image holding `regions` (see
/// [`PeImage`]): a resident one at the resident regions' end, below every working one; a working
/// one (an operand buffer or a result) as high below the SRAM's `top` as it fits without
/// overlapping a working region it may not share bytes with ([`Region::may_share`]). `None` when it does not fit.
fn region_offset(
    regions: &[Region],
    new: &Region,
    top: u64,
    completion: &Completion,
    clashes: &mut Vec<(u64, u64)>,
) -> Option<u64> {
    let end = |r: &Region| r.offset as u64 + r.bytes as u64;
    let bytes = new.bytes as u64;
    let resident_end = regions.iter().filter(|r| !r.kind.is_working()).map(end).max().unwrap_or(0);
    if !new.kind.is_working() {
        let floor = regions.iter().filter(|r| r.kind.is_working()).map(|r| r.offset as u64).min().unwrap_or(top);
        return (resident_end + bytes <= floor).then_some(resident_end);
    }
    // `clashes` is the caller's scratch list: this runs once per region placed, tens of
    // millions of times for a full-size model, so it allocates nothing.
    clashes.clear();
    clashes.extend(
        regions
            .iter()
            .filter(|r| r.kind.is_working() && !r.may_share(new, completion))
            .map(|r| (r.offset as u64, end(r))),
    );
    clashes.sort_unstable_by(|a, b| b.cmp(a));
    // Highest first: right below the top (above every working region), or right below a
    // clashing buffer.
    std::iter::once(top).chain(clashes.iter().map(|&(start, _)| start)).find_map(|t| {
        let start = t.checked_sub(bytes)?;
        (start >= resident_end && clashes.iter().all(|&(s, e)| e <= start || s >= t)).then_some(start)
    })
}

/// Who holds a PE's SRAM, for an overflow message: the code reserve's bytes, then each
/// instruction's bytes in the order its regions were placed (`%12 matvec 34304`), so a plan
/// that overfills a PE says what shares it.
fn sram_holders(module: &Module, regions: &[Region]) -> String {
    let mut holders: Vec<(Option<u32>, u64)> = Vec::new();
    for region in regions {
        match holders.iter_mut().find(|(instr, _)| *instr == region.instr) {
            Some((_, bytes)) => *bytes += region.bytes as u64,
            None => holders.push((region.instr, region.bytes as u64)),
        }
    }
    holders
        .into_iter()
        .map(|(instr, bytes)| match instr {
            Some(i) => format!("%{i} {} {bytes}", module.body[waferc_ir::Handle::new(i as usize)].op.name()),
            None => format!("code {bytes}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Index in the placer's images of each PE's image: a dense grid index (the placer looks PEs up
/// millions of times), a map for a PE off the grid.
struct ImageIndex {
    grid: PeGrid,
    dense: Vec<u32>,
    outside: HashMap<Pe, usize>,
}

impl ImageIndex {
    fn new(params: &TargetParams) -> Self {
        let grid = PeGrid::of(params);
        ImageIndex { grid, dense: vec![u32::MAX; grid.len()], outside: HashMap::default() }
    }

    fn get(&self, pe: Pe) -> Option<usize> {
        match self.grid.index(pe) {
            Some(d) => (self.dense[d] != u32::MAX).then_some(self.dense[d] as usize),
            None => self.outside.get(&pe).copied(),
        }
    }

    fn remove(&mut self, pe: Pe) {
        match self.grid.index(pe) {
            Some(d) => self.dense[d] = u32::MAX,
            None => {
                self.outside.remove(&pe);
            }
        }
    }

    fn insert(&mut self, pe: Pe, index: usize) {
        match self.grid.index(pe) {
            Some(d) => self.dense[d] = index as u32,
            None => {
                self.outside.insert(pe, index);
            }
        }
    }
}

pub(super) struct Placer<'a> {
    pub(super) module: &'a Module,
    pub(super) analysis: &'a Analysis,
    pub(super) params: &'a TargetParams,
    pub(super) options: &'a CompileOptions,
    cells: Cells,
    images: Vec<PeImage>,
    pub(super) placements: Vec<InstrPlacement>,
    /// Index in `images` of each PE's image.
    image_of: ImageIndex,
    routes: Vec<Route>,
    /// Rows per band that multicasts and gathers keep their trees inside (`route::multicast`).
    pub(super) route_band: u16,
    /// Whether a vector op may run in place on a slice of its operand's layout (a rope on the
    /// queries of a fused q/k/v matvec). The stacked plan's segments are cut for it; the tiled
    /// plan's are not, and keeps hosting only on whole values.
    pub(super) host_slices: bool,
    /// Per instruction, its position in the placement order (experts may be reordered).
    rank: Vec<usize>,
    /// Extra copies of hot experts (`experts::place_replicas`).
    pub(super) replicas: Vec<ExpertReplicas>,
    /// While a copy's own routes are built: its readers are its own instructions only.
    routing_copy: bool,
    /// Routes into copies (`route_copy_inputs`), with the instruction whose `Deliver` step sends them.
    copy_inputs: Vec<(usize, RouteId)>,
    /// [`region_offset`]'s scratch list.
    clashes: Vec<(u64, u64)>,
}

/// PEs each instruction takes when the whole module is laid out on one unbounded wafer, alignment
/// and stripe waste included: the loads a pipeline split balances.
pub(super) fn measure(
    module: &Module,
    analysis: &Analysis,
    sizes: &Sizes,
    params: &TargetParams,
    options: &CompileOptions,
) -> Result<Vec<u64>, WaferError> {
    let mut cells = Cells::new(params);
    cells.capacity = u64::MAX;
    let mut placer = Placer::new(module, analysis, params, options, cells);
    let mut used = Vec::with_capacity(module.body.len());
    for (handle, _) in module.body.iter() {
        let i = handle.index();
        let before = placer.cells.next[0];
        let placement = placer.place_instr(i, &sizes.shapes[i], 0)?;
        placer.placements.push(placement);
        used.push(placer.cells.next[0] - before);
    }
    Ok(used)
}

pub(super) fn place(
    module: &Module,
    analysis: &Analysis,
    sizes: &Sizes,
    wafer_of: &[u16],
    params: &TargetParams,
    options: &CompileOptions,
) -> Result<WaferProgram, WaferError> {
    let mut placer = Placer::new(module, analysis, params, options, Cells::new(params));
    // Instructions are placed in `placement_sequence` order (an MoE layer's experts by the
    // routing profile) into slots indexed by instruction; an instruction only reads
    // placements of instructions placed before it.
    let sequence = placement_sequence(module, analysis, options);
    for (rank, &i) in sequence.iter().enumerate() {
        placer.rank[i] = rank;
    }
    placer.placements = (0..module.body.len()).map(unplaced).collect();
    for &i in &sequence {
        placer.placements[i] = placer.place_instr(i, &sizes.shapes[i], wafer_of[i])?;
    }
    super::experts::place_replicas(&mut placer, sizes, wafer_of);
    placer.finish()
}

/// The slot of an instruction not placed yet.
fn unplaced(i: usize) -> InstrPlacement {
    InstrPlacement {
        instr: i as u32,
        op: String::new(),
        layer: None,
        expert: None,
        result: ResultLayout::Vector(VectorLayout::default()),
        operand_routes: Vec::new(),
        deliveries: Vec::new(),
        work: Work::Elementwise,
    }
}

/// A region request: the instruction it serves, its kind, its bytes.
pub(super) type Request = (RegionKind, u64);

impl<'a> Placer<'a> {
    /// Routes every placed instruction's results and collectives, colours the routes, writes the
    /// schedule and sizes the tile blob: the part of placement every
    /// plan shares once its instructions have PEs.
    pub(super) fn finish(mut self) -> Result<WaferProgram, WaferError> {
        let module = self.module;
        let params = self.params;
        // The images are complete (routing adds none): give back their regions' spare capacity
        // (up to half of each list, grown by doubling) before the routes are built, so the
        // routes and the colouring reuse that memory instead of raising the peak.
        for image in &mut self.images {
            image.regions.shrink_to_fit();
        }
        for i in 0..module.body.len() {
            self.route_instr(i)?;
        }
        for i in 0..module.body.len() {
            self.deliver(i);
        }
        self.route_copies()?;
        let precedence = super::precedence::Precedence::new(module);
        let schedule = self.schedule();
        let mut step_of = vec![0u32; self.routes.len()];
        for (s, step) in schedule.iter().enumerate() {
            for &id in &step.routes {
                step_of[id as usize] = s as u32;
            }
        }
        let shared = SharedPes::new(&self.placements, !self.replicas.is_empty());
        let order = route::RouteOrder { precedence: &precedence, step_of, shared: &shared };
        if let Err(clash) = assign_colours(&mut self.routes, params, &order) {
            let route = &self.routes[clash.route];
            let instr = &module.body[waferc_ir::Handle::new(route.instr as usize)];
            // Name the routes that took the colours: the failed route's colour must differ from
            // every route that meets it anywhere on its path and may be active alongside it, so
            // those are counted, not only the ones through the PE reported.
            let mut path: Vec<Pe> = Vec::new();
            route::for_each_pe(route, |pe| path.push(pe));
            path.sort_unstable();
            path.dedup();
            let mut holders: BTreeMap<(u32, &'static str), u32> = BTreeMap::new();
            for (j, r) in self.routes.iter().enumerate() {
                let mut meets = false;
                route::for_each_pe(r, |pe| meets |= path.binary_search(&pe).is_ok());
                if meets && j != clash.route && !order.apart(&self.routes, clash.route, j) {
                    *holders.entry((r.instr, kind_name(&r.kind))).or_default() += 1;
                }
            }
            // The instructions with the most such routes first.
            let mut holders: Vec<((u32, &'static str), u32)> = holders.into_iter().collect();
            holders.sort_by_key(|&(key, n)| (std::cmp::Reverse(n), key));
            let named: Vec<String> = holders
                .iter()
                .take(MAX_HOLDERS_NAMED)
                .map(|&((instr, kind), n)| {
                    format!("{n} {kind} of %{instr} {}", module.body[waferc_ir::Handle::new(instr as usize)].op.name())
                })
                .collect();
            let rest: u32 = holders.iter().skip(MAX_HOLDERS_NAMED).map(|&(_, n)| n).sum();
            let holders = match rest {
                0 => named.join(", "),
                _ => format!("{}, and {rest} more", named.join(", ")),
            };
            return Err(WaferError::Colours {
                pe: clash.pe,
                route: clash.route as u32,
                instr: route.instr,
                op: instr.op.name(),
                layer: instr.layer,
                limit: params.colours_per_pe,
                holders,
            });
        }
        let options = self.options;
        let Placer { mut images, placements, routes, replicas, .. } = self;
        images.sort_unstable_by_key(|image| image.pe);
        // The tile blob lays the weight regions' bytes end to end in this order.
        let blob: u64 = (images.iter().flat_map(|image| &image.regions))
            .filter(|region| matches!(region.kind, RegionKind::Weight { .. }))
            .map(|region| region.bytes as u64)
            .sum();
        Ok(WaferProgram {
            target: params.clone(),
            plan: options.plan,
            max_context: options.max_context,
            pes: images,
            instrs: placements,
            routes,
            schedule,
            tile_blob_len: blob,
            weights_present: module.weights.iter().all(|(_, w)| w.data.is_present()),
            max_sequences: options.max_sequences,
            routing_profile: options.profile.clone(),
            replicas,
        })
    }

    pub(super) fn new(
        module: &'a Module,
        analysis: &'a Analysis,
        params: &'a TargetParams,
        options: &'a CompileOptions,
        cells: Cells,
    ) -> Placer<'a> {
        let route_band = cells.shelf as u16;
        Placer {
            module,
            analysis,
            params,
            options,
            cells,
            images: Vec::new(),
            placements: Vec::with_capacity(module.body.len()),
            image_of: ImageIndex::new(params),
            routes: Vec::new(),
            route_band,
            host_slices: false,
            rank: (0..module.body.len()).collect(),
            replicas: Vec::new(),
            routing_copy: false,
            copy_inputs: Vec::new(),
            clashes: Vec::new(),
        }
    }

    /// One more copy of the instructions `group` (an expert's, in program order) on fresh PEs of
    /// `wafer`, placed exactly as the originals were (same shapes, so the same tiles and
    /// segments); `None`, with nothing taken, when they do not fit. Each copy instruction is
    /// placed in its original's slot, so the copy's later instructions find the copy's earlier
    /// ones, then the originals are put back.
    pub(super) fn place_copy(&mut self, group: &[usize], shapes: &[Shape], wafer: u16) -> Option<Vec<InstrPlacement>> {
        let (next, images) = (self.cells.next.clone(), self.images.len());
        let mut originals = Vec::with_capacity(group.len());
        for &i in group {
            match self.place_instr(i, &shapes[i], wafer) {
                Ok(copy) => originals.push(std::mem::replace(&mut self.placements[i], copy)),
                Err(_) => break,
            }
        }
        let placed = originals.len() == group.len();
        let mut copy = Vec::with_capacity(group.len());
        for (&i, original) in group.iter().zip(originals) {
            copy.push(std::mem::replace(&mut self.placements[i], original));
        }
        if placed {
            return Some(copy);
        }
        // Give back what the partial copy took (its PEs were fresh).
        self.cells.next = next;
        for image in self.images.drain(images..) {
            self.image_of.remove(image.pe);
        }
        None
    }

    /// The copies' own routes (reductions, collects, deliveries among their instructions): each
    /// copy is put in its originals' slots while its routes are built, then put back. The
    /// routes into and out of a copy (the layer's input, the routing, the combine's gather)
    /// were built with the originals' (`deliver`, `route_instr`).
    fn route_copies(&mut self) -> Result<(), WaferError> {
        self.routing_copy = true;
        for r in 0..self.replicas.len() {
            let group: Vec<usize> = self.replicas[r].instrs.iter().map(|&i| i as usize).collect();
            for c in 0..self.replicas[r].copies.len() {
                for (m, &i) in group.iter().enumerate() {
                    std::mem::swap(&mut self.placements[i], &mut self.replicas[r].copies[c][m]);
                }
                let routed = group.iter().try_for_each(|&i| self.route_instr(i));
                if routed.is_ok() {
                    for &i in &group {
                        self.deliver(i);
                    }
                }
                for (m, &i) in group.iter().enumerate() {
                    std::mem::swap(&mut self.placements[i], &mut self.replicas[r].copies[c][m]);
                }
                routed?;
            }
        }
        self.routing_copy = false;
        let mut routers: Vec<u32> = self.replicas.iter().map(|r| r.router).collect();
        routers.dedup();
        for router in routers {
            self.route_copy_inputs(router as usize);
        }
        Ok(())
    }

    /// The routes into one MoE layer's expert copies, of their own so that a step no copy
    /// serves (sequence slot 0's) sends nothing on them: the router's decision to every PE of
    /// every copy (their `expert_dispatch`es name that route), and per segment of each value the
    /// copies read from outside their expert (the layer's normed input) one multicast to the
    /// copies' PEs that read it. One route per layer and segment, not per copy: a source's routes
    /// in one step each need a colour where they meet. They are sent in the router's and the
    /// value's `Deliver` steps (`Placer::copy_inputs` lists them).
    fn route_copy_inputs(&mut self, router: usize) {
        let ResultLayout::Routing { pe: router_pe } = self.placements[router].result else { return };
        let copies: Vec<(usize, usize)> = (0..self.replicas.len())
            .filter(|&r| self.replicas[r].router == router as u32)
            .flat_map(|r| (0..self.replicas[r].copies.len()).map(move |c| (r, c)))
            .collect();
        let mut pes: Vec<Pe> =
            copies.iter().flat_map(|&(r, c)| self.replicas[r].copies[c].iter().flat_map(placement_pes)).collect();
        pes.sort_unstable();
        pes.dedup();
        let top_k = match self.module.body[waferc_ir::Handle::new(router)].ty {
            ValueType::Routing { top_k, .. } => top_k as u64,
            _ => 0,
        };
        let path = route::multicast(router_pe, &pes, self.route_band, None);
        let routing = self.add_route(router, RouteKind::Routing, vec![router_pe], pes, vec![path], top_k * 8);
        self.copy_inputs.push((router, routing));
        // Values read from outside the expert, by which copy members.
        let mut outside: Vec<(usize, usize, usize, usize)> = Vec::new();
        for &(r, c) in &copies {
            for m in 0..self.replicas[r].instrs.len() {
                let i = self.replicas[r].instrs[m];
                if let Work::Dispatch { routing: id } = &mut self.replicas[r].copies[c][m].work {
                    *id = routing;
                }
                for v in self.module.body[waferc_ir::Handle::new(i as usize)].op.operands() {
                    let value = self.analysis.source[v.index()];
                    if !self.replicas[r].instrs.contains(&value) {
                        outside.push((value as usize, r, c, m));
                    }
                }
            }
        }
        outside.sort_unstable();
        outside.dedup();
        let mut values: Vec<usize> = outside.iter().map(|o| o.0).collect();
        values.dedup();
        for value in values {
            let ResultLayout::Vector(layout) = self.placements[value].result.clone() else { continue };
            for seg in &layout.segments {
                let mut destinations = Vec::new();
                let mut readers = Vec::new();
                for &(_, r, c, m) in outside.iter().filter(|o| o.0 == value) {
                    let before = destinations.len();
                    let member = self.replicas[r].instrs[m] as usize;
                    let placement = &self.replicas[r].copies[c][m];
                    self.reader_pes(value, member, placement, &seg.elements, &mut destinations, &mut Vec::new());
                    if destinations.len() > before {
                        readers.push((r, c, m));
                    }
                }
                let Some(id) = self.operand_multicast(value, seg, seg.elements.clone(), destinations, None) else {
                    continue;
                };
                self.copy_inputs.push((value, id));
                for (r, c, m) in readers {
                    push_unique(&mut self.replicas[r].copies[c][m].operand_routes, id);
                }
            }
        }
    }

    /// The copies of instruction `i`'s placement, as `(replica, copy, member)` indices (none
    /// while a copy's own routes are built).
    fn copies_of(&self, slots: &[Option<(u32, u32)>], i: usize) -> Vec<(usize, usize, usize)> {
        match slots.get(i).copied().flatten() {
            Some((r, m)) if !self.routing_copy => {
                (0..self.replicas[r as usize].copies.len()).map(|c| (r as usize, c, m as usize)).collect()
            }
            _ => Vec::new(),
        }
    }

    /// `count` consecutive PEs of `wafer`.
    fn take(&mut self, wafer: u16, count: u64) -> Result<Vec<Pe>, WaferError> {
        let base = self.cells.take(wafer, count).ok_or_else(|| self.full(wafer, count))?;
        Ok((base..base + count).map(|cell| self.cells.pe(wafer, cell)).collect())
    }

    fn stripe(&mut self, wafer: u16, width: u64) -> Result<Pe, WaferError> {
        self.cells.take_stripe(wafer, width).ok_or_else(|| self.full(wafer, width * self.cells.shelf))
    }

    /// The wafer ran out of PEs (sizing's estimate of the shelf layout's waste was short).
    fn full(&self, wafer: u16, wanted: u64) -> WaferError {
        let need = self.cells.next[wafer as usize] + wanted;
        WaferError::DoesNotFit(Box::new(super::NotFit {
            target: self.params.name.clone(),
            needed_pes: need,
            available_pes: self.cells.capacity,
            sram_bytes_per_pe: self.params.sram_bytes_per_pe,
            wafer: (self.params.wafers > 1).then_some((wafer, need)),
            would_fit: Vec::new(),
            kv_sequences: None,
        }))
    }

    /// Adds `requests` to `pe`'s image, in order, after what it already holds (a new image starts
    /// with the code reserve). Returns the regions' indices in the image.
    pub(super) fn fill(&mut self, pe: Pe, instr: u32, requests: Vec<Request>) -> Result<Vec<u32>, WaferError> {
        let index = match self.image_of.get(pe) {
            Some(index) => index,
            None => {
                let code =
                    Region { offset: 0, bytes: self.params.code_reserve_bytes, instr: None, kind: RegionKind::Code };
                self.image_of.insert(pe, self.images.len());
                self.images.push(PeImage { pe, regions: vec![code] });
                self.images.len() - 1
            }
        };
        let (top, completion) = (self.params.sram_bytes_per_pe as u64, &self.analysis.completion);
        let regions = &mut self.images[index].regions;
        make_room(regions, requests.len());
        let first = regions.len() as u32;
        let mut unplaced = 0;
        for (kind, bytes) in requests {
            let mut region = Region { offset: 0, bytes: bytes as u32, instr: Some(instr), kind };
            match region_offset(regions, &region, top, completion, &mut self.clashes) {
                Some(offset) if unplaced == 0 => {
                    region.offset = offset as u32;
                    regions.push(region);
                }
                _ => unplaced += bytes,
            }
        }
        if unplaced > 0 {
            let op = &self.module.body[waferc_ir::Handle::new(instr as usize)];
            let holders = sram_holders(self.module, regions);
            let needed = covered_bytes(regions) + unplaced;
            return Err(WaferError::Unsupported {
                instr,
                op: op.op.name(),
                layer: op.layer,
                message: format!(
                    "{pe} would need {needed} bytes of SRAM, more than {top} ({holders}; operand buffers and \
                     results share bytes where one is dead before the other is written)"
                ),
            });
        }
        Ok((first..regions.len() as u32).collect())
    }

    /// The layout of a vector op's result: on the PEs of its newest operand's segments when
    /// their cut suits the op and their SRAM has room (the data is then local and the op sits
    /// beside its producer), otherwise on fresh PEs cut as `segments`. `requests` lists a
    /// segment's regions; operand regions for data already on the PE are dropped.
    fn vector_layout(
        &mut self,
        i: usize,
        wafer: u16,
        segments: &[Range<u64>],
        requests: impl Fn(&Range<u64>) -> Vec<Request>,
    ) -> Result<VectorLayout, WaferError> {
        let len = segments.last().map_or(0, |s| s.end);
        match self.host_layout(i, &|pe| pe.wafer == wafer, len, &requests) {
            Some(layout) => Ok(layout),
            None => self.result_segments(wafer, i as u32, segments, requests),
        }
    }

    /// The instruction whose segments vector op `i` would run in place on: its newest tensor
    /// operand (a slice of a value only where `host_slices` allows).
    pub(super) fn host_operand(&self, i: usize) -> Option<usize> {
        self.module.body[waferc_ir::Handle::new(i)]
            .op
            .operands()
            .into_iter()
            .filter(|v| matches!(self.module.body[*v].ty, ValueType::Tensor(_)))
            .max_by_key(|v| self.rank[v.index()])
            .filter(|v| self.host_slices || self.analysis.offset[v.index()] == 0)
            .map(|v| if self.host_slices { v.index() } else { self.analysis.source[v.index()] as usize })
    }

    /// A vector op's result on its newest operand's segments (see [`Placer::vector_layout`]), if
    /// their cut suits the op, they lie where `allowed` says and SRAM has room; the regions are
    /// added to those PEs.
    pub(super) fn host_layout(
        &mut self,
        i: usize,
        allowed: &dyn Fn(Pe) -> bool,
        len: u64,
        requests: &dyn Fn(&Range<u64>) -> Vec<Request>,
    ) -> Option<VectorLayout> {
        let ir = &self.module.body[waferc_ir::Handle::new(i)];
        let host = self.host_operand(i);
        if let Some(ResultLayout::Vector(host)) = host.map(|h| &self.placements[h].result) {
            let host = host.clone();
            if host.len() == len
                && suits(&ir.op, self.module, &host, len)
                && host.segments.iter().all(|s| allowed(s.pe))
            {
                let plan: Vec<(Pe, Range<u64>, Vec<Request>)> = host
                    .segments
                    .iter()
                    .map(|seg| {
                        let mut wanted = vec![(
                            RegionKind::Output { elements: seg.elements.clone() },
                            (seg.elements.end - seg.elements.start) * F32,
                        )];
                        wanted.extend(requests(&seg.elements).into_iter().filter(|(kind, _)| match kind {
                            RegionKind::Operand { value, elements } => !self.holds(seg.pe, *value as usize, elements),
                            _ => true,
                        }));
                        (seg.pe, seg.elements.clone(), wanted)
                    })
                    .collect();
                let (top, completion) = (self.params.sram_bytes_per_pe as u64, &self.analysis.completion);
                // Per host segment: its PE, its elements and the regions it gains.
                type Hosted = (Pe, Range<u64>, Vec<Region>);
                // Segments sharing a PE (a rope's pairs: `suits`) each see the regions the ones
                // before them gain there.
                let mut gained: HashMap<Pe, Vec<Region>> = HashMap::default();
                let placed: Option<Vec<Hosted>> = plan
                    .into_iter()
                    .map(|(pe, elements, wanted)| {
                        let image = &self.images[self.image_of.get(pe).expect("a host segment's PE has an image")];
                        let mut regions = image.regions.clone();
                        let earlier = gained.entry(pe).or_default();
                        regions.extend(earlier.iter().cloned());
                        let first = regions.len();
                        let mut clashes = Vec::new();
                        for (kind, bytes) in wanted {
                            let mut region = Region { offset: 0, bytes: bytes as u32, instr: Some(i as u32), kind };
                            region.offset = region_offset(&regions, &region, top, completion, &mut clashes)? as u32;
                            regions.push(region);
                        }
                        let new = regions.split_off(first);
                        earlier.extend(new.iter().cloned());
                        Some((pe, elements, new))
                    })
                    .collect();
                if let Some(placed) = placed {
                    let mut layout = VectorLayout::default();
                    for (pe, elements, regions) in placed {
                        let image = &mut self.images[self.image_of.get(pe).expect("a host segment's PE has an image")];
                        make_room(&mut image.regions, regions.len());
                        image.regions.extend(regions);
                        layout.segments.push(Segment { pe, elements });
                    }
                    return Some(layout);
                }
            }
        }
        None
    }

    /// SRAM bytes `pe`'s regions cover so far (0 for a PE with no image yet).
    pub(super) fn used_bytes(&self, pe: Pe) -> u64 {
        self.image_of.get(pe).map_or(0, |i| covered_bytes(&self.images[i].regions))
    }

    /// Whether `pe` holds `elements` of value `value`'s data (its source's result).
    /// A `slice`'s layout: the parts of its source's segments it covers, numbered from its start
    /// (every plan places a slice this way: no PEs, no data moved).
    pub(super) fn slice_layout(&self, i: usize, len: u64) -> Result<ResultLayout, WaferError> {
        let source = self.analysis.source[i] as usize;
        let start = self.analysis.offset[i];
        let ResultLayout::Vector(whole) = &self.placements[source].result else {
            return Err(self.unsupported(i, "internal: a slice of a routing".into()));
        };
        let segments = whole
            .overlapping(start..start + len)
            .map(|(seg, part)| Segment { pe: seg.pe, elements: part.start - start..part.end - start })
            .collect();
        Ok(ResultLayout::Vector(VectorLayout { segments }))
    }

    fn holds(&self, pe: Pe, value: usize, elements: &Range<u64>) -> bool {
        let source = self.analysis.source[value] as usize;
        let shift = self.analysis.offset[value];
        let elements = &(elements.start + shift..elements.end + shift);
        match &self.placements[source].result {
            ResultLayout::Vector(l) => l
                .segments
                .iter()
                .any(|s| s.pe == pe && s.elements.start <= elements.start && elements.end <= s.elements.end),
            ResultLayout::Routing { .. } => false,
        }
    }

    fn result_segments(
        &mut self,
        wafer: u16,
        instr: u32,
        segments: &[Range<u64>],
        extra: impl Fn(&Range<u64>) -> Vec<Request>,
    ) -> Result<VectorLayout, WaferError> {
        let mut layout = VectorLayout::default();
        for seg in segments {
            layout.segments.push(self.segment_pe(wafer, instr, seg, extra(seg))?);
        }
        Ok(layout)
    }

    /// The next PE, holding result segment `seg` (and `extra` regions).
    fn segment_pe(
        &mut self,
        wafer: u16,
        instr: u32,
        seg: &Range<u64>,
        extra: Vec<Request>,
    ) -> Result<Segment, WaferError> {
        let pe = self.take(wafer, 1)?[0];
        let mut requests = vec![(RegionKind::Output { elements: seg.clone() }, (seg.end - seg.start) * F32)];
        requests.extend(extra);
        self.fill(pe, instr, requests)?;
        Ok(Segment { pe, elements: seg.clone() })
    }

    fn unsupported(&self, instr: usize, message: String) -> WaferError {
        unsupported(self.module, instr, message)
    }

    fn place_instr(&mut self, i: usize, shape: &Shape, wafer: u16) -> Result<InstrPlacement, WaferError> {
        let module = self.module;
        let ir = &module.body[waferc_ir::Handle::new(i)];
        let instr = i as u32;
        let operand_regions = |seg: &Range<u64>| operand_requests(module, i, seg);
        let (result, work) = match (&ir.op, shape) {
            (Op::Embed { table }, Shape::Embed { segments, rows_per_block }) => {
                let w = &module.weights[*table];
                let rows = w.ty.shape[0];
                let mut blocks = Vec::new();
                let mut layout = VectorLayout::default();
                // Each segment's PE follows its table blocks, so its gather stays local.
                for (seg, per) in segments.iter().zip(rows_per_block) {
                    let width = seg.end - seg.start;
                    let row_bytes = w.ty.dtype.row_bytes(width).expect("sizing checked the cut");
                    let count = rows.div_ceil(*per);
                    for (b, pe) in (0..count).zip(self.take(wafer, count)?) {
                        let block_rows = b * per..((b + 1) * per).min(rows);
                        self.fill(pe, instr, embed_block_requests(*table, &block_rows, seg, row_bytes))?;
                        blocks.push(EmbedBlock { pe, rows: block_rows, elements: seg.clone() });
                    }
                    layout.segments.push(self.segment_pe(wafer, instr, seg, Vec::new())?);
                }
                (ResultLayout::Vector(layout), Work::Embed { blocks, collects: Vec::new() })
            }
            (
                Op::MatVec { weight, bias, .. },
                Shape::MatVec { rows_per_tile, chunks_per_tile, row_blocks, col_blocks, segments },
            ) => {
                let w = &module.weights[*weight];
                let (rows, cols) = (w.ty.shape[0], w.ty.shape[1]);
                let (r_count, c_count) = (*row_blocks as u64, *col_blocks as u64);
                // Each result segment's PE comes right after the stripe holding the last tile
                // row it collects from, so collects stay local. A grid shorter than a shelf is
                // packed into cells instead, tile column by tile column (tile (r, c) at cell
                // base + c * R + r).
                let shelf = self.cells.shelf;
                let packed = if r_count < shelf { Some(self.take(wafer, r_count * c_count)?) } else { None };
                let mut layout = VectorLayout::default();
                let width_of = |c: u64| (c * chunks_per_tile * CHUNK)..((c + 1) * chunks_per_tile * CHUNK).min(cols);
                let mut tiles: Vec<Tile> = Vec::with_capacity((r_count * c_count) as usize);
                for r in 0..r_count {
                    let tile_rows = r * rows_per_tile..((r + 1) * rows_per_tile).min(rows);
                    let row_start = if packed.is_some() {
                        Pe::new(wafer, 0, 0)
                    } else if r % shelf == 0 {
                        self.stripe(wafer, c_count)?
                    } else {
                        let top = tiles[((r - r % shelf) * c_count) as usize].pe;
                        Pe::new(wafer, top.x, top.y + (r % shelf) as u16)
                    };
                    for c in 0..c_count {
                        let pe = match &packed {
                            Some(cells) => cells[(c * r_count + r) as usize],
                            None => Pe::new(wafer, row_start.x + c as u16, row_start.y),
                        };
                        let tile_cols = width_of(c);
                        let requests = tile_requests(module, i, tile_rows.clone(), tile_cols.clone(), c == 0)?;
                        let region = self.fill(pe, instr, requests)?[0];
                        tiles.push(Tile {
                            pe,
                            rows: narrow(tile_rows.clone()),
                            chunks: narrow(tile_cols.start / CHUNK..tile_cols.end.div_ceil(CHUNK)),
                            region,
                        });
                    }
                    // Beside the tile row that completes it: the collect stays short, and
                    // segments sit on different rows, so their deliveries do not share one.
                    let row = (tiles.last().expect("a row was placed").pe.y as u64) % shelf;
                    while let Some(seg) = segments.get(layout.segments.len()).filter(|s| s.end <= tile_rows.end) {
                        let cell = self.cells.take_at_row(wafer, row).ok_or_else(|| self.full(wafer, 1))?;
                        let pe = self.cells.pe(wafer, cell);
                        let requests =
                            vec![(RegionKind::Output { elements: seg.clone() }, (seg.end - seg.start) * F32)];
                        self.fill(pe, instr, requests)?;
                        layout.segments.push(Segment { pe, elements: seg.clone() });
                    }
                }
                let placement = MatVecPlacement::unrouted(
                    rows,
                    cols,
                    *row_blocks,
                    *col_blocks,
                    tiles,
                    bias.map(|b| b.index() as u32),
                );
                (ResultLayout::Vector(layout), Work::MatVec(placement))
            }
            (Op::RmsNorm { weight, .. }, Shape::Vector { segments }) => {
                let w = &module.weights[*weight];
                let g = w.ty.shape[0];
                let len = segments.last().map_or(0, |s| s.end);
                let layout = self.vector_layout(i, wafer, segments, |seg| norm_requests(module, i, seg, len))?;
                (ResultLayout::Vector(layout), Work::RmsNorm(NormPlacement { group_len: g, group_routes: Vec::new() }))
            }
            (Op::ExpertCombine { routing, .. }, Shape::Vector { segments }) => {
                let top_k = match module.body[*routing].ty {
                    ValueType::Routing { top_k, .. } => top_k as u64,
                    _ => 0,
                };
                let layout = self.result_segments(wafer, instr, segments, |seg| {
                    vec![(RegionKind::Scratch, top_k * (seg.end - seg.start) * F32 + top_k * 8)]
                })?;
                (ResultLayout::Vector(layout), Work::Combine { routing: 0, collects: Vec::new() })
            }
            (
                Op::Rope { .. } | Op::Silu { .. } | Op::Mul { .. } | Op::Add { .. } | Op::SwiGlu { .. },
                Shape::Vector { segments },
            ) => {
                let layout = self.vector_layout(i, wafer, segments, operand_regions)?;
                (ResultLayout::Vector(layout), Work::Elementwise)
            }
            (
                Op::Attention { cache, heads, window, .. },
                Shape::Attention { positions_per_block, blocks_per_head, segments },
            ) => {
                let c = &module.caches[*cache];
                let (kv_heads, head_dim) = (c.kv_heads, c.head_dim);
                // A windowed cache keeps only the window's rows.
                let rows = window.map_or(self.options.max_context as u64, u64::from);
                let per = *positions_per_block as u64;
                let sequences = self.options.max_sequences;
                let mut placed = Vec::with_capacity(sequences as usize * kv_heads as usize);
                // Each sequence in flight gets blocks of its own.
                for sequence in 0..sequences {
                    for h in 0..kv_heads as u64 {
                        let mut blocks = Vec::with_capacity(*blocks_per_head as usize);
                        for (b, pe) in (0..*blocks_per_head as u64).zip(self.take(wafer, *blocks_per_head as u64)?) {
                            let positions = (b * per) as u32..((b + 1) * per).min(rows) as u32;
                            let block = KvBlockShape {
                                kv_head: h,
                                query_heads: 0..*heads / kv_heads,
                                positions: positions.clone(),
                                lanes: Lanes::ALL,
                                dims: 0..head_dim,
                            };
                            let region = self.fill(pe, instr, kv_block_requests(module, i, &block))?[0];
                            blocks.push(KvBlock { pe, positions, lanes: Lanes::ALL, region });
                        }
                        let whole = 0..head_dim;
                        placed.push(KvHeadPlacement::unrouted(h as u32, sequence, 0..*heads / kv_heads, whole, blocks));
                    }
                }
                let layout = self.result_segments(wafer, instr, segments, |_| Vec::new())?;
                let placement = AttentionPlacement {
                    heads: *heads,
                    kv_heads,
                    head_dim: c.head_dim,
                    kv_heads_placed: placed,
                    collects: Vec::new(),
                };
                (ResultLayout::Vector(layout), Work::Attention(placement))
            }
            (Op::RouterTopK { logits, top_k, .. }, Shape::Router) => {
                let experts = match &module.body[*logits].ty {
                    ValueType::Tensor(t) => t.elements(),
                    ValueType::Routing { .. } => 0,
                };
                let pe = self.take(wafer, 1)?[0];
                let requests = vec![
                    (RegionKind::Operand { value: logits.index() as u32, elements: 0..experts }, experts * F32),
                    (RegionKind::Output { elements: 0..*top_k as u64 }, *top_k as u64 * 8),
                ];
                self.fill(pe, instr, requests)?;
                (ResultLayout::Routing { pe }, Work::Router { routing: 0 })
            }
            (Op::ExpertDispatch { .. }, Shape::Alias) => {
                let source = self.analysis.source[i] as usize;
                (self.placements[source].result.clone(), Work::Dispatch { routing: 0 })
            }
            (Op::Slice { len, .. }, Shape::Alias) => (self.slice_layout(i, *len as u64)?, Work::Slice),
            (op, shape) => {
                return Err(self.unsupported(i, format!("internal: {} was sized as {shape:?}", op.name())));
            }
        };
        Ok(InstrPlacement {
            instr,
            op: ir.op.name().to_string(),
            layer: ir.layer,
            expert: self.analysis.expert[i],
            result,
            operand_routes: Vec::new(),
            deliveries: Vec::new(),
            work,
        })
    }

    fn add_route(
        &mut self,
        instr: usize,
        kind: RouteKind,
        mut sources: Vec<Pe>,
        mut destinations: Vec<Pe>,
        path: Vec<Vec<Run>>,
        message_bytes: u64,
    ) -> RouteId {
        let id = self.routes.len() as RouteId;
        // Lists built by extending grow by doubling; a stacked program holds hundreds of
        // thousands of routes with millions of destinations, so each keeps its exact length.
        sources.shrink_to_fit();
        // Sorted, so the executor tests membership in place rather than in a sorted copy.
        destinations.sort_unstable();
        destinations.shrink_to_fit();
        let mut path: Vec<Run> = path.into_iter().flatten().collect();
        path.shrink_to_fit();
        self.routes.push(Route {
            id,
            instr: instr as u32,
            kind,
            colour: 0,
            sources,
            destinations,
            path,
            message_bytes: message_bytes as u32,
        });
        id
    }

    fn reduce_route(&mut self, instr: usize, op: ReduceOp, elements: u64, leaves: Vec<Pe>, destination: Pe) -> RouteId {
        let path = route::reduction(&leaves, destination);
        self.add_route(
            instr,
            RouteKind::Reduce { op, elements: elements as u32 },
            leaves,
            vec![destination],
            vec![path],
            elements * F32,
        )
    }

    fn statistic_route(&mut self, instr: usize, elements: u64, source: Pe, destinations: Vec<Pe>) -> RouteId {
        let path = route::multicast(source, &destinations, self.route_band, None);
        self.add_route(
            instr,
            RouteKind::Statistic { elements: elements as u32 },
            vec![source],
            destinations,
            vec![path],
            elements * F32,
        )
    }

    /// `Collect` routes into each of `layout`'s segments from `pieces` (a PE and the elements it
    /// holds), pieces in order. A PE that alone feeds several segments on its wafer (a KV head's
    /// root holding its query heads' outputs) spreads them over its out-links: each goes along
    /// its column first, or along its row first when that leaves by a link it has used less,
    /// rather than every one leaving by the one or two links toward the nearest rows.
    fn collect_routes(&mut self, instr: usize, layout: &VectorLayout, pieces: &[(Pe, Range<u64>)]) -> Vec<RouteId> {
        let mut ids = Vec::with_capacity(layout.segments.len());
        let mut sent: HashMap<(Pe, route::Direction), u32> = HashMap::default();
        for seg in &layout.segments {
            // Each source sends one message, its pieces of the segment in order (a KV head's slice
            // holds its dims of each query head: several pieces).
            let mut sources: Vec<Pe> = Vec::new();
            let mut sent_by: Vec<u64> = Vec::new();
            for (pe, elements) in pieces {
                let overlap = elements.start.max(seg.elements.start)..elements.end.min(seg.elements.end);
                if overlap.start < overlap.end {
                    let at = match sources.iter().rposition(|s| s == pe) {
                        Some(at) => at,
                        None => {
                            sources.push(*pe);
                            sent_by.push(0);
                            sources.len() - 1
                        }
                    };
                    sent_by[at] += overlap.end - overlap.start;
                }
            }
            let largest = sent_by.iter().copied().max().unwrap_or(0);
            let path = match sources.as_slice() {
                [only] if only.wafer == seg.pe.wafer && only.y / self.route_band == seg.pe.y / self.route_band => {
                    let load = |rows_first| {
                        route::first_link(*only, seg.pe, rows_first)
                            .map(|d| (d, sent.get(&(*only, d)).copied().unwrap_or(0)))
                    };
                    let rows_first = match (load(false), load(true)) {
                        (Some((_, column)), Some((_, row))) => row < column,
                        _ => false,
                    };
                    if let Some((d, _)) = load(rows_first) {
                        *sent.entry((*only, d)).or_default() += 1;
                    }
                    route::single_source(*only, seg.pe, rows_first)
                }
                _ => route::gather(&sources, seg.pe, self.route_band),
            };
            ids.push(self.add_route(
                instr,
                RouteKind::Collect { elements: seg.elements.clone() },
                sources,
                vec![seg.pe],
                vec![path],
                largest * F32,
            ));
        }
        ids
    }

    /// The instruction's own routes: reductions, broadcasts, collects, the routing.
    fn route_instr(&mut self, i: usize) -> Result<(), WaferError> {
        let layout = match &self.placements[i].result {
            ResultLayout::Vector(layout) => layout.clone(),
            ResultLayout::Routing { .. } => VectorLayout::default(),
        };
        let mut work = std::mem::replace(&mut self.placements[i].work, Work::Elementwise);
        match &mut work {
            Work::Embed { blocks, collects } => {
                let pieces: Vec<(Pe, Range<u64>)> = blocks.iter().map(|b| (b.pe, b.elements.clone())).collect();
                *collects = self.collect_routes(i, &layout, &pieces);
            }
            Work::MatVec(mv) => self.matvec_routes(i, mv, &layout),
            Work::RmsNorm(norm) => {
                let g = norm.group_len;
                let groups = layout.len().div_ceil(g);
                for group in 0..groups {
                    let members: Vec<Pe> =
                        layout.overlapping(group * g..(group + 1) * g).map(|(seg, _)| seg.pe).collect();
                    if members.len() > 1 {
                        // The statistic goes back to every member, so the tree ends on the most
                        // central one: the broadcast's reach and the tree's last edges halve.
                        let root = central(&members);
                        let reduce = self.reduce_route(i, ReduceOp::Sum, 1, members.clone(), root);
                        let others = members.iter().copied().filter(|&pe| pe != root).collect();
                        let broadcast = self.statistic_route(i, 1, root, others);
                        norm.group_routes.push(GroupRoutes { group, reduce, broadcast });
                    }
                }
            }
            Work::Attention(att) => {
                let group = (att.heads / att.kv_heads) as u64;
                let hd = att.head_dim as u64;
                let mut pieces = Vec::new();
                for head in &mut att.kv_heads_placed {
                    let blocks: Vec<Pe> = head.blocks.iter().map(|b| b.pe).collect();
                    let root = blocks[0];
                    let queries = head.query_count();
                    let dims = (head.dims.end - head.dims.start) as u64;
                    if blocks.len() > 1 {
                        head.max_reduce = Some(self.reduce_route(i, ReduceOp::Max, queries, blocks.clone(), root));
                        head.max_broadcast = Some(self.statistic_route(i, queries, root, blocks[1..].to_vec()));
                        head.sum_reduce = Some(self.reduce_route(i, ReduceOp::Sum, queries, blocks.clone(), root));
                        head.sum_broadcast = Some(self.statistic_route(i, queries, root, blocks[1..].to_vec()));
                        head.out_reduce = Some(self.reduce_route(i, ReduceOp::Sum, queries * dims, blocks, root));
                    }
                    pieces.extend(head.query_pieces(group, hd).map(|piece| (root, piece)));
                }
                self.score_routes(i, &mut att.kv_heads_placed);
                pieces.sort_by_key(|(_, piece)| piece.start);
                att.collects = self.collect_routes(i, &layout, &pieces);
            }
            Work::Router { routing } => {
                let ResultLayout::Routing { pe } = self.placements[i].result else {
                    return Err(self.unsupported(i, "internal: router without a routing layout".into()));
                };
                let mut destinations = Vec::new();
                for (j, placement) in self.placements.iter().enumerate() {
                    if j != i && self.analysis.router[j] == Some(i as u32) {
                        destinations.extend(placement_pes(placement));
                    }
                }
                destinations.sort_unstable();
                destinations.dedup();
                let top_k = match self.module.body[waferc_ir::Handle::new(i)].ty {
                    ValueType::Routing { top_k, .. } => top_k as u64,
                    _ => 0,
                };
                let path = route::multicast(pe, &destinations, self.route_band, None);
                *routing = self.add_route(i, RouteKind::Routing, vec![pe], destinations, vec![path], top_k * 8);
            }
            Work::Dispatch { routing } | Work::Combine { routing, .. } => {
                let router = self.analysis.router[i].expect("dispatch and combine read a routing") as usize;
                let Work::Router { routing: id } = self.placements[router].work else {
                    return Err(self.unsupported(i, format!("internal: %{router} is not a placed router")));
                };
                *routing = id;
            }
            Work::Elementwise | Work::Slice => {}
        }
        if let (Work::Combine { collects, .. }, Op::ExpertCombine { experts, .. }) =
            (&mut work, &self.module.body[waferc_ir::Handle::new(i)].op)
        {
            let mut pieces = Vec::new();
            let slots = replica_slots_in(&self.replicas, self.placements.len());
            for e in experts {
                let source = self.analysis.source[e.index()] as usize;
                if let ResultLayout::Vector(l) = &self.placements[source].result {
                    pieces.extend(l.segments.iter().map(|s| (s.pe, s.elements.clone())));
                }
                // Every copy of the expert sends its output on the same gather.
                for (r, c, m) in self.copies_of(&slots, source) {
                    if let ResultLayout::Vector(l) = &self.replicas[r].copies[c][m].result {
                        pieces.extend(l.segments.iter().map(|s| (s.pe, s.elements.clone())));
                    }
                }
            }
            // Per segment, sources in expert order (the collect route lists each once).
            *collects = self.collect_routes(i, &layout, &pieces);
        }
        self.placements[i].work = work;
        Ok(())
    }

    fn matvec_routes(&mut self, i: usize, mv: &mut MatVecPlacement, layout: &VectorLayout) {
        let c_count = mv.col_blocks as usize;
        let row_pes = |mv: &MatVecPlacement, r: usize| -> Vec<Pe> {
            mv.tiles[r * c_count..(r + 1) * c_count].iter().map(|t| t.pe).collect()
        };
        let rows_of =
            |mv: &MatVecPlacement, r: usize| (mv.tiles[r * c_count].rows.end - mv.tiles[r * c_count].rows.start) as u64;
        // Per row block, the PE its reduced rows end on (its reduction's destination).
        let mut roots: Vec<Pe> = Vec::with_capacity(mv.row_blocks as usize);
        match self.options.plan {
            Plan::Tiled | Plan::Stacked { .. } => {
                for r in 0..mv.row_blocks as usize {
                    let leaves = row_pes(mv, r);
                    // The row block's total goes to the segments holding its rows: the tree ends
                    // on the tile nearest them, so the collect after it is short. A biased
                    // matvec's total ends on the first tile, which holds the bias slice.
                    let root = match mv.bias {
                        Some(_) => leaves[0],
                        None => {
                            let rows = &mv.tiles[r * c_count].rows;
                            let targets: Vec<Pe> = layout.overlapping(wide(rows)).map(|(seg, _)| seg.pe).collect();
                            nearest(&leaves, &targets)
                        }
                    };
                    roots.push(root);
                    if leaves.len() > 1 {
                        let id = self.reduce_route(i, ReduceOp::Sum, rows_of(mv, r), leaves, root);
                        mv.reductions.push(id);
                    }
                }
            }
            Plan::MeshGemv { group_num, .. } => {
                roots.extend((0..mv.row_blocks as usize).map(|r| mv.tiles[r * c_count].pe));
                let group = c_count.div_ceil(group_num as usize).next_power_of_two();
                for r in 0..mv.row_blocks as usize {
                    let leaves = row_pes(mv, r);
                    for chunk in leaves.chunks(group).filter(|c| c.len() > 1) {
                        let id = self.reduce_route(i, ReduceOp::Sum, rows_of(mv, r), chunk.to_vec(), chunk[0]);
                        mv.reductions.push(id);
                    }
                }
                for r in 0..mv.row_blocks as usize {
                    let leaves = row_pes(mv, r);
                    let leaders: Vec<Pe> = leaves.iter().step_by(group).copied().collect();
                    if leaders.len() > 1 {
                        let id = self.reduce_route(i, ReduceOp::Sum, rows_of(mv, r), leaders.clone(), leaders[0]);
                        mv.reductions.push(id);
                    }
                    if leaves.len() > 1 {
                        let id = self.statistic_route(i, rows_of(mv, r), leaves[0], leaves[1..].to_vec());
                        mv.broadcasts.push(id);
                    }
                }
            }
        }
        let pieces: Vec<(Pe, Range<u64>)> =
            roots.into_iter().enumerate().map(|(r, pe)| (pe, wide(&mv.tiles[r * c_count].rows))).collect();
        mv.collects = self.collect_routes(i, layout, &pieces);
    }

    /// The score sums of attention `i`'s KV heads held in slices of the head dimension: per
    /// head, copy and sequence in several slices, per block, a sum of the slices' partial scores
    /// (block `b` of each, in dims order) ending on the first slice's block, and a broadcast of
    /// the sums back to the others, on the first slice's placement
    /// ([`KvHeadPlacement::score_reduce`]). A message holds the block's scores for its query heads
    /// at each of its positions.
    fn score_routes(&mut self, i: usize, heads: &mut [KvHeadPlacement]) {
        for slices in heads.chunk_by_mut(KvHeadPlacement::same_head).filter(|slices| slices.len() > 1) {
            let queries = slices[0].query_count();
            let (mut reduces, mut broadcasts) = (Vec::new(), Vec::new());
            for b in 0..slices[0].blocks.len() {
                let pes: Vec<Pe> = slices.iter().map(|h| h.blocks[b].pe).collect();
                let positions = &slices[0].blocks[b].positions;
                let scores = queries * (positions.end - positions.start) as u64;
                reduces.push(self.reduce_route(i, ReduceOp::Sum, scores, pes.clone(), pes[0]));
                broadcasts.push(self.statistic_route(i, scores, pes[0], pes[1..].to_vec()));
            }
            slices[0].score_reduce = reduces;
            slices[0].score_broadcast = broadcasts;
        }
    }

    /// One multicast of `elements` (inside `seg`) of value `value` to `destinations` (sorted,
    /// deduplicated, the segment's own PE left out), crossing to other wafers on row `crossing`
    /// when given (`route::multicast`); `None` when no destination is left.
    fn operand_multicast(
        &mut self,
        value: usize,
        seg: &Segment,
        elements: Range<u64>,
        mut destinations: Vec<Pe>,
        crossing: Option<u16>,
    ) -> Option<RouteId> {
        destinations.sort_unstable();
        destinations.dedup();
        destinations.retain(|d| *d != seg.pe);
        if destinations.is_empty() {
            return None;
        }
        let path = route::multicast(seg.pe, &destinations, self.route_band, crossing);
        let bytes = (elements.end - elements.start) * F32;
        Some(self.add_route(
            value,
            RouteKind::Operand { value: value as u32, elements },
            vec![seg.pe],
            destinations,
            vec![path],
            bytes,
        ))
    }

    /// The deliveries of instruction `i`'s result: per segment, one multicast to every PE of every
    /// reader that needs part of it; except that a PE whose vector readers need at least
    /// [`GATHER_MIN_SEGMENTS`] segments gets them on one gather per run of consecutive segments
    /// (a multicast each would take as many colours at that PE).
    fn deliver(&mut self, i: usize) {
        if self.analysis.source[i] as usize != i {
            return;
        }
        let ResultLayout::Vector(layout) = self.placements[i].result.clone() else {
            return;
        };
        let readers = self.analysis.readers[i].clone();
        // Per segment: each reader's PEs that need part of it, and the attention heads reached.
        let mut reads: Vec<Vec<SegmentReader>> = Vec::new();
        for seg in &layout.segments {
            let mut per_reader = Vec::new();
            for &reader in &readers {
                let reader = reader as usize;
                let (mut pes, mut heads, mut parts) = (Vec::new(), Vec::new(), Vec::new());
                let placement = &self.placements[reader];
                self.reader_pes(i, reader, placement, &seg.elements, &mut pes, &mut heads);
                self.sliced_reader_pes(i, reader, placement, &seg.elements, &mut parts);
                if !pes.is_empty() || !parts.is_empty() {
                    per_reader.push(SegmentReader { reader, pes, heads, parts });
                }
            }
            reads.push(per_reader);
        }
        let gathers = self.gathers(&layout, &reads);
        let gathered: HashSet<(usize, Pe)> =
            gathers.iter().flat_map(|(d, run)| run.clone().map(move |k| (k, *d))).collect();
        let crossing = crossing_rows(&layout, self.params.grid_rows);
        for (k, seg) in layout.segments.iter().enumerate() {
            let mut destinations = Vec::new();
            let mut reached: Vec<Reached> = Vec::new();
            // Per part of the segment that only some readers' PEs need (a KV head's slice of a
            // head dimension): those PEs and the heads reached.
            let mut by_part: BTreeMap<(u64, u64), (Vec<Pe>, Vec<Reached>)> = BTreeMap::new();
            for SegmentReader { reader, pes, heads, parts } in &reads[k] {
                let vector = gathers_operands(&self.placements[*reader]);
                let before = destinations.len();
                destinations.extend(pes.iter().filter(|&&pe| !(vector && gathered.contains(&(k, pe)))));
                if destinations.len() > before {
                    reached.push((*reader, None));
                }
                reached.extend(heads);
                for SlicedRead { elements, pes, head, role } in parts {
                    let (to, heads) = by_part.entry((elements.start, elements.end)).or_default();
                    to.extend(pes);
                    if !heads.contains(&(*reader, None)) {
                        heads.push((*reader, None));
                    }
                    heads.push((*reader, Some((*head, *role))));
                }
            }
            let whole = (seg.elements.clone(), destinations, reached);
            let parts = by_part.into_iter().map(|((start, end), (to, heads))| (start..end, to, heads));
            for (elements, destinations, reached) in std::iter::once(whole).chain(parts) {
                let Some(id) = self.operand_multicast(i, seg, elements, destinations, Some(crossing[k])) else {
                    continue;
                };
                self.placements[i].deliveries.push(id);
                for (reader, head_role) in reached {
                    match head_role {
                        None => push_unique(&mut self.placements[reader].operand_routes, id),
                        Some((head, role)) => {
                            if let Work::Attention(att) = &mut self.placements[reader].work {
                                let h = &mut att.kv_heads_placed[head];
                                let list = [&mut h.q_routes, &mut h.k_routes, &mut h.v_routes];
                                push_unique(list.into_iter().nth(role).expect("three roles"), id);
                            }
                        }
                    }
                }
            }
        }
        for (destination, run) in gathers {
            let segments = &layout.segments[run.clone()];
            let sources: Vec<Pe> = segments.iter().map(|s| s.pe).collect();
            let largest = segments.iter().map(|s| s.elements.end - s.elements.start).max().unwrap_or(0);
            let elements = segments[0].elements.start..segments[segments.len() - 1].elements.end;
            let path = route::gather(&sources, destination, self.route_band);
            let id = self.add_route(
                i,
                RouteKind::Gather { value: i as u32, elements },
                sources,
                vec![destination],
                vec![path],
                largest * F32,
            );
            self.placements[i].deliveries.push(id);
            let mut listed: Vec<usize> = Vec::new();
            for k in run {
                for SegmentReader { reader, pes, .. } in &reads[k] {
                    let reads_here = gathers_operands(&self.placements[*reader]) && pes.contains(&destination);
                    if reads_here && !listed.contains(reader) {
                        listed.push(*reader);
                    }
                }
            }
            for reader in listed {
                push_unique(&mut self.placements[reader].operand_routes, id);
            }
        }
    }

    /// The gathers of a value laid out as `layout`, whose segments' readers reach the PEs `reads`
    /// lists (see [`Placer::deliver`]): per PE whose vector readers need at least
    /// [`GATHER_MIN_SEGMENTS`] segments held elsewhere, the runs of consecutive such segments
    /// on distinct PEs (a route takes one message per source), two segments or more each.
    fn gathers(&self, layout: &VectorLayout, reads: &[Vec<SegmentReader>]) -> Vec<(Pe, Range<usize>)> {
        let mut needs: BTreeMap<Pe, Vec<usize>> = BTreeMap::new();
        for (k, per_reader) in reads.iter().enumerate() {
            for SegmentReader { reader, pes, .. } in per_reader {
                if !gathers_operands(&self.placements[*reader]) {
                    continue;
                }
                for &pe in pes.iter().filter(|&&pe| pe != layout.segments[k].pe) {
                    let list = needs.entry(pe).or_default();
                    if list.last() != Some(&k) {
                        list.push(k);
                    }
                }
            }
        }
        let mut gathers = Vec::new();
        // Each list is in segment order, once each: segments are visited in order.
        for (pe, list) in needs {
            if list.len() < GATHER_MIN_SEGMENTS {
                continue;
            }
            let mut start = 0;
            for end in 1..=list.len() {
                let joins = end < list.len()
                    && list[end] == list[end - 1] + 1
                    && layout.segments[list[end - 1]].elements.end == layout.segments[list[end]].elements.start
                    && !list[start..end].iter().any(|&k| layout.segments[k].pe == layout.segments[list[end]].pe);
                if !joins {
                    if end - start >= 2 {
                        gathers.push((pe, list[start]..list[end - 1] + 1));
                    }
                    start = end;
                }
            }
        }
        gathers
    }

    /// Appends the PEs of `reader` that need `elements` of value `value` (an operand, possibly
    /// through `expert_dispatch` or as a `slice` of it).
    #[allow(clippy::too_many_arguments)]
    fn reader_pes(
        &self,
        value: usize,
        reader: usize,
        placement: &InstrPlacement,
        elements: &Range<u64>,
        out: &mut Vec<Pe>,
        reached: &mut Vec<(usize, Option<(usize, usize)>)>,
    ) {
        let overlaps = |r: &Range<u64>, part: &Range<u64>| r.start < part.end && part.start < r.end;
        // The part of `elements` that operand `v` reads, in `v`'s own element numbering.
        let part_of = |v: waferc_ir::Value| -> Option<Range<u64>> {
            if self.analysis.source[v.index()] as usize != value {
                return None;
            }
            let shift = self.analysis.offset[v.index()];
            let len = match &self.module.body[v].ty {
                ValueType::Tensor(t) => t.elements(),
                ValueType::Routing { .. } => 0,
            };
            let (start, end) = (elements.start.max(shift), elements.end.min(shift + len));
            (start < end).then(|| start - shift..end - shift)
        };
        let op = &self.module.body[waferc_ir::Handle::new(reader)].op;
        match (&placement.work, op) {
            (Work::MatVec(mv), Op::MatVec { x, .. }) => {
                let Some(part) = part_of(*x) else { return };
                let c_count = mv.col_blocks as usize;
                let cols_of = |t: &Tile| t.chunks.start as u64 * CHUNK..(t.chunks.end as u64 * CHUNK).min(mv.cols);
                for c in 0..c_count {
                    if overlaps(&cols_of(&mv.tiles[c]), &part) {
                        out.extend(mv.tiles.iter().skip(c).step_by(c_count).map(|t| t.pe));
                    }
                }
            }
            (Work::Attention(att), Op::Attention { q, k, v, .. }) => {
                let hd = att.head_dim as u64;
                let group = (att.heads / att.kv_heads) as u64;
                for (role, operand) in [q, k, v].into_iter().enumerate() {
                    let Some(part) = part_of(*operand) else { continue };
                    for (head, placed) in att.kv_heads_placed.iter().enumerate() {
                        // A slice's blocks need only their dims of each head: `sliced_reader_pes`.
                        if !placed.whole_dims(hd) {
                            continue;
                        }
                        let h = placed.kv_head as u64;
                        let range = if role == 0 { placed.query_elements(group, hd) } else { h * hd..(h + 1) * hd };
                        if overlaps(&range, &part) {
                            out.extend(placed.blocks.iter().map(|b| b.pe));
                            reached.push((reader, Some((head, role))));
                        }
                    }
                }
            }
            (Work::Combine { .. }, _) | (Work::Dispatch { .. }, _) | (Work::Slice, _) | (Work::Embed { .. }, _) => {}
            (_, op) => {
                for part in op.operands().into_iter().filter_map(part_of) {
                    match &placement.result {
                        ResultLayout::Routing { pe } => out.push(*pe),
                        ResultLayout::Vector(l) => {
                            out.extend(l.overlapping(part.clone()).map(|(s, _)| s.pe));
                            // A part of a head's half also reads its twin half a head away.
                            if let Op::Rope { head_dim, .. } = op {
                                let twin_reads = |s: &&Segment| {
                                    rope_twin(&s.elements, *head_dim as u64).is_some_and(|t| overlaps(&t, &part))
                                };
                                out.extend(l.segments.iter().filter(twin_reads).map(|s| s.pe));
                            }
                        }
                    }
                }
            }
        }
    }

    /// Appends, for the KV heads of attention `reader` held in slices of the head dimension, the
    /// part of `elements` of value `value` each slice's blocks read (in `value`'s numbering),
    /// with the blocks' PEs: its dims of each query head, of the key and of the value. Each part
    /// gets a multicast of its own, so a slice's blocks receive only their dims.
    fn sliced_reader_pes(
        &self,
        value: usize,
        reader: usize,
        placement: &InstrPlacement,
        elements: &Range<u64>,
        out: &mut Vec<SlicedRead>,
    ) {
        let (Work::Attention(att), Op::Attention { q, k, v, .. }) =
            (&placement.work, &self.module.body[waferc_ir::Handle::new(reader)].op)
        else {
            return;
        };
        let (hd, group) = (att.head_dim as u64, (att.heads / att.kv_heads) as u64);
        for (role, operand) in [q, k, v].into_iter().enumerate() {
            if self.analysis.source[operand.index()] as usize != value {
                continue;
            }
            let shift = self.analysis.offset[operand.index()];
            for (head, placed) in att.kv_heads_placed.iter().enumerate().filter(|(_, h)| !h.whole_dims(hd)) {
                let (h, dims) = (placed.kv_head as u64, wide(&placed.dims));
                // A query's dims in each query head served; a key's or value's in its KV head.
                let (heads, dims) = match role {
                    0 => (placed.query_range(group), query_delivery_dims(&dims, hd, placed.query_count())),
                    _ => (h..h + 1, dims),
                };
                let pieces = heads.map(|q| q * hd + dims.start..q * hd + dims.end);
                for piece in pieces {
                    let (start, end) = (elements.start.max(piece.start + shift), elements.end.min(piece.end + shift));
                    if start < end {
                        let pes = placed.blocks.iter().map(|b| b.pe).collect();
                        out.push(SlicedRead { elements: start..end, pes, head, role });
                    }
                }
            }
        }
    }

    /// One decode step's schedule: every instruction's steps in program order. A replicated
    /// expert's instruction has one step per phase for all its copies, listing every copy's
    /// routes (a token runs one copy, which sends on its own).
    fn schedule(&self) -> Vec<Step> {
        let slots = replica_slots_in(&self.replicas, self.placements.len());
        let mut steps = Vec::new();
        for (i, p) in self.placements.iter().enumerate() {
            let mut phases = steps_of(p);
            for (r, c, m) in self.copies_of(&slots, i) {
                for (phase, routes) in steps_of(&self.replicas[r].copies[c][m]) {
                    match phases.iter_mut().find(|(p, _)| *p == phase) {
                        Some((_, listed)) => listed.extend(routes),
                        None => phases.push((phase, routes)),
                    }
                }
            }
            let inputs: Vec<RouteId> =
                self.copy_inputs.iter().filter(|(instr, _)| *instr == i).map(|&(_, id)| id).collect();
            if !inputs.is_empty() {
                match phases.iter_mut().rev().find(|(p, _)| *p == Phase::Deliver) {
                    Some((_, listed)) => listed.extend(inputs),
                    None => phases.push((Phase::Deliver, inputs)),
                }
            }
            phases.sort_by_key(|(phase, _)| *phase);
            for (phase, routes) in &mut phases {
                // Reductions and broadcasts keep their order: a later one may wait for an
                // earlier one's total (a MeshGemv row reduce after its group reduces).
                if matches!(*phase, Phase::Deliver | Phase::Collect | Phase::Gather) {
                    route::order_in_waves(&self.routes, routes);
                }
            }
            steps.extend(phases.into_iter().map(|(phase, routes)| Step { instr: i as u32, phase, routes }));
        }
        steps
    }
}

/// The most query multicasts into one KV head's blocks when rope runs on pairs of chunks (the
/// stacked plan's `rope_pairs`): one per query head and source segment. Each enters every shelf
/// of the head's band along one row, so they all meet there (the 70B's 8 query heads a KV head
/// ran out of colours so). A head cut in slices has its own bound,
/// [`MAX_SLICED_QUERY_ROUTES`].
pub(super) const MAX_QUERY_ROUTES: u64 = 16;

/// The most query multicasts into one KV head's blocks when its cache is cut in slices: one per
/// query head and slice. When the query segments left from the top and bottom rows of the
/// head's band, the 70B's 8 query heads in 4 slices met 31 to a PE and ran out of colours, and
/// the bound was 16 (a multicast to each run of two slices). The stacked plan now spreads a
/// sliced head's query segments over rows of their own, above and below its blocks
/// (`KvShape::query_row`), so their multicasts meet only in the slices' columns, each column a
/// multicast per query head whatever the slices a multicast reaches; a multicast to two slices
/// carries its other slice's dims on every link of both columns (the 70B's
/// `stacked:5,100,slice4`: 64 elements a query head down each column, where each slice reads
/// 32).
pub(super) const MAX_SLICED_QUERY_ROUTES: u64 = 32;

/// The dims of each query head that reach a KV head slice holding `dims` of `head_dim`, serving
/// `queries` query heads: its own, or those of the run of adjacent slices it shares a multicast
/// with (the fewest slices a run that keeps the head's query multicasts to
/// [`MAX_SLICED_QUERY_ROUTES`]; each block then receives its run's dims and reads its own).
fn query_delivery_dims(dims: &Range<u64>, head_dim: u64, queries: u64) -> Range<u64> {
    let width = (dims.end - dims.start).max(1);
    let slices = head_dim / width;
    let mut run = 1;
    while run < slices && queries * (slices / run) > MAX_SLICED_QUERY_ROUTES {
        run *= 2;
    }
    let start = dims.start / (width * run) * (width * run);
    start..start + width * run
}

/// A reader a delivery reaches, and for an attention the KV head placement and operand role
/// (q, k, v) whose route list takes it.
type Reached = (usize, Option<(usize, usize)>);

/// One reader's PEs that need part of a segment (see [`Placer::deliver`]), with the attention
/// heads and q/k/v roles they serve.
struct SegmentReader {
    reader: usize,
    pes: Vec<Pe>,
    heads: Vec<Reached>,
    /// Parts of the segment only some of the reader's PEs need: [`Placer::sliced_reader_pes`].
    parts: Vec<SlicedRead>,
}

/// A part of a segment (`elements`, in its value's numbering) that the blocks of one KV head's
/// slice (`head`, its index in `kv_heads_placed`) read as operand `role` (q, k, v).
struct SlicedRead {
    elements: Range<u64>,
    pes: Vec<Pe>,
    head: usize,
    role: usize,
}

/// Whether `p`'s PEs that read a vector operand are its own result segments (an elementwise op,
/// a norm, a router): those may take their operand's segments on one gather.
fn gathers_operands(p: &InstrPlacement) -> bool {
    let reads_on_segments = !matches!(
        p.work,
        Work::MatVec(_)
            | Work::Attention(_)
            | Work::Combine { .. }
            | Work::Dispatch { .. }
            | Work::Slice
            | Work::Embed { .. }
    );
    reads_on_segments && matches!(p.result, ResultLayout::Vector(_))
}

/// The fewest segments of one value a PE's vector readers need from elsewhere before they come
/// on gathers rather than a multicast each: below it the multicasts cost few colours and each
/// still reaches every other reader of its segment.
const GATHER_MIN_SEGMENTS: usize = 3;

/// The steps of one placement, in phase order: each phase with the routes it sends on.
fn steps_of(p: &InstrPlacement) -> Vec<(Phase, Vec<RouteId>)> {
    let mut steps = Vec::new();
    let mut step = |phase: Phase, routes: Vec<RouteId>| steps.push((phase, routes));
    match &p.work {
        Work::Embed { collects, .. } => step(Phase::Gather, collects.clone()),
        Work::MatVec(mv) => {
            step(Phase::Compute, Vec::new());
            if !mv.reductions.is_empty() {
                step(Phase::Reduce, mv.reductions.clone());
            }
            if !mv.broadcasts.is_empty() {
                step(Phase::Broadcast, mv.broadcasts.clone());
            }
            step(Phase::Collect, mv.collects.clone());
        }
        Work::RmsNorm(norm) => {
            step(Phase::Compute, Vec::new());
            if !norm.group_routes.is_empty() {
                step(Phase::Reduce, norm.group_routes.iter().map(|g| g.reduce).collect());
                step(Phase::Broadcast, norm.group_routes.iter().map(|g| g.broadcast).collect());
            }
            step(Phase::Finish, Vec::new());
        }
        Work::Attention(att) => {
            step(Phase::Compute, Vec::new());
            let heads = &att.kv_heads_placed;
            let gather = |pick: &dyn Fn(&KvHeadPlacement) -> [Option<RouteId>; 2]| -> Vec<RouteId> {
                heads.iter().flat_map(pick).flatten().collect()
            };
            let scores: Vec<RouteId> = heads
                .iter()
                .flat_map(|h| h.score_reduce.iter().zip(&h.score_broadcast).flat_map(|(&r, &b)| [r, b]))
                .collect();
            if !scores.is_empty() {
                step(Phase::AttentionScore, scores);
            }
            step(Phase::AttentionMax, gather(&|h| [h.max_reduce, h.max_broadcast]));
            step(Phase::AttentionSum, gather(&|h| [h.sum_reduce, h.sum_broadcast]));
            step(Phase::AttentionOut, gather(&|h| [h.out_reduce, None]));
            step(Phase::Collect, att.collects.clone());
        }
        Work::Combine { collects, .. } => {
            step(Phase::Gather, collects.clone());
            step(Phase::Compute, Vec::new());
        }
        Work::Router { routing } => {
            step(Phase::Compute, Vec::new());
            step(Phase::Deliver, vec![*routing]);
        }
        Work::Elementwise | Work::Dispatch { .. } | Work::Slice => step(Phase::Compute, Vec::new()),
    }
    if !p.deliveries.is_empty() {
        step(Phase::Deliver, p.deliveries.clone());
    }
    steps
}

/// An elementwise op's operand buffers for result segment `seg`.
pub(super) fn operand_requests(module: &Module, i: usize, seg: &Range<u64>) -> Vec<Request> {
    let mut operands = module.body[waferc_ir::Handle::new(i)].op.operands();
    operands.dedup();
    operands
        .into_iter()
        .filter(|v| matches!(module.body[*v].ty, ValueType::Tensor(_)))
        .map(|v| (RegionKind::Operand { value: v.index() as u32, elements: seg.clone() }, (seg.end - seg.start) * F32))
        .collect()
}

/// A norm segment's regions: operands, the weight slice it scales by (the whole weight when
/// the segment holds whole groups, else the segment's part of its group) and its statistics.
pub(super) fn norm_requests(module: &Module, i: usize, seg: &Range<u64>, len: u64) -> Vec<Request> {
    let Op::RmsNorm { weight, .. } = &module.body[waferc_ir::Handle::new(i)].op else {
        return Vec::new();
    };
    let w = &module.weights[*weight];
    let g = w.ty.shape[0];
    let n = seg.end - seg.start;
    let cols = if g <= n && g < len { 0..g } else { seg.start % g..seg.start % g + n };
    let bytes = w.ty.dtype.row_bytes(cols.end - cols.start).unwrap_or((cols.end - cols.start) * F32);
    let mut requests = operand_requests(module, i, seg);
    requests.push((RegionKind::Weight { weight: weight.index() as u32, rows: 0..1, cols: narrow(cols) }, bytes));
    requests.push((RegionKind::Scratch, 2 * n.div_ceil(g.min(n)) * F32));
    requests
}

/// The PE of `pes` with the least Manhattan distance to its farthest other (the first of equals).
fn central(pes: &[Pe]) -> Pe {
    let reach = |pe: &Pe| pes.iter().map(|q| pe.distance(*q).unwrap_or(u32::MAX)).max().unwrap_or(0);
    *pes.iter().min_by_key(|pe| reach(pe)).expect("a group has members")
}

/// The PE of `leaves` with the least total Manhattan distance to `targets` (the first of equals;
/// the first leaf when there is no target).
fn nearest(leaves: &[Pe], targets: &[Pe]) -> Pe {
    let cost = |pe: &Pe| targets.iter().map(|t| pe.distance(*t).map_or(u64::MAX / 4, u64::from)).sum::<u64>();
    *leaves.iter().min_by_key(|pe| cost(pe)).expect("a row block has tiles")
}

/// A matvec tile's regions (the weight block first): weight rows `rows` by elements `cols`,
/// the x slice with room behind it for the partial sums and their receive buffer (one region,
/// not two: a lowering holds tens of millions of tiles), and on a row block's root the bias.
pub(super) fn tile_requests(
    module: &Module,
    i: usize,
    rows: Range<u64>,
    cols: Range<u64>,
    root: bool,
) -> Result<Vec<Request>, WaferError> {
    let Op::MatVec { x, weight, bias } = &module.body[waferc_ir::Handle::new(i)].op else {
        return Err(unsupported(module, i, "internal: tile requests of a non-matvec".into()));
    };
    let w = &module.weights[*weight];
    let (n_rows, width) = (rows.end - rows.start, cols.end - cols.start);
    let mut requests = vec![
        (
            RegionKind::Weight {
                weight: weight.index() as u32,
                rows: narrow(rows.clone()),
                cols: narrow(cols.clone()),
            },
            n_rows * w.ty.dtype.row_bytes(width).expect("tiles cut at block boundaries"),
        ),
        (RegionKind::Operand { value: x.index() as u32, elements: cols }, (width + 2 * n_rows) * F32),
    ];
    if let (Some(b), true) = (bias, root) {
        let bw = &module.weights[*b];
        let bytes = bw.ty.dtype.row_bytes(n_rows).ok_or_else(|| {
            unsupported(module, i, format!("bias {} ({}) cannot be cut at row {}", bw.name, bw.ty, rows.start))
        })?;
        requests.push((RegionKind::Weight { weight: b.index() as u32, rows: 0..1, cols: narrow(rows) }, bytes));
    }
    Ok(requests)
}

/// An embedding table block's regions: rows `rows` of `table`'s columns `cols` (`row_bytes`
/// each), and scratch for the row it looks up.
pub(super) fn embed_block_requests(
    table: waferc_ir::Handle<waferc_ir::Weight>,
    rows: &Range<u64>,
    cols: &Range<u64>,
    row_bytes: u64,
) -> Vec<Request> {
    let weight =
        RegionKind::Weight { weight: table.index() as u32, rows: narrow(rows.clone()), cols: narrow(cols.clone()) };
    vec![(weight, (rows.end - rows.start) * row_bytes), (RegionKind::Scratch, (cols.end - cols.start) * F32)]
}

/// What one KV block holds: KV head `kv_head`'s rows of `positions` in `lanes`, elements `dims`
/// of each, for the query heads `query_heads` of its group.
pub(super) struct KvBlockShape {
    pub kv_head: u64,
    pub query_heads: Range<u32>,
    pub positions: Range<u32>,
    pub lanes: Lanes,
    pub dims: Range<u32>,
}

/// A KV block's regions (the cache first): keys and values of its rows, its elements of each;
/// its elements of the query heads it serves (one region per head when it holds a slice of the
/// head dimension; the first buffer later receives the reductions' partials), the new key and
/// value, the scores and the block's own partials.
pub(super) fn kv_block_requests(module: &Module, i: usize, block: &KvBlockShape) -> Vec<Request> {
    let Op::Attention { q, k, v, cache, heads, sinks, .. } = &module.body[waferc_ir::Handle::new(i)].op else {
        return Vec::new();
    };
    let c = &module.caches[*cache];
    let (h, lanes) = (block.kv_head, block.lanes);
    let hd = c.head_dim as u64;
    let dims = wide(&block.dims);
    let d = dims.end - dims.start;
    let group = (*heads / c.kv_heads) as u64;
    let n = lanes.held(&block.positions, block.positions.end) as u64;
    let served = group_query_heads(h, group, &block.query_heads);
    let queries = served.end - served.start;
    let kv_range = h * hd + dims.start..h * hd + dims.end;
    let first = block.positions.start == 0 && lanes.first == 0;
    let cache =
        RegionKind::KvCache { kv_head: h as u32, positions: block.positions.clone(), lanes, dims: block.dims.clone() };
    let mut requests = vec![(cache, n * d * 2 * F32)];
    // The queries: one run for whole heads; a slice's elements of each head, each a run of its own
    // (the first also holds the per-head statistics the partials bring).
    if d == hd {
        let q_range = served.start * hd..served.end * hd;
        requests.push((RegionKind::Operand { value: q.index() as u32, elements: q_range }, queries * (hd + 2) * F32));
    } else {
        for (k, head) in served.clone().enumerate() {
            let elements = head * hd + dims.start..head * hd + dims.end;
            let extra = if k == 0 { 2 * queries } else { 0 };
            requests.push((RegionKind::Operand { value: q.index() as u32, elements }, (d + extra) * F32));
        }
    }
    requests.extend([
        (RegionKind::Operand { value: k.index() as u32, elements: kv_range.clone() }, d * F32),
        (RegionKind::Operand { value: v.index() as u32, elements: kv_range }, d * F32),
        (RegionKind::Scratch, queries * n * F32),
        (RegionKind::Partial { elements: (queries * (d + 2)) as u32 }, queries * (d + 2) * F32),
    ]);
    // The sink logits of the block's query heads live on its first block, the reductions' root.
    if let (Some(sinks), true) = (sinks, first) {
        let bytes = module.weights[*sinks].ty.dtype.row_bytes(queries).unwrap_or(queries * F32);
        requests.push((RegionKind::Weight { weight: sinks.index() as u32, rows: 0..1, cols: narrow(served) }, bytes));
    }
    requests
}

/// Refuses to cut attention `i`'s head dimension in `slices` unless each slice is an aligned
/// power-of-two run of whole 32-element chunks (the chunk tree's subtrees, which the slices'
/// partial scores are), its KV blocks are whole (`spread` 1: a slice's score partials are
/// summed per block across the slices), and it has no sinks (which join the softmax at the root
/// block of each head, a placement of whole heads).
pub(super) fn slices_suit(module: &Module, i: usize, slices: u64, spread: u64) -> Result<(), WaferError> {
    if slices == 1 {
        return Ok(());
    }
    let Op::Attention { cache, sinks, .. } = &module.body[waferc_ir::Handle::new(i)].op else {
        return Ok(());
    };
    let hd = module.caches[*cache].head_dim as u64;
    let problem = if !hd.is_multiple_of(slices * CHUNK) || !(hd / CHUNK).is_power_of_two() {
        Some(format!("slice{slices} needs a head_dim of a power-of-two count of {CHUNK}-element chunks, at least {slices}; it is {hd}"))
    } else if spread > 1 {
        Some(format!("slice{slices} needs whole KV blocks, not spread{spread}"))
    } else if sinks.is_some() {
        Some(format!("slice{slices} does not cut a head dimension with attention sinks"))
    } else {
        None
    };
    problem.map_or(Ok(()), |message| Err(unsupported(module, i, message)))
}

/// An instruction the placer cannot place, with why.
pub(super) fn unsupported(module: &Module, instr: usize, message: String) -> WaferError {
    let ir = &module.body[waferc_ir::Handle::new(instr)];
    WaferError::Unsupported { instr: instr as u32, op: ir.op.name(), layer: ir.layer, message }
}

/// Whether a vector op can compute on `layout`'s cut: rope needs whole heads per segment, or a
/// part of a head's half whose twin half a head away is on the same PE (`rope_twin`); a norm
/// whole groups per segment, or equal aligned power-of-two chunk runs that tile its groups.
fn suits(op: &Op, module: &Module, layout: &VectorLayout, len: u64) -> bool {
    let segs = &layout.segments;
    match op {
        Op::Rope { head_dim, .. } => {
            let hd = *head_dim as u64;
            segs.iter().all(|s| match rope_twin(&s.elements, hd) {
                Some(twin) => segs
                    .binary_search_by_key(&twin.start, |t| t.elements.start)
                    .is_ok_and(|t| segs[t].pe == s.pe && segs[t].elements == twin),
                None => s.elements.start % hd == 0 && s.elements.end % hd == 0,
            })
        }
        Op::RmsNorm { weight, .. } => {
            let g = module.weights[*weight].ty.shape[0];
            let whole_groups =
                segs.iter().all(|s| s.elements.start % g == 0 && (s.elements.end % g == 0 || s.elements.end == len));
            let run = segs.first().map_or(0, |s| s.elements.end - s.elements.start);
            let runs = run.is_multiple_of(CHUNK)
                && (run / CHUNK).is_power_of_two()
                && segs[..segs.len().saturating_sub(1)].iter().all(|s| s.elements.end - s.elements.start == run)
                && (g == len || g.is_multiple_of(run));
            whole_groups || runs
        }
        _ => true,
    }
}

fn kind_name(kind: &RouteKind) -> &'static str {
    match kind {
        RouteKind::Operand { .. } => "delivery",
        RouteKind::Gather { .. } => "gather",
        RouteKind::Collect { .. } => "collect",
        RouteKind::Reduce { .. } => "reduction",
        RouteKind::Statistic { .. } => "broadcast",
        RouteKind::Routing => "routing",
    }
}

fn push_unique(list: &mut Vec<RouteId>, id: RouteId) {
    if list.last() != Some(&id) {
        list.push(id);
    }
}

/// Every PE an instruction's placement occupies (not the PEs it merely aliases).
fn placement_pes(p: &InstrPlacement) -> Vec<Pe> {
    let mut pes = Vec::new();
    match &p.work {
        Work::Dispatch { .. } | Work::Slice => return pes,
        Work::MatVec(mv) => pes.extend(mv.tiles.iter().map(|t| t.pe)),
        Work::Embed { blocks, .. } => pes.extend(blocks.iter().map(|b| b.pe)),
        Work::Attention(att) => pes.extend(att.kv_heads_placed.iter().flat_map(|h| h.blocks.iter().map(|b| b.pe))),
        _ => {}
    }
    match &p.result {
        ResultLayout::Vector(l) => pes.extend(l.segments.iter().map(|s| s.pe)),
        ResultLayout::Routing { pe } => pes.push(*pe),
    }
    pes
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sliced KV head's query heads each send a multicast per slice with its dims while that
    /// keeps them to [`MAX_SLICED_QUERY_ROUTES`]: the 70B's 8 query heads a KV head in 4 slices
    /// of 32 dims, 32 multicasts; 16 query heads share one per run of two slices.
    #[test]
    fn sliced_query_multicasts_carry_their_slices_dims_while_few_enough() {
        assert_eq!(query_delivery_dims(&(32..64), 128, 8), 32..64);
        assert_eq!(query_delivery_dims(&(96..128), 128, 8), 96..128);
        assert_eq!(query_delivery_dims(&(32..64), 128, 16), 0..64);
        assert_eq!(query_delivery_dims(&(64..96), 128, 16), 64..128);
        // Whole heads: the head's dims.
        assert_eq!(query_delivery_dims(&(0..128), 128, 64), 0..128);
    }
}
