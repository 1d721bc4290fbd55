//! `waferc::inspect` on hand-built placements whose every figure is known: the text summary,
//! the JSON and the SVG show exactly what the program holds, and filters restrict all three.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use waferc::inspect::{
    placement_json, placement_svg, summary_text, write_placement_json, ColourBy, Filter, FilterError, Rect,
    PLACEMENT_SCHEMA,
};
use waferc_ir::wafer::{
    narrow, AttentionPlacement, EmbedBlock, InstrIndex, InstrPlacement, KvBlock, KvHeadPlacement, Lanes,
    MatVecPlacement, NormPlacement, Pe, PeImage, Plan, ReduceOp, Region, RegionKind, ResultLayout, Route, RouteId,
    RouteKind, Run, Segment, TargetParams, Tile, VectorLayout, WaferProgram, Work,
};

/// Builds a program region by region, keeping SRAM offsets and the tile blob consistent.
struct Builder {
    target: TargetParams,
    images: BTreeMap<Pe, Vec<Region>>,
    instrs: Vec<InstrPlacement>,
    routes: Vec<Route>,
    blob: u64,
}

impl Builder {
    fn new(target: TargetParams) -> Self {
        Builder { target, images: BTreeMap::new(), instrs: Vec::new(), routes: Vec::new(), blob: 0 }
    }

    fn region(&mut self, pe: Pe, instr: InstrIndex, kind: RegionKind, bytes: u32) -> u32 {
        let code = Region { offset: 0, bytes: self.target.code_reserve_bytes, instr: None, kind: RegionKind::Code };
        let regions = self.images.entry(pe).or_insert_with(|| vec![code]);
        let offset = regions.iter().map(|r| r.offset + r.bytes).max().unwrap_or(0);
        regions.push(Region { offset, bytes, instr: Some(instr), kind });
        (regions.len() - 1) as u32
    }

    fn weight(
        &mut self,
        pe: Pe,
        instr: InstrIndex,
        weight: u32,
        rows: (u64, u64),
        cols: (u64, u64),
        bytes: u32,
    ) -> u32 {
        self.blob += bytes as u64;
        self.region(
            pe,
            instr,
            RegionKind::Weight { weight, rows: narrow(rows.0..rows.1), cols: narrow(cols.0..cols.1) },
            bytes,
        )
    }

    fn output(&mut self, pe: Pe, instr: InstrIndex, elements: (u64, u64)) -> Segment {
        self.region(
            pe,
            instr,
            RegionKind::Output { elements: elements.0..elements.1 },
            (elements.1 - elements.0) as u32 * 4,
        );
        Segment { pe, elements: elements.0..elements.1 }
    }

    fn operand(&mut self, pe: Pe, instr: InstrIndex, value: InstrIndex, elements: (u64, u64)) {
        let kind = RegionKind::Operand { value, elements: elements.0..elements.1 };
        self.region(pe, instr, kind, (elements.1 - elements.0) as u32 * 4);
    }

    #[allow(clippy::too_many_arguments)]
    fn route(
        &mut self,
        instr: InstrIndex,
        kind: RouteKind,
        colour: u8,
        sources: &[Pe],
        destinations: &[Pe],
        path: &[(Pe, Pe, u16)],
        message_bytes: u32,
    ) -> RouteId {
        let id = self.routes.len() as RouteId;
        self.routes.push(Route {
            id,
            instr,
            kind,
            colour,
            sources: sources.to_vec(),
            destinations: destinations.to_vec(),
            path: path.iter().map(|&(from, to, messages)| Run { from, to, messages }).collect(),
            message_bytes,
        });
        id
    }

    fn instr(&mut self, op: &str, layer: Option<u32>, expert: Option<u32>) -> InstrIndex {
        self.instrs.push(InstrPlacement {
            instr: self.instrs.len() as u32,
            op: op.to_string(),
            layer,
            expert,
            result: ResultLayout::Vector(VectorLayout::default()),
            operand_routes: Vec::new(),
            deliveries: Vec::new(),
            work: Work::Elementwise,
        });
        self.instrs.len() as InstrIndex - 1
    }

    fn set(
        &mut self,
        instr: InstrIndex,
        result: ResultLayout,
        work: Work,
        operands: &[RouteId],
        deliveries: &[RouteId],
    ) {
        let placement = &mut self.instrs[instr as usize];
        placement.result = result;
        placement.work = work;
        placement.operand_routes = operands.to_vec();
        placement.deliveries = deliveries.to_vec();
    }

    fn finish(self) -> WaferProgram {
        WaferProgram {
            target: self.target,
            plan: Plan::Tiled,
            max_context: 64,
            pes: self.images.into_iter().map(|(pe, regions)| PeImage { pe, regions }).collect(),
            instrs: self.instrs,
            routes: self.routes,
            schedule: Vec::new(),
            tile_blob_len: self.blob,
            weights_present: false,
            max_sequences: 1,
            routing_profile: None,
            replicas: Vec::new(),
        }
    }
}

fn target(cols: u16, rows: u16, wafers: u16) -> TargetParams {
    TargetParams {
        name: format!("grid:{rows}x{cols}"),
        grid_cols: cols,
        grid_rows: rows,
        wafers,
        sram_bytes_per_pe: 48 * 1024,
        code_reserve_bytes: 4096,
        clock_hz: 1.1e9,
        link_bytes_per_cycle: 4,
        hop_latency_cycles: 1,
        colours_per_pe: 24,
        f32_fma_per_cycle: 1.0,
        inter_wafer_latency_cycles: 2200,
        inter_wafer_bytes_per_cycle: 136.0,
    }
}

fn vector(segments: Vec<Segment>) -> ResultLayout {
    ResultLayout::Vector(VectorLayout { segments })
}

/// A 2-layer MoE-shaped program on an 8 x 6 grid (8 columns, 6 rows):
///
/// ```text
///   x 01234567
/// y 0 EEE0....   embedding blocks (0,0), (1,0), its result (2,0); layer 0's norm (3,0)
///   1 ...00000   q matvec tiles (3..4, 1..2), its result (5,1), KV blocks (6,1), (7,1)
///   2 ...00.0.   attention result (6,2)
///   3 11...1..   expert 0 tiles (0,3), (1,3); the router (5,3)
///   4 11......   expert 1 tiles (0,4), (1,4)
///   5 ..1...HH   the combine (2,5); the head's tiles (6,5), (7,5)
/// ```
///
/// With `two_wafers`, the head's tiles are on wafer 1 and the combine's result crosses over.
fn tiny_moe(two_wafers: bool) -> WaferProgram {
    let mut b = Builder::new(target(8, 6, if two_wafers { 2 } else { 1 }));
    let p = |x, y| Pe::new(0, x, y);
    let head_wafer = if two_wafers { 1 } else { 0 };
    let h = |x, y| Pe::new(head_wafer, x, y);

    let embed = b.instr("embed", None, None);
    let blocks = vec![
        EmbedBlock { pe: p(0, 0), rows: 0..32, elements: 0..64 },
        EmbedBlock { pe: p(1, 0), rows: 32..64, elements: 0..64 },
    ];
    for block in &blocks {
        b.weight(block.pe, embed, 0, (block.rows.start, block.rows.end), (0, 64), 4096);
    }
    let embed_out = b.output(p(2, 0), embed, (0, 64));
    let gather = b.route(
        embed,
        RouteKind::Collect { elements: 0..64 },
        0,
        &[p(0, 0), p(1, 0)],
        &[p(2, 0)],
        &[(p(0, 0), p(1, 0), 1), (p(1, 0), p(2, 0), 1)],
        256,
    );
    let embed_delivery = b.route(
        embed,
        RouteKind::Operand { value: embed, elements: 0..64 },
        1,
        &[p(2, 0)],
        &[p(3, 0)],
        &[(p(2, 0), p(3, 0), 1)],
        256,
    );
    b.set(embed, vector(vec![embed_out]), Work::Embed { blocks, collects: vec![gather] }, &[], &[embed_delivery]);

    let norm = b.instr("rms_norm", Some(0), None);
    b.operand(p(3, 0), norm, embed, (0, 64));
    b.weight(p(3, 0), norm, 1, (0, 1), (0, 64), 128);
    let norm_out = b.output(p(3, 0), norm, (0, 64));
    let tiles = [p(3, 1), p(4, 1), p(3, 2), p(4, 2)];
    let norm_delivery = b.route(
        norm,
        RouteKind::Operand { value: norm, elements: 0..64 },
        2,
        &[p(3, 0)],
        &tiles,
        &[(p(3, 0), p(3, 2), 1), (p(3, 1), p(4, 1), 1), (p(3, 2), p(4, 2), 1)],
        256,
    );
    let norm_work = Work::RmsNorm(NormPlacement { group_len: 64, group_routes: vec![] });
    b.set(norm, vector(vec![norm_out]), norm_work, &[embed_delivery], &[norm_delivery]);

    let q = b.instr("matvec", Some(0), None);
    let mut q_tiles = Vec::new();
    for (i, &pe) in tiles.iter().enumerate() {
        let (rows, chunks) = ((i as u64 / 2) * 32..(i as u64 / 2 + 1) * 32, i as u64 % 2..i as u64 % 2 + 1);
        b.operand(pe, q, norm, (chunks.start * 32, chunks.end * 32));
        let region = b.weight(pe, q, 2, (rows.start, rows.end), (chunks.start * 32, chunks.end * 32), 4096);
        q_tiles.push(Tile { pe, rows: narrow(rows), chunks: narrow(chunks), region });
    }
    let reduce_top = b.route(
        q,
        RouteKind::Reduce { op: ReduceOp::Sum, elements: 32 },
        3,
        &[p(3, 1), p(4, 1)],
        &[p(3, 1)],
        &[(p(4, 1), p(3, 1), 1)],
        128,
    );
    let reduce_bottom = b.route(
        q,
        RouteKind::Reduce { op: ReduceOp::Sum, elements: 32 },
        3,
        &[p(3, 2), p(4, 2)],
        &[p(3, 2)],
        &[(p(4, 2), p(3, 2), 1)],
        128,
    );
    let q_out = b.output(p(5, 1), q, (0, 64));
    let q_collect = b.route(
        q,
        RouteKind::Collect { elements: 0..64 },
        4,
        &[p(3, 1), p(3, 2)],
        &[p(5, 1)],
        &[(p(3, 1), p(5, 1), 1), (p(3, 2), p(5, 2), 1), (p(5, 2), p(5, 1), 1)],
        128,
    );
    let kv = [p(6, 1), p(7, 1)];
    let q_delivery =
        b.route(q, RouteKind::Operand { value: q, elements: 0..64 }, 5, &[p(5, 1)], &kv, &[(p(5, 1), p(7, 1), 1)], 256);
    let q_work = Work::MatVec(MatVecPlacement {
        rows: 64,
        cols: 64,
        row_blocks: 2,
        col_blocks: 2,
        tiles: q_tiles,
        reductions: vec![reduce_top, reduce_bottom],
        broadcasts: vec![],
        bias: None,
        collects: vec![q_collect],
    });
    b.set(q, vector(vec![q_out]), q_work, &[norm_delivery], &[q_delivery]);

    let attention = b.instr("attention", Some(0), None);
    let mut kv_blocks = Vec::new();
    for (i, &pe) in kv.iter().enumerate() {
        let positions = i as u32 * 32..(i as u32 + 1) * 32;
        b.operand(pe, attention, q, (0, 64));
        let region = b.region(
            pe,
            attention,
            RegionKind::KvCache { kv_head: 0, positions: positions.clone(), lanes: Lanes::ALL, dims: 0..64 },
            16384,
        );
        kv_blocks.push(KvBlock { pe, positions, lanes: Lanes::ALL, region });
    }
    let max_reduce = b.route(
        attention,
        RouteKind::Reduce { op: ReduceOp::Max, elements: 1 },
        6,
        &kv,
        &[p(6, 1)],
        &[(p(7, 1), p(6, 1), 1)],
        4,
    );
    let attention_out = b.output(p(6, 2), attention, (0, 64));
    let attention_collect = b.route(
        attention,
        RouteKind::Collect { elements: 0..64 },
        7,
        &[p(6, 1)],
        &[p(6, 2)],
        &[(p(6, 1), p(6, 2), 1)],
        256,
    );
    let experts = [p(0, 3), p(1, 3), p(0, 4), p(1, 4)];
    let attention_delivery = b.route(
        attention,
        RouteKind::Operand { value: attention, elements: 0..64 },
        8,
        &[p(6, 2)],
        &[p(5, 3), experts[0], experts[1], experts[2], experts[3]],
        &[(p(6, 2), p(6, 4), 1), (p(6, 3), p(0, 3), 1), (p(6, 4), p(0, 4), 1)],
        256,
    );
    let attention_work = Work::Attention(AttentionPlacement {
        heads: 1,
        kv_heads: 1,
        head_dim: 64,
        kv_heads_placed: vec![KvHeadPlacement {
            kv_head: 0,
            sequence: 0,
            query_heads: 0..1,
            dims: 0..64,
            blocks: kv_blocks,
            q_routes: vec![q_delivery],
            k_routes: vec![],
            v_routes: vec![],
            max_reduce: Some(max_reduce),
            max_broadcast: None,
            sum_reduce: None,
            sum_broadcast: None,
            out_reduce: None,
            score_reduce: Vec::new(),
            score_broadcast: Vec::new(),
        }],
        collects: vec![attention_collect],
    });
    b.set(attention, vector(vec![attention_out]), attention_work, &[q_delivery], &[attention_delivery]);

    let router = b.instr("router_topk", Some(1), None);
    b.operand(p(5, 3), router, attention, (0, 64));
    let combine_pe = p(2, 5);
    let routing = b.route(
        router,
        RouteKind::Routing,
        9,
        &[p(5, 3)],
        &[experts[0], experts[1], experts[2], experts[3], combine_pe],
        &[
            (p(5, 3), p(0, 3), 1),
            (p(0, 3), p(0, 4), 1),
            (p(0, 4), p(1, 4), 1),
            (p(5, 3), p(5, 5), 1),
            (p(5, 5), p(2, 5), 1),
        ],
        8,
    );
    b.set(router, ResultLayout::Routing { pe: p(5, 3) }, Work::Router { routing }, &[attention_delivery], &[routing]);

    let mut expert_outs = Vec::new();
    for expert in 0..2u16 {
        let dispatch = b.instr("expert_dispatch", Some(1), Some(expert as u32));
        let alias = vector(vec![Segment { pe: p(6, 2), elements: 0..64 }]);
        b.set(dispatch, alias, Work::Dispatch { routing }, &[attention_delivery, routing], &[]);
        let matvec = b.instr("matvec", Some(1), Some(expert as u32));
        let (left, right) = (p(0, 3 + expert), p(1, 3 + expert));
        let mut expert_tiles = Vec::new();
        for (c, pe) in [left, right].into_iter().enumerate() {
            b.operand(pe, matvec, attention, (c as u64 * 32, c as u64 * 32 + 32));
            let region = b.weight(pe, matvec, 3 + expert as u32, (0, 32), (c as u64 * 32, c as u64 * 32 + 32), 2048);
            expert_tiles.push(Tile { pe, rows: 0..32, chunks: c as u32..c as u32 + 1, region });
        }
        b.region(left, matvec, RegionKind::Partial { elements: 32 }, 128);
        let reduce = b.route(
            matvec,
            RouteKind::Reduce { op: ReduceOp::Sum, elements: 32 },
            10,
            &[left, right],
            &[left],
            &[(right, left, 1)],
            128,
        );
        let out = b.output(left, matvec, (0, 32));
        let collect = b.route(matvec, RouteKind::Collect { elements: 0..32 }, 11, &[left], &[left], &[], 128);
        expert_outs.push(left);
        let work = Work::MatVec(MatVecPlacement {
            rows: 32,
            cols: 64,
            row_blocks: 1,
            col_blocks: 2,
            tiles: expert_tiles,
            reductions: vec![reduce],
            broadcasts: vec![],
            bias: None,
            collects: vec![collect],
        });
        b.set(matvec, vector(vec![out]), work, &[attention_delivery], &[]);
    }

    let combine = b.instr("expert_combine", Some(1), None);
    let combine_out = b.output(combine_pe, combine, (0, 32));
    let combine_collect = b.route(
        combine,
        RouteKind::Collect { elements: 0..32 },
        12,
        &expert_outs,
        &[combine_pe],
        &[(p(0, 3), p(0, 5), 1), (p(0, 5), p(2, 5), 2)],
        128,
    );
    let head_tiles = [h(6, 5), h(7, 5)];
    let mut head_path = vec![(combine_pe, p(7, 5), 1)];
    if two_wafers {
        head_path = vec![
            (combine_pe, p(0, 5), 1),
            (p(0, 5), p(0, 0), 1),
            (p(0, 0), h(0, 0), 1),
            (h(0, 0), h(0, 5), 1),
            (h(0, 5), h(7, 5), 1),
        ];
    }
    let combine_delivery = b.route(
        combine,
        RouteKind::Operand { value: combine, elements: 0..32 },
        13,
        &[combine_pe],
        &head_tiles,
        &head_path,
        128,
    );
    let combine_work = Work::Combine { routing, collects: vec![combine_collect] };
    b.set(combine, vector(vec![combine_out]), combine_work, &[routing], &[combine_delivery]);

    let lm_head = b.instr("matvec", None, None);
    let mut lm_tiles = Vec::new();
    let mut lm_outs = Vec::new();
    let mut lm_collects = Vec::new();
    for (r, &pe) in head_tiles.iter().enumerate() {
        let rows = r as u64 * 32..(r as u64 + 1) * 32;
        b.operand(pe, lm_head, combine, (0, 32));
        let region = b.weight(pe, lm_head, 5, (rows.start, rows.end), (0, 32), 2048);
        lm_tiles.push(Tile { pe, rows: narrow(rows.clone()), chunks: 0..1, region });
        lm_outs.push(b.output(pe, lm_head, (rows.start, rows.end)));
        lm_collects.push(b.route(lm_head, RouteKind::Collect { elements: rows }, 14, &[pe], &[pe], &[], 128));
    }
    let lm_work = Work::MatVec(MatVecPlacement {
        rows: 64,
        cols: 32,
        row_blocks: 2,
        col_blocks: 1,
        tiles: lm_tiles,
        reductions: vec![],
        broadcasts: vec![],
        bias: None,
        collects: lm_collects,
    });
    b.set(lm_head, vector(lm_outs), lm_work, &[combine_delivery], &[]);
    b.finish()
}

/// The link loads of a program, from `WaferProgram::link_bytes` (the ir crate's own count).
fn busiest_link(program: &WaferProgram) -> u64 {
    program.link_bytes().into_iter().filter(|((a, b), _)| a.wafer == b.wafer).map(|(_, v)| v).max().unwrap()
}

fn all() -> Filter {
    Filter::all()
}

// ---- text summary ----

#[test]
fn summary_reports_use_of_the_grid() {
    let program = tiny_moe(false);
    let text = summary_text(&program, None, &all(), None);
    assert!(text.contains("PEs used: 20 of 48 (41.67%)"), "{text}");
    assert!(text.contains("target: 8 x 6 PEs (columns x rows) x 1 wafer, 49,152 bytes SRAM per PE"), "{text}");

    let mut used: Vec<u64> = program.pes.iter().map(|p| p.used_bytes()).collect();
    used.sort_unstable();
    let (min, median, max) = (used[0], used[(used.len() - 1) / 2], used[used.len() - 1]);
    let all_row = text.lines().find(|l| l.trim_start().starts_with("all ")).expect("an SRAM row for all regions");
    let figures: Vec<&str> = all_row.split_whitespace().collect();
    // The smallest PE holds the combine's result (4096 code + 128), the largest a KV block
    // (4096 code + 256 operand + 16384 KV).
    assert_eq!((min, median, max), (4096 + 128, 6400, 4096 + 256 + 16384));
    assert_eq!(figures[1..4], ["4,224", "6,400", "20,736"], "{all_row}");
    let kv_row = text.lines().find(|l| l.trim_start().starts_with("kv ")).unwrap();
    assert!(kv_row.contains("16,384") && kv_row.contains("32.00 KiB"), "{kv_row}");

    assert!(text.contains(&format!("routes: {}", program.routes.len())), "{text}");
    assert!(text.contains("(collect 8, operand 5, reduce 5, routing 1)"), "{text}");
    // The attention delivery (256 bytes), the routing (8) and expert 0's reduction (128) share
    // the link from (1,3) to (0,3).
    assert_eq!(busiest_link(&program), 392);
    assert!(text.contains("busiest link PE(w0, x1, y3) -> PE(w0, x0, y3): 392 bytes per token (98 cycles"), "{text}");
}

#[test]
fn summary_counts_colours_per_pe() {
    let program = tiny_moe(false);
    let text = summary_text(&program, None, &all(), None);
    // PE (0,3) is on the attention delivery, the routing, expert 0's reduce and collect and the
    // combine's collect: 5 colours; no PE has more.
    assert!(text.contains("colours per PE: max 5 of 24; 0 PEs at the limit"), "{text}");
}

#[test]
fn summary_lists_layer_and_expert_boxes() {
    let program = tiny_moe(false);
    let text = summary_text(&program, None, &all(), None);
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split_whitespace().collect()).collect();
    let has = |want: &[&str]| rows.iter().any(|r| r.as_slice() == want);
    assert!(has(&["embedding", "0", "3", "0-2", "0-0"]), "{text}");
    assert!(has(&["layer", "0", "0", "9", "3-7", "0-2"]), "{text}");
    assert!(has(&["layer", "1", "0", "6", "0-5", "3-5"]), "{text}");
    assert!(has(&["head", "0", "2", "6-7", "5-5"]), "{text}");
    assert!(has(&["layer", "1", "0", "0", "2", "0-1", "3-3"]), "{text}");
    assert!(has(&["layer", "1", "1", "0", "2", "0-1", "4-4"]), "{text}");
}

#[test]
fn summary_map_shows_each_pe_on_a_small_grid() {
    let program = tiny_moe(false);
    let text = summary_text(&program, None, &all(), None);
    let map: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("map of wafer 0")).collect();
    assert!(map[0].contains("one character per PE"), "{}", map[0]);
    assert_eq!(map[1].trim_end(), "      0");
    let expected =
        ["    0 EEE0....", "    1 ...00000", "    2 ...00.0.", "    3 11...1..", "    4 11......", "    5 ..1...HH"];
    assert_eq!(&map[2..8], &expected, "{text}");
    assert_eq!(map[8], "legend: E embedding, 0-1 layers 0-1, H head, . empty");
}

#[test]
fn summary_includes_the_modeled_speed_and_model() {
    let program = tiny_moe(false);
    let speed = "modeled speed: 12,345 tokens/s (89,000 cycles per token at 1.1 GHz)";
    let text = summary_text(&program, None, &all(), Some(speed));
    assert!(text.lines().any(|l| l == speed), "{text}");
    let mut module = waferc_ir::Module::new(waferc_ir::ModelMeta {
        architecture: "mixtral".into(),
        num_layers: 2,
        ..Default::default()
    });
    module.meta.vocab_size = 64;
    let text = summary_text(&program, Some(&module), &all(), None);
    assert!(text.starts_with("placement of mixtral, 2 layers on grid:6x8\n"), "{text}");
}

#[test]
fn summary_layer_filter_restricts_every_figure() {
    let program = tiny_moe(false);
    let filter = Filter { layer: Some(1), ..Filter::all() };
    let text = summary_text(&program, None, &filter, None);
    assert!(text.contains("filter: layer 1"), "{text}");
    assert!(text.contains("PEs holding layer 1: 6 of 48 (12.50%)"), "{text}");
    // Layer 1's routes: the routing, per expert a reduce and a collect, the combine's collect
    // and delivery, and the attention delivery it receives.
    assert!(text.contains("routes: 8 (collect 3, operand 2, reduce 2, routing 1)"), "{text}");
    assert!(!text.contains("embedding"), "{text}");
    let map: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("map of wafer 0")).collect();
    let expected =
        ["    0 ::::....", "    1 ...:::::", "    2 ...::.:.", "    3 11...1..", "    4 11......", "    5 ..1...::"];
    assert_eq!(&map[2..8], &expected, "{text}");
    assert!(map[8].contains("1 layer 1") && map[8].contains(": other layers (filtered out)"), "{}", map[8]);
}

#[test]
fn summary_region_filter_zooms_the_map() {
    let program = tiny_moe(false);
    let filter = Filter { region: Some(Rect { x: 3, y: 1, w: 2, h: 2 }), ..Filter::all() };
    let text = summary_text(&program, None, &filter, None);
    assert!(text.contains("PEs used: 4 of 4 (100.00%)"), "{text}");
    assert!(text.contains("map of wafer 0, x 3..5, y 1..3"), "{text}");
    let map: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("map of wafer 0")).collect();
    assert_eq!(&map[1..4], &["      3", "    1 00", "    2 00"], "{text}");
    // Routes meeting the square: the norm's delivery into the tiles, the two reductions and
    // the collect leaving it; the busiest link inside carries the delivery and a reduction.
    assert!(text.contains("routes: 4 (collect 1, operand 1, reduce 2)"), "{text}");
    assert!(text.contains("busiest link PE(w0, x3, y1) -> PE(w0, x4, y1): 384 bytes per token"), "{text}");
    let layer_rows: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|r| r.first() == Some(&"layer"))
        .collect();
    assert_eq!(layer_rows, vec![vec!["layer", "0", "0", "4", "3-4", "1-2"]]);
}

#[test]
fn summary_of_a_pipeline_reports_each_wafer_and_the_crossing() {
    let program = tiny_moe(true);
    let text = summary_text(&program, None, &all(), None);
    assert!(text.contains("PEs used: 20 of 96 (20.83%)"), "{text}");
    assert!(text.contains("  wafer 0: 18 of 48 (37.50%)"), "{text}");
    assert!(text.contains("  wafer 1: 2 of 48 (4.17%)"), "{text}");
    assert!(
        text.contains(
            "inter-wafer bytes per token: 128 B over 1 link; busiest PE(w0, x0, y0) -> PE(w1, x0, y0): 128 bytes"
        ),
        "{text}"
    );
    assert!(text.contains("map of wafer 1"), "{text}");
    let only_second = Filter { wafer: Some(1), ..Filter::all() };
    let text = summary_text(&program, None, &only_second, None);
    assert!(!text.contains("map of wafer 0") && text.contains("PEs used: 2 of 48"), "{text}");
}

// ---- JSON ----

#[test]
fn json_lists_every_tile_once_with_its_bytes() {
    let program = tiny_moe(false);
    let json = placement_json(&program, None, &all());
    assert_eq!(json["schema"], PLACEMENT_SCHEMA);
    let tiles = json["tiles"].as_array().unwrap();
    let mut expected = BTreeSet::new();
    for (instr, placement) in program.instrs.iter().enumerate() {
        match &placement.work {
            Work::MatVec(m) => {
                for t in &m.tiles {
                    let bytes = program.pe(t.pe).unwrap().regions[t.region as usize].bytes as u64;
                    expected.insert((
                        instr as u64,
                        [t.pe.wafer, t.pe.x, t.pe.y].map(u64::from),
                        t.rows.start as u64,
                        bytes,
                    ));
                }
            }
            Work::Embed { blocks, .. } => {
                for block in blocks {
                    expected.insert((
                        instr as u64,
                        [block.pe.wafer, block.pe.x, block.pe.y].map(u64::from),
                        block.rows.start,
                        4096,
                    ));
                }
            }
            _ => {}
        }
    }
    let listed: Vec<_> = tiles
        .iter()
        .map(|t| {
            let pe: Vec<u64> = t["pe"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
            (
                t["instr"].as_u64().unwrap(),
                [pe[0], pe[1], pe[2]],
                t["rows"][0].as_u64().unwrap(),
                t["bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(listed.len(), expected.len(), "a tile listed twice or missing");
    assert_eq!(listed.iter().cloned().collect::<BTreeSet<_>>(), expected);
    assert_eq!(listed.len(), 12);

    let q_tile = &tiles[3];
    assert_eq!(q_tile["kind"], "matvec");
    assert_eq!(q_tile["op"], "matvec");
    assert_eq!(q_tile["layer"], 0);
    assert_eq!(q_tile["row_block"], 0);
    assert_eq!(q_tile["col_block"], 1);
    assert_eq!(q_tile["chunks"], serde_json::json!([1, 2]));
    assert_eq!(q_tile["weight"], 2);
    let embed_tile = &tiles[0];
    assert_eq!(embed_tile["kind"], "embed");
    assert_eq!(embed_tile["elements"], serde_json::json!([0, 64]));
    assert_eq!(embed_tile["region"], 1);
    let expert_tile = tiles.iter().find(|t| t["expert"] == 1).unwrap();
    assert_eq!(expert_tile["pe"], serde_json::json!([0, 0, 4]));
}

#[test]
fn json_lists_kv_blocks_segments_routes_and_pes() {
    let program = tiny_moe(false);
    let json = placement_json(&program, None, &all());
    let kv = json["kv_blocks"].as_array().unwrap();
    assert_eq!(kv.len(), 2);
    assert_eq!(kv[1]["positions"], serde_json::json!([32, 64]));
    assert_eq!(kv[1]["bytes"], 16384);
    assert_eq!(kv[1]["query_heads"], serde_json::json!([0, 1]), "the one query head its KV head has");
    assert_eq!(kv[1]["dims"], serde_json::json!([0, 64]), "every element of the head vector");

    let segments: usize = program
        .instrs
        .iter()
        .map(|p| match &p.result {
            ResultLayout::Vector(v) => v.segments.len(),
            ResultLayout::Routing { .. } => 0,
        })
        .sum();
    assert_eq!(json["segments"].as_array().unwrap().len(), segments);

    let routes = json["routes"].as_array().unwrap();
    assert_eq!(routes.len(), program.routes.len());
    for (route, listed) in program.routes.iter().zip(routes) {
        assert_eq!(listed["id"], route.id);
        assert_eq!(listed["colour"], route.colour);
        assert_eq!(listed["message_bytes"], route.message_bytes);
        assert_eq!(listed["path"].as_array().unwrap().len(), route.path.len());
        let moved: u64 = route.path.iter().map(|r| r.hops().len() as u64 * r.messages as u64).sum::<u64>()
            * route.message_bytes as u64;
        assert_eq!(listed["bytes_per_token"], moved, "route {}", route.id);
    }
    let combine_collect = routes.iter().find(|r| r["kind"] == "collect" && r["op"] == "expert_combine").unwrap();
    assert_eq!(combine_collect["bytes_per_token"], (2 + 2 * 2) * 128);
    assert_eq!(combine_collect["elements"], serde_json::json!([0, 32]));
    let max_reduce = routes.iter().find(|r| r["reduce_op"] == "max").unwrap();
    assert_eq!(max_reduce["op"], "attention");

    let pes = json["pes"].as_array().unwrap();
    assert_eq!(pes.len(), program.pes.len());
    for (image, listed) in program.pes.iter().zip(pes) {
        assert_eq!(listed["used_bytes"], image.used_bytes());
        assert_eq!(listed["regions"].as_array().unwrap().len(), image.regions.len());
        let kinds = &listed["bytes"];
        let sum: u64 = ["weights", "kv", "buffers", "code"].iter().map(|k| kinds[*k].as_u64().unwrap()).sum();
        assert_eq!(sum, image.used_bytes());
    }
    let kv_pe = pes.iter().find(|p| p["pe"] == serde_json::json!([0, 7, 1])).unwrap();
    assert_eq!(kv_pe["owner"], serde_json::json!({"expert": null, "layer": 0, "part": "layer"}));
    assert_eq!(kv_pe["regions"][2]["kind"], "kv_cache");
    // The query delivery ends there and the max reduction starts there.
    assert_eq!(kv_pe["colours"], 2);
}

#[test]
fn json_streamed_equals_built_and_is_deterministic() {
    let program = tiny_moe(true);
    let built = placement_json(&program, None, &all());
    let mut streamed = Vec::new();
    write_placement_json(&program, None, &all(), &mut streamed, false).unwrap();
    let text = String::from_utf8(streamed).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), built);
    // Keys are written sorted, so the streamed text is the built value's text.
    assert_eq!(text, serde_json::to_string(&built).unwrap());
    let mut again = Vec::new();
    write_placement_json(&program, None, &all(), &mut again, true).unwrap();
    assert_eq!(serde_json::from_slice::<Value>(&again).unwrap(), built);
}

#[test]
fn json_filters_restrict_everything() {
    let program = tiny_moe(false);
    let json = placement_json(&program, None, &Filter { layer: Some(0), ..Filter::all() });
    assert_eq!(json["filter"]["layer"], 0);
    for list in ["tiles", "kv_blocks", "segments", "instructions"] {
        assert!(json[list].as_array().unwrap().iter().all(|t| t["layer"] == 0), "{list}");
    }
    assert_eq!(json["tiles"].as_array().unwrap().len(), 4);
    assert_eq!(json["pes"].as_array().unwrap().len(), 9);
    // Layer 0's routes, and the embedding's delivery into its norm.
    let routes: Vec<u64> = json["routes"].as_array().unwrap().iter().map(|r| r["id"].as_u64().unwrap()).collect();
    assert_eq!(routes, vec![1, 2, 3, 4, 5, 6, 7, 8, 9]);

    let square = Filter { region: Some(Rect { x: 0, y: 3, w: 2, h: 2 }), ..Filter::all() };
    let json = placement_json(&program, None, &square);
    let tiles = json["tiles"].as_array().unwrap();
    assert_eq!(tiles.len(), 4);
    assert!(tiles.iter().all(|t| t["expert"].is_u64()));
    assert_eq!(json["pes"].as_array().unwrap().len(), 4);
    assert!(json["routes"].as_array().unwrap().iter().all(|r| {
        let touches = |pes: &Value| {
            pes.as_array()
                .unwrap()
                .iter()
                .any(|pe| pe[1].as_u64() < Some(2) && (3..5).contains(&pe[2].as_u64().unwrap()))
        };
        touches(&r["sources"])
            || touches(&r["destinations"])
            || r["path"].as_array().unwrap().iter().any(|run| {
                let (a, b) = (&run["from"], &run["to"]);
                a[1].as_u64().unwrap().min(b[1].as_u64().unwrap()) < 2
                    && a[2].as_u64().unwrap().min(b[2].as_u64().unwrap()) < 5
                    && a[2].as_u64().unwrap().max(b[2].as_u64().unwrap()) >= 3
            })
    }));
}

// ---- SVG ----

fn parse(svg: &str) -> roxmltree::Document<'_> {
    roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("the SVG is not XML: {e}\n{svg}"))
}

fn with_class<'a, 'i>(doc: &'a roxmltree::Document<'i>, class: &str) -> Vec<roxmltree::Node<'a, 'i>> {
    doc.descendants().filter(|n| n.attribute("class") == Some(class)).collect()
}

#[test]
fn svg_draws_every_pe_a_legend_and_the_links() {
    let program = tiny_moe(false);
    let svg = placement_svg(&program, None, &all(), ColourBy::Layer);
    let doc = parse(&svg);
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let pes = with_class(&doc, "pe");
    assert_eq!(pes.len(), program.pes.len());
    let drawn: BTreeSet<&str> = pes.iter().map(|n| n.attribute("data-pe").unwrap()).collect();
    let expected: BTreeSet<String> =
        program.pes.iter().map(|i| format!("{},{},{}", i.pe.wafer, i.pe.x, i.pe.y)).collect();
    assert_eq!(drawn, expected.iter().map(String::as_str).collect());

    let keys: Vec<&str> = with_class(&doc, "legend-entry").iter().map(|n| n.attribute("data-key").unwrap()).collect();
    assert_eq!(keys, ["embedding", "layer 0", "layer 1", "head"]);
    // Each PE's fill is its legend entry's swatch.
    let swatch = |key: &str| {
        let entry =
            with_class(&doc, "legend-entry").into_iter().find(|n| n.attribute("data-key") == Some(key)).unwrap();
        entry.children().find(|c| c.has_tag_name("rect")).unwrap().attribute("fill").unwrap().to_string()
    };
    let fill_of =
        |pe: &str| pes.iter().find(|n| n.attribute("data-pe") == Some(pe)).unwrap().attribute("fill").unwrap();
    assert_eq!(fill_of("0,0,3"), swatch("layer 1"));
    assert_eq!(fill_of("0,7,5"), swatch("head"));
    assert_ne!(swatch("layer 0"), swatch("layer 1"));

    let heat = doc.descendants().find(|n| n.attribute("id") == Some("heat")).expect("a heat layer");
    let links: Vec<u64> = heat
        .children()
        .filter(|n| n.attribute("class") == Some("link"))
        .map(|n| n.attribute("data-bytes").unwrap().parse().unwrap())
        .collect();
    let undirected: BTreeSet<(Pe, Pe)> = program.link_bytes().keys().map(|&(a, b)| (a.min(b), a.max(b))).collect();
    assert_eq!(links.len(), undirected.len());
    assert_eq!(links.iter().max().copied(), Some(busiest_link(&program)));
    assert!(svg.contains("url(#heat-scale)"));
}

#[test]
fn svg_colours_by_expert() {
    let program = tiny_moe(false);
    let svg = placement_svg(&program, None, &all(), ColourBy::Expert);
    let doc = parse(&svg);
    let keys: Vec<&str> = with_class(&doc, "legend-entry").iter().map(|n| n.attribute("data-key").unwrap()).collect();
    assert_eq!(keys, ["expert 0", "expert 1", "outside experts"]);
    let fill = |pe: &str| {
        with_class(&doc, "pe")
            .into_iter()
            .find(|n| n.attribute("data-pe") == Some(pe))
            .unwrap()
            .attribute("fill")
            .unwrap()
            .to_string()
    };
    assert_eq!(fill("0,0,3"), fill("0,1,3"));
    assert_ne!(fill("0,0,3"), fill("0,0,4"));
    assert_eq!(fill("0,3,0"), fill("0,2,5"));
}

#[test]
fn svg_escapes_the_title_and_filters() {
    let program = tiny_moe(false);
    let module = waferc_ir::Module::new(waferc_ir::ModelMeta {
        architecture: "<script>&".into(),
        num_layers: 2,
        ..Default::default()
    });
    let filter = Filter { layer: Some(0), ..Filter::all() };
    let svg = placement_svg(&program, Some(&module), &filter, ColourBy::Layer);
    assert!(!svg.contains("<script>"));
    let doc = parse(&svg);
    let title = doc.descendants().find(|n| n.has_tag_name("text")).unwrap().text().unwrap();
    assert_eq!(title, "<script>&, 2 layers on grid:6x8: PEs coloured by layer");
    let keys: Vec<&str> = with_class(&doc, "legend-entry").iter().map(|n| n.attribute("data-key").unwrap()).collect();
    assert_eq!(keys, ["layer 0", "other layers (filtered out)"]);
    assert_eq!(with_class(&doc, "pe").len(), 20);
}

#[test]
fn svg_of_a_pipeline_has_a_panel_per_wafer_and_the_crossing() {
    let program = tiny_moe(true);
    let svg = placement_svg(&program, None, &all(), ColourBy::Layer);
    let doc = parse(&svg);
    assert!(doc.descendants().any(|n| n.attribute("id") == Some("wafer-0")));
    assert!(doc.descendants().any(|n| n.attribute("id") == Some("wafer-1")));
    let crossing = with_class(&doc, "inter-wafer");
    assert_eq!(crossing.len(), 1);
    assert_eq!(crossing[0].attribute("data-bytes"), Some("128"));
}

#[test]
fn svg_region_filter_zooms_to_the_rectangle() {
    let program = tiny_moe(false);
    // Reaches past the grid's right edge: clipped to columns 6 and 7.
    let filter = Filter { region: Some(Rect { x: 6, y: 0, w: 10, h: 3 }), ..Filter::all() };
    assert_eq!(filter.check(&program), Ok(()));
    let svg = placement_svg(&program, None, &filter, ColourBy::Layer);
    let doc = parse(&svg);
    let drawn: Vec<&str> = with_class(&doc, "pe").iter().map(|n| n.attribute("data-pe").unwrap()).collect();
    assert_eq!(drawn, ["0,6,1", "0,7,1", "0,6,2"]);
    assert!(svg.contains("wafer 0: x 6..8, y 0..3"));
    // Links inside: (6,1)-(7,1), the query delivery east (256 bytes) and the max reduction west
    // (4; a line shows the busier direction), and (6,1)-(6,2), the attention collect (256).
    let links = with_class(&doc, "link");
    let bytes: Vec<u64> = links.iter().map(|n| n.attribute("data-bytes").unwrap().parse().unwrap()).collect();
    assert_eq!(bytes, [256, 256]);
}

/// A program filling the first `rows` rows of a WSE-3-sized wafer, one layer per band of rows,
/// with a route along each row.
fn wide_program(rows: u16) -> WaferProgram {
    let mut t = target(755, 1170, 1);
    t.name = "wse3".into();
    let mut b = Builder::new(t);
    let layers = 32u16;
    for layer in 0..layers {
        b.instr("matvec", Some(layer as u32), None);
    }
    for y in 0..rows {
        let layer = (y * layers / rows) as u32;
        for x in 0..755 {
            b.weight(Pe::new(0, x, y), layer, 0, (0, 1), (0, 32), 20_000);
        }
        b.route(
            layer,
            RouteKind::Statistic { elements: 1 },
            (y % 24) as u8,
            &[Pe::new(0, 0, y)],
            &[Pe::new(0, 754, y)],
            &[(Pe::new(0, 0, y), Pe::new(0, 754, y), 1)],
            4 * (y as u32 + 1),
        );
    }
    b.finish()
}

#[test]
fn large_grids_are_drawn_in_blocks_and_mapped_in_100_columns() {
    let program = wide_program(400);
    let text = summary_text(&program, None, &all(), None);
    let map: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("map of wafer 0")).skip(1).collect();
    assert!(map.iter().all(|l| l.len() <= 102), "{text}");
    assert!(map.len() < 90, "{} lines", map.len());
    assert!(text.contains("each character 8 x 16 PEs"), "{text}");
    assert!(text.contains("PEs used: 302,000 of 883,350"), "{text}");
    assert!(text.contains("busiest link PE(w0, x0, y399) -> PE(w0, x1, y399): 1,600 bytes per token"), "{text}");

    let svg = placement_svg(&program, None, &all(), ColourBy::Layer);
    let doc = parse(&svg);
    let elements = doc.descendants().filter(|n| n.is_element()).count();
    assert!(elements <= 50_000, "{elements} elements");
    assert!(with_class(&doc, "pe").is_empty());
    let blocks = with_class(&doc, "block");
    assert_eq!(blocks.len(), 108 * 58, "7 x 7 blocks: 755 columns in 108, 400 rows in 58");
    assert_eq!(blocks[0].attribute("data-block"), Some("0,0,0,7,7"));
    let keys = with_class(&doc, "legend-entry");
    assert_eq!(keys.len(), 32);
    let heat = with_class(&doc, "heat-block");
    assert_eq!(heat.len(), 108 * 58);

    let mut out = Vec::new();
    write_placement_json(&program, None, &all(), &mut out, false).unwrap();
    let json: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(json["pes"].as_array().unwrap().len(), 302_000);
}

// ---- filters ----

#[test]
fn regions_parse_and_bad_ones_say_why() {
    assert_eq!("10,20,30,40".parse::<Rect>(), Ok(Rect { x: 10, y: 20, w: 30, h: 40 }));
    assert_eq!(" 1, 2 ,3,4".parse::<Rect>(), Ok(Rect { x: 1, y: 2, w: 3, h: 4 }));
    let message = |text: &str| text.parse::<Rect>().unwrap_err().to_string();
    assert_eq!(message("1,2,3"), "--region \"1,2,3\": expected 4 comma-separated numbers X,Y,W,H, found 3");
    assert_eq!(message("1,2,x,4"), "--region \"1,2,x,4\": W = \"x\" is not a number from 0 to 65535");
    assert_eq!(message("1,2,0,4"), "--region \"1,2,0,4\": width and height must be at least 1");
}

#[test]
fn filters_that_cannot_apply_are_rejected() {
    let program = tiny_moe(false);
    assert_eq!(Filter::all().check(&program), Ok(()));
    assert_eq!(
        Filter { layer: Some(7), ..Filter::all() }.check(&program),
        Err(FilterError::NoSuchLayer { layer: 7, placed: "layers 0 to 1".into() })
    );
    let outside = Filter { region: Some(Rect { x: 8, y: 0, w: 1, h: 1 }), ..Filter::all() };
    assert_eq!(
        outside.check(&program).unwrap_err().to_string(),
        "--region 8,0,1,1 starts outside the 8 x 6 PE grid (columns x rows)"
    );
    assert_eq!(
        Filter { wafer: Some(1), ..Filter::all() }.check(&program).unwrap_err().to_string(),
        "--wafer 1: the target has 1 wafer(s), numbered from 0"
    );
    let filter = Filter { layer: Some(1), region: Some(Rect { x: 0, y: 0, w: 4, h: 4 }), wafer: Some(0) };
    assert_eq!(filter.check(&program), Ok(()));
    assert_eq!(filter.describe(), "layer 1, x 0..4 y 0..4, wafer 0");
}
