//! Shared by the executor tests: small dense and MoE decoder modules built with `Module::push`
//! and random weights, compiling them for a grid, and packing the tile blob the way the artifact
//! lays it out (each weight region's rows, `cols` slice of each, at its `blob_ranges` range).

#![allow(dead_code)] // each test binary uses a different subset

use half::{bf16, f16};
use waferc_ir::wafer::{region_bytes, WaferProgram};
use waferc_ir::{DType, KvCache, ModelMeta, Module, Op, Rope, RopeScaling, TensorType, Value, WeightBytes};
use waferc_passes::wafer::{check, compile, CompileOptions};
use waferc_targets::Target;

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
}

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
    pub bias: bool,
    /// Weight bytes present, or shape-only.
    pub bytes: bool,
}

impl Shape {
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
            bytes: true,
        }
    }

    pub fn moe() -> Shape {
        Shape { moe: Some((4, 2)), ffn: 96, ..Shape::dense() }
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
            bytes: false,
        }
    }
}

struct Builder {
    module: Module,
    rng: Rng,
    bytes: bool,
}

impl Builder {
    /// A weight of random values around `center` with spread `scale`, stored as `dtype`.
    fn weight(
        &mut self,
        name: String,
        dtype: DType,
        dims: Vec<u64>,
        center: f32,
        scale: f32,
    ) -> waferc_ir::Handle<waferc_ir::Weight> {
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
            DType::Q4_0 | DType::Q4_1 | DType::Mxfp4 => panic!("the executor tests do not build 4-bit weights"),
        }
        out
    }

    fn push(&mut self, op: Op, layer: Option<u32>) -> Value {
        self.module.push(op, layer).expect("the test module's ops type-check")
    }

    #[allow(clippy::too_many_arguments)] // one projection spelled out: name, shape, dtype, input, bias, layer, data
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

/// A Llama-shaped decoder (Mixtral-shaped with `moe`), random weights from `seed`.
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
        let norm = b.weight(p("input_norm"), DType::F32, vec![h], 1.0, 0.2);
        let hn = b.push(Op::RmsNorm { x, weight: norm, eps: 1e-5 }, at);
        let q = b.proj(p("q"), q_width, h, dt, hn, shape.bias, at);
        let k = b.proj(p("k"), kv_width, h, dt, hn, shape.bias, at);
        let v = b.proj(p("v"), kv_width, h, dt, hn, shape.bias, at);
        let q = b.push(Op::Rope { x: q, head_dim: shape.head_dim, rope: rope.clone() }, at);
        let k = b.push(Op::Rope { x: k, head_dim: shape.head_dim, rope: rope.clone() }, at);
        let cache = b.module.add_cache(KvCache { layer: l, kv_heads: shape.kv_heads, head_dim: shape.head_dim });
        let scale = 1.0 / (hd as f32).sqrt();
        let a = b.push(Op::Attention { q, k, v, cache, heads: shape.heads, scale, window: None, sinks: None }, at);
        let o = b.proj(p("o"), h, q_width, dt, a, false, at);
        x = b.push(Op::Add { a: x, b: o }, at);
        let norm = b.weight(p("post_norm"), DType::F32, vec![h], 1.0, 0.2);
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
    let norm = b.weight("norm".into(), DType::F32, vec![h], 1.0, 0.2);
    let xn = b.push(Op::RmsNorm { x, weight: norm, eps: 1e-5 }, None);
    let logits = b.proj("lm_head".into(), shape.vocab, h, dt, xn, false, None);
    b.module.output = Some(logits);
    waferc_ir::verify(&b.module).expect("the test module verifies");
    b.module
}

/// Compiles `module` for `target` (a spec such as `grid:8x8`) with KV capacity `max_context`.
pub fn compile_for(module: &Module, target: &str, max_context: u32) -> WaferProgram {
    compile_with(module, target, CompileOptions::new(max_context))
}

/// Compiles `module` for `target` with `options`; the placement checker must accept the program.
pub fn compile_with(module: &Module, target: &str, options: CompileOptions) -> WaferProgram {
    let target = Target::resolve(target).expect("a known target");
    let program = compile(module, &target, &options)
        .unwrap_or_else(|e| panic!("the test module compiles for {}: {e}", target.name));
    check(&program, module).unwrap_or_else(|e| panic!("{} {}: {e}", target.name, options.plan));
    program
}

/// The tile blob of `program`, as the artifact writer lays it out: every weight region's bytes
/// (cut from the module by `region_bytes`) at its range (`WaferProgram::blob_ranges`).
pub fn pack_tile_blob(program: &WaferProgram, module: &Module) -> Vec<u8> {
    let mut blob = vec![0u8; program.tile_blob_len as usize];
    for (at, index, range) in program.blob_ranges() {
        let bytes = region_bytes(module, &program.pes[at].regions[index].kind).expect("weights present");
        blob[range.start as usize..range.end as usize].copy_from_slice(&bytes);
    }
    blob
}
