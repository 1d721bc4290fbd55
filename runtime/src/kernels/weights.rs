//! Views over a weight's stored bytes, and their exact widening to f32 (NUMERICS.md, "Values").
//!
//! Weights are never expanded in memory: a kernel asks a [`RowView`] for one chunk of
//! [`BLOCK`] elements at a time and multiplies it straight away. A chunk of a quantised row is
//! exactly one quantisation block.

use std::ops::Range;

use half::f16;
use waferc_ir::{DType, TensorType, Weight, WeightBytes, BLOCK};

use crate::error::RuntimeError;

/// Bytes of one quantisation block (32 elements), or `None` for an unquantised dtype.
fn block_bytes(dtype: DType) -> Option<usize> {
    match dtype {
        DType::Q8_0 => Some(2 + 32),
        DType::Q4_0 => Some(2 + 16),
        DType::Q4_1 => Some(2 + 2 + 16),
        DType::Mxfp4 => Some(1 + 16),
        DType::F32 | DType::BF16 | DType::F16 => None,
    }
}

/// Bytes per element of an unquantised dtype.
fn element_bytes(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 4,
        _ => 2,
    }
}

/// A weight as a matrix of rows along its last axis: `[rows, cols]` for a 2-D weight, one row
/// for a 1-D weight (a norm scale or a bias).
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    dtype: DType,
    bytes: &'a [u8],
    rows: usize,
    cols: usize,
    row_bytes: usize,
}

impl<'a> WeightView<'a> {
    /// Checks that the weight has data, is 1-D or 2-D, and that its byte length matches its type.
    pub fn new(weight: &'a Weight) -> Result<Self, RuntimeError> {
        let ty = &weight.ty;
        let unsupported = |reason: &str| RuntimeError::UnsupportedWeight {
            weight: weight.name.clone(),
            dtype: ty.dtype,
            shape: ty.shape.clone(),
            reason: reason.to_string(),
        };
        let bytes =
            weight.data.bytes().ok_or_else(|| RuntimeError::MissingWeightData { weight: weight.name.clone() })?;
        let (rows, cols) = match ty.shape[..] {
            [cols] => (1, cols),
            [rows, cols] => (rows, cols),
            _ => return Err(unsupported("kernels read 1-D and 2-D weights only")),
        };
        let row_bytes = ty
            .dtype
            .row_bytes(cols)
            .ok_or_else(|| unsupported("a block-quantised last axis must be a whole number of 32-element blocks"))?;
        let expected = row_bytes.checked_mul(rows).ok_or_else(|| unsupported("the tensor is too large"))?;
        if expected != bytes.len() as u64 {
            return Err(RuntimeError::WeightByteLength {
                weight: weight.name.clone(),
                dtype: ty.dtype,
                shape: ty.shape.clone(),
                expected,
                found: bytes.len(),
            });
        }
        let too_large = || unsupported("the tensor does not fit in this machine's address space");
        Ok(WeightView {
            dtype: ty.dtype,
            bytes,
            rows: usize::try_from(rows).map_err(|_| too_large())?,
            cols: usize::try_from(cols).map_err(|_| too_large())?,
            row_bytes: usize::try_from(row_bytes).map_err(|_| too_large())?,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `n`. Panics if `n >= rows()`, like slice indexing.
    pub fn row(&self, n: usize) -> RowView<'a> {
        assert!(n < self.rows, "row {n} of a weight with {} rows", self.rows);
        RowView { dtype: self.dtype, bytes: &self.bytes[n * self.row_bytes..][..self.row_bytes], len: self.cols }
    }

    /// The single row of a 1-D weight, or the first row of a 2-D one, widened to f32.
    pub fn widen_vector(&self) -> Vec<f32> {
        self.row(0).widen()
    }
}

/// `weight` with every element widened exactly to f32 as the kernels widen it (NUMERICS.md,
/// "Values"): the same model in a format with no rounding, which is what a quantised
/// checkpoint's unquantised baseline is (e.g. for measuring what requantising costs).
pub fn dequantize(weight: &Weight) -> Result<Weight, RuntimeError> {
    let view = WeightView::new(weight)?;
    let mut bytes = Vec::with_capacity(view.rows() * view.cols() * 4);
    for n in 0..view.rows() {
        bytes.extend(view.row(n).widen().iter().flat_map(|x| x.to_le_bytes()));
    }
    Ok(Weight {
        name: weight.name.clone(),
        ty: TensorType::new(DType::F32, weight.ty.shape.clone()),
        data: WeightBytes::owned(bytes),
    })
}

/// One row of a weight (or a run of its chunks), in its stored dtype.
#[derive(Clone, Copy, Debug)]
pub struct RowView<'a> {
    dtype: DType,
    bytes: &'a [u8],
    len: usize,
}

impl<'a> RowView<'a> {
    /// A row of `len` elements stored as `bytes`; `None` if the byte length does not match.
    pub fn new(dtype: DType, bytes: &'a [u8], len: usize) -> Option<Self> {
        let expected = dtype.row_bytes(len as u64)?;
        (expected == bytes.len() as u64).then_some(RowView { dtype, bytes, len })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Elements in the row.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The stored bytes: whole blocks for a quantised row, packed little-endian elements otherwise.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
    /// Chunks of [`BLOCK`] elements; the last may be short (never for a quantised row).
    pub fn chunks(&self) -> usize {
        self.len.div_ceil(BLOCK)
    }

    /// The chunks `range` of this row as a row of its own (what one tile of a matvec holds).
    /// The end is clamped to `chunks()`, so a short last run reads as the chunks that exist.
    pub fn sub(&self, range: Range<usize>) -> RowView<'a> {
        let end = range.end.min(self.chunks());
        let start = range.start.min(end);
        let (first, last) = (start * BLOCK, (end * BLOCK).min(self.len));
        let (byte_start, byte_end) = match block_bytes(self.dtype) {
            Some(per_block) => (start * per_block, end * per_block),
            None => (first * element_bytes(self.dtype), last * element_bytes(self.dtype)),
        };
        RowView { dtype: self.dtype, bytes: &self.bytes[byte_start..byte_end], len: last - first }
    }

    /// Chunk `c` widened exactly to f32 into `out`; elements past the end of a short last chunk
    /// are +0.0. Panics if `c >= chunks()`.
    #[inline(always)]
    pub fn widen_chunk(&self, c: usize, out: &mut [f32; BLOCK]) {
        match self.dtype {
            DType::F32 | DType::BF16 | DType::F16 => {
                let first = c * BLOCK;
                let count = (self.len - first).min(BLOCK);
                let size = element_bytes(self.dtype);
                let bytes = &self.bytes[first * size..(first + count) * size];
                if count < BLOCK {
                    *out = [0.0; BLOCK];
                }
                match self.dtype {
                    DType::F32 => {
                        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        }
                    }
                    DType::BF16 => {
                        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                            *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                        }
                    }
                    _ => {
                        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                            *o = f16_at(b, 0);
                        }
                    }
                }
            }
            DType::Q8_0 => {
                let block: &[u8; 34] = self.bytes[c * 34..][..34].try_into().expect("34-byte block");
                widen_q8_0(block, out);
            }
            DType::Q4_0 => {
                let block: &[u8; 18] = self.bytes[c * 18..][..18].try_into().expect("18-byte block");
                widen_q4_0(block, out);
            }
            DType::Q4_1 => {
                let block: &[u8; 20] = self.bytes[c * 20..][..20].try_into().expect("20-byte block");
                widen_q4_1(block, out);
            }
            DType::Mxfp4 => {
                let block: &[u8; 17] = self.bytes[c * 17..][..17].try_into().expect("17-byte block");
                widen_mxfp4(block, out);
            }
        }
    }

    /// The whole row widened to f32.
    pub fn widen(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.chunks() * BLOCK);
        let mut chunk = [0.0; BLOCK];
        for c in 0..self.chunks() {
            self.widen_chunk(c, &mut chunk);
            out.extend_from_slice(&chunk);
        }
        out.truncate(self.len);
        out
    }
}

/// The f16 at `bytes[at..at + 2]`, widened exactly. The software conversion inlines into the
/// vectorised loops (the hardware one is a call per block), and gives the same value.
#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32_const()
}

/// GGUF `block_q8_0`: f16 `d`, then 32 int8 `q`; element `i` is `d * q[i]`.
#[inline(always)]
pub fn widen_q8_0(block: &[u8; 34], out: &mut [f32; BLOCK]) {
    let d = f16_at(block, 0);
    for (o, &q) in out.iter_mut().zip(&block[2..]) {
        *o = d * (q as i8) as f32;
    }
}

/// GGUF `block_q4_0`: f16 `d`, then 16 bytes whose low nibbles are elements 0..16 and high
/// nibbles elements 16..32; element value `d * (q - 8)`.
#[inline(always)]
pub fn widen_q4_0(block: &[u8; 18], out: &mut [f32; BLOCK]) {
    let d = f16_at(block, 0);
    let mut q = [0i32; BLOCK];
    for (j, &byte) in block[2..].iter().enumerate() {
        q[j] = (byte & 0x0F) as i32 - 8;
        q[j + 16] = (byte >> 4) as i32 - 8;
    }
    for (o, q) in out.iter_mut().zip(q) {
        *o = d * q as f32;
    }
}

/// GGUF `block_q4_1`: f16 `d`, f16 `m`, then 16 bytes of nibbles laid out as in q4_0; element
/// value `(d * q) + m`, the product rounded before the sum.
#[inline(always)]
pub fn widen_q4_1(block: &[u8; 20], out: &mut [f32; BLOCK]) {
    let d = f16_at(block, 0);
    let m = f16_at(block, 2);
    let mut q = [0u8; BLOCK];
    for (j, &byte) in block[4..].iter().enumerate() {
        q[j] = byte & 0x0F;
        q[j + 16] = byte >> 4;
    }
    for (o, q) in out.iter_mut().zip(q) {
        *o = d * q as f32 + m;
    }
}

/// The e2m1 (FP4) values of codes 0..16: sign bit 3, then exponent and mantissa.
const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// `2^(e - 127)` for an e8m0 scale byte `e`, exact in f32 for `e` in 0..=254 (2^-127 is
/// subnormal); 255 is the format's NaN.
#[inline(always)]
pub fn e8m0_scale(e: u8) -> f32 {
    match e {
        255 => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        e => f32::from_bits((e as u32) << 23),
    }
}

/// waferc's MXFP4 block: the e8m0 scale byte, then 16 bytes whose low nibble is element `2j`
/// and high nibble element `2j + 1`; element value `e2m1(code) * 2^(scale - 127)`, one rounding
/// (to infinity past f32's range; exact otherwise).
#[inline(always)]
pub fn widen_mxfp4(block: &[u8; 17], out: &mut [f32; BLOCK]) {
    let scale = e8m0_scale(block[0]);
    for (j, &byte) in block[1..].iter().enumerate() {
        out[2 * j] = E2M1[(byte & 0x0F) as usize] * scale;
        out[2 * j + 1] = E2M1[(byte >> 4) as usize] * scale;
    }
}
