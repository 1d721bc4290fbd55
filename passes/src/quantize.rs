//! Weight quantisation to GGUF's `q8_0`, `q4_0` or `q4_1` (`--passes "quantize FORMAT[:WHAT] ..."`).
//!
//! Rewrites the chosen weights stored as f32, bf16 or f16 to a block format with ggml's reference
//! quantisers (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`, `quantize_row_q4_1_ref`), so the
//! bytes equal what llama.cpp's `llama-quantize` writes for the same values. The blocks stay
//! packed: lowering places them in PE tiles as they are, and the kernels widen one block at a
//! time inside the dot product (NUMERICS.md, "Values"). A quantised weight needs 34/128 (q8_0),
//! 18/128 (q4_0) or 20/128 (q4_1) of f32's SRAM, which is what lets larger models fit.
//!
//! # What is quantised
//!
//! A model has three parts a weight can belong to, chosen separately:
//! - `layers`: the `matvec` weights inside decoder layers (projections, MLPs, experts, routers);
//! - `embedding`: tables read by `embed`;
//! - `lm_head`: `matvec` weights outside the layers (the output projection).
//!
//! Each argument is `FORMAT[:WHAT]`, WHAT being parts joined by `+` or `all`, e.g.
//! `quantize q4_0:layers q8_0:embedding+lm_head`. A bare `FORMAT` means every matvec weight:
//! `layers`, and `lm_head` unless the LM head is the embedding table (tied), which then stays.
//! No part may be named twice.
//!
//! A weight is rewritten only when:
//! - every use reads it as a quantisable part (a `matvec` weight, not a bias; or an `embed`
//!   table), and every part reading it is chosen with the same format. A table tied to the LM
//!   head is read by both `embedding` and `lm_head`: naming one and not the other, or the two
//!   with different formats, is an error (one tensor cannot be two formats);
//! - it is 2-D with rows (the last axis) a whole number of 32-element blocks: ggml's blocks
//!   never straddle rows, so any other weight stays as it is;
//! - it is f32, bf16 or f16. Weights that arrive quantised (a GGUF's Q8_0/Q4_0/Q4_1 tensors) are
//!   never requantised: they are placed with the bytes the checkpoint holds.
//!
//! A shape-only weight ([`WeightBytes::Absent`]) just gets the new dtype.

use rayon::prelude::*;
use waferc_ir::{DType, Handle, Module, Op, TensorType, Weight, WeightBytes, BLOCK};

use crate::error::PassError;
use crate::manager::Pass;

/// The block formats the pass writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormat {
    Q8_0,
    Q4_0,
    Q4_1,
}

impl QuantFormat {
    pub const ALL: [QuantFormat; 3] = [QuantFormat::Q8_0, QuantFormat::Q4_0, QuantFormat::Q4_1];

    pub fn dtype(self) -> DType {
        match self {
            QuantFormat::Q8_0 => DType::Q8_0,
            QuantFormat::Q4_0 => DType::Q4_0,
            QuantFormat::Q4_1 => DType::Q4_1,
        }
    }

    /// `q8_0`, `q4_0` or `q4_1`, as the CLI and pipelines spell them.
    pub fn from_name(name: &str) -> Option<QuantFormat> {
        QuantFormat::ALL.into_iter().find(|f| f.dtype().name() == name)
    }

    /// Quantises one row (a whole number of blocks) into `out` (the row's bytes in this format).
    pub fn quantize_row(self, row: &[f32], out: &mut [u8]) {
        match self {
            QuantFormat::Q8_0 => quantize_row_q8_0(row, out),
            QuantFormat::Q4_0 => quantize_row_q4_0(row, out),
            QuantFormat::Q4_1 => quantize_row_q4_1(row, out),
        }
    }
}

/// A part of the model `quantize` can be told to rewrite (module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Part {
    Layers,
    Embedding,
    LmHead,
}

impl Part {
    pub const ALL: [Part; 3] = [Part::Layers, Part::Embedding, Part::LmHead];

    /// `layers`, `embedding` or `lm_head`, as `FORMAT:WHAT` spells them.
    pub fn name(self) -> &'static str {
        match self {
            Part::Layers => "layers",
            Part::Embedding => "embedding",
            Part::LmHead => "lm_head",
        }
    }

    pub fn from_name(name: &str) -> Option<Part> {
        Part::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The part a use of a weight belongs to: `None` for a use no format can take (a bias, a
    /// norm scale, ...).
    fn of_use(op: &Op, layer: Option<u32>, weight: Handle<Weight>) -> Option<Part> {
        match op {
            Op::MatVec { weight: w, .. } if *w == weight => {
                Some(if layer.is_some() { Part::Layers } else { Part::LmHead })
            }
            Op::Embed { table } if *table == weight => Some(Part::Embedding),
            _ => None,
        }
    }
}

/// The `quantize` pass: a format (or none) for each [`Part`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantize {
    pub layers: Option<QuantFormat>,
    pub embedding: Option<QuantFormat>,
    pub lm_head: Option<QuantFormat>,
    /// Leave a table shared by the embedding and the LM head alone when only one of its parts
    /// is chosen, instead of rejecting the selection (what a bare `FORMAT` asks for).
    pub keep_shared: bool,
}

impl Quantize {
    /// A bare `FORMAT`: every matvec weight, an LM head tied to the embedding excepted.
    pub fn matvecs(format: QuantFormat) -> Quantize {
        Quantize { layers: Some(format), embedding: None, lm_head: Some(format), keep_shared: true }
    }

    /// `FORMAT:all`: layers, embedding and LM head.
    pub fn all(format: QuantFormat) -> Quantize {
        Quantize { layers: Some(format), embedding: Some(format), lm_head: Some(format), keep_shared: false }
    }

    /// The format chosen for `part`.
    pub fn format_of(&self, part: Part) -> Option<QuantFormat> {
        match part {
            Part::Layers => self.layers,
            Part::Embedding => self.embedding,
            Part::LmHead => self.lm_head,
        }
    }

    fn slot(&mut self, part: Part) -> &mut Option<QuantFormat> {
        match part {
            Part::Layers => &mut self.layers,
            Part::Embedding => &mut self.embedding,
            Part::LmHead => &mut self.lm_head,
        }
    }

    /// Builds the pass from its arguments, each `FORMAT[:WHAT]` (module documentation). The
    /// error says what is wrong; the registry adds the usage.
    pub fn from_args(args: &[&str]) -> Result<Quantize, String> {
        if args.is_empty() {
            return Err("needs a format".into());
        }
        let mut pass = Quantize { layers: None, embedding: None, lm_head: None, keep_shared: false };
        for arg in args {
            let (format_name, what) = match arg.split_once(':') {
                Some((format, what)) => (format, Some(what)),
                None => (*arg, None),
            };
            let format =
                QuantFormat::from_name(format_name).ok_or_else(|| format!("unknown format `{format_name}`"))?;
            let parts: Vec<Part> = match what {
                None => {
                    pass.keep_shared = true;
                    vec![Part::Layers, Part::LmHead]
                }
                Some("all") => Part::ALL.to_vec(),
                Some(what) => what
                    .split('+')
                    .map(|name| {
                        Part::from_name(name).ok_or_else(|| {
                            format!("unknown part `{name}` in `{arg}` (parts: layers, embedding, lm_head, all)")
                        })
                    })
                    .collect::<Result<_, _>>()?,
            };
            for part in parts {
                let slot = pass.slot(part);
                if slot.is_some() {
                    return Err(format!("`{arg}` chooses a format for {} a second time", part.name()));
                }
                *slot = Some(format);
            }
        }
        Ok(pass)
    }
}

impl Pass for Quantize {
    fn name(&self) -> &'static str {
        "quantize"
    }

    fn run(&self, module: &mut Module) -> Result<(), PassError> {
        let chosen = self.chosen_formats(module)?;
        for handle in module.weights.handles() {
            if let Some(format) = chosen[handle.index()] {
                module.weights[handle] = quantize_weight(format, &module.weights[handle])?;
            }
        }
        Ok(())
    }
}

impl Quantize {
    /// For each weight, the format the rules in the module documentation rewrite it to.
    fn chosen_formats(&self, module: &Module) -> Result<Vec<Option<QuantFormat>>, PassError> {
        // Per weight: the parts reading it, and whether anything else reads it.
        let mut parts: Vec<Vec<Part>> = vec![Vec::new(); module.weights.len()];
        let mut other_use = vec![false; module.weights.len()];
        for (_, instr) in module.body.iter() {
            for w in instr.op.weights() {
                let Some(index) = (w.index() < parts.len()).then_some(w.index()) else { continue };
                match Part::of_use(&instr.op, instr.layer, w) {
                    Some(part) if !parts[index].contains(&part) => parts[index].push(part),
                    Some(_) => {}
                    None => other_use[index] = true,
                }
            }
        }
        let mut chosen = Vec::with_capacity(parts.len());
        for (handle, weight) in module.weights.iter() {
            let (parts, other_use) = (&mut parts[handle.index()], other_use[handle.index()]);
            parts.sort();
            let formats: Vec<Option<QuantFormat>> = parts.iter().map(|&p| self.format_of(p)).collect();
            let format = if formats.iter().all(|&f| Some(&f) == formats.first()) {
                formats.first().copied().flatten()
            } else {
                let mut named_formats: Vec<QuantFormat> = formats.iter().flatten().copied().collect();
                named_formats.dedup();
                if self.keep_shared && named_formats.len() == 1 {
                    None
                } else {
                    let named: Vec<String> = parts
                        .iter()
                        .zip(&formats)
                        .map(|(p, f)| format!("{} ({})", p.name(), f.map_or("not chosen", |f| f.dtype().name())))
                        .collect();
                    return Err(PassError::SharedWeight {
                        pass: "quantize",
                        weight: weight.name.clone(),
                        parts: named.join(", "),
                    });
                }
            };
            let eligible = !other_use
                && matches!(weight.ty.dtype, DType::F32 | DType::BF16 | DType::F16)
                && weight.ty.shape.len() == 2
                && weight.ty.shape[1] > 0
                && weight.ty.shape[1] % BLOCK as u64 == 0;
            chosen.push(format.filter(|_| eligible));
        }
        Ok(chosen)
    }
}

fn quantize_weight(format: QuantFormat, weight: &Weight) -> Result<Weight, PassError> {
    let ty = TensorType::new(format.dtype(), weight.ty.shape.clone());
    let data = match weight.data.bytes() {
        None => WeightBytes::Absent,
        Some(bytes) => WeightBytes::owned(quantize_bytes(format, weight, bytes)?),
    };
    Ok(Weight { name: weight.name.clone(), ty, data })
}

/// The weight's bytes in `format`, row by row in parallel (rows are independent, so the result
/// does not depend on the thread count).
fn quantize_bytes(format: QuantFormat, weight: &Weight, bytes: &[u8]) -> Result<Vec<u8>, PassError> {
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
    let out_row = format.dtype().row_bytes(cols as u64).unwrap_or(0) as usize;
    let mut out = vec![0u8; out_row * rows as usize];
    bytes.par_chunks(cols * element_bytes as usize).zip(out.par_chunks_mut(out_row)).for_each(|(src, dst)| {
        let row: Vec<f32> = widen(source, src);
        format.quantize_row(&row, dst);
    });
    Ok(out)
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

/// ggml's `quantize_row_q4_1_ref`: per block of 32, `min` and `max` of the elements,
/// `d = (max - min) / 15`; `d` and `min` stored as f16, then `q = min(15, trunc((x - min) * (1/d) + 0.5))`
/// computed with the unrounded f32 `min` and `d`; nibbles laid out as in q4_0. `row.len()` is a
/// multiple of 32 and `out` holds 20 bytes per block.
pub fn quantize_row_q4_1(row: &[f32], out: &mut [u8]) {
    for (block, dst) in row.chunks_exact(BLOCK).zip(out.chunks_exact_mut(4 + BLOCK / 2)) {
        let (mut min, mut max) = (f32::MAX, -f32::MAX);
        for &x in block {
            if x < min {
                min = x;
            }
            if x > max {
                max = x;
            }
        }
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        dst[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        dst[2..4].copy_from_slice(&half::f16::from_f32(min).to_le_bytes());
        // C's float-to-int8 conversion truncates toward zero, as `as i8` does in range.
        let nibble = |x: f32| (((x - min) * id + 0.5) as i8).min(15) as u8;
        for j in 0..BLOCK / 2 {
            dst[4 + j] = nibble(block[j]) | (nibble(block[j + BLOCK / 2]) << 4);
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
                    QuantFormat::Q4_1 => {
                        let m = scale(&b[2..]);
                        (0..BLOCK)
                            .map(|i| {
                                let byte = b[4 + i % (BLOCK / 2)];
                                let q = if i < BLOCK / 2 { byte & 0xf } else { byte >> 4 };
                                d * f32::from(q) + m
                            })
                            .collect()
                    }
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
                    QuantFormat::Q8_0 | QuantFormat::Q4_1 => 0.5 * d.abs(),
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
        Quantize::matvecs(QuantFormat::Q8_0).run(&mut m).unwrap();
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
        Quantize::all(QuantFormat::Q4_0).run(&mut m).unwrap();
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
        let err = Quantize::matvecs(QuantFormat::Q8_0).run(&mut m).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pass `quantize`: weight up is bf16[48, 64], which needs 6144 bytes, but it has 10"
        );
    }

    /// A block whose q4_1 arithmetic is exact, worked by hand from ggml's rules: min -1 and
    /// max 14 give d = 1 and 1/d = 1, so `q = trunc(x + 1 + 0.5)`: x = k - 1 gives k, x = k - 0.5
    /// (a tie) rounds up to k + 1, x = k - 0.51 down to k. A constant block gives d = 0, m = x, q = 0.
    #[test]
    fn q4_1_follows_ggml_reference_rules() {
        let mut block = [0.0f32; 32];
        for (j, x) in block.iter_mut().enumerate() {
            *x = match j % 4 {
                0 => (j % 16) as f32 - 1.0,  // q = j % 16
                1 => (j % 15) as f32 - 0.5,  // q = j % 15 + 1 (ties round up)
                2 => (j % 15) as f32 - 0.51, // q = j % 15
                _ => {
                    if j < 16 {
                        -1.0
                    } else {
                        14.0
                    }
                } // q = 0, then 15
            };
        }
        let expected_q: Vec<u8> = (0..32)
            .map(|j| match j % 4 {
                0 => (j % 16) as u8,
                1 => (j % 15 + 1) as u8,
                2 => (j % 15) as u8,
                _ => {
                    if j < 16 {
                        0
                    } else {
                        15
                    }
                }
            })
            .collect();
        let mut expected = vec![0x00, 0x3c, 0x00, 0xbc]; // f16 1.0, f16 -1.0
        expected.extend((0..16).map(|j| expected_q[j] | (expected_q[j + 16] << 4)));
        let mut out = vec![0u8; 20];
        quantize_row_q4_1(&block, &mut out);
        assert_eq!(hex(&out), hex(&expected));

        quantize_row_q4_1(&[0.75; 32], &mut out);
        assert_eq!(out[..4], [0x00, 0x00, 0x00, 0x3a], "d = 0, m = f16 0.75");
        assert!(out[4..].iter().all(|&b| b == 0));
    }

    #[test]
    fn parts_are_chosen_separately() {
        // `table` is tied: read by embed and by the LM head's matvec.
        let mut m = module();
        let layers = Quantize { layers: Some(QuantFormat::Q4_1), embedding: None, lm_head: None, keep_shared: false };
        layers.run(&mut m).unwrap();
        verify(&m).unwrap();
        // No instruction of module() is inside a layer, so nothing changes.
        assert_eq!(dtypes(&m), dtypes(&module()));

        let mut m = module();
        Quantize::all(QuantFormat::Q4_1).run(&mut m).unwrap();
        assert_eq!(m.weights[Handle::new(0)].ty.dtype, DType::Q4_1);
        assert_eq!(m.weights[Handle::new(1)].ty.dtype, DType::Q4_1);
        assert_eq!(m.weights[Handle::new(1)].data.bytes().map(<[u8]>::len), Some(48 * 40));
    }

    #[test]
    fn a_tied_table_needs_both_its_parts() {
        for (embedding, lm_head) in
            [(Some(QuantFormat::Q8_0), None), (Some(QuantFormat::Q8_0), Some(QuantFormat::Q4_0))]
        {
            let mut m = module();
            let pass = Quantize { layers: None, embedding, lm_head, keep_shared: false };
            let err = pass.run(&mut m).unwrap_err().to_string();
            assert!(err.starts_with("pass `quantize`: weight table is read as embedding (q8_0), lm_head ("), "{err}");
            assert!(err.contains("choose its parts together (e.g. `q8_0:embedding+lm_head`)"), "{err}");
        }
    }

    #[test]
    fn quantised_weights_keep_their_bytes() {
        let mut m = module();
        Quantize::all(QuantFormat::Q8_0).run(&mut m).unwrap();
        let before: Vec<Vec<u8>> = m.weights.iter().map(|(_, w)| w.data.bytes().unwrap_or(&[]).to_vec()).collect();
        let types: Vec<String> = dtypes(&m);
        // A second pass with another format finds them already quantised: nothing is requantised.
        Quantize::all(QuantFormat::Q4_0).run(&mut m).unwrap();
        assert_eq!(dtypes(&m), types);
        let after: Vec<Vec<u8>> = m.weights.iter().map(|(_, w)| w.data.bytes().unwrap_or(&[]).to_vec()).collect();
        assert_eq!(after, before);
    }
}
