//! Several sequences in flight: the pipeline model behind `waferc run --sequences N`.
//!
//! The placement puts each layer (and the embedding, and the output head) in a region of its
//! own, and a decode step walks the regions in order. With one sequence only one region works
//! at a time; with several in flight, each region can work on a different sequence in the same
//! interval, so the regions form a pipeline. Per decode step of a sequence we know, from the
//! executor's timeline, the step's cycles `T` (its critical path) and each region's busy cycles
//! (from its first span's start to its last span's end). Sequences are admitted in order into
//! `N` slots; the run proceeds in rounds in which every admitted sequence advances one position.
//! A round of `A` sequences lasts at least each one's own step (`T`: a token needs the whole
//! walk through the layers before the next can start) and at least `A` times the busiest
//! region's cycles (that region must serve all `A`): the model takes the larger of the two
//! bounds, i.e. perfect staggering with the busiest region as the pipeline's bottleneck.
//! A finished sequence frees its slot for the next one at the end of the round.
//!
//! Regions are the placement's: under the tiled plan each layer has PEs of its own; under the
//! stacked plan (`stacked:K`) `K` consecutive layers share one rectangle of PEs, so their group is
//! one region, busy from its first layer's first span to its last layer's last span (a second
//! sequence cannot use the group's PEs while a first walks through its layers).
//!
//! MoE layers (tiled plan): a layer's experts run on PEs of their own, so an MoE layer's region is split into
//! units that serve sequences independently: the layer's other instructions (busy for the union
//! of their spans, which leaves out the stretch in which only experts work) and each copy of
//! each expert (busy from its first span to its last). A round also lasts at least, for every
//! expert copy, the sum of its busy cycles over the sequences it serves in the round: sequences
//! that pick the same hot expert queue on it, and copies of that expert
//! (`waferc_ir::wafer::replicas`) split the queue. Under the stacked plan an MoE layer's experts
//! run in lanes of the group's own rectangle, so they count to the group's region.

use std::collections::BTreeMap;

use serde::Serialize;

use waferc_ir::wafer::Plan;

use super::timing::StepTiming;

/// One decode step of one sequence, as the pipeline model sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepCost {
    /// The step's critical path.
    pub cycles: u64,
    /// The busiest region's busy cycles in the step (an MoE layer's experts left out).
    pub bottleneck: u64,
    /// Busy cycles of each expert copy that worked: `((layer, expert, copy), cycles)`.
    pub experts: Vec<((u32, u32, u32), u64)>,
}

impl StepCost {
    /// The step's cycles and its busiest region: regions are the `plan`'s layer regions (a
    /// layer, or a stacked plan's group of layers), plus the instructions before the first layer
    /// (the embedding) and those after the last (the output head).
    pub fn of(step: &StepTiming, plan: &Plan) -> StepCost {
        let (layers_per_region, experts_apart) = match *plan {
            Plan::Stacked { layers_per_region, .. } => (layers_per_region.max(1) as u32, false),
            Plan::Tiled | Plan::MeshGemv { .. } => (1, true),
        };
        let first_layer_instr = step.spans.iter().filter(|s| s.layer.is_some()).map(|s| s.instr).min();
        // Region key: (0, layer) for layers, (-1, 0) before them, (1, 0) after them.
        let mut regions: BTreeMap<(i8, u32), (u64, u64)> = BTreeMap::new();
        let mut experts: BTreeMap<(u32, u32, u32), (u64, u64)> = BTreeMap::new();
        // Per MoE layer, its non-expert spans' intervals.
        let mut moe_spans: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
        for span in &step.spans {
            let end = span.start_cycle + span.duration_cycles;
            if let (Some(layer), Some(expert), true) = (span.layer, span.expert, experts_apart) {
                let entry = experts.entry((layer, expert, span.copy)).or_insert((span.start_cycle, end));
                entry.0 = entry.0.min(span.start_cycle);
                entry.1 = entry.1.max(end);
                continue;
            }
            if let Some(layer) = span.layer {
                moe_spans.entry(layer).or_default().push((span.start_cycle, end));
            }
            let key = match (span.layer, first_layer_instr) {
                (Some(layer), _) => (0, layer / layers_per_region),
                (None, Some(first)) if span.instr < first => (-1, 0),
                (None, _) => (1, 0),
            };
            let entry = regions.entry(key).or_insert((span.start_cycle, end));
            entry.0 = entry.0.min(span.start_cycle);
            entry.1 = entry.1.max(end);
        }
        let moe_layers: std::collections::BTreeSet<u32> = experts.keys().map(|&(layer, _, _)| layer).collect();
        let bottleneck = regions
            .iter()
            .map(|(&(kind, layer), (start, end))| match (kind, moe_layers.contains(&layer)) {
                (0, true) => union_length(moe_spans.remove(&layer).unwrap_or_default()),
                _ => end - start,
            })
            .max()
            .unwrap_or(0);
        let experts = experts.into_iter().map(|(key, (start, end))| (key, end - start)).collect();
        StepCost { cycles: step.cycles, bottleneck: bottleneck.min(step.cycles), experts }
    }
}

/// What copies of hot experts can do for a pipeline of sequences, by this model: the answer of
/// [`replica_need`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplicaNeed {
    /// A round's length without copies from its other bounds: the larger of one sequence's step
    /// and the sequences in flight times the busiest region.
    pub round_cycles: u64,
    /// The expert with the longest expected queue per round, and that queue in cycles.
    pub longest_queue: Option<((u32, u32), u64)>,
    /// Copies (the original included) each expert needs so that its expected queue fits in the
    /// round: only experts needing more than one, by `(layer, expert)`.
    pub copies: BTreeMap<(u32, u32), u32>,
}

/// Which experts' copies can shorten a round of `sequences` in flight (module documentation),
/// from one sequence's step on the copy-free placement. A round lasts at least one sequence's
/// step `T` and `sequences` times the busiest region `B`; an expert picked with probability
/// `p` per token (`pick_rate(layer, expert)`: the routing profile's picks over its tokens) and
/// busy `b` cycles when it runs queues on average `sequences x p x b` cycles a round. Only
/// where that queue is longer than `max(T, sequences x B)` can copies shorten the round, and
/// `ceil(queue / round)` copies (at most one per sequence) bring it back within the round. An
/// expert that did not run in the step is taken to be as busy as the busiest of its layer that
/// did (a layer's experts have one shape). `experts` lists the candidates, `(layer, expert)`.
pub fn replica_need(
    step: &StepCost,
    sequences: u32,
    experts: &[(u32, u32)],
    pick_rate: impl Fn(u32, u32) -> f64,
) -> ReplicaNeed {
    let round_cycles = step.cycles.max(sequences as u64 * step.bottleneck);
    let mut busy: BTreeMap<(u32, u32), u64> = BTreeMap::new();
    let mut layer_busy: BTreeMap<u32, u64> = BTreeMap::new();
    for &((layer, expert, copy), cycles) in &step.experts {
        if copy == 0 {
            busy.insert((layer, expert), cycles);
        }
        let widest = layer_busy.entry(layer).or_insert(0);
        *widest = (*widest).max(cycles);
    }
    let mut need = ReplicaNeed { round_cycles, longest_queue: None, copies: BTreeMap::new() };
    for &(layer, expert) in experts {
        let Some(&cycles) = busy.get(&(layer, expert)).or(layer_busy.get(&layer)) else { continue };
        let queue = (sequences as f64 * pick_rate(layer, expert) * cycles as f64).ceil() as u64;
        if need.longest_queue.is_none_or(|(_, longest)| queue > longest) {
            need.longest_queue = Some(((layer, expert), queue));
        }
        let copies = queue.div_ceil(round_cycles.max(1)).min(sequences as u64) as u32;
        if copies > 1 {
            need.copies.insert((layer, expert), copies);
        }
    }
    need
}

/// Cycles covered by the union of `intervals` (`(start, end)`).
fn union_length(mut intervals: Vec<(u64, u64)>) -> u64 {
    intervals.sort_unstable();
    let (mut total, mut reached) = (0, 0);
    for (start, end) in intervals {
        let start = start.max(reached);
        if end > start {
            total += end - start;
            reached = end;
        }
    }
    total
}

/// A sequence to run: its steps' costs (prompt positions, then one per generated token but the
/// last, whose step nobody needs) and its prompt length.
#[derive(Clone, Debug)]
pub struct SequenceCosts {
    pub prompt_tokens: usize,
    /// Tokens it generates (its first comes from the last prompt step).
    pub new_tokens: usize,
    /// One per step the sequence runs, in position order.
    pub steps: Vec<StepCost>,
}

/// What the pipeline model gives for one sequence.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SequenceTiming {
    /// Time from the start of the run to its first generated token.
    pub modeled_ttft_us: f64,
    /// Its generated tokens over the time of the rounds that produced them.
    pub modeled_tok_s: f64,
}

/// The whole run under the pipeline model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PipelineTiming {
    pub sequences: Vec<SequenceTiming>,
    /// All sequences' generated tokens over the time of the rounds producing any.
    pub aggregate_modeled_tok_s: f64,
    /// Modeled cycles from the start to the last token.
    pub total_cycles: u64,
}

/// Runs the pipeline model (module documentation) with up to `in_flight` sequences at once.
pub fn pipeline(sequences: &[SequenceCosts], in_flight: usize, clock_hz: f64) -> PipelineTiming {
    let in_flight = in_flight.max(1);
    let n = sequences.len();
    let mut position = vec![0usize; n];
    let mut first_token_at = vec![None::<u64>; n];
    let mut token_cycles = vec![0u64; n];
    let mut produced = vec![0usize; n];
    let mut active: Vec<usize> = Vec::new();
    let mut next = 0;
    let (mut now, mut all_tokens, mut token_rounds) = (0u64, 0usize, 0u64);
    loop {
        while active.len() < in_flight && next < n {
            active.push(next);
            next += 1;
        }
        if active.is_empty() {
            break;
        }
        let cost = |s: usize| sequences[s].steps.get(position[s]).or(sequences[s].steps.last());
        let longest = active.iter().filter_map(|&s| cost(s)).map(|c| c.cycles).max().unwrap_or(0);
        let busiest = active.iter().filter_map(|&s| cost(s)).map(|c| c.bottleneck).max().unwrap_or(0);
        // Sequences picking the same expert copy queue on it.
        let mut queued: BTreeMap<(u32, u32, u32), u64> = BTreeMap::new();
        for c in active.iter().filter_map(|&s| cost(s)) {
            for &(unit, cycles) in &c.experts {
                *queued.entry(unit).or_insert(0) += cycles;
            }
        }
        let expert_queue = queued.values().copied().max().unwrap_or(0);
        let round = longest.max(active.len() as u64 * busiest).max(expert_queue);
        now += round;
        let mut tokens = 0;
        for &s in &active {
            position[s] += 1;
            // The step of position p produces a token once the prompt is in (p + 1 >= prompt).
            if position[s] >= sequences[s].prompt_tokens && produced[s] < sequences[s].new_tokens {
                produced[s] += 1;
                token_cycles[s] += round;
                tokens += 1;
                if first_token_at[s].is_none() {
                    first_token_at[s] = Some(now);
                }
            }
        }
        if tokens > 0 {
            all_tokens += tokens;
            token_rounds += round;
        }
        active.retain(|&s| produced[s] < sequences[s].new_tokens);
    }
    let seconds = |cycles: u64| cycles as f64 / clock_hz;
    let rate = |tokens: usize, cycles: u64| if cycles == 0 { 0.0 } else { tokens as f64 / seconds(cycles) };
    PipelineTiming {
        sequences: (0..n)
            .map(|s| SequenceTiming {
                modeled_ttft_us: seconds(first_token_at[s].unwrap_or(now)) * 1e6,
                modeled_tok_s: rate(produced[s], token_cycles[s]),
            })
            .collect(),
        aggregate_modeled_tok_s: rate(all_tokens, token_rounds),
        total_cycles: now,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(steps: usize, cycles: u64, bottleneck: u64) -> SequenceCosts {
        let step = StepCost { cycles, bottleneck, experts: Vec::new() };
        SequenceCosts { prompt_tokens: 1, new_tokens: steps, steps: vec![step; steps] }
    }

    #[test]
    fn sequences_queue_on_a_shared_expert_and_copies_split_the_queue() {
        // Eight sequences whose steps all use expert 3 of layer 0 for 400 cycles.
        let on = |copy: u32| StepCost { cycles: 1000, bottleneck: 100, experts: vec![((0, 3, copy), 400)] };
        let one_copy: Vec<SequenceCosts> =
            (0..8).map(|_| SequenceCosts { prompt_tokens: 1, new_tokens: 2, steps: vec![on(0); 2] }).collect();
        // 8 x 400 on the one copy bounds the round (above 1000 and 8 x 100).
        assert_eq!(pipeline(&one_copy, 8, 1e6).aggregate_modeled_tok_s, 8.0 / 3200e-6);
        // Two copies, sequences alternating: 4 x 400 each.
        let two_copies: Vec<SequenceCosts> =
            (0..8).map(|s| SequenceCosts { prompt_tokens: 1, new_tokens: 2, steps: vec![on(s % 2); 2] }).collect();
        assert_eq!(pipeline(&two_copies, 8, 1e6).aggregate_modeled_tok_s, 8.0 / 1600e-6);
    }

    #[test]
    fn copies_are_needed_only_where_an_expert_queue_outlasts_the_round() {
        // A token's walk of 10,000 cycles, the busiest region 500, expert 3 of layer 0 busy
        // 400 and picked by every token, expert 5 by a quarter of them.
        let step = StepCost { cycles: 10_000, bottleneck: 500, experts: vec![((0, 3, 0), 400), ((0, 5, 0), 400)] };
        let rate = |_: u32, expert: u32| if expert == 3 { 1.0 } else { 0.25 };
        let experts = [(0, 3), (0, 5), (0, 7)];
        // 16 sequences: the round is 16 x 500 = 8,000 < 10,000; expert 3 queues 6,400: no copy pays.
        let need = replica_need(&step, 16, &experts, rate);
        assert_eq!(need.round_cycles, 10_000);
        assert_eq!(need.longest_queue, Some(((0, 3), 6_400)));
        assert!(need.copies.is_empty());
        // A walk of 2,000 and a busiest region of 100: 16 sequences make a round of 2,000, and
        // expert 3 queues 6,400 (4 copies), expert 5 1,600 (none), expert 7, which did not run,
        // is taken as busy as its layer's busiest, at expert 5's rate: none either.
        let short = StepCost { cycles: 2_000, bottleneck: 100, ..step };
        let need = replica_need(&short, 16, &experts, rate);
        assert_eq!(need.copies, BTreeMap::from([((0, 3), 4)]));
        // Never more copies than sequences.
        let need = replica_need(&short, 2, &experts, |_, _| 100.0);
        assert!(need.copies.values().all(|&c| c == 2));
    }

    /// A step through `layers` layers of 100 cycles each, one after another.
    fn walk(layers: u32) -> StepTiming {
        let spans = (0..layers)
            .map(|layer| super::super::timing::StepSpan {
                step: layer as usize,
                instr: layer,
                op: "matvec".into(),
                layer: Some(layer),
                expert: None,
                copy: 0,
                phase: waferc_ir::wafer::Phase::Compute,
                start_cycle: 100 * layer as u64,
                duration_cycles: 100,
                compute_cycles: 100,
                comm_cycles: 0,
                wait_cycles: 0,
                waited_on: None,
                pes: 1,
                routes: 0,
            })
            .collect();
        StepTiming {
            position: 0,
            cycles: 100 * layers as u64,
            spans,
            layers: Vec::new(),
            pe_cycles: Default::default(),
            pe_attention_cycles: Default::default(),
            active_routes: Vec::new(),
            active_senders: Vec::new(),
        }
    }

    #[test]
    fn a_stacked_group_of_layers_is_one_region() {
        let step = walk(8);
        assert_eq!(StepCost::of(&step, &Plan::Tiled).bottleneck, 100);
        // Four layers share one rectangle of PEs: a second sequence waits for all four.
        assert_eq!(StepCost::of(&step, &Plan::stacked(4)).bottleneck, 400);
        assert_eq!(StepCost::of(&step, &Plan::stacked(1)).bottleneck, 100);
        // So 16 sequences in flight on two groups are bound by the groups, not by one layer.
        let costs = vec![
            SequenceCosts {
                prompt_tokens: 1,
                new_tokens: 2,
                steps: vec![StepCost::of(&step, &Plan::stacked(4)); 2]
            };
            16
        ];
        assert_eq!(pipeline(&costs, 16, 1e6).aggregate_modeled_tok_s, 16.0 / 6400e-6);
    }

    #[test]
    fn the_busiest_region_bounds_a_full_pipeline() {
        // 10 regions of 100 cycles: one sequence takes 1000 per token.
        let one = pipeline(&[seq(4, 1000, 100)], 1, 1e6);
        assert_eq!(one.aggregate_modeled_tok_s, 1000.0);
        // Four in flight share the pipeline: each still waits its own 1000 cycles.
        let four = pipeline(&vec![seq(4, 1000, 100); 4], 4, 1e6);
        assert_eq!(four.aggregate_modeled_tok_s, 4000.0);
        assert_eq!(four.sequences[0].modeled_tok_s, 1000.0);
        // Sixteen saturate the busiest region: 1600 cycles per round.
        let sixteen = pipeline(&vec![seq(4, 1000, 100); 16], 16, 1e6);
        assert_eq!(sixteen.aggregate_modeled_tok_s, 10_000.0);
        // More sequences than slots queue: the fifth starts after the first four finish.
        let queued = pipeline(&vec![seq(2, 1000, 100); 5], 4, 1e6);
        assert_eq!(queued.sequences[4].modeled_ttft_us, 3000.0);
        assert_eq!(queued.sequences[0].modeled_ttft_us, 1000.0);
    }
}
