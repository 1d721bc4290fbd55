//! Element types and tensor types.

use std::fmt;

/// Storage type of a tensor. Activations are always `F32`; weights may be stored in any of these
/// and are widened to f32 exactly (see NUMERICS.md) before they meet an activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum DType {
    F32,
    BF16,
    F16,
    /// int8 in blocks of 32 along the last axis, one f16 scale per block (GGUF `Q8_0`).
    Q8_0,
    /// int4 in blocks of 32 along the last axis, one f16 scale per block, offset -8 (GGUF `Q4_0`).
    Q4_0,
    /// uint4 in blocks of 32 along the last axis, an f16 scale and an f16 minimum per block (GGUF `Q4_1`).
    Q4_1,
    /// OCP MXFP4 in blocks of 32 along the last axis: an e8m0 scale byte, then 16 bytes of
    /// e2m1 codes, the low nibble of byte `j` element `2j` and the high nibble element `2j + 1`
    /// (gpt-oss's release layout, with each block's scale moved in front of its codes).
    Mxfp4,
}

/// Elements per quantisation block along the last axis. Also the chunk length of every
/// reduction in the numerics contract, so a quantised block never straddles two chunks.
pub const BLOCK: usize = 32;

impl DType {
    pub const ALL: [DType; 7] =
        [DType::F32, DType::BF16, DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Mxfp4];

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Mxfp4 => "mxfp4",
        }
    }

    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    pub fn is_block_quantized(self) -> bool {
        matches!(self, DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Mxfp4)
    }

    /// Bytes needed to store a row of `len` elements (the last axis). `None` when a block-quantised
    /// row is not a whole number of blocks.
    pub fn row_bytes(self, len: u64) -> Option<u64> {
        match self {
            DType::F32 => Some(len * 4),
            DType::BF16 | DType::F16 => Some(len * 2),
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Mxfp4 => {
                if !len.is_multiple_of(BLOCK as u64) {
                    return None;
                }
                let per_block = match self {
                    DType::Q8_0 => 2 + 32,
                    DType::Q4_0 => 2 + 16,
                    DType::Mxfp4 => 1 + 16,
                    _ => 2 + 2 + 16,
                };
                Some(len / BLOCK as u64 * per_block)
            }
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A dense tensor type: a row-major shape and an element type.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TensorType {
    pub shape: Vec<u64>,
    pub dtype: DType,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Vec<u64>>) -> Self {
        TensorType { shape: shape.into(), dtype }
    }
    pub fn f32(shape: impl Into<Vec<u64>>) -> Self {
        Self::new(DType::F32, shape)
    }
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
    /// Bytes of the whole tensor in its storage type; `None` if a quantised last axis is ragged.
    pub fn bytes(&self) -> Option<u64> {
        let last = *self.shape.last().unwrap_or(&1);
        let rows: u64 = self.shape.iter().rev().skip(1).product();
        Some(self.dtype.row_bytes(last)? * rows)
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The type of an SSA value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    /// An activation: always f32.
    Tensor(TensorType),
    /// The router's choice for one token: `top_k` (expert, weight) pairs out of `experts`.
    Routing { experts: u32, top_k: u32 },
}

impl ValueType {
    pub fn tensor(&self) -> Option<&TensorType> {
        match self {
            ValueType::Tensor(t) => Some(t),
            ValueType::Routing { .. } => None,
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueType::Tensor(t) => t.fmt(f),
            ValueType::Routing { experts, top_k } => write!(f, "routing[{experts}, top{top_k}]"),
        }
    }
}
