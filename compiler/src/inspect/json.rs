//! The full placement as JSON, built or streamed by one serializer.

use std::io;
use std::ops::Range;

use serde::ser::{SerializeStruct, Serializer};
use serde::Serialize;
use waferc_ir::wafer::{
    wide, InstrPlacement, Lanes, Pe, PeImage, Plan, ReduceOp, Region, RegionKind, ResultLayout, Route, RouteKind, Run,
    WaferProgram, Work,
};
use waferc_ir::Module;

use super::analysis::{route_bytes_per_step, Analysis, Part, SramKind};
use super::summary::route_kind_name;
use super::Filter;

/// The `schema` field of [`placement_json`]; bumped when a field changes meaning or goes away.
pub const PLACEMENT_SCHEMA: &str = "waferc.placement.v1";

/// The whole placement as one JSON object (`waferc inspect --json`).
///
/// Conventions: a PE is `[wafer, x, y]` (`x` the column, `y` the row); a range is `[start, end]`,
/// end exclusive; indices of instructions are IR value indices (`%N` in the IR text); sizes are
/// bytes; loads are per decode step (one token). Keys are sorted; arrays are in program order
/// (instructions; then each one's tiles in row-major tile order, KV blocks by KV head and
/// position, segments in element order), route id order, or PE order (wafer, then `x`, then
/// `y`), so the same program and filter always give the same text. Fields marked *if* are absent
/// otherwise. The [`Filter`] applies: with a layer, only that layer's instructions, tiles, KV
/// blocks, segments and routes (those it computes or receives) and the PEs holding any of its
/// regions; with a rectangle or wafer, only the tiles, KV blocks, segments and PEs there and the
/// routes with any PE there (`instructions` are restricted by the layer alone).
///
/// Top level:
/// * `schema`: [`PLACEMENT_SCHEMA`].
/// * `target`: `name`, `grid_cols`, `grid_rows`, `wafers`, `sram_bytes_per_pe`,
///   `code_reserve_bytes`, `clock_hz`, `link_bytes_per_cycle`, `hop_latency_cycles`,
///   `colours_per_pe`, `f32_fma_per_cycle`, `inter_wafer_latency_cycles`,
///   `inter_wafer_bytes_per_cycle` (as in `waferc targets`).
/// * `plan`: `{"kind": "tiled"}`, `{"kind": "mesh_gemv", "p", "group_num"}` or `{"kind":
///   "stacked", "layers_per_region", "wafer_percent", "kv_copies", "experts_per_lane",
///   "kv_spread"}`, and `"kv_slices"` when each KV head's cache is cut in slices of its head
///   dimension.
/// * `max_context`: KV capacity in positions. `tile_blob_len`: bytes of packed weights.
///   `weights_present`: false for a shape-only compile.
/// * `model`: `{"architecture", "num_layers", "vocab_size"}` when the module was given, else null.
/// * `filter`: `{"layer", "region": {"x", "y", "w", "h"}, "wafer"}`, each null when not set.
/// * `instructions`, `tiles`, `kv_blocks`, `segments`, `routes`, `pes`: arrays, below.
///
/// Every element of `instructions`, `tiles`, `kv_blocks`, `segments` and `routes` names its
/// instruction: `instr`, `op` (`matvec`, `attention`, ...), `layer` (null for the embedding and
/// the head), `expert` (the MoE expert, else null).
///
/// * `instructions[]`: also `part` (`"embedding"`, `"layer"`, `"head"`), `result` (`{"kind":
///   "vector", "elements", "segments"}`: length and segment count, or `{"kind": "routing", "pe"}`),
///   `operand_routes` and `deliveries` (route ids, as in the program).
/// * `tiles[]`: one per weight tile, each exactly once: `kind` `"matvec"` (a tile of a matvec's
///   grid: `row_block`, `col_block`, `rows` = output rows, `chunks` = 32-element reduction
///   chunks) or `"embed"` (a block of the embedding table: `rows` = token rows, `elements` =
///   columns of the row); `pe`; `region` (index into the PE's `regions`, null if the PE has no
///   such region); `bytes` (of that weight region); `weight` and *if the module was given*
///   `weight_name` (the IR weight).
/// * `kv_blocks[]`: one per attention KV block: `kv_head`, `query_heads` (which of the KV
///   head's query heads its placement serves: all, or a copy's share), `positions` (capacity),
///   `lanes` (`[first, end)` of each chunk's 8 lanes it holds: `[0, 8]` unless the plan spreads
///   a block over PEs by lane), `dims` (`[first, end)` of each head vector it holds: all of
///   them unless the plan cuts the head dimension in slices), `pe`, `region`, `bytes`.
/// * `segments[]`: one per piece of a vector result: `pe`, `elements`. An `expert_dispatch`'s
///   segments are its input's (the result aliases it; no SRAM of its own).
/// * `routes[]`: `id`, `kind` (`operand`, `collect`, `reduce`, `statistic`, `routing`), `colour`,
///   `sources`, `destinations` (PEs), `path` (runs `{"from", "to", "messages"}`: a straight line
///   of neighbour hops, or one inter-wafer hop, crossed by `messages` messages per token),
///   `message_bytes`, `links` (neighbour and inter-wafer hops of the path), `bytes_per_token`
///   (`message_bytes` x messages over every hop), *if operand* `value` and `elements` (the
///   segment of `value` carried), *if collect* `elements`, *if reduce* `reduce_op` (`sum`,
///   `max`) and `elements` (`[0, n]`, the partials' length), *if statistic* `elements` (`[0, n]`).
///   `instr`, `layer`, `expert` and `op` are the route's producer's (for an operand route, the
///   instruction whose result it carries).
/// * `pes[]`: one per PE holding anything: `pe`, `used_bytes` (all regions, code included),
///   `bytes` (`{"weights", "kv", "buffers", "code"}`: buffers are operands, partial sums,
///   results and scratch), `colours` (distinct colours of all routes through the PE's router),
///   `owner` (`{"part", "layer", "expert"}`: the part holding most of the PE's bytes (of the
///   filtered layer, with a layer filter), or null), `regions`.
/// * `pes[].regions[]`: `offset`, `bytes`, `instr` (null for the code reserve), `kind`
///   (`code`, `weight`, `kv_cache`, `operand`, `partial`, `output`, `scratch`); *if weight*
///   `weight`, `rows`, `cols` (element range of the last axis) and `blob` (byte range in the tile
///   blob); *if kv_cache* `kv_head`, `positions`, `lanes`, `dims`; *if operand* `value`, `elements`; *if partial*
///   `elements` (`[0, n]`); *if output* `elements`.
pub fn placement_json(program: &WaferProgram, module: Option<&Module>, filter: &Filter) -> serde_json::Value {
    let view = Analysis::new(program, module, filter);
    serde_json::to_value(Document::new(&view)).expect("the placement document has only string keys")
}

/// Writes [`placement_json`]'s document to `out` as it goes, without building it in memory (a
/// full-wafer program has about a million PEs). `pretty` indents it.
pub fn write_placement_json(
    program: &WaferProgram,
    module: Option<&Module>,
    filter: &Filter,
    out: &mut dyn io::Write,
    pretty: bool,
) -> serde_json::Result<()> {
    let view = Analysis::new(program, module, filter);
    let document = Document::new(&view);
    if pretty {
        serde_json::to_writer_pretty(out, &document)
    } else {
        serde_json::to_writer(out, &document)
    }
}

/// A sequence serialised from an iterator made on demand, so that streaming never collects it.
struct Lazy<F>(F);

impl<F, I> Serialize for Lazy<F>
where
    F: Fn() -> I,
    I: Iterator,
    I::Item: Serialize,
{
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq((self.0)())
    }
}

struct Document<'v, 'a> {
    view: &'v Analysis<'a>,
    /// Colours in use per PE of each wafer (`y * grid_cols + x`), indexed by wafer.
    colours: Vec<Vec<u16>>,
    /// Where each PE image's weight bytes start in the tile blob (by position in `pes`).
    blob_starts: Vec<u64>,
}

impl<'v, 'a> Document<'v, 'a> {
    fn new(view: &'v Analysis<'a>) -> Self {
        let colours = (0..view.program.target.wafers)
            .map(|w| if view.wafers().contains(&w) { view.colours_in_use(w) } else { Vec::new() })
            .collect();
        let blob_starts = view.program.blob_starts().collect();
        Document { view, colours, blob_starts }
    }
}

// Fields of every object are written in alphabetical order, so the streamed text and the
// `serde_json::Value` (a sorted map) agree key for key.
impl Serialize for Document<'_, '_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let view = self.view;
        let program = view.program;
        let mut doc = serializer.serialize_struct("Placement", 16)?;
        doc.serialize_field("filter", &FilterJson::of(view.filter))?;
        doc.serialize_field("instructions", &Lazy(|| instructions(view)))?;
        doc.serialize_field("kv_blocks", &Lazy(|| kv_blocks(view)))?;
        doc.serialize_field("max_context", &program.max_context)?;
        doc.serialize_field("model", &view.module.map(ModelJson::of))?;
        doc.serialize_field("pes", &Lazy(|| view.kept_images().map(|image| self.pe_json(image))))?;
        doc.serialize_field("plan", &PlanJson::of(program.plan))?;
        doc.serialize_field("routes", &Lazy(|| view.kept_routes().map(|route| RouteJson::of(view, route))))?;
        doc.serialize_field("schema", PLACEMENT_SCHEMA)?;
        doc.serialize_field("segments", &Lazy(|| segments(view)))?;
        doc.serialize_field("target", &TargetJson::of(program))?;
        doc.serialize_field("tile_blob_len", &program.tile_blob_len)?;
        doc.serialize_field("tiles", &Lazy(|| tiles(view)))?;
        doc.serialize_field("weights_present", &program.weights_present)?;
        doc.end()
    }
}

type PeJson = [u16; 3];

fn pe(pe: Pe) -> PeJson {
    [pe.wafer, pe.x, pe.y]
}

fn range<T: Copy>(range: &Range<T>) -> [T; 2] {
    [range.start, range.end]
}

fn part_name(part: Part) -> &'static str {
    match part {
        Part::Embedding => "embedding",
        Part::Layer(_) => "layer",
        Part::Head => "head",
    }
}

#[derive(Serialize)]
struct FilterJson {
    layer: Option<u32>,
    region: Option<RectJson>,
    wafer: Option<u16>,
}

#[derive(Serialize)]
struct RectJson {
    h: u16,
    w: u16,
    x: u16,
    y: u16,
}

impl FilterJson {
    fn of(filter: &Filter) -> Self {
        FilterJson {
            layer: filter.layer,
            region: filter.region.map(|r| RectJson { h: r.h, w: r.w, x: r.x, y: r.y }),
            wafer: filter.wafer,
        }
    }
}

#[derive(Serialize)]
struct ModelJson<'a> {
    architecture: &'a str,
    num_layers: u32,
    vocab_size: u32,
}

impl<'a> ModelJson<'a> {
    fn of(module: &'a Module) -> Self {
        ModelJson {
            architecture: &module.meta.architecture,
            num_layers: module.meta.num_layers,
            vocab_size: module.meta.vocab_size,
        }
    }
}

#[derive(Serialize)]
struct PlanJson {
    #[serde(skip_serializing_if = "Option::is_none")]
    group_num: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    experts_per_lane: Option<u8>,
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_copies: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_slices: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_spread: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    layers_per_region: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    wafer_percent: Option<u8>,
}

impl PlanJson {
    fn of(plan: Plan) -> Self {
        match plan {
            Plan::Tiled => PlanJson {
                group_num: None,
                experts_per_lane: None,
                kind: "tiled",
                kv_copies: None,
                kv_slices: None,
                kv_spread: None,
                layers_per_region: None,
                p: None,
                wafer_percent: None,
            },
            Plan::MeshGemv { p, group_num } => PlanJson {
                group_num: Some(group_num),
                experts_per_lane: None,
                kind: "mesh_gemv",
                kv_copies: None,
                kv_slices: None,
                kv_spread: None,
                layers_per_region: None,
                p: Some(p),
                wafer_percent: None,
            },
            Plan::Stacked { layers_per_region, wafer_percent, kv_copies, experts_per_lane, kv_spread, kv_slices } => {
                PlanJson {
                    group_num: None,
                    experts_per_lane: Some(experts_per_lane),
                    kind: "stacked",
                    kv_copies: Some(kv_copies),
                    kv_slices: (kv_slices != 1).then_some(kv_slices),
                    kv_spread: Some(kv_spread),
                    layers_per_region: Some(layers_per_region),
                    p: None,
                    wafer_percent: Some(wafer_percent),
                }
            }
        }
    }
}

#[derive(Serialize)]
struct TargetJson<'a> {
    clock_hz: f64,
    code_reserve_bytes: u32,
    colours_per_pe: u8,
    f32_fma_per_cycle: f64,
    grid_cols: u16,
    grid_rows: u16,
    hop_latency_cycles: u32,
    inter_wafer_bytes_per_cycle: f64,
    inter_wafer_latency_cycles: u64,
    link_bytes_per_cycle: u32,
    name: &'a str,
    sram_bytes_per_pe: u32,
    wafers: u16,
}

impl<'a> TargetJson<'a> {
    fn of(program: &'a WaferProgram) -> Self {
        let t = &program.target;
        TargetJson {
            clock_hz: t.clock_hz,
            code_reserve_bytes: t.code_reserve_bytes,
            colours_per_pe: t.colours_per_pe,
            f32_fma_per_cycle: t.f32_fma_per_cycle,
            grid_cols: t.grid_cols,
            grid_rows: t.grid_rows,
            hop_latency_cycles: t.hop_latency_cycles,
            inter_wafer_bytes_per_cycle: t.inter_wafer_bytes_per_cycle,
            inter_wafer_latency_cycles: t.inter_wafer_latency_cycles,
            link_bytes_per_cycle: t.link_bytes_per_cycle,
            name: &t.name,
            sram_bytes_per_pe: t.sram_bytes_per_pe,
            wafers: t.wafers,
        }
    }
}

#[derive(Serialize)]
struct InstructionJson<'a> {
    deliveries: &'a [u32],
    expert: Option<u32>,
    instr: u32,
    layer: Option<u32>,
    op: &'a str,
    operand_routes: &'a [u32],
    part: &'static str,
    result: ResultJson,
}

#[derive(Serialize)]
struct ResultJson {
    #[serde(skip_serializing_if = "Option::is_none")]
    elements: Option<u64>,
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pe: Option<PeJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    segments: Option<usize>,
}

fn instructions<'a>(view: &'a Analysis) -> impl Iterator<Item = InstructionJson<'a>> + 'a {
    let kept = view.program.instrs.iter().enumerate().filter(|(i, _)| view.instr_kept(*i as u32));
    kept.map(|(i, placement)| InstructionJson {
        deliveries: &placement.deliveries,
        expert: placement.expert,
        instr: i as u32,
        layer: placement.layer,
        op: &placement.op,
        operand_routes: &placement.operand_routes,
        part: view.part(i as u32).map_or("head", part_name),
        result: match &placement.result {
            ResultLayout::Vector(layout) => ResultJson {
                elements: Some(layout.len()),
                kind: "vector",
                pe: None,
                segments: Some(layout.segments.len()),
            },
            ResultLayout::Routing { pe: at } => {
                ResultJson { elements: None, kind: "routing", pe: Some(pe(*at)), segments: None }
            }
        },
    })
}

/// The instructions the layer filter keeps, with their indices.
fn kept_instrs<'a>(view: &'a Analysis) -> impl Iterator<Item = (u32, &'a InstrPlacement)> + 'a {
    let instrs = view.program.instrs.iter().enumerate().map(|(i, p)| (i as u32, p));
    instrs.filter(|(i, _)| view.instr_kept(*i))
}

#[derive(Serialize)]
struct TileJson<'a> {
    bytes: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    chunks: Option<[u64; 2]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    col_block: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    elements: Option<[u64; 2]>,
    expert: Option<u32>,
    instr: u32,
    kind: &'static str,
    layer: Option<u32>,
    op: &'a str,
    pe: PeJson,
    region: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    row_block: Option<u32>,
    rows: [u64; 2],
    weight: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    weight_name: Option<&'a str>,
}

fn tiles<'a>(view: &'a Analysis) -> impl Iterator<Item = TileJson<'a>> + 'a {
    kept_instrs(view).flat_map(move |(instr, placement)| {
        let base = move |at: Pe, region: Option<(u32, &Region)>| {
            let weight = region.and_then(|(_, r)| match r.kind {
                RegionKind::Weight { weight, .. } => Some(weight),
                _ => None,
            });
            TileJson {
                bytes: region.map_or(0, |(_, r)| r.bytes),
                chunks: None,
                col_block: None,
                elements: None,
                expert: placement.expert,
                instr,
                kind: "",
                layer: placement.layer,
                op: &placement.op,
                pe: pe(at),
                region: region.map(|(index, _)| index),
                row_block: None,
                rows: [0, 0],
                weight,
                weight_name: weight.and_then(|w| view.weight_name(w)),
            }
        };
        let tiles: Vec<TileJson<'a>> = match &placement.work {
            Work::MatVec(matvec) => {
                let col_blocks = matvec.col_blocks.max(1) as usize;
                let in_view = matvec.tiles.iter().enumerate().filter(|(_, t)| view.filter.contains(t.pe));
                in_view
                    .map(|(i, tile)| TileJson {
                        chunks: Some(range(&wide(&tile.chunks))),
                        col_block: Some((i % col_blocks) as u32),
                        kind: "matvec",
                        row_block: Some((i / col_blocks) as u32),
                        rows: range(&wide(&tile.rows)),
                        ..base(tile.pe, region_at(view.program, tile.pe, tile.region))
                    })
                    .collect()
            }
            Work::Embed { blocks, .. } => blocks
                .iter()
                .filter(|block| view.filter.contains(block.pe))
                .map(|block| TileJson {
                    elements: Some(range(&block.elements)),
                    kind: "embed",
                    rows: range(&block.rows),
                    ..base(block.pe, embed_region(view.program, instr, block.pe, &block.rows, &block.elements))
                })
                .collect(),
            _ => Vec::new(),
        };
        tiles
    })
}

fn region_at(program: &WaferProgram, at: Pe, index: u32) -> Option<(u32, &Region)> {
    program.pe(at)?.regions.get(index as usize).map(|r| (index, r))
}

/// The weight region of an embedding block (blocks do not record their region index).
fn embed_region<'p>(
    program: &'p WaferProgram,
    instr: u32,
    at: Pe,
    rows: &Range<u64>,
    elements: &Range<u64>,
) -> Option<(u32, &'p Region)> {
    let image = program.pe(at)?;
    image.regions.iter().enumerate().find_map(|(i, region)| match &region.kind {
        RegionKind::Weight { rows: r, cols, .. }
            if region.instr == Some(instr) && wide(r) == *rows && wide(cols) == *elements =>
        {
            Some((i as u32, region))
        }
        _ => None,
    })
}

/// `[first, end)` of the lanes a KV block holds.
fn lanes(lanes: Lanes) -> [u16; 2] {
    [lanes.first as u16, lanes.end()]
}

#[derive(Serialize)]
struct KvBlockJson<'a> {
    bytes: u32,
    dims: [u32; 2],
    expert: Option<u32>,
    instr: u32,
    kv_head: u32,
    lanes: [u16; 2],
    layer: Option<u32>,
    op: &'a str,
    pe: PeJson,
    positions: [u32; 2],
    query_heads: [u32; 2],
    region: Option<u32>,
}

fn kv_blocks<'a>(view: &'a Analysis) -> impl Iterator<Item = KvBlockJson<'a>> + 'a {
    kept_instrs(view).flat_map(move |(instr, placement)| {
        let heads = match &placement.work {
            Work::Attention(attention) => attention.kv_heads_placed.as_slice(),
            _ => &[],
        };
        heads.iter().flat_map(move |head| {
            head.blocks.iter().filter(|block| view.filter.contains(block.pe)).map(move |block| {
                let region = region_at(view.program, block.pe, block.region);
                KvBlockJson {
                    bytes: region.map_or(0, |(_, r)| r.bytes),
                    dims: range(&head.dims),
                    expert: placement.expert,
                    instr,
                    kv_head: head.kv_head,
                    lanes: lanes(block.lanes),
                    layer: placement.layer,
                    op: &placement.op,
                    pe: pe(block.pe),
                    positions: range(&block.positions),
                    query_heads: range(&head.query_heads),
                    region: region.map(|(index, _)| index),
                }
            })
        })
    })
}

#[derive(Serialize)]
struct SegmentJson<'a> {
    elements: [u64; 2],
    expert: Option<u32>,
    instr: u32,
    layer: Option<u32>,
    op: &'a str,
    pe: PeJson,
}

fn segments<'a>(view: &'a Analysis) -> impl Iterator<Item = SegmentJson<'a>> + 'a {
    kept_instrs(view).flat_map(move |(instr, placement)| {
        let segments = match &placement.result {
            ResultLayout::Vector(layout) => layout.segments.as_slice(),
            ResultLayout::Routing { .. } => &[],
        };
        segments.iter().filter(|s| view.filter.contains(s.pe)).map(move |segment| SegmentJson {
            elements: range(&segment.elements),
            expert: placement.expert,
            instr,
            layer: placement.layer,
            op: &placement.op,
            pe: pe(segment.pe),
        })
    })
}

#[derive(Serialize)]
struct RouteJson<'a> {
    bytes_per_token: u64,
    colour: u8,
    destinations: Vec<PeJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    elements: Option<[u64; 2]>,
    expert: Option<u32>,
    id: u32,
    instr: u32,
    kind: &'static str,
    layer: Option<u32>,
    links: u64,
    message_bytes: u32,
    op: &'a str,
    path: Vec<RunJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reduce_op: Option<&'static str>,
    sources: Vec<PeJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<u32>,
}

#[derive(Serialize)]
struct RunJson {
    from: PeJson,
    messages: u16,
    to: PeJson,
}

impl<'a> RouteJson<'a> {
    fn of(view: &Analysis<'a>, route: &'a Route) -> Self {
        let producer = view.program.instrs.get(route.instr as usize);
        let (elements, value, reduce_op) = match &route.kind {
            RouteKind::Operand { value, elements } | RouteKind::Gather { value, elements } => {
                (Some(range(elements)), Some(*value), None)
            }
            RouteKind::Collect { elements } => (Some(range(elements)), None, None),
            RouteKind::Reduce { op, elements } => {
                let op = match op {
                    ReduceOp::Sum => "sum",
                    ReduceOp::Max => "max",
                };
                (Some([0, *elements as u64]), None, Some(op))
            }
            RouteKind::Statistic { elements } => (Some([0, *elements as u64]), None, None),
            RouteKind::Routing => (None, None, None),
        };
        RouteJson {
            bytes_per_token: route_bytes_per_step(route),
            colour: route.colour,
            destinations: route.destinations.iter().map(|&p| pe(p)).collect(),
            elements,
            expert: producer.and_then(|p| p.expert),
            id: route.id,
            instr: route.instr,
            kind: route_kind_name(&route.kind),
            layer: producer.and_then(|p| p.layer),
            links: route.path.iter().map(super::analysis::hop_count).sum(),
            message_bytes: route.message_bytes,
            op: producer.map_or("", |p| p.op.as_str()),
            path: route
                .path
                .iter()
                .map(|run: &Run| RunJson { from: pe(run.from), messages: run.messages, to: pe(run.to) })
                .collect(),
            reduce_op,
            sources: route.sources.iter().map(|&p| pe(p)).collect(),
            value,
        }
    }
}

#[derive(Serialize)]
struct PeImageJson {
    bytes: KindBytesJson,
    colours: u16,
    owner: Option<OwnerJson>,
    pe: PeJson,
    regions: Vec<RegionJson>,
    used_bytes: u64,
}

#[derive(Serialize)]
struct KindBytesJson {
    buffers: u64,
    code: u64,
    kv: u64,
    weights: u64,
}

#[derive(Serialize)]
struct OwnerJson {
    expert: Option<u32>,
    layer: Option<u32>,
    part: &'static str,
}

#[derive(Serialize)]
struct RegionJson {
    #[serde(skip_serializing_if = "Option::is_none")]
    blob: Option<[u64; 2]>,
    bytes: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    cols: Option<[u64; 2]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dims: Option<[u32; 2]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    elements: Option<[u64; 2]>,
    instr: Option<u32>,
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_head: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lanes: Option<[u16; 2]>,
    offset: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    positions: Option<[u32; 2]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rows: Option<[u64; 2]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    weight: Option<u32>,
}

impl RegionJson {
    /// `blob`: a weight region's bytes' range in the tile blob.
    fn of(region: &Region, blob: Option<Range<u64>>) -> Self {
        let mut json = RegionJson {
            blob: None,
            bytes: region.bytes,
            cols: None,
            elements: None,
            instr: region.instr,
            kind: "",
            dims: None,
            kv_head: None,
            lanes: None,
            offset: region.offset,
            positions: None,
            rows: None,
            value: None,
            weight: None,
        };
        json.kind = match &region.kind {
            RegionKind::Code => "code",
            RegionKind::Weight { weight, rows, cols } => {
                json.weight = Some(*weight);
                json.rows = Some(range(&wide(rows)));
                json.cols = Some(range(&wide(cols)));
                json.blob = blob.as_ref().map(range);
                "weight"
            }
            RegionKind::KvCache { kv_head, positions, lanes: held, dims } => {
                json.kv_head = Some(*kv_head);
                json.dims = Some(range(dims));
                json.positions = Some(range(positions));
                json.lanes = Some(lanes(*held));
                "kv_cache"
            }
            RegionKind::Operand { value, elements } => {
                json.value = Some(*value);
                json.elements = Some(range(elements));
                "operand"
            }
            RegionKind::Partial { elements } => {
                json.elements = Some([0, *elements as u64]);
                "partial"
            }
            RegionKind::Output { elements } => {
                json.elements = Some(range(elements));
                "output"
            }
            RegionKind::Scratch => "scratch",
        };
        json
    }
}

impl Document<'_, '_> {
    fn pe_json(&self, image: &PeImage) -> PeImageJson {
        let mut kinds = [0u64; 4];
        for region in &image.regions {
            kinds[SramKind::of(&region.kind) as usize] += region.bytes as u64;
        }
        let [weights, kv, buffers, code] = kinds;
        let cols = self.view.program.target.grid_cols as usize;
        let colours = self
            .colours
            .get(image.pe.wafer as usize)
            .and_then(|c| c.get(image.pe.y as usize * cols + image.pe.x as usize))
            .copied()
            .unwrap_or(0);
        PeImageJson {
            bytes: KindBytesJson { buffers, code, kv, weights },
            colours,
            owner: self.view.owner(image).map(|owner| OwnerJson {
                expert: owner.expert,
                layer: match owner.part {
                    Part::Layer(layer) => Some(layer),
                    _ => None,
                },
                part: part_name(owner.part),
            }),
            pe: pe(image.pe),
            regions: {
                let at = self.view.program.pes.binary_search_by_key(&image.pe, |i| i.pe).ok();
                let mut blob = vec![None; image.regions.len()];
                for (index, range) in image.blob_ranges(at.map_or(0, |at| self.blob_starts[at])) {
                    blob[index] = Some(range);
                }
                image.regions.iter().zip(blob).map(|(region, blob)| RegionJson::of(region, blob)).collect()
            },
            used_bytes: image.used_bytes(),
        }
    }
}
