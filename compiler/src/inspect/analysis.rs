//! What the views share: the part of the model each instruction and PE belongs to, the filter
//! applied to PEs, regions and routes, and the per-wafer loads routes put on routers and links.

use std::collections::BTreeMap;

use waferc_ir::wafer::{InstrIndex, Pe, PeImage, Region, RegionKind, Route, Run, WaferProgram};
use waferc_ir::Module;

use super::{Filter, Rect};

/// The part of the model an instruction belongs to. Instructions outside the decoder layers are
/// the embedding (the `embed` op) or the head (final norm, `lm_head`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Part {
    Embedding,
    Layer(u32),
    Head,
}

/// The digits and letters the ASCII map cycles through for layers.
const LAYER_SYMBOLS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";

impl Part {
    pub fn label(self) -> String {
        match self {
            Part::Embedding => "embedding".to_string(),
            Part::Layer(layer) => format!("layer {layer}"),
            Part::Head => "head".to_string(),
        }
    }

    /// The part's character in the ASCII map: `E`, layers `0-9a-z` cycling, `H`.
    pub fn symbol(self) -> char {
        match self {
            Part::Embedding => 'E',
            Part::Layer(layer) => LAYER_SYMBOLS[layer as usize % LAYER_SYMBOLS.len()] as char,
            Part::Head => 'H',
        }
    }
}

/// How SRAM is spent, in the summary's four kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum SramKind {
    Weights,
    Kv,
    /// Operands, partial sums, results and scratch.
    Buffers,
    Code,
}

impl SramKind {
    pub const ALL: [SramKind; 4] = [SramKind::Weights, SramKind::Kv, SramKind::Buffers, SramKind::Code];

    pub fn of(kind: &RegionKind) -> SramKind {
        match kind {
            RegionKind::Weight { .. } => SramKind::Weights,
            RegionKind::KvCache { .. } => SramKind::Kv,
            RegionKind::Code => SramKind::Code,
            RegionKind::Operand { .. }
            | RegionKind::Partial { .. }
            | RegionKind::Output { .. }
            | RegionKind::Scratch => SramKind::Buffers,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SramKind::Weights => "weights",
            SramKind::Kv => "kv",
            SramKind::Buffers => "buffers",
            SramKind::Code => "code",
        }
    }
}

/// Which part (and expert) holds most of a PE's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Owner {
    pub part: Part,
    pub expert: Option<u32>,
}

/// A box of PEs on one wafer: columns `x0..=x1`, rows `y0..=y1`, holding `pes` PEs of something.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BBox {
    pub x0: u16,
    pub x1: u16,
    pub y0: u16,
    pub y1: u16,
    pub pes: u64,
}

impl BBox {
    fn at(pe: Pe) -> BBox {
        BBox { x0: pe.x, x1: pe.x, y0: pe.y, y1: pe.y, pes: 1 }
    }

    fn add(&mut self, pe: Pe) {
        self.x0 = self.x0.min(pe.x);
        self.x1 = self.x1.max(pe.x);
        self.y0 = self.y0.min(pe.y);
        self.y1 = self.y1.max(pe.y);
        self.pes += 1;
    }
}

/// Where each part and each expert of each layer went: bounding boxes per wafer.
pub(super) struct Footprints {
    pub parts: BTreeMap<(Part, u16), BBox>,
    pub experts: BTreeMap<(Part, u32, u16), BBox>,
}

/// The rectangle of one wafer a view shows: the whole grid, or the filter's region clipped to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Extent {
    pub x0: u16,
    pub y0: u16,
    pub cols: u16,
    pub rows: u16,
}

/// The grid of an extent cut into blocks of `block_w x block_h` PEs, each with its dominant owner.
pub(super) struct CellGrid {
    pub wafer: u16,
    pub extent: Extent,
    pub block_w: u16,
    pub block_h: u16,
    pub cols: u32,
    pub rows: u32,
    /// Row-major, `cols * rows`.
    pub cells: Vec<Cell>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Cell {
    /// The part most of the block's shown PEs belong to (ties to the earlier part).
    pub part: Option<Part>,
    /// The expert most of the block's shown PEs belong to, `Some(None)` when most belong to none.
    pub expert: Option<Option<u32>>,
    /// PEs the filter shows.
    pub shown: u32,
    /// PEs that hold something, but only of layers the filter hides.
    pub hidden: u32,
}

impl CellGrid {
    pub fn cell_of(&self, x: u16, y: u16) -> Option<usize> {
        let e = self.extent;
        if x < e.x0 || y < e.y0 || x - e.x0 >= e.cols || y - e.y0 >= e.rows {
            return None;
        }
        let (cx, cy) = (((x - e.x0) / self.block_w) as u32, ((y - e.y0) / self.block_h) as u32);
        Some((cy * self.cols + cx) as usize)
    }

    /// The PE box of cell `(cx, cy)`: first column, first row, columns, rows.
    pub fn cell_box(&self, cx: u32, cy: u32) -> (u16, u16, u16, u16) {
        let e = self.extent;
        let x = e.x0 + (cx as u16) * self.block_w;
        let y = e.y0 + (cy as u16) * self.block_h;
        let w = self.block_w.min(e.x0 + e.cols - x);
        let h = self.block_h.min(e.y0 + e.rows - y);
        (x, y, w, h)
    }
}

/// Directions of the links leaving a PE, as indices into [`LinkLoads::out`].
pub(super) const EAST: usize = 0;
pub(super) const WEST: usize = 1;
pub(super) const SOUTH: usize = 2;
pub(super) const NORTH: usize = 3;

/// Bytes per decode step on each directed link of one wafer, from the filter's routes.
pub(super) struct LinkLoads {
    pub cols: u16,
    /// Per PE (`y * cols + x`): bytes leaving it east (+x), west, south (+y), north.
    pub out: Vec<[u64; 4]>,
}

impl LinkLoads {
    pub fn at(&self, x: u16, y: u16) -> &[u64; 4] {
        &self.out[y as usize * self.cols as usize + x as usize]
    }

    /// The busiest link: its load and endpoints.
    pub fn max(&self, wafer: u16) -> Option<(u64, Pe, Pe)> {
        let mut best: Option<(u64, Pe, Pe)> = None;
        for (i, loads) in self.out.iter().enumerate() {
            for (dir, &load) in loads.iter().enumerate() {
                if load > 0 && best.is_none_or(|(b, _, _)| load > b) {
                    let from = Pe::new(wafer, (i % self.cols as usize) as u16, (i / self.cols as usize) as u16);
                    best = Some((load, from, neighbour(from, dir)));
                }
            }
        }
        best
    }

    pub fn total(&self) -> u64 {
        self.out.iter().flatten().sum()
    }
}

fn neighbour(pe: Pe, dir: usize) -> Pe {
    match dir {
        EAST => Pe::new(pe.wafer, pe.x + 1, pe.y),
        WEST => Pe::new(pe.wafer, pe.x - 1, pe.y),
        SOUTH => Pe::new(pe.wafer, pe.x, pe.y + 1),
        _ => Pe::new(pe.wafer, pe.x, pe.y - 1),
    }
}

/// The direction of the neighbour hop `from -> to` on one wafer (`None` for anything else).
fn direction(from: Pe, to: Pe) -> Option<usize> {
    if from.wafer != to.wafer || from.distance(to) != Some(1) {
        return None;
    }
    Some(if to.x > from.x {
        EAST
    } else if to.x < from.x {
        WEST
    } else if to.y > from.y {
        SOUTH
    } else {
        NORTH
    })
}

/// Calls `hop(from, direction)` for each neighbour hop of an on-wafer run, without allocating.
/// Runs that are neither straight nor inter-wafer have no hops (the checker rejects them).
fn for_each_hop(run: &Run, mut hop: impl FnMut(Pe, usize)) {
    let (a, b) = (run.from, run.to);
    if a.wafer != b.wafer || (a.x != b.x && a.y != b.y) {
        return;
    }
    let (dir, steps) = if a.x < b.x {
        (EAST, b.x - a.x)
    } else if a.x > b.x {
        (WEST, a.x - b.x)
    } else if a.y < b.y {
        (SOUTH, b.y - a.y)
    } else {
        (NORTH, a.y - b.y)
    };
    let mut at = a;
    for _ in 0..steps {
        hop(at, dir);
        at = neighbour(at, dir);
    }
}

/// Bytes a route moves over all its links per decode step.
pub(super) fn route_bytes_per_step(route: &Route) -> u64 {
    route.link_messages().values().map(|&m| m as u64).sum::<u64>() * route.message_bytes as u64
}

/// Links a run crosses: its length on a wafer, 1 between wafers.
pub(super) fn hop_count(run: &Run) -> u64 {
    if run.is_inter_wafer() {
        1
    } else if run.from.x == run.to.x || run.from.y == run.to.y {
        run.from.distance(run.to).unwrap_or(0) as u64
    } else {
        0
    }
}

/// The program, the module and the filter, with the per-instruction and per-route facts every
/// view needs.
pub(super) struct Analysis<'a> {
    pub program: &'a WaferProgram,
    pub module: Option<&'a Module>,
    pub filter: &'a Filter,
    parts: Vec<Part>,
    routes_kept: Vec<bool>,
}

impl<'a> Analysis<'a> {
    pub fn new(program: &'a WaferProgram, module: Option<&'a Module>, filter: &'a Filter) -> Self {
        let parts: Vec<Part> = program
            .instrs
            .iter()
            .map(|p| match p.layer {
                Some(layer) => Part::Layer(layer),
                None if p.op == "embed" => Part::Embedding,
                None => Part::Head,
            })
            .collect();
        let mut in_layer = vec![filter.layer.is_none(); program.routes.len()];
        if let Some(layer) = filter.layer {
            for (route, keep) in program.routes.iter().zip(&mut in_layer) {
                *keep = parts.get(route.instr as usize) == Some(&Part::Layer(layer));
            }
            for placement in program.instrs.iter().filter(|p| p.layer == Some(layer)) {
                for &id in &placement.operand_routes {
                    if let Some(keep) = in_layer.get_mut(id as usize) {
                        *keep = true;
                    }
                }
            }
        }
        let routes_kept =
            program.routes.iter().zip(in_layer).map(|(route, keep)| keep && route_meets(route, filter)).collect();
        Analysis { program, module, filter, parts, routes_kept }
    }

    /// The part of instruction `instr` (`None` for an index outside the program).
    pub fn part(&self, instr: InstrIndex) -> Option<Part> {
        self.parts.get(instr as usize).copied()
    }

    /// Whether the layer filter keeps instruction `instr`.
    pub fn instr_kept(&self, instr: InstrIndex) -> bool {
        match self.filter.layer {
            None => (instr as usize) < self.parts.len(),
            Some(layer) => self.part(instr) == Some(Part::Layer(layer)),
        }
    }

    /// Whether a region serves an instruction the layer filter keeps (the code reserve serves none).
    pub fn region_kept(&self, region: &Region) -> bool {
        region.instr.is_some_and(|instr| self.instr_kept(instr))
    }

    /// Whether a PE image is shown: inside the rectangle and holding something of the kept layer.
    pub fn pe_kept(&self, image: &PeImage) -> bool {
        self.filter.contains(image.pe) && image.regions.iter().any(|r| self.region_kept(r))
    }

    /// Whether a PE holds anything of an instruction (rather than only its code reserve).
    pub fn pe_used(image: &PeImage) -> bool {
        image.regions.iter().any(|r| r.instr.is_some())
    }

    pub fn kept_routes(&self) -> impl Iterator<Item = &'a Route> + '_ {
        self.program.routes.iter().enumerate().filter(|(i, _)| self.routes_kept[*i]).map(|(_, r)| r)
    }

    /// The model's name for titles: its architecture and layer count, if the module is known.
    pub fn model_name(&self) -> Option<String> {
        self.module.map(|m| {
            let arch = if m.meta.architecture.is_empty() { "model" } else { m.meta.architecture.as_str() };
            format!("{arch}, {} layers", m.meta.num_layers)
        })
    }

    /// The IR name of weight `weight`, if the module is known and has it.
    pub fn weight_name(&self, weight: u32) -> Option<&'a str> {
        let module = self.module?;
        module.weights.get(waferc_ir::Handle::new(weight as usize)).map(|w| w.name.as_str())
    }

    /// The wafers the views show.
    pub fn wafers(&self) -> Vec<u16> {
        (0..self.program.target.wafers).filter(|w| self.filter.wafer.is_none_or(|f| f == *w)).collect()
    }

    /// The part of each wafer the views show.
    pub fn extent(&self) -> Extent {
        let t = &self.program.target;
        match self.filter.region {
            None => Extent { x0: 0, y0: 0, cols: t.grid_cols, rows: t.grid_rows },
            Some(Rect { x, y, w, h }) => {
                let x0 = x.min(t.grid_cols);
                let y0 = y.min(t.grid_rows);
                let cols = (x0 as u32 + w as u32).min(t.grid_cols as u32) as u16 - x0;
                let rows = (y0 as u32 + h as u32).min(t.grid_rows as u32) as u16 - y0;
                Extent { x0, y0, cols, rows }
            }
        }
    }

    /// The images of wafer `wafer`'s PEs (`pes` is sorted by wafer first).
    pub fn wafer_images(&self, wafer: u16) -> &'a [PeImage] {
        let pes = &self.program.pes;
        let start = pes.partition_point(|image| image.pe.wafer < wafer);
        let end = pes.partition_point(|image| image.pe.wafer <= wafer);
        &pes[start..end.max(start)]
    }

    /// The images the filter shows, in `pes` order.
    pub fn kept_images(&self) -> impl Iterator<Item = &'a PeImage> + '_ {
        self.program.pes.iter().filter(|image| self.pe_kept(image))
    }

    /// Which part, and which expert of it, hold most of the kept bytes of a PE.
    pub fn owner(&self, image: &PeImage) -> Option<Owner> {
        let mut by_part: Vec<(Part, u64)> = Vec::new();
        let mut by_owner: Vec<(Owner, u64)> = Vec::new();
        for region in image.regions.iter().filter(|r| self.region_kept(r)) {
            let Some(instr) = region.instr else { continue };
            let (Some(part), Some(placement)) = (self.part(instr), self.program.instrs.get(instr as usize)) else {
                continue;
            };
            add_to(&mut by_part, part, region.bytes as u64);
            add_to(&mut by_owner, Owner { part, expert: placement.expert }, region.bytes as u64);
        }
        let part = heaviest(&by_part)?;
        let in_part: Vec<(Option<u32>, u64)> =
            by_owner.iter().filter(|(o, _)| o.part == part).map(|(o, bytes)| (o.expert, *bytes)).collect();
        Some(Owner { part, expert: heaviest(&in_part).flatten() })
    }

    /// Bounding boxes of every part and every expert on the kept PEs.
    pub fn footprints(&self) -> Footprints {
        let mut parts: BTreeMap<(Part, u16), BBox> = BTreeMap::new();
        let mut experts: BTreeMap<(Part, u32, u16), BBox> = BTreeMap::new();
        let mut seen_parts = Vec::new();
        let mut seen_experts = Vec::new();
        for image in self.kept_images() {
            seen_parts.clear();
            seen_experts.clear();
            for region in image.regions.iter().filter(|r| self.region_kept(r)) {
                let Some(instr) = region.instr else { continue };
                let (Some(part), Some(placement)) = (self.part(instr), self.program.instrs.get(instr as usize)) else {
                    continue;
                };
                if !seen_parts.contains(&part) {
                    seen_parts.push(part);
                }
                if let Some(expert) = placement.expert {
                    if !seen_experts.contains(&(part, expert)) {
                        seen_experts.push((part, expert));
                    }
                }
            }
            let pe = image.pe;
            for &part in &seen_parts {
                parts.entry((part, pe.wafer)).and_modify(|b| b.add(pe)).or_insert_with(|| BBox::at(pe));
            }
            for &(part, expert) in &seen_experts {
                experts.entry((part, expert, pe.wafer)).and_modify(|b| b.add(pe)).or_insert_with(|| BBox::at(pe));
            }
        }
        Footprints { parts, experts }
    }

    /// Wafer `wafer`'s extent cut into blocks of `block_w x block_h` PEs with their owners.
    pub fn cell_grid(&self, wafer: u16, block_w: u16, block_h: u16) -> CellGrid {
        let extent = self.extent();
        let cols = (extent.cols as u32).div_ceil(block_w as u32);
        let rows = (extent.rows as u32).div_ceil(block_h as u32);
        let mut grid = CellGrid { wafer, extent, block_w, block_h, cols, rows, cells: Vec::new() };
        let mut owners: Vec<(usize, Owner)> = Vec::new();
        let mut hidden = vec![0u32; (cols * rows) as usize];
        for image in self.wafer_images(wafer) {
            let Some(cell) = grid.cell_of(image.pe.x, image.pe.y) else { continue };
            match self.owner(image) {
                Some(owner) => owners.push((cell, owner)),
                None if Self::pe_used(image) => hidden[cell] += 1,
                None => {}
            }
        }
        owners.sort_unstable();
        let mut cells: Vec<Cell> = hidden.into_iter().map(|hidden| Cell { hidden, ..Cell::default() }).collect();
        for group in owners.chunk_by(|a, b| a.0 == b.0) {
            let mut by_part = Vec::new();
            let mut by_expert = Vec::new();
            for (_, owner) in group {
                add_to(&mut by_part, owner.part, 1);
                add_to(&mut by_expert, owner.expert, 1);
            }
            let cell = &mut cells[group[0].0];
            cell.shown = group.len() as u32;
            cell.part = heaviest(&by_part);
            cell.expert = heaviest(&by_expert);
        }
        grid.cells = cells;
        grid
    }

    /// Colours each PE of wafer `wafer` routes (every route, not only the filter's: a router's
    /// colours are spent by whatever passes through it), indexed `y * grid_cols + x`.
    pub fn colours_in_use(&self, wafer: u16) -> Vec<u16> {
        let t = &self.program.target;
        let cols = t.grid_cols as usize;
        let mut masks = vec![[0u64; 4]; cols * t.grid_rows as usize];
        let mut mark = |pe: Pe, colour: u8| {
            if pe.wafer == wafer && t.contains(pe) {
                masks[pe.y as usize * cols + pe.x as usize][colour as usize / 64] |= 1 << (colour % 64);
            }
        };
        for route in &self.program.routes {
            for &pe in route.sources.iter().chain(&route.destinations) {
                mark(pe, route.colour);
            }
            for run in &route.path {
                mark(run.from, route.colour);
                mark(run.to, route.colour);
                if run.from.wafer == wafer {
                    for_each_hop(run, |from, _| mark(from, route.colour));
                }
            }
        }
        masks.iter().map(|m| m.iter().map(|w| w.count_ones() as u16).sum()).collect()
    }

    /// The load the filter's routes put on wafer `wafer`'s links (hops with an end inside the
    /// filter's rectangle).
    pub fn link_loads(&self, wafer: u16) -> LinkLoads {
        let t = &self.program.target;
        let cols = t.grid_cols as usize;
        let mut out = vec![[0u64; 4]; cols * t.grid_rows as usize];
        for route in self.kept_routes() {
            for ((from, to), messages) in route.link_messages() {
                let Some(dir) = direction(from, to).filter(|_| from.wafer == wafer) else { continue };
                if t.contains(from) && t.contains(to) && (self.filter.contains(from) || self.filter.contains(to)) {
                    out[from.y as usize * cols + from.x as usize][dir] += route.message_bytes as u64 * messages as u64;
                }
            }
        }
        LinkLoads { cols: t.grid_cols, out }
    }

    /// The load the filter's routes put on links between wafers, by endpoints.
    pub fn inter_wafer_loads(&self) -> BTreeMap<(Pe, Pe), u64> {
        let mut loads = BTreeMap::new();
        for route in self.kept_routes() {
            for ((from, to), messages) in route.link_messages() {
                if from.wafer != to.wafer && (self.filter.contains(from) || self.filter.contains(to)) {
                    *loads.entry((from, to)).or_insert(0) += route.message_bytes as u64 * messages as u64;
                }
            }
        }
        loads
    }
}

fn add_to<K: PartialEq>(totals: &mut Vec<(K, u64)>, key: K, amount: u64) {
    match totals.iter_mut().find(|(k, _)| *k == key) {
        Some((_, total)) => *total += amount,
        None => totals.push((key, amount)),
    }
}

/// The key with the largest total; ties go to the smallest key, so the choice is deterministic.
fn heaviest<K: Ord + Copy>(totals: &[(K, u64)]) -> Option<K> {
    totals.iter().max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0))).map(|(k, _)| *k)
}

/// Whether a route has a PE on the filter's wafer and inside its rectangle.
fn route_meets(route: &Route, filter: &Filter) -> bool {
    if filter.region.is_none() && filter.wafer.is_none() {
        return true;
    }
    if route.sources.iter().chain(&route.destinations).any(|&pe| filter.contains(pe)) {
        return true;
    }
    route.path.iter().any(|run| {
        let (a, b) = (run.from, run.to);
        if a.wafer != b.wafer {
            return filter.contains(a) || filter.contains(b);
        }
        filter.wafer.is_none_or(|w| w == a.wafer)
            && filter.region.is_none_or(|r| r.meets((a.x.min(b.x), a.x.max(b.x)), (a.y.min(b.y), a.y.max(b.y))))
    })
}

/// The median of `values`, sorting them (the lower middle for an even count); 0 when empty.
pub(super) fn median(values: &mut [u64]) -> u64 {
    if values.is_empty() {
        return 0;
    }
    values.sort_unstable();
    values[(values.len() - 1) / 2]
}
