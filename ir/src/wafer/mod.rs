//! The placed program: one IR module laid out on a wafer (or a pipeline of wafers).
//!
//! `passes::wafer::compile` produces a [`WaferProgram`]; the executor (`runtime::executor`) runs
//! it PE by PE; [`artifact`] stores it with the packed weight tiles and the IR for validation.
//!
//! # Model
//!
//! * A PE is named by its coordinates, [`Pe`] `{ wafer, x, y }`; `x` is the column, `y` the row.
//! * Every value lives in pieces: a vector value is a [`VectorLayout`], a list of [`Segment`]s
//!   (element ranges, each on one PE, in element order, covering the vector exactly once). A
//!   routing value lives on one PE.
//! * Every IR instruction has an [`InstrPlacement`] (indexed by the instruction's value index):
//!   where its weights are, which PEs compute it, where its result lives, and the routes its
//!   operands and collectives use.
//! * Every PE that holds anything has a [`PeImage`]: its SRAM regions (code reserve, weight tiles,
//!   KV cache, activation buffers). Weight regions name the IR weight elements they hold and where
//!   their bytes are in the tile blob, so a PE's initial SRAM is its image plus those bytes.
//! * Data moves only along [`Route`]s. A route has one colour, its sources, its destinations and
//!   its path (straight [`Run`]s of neighbour hops, plus inter-wafer hops). **Each source of a route
//!   sends at most one message on it per decode step**, so an executor can key its message buffers
//!   by `(route id, sending PE)`.
//! * A value's result segments are sent once, by the producer's [`Phase::Deliver`] step, along one
//!   [`RouteKind::Operand`] multicast per segment to every PE of every consumer that needs it (so a
//!   vector read by q, k and v projections, or by all experts of a layer, costs one colour per
//!   segment, not one per consumer); a PE that would receive many segments of a value on its
//!   own (a vector op cut coarser than its operand) gets them on one [`RouteKind::Gather`]
//!   instead, one colour for all of them. `expert_dispatch` aliases its `x`: its result layout is `x`'s,
//!   and `x`'s operand routes reach the expert's PEs, which learn whether their expert was chosen
//!   from the router's [`RouteKind::Routing`] route.
//! * The [`Step`]s of `schedule` are the order of one decode step. Each names its instruction, a
//!   [`Phase`] and the routes that phase uses; placements name their routes the same way, so an
//!   artifact with a route deleted fails in the checker and in the executor, naming the route.
//!
//! # Numerics
//!
//! Tiling never changes a bit (NUMERICS.md): every reduction axis is cut into *aligned
//! power-of-two runs of 32-element chunks*, each PE computes the chunk tree of its run, and a
//! [`RouteKind::Reduce`] route combines the runs' results with the same binary tree
//! ([`reduce_tree`]). Rows of a matvec, heads of attention and elements of elementwise ops are
//! independent outputs and are cut anywhere.

pub mod arrival;
pub mod artifact;
mod bound;
pub mod profile;
pub mod replicas;
pub mod serial;

pub use bound::{distance_bound_cycles, distance_bound_ends};
pub use profile::{LayerProfile, RoutingProfile};
pub use replicas::{replica_slots, replica_slots_in, serving_copy, ExpertReplicas};

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::arena::Handle;
use crate::module::Module;

/// Index of an IR instruction (`Handle<Instr>::index()`), which is also its value.
pub type InstrIndex = u32;
/// Index of a route in [`WaferProgram::routes`]; a route's `id` equals its index.
pub type RouteId = u32;

/// The target parameters a program was compiled for: everything the checker and the timing
/// model need, copied so an artifact is self-contained. `waferc_targets::Target::params` builds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TargetParams {
    /// The target's name (`wse3`, `grid:8x8`, a file's `name`).
    pub name: String,
    /// Usable PE columns per wafer (`x` ranges over `0..grid_cols`).
    pub grid_cols: u16,
    /// Usable PE rows per wafer (`y` ranges over `0..grid_rows`).
    pub grid_rows: u16,
    /// Wafers in the pipeline; wafer `w` sends to wafer `w + 1`.
    pub wafers: u16,
    pub sram_bytes_per_pe: u32,
    /// SRAM per PE kept for code and runtime state; placement never uses it.
    pub code_reserve_bytes: u32,
    pub clock_hz: f64,
    /// Bytes a link between neighbour PEs moves per cycle, per direction.
    pub link_bytes_per_cycle: u32,
    pub hop_latency_cycles: u32,
    /// Routable colours (virtual channels) per PE router.
    pub colours_per_pe: u8,
    /// f32 fused-or-not multiply-adds a PE retires per cycle.
    pub f32_fma_per_cycle: f64,
    /// Cycles (of this target's clock) for one hop between wafers.
    pub inter_wafer_latency_cycles: u64,
    /// Bytes per cycle (of this target's clock) one inter-wafer link moves.
    pub inter_wafer_bytes_per_cycle: f64,
}

impl TargetParams {
    /// SRAM a placement may use on one PE.
    pub fn usable_bytes_per_pe(&self) -> u32 {
        self.sram_bytes_per_pe.saturating_sub(self.code_reserve_bytes)
    }

    /// Whether `pe` exists on this target.
    pub fn contains(&self, pe: Pe) -> bool {
        pe.wafer < self.wafers && pe.x < self.grid_cols && pe.y < self.grid_rows
    }
}

/// Dense numbering of a target's PEs, `(wafer x rows + y) x cols + x`: vectors indexed by it
/// stand in for maps keyed by [`Pe`], which are slow at a PE per tile.
#[derive(Clone, Copy, Debug)]
pub struct PeGrid {
    cols: usize,
    rows: usize,
    wafers: usize,
}

impl PeGrid {
    pub fn of(params: &TargetParams) -> PeGrid {
        PeGrid { cols: params.grid_cols as usize, rows: params.grid_rows as usize, wafers: params.wafers as usize }
    }

    /// How many PEs the target has.
    pub fn len(&self) -> usize {
        self.wafers * self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many wafers the target has.
    pub fn wafers(&self) -> usize {
        self.wafers
    }

    /// `pe`'s number; `None` for a PE off the grid.
    pub fn index(&self, pe: Pe) -> Option<usize> {
        let (w, x, y) = (pe.wafer as usize, pe.x as usize, pe.y as usize);
        (w < self.wafers && x < self.cols && y < self.rows).then(|| (w * self.rows + y) * self.cols + x)
    }

    /// The PE numbered `index` (the inverse of [`PeGrid::index`]).
    pub fn pe(&self, index: usize) -> Pe {
        let (x, rest) = (index % self.cols, index / self.cols);
        let (y, w) = (rest % self.rows, rest / self.rows);
        Pe::new(w as u16, x as u16, y as u16)
    }
}

/// A processing element: wafer index, column `x`, row `y`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Pe {
    pub wafer: u16,
    pub x: u16,
    pub y: u16,
}

impl Pe {
    pub fn new(wafer: u16, x: u16, y: u16) -> Self {
        Pe { wafer, x, y }
    }

    /// Manhattan distance on the same wafer; `None` across wafers.
    pub fn distance(self, other: Pe) -> Option<u32> {
        (self.wafer == other.wafer)
            .then(|| (self.x as i32 - other.x as i32).unsigned_abs() + (self.y as i32 - other.y as i32).unsigned_abs())
    }
}

impl fmt::Display for Pe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PE(w{}, x{}, y{})", self.wafer, self.x, self.y)
    }
}

/// How a program was planned (`passes::wafer::CompileOptions::plan`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Plan {
    /// Each matvec gets its own tile grid (tiles sized so the module fills most of the target,
    /// at most one PE's SRAM each); partial sums reduce along tile rows by the chunk tree;
    /// results stay on the row roots.
    Tiled,
    /// WaferLLM-style (MeshGEMV): every matrix cut into `p x p` blocks (finer where a block would
    /// not fit one PE), one PE per block; each block column receives its activation slice; the
    /// partial sums are all-reduced along each block row by a two-level tree (groups of
    /// `ceil(cols / group_num)` blocks rounded up to a power of two, then across the groups'
    /// first blocks) and the result broadcast back along the row.
    MeshGemv { p: u16, group_num: u16 },
    /// Every PE of a region works in every phase: consecutive layers are grouped
    /// `layers_per_region` at a time, each group gets one rectangle of PEs, and every matvec of
    /// the group is tiled over the whole rectangle (each PE holds a slice of every matrix of its
    /// layers); vectors are cut in 32-element segments spread over the region; KV blocks sit in
    /// a strip at the region's east side. Routes of the same shape in different layers share
    /// colours (a layer starts only once the previous one's result has arrived). The regions
    /// together span `wafer_percent` of each wafer's PEs (a square-ish block at its north-west
    /// corner): a small model's layers are faster on smaller regions, whose collectives are
    /// shorter, than spread over the whole wafer. Each KV head's cache is held `kv_copies`
    /// times, each copy on blocks of its own serving an equal share of the head's query heads
    /// ([`KvHeadPlacement::query_heads`]): a copy's blocks compute scores and weighted values
    /// for fewer query heads, at the price of the copies' SRAM. An MoE layer's experts share
    /// their region's tile area in lanes of `experts_per_lane` experts each: a larger lane gives
    /// each expert more PEs (less arithmetic per PE), and two chosen experts of one lane run one
    /// after the other on its PEs. Each 32-position KV block is spread over `kv_spread` PEs
    /// (1, 2, 4 or 8), each holding the positions of an equal aligned run of the chunk's eight
    /// lanes ([`Lanes`]): a full block's scores and weighted values are then split between
    /// them, at the price of their PEs (the SRAM is the same). Each KV head's cache is cut in
    /// `kv_slices` slices of its head dimension (1, 2, 4 or 8, each an aligned run of whole
    /// 32-element chunks), each slice on blocks of its own holding `kv_slices` times the
    /// positions ([`KvHeadPlacement::dims`]): the same PEs and SRAM, but a step's query and its
    /// scores' work at a position are split between the slices, whose partial scores are summed
    /// across them (the chunk tree's upper levels) before the softmax.
    Stacked {
        layers_per_region: u16,
        wafer_percent: u8,
        kv_copies: u8,
        experts_per_lane: u8,
        kv_spread: u8,
        kv_slices: u8,
    },
}

impl Plan {
    /// The stacked plan with `layers_per_region` layers a region over the whole wafer, and none
    /// of its options (no KV copies, an expert a lane, KV blocks on one PE each, whole heads).
    pub fn stacked(layers_per_region: u16) -> Plan {
        Plan::Stacked {
            layers_per_region,
            wafer_percent: 100,
            kv_copies: 1,
            experts_per_lane: 1,
            kv_spread: 1,
            kv_slices: 1,
        }
    }

    /// This plan with each KV head's cache in `slices` slices of its head dimension (a plan
    /// that is not stacked has no such option, and comes back as it is).
    pub fn with_kv_slices(mut self, slices: u8) -> Plan {
        if let Plan::Stacked { kv_slices, .. } = &mut self {
            *kv_slices = slices;
        }
        self
    }
}

impl fmt::Display for Plan {
    /// The `--plan` spelling.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Plan::Tiled => write!(f, "tiled"),
            Plan::MeshGemv { p, group_num } => write!(f, "meshgemv:{p},{group_num}"),
            Plan::Stacked { layers_per_region, wafer_percent, kv_copies, experts_per_lane, kv_spread, kv_slices } => {
                write!(f, "stacked:{layers_per_region}")?;
                if wafer_percent != 100 || kv_copies != 1 || experts_per_lane != 1 || kv_spread != 1 || kv_slices != 1 {
                    write!(f, ",{wafer_percent}")?;
                }
                if kv_copies != 1 {
                    write!(f, ",kv{kv_copies}")?;
                }
                if experts_per_lane != 1 {
                    write!(f, ",share{experts_per_lane}")?;
                }
                if kv_spread != 1 {
                    write!(f, ",spread{kv_spread}")?;
                }
                if kv_slices != 1 {
                    write!(f, ",slice{kv_slices}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::str::FromStr for Plan {
    type Err = String;

    /// The `--plan` spelling ([`Plan`]'s `Display`): `tiled`, `stacked:K[,P][,kvC][,shareE][,spreadL][,sliceD]`
    /// or `meshgemv:P,G`. The error says which field is wrong and shows a valid spelling.
    fn from_str(text: &str) -> Result<Plan, String> {
        if text == "tiled" {
            return Ok(Plan::Tiled);
        }
        if let Some(args) = text.strip_prefix("stacked:") {
            let mut fields = args.split(',').map(str::trim);
            let layers_per_region = match fields.next().map(str::parse) {
                Some(Ok(k)) if k > 0 => k,
                _ => return Err("K must be a whole number of layers per region, at least 1, as in stacked:2".into()),
            };
            let wafer_percent = match fields.next().map_or(Ok(100), str::parse) {
                Ok(p) if (1..=100).contains(&p) => p,
                _ => return Err("P must be a percentage of the wafer from 1 to 100, as in stacked:1,25".into()),
            };
            let (mut kv_copies, mut experts_per_lane, mut kv_spread, mut kv_slices) = (None, None, None, None);
            for field in fields {
                let prefixes = (
                    field.strip_prefix("kv"),
                    field.strip_prefix("share"),
                    field.strip_prefix("spread"),
                    field.strip_prefix("slice"),
                );
                let (slot, count) = match prefixes {
                    (Some(c), _, _, _) => (&mut kv_copies, c),
                    (_, Some(e), _, _) => (&mut experts_per_lane, e),
                    (_, _, _, Some(d)) => {
                        if !matches!(d.parse::<u8>(), Ok(1 | 2 | 4 | 8)) {
                            return Err(format!(
                                "{field:?}: sliceD cuts each KV head's cache in D = 1, 2, 4 or 8 slices of its \
                                 head dimension, as in stacked:4,100,slice4"
                            ));
                        }
                        (&mut kv_slices, d)
                    }
                    (_, _, Some(l), _) => {
                        if !matches!(l.parse::<u8>(), Ok(1 | 2 | 4 | 8)) {
                            return Err(format!(
                                "{field:?}: spreadL spreads each KV block over L = 1, 2, 4 or 8 PEs, as in \
                                 stacked:4,100,kv4,spread2"
                            ));
                        }
                        (&mut kv_spread, l)
                    }
                    _ => {
                        return Err(format!(
                            "unknown field {field:?}: after K and P come kvC, shareE, spreadL and sliceD, as in \
                             stacked:2,100,kv8,share2"
                        ))
                    }
                };
                match count.parse::<u8>() {
                    Ok(n) if n > 0 && slot.is_none() => *slot = Some(n),
                    _ => {
                        return Err(format!(
                            "{field:?}: kvC (C copies of each KV head's cache), shareE (E experts a lane), \
                             spreadL (each KV block over L PEs) and sliceD (each KV head's cache in D slices of \
                             its head dimension) each take a whole number, once, as in stacked:2,100,kv8,share2"
                        ))
                    }
                }
            }
            return Ok(Plan::Stacked {
                layers_per_region,
                wafer_percent,
                kv_copies: kv_copies.unwrap_or(1),
                experts_per_lane: experts_per_lane.unwrap_or(1),
                kv_spread: kv_spread.unwrap_or(1),
                kv_slices: kv_slices.unwrap_or(1),
            });
        }
        let Some(args) = text.strip_prefix("meshgemv:") else {
            return Err(
                "expected `tiled`, `stacked:K[,P][,kvC][,shareE][,spreadL][,sliceD]` (e.g. stacked:2, stacked:1,25 or \
                 stacked:4,100,kv2) or `meshgemv:P,G` (e.g. meshgemv:660,22)"
                    .into(),
            );
        };
        let parsed = args.split_once(',').and_then(|(p, g)| Some((p.trim().parse().ok()?, g.trim().parse().ok()?)));
        match parsed {
            Some((p, group_num)) => Ok(Plan::MeshGemv { p, group_num }),
            None => Err("P and G must be whole numbers, as in meshgemv:660,22".into()),
        }
    }
}

/// The whole placed program. Serialised into an artifact with bincode; weight bytes are not
/// part of it (they are the artifact's tile blob, where [`WaferProgram::blob_ranges`] finds them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WaferProgram {
    pub target: TargetParams,
    pub plan: Plan,
    /// KV capacity in positions; the executor refuses a position `>= max_context`.
    pub max_context: u32,
    /// Every PE that holds anything, sorted by [`Pe`] (binary-search with [`WaferProgram::pe`]).
    pub pes: Vec<PeImage>,
    /// One per IR instruction, indexed by its value index.
    pub instrs: Vec<InstrPlacement>,
    /// Indexed by [`RouteId`].
    pub routes: Vec<Route>,
    /// One decode step, in execution order.
    pub schedule: Vec<Step>,
    /// Length of the tile blob: the weight regions' bytes, laid end to end in `pes` order (each
    /// region's `bytes` of them: [`WaferProgram::blob_ranges`]).
    pub tile_blob_len: u64,
    /// Whether the tile blob holds bytes (false for a shape-only compile).
    pub weights_present: bool,
    /// Sequences whose KV caches fit at once: every attention's KV heads are placed once per
    /// sequence in flight, on blocks of their own ([`KvHeadPlacement::sequence`]).
    pub max_sequences: u32,
    /// The routing profile the experts were placed by (`None`: uniform routing assumed).
    pub routing_profile: Option<RoutingProfile>,
    /// Extra copies of hot experts ([`replicas`]). Not serialised with the rest of the program:
    /// the artifact appends it after the header when non-empty, so artifacts without replicas
    /// keep their bytes.
    #[serde(skip)]
    pub replicas: Vec<ExpertReplicas>,
}

impl WaferProgram {
    /// How many matvec tiles the program places, over all its matvecs.
    pub fn matvec_tiles(&self) -> usize {
        self.instrs
            .iter()
            .map(|p| match &p.work {
                Work::MatVec(m) => m.tiles.len(),
                _ => 0,
            })
            .sum()
    }

    /// Every weight region with its bytes' range in the tile blob, in blob order: as
    /// (position in `pes`, position in its image's regions, range). The blob lays the weight
    /// regions' `bytes` end to end in `pes` order, so the ranges are derived rather than stored
    /// (16 bytes a region: a quarter of a full-size lowering's regions).
    pub fn blob_ranges(&self) -> impl Iterator<Item = (usize, usize, Range<u64>)> + '_ {
        self.blob_starts()
            .zip(self.pes.iter().enumerate())
            .flat_map(|(start, (at, image))| image.blob_ranges(start).map(move |(index, range)| (at, index, range)))
    }

    /// Where each image's weight bytes start in the tile blob, in `pes` order.
    pub fn blob_starts(&self) -> impl Iterator<Item = u64> + '_ {
        self.pes.iter().scan(0u64, |end, image| {
            let start = *end;
            *end += image
                .regions
                .iter()
                .filter(|r| matches!(r.kind, RegionKind::Weight { .. }))
                .map(|r| r.bytes as u64)
                .sum::<u64>();
            Some(start)
        })
    }

    /// The image of `pe`, if it holds anything.
    pub fn pe(&self, pe: Pe) -> Option<&PeImage> {
        self.pes.binary_search_by(|image| image.pe.cmp(&pe)).ok().map(|i| &self.pes[i])
    }

    pub fn route(&self, id: RouteId) -> Option<&Route> {
        self.routes.get(id as usize)
    }

    /// Bytes each directed link carries per decode step, summed over all routes (inter-wafer
    /// hops are keyed by their endpoints like any other link).
    pub fn link_bytes(&self) -> std::collections::BTreeMap<(Pe, Pe), u64> {
        let mut load = std::collections::BTreeMap::new();
        for route in &self.routes {
            for (hop, messages) in route.link_messages() {
                *load.entry(hop).or_insert(0) += route.message_bytes as u64 * messages as u64;
            }
        }
        load
    }
}

/// One PE's SRAM: regions at byte offsets within `sram_bytes_per_pe`, in the order they were
/// placed. The first is the code reserve at offset 0. The *resident* regions (code, weights, KV,
/// partial sums, scratch) follow it in increasing offset without overlapping. The *working* ones
/// ([`RegionKind::is_working`]: operand buffers and results) lie above every resident one and
/// may overlap one another where one is dead before the other is first written
/// ([`Region::may_share`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeImage {
    pub pe: Pe,
    pub regions: Vec<Region>,
}

impl PeImage {
    /// Bytes used (covered by a region), including the code reserve.
    pub fn used_bytes(&self) -> u64 {
        covered_bytes(&self.regions)
    }

    /// The regions instruction `instr` owns on this PE.
    pub fn regions_of(&self, instr: InstrIndex) -> impl Iterator<Item = &Region> {
        self.regions.iter().filter(move |r| r.instr == Some(instr))
    }

    /// This image's weight regions (by position) with their ranges in the tile blob, end to end
    /// from `start` (see [`WaferProgram::blob_ranges`]).
    pub fn blob_ranges(&self, start: u64) -> impl Iterator<Item = (usize, Range<u64>)> + '_ {
        let weights = self.regions.iter().enumerate().filter(|(_, r)| matches!(r.kind, RegionKind::Weight { .. }));
        weights.scan(start, |end, (index, r)| {
            let range = *end..*end + r.bytes as u64;
            *end = range.end;
            Some((index, range))
        })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Region {
    pub offset: u32,
    pub bytes: u32,
    /// The instruction the region serves; `None` for the code reserve.
    pub instr: Option<InstrIndex>,
    pub kind: RegionKind,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RegionKind {
    /// Program text and runtime state (the target's code reserve).
    Code,
    /// A block of IR weight `weight`: rows `rows` by elements `cols` of its last axis (a 1-D
    /// weight has the single row `0..1`). The bytes are the weight's storage bytes of each row's
    /// `cols` slice, rows in order; `cols` starts and ends on 32-element block boundaries for
    /// block-quantised types (or at the row end). The region's `bytes` are exactly those bytes;
    /// where they are in the tile blob follows from the order ([`WaferProgram::blob_ranges`]).
    Weight { weight: u32, rows: Range<u32>, cols: Range<u32> },
    /// KV cache of one KV head for the positions of `positions` in `lanes` (capacity; filled as
    /// decoding goes), elements `dims` of each head vector (all of `0..head_dim`, or a slice,
    /// [`KvHeadPlacement::dims`]): keys then values, each `held x dims` f32, position-major.
    KvCache { kv_head: u32, positions: Range<u32>, lanes: Lanes, dims: Range<u32> },
    /// An operand's elements received from routes, as f32 (`value` is the IR operand, which may
    /// be an `expert_dispatch` of the vector actually delivered). Attention's query buffer also
    /// receives the reductions' partials once the scores are computed, so it is sized for both;
    /// a matvec tile's input slice has its partial sums and their receive buffer behind it.
    Operand { value: InstrIndex, elements: Range<u64> },
    /// Partial sums and received partials of a reduction (f32): a KV block's.
    Partial { elements: u32 },
    /// The instruction's result elements held on this PE (f32).
    Output { elements: Range<u64> },
    /// Scratch the op needs (attention scores, per-group statistics).
    Scratch,
}

/// The bytes `regions` cover: where working regions share bytes, those count once.
pub fn covered_bytes(regions: &[Region]) -> u64 {
    let mut spans: Vec<(u64, u64)> =
        regions.iter().map(|r| (r.offset as u64, r.offset as u64 + r.bytes as u64)).collect();
    spans.sort_unstable();
    let (mut used, mut reach) = (0, 0);
    for (start, end) in spans {
        used += end.saturating_sub(start.max(reach));
        reach = reach.max(end);
    }
    used
}

impl RegionKind {
    /// Whether the region is working memory, which may share bytes with another working region
    /// of its image (see [`PeImage`]): an operand buffer, live from its value's first arrival
    /// until its instruction is done.
    pub fn is_working(&self) -> bool {
        matches!(self, RegionKind::Operand { .. } | RegionKind::Output { .. })
    }
}

impl Region {
    /// Whether this region and `other` may take the same bytes: both are working regions and one
    /// is dead before the other is first written. An operand buffer is written no earlier than
    /// its value's first element exists and is dead once its instruction is done
    /// ([`Completion::done_before`]); a result is written no earlier than its own first element
    /// exists and is dead once its readers are done ([`Completion::dead_before`]).
    ///
    /// [`Completion::done_before`]: crate::completion::Completion::done_before
    /// [`Completion::dead_before`]: crate::completion::Completion::dead_before
    pub fn may_share(&self, other: &Region, completion: &crate::completion::Completion) -> bool {
        match (self.lifetime(), other.lifetime()) {
            (Some(mine), Some(theirs)) => {
                mine.dead_before(&theirs, completion) || theirs.dead_before(&mine, completion)
            }
            _ => false,
        }
    }

    fn lifetime(&self) -> Option<Lifetime> {
        match (&self.kind, self.instr) {
            (RegionKind::Operand { value, .. }, Some(instr)) => {
                Some(Lifetime { written_from: *value as usize, dead: Dead::InstrDone(instr as usize) })
            }
            (RegionKind::Output { .. }, Some(instr)) => {
                Some(Lifetime { written_from: instr as usize, dead: Dead::ValueRead(instr as usize) })
            }
            _ => None,
        }
    }
}

/// When a working region's bytes are in use: from the first element of value `written_from`
/// until `dead`.
struct Lifetime {
    written_from: usize,
    dead: Dead,
}

enum Dead {
    /// Once this instruction is done (an operand buffer).
    InstrDone(usize),
    /// Once every reader of this value is done (a result).
    ValueRead(usize),
}

impl Lifetime {
    fn dead_before(&self, other: &Lifetime, completion: &crate::completion::Completion) -> bool {
        match self.dead {
            Dead::InstrDone(instr) => completion.done_before(instr, other.written_from),
            Dead::ValueRead(value) => completion.dead_before(value, other.written_from),
        }
    }
}

/// A piece of a vector value: elements `elements` held on `pe`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub pe: Pe,
    pub elements: Range<u64>,
}

/// Where a vector value lives: segments in element order covering `0..len` exactly once.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VectorLayout {
    pub segments: Vec<Segment>,
}

impl VectorLayout {
    pub fn len(&self) -> u64 {
        self.segments.last().map_or(0, |s| s.elements.end)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The segments overlapping `elements`, with the overlap.
    pub fn overlapping(&self, elements: Range<u64>) -> impl Iterator<Item = (&Segment, Range<u64>)> {
        self.segments.iter().filter_map(move |s| {
            let start = s.elements.start.max(elements.start);
            let end = s.elements.end.min(elements.end);
            (start < end).then_some((s, start..end))
        })
    }
}

/// Where an instruction's result lives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ResultLayout {
    Vector(VectorLayout),
    /// A routing decision, held on one PE.
    Routing {
        pe: Pe,
    },
}

/// How one IR instruction is placed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InstrPlacement {
    pub instr: InstrIndex,
    /// The op's name (`Op::name`), for diagnostics.
    pub op: String,
    pub layer: Option<u32>,
    /// The MoE expert whose FFN the instruction belongs to (from its `expert_dispatch` ancestry).
    pub expert: Option<u32>,
    pub result: ResultLayout,
    /// The [`RouteKind::Operand`] and [`RouteKind::Gather`] routes on which this instruction's PEs receive their operands
    /// (other instructions' deliveries; for an operand produced by `expert_dispatch`, the
    /// deliveries of the dispatched `x`). For a matvec they end at the tiles, for attention at the
    /// KV blocks, otherwise at the result's segments or the router PE.
    pub operand_routes: Vec<RouteId>,
    /// The routes carrying this instruction's result to its consumers: the [`RouteKind::Operand`]
    /// multicasts in segment order, one per result segment read on another PE (empty when
    /// nothing reads the result elsewhere, e.g. the logits), then the [`RouteKind::Gather`]s.
    pub deliveries: Vec<RouteId>,
    pub work: Work,
}

/// The op-specific part of a placement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Work {
    /// The table is cut into blocks (row ranges x the element ranges of the result's segments);
    /// for each result segment, one [`RouteKind::Collect`] route (in `collects`, in segment order)
    /// from the blocks covering its elements: the block holding the token's row sends its slice.
    Embed {
        blocks: Vec<EmbedBlock>,
        collects: Vec<RouteId>,
    },
    MatVec(MatVecPlacement),
    /// `silu`, `mul`, `add`, `rope`: computed segment by segment on the result's segments, from
    /// operand elements delivered there.
    Elementwise,
    /// `expert_dispatch`: no data moves; the result aliases `x`'s layout. `routing` is the router's
    /// [`RouteKind::Routing`] route, which reaches this expert's PEs.
    Dispatch {
        routing: RouteId,
    },
    /// `slice`: no data moves; the result names elements `offset..offset + len` of `x`'s layout
    /// (its segments are the overlapping parts of `x`'s, numbered from the slice's start), and
    /// `x`'s deliveries reach the slice's readers.
    Slice,
    RmsNorm(NormPlacement),
    Attention(AttentionPlacement),
    /// `router_topk` on the result's PE; it sends the decision on `routing` to every PE of the
    /// layer's experts and to the combine's segments.
    Router {
        routing: RouteId,
    },
    /// `expert_combine` on the result's segments: per segment, a [`RouteKind::Collect`] route from
    /// every expert's result segment (only chosen experts send); the routing arrives on `routing`.
    Combine {
        routing: RouteId,
        collects: Vec<RouteId>,
    },
}

/// One row block of the embedding table on one PE.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmbedBlock {
    pub pe: Pe,
    pub rows: Range<u64>,
    pub elements: Range<u64>,
}

/// A matvec `y[n] = sum_k w[n,k] x[k]` as a grid of tiles.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MatVecPlacement {
    pub rows: u64,
    pub cols: u64,
    /// Tiles of row block `r` are `tiles[r * col_blocks .. (r + 1) * col_blocks]`, in chunk order.
    pub row_blocks: u32,
    pub col_blocks: u32,
    pub tiles: Vec<Tile>,
    /// [`RouteKind::Reduce`] routes in execution order. [`Plan::Tiled`]: one per row block (none
    /// when `col_blocks == 1`), from its tiles to its root tile `(r, 0)`. [`Plan::MeshGemv`]: first
    /// one per group of tiles in each row (to the group's first tile), then one per row across the
    /// groups' first tiles (to the root).
    pub reductions: Vec<RouteId>,
    /// [`Plan::MeshGemv`] only: per row block, the reduced rows from the root back to the row's
    /// tiles ([`RouteKind::Statistic`]), which makes the all-reduce.
    pub broadcasts: Vec<RouteId>,
    /// The bias (IR weight index), held on each row block's root in a weight region.
    pub bias: Option<u32>,
    /// Per result segment, a [`RouteKind::Collect`] route from the roots of the row blocks it
    /// covers (each adds its bias slice, then sends its rows).
    pub collects: Vec<RouteId>,
}

impl MatVecPlacement {
    /// A `rows x cols` matvec on `tiles` (a `row_blocks x col_blocks` grid), before routing adds
    /// its reductions, broadcasts and collects.
    pub fn unrouted(
        rows: u64,
        cols: u64,
        row_blocks: u32,
        col_blocks: u32,
        tiles: Vec<Tile>,
        bias: Option<u32>,
    ) -> Self {
        MatVecPlacement {
            rows,
            cols,
            row_blocks,
            col_blocks,
            tiles,
            reductions: Vec::new(),
            broadcasts: Vec::new(),
            bias,
            collects: Vec::new(),
        }
    }
}

/// Tile `(r, c)` of a matvec: output rows `rows` x reduction chunks `chunks` (32 elements each,
/// an aligned power-of-two run, the last possibly short), on `pe`, weight in region `region`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tile {
    pub pe: Pe,
    pub rows: Range<u32>,
    pub chunks: Range<u32>,
    /// Index into the PE's `regions` of the tile's weight.
    pub region: u32,
}

/// RMSNorm over groups: each result segment computes its partial sum of squares; groups spanning
/// several segments reduce them ([`RouteKind::Reduce`]) and broadcast `1/rms` back.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NormPlacement {
    pub group_len: u64,
    /// For each group that spans more than one segment: its reduce route and the broadcast of
    /// the statistic back to its segments. Groups inside one segment need no route.
    pub group_routes: Vec<GroupRoutes>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRoutes {
    pub group: u64,
    pub reduce: RouteId,
    pub broadcast: RouteId,
}

/// Attention: each KV head's cache is cut into position blocks (aligned power-of-two runs of
/// 32-position chunks up to `max_context`), one per PE; each block attends for every query head
/// sharing its KV head.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionPlacement {
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Every sequence's KV heads, sequence by sequence, each in KV head order.
    pub kv_heads_placed: Vec<KvHeadPlacement>,
    /// Per result segment, a [`RouteKind::Collect`] route from the root blocks of the KV heads
    /// whose query heads it covers (every sequence's; a step's sequence sends from its own).
    pub collects: Vec<RouteId>,
}

impl AttentionPlacement {
    /// The KV heads of sequence `sequence`, with their indices in `kv_heads_placed`.
    pub fn heads_of(&self, sequence: u32) -> impl Iterator<Item = (usize, &KvHeadPlacement)> {
        self.kv_heads_placed.iter().enumerate().filter(move |(_, h)| h.sequence == sequence)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvHeadPlacement {
    pub kv_head: u32,
    /// The sequence in flight whose cache this is (`0..max_sequences`): each sequence has KV
    /// blocks of its own, on PEs of their own.
    pub sequence: u32,
    /// The KV head's query heads these blocks serve, numbered within its group
    /// (`0..heads / kv_heads`): all of them, or a share when the cache is held in copies
    /// (`Plan::Stacked::kv_copies`); the placements of one head and sequence partition them.
    pub query_heads: Range<u32>,
    /// The elements of each head vector (of `0..head_dim`) these blocks hold and compute on: all
    /// of them, or a slice (`Plan::Stacked::kv_slices`), an aligned power-of-two run of whole
    /// 32-element chunks. The slices of one head, copy and sequence partition `0..head_dim`,
    /// come one after another in `kv_heads_placed` in dims order, and have blocks of the same
    /// positions: a slice's score at a position is the chunk tree's subtree over its dims, and
    /// the slices' subtrees are summed across them ([`KvHeadPlacement::score_reduce`]).
    pub dims: Range<u32>,
    /// In position order; equal power-of-two chunk runs.
    pub blocks: Vec<KvBlock>,
    /// Operand routes bringing this head's query heads, key and value to all its blocks.
    pub q_routes: Vec<RouteId>,
    pub k_routes: Vec<RouteId>,
    pub v_routes: Vec<RouteId>,
    /// Reductions over the blocks, destination the root block (`blocks[0]`): the score maximum
    /// per query head, then the exp sum, then the weighted values (`head_dim` per query head);
    /// the maximum and the sum go back to every block. All absent with a single block.
    pub max_reduce: Option<RouteId>,
    pub max_broadcast: Option<RouteId>,
    pub sum_reduce: Option<RouteId>,
    pub sum_broadcast: Option<RouteId>,
    pub out_reduce: Option<RouteId>,
    /// On a head's first slice when it has several (empty otherwise): per block, a reduction of
    /// the slices' partial scores (block `b` of each slice, in dims order) to this slice's block
    /// `b`, then a broadcast of the summed scores back to the other slices' block `b`.
    pub score_reduce: Vec<RouteId>,
    pub score_broadcast: Vec<RouteId>,
}

impl KvHeadPlacement {
    /// KV head `kv_head` of sequence `sequence`, serving `query_heads` of its group with the
    /// elements `dims` of each head vector, on `blocks`, before routing adds its routes.
    pub fn unrouted(
        kv_head: u32,
        sequence: u32,
        query_heads: Range<u32>,
        dims: Range<u32>,
        blocks: Vec<KvBlock>,
    ) -> Self {
        KvHeadPlacement {
            kv_head,
            sequence,
            query_heads,
            dims,
            blocks,
            q_routes: Vec::new(),
            k_routes: Vec::new(),
            v_routes: Vec::new(),
            max_reduce: None,
            max_broadcast: None,
            sum_reduce: None,
            sum_broadcast: None,
            out_reduce: None,
            score_reduce: Vec::new(),
            score_broadcast: Vec::new(),
        }
    }

    /// Whether `other` holds another slice of the same KV head's cache (the same sequence and
    /// query heads): a head's slices come one after another in `kv_heads_placed`, so
    /// `chunk_by(KvHeadPlacement::same_head)` gives each head's slices together.
    pub fn same_head(&self, other: &KvHeadPlacement) -> bool {
        (self.sequence, self.kv_head, &self.query_heads) == (other.sequence, other.kv_head, &other.query_heads)
    }

    /// Whether these blocks hold every element of each head vector (no slices).
    pub fn whole_dims(&self, head_dim: u64) -> bool {
        self.dims.start == 0 && self.dims.end as u64 == head_dim
    }

    /// The elements of the queries (and of the attention's output) these blocks read and
    /// produce, per query head served, in order: `dims` of each head.
    pub fn query_pieces(&self, group: u64, head_dim: u64) -> impl Iterator<Item = Range<u64>> + '_ {
        let dims = wide(&self.dims);
        self.query_range(group).map(move |q| q * head_dim + dims.start..q * head_dim + dims.end)
    }

    /// How many query heads these blocks serve.
    pub fn query_count(&self) -> u64 {
        (self.query_heads.end - self.query_heads.start) as u64
    }

    /// The query heads these blocks serve, numbered over the whole model, of a model with
    /// `group` query heads per KV head.
    pub fn query_range(&self, group: u64) -> Range<u64> {
        group_query_heads(self.kv_head as u64, group, &self.query_heads)
    }

    /// The elements of the queries (and of the attention's output) these blocks serve, of a
    /// model with `group` query heads per KV head of `head_dim` elements.
    pub fn query_elements(&self, group: u64, head_dim: u64) -> Range<u64> {
        let heads = self.query_range(group);
        heads.start * head_dim..heads.end * head_dim
    }
}

/// Query heads `query_heads` of KV head `kv_head`'s group, numbered over the whole model, of a
/// model with `group` query heads per KV head.
pub fn group_query_heads(kv_head: u64, group: u64, query_heads: &Range<u32>) -> Range<u64> {
    let first = kv_head * group;
    first + query_heads.start as u64..first + query_heads.end as u64
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvBlock {
    pub pe: Pe,
    pub positions: Range<u32>,
    /// Which of `positions` the block holds: all, or those of some lanes of a single chunk.
    pub lanes: Lanes,
    /// Index into the PE's `regions` of the block's KV cache.
    pub region: u32,
}

impl KvBlock {
    /// Whether the block holds row `row` (a position, or a windowed cache's ring row).
    pub fn holds(&self, row: u32) -> bool {
        self.positions.contains(&row) && self.lanes.holds(row)
    }

    /// Where among the block's rows (stored in row order) row `row`, which it holds, is.
    pub fn slot(&self, row: u32) -> usize {
        let offset = row - self.positions.start;
        let lane = offset % LANES as u32 - self.lanes.first as u32;
        ((offset / LANES as u32) * self.lanes.count as u32 + lane) as usize
    }

    /// How many of rows `0..rows` the block holds.
    pub fn held_below(&self, rows: u32) -> u32 {
        self.lanes.held(&self.positions, rows)
    }

    /// How many rows the block holds when full.
    pub fn capacity(&self) -> u32 {
        self.held_below(self.positions.end)
    }

    /// The first row the block holds: it computes (and its reductions' leaves send) from the
    /// step at this position on.
    pub fn first_row(&self) -> u32 {
        self.positions.start + self.lanes.first as u32
    }

    /// The rows below `rows` the block holds, in order.
    pub fn rows_below(&self, rows: u32) -> impl Iterator<Item = u32> + '_ {
        (self.positions.start..rows.min(self.positions.end)).filter(|&row| self.lanes.holds(row))
    }
}

/// Accumulator lanes of a 32-position chunk (NUMERICS.md's chunk tree: the chunk starting at
/// row `r` has row `r + t` in lane `t % 8`).
pub const LANES: usize = 8;

/// The lanes of its chunk a KV block holds: `count` lanes from `first`, an aligned power-of-two
/// run, so the block's sums over its rows are one subtree of the chunk's lane combine
/// `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`, and a chunk's blocks, in lane order,
/// combine by the same tree as whole chunks. A block holding fewer than all lanes holds one
/// chunk (its sums would not be a subtree otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Lanes {
    pub first: u8,
    pub count: u8,
}

impl Lanes {
    pub const ALL: Lanes = Lanes { first: 0, count: LANES as u8 };

    /// Group `group` of the chunk's lanes cut in `groups` equal groups (a power of two).
    pub fn group(group: u8, groups: u8) -> Lanes {
        let count = LANES as u8 / groups;
        Lanes { first: group * count, count }
    }

    pub fn is_all(&self) -> bool {
        *self == Lanes::ALL
    }

    /// Whether the lanes are an aligned power-of-two run within the chunk: a subtree of its
    /// lane combine.
    pub fn is_aligned(&self) -> bool {
        self.count.is_power_of_two() && self.first.is_multiple_of(self.count) && self.end() <= LANES as u16
    }

    pub fn holds(&self, row: u32) -> bool {
        let lane = (row % LANES as u32) as u16;
        (self.first as u16..self.end()).contains(&lane)
    }

    /// Where the `k`-th row a block of these lanes holds sits among its chunk run's rows (the
    /// inverse of [`KvBlock::slot`]).
    pub fn row(&self, k: usize) -> usize {
        let count = self.count as usize;
        (k / count) * LANES + self.first as usize + k % count
    }

    /// One past the last lane (wide, so a malformed artifact's lanes cannot overflow).
    pub fn end(&self) -> u16 {
        self.first as u16 + self.count as u16
    }

    /// How many rows of `positions` (starting at a multiple of 8) below `rows` are in these
    /// lanes.
    pub fn held(&self, positions: &Range<u32>, rows: u32) -> u32 {
        let span = rows.clamp(positions.start, positions.end) - positions.start;
        let (whole, rest) = (span / LANES as u32, span % LANES as u32);
        whole * self.count as u32 + rest.saturating_sub(self.first as u32).min(self.count as u32)
    }
}

impl fmt::Display for Lanes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lanes {}..{}", self.first, self.end())
    }
}

/// A straight run of neighbour hops on one wafer (`from` and `to` share a row or a column), or
/// one inter-wafer hop (`from` and `to` on different wafers). `messages` is how many messages
/// of the route cross each of the run's links per decode step (a reduction crosses some links
/// at several tree levels).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    pub from: Pe,
    pub to: Pe,
    pub messages: u16,
}

impl Run {
    pub fn is_inter_wafer(&self) -> bool {
        self.from.wafer != self.to.wafer
    }

    /// The directed neighbour hops of the run (one hop for an inter-wafer run; none if `from`
    /// and `to` are neither aligned nor on different wafers, which the checker rejects). An
    /// iterator: link loads, waves and contention walk every hop of every route.
    pub fn hops(&self) -> impl ExactSizeIterator<Item = (Pe, Pe)> + use<> {
        let (a, b) = (self.from, self.to);
        let inter_wafer = self.is_inter_wafer();
        let step = |from: u16, to: u16| -> i32 { (to as i32 - from as i32).signum() };
        let (dx, dy) = (step(a.x, b.x), step(a.y, b.y));
        let n = match (inter_wafer, a.x == b.x || a.y == b.y) {
            (true, _) => 1,
            (false, true) => a.distance(b).unwrap_or(0) as usize,
            (false, false) => 0,
        };
        let at = move |i: usize| {
            let k = i as i32;
            Pe::new(a.wafer, (a.x as i32 + dx * k) as u16, (a.y as i32 + dy * k) as u16)
        };
        (0..n).map(move |i| if inter_wafer { (a, b) } else { (at(i), at(i + 1)) })
    }

    /// The PEs the run visits, `from` and `to` included.
    pub fn pes(&self) -> Vec<Pe> {
        let mut pes = vec![self.from];
        pes.extend(self.hops().map(|(_, to)| to));
        pes
    }
}

/// What a route carries.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RouteKind {
    /// The segment `elements` of `value` from the one source (the segment's PE) to every
    /// destination (a multicast); each destination uses the part it needs.
    Operand { value: InstrIndex, elements: Range<u64> },
    /// Elements `elements` of `value`, from several sources to the one destination: each source
    /// holds one segment of `value` inside `elements` and sends it (sources in element order,
    /// their segments covering `elements`). One route, so one colour, where one multicast per
    /// segment would take a colour each at the destination: a few long segments reading a finely
    /// cut operand (the 70B's residual crossing to the next region in 16 segments, reading 256).
    Gather { value: InstrIndex, elements: Range<u64> },
    /// Elements `elements` of the route's instruction's result, from several sources to the one
    /// destination (the result segment's PE); each source sends the part it holds: a matvec's
    /// row-block roots their reduced rows (bias added), attention's root blocks their heads'
    /// outputs, the embedding block holding the token's row its slice, each chosen expert its
    /// result (unchosen experts send nothing).
    Collect { elements: Range<u64> },
    /// A reduction: `sources` hold the leaves in chunk order (each an aligned power-of-two run of
    /// equal length, the last possibly short), combined by the chunk tree as [`reduce_tree`]
    /// lists its edges toward the root leaf ([`Route::reduce_root`]: the destination if it is a
    /// source, else `sources[0]`): the partial of `sources[sender]` (its subtree's) is sent to
    /// `sources[receiver]`, which combines the two in leaf order (lower leaves' partial on the
    /// left). Then, if the destination is not a source, `sources[0]` sends the total there.
    /// `op` says how partials combine.
    Reduce { op: ReduceOp, elements: u32 },
    /// A per-group statistic (norm `1/rms`, softmax max or sum) from the one source to every
    /// destination: `elements` f32 values.
    Statistic { elements: u32 },
    /// The router's decision (for `expert_dispatch` and `expert_combine`) to every destination.
    Routing,
}

impl RouteKind {
    /// One source sending one message that the routers replicate to every destination.
    pub fn is_multicast(&self) -> bool {
        matches!(self, RouteKind::Operand { .. } | RouteKind::Statistic { .. } | RouteKind::Routing)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReduceOp {
    /// f32 sum by the chunk tree.
    Sum,
    /// f32 maximum (exact in any order, but it follows the same tree).
    Max,
}

/// One route: a colour, sources, destinations and the path between them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Route {
    pub id: RouteId,
    /// The instruction whose result the route carries or computes (an operand route's producer).
    pub instr: InstrIndex,
    pub kind: RouteKind,
    /// The same colour on every PE the route touches.
    pub colour: u8,
    pub sources: Vec<Pe>,
    pub destinations: Vec<Pe>,
    /// Runs in order; each starts at a source or at a PE an earlier run visited, and every
    /// destination is a source or is visited by some run. For a reduction, the runs of each tree
    /// edge in [`Route::reduce_edges`] order, then the final forward.
    pub path: Vec<Run>,
    /// Payload bytes of one message.
    pub message_bytes: u32,
}

impl Route {
    /// The messages the route puts on each directed link per decode step. A multicast (an
    /// operand delivery, a statistic, the routing: one source) is replicated by the routers where
    /// its tree branches, so its message crosses each link once however many of its runs share
    /// the link. A reduction or a gather sends distinct messages, so its runs' counts add up.
    /// The timing model and every link-load view count traffic with this one rule.
    pub fn link_messages(&self) -> std::collections::BTreeMap<(Pe, Pe), u32> {
        let multicast = self.kind.is_multicast();
        let mut messages = std::collections::BTreeMap::new();
        for run in &self.path {
            for hop in run.hops() {
                let on_link = messages.entry(hop).or_insert(0);
                *on_link = if multicast { 1 } else { *on_link + run.messages as u32 };
            }
        }
        messages
    }

    /// A reduction's root leaf, where its tree's total ends ([`reduce_root`]).
    pub fn reduce_root(&self) -> usize {
        self.destinations.first().map_or(0, |&destination| reduce_root(&self.sources, destination))
    }

    /// The reduction's tree edges ([`reduce_tree`] toward [`Route::reduce_root`]).
    pub fn reduce_edges(&self) -> Vec<(usize, usize)> {
        reduce_tree(self.sources.len(), self.reduce_root())
    }

    /// Every PE on the route (sources, destinations, and PEs its runs pass), sorted, deduplicated:
    /// each needs the route's colour in its router.
    pub fn pes(&self) -> Vec<Pe> {
        let mut pes: Vec<Pe> = self.sources.iter().chain(&self.destinations).copied().collect();
        for run in &self.path {
            pes.extend(run.pes());
        }
        pes.sort_unstable();
        pes.dedup();
        pes
    }
}

/// For a rope result segment `elements` that lies inside one half of a `head_dim` head (a part,
/// not whole heads): the elements half a head away it rotates with. `None` for a segment of
/// whole heads, or one that crosses a half's edge (which a placement never cuts).
pub fn rope_twin(elements: &std::ops::Range<u64>, head_dim: u64) -> Option<std::ops::Range<u64>> {
    let half = head_dim / 2;
    if half == 0 || elements.is_empty() || elements.start / half != (elements.end - 1) / half {
        return None;
    }
    let head_start = elements.start / head_dim * head_dim;
    Some(match (elements.start - head_start) < half {
        true => elements.start + half..elements.end + half,
        false => elements.start - half..elements.end - half,
    })
}

/// The root leaf of a reduction over `leaves` into `destination`: the destination's position
/// among the leaves, or 0 when it is not one (then the first leaf forwards the total there).
pub fn reduce_root(leaves: &[Pe], destination: Pe) -> usize {
    leaves.iter().position(|&pe| pe == destination).unwrap_or(0)
}

/// The combine order of a reduction over `leaves` leaves whose total ends on leaf `root`:
/// `(receiver, sender)` pairs, executed in order. The chunk tree of NUMERICS.md over leaves of
/// equal power-of-two chunk runs: for leaves `lo..hi` with `p` the smallest power of two
/// `>= hi - lo`, the left subtree is `lo..lo + p/2` and the right `lo + p/2..hi`. Each subtree's
/// value accumulates on its leaf nearest `root` (`root` clamped into it), so the tree's edges
/// lead toward `root` and the total ends there. The tree, not the place, decides which partial
/// is the left operand: the one from the lower leaves, i.e. the sender's when
/// `sender < receiver`. With `root` 0 every subtree accumulates on its first leaf.
pub fn reduce_tree(leaves: usize, root: usize) -> Vec<(usize, usize)> {
    fn walk(lo: usize, hi: usize, root: usize, edges: &mut Vec<(usize, usize)>) {
        if hi - lo <= 1 {
            return;
        }
        let mid = lo + (hi - lo).next_power_of_two() / 2;
        walk(lo, mid, root, edges);
        walk(mid, hi, root, edges);
        let (left, right) = (root.clamp(lo, mid - 1), root.clamp(mid, hi - 1));
        edges.push(if root < mid { (left, right) } else { (right, left) });
    }
    let mut edges = Vec::with_capacity(leaves.saturating_sub(1));
    walk(0, leaves, root.min(leaves.saturating_sub(1)), &mut edges);
    edges
}

/// One step of a decode step's schedule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub instr: InstrIndex,
    pub phase: Phase,
    /// The routes this step sends on (all of them carry their message within the step).
    pub routes: Vec<RouteId>,
}

/// What a step does. An instruction's steps are consecutive, in the order listed here (the
/// derived `Ord`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Phase {
    /// `expert_combine` and the embedding: gather inputs along the `Collect` routes.
    Gather,
    /// Local arithmetic on every PE of the instruction: tiles' partial products; elementwise ops
    /// and rope; a norm's partial sums of squares; attention's append, scores and local maximum;
    /// the router's top-k; the combine's weighted sum.
    Compute,
    /// Reductions (routes in order): matvec row blocks; norm groups.
    Reduce,
    /// Broadcasts: a norm's `1/rms`; MeshGemv's reduced rows back along each row.
    Broadcast,
    /// Local arithmetic after the reduction: the norm's scaling.
    Finish,
    /// Attention with its head dimension in slices: the slices' partial scores summed across
    /// them, then the sums broadcast back.
    AttentionScore,
    /// Attention: maximum reduce, then its broadcast.
    AttentionMax,
    /// Attention: exponentials, their sum reduce, then its broadcast.
    AttentionSum,
    /// Attention: weighted values, their reduce to each KV head's root block.
    AttentionOut,
    /// Matvec and attention: the roots send their rows/heads along the `Collect` routes into the
    /// result's segments (a matvec's roots add the bias first).
    Collect,
    /// Send the result along its deliveries (the router: the routing along its route).
    Deliver,
}

/// `range` widened to `u64` (tiles and weight regions keep their rows and columns in `u32`: a
/// lowering holds tens of millions of them).
pub fn wide(range: &Range<u32>) -> Range<u64> {
    range.start as u64..range.end as u64
}

/// `range` narrowed to `u32`; rows and columns of a weight, elements of a vector, always fit.
pub fn narrow(range: Range<u64>) -> Range<u32> {
    debug_assert!(range.end <= u32::MAX as u64, "{range:?} does not fit u32");
    range.start as u32..range.end as u32
}

/// The storage bytes of a weight region, cut from the module's weights: each row's `cols` slice,
/// rows in order (the layout the tile blob holds). `None` for another region kind, an absent
/// weight, or a range the weight does not have.
pub fn region_bytes(module: &Module, kind: &RegionKind) -> Option<Vec<u8>> {
    let RegionKind::Weight { weight, rows, cols, .. } = kind else { return None };
    let w = module.weights.get(Handle::new(*weight as usize))?;
    let data = w.data.bytes()?;
    let dtype = w.ty.dtype;
    let row_bytes = dtype.row_bytes(*w.ty.shape.last()?)? as usize;
    let start = dtype.row_bytes(cols.start as u64)? as usize;
    let len = dtype.row_bytes(cols.end.checked_sub(cols.start)? as u64)? as usize;
    let mut out = Vec::with_capacity(len * (rows.end - rows.start) as usize);
    for row in rows.clone() {
        let base = row as usize * row_bytes + start;
        out.extend_from_slice(data.get(base..base + len)?);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block of lanes 4..8 of the chunk at 32 holds rows 36-39, 44-47, 52-55, 60-63, stored
    /// in that order.
    #[test]
    fn a_lane_group_holds_its_lanes_rows_in_order() {
        let block = KvBlock { pe: Pe::new(0, 0, 0), positions: 32..64, lanes: Lanes::group(1, 2), region: 0 };
        assert_eq!(block.lanes, Lanes { first: 4, count: 4 });
        assert!(block.holds(36) && block.holds(63) && !block.holds(35) && !block.holds(40) && !block.holds(4));
        assert_eq!([block.slot(36), block.slot(39), block.slot(44), block.slot(63)], [0, 3, 4, 15]);
        assert_eq!(
            [block.held_below(36), block.held_below(40), block.held_below(45), block.held_below(99)],
            [0, 4, 5, 16]
        );
        assert_eq!((block.capacity(), block.first_row()), (16, 36));
        assert_eq!(block.rows_below(46).collect::<Vec<_>>(), [36, 37, 38, 39, 44, 45]);
        let whole = KvBlock { lanes: Lanes::ALL, ..block.clone() };
        assert_eq!((whole.slot(45), whole.held_below(45), whole.capacity(), whole.first_row()), (13, 13, 32, 32));
        assert!(Lanes::group(3, 4).is_aligned() && !Lanes { first: 2, count: 4 }.is_aligned());
        assert!(!Lanes { first: 6, count: 3 }.is_aligned() && !Lanes { first: 8, count: 1 }.is_aligned());
        assert!(!Lanes { first: 128, count: 128 }.is_aligned() && !Lanes { first: 0, count: 0 }.is_aligned());
        assert!((0..16).all(|k| block.slot(32 + block.lanes.row(k) as u32) == k));
    }

    /// Every plan's `--plan` spelling parses back to it, and a bad field is named.
    #[test]
    fn plan_spellings_round_trip() {
        let stacked = |layers_per_region, wafer_percent, kv_copies, experts_per_lane| Plan::Stacked {
            layers_per_region,
            wafer_percent,
            kv_copies,
            experts_per_lane,
            kv_spread: 1,
            kv_slices: 1,
        };
        let plans = [
            (Plan::Tiled, "tiled"),
            (Plan::MeshGemv { p: 660, group_num: 22 }, "meshgemv:660,22"),
            (stacked(2, 100, 1, 1), "stacked:2"),
            (stacked(1, 35, 1, 1), "stacked:1,35"),
            (stacked(4, 100, 2, 1), "stacked:4,100,kv2"),
            (stacked(2, 100, 8, 2), "stacked:2,100,kv8,share2"),
            (stacked(2, 100, 1, 4), "stacked:2,100,share4"),
            (
                Plan::Stacked {
                    layers_per_region: 4,
                    wafer_percent: 100,
                    kv_copies: 4,
                    experts_per_lane: 1,
                    kv_spread: 2,
                    kv_slices: 1,
                },
                "stacked:4,100,kv4,spread2",
            ),
            (Plan::stacked(4).with_kv_slices(4), "stacked:4,100,slice4"),
        ];
        for (plan, text) in plans {
            assert_eq!(plan.to_string(), text);
            assert_eq!(text.parse::<Plan>(), Ok(plan), "{text}");
        }
        assert_eq!("stacked:2,100,share2,kv8".parse::<Plan>(), Ok(stacked(2, 100, 8, 2)));
        for (bad, names) in [
            ("stacked:0", "K must be"),
            ("stacked:1,101", "P must be"),
            ("stacked:1,100,kv0", "\"kv0\""),
            ("stacked:1,100,share2,share4", "\"share4\""),
            ("stacked:1,100,spread3", "\"spread3\": spreadL spreads"),
            ("stacked:1,100,spread2,spread4", "\"spread4\""),
            ("stacked:1,100,slice3", "\"slice3\": sliceD cuts"),
            ("stacked:1,100,slice2,slice2", "\"slice2\""),
            ("stacked:1,100,copies2", "unknown field \"copies2\""),
            ("mesh:1", "expected `tiled`"),
        ] {
            let error = bad.parse::<Plan>().expect_err(bad);
            assert!(error.contains(names), "{bad}: {error}");
        }
    }

    #[test]
    fn rope_parts_rotate_with_the_part_half_a_head_away() {
        assert_eq!(rope_twin(&(0..32), 128), Some(64..96));
        assert_eq!(rope_twin(&(352..384), 128), Some(288..320));
        assert_eq!(rope_twin(&(256..320), 128), Some(320..384));
        // Whole heads, and a part across a half's edge, have none.
        assert_eq!(rope_twin(&(0..128), 128), None);
        assert_eq!(rope_twin(&(128..384), 128), None);
        assert_eq!(rope_twin(&(32..96), 128), None);
    }

    #[test]
    fn reduce_tree_follows_the_chunk_tree() {
        assert!(reduce_tree(1, 0).is_empty());
        assert_eq!(reduce_tree(2, 0), [(0, 1)]);
        assert_eq!(reduce_tree(3, 0), [(0, 1), (0, 2)]);
        // 5 leaves: p = 8, so [0..4] + [4..5]; the lone right leaf joins last.
        assert_eq!(reduce_tree(5, 0), [(0, 1), (2, 3), (0, 2), (0, 4)]);
        assert_eq!(reduce_tree(8, 0).len(), 7);
    }

    #[test]
    fn reduce_tree_leads_toward_its_root() {
        // The same subtrees as with root 0; each accumulates on its leaf nearest the root.
        assert_eq!(reduce_tree(2, 1), [(1, 0)]);
        assert_eq!(reduce_tree(5, 2), [(1, 0), (2, 3), (2, 1), (2, 4)]);
        assert_eq!(reduce_tree(5, 4), [(1, 0), (3, 2), (3, 1), (4, 3)]);
        // Every leaf but the root sends exactly once, whatever the root.
        for root in 0..8 {
            let mut senders: Vec<usize> = reduce_tree(8, root).iter().map(|&(_, s)| s).collect();
            senders.sort_unstable();
            assert_eq!(senders, (0..8).filter(|&l| l != root).collect::<Vec<_>>(), "root {root}");
        }
    }

    #[test]
    fn runs_list_their_hops() {
        let run = Run { from: Pe::new(0, 3, 2), to: Pe::new(0, 1, 2), messages: 1 };
        assert_eq!(
            run.hops().collect::<Vec<_>>(),
            [(Pe::new(0, 3, 2), Pe::new(0, 2, 2)), (Pe::new(0, 2, 2), Pe::new(0, 1, 2))]
        );
        assert_eq!(run.pes().len(), 3);
        let hop = Run { from: Pe::new(0, 0, 0), to: Pe::new(1, 0, 0), messages: 1 };
        assert!(hop.is_inter_wafer());
        assert_eq!(hop.hops().len(), 1);
        let bent = Run { from: Pe::new(0, 0, 0), to: Pe::new(0, 1, 1), messages: 1 };
        assert_eq!(bent.hops().len(), 0);
    }
}
