//! Small modules built through the API, shared by the integration tests.

#![allow(dead_code)] // Each test binary uses a different subset.

use waferc_ir::{DType, KvCache, ModelMeta, Module, Op, Rope, RopeScaling, TensorType, Value, WeightBytes};

pub const HIDDEN: u64 = 64;
pub const HEADS: u32 = 4;
pub const KV_HEADS: u32 = 2;
pub const HEAD_DIM: u32 = 16;
pub const VOCAB: u32 = 128;

fn weight(m: &mut Module, name: &str, dtype: DType, shape: &[u64]) -> waferc_ir::Handle<waferc_ir::Weight> {
    m.add_weight(name, TensorType::new(dtype, shape.to_vec()), WeightBytes::Absent)
}

/// Attention block of layer `layer` on the normed input `x`; returns the residual sum.
fn attention_block(m: &mut Module, layer: u32, residual: Value, rope: &Rope, qk_norm: bool, bias: bool) -> Value {
    let l = Some(layer);
    let p = format!("model.layers.{layer}");
    let kv = (KV_HEADS * HEAD_DIM) as u64;
    let norm_w = weight(m, &format!("{p}.input_layernorm.weight"), DType::BF16, &[HIDDEN]);
    let x = m.push(Op::RmsNorm { x: residual, weight: norm_w, eps: 1e-6 }, l).unwrap();
    let proj = |m: &mut Module, name: &str, rows: u64| {
        let w = weight(m, &format!("{p}.self_attn.{name}.weight"), DType::BF16, &[rows, HIDDEN]);
        let b = bias.then(|| weight(m, &format!("{p}.self_attn.{name}.bias"), DType::BF16, &[rows]));
        m.push(Op::MatVec { x, weight: w, bias: b }, l).unwrap()
    };
    let mut q = proj(m, "q_proj", HIDDEN);
    let mut k = proj(m, "k_proj", kv);
    let v = proj(m, "v_proj", kv);
    if qk_norm {
        let qn = weight(m, &format!("{p}.self_attn.q_norm.weight"), DType::BF16, &[HEAD_DIM as u64]);
        let kn = weight(m, &format!("{p}.self_attn.k_norm.weight"), DType::BF16, &[HEAD_DIM as u64]);
        q = m.push(Op::RmsNorm { x: q, weight: qn, eps: 1e-6 }, l).unwrap();
        k = m.push(Op::RmsNorm { x: k, weight: kn, eps: 1e-6 }, l).unwrap();
    }
    let q = m.push(Op::Rope { x: q, head_dim: HEAD_DIM, rope: rope.clone() }, l).unwrap();
    let k = m.push(Op::Rope { x: k, head_dim: HEAD_DIM, rope: rope.clone() }, l).unwrap();
    let cache = m.add_cache(KvCache { layer, kv_heads: KV_HEADS, head_dim: HEAD_DIM });
    let attn =
        m.push(Op::Attention { q, k, v, cache, heads: HEADS, scale: 0.25, window: None, sinks: None }, l).unwrap();
    let o_w = weight(m, &format!("{p}.self_attn.o_proj.weight"), DType::BF16, &[HIDDEN, HIDDEN]);
    let o = m.push(Op::MatVec { x: attn, weight: o_w, bias: None }, l).unwrap();
    m.push(Op::Add { a: residual, b: o }, l).unwrap()
}

/// SwiGLU feed-forward on `x` with weights under `prefix`.
fn swiglu(m: &mut Module, layer: u32, x: Value, prefix: &str, inter: u64) -> Value {
    let l = Some(layer);
    let gate_w = weight(m, &format!("{prefix}.gate_proj.weight"), DType::BF16, &[inter, HIDDEN]);
    let up_w = weight(m, &format!("{prefix}.up_proj.weight"), DType::BF16, &[inter, HIDDEN]);
    let down_w = weight(m, &format!("{prefix}.down_proj.weight"), DType::BF16, &[HIDDEN, inter]);
    let gate = m.push(Op::MatVec { x, weight: gate_w, bias: None }, l).unwrap();
    let gate = m.push(Op::Silu { x: gate }, l).unwrap();
    let up = m.push(Op::MatVec { x, weight: up_w, bias: None }, l).unwrap();
    let h = m.push(Op::Mul { a: gate, b: up }, l).unwrap();
    m.push(Op::MatVec { x: h, weight: down_w, bias: None }, l).unwrap()
}

fn head(m: &mut Module, residual: Value) {
    let norm_w = weight(m, "model.norm.weight", DType::BF16, &[HIDDEN]);
    let x = m.push(Op::RmsNorm { x: residual, weight: norm_w, eps: 1e-5 }, None).unwrap();
    let lm = weight(m, "lm_head.weight", DType::BF16, &[VOCAB as u64, HIDDEN]);
    let logits = m.push(Op::MatVec { x, weight: lm, bias: None }, None).unwrap();
    m.output = Some(logits);
}

fn meta(architecture: &str, layers: u32) -> ModelMeta {
    ModelMeta {
        architecture: architecture.into(),
        vocab_size: VOCAB,
        num_layers: layers,
        bos_token_id: Some(1),
        eos_token_ids: vec![2, 7],
    }
}

/// A two-layer Llama-style model: GQA, q/k/v biases in layer 0, Llama 3 rope scaling.
pub fn dense() -> Module {
    let mut m = Module::new(meta("llama", 2));
    let embed_w = weight(&mut m, "model.embed_tokens.weight", DType::BF16, &[VOCAB as u64, HIDDEN]);
    let mut residual = m.push(Op::Embed { table: embed_w }, None).unwrap();
    let rope = Rope {
        theta: 500000.0,
        scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        },
    };
    for layer in 0..2 {
        residual = attention_block(&mut m, layer, residual, &rope, false, layer == 0);
        let p = format!("model.layers.{layer}");
        let norm_w = weight(&mut m, &format!("{p}.post_attention_layernorm.weight"), DType::BF16, &[HIDDEN]);
        let x = m.push(Op::RmsNorm { x: residual, weight: norm_w, eps: 1e-6 }, Some(layer)).unwrap();
        let ffn = swiglu(&mut m, layer, x, &format!("{p}.mlp"), 128);
        residual = m.push(Op::Add { a: residual, b: ffn }, Some(layer)).unwrap();
    }
    head(&mut m, residual);
    m
}

pub const EXPERTS: u32 = 4;

/// A one-layer Qwen3-MoE-style model: q/k norms, linear rope scaling, 4 experts, top 2.
pub fn moe() -> Module {
    let mut m = Module::new(meta("qwen3_moe", 1));
    let embed_w = weight(&mut m, "model.embed_tokens.weight", DType::F32, &[VOCAB as u64, HIDDEN]);
    let residual = m.push(Op::Embed { table: embed_w }, None).unwrap();
    let rope = Rope { theta: 1000000.0, scaling: RopeScaling::Linear { factor: 2.0 } };
    let residual = attention_block(&mut m, 0, residual, &rope, true, false);
    let norm_w = weight(&mut m, "model.layers.0.post_attention_layernorm.weight", DType::BF16, &[HIDDEN]);
    let l = Some(0);
    let x = m.push(Op::RmsNorm { x: residual, weight: norm_w, eps: 1e-6 }, l).unwrap();
    let gate_w = weight(&mut m, "model.layers.0.mlp.gate.weight", DType::BF16, &[EXPERTS as u64, HIDDEN]);
    let router_logits = m.push(Op::MatVec { x, weight: gate_w, bias: None }, l).unwrap();
    let routing = m.push(Op::RouterTopK { logits: router_logits, top_k: 2, normalize: true }, l).unwrap();
    let experts = (0..EXPERTS)
        .map(|expert| {
            let xe = m.push(Op::ExpertDispatch { x, routing, expert }, l).unwrap();
            swiglu(&mut m, 0, xe, &format!("model.layers.0.mlp.experts.{expert}"), 32)
        })
        .collect();
    let moe = m.push(Op::ExpertCombine { routing, experts }, l).unwrap();
    let residual = m.push(Op::Add { a: residual, b: moe }, l).unwrap();
    head(&mut m, residual);
    m
}
