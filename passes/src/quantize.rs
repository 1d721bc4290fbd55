//! Weight quantisation to GGUF's `q8_0` or `q4_0` (`--quantize q8_0|q4_0`).
//!
//! Rewrites every `matvec` weight stored as f32, bf16 or f16 (and, if asked, the embedding
//! table) to the chosen block format, with ggml's reference quantisers
//! (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`) so the bytes equal what llama.cpp's
//! `llama-quantize` writes for the same values. A quantised weight needs a quarter (q8_0:
//! 34/128) or an eighth (q4_0: 18/128) of f32's SRAM, which is what lets larger models fit
//! on a wafer. The reference decoder widens the blocks back to f32 as NUMERICS.md says.
//!
//! A weight is rewritten only when:
//! - every use reads it as a `matvec` weight (not a bias), or as an `embed` table when the
//!   embedding is included. A table tied to the LM head is therefore left alone unless the
//!   embedding is included;
//! - it is 2-D with rows (the last axis) a whole number of 32-element blocks: ggml's blocks
//!   never straddle rows, so any other weight stays as it is;
//! - it is f32, bf16 or f16 (already-quantised weights are not requantised).
//!
//! A shape-only weight ([`WeightBytes::Absent`]) just gets the new dtype.

use rayon::prelude::*;
use waferc_ir::{DType, Module, Op, TensorType, Weight, WeightBytes, BLOCK};

use crate::error::PassError;
use crate::manager::Pass;

/// The block formats the pass writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormat {
    Q8_0,
    Q4_0,
}

impl QuantFormat {
    pub const ALL: [QuantFormat; 2] = [QuantFormat::Q8_0, QuantFormat::Q4_0];

    pub fn dtype(self) -> DType {
        match self {
            QuantFormat::Q8_0 => DType::Q8_0,
            QuantFormat::Q4_0 => DType::Q4_0,
        }
    }

    /// `q8_0` or `q4_0`, as the CLI and pipelines spell them.
    pub fn from_name(name: &str) -> Option<QuantFormat> {
        QuantFormat::ALL.into_iter().find(|f| f.dtype().name() == name)
    }

    /// Quantises one row (a whole number of blocks) into `out` (the row's bytes in this format).
    fn quantize_row(self, row: &[f32], out: &mut [u8]) {
        match self {
            QuantFormat::Q8_0 => quantize_row_q8_0(row, out),
            QuantFormat::Q4_0 => quantize_row_q4_0(row, out),
        }
    }
}

pub struct Quantize {
    pub format: QuantFormat,
    /// Also quantise tables read by `embed`.
    pub include_embedding: bool,
}

impl Pass for Quantize {
    fn name(&self) -> &'static str {
        "quantize"
    }

    fn run(&self, module: &mut Module) -> Result<(), PassError> {
        let chosen = self.chosen_weights(module);
        for handle in module.weights.handles() {
            if chosen[handle.index()] {
                module.weights[handle] = self.quantize_weight(&module.weights[handle])?;
            }
        }
        Ok(())
    }
}

impl Quantize {
    /// For each weight, whether the rules in the module documentation allow rewriting it.
    fn chosen_weights(&self, module: &Module) -> Vec<bool> {
        let mut eligible: Vec<bool> = module
            .weights
            .iter()
            .map(|(_, w)| {
                matches!(w.ty.dtype, DType::F32 | DType::BF16 | DType::F16)
                    && w.ty.shape.len() == 2
                    && w.ty.shape[1] > 0
                    && w.ty.shape[1] % BLOCK as u64 == 0
            })
            .collect();
        let mut used = vec![false; eligible.len()];
        for (_, instr) in module.body.iter() {
            let quantizable_use = match &instr.op {
                Op::MatVec { weight, .. } => Some(*weight),
                Op::Embed { table } if self.include_embedding => Some(*table),
                _ => None,
            };
            for w in instr.op.weights() {
                let Some(index) = (w.index() < eligible.len()).then_some(w.index()) else { continue };
                used[index] = true;
                if Some(w) != quantizable_use {
                    eligible[index] = false;
                }
            }
        }
        eligible.iter().zip(&used).map(|(&e, &u)| e && u).collect()
    }

    fn quantize_weight(&self, weight: &Weight) -> Result<Weight, PassError> {
        let ty = TensorType::new(self.format.dtype(), weight.ty.shape.clone());
        let data = match weight.data.bytes() {
            None => WeightBytes::Absent,
            Some(bytes) => WeightBytes::owned(self.quantize_bytes(weight, bytes)?),
        };
        Ok(Weight { name: weight.name.clone(), ty, data })
    }

    /// The weight's bytes in the target format, row by row in parallel (rows are independent,
    /// so the result does not depend on the thread count).
    fn quantize_bytes(&self, weight: &Weight, bytes: &[u8]) -> Result<Vec<u8>, PassError> {
        let (rows, cols) = (weight.ty.shape[0], weight.ty.shape[1]);
        let source = weight.ty.dtype;
        let element_bytes = match source {
            DType::F32 => 4,
            _ => 2,
        };
        let expected = rows.checked_mul(cols).and_then(|n| n.checked_mul(element_bytes));
        if expected != Some(bytes.len() as u64) {
            return Err(PassError::WeightSize {
                pass: "quantize",
                weight: weight.name.clone(),
                ty: weight.ty.clone(),
                expected: expected.unwrap_or(u64::MAX),
                found: bytes.len(),
            });
        }
        // The byte count fits in memory, so the row lengths do too.
        let cols = cols as usize;
        let out_row = self.format.dtype().row_bytes(cols as u64).unwrap_or(0) as usize;
        let mut out = vec![0u8; out_row * rows as usize];
        bytes.par_chunks(cols * element_bytes as usize).zip(out.par_chunks_mut(out_row)).for_each(|(src, dst)| {
            let row: Vec<f32> = widen(source, src);
            self.format.quantize_row(&row, dst);
        });
        Ok(out)
    }
}

/// Little-endian f32, bf16 or f16 elements widened exactly to f32.
fn widen(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        DType::BF16 => {
            bytes.chunks_exact(2).map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)).collect()
        }
        _ => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
    }
}

/// ggml's `quantize_row_q8_0_ref`: per block of 32, `d = max|x| / 127` stored as f16, then
/// `q = round(x * (1/d))` (half away from zero) as int8. `row.len()` is a multiple of 32 and
/// `out` holds 34 bytes per block.
pub fn quantize_row_q8_0(row: &[f32], out: &mut [u8]) {
    for (block, dst) in row.chunks_exact(BLOCK).zip(out.chunks_exact_mut(2 + BLOCK)) {
        let amax = block.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        dst[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for (q, x) in dst[2..].iter_mut().zip(block) {
            *q = ((x * id).round() as i8) as u8;
        }
    }
}

/// ggml's `quantize_row_q4_0_ref`: per block of 32, `max` the element of largest magnitude
/// (the first such), `d = max / -8` stored as f16, then `q = min(15, trunc(x * (1/d) + 8.5))`;
/// element `j` goes to the low nibble of byte `j` and element `j + 16` to its high nibble.
/// `row.len()` is a multiple of 32 and `out` holds 18 bytes per block.
pub fn quantize_row_q4_0(row: &[f32], out: &mut [u8]) {
    for (block, dst) in row.chunks_exact(BLOCK).zip(out.chunks_exact_mut(2 + BLOCK / 2)) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &x in block {
            if amax < x.abs() {
                amax = x.abs();
                max = x;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        dst[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        // C's float-to-int8 conversion truncates toward zero, as `as i8` does in range.
        let nibble = |x: f32| ((x * id + 8.5) as i8).min(15) as u8;
        for j in 0..BLOCK / 2 {
            dst[2 + j] = nibble(block[j]) | (nibble(block[j + BLOCK / 2]) << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use waferc_ir::{text, verify, Handle, ModelMeta};

    /// 64 values: a block with a magnitude tie for the maximum (-4.5 first, then 4.5), then a
    /// block with zeros, halves and quarters that land exactly on rounding boundaries.
    fn sample_row() -> Vec<f32> {
        let mut row: Vec<f32> = (0..32).map(|i| (((i * 37) % 64) as f64 - 31.5) as f32 / 7.0).collect();
        row.extend([0.0; 8]);
        row.extend([1.0, -2.0, 2.0, 0.5]);
        row.extend((0..20).map(|i| (i % 5) as f32 * 0.25 - 0.5));
        row
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    // Expected bytes from gguf-py's `gguf.quants.quantize`, which mirrors ggml's reference
    // quantisers, on `sample_row()`.
    const Q8_0_REFERENCE: &str = "89288116a93ed267fa8d22b54bde7306992ec257ea7f12a53ace63f6891eb147da6f0824\
                                  000000000000000040817f20e0f0001020e0f0001020e0f0001020e0f0001020";
    const Q4_0_REFERENCE: &str = "803840d973fc952ec851ea731da63fc862fb0034a868788898a868788c90af6a768798a9";

    #[test]
    fn q8_0_matches_ggml_reference() {
        let mut out = vec![0u8; 68];
        quantize_row_q8_0(&sample_row(), &mut out);
        assert_eq!(hex(&out), Q8_0_REFERENCE);
    }

    #[test]
    fn q4_0_matches_ggml_reference() {
        let mut out = vec![0u8; 36];
        quantize_row_q4_0(&sample_row(), &mut out);
        assert_eq!(hex(&out), Q4_0_REFERENCE);
    }

    #[test]
    fn all_zero_blocks_quantize_to_zero_scale() {
        let mut q8 = vec![0xffu8; 34];
        quantize_row_q8_0(&[0.0; 32], &mut q8);
        assert_eq!(q8, vec![0u8; 34]);
        let mut q4 = vec![0u8; 18];
        quantize_row_q4_0(&[0.0; 32], &mut q4);
        assert_eq!(q4[..2], [0x00, 0x80], "d = 0 / -8 is -0.0, as in ggml");
        assert!(q4[2..].iter().all(|&b| b == 0x88), "zero maps to the offset 8 in both nibbles");
    }

    /// Widens blocks as NUMERICS.md says the decoders do: q8_0 `d * q`, q4_0 `d * (q - 8)`.
    fn widen_blocks(format: QuantFormat, bytes: &[u8]) -> Vec<(f32, Vec<f32>)> {
        let block_bytes = format.dtype().row_bytes(BLOCK as u64).unwrap() as usize;
        let scale = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        bytes
            .chunks(block_bytes)
            .map(|b| {
                let d = scale(b);
                let values = match format {
                    QuantFormat::Q8_0 => b[2..].iter().map(|&q| d * f32::from(q as i8)).collect(),
                    QuantFormat::Q4_0 => (0..BLOCK)
                        .map(|i| {
                            let byte = b[2 + i % (BLOCK / 2)];
                            let q = if i < BLOCK / 2 { byte & 0xf } else { byte >> 4 };
                            d * (f32::from(q) - 8.0)
                        })
                        .collect(),
                };
                (d, values)
            })
            .collect()
    }

    #[test]
    fn decoded_blocks_are_within_the_quantisation_step() {
        // Deterministic values spanning several magnitudes, and both signs for the largest. Blocks
        // stay above ~0.01 in magnitude: below that the f16 scale is subnormal and loses bits,
        // as it does in ggml.
        let row: Vec<f32> = (0..32 * 64)
            .map(|i: u32| {
                let phase = (i.wrapping_mul(2_654_435_761) >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                phase * 10f32.powi((i / 32 % 4) as i32 - 1)
            })
            .collect();
        for format in QuantFormat::ALL {
            let mut bytes = vec![0u8; format.dtype().row_bytes(row.len() as u64).unwrap() as usize];
            format.quantize_row(&row, &mut bytes);
            for ((d, decoded), original) in widen_blocks(format, &bytes).iter().zip(row.chunks(BLOCK)) {
                let amax = original.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                // Half a step for rounding (a whole step where q4_0 clamps 16 to 15), plus the
                // f16 rounding of the scale, which scales with the block's largest value.
                let step = match format {
                    QuantFormat::Q8_0 => 0.5 * d.abs(),
                    QuantFormat::Q4_0 => d.abs(),
                };
                for (x, y) in original.iter().zip(decoded) {
                    assert!((x - y).abs() <= step + amax * 2e-3, "{format:?}: {x} decoded as {y}, d = {d}");
                }
            }
        }
    }

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// embed (table 4x64), matvec with a 64-row bf16 weight and a bias, a 4x48 head whose rows
    /// are not whole blocks, a q8_0-ready f16 weight given by shape only, and a norm.
    fn module() -> Module {
        let meta = ModelMeta { architecture: "test".into(), vocab_size: 4, ..Default::default() };
        let mut m = Module::new(meta);
        let row = sample_row();
        let table_bytes = f32_bytes(&row.iter().cycle().take(4 * 64).copied().collect::<Vec<_>>());
        let table = m.add_weight("table", TensorType::f32([4, 64]), WeightBytes::owned(table_bytes));
        let bf16: Vec<u8> =
            row.iter().cycle().take(48 * 64).flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
        let up = m.add_weight("up", TensorType::new(DType::BF16, [48, 64]), WeightBytes::owned(bf16));
        let bias = m.add_weight("up.bias", TensorType::f32([48]), WeightBytes::owned(vec![0u8; 48 * 4]));
        let down = m.add_weight("down", TensorType::new(DType::F16, [64, 48]), WeightBytes::Absent);
        let norm = m.add_weight("norm", TensorType::f32([64]), WeightBytes::Absent);
        let shapes_only = m.add_weight("gate", TensorType::new(DType::F16, [64, 64]), WeightBytes::Absent);
        let x = m.push(Op::Embed { table }, None).unwrap();
        let x = m.push(Op::RmsNorm { x, weight: norm, eps: 1e-6 }, None).unwrap();
        let x = m.push(Op::MatVec { x, weight: shapes_only, bias: None }, None).unwrap();
        let h = m.push(Op::MatVec { x, weight: up, bias: Some(bias) }, None).unwrap();
        let x = m.push(Op::MatVec { x: h, weight: down, bias: None }, None).unwrap();
        m.output = Some(m.push(Op::MatVec { x, weight: table, bias: None }, None).unwrap());
        verify(&m).unwrap();
        m
    }

    fn dtypes(m: &Module) -> Vec<String> {
        m.weights.iter().map(|(_, w)| format!("{} {}", w.name, w.ty)).collect()
    }

    #[test]
    fn rewrites_only_eligible_matvec_weights() {
        let mut m = module();
        Quantize { format: QuantFormat::Q8_0, include_embedding: false }.run(&mut m).unwrap();
        verify(&m).unwrap();
        assert_eq!(
            dtypes(&m),
            [
                "table f32[4, 64]",  // tied to the embedding, which is not included
                "up q8_0[48, 64]",   // rows of two blocks
                "up.bias f32[48]",   // a bias
                "down f16[64, 48]",  // rows of 48: not whole blocks
                "norm f32[64]",      // not a matvec weight
                "gate q8_0[64, 64]", // shape only
            ]
        );
        let up = &m.weights[Handle::new(1)];
        assert_eq!(up.data.bytes().map(<[u8]>::len), Some(48 * 68));
        // Each row of `up` is sample_row() truncated to bf16; it must quantise as that row does.
        let bf16_row: Vec<u8> = sample_row().iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
        let mut expected = vec![0u8; 68];
        quantize_row_q8_0(&widen(DType::BF16, &bf16_row), &mut expected);
        for row in up.data.bytes().unwrap().chunks(68) {
            assert_eq!(row, &expected[..]);
        }
        assert!(!m.weights[Handle::new(5)].data.is_present());
    }

    #[test]
    fn includes_the_embedding_table_when_asked() {
        let mut m = module();
        Quantize { format: QuantFormat::Q4_0, include_embedding: true }.run(&mut m).unwrap();
        verify(&m).unwrap();
        let table = &m.weights[Handle::new(0)];
        assert_eq!(table.ty, TensorType::new(DType::Q4_0, [4, 64]));
        for row in table.data.bytes().unwrap().chunks(36) {
            assert_eq!(hex(row), Q4_0_REFERENCE);
        }
        assert!(text::print(&m).contains("weight @table : q4_0[4, 64]\n"));
    }

    #[test]
    fn a_weight_whose_bytes_do_not_fit_its_type_is_an_error() {
        let mut m = module();
        m.weights[Handle::new(1)].data = WeightBytes::owned(vec![0u8; 10]);
        let err = Quantize { format: QuantFormat::Q8_0, include_embedding: false }.run(&mut m).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pass `quantize`: weight up is bf16[48, 64], which needs 6144 bytes, but it has 10"
        );
    }
}
