//! The compiled artifact file: a placed program, its packed weight tiles, and the IR with its own
//! copy of the weights, so `waferc run --validate` can run the reference decoder from the file
//! alone and a corrupted tile cannot also corrupt the reference's copy.
//!
//! Layout (integers little-endian):
//!
//! ```text
//! magic          8 bytes   "WAFERC\0\x1a"
//! version        u32       FORMAT_VERSION
//! header_len     u64       bytes of the bincode header
//! tile_blob_len  u64       bytes of the tile blob
//! ir_blob_len    u64       bytes of the IR weight blob
//! checksum       u64       over header, tile blob and IR blob, in that order
//! header         bincode 2 (serde, standard config): `Header`, then the replica table
//!                (`Vec<ExpertReplicas>`, bincode) only when the program has replicas
//! tile blob      every weight region's bytes, in the program's `pes` order (`WaferProgram::blob_ranges`)
//! IR blob        every IR weight's bytes, in module order (`Header::ir_weights`)
//! ```
//!
//! [`write()`] writes to a temporary file beside the target and renames it into place, so a
//! reader never sees half a file. [`read()`] memory-maps the file, checks magic, version, lengths
//! and checksum before decoding anything, and refuses a foreign, truncated or corrupted file.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{region_bytes, RegionKind, WaferProgram};
use crate::module::Module;
use crate::weights::WeightBytes;

pub const MAGIC: [u8; 8] = *b"WAFERC\0\x1a";
/// Bumped on any change to the file layout, to the serialised types or to what they mean
/// (5: a PE image's working regions may overlap).
pub const FORMAT_VERSION: u32 = 9;
/// Magic, version, three lengths and the checksum.
pub const PREFIX_LEN: usize = 8 + 4 + 8 + 8 + 8 + 8;

/// A compiled program with the module it came from.
#[derive(Clone, Debug)]
pub struct Artifact {
    pub program: WaferProgram,
    /// The IR. After [`read`], its weights are views of the file's IR blob (absent for a
    /// shape-only compile).
    pub module: Module,
    /// The tile blob (ranges from `WaferProgram::blob_ranges`). After [`read`], a view of the file;
    /// for a freshly compiled program, `Absent` (the writer cuts tiles from the module's weights).
    pub tiles: WeightBytes,
    /// The checkpoint's tokenizer as Hugging Face `tokenizer.json` text, so `waferc run --prompt`
    /// needs nothing but the artifact.
    pub tokenizer_json: Option<String>,
}

impl Artifact {
    /// A freshly compiled program and its module.
    pub fn new(program: WaferProgram, module: Module) -> Artifact {
        Artifact { program, module, tiles: WeightBytes::Absent, tokenizer_json: None }
    }

    /// The same artifact carrying the checkpoint's tokenizer (`tokenizer.json` text).
    pub fn with_tokenizer(self, tokenizer_json: Option<String>) -> Artifact {
        Artifact { tokenizer_json, ..self }
    }

    /// The initial bytes of a weight region whose bytes are at `blob` in the tile blob (see
    /// [`WaferProgram::blob_ranges`]): from the tile blob if the artifact has one, else cut from
    /// the module's weights. `None` for another region kind or a shape-only artifact.
    pub fn region_bytes(&self, kind: &RegionKind, blob: Range<u64>) -> Option<Vec<u8>> {
        match (kind, self.tiles.bytes()) {
            (RegionKind::Weight { .. }, Some(tiles)) => {
                tiles.get(blob.start as usize..blob.end as usize).map(|b| b.to_vec())
            }
            (RegionKind::Weight { .. }, None) => region_bytes(&self.module, kind),
            _ => None,
        }
    }
}

/// [`Header`] as the writer serialises it: the same fields in the same order (so the same
/// bytes), borrowing the program instead of cloning it.
#[derive(Serialize)]
struct HeaderRef<'a> {
    program: &'a WaferProgram,
    module_text: String,
    ir_weights: Vec<Option<Range<u64>>>,
    tokenizer_json: &'a Option<String>,
}

/// A writer that feeds the checksum and counts the bytes on their way to `out`, so the header
/// is encoded straight into the file instead of into a buffer of its own.
struct Summed<'a, W: Write> {
    out: &'a mut W,
    sum: &'a mut Checksum,
    written: u64,
}

impl<W: Write> Write for Summed<'_, W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(bytes)?;
        self.sum.update(&bytes[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// The serialised part of the file.
#[derive(Serialize, Deserialize)]
struct Header {
    program: WaferProgram,
    /// `text::print` of the module.
    module_text: String,
    /// Per IR weight, in module order: its byte range in the IR blob (`None` when absent).
    ir_weights: Vec<Option<Range<u64>>>,
    tokenizer_json: Option<String>,
}

/// Why an artifact could not be written or read. Each variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a waferc artifact (bad magic number)")]
    Foreign { path: PathBuf },
    #[error("{path}: artifact format version {found}, but this waferc reads version {FORMAT_VERSION} (recompile the model with this waferc)")]
    Version { path: PathBuf, found: u32 },
    #[error("{path}: truncated: the header promises {expected} bytes, the file has {found}")]
    Truncated { path: PathBuf, expected: u64, found: u64 },
    #[error("{path}: checksum mismatch (stored {stored:016x}, computed {computed:016x}): the file is corrupt")]
    Checksum { path: PathBuf, stored: u64, computed: u64 },
    #[error("{path}: header: {message}")]
    Header { path: PathBuf, message: String },
    #[error("{path}: the program is inconsistent with its module: {message}")]
    Inconsistent { path: PathBuf, message: String },
}

/// Writes `artifact` to `path` (through a temporary file renamed into place).
pub fn write(path: &Path, artifact: &Artifact) -> Result<(), ArtifactError> {
    let program = &artifact.program;
    let module = &artifact.module;
    let io = |source| ArtifactError::Io { path: path.to_path_buf(), source };
    let inconsistent = |message: String| ArtifactError::Inconsistent { path: path.to_path_buf(), message };

    let mut ir_weights = Vec::with_capacity(module.weights.len());
    let mut ir_len = 0u64;
    for (_, w) in module.weights.iter() {
        ir_weights.push(w.data.bytes().map(|b| {
            let range = ir_len..ir_len + b.len() as u64;
            ir_len = range.end;
            range
        }));
    }
    let tile_len = if program.weights_present { program.tile_blob_len } else { 0 };
    let header = HeaderRef {
        program,
        module_text: crate::text::print(module),
        ir_weights,
        tokenizer_json: &artifact.tokenizer_json,
    };

    // A full disk or a failed write is an I/O error on the file, not a malformed header.
    let encoding = |e: bincode::error::EncodeError| match e {
        bincode::error::EncodeError::Io { inner, .. } => io(inner),
        e => ArtifactError::Header { path: path.to_path_buf(), message: e.to_string() },
    };

    let temp = temp_path(path);
    let result = (|| {
        let file = File::create(&temp).map_err(io)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&[0u8; PREFIX_LEN]).map_err(io)?;
        let mut sum = Checksum::new();
        let header_len = {
            let mut summed = Summed { out: &mut out, sum: &mut sum, written: 0 };
            // bincode writes field by field: buffer its small writes before they reach the checksum.
            let mut buffered = BufWriter::with_capacity(1 << 16, &mut summed);
            bincode::serde::encode_into_std_write(&header, &mut buffered, bincode::config::standard())
                .map_err(encoding)?;
            // The replica table follows the header, only when there is one (module docs).
            if !program.replicas.is_empty() {
                bincode::serde::encode_into_std_write(&program.replicas, &mut buffered, bincode::config::standard())
                    .map_err(encoding)?;
            }
            buffered.flush().map_err(io)?;
            drop(buffered);
            summed.written
        };
        let mut emit = |out: &mut BufWriter<File>, bytes: &[u8]| -> Result<(), ArtifactError> {
            sum.update(bytes);
            out.write_all(bytes).map_err(io)
        };
        if tile_len > 0 {
            let mut written = 0u64;
            for (at, index, blob) in program.blob_ranges() {
                let (pe, region) = (program.pes[at].pe, &program.pes[at].regions[index]);
                let bytes = artifact.region_bytes(&region.kind, blob.clone()).ok_or_else(|| {
                    inconsistent(format!("{pe}: no bytes for the weight region at {blob:?} of the tile blob"))
                })?;
                if bytes.len() as u64 != blob.end - blob.start {
                    return Err(inconsistent(format!(
                        "{pe}: a weight region of {} bytes holds {} bytes of its weight",
                        region.bytes,
                        bytes.len()
                    )));
                }
                emit(&mut out, &bytes)?;
                written = blob.end;
            }
            if written != tile_len {
                return Err(inconsistent(format!("tile regions hold {written} bytes, the program says {tile_len}")));
            }
        }
        for (_, w) in module.weights.iter() {
            if let Some(bytes) = w.data.bytes() {
                emit(&mut out, bytes)?;
            }
        }
        let mut prefix = Vec::with_capacity(PREFIX_LEN);
        prefix.extend_from_slice(&MAGIC);
        prefix.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        for n in [header_len, tile_len, ir_len, sum.finish()] {
            prefix.extend_from_slice(&n.to_le_bytes());
        }
        out.seek(SeekFrom::Start(0)).map_err(io)?;
        out.write_all(&prefix).map_err(io)?;
        let file = out.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&temp, path).map_err(io)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// Reads and verifies an artifact.
pub fn read(path: &Path) -> Result<Artifact, ArtifactError> {
    let at = || path.to_path_buf();
    let file = File::open(path).map_err(|source| ArtifactError::Io { path: at(), source })?;
    if file.metadata().map_err(|source| ArtifactError::Io { path: at(), source })?.is_dir() {
        return Err(ArtifactError::Foreign { path: at() });
    }
    // SAFETY: the map is read-only; like every memory-mapped input, the file must not be
    // truncated while mapped (the writer only ever renames a complete file into place).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| ArtifactError::Io { path: at(), source })?;
    read_image(Arc::new(map), path)
}

/// [`read()`] of an artifact image already mapped (an anonymous map, say); `path` names it in
/// errors. The fuzz targets' entry point.
pub fn read_image(map: Arc<memmap2::Mmap>, path: &Path) -> Result<Artifact, ArtifactError> {
    let at = || path.to_path_buf();
    let found = map.len() as u64;
    if map.len() < MAGIC.len() || map[..MAGIC.len()] != MAGIC {
        return Err(ArtifactError::Foreign { path: at() });
    }
    if map.len() < PREFIX_LEN {
        return Err(ArtifactError::Truncated { path: at(), expected: PREFIX_LEN as u64, found });
    }
    let u64_at = |offset: usize| u64::from_le_bytes(map[offset..offset + 8].try_into().expect("8 bytes"));
    let version = u32::from_le_bytes(map[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(ArtifactError::Version { path: at(), found: version });
    }
    let (header_len, tile_len, ir_len, stored) = (u64_at(12), u64_at(20), u64_at(28), u64_at(36));
    let expected = (PREFIX_LEN as u64)
        .checked_add(header_len)
        .and_then(|n| n.checked_add(tile_len))
        .and_then(|n| n.checked_add(ir_len));
    if expected != Some(found) {
        return Err(ArtifactError::Truncated { path: at(), expected: expected.unwrap_or(u64::MAX), found });
    }
    let mut sum = Checksum::new();
    sum.update(&map[PREFIX_LEN..]);
    let computed = sum.finish();
    if computed != stored {
        return Err(ArtifactError::Checksum { path: at(), stored, computed });
    }
    let header_end = PREFIX_LEN + header_len as usize;
    let header_error = |message: String| ArtifactError::Header { path: at(), message };
    let (mut header, used): (Header, usize) =
        bincode::serde::decode_from_slice(&map[PREFIX_LEN..header_end], bincode::config::standard())
            .map_err(|e| header_error(e.to_string()))?;
    if used != header_len as usize {
        // The rest of the header is the replica table (written only when non-empty).
        let (replicas, more): (Vec<super::ExpertReplicas>, usize) =
            bincode::serde::decode_from_slice(&map[PREFIX_LEN + used..header_end], bincode::config::standard())
                .map_err(|e| header_error(format!("replica table: {e}")))?;
        if used + more != header_len as usize || replicas.is_empty() {
            return Err(header_error(format!("{} trailing bytes", header_len as usize - used)));
        }
        header.program.replicas = replicas;
    }
    let mut module = crate::text::parse(&header.module_text).map_err(|e| header_error(format!("module text: {e}")))?;
    let file_name = Arc::new(path.to_path_buf());
    let tile_start = header_end;
    let ir_start = tile_start + tile_len as usize;
    if header.ir_weights.len() != module.weights.len() {
        return Err(ArtifactError::Inconsistent {
            path: at(),
            message: format!("{} IR weight entries for {} weights", header.ir_weights.len(), module.weights.len()),
        });
    }
    for (handle, range) in module.weights.handles().zip(header.ir_weights) {
        let Some(range) = range else { continue };
        if range.end > ir_len || range.start > range.end {
            return Err(ArtifactError::Inconsistent {
                path: at(),
                message: format!("IR weight range {range:?} is past the blob"),
            });
        }
        module.weights[handle].data = WeightBytes::Mapped {
            map: map.clone(),
            range: ir_start + range.start as usize..ir_start + range.end as usize,
            file: file_name.clone(),
        };
    }
    let tiles = if tile_len > 0 {
        WeightBytes::Mapped { map: map.clone(), range: tile_start..ir_start, file: file_name }
    } else {
        WeightBytes::Absent
    };
    Ok(Artifact { program: header.program, module, tiles, tokenizer_json: header.tokenizer_json })
}

/// The checksum an artifact's prefix stores for `body`, everything after the prefix (what a
/// structure-aware fuzzer needs to make a mutated image pass the corruption check).
pub fn checksum(body: &[u8]) -> u64 {
    let mut sum = Checksum::new();
    sum.update(body);
    sum.finish()
}

/// A 64-bit checksum over a byte stream fed in arbitrary pieces: four multiply-rotate lanes over
/// 32-byte blocks (fast enough for tens of gigabytes), then a final mix with the length. It
/// detects corruption, not tampering.
struct Checksum {
    lanes: [u64; 4],
    pending: Vec<u8>,
    total: u64,
}

const PRIME: u64 = 0x9E37_79B9_7F4A_7C15;

impl Checksum {
    fn new() -> Checksum {
        Checksum { lanes: [1, 2, 3, 4], pending: Vec::with_capacity(32), total: 0 }
    }

    fn block(lanes: &mut [u64; 4], block: &[u8]) {
        for (lane, word) in lanes.iter_mut().zip(block.chunks_exact(8)) {
            let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            *lane = (*lane ^ w).wrapping_mul(PRIME).rotate_left(31);
        }
    }

    fn update(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if !self.pending.is_empty() {
            let take = (32 - self.pending.len()).min(data.len());
            self.pending.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.pending.len() < 32 {
                return;
            }
            let pending = std::mem::take(&mut self.pending);
            Self::block(&mut self.lanes, &pending);
            self.pending = pending;
            self.pending.clear();
        }
        let blocks = data.chunks_exact(32);
        let rest = blocks.remainder();
        for block in blocks {
            Self::block(&mut self.lanes, block);
        }
        self.pending.extend_from_slice(rest);
    }

    fn finish(mut self) -> u64 {
        let mut last = [0u8; 32];
        last[..self.pending.len()].copy_from_slice(&self.pending);
        Self::block(&mut self.lanes, &last);
        let mut h = self.total.wrapping_mul(PRIME);
        for lane in self.lanes {
            h = (h ^ lane).wrapping_mul(PRIME).rotate_left(27);
        }
        h ^ (h >> 29)
    }
}

#[cfg(test)]
mod tests {
    use super::Checksum;

    #[test]
    fn checksum_does_not_depend_on_how_the_stream_is_cut() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let mut whole = Checksum::new();
        whole.update(&data);
        let expected = whole.finish();
        for piece in [1, 5, 31, 32, 33, 999] {
            let mut sum = Checksum::new();
            for chunk in data.chunks(piece) {
                sum.update(chunk);
            }
            assert_eq!(sum.finish(), expected, "pieces of {piece}");
        }
        let mut shorter = Checksum::new();
        shorter.update(&data[..999]);
        assert_ne!(shorter.finish(), expected);
    }
}
