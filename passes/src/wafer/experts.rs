//! Profile-guided expert placement: the order in which an MoE layer's experts take their PEs.
//!
//! The placer fills a wafer in shelves, in placement order, so instructions placed one after
//! another are neighbours. An MoE layer's dispatch point is the router and the normed input it
//! multicasts to the experts (placed before them); its gather point is the combine. A routing
//! profile (how often the router picks each expert, and each pair together) orders the layer's
//! experts as a chain: start from the hottest, then repeatedly take the expert most drawn to
//! the chain's end (picked together with it, plus its own picks), so hot experts come first and
//! co-picked experts stay adjacent. The combine is then placed before the experts, beside the
//! router, and the chain after it: the hottest experts sit nearest both the dispatch and the
//! gather point, and the cold ones farthest away, where only rare tokens pay the distance.
//! Without a profile, or with one where every expert is equally hot, experts keep index order and
//! the combine follows them (the placement is exactly the profile-free one).
//!
//! Replicas ([`place_replicas`]): once everything is placed, the PEs left free on a wafer take
//! extra copies of that wafer's hot experts, for several sequences in flight to share
//! (`waferc_ir::wafer::replicas`: sequence slot `s` uses copy `s mod copies`). Copies go one at a
//! time to the expert with the most expected picks per copy, so the hottest expert's load is
//! split first and no copy stays busier than it must; an expert gets at most `max_sequences`
//! copies (more would serve no sequence), and copies stop when the next does not fit. Which
//! experts may have copies, and how many, is the [`ReplicaPolicy`]: none, as many as the free
//! PEs hold, or the counts `compile --expert-replicas auto` finds worth their distance.

use std::collections::BTreeMap;

use waferc_ir::wafer::{LayerProfile, RoutingProfile};
use waferc_ir::{Module, Op, ValueType};

use waferc_ir::wafer::ExpertReplicas;

use super::place::Placer;
use super::size::{Analysis, Sizes};
use super::CompileOptions;

/// How experts are ordered within an MoE layer's region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertOrder {
    /// By the routing profile (index order when there is none).
    #[default]
    Profile,
    /// Index order whatever the profile says (the baseline profile-guided placement is measured
    /// against).
    Index,
}

/// Which hot experts get copies on the PEs left free ([`place_replicas`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ReplicaPolicy {
    /// No copies.
    #[default]
    Off,
    /// Copies while the free PEs hold them, at most `max_sequences` per expert.
    Fill,
    /// At most this many copies in all (the original included) of each listed `(layer,
    /// expert)`, while the free PEs hold them; no copies of the others.
    Limited(BTreeMap<(u32, u32), u32>),
}

impl ReplicaPolicy {
    /// The most copies (the original included) expert `expert` of `layer` may have with
    /// `max_sequences` sequences in flight.
    fn cap(&self, layer: u32, expert: u32, max_sequences: u32) -> u32 {
        match self {
            ReplicaPolicy::Off => 1,
            ReplicaPolicy::Fill => max_sequences,
            ReplicaPolicy::Limited(limits) => limits.get(&(layer, expert)).copied().unwrap_or(1).min(max_sequences),
        }
    }
}

/// The order in which a layer's `experts` are placed (first placed first: with a profile, the
/// hottest).
pub fn expert_order(profile: Option<&LayerProfile>, experts: u32) -> Vec<u32> {
    let Some(profile) = guiding(profile, experts) else {
        return (0..experts).collect();
    };
    let hottest = (0..experts).max_by_key(|&e| (profile.picks[e as usize], std::cmp::Reverse(e)));
    let mut chain: Vec<u32> = hottest.into_iter().collect();
    let mut placed = vec![false; experts as usize];
    if let Some(&first) = chain.first() {
        placed[first as usize] = true;
    }
    while chain.len() < experts as usize {
        let last = *chain.last().expect("the chain starts with the hottest expert");
        let next = (0..experts)
            .filter(|&e| !placed[e as usize])
            .max_by_key(|&e| (profile.pair(last, e) + profile.picks[e as usize], std::cmp::Reverse(e)))
            .expect("an unplaced expert remains");
        placed[next as usize] = true;
        chain.push(next);
    }
    chain
}

/// The profile if it can guide the placement of `experts` experts.
fn guiding(profile: Option<&LayerProfile>, experts: u32) -> Option<&LayerProfile> {
    profile.filter(|p| !p.is_uniform() && p.experts == experts)
}

/// Checks that `profile` describes `module`'s MoE layers: each profiled layer has a router with
/// as many experts and the same top-k.
pub(super) fn check_profile(module: &Module, profile: &RoutingProfile) -> Result<(), String> {
    if let Some(problem) = profile.problem() {
        return Err(format!("routing profile ({}): {problem}", profile.source));
    }
    for layer in &profile.layers {
        let router = module.body.iter().find_map(|(_, instr)| match (&instr.op, instr.layer) {
            (Op::RouterTopK { logits, top_k, .. }, Some(l)) if l == layer.layer => Some((*logits, *top_k)),
            _ => None,
        });
        let Some((logits, top_k)) = router else {
            return Err(format!(
                "routing profile ({}): layer {} has no MoE router in this model",
                profile.source, layer.layer
            ));
        };
        let experts = match &module.body[logits].ty {
            ValueType::Tensor(t) => t.elements(),
            ValueType::Routing { .. } => 0,
        };
        if experts != layer.experts as u64 || top_k != layer.top_k {
            return Err(format!(
                "routing profile ({}): layer {} profiles top {} of {} experts, but the model routes top {top_k} of {experts}",
                profile.source, layer.layer, layer.top_k, layer.experts
            ));
        }
    }
    Ok(())
}

/// The order in which the placer takes the module's instructions: program order, except that
/// each MoE layer's experts (every instruction of an expert, in program order) come in
/// [`expert_order`], after the layer's combine when a profile guides them.
pub(super) fn placement_sequence(module: &Module, analysis: &Analysis, options: &CompileOptions) -> Vec<usize> {
    let n = module.body.len();
    let mut sequence = Vec::with_capacity(n);
    let mut i = 0;
    while i < n {
        let (Some(_), Some(router)) = (analysis.expert[i], analysis.router[i]) else {
            sequence.push(i);
            i += 1;
            continue;
        };
        // The run of expert instructions of this router, grouped by expert.
        let mut groups: Vec<Vec<usize>> = Vec::new();
        while i < n && analysis.router[i] == Some(router) {
            let Some(expert) = analysis.expert[i] else { break };
            let e = expert as usize;
            if groups.len() <= e {
                groups.resize(e + 1, Vec::new());
            }
            groups[e].push(i);
            i += 1;
        }
        let layer = module.body[waferc_ir::Handle::new(router as usize)].layer;
        let profile = match options.expert_order {
            ExpertOrder::Profile => {
                options.profile.as_ref().zip(layer).and_then(|(profile, layer)| profile.layer(layer))
            }
            ExpertOrder::Index => None,
        };
        let experts = groups.len() as u32;
        let combine = (i < n && matches!(module.body[waferc_ir::Handle::new(i)].op, Op::ExpertCombine { .. }))
            .then_some(i)
            .filter(|&c| analysis.router[c] == Some(router));
        if let (Some(combine), Some(_)) = (combine, guiding(profile, experts)) {
            sequence.push(combine);
            i += 1;
        }
        for e in expert_order(profile, experts) {
            sequence.extend(&groups[e as usize]);
        }
    }
    sequence
}

/// Each MoE layer's experts: `(router, per expert its instructions in program order)`, in
/// program order (an expert's instructions are a run of the body, grouped by expert).
fn expert_groups(module: &Module, analysis: &Analysis) -> Vec<(u32, Vec<Vec<usize>>)> {
    let mut layers: Vec<(u32, Vec<Vec<usize>>)> = Vec::new();
    for i in 0..module.body.len() {
        let (Some(expert), Some(router)) = (analysis.expert[i], analysis.router[i]) else { continue };
        if layers.last().is_none_or(|(r, _)| *r != router) {
            layers.push((router, Vec::new()));
        }
        let groups = &mut layers.last_mut().expect("pushed above").1;
        if groups.len() <= expert as usize {
            groups.resize(expert as usize + 1, Vec::new());
        }
        groups[expert as usize].push(i);
    }
    layers
}

/// Places copies of hot experts on the PEs the placement left free (module docs), as the
/// options' [`ReplicaPolicy`] allows. Only with a profile that guides the order
/// (`--expert-order profile`) and room for several sequences.
pub(super) fn place_replicas(placer: &mut Placer, sizes: &Sizes, wafer_of: &[u16]) {
    let options = placer.options;
    let (Some(profile), ExpertOrder::Profile) = (&options.profile, options.expert_order) else { return };
    if options.max_sequences < 2 || options.expert_replicas == ReplicaPolicy::Off {
        return;
    }
    // Candidates: every picked expert of a guided layer, with its expected picks per token.
    struct Candidate {
        layer: u32,
        expert: u32,
        router: u32,
        group: Vec<usize>,
        picks: u64,
        tokens: u64,
        /// The most copies it may have, the original included.
        cap: usize,
        copies: Vec<Vec<waferc_ir::wafer::InstrPlacement>>,
        full: bool,
    }
    let mut candidates = Vec::new();
    for (router, groups) in expert_groups(placer.module, placer.analysis) {
        let Some(layer) = placer.module.body[waferc_ir::Handle::new(router as usize)].layer else { continue };
        let Some(guide) = guiding(profile.layer(layer), groups.len() as u32) else { continue };
        for (expert, group) in groups.into_iter().enumerate() {
            let picks = guide.picks[expert];
            let cap = options.expert_replicas.cap(layer, expert as u32, options.max_sequences) as usize;
            if picks > 0 && !group.is_empty() && cap > 1 {
                let tokens = guide.tokens.max(1);
                candidates.push(Candidate {
                    layer,
                    expert: expert as u32,
                    router,
                    group,
                    picks,
                    tokens,
                    cap,
                    copies: Vec::new(),
                    full: false,
                });
            }
        }
    }
    loop {
        // The most expected picks per copy (picks / tokens / copies, compared exactly), ties to
        // the earlier layer and expert.
        let next = candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| !c.full && c.copies.len() + 1 < c.cap)
            .max_by(|(_, a), (_, b)| {
                let load =
                    |c: &Candidate| c.picks as u128 * 1_000_000 / (c.tokens as u128 * (c.copies.len() as u128 + 1));
                load(a).cmp(&load(b)).then((b.layer, b.expert).cmp(&(a.layer, a.expert)))
            })
            .map(|(k, _)| k);
        let Some(k) = next else { break };
        let wafer = wafer_of[candidates[k].group[0]];
        match placer.place_copy(&candidates[k].group, &sizes.shapes, wafer) {
            Some(copy) => candidates[k].copies.push(copy),
            // A layer's experts are alike: none of this size fits on this wafer any more.
            None => {
                let size = candidates[k].group.len();
                for c in candidates.iter_mut().filter(|c| c.group.len() == size && wafer_of[c.group[0]] == wafer) {
                    c.full = true;
                }
            }
        }
    }
    placer.replicas = candidates
        .into_iter()
        .filter(|c| !c.copies.is_empty())
        .map(|c| ExpertReplicas {
            layer: c.layer,
            expert: c.expert,
            router: c.router,
            instrs: c.group.iter().map(|&i| i as u32).collect(),
            copies: c.copies,
        })
        .collect();
    placer.replicas.sort_by_key(|r| (r.router, r.expert));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hottest_last_and_pairs_adjacent() {
        let mut layer = LayerProfile::new(0, 6, 2);
        for _ in 0..50 {
            layer.record(&[2, 4]);
        }
        for _ in 0..30 {
            layer.record(&[0, 5]);
        }
        for _ in 0..5 {
            layer.record(&[1, 3]);
        }
        let order = expert_order(Some(&layer), 6);
        assert_eq!(order, vec![2, 4, 0, 5, 1, 3], "hottest first, partners beside each other");
        assert_eq!(expert_order(None, 4), vec![0, 1, 2, 3]);
        assert_eq!(expert_order(Some(&LayerProfile::new(0, 6, 2)), 6), vec![0, 1, 2, 3, 4, 5]);
    }
}
