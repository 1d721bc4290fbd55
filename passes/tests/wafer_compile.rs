use waferc_ir::wafer::Plan;
use waferc_passes::wafer::{check, compile, CompileOptions};
use waferc_targets::Target;
use waferc_testsuite::models::{build, Shape};

#[test]
fn tiny_llama_compiles_and_checks_on_8x8() {
    let module = build(&Shape::tiny(), 7);
    let target = Target::resolve("grid:8x8").unwrap();
    let program = compile(&module, &target, &CompileOptions::new(64)).unwrap();
    check(&program, &module).unwrap();
    assert_eq!(program.instrs.len(), module.body.len());
    assert!(program.pes.len() <= 64);
    assert!(program.weights_present);
}

#[test]
fn llama8b_shape_compiles_for_wse3() {
    let module = build(&Shape::llama8b(), 7);
    let target = Target::resolve("wse3").unwrap();
    let start = std::time::Instant::now();
    let program = compile(&module, &target, &CompileOptions::new(8192)).unwrap();
    // Its time is a figure for `bench_scale`, not a pass condition: a loaded CI machine would
    // fail a wall-clock bound the code meets.
    let compile_time = start.elapsed();
    let start = std::time::Instant::now();
    check(&program, &module).unwrap();
    eprintln!(
        "8B: compile {compile_time:?}, check {:?}, {} PEs, {} routes, {} steps, blob {} bytes",
        start.elapsed(),
        program.pes.len(),
        program.routes.len(),
        program.schedule.len(),
        program.tile_blob_len
    );
    assert!(!program.weights_present);
}

#[test]
fn llama70b_shape_compiles_for_wse3x4() {
    let module = build(&Shape::llama70b(), 7);
    let target = Target::resolve("wse3x4").unwrap();
    let start = std::time::Instant::now();
    let program = compile(&module, &target, &CompileOptions::new(2048)).unwrap();
    eprintln!("70B: compile {:?}, {} PEs, {} routes", start.elapsed(), program.pes.len(), program.routes.len());
    let wafers: std::collections::BTreeSet<u16> = program.pes.iter().map(|p| p.pe.wafer).collect();
    assert_eq!(wafers.len(), 4, "layers spread over all four wafers");
    assert!(program.routes.iter().any(|r| r.path.iter().any(|run| run.is_inter_wafer())));
    check(&program, &module).unwrap();
}

#[test]
fn moe_qwen_style_and_mesh_plans_compile_and_check() {
    let target = Target::resolve("grid:48x48").unwrap();
    let shapes = [
        Shape { moe: Some((8, 2)), ..Shape::tiny() },
        Shape { bias: true, qk_norm: true, ..Shape::tiny() },
        Shape { dtype: waferc_ir::DType::Q8_0, ..Shape::tiny() },
    ];
    for shape in shapes {
        let module = build(&shape, 7);
        for plan in [Plan::Tiled, Plan::MeshGemv { p: 4, group_num: 2 }] {
            let options = CompileOptions { max_context: 100, plan, ..CompileOptions::default() };
            let program = compile(&module, &target, &options).unwrap_or_else(|e| panic!("{shape:?} {plan:?}: {e}"));
            check(&program, &module).unwrap_or_else(|e| panic!("{shape:?} {plan:?}: {e}"));
        }
    }
}

#[test]
fn moe_shapes_at_scale_compile_and_check() {
    let qwen3_moe = Shape {
        hidden: 2048,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        ffn: 768,
        layers: 4,
        vocab: 151936,
        moe: Some((128, 8)),
        qk_norm: true,
        ..Shape::llama8b()
    };
    let mixtral = Shape { layers: 2, vocab: 32000, moe: Some((8, 2)), ..Shape::llama8b() };
    let target = Target::resolve("wse3").unwrap();
    for shape in [qwen3_moe, mixtral] {
        let module = build(&shape, 7);
        let program = compile(&module, &target, &CompileOptions::new(4096)).unwrap();
        check(&program, &module).unwrap();
        // Experts never share a PE.
        let mut owner = std::collections::HashMap::new();
        for p in &program.instrs {
            if let (Some(e), waferc_ir::wafer::Work::MatVec(mv)) = (p.expert, &p.work) {
                for t in &mv.tiles {
                    assert_eq!(*owner.entry(t.pe).or_insert(e), e, "{} holds tiles of two experts", t.pe);
                }
            }
        }
    }
}

#[test]
fn mesh_plan_compiles_the_8b_shape() {
    let module = build(&Shape { layers: 4, ..Shape::llama8b() }, 7);
    let target = Target::resolve("wse3").unwrap();
    let mesh = compile(
        &module,
        &target,
        &CompileOptions {
            max_context: 4096,
            plan: Plan::MeshGemv { p: 32, group_num: 4 },
            ..CompileOptions::default()
        },
    )
    .unwrap();
    check(&mesh, &module).unwrap();
    let tiled = compile(&module, &target, &CompileOptions::new(4096)).unwrap();
    let broadcasts = |p: &waferc_ir::wafer::WaferProgram| {
        p.instrs
            .iter()
            .filter_map(|i| match &i.work {
                waferc_ir::wafer::Work::MatVec(mv) => Some(mv.broadcasts.len()),
                _ => None,
            })
            .sum::<usize>()
    };
    assert!(broadcasts(&mesh) > 0 && broadcasts(&tiled) == 0, "the mesh plan all-reduces, the tiled plan does not");
}

/// The plan search's size guard (`stacked_tiles_estimate`) bounds what the stacked plan really
/// lays out: a matvec's tiles sit on distinct PEs of its region (an expert's in its lane), at
/// most one per row-by-chunk block, so the lowered tile count never exceeds the estimate, dense
/// and MoE, at either group size, and with experts sharing lanes (whose experts spread over
/// twice the PEs). (At full size each matvec spreads over its whole area and the two are close;
/// on a small grid the tiling keeps small matrices on fewer PEs.)
#[test]
fn stacked_tile_estimate_bounds_the_lowered_tiles() {
    let target = Target::resolve("grid:48x48").unwrap();
    // Matrices with more row-by-chunk blocks than a region (or an expert's lane) has PEs, as at
    // full size.
    let dense = Shape { hidden: 256, heads: 8, head_dim: 32, ffn: 512, ..Shape::tiny() };
    let cases = [
        (dense.clone(), 1u8),
        (Shape { moe: Some((8, 2)), ..dense.clone() }, 1),
        (Shape { moe: Some((8, 2)), ..dense }, 2),
    ];
    for (shape, experts_per_lane) in cases {
        let module = build(&shape, 7);
        for k in [1u16, 2] {
            let plan = Plan::Stacked {
                layers_per_region: k,
                wafer_percent: 100,
                kv_copies: 1,
                experts_per_lane,
                kv_spread: 1,
                kv_slices: 1,
            };
            let options = CompileOptions { max_context: 64, plan, ..CompileOptions::default() };
            let program = compile(&module, &target, &options).unwrap_or_else(|e| panic!("{shape:?} {plan}: {e}"));
            let tiles = program.matvec_tiles();
            let estimate = waferc_passes::wafer::stacked_tiles_estimate(&module, k, experts_per_lane, 48 * 48) as usize;
            assert!(tiles <= estimate, "{shape:?} {plan}: {tiles} tiles, estimate {estimate}");
        }
    }
}

/// The 70B's layers on a quarter wafer each leave no room for their smallest tiles: the placer
/// stops at the first PE that overflows and says what already holds it.
#[test]
fn an_overfilled_pe_is_reported_with_what_holds_it() {
    let module = build(&Shape::llama70b(), 7);
    let target = Target::resolve("wse3x4").unwrap();
    let plan = Plan::stacked(1);
    let err = compile(&module, &target, &CompileOptions { plan, ..CompileOptions::new(2048) }).unwrap_err().to_string();
    assert!(err.contains("bytes of SRAM, more than 49152 (code 2048, %"), "{err}");
    assert!(err.contains(" matvec "), "the tiles on the PE are named: {err}");
}

/// Experts sharing lanes (`shareE`) is an MoE plan: a dense model pinned to it is refused with
/// the plan named, not lowered as if the option meant something.
#[test]
fn shared_expert_lanes_are_refused_for_a_dense_model() {
    let target = Target::resolve("grid:48x48").unwrap();
    let plan = Plan::Stacked {
        layers_per_region: 1,
        wafer_percent: 100,
        kv_copies: 1,
        experts_per_lane: 2,
        kv_spread: 1,
        kv_slices: 1,
    };
    let options = CompileOptions { max_context: 64, plan, ..CompileOptions::default() };
    let err = compile(&build(&Shape::tiny(), 7), &target, &options).unwrap_err().to_string();
    assert!(err.contains("stacked:1,100,share2") && err.contains("no MoE layer"), "{err}");
    compile(&build(&Shape { moe: Some((8, 2)), ..Shape::tiny() }, 7), &target, &options)
        .unwrap_or_else(|e| panic!("the MoE model takes {plan}: {e}"));
}

/// Qwen3's per-head q and k norms sit between the projection and rope: the stacked plan still
/// cuts the projection's result in whole heads (not the general segments of `len / 16`, two
/// heads each here), so each head's norm and rope run on a PE of its own. Fused or not.
#[test]
fn stacked_qk_norms_run_on_one_head_a_segment() {
    let shape = Shape { hidden: 128, heads: 32, kv_heads: 2, head_dim: 16, qk_norm: true, ..Shape::tiny() };
    let unfused = build(&shape, 7);
    let fused = waferc_passes::rewrite::rewrite_module(&unfused, waferc_passes::PlanKind::Stacked).unwrap();
    let target = Target::resolve("grid:32x32").unwrap();
    let plan = Plan::stacked(1);
    for module in [unfused, fused] {
        let program = compile(&module, &target, &CompileOptions { plan, ..CompileOptions::new(64) }).unwrap();
        check(&program, &module).unwrap();
        let hd = shape.head_dim as u64;
        let mut normed = 0;
        for (handle, instr) in module.body.iter() {
            let waferc_ir::Op::RmsNorm { x, weight, .. } = &instr.op else { continue };
            if module.weights[*weight].ty.shape != [hd] {
                continue;
            }
            // The norm reads a slice of a projection (fused) or the projection itself.
            let (source, offset) = match &module.body[*x].op {
                waferc_ir::Op::Slice { x, offset, .. } => (*x, *offset as u64),
                _ => (*x, 0),
            };
            let waferc_ir::wafer::ResultLayout::Vector(layout) = &program.instrs[source.index()].result else {
                panic!("%{} has a vector result", source.index())
            };
            let len = match &instr.ty {
                waferc_ir::ValueType::Tensor(t) => t.elements(),
                waferc_ir::ValueType::Routing { .. } => unreachable!(),
            };
            for (segment, _) in layout.overlapping(offset..offset + len) {
                let (start, end) = (segment.elements.start, segment.elements.end);
                assert!(
                    (start - offset).is_multiple_of(hd) && end - start == hd,
                    "norm %{} reads segment {start}..{end} of %{}: not one head",
                    handle.index(),
                    source.index()
                );
            }
            normed += 1;
        }
        assert_eq!(normed, 2 * shape.layers, "a q and a k norm a layer");
    }
}

/// An MoE model's LM head lays its panels side by side, so the reductions of the row blocks in
/// one PE row share no link (interleaved, they all ran over the same links), and its input sits
/// in few segments on a diagonal: each in a row and a column of its own.
#[test]
fn stacked_lm_head_reductions_share_no_link() {
    let shape = Shape {
        hidden: 256,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        ffn: 512,
        vocab: 32768,
        moe: Some((4, 2)),
        ..Shape::tiny()
    };
    let module = build(&shape, 7);
    let target = Target::resolve("grid:64x64").unwrap();
    let plan = Plan::stacked(1);
    let program = compile(&module, &target, &CompileOptions { max_context: 64, plan, ..CompileOptions::default() })
        .unwrap_or_else(|e| panic!("{e}"));
    check(&program, &module).unwrap();
    let head = program.instrs.iter().rev().find(|p| p.op == "matvec").expect("an LM head");
    let waferc_ir::wafer::Work::MatVec(mv) = &head.work else { unreachable!() };
    let mut rows: std::collections::BTreeMap<u16, usize> = Default::default();
    let mut held: std::collections::HashMap<(waferc_ir::wafer::Pe, waferc_ir::wafer::Pe), u32> = Default::default();
    for &id in &mv.reductions {
        let route = &program.routes[id as usize];
        *rows.entry(route.sources[0].y).or_default() += 1;
        for link in route.path.iter().flat_map(|run| run.hops()) {
            if let Some(other) = held.insert(link, id).filter(|&other| other != id) {
                panic!("reductions {other} and {id} share the link {link:?}");
            }
        }
    }
    assert!(rows.values().any(|&n| n > 1), "no PE row holds two row blocks: {rows:?}");
    // The head's input: the final norm's segments, each in a row and a column of its own.
    let norm = program.instrs.iter().rev().find(|p| p.op == "rms_norm").expect("a final norm");
    let waferc_ir::wafer::ResultLayout::Vector(layout) = &norm.result else { unreachable!() };
    let (mut xs, mut ys): (Vec<u16>, Vec<u16>) = layout.segments.iter().map(|s| (s.pe.x, s.pe.y)).unzip();
    let count = xs.len();
    xs.sort_unstable();
    xs.dedup();
    ys.sort_unstable();
    ys.dedup();
    assert!(count > 1 && xs.len() == count && ys.len() == count, "{:?}", layout.segments);
}
