//! Hand-built decoder modules for the wafer and executor tests: Llama-shaped (optionally with
//! Qwen2 biases and Qwen3 q/k norms) and Mixtral-shaped MoE, built with `Module::push`, with
//! seeded random weights or shape-only.

use half::{bf16, f16};
use waferc_ir::{
    DType, Handle, KvCache, ModelMeta, Module, Op, Rope, RopeScaling, TensorType, Value, Weight, WeightBytes,
};

/// SplitMix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn signed(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `n` values uniform in [-scale, scale).
    pub fn vector(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.signed() * scale).collect()
    }
}

/// The dimensions and options of a built decoder.
#[derive(Clone, Debug)]
pub struct Shape {
    pub hidden: u64,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub ffn: u64,
    pub layers: u32,
    pub vocab: u64,
    /// Storage type of the matrices (norm scales and biases are f32).
    pub dtype: DType,
    /// `Some((experts, top_k))` for an MoE FFN in every layer.
    pub moe: Option<(u32, u32)>,
    /// q/k/v biases, as Qwen2 has.
    pub bias: bool,
    /// A per-head RMS norm of the queries and keys before rope, as Qwen3 has.
    pub qk_norm: bool,
    /// Weight bytes present, or shape-only.
    pub bytes: bool,
}

impl Shape {
    /// The smallest decoder the wafer tests lower: 64 wide, 16-dim heads.
    pub fn tiny() -> Shape {
        Shape { hidden: 64, heads: 4, head_dim: 16, ffn: 128, vocab: 256, ..Shape::dense() }
    }

    /// A small dense decoder whose heads are one 32-element chunk.
    pub fn dense() -> Shape {
        Shape {
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            ffn: 256,
            layers: 2,
            vocab: 192,
            dtype: DType::BF16,
            moe: None,
            bias: false,
            qk_norm: false,
            bytes: true,
        }
    }

    /// [`Shape::dense`] with four experts, two picked per token.
    pub fn moe() -> Shape {
        Shape { moe: Some((4, 2)), ffn: 96, ..Shape::dense() }
    }

    /// Llama-3.1-8B's shape, without weight bytes.
    pub fn llama8b() -> Shape {
        Shape {
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            ffn: 14336,
            layers: 32,
            vocab: 128256,
            bytes: false,
            ..Shape::dense()
        }
    }

    /// Llama-3.1-70B's shape, without weight bytes.
    pub fn llama70b() -> Shape {
        Shape { hidden: 8192, heads: 64, ffn: 28672, layers: 80, ..Shape::llama8b() }
    }
}

struct Builder {
    module: Module,
    rng: Rng,
    bytes: bool,
}

impl Builder {
    /// A weight of random values around `center` with spread `scale`, stored as `dtype`.
    fn weight(&mut self, name: String, dtype: DType, dims: Vec<u64>, center: f32, scale: f32) -> Handle<Weight> {
        let ty = TensorType::new(dtype, dims);
        let data = if self.bytes { WeightBytes::owned(self.encode(&ty, center, scale)) } else { WeightBytes::Absent };
        self.module.add_weight(name, ty, data)
    }

    fn encode(&mut self, ty: &TensorType, center: f32, scale: f32) -> Vec<u8> {
        let n = ty.elements() as usize;
        let mut out = Vec::with_capacity(ty.bytes().expect("whole blocks") as usize);
        match ty.dtype {
            DType::F32 => (0..n).for_each(|_| out.extend((center + self.rng.signed() * scale).to_le_bytes())),
            DType::BF16 => {
                (0..n).for_each(|_| out.extend(bf16::from_f32(center + self.rng.signed() * scale).to_le_bytes()))
            }
            DType::F16 => {
                (0..n).for_each(|_| out.extend(f16::from_f32(center + self.rng.signed() * scale).to_le_bytes()))
            }
            DType::Q8_0 => {
                for _ in 0..n / 32 {
                    out.extend(f16::from_f32(scale / 127.0).to_le_bytes());
                    out.extend((0..32).map(|_| (self.rng.signed() * 127.0) as i8 as u8));
                }
            }
            DType::Q4_0 | DType::Q4_1 | DType::Mxfp4 => panic!("the built test models have no 4-bit weights"),
        }
        out
    }

    fn push(&mut self, op: Op, layer: Option<u32>) -> Value {
        self.module.push(op, layer).expect("the test module's ops type-check")
    }

    /// A norm scale near 1.
    fn norm(&mut self, name: String, len: u64) -> Handle<Weight> {
        self.weight(name, DType::F32, vec![len], 1.0, 0.2)
    }

    #[allow(clippy::too_many_arguments)] // one projection spelled out: name, shape, dtype, input, bias, layer
    fn proj(
        &mut self,
        name: String,
        rows: u64,
        cols: u64,
        dtype: DType,
        x: Value,
        bias: bool,
        layer: Option<u32>,
    ) -> Value {
        let scale = 1.0 / (cols as f32).sqrt();
        let weight = self.weight(name.clone(), dtype, vec![rows, cols], 0.0, scale);
        let bias = bias.then(|| self.weight(format!("{name}.bias"), DType::F32, vec![rows], 0.0, 0.1));
        self.push(Op::MatVec { x, weight, bias }, layer)
    }

    fn mlp(&mut self, shape: &Shape, x: Value, prefix: String, layer: Option<u32>) -> Value {
        let (h, f, dt) = (shape.hidden, shape.ffn, shape.dtype);
        let gate = self.proj(format!("{prefix}.gate"), f, h, dt, x, false, layer);
        let up = self.proj(format!("{prefix}.up"), f, h, dt, x, false, layer);
        let act = self.push(Op::Silu { x: gate }, layer);
        let product = self.push(Op::Mul { a: act, b: up }, layer);
        self.proj(format!("{prefix}.down"), h, f, dt, product, false, layer)
    }
}

/// A Llama-shaped decoder of `shape` (Mixtral-shaped with `moe`), random weights from `seed`.
pub fn build(shape: &Shape, seed: u64) -> Module {
    let meta = ModelMeta {
        architecture: if shape.moe.is_some() { "mixtral".into() } else { "llama".into() },
        vocab_size: shape.vocab as u32,
        num_layers: shape.layers,
        bos_token_id: Some(1),
        eos_token_ids: vec![],
    };
    let mut b = Builder { module: Module::new(meta), rng: Rng(seed), bytes: shape.bytes };
    let (h, dt, hd) = (shape.hidden, shape.dtype, shape.head_dim as u64);
    let (q_width, kv_width) = (shape.heads as u64 * hd, shape.kv_heads as u64 * hd);
    let table = b.weight("embed".into(), dt, vec![shape.vocab, h], 0.0, 1.0);
    let mut x = b.push(Op::Embed { table }, None);
    let rope = Rope { theta: 10000.0, scaling: RopeScaling::None };
    for l in 0..shape.layers {
        let at = Some(l);
        let p = |s: &str| format!("layers.{l}.{s}");
        let norm = b.norm(p("input_norm"), h);
        let hn = b.push(Op::RmsNorm { x, weight: norm, eps: 1e-5 }, at);
        let mut q = b.proj(p("q"), q_width, h, dt, hn, shape.bias, at);
        let mut k = b.proj(p("k"), kv_width, h, dt, hn, shape.bias, at);
        let v = b.proj(p("v"), kv_width, h, dt, hn, shape.bias, at);
        if shape.qk_norm {
            let (q_norm, k_norm) = (b.norm(p("q_norm"), hd), b.norm(p("k_norm"), hd));
            q = b.push(Op::RmsNorm { x: q, weight: q_norm, eps: 1e-6 }, at);
            k = b.push(Op::RmsNorm { x: k, weight: k_norm, eps: 1e-6 }, at);
        }
        let q = b.push(Op::Rope { x: q, head_dim: shape.head_dim, rope: rope.clone() }, at);
        let k = b.push(Op::Rope { x: k, head_dim: shape.head_dim, rope: rope.clone() }, at);
        let cache = b.module.add_cache(KvCache { layer: l, kv_heads: shape.kv_heads, head_dim: shape.head_dim });
        let scale = 1.0 / (hd as f32).sqrt();
        let a = b.push(Op::Attention { q, k, v, cache, heads: shape.heads, scale, window: None, sinks: None }, at);
        let o = b.proj(p("o"), h, q_width, dt, a, false, at);
        x = b.push(Op::Add { a: x, b: o }, at);
        let norm = b.norm(p("post_norm"), h);
        let hn = b.push(Op::RmsNorm { x, weight: norm, eps: 1e-5 }, at);
        let ffn = match shape.moe {
            None => b.mlp(shape, hn, p("mlp"), at),
            Some((experts, top_k)) => {
                let logits = b.proj(p("router"), experts as u64, h, dt, hn, false, at);
                let routing = b.push(Op::RouterTopK { logits, top_k, normalize: true }, at);
                let outs = (0..experts)
                    .map(|e| {
                        let routed = b.push(Op::ExpertDispatch { x: hn, routing, expert: e }, at);
                        b.mlp(shape, routed, p(&format!("experts.{e}")), at)
                    })
                    .collect();
                b.push(Op::ExpertCombine { routing, experts: outs }, at)
            }
        };
        x = b.push(Op::Add { a: x, b: ffn }, at);
    }
    let norm = b.norm("norm".into(), h);
    let xn = b.push(Op::RmsNorm { x, weight: norm, eps: 1e-5 }, None);
    let logits = b.proj("lm_head".into(), shape.vocab, h, dt, xn, false, None);
    b.module.output = Some(logits);
    waferc_ir::verify(&b.module).expect("the test module verifies");
    b.module
}
