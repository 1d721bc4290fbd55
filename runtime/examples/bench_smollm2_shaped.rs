//! Decode throughput of the reference decoder on a SmolLM2-135M-shaped module with random
//! weights in memory (Q4_1 layers, Q8_0 tied embedding / head, as the GGUF ships them).
//!
//! cargo run --release -p waferc-runtime --example bench_smollm2_shaped -- [steps] [threads]

use std::time::Instant;

use half::f16;
use waferc_ir::{DType, KvCache, ModelMeta, Module, Op, Rope, RopeScaling, TensorType, WeightBytes};
use waferc_runtime::ReferenceDecoder;

const HIDDEN: u64 = 576;
const FFN: u64 = 1536;
const LAYERS: u32 = 30;
const VOCAB: u64 = 49152;
const HEADS: u32 = 9;
const KV_HEADS: u32 = 3;
const HEAD_DIM: u32 = 64;

/// SplitMix64: deterministic bytes without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Random blocks of a quantised `[rows, cols]` weight with scales that keep activations tame.
fn quantized(rng: &mut Rng, dtype: DType, rows: u64, cols: u64) -> WeightBytes {
    let blocks = rows * cols / 32;
    let mut bytes = Vec::new();
    for _ in 0..blocks {
        match dtype {
            DType::Q8_0 => {
                bytes.extend(f16::from_f32(0.0005 + 0.0005 * rng.unit()).to_le_bytes());
                bytes.extend((0..32).map(|_| rng.next() as u8));
            }
            DType::Q4_1 => {
                bytes.extend(f16::from_f32(0.005 + 0.005 * rng.unit()).to_le_bytes());
                bytes.extend(f16::from_f32(-0.04 - 0.01 * rng.unit()).to_le_bytes());
                bytes.extend((0..16).map(|_| rng.next() as u8));
            }
            _ => unreachable!("the benchmark only builds q8_0 and q4_1 weights"),
        }
    }
    WeightBytes::owned(bytes)
}

fn norm_weight(rng: &mut Rng) -> WeightBytes {
    WeightBytes::owned((0..HIDDEN).flat_map(|_| (0.9 + 0.2 * rng.unit()).to_le_bytes()).collect::<Vec<u8>>())
}

fn smollm2_shaped() -> Module {
    let mut rng = Rng(0x5EED);
    let mut m = Module::new(ModelMeta {
        architecture: "llama".into(),
        vocab_size: VOCAB as u32,
        num_layers: LAYERS,
        ..ModelMeta::default()
    });
    let mut weight = |m: &mut Module, name: String, dtype: DType, rows: u64, cols: u64| {
        let data = quantized(&mut rng, dtype, rows, cols);
        m.add_weight(name, TensorType::new(dtype, [rows, cols]), data)
    };
    let embed = weight(&mut m, "model.embed_tokens.weight".into(), DType::Q8_0, VOCAB, HIDDEN);
    let mut layer_weights = Vec::new();
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        let kv = (KV_HEADS * HEAD_DIM) as u64;
        layer_weights.push([
            weight(&mut m, format!("{p}.self_attn.q_proj.weight"), DType::Q4_1, HIDDEN, HIDDEN),
            weight(&mut m, format!("{p}.self_attn.k_proj.weight"), DType::Q4_1, kv, HIDDEN),
            weight(&mut m, format!("{p}.self_attn.v_proj.weight"), DType::Q4_1, kv, HIDDEN),
            weight(&mut m, format!("{p}.self_attn.o_proj.weight"), DType::Q4_1, HIDDEN, HIDDEN),
            weight(&mut m, format!("{p}.mlp.gate_proj.weight"), DType::Q4_1, FFN, HIDDEN),
            weight(&mut m, format!("{p}.mlp.up_proj.weight"), DType::Q4_1, FFN, HIDDEN),
            weight(&mut m, format!("{p}.mlp.down_proj.weight"), DType::Q4_1, HIDDEN, FFN),
        ]);
    }
    let mut norm_rng = Rng(7);
    let rope = Rope { theta: 100000.0, scaling: RopeScaling::None };
    let mut build = |m: &mut Module| -> Result<(), waferc_ir::IrError> {
        let mut x = m.push(Op::Embed { table: embed }, None)?;
        for (l, [wq, wk, wv, wo, wg, wu, wd]) in layer_weights.iter().copied().enumerate() {
            let layer = Some(l as u32);
            let norm = |m: &mut Module, name: String, rng: &mut Rng| {
                m.add_weight(name, TensorType::f32([HIDDEN]), norm_weight(rng))
            };
            let attn_norm = norm(m, format!("model.layers.{l}.input_layernorm.weight"), &mut norm_rng);
            let ffn_norm = norm(m, format!("model.layers.{l}.post_attention_layernorm.weight"), &mut norm_rng);
            let cache = m.add_cache(KvCache { layer: l as u32, kv_heads: KV_HEADS, head_dim: HEAD_DIM });
            let h = m.push(Op::RmsNorm { x, weight: attn_norm, eps: 1e-5 }, layer)?;
            let q = m.push(Op::MatVec { x: h, weight: wq, bias: None }, layer)?;
            let k = m.push(Op::MatVec { x: h, weight: wk, bias: None }, layer)?;
            let v = m.push(Op::MatVec { x: h, weight: wv, bias: None }, layer)?;
            let q = m.push(Op::Rope { x: q, head_dim: HEAD_DIM, rope: rope.clone() }, layer)?;
            let k = m.push(Op::Rope { x: k, head_dim: HEAD_DIM, rope: rope.clone() }, layer)?;
            let scale = 1.0 / (HEAD_DIM as f32).sqrt();
            let a = m.push(Op::Attention { q, k, v, cache, heads: HEADS, scale, window: None, sinks: None }, layer)?;
            let o = m.push(Op::MatVec { x: a, weight: wo, bias: None }, layer)?;
            x = m.push(Op::Add { a: x, b: o }, layer)?;
            let h = m.push(Op::RmsNorm { x, weight: ffn_norm, eps: 1e-5 }, layer)?;
            let g = m.push(Op::MatVec { x: h, weight: wg, bias: None }, layer)?;
            let u = m.push(Op::MatVec { x: h, weight: wu, bias: None }, layer)?;
            let g = m.push(Op::Silu { x: g }, layer)?;
            let f = m.push(Op::Mul { a: g, b: u }, layer)?;
            let d = m.push(Op::MatVec { x: f, weight: wd, bias: None }, layer)?;
            x = m.push(Op::Add { a: x, b: d }, layer)?;
        }
        let final_norm = m.add_weight("model.norm.weight", TensorType::f32([HIDDEN]), norm_weight(&mut norm_rng));
        let h = m.push(Op::RmsNorm { x, weight: final_norm, eps: 1e-5 }, None)?;
        m.output = Some(m.push(Op::MatVec { x: h, weight: embed, bias: None }, None)?);
        Ok(())
    };
    build(&mut m).expect("the SmolLM2-shaped module is well formed");
    m
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(64).max(1);
    let threads: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(2);
    let module = smollm2_shaped();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    let mut decoder = ReferenceDecoder::new(&module, steps + 1)?;
    pool.install(|| -> Result<(), waferc_runtime::RuntimeError> {
        decoder.step(1)?; // warm-up: page in the weights
        let mut step_times = Vec::with_capacity(steps);
        let start = Instant::now();
        let mut token = 1;
        for _ in 0..steps {
            let step_start = Instant::now();
            let logits = decoder.step(token)?;
            step_times.push(step_start.elapsed().as_secs_f64());
            token = waferc_runtime::argmax(&logits);
        }
        let secs = start.elapsed().as_secs_f64();
        step_times.sort_by(f64::total_cmp);
        println!("SmolLM2-135M-shaped (Q4_1 layers, Q8_0 head), {threads} thread(s), {steps} decode steps:");
        println!("  overall     {:6.1} tokens/s", steps as f64 / secs);
        // Other processes on a shared machine slow some steps down; the median and best step
        // show the decoder's own speed.
        println!("  median step {:6.1} tokens/s", 1.0 / step_times[steps / 2]);
        println!("  best step   {:6.1} tokens/s", 1.0 / step_times[0]);
        Ok(())
    })?;
    Ok(())
}
