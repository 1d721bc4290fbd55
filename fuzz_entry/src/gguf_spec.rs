//! Structure-aware GGUF inputs: `arbitrary` decodes the fuzzer's bytes into a [`GgufSpec`], which
//! is written as a GGUF file with the right magic and framing (random bytes almost never get
//! past the magic, version and counts). Keys, tensor names and types come mostly from the sets a
//! llama GGUF uses, so the metadata, tensor directory, data offsets, vocabulary and lowering are
//! all reached; free-form keys, values and offsets keep the rest of the space open.

use arbitrary::{Arbitrary, Unstructured};

/// Metadata keys the GGUF frontend reads.
const KEYS: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "llama.context_length",
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.attention.key_length",
    "llama.attention.value_length",
    "llama.rope.freq_base",
    "llama.rope.dimension_count",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.expert_count",
    "llama.vocab_size",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
];

/// Per-layer tensor names (after `blk.N.`) and the whole-model ones.
const LAYER_TENSORS: &[&str] = &[
    "attn_norm.weight",
    "ffn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
];
const MODEL_TENSORS: &[&str] = &["token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"];

/// ggml types: the ones waferc stores, and a few it reports.
const GGML_TYPES: &[u32] = &[0, 1, 2, 3, 8, 30, 12, 14, 39];

#[derive(Arbitrary, Debug)]
struct GgufSpec {
    version: Version,
    /// Start from a complete one-layer llama (metadata, token list and every tensor), so the
    /// fuzzer mutates a file that lowers instead of rediscovering one.
    tiny_llama: bool,
    metadata: Vec<(Key, Value)>,
    tensors: Vec<TensorSpec>,
    /// Lie about the counts in the header.
    tensor_count_delta: Option<i8>,
    kv_count_delta: Option<i8>,
    /// Bytes appended after the data section.
    trailing: Vec<u8>,
}

#[derive(Arbitrary, Debug)]
enum Version {
    V3,
    V2,
    Other(u32),
}

#[derive(Arbitrary, Debug)]
enum Key {
    Known(u8),
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(u8),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Strings(Vec<String>),
    I32s(Vec<i32>),
    /// An array header with any element type and count, then raw bytes.
    RawArray {
        element_type: u32,
        count: u64,
        bytes: Vec<u8>,
    },
    /// Any type id, then raw bytes.
    Raw {
        type_id: u32,
        bytes: Vec<u8>,
    },
}

#[derive(Arbitrary, Debug)]
struct TensorSpec {
    name: TensorName,
    dims: Vec<u64>,
    /// An index into [`GGML_TYPES`] or, past its end, any id.
    ggml_type: u32,
    /// `None`: the next aligned offset after the previous tensor, with its data written.
    offset: Option<u64>,
}

#[derive(Arbitrary, Debug)]
enum TensorName {
    Layer { layer: u8, part: u8 },
    Model(u8),
    Other(String),
}

/// Data written for one tensor is capped, so a spec claiming a huge tensor makes a short file
/// (which the reader must reject) rather than a huge input.
const MAX_TENSOR_DATA: u64 = 1 << 20;

/// Decodes `data` as a [`GgufSpec`], writes the GGUF file and reads it as `waferc` does.
pub fn gguf_structured(data: &[u8]) -> Result<(), String> {
    let spec = GgufSpec::arbitrary_take_rest(Unstructured::new(data)).map_err(|e| format!("spec: {e}"))?;
    crate::read_gguf(&spec.to_bytes())
}

/// The complete one-layer llama GGUF the structured target starts from (a seed for `gguf` and,
/// compiled, for `artifact`).
pub fn tiny_llama_gguf() -> Vec<u8> {
    let spec = GgufSpec {
        version: Version::V3,
        tiny_llama: true,
        metadata: Vec::new(),
        tensors: Vec::new(),
        tensor_count_delta: None,
        kv_count_delta: None,
        trailing: Vec::new(),
    };
    spec.to_bytes()
}

impl GgufSpec {
    fn to_bytes(&self) -> Vec<u8> {
        let mut metadata: Vec<(String, Vec<u8>)> = Vec::new();
        let mut tensors: Vec<(String, Vec<u64>, u32, Option<u64>)> = Vec::new();
        if self.tiny_llama {
            tiny_llama(&mut metadata, &mut tensors);
        }
        for (key, value) in &self.metadata {
            let key = match key {
                Key::Known(i) => KEYS[*i as usize % KEYS.len()].to_string(),
                Key::Other(s) => s.clone(),
            };
            // A known key overrides the tiny llama's value instead of appearing twice.
            metadata.retain(|(k, _)| *k != key);
            metadata.push((key, value.encode()));
        }
        for t in &self.tensors {
            let name = match &t.name {
                TensorName::Layer { layer, part } => {
                    format!("blk.{}.{}", layer % 4, LAYER_TENSORS[*part as usize % LAYER_TENSORS.len()])
                }
                TensorName::Model(i) => MODEL_TENSORS[*i as usize % MODEL_TENSORS.len()].to_string(),
                TensorName::Other(s) => s.clone(),
            };
            let ggml_type = GGML_TYPES.get(t.ggml_type as usize).copied().unwrap_or(t.ggml_type);
            tensors.retain(|(n, ..)| *n != name);
            tensors.push((name, t.dims.clone(), ggml_type, t.offset));
        }

        let alignment = 32u64;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.number().to_le_bytes());
        let count = |n: usize, delta: Option<i8>| (n as u64).wrapping_add_signed(delta.unwrap_or(0).into());
        out.extend_from_slice(&count(tensors.len(), self.tensor_count_delta).to_le_bytes());
        out.extend_from_slice(&count(metadata.len(), self.kv_count_delta).to_le_bytes());
        for (key, value) in &metadata {
            put_string(&mut out, key);
            out.extend_from_slice(value);
        }
        let mut next = 0u64;
        let mut data: Vec<(u64, u64)> = Vec::new();
        for (name, dims, ggml_type, offset) in &tensors {
            let size = data_bytes(dims, *ggml_type).unwrap_or(0).min(MAX_TENSOR_DATA);
            let offset = offset.unwrap_or_else(|| {
                let at = next;
                data.push((at, size));
                next = (at + size).next_multiple_of(alignment);
                at
            });
            put_string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ggml_type.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
        }
        let start = out.len().next_multiple_of(alignment as usize);
        out.resize(start, 0);
        // Deterministic, non-constant tensor bytes: small finite f32/f16/bf16 values and block scales.
        for (at, size) in data {
            out.resize(start + at as usize, 0);
            out.extend((0..size).map(|i| (i % 61) as u8 & 0x3b));
        }
        out.extend_from_slice(&self.trailing);
        out
    }
}

impl Version {
    fn number(&self) -> u32 {
        match self {
            Version::V3 => 3,
            Version::V2 => 2,
            Version::Other(v) => *v,
        }
    }
}

/// Bytes of a tensor of a type waferc stores (`None` otherwise, or when it overflows).
fn data_bytes(dims: &[u64], ggml_type: u32) -> Option<u64> {
    let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
    match ggml_type {
        0 => elements.checked_mul(4),
        1 | 30 => elements.checked_mul(2),
        2 => Some(elements / 32 * 18),
        3 => Some(elements / 32 * 20),
        8 => Some(elements / 32 * 34),
        _ => None,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl Value {
    /// Type id and payload, as a metadata value is stored.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut typed = |id: u32, payload: &[u8]| {
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(payload);
        };
        match self {
            Value::U8(v) => typed(0, &v.to_le_bytes()),
            Value::I8(v) => typed(1, &v.to_le_bytes()),
            Value::U16(v) => typed(2, &v.to_le_bytes()),
            Value::I16(v) => typed(3, &v.to_le_bytes()),
            Value::U32(v) => typed(4, &v.to_le_bytes()),
            Value::I32(v) => typed(5, &v.to_le_bytes()),
            Value::F32(v) => typed(6, &v.to_le_bytes()),
            Value::Bool(v) => typed(7, &[*v]),
            Value::Str(s) => {
                let mut payload = Vec::new();
                put_string(&mut payload, s);
                typed(8, &payload)
            }
            Value::U64(v) => typed(10, &v.to_le_bytes()),
            Value::I64(v) => typed(11, &v.to_le_bytes()),
            Value::F64(v) => typed(12, &v.to_le_bytes()),
            Value::Strings(items) => return string_array(items),
            Value::I32s(items) => {
                let mut payload = 5u32.to_le_bytes().to_vec();
                payload.extend_from_slice(&(items.len() as u64).to_le_bytes());
                items.iter().for_each(|v| payload.extend_from_slice(&v.to_le_bytes()));
                typed(9, &payload)
            }
            Value::RawArray { element_type, count, bytes } => {
                let mut payload = element_type.to_le_bytes().to_vec();
                payload.extend_from_slice(&count.to_le_bytes());
                payload.extend_from_slice(bytes);
                typed(9, &payload)
            }
            Value::Raw { type_id, bytes } => typed(*type_id, bytes),
        }
        out
    }
}

fn string_array<S: AsRef<str>>(items: &[S]) -> Vec<u8> {
    let mut out = 9u32.to_le_bytes().to_vec();
    out.extend_from_slice(&8u32.to_le_bytes());
    out.extend_from_slice(&(items.len() as u64).to_le_bytes());
    items.iter().for_each(|s| put_string(&mut out, s.as_ref()));
    out
}

/// A one-layer llama (hidden 64, 4 heads of 16, 2 KV heads, vocab 64) with a byte-level BPE
/// vocabulary in its metadata: a file the GGUF frontend reads and lowers.
fn tiny_llama(metadata: &mut Vec<(String, Vec<u8>)>, tensors: &mut Vec<(String, Vec<u64>, u32, Option<u64>)>) {
    let u32_value = |v: u32| Value::U32(v).encode();
    let str_value = |s: &str| Value::Str(s.to_string()).encode();
    // 64 tokens: letters, eight digits, GPT-2's byte-level space, then the three merges' results.
    let mut tokens: Vec<String> =
        (b'a'..=b'z').chain(b'A'..=b'Z').chain(b'0'..=b'7').map(|b| (b as char).to_string()).collect();
    tokens.extend(["\u{120}", "He", "ll", "Hell"].map(String::from));
    let merges = ["H e", "l l", "He ll"];
    metadata.extend([
        ("general.architecture".to_string(), str_value("llama")),
        ("llama.embedding_length".to_string(), u32_value(64)),
        ("llama.block_count".to_string(), u32_value(1)),
        ("llama.feed_forward_length".to_string(), u32_value(96)),
        ("llama.attention.head_count".to_string(), u32_value(4)),
        ("llama.attention.head_count_kv".to_string(), u32_value(2)),
        ("llama.attention.layer_norm_rms_epsilon".to_string(), Value::F32(1e-5).encode()),
        ("llama.vocab_size".to_string(), u32_value(64)),
        ("tokenizer.ggml.model".to_string(), str_value("gpt2")),
        ("tokenizer.ggml.pre".to_string(), str_value("smollm")),
        ("tokenizer.ggml.tokens".to_string(), string_array(&tokens)),
        ("tokenizer.ggml.merges".to_string(), string_array(&merges)),
        ("tokenizer.ggml.bos_token_id".to_string(), u32_value(1)),
        ("tokenizer.ggml.eos_token_id".to_string(), u32_value(2)),
    ]);
    let (f32_type, f16_type, q8_type) = (0, 1, 8);
    tensors.extend([
        ("token_embd.weight".to_string(), vec![64, 64], q8_type, None),
        ("output_norm.weight".to_string(), vec![64], f32_type, None),
        ("blk.0.attn_norm.weight".to_string(), vec![64], f32_type, None),
        ("blk.0.ffn_norm.weight".to_string(), vec![64], f32_type, None),
        ("blk.0.attn_q.weight".to_string(), vec![64, 64], f16_type, None),
        ("blk.0.attn_k.weight".to_string(), vec![64, 32], f16_type, None),
        ("blk.0.attn_v.weight".to_string(), vec![64, 32], f16_type, None),
        ("blk.0.attn_output.weight".to_string(), vec![64, 64], f16_type, None),
        ("blk.0.ffn_gate.weight".to_string(), vec![64, 96], f16_type, None),
        ("blk.0.ffn_up.weight".to_string(), vec![64, 96], f16_type, None),
        ("blk.0.ffn_down.weight".to_string(), vec![96, 64], f16_type, None),
    ]);
}
