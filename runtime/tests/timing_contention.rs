//! Link contention in the timing model, on hand-built programs (no compiler involved): two
//! matvecs read the same embedded vector, run at the same time on disjoint PEs, and reduce
//! their two tiles along a row. When the two reductions cross the same links, the one that
//! claims them second waits; when they use disjoint rows, neither does.

use waferc_ir::wafer::{
    EmbedBlock, InstrPlacement, MatVecPlacement, Pe, PeImage, Phase, Plan, ReduceOp, Region, RegionKind, ResultLayout,
    Route, RouteKind, Run, Segment, Step, Tile, VectorLayout, WaferProgram, Work,
};
use waferc_ir::{DType, ModelMeta, Module, Op, TensorType, WeightBytes};
use waferc_runtime::executor::{ExecOptions, Executor, StepSpan, StepTiming};
use waferc_targets::Target;

const VOCAB: u64 = 8;
const HIDDEN: u64 = 64;
const OUT: u64 = 16;

/// `embed -> matvec a` (the output) and `embed -> matvec b` beside it, shape-only.
fn module() -> Module {
    let mut module = Module::new(ModelMeta { vocab_size: OUT as u32, ..ModelMeta::default() });
    let t = module.add_weight("embed", TensorType::new(DType::F32, [VOCAB, HIDDEN]), WeightBytes::Absent);
    let wa = module.add_weight("a", TensorType::new(DType::BF16, [OUT, HIDDEN]), WeightBytes::Absent);
    let wb = module.add_weight("b", TensorType::new(DType::BF16, [OUT, HIDDEN]), WeightBytes::Absent);
    let x = module.push(Op::Embed { table: t }, None).unwrap();
    let a = module.push(Op::MatVec { x, weight: wa, bias: None }, Some(0)).unwrap();
    module.push(Op::MatVec { x, weight: wb, bias: None }, Some(0)).unwrap();
    module.output = Some(a);
    module
}

/// On a 2 x 16 grid: the embedding on (0, 0), matvec a's tiles on (1, 0) and (9, 0); matvec b's
/// on (2, b_row) and (10, b_row). With `b_row == 0` the reductions (9 -> 1 and 10 -> 2) share the
/// links from x9 to x2 of row 0.
fn program(b_row: u16) -> WaferProgram {
    let params = Target::grid(2, 16).params();
    let code = params.code_reserve_bytes;
    let pe = |x: u16, y: u16| Pe::new(0, x, y);
    let embed_pe = pe(0, 0);
    let (a0, a1, b0, b1) = (pe(1, 0), pe(9, 0), pe(2, b_row), pe(10, b_row));
    let region = |offset, bytes, instr, kind| Region { offset, bytes, instr, kind };
    let code_region = region(0, code, None, RegionKind::Code);
    let tile_bytes = (OUT * 32 * 2) as u32;
    let table_bytes = (VOCAB * HIDDEN * 4) as u32;
    let weight = |weight: u32, instr: u32, cols: std::ops::Range<u32>| {
        region(code, tile_bytes, Some(instr), RegionKind::Weight { weight, rows: 0..OUT as u32, cols })
    };
    let t = table_bytes as u64;
    let b = tile_bytes as u64;
    let mut pes = vec![
        PeImage {
            pe: embed_pe,
            regions: vec![
                code_region.clone(),
                region(
                    code,
                    table_bytes,
                    Some(0),
                    RegionKind::Weight { weight: 0, rows: 0..VOCAB as u32, cols: 0..HIDDEN as u32 },
                ),
            ],
        },
        PeImage { pe: a0, regions: vec![code_region.clone(), weight(1, 1, 0..32)] },
        PeImage { pe: a1, regions: vec![code_region.clone(), weight(1, 1, 32..64)] },
        PeImage { pe: b0, regions: vec![code_region.clone(), weight(2, 2, 0..32)] },
        PeImage { pe: b1, regions: vec![code_region, weight(2, 2, 32..64)] },
    ];
    pes.sort_by_key(|image| image.pe);
    let route = |id: u32, instr, kind, sources, destinations, path, message_bytes| Route {
        id,
        instr,
        kind,
        colour: id as u8,
        sources,
        destinations,
        path,
        message_bytes,
    };
    let run = |from, to| Run { from, to, messages: 1 };
    let reduce = RouteKind::Reduce { op: ReduceOp::Sum, elements: OUT as u32 };
    let routes = vec![
        route(0, 0, RouteKind::Collect { elements: 0..HIDDEN }, vec![embed_pe], vec![embed_pe], vec![], 256),
        // One multicast over both rows in either layout, so the delivery costs the same.
        route(
            1,
            0,
            RouteKind::Operand { value: 0, elements: 0..HIDDEN },
            vec![embed_pe],
            vec![a0, a1, b0, b1],
            vec![run(embed_pe, pe(10, 0)), run(embed_pe, pe(0, 1)), run(pe(0, 1), pe(10, 1))],
            256,
        ),
        route(2, 1, reduce.clone(), vec![a0, a1], vec![a0], vec![run(a1, a0)], 64),
        route(3, 1, RouteKind::Collect { elements: 0..OUT }, vec![a0], vec![a0], vec![], 64),
        route(4, 2, reduce, vec![b0, b1], vec![b0], vec![run(b1, b0)], 64),
        route(5, 2, RouteKind::Collect { elements: 0..OUT }, vec![b0], vec![b0], vec![], 64),
    ];
    let matvec = |instr: u32, t0: Pe, t1: Pe, reduction: u32, collect: u32| InstrPlacement {
        instr,
        op: "matvec".into(),
        layer: Some(0),
        expert: None,
        result: ResultLayout::Vector(VectorLayout { segments: vec![Segment { pe: t0, elements: 0..OUT }] }),
        operand_routes: vec![1],
        deliveries: vec![],
        work: Work::MatVec(MatVecPlacement {
            rows: OUT,
            cols: HIDDEN,
            row_blocks: 1,
            col_blocks: 2,
            tiles: vec![
                Tile { pe: t0, rows: 0..OUT as u32, chunks: 0..1, region: 1 },
                Tile { pe: t1, rows: 0..OUT as u32, chunks: 1..2, region: 1 },
            ],
            reductions: vec![reduction],
            broadcasts: vec![],
            bias: None,
            collects: vec![collect],
        }),
    };
    let instrs = vec![
        InstrPlacement {
            instr: 0,
            op: "embed".into(),
            layer: None,
            expert: None,
            result: ResultLayout::Vector(VectorLayout {
                segments: vec![Segment { pe: embed_pe, elements: 0..HIDDEN }],
            }),
            operand_routes: vec![],
            deliveries: vec![1],
            work: Work::Embed {
                blocks: vec![EmbedBlock { pe: embed_pe, rows: 0..VOCAB, elements: 0..HIDDEN }],
                collects: vec![0],
            },
        },
        matvec(1, a0, a1, 2, 3),
        matvec(2, b0, b1, 4, 5),
    ];
    let step = |instr, phase, routes: Vec<u32>| Step { instr, phase, routes };
    let schedule = vec![
        step(0, Phase::Gather, vec![0]),
        step(0, Phase::Deliver, vec![1]),
        step(1, Phase::Compute, vec![]),
        step(1, Phase::Reduce, vec![2]),
        step(1, Phase::Collect, vec![3]),
        step(2, Phase::Compute, vec![]),
        step(2, Phase::Reduce, vec![4]),
        step(2, Phase::Collect, vec![5]),
    ];
    WaferProgram {
        target: params,
        plan: Plan::Tiled,
        max_context: 8,
        pes,
        instrs,
        routes,
        schedule,
        tile_blob_len: t + 4 * b,
        weights_present: false,
        max_sequences: 1,
        routing_profile: None,
        replicas: Vec::new(),
    }
}

fn timing(program: &WaferProgram) -> StepTiming {
    let module = module();
    let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
    Executor::new(program, &module, None, options).unwrap().step(1).unwrap().timing
}

fn reduce_span(timing: &StepTiming, instr: u32) -> &StepSpan {
    timing.spans.iter().find(|s| s.instr == instr && s.phase == Phase::Reduce).unwrap()
}

#[test]
fn overlapping_reductions_on_shared_links_wait_and_disjoint_ones_do_not() {
    // (`waited_on` names the instruction whose message held the link a step waited for.)
    let (shared, disjoint) = (timing(&program(0)), timing(&program(1)));
    // Disjoint rows: the two matvecs overlap in time, and nothing waits.
    let (a, b) = (reduce_span(&disjoint, 1), reduce_span(&disjoint, 2));
    assert!(a.start_cycle < b.start_cycle + b.duration_cycles && b.start_cycle < a.start_cycle + a.duration_cycles);
    assert!(disjoint.spans.iter().all(|s| s.wait_cycles == 0), "{:#?}", disjoint.spans);
    // Shared links: a claims them first, b waits for them, and the step takes longer.
    let (a_shared, b_shared) = (reduce_span(&shared, 1), reduce_span(&shared, 2));
    assert_eq!(a_shared, a, "the first to claim the links does not wait");
    assert!(b_shared.wait_cycles > 0, "{b_shared:?}");
    assert_eq!(b_shared.waited_on, Some(1), "b waited for a's reduction: {b_shared:?}");
    assert_eq!(a_shared.waited_on, None);
    assert_eq!(b_shared.comm_cycles, b.comm_cycles, "the route itself costs the same");
    assert!(shared.cycles > disjoint.cycles, "{} > {}", shared.cycles, disjoint.cycles);
    // 64 bytes at the grid's link rate: b's route starts exactly when a's serialisation on the
    // shared links ends (each starts when its own tiles have the embedding: `reader_leads`).
    let link = Target::grid(2, 16).params().link_bytes_per_cycle as u64;
    let route_start = |s: &StepSpan| s.start_cycle + s.compute_cycles + s.wait_cycles;
    assert_eq!(route_start(b_shared), route_start(a_shared) + 64u64.div_ceil(link));
    // The critical path adds up to the step, compute + communication + waiting.
    for timing in [&shared, &disjoint] {
        assert_eq!(timing.layers.iter().map(|l| l.cycles).sum::<u64>(), timing.cycles);
        for layer in &timing.layers {
            assert_eq!(layer.cycles, layer.compute_cycles + layer.comm_cycles + layer.wait_cycles);
        }
    }
}
