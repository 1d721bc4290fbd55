//! Safetensors checkpoints, single-file or sharded, memory-mapped.
//!
//! Opening a checkpoint maps each file and validates its header (8-byte little-endian length,
//! JSON, then the data); tensor bytes are never read here, so a 16 GB checkpoint costs a few
//! page faults. The header is checked completely, since every later stage trusts it: each
//! tensor's byte range must lie inside the data, hold exactly `shape x dtype` bytes and overlap
//! no other tensor.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value};
use waferc_ir::{DType, TensorType, WeightBytes};

use super::{FrontendError, TensorEntry};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The largest JSON header a safetensors file may declare: the safetensors crate's own limit
/// (`MAX_HEADER_SIZE`). Tensor count, names and shapes are all bounded by it.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The tensors of a checkpoint directory.
#[derive(Debug, Default)]
pub struct CheckpointTensors {
    /// Tensors in a type waferc reads (f32, bf16, f16), under their stored names.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Well-formed tensors in a type waferc does not read (i64, f8, ...): name -> why, naming the
    /// file, so lowering reports them with every other problem.
    pub unusable: BTreeMap<String, String>,
    /// The U8 tensors among the unusable ones, kept so that MXFP4 `_blocks`/`_scales` pairs can
    /// become one tensor ([`pair_mxfp4`]).
    pub bytes: BTreeMap<String, TensorEntry>,
}

/// One tensor as a safetensors header describes it.
#[derive(Clone, Debug)]
struct HeaderTensor {
    name: String,
    dtype: StoredDtype,
    shape: Vec<u64>,
    /// Byte range in the file (not in the data section).
    range: Range<usize>,
}

/// A validated, memory-mapped safetensors file.
struct SafetensorsFile {
    path: Arc<PathBuf>,
    map: Arc<memmap2::Mmap>,
    tensors: Vec<HeaderTensor>,
    /// The file's `__metadata__` marks it shape-only (see [`SHAPE_ONLY_KEY`]).
    shape_only: bool,
}

/// `__metadata__` key with value `"true"` that `waferc synth --shape-only` writes: the data
/// section is a sparse hole, so its tensors are read as shapes without data and nothing
/// downstream (packing an artifact, say) ever touches the hole.
pub const SHAPE_ONLY_KEY: &str = "waferc.shape_only";

/// A safetensors dtype name: one waferc reads, or another the format defines.
#[derive(Clone, Copy, Debug, PartialEq)]
enum StoredDtype {
    Usable(DType),
    Other { name: &'static str, bits: u64 },
}

impl StoredDtype {
    fn parse(name: &str) -> Option<StoredDtype> {
        let usable = match name {
            "F32" => Some(DType::F32),
            "BF16" => Some(DType::BF16),
            "F16" => Some(DType::F16),
            _ => None,
        };
        if let Some(d) = usable {
            return Some(StoredDtype::Usable(d));
        }
        // The rest of the format's dtypes, with their element widths in bits.
        const OTHERS: [(&str, u64); 17] = [
            ("BOOL", 8),
            ("U8", 8),
            ("I8", 8),
            ("F8_E5M2", 8),
            ("F8_E4M3", 8),
            ("F8_E8M0", 8),
            ("I16", 16),
            ("U16", 16),
            ("I32", 32),
            ("U32", 32),
            ("F64", 64),
            ("I64", 64),
            ("U64", 64),
            ("C64", 64),
            ("F4", 4),
            ("F6_E2M3", 6),
            ("F6_E3M2", 6),
        ];
        OTHERS.iter().find(|(n, _)| *n == name).map(|&(name, bits)| StoredDtype::Other { name, bits })
    }

    fn bits(self) -> u64 {
        match self {
            StoredDtype::Usable(DType::F32) => 32,
            StoredDtype::Usable(_) => 16,
            StoredDtype::Other { bits, .. } => bits,
        }
    }

    fn name(self) -> &'static str {
        match self {
            StoredDtype::Usable(DType::F32) => "F32",
            StoredDtype::Usable(DType::BF16) => "BF16",
            StoredDtype::Usable(_) => "F16",
            StoredDtype::Other { name, .. } => name,
        }
    }
}

/// Reads the tensors of a Hugging Face checkpoint directory: `model.safetensors.index.json` and
/// the shards it names, or a single `model.safetensors`.
pub fn read_checkpoint_dir(dir: &Path) -> Result<CheckpointTensors, FrontendError> {
    let index = dir.join(INDEX_FILE);
    let single = dir.join(SINGLE_FILE);
    if index.is_file() {
        read_sharded(dir, &index)
    } else if single.is_file() {
        let mut out = CheckpointTensors::default();
        add_file_tensors(&mut out, read_file(&single)?, |_| true);
        Ok(out)
    } else {
        Err(FrontendError::Format {
            file: dir.to_path_buf(),
            message: format!("no {SINGLE_FILE} or {INDEX_FILE} (waferc reads safetensors checkpoints only)"),
        })
    }
}

fn read_sharded(dir: &Path, index_path: &Path) -> Result<CheckpointTensors, FrontendError> {
    let format = |message: String| FrontendError::Format { file: index_path.to_path_buf(), message };
    let text = super::read_bounded_text(index_path, super::MAX_INDEX_BYTES)?;
    let index: Value = serde_json::from_str(&text).map_err(|e| format(format!("invalid JSON: {e}")))?;
    let Some(Value::Object(weight_map)) = index.get("weight_map") else {
        return Err(format("missing `weight_map` object".to_string()));
    };

    let mut problems = Vec::new();
    // shard file name -> tensor names the index puts there
    let mut shards: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (tensor, shard) in weight_map {
        match shard.as_str() {
            Some(shard) if is_plain_relative(shard) => shards.entry(shard).or_default().push(tensor),
            Some(shard) => {
                problems.push(format!("tensor {tensor}: shard `{shard}` is not a path inside the checkpoint"))
            }
            None => problems.push(format!("tensor {tensor}: shard must be a file name, found {shard}")),
        }
    }

    let mut out = CheckpointTensors::default();
    for (shard, names) in &shards {
        let path = dir.join(shard);
        if !path.is_file() {
            problems.push(format!(
                "shard {shard} is missing (the index puts {} tensor{} there, such as {})",
                names.len(),
                if names.len() == 1 { "" } else { "s" },
                names[0]
            ));
            continue;
        }
        let file = read_file(&path)?;
        for name in names {
            if !file.tensors.iter().any(|t| t.name == *name) {
                problems.push(format!("tensor {name} is not in its shard {shard}"));
            }
        }
        for tensor in &file.tensors {
            match weight_map.get(&tensor.name).and_then(Value::as_str) {
                Some(listed) if listed == *shard => {}
                Some(listed) => problems
                    .push(format!("tensor {} is in shard {shard} but the index puts it in {listed}", tensor.name)),
                None => problems.push(format!("tensor {} is in shard {shard} but not in the index", tensor.name)),
            }
        }
        add_file_tensors(&mut out, file, |name| weight_map.get(name).and_then(Value::as_str) == Some(*shard));
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(format(list_problems(&problems)))
    }
}

/// A relative path with no `..`, root or prefix: a shard cannot name a file outside the checkpoint.
fn is_plain_relative(name: &str) -> bool {
    !name.is_empty() && Path::new(name).components().all(|c| matches!(c, Component::Normal(_)))
}

/// Moves the tensors of `file` that `keep` accepts into `out` (a sharded checkpoint keeps only
/// those its index assigns to the file; any others are reported as problems).
fn add_file_tensors(out: &mut CheckpointTensors, file: SafetensorsFile, keep: impl Fn(&str) -> bool) {
    for t in file.tensors {
        if !keep(&t.name) {
            continue;
        }
        match t.dtype {
            StoredDtype::Usable(dtype) => {
                let entry = TensorEntry {
                    ty: TensorType::new(dtype, t.shape),
                    data: if file.shape_only {
                        WeightBytes::Absent
                    } else {
                        WeightBytes::Mapped { map: file.map.clone(), range: t.range, file: file.path.clone() }
                    },
                    file: file.path.as_ref().clone(),
                };
                out.tensors.insert(t.name, entry);
            }
            StoredDtype::Other { name, .. } => {
                if name == "U8" {
                    // Kept as a byte tensor: raw MXFP4 blocks or scales, paired later.
                    let data = if file.shape_only {
                        WeightBytes::Absent
                    } else {
                        WeightBytes::Mapped { map: file.map.clone(), range: t.range.clone(), file: file.path.clone() }
                    };
                    let ty = TensorType::new(DType::F32, t.shape.clone());
                    out.bytes.insert(t.name.clone(), TensorEntry { ty, data, file: file.path.as_ref().clone() });
                }
                let why = format!(
                    "{}: tensor {} is {name}{:?}; waferc reads F32, BF16 and F16 tensors",
                    file.path.display(),
                    t.name,
                    t.shape
                );
                out.unusable.insert(t.name, why);
            }
        }
    }
}

/// Joins each MXFP4 pair `X_blocks` (U8 `[.., rows, cols / 32, 16]`, two e2m1 codes a byte, low
/// nibble first) and `X_scales` (U8 `[.., rows, cols / 32]`, e8m0) into one tensor `X` of dtype
/// [`DType::Mxfp4`], shape `[.., rows, cols]`, each block's scale byte in front of its 16 code
/// bytes (a copy; shape-only files stay without data). A pair that does not match, or a half
/// without the other, becomes an unusable `X` whose reason names both tensors and the file.
pub fn pair_mxfp4(read: &mut CheckpointTensors) {
    let bases: std::collections::BTreeSet<String> = read
        .bytes
        .keys()
        .filter_map(|n| n.strip_suffix("_blocks").or_else(|| n.strip_suffix("_scales")))
        .map(str::to_string)
        .collect();
    for base in bases {
        let (blocks_name, scales_name) = (format!("{base}_blocks"), format!("{base}_scales"));
        let blocks = read.bytes.remove(&blocks_name);
        let scales = read.bytes.remove(&scales_name);
        read.unusable.remove(&blocks_name);
        read.unusable.remove(&scales_name);
        match (blocks, scales) {
            (Some(b), Some(s)) => match mxfp4_tensor(&b, &s) {
                Some(entry) => {
                    read.tensors.insert(base, entry);
                }
                None => {
                    let why = format!(
                        "{}: MXFP4 tensor {blocks_name} is U8{:?} but {scales_name} is U8{:?}: expected blocks \
                         [.., rows, n, 16] and scales [.., rows, n]",
                        b.file.display(),
                        b.ty.shape,
                        s.ty.shape
                    );
                    read.unusable.insert(base, why);
                }
            },
            (Some(half), None) => {
                read.unusable.insert(base, half_pair(&half, &blocks_name, &scales_name));
            }
            (None, Some(half)) => {
                read.unusable.insert(base, half_pair(&half, &scales_name, &blocks_name));
            }
            (None, None) => {}
        }
    }
}

fn half_pair(half: &TensorEntry, have: &str, lack: &str) -> String {
    format!(
        "{}: MXFP4 tensor {have} U8{:?} has no {lack} (the release stores both)",
        half.file.display(),
        half.ty.shape
    )
}

/// One MXFP4 tensor from a matching `_blocks`/`_scales` pair, or `None` if the shapes disagree.
fn mxfp4_tensor(blocks: &TensorEntry, scales: &TensorEntry) -> Option<TensorEntry> {
    let (b, s) = (&blocks.ty.shape, &scales.ty.shape);
    if b.len() < 3 || b[b.len() - 1] != 16 || s.as_slice() != &b[..b.len() - 1] {
        return None;
    }
    let mut shape = s.clone();
    *shape.last_mut()? *= 32;
    let data = match (blocks.data.bytes(), scales.data.bytes()) {
        (Some(codes), Some(exponents)) => {
            let mut packed = Vec::with_capacity(exponents.len() * 17);
            for (e, block) in exponents.iter().zip(codes.chunks_exact(16)) {
                packed.push(*e);
                packed.extend_from_slice(block);
            }
            WeightBytes::owned(packed)
        }
        _ => WeightBytes::Absent,
    };
    Some(TensorEntry { ty: TensorType::new(DType::Mxfp4, shape), data, file: blocks.file.clone() })
}

/// Maps `path` and validates its header.
fn read_file(path: &Path) -> Result<SafetensorsFile, FrontendError> {
    let io = |source| FrontendError::Io { path: path.to_path_buf(), source };
    let format = |message: String| FrontendError::Format { file: path.to_path_buf(), message };
    let file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len < 8 {
        return Err(format(format!("truncated: {len} bytes, too short for the 8-byte header length")));
    }
    // SAFETY: the map is read-only and the file is not modified while waferc runs; that is the
    // same contract transformers and the safetensors crate rely on. A file truncated underneath
    // us would fault on access, it cannot yield wrong bytes silently.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    let tensors = parse_header(&map).map_err(|problems| format(list_problems(&problems)))?;
    let shape_only = is_shape_only(&map);
    Ok(SafetensorsFile { path: Arc::new(path.to_path_buf()), map: Arc::new(map), tensors, shape_only })
}

/// Validates a safetensors file image held in memory, as [`read_checkpoint_dir`] validates each
/// file it maps, and lists its tensor names; `file` names the image in errors. Also the entry
/// point the fuzz targets and their replay test drive.
pub fn check_image(bytes: &[u8], file: &Path) -> Result<Vec<String>, FrontendError> {
    let tensors = parse_header(bytes)
        .map_err(|problems| FrontendError::Format { file: file.to_path_buf(), message: list_problems(&problems) })?;
    is_shape_only(bytes);
    Ok(tensors.into_iter().map(|t| t.name).collect())
}

/// Whether the (already validated) header's `__metadata__` has [`SHAPE_ONLY_KEY`] = "true".
fn is_shape_only(bytes: &[u8]) -> bool {
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("validated header")) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).expect("validated header");
    header["__metadata__"][SHAPE_ONLY_KEY] == "true"
}

/// Validates a whole safetensors file image (only the header is read) and lists its tensors
/// with absolute byte ranges, or every problem found.
fn parse_header(bytes: &[u8]) -> Result<Vec<HeaderTensor>, Vec<String>> {
    let file_len = bytes.len() as u64;
    let length_bytes = bytes.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok());
    let header_len = u64::from_le_bytes(
        length_bytes
            .ok_or_else(|| vec![format!("truncated: {file_len} bytes, too short for the 8-byte header length")])?,
    );
    if header_len > MAX_HEADER_BYTES {
        return Err(vec![format!(
            "header length {header_len} is more than the {MAX_HEADER_BYTES} bytes a safetensors header may have"
        )]);
    }
    let data_start = 8u64.checked_add(header_len).filter(|&end| end <= file_len).ok_or_else(|| {
        vec![format!(
            "header length {header_len} runs past the end of the file ({file_len} bytes): truncated or not safetensors"
        )]
    })?;
    let header_bytes = &bytes[8..data_start as usize];
    let header: Map<String, Value> =
        serde_json::from_slice(header_bytes).map_err(|e| vec![format!("header is not a JSON object: {e}")])?;
    let data_len = file_len - data_start;

    let mut problems = Vec::new();
    let mut tensors = Vec::new();
    for (name, info) in &header {
        if name == "__metadata__" {
            if !info.is_object() {
                problems.push("__metadata__ must be an object".to_string());
            }
            continue;
        }
        match parse_tensor_info(info, data_len) {
            Ok((dtype, shape, offsets)) => tensors.push(HeaderTensor {
                name: name.clone(),
                dtype,
                shape,
                range: (data_start + offsets.start) as usize..(data_start + offsets.end) as usize,
            }),
            Err(problem) => problems.push(format!("tensor {name}: {problem}")),
        }
    }

    // Overlaps: sort by start; empty tensors occupy nothing.
    let mut by_start: Vec<&HeaderTensor> = tensors.iter().filter(|t| !t.range.is_empty()).collect();
    by_start.sort_by_key(|t| (t.range.start, t.range.end));
    for pair in by_start.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.range.end > b.range.start {
            problems.push(format!(
                "tensors {} (data bytes {}..{}) and {} (data bytes {}..{}) overlap",
                a.name,
                a.range.start as u64 - data_start,
                a.range.end as u64 - data_start,
                b.name,
                b.range.start as u64 - data_start,
                b.range.end as u64 - data_start
            ));
        }
    }
    if problems.is_empty() {
        Ok(tensors)
    } else {
        Err(problems)
    }
}

/// Checks one header entry; the range returned is relative to the data section.
fn parse_tensor_info(info: &Value, data_len: u64) -> Result<(StoredDtype, Vec<u64>, Range<u64>), String> {
    let info = info.as_object().ok_or_else(|| format!("entry must be an object, found {info}"))?;
    let dtype_name = info.get("dtype").and_then(Value::as_str).ok_or("missing `dtype` string")?;
    let dtype = StoredDtype::parse(dtype_name).ok_or_else(|| format!("unknown dtype `{dtype_name}`"))?;
    let shape: Vec<u64> = info
        .get("shape")
        .and_then(Value::as_array)
        .and_then(|dims| dims.iter().map(Value::as_u64).collect())
        .ok_or("`shape` must be a list of non-negative integers")?;
    let offsets: Vec<u64> = info
        .get("data_offsets")
        .and_then(Value::as_array)
        .and_then(|o| o.iter().map(Value::as_u64).collect())
        .filter(|o: &Vec<u64>| o.len() == 2)
        .ok_or("`data_offsets` must be two non-negative integers")?;
    let (begin, end) = (offsets[0], offsets[1]);
    if begin > end {
        return Err(format!("data_offsets [{begin}, {end}] end before they begin"));
    }
    if end > data_len {
        return Err(format!("data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes)"));
    }
    let bits = shape
        .iter()
        .try_fold(dtype.bits(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} is too large"))?;
    if bits % 8 != 0 || bits / 8 != end - begin {
        return Err(format!(
            "data_offsets [{begin}, {end}] hold {} bytes, but {}{shape:?} needs {}",
            end - begin,
            dtype.name(),
            if bits % 8 == 0 { (bits / 8).to_string() } else { format!("{bits} bits") }
        ));
    }
    Ok((dtype, shape, begin..end))
}

fn list_problems(problems: &[String]) -> String {
    match problems {
        [one] => one.clone(),
        many => format!(
            "{} problems:\n{}",
            many.len(),
            many.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors image from a header JSON and `data_len` zero bytes.
    fn image(header: &str, data_len: usize) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + data_len, 0);
        bytes
    }

    fn problems(header: &str, data_len: usize) -> String {
        parse_header(&image(header, data_len)).expect_err("header should be rejected").join("\n")
    }

    #[test]
    fn reads_tensors_with_file_ranges() {
        let header = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}}"#;
        let tensors = parse_header(&image(header, 22)).unwrap();
        let start = 8 + header.len();
        assert_eq!(tensors.len(), 2);
        assert_eq!(tensors[0].name, "a");
        assert_eq!(tensors[0].range, start..start + 16);
        assert_eq!(tensors[1].dtype, StoredDtype::Usable(DType::BF16));
        assert_eq!(tensors[1].range, start + 16..start + 22);
    }

    #[test]
    fn rejects_overlapping_ranges() {
        let header = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#;
        let message = problems(header, 24);
        assert!(message.contains("tensors a (data bytes 0..16) and b (data bytes 8..24) overlap"), "{message}");
    }

    #[test]
    fn rejects_size_mismatch_and_unknown_dtype_together() {
        let header = r#"{"a":{"dtype":"F16","shape":[4],"data_offsets":[0,6]},"b":{"dtype":"Q9","shape":[1],"data_offsets":[6,7]}}"#;
        let message = problems(header, 7);
        assert!(message.contains("tensor a: data_offsets [0, 6] hold 6 bytes, but F16[4] needs 8"), "{message}");
        assert!(message.contains("tensor b: unknown dtype `Q9`"), "{message}");
    }

    #[test]
    fn rejects_header_length_past_end_and_bad_json() {
        let mut bytes = image("{}", 0);
        bytes[..8].copy_from_slice(&1000u64.to_le_bytes());
        let message = parse_header(&bytes).unwrap_err().join("\n");
        assert!(message.contains("header length 1000 runs past the end of the file (10 bytes)"), "{message}");
        let message = problems("{not json", 0);
        assert!(message.contains("header is not a JSON object"), "{message}");
    }

    #[test]
    fn sub_byte_dtypes_must_fill_whole_bytes() {
        let header = r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#;
        assert!(problems(header, 2).contains("needs 12 bits"));
    }

    #[test]
    fn shard_names_stay_inside_the_checkpoint() {
        assert!(is_plain_relative("model-00001-of-00002.safetensors"));
        assert!(!is_plain_relative("../model.safetensors"));
        assert!(!is_plain_relative("/etc/passwd"));
        assert!(!is_plain_relative(""));
    }
}
