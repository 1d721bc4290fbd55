//! The executor on programs compiled by `passes::wafer::compile`: bit-identical to the reference
//! decoder on dense and MoE modules, the same bits on every grid, and failures that name the
//! route, PE and layer at fault.

mod executor_common;

use executor_common::{compile_for, compile_with, pack_tile_blob};
use waferc_ir::wafer::{Phase, Plan, ResultLayout, WaferProgram};
use waferc_ir::Op;
use waferc_passes::rewrite::rewrite_module;
use waferc_passes::wafer::CompileOptions;
use waferc_passes::PlanKind;
use waferc_runtime::executor::{validate, ExecOptions, Executor, ValidationOptions};
use waferc_testsuite::models::{build, Shape};

fn greedy(tokens: usize) -> ValidationOptions {
    ValidationOptions { max_new_tokens: tokens, ..ValidationOptions::default() }
}

#[test]
fn dense_module_matches_the_reference_bit_for_bit() {
    let module = build(&Shape::dense(), 1);
    let program = compile_for(&module, "grid:12x12", 64);
    let blob = pack_tile_blob(&program, &module);
    let validation =
        validate(&program, &module, Some(&blob), &[3, 17, 5], &greedy(5)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(validation.steps, 3 + 4);
    assert_eq!(validation.tokens.len(), 5);
}

#[test]
fn moe_module_matches_the_reference_bit_for_bit() {
    let module = build(&Shape::moe(), 2);
    let program = compile_for(&module, "grid:12x12", 64);
    let blob = pack_tile_blob(&program, &module);
    let validation = validate(&program, &module, Some(&blob), &[4, 9], &greedy(6)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(validation.steps, 2 + 5);
}

#[test]
fn quantised_module_with_biases_matches_the_reference() {
    let shape = Shape { dtype: waferc_ir::DType::Q8_0, bias: true, ..Shape::dense() };
    let module = build(&shape, 3);
    let program = compile_for(&module, "grid:12x12", 64);
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[1, 2, 3], &greedy(3)).unwrap_or_else(|e| panic!("{e}"));
}

/// On a grid tall enough for lanes of many rows, the stacked plan column-aligns each expert's
/// vectors inside its lane (SiLU and the product on half-chunk segments, as a dense layer's)
/// and puts each combine segment beside the residual stream's segment it is added to (the MoE
/// input's diagonal), in a row of its own; the bits stay the reference's.
#[test]
fn stacked_moe_with_tall_lanes_aligns_expert_vectors_and_matches_the_reference() {
    let module = build(&Shape::moe(), 5);
    let plan = Plan::stacked(1);
    let program =
        compile_with(&module, "grid:256x24", CompileOptions { max_context: 64, plan, ..CompileOptions::default() });
    let silu_segments: Vec<u64> = program
        .instrs
        .iter()
        .filter(|p| p.op == "silu" && p.expert.is_some())
        .flat_map(|p| match &p.result {
            waferc_ir::wafer::ResultLayout::Vector(layout) => {
                layout.segments.iter().map(|s| s.elements.end - s.elements.start).collect()
            }
            waferc_ir::wafer::ResultLayout::Routing { .. } => Vec::new(),
        })
        .collect();
    assert!(!silu_segments.is_empty(), "the module has experts' SiLUs");
    assert!(
        silu_segments.iter().all(|&len| len == 16),
        "every expert SiLU segment is half a chunk (column-aligned), got {silu_segments:?}"
    );
    // Each combine segment sits next to the residual's segment of its elements, and in a row of
    // its own (its delivery runs along that row, not queued behind the others').
    let vector = |p: &waferc_ir::wafer::InstrPlacement| match &p.result {
        waferc_ir::wafer::ResultLayout::Vector(layout) => layout.segments.clone(),
        waferc_ir::wafer::ResultLayout::Routing { .. } => Vec::new(),
    };
    let combines: Vec<_> = program.instrs.iter().filter(|p| p.op == "expert_combine").collect();
    assert!(!combines.is_empty(), "the module has combines");
    for combine in combines {
        let Op::ExpertCombine { experts, .. } = &module.body[waferc_ir::Handle::new(combine.instr as usize)].op else {
            panic!("instruction {} is a combine", combine.instr)
        };
        // The down projections have fewer column blocks (three chunks of input) than output
        // segments, so their segments spread over the lane, one column each: the combine's
        // gathers then come down columns of their own.
        for expert in experts {
            let columns: Vec<u16> = vector(&program.instrs[expert.index()]).iter().map(|s| s.pe.x).collect();
            let distinct: std::collections::HashSet<_> = columns.iter().collect();
            assert_eq!(distinct.len(), columns.len(), "expert output %{} shares columns: {columns:?}", expert.index());
        }
        let residual = module
            .body
            .iter()
            .find_map(|(_, instr)| match &instr.op {
                Op::Add { a, b } if a.index() == combine.instr as usize => Some(b.index()),
                Op::Add { a, b } if b.index() == combine.instr as usize => Some(a.index()),
                _ => None,
            })
            .map(|r| vector(&program.instrs[r]))
            .expect("a residual add reads the combine");
        let mut rows = std::collections::HashSet::new();
        for seg in vector(combine) {
            let twin = residual.iter().find(|r| r.elements == seg.elements).expect("a residual segment");
            let hops = seg.pe.x.abs_diff(twin.pe.x) + seg.pe.y.abs_diff(twin.pe.y);
            assert!(
                (1..=2).contains(&hops),
                "combine %{} segment {:?} at {:?}, the residual's at {:?}",
                combine.instr,
                seg.elements,
                seg.pe,
                twin.pe
            );
            assert!(
                rows.insert(seg.pe.y),
                "combine %{} segment {:?} shares row {}",
                combine.instr,
                seg.elements,
                seg.pe.y
            );
        }
        assert!(rows.len() > 1, "combine %{} is cut in segments", combine.instr);
    }
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[4, 9, 30], &greedy(5)).unwrap_or_else(|e| panic!("{e}"));
}

/// An MoE layer's input cannot be column-aligned for every expert's lane, so each of its
/// segments keeps a row and a column of its own (their multicasts to the lanes share no link),
/// on a diagonal of adjacent PEs at the region's centre, where the norm on them reduces over a
/// few hops; the layers of a region continue one diagonal. The router's logits matvec takes one
/// expert's column blocks in that expert's lane (split where its share of a PE is too small for
/// the expert's tile), so the input reaches it down the lane's columns, and the top-k runs on
/// the logits' PE. The bits stay the reference's.
#[test]
fn stacked_moe_input_sits_on_a_central_diagonal_and_the_router_in_an_experts_columns() {
    let shape = Shape { hidden: 512, layers: 4, ..Shape::moe() };
    let module = build(&shape, 6);
    let dispatched: std::collections::HashSet<usize> = module
        .body
        .iter()
        .filter_map(|(_, instr)| match &instr.op {
            Op::ExpertDispatch { x, .. } => Some(x.index()),
            _ => None,
        })
        .collect();
    for layers_per_region in [1, 2] {
        let plan = Plan::stacked(layers_per_region);
        let program =
            compile_with(&module, "grid:96x96", CompileOptions { max_context: 64, plan, ..CompileOptions::default() });
        let mut held = std::collections::HashSet::new();
        let mut norms = 0;
        for norm in program.instrs.iter().filter(|p| dispatched.contains(&(p.instr as usize))) {
            let waferc_ir::wafer::ResultLayout::Vector(layout) = &norm.result else {
                panic!("%{} is a vector", norm.instr)
            };
            assert!(layout.segments.len() > 1, "%{} is cut in segments", norm.instr);
            for pair in layout.segments.windows(2) {
                let (a, b) = (pair[0].pe, pair[1].pe);
                assert_eq!((b.x, b.y), (a.x + 1, a.y + 1), "%{} at stacked:{layers_per_region}", norm.instr);
            }
            for seg in &layout.segments {
                assert!(held.insert(seg.pe), "%{} shares {:?} with another layer's input", norm.instr, seg.pe);
            }
            norms += 1;
        }
        assert_eq!(norms, shape.layers, "one MoE input a layer");
        let tiles = |instr: usize| match &program.instrs[instr].work {
            waferc_ir::wafer::Work::MatVec(mv) => mv.tiles.clone(),
            _ => panic!("%{instr} is a matvec"),
        };
        for (handle, instr) in module.body.iter() {
            let Op::RouterTopK { logits, .. } = &instr.op else { continue };
            let router = tiles(logits.index());
            // The top-k runs on its logits' PE.
            let topk = &program.instrs[handle.index()];
            let (ResultLayout::Routing { pe }, ResultLayout::Vector(logits_at)) =
                (&topk.result, &program.instrs[logits.index()].result)
            else {
                panic!("%{} routes and %{} is a vector", handle.index(), logits.index())
            };
            assert_eq!(logits_at.segments.iter().map(|s| s.pe).collect::<Vec<_>>(), vec![*pe]);
            // Every router tile sits in a column of one expert's tiles of its chunks.
            let hosts = program
                .instrs
                .iter()
                .filter(|p| p.op == "matvec" && dispatch_router(&module, p.instr as usize) == Some(handle.index()));
            let host = hosts.map(|p| tiles(p.instr as usize)).find(|expert| {
                router.iter().all(|t| {
                    expert
                        .iter()
                        .any(|e| e.pe.x == t.pe.x && e.chunks.start <= t.chunks.start && t.chunks.end <= e.chunks.end)
                })
            });
            assert!(host.is_some(), "router %{}'s tiles are not in the columns of one expert's", logits.index());
        }
        let blob = pack_tile_blob(&program, &module);
        validate(&program, &module, Some(&blob), &[4, 9, 30], &greedy(4)).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The router (its instruction index) whose `expert_dispatch` instruction `i` reads, if any: `i`
/// is an expert's instruction reading the MoE layer's input.
fn dispatch_router(module: &waferc_ir::Module, i: usize) -> Option<usize> {
    module.body[waferc_ir::Handle::new(i)].op.operands().iter().find_map(|o| match &module.body[*o].op {
        Op::ExpertDispatch { routing, .. } => Some(routing.index()),
        _ => None,
    })
}

/// An expert's matvec that reads the MoE layer's input lays its panels side by side: each row
/// block's tiles are adjacent PEs of one row, so the row blocks sharing a PE row reduce over
/// links of their own (with interleaved panels every one of them crossed the whole row). The bits
/// stay the reference's.
#[test]
fn stacked_expert_input_matvecs_reduce_over_adjacent_pes() {
    let shape = Shape { hidden: 512, layers: 2, ..Shape::moe() };
    let module = build(&shape, 7);
    let plan = Plan::stacked(1);
    let program =
        compile_with(&module, "grid:96x96", CompileOptions { max_context: 64, plan, ..CompileOptions::default() });
    let mut shared_rows = 0;
    let mut matvecs = 0;
    for p in program.instrs.iter().filter(|p| p.expert.is_some()) {
        let waferc_ir::wafer::Work::MatVec(mv) = &p.work else { continue };
        if dispatch_router(&module, p.instr as usize).is_none() {
            continue;
        }
        matvecs += 1;
        let mut blocks: std::collections::BTreeMap<u64, Vec<waferc_ir::wafer::Pe>> = Default::default();
        for t in &mv.tiles {
            blocks.entry(t.rows.start as u64).or_default().push(t.pe);
        }
        let mut per_row: std::collections::HashMap<u16, usize> = Default::default();
        for (start, pes) in &blocks {
            let mut xs: Vec<u16> = pes.iter().map(|pe| pe.x).collect();
            xs.sort_unstable();
            assert!(pes.iter().all(|pe| pe.y == pes[0].y), "%{} row block {start} spans rows", p.instr);
            assert!(xs.windows(2).all(|w| w[1] == w[0] + 1), "%{} row block {start} at columns {xs:?}", p.instr);
            *per_row.entry(pes[0].y).or_default() += 1;
        }
        shared_rows += per_row.values().filter(|&&n| n > 1).count();
    }
    assert!(matvecs > 0, "the experts read the MoE input");
    assert!(shared_rows > 0, "some PE row holds several row blocks (panels side by side)");
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[4, 9, 30], &greedy(4)).unwrap_or_else(|e| panic!("{e}"));
}

/// Many experts on a short region: rather than bands of one row (whose tiles would hold twice
/// the bytes a PE of a two-row band's), the stacked plan cuts the bands across into columns of
/// lanes at least two rows high, as many as tile the experts cheapest, which need not be a power
/// of two (three on a 96-column grid). Experts still never share a PE, and the bits stay the
/// reference's.
#[test]
fn stacked_experts_in_lanes_cut_across_match_the_reference() {
    let shape = Shape { moe: Some((32, 4)), ffn: 256, ..Shape::moe() };
    let module = build(&shape, 8);
    let plan = Plan::stacked(1);
    for (grid, lane_columns) in [("grid:64x128", None), ("grid:96x128", Some(3))] {
        let options = CompileOptions { max_context: 64, plan, ..CompileOptions::default() };
        let program = compile_with(&module, grid, options);
        let mut rows: std::collections::BTreeMap<(u32, u32), std::collections::BTreeSet<u16>> = Default::default();
        let mut owner = std::collections::HashMap::new();
        for p in &program.instrs {
            let (Some(expert), waferc_ir::wafer::Work::MatVec(mv)) = (p.expert, &p.work) else { continue };
            let layer = module.body[waferc_ir::Handle::new(p.instr as usize)].layer.expect("an expert is in a layer");
            for t in &mv.tiles {
                rows.entry((layer, expert)).or_default().insert(t.pe.y);
                let first = *owner.entry(t.pe).or_insert((layer, expert));
                assert_eq!(first, (layer, expert), "{grid}: {} holds two experts", t.pe);
            }
        }
        assert_eq!(rows.len(), 32 * shape.layers as usize, "{grid}: every expert has tiles");
        for ((layer, expert), ys) in rows {
            assert!(ys.len() >= 2, "{grid}: layer {layer} expert {expert}: tiles on rows {ys:?} only");
        }
        // The columns of lanes: the distinct westmost columns of layer 0's experts.
        let mut west: std::collections::BTreeMap<u32, u16> = Default::default();
        for (pe, (layer, expert)) in &owner {
            if *layer == 0 {
                let x = west.entry(*expert).or_insert(pe.x);
                *x = (*x).min(pe.x);
            }
        }
        let columns = west.values().collect::<std::collections::BTreeSet<_>>().len();
        assert!(columns > 1, "{grid}: the bands are not cut across");
        if let Some(expected) = lane_columns {
            assert_eq!(columns, expected, "{grid}: columns of lanes");
        }
        let blob = pack_tile_blob(&program, &module);
        validate(&program, &module, Some(&blob), &[4, 9, 30], &greedy(5)).unwrap_or_else(|e| panic!("{grid}: {e}"));
    }
}

/// Experts sharing lanes (`experts_per_lane`): 32 experts in 16 or 8 lanes. A PE holds tiles of
/// the experts of one lane only (experts congruent modulo the lane count), each expert's tiles
/// spread over more PEs than in a lane of its own, the checker accepts the program, and the
/// bits stay the reference's whichever experts the router picks together.
#[test]
fn stacked_experts_sharing_lanes_match_the_reference() {
    let shape = Shape { moe: Some((32, 4)), ffn: 256, ..Shape::moe() };
    let module = build(&shape, 8);
    // On 64 x 128, two experts' tiles leave a lane's PEs no room for its vectors (the compile
    // says so); 128 x 128 has the room.
    const GRID: &str = "grid:128x128";
    // Per (layer, expert), the PEs holding its tiles; per PE, the experts it holds per layer.
    let tiles_of = |experts_per_lane| {
        let plan = Plan::Stacked {
            layers_per_region: 1,
            wafer_percent: 100,
            kv_copies: 1,
            experts_per_lane,
            kv_spread: 1,
            kv_slices: 1,
        };
        let program = compile_with(&module, GRID, CompileOptions { max_context: 64, plan, ..Default::default() });
        waferc_passes::wafer::check(&program, &module).unwrap_or_else(|e| panic!("{plan}: {e}"));
        let mut pes: std::collections::BTreeMap<(u32, u32), std::collections::BTreeSet<waferc_ir::wafer::Pe>> =
            Default::default();
        for p in &program.instrs {
            let (Some(expert), waferc_ir::wafer::Work::MatVec(mv)) = (p.expert, &p.work) else { continue };
            let layer = module.body[waferc_ir::Handle::new(p.instr as usize)].layer.expect("an expert is in a layer");
            pes.entry((layer, expert)).or_default().extend(mv.tiles.iter().map(|t| t.pe));
        }
        (program, pes)
    };
    let (_, alone) = tiles_of(1);
    for experts_per_lane in [2u32, 4] {
        let lanes = 32 / experts_per_lane;
        let (program, shared) = tiles_of(experts_per_lane as u8);
        let mut held: std::collections::HashMap<(u32, waferc_ir::wafer::Pe), std::collections::BTreeSet<u32>> =
            Default::default();
        for (&(layer, expert), pes) in &shared {
            for &pe in pes {
                held.entry((layer, pe)).or_default().insert(expert);
            }
            let before = alone[&(layer, expert)].len();
            assert!(
                pes.len() > before,
                "{experts_per_lane} a lane: layer {layer} expert {expert} on {} PEs, alone {before}",
                pes.len()
            );
        }
        for ((layer, pe), experts) in held {
            let lane = experts.first().unwrap() % lanes;
            assert!(
                experts.len() <= experts_per_lane as usize && experts.iter().all(|e| e % lanes == lane),
                "{experts_per_lane} a lane: {pe} holds layer {layer}'s experts {experts:?}"
            );
        }
        // The lane-mates' tiles fill the PEs, so an expert's result segments find no room on
        // their tiles' PEs; each still takes a column of its own in the lane (the combine's
        // gathers come up columns of their own) rather than the next free PEs of the region,
        // which run down one column.
        let mut moved = 0;
        for (_, instr) in module.body.iter() {
            let Op::ExpertCombine { experts, .. } = &instr.op else { continue };
            for expert in experts {
                let placement = &program.instrs[expert.index()];
                let (ResultLayout::Vector(layout), waferc_ir::wafer::Work::MatVec(mv)) =
                    (&placement.result, &placement.work)
                else {
                    panic!("expert output %{} is a matvec's vector", expert.index())
                };
                let columns: std::collections::BTreeSet<u16> = layout.segments.iter().map(|s| s.pe.x).collect();
                assert_eq!(
                    columns.len(),
                    layout.segments.len(),
                    "{experts_per_lane} a lane: expert output %{} shares columns: {:?}",
                    expert.index(),
                    layout.segments
                );
                moved += layout.segments.iter().filter(|s| !mv.tiles.iter().any(|t| t.pe == s.pe)).count();
            }
        }
        assert!(moved > 0, "{experts_per_lane} a lane: some expert result segment has no room on its tile");
        let blob = pack_tile_blob(&program, &module);
        validate(&program, &module, Some(&blob), &[4, 9, 30], &greedy(5))
            .unwrap_or_else(|e| panic!("{experts_per_lane} a lane: {e}"));
    }
}

/// The experts of an MoE block interleaved stage by stage (`interleave-experts`), four to a
/// lane: the program runs lane-mates' projections back to back, and the bits stay the
/// reference's whichever experts the router picks together.
#[test]
fn stacked_interleaved_experts_sharing_lanes_match_the_reference() {
    use waferc_passes::Pass;
    let shape = Shape { moe: Some((32, 4)), ffn: 256, ..Shape::moe() };
    let mut module = build(&shape, 8);
    let before = waferc_ir::text::print(&module);
    waferc_passes::interleave_experts::InterleaveExperts.run(&mut module).unwrap();
    waferc_ir::verify(&module).unwrap();
    assert_ne!(waferc_ir::text::print(&module), before, "the experts' instructions moved");
    let plan = Plan::Stacked {
        layers_per_region: 1,
        wafer_percent: 100,
        kv_copies: 1,
        experts_per_lane: 4,
        kv_spread: 1,
        kv_slices: 1,
    };
    let program = compile_with(&module, "grid:128x128", CompileOptions { max_context: 64, plan, ..Default::default() });
    waferc_passes::wafer::check(&program, &module).unwrap_or_else(|e| panic!("{plan}: {e}"));
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[4, 9, 30], &greedy(5)).unwrap_or_else(|e| panic!("{plan}: {e}"));
}

/// An attention output cut for its o projection in more pieces than a KV band's colours take
/// (32 query heads of 64 over two KV heads: 64 one-chunk pieces) is merged into whole query
/// heads, one segment each, rather than one segment per KV head; the bits stay the reference's.
#[test]
fn stacked_attention_output_too_fine_for_its_bands_is_cut_in_query_heads() {
    let shape = Shape { heads: 32, kv_heads: 2, head_dim: 64, ..Shape::dense() };
    let module = rewrite_module(&build(&shape, 3), PlanKind::Stacked).unwrap();
    let plan = Plan::stacked(1);
    let program =
        compile_with(&module, "grid:48x48", CompileOptions { max_context: 64, plan, ..CompileOptions::default() });
    let hd = shape.head_dim as u64;
    let mut attentions = 0;
    for p in program.instrs.iter().filter(|p| p.op == "attention") {
        let waferc_ir::wafer::ResultLayout::Vector(layout) = &p.result else { panic!("%{} is a vector", p.instr) };
        let lengths: Vec<u64> = layout.segments.iter().map(|s| s.elements.end - s.elements.start).collect();
        assert_eq!(lengths, vec![hd; shape.heads as usize], "%{}: one segment a query head", p.instr);
        attentions += 1;
    }
    assert_eq!(attentions, shape.layers);
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[7, 3, 11], &greedy(4)).unwrap_or_else(|e| panic!("{e}"));
}

/// The stacked plan keeps each head's fused q/k/v rows in whole-head row blocks inside its KV
/// head's band (near the head's segment), puts each up-projection segment on its gate twin's PE
/// so SiLU and the product need no delivery, and stays bit-exact.
#[test]
fn stacked_dense_keeps_heads_in_their_bands_and_gate_up_twins_together_bit_exactly() {
    let shape = Shape::dense();
    // Fused as the compile driver's `rewrite` pass fuses them for the stacked plan.
    let module = rewrite_module(&build(&shape, 6), PlanKind::Stacked).unwrap();
    let plan = Plan::stacked(1);
    // 16 rows: three rows per tile, which does not divide a head's 32.
    let rows = 16;
    let target = format!("grid:{rows}x64");
    let program = compile_with(&module, &target, CompileOptions { max_context: 64, plan, ..CompileOptions::default() });
    let (hd, band) = (shape.head_dim as u64, rows / shape.kv_heads as u16);
    let qkv_rows = (shape.heads + 2 * shape.kv_heads) as u64 * hd;
    let segments = |p: &waferc_ir::wafer::InstrPlacement| match &p.result {
        waferc_ir::wafer::ResultLayout::Vector(layout) => layout.segments.clone(),
        waferc_ir::wafer::ResultLayout::Routing { .. } => Vec::new(),
    };
    let matvecs = |rows: u64| {
        program.instrs.iter().filter_map(move |p| match &p.work {
            waferc_ir::wafer::Work::MatVec(mv) if mv.rows == rows => Some((p, mv)),
            _ => None,
        })
    };
    let mut straddling_grid = false;
    for (p, mv) in matvecs(qkv_rows) {
        let heads = segments(p);
        assert_eq!(heads.len() as u64, qkv_rows / hd, "%{} is cut in heads", p.instr);
        straddling_grid |= mv.tiles.iter().any(|t| hd % (t.rows.end - t.rows.start) as u64 != 0);
        for tile in &mv.tiles {
            let head = tile.rows.start as u64 / hd;
            assert_eq!(head, (tile.rows.end as u64 - 1) / hd, "%{} tile rows {:?} span two heads", p.instr, tile.rows);
            let seg = &heads[head as usize];
            assert!(
                tile.pe.y.abs_diff(seg.pe.y) < band,
                "%{} tile rows {:?} on {} is not in the band of its head's segment on {}",
                p.instr,
                tile.rows,
                tile.pe,
                seg.pe
            );
        }
    }
    assert!(straddling_grid, "some q/k/v tile height does not divide a head");
    let mut twins = 0;
    for (p, _) in matvecs(2 * shape.ffn) {
        let segs = segments(p);
        for seg in segs.iter().filter(|s| s.elements.start >= shape.ffn) {
            let twin = seg.elements.start - shape.ffn..seg.elements.end - shape.ffn;
            let on = segs.iter().find(|s| s.elements == twin).map(|s| s.pe);
            assert_eq!(on, Some(seg.pe), "%{} up segment {:?} is not on its gate twin's PE", p.instr, seg.elements);
            twins += 1;
        }
    }
    assert!(twins > 0, "the module has fused gate/up projections");
    let silus: Vec<u32> = program.instrs.iter().filter(|p| p.op == "silu").map(|p| p.instr).collect();
    assert!(!silus.is_empty(), "the module has SiLUs");
    for step in program.schedule.iter().filter(|s| silus.contains(&s.instr)) {
        assert!(
            step.phase != waferc_ir::wafer::Phase::Deliver || step.routes.is_empty(),
            "SiLU %{} delivers on {:?}",
            step.instr,
            step.routes
        );
    }
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[5, 21, 2], &greedy(5)).unwrap_or_else(|e| panic!("{e}"));
}

/// KV heads cut in slices of their head dimension: each slice's blocks hold its dims of every
/// position, the slices' score parts are summed block by block before the softmax, the blocks
/// compute less attention per step, and the logits stay the reference's bits. Eight query heads
/// a KV head: in four slices, adjacent slices share their queries' multicasts.
#[test]
fn stacked_kv_slices_split_each_heads_dims_and_match_the_reference() {
    let shape = Shape { head_dim: 128, heads: 16, ..Shape::dense() };
    let module = rewrite_module(&build(&shape, 9), PlanKind::Stacked).unwrap();
    let compile = |kv_slices| {
        let plan = Plan::stacked(1).with_kv_slices(kv_slices);
        compile_with(&module, "grid:24x64", CompileOptions { max_context: 64, plan, ..CompileOptions::default() })
    };
    let attention_compute = |program: &waferc_ir::wafer::WaferProgram| {
        let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
        let timing = Executor::new(program, &module, None, options).unwrap().step(1).unwrap().timing;
        let spans = timing.spans.iter().filter(|s| s.op == "attention");
        spans.map(|s| s.compute_cycles).sum::<u64>()
    };
    let whole = compile(1);
    for slices in [2u32, 4] {
        let sliced = compile(slices as u8);
        let mut attentions = 0;
        for p in &sliced.instrs {
            let waferc_ir::wafer::Work::Attention(att) = &p.work else { continue };
            attentions += 1;
            for head in 0..shape.kv_heads {
                let dims: Vec<_> =
                    att.kv_heads_placed.iter().filter(|h| h.kv_head == head).map(|h| h.dims.clone()).collect();
                let width = shape.head_dim / slices;
                let expected: Vec<_> = (0..slices).map(|s| s * width..(s + 1) * width).collect();
                assert_eq!(dims, expected, "%{} KV head {head}'s slices cut its dims in order", p.instr);
            }
        }
        assert!(attentions > 0);
        assert!(
            attention_compute(&sliced) < attention_compute(&whole),
            "slice{slices} computes less attention per block: {} vs {}",
            attention_compute(&sliced),
            attention_compute(&whole)
        );
        let blob = pack_tile_blob(&sliced, &module);
        validate(&sliced, &module, Some(&blob), &[7, 3, 40], &greedy(6))
            .unwrap_or_else(|e| panic!("slice{slices}: {e}"));
    }
}

/// Rope on pairs of chunks: where rope reads the queries and keys directly and a head's half is
/// several chunks, the stacked plan cuts them in chunks and puts each chunk of a head's second
/// half on its twin's PE (half a head away), so a 128-element head rotates on two PEs at once,
/// in place; the logits stay the reference's bits.
#[test]
fn stacked_rope_runs_on_pairs_of_chunks_and_matches_the_reference() {
    let shape = Shape { head_dim: 128, heads: 4, kv_heads: 2, ..Shape::dense() };
    let module = rewrite_module(&build(&shape, 11), PlanKind::Stacked).unwrap();
    let options = CompileOptions { max_context: 64, plan: Plan::stacked(1), ..CompileOptions::default() };
    let program = compile_with(&module, "grid:24x64", options);
    let half = shape.head_dim as u64 / 2;
    let mut ropes = 0;
    for p in program.instrs.iter().filter(|p| p.op == "rope") {
        ropes += 1;
        let ResultLayout::Vector(layout) = &p.result else { panic!("rope %{} has a vector result", p.instr) };
        for seg in &layout.segments {
            assert_eq!(seg.elements.end - seg.elements.start, 32, "%{}: chunks", p.instr);
            let within = seg.elements.start % (2 * half);
            if within >= half {
                let twin = layout.segments.iter().find(|t| t.elements.start == seg.elements.start - half).unwrap();
                assert_eq!(twin.pe, seg.pe, "%{}: chunk {:?} sits with its twin", p.instr, seg.elements);
            }
        }
    }
    assert!(ropes > 0);
    let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
    let timing = Executor::new(&program, &module, None, options).unwrap().step(1).unwrap().timing;
    for span in timing.spans.iter().filter(|s| s.op == "rope" && s.phase == Phase::Compute) {
        // Each PE rotates half a head: its two chunks.
        assert_eq!(span.compute_cycles, 2 * 32 * waferc_runtime::executor::timing::ROPE_FLOPS, "{span:?}");
    }
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[7, 3, 40], &greedy(6)).unwrap_or_else(|e| panic!("{e}"));
}

/// Rope pairs with KV heads cut in slices: a query head's chunks multicast to their slices'
/// blocks whether rope runs on pairs or whole heads, so the bound on a band's query multicasts
/// is the sliced one. Eight query heads a KV head of 128 dims (32 chunk multicasts a band) rotate
/// on whole heads unsliced, on pairs in four slices, and keep the reference's bits.
#[test]
fn stacked_rope_runs_on_pairs_when_kv_heads_are_sliced() {
    let shape = Shape { head_dim: 128, heads: 16, ..Shape::dense() };
    assert_eq!(shape.heads / shape.kv_heads, 8);
    let module = rewrite_module(&build(&shape, 9), PlanKind::Stacked).unwrap();
    let compile = |kv_slices| {
        let plan = Plan::stacked(1).with_kv_slices(kv_slices);
        compile_with(&module, "grid:24x64", CompileOptions { max_context: 64, plan, ..CompileOptions::default() })
    };
    let rope_segments = |program: &waferc_ir::wafer::WaferProgram| {
        let ropes = program.instrs.iter().filter(|p| p.op == "rope");
        let layouts = ropes.map(|p| match &p.result {
            ResultLayout::Vector(layout) => layout.segments.iter().map(|s| s.elements.end - s.elements.start).collect(),
            _ => panic!("rope %{} has a vector result", p.instr),
        });
        layouts.collect::<Vec<Vec<u64>>>().concat()
    };
    let whole = rope_segments(&compile(1));
    assert!(!whole.is_empty() && whole.iter().all(|&len| len == 128), "unsliced: whole heads, {whole:?}");
    let sliced = compile(4);
    let pairs = rope_segments(&sliced);
    assert!(!pairs.is_empty() && pairs.iter().all(|&len| len == 32), "in four slices: chunks, {pairs:?}");
    let blob = pack_tile_blob(&sliced, &module);
    validate(&sliced, &module, Some(&blob), &[7, 3, 40], &greedy(6)).unwrap_or_else(|e| panic!("{e}"));
}

/// Where rope pairs' extra query multicasts leave a route without a colour, the stacked plan
/// places the module again with whole heads: on routers of 10 colours (12 hold the pairs) the
/// same module compiles, its rope on whole heads, and keeps the reference's bits.
#[test]
fn stacked_rope_pairs_without_colours_fall_back_to_whole_heads() {
    let shape = Shape { head_dim: 128, heads: 4, kv_heads: 2, ..Shape::dense() };
    let module = rewrite_module(&build(&shape, 11), PlanKind::Stacked).unwrap();
    let options = CompileOptions { max_context: 64, plan: Plan::stacked(1), ..CompileOptions::default() };
    let mut target = waferc_targets::Target::resolve("grid:24x64").unwrap();
    target.colours_per_pe.value = 10;
    let program = waferc_passes::wafer::compile(&module, &target, &options).unwrap_or_else(|e| panic!("{e}"));
    waferc_passes::wafer::check(&program, &module).unwrap_or_else(|e| panic!("{e}"));
    for p in program.instrs.iter().filter(|p| p.op == "rope") {
        let ResultLayout::Vector(layout) = &p.result else { panic!("rope %{} has a vector result", p.instr) };
        assert!(layout.segments.iter().all(|s| s.elements.end - s.elements.start == 128), "%{}: whole heads", p.instr);
    }
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[7, 3, 40], &greedy(4)).unwrap_or_else(|e| panic!("{e}"));
}

/// KV heads held in copies: each copy's blocks serve one share of its head's query heads, the
/// blocks compute less attention per step, and the logits stay the reference's bits.
#[test]
fn stacked_kv_copies_split_each_heads_queries_and_match_the_reference() {
    let shape = Shape::dense();
    let group = shape.heads / shape.kv_heads;
    assert_eq!(group, 2, "two query heads per KV head, one per copy");
    let module = rewrite_module(&build(&shape, 8), PlanKind::Stacked).unwrap();
    let compile = |kv_copies| {
        let plan = Plan::Stacked {
            layers_per_region: 1,
            wafer_percent: 100,
            kv_copies,
            experts_per_lane: 1,
            kv_spread: 1,
            kv_slices: 1,
        };
        compile_with(&module, "grid:16x64", CompileOptions { max_context: 64, plan, ..CompileOptions::default() })
    };
    let (single, copied) = (compile(1), compile(2));
    let mut attentions = 0;
    for p in &copied.instrs {
        let waferc_ir::wafer::Work::Attention(att) = &p.work else { continue };
        attentions += 1;
        assert_eq!(att.kv_heads_placed.len() as u32, 2 * shape.kv_heads, "%{} places each KV head twice", p.instr);
        for head in 0..shape.kv_heads {
            let mut served: Vec<_> =
                att.kv_heads_placed.iter().filter(|h| h.kv_head == head).map(|h| h.query_heads.clone()).collect();
            served.sort_by_key(|r| r.start);
            assert_eq!(served, vec![0..1, 1..2], "%{} KV head {head}'s copies split its query heads", p.instr);
        }
        let mut pes: Vec<_> = att.kv_heads_placed.iter().flat_map(|h| h.blocks.iter().map(|b| b.pe)).collect();
        let blocks = pes.len();
        pes.sort_unstable();
        pes.dedup();
        assert_eq!(pes.len(), blocks, "%{}: every copy's blocks on PEs of their own", p.instr);
    }
    assert!(attentions > 0);
    // The busiest block's attention arithmetic at position 0: half the query heads, half of it
    // but the append.
    let attention_compute = |program: &waferc_ir::wafer::WaferProgram| {
        let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
        let timing = Executor::new(program, &module, None, options).unwrap().step(1).unwrap().timing;
        let spans = timing.spans.iter().filter(|s| s.op == "attention");
        spans.map(|s| s.compute_cycles).sum::<u64>()
    };
    assert!(
        attention_compute(&copied) < attention_compute(&single),
        "copies compute less attention per block: {} vs {}",
        attention_compute(&copied),
        attention_compute(&single)
    );
    let blob = pack_tile_blob(&copied, &module);
    validate(&copied, &module, Some(&blob), &[7, 3, 40], &greedy(6)).unwrap_or_else(|e| panic!("{e}"));
}

/// KV blocks spread over 2, 4 and 8 PEs by lane: each chunk's blocks hold equal lane groups
/// on PEs of their own, the checker accepts the program, a step deep in the context computes
/// less attention on the busiest block, and the logits stay the reference's bits over two
/// chunks of positions (lane groups fill in turn, then the next chunk's).
#[test]
fn stacked_kv_blocks_spread_by_lane_match_the_reference() {
    let shape = Shape::dense();
    let module = rewrite_module(&build(&shape, 9), PlanKind::Stacked).unwrap();
    let compile = |kv_spread| {
        let plan = Plan::Stacked {
            layers_per_region: 1,
            wafer_percent: 100,
            kv_copies: 1,
            experts_per_lane: 1,
            kv_spread,
            kv_slices: 1,
        };
        compile_with(&module, "grid:16x64", CompileOptions { max_context: 64, plan, ..CompileOptions::default() })
    };
    // The busiest attention PE's arithmetic at position 40 (chunk 0 full, chunk 1 holding 9 rows).
    let busiest_attention = |program: &WaferProgram| {
        let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
        let mut executor = Executor::new(program, &module, None, options).unwrap();
        executor.seek(40).unwrap();
        let timing = executor.step(1).unwrap().timing;
        let spans = timing.spans.iter().filter(|s| s.op == "attention");
        spans.map(|s| s.compute_cycles).max().unwrap()
    };
    let whole = compile(1);
    let mut previous = busiest_attention(&whole);
    for groups in [2u8, 4, 8] {
        let program = compile(groups);
        waferc_passes::wafer::check(&program, &module).unwrap_or_else(|e| panic!("spread{groups}: {e}"));
        for p in &program.instrs {
            let waferc_ir::wafer::Work::Attention(att) = &p.work else { continue };
            for head in &att.kv_heads_placed {
                let held: Vec<_> =
                    head.blocks.iter().map(|b| (b.positions.start, b.lanes.first, b.lanes.count)).collect();
                let count = 8 / groups;
                let expected: Vec<_> =
                    (0..2).flat_map(|chunk| (0..groups).map(move |g| (chunk * 32, g * count, count))).collect();
                assert_eq!(held, expected, "spread{groups} %{} KV head {}", p.instr, head.kv_head);
            }
            let mut pes: Vec<_> = att.kv_heads_placed.iter().flat_map(|h| h.blocks.iter().map(|b| b.pe)).collect();
            let blocks = pes.len();
            pes.sort_unstable();
            pes.dedup();
            assert_eq!(pes.len(), blocks, "spread{groups} %{}: a PE per block", p.instr);
        }
        let busiest = busiest_attention(&program);
        assert!(busiest < previous, "spread{groups}: busiest attention span {busiest} cycles, not under {previous}");
        previous = busiest;
        let blob = pack_tile_blob(&program, &module);
        let prompt: Vec<u32> = (0..20).map(|t| ((t * 7 + 3) % shape.vocab) as u32).collect();
        let validation = validate(&program, &module, Some(&blob), &prompt, &greedy(26))
            .unwrap_or_else(|e| panic!("spread{groups}: {e}"));
        assert_eq!(validation.steps, 45, "spread{groups}: positions 0..45 checked");
    }
}

/// The logits' bits for `tokens` fed in turn on `target` with `plan`, and the program's PE and
/// matvec tile counts.
fn logits_on(module: &waferc_ir::Module, target: &str, plan: Plan, tokens: &[u32]) -> (Vec<Vec<u32>>, usize, usize) {
    let program = compile_with(module, target, CompileOptions { max_context: 64, plan, ..CompileOptions::default() });
    let blob = pack_tile_blob(&program, module);
    let mut executor = Executor::new(&program, module, Some(&blob), ExecOptions::default()).unwrap();
    let bits = tokens
        .iter()
        .map(|&t| executor.step(t).unwrap().logits.unwrap().iter().map(|v| v.to_bits()).collect())
        .collect();
    (bits, program.pes.len(), program.matvec_tiles())
}

#[test]
fn every_grid_gives_the_same_logit_bits() {
    for shape in [Shape::dense(), Shape::moe()] {
        let module = build(&shape, 4);
        let tokens = [7, 1, 30, 2, 11];
        let (reference, pes, tiles) = logits_on(&module, "grid:12x12", Plan::Tiled, &tokens);
        let mesh = Plan::MeshGemv { p: 4, group_num: 2 };
        for (target, plan) in
            [("grid:10x20", Plan::Tiled), ("grid:16x16", Plan::Tiled), ("grid:50x4", Plan::Tiled), ("grid:32x32", mesh)]
        {
            let (bits, other_pes, other_tiles) = logits_on(&module, target, plan, &tokens);
            assert_eq!(
                bits, reference,
                "{target} {plan:?} vs grid:12x12 ({other_pes} vs {pes} PEs, {other_tiles} vs {tiles} tiles)"
            );
        }
    }
}

#[test]
fn a_two_wafer_pipeline_matches_the_reference_and_waits_for_the_wafer_hop() {
    let toml = "name = \"two-grids\"\nbase = \"wse3\"\ngrid_cols = 12\ngrid_rows = 12\nwafers = 2\n";
    let two = waferc_targets::Target::from_toml(toml, "two-grids.toml").unwrap();
    let module = build(&Shape::dense(), 12);
    let program = waferc_passes::wafer::compile(&module, &two, &CompileOptions::new(64)).unwrap();
    assert!(program.routes.iter().any(|r| r.path.iter().any(|run| run.is_inter_wafer())), "some route crosses wafers");
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[2, 8], &greedy(3)).unwrap_or_else(|e| panic!("{e}"));

    let cycles = |program: &waferc_ir::wafer::WaferProgram| {
        let blob = pack_tile_blob(program, &module);
        let mut executor = Executor::new(program, &module, Some(&blob), ExecOptions::default()).unwrap();
        executor.step(2).unwrap().timing.cycles
    };
    // The hop between the wafers is on the critical path: every later layer waits for it.
    let hop = program.target.inter_wafer_latency_cycles;
    let mut slower = program.clone();
    slower.target.inter_wafer_latency_cycles *= 10;
    assert!(cycles(&slower) >= cycles(&program) + 9 * hop, "ten times the wafer hop latency costs 9 more hops");
}

#[test]
fn attention_split_over_kv_blocks_matches_the_reference_across_block_boundaries() {
    let module = build(&Shape::dense(), 13);
    let program = compile_for(&module, "grid:16x16", 1024);
    let blocks: Vec<(usize, u32)> = program
        .instrs
        .iter()
        .filter_map(|p| match &p.work {
            waferc_ir::wafer::Work::Attention(a) => {
                let first = &a.kv_heads_placed[0].blocks;
                Some((first.len(), first[0].positions.end - first[0].positions.start))
            }
            _ => None,
        })
        .collect();
    let (count, per_block) = blocks[0];
    assert!(count > 1, "each KV head is split over several blocks ({blocks:?})");
    // Feed past the first block's end so that two blocks hold positions.
    let prompt: Vec<u32> = (0..per_block + 3).map(|i| i * 7 % 190).collect();
    let blob = pack_tile_blob(&program, &module);
    let validation = validate(&program, &module, Some(&blob), &prompt, &greedy(2)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(validation.steps, prompt.len() + 1);
}

#[test]
fn generate_drives_the_executor_like_the_reference_decoder() {
    let module = build(&Shape::moe(), 14);
    let program = compile_for(&module, "grid:12x12", 64);
    let blob = pack_tile_blob(&program, &module);
    let mut executor = Executor::new(&program, &module, Some(&blob), ExecOptions::default()).unwrap();
    let mut reference = waferc_runtime::ReferenceDecoder::new(&module, 64).unwrap();
    let prompt = [3, 1, 4, 1, 5];
    let ours = waferc_runtime::generate(&mut executor, &prompt, 5, None, &[], |_| {}).unwrap();
    let theirs = waferc_runtime::generate(&mut reference, &prompt, 5, None, &[], |_| {}).unwrap();
    assert_eq!(ours.tokens, theirs.tokens);
    let bits = |rows: &[Vec<f32>]| rows.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&ours.logits), bits(&theirs.logits));
    let report = executor.timing_report(prompt.len()).unwrap();
    assert!(report.modeled_decode_tok_s > 0.0 && report.modeled_ttft_us > 0.0);

    let mut timing_only =
        Executor::new(&program, &module, None, ExecOptions { timing_only: true, ..ExecOptions::default() }).unwrap();
    let error = waferc_runtime::generate(&mut timing_only, &prompt, 1, None, &[], |_| {}).unwrap_err();
    assert!(
        matches!(&error, waferc_runtime::RuntimeError::Executor(e) if matches!(**e, waferc_runtime::executor::ExecError::TimingOnly)),
        "{error}"
    );
}

/// A wide matrix over a narrow area takes tiles of eight chunks: half the column blocks, so
/// three times the panels fit the width (a deep down projection over 48 columns: 16 blocks in
/// three panels rather than 32 in one). The reduction still combines the contract's subtrees
/// (an aligned run of eight chunks is one), so the bits stay the reference's.
#[test]
fn stacked_tiles_of_eight_chunks_match_the_reference() {
    let shape = Shape { ffn: 4096, ..Shape::dense() };
    let module = rewrite_module(&build(&shape, 8), PlanKind::Stacked).unwrap();
    let plan = Plan::stacked(2);
    let program =
        compile_with(&module, "grid:48x24", CompileOptions { max_context: 64, plan, ..CompileOptions::default() });
    let runs: Vec<(u32, u64, u64)> = program
        .instrs
        .iter()
        .filter_map(|p| match &p.work {
            waferc_ir::wafer::Work::MatVec(mv) => {
                let t = &mv.tiles[0];
                Some((p.instr, mv.cols, (t.chunks.end - t.chunks.start) as u64))
            }
            _ => None,
        })
        .collect();
    assert!(runs.iter().any(|&(_, cols, run)| cols == shape.ffn && run == 8), "{runs:?}");
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[6, 14, 9], &greedy(4)).unwrap_or_else(|e| panic!("{e}"));
}

/// A stacked region too narrow for a matrix's column blocks at the widest tiles says how many
/// columns they need (its budget had read as `u64::MAX` bytes, and could wrap).
#[test]
fn a_stacked_region_too_narrow_for_a_matrix_names_the_columns_it_needs() {
    let module = rewrite_module(&build(&Shape { ffn: 2048, ..Shape::dense() }, 8), PlanKind::Stacked).unwrap();
    let plan = Plan::stacked(2);
    let target = waferc_targets::Target::resolve("grid:16x12").unwrap();
    let options = CompileOptions { max_context: 64, plan, ..CompileOptions::default() };
    let error = waferc_passes::wafer::compile(&module, &target, &options).expect_err("the regions are too narrow");
    let message = error.to_string();
    assert!(
        message.contains("layers.0.mlp.down") && message.contains("its 64 chunks need at least 8 columns"),
        "{message}"
    );
}

/// A router whose logits are several segments (64 experts: two of 32) takes its top-k on the
/// logits' segment nearest the region's centre, so only the other segments travel to it (on
/// a fresh PE, Qwen3-30B-A3B's four segments crossed the region: 1,402 -> 1,436 tok/s), and
/// the bits stay the reference's.
#[test]
fn stacked_top_k_sits_on_a_segment_of_its_logits() {
    let shape = Shape { moe: Some((64, 4)), ffn: 128, ..Shape::moe() };
    let module = build(&shape, 8);
    let plan = Plan::stacked(1);
    let program =
        compile_with(&module, "grid:96x128", CompileOptions { max_context: 64, plan, ..CompileOptions::default() });
    let mut routers = 0;
    for p in &program.instrs {
        let (Op::RouterTopK { logits, .. }, ResultLayout::Routing { pe }) =
            (&module.body[waferc_ir::Handle::new(p.instr as usize)].op, &p.result)
        else {
            continue;
        };
        let ResultLayout::Vector(segments) = &program.instrs[logits.index()].result else { panic!("logits") };
        assert!(segments.segments.len() > 1, "the logits are one segment: nothing to test");
        assert!(segments.segments.iter().any(|s| s.pe == *pe), "top-k of %{} on {pe}, off its logits", p.instr);
        routers += 1;
    }
    assert_eq!(routers, shape.layers as usize);
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[4, 9, 30], &greedy(5)).unwrap_or_else(|e| panic!("{e}"));
}

/// `shape`'s model (seeded) compiled `stacked:1` with 64 positions for two wafers of
/// `grid_cols x 48` PEs.
fn stacked_on_two_wafers(grid_cols: u16, shape: &Shape, seed: u64) -> (waferc_ir::Module, WaferProgram) {
    let toml = format!("name = \"two-grids\"\nbase = \"wse3\"\ngrid_cols = {grid_cols}\ngrid_rows = 48\nwafers = 2\n");
    let two = waferc_targets::Target::from_toml(&toml, "two-grids.toml").unwrap();
    let module = build(shape, seed);
    let plan = Plan::stacked(1);
    let options = CompileOptions { max_context: 64, plan, ..CompileOptions::default() };
    let program = waferc_passes::wafer::compile(&module, &two, &options).unwrap_or_else(|e| panic!("{e}"));
    (module, program)
}

/// A residual read on the next wafer leaves in at most 16 segments, one multicast each through
/// the gateway PEs, where its own layout would run in place on its down projection's one-chunk
/// segments: the 70B's 256 at each crossing ran out of the router's 24 colours. The logits keep
/// their bits.
#[test]
fn a_stacked_residual_crosses_wafers_in_few_segments() {
    let shape = Shape { hidden: 1024, heads: 8, kv_heads: 2, head_dim: 128, ffn: 2048, ..Shape::dense() };
    let (module, program) = stacked_on_two_wafers(96, &shape, 15);
    let mut crossing: std::collections::BTreeMap<u32, usize> = Default::default();
    for route in program.routes.iter().filter(|r| r.path.iter().any(|run| run.is_inter_wafer())) {
        *crossing.entry(route.instr).or_default() += 1;
    }
    assert!(!crossing.is_empty(), "no route crosses wafers");
    assert!(crossing.values().all(|&routes| routes <= 16), "routes crossing, per value: {crossing:?}");
    // Without the rule the residual would cross in one route per down projection segment.
    let down_segments = program
        .instrs
        .iter()
        .filter(|p| matches!(p.work, waferc_ir::wafer::Work::MatVec(_)))
        .filter_map(|p| match &p.result {
            ResultLayout::Vector(layout) if layout.len() == shape.hidden => Some(layout.segments.len()),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    assert!(down_segments > 16, "the matvecs' results are {down_segments} segments: the rule is not exercised");
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[2, 8], &greedy(2)).unwrap_or_else(|e| panic!("{e}"));
}

/// Each multicast of a value crossing to the next wafer crosses on a row of its own: through one
/// gateway PE, the 70B's residual queued 7,680 cycles on its links at each crossing.
#[test]
fn a_value_crosses_wafers_on_rows_of_its_own() {
    use waferc_ir::wafer::RouteKind;
    let shape = Shape { hidden: 1024, heads: 8, kv_heads: 2, head_dim: 128, ffn: 2048, ..Shape::dense() };
    let (_, program) = stacked_on_two_wafers(96, &shape, 15);
    let mut gateways: std::collections::BTreeMap<u32, Vec<waferc_ir::wafer::Pe>> = Default::default();
    for route in program.routes.iter().filter(|r| matches!(r.kind, RouteKind::Operand { .. })) {
        if let Some(hop) = route.path.iter().find(|run| run.is_inter_wafer()) {
            gateways.entry(route.instr).or_default().push(hop.from);
        }
    }
    assert!(gateways.values().any(|g| g.len() > 1), "no value crosses in several multicasts: {gateways:?}");
    for (instr, pes) in &gateways {
        let mut distinct = pes.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), pes.len(), "%{instr} crosses through {pes:?}");
    }
}

/// A vector cut coarser than its operand takes the operand's segments on one gather per landing
/// segment, not one multicast each: the residual crossing to the next wafer in 16 segments of
/// 128 elements reads its down projection's and its residual's 32-element segments, four each
/// (three of them from other PEs), and each multicast into one PE took a colour there (the 70B's
/// 16 segments of 512 read 256: 32 routes into each, beyond the router's 24 colours). The logits
/// keep their bits.
#[test]
fn a_coarse_crossing_gathers_its_fine_operands_bit_exactly() {
    use waferc_ir::wafer::RouteKind;
    // Wide enough for the down projection's 64 one-chunk column blocks.
    let shape = Shape { hidden: 2048, heads: 16, kv_heads: 2, head_dim: 128, ffn: 2048, ..Shape::dense() };
    let (module, program) = stacked_on_two_wafers(192, &shape, 16);
    let gathers: Vec<_> = program.routes.iter().filter(|r| matches!(r.kind, RouteKind::Gather { .. })).collect();
    assert!(!gathers.is_empty(), "no operand comes on a gather");
    for route in &gathers {
        assert_eq!(route.destinations.len(), 1, "route {}", route.id);
        assert!(route.sources.len() >= 2, "route {} gathers {} segments", route.id, route.sources.len());
    }
    // Every gathered PE receives no multicast of the segments its gather brings.
    for route in &gathers {
        let RouteKind::Gather { value, elements } = &route.kind else { unreachable!() };
        let twice = program.routes.iter().any(|r| match &r.kind {
            RouteKind::Operand { value: v, elements: e } => {
                v == value
                    && e.start >= elements.start
                    && e.end <= elements.end
                    && r.destinations.contains(&route.destinations[0])
            }
            _ => false,
        });
        assert!(!twice, "route {} and a multicast both bring %{value} {elements:?}", route.id);
    }
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[2, 8], &greedy(2)).unwrap_or_else(|e| panic!("{e}"));
}

/// Where the weights fill the wafer (here PEs of 24 KiB), the embedding's table is cut in bands
/// of as many PEs each, so each band's row blocks are as long: in bands of whole rows of its
/// area, a smaller band's PEs held longer blocks, and this grid's embedding overflowed one
/// (`PE(w0, x0, y0) would need 31488 bytes`). The logits keep their bits.
#[test]
fn a_tight_embedding_gives_its_bands_as_many_pes_and_matches_the_reference() {
    let (target, shape) = tight_grid();
    let module = build(&shape, 3);
    let options = CompileOptions { max_context: 64, plan: Plan::stacked(1), ..CompileOptions::default() };
    let program = waferc_passes::wafer::compile(&module, &target, &options).unwrap_or_else(|e| panic!("{e}"));
    let mut blocks_per_band: std::collections::BTreeMap<u64, usize> = Default::default();
    let mut columns_per_band: std::collections::BTreeMap<u64, std::collections::BTreeSet<u16>> = Default::default();
    for p in &program.instrs {
        if let waferc_ir::wafer::Work::Embed { blocks, .. } = &p.work {
            for b in blocks {
                *blocks_per_band.entry(b.elements.start).or_default() += 1;
                columns_per_band.entry(b.elements.start).or_default().insert(b.pe.x);
            }
        }
    }
    assert!(blocks_per_band.len() > 1, "one band: nothing to share out");
    let (fewest, most) = (blocks_per_band.values().min().unwrap(), blocks_per_band.values().max().unwrap());
    assert!(most - fewest <= 1, "blocks per band: {blocks_per_band:?}");
    // The bands are runs of columns (a wafer the weights do not fill keeps bands of whole rows,
    // each across every column of the area, and would not test the runs).
    let all: std::collections::BTreeSet<u16> = columns_per_band.values().flatten().copied().collect();
    assert!(
        columns_per_band.values().all(|columns| 2 * columns.len() < all.len()),
        "bands span {:?} of {} columns",
        columns_per_band.values().map(|c| c.len()).collect::<Vec<_>>(),
        all.len()
    );
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[5, 2000], &greedy(3)).unwrap_or_else(|e| panic!("{e}"));
}

/// A 20x17 grid of 24 KiB PEs and a shape whose weights fill it beyond the tiles' share (a
/// tight wafer, as the 70B's on wse3x4).
fn tight_grid() -> (waferc_targets::Target, Shape) {
    grid_of(24_576)
}

/// A 20x17 grid of `sram` bytes a PE and the shape of [`tight_grid`].
fn grid_of(sram: u32) -> (waferc_targets::Target, Shape) {
    let toml =
        format!("name = \"tight\"\nbase = \"wse3\"\ngrid_cols = 20\ngrid_rows = 17\nsram_bytes_per_pe = {sram}\n");
    let target = waferc_targets::Target::from_toml(&toml, "tight.toml").unwrap();
    (target, Shape { hidden: 256, heads: 4, kv_heads: 2, head_dim: 64, ffn: 512, vocab: 2048, ..Shape::dense() })
}

/// PEs of 26 KiB leave the grid of [`tight_grid`] short of tight, but the units' floors still
/// fill it, so each region's share is its bytes and the embedding's table fills its area as
/// densely: its bands are cut as on a tight wafer. Cut as whole rows for the smallest band, it
/// overflowed `PE(w0, x0, y0)` (31,488 bytes) where 24 KiB PEs compiled. The logits keep
/// their bits.
#[test]
fn an_embedding_area_filled_by_its_table_compiles_on_larger_pes() {
    let (target, shape) = grid_of(26_624);
    let module = build(&shape, 3);
    let options = CompileOptions { max_context: 64, plan: Plan::stacked(1), ..CompileOptions::default() };
    let program = waferc_passes::wafer::compile(&module, &target, &options).unwrap_or_else(|e| panic!("{e}"));
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[5, 2000], &greedy(3)).unwrap_or_else(|e| panic!("{e}"));
}

/// On a tight wafer the residual leaving a region for the one beside it (the next strip of the
/// snake) goes in few segments, each on a row of its own, so their multicasts run side by side
/// and share no link: the 70B's `stacked:5` found room for them only in its region's last row,
/// and its 16 messages queued along it (7.2k cycles a crossing). The logits keep their bits.
#[test]
fn a_tight_residual_crossing_beside_leaves_on_rows_of_its_own() {
    let (target, shape) = tight_grid();
    let module = build(&Shape { layers: 2, ..shape }, 3);
    let options = CompileOptions { max_context: 64, plan: Plan::stacked(1), ..CompileOptions::default() };
    let program = waferc_passes::wafer::compile(&module, &target, &options).unwrap_or_else(|e| panic!("{e}"));
    let mut crossings = 0;
    for p in program.instrs.iter().filter(|p| p.op == "add") {
        let ResultLayout::Vector(layout) = &p.result else { continue };
        let span = |xs: &mut dyn Iterator<Item = u16>| xs.fold((u16::MAX, 0), |(lo, hi), x| (lo.min(x), hi.max(x)));
        let (own_lo, own_hi) = span(&mut layout.segments.iter().map(|s| s.pe.x));
        let (to_lo, to_hi) =
            span(&mut p.deliveries.iter().flat_map(|&r| program.routes[r as usize].destinations.iter().map(|d| d.x)));
        if !(own_hi < to_lo || to_hi < own_lo) {
            continue;
        }
        crossings += 1;
        let rows: std::collections::BTreeSet<u16> = layout.segments.iter().map(|s| s.pe.y).collect();
        assert_eq!(rows.len(), layout.segments.len(), "{}: segments share rows", p.instr);
        let mut links: std::collections::BTreeMap<_, u32> = Default::default();
        for &r in &p.deliveries {
            program.routes[r as usize]
                .link_messages()
                .into_keys()
                .for_each(|link| *links.entry(link).or_default() += 1);
        }
        assert!(links.values().all(|&n| n == 1), "{}: deliveries share a link", p.instr);
    }
    assert_eq!(crossings, 1, "one region beside another");
    let blob = pack_tile_blob(&program, &module);
    validate(&program, &module, Some(&blob), &[5, 2000], &greedy(3)).unwrap_or_else(|e| panic!("{e}"));
}
