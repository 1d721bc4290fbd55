//! A tiny GGUF writer for tests: just enough of the format to build valid files and then break
//! them on purpose.

#![allow(dead_code)] // each test binary uses a different part of it

use std::path::{Path, PathBuf};

pub const F32: u32 = 0;
pub const F16: u32 = 1;
pub const Q4_0: u32 = 2;
pub const Q4_1: u32 = 3;
pub const Q8_0: u32 = 8;
pub const Q4_K: u32 = 12;
pub const Q6_K: u32 = 14;
pub const BF16: u32 = 30;

pub enum Value {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strings(Vec<String>),
    I32s(Vec<i32>),
}

pub struct Tensor {
    pub name: String,
    /// ggml order, innermost first.
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
}

pub struct GgufWriter {
    pub version: u32,
    pub alignment: u64,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<Tensor>,
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter { version: 3, alignment: 32, metadata: Vec::new(), tensors: Vec::new() }
    }

    pub fn kv(mut self, key: &str, value: Value) -> Self {
        self.metadata.push((key.to_owned(), value));
        self
    }

    pub fn tensor(mut self, name: &str, dims: &[u64], ggml_type: u32, data: Vec<u8>) -> Self {
        self.tensors.push(Tensor { name: name.to_owned(), dims: dims.to_vec(), ggml_type, data });
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            put_value(&mut out, value);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).next_multiple_of(self.alignment);
        }
        for (t, offset) in self.tensors.iter().zip(&offsets) {
            put_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
        }
        let start = (out.len() as u64).next_multiple_of(self.alignment) as usize;
        out.resize(start, 0);
        for (t, offset) in self.tensors.iter().zip(&offsets) {
            out.resize(start + *offset as usize, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }

    /// Writes the file as `dir/name` and returns its path.
    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, self.to_bytes()).expect("write test GGUF");
        path
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U32(v) => {
            out.extend_from_slice(&4u32.to_le_bytes());
            out.extend_from_slice(&v.to_le_bytes());
        }
        Value::I32(v) => {
            out.extend_from_slice(&5u32.to_le_bytes());
            out.extend_from_slice(&v.to_le_bytes());
        }
        Value::F32(v) => {
            out.extend_from_slice(&6u32.to_le_bytes());
            out.extend_from_slice(&v.to_le_bytes());
        }
        Value::Bool(v) => {
            out.extend_from_slice(&7u32.to_le_bytes());
            out.push(u8::from(*v));
        }
        Value::Str(s) => {
            out.extend_from_slice(&8u32.to_le_bytes());
            put_string(out, s);
        }
        Value::Strings(items) => {
            out.extend_from_slice(&9u32.to_le_bytes());
            out.extend_from_slice(&8u32.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for s in items {
                put_string(out, s);
            }
        }
        Value::I32s(items) => {
            out.extend_from_slice(&9u32.to_le_bytes());
            out.extend_from_slice(&5u32.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for v in items {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// A fresh, empty directory under the target dir's tmp for one test.
pub fn scratch_dir(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gguf-tests").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create test dir");
    dir
}

/// A minimal llama model's metadata: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, vocab 64.
pub fn tiny_llama_metadata(writer: GgufWriter) -> GgufWriter {
    writer
        .kv("general.architecture", Value::Str("llama".into()))
        .kv("general.alignment", Value::U32(32))
        .kv("llama.context_length", Value::U32(256))
        .kv("llama.embedding_length", Value::U32(64))
        .kv("llama.block_count", Value::U32(1))
        .kv("llama.feed_forward_length", Value::U32(96))
        .kv("llama.attention.head_count", Value::U32(4))
        .kv("llama.attention.head_count_kv", Value::U32(2))
        .kv("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5))
        .kv("llama.rope.freq_base", Value::F32(10000.0))
        .kv("llama.rope.dimension_count", Value::U32(16))
        .kv("llama.vocab_size", Value::U32(64))
        .kv("tokenizer.ggml.bos_token_id", Value::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Value::U32(2))
}
