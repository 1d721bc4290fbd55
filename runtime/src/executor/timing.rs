//! The timing model: cycles of one decode step, derived from the same execution that computes
//! the values (the same steps, the same PEs' work, the same messages on the same routes).
//!
//! # Parameters
//!
//! Everything comes from the program's [`TargetParams`]; for the built-in wafer targets the
//! parameters marked *(assumed)* are assumptions no public source states (see `waferc targets`
//! and `/work/shared/reference/wafer-facts.md`):
//!
//! * `clock_hz` *(assumed for WSE-3)* converts cycles to seconds;
//! * `f32_fma_per_cycle` *(assumed)*: arithmetic rate of one PE;
//! * `hop_latency_cycles` *(assumed for WSE-3)*, `link_bytes_per_cycle`: neighbour links;
//! * `inter_wafer_latency_cycles`, `inter_wafer_bytes_per_cycle` *(both assumed)*: wafer hops.
//!
//! The model's own constants, not target parameters and also assumptions: an elementwise add or
//! multiply is one FMA slot, a transcendental (`exp`, `sqrt`, `sin`/`cos`) [`EXP_FLOPS`] slots, a
//! division [`DIVIDE_FLOPS`]; SiLU [`SILU_FLOPS`] per element, rope [`ROPE_FLOPS`]. Weight
//! widening (quantised or 16-bit weights to f32) is taken to be free, hidden in the FMA pipeline.
//!
//! # Compute
//!
//! Each PE's work in a step is counted in FMA slots and divided by `f32_fma_per_cycle`: a matvec
//! tile `rows x elements` MACs; a norm's segment its squares, then two multiplies per element;
//! attention per block `positions x head_dim` MACs per query head for the scores, the same again
//! for the weighted values, plus one exponential and one division per score; the combine one
//! MAC per chosen expert per element; the router an exponential and a division per expert; each
//! edge of a reduction tree one add per element on the receiving PE. A step's compute time is its
//! **busiest PE's**.
//!
//! # Communication
//!
//! A route's time is its latency plus its serialisation. Latency: the hops from a source to the
//! farthest PE its runs reach, times `hop_latency_cycles` (an inter-wafer run counts
//! `inter_wafer_latency_cycles`). Serialisation: the busiest link of the route carries `messages x
//! message_bytes`, at `link_bytes_per_cycle` (or `inter_wafer_bytes_per_cycle`), wormhole-style, so
//! it adds to the latency once rather than per hop; a multicast's message crosses each link once
//! (the routers replicate it where the tree branches), a reduction's and a gather's messages add
//! up on the links they share. A reduction route is timed edge by edge along
//! [`reduce_tree`]: an edge starts when the sender's subtree is complete, costs its runs' hops,
//! one message's serialisation and the receiver's adds, and the route ends when the root has its
//! total (plus the forward to the destination, if any): its cost is the tree's critical path,
//! `~ depth x (distance + message)`. In one step, routes run concurrently on their colours, except
//! that a reduction or broadcast whose sources include an earlier such route's destination waits
//! for it (a MeshGemv row reduce after its group reduces; a broadcast after its reduce); and
//! routes that share a link serialise on it: the step's communication time is at least the
//! busiest link's bytes in the step over its bandwidth.
//!
//! # The decode step's critical path, and the overlap modeled
//!
//! A step lasts its compute time then its communication time. An instruction's steps run one
//! after another. An instruction starts when all its operands' instructions have finished (their
//! `Deliver` steps done; an expert's also waits for the router's decision) **and** when its PEs
//! are free: instructions on disjoint PEs whose inputs are ready overlap (the q, k and v
//! projections; the chosen experts), instructions sharing PEs run one after the other. Links
//! shared between overlapping steps of different instructions are not modeled as contended. The
//! decode step's cycles are the end of its last step. An unchosen expert takes no time.
//!
//! Prompt tokens are processed as decode steps, one position at a time (the executor and the
//! reference decoder both do so), so the time to first token for `n` prompt tokens is the sum of
//! the first `n` steps' cycles: attention grows with the position, everything else is constant.
//! Modeled decode throughput is `clock_hz / cycles per token`.

use std::collections::HashMap;

use serde::Serialize;
use waferc_ir::wafer::{
    reduce_tree, InstrIndex, Pe, Phase, Route, RouteId, RouteKind, Run, TargetParams, WaferProgram,
};

use super::error::ExecError;
use super::{route_of, site_of, InstrRun};

/// FMA slots of one transcendental (`exp`, `sqrt`, `sin`, `cos`): a model assumption.
pub const EXP_FLOPS: u64 = 8;
/// FMA slots of one f32 division: a model assumption.
pub const DIVIDE_FLOPS: u64 = 4;
/// Per element of SiLU, `x / (1 + exp(-x))`.
pub const SILU_FLOPS: u64 = EXP_FLOPS + DIVIDE_FLOPS + 1;
/// Per element of rope: two products and a sum (the angles are computed once per position).
pub const ROPE_FLOPS: u64 = 3;
/// `1 / sqrt(ms / g + eps)` once per norm group.
pub const RMS_INVERSE_FLOPS: u64 = EXP_FLOPS + 2 * DIVIDE_FLOPS + 1;

/// How many of the busiest PEs and links a report lists.
const BUSIEST: usize = 10;

/// One step of the schedule as it ran: what a Chrome trace shows as one slice.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepSpan {
    /// Index of the step in the program's schedule.
    pub step: usize,
    pub instr: InstrIndex,
    pub op: String,
    pub layer: Option<u32>,
    pub expert: Option<u32>,
    pub phase: Phase,
    pub start_cycle: u64,
    pub duration_cycles: u64,
    /// The busiest PE's compute in the step.
    pub compute_cycles: u64,
    pub comm_cycles: u64,
    /// PEs that computed in the step.
    pub pes: usize,
    /// Routes the step sent on.
    pub routes: usize,
}

/// The modeled timing of one decode step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepTiming {
    /// The position the step fed.
    pub position: u32,
    /// The step's critical path: the end of its last schedule step.
    pub cycles: u64,
    pub spans: Vec<StepSpan>,
    /// Compute cycles of each PE that worked in the step.
    #[serde(skip)]
    pub(crate) pe_cycles: HashMap<Pe, u64>,
    /// Routes that carried messages in the step, and how many messages each.
    #[serde(skip)]
    pub(crate) active_routes: Vec<(RouteId, u32)>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PeLoad {
    pub pe: Pe,
    /// Compute cycles per decode token.
    pub cycles: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkLoad {
    pub from: Pe,
    pub to: Pe,
    pub bytes_per_token: u64,
    /// `bytes_per_token / (link bytes per cycle x cycles per token)`.
    pub utilisation: f64,
}

/// The modeled performance of a program, for `waferc run --json` and `--trace`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TimingReport {
    pub target: String,
    pub clock_hz: f64,
    pub pes_used: usize,
    /// Mean cycles of the decode steps after the prompt (the last step's when there are none).
    pub cycles_per_token: u64,
    pub modeled_decode_tok_s: f64,
    pub prompt_tokens: usize,
    /// Time to first token: the prompt's steps, one per token (positions not run are charged the
    /// last step's cycles).
    pub modeled_ttft_us: f64,
    pub busiest_pes: Vec<PeLoad>,
    pub busiest_links: Vec<LinkLoad>,
    /// The last step's schedule, step by step.
    pub steps: Vec<StepSpan>,
}

/// Per-route and per-step communication costs, computed once per program.
#[derive(Clone, Debug)]
pub(crate) struct CostModel {
    params: TargetParams,
    routes: Vec<RouteCost>,
    /// Per schedule step: the busiest link's serialisation over the routes the step lists
    /// (collects excepted: how many of their sources send is only known when they run).
    step_link_cycles: Vec<u64>,
}

/// A route's cost when all its sources send.
#[derive(Clone, Copy, Debug)]
struct RouteCost {
    /// Hops to the farthest PE reached (a reduction: its whole tree, messages and adds included).
    latency: u64,
    /// The busiest link's bytes over its bandwidth.
    serial: u64,
    /// The slowest link's bytes per cycle (for a collect whose sources do not all send).
    bytes_per_cycle: f64,
}

impl CostModel {
    pub(crate) fn new(program: &WaferProgram) -> Result<Self, ExecError> {
        let params = program.target.clone();
        let routes =
            program.routes.iter().map(|route| route_cost(program, &params, route)).collect::<Result<_, _>>()?;
        let mut step_link_cycles = Vec::with_capacity(program.schedule.len());
        let mut load: HashMap<(Pe, Pe), u64> = HashMap::new();
        for step in &program.schedule {
            // One route's own serialisation is already in its cost.
            if step.routes.len() < 2 {
                step_link_cycles.push(0);
                continue;
            }
            load.clear();
            for &id in &step.routes {
                let route = route_of(program, &site_of(program, step.instr), id)?;
                if matches!(route.kind, RouteKind::Collect { .. }) {
                    continue;
                }
                for (hop, messages) in route.link_messages() {
                    *load.entry(hop).or_insert(0) += route.message_bytes as u64 * messages as u64;
                }
            }
            let busiest = load.iter().map(|(&(from, to), &bytes)| serialise(&params, from, to, bytes)).max();
            step_link_cycles.push(busiest.unwrap_or(0));
        }
        Ok(CostModel { params, routes, step_link_cycles })
    }

    /// Cycles of `n` fused multiply-adds on one PE.
    pub(crate) fn fma(&self, n: u64) -> u64 {
        (n as f64 / self.params.f32_fma_per_cycle).ceil() as u64
    }

    /// Cycles of `n` FMA slots of other arithmetic.
    pub(crate) fn flops(&self, n: u64) -> u64 {
        self.fma(n)
    }

    /// Cycles of a message from `from` to `to` on one wafer by a shortest path (an inter-wafer
    /// pair: `u64::MAX`, the route's own latency is kept).
    pub(crate) fn hop_latency(&self, from: Pe, to: Pe) -> u64 {
        from.distance(to).map_or(u64::MAX, |hops| hops as u64 * self.params.hop_latency_cycles as u64)
    }

    /// Cycles of route `id` carrying `messages` messages: a collect whose sources do not all
    /// send (the embedding: one table block; an MoE combine: the chosen experts) serialises only
    /// the messages sent, and an MoE combine's waits only for its farthest sender (`reach`).
    fn route_cycles(&self, route: &Route, messages: u32, reach: Option<u64>) -> u64 {
        let mut cost = self.routes[route.id as usize];
        if let Some(reach) = reach {
            cost.latency = cost.latency.min(reach);
        }
        let serial = match route.kind {
            RouteKind::Collect { .. } => {
                let sent = (messages as u64 * route.message_bytes as u64) as f64 / cost.bytes_per_cycle;
                cost.serial.min(sent.ceil() as u64)
            }
            _ => cost.serial,
        };
        cost.latency + serial
    }

    /// Communication cycles of schedule step `step` that sent on `routes` (in send order).
    fn comm_cycles(
        &self,
        program: &WaferProgram,
        step: usize,
        routes: &[(RouteId, u32)],
        reach: &[(RouteId, u64)],
    ) -> u64 {
        if routes.is_empty() {
            return 0;
        }
        // (destination, end) of the reductions and broadcasts so far: later ones may wait on them.
        let mut collective_ends: Vec<(Pe, u64)> = Vec::new();
        let mut end = 0;
        for &(id, messages) in routes {
            let route = &program.routes[id as usize];
            let farthest = reach.iter().find(|(r, _)| *r == id).map(|(_, latency)| *latency);
            let cycles = self.route_cycles(route, messages, farthest);
            let start = match route.kind {
                RouteKind::Reduce { .. } | RouteKind::Statistic { .. } => {
                    let start = collective_ends
                        .iter()
                        .filter(|(pe, _)| route.sources.contains(pe))
                        .map(|(_, e)| *e)
                        .max()
                        .unwrap_or(0);
                    collective_ends.extend(route.destinations.iter().map(|&pe| (pe, start + cycles)));
                    start
                }
                _ => 0,
            };
            end = end.max(start + cycles);
        }
        end.max(self.step_link_cycles[step])
    }
}

/// Cycles to push `bytes` over the link `from -> to`.
fn serialise(params: &TargetParams, from: Pe, to: Pe, bytes: u64) -> u64 {
    if from.wafer != to.wafer {
        (bytes as f64 / params.inter_wafer_bytes_per_cycle).ceil() as u64
    } else {
        bytes.div_ceil(params.link_bytes_per_cycle.max(1) as u64)
    }
}

fn run_latency(params: &TargetParams, run: &Run) -> u64 {
    if run.is_inter_wafer() {
        params.inter_wafer_latency_cycles
    } else {
        run.from.distance(run.to).unwrap_or(0) as u64 * params.hop_latency_cycles as u64
    }
}

fn path_error(program: &WaferProgram, route: &Route, problem: String) -> ExecError {
    ExecError::RoutePath { site: site_of(program, route.instr), route: route.id, problem }
}

/// A route's cost from its path (see the module documentation).
fn route_cost(program: &WaferProgram, params: &TargetParams, route: &Route) -> Result<RouteCost, ExecError> {
    let bytes_per_cycle = match route.path.iter().any(Run::is_inter_wafer) {
        true => params.inter_wafer_bytes_per_cycle.min(params.link_bytes_per_cycle as f64),
        false => params.link_bytes_per_cycle as f64,
    };
    let bytes = route.message_bytes as u64;
    if let RouteKind::Reduce { elements, .. } = route.kind {
        let Some(&root) = route.sources.first() else {
            return Err(path_error(program, route, "the reduction has no sources".into()));
        };
        let mut runs = route.path.iter().enumerate().peekable();
        // Walks the runs of one edge `from -> to`: (latency, serialisation).
        let mut walk = |from: Pe, to: Pe| -> Result<(u64, u64), ExecError> {
            let (mut at, mut latency, mut serial) = (from, 0, 0);
            while at != to {
                let Some((index, run)) = runs.next() else {
                    return Err(path_error(program, route, format!("the path ends before {from} reaches {to}")));
                };
                if run.from != at {
                    return Err(path_error(
                        program,
                        route,
                        format!("run {index} starts at {}, but the edge {from} -> {to} is at {at}", run.from),
                    ));
                }
                latency += run_latency(params, run);
                serial = serial.max(serialise(params, run.from, run.to, bytes));
                at = run.to;
            }
            Ok((latency, serial))
        };
        let mut ready = vec![0u64; route.sources.len()];
        for (receiver, sender) in reduce_tree(route.sources.len()) {
            let (latency, serial) = walk(route.sources[sender], route.sources[receiver])?;
            let add = (elements as f64 / params.f32_fma_per_cycle).ceil() as u64;
            ready[receiver] = ready[receiver].max(ready[sender] + latency + serial + add);
        }
        let mut total = ready[0];
        for &destination in &route.destinations {
            let (latency, serial) = walk(root, destination)?;
            total += latency + serial;
        }
        if let Some((index, _)) = runs.next() {
            return Err(path_error(program, route, format!("run {index} is not on any edge of the tree")));
        }
        return Ok(RouteCost { latency: total, serial: 0, bytes_per_cycle });
    }
    // Depth (cycles from a source) of every PE the runs reach so far.
    let mut depth: HashMap<Pe, u64> = route.sources.iter().map(|&pe| (pe, 0)).collect();
    let (mut latency, mut serial) = (0, 0);
    for (index, run) in route.path.iter().enumerate() {
        let Some(&start) = depth.get(&run.from) else {
            return Err(path_error(
                program,
                route,
                format!("run {index} starts at {}, which no source or earlier run reaches", run.from),
            ));
        };
        if run.is_inter_wafer() {
            let end = start + params.inter_wafer_latency_cycles;
            depth.entry(run.to).and_modify(|d| *d = (*d).min(end)).or_insert(end);
            latency = latency.max(end);
        } else {
            for (k, pe) in run.pes().into_iter().enumerate().skip(1) {
                let end = start + k as u64 * params.hop_latency_cycles as u64;
                depth.entry(pe).and_modify(|d| *d = (*d).min(end)).or_insert(end);
                latency = latency.max(end);
            }
        }
        serial = serial.max(serialise(params, run.from, run.to, bytes * run.messages as u64));
    }
    Ok(RouteCost { latency, serial, bytes_per_cycle })
}

/// The decode step's schedule as it runs: when each instruction ends, when each PE is free.
pub(crate) struct Timeline {
    instr_end: Vec<u64>,
    pe_free: HashMap<Pe, u64>,
    spans: Vec<StepSpan>,
    pe_cycles: HashMap<Pe, u64>,
    active_routes: Vec<(RouteId, u32)>,
    end: u64,
}

impl Timeline {
    pub(crate) fn new(program: &WaferProgram) -> Self {
        Timeline {
            instr_end: vec![0; program.instrs.len()],
            pe_free: HashMap::new(),
            spans: Vec::with_capacity(program.schedule.len()),
            pe_cycles: HashMap::new(),
            active_routes: Vec::new(),
            end: 0,
        }
    }

    pub(crate) fn instr_end(&self, instr: InstrIndex) -> u64 {
        self.instr_end[instr as usize]
    }

    /// Places an executed instruction's steps on the timeline: it starts at `ready` (its
    /// operands' end) or when its PEs are free, whichever is later; an unchosen expert
    /// (`worked == false`) takes no time and occupies nothing.
    pub(crate) fn finish_instr(
        &mut self,
        program: &WaferProgram,
        costs: &CostModel,
        run: &mut InstrRun,
        worked: bool,
        ready: u64,
        pes: &[Pe],
    ) {
        let orphan = run.take_orphan();
        if let Some(last) = run.work.last_mut() {
            for (pe, cycles) in orphan {
                *last.compute.entry(pe).or_insert(0) += cycles;
            }
        }
        let mut at = ready;
        if worked {
            at = pes.iter().filter_map(|pe| self.pe_free.get(pe)).fold(at, |a, &b| a.max(b));
        }
        let placement = &program.instrs[run.instr as usize];
        for ((index, step), work) in run.steps.iter().zip(&run.work) {
            let (compute, routes) = (&work.compute, &work.routes);
            let (compute_cycles, comm_cycles) = if worked {
                (compute.values().copied().max().unwrap_or(0), costs.comm_cycles(program, *index, routes, &work.reach))
            } else {
                (0, 0)
            };
            let duration = compute_cycles + comm_cycles;
            self.spans.push(StepSpan {
                step: *index,
                instr: run.instr,
                op: placement.op.clone(),
                layer: placement.layer,
                expert: placement.expert,
                phase: step.phase,
                start_cycle: at,
                duration_cycles: duration,
                compute_cycles,
                comm_cycles,
                pes: compute.len(),
                routes: routes.len(),
            });
            at += duration;
            if worked {
                for (&pe, &cycles) in compute {
                    *self.pe_cycles.entry(pe).or_insert(0) += cycles;
                }
                self.active_routes.extend_from_slice(routes);
            }
        }
        self.instr_end[run.instr as usize] = at;
        if worked {
            for &pe in pes {
                self.pe_free.insert(pe, at);
            }
        }
        self.end = self.end.max(at);
    }

    pub(crate) fn into_step_timing(self, position: u32) -> StepTiming {
        StepTiming {
            position,
            cycles: self.end,
            spans: self.spans,
            pe_cycles: self.pe_cycles,
            active_routes: self.active_routes,
        }
    }
}

/// The report over the steps run so far (`history`: cycles by position; `last`: the last step).
pub(crate) fn report(program: &WaferProgram, history: &[u64], last: &StepTiming, prompt_tokens: usize) -> TimingReport {
    let params = &program.target;
    let decode = history.get(prompt_tokens..).unwrap_or(&[]);
    let cycles_per_token = match decode.len() {
        0 => last.cycles,
        n => (decode.iter().sum::<u64>() as f64 / n as f64).round() as u64,
    }
    .max(1);
    let run_prompt = prompt_tokens.min(history.len());
    let ttft_cycles = history[..run_prompt].iter().sum::<u64>() + (prompt_tokens - run_prompt) as u64 * last.cycles;

    let mut busiest_pes: Vec<PeLoad> = last.pe_cycles.iter().map(|(&pe, &cycles)| PeLoad { pe, cycles }).collect();
    busiest_pes.sort_by(|a, b| b.cycles.cmp(&a.cycles).then(a.pe.cmp(&b.pe)));
    busiest_pes.truncate(BUSIEST);

    let mut link_bytes: HashMap<(Pe, Pe), u64> = HashMap::new();
    for &(id, sent) in &last.active_routes {
        let route = &program.routes[id as usize];
        for (hop, messages) in route.link_messages() {
            // A collect's link carries at most the messages its senders sent.
            let messages = match route.kind {
                RouteKind::Collect { .. } => messages.min(sent),
                _ => messages,
            };
            *link_bytes.entry(hop).or_insert(0) += route.message_bytes as u64 * messages as u64;
        }
    }
    let mut busiest_links: Vec<LinkLoad> = link_bytes
        .into_iter()
        .map(|((from, to), bytes)| {
            let per_cycle = if from.wafer != to.wafer {
                params.inter_wafer_bytes_per_cycle
            } else {
                params.link_bytes_per_cycle as f64
            };
            LinkLoad {
                from,
                to,
                bytes_per_token: bytes,
                utilisation: bytes as f64 / (per_cycle * cycles_per_token as f64),
            }
        })
        .collect();
    busiest_links.sort_by(|a, b| b.bytes_per_token.cmp(&a.bytes_per_token).then((a.from, a.to).cmp(&(b.from, b.to))));
    busiest_links.truncate(BUSIEST);

    TimingReport {
        target: params.name.clone(),
        clock_hz: params.clock_hz,
        pes_used: program.pes.len(),
        cycles_per_token,
        modeled_decode_tok_s: params.clock_hz / cycles_per_token as f64,
        prompt_tokens,
        modeled_ttft_us: ttft_cycles as f64 / params.clock_hz * 1e6,
        busiest_pes,
        busiest_links,
        steps: last.spans.clone(),
    }
}
