//! The executor's timing model on compiled programs: deterministic, the same whether values are
//! computed or not, monotone in the target's costs, and fast enough for full-size shape-only
//! programs.

mod executor_common;

use executor_common::{compile_for, compile_with, pack_tile_blob};
use waferc_ir::wafer::profile::{timing_only_experts, timing_picks};
use waferc_ir::wafer::{distance_bound_cycles, distance_bound_ends, LayerProfile, Plan, RoutingProfile};
use waferc_passes::rewrite::rewrite_module;
use waferc_passes::wafer::CompileOptions;
use waferc_passes::PlanKind;
use waferc_runtime::executor::{ExecError, ExecOptions, Executor, StepTiming};
use waferc_testsuite::models::{build, Shape};

fn timings(
    program: &waferc_ir::wafer::WaferProgram,
    module: &waferc_ir::Module,
    blob: Option<&[u8]>,
    steps: usize,
) -> Vec<StepTiming> {
    let options = ExecOptions { timing_only: blob.is_none(), ..ExecOptions::default() };
    let mut executor = Executor::new(program, module, blob, options).unwrap();
    (0..steps).map(|i| executor.step(i as u32 + 1).unwrap().timing).collect()
}

#[test]
fn timing_is_deterministic_and_the_same_without_values() {
    let module = build(&Shape::dense(), 5);
    let program = compile_for(&module, "grid:12x12", 64);
    let blob = pack_tile_blob(&program, &module);
    let first = timings(&program, &module, Some(&blob), 4);
    assert_eq!(first, timings(&program, &module, Some(&blob), 4));
    assert_eq!(first, timings(&program, &module, None, 4), "timing only walks the same steps and routes");
    let shape_only = build(&Shape { bytes: false, ..Shape::dense() }, 5);
    let shape_program = compile_for(&shape_only, "grid:12x12", 64);
    assert_eq!(first, timings(&shape_program, &shape_only, None, 4), "a shape-only compile times the same");
    for timing in &first {
        assert!(timing.cycles > 0);
        assert_eq!(timing.spans.len(), program.schedule.len());
        let last_end = timing.spans.iter().map(|s| s.start_cycle + s.duration_cycles).max().unwrap();
        assert_eq!(timing.cycles, last_end);
    }
    // Attention reads one more position each step; nothing else changes.
    assert!(
        first.windows(2).all(|w| w[0].cycles <= w[1].cycles),
        "{:?}",
        first.iter().map(|t| t.cycles).collect::<Vec<_>>()
    );
}

/// gpt-oss's attention sinks are weights the attention reads on its reductions' root; a
/// timing-only run (no SRAM) walks the same steps without reading them, past the sliding layers'
/// window of 8 positions, and times every attention (sliding and full) as a run with values does.
/// Only the experts differ: the timing-only router takes a uniform router's picks.
#[test]
fn gpt_oss_times_attention_the_same_without_values() {
    let name = "gpt-oss-tiny-mxfp4";
    let module = waferc::frontend::load(&waferc_testsuite::fixtures_dir().join("hf").join(name)).unwrap().module;
    assert!(module.body.iter().any(|(_, i)| matches!(i.op, waferc_ir::Op::Attention { sinks: Some(_), .. })));
    let program = compile_for(&module, "grid:32x32", 64);
    let blob = pack_tile_blob(&program, &module);
    let with_values = timings(&program, &module, Some(&blob), 10);
    let timing_only = timings(&program, &module, None, 10);
    for (values, shapes) in with_values.iter().zip(&timing_only) {
        let step = |s: &waferc_runtime::executor::StepSpan| (s.step, s.instr, s.op.clone(), s.layer, s.expert, s.phase);
        assert!(values.spans.iter().map(step).eq(shapes.spans.iter().map(step)), "position {}", values.position);
        let attention = |timing: &StepTiming| {
            let spans = timing.spans.iter().filter(|s| s.op == "attention");
            spans.map(|s| (s.layer, s.phase, s.duration_cycles)).collect::<Vec<_>>()
        };
        assert_eq!(attention(values), attention(shapes), "position {}", values.position);
        let layers: std::collections::BTreeSet<_> = attention(values).iter().map(|&(layer, ..)| layer).collect();
        assert_eq!(layers.len(), 4, "every layer's attention is compared");
    }
}

#[test]
fn slower_hops_links_and_arithmetic_cost_more_cycles() {
    let module = build(&Shape { bytes: false, ..Shape::dense() }, 6);
    let program = compile_for(&module, "grid:12x12", 64);
    let cycles = |program: &waferc_ir::wafer::WaferProgram| timings(program, &module, None, 2)[1].cycles;
    let base = cycles(&program);
    let mut slower = program.clone();
    slower.target.hop_latency_cycles *= 4;
    assert!(cycles(&slower) > base, "4x hop latency");
    let mut narrower = program.clone();
    narrower.target.link_bytes_per_cycle = 1;
    assert!(cycles(&narrower) > base, "quarter link bandwidth");
    let mut weaker = program.clone();
    weaker.target.f32_fma_per_cycle /= 2.0;
    assert!(cycles(&weaker) > base, "half the arithmetic rate");
}

#[test]
fn report_derives_throughput_and_time_to_first_token_from_the_steps() {
    let module = build(&Shape::moe(), 7);
    let program = compile_for(&module, "grid:12x12", 64);
    let blob = pack_tile_blob(&program, &module);
    let mut executor = Executor::new(&program, &module, Some(&blob), ExecOptions::default()).unwrap();
    assert!(executor.timing_report(1).is_none(), "no report before a step");
    let cycles: Vec<u64> = [5, 6, 7, 8, 9].iter().map(|&t| executor.step(t).unwrap().timing.cycles).collect();
    let report = executor.timing_report(3).unwrap();
    assert_eq!(report.cycles_per_token, ((cycles[3] + cycles[4]) as f64 / 2.0).round() as u64);
    assert_eq!(report.modeled_decode_tok_s, report.clock_hz / report.cycles_per_token as f64);
    let ttft_cycles: u64 = cycles[..3].iter().sum();
    assert!((report.modeled_ttft_us - ttft_cycles as f64 / report.clock_hz * 1e6).abs() < 1e-9);
    assert_eq!(report.pes_used, program.pes.len());
    assert!(!report.busiest_pes.is_empty() && !report.busiest_links.is_empty());
    assert!(report.busiest_pes.windows(2).all(|w| w[0].cycles >= w[1].cycles));
    assert!(report.busiest_links.iter().all(|l| l.utilisation > 0.0 && l.utilisation <= 1.0 + 1e-9));
    // Only the chosen experts worked: top 2 of 4, so some expert steps took no time.
    let idle = report.steps.iter().filter(|s| s.expert.is_some() && s.duration_cycles == 0).count();
    let busy = report.steps.iter().filter(|s| s.expert.is_some() && s.duration_cycles > 0).count();
    assert!(idle > 0 && busy > 0, "{idle} idle and {busy} busy expert steps");
    // An unchosen expert sends nothing and no PE of it works.
    for span in report.steps.iter().filter(|s| s.expert.is_some() && s.duration_cycles == 0) {
        assert_eq!((span.routes, span.pes), (0, 0), "{span:?}");
    }
    let json = serde_json::to_value(&report).unwrap();
    for key in [
        "modeled_decode_tok_s",
        "modeled_ttft_us",
        "cycles_per_token",
        "pes_used",
        "busiest_links",
        "busiest_pes",
        "steps",
        "layers",
        "mean_layer",
        "costliest_steps",
        "prefill",
        "modeled_ttft_prefill_us",
    ] {
        assert!(json.get(key).is_some(), "--json has {key}");
    }
}

/// Seeking (timing only) moves a sequence deep into its context without feeding the positions
/// before: the step there is the step that feeding every earlier position leads to, span for
/// span, on the tiled plan and on the stacked plan (whose KV blocks hold 32 positions and more).
/// Its report starts at that position and leaves out the batched prefill, which starts from
/// position 0. A run with values cannot seek (its KV blocks would hold no keys), nor can any run
/// past the KV capacity.
#[test]
fn a_step_after_seeking_costs_what_it_costs_after_feeding_every_earlier_position() {
    let module = build(&Shape::dense(), 5);
    let stacked = Plan::stacked(2);
    for plan in [Plan::Tiled, stacked] {
        let program = compile_with(&module, "grid:24x24", CompileOptions { plan, ..CompileOptions::new(128) });
        let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
        let mut fed = Executor::new(&program, &module, None, options).unwrap();
        let steps: Vec<StepTiming> = (0..100).map(|t| fed.step(t % 7 + 1).unwrap().timing).collect();
        for position in [1u32, 31, 32, 63, 99] {
            let mut sought = Executor::new(&program, &module, None, options).unwrap();
            sought.seek(position).unwrap();
            let step = sought.step(3).unwrap().timing;
            assert_eq!(step, steps[position as usize], "{plan}: the step at position {position}");
            let report = sought.timing_report(1).unwrap();
            assert_eq!((report.first_position, report.cycles_per_token), (position, step.cycles));
            assert!(report.prefill.iter().all(|p| p.cycles.is_none()), "{plan}: {:?}", report.prefill);
        }
        assert!(steps[99].cycles > steps[0].cycles, "{plan}: attention over 100 positions costs more than over one");
        let mut full = Executor::new(&program, &module, None, options).unwrap();
        assert!(matches!(full.seek(128), Err(ExecError::ContextFull { position: 128, max_context: 128 })));
    }
    let program = compile_for(&module, "grid:24x24", 128);
    let blob = pack_tile_blob(&program, &module);
    let mut with_values = Executor::new(&program, &module, Some(&blob), ExecOptions::default()).unwrap();
    assert!(matches!(with_values.seek(5), Err(ExecError::SeekWithValues { position: 5 })));
}

/// A full-size Llama-3.1-8B-shaped program on WSE-3 (shape-only), timed without values: the
/// executor's setup and one token take seconds even in the test profile.
#[test]
fn llama8b_on_wse3_times_a_token_quickly() {
    let module = build(&Shape::llama8b(), 8);
    let start = std::time::Instant::now();
    let program = compile_for(&module, "wse3", 4096);
    let compiled = start.elapsed();
    let start = std::time::Instant::now();
    let mut executor =
        Executor::new(&program, &module, None, ExecOptions { timing_only: true, ..ExecOptions::default() }).unwrap();
    let prepared = start.elapsed();
    let start = std::time::Instant::now();
    let timing = executor.step(1).unwrap().timing;
    let stepped = start.elapsed();
    let report = executor.timing_report(1).unwrap();
    eprintln!(
        "8B on wse3: compile {compiled:?}, executor setup {prepared:?}, one token {stepped:?}; {} PEs, {} cycles/token, {:.0} tok/s modeled",
        report.pes_used, timing.cycles, report.modeled_decode_tok_s
    );
    assert!(prepared + stepped < std::time::Duration::from_secs(30));
}

/// Without a profile, a timing-only step charges a uniform router's picks, drawn per layer and
/// position ([`timing_picks`]): exactly those experts compute, and the picks move, so no plan is
/// timed on one fixed set of experts.
#[test]
fn timing_only_moe_runs_a_uniform_routers_picks() {
    let module = build(&Shape { bytes: false, ..Shape::moe() }, 9);
    let program = compile_for(&module, "grid:12x12", 64);
    let computing = |s: &&waferc_runtime::executor::StepSpan| {
        s.expert.is_some() && s.phase == waferc_ir::wafer::Phase::Compute && s.op != "expert_dispatch"
    };
    let mut picked = std::collections::BTreeSet::new();
    for (position, timing) in timings(&program, &module, None, 4).iter().enumerate() {
        let runs = timing_only_experts(&module, None, position as u32);
        for span in timing.spans.iter().filter(computing) {
            let (layer, expert) = (span.layer.unwrap(), span.expert.unwrap());
            assert_eq!(
                span.duration_cycles > 0,
                runs(layer, expert),
                "position {position}: expert {expert} of %{} ({})",
                span.instr,
                span.op
            );
            if span.duration_cycles > 0 {
                picked.insert((layer, expert));
            }
        }
        assert_eq!((0..8).filter(|&e| runs(0, e)).count(), timing_picks(None, 0, 8, 2, position as u32).len());
    }
    assert!(picked.len() > 2 * Shape::moe().layers as usize, "the picks never move: {picked:?}");
}

/// The model never times a step faster than the placement's own distance bound (only hops, no
/// arithmetic, serialisation or contention), at any position (attention's empty blocks send
/// nothing, and the bound counts only the blocks holding positions), on every plan kind (tiled,
/// MeshGemv, stacked with one and with two layers per region, with each KV head's cache in
/// slices of its head dimension, and the plan `compile`'s search picks), dense and MoE, on one
/// wafer and on a two-wafer pipeline.
#[test]
fn modeled_cycles_never_undercut_the_distance_bound() {
    let mesh = Plan::MeshGemv { p: 4, group_num: 2 };
    let two = "name = \"two-grids\"\nbase = \"wse3\"\ngrid_cols = 12\ngrid_rows = 12\nwafers = 2\n";
    let two = waferc_targets::Target::from_toml(two, "two-grids.toml").unwrap();
    let mut cases = vec![
        (Shape::dense(), "grid:12x12", Some(Plan::Tiled)),
        (Shape::dense(), "grid:50x4", Some(Plan::Tiled)),
        (Shape::dense(), "grid:32x32", Some(mesh)),
        (Shape::moe(), "grid:12x12", Some(Plan::Tiled)),
        (Shape::moe(), "grid:32x32", Some(mesh)),
        (Shape::dense(), "two-grids", Some(Plan::Tiled)),
    ];
    // Two slices of 32 dims: blocks of 64 positions, summing their slices' score parts.
    cases.push((Shape { head_dim: 64, ..Shape::dense() }, "grid:64x48", Some(Plan::stacked(1).with_kv_slices(2))));
    for shape in [Shape::dense(), Shape::moe()] {
        for grid in ["grid:32x32", "grid:64x48"] {
            cases.extend([1, 2].map(|k| (shape.clone(), grid, Some(Plan::stacked(k)))));
        }
        // `None`: the plan the search picks.
        cases.push((shape.clone(), "grid:64x48", None));
    }
    for (shape, target, plan) in cases {
        let module = build(&Shape { bytes: false, ..shape.clone() }, 21);
        let options =
            CompileOptions { max_context: 96, plan: plan.unwrap_or(Plan::Tiled), ..CompileOptions::default() };
        let program = match (target, plan) {
            ("two-grids", _) => waferc_passes::wafer::compile(&module, &two, &options).unwrap(),
            (_, None) => {
                let target = waferc_targets::Target::resolve(target).unwrap();
                waferc::plan_search::search(&module, &target, &options).unwrap().program
            }
            (_, Some(_)) => compile_with(&module, target, options),
        };
        let plan = program.plan;
        let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
        let mut executor = Executor::new(&program, &module, None, options).unwrap();
        // Positions 0..70 cross two 32-position KV chunk boundaries.
        for position in 0..70u32 {
            let cycles = executor.step(1).unwrap().timing.cycles;
            let chosen = timing_only_experts(&module, program.routing_profile.as_ref(), position);
            let bound = distance_bound_cycles(&program, &module, position, &chosen);
            assert!(bound > 1, "{target} {plan:?}: a bound of {bound} cycles says nothing");
            assert!(
                cycles >= bound,
                "{target} {plan:?} position {position}: modeled {cycles} cycles undercut the distance bound {bound}"
            );
        }
    }
}

/// With hops a thousand times dearer, an MoE step is almost all distance, so any distance the
/// bound charges that the model does not shows: a chosen expert near the dispatch point starts
/// as soon as its own PEs have the input and the routing (not when the multicasts reach the
/// farthest expert), and a combine waits only for its chosen experts. Experts chosen by a skewed
/// profile's expected picks (which move from position to position) and by the profile-free
/// default (a uniform router's picks), on every plan kind.
#[test]
fn the_distance_bound_holds_for_experts_when_distance_dominates() {
    let shape = Shape { bytes: false, moe: Some((8, 2)), ..Shape::moe() };
    let module = build(&shape, 23);
    let mut profile = RoutingProfile { source: "skewed".into(), layers: Vec::new() };
    for layer in 0..shape.layers {
        let mut picks = LayerProfile::new(layer, 8, 2);
        for t in 0..64u32 {
            picks.record(&[5, [7, 2, 0][t as usize % 3]]);
        }
        profile.layers.push(picks);
    }
    let plans = [Plan::Tiled, Plan::MeshGemv { p: 4, group_num: 2 }, Plan::stacked(1)];
    for plan in plans {
        for profile in [None, Some(profile.clone())] {
            let options =
                CompileOptions { max_context: 64, plan, profile: profile.clone(), ..CompileOptions::default() };
            let mut program = compile_with(&module, "grid:48x48", options);
            program.target.hop_latency_cycles *= 1000;
            program.target.inter_wafer_latency_cycles *= 1000;
            let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
            let mut executor = Executor::new(&program, &module, None, options).unwrap();
            for position in 0..6u32 {
                let timing = executor.step(1).unwrap().timing;
                let cycles = timing.cycles;
                let chosen = timing_only_experts(&module, profile.as_ref(), position);
                // Instruction by instruction: none ends, modeled, before its distance floor.
                let ends = distance_bound_ends(&program, &module, position, &chosen);
                let mut modeled_end = vec![None::<u64>; ends.len()];
                for span in &timing.spans {
                    let end = modeled_end[span.instr as usize].get_or_insert(0);
                    *end = (*end).max(span.start_cycle + span.duration_cycles);
                }
                for (instr, (&floor, modeled)) in ends.iter().zip(&modeled_end).enumerate() {
                    let op = &program.instrs[instr].op;
                    assert!(
                        modeled.is_none_or(|m| m >= floor),
                        "{plan:?} profile {} position {position}: {op} {instr} ends at {modeled:?}, before its distance floor {floor}",
                        profile.is_some()
                    );
                }
                let bound = distance_bound_cycles(&program, &module, position, &chosen);
                assert!(
                    cycles >= bound,
                    "{plan:?} profile {} position {position}: modeled {cycles} cycles undercut the distance bound {bound}",
                    profile.is_some()
                );
                assert!(
                    bound * 4 > cycles,
                    "{plan:?}: distance should dominate here, yet the bound is {bound} of {cycles} cycles"
                );
            }
        }
    }
}

/// An instruction that reads its operand where it lies (rope on the q/k/v projection's head
/// segments) starts once the steps before the operand's `Deliver` end, while that `Deliver`
/// (the values to the KV blocks) still runs, but sends nothing before it ends; attention, which
/// the `Deliver` feeds, waits for it.
#[test]
fn a_reader_in_place_overlaps_its_operands_delivery_and_a_receiver_waits_for_it() {
    // q, k and v fused into one projection, as the compile driver's `rewrite` pass does.
    let module = rewrite_module(&build(&Shape { bytes: false, ..Shape::dense() }, 6), PlanKind::Stacked).unwrap();
    let plan = Plan::stacked(1);
    let program =
        compile_with(&module, "grid:16x64", CompileOptions { max_context: 64, plan, ..CompileOptions::default() });
    let timing = &timings(&program, &module, None, 1)[0];
    let end = |s: &waferc_runtime::executor::StepSpan| s.start_cycle + s.duration_cycles;
    let mut overlapped = 0;
    for (handle, instr) in module.body.iter() {
        let waferc_ir::Op::Attention { q, .. } = &instr.op else { continue };
        // q is rope of a slice of the projection.
        let waferc_ir::Op::Rope { x, .. } = &module.body[*q].op else { panic!("q is rope") };
        let waferc_ir::Op::Slice { x: projection, .. } = &module.body[*x].op else { panic!("rope reads a slice") };
        let spans_of = |i: usize| timing.spans.iter().filter(move |s| s.instr as usize == i);
        let deliver = spans_of(projection.index())
            .find(|s| s.phase == waferc_ir::wafer::Phase::Deliver)
            .expect("the projection delivers the values to the KV blocks");
        let rope_start = spans_of(q.index()).map(|s| s.start_cycle).min().unwrap();
        let attention_start = spans_of(handle.index()).map(|s| s.start_cycle).min().unwrap();
        assert_eq!(rope_start, deliver.start_cycle, "rope starts as the projection's Deliver does");
        for sent in spans_of(q.index()).filter(|s| s.routes > 0) {
            assert!(end(sent) > end(deliver), "rope sends while the projection's Deliver runs: {sent:?}");
        }
        assert!(deliver.duration_cycles > 0 && attention_start >= end(deliver), "attention waits for the values");
        overlapped += 1;
    }
    assert!(overlapped > 0, "the module has attentions");
}

/// A PE is held through the steps in which it computes, not those in which it only sends: when
/// two chosen experts share a lane (`experts_per_lane`), the later one's matvec on the lane's
/// PEs starts while the earlier one's collect is still on its way, never before the earlier
/// one's tiles have computed, and sends nothing before the earlier one's routes are over (their
/// routes may share colours: `ir::wafer::serial`). (Held through every step, as before, no such
/// overlap happens.)
#[test]
fn lane_mates_overlap_where_the_earlier_one_only_sends() {
    let shape = Shape { moe: Some((32, 4)), ffn: 256, bytes: false, ..Shape::moe() };
    let module = build(&shape, 8);
    let plan: Plan = "stacked:1,100,share2".parse().unwrap();
    let mut program =
        compile_with(&module, "grid:128x128", CompileOptions { max_context: 64, plan, ..Default::default() });
    // Slow hops: a collect outlasts the next expert's arithmetic, so sending early would show.
    program.target.hop_latency_cycles *= 100;
    // Each expert matvec's tile PEs, sorted.
    let tiles: Vec<(usize, Vec<waferc_ir::wafer::Pe>)> = program
        .instrs
        .iter()
        .enumerate()
        .filter_map(|(i, p)| match (&p.expert, &p.work) {
            (Some(_), waferc_ir::wafer::Work::MatVec(mv)) => {
                let mut pes: Vec<_> = mv.tiles.iter().map(|t| t.pe).collect();
                pes.sort_unstable();
                Some((i, pes))
            }
            _ => None,
        })
        .collect();
    let mut overlapped = 0;
    for timing in timings(&program, &module, None, 16) {
        // Per instruction that worked: its start, its Compute step's end and its end; and the
        // ends of its steps that sent.
        let mut ran: std::collections::HashMap<usize, (u64, u64, u64)> = Default::default();
        let mut sent: std::collections::HashMap<usize, Vec<u64>> = Default::default();
        for span in timing.spans.iter().filter(|s| s.duration_cycles > 0) {
            let end = span.start_cycle + span.duration_cycles;
            let (start, computed, last) = ran.entry(span.instr as usize).or_insert((span.start_cycle, 0, 0));
            *start = (*start).min(span.start_cycle);
            if span.phase == waferc_ir::wafer::Phase::Compute {
                *computed = (*computed).max(end);
            }
            *last = (*last).max(end);
            if span.routes > 0 {
                sent.entry(span.instr as usize).or_default().push(end);
            }
        }
        for (k, (a, a_pes)) in tiles.iter().enumerate() {
            let Some(&(_, a_computed, a_end)) = ran.get(a) else { continue };
            for (b, b_pes) in &tiles[k + 1..] {
                let Some(&(b_start, ..)) = ran.get(b) else { continue };
                if !b_pes.iter().any(|pe| a_pes.binary_search(pe).is_ok()) {
                    continue;
                }
                assert!(b_start >= a_computed, "%{b} starts at {b_start}, before %{a}'s tiles are done ({a_computed})");
                let sends = sent.get(b).map_or(&[][..], Vec::as_slice);
                assert!(sends.iter().all(|&end| end > a_end), "%{b} sends while %{a}'s routes run: {sends:?}, {a_end}");
                overlapped += usize::from(b_start < a_end);
            }
        }
    }
    assert!(overlapped > 0, "no lane-mate started while the one before it still sent");
}

/// A reader whose own PEs sit near a delivery's source starts once its copy has arrived, while
/// the multicasts still travel to readers farther out (`arrival::reader_leads`: the MoE router
/// beside the norm that feeds every expert), and never earlier: no later than the producer ends,
/// and no sooner than the delivery's start plus the hops to its farthest PE along each route.
/// It sends nothing before the producer's routes are over (their colours may be shared).
#[test]
fn a_reader_near_a_deliverys_source_starts_when_its_copy_arrives() {
    let module = build(&Shape { bytes: false, moe: Some((8, 2)), ..Shape::moe() }, 23);
    let mut program = compile_with(
        &module,
        "grid:48x48",
        CompileOptions { max_context: 64, plan: Plan::stacked(1), ..CompileOptions::default() },
    );
    // Slow hops: a delivery outlasts its near readers' arithmetic, so sending early would show.
    program.target.hop_latency_cycles *= 100;
    let pes = waferc_ir::wafer::arrival::compute_pes_by_instr(&program);
    let leads = waferc_ir::wafer::arrival::reader_leads(&program, &module, &pes);
    let timing = &timings(&program, &module, None, 1)[0];
    let spans_of = |i: u32| timing.spans.iter().filter(move |s| s.instr == i && s.duration_cycles > 0);
    let mut early = 0;
    for &(reader, producer) in leads.keys() {
        let Some(start) = spans_of(reader).map(|s| s.start_cycle).min() else { continue };
        let end = spans_of(producer).map(|s| s.start_cycle + s.duration_cycles).max().unwrap();
        let deliver = spans_of(producer).find(|s| s.phase == waferc_ir::wafer::Phase::Deliver).unwrap().start_cycle;
        let reader_pes = &pes[reader as usize];
        for &id in &program.instrs[producer as usize].deliveries {
            let (_, depth) =
                waferc_ir::wafer::arrival::multicast_depths(&program.target, &program.routes[id as usize]).unwrap();
            let farthest = depth.iter().filter(|(pe, _)| reader_pes.contains(pe)).map(|(_, &d)| d).max().unwrap_or(0);
            assert!(start >= deliver + farthest, "%{reader} starts at {start}, before route {id} reaches it");
        }
        for span in spans_of(reader).filter(|s| s.routes > 0) {
            assert!(
                span.start_cycle + span.duration_cycles > end,
                "%{reader} sends while %{producer} delivers: {span:?}"
            );
        }
        early += usize::from(start < end);
    }
    assert!(early > 0, "no reader started before its producer's deliveries ended: {leads:?}");
}

/// The critical path splits each step exactly; the batched prefill grows with the prompt, beats
/// feeding the prompt one decode step at a time, and needs the KV capacity.
#[test]
fn the_critical_path_adds_up_and_prefill_grows_with_the_prompt() {
    let module = build(&Shape { bytes: false, ..Shape::dense() }, 22);
    let program = compile_for(&module, "grid:16x16", 256);
    let options = ExecOptions { timing_only: true, ..ExecOptions::default() };
    let mut executor = Executor::new(&program, &module, None, options).unwrap();
    let timing = executor.step(1).unwrap().timing;
    assert_eq!(timing.layers.iter().map(|l| l.cycles).sum::<u64>(), timing.cycles);
    assert!(timing.layers.iter().all(|l| l.cycles == l.compute_cycles + l.comm_cycles + l.wait_cycles));
    assert_eq!(timing.layers.iter().filter(|l| l.layer.is_some()).count(), 2, "{:?}", timing.layers);
    for span in &timing.spans {
        assert_eq!(span.duration_cycles, span.compute_cycles + span.comm_cycles + span.wait_cycles);
    }
    let prefill = |tokens: usize| executor.timing_report(tokens).unwrap().modeled_ttft_prefill_us;
    let step_us = timing.cycles as f64 / program.target.clock_hz * 1e6;
    let (one, some, more, all) =
        (prefill(1).unwrap(), prefill(16).unwrap(), prefill(64).unwrap(), prefill(256).unwrap());
    assert!((one - step_us).abs() < 1e-9, "one token is one decode step");
    assert!(one < some && some < more && more < all, "{one} < {some} < {more} < {all}");
    assert!(all < 256.0 * step_us, "batched and pipelined beats 256 decode steps: {all} vs {}", 256.0 * step_us);
    assert_eq!(prefill(257), None, "257 positions do not fit a KV capacity of 256");
    let report = executor.timing_report(0).unwrap();
    assert!(report.prefill.iter().all(|p| p.cycles.is_none()), "1,024 and 8,192 exceed 256 positions");
    assert_eq!(report.costliest_steps.len(), 10);
    assert!(report.costliest_steps.windows(2).all(|w| w[0].duration_cycles >= w[1].duration_cycles));
    let mean = report.mean_layer.unwrap();
    assert_eq!(mean.cycles, mean.compute_cycles + mean.comm_cycles + mean.wait_cycles);
}
