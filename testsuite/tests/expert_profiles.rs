//! Routing profiles from real prompts on the MoE fixtures, placements built from them, and the
//! executor bit-exact on those placements: the profile changes where experts go, never a bit.

mod executor_common;

use executor_common::{compile_with, pack_tile_blob};
use waferc_ir::wafer::{ResultLayout, RoutingProfile, WaferProgram};
use waferc_ir::{Module, Op};
use waferc_passes::wafer::{expert_order, CompileOptions, ExpertOrder};
use waferc_runtime::executor::{validate, ValidationOptions};
use waferc_runtime::profile::record_profile;
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
