//! The GGUF container (versions 2 and 3): header, metadata and tensor directory, read from a
//! memory map. Every count, length and offset comes from an untrusted file, so each is checked
//! against the bytes actually there before it is used or allocated for.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;
use waferc_ir::DType;

use crate::frontend::FrontendError;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// Arrays of arrays are legal; nothing real nests deeper than this.
const MAX_ARRAY_NESTING: u32 = 8;
/// A parsed value takes up to 32 times the bytes of a packed one (a `u8` becomes a
/// `MetadataValue`), so the file size alone does not bound memory. The largest real arrays are
/// token lists and merges, well under a million entries.
const MAX_ARRAY_LEN: u64 = 1 << 24;
/// The most metadata entries and tensors a file may declare, and the longest string (key,
/// value or tensor name). Real files have tens of metadata entries, a few thousand tensors (an
/// MoE with an entry per expert tensor under twenty thousand) and strings of kilobytes (chat
/// templates); these bounds stop a file of lies from costing memory in proportion to its size.
pub(crate) const MAX_METADATA_ENTRIES: u64 = 1 << 16;
pub(crate) const MAX_TENSORS: u64 = 1 << 20;
pub(crate) const MAX_STRING_LEN: u64 = 16 << 20;

/// A parsed GGUF file. Tensor data stays in `map`; `TensorInfo::range` locates it.
pub(crate) struct GgufFile {
    pub metadata: BTreeMap<String, MetadataValue>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
    pub map: Arc<Mmap>,
}

/// One metadata value, as typed in the file.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetadataValue>),
}

impl MetadataValue {
    /// Any integer type holding a non-negative value: converters disagree on which width to write.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetadataValue::U8(v) => Some(v.into()),
            MetadataValue::U16(v) => Some(v.into()),
            MetadataValue::U32(v) => Some(v.into()),
            MetadataValue::U64(v) => Some(v),
            MetadataValue::I8(v) => u64::try_from(v).ok(),
            MetadataValue::I16(v) => u64::try_from(v).ok(),
            MetadataValue::I32(v) => u64::try_from(v).ok(),
            MetadataValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetadataValue::I8(v) => Some(v.into()),
            MetadataValue::I16(v) => Some(v.into()),
            MetadataValue::I32(v) => Some(v.into()),
            MetadataValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetadataValue::F32(v) => Some(v.into()),
            MetadataValue::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            MetadataValue::Array(items) => Some(items),
            _ => None,
        }
    }

    /// The GGUF spelling of this value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetadataValue::U8(_) => "uint8",
            MetadataValue::I8(_) => "int8",
            MetadataValue::U16(_) => "uint16",
            MetadataValue::I16(_) => "int16",
            MetadataValue::U32(_) => "uint32",
            MetadataValue::I32(_) => "int32",
            MetadataValue::U64(_) => "uint64",
            MetadataValue::I64(_) => "int64",
            MetadataValue::F32(_) => "float32",
            MetadataValue::F64(_) => "float64",
            MetadataValue::Bool(_) => "bool",
            MetadataValue::String(_) => "string",
            MetadataValue::Array(_) => "array",
        }
    }
}

/// A ggml tensor type id. Only some have a waferc `DType`; the rest are named in errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GgmlType(pub u32);

impl GgmlType {
    /// Names from gguf-py's `GGMLQuantizationType`.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => return None,
        })
    }

    /// The waferc storage type with the same bytes, block for block.
    pub fn dtype(self) -> Option<DType> {
        match self.0 {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            2 => Some(DType::Q4_0),
            3 => Some(DType::Q4_1),
            8 => Some(DType::Q8_0),
            30 => Some(DType::BF16),
            _ => None,
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "unknown type id {}", self.0),
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug)]
pub(crate) struct TensorInfo {
    pub name: String,
    /// ggml order: innermost (contiguous) dimension first.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Where the bytes are in the file. `None` for a type waferc cannot store (its size is
    /// never needed: such a tensor is reported, not read).
    pub range: Option<std::ops::Range<usize>>,
}

impl TensorInfo {
    /// The shape in Hugging Face (row-major, outermost first) order.
    pub fn hf_shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile, FrontendError> {
        let io = |source| FrontendError::Io { path: path.to_owned(), source };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; like every mmap-based model loader, we rely on the
        // checkpoint not being truncated or rewritten while the compiler runs.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        GgufFile::from_map(Arc::new(map), path)
    }

    /// Parses a GGUF image already mapped; `path` names it in errors.
    pub fn from_map(map: Arc<Mmap>, path: &Path) -> Result<GgufFile, FrontendError> {
        parse(map).map_err(|message| FrontendError::Format { file: path.to_owned(), message })
    }

    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }
}

/// Parses the whole directory; errors are messages the caller attaches the file name to.
fn parse(map: Arc<Mmap>) -> Result<GgufFile, String> {
    let mut r = Reader { bytes: &map, pos: 0 };
    let magic = r.take(4).map_err(|_| format!("not a GGUF file: only {} bytes", map.len()))?;
    if magic != MAGIC {
        return Err(format!("not a GGUF file: starts with {magic:02x?}, expected the magic \"GGUF\""));
    }
    let version = r.u32().map_err(|e| format!("header: {e}"))?;
    match version {
        2 | 3 => {}
        1 => return Err("GGUF version 1 is not supported (only versions 2 and 3)".into()),
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return Err("big-endian GGUF is not supported (the file's version field is byte-swapped)".into())
        }
        v => return Err(format!("unknown GGUF version {v} (only versions 2 and 3)")),
    }
    let tensor_count = r.u64().map_err(|e| format!("header: {e}"))?;
    let kv_count = r.u64().map_err(|e| format!("header: {e}"))?;
    // The smallest possible entries: a key (8-byte length, empty) and a 4-byte type and a 1-byte
    // value; a tensor name (8), its dimension count (4), type (4) and offset (8).
    r.check_count(kv_count, 8 + 4 + 1, "metadata entries")?;
    r.check_count(tensor_count, 8 + 4 + 4 + 8, "tensor entries")?;
    if kv_count > MAX_METADATA_ENTRIES {
        return Err(format!("claims {kv_count} metadata entries, more than the {MAX_METADATA_ENTRIES} waferc accepts"));
    }
    if tensor_count > MAX_TENSORS {
        return Err(format!("claims {tensor_count} tensors, more than the {MAX_TENSORS} waferc accepts"));
    }

    let mut metadata = BTreeMap::new();
    for index in 0..kv_count {
        let key = r.string().map_err(|e| format!("metadata entry {index}: key: {e}"))?;
        let value = r.value(0).map_err(|e| format!("metadata entry {index} ({key}): {e}"))?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(format!("metadata key {key} appears twice"));
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(MetadataValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(other) => {
            return Err(format!("general.alignment must be a uint32 power of two, found {other:?}"));
        }
    };

    let mut raw_tensors = Vec::new();
    let mut names = std::collections::BTreeSet::new();
    for index in 0..tensor_count {
        let name = r.string().map_err(|e| format!("tensor entry {index}: name: {e}"))?;
        let context = |e: String| format!("tensor {name}: {e}");
        let n_dims = r.u32().map_err(context)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(context(format!("{n_dims} dimensions (ggml allows 1 to {MAX_DIMS})")));
        }
        let dims = (0..n_dims).map(|_| r.u64()).collect::<Result<Vec<_>, _>>().map_err(context)?;
        let ggml_type = GgmlType(r.u32().map_err(context)?);
        let offset = r.u64().map_err(context)?;
        if !names.insert(name.clone()) {
            return Err(format!("tensor {name} appears twice"));
        }
        raw_tensors.push((name, dims, ggml_type, offset));
    }

    let data_start = align_up(r.pos as u64, alignment)
        .filter(|&start| start <= map.len() as u64)
        .ok_or_else(|| format!("the tensor data section (aligned to {alignment}) starts past the end of the file"))?;
    let data_len = map.len() as u64 - data_start;

    let mut tensors = Vec::with_capacity(raw_tensors.len());
    for (name, dims, ggml_type, offset) in raw_tensors {
        let range = match ggml_type.dtype() {
            Some(dtype) => Some(
                tensor_range(&dims, dtype, offset, alignment, data_start, data_len)
                    .map_err(|e| format!("tensor {name} ({ggml_type} {dims:?}): {e}"))?,
            ),
            None => None,
        };
        tensors.push(TensorInfo { name, dims, ggml_type, range });
    }
    Ok(GgufFile { metadata, tensors, map })
}

/// The byte range of a tensor of a supported type, checked against the data section.
fn tensor_range(
    dims: &[u64],
    dtype: DType,
    offset: u64,
    alignment: u64,
    data_start: u64,
    data_len: u64,
) -> Result<std::ops::Range<usize>, String> {
    if dims.contains(&0) {
        return Err("a dimension is 0".into());
    }
    // No storage type packs more than 2 elements in a byte (q4: 32 in 18 or 20), so a larger
    // count is a lie; bounding it first keeps the size arithmetic below from overflowing.
    let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
    if elements.is_none_or(|n| n / 2 > data_len) {
        return Err(format!("more elements than a data section of {data_len} bytes can hold"));
    }
    let row_len = dims[0];
    let row_bytes = dtype
        .row_bytes(row_len)
        .ok_or_else(|| format!("rows of {row_len} elements are not whole {}-element blocks", waferc_ir::BLOCK))?;
    let rows: u64 = dims[1..].iter().product();
    let size = row_bytes * rows;
    if !offset.is_multiple_of(alignment) {
        return Err(format!("data offset {offset} is not a multiple of the alignment {alignment}"));
    }
    let end = offset.checked_add(size).filter(|&end| end <= data_len).ok_or_else(|| {
        format!("data at offset {offset}, {size} bytes, runs past the end of the data section ({data_len} bytes)")
    })?;
    // Both fit in the file's length, a usize.
    Ok((data_start + offset) as usize..(data_start + end) as usize)
}

fn align_up(pos: u64, alignment: u64) -> Option<u64> {
    pos.checked_next_multiple_of(alignment)
}

/// A little-endian cursor whose every read is bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.remaining() {
            return Err(format!(
                "truncated: needs {n} bytes at offset {}, the file has {} bytes",
                self.pos,
                self.bytes.len()
            ));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }

    /// Fails unless `count` items of at least `min_size` bytes each fit in what is left, so a
    /// lying count can never drive an allocation.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<(), String> {
        if count.checked_mul(min_size).is_none_or(|need| need > self.remaining() as u64) {
            return Err(format!(
                "claims {count} {what}, more than the {} bytes left at offset {} can hold",
                self.remaining(),
                self.pos
            ));
        }
        Ok(())
    }

    fn string(&mut self) -> Result<String, String> {
        let len = self.u64()?;
        if len > MAX_STRING_LEN {
            return Err(format!(
                "string of {len} bytes at offset {}, longer than the {MAX_STRING_LEN} waferc accepts",
                self.pos - 8
            ));
        }
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= self.remaining())
            .ok_or_else(|| format!("string of {len} bytes at offset {} runs past the end of the file", self.pos - 8))?;
        let at = self.pos;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("string at offset {at} is not UTF-8"))
    }

    fn value(&mut self, depth: u32) -> Result<MetadataValue, String> {
        let type_id = self.u32()?;
        self.value_of_type(type_id, depth)
    }

    fn value_of_type(&mut self, type_id: u32, depth: u32) -> Result<MetadataValue, String> {
        Ok(match type_id {
            0 => MetadataValue::U8(u8::from_le_bytes(self.array()?)),
            1 => MetadataValue::I8(i8::from_le_bytes(self.array()?)),
            2 => MetadataValue::U16(u16::from_le_bytes(self.array()?)),
            3 => MetadataValue::I16(i16::from_le_bytes(self.array()?)),
            4 => MetadataValue::U32(u32::from_le_bytes(self.array()?)),
            5 => MetadataValue::I32(i32::from_le_bytes(self.array()?)),
            6 => MetadataValue::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => MetadataValue::Bool(false),
                1 => MetadataValue::Bool(true),
                b => return Err(format!("bool byte {b} at offset {} is neither 0 nor 1", self.pos - 1)),
            },
            8 => MetadataValue::String(self.string()?),
            9 => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(format!("arrays nested more than {MAX_ARRAY_NESTING} deep"));
                }
                let element_type = self.u32()?;
                let count = self.u64()?;
                let min_size = match element_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 4 + 8,
                    other => return Err(format!("array of unknown value type {other}")),
                };
                if count > MAX_ARRAY_LEN {
                    return Err(format!("array of {count} values, more than the {MAX_ARRAY_LEN} waferc accepts"));
                }
                self.check_count(count, min_size, "array elements")?;
                let mut items = Vec::with_capacity(count as usize);
                for index in 0..count {
                    items.push(
                        self.value_of_type(element_type, depth + 1)
                            .map_err(|e| format!("array element {index}: {e}"))?,
                    );
                }
                MetadataValue::Array(items)
            }
            10 => MetadataValue::U64(u64::from_le_bytes(self.array()?)),
            11 => MetadataValue::I64(i64::from_le_bytes(self.array()?)),
            12 => MetadataValue::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(format!("unknown value type {other}")),
        })
    }
}
