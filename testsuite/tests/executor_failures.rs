//! Broken programs and artifacts make the executor (and validation) fail naming what is wrong:
//! the route, the PE, the instruction and its layer.

mod executor_common;

use executor_common::{compile_for, pack_tile_blob};
use waferc_ir::wafer::{Lanes, Phase, RegionKind, WaferProgram, Work};
use waferc_ir::Module;
use waferc_runtime::executor::{validate, ExecError, ExecOptions, Executor, ValidationOptions};
use waferc_testsuite::models::{build, Shape};

fn dense() -> (Module, WaferProgram) {
    let module = build(&Shape::dense(), 11);
    let program = compile_for(&module, "grid:12x12", 64);
    (module, program)
}

/// Runs two steps of `program`, returning the first error.
fn run(program: &WaferProgram, module: &Module) -> ExecError {
    let blob = pack_tile_blob(program, module);
    let mut executor = match Executor::new(program, module, Some(&blob), ExecOptions::default()) {
        Ok(executor) => executor,
        Err(error) => return error,
    };
    for token in [3, 4] {
        if let Err(error) = executor.step(token) {
            return error;
        }
    }
    panic!("the broken program ran")
}

#[test]
fn a_flipped_byte_in_a_layer_1_tile_names_its_pe_and_layer() {
    let (module, program) = dense();
    let mut blob = pack_tile_blob(&program, &module);
    let placement =
        program.instrs.iter().find(|p| p.layer == Some(1) && p.op == "matvec").expect("layer 1 has a matvec");
    let Work::MatVec(matvec) = &placement.work else { unreachable!() };
    let tile = matvec.tiles.last().expect("tiles");
    let at = program.pes.iter().position(|image| image.pe == tile.pe).expect("the tile's PE has an image");
    let (_, _, range) = (program.blob_ranges())
        .find(|&(of, index, _)| of == at && index == tile.region as usize)
        .expect("a tile's region is a weight region");
    blob[range.start as usize + 5] ^= 0x40;

    let error = validate(&program, &module, Some(&blob), &[3, 4], &ValidationOptions::default()).unwrap_err();
    let ExecError::Mismatch(mismatch) = &error else { panic!("expected a mismatch, got {error}") };
    assert_eq!(mismatch.site.value, placement.instr, "{error}");
    assert_eq!(mismatch.site.layer, Some(1));
    let corrupt = mismatch.corrupt_region.as_ref().expect("the corrupt region is found");
    assert_eq!((corrupt.pe, corrupt.region), (tile.pe, tile.region as usize));
    let message = error.to_string();
    assert!(message.contains(&tile.pe.to_string()) && message.contains("layer 1"), "{message}");
    // The clean blob validates.
    validate(&program, &module, Some(&pack_tile_blob(&program, &module)), &[3, 4], &ValidationOptions::default())
        .unwrap();
}

#[test]
fn a_route_missing_from_its_step_is_named() {
    let (module, mut program) = dense();
    let step = program
        .schedule
        .iter_mut()
        .find(|s| s.phase == Phase::Deliver && !s.routes.is_empty())
        .expect("a delivery step");
    let (instr, route) = (step.instr, step.routes.remove(0));
    match run(&program, &module) {
        ExecError::RouteNotInStep { site, route: named, phase, .. } => {
            assert_eq!((site.value, named, phase), (instr, route, Phase::Deliver));
        }
        other => panic!("expected RouteNotInStep for route {route}, got {other}"),
    }
}

#[test]
fn a_route_missing_from_the_program_is_named() {
    let (module, mut program) = dense();
    let removed = program.routes.pop().expect("routes").id;
    let error = run(&program, &module);
    assert!(matches!(error, ExecError::MissingRoute { route, .. } if route == removed), "{error}");
    assert!(error.to_string().contains(&format!("route {removed}")), "{error}");
}

#[test]
fn a_receiver_that_is_not_a_destination_is_named() {
    let (module, mut program) = dense();
    // Cut one PE of an elementwise op or a norm off from a route bringing it an operand.
    let (instr, route, dropped) = program
        .instrs
        .iter()
        .filter(|p| ["rms_norm", "add", "mul", "silu"].contains(&p.op.as_str()))
        .find_map(|p| {
            let waferc_ir::wafer::ResultLayout::Vector(layout) = &p.result else { return None };
            p.operand_routes.iter().find_map(|&r| {
                let route = &program.routes[r as usize];
                let remote = |pe: &waferc_ir::wafer::Pe| route.destinations.contains(pe) && !route.sources.contains(pe);
                layout.segments.iter().find(|s| remote(&s.pe)).map(|s| (p.instr, r, s.pe))
            })
        })
        .expect("some operand route reaches a segment on another PE");
    program.routes[route as usize].destinations.retain(|&pe| pe != dropped);
    match run(&program, &module) {
        ExecError::NotADestination { site, route: named, pe } => {
            assert_eq!((site.value, named, pe), (instr, route, dropped));
        }
        other => panic!("expected NotADestination on route {route}, got {other}"),
    }
}

#[test]
fn a_sender_that_is_not_a_source_is_named() {
    let (module, mut program) = dense();
    let step = program.schedule.iter().find(|s| s.phase == Phase::Deliver && !s.routes.is_empty()).unwrap().clone();
    let route = step.routes[0];
    let sender = program.routes[route as usize].sources[0];
    let elsewhere = program.pes.iter().map(|i| i.pe).find(|&pe| pe != sender).unwrap();
    // A route from some other PE to itself: the real sender is then not its source.
    let broken = &mut program.routes[route as usize];
    (broken.sources, broken.destinations, broken.path) = (vec![elsewhere], vec![elsewhere], Vec::new());
    match run(&program, &module) {
        ExecError::NotASource { site, route: named, pe } => {
            assert_eq!((site.value, named, pe), (step.instr, route, sender));
        }
        other => panic!("expected NotASource on route {route}, got {other}"),
    }
}

#[test]
fn a_schedule_that_runs_a_consumer_first_names_the_missing_operand() {
    let (module, mut program) = dense();
    // Run the first norm before the embedding: it waits for the embedding's delivery.
    let (embed, rest): (Vec<_>, Vec<_>) = program.schedule.drain(..).partition(|s| s.instr == 0);
    let norm_end = rest.iter().rposition(|s| s.instr == 1).unwrap() + 1;
    let route = embed.iter().find(|s| s.phase == Phase::Deliver).unwrap().routes.clone();
    program.schedule = rest[..norm_end].iter().chain(&embed).chain(&rest[norm_end..]).cloned().collect();
    match run(&program, &module) {
        ExecError::MissingOperand { site, value, .. } => assert_eq!((site.op.as_str(), value), ("rms_norm", 0)),
        ExecError::MissingMessage { route: named, site, .. } => {
            assert!(route.contains(&named), "route {named} is one of the embedding's deliveries {route:?}");
            assert_eq!(site.op, "rms_norm");
        }
        other => panic!("expected the norm to miss the embedding (routes {route:?}), got {other}"),
    }
}

/// A KV block whose positions end before they start (a malformed artifact) is an error naming
/// the attention and the block's PE when the executor is prepared, timing-only too, not an
/// underflow in the prefill model or the attention kernel.
#[test]
fn an_inverted_kv_block_range_is_named_not_an_underflow() {
    let (module, mut program) = dense();
    let placement = program.instrs.iter_mut().find(|p| p.op == "attention").expect("an attention");
    let instr = placement.instr;
    let Work::Attention(attention) = &mut placement.work else { panic!("attention's work") };
    let block = &mut attention.kv_heads_placed[0].blocks[0];
    block.positions = block.positions.end + 3..block.positions.start;
    let pe = block.pe;
    let timing_only = ExecOptions { timing_only: true, ..ExecOptions::default() };
    let blob = pack_tile_blob(&program, &module);
    for options in [ExecOptions::default(), timing_only] {
        let Err(error) = Executor::new(&program, &module, Some(&blob), options) else {
            panic!("an inverted KV block was accepted")
        };
        let message = error.to_string();
        assert!(matches!(error, ExecError::MalformedOnPe { .. }), "{message}");
        assert!(message.contains(&format!("%{instr} = attention")) && message.contains(&pe.to_string()), "{message}");
        assert!(message.contains("block positions") && message.contains("end before they start"), "{message}");
    }
}

/// A KV block's lanes from a malformed artifact (past the chunk's 8, or of a block longer than a
/// chunk) are refused naming the block, before any slot is computed from them.
#[test]
fn kv_block_lanes_outside_one_chunk_are_named() {
    let (module, program) = dense();
    let placement = program.instrs.iter().position(|p| p.op == "attention").expect("an attention");
    let wide = Lanes { first: 128, count: 128 };
    for (lanes, positions) in [(wide, None), (Lanes::group(1, 2), Some(0..64))] {
        let mut program = program.clone();
        let Work::Attention(attention) = &mut program.instrs[placement].work else { panic!("attention's work") };
        let block = &mut attention.kv_heads_placed[0].blocks[0];
        block.lanes = lanes;
        if let Some(positions) = positions {
            block.positions = positions;
        }
        let pe = block.pe;
        let Err(error) = Executor::new(&program, &module, None, ExecOptions::default()) else {
            panic!("{lanes} was accepted")
        };
        let message = error.to_string();
        assert!(message.contains(&pe.to_string()) && message.contains(&lanes.to_string()), "{message}");
        assert!(
            message.contains("not an aligned power-of-two run of the 8 lanes of one 32-position chunk"),
            "{message}"
        );
    }
}

/// A weight region whose rows are inverted is named with its PE and region.
#[test]
fn an_inverted_weight_region_is_named() {
    let (module, mut program) = dense();
    let blob = pack_tile_blob(&program, &module);
    let image =
        program.pes.iter_mut().find(|image| image.regions.iter().any(|r| matches!(r.kind, RegionKind::Weight { .. })));
    let image = image.expect("a PE holds a weight");
    let pe = image.pe;
    let index = image.regions.iter().position(|r| matches!(r.kind, RegionKind::Weight { .. })).unwrap();
    let RegionKind::Weight { rows, .. } = &mut image.regions[index].kind else { unreachable!() };
    *rows = rows.end + 1..rows.start;
    let Err(error) = Executor::new(&program, &module, Some(&blob), ExecOptions::default()) else {
        panic!("an inverted weight region was accepted")
    };
    let message = error.to_string();
    assert!(message.contains(&pe.to_string()) && message.contains(&format!("region {index}: rows")), "{message}");
}
