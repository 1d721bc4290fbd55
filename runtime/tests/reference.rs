//! The reference decoder on hand-built modules: a tiny Llama-style model and a tiny MoE checked
//! against straightforward f64 forward passes, absent-value propagation, determinism across
//! thread counts, error paths, and the generation driver.

mod common;

use common::{dot64, max_abs_diff, random_weight, Rng};
use waferc_ir::{DType, Handle, KvCache, ModelMeta, Module, Op, Rope, RopeScaling, TensorType, Value, Weight};
use waferc_runtime::{argmax, generate, ReferenceDecoder, RuntimeError};

/// A module under construction with the f64 decoding of each weight kept alongside.
struct Builder {
    module: Module,
    rng: Rng,
    decoded: Vec<Vec<f64>>,
}

impl Builder {
    fn new(vocab: u32, seed: u64) -> Self {
        let meta = ModelMeta { architecture: "test".into(), vocab_size: vocab, ..ModelMeta::default() };
        Builder { module: Module::new(meta), rng: Rng(seed), decoded: Vec::new() }
    }

    fn weight(&mut self, name: &str, dtype: DType, shape: &[u64], scale: f32) -> Handle<Weight> {
        let (ty, data, decoded) = random_weight(&mut self.rng, dtype, shape, scale);
        self.decoded.push(decoded);
        self.module.add_weight(name, ty, data)
    }

    /// A norm scale near 1.
    fn norm(&mut self, name: &str, len: u64) -> Handle<Weight> {
        let values: Vec<f32> = (0..len).map(|_| 1.0 + 0.2 * self.rng.signed()).collect();
        let bytes = common::encode(DType::F32, &values);
        self.decoded.push(values.iter().map(|&v| v as f64).collect());
        self.module.add_weight(name, TensorType::f32([len]), waferc_ir::WeightBytes::owned(bytes))
    }

    fn push(&mut self, op: Op, layer: Option<u32>) -> Value {
        self.module.push(op, layer).expect("well-formed test module")
    }
}

// ---- A tiny Llama: GQA, a q bias, rope with linear scaling, mixed weight dtypes. ----

const VOCAB: u64 = 200;
const HIDDEN: u64 = 64;
const HEADS: u32 = 4;
const KV_HEADS: u32 = 2;
const HEAD_DIM: u32 = 16;
const FFN: u64 = 96;
const LAYERS: u32 = 2;
const EPS: f32 = 1e-5;

struct LayerWeights {
    attn_norm: Handle<Weight>,
    q: Handle<Weight>,
    q_bias: Handle<Weight>,
    k: Handle<Weight>,
    v: Handle<Weight>,
    o: Handle<Weight>,
    ffn_norm: Handle<Weight>,
    gate: Handle<Weight>,
    up: Handle<Weight>,
    down: Handle<Weight>,
}

struct TinyLlama {
    builder: Builder,
    embed: Handle<Weight>,
    layers: Vec<LayerWeights>,
    final_norm: Handle<Weight>,
    head: Handle<Weight>,
    rope: Rope,
}

fn tiny_llama(seed: u64) -> TinyLlama {
    let mut b = Builder::new(VOCAB as u32, seed);
    let kv = (KV_HEADS * HEAD_DIM) as u64;
    let embed = b.weight("embed", DType::Q8_0, &[VOCAB, HIDDEN], 1.0);
    let layers: Vec<LayerWeights> = (0..LAYERS)
        .map(|l| LayerWeights {
            attn_norm: b.norm(&format!("l{l}.attn_norm"), HIDDEN),
            q: b.weight(&format!("l{l}.q"), DType::F32, &[HIDDEN, HIDDEN], 0.3),
            q_bias: b.weight(&format!("l{l}.q_bias"), DType::F32, &[HIDDEN], 0.3),
            k: b.weight(&format!("l{l}.k"), DType::F16, &[kv, HIDDEN], 0.3),
            v: b.weight(&format!("l{l}.v"), DType::BF16, &[kv, HIDDEN], 0.3),
            o: b.weight(&format!("l{l}.o"), DType::Q4_0, &[HIDDEN, HIDDEN], 0.2),
            ffn_norm: b.norm(&format!("l{l}.ffn_norm"), HIDDEN),
            gate: b.weight(&format!("l{l}.gate"), DType::Q4_1, &[FFN, HIDDEN], 0.3),
            up: b.weight(&format!("l{l}.up"), DType::Q8_0, &[FFN, HIDDEN], 0.3),
            down: b.weight(&format!("l{l}.down"), DType::Q4_1, &[HIDDEN, FFN], 0.2),
        })
        .collect();
    let final_norm = b.norm("final_norm", HIDDEN);
    let head = b.weight("head", DType::BF16, &[VOCAB, HIDDEN], 0.5);
    let rope = Rope { theta: 10000.0, scaling: RopeScaling::Linear { factor: 2.0 } };

    let mut x = b.push(Op::Embed { table: embed }, None);
    for (l, w) in layers.iter().enumerate() {
        let layer = Some(l as u32);
        let cache = b.module.add_cache(KvCache { layer: l as u32, kv_heads: KV_HEADS, head_dim: HEAD_DIM });
        let h = b.push(Op::RmsNorm { x, weight: w.attn_norm, eps: EPS }, layer);
        let q = b.push(Op::MatVec { x: h, weight: w.q, bias: Some(w.q_bias) }, layer);
        let k = b.push(Op::MatVec { x: h, weight: w.k, bias: None }, layer);
        let v = b.push(Op::MatVec { x: h, weight: w.v, bias: None }, layer);
        let q = b.push(Op::Rope { x: q, head_dim: HEAD_DIM, rope: rope.clone() }, layer);
        let k = b.push(Op::Rope { x: k, head_dim: HEAD_DIM, rope: rope.clone() }, layer);
        let scale = 1.0 / (HEAD_DIM as f32).sqrt();
        let a = b.push(Op::Attention { q, k, v, cache, heads: HEADS, scale, window: None, sinks: None }, layer);
        let o = b.push(Op::MatVec { x: a, weight: w.o, bias: None }, layer);
        x = b.push(Op::Add { a: x, b: o }, layer);
        let h = b.push(Op::RmsNorm { x, weight: w.ffn_norm, eps: EPS }, layer);
        let g = b.push(Op::MatVec { x: h, weight: w.gate, bias: None }, layer);
        let u = b.push(Op::MatVec { x: h, weight: w.up, bias: None }, layer);
        let g = b.push(Op::Silu { x: g }, layer);
        let f = b.push(Op::Mul { a: g, b: u }, layer);
        let d = b.push(Op::MatVec { x: f, weight: w.down, bias: None }, layer);
        x = b.push(Op::Add { a: x, b: d }, layer);
    }
    let h = b.push(Op::RmsNorm { x, weight: final_norm, eps: EPS }, None);
    let logits = b.push(Op::MatVec { x: h, weight: head, bias: None }, None);
    b.module.output = Some(logits);
    TinyLlama { builder: b, embed, layers, final_norm, head, rope }
}

fn matvec64(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks(x.len()).map(|row| dot64(row, x)).collect()
}

fn rms_norm64(x: &[f64], w: &[f64]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + EPS as f64).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

fn rope64(x: &mut [f64], position: usize, theta: f64, linear_factor: f64) {
    let half = HEAD_DIM as usize / 2;
    for head in x.chunks_mut(HEAD_DIM as usize) {
        for i in 0..half {
            let freq = 1.0 / theta.powf(2.0 * i as f64 / HEAD_DIM as f64) / linear_factor;
            let (c, s) = ((position as f64 * freq).cos(), (position as f64 * freq).sin());
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * c - b * s;
            head[i + half] = b * c + a * s;
        }
    }
}

/// The tiny Llama's forward pass in f64, one token at a time, with its own KV caches.
struct Llama64<'a> {
    model: &'a TinyLlama,
    keys: Vec<Vec<Vec<f64>>>,
    values: Vec<Vec<Vec<f64>>>,
}

impl<'a> Llama64<'a> {
    fn new(model: &'a TinyLlama) -> Self {
        Llama64 { model, keys: vec![Vec::new(); LAYERS as usize], values: vec![Vec::new(); LAYERS as usize] }
    }

    fn w(&self, h: Handle<Weight>) -> &'a [f64] {
        &self.model.builder.decoded[h.index()]
    }

    fn step(&mut self, token: u32) -> Vec<f64> {
        let hidden = HIDDEN as usize;
        let dim = HEAD_DIM as usize;
        let position = self.keys[0].len();
        let mut x = self.w(self.model.embed)[token as usize * hidden..][..hidden].to_vec();
        for (l, lw) in self.model.layers.iter().enumerate() {
            let h = rms_norm64(&x, self.w(lw.attn_norm));
            let mut q: Vec<f64> =
                matvec64(self.w(lw.q), &h).iter().zip(self.w(lw.q_bias)).map(|(a, b)| a + b).collect();
            let mut k = matvec64(self.w(lw.k), &h);
            let v = matvec64(self.w(lw.v), &h);
            rope64(&mut q, position, 10000.0, 2.0);
            rope64(&mut k, position, 10000.0, 2.0);
            self.keys[l].push(k);
            self.values[l].push(v);
            let mut attn = vec![0.0; hidden];
            for head in 0..HEADS as usize {
                let kv = head / (HEADS / KV_HEADS) as usize;
                let qh = &q[head * dim..][..dim];
                let scores: Vec<f64> =
                    self.keys[l].iter().map(|k| dot64(qh, &k[kv * dim..][..dim]) / (dim as f64).sqrt()).collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for d in 0..dim {
                    attn[head * dim + d] =
                        scores.iter().zip(&self.values[l]).map(|(s, v)| (s - m).exp() / z * v[kv * dim + d]).sum();
                }
            }
            let o = matvec64(self.w(lw.o), &attn);
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            let h = rms_norm64(&x, self.w(lw.ffn_norm));
            let g = matvec64(self.w(lw.gate), &h);
            let u = matvec64(self.w(lw.up), &h);
            let f: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let d = matvec64(self.w(lw.down), &f);
            x.iter_mut().zip(&d).for_each(|(x, d)| *x += d);
        }
        let h = rms_norm64(&x, self.w(self.model.final_norm));
        matvec64(self.w(self.model.head), &h)
    }
}

#[test]
fn tiny_llama_matches_an_f64_forward_pass() {
    let model = tiny_llama(1);
    assert_eq!(model.rope.scaling, RopeScaling::Linear { factor: 2.0 });
    let mut decoder = ReferenceDecoder::new(&model.builder.module, 64).expect("decoder");
    let mut reference = Llama64::new(&model);
    for (i, token) in [3u32, 17, 199, 0, 42, 42, 7, 150, 99, 1].into_iter().enumerate() {
        let logits = decoder.step(token).expect("step");
        let expected = reference.step(token);
        let diff = max_abs_diff(&logits, &expected);
        assert!(diff < 2e-4, "step {i}: max |logit - f64| = {diff}");
        assert_eq!(decoder.position(), i + 1);
    }
}

#[test]
fn decoding_is_bit_identical_across_thread_counts_and_after_reset() {
    let model = tiny_llama(2);
    let tokens = [5u32, 6, 7, 8, 190, 3];
    let run = |threads: usize| -> Vec<Vec<u32>> {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
        pool.install(|| {
            let mut decoder = ReferenceDecoder::new(&model.builder.module, 16).expect("decoder");
            let mut rows = Vec::new();
            for _ in 0..2 {
                decoder.reset();
                for &t in &tokens {
                    rows.push(decoder.step(t).expect("step").iter().map(|v| v.to_bits()).collect());
                }
            }
            rows
        })
    };
    let one = run(1);
    assert_eq!(one[..tokens.len()], one[tokens.len()..], "reset replays the same bits");
    assert_eq!(one, run(2));
    assert_eq!(one, run(3));
}

#[test]
fn errors_leave_the_decoder_where_it_was() {
    let model = tiny_llama(3);
    let mut decoder = ReferenceDecoder::new(&model.builder.module, 3).expect("decoder");
    let mut fresh = decoder.clone();
    decoder.step(1).expect("step");
    let err = decoder.step(VOCAB as u32).expect_err("token past the vocabulary");
    assert!(
        matches!(&err, RuntimeError::TokenOutOfRange { token: 200, rows: 200, table, .. } if table == "embed"),
        "{err}"
    );
    assert_eq!(decoder.position(), 1);
    fresh.step(1).expect("step");
    assert_eq!(decoder.step(2).expect("step"), fresh.step(2).expect("step"), "the failed step left no trace");
    decoder.step(3).expect("step");
    let full = decoder.step(4).expect_err("context is 3");
    assert_eq!(full, RuntimeError::ContextFull { position: 3, max_context: 3 });
}

#[test]
fn rejects_modules_without_weight_data() {
    let mut model = tiny_llama(4);
    let head = model.head;
    model.builder.module.weights[head].data = waferc_ir::WeightBytes::Absent;
    let err = ReferenceDecoder::new(&model.builder.module, 8).expect_err("head has no data");
    assert_eq!(err, RuntimeError::MissingWeightData { weight: "head".into() });
    let mut unverified = tiny_llama(4).builder.module;
    unverified.output = None;
    assert!(matches!(ReferenceDecoder::new(&unverified, 8), Err(RuntimeError::InvalidModule(_))));
}

// ---- Generation. ----

#[test]
fn generate_feeds_the_prompt_then_greedy_or_forced_tokens() {
    let model = tiny_llama(5);
    let mut decoder = ReferenceDecoder::new(&model.builder.module, 32).expect("decoder");
    let prompt = [1u32, 2, 3];
    let mut seen = Vec::new();
    let greedy = generate(&mut decoder, &prompt, 6, None, &[], |t| seen.push(t)).expect("generate");
    assert_eq!(greedy.tokens.len(), 6);
    assert_eq!(seen, greedy.tokens);
    assert_eq!(greedy.decode_steps, 5);
    // Replay by hand: row i follows the prompt and tokens[..i].
    let mut manual = ReferenceDecoder::new(&model.builder.module, 32).expect("decoder");
    let mut row = prompt.iter().map(|&t| manual.step(t).expect("step")).last().expect("prompt");
    for (i, &token) in greedy.tokens.iter().enumerate() {
        assert_eq!(greedy.logits[i], row, "logits row {i}");
        assert_eq!(token, argmax(&row));
        row = manual.step(token).expect("step");
    }
    assert_eq!(decoder.position(), prompt.len() + 5, "the last chosen token is not fed");

    let forced = [9u32, 8, 7, 6];
    let teacher = generate(&mut decoder, &prompt, 4, Some(&forced), &[], |_| {}).expect("generate");
    assert_eq!(teacher.tokens, forced);
    assert_eq!(teacher.logits[0], greedy.logits[0], "generate starts from a reset decoder");

    let stop = greedy.tokens[2];
    let stopped = generate(&mut decoder, &prompt, 6, None, &[stop], |_| {}).expect("generate");
    let first_stop = greedy.tokens.iter().position(|&t| t == stop).expect("present");
    assert_eq!(stopped.tokens, greedy.tokens[..=first_stop]);
    assert_eq!(stopped.logits.len(), stopped.tokens.len());

    let nothing = generate(&mut decoder, &prompt, 0, None, &[], |_| {}).expect("generate");
    assert!(nothing.tokens.is_empty() && nothing.logits.is_empty());
    assert_eq!(generate(&mut decoder, &[], 3, None, &[], |_| {}).expect_err("empty prompt"), RuntimeError::EmptyPrompt);
}

#[test]
fn argmax_ties_go_to_the_lower_id() {
    assert_eq!(argmax(&[0.0, 2.0, 1.0, 2.0]), 1);
    assert_eq!(argmax(&[-1.0, -1.0]), 0);
    assert_eq!(argmax(&[f32::NAN, 1.0, 3.0]), 2);
}

// ---- A tiny mixture of experts. ----

const EXPERTS: u32 = 4;
const MOE_HIDDEN: u64 = 32;
const EXPERT_FFN: u64 = 64;

struct TinyMoe {
    builder: Builder,
    embed: Handle<Weight>,
    router: Handle<Weight>,
    experts: Vec<[Handle<Weight>; 3]>,
    head: Handle<Weight>,
}

/// `x = embed; y = x + expert_combine(top-2 experts' SwiGLU FFNs of x); logits = head(y)`.
/// With `miswire`, expert slot 1 of the combine is expert 3's output.
fn tiny_moe(seed: u64, miswire: bool) -> TinyMoe {
    let mut b = Builder::new(VOCAB as u32, seed);
    let embed = b.weight("embed", DType::F32, &[VOCAB, MOE_HIDDEN], 1.0);
    let router = b.weight("router", DType::F32, &[EXPERTS as u64, MOE_HIDDEN], 1.0);
    let experts: Vec<[Handle<Weight>; 3]> = (0..EXPERTS)
        .map(|e| {
            [
                b.weight(&format!("e{e}.gate"), DType::Q4_1, &[EXPERT_FFN, MOE_HIDDEN], 0.5),
                b.weight(&format!("e{e}.up"), DType::Q8_0, &[EXPERT_FFN, MOE_HIDDEN], 0.5),
                b.weight(&format!("e{e}.down"), DType::Q4_0, &[MOE_HIDDEN, EXPERT_FFN], 0.5),
            ]
        })
        .collect();
    let head = b.weight("head", DType::F32, &[VOCAB, MOE_HIDDEN], 0.5);
    let x = b.push(Op::Embed { table: embed }, None);
    let layer = Some(0);
    let router_logits = b.push(Op::MatVec { x, weight: router, bias: None }, layer);
    let routing = b.push(Op::RouterTopK { logits: router_logits, top_k: 2, normalize: true }, layer);
    let mut outputs = Vec::new();
    for (e, [gate, up, down]) in experts.iter().copied().enumerate() {
        let xe = b.push(Op::ExpertDispatch { x, routing, expert: e as u32 }, layer);
        let g = b.push(Op::MatVec { x: xe, weight: gate, bias: None }, layer);
        let u = b.push(Op::MatVec { x: xe, weight: up, bias: None }, layer);
        let g = b.push(Op::Silu { x: g }, layer);
        let f = b.push(Op::Mul { a: g, b: u }, layer);
        outputs.push(b.push(Op::MatVec { x: f, weight: down, bias: None }, layer));
    }
    if miswire {
        outputs[1] = outputs[3];
    }
    let combined = b.push(Op::ExpertCombine { routing, experts: outputs }, layer);
    let y = b.push(Op::Add { a: x, b: combined }, layer);
    b.module.output = Some(b.push(Op::MatVec { x: y, weight: head, bias: None }, None));
    TinyMoe { builder: b, embed, router, experts, head }
}

impl TinyMoe {
    fn w(&self, h: Handle<Weight>) -> &[f64] {
        &self.builder.decoded[h.index()]
    }

    /// The chosen experts (ties to the lower index) and the f64 logits.
    fn forward64(&self, token: u32) -> (Vec<usize>, Vec<f64>) {
        let hidden = MOE_HIDDEN as usize;
        let x = &self.w(self.embed)[token as usize * hidden..][..hidden];
        let logits = matvec64(self.w(self.router), x);
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let mut chosen = order[..2].to_vec();
        let total = p[chosen[0]] + p[chosen[1]];
        chosen.sort();
        let mut y = x.to_vec();
        for &e in &chosen {
            let [gate, up, down] = self.experts[e];
            let g = matvec64(self.w(gate), x);
            let u = matvec64(self.w(up), x);
            let f: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let d = matvec64(self.w(down), &f);
            y.iter_mut().zip(&d).for_each(|(y, d)| *y += p[e] / total * d);
        }
        (chosen, matvec64(self.w(self.head), &y))
    }
}

#[test]
fn tiny_moe_matches_an_f64_forward_pass() {
    let moe = tiny_moe(6, false);
    let mut decoder = ReferenceDecoder::new(&moe.builder.module, 64).expect("decoder");
    let mut chosen_sets = std::collections::BTreeSet::new();
    for token in 0..40u32 {
        let logits = decoder.step(token * 5).expect("step");
        let (chosen, expected) = moe.forward64(token * 5);
        chosen_sets.insert(chosen);
        let diff = max_abs_diff(&logits, &expected);
        assert!(diff < 1e-4, "token {}: max |logit - f64| = {diff}", token * 5);
    }
    assert!(chosen_sets.len() > 2, "the test tokens route to several expert pairs: {chosen_sets:?}");
}

#[test]
fn a_chosen_expert_wired_to_an_unchosen_output_is_an_error() {
    let moe = tiny_moe(7, true);
    let mut decoder = ReferenceDecoder::new(&moe.builder.module, 64).expect("decoder");
    // Find a token whose routing chooses expert 1 but not expert 3.
    let token = (0..VOCAB as u32)
        .find(|&t| {
            let (chosen, _) = moe.forward64(t);
            chosen.contains(&1) && !chosen.contains(&3)
        })
        .expect("some token routes to expert 1 without expert 3");
    let err = decoder.step(token).expect_err("expert 1's slot is absent");
    assert!(matches!(err, RuntimeError::ChosenExpertAbsent { expert: 1, .. }), "{err}");
}

#[test]
fn absent_values_propagate_to_an_error_where_they_cannot_skip() {
    // The output is an expert's FFN output: absent whenever that expert is not chosen.
    let mut b = Builder::new(VOCAB as u32, 8);
    let embed = b.weight("embed", DType::F32, &[VOCAB, MOE_HIDDEN], 1.0);
    let router = b.weight("router", DType::F32, &[EXPERTS as u64, MOE_HIDDEN], 1.0);
    let head = b.weight("head", DType::F32, &[VOCAB, MOE_HIDDEN], 1.0);
    let x = b.push(Op::Embed { table: embed }, None);
    let logits = b.push(Op::MatVec { x, weight: router, bias: None }, None);
    let routing = b.push(Op::RouterTopK { logits, top_k: 1, normalize: false }, None);
    let x2 = b.push(Op::ExpertDispatch { x, routing, expert: 2 }, None);
    let h = b.push(Op::Silu { x: x2 }, None);
    let out = b.push(Op::MatVec { x: h, weight: head, bias: None }, None);
    b.module.output = Some(out);
    let routes_to_2 = |b: &Builder, t: u32| {
        let x = &b.decoded[embed.index()][t as usize * 32..][..32];
        argmax(&matvec64(&b.decoded[router.index()], x).iter().map(|&v| v as f32).collect::<Vec<_>>()) == 2
    };
    let (chosen, unchosen) = (
        (0..VOCAB as u32).find(|&t| routes_to_2(&b, t)).expect("a token for expert 2"),
        (0..VOCAB as u32).find(|&t| !routes_to_2(&b, t)).expect("a token for another expert"),
    );
    let mut decoder = ReferenceDecoder::new(&b.module, 8).expect("decoder");
    assert_eq!(decoder.step(chosen).expect("expert 2 chosen").len(), VOCAB as usize);
    assert_eq!(
        decoder.step(unchosen).expect_err("expert 2 not chosen"),
        RuntimeError::AbsentOutput { value: out.index() }
    );

    // Attention must append to its cache every step, so it cannot skip an absent operand.
    let cache = b.module.add_cache(KvCache { layer: 0, kv_heads: 1, head_dim: 32 });
    let a =
        b.push(Op::Attention { q: x2, k: x, v: x, cache, heads: 1, scale: 1.0, window: None, sinks: None }, Some(0));
    let y = b.push(Op::Add { a: x, b: a }, None);
    b.module.output = Some(b.push(Op::MatVec { x: y, weight: head, bias: None }, None));
    let mut decoder = ReferenceDecoder::new(&b.module, 8).expect("decoder");
    let err = decoder.step(unchosen).expect_err("attention over an absent query");
    assert!(
        matches!(&err, RuntimeError::AbsentOperand { site, operand } if site.op == "attention" && *operand == x2.index()),
        "{err}"
    );
}
