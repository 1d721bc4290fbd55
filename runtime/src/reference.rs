//! The reference CPU decoder: interprets a module's instruction list in order, one position per
//! step, with the kernels of [`crate::kernels`]. It is the oracle the wafer executor is checked
//! against bit for bit, so it does nothing clever: prompts are processed one step per token (no
//! separate prefill kernel), exactly as the executor does.

use std::time::{Duration, Instant};

use waferc_ir::{Instr, Module, Op, Value, ValueType};

use crate::error::{RuntimeError, Site};
use crate::kernels::{self, AttentionShape, RopeAngles, Routing, WeightView};

/// A decoder that turns one token at the next position into that position's logits row.
/// [`generate`] drives any of them.
pub trait Decoder {
    /// Feeds `token` at [`Decoder::position`], appending to the KV caches, and returns the logits.
    fn step(&mut self, token: u32) -> Result<Vec<f32>, RuntimeError>;
    /// Positions fed so far.
    fn position(&self) -> usize;
    /// Forgets every position.
    fn reset(&mut self);
}

/// One layer's KV cache contents, `[position][kv_head][head_dim]`.
#[derive(Clone, Debug, Default)]
struct CacheState {
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// An instruction's value during a step, and after it as [`ReferenceDecoder::last_values`]
/// records it (the wafer executor reports the same, so the two can be compared instruction by
/// instruction).
#[derive(Clone, Debug, PartialEq)]
pub enum InstrValue {
    Tensor(Vec<f32>),
    Routing(Routing),
    /// Computed from an expert the routing did not choose: skipped, costs nothing.
    Absent,
}

impl InstrValue {
    fn kind(&self) -> &'static str {
        match self {
            InstrValue::Tensor(_) => "a tensor",
            InstrValue::Routing(_) => "a routing",
            InstrValue::Absent => "absent",
        }
    }
}

#[derive(Clone, Debug)]
pub struct ReferenceDecoder {
    module: Module,
    /// Every instruction's value of the last step, when recording ([`Self::record_values`]).
    last_values: Option<Vec<InstrValue>>,
    record_values: bool,
    max_context: usize,
    position: usize,
    caches: Vec<CacheState>,
    /// Distinct rotary frequency tables of the module (one per `(head_dim, rope)`).
    rope_tables: Vec<kernels::RopeTable>,
    /// For each instruction, the index in `rope_tables` if it is a `rope`.
    rope_table_of: Vec<Option<usize>>,
}

impl ReferenceDecoder {
    /// Verifies the module and checks that every weight an op reads has data of a supported
    /// type and the right byte length. `max_context` bounds the positions [`Self::step`] accepts.
    pub fn new(module: &Module, max_context: usize) -> Result<Self, RuntimeError> {
        waferc_ir::verify(module)?;
        for (_, instr) in module.body.iter() {
            for weight in instr.op.weights() {
                WeightView::new(&module.weights[weight])?;
            }
        }
        let mut rope_keys: Vec<(u32, &waferc_ir::Rope)> = Vec::new();
        let mut rope_table_of = Vec::with_capacity(module.body.len());
        for (_, instr) in module.body.iter() {
            rope_table_of.push(match &instr.op {
                Op::Rope { head_dim, rope, .. } => {
                    let key = (*head_dim, rope);
                    Some(rope_keys.iter().position(|k| *k == key).unwrap_or_else(|| {
                        rope_keys.push(key);
                        rope_keys.len() - 1
                    }))
                }
                _ => None,
            });
        }
        let rope_tables = rope_keys.iter().map(|(dim, rope)| kernels::rope_frequencies(*dim as usize, rope)).collect();
        Ok(ReferenceDecoder {
            module: module.clone(),
            last_values: None,
            record_values: false,
            max_context,
            position: 0,
            caches: vec![CacheState::default(); module.caches.len()],
            rope_tables,
            rope_table_of,
        })
    }

    pub fn module(&self) -> &Module {
        &self.module
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Whether to keep every instruction's value of each step (off by default: it copies them).
    pub fn record_values(&mut self, record: bool) {
        self.record_values = record;
        self.last_values = None;
    }

    /// Every instruction's value of the last successful step, indexed by value, when recording.
    pub fn last_values(&self) -> Option<&[InstrValue]> {
        self.last_values.as_deref()
    }

    /// Feeds `token` at the next position and returns that position's logits row.
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>, RuntimeError> {
        if self.position >= self.max_context {
            return Err(RuntimeError::ContextFull { position: self.position, max_context: self.max_context });
        }
        // The whole step runs on a rayon worker (`scope` moves it there when called from outside
        // the pool), so each kernel's parallel loop forks within the pool instead of handing
        // every op to it from this thread and sleeping until it is done.
        match rayon::scope(|_| self.run(token)) {
            Ok(logits) => {
                self.position += 1;
                Ok(logits)
            }
            Err(error) => {
                // Undo this step's cache appends so the decoder stays at a consistent position.
                for (handle, cache) in self.module.caches.iter() {
                    let row = cache.kv_heads as usize * cache.head_dim as usize;
                    let state = &mut self.caches[handle.index()];
                    state.keys.truncate(self.position * row);
                    state.values.truncate(self.position * row);
                }
                Err(error)
            }
        }
    }

    pub fn position(&self) -> usize {
        self.position
    }

    pub fn reset(&mut self) {
        self.position = 0;
        self.last_values = None;
        for state in &mut self.caches {
            state.keys.clear();
            state.values.clear();
        }
    }

    fn run(&mut self, token: u32) -> Result<Vec<f32>, RuntimeError> {
        let angles: Vec<RopeAngles> =
            self.rope_tables.iter().map(|freqs| RopeAngles::new(freqs, self.position)).collect();
        let mut slots: Vec<InstrValue> = Vec::with_capacity(self.module.body.len());
        for (handle, instr) in self.module.body.iter() {
            let mut step = Step {
                module: &self.module,
                caches: &mut self.caches,
                position: self.position,
                token,
                slots: &slots,
                site: Site { value: handle.index(), op: instr.op.name(), layer: instr.layer },
            };
            let angles = self.rope_table_of[handle.index()].map(|t| &angles[t]);
            let slot = step.eval(instr, angles)?;
            slots.push(slot);
        }
        if self.record_values {
            self.last_values = Some(slots.clone());
        }
        let output = self.module.output.ok_or(waferc_ir::IrError::NoOutput)?;
        match std::mem::replace(&mut slots[output.index()], InstrValue::Absent) {
            InstrValue::Tensor(logits) => Ok(logits),
            InstrValue::Absent => Err(RuntimeError::AbsentOutput { value: output.index() }),
            InstrValue::Routing(_) => Err(RuntimeError::OperandKind {
                site: Site { value: output.index(), op: "output", layer: None },
                operand: output.index(),
                expected: "a tensor",
                found: "a routing",
            }),
        }
    }
}

impl Decoder for ReferenceDecoder {
    fn step(&mut self, token: u32) -> Result<Vec<f32>, RuntimeError> {
        ReferenceDecoder::step(self, token)
    }
    fn position(&self) -> usize {
        self.position
    }
    fn reset(&mut self) {
        ReferenceDecoder::reset(self)
    }
}

/// Everything one instruction's evaluation reads.
struct Step<'a> {
    module: &'a Module,
    caches: &'a mut [CacheState],
    position: usize,
    token: u32,
    slots: &'a [InstrValue],
    site: Site,
}

/// An operand the absence check has already vouched for.
fn present(operand: Option<&[f32]>) -> &[f32] {
    operand.expect("absent operands were handled before evaluation")
}

impl<'a> Step<'a> {
    /// A tensor operand, `None` if it is absent.
    fn tensor(&self, value: Value) -> Result<Option<&'a [f32]>, RuntimeError> {
        let slots: &'a [InstrValue] = self.slots;
        match &slots[value.index()] {
            InstrValue::Tensor(t) => Ok(Some(t)),
            InstrValue::Absent => Ok(None),
            other => Err(self.kind_error(value, "a tensor", other)),
        }
    }

    fn routing(&self, value: Value) -> Result<Option<&'a Routing>, RuntimeError> {
        let slots: &'a [InstrValue] = self.slots;
        match &slots[value.index()] {
            InstrValue::Routing(r) => Ok(Some(r)),
            InstrValue::Absent => Ok(None),
            other => Err(self.kind_error(value, "a routing", other)),
        }
    }

    fn kind_error(&self, value: Value, expected: &'static str, found: &InstrValue) -> RuntimeError {
        RuntimeError::OperandKind { site: self.site.clone(), operand: value.index(), expected, found: found.kind() }
    }

    fn weight(&self, handle: waferc_ir::Handle<waferc_ir::Weight>) -> Result<WeightView<'_>, RuntimeError> {
        WeightView::new(&self.module.weights[handle])
    }

    fn eval(&mut self, instr: &Instr, angles: Option<&RopeAngles>) -> Result<InstrValue, RuntimeError> {
        // Absent in, absent out: an unchosen expert's ops are skipped. Attention cannot skip
        // (it must append to its cache every step); expert_combine reads absence as "not chosen".
        if !matches!(instr.op, Op::ExpertCombine { .. }) {
            for operand in instr.op.operands() {
                if matches!(self.slots[operand.index()], InstrValue::Absent) {
                    if matches!(instr.op, Op::Attention { .. }) {
                        return Err(RuntimeError::AbsentOperand { site: self.site.clone(), operand: operand.index() });
                    }
                    return Ok(InstrValue::Absent);
                }
            }
        }
        let out_len = match &instr.ty {
            ValueType::Tensor(t) => t.elements() as usize,
            ValueType::Routing { .. } => 0,
        };
        let slot = match &instr.op {
            Op::Embed { table } => {
                let view = self.weight(*table)?;
                let token = self.token as usize;
                if token >= view.rows() {
                    return Err(RuntimeError::TokenOutOfRange {
                        site: self.site.clone(),
                        token: self.token,
                        table: self.module.weights[*table].name.clone(),
                        rows: view.rows(),
                    });
                }
                InstrValue::Tensor(view.row(token).widen())
            }
            Op::RmsNorm { x, weight, eps } => {
                let x = present(self.tensor(*x)?);
                let scale = self.weight(*weight)?.widen_vector();
                let mut out = vec![0.0; out_len];
                kernels::rms_norm(x, &scale, *eps, &mut out);
                InstrValue::Tensor(out)
            }
            Op::MatVec { x, weight, bias } => {
                let x = present(self.tensor(*x)?);
                let view = self.weight(*weight)?;
                let bias = bias.map(|b| self.weight(b).map(|v| v.widen_vector())).transpose()?;
                let mut out = vec![0.0; out_len];
                kernels::matvec(x, &view, bias.as_deref(), &mut out);
                InstrValue::Tensor(out)
            }
            Op::Rope { x, .. } => {
                let x = present(self.tensor(*x)?);
                let angles = angles.expect("every rope instruction has a frequency table");
                let mut out = vec![0.0; out_len];
                kernels::rope(x, angles, &mut out);
                InstrValue::Tensor(out)
            }
            Op::Attention { q, k, v, cache, heads, scale, window, sinks } => {
                let (q, k, v) = (present(self.tensor(*q)?), present(self.tensor(*k)?), present(self.tensor(*v)?));
                let spec = &self.module.caches[*cache];
                let shape = AttentionShape {
                    heads: *heads as usize,
                    kv_heads: spec.kv_heads as usize,
                    head_dim: spec.head_dim as usize,
                };
                let sinks = sinks.map(|s| self.weight(s).map(|v| v.widen_vector())).transpose()?;
                // A windowed cache keeps `window` rows, position t in row t % window.
                let rows = window.map_or(usize::MAX, |w| w as usize);
                let state = &mut self.caches[cache.index()];
                if state.keys.len() != self.position.min(rows) * shape.kv_row() {
                    return Err(RuntimeError::CacheOutOfStep {
                        site: self.site.clone(),
                        cache: cache.index(),
                        cache_layer: spec.layer,
                        found: state.keys.len() / shape.kv_row(),
                        position: self.position,
                    });
                }
                if self.position < rows {
                    state.keys.extend_from_slice(k);
                    state.values.extend_from_slice(v);
                } else {
                    let row = (self.position % rows) * shape.kv_row()..(self.position % rows + 1) * shape.kv_row();
                    state.keys[row.clone()].copy_from_slice(k);
                    state.values[row].copy_from_slice(v);
                }
                let mut out = vec![0.0; out_len];
                kernels::attention(q, &state.keys, &state.values, shape, *scale, sinks.as_deref(), &mut out);
                InstrValue::Tensor(out)
            }
            Op::Silu { x } => InstrValue::Tensor(kernels::silu(present(self.tensor(*x)?))),
            Op::Mul { a, b } => InstrValue::Tensor(kernels::mul(present(self.tensor(*a)?), present(self.tensor(*b)?))),
            Op::Add { a, b } => InstrValue::Tensor(kernels::add(present(self.tensor(*a)?), present(self.tensor(*b)?))),
            Op::SwiGlu { gate, up, alpha, limit } => InstrValue::Tensor(kernels::swiglu(
                present(self.tensor(*gate)?),
                present(self.tensor(*up)?),
                *alpha,
                *limit,
            )),
            Op::RouterTopK { logits, top_k, normalize } => {
                InstrValue::Routing(kernels::router_topk(present(self.tensor(*logits)?), *top_k as usize, *normalize))
            }
            Op::ExpertDispatch { x, routing, expert } => {
                let routing = self.routing(*routing)?.expect("absent operands were handled before evaluation");
                match routing.weight_of(*expert) {
                    Some(_) => InstrValue::Tensor(present(self.tensor(*x)?).to_vec()),
                    None => InstrValue::Absent,
                }
            }
            Op::Slice { x, offset, len } => {
                let x = present(self.tensor(*x)?);
                InstrValue::Tensor(x[*offset as usize..(*offset + *len) as usize].to_vec())
            }
            Op::ExpertCombine { routing, experts } => {
                let Some(routing) = self.routing(*routing)? else { return Ok(InstrValue::Absent) };
                let mut weighted = Vec::with_capacity(routing.chosen.len());
                for &(expert, weight) in &routing.chosen {
                    let operand = experts[expert as usize];
                    let output = self.tensor(operand)?.ok_or_else(|| RuntimeError::ChosenExpertAbsent {
                        site: self.site.clone(),
                        expert,
                        operand: operand.index(),
                    })?;
                    weighted.push((weight, output));
                }
                let mut out = vec![0.0; out_len];
                kernels::expert_combine(&weighted, &mut out);
                InstrValue::Tensor(out)
            }
        };
        Ok(slot)
    }
}

/// The result of [`generate`].
#[derive(Clone, Debug, Default)]
pub struct Generation {
    /// The generated (or forced) tokens, prompt excluded; ends with a stop token if one was hit.
    pub tokens: Vec<u32>,
    /// `logits[i]` is the row `tokens[i]` was chosen from: row 0 follows the last prompt token.
    pub logits: Vec<Vec<f32>>,
    /// Time to feed the prompt (one step per token), up to the first logits row.
    pub prefill: Duration,
    /// Time of the steps that fed generated tokens.
    pub decode: Duration,
    /// Steps inside `decode`: `tokens.len() - 1` unless the generation is empty (the last token
    /// chosen is not fed back).
    pub decode_steps: usize,
}

impl Generation {
    /// Decode throughput, steps per second (0 when nothing was decoded).
    pub fn decode_tokens_per_second(&self) -> f64 {
        let secs = self.decode.as_secs_f64();
        if self.decode_steps == 0 || secs == 0.0 {
            return 0.0;
        }
        self.decode_steps as f64 / secs
    }
}

/// The id of the largest logit, ties to the lower id; NaNs never win (0 for a row without a
/// number).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<usize> = None;
    for (i, &v) in logits.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|b| v > logits[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

/// Resets `decoder`, feeds `prompt` one step per token, then chooses up to `max_new_tokens`
/// tokens: `force_tokens[i]` at step `i` while it lasts (teacher forcing), else the argmax.
/// Stops after a token in `stop_tokens`. `on_token` sees each token as it is chosen.
pub fn generate<D: Decoder>(
    decoder: &mut D,
    prompt: &[u32],
    max_new_tokens: usize,
    force_tokens: Option<&[u32]>,
    stop_tokens: &[u32],
    mut on_token: impl FnMut(u32),
) -> Result<Generation, RuntimeError> {
    let Some((&last, earlier)) = prompt.split_last() else { return Err(RuntimeError::EmptyPrompt) };
    decoder.reset();
    let start = Instant::now();
    for &token in earlier {
        decoder.step(token)?;
    }
    let mut row = decoder.step(last)?;
    let mut generation = Generation { prefill: start.elapsed(), ..Generation::default() };
    let decode_start = Instant::now();
    while generation.tokens.len() < max_new_tokens {
        let next = match force_tokens.and_then(|forced| forced.get(generation.tokens.len())) {
            Some(&forced) => forced,
            None => argmax(&row),
        };
        generation.tokens.push(next);
        on_token(next);
        if stop_tokens.contains(&next) || generation.tokens.len() == max_new_tokens {
            generation.logits.push(row);
            break;
        }
        let following = decoder.step(next)?;
        generation.logits.push(std::mem::replace(&mut row, following));
        generation.decode_steps += 1;
    }
    generation.decode = decode_start.elapsed();
    Ok(generation)
}
