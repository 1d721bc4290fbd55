//! `compile --expert-replicas auto|off|always`: whether hot MoE experts get copies on the PEs the
//! placement left free (`waferc_passes::wafer::ReplicaPolicy`).
//!
//! Copies only help sequences in flight that queue on one expert, and they cost distance: they
//! sit on whatever PEs are left, far from the layer's dispatch and gather points, and lengthen
//! the layer input's multicast. So `auto` (the default) lowers without copies, times one decode
//! step of the result on the executor's timing model (timing-only, the router drawing the
//! profile's expected experts), and asks the pipeline model which experts' expected queue per
//! round outlasts the round (`waferc_runtime::executor::replica_need`): `sequences x picks per
//! token x the expert's busy cycles` against `max(one token's walk, sequences x the busiest
//! region)`. Only those experts get copies, as many as bring their queue within the round; when
//! none does, the copy-free program is kept. With the tiled plan a token's walk is far longer
//! than any expert's queue (Qwen3-30B-A3B at 16 sequences: a round of 11.35M cycles against a
//! longest expected queue of 0.75M), so `auto` declines copies there. `always` fills the free PEs as before (the bit-exact replica tests
//! use it); `off` never places copies.

use serde::Serialize;
use waferc_ir::wafer::{Plan, WaferProgram};
use waferc_ir::Module;
use waferc_passes::wafer::{self as lowering, CompileOptions, ExpertOrder, ReplicaPolicy};
use waferc_runtime::executor::{replica_need, ExecOptions, Executor, StepCost};
use waferc_targets::Target;

/// `--expert-replicas`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplicaMode {
    /// Copies only of experts whose expected queue outlasts a round of the pipeline model.
    Auto,
    /// No copies.
    Off,
    /// Copies of hot experts while the free PEs hold them, at most one per sequence slot.
    Always,
}

impl ReplicaMode {
    /// The policy to lower with first (`auto` starts without copies).
    pub fn policy(self) -> ReplicaPolicy {
        match self {
            ReplicaMode::Always => ReplicaPolicy::Fill,
            ReplicaMode::Auto | ReplicaMode::Off => ReplicaPolicy::Off,
        }
    }
}

/// What became of `--expert-replicas`, for the compile report.
#[derive(Clone, Debug, Serialize)]
pub struct ReplicaChoice {
    pub mode: ReplicaMode,
    /// Extra copies placed in all.
    pub copies: usize,
    /// Why `auto` placed what it placed (`None` for `off` and `always`, and where copies cannot
    /// apply).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision: Option<String>,
}

/// Whether copies can apply to `program` at all: a guiding routing profile with experts placed
/// by it, several sequences in flight, and the tiled plan (the only one that places copies).
fn applicable(program: &WaferProgram, options: &CompileOptions) -> bool {
    options.max_sequences >= 2
        && options.expert_order == ExpertOrder::Profile
        && program.routing_profile.as_ref().is_some_and(|p| p.layers.iter().any(|l| !l.is_uniform()))
        && matches!(program.plan, Plan::Tiled)
        && program.instrs.iter().any(|p| p.expert.is_some())
}

/// Applies `mode` to `program`, lowered with [`ReplicaMode::policy`] and `options`: for `auto`,
/// lowers it again with the copies the pipeline model finds worth placing (and checks that
/// program), or keeps it when none are.
pub fn apply(
    program: WaferProgram,
    module: &Module,
    target: &Target,
    options: &CompileOptions,
    mode: ReplicaMode,
) -> anyhow::Result<(WaferProgram, ReplicaChoice)> {
    let placed = |program: &WaferProgram| program.replicas.iter().map(|r| r.copies.len()).sum();
    if mode != ReplicaMode::Auto || !applicable(&program, options) {
        let copies = placed(&program);
        return Ok((program, ReplicaChoice { mode, copies, decision: None }));
    }
    let profile = program.routing_profile.as_ref().expect("applicable: a profile");
    let experts: Vec<(u32, u32)> = profile
        .layers
        .iter()
        .filter(|l| !l.is_uniform())
        .flat_map(|l| (0..l.experts).filter(|&e| l.picks[e as usize] > 0).map(move |e| (l.layer, e)))
        .collect();
    let pick_rate = |layer: u32, expert: u32| {
        profile.layer(layer).map_or(0.0, |l| l.picks[expert as usize] as f64 / l.tokens.max(1) as f64)
    };
    let exec = ExecOptions { timing_only: true, record_values: false };
    let step = Executor::new(&program, module, None, exec)?.step(module.meta.bos_token_id.unwrap_or(0))?;
    let cost = StepCost::of(&step.timing, &program.plan);
    let sequences = options.max_sequences;
    let need = replica_need(&cost, sequences, &experts, pick_rate);
    let longest = need.longest_queue.map_or("no expert ran".to_string(), |((layer, expert), queue)| {
        format!("the longest expected expert queue (layer {layer} expert {expert}) is {queue} cycles a round")
    });
    if need.copies.is_empty() {
        let decision = format!(
            "no copies: with {sequences} sequences in flight a round lasts {} cycles (one token's walk {}, the busiest \
             region {} x {sequences}) and {longest}, so no sequence waits for an expert",
            need.round_cycles, cost.cycles, cost.bottleneck
        );
        return Ok((program, ReplicaChoice { mode, copies: 0, decision: Some(decision) }));
    }
    let wanted = need.copies.len();
    let options =
        CompileOptions { plan: program.plan, expert_replicas: ReplicaPolicy::Limited(need.copies), ..options.clone() };
    drop(program);
    let program = lowering::compile(module, target, &options)?;
    lowering::check(&program, module)?;
    let copies = placed(&program);
    let decision = format!(
        "copies of {wanted} experts whose expected queue outlasts a round of {} cycles ({longest}); {copies} placed",
        need.round_cycles
    );
    Ok((program, ReplicaChoice { mode, copies, decision: Some(decision) }))
}
