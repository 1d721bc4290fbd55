//! The wafer executor: runs a placed [`WaferProgram`] the way the wafer would.
//!
//! Every PE works on its own SRAM image (its [`PeImage`] regions, weight regions filled from the
//! artifact's tile blob), and values move between PEs **only** as messages on the program's
//! routes, keyed by `(route id, sending PE)`: a PE that sends on a route it is not a source of,
//! reads a route it is not a destination of, or waits for a message nobody sent is an error
//! naming the route, the instruction (op, layer, expert) and the PE. The schedule's [`Step`]s give
//! the order; a step may only send on the routes it lists.
//!
//! Arithmetic is the runtime kernels' at tile granularity, so every value is bit-identical to the
//! reference decoder's (NUMERICS.md): a matvec tile computes [`kernels::dot`] over its aligned
//! chunk run, the [`RouteKind::Reduce`] routes combine the partials with [`reduce_tree`], norms
//! and attention split their sums the same way. MoE: every PE of an expert's instruction reads the
//! router's decision from its `Routing` route; an unchosen expert does no work and sends nothing.
//!
//! With [`ExecOptions::timing_only`] the executor walks the same schedule, routes and messages
//! without values (for shape-only programs of full-size models): per-step work is proportional
//! to routes and tiles, never to elements, and the router chooses experts `0..top_k`.
//!
//! Each step also produces its [`StepTiming`] from the [`timing`] model.

mod error;
pub mod timing;
mod validate;

use std::collections::HashMap;
use std::ops::Range;

use waferc_ir::wafer::{
    reduce_tree, AttentionPlacement, InstrIndex, MatVecPlacement, NormPlacement, Pe, PeImage, Phase, ReduceOp,
    RegionKind, ResultLayout, Route, RouteId, RouteKind, Segment, Step, WaferProgram, Work,
};
use waferc_ir::{DType, Module, Op, ValueType, BLOCK};

use crate::kernels::{self, RopeAngles, Routing, RowView, VectorTreeSum};
use crate::reference::{Decoder, InstrValue};
use crate::RuntimeError;

pub use error::{ExecError, InstrSite, WeightRegionError};
pub use timing::{LinkLoad, PeLoad, StepSpan, StepTiming, TimingReport};
pub use validate::{validate, Mismatch, Validation, ValidationOptions};

/// How an [`Executor`] runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecOptions {
    /// Walk the schedule and routes without values: no tile blob is read, no arithmetic is done,
    /// and [`StepResult::logits`] is `None`. For shape-only programs of full-size models.
    pub timing_only: bool,
    /// Keep every instruction's value of the last step ([`Executor::last_values`]), for
    /// validation's first-mismatch report.
    pub record_values: bool,
}

/// What one decode step produced.
#[derive(Clone, Debug)]
pub struct StepResult {
    /// The logits row, assembled from the output's result segments (`None` when timing only).
    pub logits: Option<Vec<f32>>,
    pub timing: StepTiming,
}

/// Values on the wafer: real f32 elements, or (timing only) just how many there would be.
#[derive(Clone, Debug)]
enum Data {
    Values(Vec<f32>),
    Shape(usize),
}

impl Data {
    fn len(&self) -> usize {
        match self {
            Data::Values(v) => v.len(),
            Data::Shape(n) => *n,
        }
    }

    /// The elements; empty when timing only (arithmetic never runs then).
    fn values(&self) -> &[f32] {
        match self {
            Data::Values(v) => v,
            Data::Shape(_) => &[],
        }
    }

    fn slice(&self, range: Range<usize>) -> Data {
        match self {
            Data::Values(v) => Data::Values(v[range].to_vec()),
            Data::Shape(_) => Data::Shape(range.len()),
        }
    }
}

/// A message on a route.
#[derive(Clone, Debug)]
enum Payload {
    Data(Data),
    Routing(Routing),
}

/// What an instruction's result PEs hold during a step.
#[derive(Clone, Debug)]
enum Held {
    Pending,
    /// An unchosen expert's instruction (or one computed from it).
    Absent,
    /// One entry per result segment, on the segment's PE.
    Segments(Vec<Data>),
    Routing(Routing),
}

/// The router decision an expert's instruction waits for.
#[derive(Clone, Copy, Debug)]
struct Gate {
    route: RouteId,
    expert: u32,
}

/// One attention KV block's cache: keys then values, `head_dim` f32 per position.
#[derive(Clone, Debug, Default)]
struct KvBlockState {
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// Runs one [`WaferProgram`] against the IR module it was compiled from.
pub struct Executor<'p> {
    program: &'p WaferProgram,
    module: &'p Module,
    options: ExecOptions,
    /// The schedule cut into instructions: `(instruction, its steps' indices)`, in order.
    runs: Vec<(InstrIndex, Range<usize>)>,
    /// Per PE image (in `program.pes` order), its SRAM with the weight regions filled.
    sram: Vec<Vec<u8>>,
    /// The operand routes reaching each `(consumer instruction, PE)`.
    receivers: HashMap<(InstrIndex, Pe), Vec<RouteId>>,
    /// Each value, followed through `expert_dispatch` (which aliases its `x`).
    alias: Vec<InstrIndex>,
    gates: Vec<Option<Gate>>,
    /// The PEs that compute each instruction (tiles, segments, KV blocks, the router).
    instr_pes: Vec<Vec<Pe>>,
    /// Attention's `Collect` routes (the placement does not list them), in element order.
    attention_collects: HashMap<InstrIndex, Vec<RouteId>>,
    rope_frequencies: Vec<Option<Vec<f32>>>,
    /// KV caches, keyed by (attention instruction, KV head placement, block).
    kv: HashMap<(InstrIndex, usize, usize), KvBlockState>,
    /// Destinations of each route, sorted (membership tests on big multicasts).
    destinations: Vec<Vec<Pe>>,
    costs: timing::CostModel,
    position: u32,
    /// Modeled cycles of each step since the last reset, by position.
    history: Vec<u64>,
    last_timing: Option<StepTiming>,
    last_values: Option<Vec<InstrValue>>,
}

impl<'p> Executor<'p> {
    /// Prepares `program` (compiled from `module`) for execution: checks that the placements
    /// match the module and the schedule keeps each instruction's steps together and in phase
    /// order, and loads every PE's weight regions from `tile_blob` (not needed when timing only).
    pub fn new(
        program: &'p WaferProgram,
        module: &'p Module,
        tile_blob: Option<&[u8]>,
        options: ExecOptions,
    ) -> Result<Self, ExecError> {
        waferc_ir::verify(module)?;
        if program.instrs.len() != module.body.len() {
            return Err(ExecError::InstructionCount { program: program.instrs.len(), module: module.body.len() });
        }
        for (index, (placement, (_, instr))) in program.instrs.iter().zip(module.body.iter()).enumerate() {
            if placement.instr as usize != index || placement.op != instr.op.name() {
                return Err(ExecError::PlacementMismatch {
                    index,
                    instr: placement.instr,
                    op: placement.op.clone(),
                    module_op: instr.op.name(),
                });
            }
        }
        let runs = schedule_runs(program)?;
        let sram = if options.timing_only { Vec::new() } else { load_sram(program, module, tile_blob)? };

        let mut alias: Vec<InstrIndex> = Vec::with_capacity(module.body.len());
        let mut gates: Vec<Option<Gate>> = Vec::with_capacity(module.body.len());
        for (handle, instr) in module.body.iter() {
            let index = handle.index() as InstrIndex;
            let site = site_of(program, index);
            match &instr.op {
                Op::ExpertDispatch { x, expert, .. } => {
                    alias.push(alias[x.index()]);
                    let Work::Dispatch { routing } = program.instrs[index as usize].work else {
                        return Err(ExecError::Malformed { site, problem: "its work is not Dispatch".into() });
                    };
                    gates.push(Some(Gate { route: routing, expert: *expert }));
                }
                Op::ExpertCombine { .. } => {
                    alias.push(index);
                    gates.push(None);
                }
                op => {
                    alias.push(index);
                    gates.push(op.operands().iter().find_map(|o| gates[o.index()]));
                }
            }
        }

        let mut receivers: HashMap<(InstrIndex, Pe), Vec<RouteId>> = HashMap::new();
        for placement in &program.instrs {
            let site = site_of(program, placement.instr);
            for &id in &placement.operand_routes {
                let route = route_of(program, &site, id)?;
                for &pe in &route.destinations {
                    receivers.entry((placement.instr, pe)).or_default().push(id);
                }
            }
        }

        let mut attention_collects: HashMap<InstrIndex, Vec<RouteId>> = HashMap::new();
        for route in &program.routes {
            let is_attention = program.instrs.get(route.instr as usize).is_some_and(|p| p.op == "attention");
            if let (true, RouteKind::Collect { .. }) = (is_attention, &route.kind) {
                attention_collects.entry(route.instr).or_default().push(route.id);
            }
        }
        for routes in attention_collects.values_mut() {
            routes.sort_by_key(|&id| match &program.routes[id as usize].kind {
                RouteKind::Collect { elements } => elements.start,
                _ => 0,
            });
        }

        let rope_frequencies = module
            .body
            .iter()
            .map(|(_, instr)| match &instr.op {
                Op::Rope { head_dim, rope, .. } => Some(kernels::rope_frequencies(*head_dim as usize, rope)),
                _ => None,
            })
            .collect();
        let instr_pes = program.instrs.iter().map(compute_pes).collect();
        let destinations = program
            .routes
            .iter()
            .map(|r| {
                let mut d = r.destinations.clone();
                d.sort_unstable();
                d
            })
            .collect();
        let costs = timing::CostModel::new(program)?;
        Ok(Executor {
            program,
            module,
            options,
            runs,
            sram,
            receivers,
            alias,
            gates,
            instr_pes,
            attention_collects,
            rope_frequencies,
            kv: HashMap::new(),
            destinations,
            costs,
            position: 0,
            history: Vec::new(),
            last_timing: None,
            last_values: None,
        })
    }

    pub fn program(&self) -> &WaferProgram {
        self.program
    }

    pub fn module(&self) -> &Module {
        self.module
    }

    /// Positions fed so far.
    pub fn position(&self) -> u32 {
        self.position
    }

    /// Forgets every position (empties the KV caches and the timing history).
    pub fn reset(&mut self) {
        self.position = 0;
        self.kv.clear();
        self.history.clear();
        self.last_timing = None;
        self.last_values = None;
    }

    /// Every instruction's value after the last step, indexed by value, when
    /// [`ExecOptions::record_values`] is set (`expert_dispatch` shows the `x` it forwards).
    pub fn last_values(&self) -> Option<&[InstrValue]> {
        self.last_values.as_deref()
    }

    /// The instructions in the order the schedule runs them.
    pub fn schedule_order(&self) -> Vec<InstrIndex> {
        self.runs.iter().map(|(instr, _)| *instr).collect()
    }

    /// The bytes of weight region `region` of the `pe_index`-th PE image, as loaded into its SRAM.
    pub(crate) fn region_bytes(&self, pe_index: usize, region: usize) -> Option<&[u8]> {
        let found = self.program.pes.get(pe_index)?.regions.get(region)?;
        let RegionKind::Weight { blob, .. } = &found.kind else { return None };
        self.sram.get(pe_index)?.get(found.offset as usize..)?.get(..(blob.end - blob.start) as usize)
    }

    /// Feeds `token` at the next position: runs the schedule once, returns the logits and the
    /// step's modeled timing. On an error the position does not advance.
    pub fn step(&mut self, token: u32) -> Result<StepResult, ExecError> {
        if self.position >= self.program.max_context {
            return Err(ExecError::ContextFull { position: self.position, max_context: self.program.max_context });
        }
        // A failed step may have appended to a KV block; the next step at this position
        // overwrites that slot (appends truncate to the position first), so nothing to undo.
        let result = self.run_step(token)?;
        self.position += 1;
        self.history.push(result.timing.cycles);
        self.last_timing = Some(result.timing.clone());
        Ok(result)
    }

    fn run_step(&mut self, token: u32) -> Result<StepResult, ExecError> {
        let mut state = StepState {
            held: vec![Held::Pending; self.module.body.len()],
            messages: HashMap::new(),
            token,
            timeline: timing::Timeline::new(self.program),
        };
        for run_index in 0..self.runs.len() {
            let (instr, steps) = self.runs[run_index].clone();
            let mut run = InstrRun::new(self.program, instr, steps);
            let open = self.gate_open(&state, &mut run, instr)?;
            if open {
                self.execute(&mut state, &mut run)?;
            } else {
                state.held[instr as usize] = Held::Absent;
            }
            let ready = self.ready_cycle(&state, instr);
            state.timeline.finish_instr(
                self.program,
                &self.costs,
                &mut run,
                open,
                ready,
                &self.instr_pes[instr as usize],
            );
        }
        let logits = self.output_logits(&state)?;
        if self.options.record_values {
            self.last_values = Some(self.collect_values(&state));
        }
        let timing = state.timeline.into_step_timing(self.position);
        Ok(StepResult { logits, timing })
    }

    /// The modeled timing report over the steps run since the last reset, for a prompt of
    /// `prompt_tokens` tokens (see [`timing`] for the model). `None` before the first step.
    pub fn timing_report(&self, prompt_tokens: usize) -> Option<TimingReport> {
        let last = self.last_timing.as_ref()?;
        Some(timing::report(self.program, &self.history, last, prompt_tokens))
    }

    /// The cycle at which all of `instr`'s operands (and, for an expert, the routing) are ready.
    fn ready_cycle(&self, state: &StepState, instr: InstrIndex) -> u64 {
        let op = &self.module.body[waferc_ir::Handle::new(instr as usize)].op;
        op.operands().iter().map(|o| self.done_cycle(state, o.index() as InstrIndex)).max().unwrap_or(0)
    }

    /// When `value` is available: its instruction's end (`expert_dispatch`: its inputs' ends).
    fn done_cycle(&self, state: &StepState, value: InstrIndex) -> u64 {
        match &self.module.body[waferc_ir::Handle::new(value as usize)].op {
            Op::ExpertDispatch { x, routing, .. } => self
                .done_cycle(state, x.index() as InstrIndex)
                .max(self.done_cycle(state, routing.index() as InstrIndex)),
            _ => state.timeline.instr_end(value),
        }
    }

    fn output_logits(&self, state: &StepState) -> Result<Option<Vec<f32>>, ExecError> {
        let output = self.module.output.ok_or(ExecError::Schedule { problem: "the module has no output".into() })?;
        let site = site_of(self.program, output.index() as InstrIndex);
        match &state.held[output.index()] {
            Held::Segments(segments) if !self.options.timing_only => {
                Ok(Some(segments.iter().flat_map(|d| d.values().iter().copied()).collect()))
            }
            Held::Segments(_) => Ok(None),
            Held::Absent => Err(ExecError::Malformed { site, problem: "the output is absent".into() }),
            Held::Pending | Held::Routing(_) => {
                Err(ExecError::Malformed { site, problem: "the schedule never computes the output".into() })
            }
        }
    }

    fn collect_values(&self, state: &StepState) -> Vec<InstrValue> {
        let value_of = |held: &Held| match held {
            Held::Segments(segments) => InstrValue::Tensor(segments.iter().flat_map(|d| d.values().to_vec()).collect()),
            Held::Routing(r) => InstrValue::Routing(r.clone()),
            Held::Pending | Held::Absent => InstrValue::Absent,
        };
        (0..self.module.body.len())
            .map(|i| match &self.module.body[waferc_ir::Handle::new(i)].op {
                Op::ExpertDispatch { routing, expert, .. } => {
                    let chosen =
                        matches!(&state.held[routing.index()], Held::Routing(r) if r.weight_of(*expert).is_some());
                    if chosen {
                        value_of(&state.held[self.alias[i] as usize])
                    } else {
                        InstrValue::Absent
                    }
                }
                _ => value_of(&state.held[i]),
            })
            .collect()
    }

    // ---------------------------------------------------------------------------------------
    // Messages

    fn route(&self, run: &InstrRun, id: RouteId) -> Result<&'p Route, ExecError> {
        route_of(self.program, &run.site, id)
    }

    /// `sender` sends `payload` on route `id` in the current phase.
    fn send(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        id: RouteId,
        sender: Pe,
        payload: Payload,
    ) -> Result<(), ExecError> {
        let route = self.route(run, id)?;
        if !run.current_lists(id) {
            return Err(ExecError::RouteNotInStep { site: run.site.clone(), route: id, phase: run.phase, pe: sender });
        }
        if !route.sources.contains(&sender) {
            return Err(ExecError::NotASource { site: run.site.clone(), route: id, pe: sender });
        }
        if state.messages.insert((id, sender), payload).is_some() {
            return Err(ExecError::DuplicateMessage { site: run.site.clone(), route: id, sender });
        }
        run.sent(id);
        Ok(())
    }

    /// The message `sender` sent on route `id`, as read by `receiver`, which must be one of the
    /// route's destinations.
    fn receive<'s>(
        &self,
        state: &'s StepState,
        run: &InstrRun,
        id: RouteId,
        sender: Pe,
        receiver: Pe,
    ) -> Result<&'s Payload, ExecError> {
        self.route(run, id)?;
        if self.destinations[id as usize].binary_search(&receiver).is_err() {
            return Err(ExecError::NotADestination { site: run.site.clone(), route: id, pe: receiver });
        }
        self.message(state, run, id, sender, receiver)
    }

    fn message<'s>(
        &self,
        state: &'s StepState,
        run: &InstrRun,
        id: RouteId,
        sender: Pe,
        receiver: Pe,
    ) -> Result<&'s Payload, ExecError> {
        state.messages.get(&(id, sender)).ok_or_else(|| ExecError::MissingMessage {
            site: run.site.clone(),
            route: id,
            sender,
            pe: receiver,
        })
    }

    /// A data message of exactly `expected` values.
    fn receive_data(
        &self,
        state: &StepState,
        run: &InstrRun,
        id: RouteId,
        sender: Pe,
        receiver: Pe,
        expected: usize,
    ) -> Result<Data, ExecError> {
        let payload = self.receive(state, run, id, sender, receiver)?;
        data_of(run, id, sender, receiver, payload, expected)
    }

    /// Whether the expert `instr` belongs to was chosen, as every PE of the instruction learns
    /// from the router's `Routing` route (always true outside experts).
    fn gate_open(&self, state: &StepState, run: &mut InstrRun, instr: InstrIndex) -> Result<bool, ExecError> {
        let Some(gate) = self.gates[instr as usize] else { return Ok(true) };
        let route = self.route(run, gate.route)?;
        let sender = *route.sources.first().ok_or_else(|| ExecError::Malformed {
            site: run.site.clone(),
            problem: format!("routing route {} has no source", gate.route),
        })?;
        let mut chosen = None;
        for &pe in &self.instr_pes[instr as usize] {
            let Payload::Routing(routing) = self.receive(state, run, gate.route, sender, pe)? else {
                return Err(ExecError::RouteKind {
                    site: run.site.clone(),
                    route: gate.route,
                    expected: "a routing decision",
                    found: "a data message".into(),
                });
            };
            chosen = Some(routing.weight_of(gate.expert).is_some());
        }
        Ok(chosen.unwrap_or(false))
    }

    /// Elements `elements` of `value` as PE `pe` sees them while computing `consumer`: from its
    /// own result segments of the value, or from the operand routes of `consumer` reaching it.
    fn operand(
        &self,
        state: &StepState,
        run: &InstrRun,
        pe: Pe,
        value: InstrIndex,
        elements: Range<u64>,
    ) -> Result<Data, ExecError> {
        let source = self.alias[value as usize];
        let mut pieces: Vec<(Range<u64>, Data)> = Vec::new();
        if let (Held::Segments(held), ResultLayout::Vector(layout)) =
            (&state.held[source as usize], &self.program.instrs[source as usize].result)
        {
            for (segment, data) in layout.segments.iter().zip(held) {
                if segment.pe == pe {
                    if let Some(overlap) = intersect(&segment.elements, &elements) {
                        pieces.push((overlap.clone(), data.slice(relative(&overlap, segment.elements.start))));
                    }
                }
            }
        }
        for &id in self.receivers.get(&(run.instr, pe)).map(Vec::as_slice).unwrap_or(&[]) {
            let route = self.route(run, id)?;
            let RouteKind::Operand { value: carried, elements: carried_elements } = &route.kind else {
                return Err(route_kind_error(run, route, "an operand route"));
            };
            if *carried != source {
                continue;
            }
            let Some(overlap) = intersect(carried_elements, &elements) else { continue };
            let sender = single_source(run, route)?;
            let data = data_of(
                run,
                id,
                sender,
                pe,
                self.message(state, run, id, sender, pe)?,
                span(carried_elements) as usize,
            )?;
            pieces.push((overlap.clone(), data.slice(relative(&overlap, carried_elements.start))));
        }
        pieces.sort_by_key(|(range, _)| range.start);
        let mut covered = elements.start;
        let mut out = if self.options.timing_only { None } else { Some(Vec::with_capacity(span(&elements) as usize)) };
        for (range, data) in &pieces {
            if range.end <= covered {
                continue;
            }
            if range.start > covered {
                break;
            }
            if let Some(out) = out.as_mut() {
                out.extend_from_slice(&data.values()[(covered - range.start) as usize..]);
            }
            covered = range.end;
        }
        if covered < elements.end {
            let gap = covered..elements.end;
            if matches!(state.held[source as usize], Held::Pending) {
                return Err(ExecError::MissingOperand {
                    site: run.site.clone(),
                    pe,
                    value: source,
                    elements: gap,
                    problem: format!("%{source} has not been computed yet: the schedule runs it later"),
                });
            }
            // Name the route that carries the missing elements but does not reach this PE.
            for &id in &self.program.instrs[run.instr as usize].operand_routes {
                let route = self.route(run, id)?;
                if let RouteKind::Operand { value: carried, elements: carried_elements } = &route.kind {
                    if *carried == source && intersect(carried_elements, &gap).is_some() {
                        return Err(ExecError::NotADestination { site: run.site.clone(), route: id, pe });
                    }
                }
            }
            return Err(ExecError::MissingOperand {
                site: run.site.clone(),
                pe,
                value: source,
                elements: gap,
                problem: "no operand route of the instruction brings them to this PE".into(),
            });
        }
        Ok(match out {
            Some(values) => Data::Values(values),
            None => Data::Shape(span(&elements) as usize),
        })
    }

    /// Runs one reduction: `leaves[i]` is the partial held by `route.sources[i]`; partials are
    /// combined along [`reduce_tree`] (receiver's own partial on the left), then sources[0]
    /// forwards the total to the destination if it is elsewhere. Returns the total.
    fn reduce(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        id: RouteId,
        mut leaves: Vec<Data>,
    ) -> Result<(Pe, Data), ExecError> {
        let route = self.route(run, id)?;
        let RouteKind::Reduce { op, elements } = route.kind else {
            return Err(route_kind_error(run, route, "a reduction"));
        };
        if leaves.is_empty() || leaves.len() != route.sources.len() {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!(
                    "reduction route {id} has {} sources for {} partials",
                    route.sources.len(),
                    leaves.len()
                ),
            });
        }
        let destination = single_destination(run, route)?;
        for (receiver, sender) in reduce_tree(leaves.len()) {
            let (from, to) = (route.sources[sender], route.sources[receiver]);
            self.send(state, run, id, from, Payload::Data(leaves[sender].clone()))?;
            let right = data_of(run, id, from, to, self.message(state, run, id, from, to)?, elements as usize)?;
            run.compute(to, self.costs.flops(elements as u64));
            leaves[receiver] = self.combine(op, &leaves[receiver], &right);
        }
        let total = leaves.swap_remove(0);
        let root = route.sources[0];
        if destination == root {
            return Ok((root, total));
        }
        self.send(state, run, id, root, Payload::Data(total))?;
        let total = self.receive_data(state, run, id, root, destination, elements as usize)?;
        Ok((destination, total))
    }

    /// One edge of a reduction tree: `left` (the receiver's subtree) combined with `right`.
    fn combine(&self, op: ReduceOp, left: &Data, right: &Data) -> Data {
        self.compute_data(left.len(), || match op {
            ReduceOp::Sum => kernels::add(left.values(), right.values()),
            // Exact in any order: the maximum rounds nothing.
            ReduceOp::Max => left.values().iter().zip(right.values()).map(|(a, b)| a.max(*b)).collect(),
        })
    }

    /// Runs `compute` unless timing only.
    fn compute_data(&self, len: usize, compute: impl FnOnce() -> Vec<f32>) -> Data {
        if self.options.timing_only {
            Data::Shape(len)
        } else {
            Data::Values(compute())
        }
    }

    /// Sends each result segment along the instruction's deliveries (one per segment).
    fn deliver(&self, state: &mut StepState, run: &mut InstrRun, segments: &[Segment]) -> Result<(), ExecError> {
        run.begin(Phase::Deliver);
        let placement = &self.program.instrs[run.instr as usize];
        if placement.deliveries.is_empty() {
            return Ok(());
        }
        if placement.deliveries.len() != segments.len() {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!("{} deliveries for {} result segments", placement.deliveries.len(), segments.len()),
            });
        }
        let Held::Segments(held) = &state.held[run.instr as usize] else { return Ok(()) };
        let held = held.clone();
        for ((&id, segment), data) in placement.deliveries.iter().zip(segments).zip(held) {
            let route = self.route(run, id)?;
            match &route.kind {
                RouteKind::Operand { value, elements } if *value == run.instr && *elements == segment.elements => {}
                _ => return Err(route_kind_error(run, route, "the delivery of this result segment")),
            }
            self.send(state, run, id, segment.pe, Payload::Data(data))?;
        }
        Ok(())
    }

    /// The receiving side of a `Collect` route into result segment `segment`: one message per
    /// `(sender, elements)` the placement says sends, assembled in element order.
    fn assemble(
        &self,
        state: &StepState,
        run: &InstrRun,
        id: RouteId,
        segment: &Segment,
        mut parts: Vec<(Pe, Range<u64>)>,
    ) -> Result<Data, ExecError> {
        parts.sort_by_key(|(_, r)| r.start);
        let mut covered = segment.elements.start;
        let mut out = Vec::new();
        for (sender, range) in &parts {
            if range.start != covered {
                break;
            }
            let data = self.receive_data(state, run, id, *sender, segment.pe, span(range) as usize)?;
            out.extend_from_slice(data.values());
            covered = range.end;
        }
        if covered != segment.elements.end {
            return Err(ExecError::MissingOperand {
                site: run.site.clone(),
                pe: segment.pe,
                value: run.instr,
                elements: covered..segment.elements.end,
                problem: format!("no source of collect route {id} holds them"),
            });
        }
        Ok(if self.options.timing_only { Data::Shape(span(&segment.elements) as usize) } else { Data::Values(out) })
    }

    // ---------------------------------------------------------------------------------------
    // Weights in SRAM

    /// The bytes of weight region `region` of `pe`'s image, with its description.
    fn weight_region(&self, run: &InstrRun, pe: Pe, region: usize) -> Result<HeldWeight<'_>, ExecError> {
        let (index, image) = pe_image(self.program, pe).ok_or_else(|| ExecError::MalformedOnPe {
            site: run.site.clone(),
            pe,
            problem: "the PE has no SRAM image".into(),
        })?;
        let found = image.regions.get(region).ok_or_else(|| ExecError::MalformedOnPe {
            site: run.site.clone(),
            pe,
            problem: format!("region {region} does not exist ({} regions)", image.regions.len()),
        })?;
        let RegionKind::Weight { weight, rows, cols, blob } = &found.kind else {
            return Err(ExecError::MalformedOnPe {
                site: run.site.clone(),
                pe,
                problem: format!("region {region} is not a weight region"),
            });
        };
        let bytes: &[u8] = match self.sram.get(index) {
            Some(sram) => &sram[found.offset as usize..found.offset as usize + (blob.end - blob.start) as usize],
            None => &[],
        };
        Ok((*weight, rows.clone(), cols.clone(), bytes))
    }

    /// The index of the weight region of `instr` on `pe` holding weight `weight`, row `row`
    /// and elements `cols`.
    fn find_weight_region(
        &self,
        run: &InstrRun,
        pe: Pe,
        weight: u32,
        row: u64,
        cols: &Range<u64>,
    ) -> Result<usize, ExecError> {
        let (_, image) = pe_image(self.program, pe).ok_or_else(|| ExecError::MalformedOnPe {
            site: run.site.clone(),
            pe,
            problem: "the PE has no SRAM image".into(),
        })?;
        image
            .regions
            .iter()
            .position(|r| match &r.kind {
                RegionKind::Weight { weight: w, rows, cols: c, .. } => {
                    r.instr == Some(run.instr)
                        && *w == weight
                        && rows.contains(&row)
                        && c.start <= cols.start
                        && cols.end <= c.end
                }
                _ => false,
            })
            .ok_or_else(|| ExecError::MalformedOnPe {
                site: run.site.clone(),
                pe,
                problem: format!(
                    "no weight region holds row {row}, elements {cols:?} of weight {}",
                    self.weight_name(weight)
                ),
            })
    }

    fn weight_name(&self, weight: u32) -> String {
        self.module
            .weights
            .get(waferc_ir::Handle::new(weight as usize))
            .map_or_else(|| format!("#{weight}"), |w| w.name.clone())
    }

    fn weight_dtype(&self, weight: u32) -> DType {
        self.module.weights[waferc_ir::Handle::new(weight as usize)].ty.dtype
    }

    /// Elements `cols` of row `row` of a weight held in region `region` of `pe`, widened.
    fn widen_from_region(
        &self,
        run: &InstrRun,
        pe: Pe,
        region: usize,
        row: u64,
        cols: Range<u64>,
    ) -> Result<Vec<f32>, ExecError> {
        let (weight, rows, held_cols, bytes) = self.weight_region(run, pe, region)?;
        let view = region_row(self.weight_dtype(weight), bytes, row - rows.start, span(&held_cols))
            .ok_or_else(|| self.region_error(run, pe, region, "its bytes do not match its rows and elements"))?;
        let widened = view.widen();
        Ok(widened[(cols.start - held_cols.start) as usize..(cols.end - held_cols.start) as usize].to_vec())
    }

    fn region_error(&self, run: &InstrRun, pe: Pe, region: usize, problem: &str) -> ExecError {
        match self.weight_region(run, pe, region) {
            Ok((weight, rows, cols, _)) => ExecError::WeightRegion(Box::new(WeightRegionError {
                site: run.site.clone(),
                pe,
                region,
                weight: self.weight_name(weight),
                rows,
                cols,
                problem: problem.to_string(),
            })),
            Err(error) => error,
        }
    }

    // ---------------------------------------------------------------------------------------
    // Instructions

    fn execute(&mut self, state: &mut StepState, run: &mut InstrRun) -> Result<(), ExecError> {
        let instr = run.instr;
        let placement = &self.program.instrs[instr as usize];
        let op = self.module.body[waferc_ir::Handle::new(instr as usize)].op.clone();
        let segments = match &placement.result {
            ResultLayout::Vector(layout) => layout.segments.clone(),
            ResultLayout::Routing { .. } => Vec::new(),
        };
        match (&op, &placement.work) {
            (Op::Embed { table }, Work::Embed { blocks, collects }) => {
                self.embed(state, run, table.index() as u32, blocks, collects, &segments)?
            }
            (Op::MatVec { x, weight, bias }, Work::MatVec(p)) => self.matvec(
                state,
                run,
                x.index() as InstrIndex,
                weight.index() as u32,
                bias.map(|b| b.index() as u32),
                p,
                &segments,
            )?,
            (Op::RmsNorm { x, weight, eps }, Work::RmsNorm(p)) => {
                self.rms_norm(state, run, x.index() as InstrIndex, weight.index() as u32, *eps, p, &segments)?
            }
            (Op::Attention { q, k, v, cache, heads, scale }, Work::Attention(p)) => {
                let spec = &self.module.caches[*cache];
                if p.heads != *heads || p.kv_heads != spec.kv_heads || p.head_dim != spec.head_dim {
                    return Err(ExecError::Malformed {
                        site: run.site.clone(),
                        problem: format!(
                            "placed for {} heads, {} KV heads of {}, but the op has {heads}, {} of {}",
                            p.heads, p.kv_heads, p.head_dim, spec.kv_heads, spec.head_dim
                        ),
                    });
                }
                let operands = [q, k, v].map(|v| v.index() as InstrIndex);
                self.attention(state, run, operands, *scale, p, &segments)?
            }
            (Op::Silu { .. } | Op::Mul { .. } | Op::Add { .. } | Op::Rope { .. }, Work::Elementwise) => {
                self.elementwise(state, run, &op, &segments)?
            }
            (Op::RouterTopK { logits, top_k, normalize }, Work::Router { routing }) => {
                let ResultLayout::Routing { pe } = placement.result else {
                    return Err(ExecError::Malformed {
                        site: run.site.clone(),
                        problem: "a router's result must be a routing".into(),
                    });
                };
                self.router(state, run, logits.index() as InstrIndex, *top_k, *normalize, pe, *routing)?
            }
            // The result aliases `x`; the gate (checked before) decided whether it exists.
            (Op::ExpertDispatch { .. }, Work::Dispatch { .. }) => {}
            (Op::ExpertCombine { routing, experts }, Work::Combine { routing: route, collects }) => {
                self.combine_experts(state, run, routing.index() as InstrIndex, experts, *route, collects, &segments)?
            }
            (_, work) => {
                return Err(ExecError::Malformed {
                    site: run.site.clone(),
                    problem: format!("its placement's work is {}", work_name(work)),
                })
            }
        }
        Ok(())
    }

    fn embed(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        table: u32,
        blocks: &[waferc_ir::wafer::EmbedBlock],
        collects: &[RouteId],
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        let rows = self.module.weights[waferc_ir::Handle::new(table as usize)].ty.shape[0];
        let token = state.token as u64;
        if token >= rows {
            return Err(ExecError::TokenOutOfRange { site: run.site.clone(), token: state.token, rows });
        }
        check_count(run, "collect routes", collects.len(), segments.len())?;
        run.begin(Phase::Gather);
        let mut held = Vec::with_capacity(segments.len());
        for (segment, &id) in segments.iter().zip(collects) {
            let mut parts = Vec::new();
            for block in blocks.iter().filter(|b| b.rows.contains(&token)) {
                let Some(overlap) = intersect(&block.elements, &segment.elements) else { continue };
                let data = if self.options.timing_only {
                    Data::Shape(span(&overlap) as usize)
                } else {
                    let region = self.find_weight_region(run, block.pe, table, token, &block.elements)?;
                    Data::Values(self.widen_from_region(run, block.pe, region, token, overlap.clone())?)
                };
                run.compute(block.pe, self.costs.flops(span(&overlap)));
                self.send(state, run, id, block.pe, Payload::Data(data))?;
                parts.push((block.pe, overlap));
            }
            held.push(self.assemble(state, run, id, segment, parts)?);
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }

    #[allow(clippy::too_many_arguments)]
    fn matvec(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        x: InstrIndex,
        weight: u32,
        bias: Option<u32>,
        p: &MatVecPlacement,
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        if p.row_blocks == 0 || p.col_blocks == 0 {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!("{} x {} tile blocks", p.row_blocks, p.col_blocks),
            });
        }
        let tile_count = p.row_blocks as usize * p.col_blocks as usize;
        check_count(run, "tiles", p.tiles.len(), tile_count)?;
        check_count(run, "collect routes", p.collects.len(), segments.len())?;
        let dtype = self.weight_dtype(weight);

        run.begin(Phase::Compute);
        let mut partials: Vec<Data> = Vec::with_capacity(tile_count);
        for tile in &p.tiles {
            let cols = (tile.chunks.start * BLOCK as u64).min(p.cols)..(tile.chunks.end * BLOCK as u64).min(p.cols);
            let x_part = self.operand(state, run, tile.pe, x, cols.clone())?;
            let rows = tile.rows.end - tile.rows.start;
            let partial = if self.options.timing_only {
                Data::Shape(rows as usize)
            } else {
                let region = tile.region as usize;
                let (held_weight, held_rows, held_cols, bytes) = self.weight_region(run, tile.pe, region)?;
                if held_weight != weight || held_rows != tile.rows || held_cols != cols {
                    return Err(self.region_error(
                        run,
                        tile.pe,
                        region,
                        &format!(
                            "the tile needs weight {}, rows {:?}, elements {cols:?}",
                            self.weight_name(weight),
                            tile.rows
                        ),
                    ));
                }
                let mut out = Vec::with_capacity(rows as usize);
                for row in 0..rows {
                    let view = region_row(dtype, bytes, row, span(&cols))
                        .ok_or_else(|| self.region_error(run, tile.pe, region, "its bytes do not match its shape"))?;
                    out.push(kernels::dot(x_part.values(), view));
                }
                Data::Values(out)
            };
            run.compute(tile.pe, self.costs.fma(rows * span(&cols)));
            partials.push(partial);
        }

        // Where each row block's running total is: its first tile until a reduction moves it.
        let mut total_at: Vec<usize> = (0..p.row_blocks as usize).map(|r| r * p.col_blocks as usize).collect();
        run.begin(Phase::Reduce);
        for &id in &p.reductions {
            let route = self.route(run, id)?;
            let row_block = reduction_row_block(run, route, p)?;
            let site = run.site.clone();
            let tile_on = |pe: Pe| -> Result<usize, ExecError> {
                tile_of_row_block(p, row_block, pe).ok_or_else(|| ExecError::MalformedOnPe {
                    site: site.clone(),
                    pe,
                    problem: format!("reduction route {id} reaches it, but it holds no tile of row block {row_block}"),
                })
            };
            let leaf_tiles = route.sources.iter().map(|&pe| tile_on(pe)).collect::<Result<Vec<_>, _>>()?;
            let leaves = leaf_tiles.iter().map(|&t| partials[t].clone()).collect();
            let (at, total) = self.reduce(state, run, id, leaves)?;
            let tile = tile_on(at)?;
            partials[tile] = total;
            total_at[row_block] = tile;
        }

        run.begin(Phase::Broadcast);
        for &id in &p.broadcasts {
            let route = self.route(run, id)?;
            let RouteKind::Statistic { elements } = route.kind else {
                return Err(route_kind_error(run, route, "a broadcast of reduced rows"));
            };
            let root = single_source(run, route)?;
            let row_block =
                total_at.iter().position(|&t| p.tiles[t].pe == root).ok_or_else(|| ExecError::MalformedOnPe {
                    site: run.site.clone(),
                    pe: root,
                    problem: format!("broadcast route {id} starts here, but no row block's total is here"),
                })?;
            self.send(state, run, id, root, Payload::Data(partials[total_at[row_block]].clone()))?;
            for &pe in &route.destinations {
                self.receive_data(state, run, id, root, pe, elements as usize)?;
            }
        }

        run.begin(Phase::Collect);
        let mut held = Vec::with_capacity(segments.len());
        for (segment, &id) in segments.iter().zip(&p.collects) {
            let mut parts = Vec::new();
            for (row_block, &tile_index) in total_at.iter().enumerate() {
                let tile = &p.tiles[tile_index];
                let Some(overlap) = intersect(&p.tiles[row_block * p.col_blocks as usize].rows, &segment.elements)
                else {
                    continue;
                };
                let rows = relative(&overlap, tile.rows.start);
                let total = partials[tile_index].slice(rows);
                let data = match bias {
                    Some(bias) if !self.options.timing_only => {
                        let region = self.find_weight_region(run, tile.pe, bias, 0, &overlap)?;
                        let bias_part = self.widen_from_region(run, tile.pe, region, 0, overlap.clone())?;
                        Data::Values(kernels::add(total.values(), &bias_part))
                    }
                    _ => total,
                };
                if bias.is_some() {
                    run.compute(tile.pe, self.costs.flops(span(&overlap)));
                }
                self.send(state, run, id, tile.pe, Payload::Data(data))?;
                parts.push((tile.pe, overlap));
            }
            held.push(self.assemble(state, run, id, segment, parts)?);
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }

    fn elementwise(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        op: &Op,
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        run.begin(Phase::Compute);
        let angles = self.rope_frequencies[run.instr as usize]
            .as_ref()
            .map(|freqs| RopeAngles::new(freqs, self.position as usize));
        let mut held = Vec::with_capacity(segments.len());
        for segment in segments {
            let n = span(&segment.elements) as usize;
            let (data, flops) = match op {
                Op::Silu { x } => {
                    let x = self.operand(state, run, segment.pe, x.index() as InstrIndex, segment.elements.clone())?;
                    (self.compute_data(n, || kernels::silu(x.values())), timing::SILU_FLOPS)
                }
                Op::Mul { a, b } | Op::Add { a, b } => {
                    let a = self.operand(state, run, segment.pe, a.index() as InstrIndex, segment.elements.clone())?;
                    let b = self.operand(state, run, segment.pe, b.index() as InstrIndex, segment.elements.clone())?;
                    let data = self.compute_data(n, || match op {
                        Op::Mul { .. } => kernels::mul(a.values(), b.values()),
                        _ => kernels::add(a.values(), b.values()),
                    });
                    (data, 1)
                }
                Op::Rope { x, head_dim, .. } => {
                    // A head's halves rotate together: compute the whole heads the segment touches.
                    let dim = *head_dim as u64;
                    let heads = segment.elements.start / dim * dim..segment.elements.end.div_ceil(dim) * dim;
                    let x = self.operand(state, run, segment.pe, x.index() as InstrIndex, heads.clone())?;
                    let data = self.compute_data(n, || {
                        let angles = angles.as_ref().expect("rope instructions have frequencies");
                        let mut out = vec![0.0; span(&heads) as usize];
                        kernels::rope(x.values(), angles, &mut out);
                        out[relative(&segment.elements, heads.start)].to_vec()
                    });
                    (data, timing::ROPE_FLOPS)
                }
                _ => unreachable!("elementwise() is only called for silu, mul, add and rope"),
            };
            run.compute(segment.pe, self.costs.flops(n as u64 * flops));
            held.push(data);
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        x: InstrIndex,
        weight: u32,
        eps: f32,
        p: &NormPlacement,
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        let g = p.group_len;
        let weight_len = self.module.weights[waferc_ir::Handle::new(weight as usize)].ty.elements();
        if g == 0 || g != weight_len {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!("group length {g}, but the norm weight has {weight_len} elements"),
            });
        }
        run.begin(Phase::Compute);
        // Per segment: its x, and per group it touches (group, elements, partial sum of squares).
        let mut xs = Vec::with_capacity(segments.len());
        let mut parts: Vec<Vec<(u64, Range<u64>, Data)>> = Vec::with_capacity(segments.len());
        for segment in segments {
            let x_seg = self.operand(state, run, segment.pe, x, segment.elements.clone())?;
            let mut seg_parts = Vec::new();
            for group in segment.elements.start / g..segment.elements.end.div_ceil(g) {
                let range = intersect(&(group * g..(group + 1) * g), &segment.elements).expect("the group overlaps");
                let part = x_seg.slice(relative(&range, segment.elements.start));
                let partial = self.compute_data(1, || vec![kernels::sum_squares(part.values())]);
                run.compute(segment.pe, self.costs.fma(span(&range)));
                seg_parts.push((group, range, partial));
            }
            xs.push(x_seg);
            parts.push(seg_parts);
        }
        let segments_of = |group: u64| -> Vec<usize> {
            (0..segments.len()).filter(|&s| parts[s].iter().any(|(gr, _, _)| *gr == group)).collect()
        };

        // `1/rms` per (segment, group), from the local sum or the group's reduce + broadcast.
        let mut inverse: HashMap<(usize, u64), Data> = HashMap::new();
        run.begin(Phase::Reduce);
        let mut totals: HashMap<u64, (Pe, Data)> = HashMap::new();
        for routes in &p.group_routes {
            let members = segments_of(routes.group);
            let route = self.route(run, routes.reduce)?;
            for (&s, &source) in members.iter().zip(&route.sources) {
                if segments[s].pe != source {
                    return Err(ExecError::MalformedOnPe {
                        site: run.site.clone(),
                        pe: source,
                        problem: format!(
                            "reduction route {} lists it as a source of group {}, which is on {}",
                            routes.reduce, routes.group, segments[s].pe
                        ),
                    });
                }
            }
            let leaves = members
                .iter()
                .map(|&s| parts[s].iter().find(|(gr, _, _)| *gr == routes.group).expect("member").2.clone())
                .collect();
            totals.insert(routes.group, self.reduce(state, run, routes.reduce, leaves)?);
        }
        run.begin(Phase::Broadcast);
        for routes in &p.group_routes {
            let (root, total) = totals.remove(&routes.group).ok_or_else(|| ExecError::Malformed {
                site: run.site.clone(),
                problem: format!("group {} has more than one pair of reduce and broadcast routes", routes.group),
            })?;
            let r = self.compute_data(1, || vec![kernels::rms_inverse(total.values()[0], g as usize, eps)]);
            run.compute(root, self.costs.flops(timing::RMS_INVERSE_FLOPS));
            self.send(state, run, routes.broadcast, root, Payload::Data(r.clone()))?;
            for s in segments_of(routes.group) {
                // The root computed the statistic; the other segments receive it.
                let r = match segments[s].pe == root {
                    true => r.clone(),
                    false => self.receive_data(state, run, routes.broadcast, root, segments[s].pe, 1)?,
                };
                inverse.insert((s, routes.group), r);
            }
        }

        run.begin(Phase::Finish);
        let mut held = Vec::with_capacity(segments.len());
        for (s, segment) in segments.iter().enumerate() {
            let mut out = Vec::with_capacity(span(&segment.elements) as usize);
            for (group, range, partial) in &parts[s] {
                let r = match inverse.get(&(s, *group)) {
                    Some(r) => r.clone(),
                    None if segments_of(*group).len() == 1 => {
                        run.compute(segment.pe, self.costs.flops(timing::RMS_INVERSE_FLOPS));
                        self.compute_data(1, || vec![kernels::rms_inverse(partial.values()[0], g as usize, eps)])
                    }
                    None => {
                        return Err(ExecError::MalformedOnPe {
                            site: run.site.clone(),
                            pe: segment.pe,
                            problem: format!(
                                "group {group} spans several segments but has no reduce and broadcast routes"
                            ),
                        })
                    }
                };
                let cols = range.start - group * g..range.end - group * g;
                run.compute(segment.pe, self.costs.flops(2 * span(range)));
                if self.options.timing_only {
                    continue;
                }
                let region = self.find_weight_region(run, segment.pe, weight, 0, &cols)?;
                let scale = self.widen_from_region(run, segment.pe, region, 0, cols)?;
                let x_part = &xs[s].values()[relative(range, segment.elements.start)];
                let mut y = vec![0.0; x_part.len()];
                kernels::rms_scale(x_part, r.values()[0], &scale, &mut y);
                out.extend_from_slice(&y);
            }
            held.push(if self.options.timing_only {
                Data::Shape(span(&segment.elements) as usize)
            } else {
                Data::Values(out)
            });
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }

    fn attention(
        &mut self,
        state: &mut StepState,
        run: &mut InstrRun,
        [q, k, v]: [InstrIndex; 3],
        scale: f32,
        p: &AttentionPlacement,
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        if p.kv_heads == 0 || p.heads % p.kv_heads != 0 {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!("{} heads do not share {} KV heads evenly", p.heads, p.kv_heads),
            });
        }
        let group = (p.heads / p.kv_heads) as usize;
        let dim = p.head_dim as usize;
        let position = self.position;
        // Per KV head placement, per block: its query heads and scores, then exps, then outputs.
        struct BlockWork {
            pe: Pe,
            /// Valid positions of the block this step.
            valid: Range<u32>,
            scores: Vec<Vec<f32>>,
            local: Data,
        }
        let mut heads_out: Vec<(Pe, Data)> = Vec::with_capacity(p.kv_heads_placed.len());

        for (h_index, kh) in p.kv_heads_placed.iter().enumerate() {
            let h = kh.kv_head as u64;
            let q_range = h * (group * dim) as u64..(h + 1) * (group * dim) as u64;
            let kv_range = h * dim as u64..(h + 1) * dim as u64;

            run.begin(Phase::Compute);
            let mut blocks = Vec::with_capacity(kh.blocks.len());
            for (b_index, block) in kh.blocks.iter().enumerate() {
                let region =
                    pe_image(self.program, block.pe).and_then(|(_, image)| image.regions.get(block.region as usize));
                match region.map(|r| &r.kind) {
                    Some(RegionKind::KvCache { kv_head, positions })
                        if *kv_head == kh.kv_head && *positions == block.positions => {}
                    _ => {
                        return Err(ExecError::MalformedOnPe {
                            site: run.site.clone(),
                            pe: block.pe,
                            problem: format!(
                                "region {} is not the KV cache of KV head {} positions {:?}",
                                block.region, kh.kv_head, block.positions
                            ),
                        })
                    }
                }
                let q_block = self.operand(state, run, block.pe, q, q_range.clone())?;
                // Only the block whose positions hold this step's position appends.
                if block.positions.contains(&position) {
                    let k_new = self.operand(state, run, block.pe, k, kv_range.clone())?;
                    let v_new = self.operand(state, run, block.pe, v, kv_range.clone())?;
                    let cache = self.kv.entry((run.instr, h_index, b_index)).or_default();
                    let slot = (position - block.positions.start) as usize;
                    if !self.options.timing_only {
                        cache.keys.truncate(slot * dim);
                        cache.values.truncate(slot * dim);
                        cache.keys.extend_from_slice(k_new.values());
                        cache.values.extend_from_slice(v_new.values());
                    }
                    run.compute(block.pe, self.costs.flops(2 * dim as u64));
                }
                let valid = block.positions.start..block.positions.end.min(position + 1);
                let valid = valid.start..valid.end.max(valid.start);
                let n = valid.len();
                let scores: Vec<Vec<f32>> = if self.options.timing_only {
                    Vec::new()
                } else {
                    let empty = KvBlockState::default();
                    let cache = self.kv.get(&(run.instr, h_index, b_index)).unwrap_or(&empty);
                    (0..group)
                        .map(|head| {
                            let q_head = &q_block.values()[head * dim..(head + 1) * dim];
                            (0..n)
                                .map(|t| kernels::attention_score(q_head, &cache.keys[t * dim..(t + 1) * dim], scale))
                                .collect()
                        })
                        .collect()
                };
                let local = self.compute_data(group, || {
                    scores.iter().map(|s| s.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect()
                });
                run.compute(block.pe, self.costs.fma((n * group * dim) as u64) + self.costs.flops((n * group) as u64));
                blocks.push(BlockWork { pe: block.pe, valid, scores, local });
            }

            // The maximum, then the exponentials and their sum, then the weighted values: each a
            // tree reduction over the blocks (none with a single block) and, for the first two,
            // a broadcast of the result back to every block.
            let statistic = |state: &mut StepState,
                             run: &mut InstrRun,
                             phase: Phase,
                             reduce: Option<RouteId>,
                             broadcast: Option<RouteId>,
                             blocks: &[BlockWork]|
             -> Result<Vec<Data>, ExecError> {
                run.begin(phase);
                let leaves: Vec<Data> = blocks.iter().map(|b| b.local.clone()).collect();
                match (reduce, broadcast) {
                    (None, None) if blocks.len() == 1 => Ok(leaves),
                    (Some(reduce), Some(broadcast)) => {
                        let (root, total) = self.reduce(state, run, reduce, leaves)?;
                        self.send(state, run, broadcast, root, Payload::Data(total.clone()))?;
                        blocks
                            .iter()
                            .map(|b| match b.pe == root {
                                true => Ok(total.clone()),
                                false => self.receive_data(state, run, broadcast, root, b.pe, group),
                            })
                            .collect()
                    }
                    _ => Err(ExecError::Malformed {
                        site: run.site.clone(),
                        problem: format!(
                            "KV head {} has {} blocks but its {phase:?} routes are {reduce:?} and {broadcast:?}",
                            kh.kv_head,
                            blocks.len()
                        ),
                    }),
                }
            };
            let maxima = statistic(state, run, Phase::AttentionMax, kh.max_reduce, kh.max_broadcast, &blocks)?;

            let mut numerators: Vec<Vec<Vec<f32>>> = Vec::with_capacity(blocks.len());
            for (block, max) in blocks.iter_mut().zip(&maxima) {
                let e: Vec<Vec<f32>> = if self.options.timing_only {
                    Vec::new()
                } else {
                    block.scores.iter().zip(max.values()).map(|(s, &m)| kernels::softmax_numerators(s, m)).collect()
                };
                block.local = self.compute_data(group, || e.iter().map(|e| kernels::tree_sum(e)).collect());
                numerators.push(e);
            }
            // Charge the exponentials and the local sums to the AttentionSum phase.
            let sums = {
                run.begin(Phase::AttentionSum);
                for block in &blocks {
                    let n = (block.valid.len() * group) as u64;
                    run.compute(block.pe, self.costs.flops(n * timing::EXP_FLOPS + n));
                }
                statistic(state, run, Phase::AttentionSum, kh.sum_reduce, kh.sum_broadcast, &blocks)?
            };

            run.begin(Phase::AttentionOut);
            let mut outs = Vec::with_capacity(blocks.len());
            for (b_index, (block, (e, z))) in blocks.iter().zip(numerators.into_iter().zip(&sums)).enumerate() {
                let n = block.valid.len();
                let out = self.compute_data(group * dim, || {
                    let empty = KvBlockState::default();
                    let cache = self.kv.get(&(run.instr, h_index, b_index)).unwrap_or(&empty);
                    let mut out = vec![0.0; group * dim];
                    for (head, (e, &z)) in e.into_iter().zip(z.values()).enumerate() {
                        let p = kernels::softmax_normalize(e, z);
                        let mut sum = VectorTreeSum::new(dim);
                        for (t, &weight) in p.iter().enumerate() {
                            sum.push_scaled(weight, &cache.values[t * dim..(t + 1) * dim]);
                        }
                        sum.finish(&mut out[head * dim..(head + 1) * dim]);
                    }
                    out
                });
                run.compute(
                    block.pe,
                    self.costs.flops((n * group) as u64 * timing::DIVIDE_FLOPS)
                        + self.costs.fma((n * group * dim) as u64),
                );
                outs.push(out);
            }
            let (root, total) = match kh.out_reduce {
                Some(id) => self.reduce(state, run, id, outs)?,
                None if blocks.len() == 1 => (blocks[0].pe, outs.swap_remove(0)),
                None => {
                    return Err(ExecError::Malformed {
                        site: run.site.clone(),
                        problem: format!("KV head {} has {} blocks but no output reduction", kh.kv_head, blocks.len()),
                    })
                }
            };
            heads_out.push((root, total));
        }

        run.begin(Phase::Collect);
        let collects = self.attention_collects.get(&run.instr).cloned().unwrap_or_default();
        check_count(run, "collect routes", collects.len(), segments.len())?;
        let mut held = Vec::with_capacity(segments.len());
        for (segment, &id) in segments.iter().zip(&collects) {
            let mut parts = Vec::new();
            for (kh, (root, total)) in p.kv_heads_placed.iter().zip(&heads_out) {
                let first = kh.kv_head as u64 * (group * dim) as u64;
                let Some(overlap) = intersect(&(first..first + (group * dim) as u64), &segment.elements) else {
                    continue;
                };
                self.send(state, run, id, *root, Payload::Data(total.slice(relative(&overlap, first))))?;
                parts.push((*root, overlap));
            }
            held.push(self.assemble(state, run, id, segment, parts)?);
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }

    #[allow(clippy::too_many_arguments)]
    fn router(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        logits: InstrIndex,
        top_k: u32,
        normalize: bool,
        pe: Pe,
        route: RouteId,
    ) -> Result<(), ExecError> {
        let experts = match &self.module.body[waferc_ir::Handle::new(logits as usize)].ty {
            ValueType::Tensor(t) => t.elements(),
            ValueType::Routing { .. } => 0,
        };
        run.begin(Phase::Compute);
        let x = self.operand(state, run, pe, logits, 0..experts)?;
        let routing = if self.options.timing_only {
            // No values: the first `top_k` experts, equally weighted (timing does not depend on which).
            let weight = 1.0 / top_k as f32;
            Routing { experts: experts as usize, chosen: (0..top_k).map(|e| (e, weight)).collect() }
        } else {
            if top_k == 0 || top_k as u64 > experts {
                return Err(ExecError::Malformed {
                    site: run.site.clone(),
                    problem: format!("top {top_k} of {experts} experts"),
                });
            }
            kernels::router_topk(x.values(), top_k as usize, normalize)
        };
        run.compute(pe, self.costs.flops(experts * (timing::EXP_FLOPS + timing::DIVIDE_FLOPS + 1)));
        state.held[run.instr as usize] = Held::Routing(routing.clone());
        run.begin(Phase::Deliver);
        self.send(state, run, route, pe, Payload::Routing(routing))
    }

    #[allow(clippy::too_many_arguments)]
    fn combine_experts(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        routing_value: InstrIndex,
        experts: &[waferc_ir::Value],
        routing_route: RouteId,
        collects: &[RouteId],
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        check_count(run, "collect routes", collects.len(), segments.len())?;
        let ResultLayout::Routing { pe: router } = self.program.instrs[routing_value as usize].result else {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: "its routing operand is not a routing".into(),
            });
        };
        run.begin(Phase::Gather);
        // The experts' PEs send what they hold (unchosen experts hold nothing and stay silent).
        for (segment, &id) in segments.iter().zip(collects) {
            for &expert_value in experts {
                let value = expert_value.index();
                let (Held::Segments(held), ResultLayout::Vector(layout)) =
                    (&state.held[value], &self.program.instrs[value].result)
                else {
                    continue;
                };
                let held = held.clone();
                for (source, data) in layout.segments.iter().zip(&held) {
                    if let Some(overlap) = intersect(&source.elements, &segment.elements) {
                        let part = data.slice(relative(&overlap, source.elements.start));
                        self.send(state, run, id, source.pe, Payload::Data(part))?;
                    }
                }
            }
        }
        let mut held = Vec::with_capacity(segments.len());
        let mut received = Vec::with_capacity(segments.len());
        for (segment, &id) in segments.iter().zip(collects) {
            let Payload::Routing(routing) = self.receive(state, run, routing_route, router, segment.pe)?.clone() else {
                return Err(ExecError::RouteKind {
                    site: run.site.clone(),
                    route: routing_route,
                    expected: "a routing decision",
                    found: "a data message".into(),
                });
            };
            let mut weighted = Vec::with_capacity(routing.chosen.len());
            for &(expert, weight) in &routing.chosen {
                let value = experts.get(expert as usize).ok_or_else(|| ExecError::Malformed {
                    site: run.site.clone(),
                    problem: format!("the routing chose expert {expert} of {}", experts.len()),
                })?;
                let ResultLayout::Vector(layout) = &self.program.instrs[value.index()].result else {
                    return Err(ExecError::Malformed {
                        site: run.site.clone(),
                        problem: format!("expert {expert}'s output is not a vector"),
                    });
                };
                let parts = layout
                    .overlapping(segment.elements.clone())
                    .map(|(source, overlap)| (source.pe, overlap))
                    .collect();
                weighted.push((weight, self.assemble(state, run, id, segment, parts)?));
            }
            received.push((routing, weighted));
        }
        run.begin(Phase::Compute);
        for (segment, (routing, weighted)) in segments.iter().zip(received) {
            let n = span(&segment.elements) as usize;
            held.push(self.compute_data(n, || {
                let inputs: Vec<(f32, &[f32])> = weighted.iter().map(|(w, d)| (*w, d.values())).collect();
                let mut out = vec![0.0; n];
                kernels::expert_combine(&inputs, &mut out);
                out
            }));
            run.compute(segment.pe, self.costs.fma((routing.chosen.len() * n) as u64));
        }
        state.held[run.instr as usize] = Held::Segments(held);
        self.deliver(state, run, segments)
    }
}

/// A weight region as a PE holds it: (weight index, rows, elements of each row, bytes).
type HeldWeight<'a> = (u32, Range<u64>, Range<u64>, &'a [u8]);

/// The executor as a [`Decoder`], so [`crate::generate`] drives it like the reference decoder
/// (the timing of every step stays available from [`Executor::timing_report`]).
impl Decoder for Executor<'_> {
    fn step(&mut self, token: u32) -> Result<Vec<f32>, RuntimeError> {
        let result = Executor::step(self, token).map_err(|e| RuntimeError::Executor(Box::new(e)))?;
        result.logits.ok_or_else(|| RuntimeError::Executor(Box::new(ExecError::TimingOnly)))
    }
    fn position(&self) -> usize {
        self.position as usize
    }
    fn reset(&mut self) {
        Executor::reset(self)
    }
}

/// Per-step state: what each instruction holds, the messages in flight, the timeline.
struct StepState {
    held: Vec<Held>,
    messages: HashMap<(RouteId, Pe), Payload>,
    token: u32,
    timeline: timing::Timeline,
}

/// What one schedule step did: compute cycles per PE, and the routes it sent on (in first-send
/// order) with their message counts.
#[derive(Clone, Debug, Default)]
pub(crate) struct StepWork {
    pub(crate) compute: HashMap<Pe, u64>,
    pub(crate) routes: Vec<(RouteId, u32)>,
}

/// One instruction's consecutive steps while it executes: which phase is current, what each
/// step computed and sent (for the timing model).
pub(crate) struct InstrRun {
    pub(crate) instr: InstrIndex,
    pub(crate) site: InstrSite,
    /// `(schedule index, step)` of the instruction's steps.
    pub(crate) steps: Vec<(usize, Step)>,
    phase: Phase,
    current: Option<usize>,
    /// What each step did.
    pub(crate) work: Vec<StepWork>,
    /// Compute in a phase the schedule has no step for, charged to the next step.
    orphan: HashMap<Pe, u64>,
}

impl InstrRun {
    fn new(program: &WaferProgram, instr: InstrIndex, steps: Range<usize>) -> Self {
        let steps: Vec<(usize, Step)> = steps.map(|i| (i, program.schedule[i].clone())).collect();
        let work = vec![StepWork::default(); steps.len()];
        InstrRun {
            instr,
            site: site_of(program, instr),
            steps,
            phase: Phase::Compute,
            current: None,
            work,
            orphan: HashMap::new(),
        }
    }

    fn begin(&mut self, phase: Phase) {
        self.phase = phase;
        self.current = self.steps.iter().position(|(_, s)| s.phase == phase);
        if let Some(current) = self.current {
            for (pe, cycles) in std::mem::take(&mut self.orphan) {
                *self.work[current].compute.entry(pe).or_insert(0) += cycles;
            }
        }
    }

    fn current_lists(&self, route: RouteId) -> bool {
        self.current.is_some_and(|c| self.steps[c].1.routes.contains(&route))
    }

    fn compute(&mut self, pe: Pe, cycles: u64) {
        let target = match self.current {
            Some(c) => &mut self.work[c].compute,
            None => &mut self.orphan,
        };
        *target.entry(pe).or_insert(0) += cycles;
    }

    fn sent(&mut self, route: RouteId) {
        if let Some(c) = self.current {
            let routes = &mut self.work[c].routes;
            match routes.iter_mut().find(|(id, _)| *id == route) {
                Some((_, messages)) => *messages += 1,
                None => routes.push((route, 1)),
            }
        }
    }

    /// Compute charged to no step yet (a trailing phase without a step goes to the last step).
    pub(crate) fn take_orphan(&mut self) -> HashMap<Pe, u64> {
        std::mem::take(&mut self.orphan)
    }
}

/// Cuts the schedule into instructions, checking each instruction's steps are consecutive, in
/// phase order, one per phase, and that every non-dispatch instruction has steps.
fn schedule_runs(program: &WaferProgram) -> Result<Vec<(InstrIndex, Range<usize>)>, ExecError> {
    let mut runs: Vec<(InstrIndex, Range<usize>)> = Vec::new();
    let mut seen = vec![false; program.instrs.len()];
    for (i, step) in program.schedule.iter().enumerate() {
        if step.instr as usize >= program.instrs.len() {
            return Err(ExecError::Schedule {
                problem: format!(
                    "step {i} names %{}, but the program has {} instructions",
                    step.instr,
                    program.instrs.len()
                ),
            });
        }
        match runs.last_mut() {
            Some((instr, range)) if *instr == step.instr => {
                let previous = &program.schedule[i - 1];
                if phase_rank(previous.phase) >= phase_rank(step.phase) {
                    return Err(ExecError::Schedule {
                        problem: format!(
                            "step {i} of %{} is {:?} after {:?}: phases must be in order, one step each",
                            step.instr, step.phase, previous.phase
                        ),
                    });
                }
                range.end = i + 1;
            }
            _ => {
                if seen[step.instr as usize] {
                    return Err(ExecError::Schedule {
                        problem: format!("the steps of %{} are not consecutive (step {i})", step.instr),
                    });
                }
                seen[step.instr as usize] = true;
                runs.push((step.instr, i..i + 1));
            }
        }
    }
    for (placement, seen) in program.instrs.iter().zip(&seen) {
        if !seen && !matches!(placement.work, Work::Dispatch { .. }) {
            return Err(ExecError::Schedule {
                problem: format!("%{} = {} has no step in the schedule", placement.instr, placement.op),
            });
        }
    }
    Ok(runs)
}

fn phase_rank(phase: Phase) -> u8 {
    match phase {
        Phase::Gather => 0,
        Phase::Compute => 1,
        Phase::Reduce => 2,
        Phase::Broadcast => 3,
        Phase::Finish => 4,
        Phase::AttentionMax => 5,
        Phase::AttentionSum => 6,
        Phase::AttentionOut => 7,
        Phase::Collect => 8,
        Phase::Deliver => 9,
    }
}

/// Every PE's SRAM with its weight regions filled from the tile blob, checking each region's
/// byte count against its weight's type.
fn load_sram(program: &WaferProgram, module: &Module, tile_blob: Option<&[u8]>) -> Result<Vec<Vec<u8>>, ExecError> {
    if !program.weights_present {
        return Err(ExecError::NoWeights);
    }
    let blob = tile_blob.ok_or(ExecError::NoWeights)?;
    if blob.len() as u64 != program.tile_blob_len {
        return Err(ExecError::TileBlobLength { expected: program.tile_blob_len, found: blob.len() as u64 });
    }
    let mut sram = Vec::with_capacity(program.pes.len());
    for image in &program.pes {
        let size = image.regions.iter().map(|r| r.offset as usize + r.bytes as usize).max().unwrap_or(0);
        let mut memory = vec![0u8; size];
        for (index, region) in image.regions.iter().enumerate() {
            let RegionKind::Weight { weight, rows, cols, blob: range } = &region.kind else { continue };
            let site = site_of(program, region.instr.unwrap_or(0));
            let error = |problem: String| {
                ExecError::WeightRegion(Box::new(WeightRegionError {
                    site: site.clone(),
                    pe: image.pe,
                    region: index,
                    weight: module
                        .weights
                        .get(waferc_ir::Handle::new(*weight as usize))
                        .map_or_else(|| format!("#{weight}"), |w| w.name.clone()),
                    rows: rows.clone(),
                    cols: cols.clone(),
                    problem,
                }))
            };
            let Some(spec) = module.weights.get(waferc_ir::Handle::new(*weight as usize)) else {
                return Err(error("the module has no such weight".into()));
            };
            let expected = spec.ty.dtype.row_bytes(cols.end - cols.start).map(|b| b * (rows.end - rows.start));
            if expected != Some(range.end - range.start) {
                return Err(error(format!(
                    "its blob range {range:?} holds {} bytes, but {} rows of {} {} elements need {expected:?}",
                    range.end.saturating_sub(range.start),
                    rows.end - rows.start,
                    cols.end - cols.start,
                    spec.ty.dtype
                )));
            }
            if range.end > blob.len() as u64 || range.end - range.start > region.bytes as u64 {
                return Err(error(format!(
                    "its blob range {range:?} does not fit the blob ({} bytes) or the region ({} bytes)",
                    blob.len(),
                    region.bytes
                )));
            }
            memory[region.offset as usize..][..(range.end - range.start) as usize]
                .copy_from_slice(&blob[range.start as usize..range.end as usize]);
        }
        sram.push(memory);
    }
    Ok(sram)
}

/// Row `row` of a region holding rows of `cols` elements of `dtype`.
fn region_row(dtype: DType, bytes: &[u8], row: u64, cols: u64) -> Option<RowView<'_>> {
    let row_bytes = dtype.row_bytes(cols)? as usize;
    let start = row as usize * row_bytes;
    RowView::new(dtype, bytes.get(start..start + row_bytes)?, cols as usize)
}

pub(crate) fn site_of(program: &WaferProgram, instr: InstrIndex) -> InstrSite {
    match program.instrs.get(instr as usize) {
        Some(p) => InstrSite { value: instr, op: p.op.clone(), layer: p.layer, expert: p.expert },
        None => InstrSite { value: instr, op: "?".into(), layer: None, expert: None },
    }
}

pub(crate) fn route_of<'a>(program: &'a WaferProgram, site: &InstrSite, id: RouteId) -> Result<&'a Route, ExecError> {
    match program.routes.get(id as usize) {
        Some(route) if route.id == id => Ok(route),
        Some(route) => Err(ExecError::Malformed {
            site: site.clone(),
            problem: format!("routes[{id}] has id {}: route ids must equal their index", route.id),
        }),
        None => Err(ExecError::MissingRoute { site: site.clone(), route: id, routes: program.routes.len() }),
    }
}

pub(crate) fn pe_image(program: &WaferProgram, pe: Pe) -> Option<(usize, &PeImage)> {
    program.pes.binary_search_by(|image| image.pe.cmp(&pe)).ok().map(|i| (i, &program.pes[i]))
}

fn route_kind_error(run: &InstrRun, route: &Route, expected: &'static str) -> ExecError {
    ExecError::RouteKind { site: run.site.clone(), route: route.id, expected, found: format!("{:?}", route.kind) }
}

fn single_source(run: &InstrRun, route: &Route) -> Result<Pe, ExecError> {
    match route.sources[..] {
        [source] => Ok(source),
        _ => Err(ExecError::Malformed {
            site: run.site.clone(),
            problem: format!("route {} must have one source, it has {}", route.id, route.sources.len()),
        }),
    }
}

fn single_destination(run: &InstrRun, route: &Route) -> Result<Pe, ExecError> {
    match route.destinations[..] {
        [destination] => Ok(destination),
        _ => Err(ExecError::Malformed {
            site: run.site.clone(),
            problem: format!("route {} must have one destination, it has {}", route.id, route.destinations.len()),
        }),
    }
}

fn data_of(
    run: &InstrRun,
    id: RouteId,
    sender: Pe,
    receiver: Pe,
    payload: &Payload,
    expected: usize,
) -> Result<Data, ExecError> {
    match payload {
        Payload::Data(data) if data.len() == expected => Ok(data.clone()),
        Payload::Data(data) => Err(ExecError::MessageLength {
            site: run.site.clone(),
            route: id,
            sender,
            pe: receiver,
            expected,
            found: data.len(),
        }),
        Payload::Routing(_) => Err(ExecError::RouteKind {
            site: run.site.clone(),
            route: id,
            expected: "a data message",
            found: "a routing decision".into(),
        }),
    }
}

fn check_count(run: &InstrRun, what: &str, found: usize, expected: usize) -> Result<(), ExecError> {
    if found == expected {
        return Ok(());
    }
    Err(ExecError::Malformed { site: run.site.clone(), problem: format!("{found} {what}, expected {expected}") })
}

/// The row block a matvec reduction combines: the one with a tile on every source.
fn reduction_row_block(run: &InstrRun, route: &Route, p: &MatVecPlacement) -> Result<usize, ExecError> {
    let elements = match route.kind {
        RouteKind::Reduce { elements, .. } => elements as u64,
        _ => return Err(route_kind_error(run, route, "a reduction")),
    };
    (0..p.row_blocks as usize)
        .find(|&r| {
            let first = &p.tiles[r * p.col_blocks as usize];
            first.rows.end - first.rows.start == elements
                && route.sources.iter().all(|&pe| tile_of_row_block(p, r, pe).is_some())
        })
        .ok_or_else(|| ExecError::Malformed {
            site: run.site.clone(),
            problem: format!("reduction route {} does not match the tiles of any row block", route.id),
        })
}

fn tile_of_row_block(p: &MatVecPlacement, row_block: usize, pe: Pe) -> Option<usize> {
    let cols = p.col_blocks as usize;
    (row_block * cols..(row_block + 1) * cols).find(|&t| p.tiles[t].pe == pe)
}

/// The PEs that compute an instruction.
fn compute_pes(placement: &waferc_ir::wafer::InstrPlacement) -> Vec<Pe> {
    let mut pes: Vec<Pe> = match &placement.result {
        ResultLayout::Vector(layout) => layout.segments.iter().map(|s| s.pe).collect(),
        ResultLayout::Routing { pe } => vec![*pe],
    };
    match &placement.work {
        Work::Embed { blocks, .. } => pes.extend(blocks.iter().map(|b| b.pe)),
        Work::MatVec(p) => pes.extend(p.tiles.iter().map(|t| t.pe)),
        Work::Attention(p) => pes.extend(p.kv_heads_placed.iter().flat_map(|kh| kh.blocks.iter().map(|b| b.pe))),
        Work::Dispatch { .. } => pes.clear(),
        Work::Elementwise | Work::RmsNorm(_) | Work::Router { .. } | Work::Combine { .. } => {}
    }
    pes.sort_unstable();
    pes.dedup();
    pes
}

fn work_name(work: &Work) -> &'static str {
    match work {
        Work::Embed { .. } => "Embed",
        Work::MatVec(_) => "MatVec",
        Work::Elementwise => "Elementwise",
        Work::Dispatch { .. } => "Dispatch",
        Work::RmsNorm(_) => "RmsNorm",
        Work::Attention(_) => "Attention",
        Work::Router { .. } => "Router",
        Work::Combine { .. } => "Combine",
    }
}

/// Elements in a range of element indices.
fn span(range: &Range<u64>) -> u64 {
    range.end - range.start
}

fn intersect(a: &Range<u64>, b: &Range<u64>) -> Option<Range<u64>> {
    let (start, end) = (a.start.max(b.start), a.end.min(b.end));
    (start < end).then_some(start..end)
}

/// `range` relative to `base`, as slice indices.
fn relative(range: &Range<u64>, base: u64) -> Range<usize> {
    (range.start - base) as usize..(range.end - base) as usize
}
