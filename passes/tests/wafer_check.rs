use waferc_ir::completion::Completion;
use waferc_ir::wafer::{Pe, Plan, Region, RegionKind, ResultLayout, WaferProgram, Work};
use waferc_ir::Module;
use waferc_passes::wafer::{check, compile, CheckError, CompileOptions, WaferError};
use waferc_targets::Target;
use waferc_testsuite::models::{build, Shape};

fn compiled() -> (Module, WaferProgram) {
    let module = build(&Shape::tiny(), 7);
    let program = compile(&module, &Target::resolve("grid:8x8").unwrap(), &CompileOptions::new(64)).unwrap();
    check(&program, &module).unwrap();
    (module, program)
}

/// The tiny model with the stacked plan (one layer per region, `kv_copies` copies of each KV
/// head's cache) on a 16x16 grid, accepted by the checker.
fn compiled_stacked(kv_copies: u8) -> (Module, WaferProgram) {
    compiled_stacked_spread(kv_copies, 1, "grid:16x16")
}

/// As [`compiled_stacked`], each KV block spread over `kv_spread` PEs, on `grid`.
fn compiled_stacked_spread(kv_copies: u8, kv_spread: u8, grid: &str) -> (Module, WaferProgram) {
    let module = build(&Shape::tiny(), 7);
    let plan = Plan::Stacked {
        layers_per_region: 1,
        wafer_percent: 100,
        kv_copies,
        experts_per_lane: 1,
        kv_spread,
        kv_slices: 1,
    };
    let options = CompileOptions { plan, ..CompileOptions::new(64) };
    let program = compile(&module, &Target::resolve(grid).unwrap(), &options).unwrap();
    check(&program, &module).unwrap();
    (module, program)
}

/// The tiny model with 64-element heads, the stacked plan with each KV head's cache in two
/// slices of its head dimension, accepted by the checker.
fn compiled_sliced() -> (Module, WaferProgram) {
    let module = build(&Shape { head_dim: 64, ..Shape::tiny() }, 7);
    let options = CompileOptions { plan: Plan::stacked(1).with_kv_slices(2), ..CompileOptions::new(64) };
    let program = compile(&module, &Target::resolve("grid:16x32").unwrap(), &options).unwrap();
    check(&program, &module).unwrap();
    (module, program)
}

fn problems(program: &WaferProgram, module: &Module) -> CheckError {
    check(program, module).expect_err("the checker must reject the fault")
}

#[test]
fn a_deleted_route_is_named() {
    let (module, mut program) = compiled();
    // Delete a matvec's collect: the step using it and the placement naming it must complain.
    let victim = program
        .instrs
        .iter()
        .find_map(|p| match &p.work {
            Work::MatVec(mv) => mv.collects.first().copied(),
            _ => None,
        })
        .expect("some matvec collects");
    program.routes.remove(victim as usize);
    let err = problems(&program, &module);
    assert!(err.problems.iter().any(|p| p.route == Some(victim) && p.message.contains("does not exist")), "{err}");
    assert!(err.to_string().contains(&format!("route {victim}")));
}

#[test]
fn a_deleted_delivery_leaves_an_operand_without_a_route() {
    let (module, mut program) = compiled();
    let victim = program.instrs.iter().find_map(|p| p.deliveries.first().copied()).unwrap();
    let pe_fed = program.routes[victim as usize].destinations[0];
    // Keep ids consistent (replace by a route to nowhere useful) so only reachability fails.
    let route = &mut program.routes[victim as usize];
    route.destinations.clear();
    route.destinations.push(route.sources[0]);
    let err = problems(&program, &module);
    assert!(
        err.problems.iter().any(|p| p.pe == Some(pe_fed) && p.message.contains("no route from its producer")),
        "{err}"
    );
}

#[test]
fn an_over_full_pe_is_named() {
    let (module, mut program) = compiled();
    let image = &mut program.pes[3];
    let pe = image.pe;
    let end = image.regions.last().map(|r| r.offset + r.bytes).unwrap();
    image.regions.push(Region { offset: end, bytes: 48 * 1024, instr: Some(0), kind: RegionKind::Scratch });
    let err = problems(&program, &module);
    assert!(err.problems.iter().any(|p| p.pe == Some(pe) && p.message.contains("over the")), "{err}");
}

#[test]
fn a_doubly_placed_tile_is_caught() {
    let (module, mut program) = compiled();
    // Copy one matvec tile's weight region onto a second PE.
    let (pe, region) = program
        .pes
        .iter()
        .find_map(|image| {
            image
                .regions
                .iter()
                .find(|r| matches!(r.kind, RegionKind::Weight { .. }) && r.bytes > 64)
                .map(|r| (image.pe, r.clone()))
        })
        .unwrap();
    let other = program.pes.iter_mut().find(|image| image.pe != pe).unwrap();
    let end = other.regions.last().map(|r| r.offset + r.bytes).unwrap();
    other.regions.push(Region { offset: end, ..region.clone() });
    let err = problems(&program, &module);
    assert!(err.problems.iter().any(|p| p.message.contains("held twice")), "{err}");

    // Listing the same tile twice in a placement is caught too.
    let (module, mut program) = compiled();
    let mv = program
        .instrs
        .iter_mut()
        .find_map(|p| match &mut p.work {
            Work::MatVec(mv) => Some(mv),
            _ => None,
        })
        .unwrap();
    let first = mv.tiles[0].clone();
    mv.tiles.push(first);
    let err = problems(&program, &module);
    assert!(
        err.problems.iter().any(|p| p.message.contains("placed twice") || p.message.contains("tiles for a")),
        "{err}"
    );
}

/// The tile blob lays the weight regions' bytes end to end, so its length is their sum: a blob
/// longer than its regions is named, and so is a weight region whose bytes are not its rows
/// of its columns.
#[test]
fn a_tile_blob_or_weight_region_of_the_wrong_size_is_caught() {
    let (module, mut program) = compiled();
    program.tile_blob_len += 2;
    let err = problems(&program, &module);
    assert!(err.problems.iter().any(|p| p.message.contains("the weight regions hold")), "{err}");

    let (module, mut program) = compiled();
    let (pe, region) = (program.pes.iter_mut())
        .find_map(|image| {
            let pe = image.pe;
            image.regions.iter_mut().find(|r| matches!(r.kind, RegionKind::Weight { .. })).map(|r| (pe, r))
        })
        .unwrap();
    region.bytes += 2;
    program.tile_blob_len += 2;
    let err = problems(&program, &module);
    assert!(err.problems.iter().any(|p| p.pe == Some(pe) && p.message.contains("; expected")), "{err}");
}

#[test]
fn shared_colours_and_broken_paths_are_caught() {
    let (module, mut program) = compiled();
    // Two routes that share a PE and may be active at the same time (their instructions are
    // different and neither reads the other's result), given the same colour.
    let (a, b) = {
        let touched = |r: &waferc_ir::wafer::Route| -> Vec<Pe> {
            let mut pes: Vec<Pe> = r.sources.iter().chain(&r.destinations).copied().collect();
            pes.extend(r.path.iter().flat_map(|run| run.pes()));
            pes
        };
        let reads = |reader: u32, source: u32| {
            let mut stack = vec![reader as usize];
            let mut seen = std::collections::HashSet::new();
            while let Some(v) = stack.pop() {
                for operand in module.body[waferc_ir::Handle::new(v)].op.operands() {
                    if operand.index() == source as usize {
                        return true;
                    }
                    if seen.insert(operand.index()) {
                        stack.push(operand.index());
                    }
                }
            }
            false
        };
        let mut found = None;
        'outer: for (i, r) in program.routes.iter().enumerate() {
            for (j, s) in program.routes.iter().enumerate().skip(i + 1) {
                let apart = r.instr == s.instr || reads(r.instr, s.instr) || reads(s.instr, r.instr);
                if !apart && touched(r).iter().any(|pe| touched(s).contains(pe)) {
                    found = Some((i, j));
                    break 'outer;
                }
            }
        }
        found.expect("two unordered routes meet at a PE")
    };
    program.routes[b].colour = program.routes[a].colour;
    let err = problems(&program, &module);
    assert!(err.problems.iter().any(|p| p.message.contains("already used at this PE")), "{err}");

    let (module, mut program) = compiled();
    let route = program.routes.iter_mut().find(|r| !r.path.is_empty()).unwrap();
    let id = route.id;
    route.path[0].from = Pe::new(0, 7, 7);
    route.path[0].to = Pe::new(0, 7, 6);
    let err = problems(&program, &module);
    assert!(err.problems.iter().any(|p| p.route == Some(id)), "{err}");

    let (module, mut program) = compiled();
    program.routes[0].colour = 30;
    assert!(problems(&program, &module).problems.iter().any(|p| p.message.contains("over the limit")));
}

#[test]
fn a_module_that_does_not_fit_says_by_how_much_and_what_would() {
    let module = build(
        &Shape {
            layers: 4,
            hidden: 512,
            ffn: 2048,
            vocab: 4096,
            heads: 8,
            kv_heads: 4,
            head_dim: 64,
            bytes: false,
            ..Shape::tiny()
        },
        7,
    );
    let target = Target::resolve("grid:16x16").unwrap();
    match compile(&module, &target, &CompileOptions::new(256)) {
        Err(WaferError::DoesNotFit(report)) => {
            assert_eq!(report.available_pes, 256);
            assert!(report.needed_pes > 256);
            assert_eq!(report.short_pes(), report.needed_pes - 256);
            assert_eq!(report.short_bytes(), report.short_pes() * 49152);
            assert!(report.would_fit.contains(&"wse3".to_string()), "{report}");
            let text = report.to_string();
            assert!(text.contains("grid:16x16") && text.contains("short by") && text.contains("wse3"), "{text}");
        }
        other => panic!("expected does-not-fit, got {other:?}"),
    }
}

#[test]
fn quantisation_is_suggested_when_it_would_fit() {
    // bf16 weights just over a grid; q8_0/q4_0 halve or quarter them.
    let module = build(
        &Shape {
            layers: 2,
            hidden: 1024,
            ffn: 2048,
            vocab: 2048,
            heads: 8,
            kv_heads: 4,
            head_dim: 128,
            bytes: false,
            ..Shape::tiny()
        },
        7,
    );
    let target = Target::resolve("grid:30x36").unwrap();
    match compile(&module, &target, &CompileOptions::new(64)) {
        Err(WaferError::DoesNotFit(report)) => {
            assert!(report.would_fit.iter().any(|s| s == "q8_0 on grid:30x36"), "{report}");
            assert!(report.would_fit.iter().any(|s| s == "q4_0 on grid:30x36"), "{report}");
        }
        other => panic!("expected does-not-fit, got {other:?}"),
    }
}

#[test]
fn bad_options_are_refused() {
    let module = build(&Shape::tiny(), 7);
    let target = Target::resolve("grid:8x8").unwrap();
    assert!(matches!(compile(&module, &target, &CompileOptions::new(0)), Err(WaferError::Options(_))));
    let mesh = CompileOptions {
        max_context: 64,
        plan: waferc_ir::wafer::Plan::MeshGemv { p: 0, group_num: 1 },
        ..CompileOptions::default()
    };
    assert!(matches!(compile(&module, &target, &mesh), Err(WaferError::Options(_))));
    // Two query heads per KV head: three copies cannot share them.
    let copies = CompileOptions {
        plan: Plan::Stacked {
            layers_per_region: 1,
            wafer_percent: 100,
            kv_copies: 3,
            experts_per_lane: 1,
            kv_spread: 1,
            kv_slices: 1,
        },
        ..CompileOptions::new(64)
    };
    let grid = Target::resolve("grid:16x16").unwrap();
    match compile(&module, &grid, &copies) {
        Err(e) => assert!(e.to_string().contains("3 copies of a KV head cannot share its 2 query heads"), "{e}"),
        Ok(_) => panic!("kv3 over two query heads per KV head compiled"),
    }
}

#[test]
fn a_collect_aimed_at_the_wrong_pe_is_named() {
    let (module, mut program) = compiled();
    let victim = program
        .instrs
        .iter()
        .find_map(|p| match &p.work {
            Work::MatVec(mv) => mv.collects.first().copied(),
            _ => None,
        })
        .unwrap();
    // Retarget it at one of its own sources (a tile), which does not hold the result.
    let route = &mut program.routes[victim as usize];
    route.destinations = vec![route.sources[0]];
    let err = problems(&program, &module);
    assert!(
        err.problems.iter().any(|p| p.route == Some(victim) && p.message.contains("holds nothing of what it carries")),
        "{err}"
    );
}

#[test]
fn a_norm_group_cut_off_chunk_boundaries_is_caught() {
    // The stacked plan cuts norms over many segments.
    let (module, mut program) = compiled_stacked(1);
    // Move the boundary between a norm's first two segments of one group by half a chunk: the
    // reduction's leaves are then no longer subtrees of the chunk tree.
    let (instr, pe) = program
        .instrs
        .iter_mut()
        .find_map(|p| {
            let (Work::RmsNorm(norm), ResultLayout::Vector(layout)) = (&p.work, &mut p.result) else { return None };
            let [a, b, ..] = &mut layout.segments[..] else { return None };
            let same_group = a.elements.start / norm.group_len == b.elements.start / norm.group_len;
            (same_group && a.elements.end - a.elements.start > 16).then(|| {
                a.elements.end -= 16;
                b.elements.start -= 16;
                (p.instr, a.pe)
            })
        })
        .expect("a norm group over two segments");
    let err = problems(&program, &module);
    assert!(
        err.problems.iter().any(|p| p.instr == Some(instr)
            && p.pe == Some(pe)
            && p.message.contains("are not an aligned power-of-two run of 32-element chunks")),
        "{err}"
    );
}

#[test]
fn kv_copies_that_do_not_partition_the_query_heads_are_caught() {
    let (module, mut program) = compiled_stacked(2);
    // Both copies of a KV head then serve its first query head; its second has no blocks.
    let instr = program
        .instrs
        .iter_mut()
        .find_map(|p| {
            let Work::Attention(att) = &mut p.work else { return None };
            let second = att.kv_heads_placed.iter_mut().find(|h| h.query_heads.start == 1)?;
            second.query_heads = 0..1;
            Some(p.instr)
        })
        .expect("an attention with a KV head in two copies");
    let err = problems(&program, &module);
    assert!(err.problems.iter().any(|p| p.instr == Some(instr) && p.message.contains("not the next ones")), "{err}");
}

#[test]
fn kv_slices_that_do_not_cut_the_head_dimension_in_order_are_caught() {
    let (module, mut program) = compiled_sliced();
    // The second slice claims the first one's dims: the dims 32..64 are held by no block.
    let instr = program
        .instrs
        .iter_mut()
        .find_map(|p| {
            let Work::Attention(att) = &mut p.work else { return None };
            att.kv_heads_placed[1].dims = 0..32;
            Some(p.instr)
        })
        .expect("an attention");
    let err = problems(&program, &module);
    assert!(err.problems.iter().any(|p| p.instr == Some(instr) && p.message.contains("holds dims")), "{err}");
}

#[test]
fn a_kv_slice_score_sum_that_skips_a_slice_is_caught() {
    let (module, mut program) = compiled_sliced();
    // The first block's score sum starts at the second slice's block only: the first slice's
    // part would be missing from every score.
    let (instr, id) = program
        .instrs
        .iter()
        .find_map(|p| match &p.work {
            Work::Attention(att) => Some((p.instr, att.kv_heads_placed[0].score_reduce[0])),
            _ => None,
        })
        .expect("an attention in slices");
    program.routes[id as usize].sources.remove(0);
    let err = problems(&program, &module);
    assert!(
        err.problems.iter().any(|p| p.instr == Some(instr) && p.message.contains("not the sum of its slices' scores")),
        "{err}"
    );
}

#[test]
fn a_rope_part_away_from_its_twin_is_caught() {
    // 128-element heads: the stacked plan cuts the queries and keys in chunks, each in the
    // second half of a head on its twin's PE, so a head's rope runs on two PEs in place.
    let module = build(&Shape { head_dim: 128, ..Shape::tiny() }, 7);
    let options = CompileOptions { plan: Plan::stacked(1), ..CompileOptions::new(64) };
    let mut program = compile(&module, &Target::resolve("grid:16x32").unwrap(), &options).unwrap();
    check(&program, &module).unwrap();
    // Move a rope's second-half part to the PE of the head's other pair.
    let instr = program
        .instrs
        .iter_mut()
        .find_map(|p| {
            let (ResultLayout::Vector(layout), "rope") = (&mut p.result, p.op.as_str()) else { return None };
            let parts = &mut layout.segments;
            assert_eq!(parts[0].elements, 0..32, "rope parts of a chunk");
            assert_eq!(parts[2].pe, parts[0].pe, "a part sits with its twin");
            assert_ne!(parts[1].pe, parts[0].pe, "a head's pairs on two PEs");
            parts[2].pe = parts[1].pe;
            Some(p.instr)
        })
        .expect("a rope");
    let err = problems(&program, &module);
    assert!(
        err.problems.iter().any(|p| p.instr == Some(instr) && p.message.contains("neither holds nor expects")),
        "{err}"
    );
}

#[test]
fn kv_lane_groups_out_of_order_are_caught() {
    let (module, mut program) = compiled_stacked_spread(1, 2, "grid:32x32");
    // A chunk's second lane group first: its leaf would be the left operand of the lane combine.
    let (instr, pe) = program
        .instrs
        .iter_mut()
        .find_map(|p| {
            let Work::Attention(att) = &mut p.work else { return None };
            let blocks = &mut att.kv_heads_placed[0].blocks;
            blocks.swap(0, 1);
            Some((p.instr, blocks[0].pe))
        })
        .expect("an attention");
    let err = problems(&program, &module);
    assert!(
        err.problems.iter().any(|p| p.instr == Some(instr)
            && p.pe == Some(pe)
            && p.message.contains("(lanes 4..8) is not the next aligned power-of-two run")),
        "{err}"
    );
}

#[test]
fn operand_buffers_overlap_only_where_one_instruction_is_done_before_the_other_reads() {
    let (module, mut program) = compiled_stacked(1);
    // The placer shares: on some PE the operand buffers of instructions that run one after the
    // other (a layer's q/k/v and its FFN's) take the same bytes, and the checker accepted that.
    let summed = |image: &waferc_ir::wafer::PeImage| image.regions.iter().map(|r| r.bytes as u64).sum::<u64>();
    assert!(program.pes.iter().any(|image| image.used_bytes() < summed(image)), "no PE shares operand bytes");
    // Move a buffer onto one whose instruction may run at the same time (two matvecs reading
    // the same norm): the checker names the pair.
    let completion = Completion::new(&module);
    let buffers = |image: &waferc_ir::wafer::PeImage| -> Vec<(usize, u32, u32)> {
        image
            .regions
            .iter()
            .enumerate()
            .filter_map(|(at, r)| match r.kind {
                RegionKind::Operand { value, .. } => Some((at, r.instr?, value)),
                _ => None,
            })
            .collect()
    };
    let (pe, moved, onto) = program
        .pes
        .iter()
        .find_map(|image| {
            let held = buffers(image);
            held.iter().find_map(|&(a, ia, va)| {
                held.iter()
                    .find(|&&(b, ib, vb)| {
                        b != a
                            && ia != ib
                            && !completion.done_before(ia as usize, vb as usize)
                            && !completion.done_before(ib as usize, va as usize)
                            && image.regions[b].bytes <= image.regions[a].bytes
                    })
                    .map(|&(b, _, _)| (image.pe, b, a))
            })
        })
        .expect("a PE holds two buffers live at once");
    let image = program.pes.iter_mut().find(|image| image.pe == pe).unwrap();
    image.regions[moved].offset = image.regions[onto].offset;
    let err = problems(&program, &module);
    assert!(err.problems.iter().any(|p| p.pe == Some(pe) && p.message.contains("overlap, but neither")), "{err}");
}

#[test]
fn results_share_bytes_only_once_their_readers_are_done() {
    let (module, mut program) = compiled_stacked(1);
    let completion = Completion::new(&module);
    let is_result = |r: &Region| matches!(r.kind, RegionKind::Output { .. });
    let overlaps = |a: &Region, b: &Region| a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
    // The placer shares: on some PE a result takes bytes another working region (a later
    // layer's result or buffer) takes too, and the checker accepted that.
    assert!(
        program.pes.iter().any(|image| image.regions.iter().enumerate().any(|(a, r)| is_result(r)
            && image.regions.iter().enumerate().any(|(b, o)| a != b && o.kind.is_working() && overlaps(r, o)))),
        "no result shares bytes"
    );
    // Move a result onto a working region that is live at the same time (neither is dead before
    // the other is written): the checker names the pair.
    let (pe, moved, onto) = program
        .pes
        .iter()
        .find_map(|image| {
            let regions = &image.regions;
            regions.iter().enumerate().filter(|(_, r)| is_result(r)).find_map(|(a, r)| {
                regions
                    .iter()
                    .enumerate()
                    .find(|&(b, o)| b != a && o.kind.is_working() && o.bytes >= r.bytes && !r.may_share(o, &completion))
                    .map(|(b, _)| (image.pe, a, b))
            })
        })
        .expect("a PE holds a result live beside another working region");
    let image = program.pes.iter_mut().find(|image| image.pe == pe).unwrap();
    image.regions[moved].offset = image.regions[onto].offset;
    let err = problems(&program, &module);
    assert!(
        err.problems.iter().any(|p| p.pe == Some(pe)
            && p.message.contains("'s result at offset")
            && p.message.contains("overlap, but neither")),
        "{err}"
    );
}
