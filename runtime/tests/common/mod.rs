//! Test helpers: a deterministic RNG (the test models' SplitMix64), GGUF block encoders, and an
//! independent f64 decoding of weight bytes for the straightforward reference computations the
//! kernels are checked against.

#![allow(dead_code)] // each test binary uses a different subset

use half::{bf16, f16};
use waferc_ir::{DType, TensorType, WeightBytes};

pub use waferc_testsuite::models::Rng;

/// Encodes `values` (a row-major `[rows, cols]` matrix or a vector) in `dtype`, rounding to the
/// nearest representable stored value.
pub fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
        DType::Q8_0 => values
            .chunks(32)
            .flat_map(|block| {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = f16::from_f32(amax / 127.0);
                let inv = if d.to_f32() == 0.0 { 0.0 } else { 1.0 / d.to_f32() };
                let mut out = d.to_le_bytes().to_vec();
                out.extend(block.iter().map(|v| ((v * inv).round().clamp(-127.0, 127.0) as i8) as u8));
                out
            })
            .collect(),
        DType::Q4_0 => values
            .chunks(32)
            .flat_map(|block| {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = f16::from_f32(amax / 7.0);
                let inv = if d.to_f32() == 0.0 { 0.0 } else { 1.0 / d.to_f32() };
                let q: Vec<u8> = block.iter().map(|v| ((v * inv).round() + 8.0).clamp(0.0, 15.0) as u8).collect();
                let mut out = d.to_le_bytes().to_vec();
                out.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
                out
            })
            .collect(),
        DType::Mxfp4 => values
            .chunks(32)
            .flat_map(|block| {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
                let e = (amax / 6.0).log2().ceil().clamp(-127.0, 127.0) as i32;
                let scale = (e as f32).exp2();
                let code = |v: f32| {
                    (0..16u8)
                        .min_by(|&a, &b| {
                            (FP4[a as usize] - v / scale).abs().total_cmp(&(FP4[b as usize] - v / scale).abs())
                        })
                        .unwrap()
                };
                let mut out = vec![(e + 127) as u8];
                out.extend((0..16).map(|j| code(block[2 * j]) | (code(block[2 * j + 1]) << 4)));
                out
            })
            .collect(),
        DType::Q4_1 => values
            .chunks(32)
            .flat_map(|block| {
                let min = block.iter().fold(f32::INFINITY, |m, v| m.min(*v));
                let max = block.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
                let d = f16::from_f32((max - min) / 15.0);
                let m = f16::from_f32(min);
                let inv = if d.to_f32() == 0.0 { 0.0 } else { 1.0 / d.to_f32() };
                let q: Vec<u8> =
                    block.iter().map(|v| ((v - m.to_f32()) * inv).round().clamp(0.0, 15.0) as u8).collect();
                let mut out = d.to_le_bytes().to_vec();
                out.extend(m.to_le_bytes());
                out.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
                out
            })
            .collect(),
    }
}

/// The stored weight a dtype's bytes decode to, in f64, straight from the GGUF block layouts
/// (independent of the crate's widening code).
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    let f16_at = |b: &[u8], at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f64();
    match dtype {
        DType::F32 => bytes.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64).collect(),
        DType::BF16 => bytes.chunks(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f64()).collect(),
        DType::F16 => bytes.chunks(2).map(|b| f16_at(b, 0)).collect(),
        DType::Q8_0 => bytes
            .chunks(34)
            .flat_map(|b| {
                let d = f16_at(b, 0);
                b[2..].iter().map(move |&q| d * (q as i8) as f64)
            })
            .collect(),
        DType::Q4_0 => bytes
            .chunks(18)
            .flat_map(|b| {
                let d = f16_at(b, 0);
                let low = b[2..].iter().map(move |&q| d * ((q & 15) as f64 - 8.0));
                let high = b[2..].iter().map(move |&q| d * ((q >> 4) as f64 - 8.0));
                low.chain(high).collect::<Vec<_>>()
            })
            .collect(),
        DType::Mxfp4 => bytes
            .chunks(17)
            .flat_map(|b| {
                let scale = ((b[0] as i32 - 127) as f64).exp2();
                b[1..]
                    .iter()
                    .flat_map(move |&q| [FP4[(q & 15) as usize] as f64 * scale, FP4[(q >> 4) as usize] as f64 * scale])
                    .collect::<Vec<_>>()
            })
            .collect(),
        DType::Q4_1 => bytes
            .chunks(20)
            .flat_map(|b| {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                // (d * q) + m rounded as f32 ops, as the contract widens it.
                let widen = move |q: u8| ((d as f32 * q as f32) + m as f32) as f64;
                let low = b[4..].iter().map(move |&q| widen(q & 15));
                let high = b[4..].iter().map(move |&q| widen(q >> 4));
                low.chain(high).collect::<Vec<_>>()
            })
            .collect(),
    }
}

/// A weight of `dtype` and `shape` with random values of magnitude `scale`, and its f64 decoding.
pub fn random_weight(rng: &mut Rng, dtype: DType, shape: &[u64], scale: f32) -> (TensorType, WeightBytes, Vec<f64>) {
    let n: u64 = shape.iter().product();
    let bytes = encode(dtype, &rng.vector(n as usize, scale));
    let decoded = decode(dtype, &bytes);
    (TensorType::new(dtype, shape.to_vec()), WeightBytes::owned(bytes), decoded)
}

pub fn dot64(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max)
}

/// The e2m1 values of MXFP4 codes 0..16.
const FP4: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
