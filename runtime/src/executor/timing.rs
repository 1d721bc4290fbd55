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
//! MAC per chosen expert per element, each expert's share worked as its message comes in (in
//! expert order, the order the sum takes: NUMERICS.md), so the step after its gather counts only
//! what is left when the gather ends; the router one slot per expert to find its top k, then an
//! exponential and a division per weight (per chosen expert when it normalises,
//! `kernels::router_topk`; else per expert); each edge of a reduction tree one add per element on
//! the receiving PE. A step's compute time is its
//! **busiest PE's**. An attention KV block holding no position yet (all its positions beyond the
//! step's) computes nothing and sends nothing: the reduction edges whose sender's subtree holds
//! only such blocks are skipped (bit-exact: an empty subtree's partial is +0.0 or, for the
//! maximum, -inf, which change nothing; NUMERICS.md, "the chunk tree"), so attention's cost grows
//! with the context as on the hardware.
//!
//! # Communication
//!
//! A route's time is its latency plus its serialisation. Latency: the hops from a source to the
//! farthest PE its runs reach, times `hop_latency_cycles` (an inter-wafer run counts
//! `inter_wafer_latency_cycles`); a gather's messages are distinct, so its latency is at least
//! its longest source's path along the runs to the destination. Serialisation: the busiest link of the route carries `messages x
//! message_bytes`, at `link_bytes_per_cycle` (or `inter_wafer_bytes_per_cycle`), wormhole-style, so
//! it adds to the latency once rather than per hop; a multicast's message crosses each link once
//! (the routers replicate it where the tree branches), a reduction's and a gather's messages add
//! up on the links they share. A reduction route is timed edge by edge along
//! [`Route::reduce_edges`]: an edge starts when the sender's subtree is complete, costs its runs' hops,
//! one message's serialisation and the receiver's adds, and the route ends when the root has its
//! total (plus the forward to the destination, if any): its cost is the tree's critical path,
//! `~ depth x (distance + message)`. In one step, a reduction or broadcast whose sources include
//! an earlier such route's destination waits for it (a MeshGemv row reduce after its group
//! reduces; a broadcast after its reduce).
//!
//! A route's messages are the size it was laid out for, except an attention's sums of its
//! slices' score parts (the stacked plan's `sliceD`) and their broadcasts back: each of those
//! messages holds a block's scores at the rows it holds so far (queries x rows), as the block's
//! compute counts only those rows, so the route is timed, and holds its links, for messages of
//! that size (`StepWork::carried`).
//!
//! # Link contention
//!
//! Every directed link (one per PE and direction, plus one per ordered pair of wafers) has a
//! *busy-until* cycle for the decode step, starting at 0. Routes claim links in the order the
//! schedule lists them (step by step, and within a step in its listed order, which the placer
//! chooses: see `order_in_waves` in the route pass; the executor's own send order inside a
//! step is an implementation detail and does not matter): a route starts at the
//! later of when it may start (its step's compute done, the collectives it depends on done) and
//! the busy-until of **every** link it uses; it then holds each of its links for its own bytes on
//! that link over the link's bandwidth, from its start: the link's busy-until becomes the route's
//! start plus that serialisation (a reduction's or a gather's runs over one link add up; a
//! multicast's message counts once; a collect only some of whose sources send, an MoE
//! combine gathering the chosen experts, holds the links its senders' messages cross, each for
//! the messages crossing it). So two routes sharing a link, in one step or in two steps
//! that overlap in time, serialise on it; routes on disjoint links do not wait. A link is granted
//! first come first served in that order, with no back-filling of an earlier gap (a
//! conservative rule: it never makes a step faster). A reduction with skipped edges (empty
//! attention blocks) claims only the links of the edges it sends.
//!
//! A step's time splits in three: `compute_cycles` (its busiest PE's compute), `comm_cycles`
//! (its routes from the end of the compute to the last route's end as if every link were free)
//! and `wait_cycles` (how much later the last route ends because routes waited for busy links).
//! A step that waited also names whose message held the link its longest-waiting route waited
//! for (`waited_on`, the last route to take that link), so a trace shows what to move apart.
//!
//! # The decode step's critical path, and the overlap modeled
//!
//! A step lasts its compute, communication and waiting. An instruction's steps run one after
//! another. An instruction starts when all its operands' instructions have finished (their
//! `Deliver` steps done; an expert's also waits for the router's decision, and starts when its
//! own PEs have received both multicasts, which for an expert near the dispatch point is before
//! the multicasts reach their farthest PE: `ir::wafer::arrival`; any other reader likewise
//! starts when the deliveries reaching its own PEs have reached the farthest of them, before
//! they reach readers farther out: `arrival::reader_leads`; a reader that takes no part in an
//! operand's `Deliver`, no delivery starting or ending on its PEs, waits only for the steps
//! before it: `arrival::in_place_readers`) **and** when its PEs are free. A PE is held by an
//! instruction through the steps in which it computes, not through those in which it only sends
//! or forwards: *(assumed)* its router and its asynchronous fabric operations move a message
//! while its core computes (the SDK's tasks fire on data arriving; wafer-facts.md, "How a PE
//! works"). So a PE is free once the last step in which it computed ends: a matvec's leaf tile
//! after the `Compute` step, an inner node of its reduction tree after the `Reduce`, a segment
//! whose result is still being multicast once the step that made it ends. A second expert on a
//! lane starts its gate/up as soon as the first's reduction has added up, while the first's
//! collect is on its way. Reusing a PE early never reuses its bytes early: working buffers share
//! SRAM only by the IR's dataflow (`ir::completion`), so an instruction whose buffers overlap
//! another's reads a value that waits for that one's messages anyway. But an instruction that
//! starts before an operand's producer, or the last instruction on one of its PEs, has ended
//! (a reader in place or near a delivery's source, a lane-mate) sends nothing until their routes
//! are over, and those of whatever their own starts skipped (`Timeline::routes_clear`): the
//! colouring lets routes of an instruction and of one it reads, or of experts sharing PEs, share
//! a colour where they meet (`passes::wafer::precedence`, `ir::wafer::serial`), so their
//! messages must not be on the fabric together. The wait counts as waiting (`waited_on`: that
//! instruction). Instructions on disjoint PEs whose inputs are ready overlap (the q, k and v
//! projections; the chosen experts), instructions computing on the same PEs run one after the
//! other, and overlapping instructions contend for links as above. The decode step's cycles are
//! the end of its last step. An unchosen expert takes no time, and an MoE combine's gather waits
//! only for the farthest chosen expert's message, not for the farthest expert's. The combine starts when its
//! last chosen expert is done, but each chosen expert's message leaves when its own output is
//! (`CostModel::pipelined_collect`): it arrives the farthest chosen expert's latency
//! later, and the messages queue one after another on the route's slowest link in arrival
//! order, so an expert done early (a lane-mate of another chosen expert ran after it) has its
//! message on the way, or in, while the later one computes. With every expert done together
//! the gather costs the farthest expert's latency plus every message's serialisation, as a
//! collect of all their messages at once would.
//!
//! The *critical path* is the chain of instructions that determined the step's end: from the
//! instruction ending last, each instruction's start was the end of one operand's instruction or
//! of the instruction that last held one of its PEs (an expert may start before its inputs'
//! multicasts end, when its own copy has arrived: only the part of those spans before the
//! expert's start counts). Its spans add up to the step's cycles exactly; [`LayerTime`] splits them by decoder layer into compute, communication and waiting.
//!
//! # Tokens per second and time to first token
//!
//! Modeled decode throughput is `clock_hz / cycles per token`. Prompt tokens are processed by the
//! executor as decode steps, one position at a time (the reference decoder does the same), so
//! `modeled_ttft_us` is the sum of the prompt's steps' cycles.
//!
//! **Prefill** ([`TimingReport::prefill`]) is modeled analytically instead, as the hardware would run it:
//! the prompt's `T` tokens go through the same placement as a batch, streamed: each tile computes
//! `T` dot products, each link carries `T` times the bytes, and the layers are pipelined (while
//! layer `l` works on one part of the prompt, layer `l + 1` works on the part before it). The
//! first token takes one whole decode step at position 0 (`D0`: every latency on the critical
//! path); every further token is admitted at the rate of the busiest resource:
//!
//! `prefill(T) = D0 + max over resources r of (L_r(T) - L_r(1))`
//!
//! where `L_r(T)` is the busy cycles of resource `r` over the first `T` tokens: a PE's compute (its
//! per-token compute in the decode step times `T`, except attention, which is counted per block
//! and per token from the positions the block holds: block `[s, e)` attends `min(t + 1 - s,
//! e - s)` positions for token `t`), or a link's serialisation (its bytes per token, every
//! reduction counted over all its blocks, times `T`). It is a lower estimate of a real pipeline
//! (perfect streaming, no bubbles between micro-batches) and needs `T <= max_context`.

use std::collections::BTreeMap;

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::ops::Range;

use serde::Serialize;
use waferc_ir::wafer::arrival::{multicast_depths, DepthGrid};
use waferc_ir::wafer::{
    InstrIndex, KvBlock, Pe, PeGrid, Phase, Route, RouteId, RouteKind, Run, TargetParams, WaferProgram, Work,
};

use super::error::ExecError;
use super::schedule::StepWork;
use super::{site_of, InstrRun};

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

/// How many of the busiest PEs and links, and of the costliest steps, a report lists.
const BUSIEST: usize = 10;

/// The prompt lengths a report gives the modeled prefill time for (when the KV cache holds them).
pub const PREFILL_PROMPTS: [u32; 2] = [1024, 8192];

/// One step of the schedule as it ran: what a Chrome trace shows as one slice.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepSpan {
    /// Index of the step in the program's schedule.
    pub step: usize,
    pub instr: InstrIndex,
    pub op: String,
    pub layer: Option<u32>,
    pub expert: Option<u32>,
    /// Which copy of a replicated expert ran (0: the original, or not an expert).
    #[serde(skip_serializing_if = "is_zero")]
    pub copy: u32,
    pub phase: Phase,
    pub start_cycle: u64,
    /// `compute_cycles + comm_cycles + wait_cycles`.
    pub duration_cycles: u64,
    /// The busiest PE's compute in the step.
    pub compute_cycles: u64,
    /// The step's routes as if every link were free.
    pub comm_cycles: u64,
    /// How much later the step ends because its routes waited for busy links.
    pub wait_cycles: u64,
    /// When the step waited: the instruction whose message held the link its longest-waiting
    /// route waited for (the step's own instruction when its routes queue on one another).
    pub waited_on: Option<InstrIndex>,
    /// PEs that computed in the step.
    pub pes: usize,
    /// Routes the step sent on.
    pub routes: usize,
}

/// Cycles of the decode step's critical path spent in one decoder layer (`layer: None`: the
/// embedding, the head and anything else outside the layers), split by kind.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LayerTime {
    pub layer: Option<u32>,
    /// `compute_cycles + comm_cycles + wait_cycles`.
    pub cycles: u64,
    pub compute_cycles: u64,
    pub comm_cycles: u64,
    pub wait_cycles: u64,
}

/// The modeled timing of one decode step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepTiming {
    /// The position the step fed.
    pub position: u32,
    /// The step's critical path: the end of its last schedule step.
    pub cycles: u64,
    pub spans: Vec<StepSpan>,
    /// The critical path's cycles by layer, in layer order (outside the layers first); they add
    /// up to `cycles`.
    pub layers: Vec<LayerTime>,
    /// Compute cycles of each PE that worked in the step.
    #[serde(skip)]
    pub(crate) pe_cycles: HashMap<Pe, u64>,
    /// The part of `pe_cycles` that attention's KV blocks spent (it grows with the position).
    #[serde(skip)]
    pub(crate) pe_attention_cycles: HashMap<Pe, u64>,
    /// Routes that carried messages in the step, and how many messages each.
    #[serde(skip)]
    pub(crate) active_routes: Vec<(RouteId, u32)>,
    /// The collects among `active_routes` whose senders were only some of their sources (an MoE
    /// combine's chosen experts), each with a sender, in route order.
    #[serde(skip)]
    pub(crate) active_senders: Vec<(RouteId, Pe)>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PeLoad {
    pub pe: Pe,
    /// Compute cycles per decode token.
    pub cycles: u64,
}

/// One directed link's load. The model keeps one link per ordered pair of wafers (their
/// bandwidth is the system's, not a PE's), named by PE (0, 0) of each wafer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkLoad {
    pub from: Pe,
    pub to: Pe,
    pub bytes_per_token: u64,
    /// `bytes_per_token / (link bytes per cycle x cycles per token)`.
    pub utilisation: f64,
}

/// The modeled prefill of a prompt of `prompt_tokens` tokens (module documentation, "Prefill").
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PrefillTime {
    pub prompt_tokens: u32,
    /// `None` when the program's KV cache holds fewer positions, or when the run started past
    /// position 0 (`Executor::seek`): the model starts from the step at position 0.
    pub cycles: Option<u64>,
    /// Time to first token, microseconds.
    pub ttft_us: Option<f64>,
}

/// The modeled performance of a program, for `waferc run --json` and `--trace`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TimingReport {
    pub target: String,
    pub clock_hz: f64,
    pub pes_used: usize,
    /// The position of the first step run (not 0 after `Executor::seek`): the steps below, the
    /// prompt's and the decode steps', are those from there.
    pub first_position: u32,
    /// Mean cycles of the decode steps after the prompt (the last step's when there are none).
    pub cycles_per_token: u64,
    pub modeled_decode_tok_s: f64,
    pub prompt_tokens: usize,
    /// Time to first token: the prompt's steps, one per token (positions not run are charged the
    /// last step's cycles).
    pub modeled_ttft_us: f64,
    /// Time to first token with the prompt prefilled as a batch (module documentation,
    /// "Prefill"); `None`
    /// without a prompt or when the KV cache is shorter than the prompt.
    pub modeled_ttft_prefill_us: Option<f64>,
    /// The modeled prefill of [`PREFILL_PROMPTS`].
    pub prefill: Vec<PrefillTime>,
    /// The last step's critical path by layer: compute, communication and waiting.
    pub layers: Vec<LayerTime>,
    /// Mean of `layers` over the decoder layers (`layer` is `None`).
    pub mean_layer: Option<LayerTime>,
    /// The last step's longest steps, longest first.
    pub costliest_steps: Vec<StepSpan>,
    pub busiest_pes: Vec<PeLoad>,
    pub busiest_links: Vec<LinkLoad>,
    /// The last step's schedule, step by step.
    pub steps: Vec<StepSpan>,
}

/// When a PE that works `cycles` on messages received at `received` (in the order it takes
/// them, an equal share of the work each) is done, counted from `step_start`: it starts on the
/// first at `instr_start` at the earliest, and on each once it is in and the one before is done.
fn accumulated(cycles: u64, received: &[u64], instr_start: u64, step_start: u64) -> u64 {
    if received.is_empty() {
        return cycles;
    }
    let count = received.len() as u64;
    let each = cycles / count;
    let done = received.iter().fold(instr_start, |t, &r| t.max(r) + each) + cycles % count;
    done.saturating_sub(step_start)
}

/// Dense numbering of a program's directed links: `((wafer x rows + y) x cols + x) x 4 +
/// direction` for a link leaving PE `(x, y)` (direction 0 east, 1 west, 2 south, 3 north), then
/// one per ordered pair of wafers. Vectors indexed by it stand in for maps keyed by `(Pe, Pe)`,
/// which are slow at millions of links.
#[derive(Clone, Copy, Debug)]
struct LinkIndex {
    grid: PeGrid,
}

impl LinkIndex {
    fn new(params: &TargetParams) -> Self {
        LinkIndex { grid: PeGrid::of(params) }
    }

    /// The links on the wafers: four per PE.
    fn on_wafer(&self) -> usize {
        self.grid.len() * 4
    }

    fn len(&self) -> usize {
        self.on_wafer() + self.grid.wafers() * self.grid.wafers()
    }

    fn pe_base(&self, pe: Pe) -> Option<usize> {
        self.grid.index(pe).map(|i| i * 4)
    }

    fn inter_wafer(&self, from: u16, to: u16) -> Option<usize> {
        let (f, t, wafers) = (from as usize, to as usize, self.grid.wafers());
        (f < wafers && t < wafers).then(|| self.on_wafer() + f * wafers + t)
    }

    /// The link of the one-hop step `from -> to` on a wafer (`None` off the target or for
    /// PEs that are not neighbours).
    fn hop(&self, from: Pe, to: Pe) -> Option<usize> {
        let direction = match (to.x as i32 - from.x as i32, to.y as i32 - from.y as i32) {
            (1, 0) => 0,
            (-1, 0) => 1,
            (0, 1) => 2,
            (0, -1) => 3,
            _ => return None,
        };
        if from.wafer != to.wafer {
            return None;
        }
        Some(self.pe_base(from)? + direction)
    }

    /// Calls `visit` with the index of every link of `run` (none for a malformed run or a PE off
    /// the target, which the checker rejects).
    fn for_each(&self, run: &Run, mut visit: impl FnMut(usize)) {
        if run.is_inter_wafer() {
            if let Some(index) = self.inter_wafer(run.from.wafer, run.to.wafer) {
                visit(index);
            }
            return;
        }
        let (a, b) = (run.from, run.to);
        let (direction, n) = match (a.x.cmp(&b.x), a.y.cmp(&b.y)) {
            (std::cmp::Ordering::Less, std::cmp::Ordering::Equal) => (0, b.x - a.x),
            (std::cmp::Ordering::Greater, std::cmp::Ordering::Equal) => (1, a.x - b.x),
            (std::cmp::Ordering::Equal, std::cmp::Ordering::Less) => (2, b.y - a.y),
            (std::cmp::Ordering::Equal, std::cmp::Ordering::Greater) => (3, a.y - b.y),
            _ => return,
        };
        let (dx, dy): (i32, i32) = [(1, 0), (-1, 0), (0, 1), (0, -1)][direction];
        for k in 0..n as i32 {
            let pe = Pe::new(a.wafer, (a.x as i32 + dx * k) as u16, (a.y as i32 + dy * k) as u16);
            if let Some(base) = self.pe_base(pe) {
                visit(base + direction);
            }
        }
    }

    /// The `(from, to)` PEs of link `index`.
    fn endpoints(&self, index: usize) -> (Pe, Pe) {
        if self.is_inter_wafer(index) {
            let (pair, wafers) = (index - self.on_wafer(), self.grid.wafers());
            let (from, to) = ((pair / wafers) as u16, (pair % wafers) as u16);
            return (Pe::new(from, 0, 0), Pe::new(to, 0, 0));
        }
        let from = self.grid.pe(index / 4);
        let (dx, dy): (i32, i32) = [(1, 0), (-1, 0), (0, 1), (0, -1)][index % 4];
        (from, Pe::new(from.wafer, (from.x as i32 + dx) as u16, (from.y as i32 + dy) as u16))
    }

    fn is_inter_wafer(&self, index: usize) -> bool {
        index >= self.on_wafer()
    }
}

/// Per-route communication costs, computed once per program.
#[derive(Clone, Debug)]
pub(crate) struct CostModel {
    params: TargetParams,
    routes: Vec<RouteCost>,
    /// Per route: the edges of an attention's reduction (empty otherwise), the only reductions
    /// some of whose leaves do not send (blocks with no position yet). Every other reduction is
    /// timed whole, so its edges are not kept (a stacked program's matvecs have one per tile:
    /// 0.2 GB for the 8B).
    reduce_edges: Vec<ReduceShape>,
    links: LinkIndex,
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

/// A reduction's tree edges, timed, and which runs of its path each uses.
#[derive(Clone, Debug, Default)]
struct ReduceShape {
    /// In [`Route::reduce_edges`] order.
    edges: Vec<ReduceEdge>,
    /// The root leaf ([`Route::reduce_root`]), where the tree's total ends.
    root: usize,
    /// The root's forward to the destination (none when the destination is the root): cycles
    /// and runs.
    forward: (u64, Range<usize>),
}

/// One edge of a reduction's tree: leaf `sender`'s partial to leaf `receiver`, in `cycles`, on
/// the route's runs `runs`. Compact (a stacked program's reductions have an edge per tile).
#[derive(Clone, Debug)]
struct ReduceEdge {
    receiver: u32,
    sender: u32,
    cycles: u32,
    runs: (u32, u32),
}

impl ReduceEdge {
    fn runs(&self) -> Range<usize> {
        self.runs.0 as usize..self.runs.1 as usize
    }
}

impl CostModel {
    pub(crate) fn new(program: &WaferProgram) -> Result<Self, ExecError> {
        let params = program.target.clone();
        let mut routes = Vec::with_capacity(program.routes.len());
        let mut reduce_edges = Vec::with_capacity(program.routes.len());
        let mut depths = DepthGrid::new(&params);
        for route in &program.routes {
            let (cost, shape) = route_cost(program, &params, route, |route| depths.latency(&params, route))?;
            routes.push(cost);
            let partial =
                program.instrs.get(route.instr as usize).is_some_and(|p| matches!(p.work, Work::Attention(_)));
            reduce_edges.push(if partial { shape } else { ReduceShape::default() });
        }
        Ok(CostModel { links: LinkIndex::new(&params), params, routes, reduce_edges })
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

    /// How many leading sources of reduction `route` sent, from the `messages` sent on it: the
    /// edges among the first `a` leaves of [`Route::reduce_edges`] are `a - 1` (every leaf but
    /// the root sends exactly once), plus the forward when the destination is not a leaf.
    fn reduce_leaves(route: &Route, shape: &ReduceShape, messages: u32) -> usize {
        let forward = !shape.forward.1.is_empty();
        (messages as usize + 1).saturating_sub(forward as usize).clamp(1, route.sources.len().max(1))
    }

    /// Reduction `route`'s kept edges and its leading leaves that sent, when `messages` came
    /// from fewer than all its leaves; `None` when it is timed whole (all sent, or its edges are
    /// not kept: see [`CostModel::reduce_edges`]).
    fn partial_reduction(&self, route: &Route, messages: u32) -> Option<(&ReduceShape, usize)> {
        let shape = &self.reduce_edges[route.id as usize];
        let leaves = Self::reduce_leaves(route, shape, messages);
        (leaves < route.sources.len() && !shape.edges.is_empty()).then_some((shape, leaves))
    }

    /// Cycles of route `route` carrying `messages` messages: a collect whose sources do not all
    /// send (the embedding: one table block) serialises only the messages sent (an MoE
    /// combine's, whose senders are listed, is [`CostModel::pipelined_collect`]); a
    /// reduction whose trailing leaves do not send (attention blocks with no position yet) is
    /// the critical path of the edges that do (a reduction whose edges are not kept is timed
    /// whole: see [`CostModel::reduce_edges`]).
    fn route_cycles(&self, route: &Route, messages: u32) -> u64 {
        let cost = self.routes[route.id as usize];
        match route.kind {
            RouteKind::Collect { .. } => {
                let sent = (messages as u64 * route.message_bytes as u64) as f64 / cost.bytes_per_cycle;
                cost.latency + cost.serial.min(sent.ceil() as u64)
            }
            RouteKind::Reduce { .. } => {
                let Some((shape, leaves)) = self.partial_reduction(route, messages) else { return cost.latency };
                let mut ready = vec![0u64; leaves];
                for edge in &shape.edges {
                    let (receiver, sender) = (edge.receiver as usize, edge.sender as usize);
                    if sender < leaves {
                        ready[receiver] = ready[receiver].max(ready[sender] + edge.cycles as u64);
                    }
                }
                // Only attention's reductions send from leading leaves, and they end on leaf 0.
                ready[shape.root.min(leaves - 1)] + shape.forward.0
            }
            _ => cost.latency + cost.serial,
        }
    }

    /// Cycles of route `route` (every source sending) when each message carries `elements`
    /// elements, fewer than it is sized for (an attention's score sums: a block's scores at the
    /// rows it holds so far): its cost with messages of that size, adds included.
    fn carried_cycles(&self, program: &WaferProgram, route: &Route, elements: u32) -> u64 {
        let short = carrying(route, elements);
        let multicast_latency = |route: &Route| multicast_depths(&self.params, route).map(|(latency, _)| latency);
        match route_cost(program, &self.params, &short, multicast_latency) {
            Ok((cost, _)) if matches!(route.kind, RouteKind::Reduce { .. }) => cost.latency,
            Ok((cost, _)) => cost.latency + cost.serial,
            Err(_) => self.route_cycles(route, u32::MAX),
        }
    }

    /// A collect whose senders each send one message when their value is done (`ready`, one
    /// per sender in send order), `reach` from the farthest of them: an MoE combine's gather,
    /// whose early experts' messages leave while a later expert still computes. Each message
    /// arrives `reach` after it leaves (the farthest sender's latency, for all: a bound), and the
    /// messages queue one after another on the route's slowest link, in arrival order. Returns
    /// the route's cycles from `comm_start` and the cycle each sender's message is in, in send
    /// order. With every value done at `comm_start` the cycles are [`CostModel::route_cycles`]'s
    /// `reach` plus every message's serialisation; they are never less than one message's.
    fn pipelined_collect(&self, route: &Route, reach: u64, ready: &[u64], comm_start: u64) -> (u64, Vec<u64>) {
        let cost = self.routes[route.id as usize];
        let latency = cost.latency.min(reach);
        let message = route.message_bytes as f64 / cost.bytes_per_cycle;
        let mut order: Vec<usize> = (0..ready.len()).collect();
        order.sort_by_key(|&i| (ready[i], i));
        let mut received = vec![0u64; ready.len()];
        let mut done = 0.0f64;
        for i in order {
            done = done.max((ready[i] + latency) as f64) + message;
            received[i] = done.ceil() as u64;
        }
        let last = received.iter().copied().max().unwrap_or(comm_start);
        (last.saturating_sub(comm_start).max(latency + message.ceil() as u64), received)
    }

    /// The runs of `route` that carry messages when `messages` were sent on it, each with the
    /// messages it carries.
    fn sending_runs<'r>(&'r self, route: &'r Route, messages: u32) -> impl Iterator<Item = (&'r Run, u64)> + 'r {
        // A reduction whose leaves all send uses every run: its edges' runs, then the forward's,
        // are the path in order.
        let reduce_runs: Option<Vec<Range<usize>>> = match route.kind {
            RouteKind::Reduce { .. } => self.partial_reduction(route, messages).map(|(shape, leaves)| {
                let mut ranges: Vec<Range<usize>> =
                    shape.edges.iter().filter(|e| (e.sender as usize) < leaves).map(ReduceEdge::runs).collect();
                ranges.push(shape.forward.1.clone());
                ranges
            }),
            _ => None,
        };
        let collect = matches!(route.kind, RouteKind::Collect { .. });
        let runs: Box<dyn Iterator<Item = &'r Run> + 'r> = match reduce_runs {
            Some(ranges) => Box::new(ranges.into_iter().flat_map(move |r| route.path[r].iter())),
            None => Box::new(route.path.iter()),
        };
        runs.map(move |run| {
            let carried = if collect { (run.messages as u32).min(messages) } else { run.messages as u32 };
            (run, carried as u64)
        })
    }

    /// The links a collect's messages from `senders` cross, each with their bytes there, into
    /// `out`: an in-tree's PE forwards along the first run leaving it (as [`gather_latency`]
    /// times it), so each message follows one path to the destination and crosses a link once.
    fn sender_links(&self, route: &Route, senders: impl Iterator<Item = Pe>, out: &mut Vec<(usize, u64)>) {
        let next: HashMap<Pe, (Pe, usize)> = in_tree_hops(route)
            .filter_map(|(from, (to, across))| {
                let link = if across { self.links.inter_wafer(from.wafer, to.wafer) } else { self.links.hop(from, to) };
                Some((from, (to, link?)))
            })
            .collect();
        let mut crossed: Vec<usize> = Vec::new();
        for sender in senders {
            let mut at = sender;
            // A path never visits more PEs than the tree has.
            for _ in 0..next.len() {
                let Some(&(to, link)) = next.get(&at) else { break };
                crossed.push(link);
                at = to;
            }
        }
        crossed.sort_unstable();
        out.clear();
        let bytes = route.message_bytes as u64;
        for link in crossed {
            match out.last_mut() {
                Some((last, held)) if *last == link => *held += bytes,
                _ => out.push((link, bytes)),
            }
        }
    }

    /// Cycles to push `bytes` over link `index`.
    fn serialise_link(&self, index: usize, bytes: u64) -> u64 {
        if self.links.is_inter_wafer(index) {
            (bytes as f64 / self.params.inter_wafer_bytes_per_cycle).ceil() as u64
        } else {
            bytes.div_ceil(self.params.link_bytes_per_cycle.max(1) as u64)
        }
    }

    /// Bytes each link carries per token for the routes `step` used (`all_leaves`: every
    /// reduction counted over all its sources, as for a prompt's later tokens), dense by link
    /// index. A collect with senders listed carries their messages over the links they cross
    /// (as the step's link claims take them), not every run of its tree.
    fn link_loads(&self, routes: &[Route], step: &StepTiming, all_leaves: bool) -> Vec<u64> {
        let mut load = vec![0u64; self.links.len()];
        // Which route last touched a link, so a multicast counts its message once per link.
        let mut stamp = vec![u32::MAX; self.links.len()];
        let (mut crossed, mut counted) = (Vec::new(), HashSet::default());
        let senders = &step.active_senders;
        for (n, &(id, sent)) in step.active_routes.iter().enumerate() {
            let route = &routes[id as usize];
            let first = senders.partition_point(|&(r, _)| r < id);
            let of_route = &senders[first..first + senders[first..].partition_point(|&(r, _)| r == id)];
            if !of_route.is_empty() {
                // Every run of the route (one per sequence in flight) is in its senders.
                if counted.insert(id) {
                    self.sender_links(route, of_route.iter().map(|&(_, pe)| pe), &mut crossed);
                    for &(l, bytes) in &crossed {
                        load[l] += bytes;
                    }
                }
                continue;
            }
            let messages = match (route.kind.clone(), all_leaves) {
                (RouteKind::Reduce { .. }, true) => u32::MAX,
                _ => sent,
            };
            let multicast = route.kind.is_multicast();
            let bytes = route.message_bytes as u64;
            for (run, carried) in self.sending_runs(route, messages) {
                self.links.for_each(run, |l| {
                    if multicast {
                        if stamp[l] != n as u32 {
                            stamp[l] = n as u32;
                            load[l] += bytes;
                        }
                    } else {
                        load[l] += bytes * carried;
                    }
                });
            }
        }
        load
    }
}

/// `route` with messages of `elements` f32 elements (a reduction's adds, too).
fn carrying(route: &Route, elements: u32) -> Route {
    let kind = match route.kind {
        RouteKind::Reduce { op, .. } => RouteKind::Reduce { op, elements },
        RouteKind::Statistic { .. } => RouteKind::Statistic { elements },
        ref other => other.clone(),
    };
    Route { kind, message_bytes: f32_bytes(elements), ..route.clone() }
}

/// Bytes of a message of `elements` f32 values.
fn f32_bytes(elements: u32) -> u32 {
    elements * std::mem::size_of::<f32>() as u32
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

/// A route's cost from its path (see the module documentation), and a reduction's edges.
/// `multicast_latency` is [`multicast_depths`]'s latency, computed by the caller (on a
/// [`DepthGrid`] when it costs every route).
fn route_cost(
    program: &WaferProgram,
    params: &TargetParams,
    route: &Route,
    multicast_latency: impl FnOnce(&Route) -> Result<u64, usize>,
) -> Result<(RouteCost, ReduceShape), ExecError> {
    let bytes_per_cycle = match route.path.iter().any(Run::is_inter_wafer) {
        true => params.inter_wafer_bytes_per_cycle.min(params.link_bytes_per_cycle as f64),
        false => params.link_bytes_per_cycle as f64,
    };
    let bytes = route.message_bytes as u64;
    if let RouteKind::Reduce { elements, .. } = route.kind {
        if route.sources.is_empty() {
            return Err(path_error(program, route, "the reduction has no sources".into()));
        }
        let root_leaf = route.reduce_root();
        let root = route.sources[root_leaf];
        let mut next_run = 0usize;
        // Walks the runs of one edge `from -> to`: (latency, serialisation, its runs).
        let walk = |next_run: &mut usize, from: Pe, to: Pe| -> Result<(u64, u64, Range<usize>), ExecError> {
            let (mut at, mut latency, mut serial, first) = (from, 0, 0, *next_run);
            while at != to {
                let Some(run) = route.path.get(*next_run) else {
                    return Err(path_error(program, route, format!("the path ends before {from} reaches {to}")));
                };
                if run.from != at {
                    return Err(path_error(
                        program,
                        route,
                        format!("run {next_run} starts at {}, but the edge {from} -> {to} is at {at}", run.from),
                    ));
                }
                latency += run_latency(params, run);
                serial = serial.max(serialise(params, run.from, run.to, bytes));
                at = run.to;
                *next_run += 1;
            }
            Ok((latency, serial, first..*next_run))
        };
        let add = (elements as f64 / params.f32_fma_per_cycle).ceil() as u64;
        let tree = route.reduce_edges();
        let mut shape =
            ReduceShape { root: root_leaf, edges: Vec::with_capacity(tree.len()), ..ReduceShape::default() };
        let mut ready = vec![0u64; route.sources.len()];
        for (receiver, sender) in tree {
            let (latency, serial, runs) = walk(&mut next_run, route.sources[sender], route.sources[receiver])?;
            let cycles = latency + serial + add;
            ready[receiver] = ready[receiver].max(ready[sender] + cycles);
            let narrow = |n: u64| {
                u32::try_from(n).map_err(|_| {
                    path_error(program, route, format!("edge {sender} -> {receiver} is too long to model ({n})"))
                })
            };
            shape.edges.push(ReduceEdge {
                receiver: receiver as u32,
                sender: sender as u32,
                cycles: narrow(cycles)?,
                runs: (narrow(runs.start as u64)?, narrow(runs.end as u64)?),
            });
        }
        let (mut forward, forward_start) = (0, next_run);
        for &destination in &route.destinations {
            let (latency, serial, _) = walk(&mut next_run, root, destination)?;
            forward += latency + serial;
        }
        shape.forward = (forward, forward_start..next_run);
        if next_run < route.path.len() {
            return Err(path_error(program, route, format!("run {next_run} is not on any edge of the tree")));
        }
        return Ok((RouteCost { latency: ready[root_leaf] + forward, serial: 0, bytes_per_cycle }, shape));
    }
    let mut latency = multicast_latency(route).map_err(|index| {
        let from = route.path[index].from;
        path_error(program, route, format!("run {index} starts at {from}, which no source or earlier run reaches"))
    })?;
    let serial = route.path.iter().map(|run| serialise(params, run.from, run.to, bytes * run.messages as u64)).max();
    let serial = serial.unwrap_or(0);
    if let RouteKind::Collect { .. } | RouteKind::Gather { .. } = route.kind {
        // The depths above are a multicast's (the earliest arrival at each PE); a gather's
        // messages are distinct, so the last one arrives after the longest source's path.
        latency = latency.max(gather_latency(params, route));
    }
    Ok((RouteCost { latency, serial, bytes_per_cycle }, ReduceShape::default()))
}

/// An in-tree's hop out of each PE on it: the first run leaving the PE (every message there
/// forwards along it), as (next PE, whether the hop crosses wafers).
fn in_tree_hops(route: &Route) -> impl Iterator<Item = (Pe, (Pe, bool))> {
    let mut next: HashMap<Pe, (Pe, bool)> = HashMap::default();
    for run in &route.path {
        if run.is_inter_wafer() {
            next.entry(run.from).or_insert((run.to, true));
        } else {
            for (from, to) in run.hops() {
                next.entry(from).or_insert((to, false));
            }
        }
    }
    next.into_iter()
}

/// A gather's (an in-tree's) latency: the longest path from a source along the runs to the
/// destination (each PE forwards along the first run leaving it), memoised per PE.
fn gather_latency(params: &TargetParams, route: &Route) -> u64 {
    let next: HashMap<Pe, (Pe, u64)> = in_tree_hops(route)
        .map(|(pe, (to, across))| {
            let cycles = if across { params.inter_wafer_latency_cycles } else { params.hop_latency_cycles as u64 };
            (pe, (to, cycles))
        })
        .collect();
    let mut to_end: HashMap<Pe, u64> = route.destinations.iter().map(|&pe| (pe, 0)).collect();
    let mut longest = 0;
    for &source in &route.sources {
        // Follow the tree until a PE whose remaining latency is known (or the path ends), then
        // fill in the PEs passed on the way back.
        let mut chain = Vec::new();
        let mut at = source;
        let mut known = 0;
        while chain.len() <= next.len() {
            if let Some(&rest) = to_end.get(&at) {
                known = rest;
                break;
            }
            let Some(&(to, cycles)) = next.get(&at) else { break };
            chain.push((at, cycles));
            at = to;
        }
        for (pe, cycles) in chain.into_iter().rev() {
            known += cycles;
            to_end.entry(pe).or_insert(known);
        }
        longest = longest.max(to_end.get(&source).copied().unwrap_or(known));
    }
    longest
}

/// Where an instruction ran on the timeline.
#[derive(Clone, Debug, Default)]
struct Placed {
    end: u64,
    /// The end of its steps before its trailing `Deliver` steps (its end when it has none).
    before_deliver: u64,
    /// When its routes, and those of every instruction whose end its start did not wait for,
    /// are all over ([`Timeline::routes_clear`]).
    clear: u64,
    /// The instruction whose end was this one's start (an operand's, or the last one on its PEs).
    cause: Option<InstrIndex>,
    /// Its spans in [`Timeline::spans`].
    spans: Range<usize>,
    /// Order in which instructions were placed (a cause is always placed earlier).
    order: usize,
}

/// When each PE is free, and the instruction that occupied it last: by dense grid index (every
/// instruction looks up each of its PEs), a map for a PE off the grid. A PE never occupied is
/// free from cycle 0.
struct PeFree {
    grid: PeGrid,
    dense: Vec<(u64, InstrIndex)>,
    outside: HashMap<Pe, (u64, InstrIndex)>,
}

impl PeFree {
    fn new(program: &WaferProgram) -> Self {
        let grid = PeGrid::of(&program.target);
        PeFree { grid, dense: vec![(0, 0); grid.len()], outside: HashMap::default() }
    }

    fn get(&self, pe: Pe) -> Option<(u64, InstrIndex)> {
        match self.grid.index(pe) {
            Some(i) => Some(self.dense[i]),
            None => self.outside.get(&pe).copied(),
        }
    }

    fn set(&mut self, pe: Pe, free: (u64, InstrIndex)) {
        match self.grid.index(pe) {
            Some(i) => self.dense[i] = free,
            None => {
                self.outside.insert(pe, free);
            }
        }
    }
}

/// When an instruction may begin, from its operands (each with the instruction that set it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ready {
    /// When its operands have reached its PEs.
    pub(crate) compute: (u64, Option<InstrIndex>),
    /// When the routes its operands' producers may share colours with its own are over
    /// ([`Timeline::routes_clear`]): it sends nothing before.
    pub(crate) send: (u64, Option<InstrIndex>),
}

/// The decode step's schedule as it runs: when each instruction ends, when each PE and link is
/// free.
pub(crate) struct Timeline {
    instrs: Vec<Placed>,
    placed: usize,
    pe_free: PeFree,
    /// Per link (dense [`LinkIndex`]), the cycle it is free from.
    link_busy: Vec<u64>,
    /// Per link, the instruction whose message last took it (for [`StepSpan::waited_on`]).
    link_holder: Vec<InstrIndex>,
    /// Scratch: the links one route uses, with their bytes.
    route_links: Vec<(usize, u64)>,
    spans: Vec<StepSpan>,
    pe_cycles: HashMap<Pe, u64>,
    pe_attention_cycles: HashMap<Pe, u64>,
    active_routes: Vec<(RouteId, u32)>,
    active_senders: Vec<(RouteId, Pe)>,
    /// Per destination of the current instruction's last gather with senders listed, the cycle
    /// each sender's message was in, in send order: its next step accumulates them as they come.
    received: HashMap<Pe, Vec<u64>>,
}

impl Timeline {
    pub(crate) fn new(program: &WaferProgram, costs: &CostModel) -> Self {
        Timeline {
            instrs: vec![Placed::default(); program.instrs.len()],
            placed: 0,
            pe_free: PeFree::new(program),
            link_busy: vec![0; costs.links.len()],
            link_holder: vec![0; costs.links.len()],
            route_links: Vec::new(),
            spans: Vec::with_capacity(program.schedule.len()),
            pe_cycles: HashMap::default(),
            pe_attention_cycles: HashMap::default(),
            active_routes: Vec::new(),
            active_senders: Vec::new(),
            received: HashMap::default(),
        }
    }

    pub(crate) fn instr_end(&self, instr: InstrIndex) -> u64 {
        self.instrs[instr as usize].end
    }

    /// When `instr`'s routes are over, and so are those of every instruction whose end its
    /// start did not wait for (a producer it read before the producer's deliveries ended, a
    /// lane-mate whose PEs it took once they had computed). A later instruction that starts
    /// before this instruction ends sends nothing before then: routes of instructions the
    /// colouring orders (one an operand of the other, or experts sharing PEs) may share a
    /// colour where they meet, so one's messages must be over before the other's begin.
    pub(crate) fn routes_clear(&self, instr: InstrIndex) -> u64 {
        self.instrs[instr as usize].clear
    }

    /// When `instr`'s steps before its `Deliver` ended: what a reader that takes no part in
    /// the `Deliver` waits for.
    pub(crate) fn before_deliver(&self, instr: InstrIndex) -> u64 {
        self.instrs[instr as usize].before_deliver
    }

    /// Gathers the links `route` uses when `messages` of `bytes` each were sent on it, with
    /// its bytes on each.
    fn gather_links(&mut self, costs: &CostModel, route: &Route, messages: u32, bytes: u64) {
        let multicast = route.kind.is_multicast();
        self.route_links.clear();
        for (run, carried) in costs.sending_runs(route, messages) {
            let per_link = if multicast { bytes } else { bytes * carried };
            let links = &mut self.route_links;
            costs.links.for_each(run, |l| links.push((l, per_link)));
        }
    }

    /// The gathered route of instruction `instr` may start at `earliest`: it starts when all its
    /// links are free too, and holds each for its bytes there (module documentation, "Link
    /// contention"). Returns its start and, when it waited, the instruction holding the link
    /// that freed last.
    fn occupy(
        &mut self,
        costs: &CostModel,
        instr: InstrIndex,
        multicast: bool,
        earliest: u64,
    ) -> (u64, Option<InstrIndex>) {
        let latest =
            self.route_links.iter().map(|&(l, _)| l).max_by_key(|&l| (self.link_busy[l], std::cmp::Reverse(l)));
        let start = latest.map_or(earliest, |l| self.link_busy[l].max(earliest));
        let holder = latest.filter(|_| start > earliest).map(|l| self.link_holder[l]);
        for &(l, bytes) in &self.route_links {
            self.link_holder[l] = instr;
            let cycles = costs.serialise_link(l, bytes);
            let busy = &mut self.link_busy[l];
            // A multicast's runs may share a link: its message crosses it once.
            *busy = if multicast { start + cycles } else { (*busy).max(start) + cycles };
        }
        (start, holder)
    }

    /// Communication of one step of instruction `instr` starting at `comm_start`:
    /// `(comm_cycles, wait_cycles, waited_on)` ([`StepSpan::waited_on`]).
    fn communicate(
        &mut self,
        program: &WaferProgram,
        costs: &CostModel,
        instr: InstrIndex,
        sent: &StepWork,
        comm_start: u64,
        floor: (u64, Option<InstrIndex>),
    ) -> (u64, u64, Option<InstrIndex>) {
        let (routes, senders, carried) = (&sent.routes, &sent.senders, &sent.carried);
        // Per destination PE of the reductions and broadcasts so far, the latest end with
        // contention and without: later ones starting there wait on them. (Kept as the latest
        // per PE, not a list scanned per route: a large matvec has thousands of reductions.)
        let mut collective_ends: HashMap<Pe, (u64, u64)> = HashMap::default();
        // Per route with senders listed: the latency from its farthest sender, and when each
        // sender's value was done.
        let mut reach_of: HashMap<RouteId, (u64, Vec<u64>)> = HashMap::default();
        for s in senders {
            let (farthest, ready) = reach_of.entry(s.route).or_insert((s.latency, Vec::new()));
            *farthest = (*farthest).max(s.latency);
            ready.push(s.ready);
        }
        let (mut end, mut free_end) = (comm_start, comm_start);
        // The longest wait of a route for a busy link (or for `floor`), and who held it.
        let mut longest: Option<(u64, InstrIndex)> =
            floor.1.filter(|_| floor.0 > comm_start).map(|by| (floor.0 - comm_start, by));
        for &(id, messages) in routes {
            let route = &program.routes[id as usize];
            let carried = carried.iter().find(|(r, _)| *r == id).map(|&(_, elements)| elements);
            let (cycles, received) = match (reach_of.get(&id), carried) {
                (Some((reach, ready)), _) => {
                    let (cycles, received) = costs.pipelined_collect(route, *reach, ready, comm_start);
                    (cycles, Some(received))
                }
                (None, Some(elements)) => (costs.carried_cycles(program, route, elements), None),
                (None, None) => (costs.route_cycles(route, messages), None),
            };
            let farthest = received.is_some();
            let collective = matches!(route.kind, RouteKind::Reduce { .. } | RouteKind::Statistic { .. });
            let (mut after, mut after_free) = (comm_start.max(floor.0), comm_start);
            if collective {
                for pe in &route.sources {
                    if let Some(&(e, f)) = collective_ends.get(pe) {
                        after = after.max(e);
                        after_free = after_free.max(f);
                    }
                }
            }
            match farthest {
                true => {
                    let of_route = senders.iter().filter(|s| s.route == id).map(|s| s.pe);
                    costs.sender_links(route, of_route, &mut self.route_links);
                }
                false => {
                    let bytes = carried.map_or(route.message_bytes, f32_bytes);
                    self.gather_links(costs, route, messages, bytes as u64)
                }
            }
            let (start, holder) = self.occupy(costs, instr, route.kind.is_multicast(), after);
            if let Some(holder) = holder {
                if longest.is_none_or(|(wait, _)| start - after > wait) {
                    longest = Some((start - after, holder));
                }
            }
            if collective {
                for &pe in &route.destinations {
                    let latest = collective_ends.entry(pe).or_insert((0, 0));
                    latest.0 = latest.0.max(start + cycles);
                    latest.1 = latest.1.max(after_free + cycles);
                }
            }
            if let (Some(received), Some(&destination)) = (received, route.destinations.first()) {
                // Waiting for busy links delays every message alike.
                let delay = start - after;
                self.received.insert(destination, received.into_iter().map(|r| r + delay).collect());
            }
            end = end.max(start + cycles);
            free_end = free_end.max(after_free + cycles);
        }
        let wait = end - free_end;
        (free_end - comm_start, wait, longest.filter(|_| wait > 0).map(|(_, holder)| holder))
    }

    /// Places an executed instruction's steps on the timeline: it starts at `ready.compute` (its
    /// operands' arrival, and the instruction that ended last among them) or when its PEs are
    /// free, whichever is later, and sends from `ready.send` on (or once the last instructions on
    /// its PEs have no routes left, if later), and holds each PE it computes on until the end of the last step in
    /// which it does (module documentation, "The decode step's critical path"); an unchosen
    /// expert (`worked == false`) takes no time and occupies nothing. `pes` are the PEs it may
    /// compute on: every PE of a step's compute is one of them.
    pub(crate) fn finish_instr(
        &mut self,
        program: &WaferProgram,
        costs: &CostModel,
        run: &mut InstrRun,
        worked: bool,
        ready: Ready,
        pes: &[Pe],
    ) {
        let orphan = run.take_orphan();
        if let Some(last) = run.work.last_mut() {
            for (pe, cycles) in orphan {
                *last.compute.entry(pe).or_insert(0) += cycles;
            }
        }
        let (mut at, mut cause) = ready.compute;
        let mut floor = ready.send;
        if worked {
            for pe in pes {
                if let Some((free, by)) = self.pe_free.get(*pe) {
                    if free > at {
                        (at, cause) = (free, Some(by));
                    }
                    let clear = self.instrs[by as usize].clear;
                    if clear > floor.0 {
                        floor = (clear, Some(by));
                    }
                }
            }
        }
        let placement = &program.instrs[run.instr as usize];
        let is_attention = matches!(placement.work, Work::Attention(_));
        let first_span = self.spans.len();
        let instr_start = at;
        self.received.clear();
        let mut before_deliver = at;
        // Routes claim links in the order the schedule lists them for each step.
        run.sort_sent_as_listed();
        for ((index, step), work) in run.steps.iter().zip(&run.work) {
            let (compute, routes) = (&work.compute, &work.routes);
            // A step after a gather works on each message as it comes in (an MoE combine adds
            // each chosen expert's weighted output, in expert order): only what is left once
            // the step starts counts.
            let received = std::mem::take(&mut self.received);
            let busy = |(pe, &cycles): (&Pe, &u64)| match received.get(pe) {
                Some(received) => accumulated(cycles, received, instr_start, at),
                None => cycles,
            };
            let compute_cycles = match (worked, received.is_empty()) {
                (false, _) => 0,
                // Every other step (a matvec's has a PE per tile) looks nothing up.
                (true, true) => compute.values().copied().max().unwrap_or(0),
                (true, false) => compute.iter().map(busy).max().unwrap_or(0),
            };
            let (comm_cycles, wait_cycles, waited_on) = match worked && !routes.is_empty() {
                true => self.communicate(program, costs, run.instr, work, at + compute_cycles, floor),
                false => (0, 0, None),
            };
            let duration = compute_cycles + comm_cycles + wait_cycles;
            self.spans.push(StepSpan {
                step: *index,
                instr: run.instr,
                op: placement.op.clone(),
                layer: placement.layer,
                expert: placement.expert,
                copy: run.copy,
                phase: step.phase,
                start_cycle: at,
                duration_cycles: duration,
                compute_cycles,
                comm_cycles,
                wait_cycles,
                waited_on,
                pes: compute.len(),
                routes: routes.len(),
            });
            at += duration;
            if worked {
                for &pe in compute.keys() {
                    self.pe_free.set(pe, (at, run.instr));
                }
            }
            if step.phase != Phase::Deliver {
                before_deliver = at;
            }
            if worked {
                for (&pe, &cycles) in compute {
                    *self.pe_cycles.entry(pe).or_insert(0) += cycles;
                    if is_attention {
                        *self.pe_attention_cycles.entry(pe).or_insert(0) += cycles;
                    }
                }
                self.active_routes.extend_from_slice(routes);
                self.active_senders.extend(work.senders.iter().map(|s| (s.route, s.pe)));
            }
        }
        let clear = at.max(if worked { floor.0 } else { 0 });
        self.instrs[run.instr as usize] =
            Placed { end: at, before_deliver, clear, cause, spans: first_span..self.spans.len(), order: self.placed };
        self.placed += 1;
    }

    pub(crate) fn into_step_timing(mut self, position: u32) -> StepTiming {
        let cycles = self.spans.iter().map(|s| s.start_cycle + s.duration_cycles).max().unwrap_or(0);
        // The critical path: from the instruction placed last among those ending last.
        let mut layers: BTreeMap<Option<u32>, LayerTime> = BTreeMap::new();
        let mut at = (0..self.instrs.len())
            .filter(|&i| !self.instrs[i].spans.is_empty() && self.instrs[i].end == cycles)
            .max_by_key(|&i| self.instrs[i].order);
        // Where the instruction after this one on the path started: an expert may start before
        // its inputs' multicasts end (`ir::wafer::arrival`), so only the part of a span before it counts.
        let mut until = cycles;
        while let Some(i) = at {
            let placed = &self.instrs[i];
            for span in &self.spans[placed.spans.clone()] {
                let layer =
                    layers.entry(span.layer).or_insert_with(|| LayerTime { layer: span.layer, ..LayerTime::default() });
                // A span is its compute, then its communication, then its waiting.
                let mut left = until.saturating_sub(span.start_cycle).min(span.duration_cycles);
                layer.cycles += left;
                for (part, total) in [
                    (span.compute_cycles, &mut layer.compute_cycles),
                    (span.comm_cycles, &mut layer.comm_cycles),
                    (span.wait_cycles, &mut layer.wait_cycles),
                ] {
                    *total += part.min(left);
                    left -= part.min(left);
                }
            }
            until = self.spans.get(placed.spans.start).map_or(until, |s| s.start_cycle);
            at = placed.cause.map(|c| c as usize).filter(|&c| self.instrs[c].order < placed.order);
        }
        StepTiming {
            position,
            cycles,
            spans: self.spans,
            layers: layers.into_values().collect(),
            pe_cycles: self.pe_cycles,
            pe_attention_cycles: self.pe_attention_cycles,
            active_routes: self.active_routes,
            active_senders: {
                self.active_senders.sort_unstable();
                self.active_senders
            },
        }
    }
}

/// Attention's compute on one KV block for a step in which it holds `n` positions (the same
/// charges as `ops::attention`, without the append): scores, exponentials and sums, weighted
/// values, in exact (unrounded) cycles.
fn attention_position_cycles(params: &TargetParams, group: u64, head_dim: u64) -> f64 {
    let slots = 2 * group * head_dim + group * (1 + EXP_FLOPS + 1 + DIVIDE_FLOPS);
    slots as f64 / params.f32_fma_per_cycle
}

/// Positions `block` attends, summed over the prompt's tokens `0..tokens`: token `t` attends
/// every row the block holds up to `t`, so each held row `r` is attended by `tokens - r` tokens.
fn attended_positions(block: &KvBlock, tokens: u32) -> u64 {
    block.rows_below(tokens).map(|row| (tokens - row) as u64).sum()
}

/// The prefill model over one decode step (module documentation, "Prefill").
pub(crate) struct Prefill<'a> {
    program: &'a WaferProgram,
    costs: &'a CostModel,
    /// The decode step at position 0.
    first_cycles: u64,
    /// Any decode step: its per-PE compute.
    last: &'a StepTiming,
    /// The busiest link's serialisation per token, every reduction over all its sources.
    link_cycles: u64,
}

impl<'a> Prefill<'a> {
    pub(crate) fn new(
        program: &'a WaferProgram,
        costs: &'a CostModel,
        first_cycles: u64,
        last: &'a StepTiming,
    ) -> Self {
        let loads = costs.link_loads(&program.routes, last, true);
        let link_cycles = loads
            .iter()
            .enumerate()
            .filter(|(_, &b)| b > 0)
            .map(|(l, &b)| costs.serialise_link(l, b))
            .max()
            .unwrap_or(0);
        Prefill { program, costs, first_cycles, last, link_cycles }
    }

    /// Modeled cycles to prefill a prompt of `tokens` tokens; `None` when the KV cache holds
    /// fewer positions.
    pub(crate) fn cycles(&self, tokens: u32) -> Option<u64> {
        let (program, last) = (self.program, self.last);
        if tokens > program.max_context {
            return None;
        }
        if tokens <= 1 {
            return Some(self.first_cycles * tokens as u64);
        }
        let params = &program.target;
        let later = (tokens - 1) as u64;
        // Attention per PE over the prompt's tokens, and over the first token alone.
        let mut attention: HashMap<Pe, (f64, f64)> = HashMap::default();
        for placement in &program.instrs {
            let Work::Attention(p) = &placement.work else { continue };
            // A block computes for the query heads its KV head's placement serves, on its dims.
            let blocks = p.kv_heads_placed.iter().flat_map(|kh| {
                let dims = (kh.dims.end - kh.dims.start) as u64;
                kh.blocks.iter().map(move |b| (kh.query_count(), dims, b))
            });
            for (queries, dims, block) in blocks {
                let append = self.costs.flops(2 * dims) as f64;
                let per_position = attention_position_cycles(params, queries, dims);
                let appended = |tokens: u32| block.held_below(tokens);
                let load = |tokens: u32| {
                    attended_positions(block, tokens) as f64 * per_position + appended(tokens) as f64 * append
                };
                let entry = attention.entry(block.pe).or_insert((0.0, 0.0));
                entry.0 += load(tokens);
                entry.1 += load(1);
            }
        }
        let mut busiest = (later * self.link_cycles) as f64;
        for (pe, &cycles) in &last.pe_cycles {
            let other = cycles.saturating_sub(last.pe_attention_cycles.get(pe).copied().unwrap_or(0)) as f64;
            let (all, first) = attention.get(pe).copied().unwrap_or((0.0, 0.0));
            busiest = busiest.max(later as f64 * other + (all - first));
        }
        for &(all, first) in attention.values() {
            busiest = busiest.max(all - first);
        }
        Some(self.first_cycles + busiest.ceil() as u64)
    }
}

/// The report over the steps run so far (`history`: cycles by position from `first_position`;
/// `last`: the last step).
pub(crate) fn report(
    program: &WaferProgram,
    costs: &CostModel,
    history: &[u64],
    last: &StepTiming,
    prompt_tokens: usize,
    first_position: u32,
) -> TimingReport {
    let params = &program.target;
    let decode = history.get(prompt_tokens..).unwrap_or(&[]);
    let cycles_per_token = match decode.len() {
        0 => last.cycles,
        n => (decode.iter().sum::<u64>() as f64 / n as f64).round() as u64,
    }
    .max(1);
    let run_prompt = prompt_tokens.min(history.len());
    let ttft_cycles = history[..run_prompt].iter().sum::<u64>() + (prompt_tokens - run_prompt) as u64 * last.cycles;
    let micros = |cycles: u64| cycles as f64 / params.clock_hz * 1e6;

    let first_cycles = history.first().copied().unwrap_or(last.cycles);
    let model = Prefill::new(program, costs, first_cycles, last);
    // The model starts from the step at position 0, which a run that sought past it lacks.
    let prefill = |tokens: u32| model.cycles(tokens).filter(|_| first_position == 0);
    let modeled_ttft_prefill_us = (prompt_tokens > 0).then(|| prefill(prompt_tokens as u32)).flatten().map(micros);
    let prefill = PREFILL_PROMPTS
        .iter()
        .map(|&tokens| {
            let cycles = prefill(tokens);
            PrefillTime { prompt_tokens: tokens, cycles, ttft_us: cycles.map(micros) }
        })
        .collect();

    let decoder_layers: Vec<&LayerTime> = last.layers.iter().filter(|l| l.layer.is_some()).collect();
    let mean_layer = (!decoder_layers.is_empty()).then(|| {
        let n = decoder_layers.len() as f64;
        let mean =
            |f: fn(&LayerTime) -> u64| (decoder_layers.iter().map(|l| f(l)).sum::<u64>() as f64 / n).round() as u64;
        LayerTime {
            layer: None,
            cycles: mean(|l| l.cycles),
            compute_cycles: mean(|l| l.compute_cycles),
            comm_cycles: mean(|l| l.comm_cycles),
            wait_cycles: mean(|l| l.wait_cycles),
        }
    });
    let mut costliest_steps = last.spans.clone();
    costliest_steps.sort_by(|a, b| b.duration_cycles.cmp(&a.duration_cycles).then(a.step.cmp(&b.step)));
    costliest_steps.truncate(BUSIEST);

    let mut busiest_pes: Vec<PeLoad> = last.pe_cycles.iter().map(|(&pe, &cycles)| PeLoad { pe, cycles }).collect();
    busiest_pes.sort_by(|a, b| b.cycles.cmp(&a.cycles).then(a.pe.cmp(&b.pe)));
    busiest_pes.truncate(BUSIEST);

    let loads = costs.link_loads(&program.routes, last, false);
    let mut loaded: Vec<(u64, (Pe, Pe), usize)> =
        loads.iter().enumerate().filter(|(_, &b)| b > 0).map(|(l, &b)| (b, costs.links.endpoints(l), l)).collect();
    loaded.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    loaded.truncate(BUSIEST);
    let busiest_links = loaded
        .into_iter()
        .map(|(bytes, (from, to), l)| {
            let per_cycle = match costs.links.is_inter_wafer(l) {
                true => params.inter_wafer_bytes_per_cycle,
                false => params.link_bytes_per_cycle as f64,
            };
            LinkLoad {
                from,
                to,
                bytes_per_token: bytes,
                utilisation: bytes as f64 / (per_cycle * cycles_per_token as f64),
            }
        })
        .collect();

    TimingReport {
        target: params.name.clone(),
        clock_hz: params.clock_hz,
        pes_used: program.pes.len(),
        first_position,
        cycles_per_token,
        modeled_decode_tok_s: params.clock_hz / cycles_per_token as f64,
        prompt_tokens,
        modeled_ttft_us: micros(ttft_cycles),
        modeled_ttft_prefill_us,
        prefill,
        layers: last.layers.clone(),
        mean_layer,
        costliest_steps,
        busiest_pes,
        busiest_links,
        steps: last.spans.clone(),
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use waferc_ir::wafer::{Lanes, RouteKind};

    /// A block attends each row it holds once per prompt token from that row on: a whole block
    /// of 32 rows from row 64, over 80 tokens, 16 rows seen 16..1 times; a chunk's lane groups
    /// together attend what the whole chunk does, for every prompt length.
    #[test]
    fn lane_groups_attend_what_their_chunk_does() {
        let block = |lanes| KvBlock { pe: Pe::new(0, 0, 0), positions: 64..96, lanes, region: 0 };
        assert_eq!(attended_positions(&block(Lanes::ALL), 80), 16 * 17 / 2);
        assert_eq!(attended_positions(&block(Lanes::ALL), 200), 32 * (200 - 64) - 32 * 31 / 2);
        for tokens in [0, 1, 64, 65, 70, 95, 96, 97, 500] {
            let whole = attended_positions(&block(Lanes::ALL), tokens);
            for groups in [2u8, 4, 8] {
                let split: u64 = (0..groups).map(|g| attended_positions(&block(Lanes::group(g, groups)), tokens)).sum();
                assert_eq!(split, whole, "{groups} groups, {tokens} tokens");
            }
        }
    }

    /// A collect's in-tree on a 6 x 6 grid into (5, 0): sources (0, 0) and (0, 2) go east along
    /// their rows to column 5, (0, 2)'s message then north to the destination, and (0, 4)'s
    /// joins it at (5, 2).
    fn in_tree() -> Route {
        let pe = |x, y| Pe::new(0, x, y);
        let run = |from, to, messages| Run { from, to, messages };
        Route {
            id: 0,
            instr: 0,
            kind: RouteKind::Collect { elements: 0..32 },
            colour: 0,
            sources: vec![pe(0, 0), pe(0, 2), pe(0, 4)],
            destinations: vec![pe(5, 0)],
            path: vec![
                run(pe(0, 0), pe(5, 0), 1),
                run(pe(0, 2), pe(5, 2), 1),
                run(pe(0, 4), pe(5, 4), 1),
                run(pe(5, 4), pe(5, 2), 1),
                run(pe(5, 2), pe(5, 0), 2),
            ],
            message_bytes: 128,
        }
    }

    fn costs() -> CostModel {
        let params = waferc_targets::Target::grid(6, 6).params();
        CostModel { links: LinkIndex::new(&params), params, routes: Vec::new(), reduce_edges: Vec::new() }
    }

    /// A gather's messages leave when their values are done and queue on the slowest link in
    /// arrival order: all done at the step's start, it is the farthest latency plus every
    /// message; done early, only what arrives after the others have gone is left.
    #[test]
    fn a_gather_from_senders_done_early_ends_sooner() {
        let route = in_tree();
        // 9 hops from the farthest sender; a 128-byte message is 32 cycles at 4 bytes a cycle.
        let costs = CostModel { routes: vec![RouteCost { latency: 9, serial: 96, bytes_per_cycle: 4.0 }], ..costs() };
        let cycles = |ready: &[u64], start| costs.pipelined_collect(&route, 9, ready, start).0;
        assert_eq!(cycles(&[100, 100, 100], 100), 9 + 3 * 32);
        // Two done long before: theirs are in; the last one's latency and message are left.
        assert_eq!(cycles(&[0, 100, 0], 100), 9 + 32);
        // Done a little before: they queue, each behind the one before.
        assert_eq!(cycles(&[95, 100, 90], 100), (90 + 9 + 3 * 32) - 100);
        // Never less than one message, however early.
        assert_eq!(cycles(&[0, 0, 0], 1000), 9 + 32);
        // Each sender's message is in when the queue has taken it, in send order.
        let (_, received) = costs.pipelined_collect(&route, 9, &[100, 0, 95], 100);
        // In by readiness: the second at 0 + 9 + 32, the third at 95 + 9 + 32, then the first.
        assert_eq!(received, [136 + 32, 41, 95 + 9 + 32]);
    }

    /// Work on messages as they come in: each share starts once its message is in and the share
    /// before is done, never before the instruction starts; only what is left at the step's
    /// start counts.
    #[test]
    fn work_on_received_messages_counts_only_what_is_left() {
        // Three messages of 100 cycles' work, all in at 500 when the step starts: all of it.
        assert_eq!(accumulated(300, &[500, 500, 500], 0, 500), 300);
        // In early, in order: done while they came in, but not before the instruction started.
        assert_eq!(accumulated(300, &[10, 20, 30], 400, 500), 300 + 400 - 500);
        assert_eq!(accumulated(300, &[10, 20, 30], 0, 500), 0);
        // The first in last: the others wait for it (the order is the sum's).
        assert_eq!(accumulated(300, &[500, 10, 20], 0, 500), 300);
        assert_eq!(accumulated(300, &[10, 20, 500], 0, 500), 100);
        // The remainder of an uneven split goes last; no messages: all of it.
        assert_eq!(accumulated(301, &[10, 20, 500], 0, 500), 101);
        assert_eq!(accumulated(300, &[], 0, 500), 300);
    }

    #[test]
    fn a_partial_collect_holds_only_the_links_its_senders_cross() {
        let (costs, route) = (costs(), in_tree());
        let pe = |x, y| Pe::new(0, x, y);
        let mut links = Vec::new();
        // (0, 4) alone: 5 hops east, then 4 north; nothing on row 0 or row 2's eastward run.
        costs.sender_links(&route, [pe(0, 4)].into_iter(), &mut links);
        assert_eq!(links.len(), 9);
        assert!(links.iter().all(|&(_, bytes)| bytes == 128));
        let ends: Vec<(Pe, Pe)> = links.iter().map(|&(l, _)| costs.links.endpoints(l)).collect();
        assert!(ends.contains(&(pe(5, 1), pe(5, 0))) && !ends.iter().any(|(from, _)| from.y == 0));
        // With (0, 2) too, the links north of (5, 2) carry both messages.
        costs.sender_links(&route, [pe(0, 4), pe(0, 2)].into_iter(), &mut links);
        let shared: Vec<u64> = (links.iter())
            .filter(|&&(l, _)| matches!(costs.links.endpoints(l), (from, _) if from.x == 5 && from.y <= 2))
            .map(|&(_, bytes)| bytes)
            .collect();
        assert_eq!(shared, [256, 256]);
        assert_eq!(links.len(), 14);
    }

    /// The per-token link loads (the report's busiest links, the prefill's busiest link) count
    /// a partial collect's messages where its senders' paths go, as its link claims do.
    #[test]
    fn link_loads_follow_a_partial_collects_senders() {
        let (costs, route) = (costs(), in_tree());
        let pe = |x, y| Pe::new(0, x, y);
        let step = StepTiming {
            position: 0,
            cycles: 0,
            spans: Vec::new(),
            layers: Vec::new(),
            pe_cycles: HashMap::default(),
            pe_attention_cycles: HashMap::default(),
            active_routes: vec![(0, 2)],
            active_senders: vec![(0, pe(0, 2)), (0, pe(0, 4))],
        };
        for all_leaves in [false, true] {
            let loads = costs.link_loads(std::slice::from_ref(&route), &step, all_leaves);
            let mut crossed = Vec::new();
            costs.sender_links(&route, [pe(0, 2), pe(0, 4)].into_iter(), &mut crossed);
            let loaded: Vec<(usize, u64)> =
                loads.iter().enumerate().filter(|(_, &b)| b > 0).map(|(l, &b)| (l, b)).collect();
            assert_eq!(loaded, crossed);
            // Row 0 sent nothing; its run, which the tree lists, carries nothing.
            assert!(loaded.iter().all(|&(l, _)| costs.links.endpoints(l).0.y != 0));
        }
    }
}
