//! Interleave an MoE block's experts stage by stage.
//!
//! The frontends emit each expert's chain (dispatch, gate/up, SiLU, product, down) whole, one
//! expert after another. Program order is also the order in which the wafer runs instructions
//! that share PEs, and the stacked plan's `shareE` puts several experts on one lane's PEs: when
//! a token picks two of them, the second's gate/up waited for the first's whole chain, although
//! the lane's PEs were idle while the first's reduction, SiLU, product and their deliveries ran.
//! This pass reorders each maximal run of expert instructions so that every expert's `k`-th
//! instruction comes before any expert's `k + 1`-th (experts in their first order): the second
//! expert's gate/up then runs on the lane while the first's result travels.
//!
//! Only the order changes: every instruction keeps its operands (renumbered), its layer and its
//! type, and an expert's chain reads only its own earlier instructions and values from before
//! the run, so the new order is still topological. The bits cannot change: the experts are
//! independent, and `expert_combine` adds them in expert index order, not program order
//! (NUMERICS.md). A run where some instruction reads another expert's value is left as it is.

use waferc_ir::{Handle, Module};

use crate::error::PassError;
use crate::manager::Pass;

pub struct InterleaveExperts;

impl Pass for InterleaveExperts {
    fn name(&self) -> &'static str {
        "interleave-experts"
    }

    fn run(&self, module: &mut Module) -> Result<(), PassError> {
        if let Some(order) = interleaved_order(module) {
            *module = reordered(module, &order);
        }
        Ok(())
    }
}

/// The new program order (old instruction indices), or `None` when nothing moves.
fn interleaved_order(module: &Module) -> Option<Vec<usize>> {
    let expert = waferc_ir::dependency::experts(module);
    let n = expert.len();
    let mut order: Vec<usize> = Vec::with_capacity(n);
    let mut i = 0;
    while i < n {
        if expert[i].is_none() {
            order.push(i);
            i += 1;
            continue;
        }
        let start = i;
        while i < n && expert[i].is_some() {
            i += 1;
        }
        order.extend(interleave_run(module, &expert, start..i));
    }
    order.iter().enumerate().any(|(new, &old)| new != old).then_some(order)
}

/// Run `run`'s instructions stage by stage, or in their order when some instruction reads a
/// value of another expert computed inside the run.
fn interleave_run(module: &Module, expert: &[Option<u32>], run: std::ops::Range<usize>) -> Vec<usize> {
    let mut first_seen: Vec<u32> = Vec::new();
    let mut stage_of_expert: Vec<usize> = Vec::new();
    let mut keyed: Vec<(usize, usize, usize)> = Vec::with_capacity(run.len());
    for i in run.clone() {
        let e = expert[i].expect("a run holds expert instructions only");
        let rank = match first_seen.iter().position(|&f| f == e) {
            Some(rank) => rank,
            None => {
                first_seen.push(e);
                stage_of_expert.push(0);
                first_seen.len() - 1
            }
        };
        let independent = module.body[Handle::new(i)]
            .op
            .operands()
            .into_iter()
            .all(|o| o.index() < run.start || expert[o.index()] == Some(e));
        if !independent {
            return run.collect();
        }
        keyed.push((stage_of_expert[rank], rank, i));
        stage_of_expert[rank] += 1;
    }
    keyed.sort_unstable();
    keyed.into_iter().map(|(_, _, i)| i).collect()
}

/// `module` with its instructions in `order` (old indices), operands renumbered.
fn reordered(module: &Module, order: &[usize]) -> Module {
    let mut new_index = vec![0usize; order.len()];
    for (new, &old) in order.iter().enumerate() {
        new_index[old] = new;
    }
    let mut out = Module::new(module.meta.clone());
    out.weights = module.weights.clone();
    out.caches = module.caches.clone();
    for &old in order {
        let mut instr = module.body[Handle::new(old)].clone();
        instr.op = instr.op.remap(|v| Handle::new(new_index[v.index()]), |w| w, |c| c);
        out.body.append(instr);
    }
    out.output = module.output.map(|o| Handle::new(new_index[o.index()]));
    out
}
