//! Hand-built decoder modules for the wafer tests: Llama-shaped (optionally with Qwen2 biases
//! and Qwen3 q/k norms) and Mixtral-shaped MoE, with deterministic weight bytes or shape-only.

#![allow(dead_code)]

use waferc_ir::{DType, KvCache, ModelMeta, Module, Op, Rope, RopeScaling, TensorType, Value, WeightBytes};

#[derive(Clone, Debug)]
pub struct Shape {
    pub hidden: u64,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub ffn: u64,
    pub layers: u32,
    pub vocab: u64,
    pub dtype: DType,
    /// `Some((experts, top_k))` for an MoE FFN in every layer.
    pub moe: Option<(u32, u32)>,
    pub bias: bool,
    pub qk_norm: bool,
    /// Weight bytes present (deterministic pseudo-random) or shape-only.
    pub bytes: bool,
}

impl Shape {
    pub fn tiny() -> Shape {
        Shape {
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 128,
            layers: 2,
            vocab: 256,
            dtype: DType::BF16,
            moe: None,
            bias: false,
            qk_norm: false,
            bytes: true,
        }
    }

    pub fn llama8b() -> Shape {
        Shape {
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            ffn: 14336,
            layers: 32,
            vocab: 128256,
            dtype: DType::BF16,
            moe: None,
            bias: false,
            qk_norm: false,
            bytes: false,
        }
    }

    pub fn llama70b() -> Shape {
        Shape { hidden: 8192, heads: 64, ffn: 28672, layers: 80, ..Shape::llama8b() }
    }
}

struct Filler(u64);

impl Filler {
    fn bytes(&mut self, n: u64, present: bool) -> WeightBytes {
        if !present {
            return WeightBytes::Absent;
        }
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            // Small bf16/f16-safe bytes: keep exponents moderate by masking the high byte.
            out.push((self.0 >> 33) as u8 & 0x3f);
        }
        WeightBytes::owned(out)
    }
}

struct Builder {
    m: Module,
    fill: Filler,
    present: bool,
    dtype: DType,
}

impl Builder {
    fn weight(&mut self, name: String, dtype: DType, dims: Vec<u64>) -> waferc_ir::Handle<waferc_ir::Weight> {
        let ty = TensorType::new(dtype, dims);
        let n = ty.bytes().expect("whole blocks");
        let data = self.fill.bytes(n, self.present);
        self.m.add_weight(name, ty, data)
    }

    fn push(&mut self, op: Op, layer: Option<u32>) -> Value {
        self.m.push(op, layer).unwrap()
    }

    fn proj(&mut self, name: String, rows: u64, cols: u64, input: Value, bias: bool, at: Option<u32>) -> Value {
        let w = self.weight(name.clone(), self.dtype, vec![rows, cols]);
        let b = bias.then(|| self.weight(format!("{name}.bias"), DType::F32, vec![rows]));
        self.push(Op::MatVec { x: input, weight: w, bias: b }, at)
    }

    fn mlp(&mut self, shape: &Shape, input: Value, prefix: String, at: Option<u32>) -> Value {
        let (h, f) = (shape.hidden, shape.ffn);
        let g = self.proj(format!("{prefix}.gate"), f, h, input, false, at);
        let u = self.proj(format!("{prefix}.up"), f, h, input, false, at);
        let s = self.push(Op::Silu { x: g }, at);
        let prod = self.push(Op::Mul { a: s, b: u }, at);
        self.proj(format!("{prefix}.down"), h, f, prod, false, at)
    }
}

pub fn build(shape: &Shape) -> Module {
    let meta = ModelMeta {
        architecture: if shape.moe.is_some() { "mixtral".into() } else { "llama".into() },
        vocab_size: shape.vocab as u32,
        num_layers: shape.layers,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    };
    let mut b = Builder { m: Module::new(meta), fill: Filler(7), present: shape.bytes, dtype: shape.dtype };
    let (h, dt) = (shape.hidden, shape.dtype);
    let hd = shape.head_dim as u64;
    let q_width = shape.heads as u64 * hd;
    let kv_width = shape.kv_heads as u64 * hd;
    let table = b.weight("embed".into(), dt, vec![shape.vocab, h]);
    let mut x = b.push(Op::Embed { table }, None);
    let rope = Rope { theta: 10000.0, scaling: RopeScaling::None };
    for l in 0..shape.layers {
        let at = Some(l);
        let p = |s: &str| format!("layers.{l}.{s}");
        let norm_w = b.weight(p("input_norm"), DType::F32, vec![h]);
        let hn = b.push(Op::RmsNorm { x, weight: norm_w, eps: 1e-5 }, at);
        let mut q = b.proj(p("q"), q_width, h, hn, shape.bias, at);
        let mut k = b.proj(p("k"), kv_width, h, hn, shape.bias, at);
        let v = b.proj(p("v"), kv_width, h, hn, shape.bias, at);
        if shape.qk_norm {
            let qn = b.weight(p("q_norm"), DType::F32, vec![hd]);
            let kn = b.weight(p("k_norm"), DType::F32, vec![hd]);
            q = b.push(Op::RmsNorm { x: q, weight: qn, eps: 1e-6 }, at);
            k = b.push(Op::RmsNorm { x: k, weight: kn, eps: 1e-6 }, at);
        }
        let q = b.push(Op::Rope { x: q, head_dim: shape.head_dim, rope: rope.clone() }, at);
        let k = b.push(Op::Rope { x: k, head_dim: shape.head_dim, rope: rope.clone() }, at);
        let cache = b.m.add_cache(KvCache { layer: l, kv_heads: shape.kv_heads, head_dim: shape.head_dim });
        let scale = 1.0 / (hd as f32).sqrt();
        let a = b.push(Op::Attention { q, k, v, cache, heads: shape.heads, scale, window: None, sinks: None }, at);
        let o = b.proj(p("o"), h, q_width, a, false, at);
        x = b.push(Op::Add { a: x, b: o }, at);
        let norm2 = b.weight(p("post_norm"), DType::F32, vec![h]);
        let hn = b.push(Op::RmsNorm { x, weight: norm2, eps: 1e-5 }, at);
        let ffn = match shape.moe {
            None => b.mlp(shape, hn, p("mlp"), at),
            Some((experts, top_k)) => {
                let logits = b.proj(p("router"), experts as u64, h, hn, false, at);
                let routing = b.push(Op::RouterTopK { logits, top_k, normalize: true }, at);
                let mut outs = Vec::new();
                for e in 0..experts {
                    let routed = b.push(Op::ExpertDispatch { x: hn, routing, expert: e }, at);
                    outs.push(b.mlp(shape, routed, p(&format!("experts.{e}")), at));
                }
                b.push(Op::ExpertCombine { routing, experts: outs }, at)
            }
        };
        x = b.push(Op::Add { a: x, b: ffn }, at);
    }
    let final_norm = b.weight("norm".into(), DType::F32, vec![h]);
    let xn = b.push(Op::RmsNorm { x, weight: final_norm, eps: 1e-5 }, None);
    let logits = b.proj("lm_head".into(), shape.vocab, h, xn, false, None);
    b.m.output = Some(logits);
    waferc_ir::verify(&b.m).expect("test module verifies");
    b.m
}
