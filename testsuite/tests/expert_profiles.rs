//! Routing profiles from real prompts on the MoE fixtures, placements built from them, and the
//! executor bit-exact on those placements: the profile changes where experts go, never a bit.

mod executor_common;

use executor_common::{compile_with, pack_tile_blob};
use waferc_ir::wafer::{ResultLayout, RoutingProfile, WaferProgram};
use waferc_ir::{Module, Op};
use waferc_passes::wafer::{expert_order, CompileOptions, ExpertOrder, ReplicaPolicy};
use waferc_runtime::executor::{validate, ExecOptions, Executor, ValidationOptions};
use waferc_runtime::profile::record_profile;
use waferc_runtime::reference::ReferenceDecoder;
use waferc_testsuite::fixtures_dir;

/// The fixture's golden prompts (real token sequences, as transformers ran them).
fn golden_prompts(name: &str) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(fixtures_dir().join("hf").join(name).join("golden.json")).unwrap();
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    golden["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["prompt"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect())
        .collect()
}

/// Per MoE layer: the combine's first segment PE, and each expert's output's first segment PE.
fn expert_sites(
    program: &WaferProgram,
    module: &Module,
) -> Vec<(u32, waferc_ir::wafer::Pe, Vec<waferc_ir::wafer::Pe>)> {
    let first_pe = |value: usize| match &program.instrs[value].result {
        ResultLayout::Vector(layout) => layout.segments[0].pe,
        ResultLayout::Routing { pe } => *pe,
    };
    module
        .body
        .iter()
        .filter_map(|(handle, instr)| match &instr.op {
            Op::ExpertCombine { experts, .. } => Some((
                instr.layer.unwrap(),
                first_pe(handle.index()),
                experts.iter().map(|e| first_pe(e.index())).collect(),
            )),
            _ => None,
        })
        .collect()
}

fn check(name: &str, target: &str) {
    let model = waferc::frontend::load(&fixtures_dir().join("hf").join(name)).unwrap();
    let module = &model.module;
    let prompts = golden_prompts(name);
    let profile = record_profile(module, &prompts, name).unwrap();

    // Every router decision of every prompt position is counted, per MoE layer.
    let routers = module.body.iter().filter(|(_, i)| matches!(i.op, Op::RouterTopK { .. })).count();
    assert_eq!(profile.layers.len(), routers, "{name}");
    let positions: usize = prompts.iter().map(Vec::len).sum();
    for layer in &profile.layers {
        assert_eq!(layer.tokens, positions as u64, "{name} layer {}", layer.layer);
        assert_eq!(profile.problem(), None);
        assert!(!layer.is_uniform(), "{name} layer {}: real prompts route unevenly: {:?}", layer.layer, layer.picks);
    }
    let json = serde_json::to_string(&profile).unwrap();
    assert_eq!(serde_json::from_str::<RoutingProfile>(&json).unwrap(), profile);

    let options = |order| CompileOptions {
        max_context: 64,
        profile: Some(profile.clone()),
        expert_order: order,
        ..CompileOptions::default()
    };
    let guided = compile_with(module, target, options(ExpertOrder::Profile));
    let indexed = compile_with(module, target, options(ExpertOrder::Index));
    assert_eq!(guided.routing_profile.as_ref(), Some(&profile));
    assert_ne!(guided.instrs, indexed.instrs, "{name}: the profile moves experts");

    // The hottest expert is placed first after the combine, nearest the gather point.
    for (layer, combine, experts) in expert_sites(&guided, module) {
        let heat = profile.layer(layer).unwrap();
        let order = expert_order(Some(heat), experts.len() as u32);
        let hottest = order[0];
        assert_eq!(heat.picks[hottest as usize], *heat.picks.iter().max().unwrap(), "{name} layer {layer}");
        let distance = |pe: waferc_ir::wafer::Pe| pe.distance(combine).unwrap_or(u32::MAX);
        let nearest = experts.iter().map(|&pe| distance(pe)).min().unwrap();
        assert_eq!(distance(experts[hottest as usize]), nearest, "{name} layer {layer}: order {order:?}");
    }

    // Bit-exact on both placements, over every profiling prompt plus generation.
    for program in [&guided, &indexed] {
        let blob = pack_tile_blob(program, module);
        for prompt in &prompts {
            let options = ValidationOptions { max_new_tokens: 4, ..ValidationOptions::default() };
            let validation =
                validate(program, module, Some(&blob), prompt, &options).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(validation.steps, prompt.len() + 3, "{name}");
        }
    }
}

#[test]
fn mixtral_tiny_profile_guided_placement_is_bit_exact() {
    check("mixtral-tiny", "grid:32x32");
}

#[test]
fn qwen3_moe_tiny_profile_guided_placement_is_bit_exact() {
    check("qwen3-moe-tiny", "grid:64x64");
}

/// Compiles `name` with a profile from its golden prompts and KV room for `sequences`
/// sequences, with hot experts' copies on all the free PEs (`--expert-replicas always`).
fn replicated(name: &str, target: &str, sequences: u32) -> (Module, WaferProgram) {
    let model = waferc::frontend::load(&fixtures_dir().join("hf").join(name)).unwrap();
    let module = model.module;
    let profile = record_profile(&module, &golden_prompts(name), name).unwrap();
    let options = CompileOptions {
        max_context: 64,
        max_sequences: sequences,
        profile: Some(profile),
        expert_replicas: ReplicaPolicy::Fill,
        ..CompileOptions::default()
    };
    let program = compile_with(&module, target, options);
    (module, program)
}

/// Runs `prompts` interleaved, one per sequence slot, each position of each checked bit for bit
/// against a reference decoder of its own; returns each sequence's generated tokens and how
/// many steps ran an expert on one of its copies.
fn run_interleaved(
    program: &WaferProgram,
    module: &Module,
    prompts: &[Vec<u32>],
    new_tokens: usize,
) -> (Vec<Vec<u32>>, usize) {
    let mut on_copies = 0;
    let blob = pack_tile_blob(program, module);
    let mut executor = Executor::new(program, module, Some(&blob), ExecOptions::default()).unwrap();
    let mut references: Vec<ReferenceDecoder> =
        prompts.iter().map(|_| ReferenceDecoder::new(module, program.max_context as usize).unwrap()).collect();
    let mut feeds: Vec<u32> = prompts.iter().map(|p| p[0]).collect();
    let mut generated = vec![Vec::new(); prompts.len()];
    for position in 0..prompts.iter().map(Vec::len).max().unwrap() + new_tokens {
        for (slot, prompt) in prompts.iter().enumerate() {
            if position >= prompt.len() + new_tokens {
                continue;
            }
            executor.select_sequence(slot as u32).unwrap();
            let step = executor.step(feeds[slot]).unwrap();
            on_copies += step.timing.spans.iter().filter(|s| s.copy > 0).count();
            let logits = step.logits.unwrap();
            let expected = references[slot].step(feeds[slot]).unwrap();
            let same = logits.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "sequence {slot} position {position}: the executor's logits differ from the reference's");
            feeds[slot] = match prompt.get(position + 1) {
                Some(&token) => token,
                None => {
                    let next = waferc_runtime::reference::argmax(&logits);
                    generated[slot].push(next);
                    next
                }
            };
        }
    }
    (generated, on_copies)
}

fn replicas_are_bit_exact(name: &str, target: &str) {
    let (module, program) = replicated(name, target, 3);
    assert!(!program.replicas.is_empty(), "{name}: free PEs on {target} take copies of hot experts");
    for replica in &program.replicas {
        assert!(replica.count() <= 3, "{name}: no more copies than sequences");
    }
    waferc_passes::wafer::check(&program, &module).unwrap_or_else(|e| panic!("{name}: {e}"));
    // Without room for several sequences, no copies: the program is the profile-guided one.
    let (_, single) = replicated(name, target, 1);
    assert!(single.replicas.is_empty());

    // Three sequences: slots 1 and 2 run on copies; every position is bit-exact, and each
    // sequence generates what it generates alone.
    let prompts = golden_prompts(name).into_iter().take(3).collect::<Vec<_>>();
    assert_eq!(prompts.len(), 3);
    let (together, on_copies) = run_interleaved(&program, &module, &prompts, 4);
    assert!(on_copies > 0, "{name}: sequences 1 and 2 ran hot experts on their copies");
    for (prompt, tokens) in prompts.iter().zip(&together) {
        let (alone, alone_on_copies) = run_interleaved(&program, &module, std::slice::from_ref(prompt), 4);
        assert_eq!(&alone[0], tokens, "{name}: in flight and alone generate the same");
        assert_eq!(alone_on_copies, 0, "{name}: a lone sequence runs on the originals");
    }
}

/// The copies `--expert-replicas auto` asks for (`ReplicaPolicy::Limited`): only the listed
/// experts get copies, no more than listed, and the program passes the checker.
#[test]
fn limited_replicas_copy_only_the_listed_experts() {
    let name = "qwen3-moe-tiny";
    let model = waferc::frontend::load(&fixtures_dir().join("hf").join(name)).unwrap();
    let module = model.module;
    let profile = record_profile(&module, &golden_prompts(name), name).unwrap();
    let heat = &profile.layers[0];
    let hottest = expert_order(Some(heat), heat.experts)[0];
    let limits = std::collections::BTreeMap::from([((heat.layer, hottest), 2)]);
    let options = CompileOptions {
        max_context: 64,
        max_sequences: 3,
        profile: Some(profile.clone()),
        expert_replicas: ReplicaPolicy::Limited(limits),
        ..CompileOptions::default()
    };
    let program = compile_with(&module, "grid:64x64", options);
    let copied: Vec<(u32, u32, u32)> = program.replicas.iter().map(|r| (r.layer, r.expert, r.count())).collect();
    assert_eq!(copied, [(heat.layer, hottest, 2)]);
    waferc_passes::wafer::check(&program, &module).unwrap();
}

/// The checker rejects a copy whose tile is not the original's, and a copy whose routing
/// route does not reach it.
#[test]
fn the_checker_rejects_a_corrupted_replica() {
    let (module, program) = replicated("qwen3-moe-tiny", "grid:64x64", 3);
    waferc_passes::wafer::check(&program, &module).unwrap();

    let mut bad_tile = program.clone();
    let tile = bad_tile.replicas[0].copies[0]
        .iter_mut()
        .find_map(|p| match &mut p.work {
            waferc_ir::wafer::Work::MatVec(mv) => mv.tiles.first_mut(),
            _ => None,
        })
        .unwrap();
    tile.rows.end -= 1;
    let error = waferc_passes::wafer::check(&bad_tile, &module).unwrap_err().to_string();
    assert!(error.contains("copy 1 of expert") && error.contains("tiles are not the original's"), "{error}");

    // The original's routing route reaches the original's PEs, not the copy's.
    let mut bad_routing = program.clone();
    let stolen = bad_routing.replicas[0]
        .instrs
        .iter()
        .find_map(|&i| match bad_routing.instrs[i as usize].work {
            waferc_ir::wafer::Work::Dispatch { routing } => Some(routing),
            _ => None,
        })
        .unwrap();
    for p in &mut bad_routing.replicas[0].copies[0] {
        if let waferc_ir::wafer::Work::Dispatch { routing } = &mut p.work {
            *routing = stolen;
        }
    }
    let error = waferc_passes::wafer::check(&bad_routing, &module).unwrap_err().to_string();
    assert!(error.contains("routing route does not reach all of its PEs"), "{error}");
}

#[test]
fn mixtral_tiny_replicas_of_hot_experts_are_bit_exact_with_three_sequences() {
    replicas_are_bit_exact("mixtral-tiny", "grid:32x32");
}

#[test]
fn qwen3_moe_tiny_replicas_of_hot_experts_are_bit_exact_with_three_sequences() {
    replicas_are_bit_exact("qwen3-moe-tiny", "grid:64x64");
}
