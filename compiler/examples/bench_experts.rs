//! Profile-guided expert placement at full scale: Qwen3-30B-A3B (shape-only, 48 MoE layers of
//! 128 experts, top 8) on wse3x4, placed in index order and by a routing profile, timed without
//! values with the executor charging each MoE layer by the experts the profile's expected picks
//! choose at each position (`LayerProfile::expected_picks`).
//!
//! cargo run --release -p waferc --example bench_experts [-- STEPS]
//!
//! Two profiles, checked in beside this file (`profiles/`): `qwen3-30b-a3b-zipf.json`, per layer
//! a Zipf law (exponent 1.0) over a seeded permutation of the experts, 4096 tokens each drawing
//! 8 distinct experts; and `qwen3-30b-a3b-uniform.json`, every expert picked equally often. With
//! `--regenerate` the example rewrites them from their seeds instead (they are deterministic).
//!
//! For each profile and each expert order it prints the modeled MoE-layer cycles (router start
//! to combine end, mean over the MoE layers and the timed steps) and the modeled decode tok/s
//! (mean over STEPS decode steps, default 4).
//!
//! Then replicas: with the Zipf profile, compiled for 1, 4 and 16 sequences in flight under each
//! `--expert-replicas` mode (`off`: no copies; `always`: copies of hot experts on all the free
//! PEs; `auto`: copies only where the pipeline model says a sequence waits for an expert,
//! `waferc::replica_choice`), every sequence slot timed (timing only) and the steps put through
//! the pipeline model (`waferc_runtime::executor::pipeline`), where sequences picking the same
//! expert copy queue on it. It prints the copies placed, the mean MoE-layer cycles, and
//! aggregate and per-sequence modeled tok/s. `--replicas-only` skips the first table;
//! `--sequences N` (repeatable) times only those numbers of sequences in flight.

use std::error::Error;
use std::path::{Path, PathBuf};

use waferc::replica_choice::{self, ReplicaMode};
use waferc::synth::{synth, Preset};
use waferc_ir::wafer::{profile::splitmix64, LayerProfile, RoutingProfile};
use waferc_ir::{Module, Op, ValueType};
use waferc_passes::wafer::{compile, CompileOptions, ExpertOrder};
use waferc_runtime::executor::{pipeline, ExecOptions, Executor, SequenceCosts, StepCost};
use waferc_targets::Target;

const PRESET: &str = "qwen3-30b-a3b";
const TARGET: &str = "wse3x4";
const TOKENS: u64 = 4096;
const ZIPF_EXPONENT: f64 = 1.0;
const SEED: u64 = 0x5eed_2026;

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let regenerate = args.iter().any(|a| a == "--regenerate");
    let mut in_flight: Vec<u32> = Vec::new();
    let mut rest: Vec<&String> = Vec::new();
    let mut words = args.iter();
    while let Some(word) = words.next() {
        match word.as_str() {
            "--sequences" => in_flight.push(words.next().and_then(|n| n.parse().ok()).ok_or("--sequences N")?),
            _ => rest.push(word),
        }
    }
    if in_flight.is_empty() {
        in_flight = vec![1, 4, 16];
    }
    let steps: u32 = rest.iter().find_map(|a| a.parse().ok()).unwrap_or(4);
    let scratch = std::env::temp_dir().join(format!("waferc-bench-experts-{}", std::process::id()));
    synth(&Preset::by_name(PRESET)?, &scratch, true)?;
    let module = waferc::frontend::load(&scratch)?.module;
    std::fs::remove_dir_all(&scratch)?;

    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/profiles");
    let zipf_path = dir.join(format!("{PRESET}-zipf.json"));
    let uniform_path = dir.join(format!("{PRESET}-uniform.json"));
    if regenerate {
        write(&zipf_path, &zipf_profile(&module))?;
        write(&uniform_path, &uniform_profile(&module))?;
        eprintln!("wrote {} and {}", zipf_path.display(), uniform_path.display());
    }
    let target = Target::resolve(TARGET)?;
    if !args.iter().any(|a| a == "--replicas-only") {
        orders(&module, &target, steps, &zipf_path, &uniform_path)?;
    }
    replicas(&module, &target, steps, &zipf_path, &in_flight)
}

/// Mean MoE-layer span (router start to combine end) over a step's MoE layers: (sum, layers).
fn moe_layer_cycles(step: &waferc_runtime::executor::StepTiming) -> (u64, u64) {
    let mut layers: std::collections::BTreeMap<u32, (u64, u64)> = Default::default();
    for span in &step.spans {
        let (Some(layer), true) = (span.layer, span.op == "router_topk" || span.op == "expert_combine") else {
            continue;
        };
        let entry = layers.entry(layer).or_insert((u64::MAX, 0));
        entry.0 = entry.0.min(span.start_cycle);
        entry.1 = entry.1.max(span.start_cycle + span.duration_cycles);
    }
    (layers.values().map(|(s, e)| e - s).sum(), layers.len() as u64)
}

/// Sequences in flight with and without replicas of hot experts (module docs).
fn replicas(
    module: &Module,
    target: &Target,
    steps: u32,
    zipf_path: &Path,
    in_flight: &[u32],
) -> Result<(), Box<dyn Error>> {
    let profile: RoutingProfile = serde_json::from_str(&std::fs::read_to_string(zipf_path)?)?;
    println!();
    println!(
        "| sequences | replicas | extra copies | MoE-layer cycles | aggregate modeled tok/s | per-sequence tok/s |"
    );
    println!("|---|---|---|---|---|---|");
    for &sequences in in_flight {
        for mode in [ReplicaMode::Off, ReplicaMode::Auto, ReplicaMode::Always] {
            let options = CompileOptions {
                max_context: 64,
                max_sequences: sequences,
                profile: Some(profile.clone()),
                expert_replicas: mode.policy(),
                ..CompileOptions::default()
            };
            let start = std::time::Instant::now();
            let program = compile(module, target, &options)?;
            let (program, choice) = replica_choice::apply(program, module, target, &options, mode)?;
            eprintln!(
                "{sequences} sequences, --expert-replicas {mode:?}: compiled in {:.0} s; timing every slot",
                start.elapsed().as_secs_f64()
            );
            if let Some(decision) = &choice.decision {
                eprintln!("{sequences} sequences, --expert-replicas auto: {decision}");
            }
            let copies: usize = program.replicas.iter().map(|r| r.copies.len()).sum();
            let mut executor =
                Executor::new(&program, module, None, ExecOptions { timing_only: true, ..Default::default() })?;
            let token = module.meta.bos_token_id.unwrap_or(0);
            let (mut moe_cycles, mut moe_layers) = (0u64, 0u64);
            let mut costs = Vec::new();
            for slot in 0..sequences {
                executor.select_sequence(slot)?;
                let mut step_costs = Vec::new();
                for _ in 0..=steps {
                    let step = executor.step(token)?;
                    if executor.position() > 1 {
                        let (cycles, layers) = moe_layer_cycles(&step.timing);
                        moe_cycles += cycles;
                        moe_layers += layers;
                    }
                    step_costs.push(StepCost::of(&step.timing, &program.plan));
                }
                costs.push(SequenceCosts { prompt_tokens: 1, new_tokens: steps as usize, steps: step_costs });
            }
            let timing = pipeline(&costs, sequences as usize, program.target.clock_hz);
            let per_sequence = timing.sequences.iter().map(|s| s.modeled_tok_s).sum::<f64>() / sequences as f64;
            println!(
                "| {sequences} | {} | {copies} | {:.0} | {:.1} | {:.1} |",
                format!("{mode:?}").to_lowercase(),
                moe_cycles as f64 / moe_layers.max(1) as f64,
                timing.aggregate_modeled_tok_s,
                per_sequence
            );
        }
    }
    Ok(())
}

/// Index order against profile-guided placement, under both profiles.
fn orders(
    module: &Module,
    target: &Target,
    steps: u32,
    zipf_path: &Path,
    uniform_path: &Path,
) -> Result<(), Box<dyn Error>> {
    println!("| profile | expert order | MoE-layer cycles | cycles/token | modeled decode tok/s |");
    println!("|---|---|---|---|---|");
    for (name, path) in [("zipf", zipf_path), ("uniform", uniform_path)] {
        let profile: RoutingProfile = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        for order in [ExpertOrder::Index, ExpertOrder::Profile] {
            let options = CompileOptions {
                max_context: 64,
                profile: Some(profile.clone()),
                expert_order: order,
                ..CompileOptions::default()
            };
            let program = compile(module, target, &options)?;
            let mut executor =
                Executor::new(&program, module, None, ExecOptions { timing_only: true, ..Default::default() })?;
            let (mut moe_cycles, mut moe_layers) = (0u64, 0u64);
            let token = module.meta.bos_token_id.unwrap_or(0);
            for _ in 0..=steps {
                let step = executor.step(token)?;
                if executor.position() > 1 {
                    let (cycles, layers) = moe_layer_cycles(&step.timing);
                    moe_cycles += cycles;
                    moe_layers += layers;
                }
            }
            let report = executor.timing_report(1).ok_or("steps ran")?;
            println!(
                "| {name} | {} | {:.0} | {} | {:.1} |",
                match order {
                    ExpertOrder::Index => "index",
                    ExpertOrder::Profile => "profile-guided",
                },
                moe_cycles as f64 / moe_layers.max(1) as f64,
                report.cycles_per_token,
                report.modeled_decode_tok_s
            );
        }
    }
    Ok(())
}

fn write(path: &Path, profile: &RoutingProfile) -> Result<(), Box<dyn Error>> {
    std::fs::write(path, serde_json::to_string(profile)?)?;
    Ok(())
}

/// `(layer, experts, top_k)` of every router.
fn routers(module: &Module) -> Vec<(u32, u32, u32)> {
    module
        .body
        .iter()
        .filter_map(|(_, instr)| match &instr.op {
            Op::RouterTopK { logits, top_k, .. } => {
                let experts = match &module.body[*logits].ty {
                    ValueType::Tensor(t) => t.elements() as u32,
                    ValueType::Routing { .. } => 0,
                };
                Some((instr.layer.unwrap_or(0), experts, *top_k))
            }
            _ => None,
        })
        .collect()
}

/// Per layer, a Zipf law over a seeded permutation of the experts; each token draws `top_k`
/// distinct experts from it.
fn zipf_profile(module: &Module) -> RoutingProfile {
    let layers = routers(module)
        .into_iter()
        .map(|(layer, experts, top_k)| {
            let mut rank: Vec<u32> = (0..experts).collect();
            let mut state = SEED ^ (layer as u64) << 32;
            for i in (1..rank.len()).rev() {
                state = splitmix64(state);
                rank.swap(i, (state % (i as u64 + 1)) as usize);
            }
            // rank[r] is the expert of popularity rank r.
            let mut weight = vec![0.0f64; experts as usize];
            for (r, &e) in rank.iter().enumerate() {
                weight[e as usize] = 1.0 / ((r + 1) as f64).powf(ZIPF_EXPONENT);
            }
            let mut profile = LayerProfile::new(layer, experts, top_k);
            for _ in 0..TOKENS {
                let mut left = weight.clone();
                let mut chosen = Vec::with_capacity(top_k as usize);
                for _ in 0..top_k {
                    state = splitmix64(state);
                    let mut ticket = (state >> 11) as f64 / (1u64 << 53) as f64 * left.iter().sum::<f64>();
                    let mut pick = left.iter().rposition(|&w| w > 0.0).expect("experts remain");
                    for (e, &w) in left.iter().enumerate() {
                        if w > 0.0 && ticket < w {
                            pick = e;
                            break;
                        }
                        ticket -= w;
                    }
                    left[pick] = 0.0;
                    chosen.push(pick as u32);
                }
                chosen.sort_unstable();
                profile.record(&chosen);
            }
            profile
        })
        .collect();
    RoutingProfile {
        source: format!("seeded Zipf (exponent {ZIPF_EXPONENT}, seed {SEED:#x}, {TOKENS} tokens per layer)"),
        layers,
    }
}

/// Every expert picked equally often: token `t` picks experts `t*k .. t*k+k` (mod experts).
fn uniform_profile(module: &Module) -> RoutingProfile {
    let layers = routers(module)
        .into_iter()
        .map(|(layer, experts, top_k)| {
            let mut profile = LayerProfile::new(layer, experts, top_k);
            for t in 0..TOKENS {
                let mut chosen: Vec<u32> =
                    (0..top_k as u64).map(|i| ((t * top_k as u64 + i) % experts as u64) as u32).collect();
                chosen.sort_unstable();
                profile.record(&chosen);
            }
            profile
        })
        .collect();
    RoutingProfile { source: format!("uniform ({TOKENS} tokens per layer)"), layers }
}
