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
//! to routes and tiles, never to elements, and the router chooses the routing profile's expected
//! picks for the layer and position (a uniform router's without a profile: `timing_picks`).
//!
//! Each step also produces its [`StepTiming`] from the [`timing`] model.
//!
//! Layout: this module holds the [`Executor`] and its step loop; `fabric` moves messages along
//! routes (send, receive, operands, reductions, collects, deliveries); `sram` loads the PE images
//! and reads weight regions; `schedule` cuts the schedule into per-instruction runs; `ops` is
//! each op's per-PE execution, one module per kind of work; `by_pe` groups what a tile looks up
//! (segments, operand routes, tiles) by PE.
//!
//! [`PeImage`]: waferc_ir::wafer::PeImage
//! [`Step`]: waferc_ir::wafer::Step
//! [`reduce_tree`]: waferc_ir::wafer::reduce_tree

mod by_pe;
mod error;
mod fabric;
mod ops;
pub mod pipeline;
mod ranges;
mod schedule;
mod sram;
pub mod timing;
mod validate;

use rustc_hash::FxHashMap as HashMap;
use std::ops::Range;

use waferc_ir::wafer::{arrival, InstrIndex, InstrPlacement, Pe, ResultLayout, RouteId, RouteKind, WaferProgram, Work};
use waferc_ir::{Module, Op};

use crate::kernels::{self, Routing};
use crate::reference::{Decoder, InstrValue};
use crate::RuntimeError;

use by_pe::ByPe;
use fabric::{route_of, Payload};
use schedule::{schedule_runs, InstrRun};
use sram::load_sram;

pub use error::{ExecError, InstrSite, WeightRegionError};
pub use pipeline::{pipeline, replica_need, PipelineTiming, ReplicaNeed, SequenceCosts, SequenceTiming, StepCost};
pub use timing::{LayerTime, LinkLoad, PeLoad, PrefillTime, StepSpan, StepTiming, TimingReport, PREFILL_PROMPTS};
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
    /// The expert's `expert_dispatch`, whose copy serving the step names the routing route.
    dispatch: InstrIndex,
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
    /// Each value, followed through `expert_dispatch` (which aliases its `x`) and `slice`
    /// (which names part of its `x`).
    alias: Vec<InstrIndex>,
    /// Where each value's elements start in its alias's result (non-zero for a `slice`).
    alias_offset: Vec<u64>,
    gates: Vec<Option<Gate>>,
    /// Per `expert_dispatch`: how early its expert receives the input and the routing, before
    /// their multicasts end (`waferc_ir::wafer::arrival`).
    dispatch_leads: HashMap<InstrIndex, (u64, u64)>,
    /// Per `(reader, producer)`: how early the reader's own PEs have the producer's result,
    /// before its deliveries end (`waferc_ir::wafer::arrival::reader_leads`).
    reader_leads: HashMap<(InstrIndex, InstrIndex), u64>,
    /// The PEs that compute each instruction (tiles, segments, KV blocks, the router), per copy
    /// (one unless the instruction belongs to a replicated expert).
    instr_pes: Vec<Vec<Vec<Pe>>>,
    /// Per instruction and copy (as `instr_pes`), the indices of its result segments by PE, so
    /// a read finds the segments held on its PE without scanning the layout (a matvec's every
    /// tile reads its input: a scan per tile is tiles x segments).
    segments_by_pe: Vec<Vec<ByPe<u32>>>,
    /// Per instruction of a replicated expert: `(replica, member)` (`waferc_ir::wafer::replicas`).
    replica_slots: Vec<Option<(u32, u32)>>,
    /// Routes into expert copies, by the instruction whose `Deliver` step sends them, with the
    /// copies `(replica, copy)` each reaches; sent only in a step one of them serves.
    copy_inputs: CopyInputs,
    /// Per instruction, the producers whose results it reads where they lie, so it may start
    /// when the steps before their `Deliver` end (`waferc_ir::wafer::arrival::in_place_readers`).
    reads_in_place: Vec<Vec<InstrIndex>>,
    /// Attention's `Collect` routes (the placement does not list them), in element order.
    attention_collects: HashMap<InstrIndex, Vec<RouteId>>,
    rope_frequencies: Vec<Option<kernels::RopeTable>>,
    /// KV caches, keyed by (attention instruction, KV head placement, block): a sequence's
    /// steps use only its own KV head placements.
    kv: HashMap<(InstrIndex, usize, usize), KvBlockState>,
    /// Destinations of each route, sorted (membership tests on big multicasts): the route's
    /// own list when it is sorted already (the compiler sorts them), else a sorted copy.
    destinations: Vec<std::borrow::Cow<'p, [Pe]>>,
    /// The most messages a step holds at once: one per source of a route other than a
    /// reduction (a reduction's partials never enter the map). A step's message map is
    /// made this large at once, so it never rehashes.
    most_messages: usize,
    costs: timing::CostModel,
    /// The sequence the steps feed, and its position.
    sequence: u32,
    position: u32,
    /// Modeled cycles of each step since the last reset, by position.
    history: Vec<u64>,
    last_timing: Option<StepTiming>,
    /// The other sequences' positions, histories and last timings, by sequence.
    parked: HashMap<u32, (u32, Vec<u64>, Option<StepTiming>)>,
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
        ranges::check_ranges(program)?;
        let runs = schedule_runs(program)?;
        let sram = if options.timing_only { Vec::new() } else { load_sram(program, module, tile_blob)? };

        let mut alias: Vec<InstrIndex> = Vec::with_capacity(module.body.len());
        let mut alias_offset: Vec<u64> = Vec::with_capacity(module.body.len());
        let mut gates: Vec<Option<Gate>> = Vec::with_capacity(module.body.len());
        for (handle, instr) in module.body.iter() {
            let index = handle.index() as InstrIndex;
            let site = site_of(program, index);
            match &instr.op {
                Op::ExpertDispatch { x, expert, .. } => {
                    alias.push(alias[x.index()]);
                    alias_offset.push(alias_offset[x.index()]);
                    let Work::Dispatch { routing } = program.instrs[index as usize].work else {
                        return Err(ExecError::Malformed { site, problem: "its work is not Dispatch".into() });
                    };
                    gates.push(Some(Gate { route: routing, expert: *expert, dispatch: index }));
                }
                Op::ExpertCombine { .. } => {
                    alias.push(index);
                    alias_offset.push(0);
                    gates.push(None);
                }
                Op::Slice { x, offset, .. } => {
                    alias.push(alias[x.index()]);
                    alias_offset.push(alias_offset[x.index()] + *offset as u64);
                    gates.push(gates[x.index()]);
                }
                op => {
                    alias.push(index);
                    alias_offset.push(0);
                    gates.push(op.operands().iter().find_map(|o| gates[o.index()]));
                }
            }
        }

        // Which operand routes reach a PE is looked up per read (`fabric::operand`) rather than
        // tabulated per (instruction, PE): a multicast feeding every expert of an MoE layer is an
        // operand route of each of them, so such a table grows as experts x all experts' PEs.
        for placement in &program.instrs {
            let site = site_of(program, placement.instr);
            for &id in &placement.operand_routes {
                route_of(program, &site, id)?;
            }
        }

        let mut attention_collects: HashMap<InstrIndex, Vec<RouteId>> = HashMap::default();
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
        let replica_slots = waferc_ir::wafer::replica_slots(program);
        let own_pes = arrival::compute_pes_by_instr(program);
        let reads_in_place = arrival::in_place_readers(program, module, &own_pes);
        let dispatch_leads = arrival::dispatch_leads(program, module, &own_pes);
        let reader_leads = arrival::reader_leads(program, module, &own_pes);
        // Each instruction's PEs, then each copy's.
        let instr_pes: Vec<Vec<Vec<Pe>>> = own_pes
            .into_iter()
            .enumerate()
            .map(|(i, own)| {
                let copies = program.placements_of(&replica_slots, i as InstrIndex).skip(1);
                std::iter::once(own).chain(copies.map(|p| p.compute_pes())).collect()
            })
            .collect();
        let segments_by_pe = (0..program.instrs.len() as InstrIndex)
            .map(|i| program.placements_of(&replica_slots, i).map(segments_by_pe).collect())
            .collect();
        let copy_inputs = copy_inputs(program, &replica_slots);
        let destinations = program
            .routes
            .iter()
            .map(|r| match r.destinations.is_sorted() {
                true => std::borrow::Cow::Borrowed(r.destinations.as_slice()),
                false => {
                    let mut d = r.destinations.clone();
                    d.sort_unstable();
                    std::borrow::Cow::Owned(d)
                }
            })
            .collect();
        let most_messages = program
            .routes
            .iter()
            .filter(|r| !matches!(r.kind, RouteKind::Reduce { .. }))
            .map(|r| r.sources.len())
            .sum();
        let costs = timing::CostModel::new(program)?;
        Ok(Executor {
            program,
            module,
            options,
            runs,
            sram,
            alias,
            alias_offset,
            gates,
            dispatch_leads,
            reader_leads,
            instr_pes,
            segments_by_pe,
            replica_slots,
            copy_inputs,
            reads_in_place,
            attention_collects,
            rope_frequencies,
            kv: HashMap::default(),
            destinations,
            most_messages,
            costs,
            sequence: 0,
            position: 0,
            parked: HashMap::default(),
            history: Vec::new(),
            last_timing: None,
            last_values: None,
        })
    }

    pub fn program(&self) -> &WaferProgram {
        self.program
    }

    /// The indices of `instr`'s result segments (in the copy the selected sequence runs) held on
    /// `pe`, in segment order.
    fn segments_on(&self, instr: InstrIndex, pe: Pe) -> &[u32] {
        self.segments_by_pe[instr as usize][self.copy_of(instr) as usize].on(pe)
    }

    /// The placement of `instr` the selected sequence runs: for an instruction of a replicated
    /// expert, the copy serving it (`waferc_ir::wafer::serving_copy`), else its only one. The
    /// functional run and the timing model both go through here.
    pub fn placement(&self, instr: InstrIndex) -> &'p InstrPlacement {
        self.program.placement(&self.replica_slots, instr, self.sequence)
    }

    /// Which copy of `instr` the selected sequence runs (0 for the original).
    fn copy_of(&self, instr: InstrIndex) -> u32 {
        match self.replica_slots.get(instr as usize).copied().flatten() {
            Some((r, _)) => waferc_ir::wafer::serving_copy(self.sequence, self.program.replicas[r as usize].count()),
            None => 0,
        }
    }

    /// Whether one of `copies` (`(replica, copy)`) serves the selected sequence.
    fn serves(&self, copies: &[(u32, u32)]) -> bool {
        copies.iter().any(|&(replica, copy)| {
            let count = self.program.replicas[replica as usize].count();
            waferc_ir::wafer::serving_copy(self.sequence, count) == copy
        })
    }

    pub fn module(&self) -> &Module {
        self.module
    }

    /// Positions fed so far.
    pub fn position(&self) -> u32 {
        self.position
    }

    /// The sequence the next steps feed.
    pub fn sequence(&self) -> u32 {
        self.sequence
    }

    /// Feeds sequence `sequence` from now on: its own KV blocks, its own position and timing
    /// history (where its last step left them). Sequences `0..program.max_sequences` exist.
    pub fn select_sequence(&mut self, sequence: u32) -> Result<(), ExecError> {
        if sequence >= self.program.max_sequences {
            return Err(ExecError::NoSuchSequence { sequence, max_sequences: self.program.max_sequences });
        }
        if sequence != self.sequence {
            let (position, history, last) = self.parked.remove(&sequence).unwrap_or_default();
            let current = (
                std::mem::replace(&mut self.position, position),
                std::mem::replace(&mut self.history, history),
                std::mem::replace(&mut self.last_timing, last),
            );
            self.parked.insert(self.sequence, current);
            self.sequence = sequence;
        }
        Ok(())
    }

    /// Moves the selected sequence to `position`, as though every position before it had been
    /// fed, and forgets its timing history. Timing only: there a KV block's contents are never
    /// read, only how many of its positions are filled, which the position alone decides; so a
    /// step after seeking costs what the same step costs after feeding every earlier position.
    /// For the decode speed deep into a context without running the whole prompt.
    pub fn seek(&mut self, position: u32) -> Result<(), ExecError> {
        if !self.options.timing_only {
            return Err(ExecError::SeekWithValues { position });
        }
        if position >= self.program.max_context {
            return Err(ExecError::ContextFull { position, max_context: self.program.max_context });
        }
        self.position = position;
        self.history.clear();
        self.last_timing = None;
        Ok(())
    }

    /// Forgets the selected sequence's positions (empties its KV blocks and its timing history),
    /// so its slot can take a new sequence.
    pub fn reset_sequence(&mut self) {
        let (program, sequence) = (self.program, self.sequence);
        self.kv.retain(|&(instr, head, _), _| match &program.instrs[instr as usize].work {
            Work::Attention(p) => p.kv_heads_placed.get(head).is_some_and(|h| h.sequence != sequence),
            _ => true,
        });
        self.position = 0;
        self.history.clear();
        self.last_timing = None;
        self.last_values = None;
    }

    /// Forgets every position of every sequence (empties the KV caches and the timing
    /// histories) and feeds sequence 0.
    pub fn reset(&mut self) {
        self.sequence = 0;
        self.parked.clear();
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
            messages: HashMap::with_capacity_and_hasher(self.most_messages, Default::default()),
            token,
            timeline: timing::Timeline::new(self.program, &self.costs),
        };
        for run_index in 0..self.runs.len() {
            let (instr, steps) = self.runs[run_index].clone();
            let mut run = InstrRun::new(self.program, instr, steps);
            let copy = self.copy_of(instr);
            run.copy = copy;
            let open = self.gate_open(&state, &mut run, instr)?;
            if open {
                self.execute(&mut state, &mut run)?;
            } else {
                state.held[instr as usize] = Held::Absent;
            }
            let ready =
                timing::Ready { compute: self.ready_cycle(&state, instr), send: self.routes_after(&state, instr) };
            state.timeline.finish_instr(
                self.program,
                &self.costs,
                &mut run,
                open,
                ready,
                &self.instr_pes[instr as usize][copy as usize],
            );
        }
        let logits = self.output_logits(&state)?;
        if self.options.record_values {
            self.last_values = Some(self.collect_values(&state));
        }
        let timing = state.timeline.into_step_timing(self.position);
        Ok(StepResult { logits, timing })
    }

    /// The modeled timing report over the steps run since the last reset (or [`Executor::seek`]),
    /// for a prompt of `prompt_tokens` tokens (see [`timing`] for the model). `None` before the
    /// first step.
    pub fn timing_report(&self, prompt_tokens: usize) -> Option<TimingReport> {
        let last = self.last_timing.as_ref()?;
        let first_position = self.position - self.history.len() as u32;
        Some(timing::report(self.program, &self.costs, &self.history, last, prompt_tokens, first_position))
    }

    /// The cycle at which all of `instr`'s operands (and, for an expert, the routing) are ready,
    /// and the instruction that ended then (none when nothing precedes it).
    fn ready_cycle(&self, state: &StepState, instr: InstrIndex) -> (u64, Option<InstrIndex>) {
        let op = &self.module.body[waferc_ir::Handle::new(instr as usize)].op;
        let mut ready = (0, None);
        for operand in op.operands() {
            let done = self.done_cycle(state, operand.index() as InstrIndex, instr);
            if ready.1.is_none() || done.0 > ready.0 {
                ready = done;
            }
        }
        ready
    }

    /// The cycle before which `instr` sends nothing: when the routes of its operands' producers
    /// (through `slice` and `expert_dispatch`) are over, and those of everything their starts
    /// skipped (`timing::Timeline::routes_clear`); and the instruction that sets it.
    fn routes_after(&self, state: &StepState, instr: InstrIndex) -> (u64, Option<InstrIndex>) {
        let mut after = (0, None);
        let mut pending: Vec<InstrIndex> = self.module.body[waferc_ir::Handle::new(instr as usize)]
            .op
            .operands()
            .iter()
            .map(|o| o.index() as InstrIndex)
            .collect();
        while let Some(value) = pending.pop() {
            match &self.module.body[waferc_ir::Handle::new(value as usize)].op {
                Op::ExpertDispatch { x, routing, .. } => {
                    pending.extend([x.index() as InstrIndex, routing.index() as InstrIndex])
                }
                Op::Slice { x, .. } => pending.push(x.index() as InstrIndex),
                _ => {
                    let clear = state.timeline.routes_clear(value);
                    if after.1.is_none() || clear > after.0 {
                        after = (clear, Some(value));
                    }
                }
            }
        }
        after
    }

    /// When `value` is available to `reader`, and the instruction whose end that is: its
    /// instruction's end (`expert_dispatch`: when its inputs reach its expert, which may be
    /// before their multicasts end; a reader that reads it in place: the end of the steps before
    /// its `Deliver`).
    fn done_cycle(&self, state: &StepState, value: InstrIndex, reader: InstrIndex) -> (u64, Option<InstrIndex>) {
        match &self.module.body[waferc_ir::Handle::new(value as usize)].op {
            Op::ExpertDispatch { x, routing, .. } => {
                // A copy of an expert gets its inputs on routes of its own: no lead.
                let leads = if self.copy_of(value) == 0 { self.dispatch_leads.get(&value).copied() } else { None };
                let (x_lead, routing_lead) = leads.unwrap_or((0, 0));
                let (x_done, x_by) = self.done_cycle(state, x.index() as InstrIndex, reader);
                let (routing_done, routing_by) = self.done_cycle(state, routing.index() as InstrIndex, reader);
                let (x_done, routing_done) = (x_done.saturating_sub(x_lead), routing_done.saturating_sub(routing_lead));
                if routing_done > x_done {
                    (routing_done, routing_by)
                } else {
                    (x_done, x_by)
                }
            }
            Op::Slice { x, .. } => self.done_cycle(state, x.index() as InstrIndex, reader),
            _ if self.reads_in_place[reader as usize].contains(&value) => {
                (state.timeline.before_deliver(value), Some(value))
            }
            _ => {
                let lead = self.reader_leads.get(&(reader, value)).copied().unwrap_or(0);
                (state.timeline.instr_end(value).saturating_sub(lead), Some(value))
            }
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
                Op::Slice { len, .. } => match value_of(&state.held[self.alias[i] as usize]) {
                    InstrValue::Tensor(values) => {
                        let start = self.alias_offset[i] as usize;
                        InstrValue::Tensor(values[start..start + *len as usize].to_vec())
                    }
                    other => other,
                },
                _ => value_of(&state.held[i]),
            })
            .collect()
    }

    /// Runs `compute` unless timing only.
    fn compute_data(&self, len: usize, compute: impl FnOnce() -> Vec<f32>) -> Data {
        if self.options.timing_only {
            Data::Shape(len)
        } else {
            Data::Values(compute())
        }
    }
}

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

/// The routes into expert copies (`Executor::copy_inputs`): each copy's routing route (its
/// dispatch's), sent by the router, and its operand routes from outside the expert, sent by
/// the value's producer.
type CopyInputs = HashMap<InstrIndex, Vec<(RouteId, Vec<(u32, u32)>)>>;

fn copy_inputs(program: &WaferProgram, slots: &[Option<(u32, u32)>]) -> CopyInputs {
    let mut inputs: CopyInputs = HashMap::default();
    for (r, replica) in program.replicas.iter().enumerate() {
        for (c, copy) in replica.copies.iter().enumerate() {
            let mut routes: Vec<(InstrIndex, RouteId)> = Vec::new();
            for placement in copy {
                if let Work::Dispatch { routing } = placement.work {
                    routes.push((replica.router, routing));
                }
                for &id in &placement.operand_routes {
                    let Some(route) = program.routes.get(id as usize) else { continue };
                    if slots.get(route.instr as usize).copied().flatten().map(|(s, _)| s) != Some(r as u32) {
                        routes.push((route.instr, id));
                    }
                }
            }
            routes.sort_unstable();
            routes.dedup();
            for (instr, id) in routes {
                let list = inputs.entry(instr).or_default();
                match list.iter_mut().find(|(route, _)| *route == id) {
                    Some((_, copies)) => copies.push((r as u32, c as u32 + 1)),
                    None => list.push((id, vec![(r as u32, c as u32 + 1)])),
                }
            }
        }
    }
    inputs
}

/// The indices of a placement's vector result segments by PE (none for a routing decision).
fn segments_by_pe(placement: &InstrPlacement) -> ByPe<u32> {
    let segments = match &placement.result {
        ResultLayout::Vector(layout) => layout.segments.as_slice(),
        ResultLayout::Routing { .. } => &[],
    };
    ByPe::new(segments.iter().enumerate().map(|(s, seg)| (seg.pe, s as u32)))
}

pub(crate) fn site_of(program: &WaferProgram, instr: InstrIndex) -> InstrSite {
    match program.instrs.get(instr as usize) {
        Some(p) => InstrSite { value: instr, op: p.op.clone(), layer: p.layer, expert: p.expert },
        None => InstrSite { value: instr, op: "?".into(), layer: None, expert: None },
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
