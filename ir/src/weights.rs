//! Weight storage by reference. A weight's bytes stay where the checkpoint put them (a
//! memory-mapped file) unless a frontend had to rewrite them (a GGUF row permutation, say).
//! Cloning a `WeightBytes` is a reference-count bump, never a copy.

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Clone)]
pub enum WeightBytes {
    /// A byte range of a memory-mapped file.
    Mapped { map: Arc<memmap2::Mmap>, range: Range<usize>, file: Arc<PathBuf> },
    /// Bytes owned in memory (rewritten by a frontend or a pass, or built by a test).
    Owned(Arc<[u8]>),
    /// No data: the module was parsed from text or compiled shape-only.
    Absent,
}

impl WeightBytes {
    pub fn owned(bytes: impl Into<Arc<[u8]>>) -> Self {
        WeightBytes::Owned(bytes.into())
    }

    /// The bytes, or `None` for a shape-only weight.
    pub fn bytes(&self) -> Option<&[u8]> {
        match self {
            WeightBytes::Mapped { map, range, .. } => Some(&map[range.clone()]),
            WeightBytes::Owned(b) => Some(b),
            WeightBytes::Absent => None,
        }
    }

    pub fn is_present(&self) -> bool {
        !matches!(self, WeightBytes::Absent)
    }

    /// The file the bytes come from, for error messages.
    pub fn file(&self) -> Option<&std::path::Path> {
        match self {
            WeightBytes::Mapped { file, .. } => Some(file),
            _ => None,
        }
    }
}

impl fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightBytes::Mapped { range, file, .. } => {
                write!(f, "Mapped({}, {}..{})", file.display(), range.start, range.end)
            }
            WeightBytes::Owned(b) => write!(f, "Owned({} bytes)", b.len()),
            WeightBytes::Absent => f.write_str("Absent"),
        }
    }
}
