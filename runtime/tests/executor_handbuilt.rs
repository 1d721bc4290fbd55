//! The executor on a program built by hand (no compiler involved): an embedding and a matvec
//! whose two tiles reduce along a row of PEs. Checks bits against the reference decoder, that
//! timing grows with distance, and that a malformed reduction path is named.

use half::bf16;
use waferc_ir::wafer::{
    EmbedBlock, InstrPlacement, MatVecPlacement, Pe, PeImage, Phase, Plan, ReduceOp, Region, RegionKind, ResultLayout,
    Route, RouteKind, Run, Segment, Step, Tile, VectorLayout, WaferProgram, Work,
};
use waferc_ir::{DType, ModelMeta, Module, Op, TensorType, WeightBytes};
use waferc_runtime::executor::{ExecError, ExecOptions, Executor};
use waferc_runtime::ReferenceDecoder;
use waferc_targets::Target;

const VOCAB: u64 = 8;
const HIDDEN: u64 = 64;
const OUT: u64 = 16;

/// `embed -> matvec` with random f32 embeddings and bf16 matrix.
fn module() -> (Module, Vec<u8>, Vec<u8>) {
    let mut seed = 0x1234_5678u64;
    let mut next = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let table: Vec<u8> = (0..VOCAB * HIDDEN).flat_map(|_| next().to_le_bytes()).collect();
    let matrix: Vec<u8> = (0..OUT * HIDDEN).flat_map(|_| bf16::from_f32(next()).to_le_bytes()).collect();
    let mut module = Module::new(ModelMeta { vocab_size: OUT as u32, ..ModelMeta::default() });
    let t = module.add_weight("embed", TensorType::new(DType::F32, [VOCAB, HIDDEN]), WeightBytes::owned(table.clone()));
    let w = module.add_weight("proj", TensorType::new(DType::BF16, [OUT, HIDDEN]), WeightBytes::owned(matrix.clone()));
    let x = module.push(Op::Embed { table: t }, None).unwrap();
    let y = module.push(Op::MatVec { x, weight: w, bias: None }, Some(0)).unwrap();
    module.output = Some(y);
    (module, table, matrix)
}

fn region(offset: u32, bytes: u32, instr: Option<u32>, kind: RegionKind) -> Region {
    Region { offset, bytes, instr, kind }
}

/// The program on a 1 x 16 row: the embedding on x0, tile (0, 0) on x1, tile (0, 1) on `far`.
fn program(far: u16) -> (WaferProgram, Vec<u8>) {
    let (_, table, matrix) = module();
    let params = Target::grid(1, 16).params();
    let code = params.code_reserve_bytes;
    let pe = |x: u16| Pe::new(0, x, 0);
    let (embed_pe, t0, t1) = (pe(0), pe(1), pe(far));
    // Each tile holds all 16 rows of one 32-element chunk.
    let half_rows = |cols: std::ops::Range<usize>| -> Vec<u8> {
        (0..OUT as usize).flat_map(|r| matrix[(r * 64 + cols.start) * 2..(r * 64 + cols.end) * 2].to_vec()).collect()
    };
    let mut blob = table.clone();
    let (tile0, tile1) = (half_rows(0..32), half_rows(32..64));
    let (b0, b1) = (blob.len() as u64, (blob.len() + tile0.len()) as u64);
    blob.extend(&tile0);
    blob.extend(&tile1);
    // The tile blob holds the regions' bytes in PE order: the table's, then each tile's.
    let weight_region = |weight: u32,
                         instr: u32,
                         rows: std::ops::Range<u32>,
                         cols: std::ops::Range<u32>,
                         blob: std::ops::Range<u64>| {
        region(code, (blob.end - blob.start) as u32, Some(instr), RegionKind::Weight { weight, rows, cols })
    };
    let code_region = region(0, code, None, RegionKind::Code);
    let pes = vec![
        PeImage {
            pe: embed_pe,
            regions: vec![code_region.clone(), weight_region(0, 0, 0..VOCAB as u32, 0..HIDDEN as u32, 0..b0)],
        },
        PeImage { pe: t0, regions: vec![code_region.clone(), weight_region(1, 1, 0..OUT as u32, 0..32, b0..b1)] },
        PeImage {
            pe: t1,
            regions: vec![code_region, weight_region(1, 1, 0..OUT as u32, 32..64, b1..blob.len() as u64)],
        },
    ];
    let route = |id, instr, kind, sources, destinations, path, message_bytes| Route {
        id,
        instr,
        kind,
        colour: id as u8,
        sources,
        destinations,
        path,
        message_bytes,
    };
    let routes = vec![
        route(0, 0, RouteKind::Collect { elements: 0..HIDDEN }, vec![embed_pe], vec![embed_pe], vec![], 256),
        route(
            1,
            0,
            RouteKind::Operand { value: 0, elements: 0..HIDDEN },
            vec![embed_pe],
            vec![t0, t1],
            vec![Run { from: embed_pe, to: t1, messages: 1 }],
            256,
        ),
        route(
            2,
            1,
            RouteKind::Reduce { op: ReduceOp::Sum, elements: OUT as u32 },
            vec![t0, t1],
            vec![t0],
            vec![Run { from: t1, to: t0, messages: 1 }],
            64,
        ),
        route(3, 1, RouteKind::Collect { elements: 0..OUT }, vec![t0], vec![t0], vec![], 64),
    ];
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
        InstrPlacement {
            instr: 1,
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
                reductions: vec![2],
                broadcasts: vec![],
                bias: None,
                collects: vec![3],
            }),
        },
    ];
    let step = |instr, phase, routes: Vec<u32>| Step { instr, phase, routes };
    let schedule = vec![
        step(0, Phase::Gather, vec![0]),
        step(0, Phase::Deliver, vec![1]),
        step(1, Phase::Compute, vec![]),
        step(1, Phase::Reduce, vec![2]),
        step(1, Phase::Collect, vec![3]),
    ];
    let program = WaferProgram {
        target: params,
        plan: Plan::Tiled,
        max_context: 8,
        pes,
        instrs,
        routes,
        schedule,
        tile_blob_len: blob.len() as u64,
        weights_present: true,
        max_sequences: 1,
        routing_profile: None,
        replicas: Vec::new(),
    };
    (program, blob)
}

#[test]
fn hand_built_program_matches_the_reference_decoder() {
    let (module, _, _) = module();
    let (program, blob) = program(5);
    let mut executor = Executor::new(&program, &module, Some(&blob), ExecOptions::default()).unwrap();
    let mut reference = ReferenceDecoder::new(&module, 8).unwrap();
    for token in [3, 0, 7, 3, 5] {
        let ours = executor.step(token).unwrap().logits.unwrap();
        let theirs = reference.step(token).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&ours), bits(&theirs), "token {token}");
    }
    assert!(matches!(executor.step(VOCAB as u32), Err(ExecError::TokenOutOfRange { token: 8, .. })));
    // The program has KV capacity for one sequence: selecting another is an error naming the flag.
    let err = executor.select_sequence(1).unwrap_err();
    assert!(matches!(err, ExecError::NoSuchSequence { sequence: 1, max_sequences: 1 }));
    assert!(err.to_string().contains("--max-sequences 2"), "{err}");
    assert_eq!((executor.sequence(), executor.position()), (0, 5));
}

#[test]
fn a_farther_tile_costs_more_cycles() {
    let (module, _, _) = module();
    let cycles = |far: u16| {
        let (program, blob) = program(far);
        let mut executor = Executor::new(&program, &module, Some(&blob), ExecOptions::default()).unwrap();
        executor.step(1).unwrap().timing.cycles
    };
    let (near, farther, farthest) = (cycles(2), cycles(6), cycles(15));
    assert!(near < farther && farther < farthest, "{near} < {farther} < {farthest}");
    // Each extra hop adds a hop's latency twice: on the way out (delivery) and back (reduction).
    let hop = Target::grid(1, 16).params().hop_latency_cycles as u64;
    assert_eq!(farther - near, 2 * 4 * hop);
}

#[test]
fn a_reduction_path_that_skips_its_tree_is_named() {
    let (module, _, _) = module();
    let (mut program, blob) = program(5);
    program.routes[2].path = vec![Run { from: Pe::new(0, 3, 0), to: Pe::new(0, 1, 0), messages: 1 }];
    match Executor::new(&program, &module, Some(&blob), ExecOptions::default()) {
        Err(ExecError::RoutePath { route: 2, site, .. }) => assert_eq!((site.value, site.layer), (1, Some(0))),
        Err(other) => panic!("expected the path of route 2 to be named, got {other}"),
        Ok(_) => panic!("expected the path of route 2 to be named"),
    }
}
