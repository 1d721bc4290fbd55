//! The GGUF frontend on small files written here: names, shapes and bytes as Hugging Face has
//! them, the q/k row permutation undone, metadata to `ModelConfig`, the tokenizer, and clean
//! errors for every kind of broken or unsupported file.

mod gguf_writer;

use std::path::Path;

use gguf_writer::{scratch_dir, tiny_llama_metadata, GgufWriter, Value, BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0};
use waferc::frontend::{gguf, Architecture, FrontendError};
use waferc_ir::{DType, RopeScaling};

/// Bytes where every row is recognisable: byte `i` of row `r` is a hash of (tensor, r, i).
fn row_bytes(seed: u8, rows: usize, row_len: usize) -> Vec<u8> {
    (0..rows * row_len)
        .map(|k| {
            let (r, i) = (k / row_len, k % row_len);
            (seed as usize * 131 + r * 31 + i * 7 + (r * i) % 13) as u8
        })
        .collect()
}

/// What the frontend should make of one GGUF tensor.
struct Expected {
    gguf_name: &'static str,
    hf_name: &'static str,
    hf_shape: Vec<u64>,
    dtype: DType,
}

/// One llama layer, hidden 64, 4 heads of 16, 2 KV heads, ffn 96, vocab 64, every supported type.
fn tiny_llama() -> (GgufWriter, Vec<Expected>) {
    // GGUF name, HF name, ggml dims (a 1-D tensor has N = 1), ggml type, dtype, bytes per row.
    let tensors = [
        ("token_embd.weight", "model.embed_tokens.weight", [64, 64], Q8_0, DType::Q8_0, 2 * 34),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", [64, 1], F32, DType::F32, 256),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", [64, 64], Q4_1, DType::Q4_1, 2 * 20),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", [64, 32], Q4_0, DType::Q4_0, 2 * 18),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight", [64, 32], F16, DType::F16, 128),
        ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight", [64, 64], BF16, DType::BF16, 128),
        ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight", [64, 1], F32, DType::F32, 256),
        ("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight", [64, 96], Q8_0, DType::Q8_0, 2 * 34),
        ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", [64, 96], F32, DType::F32, 256),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", [96, 64], Q4_1, DType::Q4_1, 3 * 20),
        ("output_norm.weight", "model.norm.weight", [64, 1], F32, DType::F32, 256),
    ];
    let mut writer = tiny_llama_metadata(GgufWriter::new());
    let mut expected = Vec::new();
    for (seed, (gguf_name, hf_name, [k, n], ggml_type, dtype, row_len)) in tensors.into_iter().enumerate() {
        let (dims, hf_shape) = if n == 1 { (vec![k], vec![k]) } else { (vec![k, n], vec![n, k]) };
        writer = writer.tensor(gguf_name, &dims, ggml_type, row_bytes(seed as u8, n as usize, row_len));
        expected.push(Expected { gguf_name, hf_name, hf_shape, dtype });
    }
    (writer, expected)
}

fn format_message(err: FrontendError) -> String {
    match err {
        FrontendError::Format { message, .. } => message,
        other => panic!("expected a format error, got: {other}"),
    }
}

fn invalid_problems(err: FrontendError) -> Vec<String> {
    match err {
        FrontendError::Invalid { problems, .. } => problems,
        other => panic!("expected an invalid-model error, got: {other}"),
    }
}

fn gguf_data<'a>(writer: &'a GgufWriter, name: &str) -> &'a [u8] {
    &writer.tensors.iter().find(|t| t.name == name).expect("tensor in writer").data
}

#[test]
fn reads_tiny_llama_under_hugging_face_names_and_shapes() {
    let dir = scratch_dir("tiny_llama");
    let (writer, expected) = tiny_llama();
    let path = writer.write(&dir, "tiny.gguf");
    let (checkpoint, _) = gguf::read(&path).expect("tiny llama reads");

    let c = &checkpoint.config;
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!(
        (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim),
        (64, 64, 96, 1, 4, 2, 16)
    );
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!(c.rope.theta, 10000.0);
    assert_eq!(c.rope.scaling, RopeScaling::None);
    assert!(c.tie_word_embeddings, "no output.weight means tied embeddings");
    assert!(!c.attention_bias && !c.qk_norm && c.moe.is_none());
    assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (Some(1), vec![2]));
    assert_eq!(checkpoint.path, path);

    let names: Vec<&str> = checkpoint.tensors.keys().map(String::as_str).collect();
    let mut expected_names: Vec<&str> = expected.iter().map(|e| e.hf_name).collect();
    expected_names.sort();
    assert_eq!(names, expected_names);
    for Expected { gguf_name, hf_name, hf_shape, dtype } in &expected {
        let entry = &checkpoint.tensors[*hf_name];
        assert_eq!((&entry.ty.shape, entry.ty.dtype), (hf_shape, *dtype), "{hf_name}");
        assert_eq!(entry.file, path);
        let bytes = entry.data.bytes().expect("tensor has data");
        assert_eq!(bytes.len() as u64, entry.ty.bytes().unwrap(), "{hf_name}");
        if !hf_name.contains("q_proj") && !hf_name.contains("k_proj") {
            assert_eq!(bytes, gguf_data(&writer, gguf_name), "{hf_name} is the file's bytes, untouched");
            assert_eq!(entry.data.file(), Some(path.as_path()), "{hf_name} stays memory-mapped");
        }
    }
}

/// transformers' `_reverse_permute_weights`: `w.reshape(n_head, dim, 2, K).swapaxes(2, 1)`, so
/// Hugging Face row (h, j, i) is GGUF row (h, i, j).
fn expected_unpermuted(gguf: &[u8], rows: usize, heads: usize) -> Vec<u8> {
    let row_len = gguf.len() / rows;
    let dim = rows / heads / 2;
    let mut out = Vec::new();
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..dim {
                let g = (h * dim + i) * 2 + j;
                out.extend_from_slice(&gguf[g * row_len..(g + 1) * row_len]);
            }
        }
    }
    out
}

#[test]
fn q_and_k_rows_return_to_hugging_face_order() {
    let dir = scratch_dir("unpermute");
    let (writer, _) = tiny_llama();
    let path = writer.write(&dir, "tiny.gguf");
    let (checkpoint, _) = gguf::read(&path).unwrap();
    let q = checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"].data.bytes().unwrap();
    let k = checkpoint.tensors["model.layers.0.self_attn.k_proj.weight"].data.bytes().unwrap();
    let gguf_q = gguf_data(&writer, "blk.0.attn_q.weight");
    let gguf_k = gguf_data(&writer, "blk.0.attn_k.weight");
    assert_eq!(q, expected_unpermuted(gguf_q, 64, 4), "q: 4 heads");
    assert_eq!(k, expected_unpermuted(gguf_k, 32, 2), "k: 2 KV heads");
    assert_ne!(q, gguf_q, "the permutation moved rows");
    // Within head 0 of k (rows 0..16), Hugging Face row 1 is GGUF row 2 and row 8 is GGUF row 1.
    let row = 36;
    assert_eq!(&k[row..2 * row], &gguf_k[2 * row..3 * row]);
    assert_eq!(&k[8 * row..9 * row], &gguf_k[row..2 * row]);
}

#[test]
fn output_weight_means_untied_head() {
    let dir = scratch_dir("untied");
    let (writer, _) = tiny_llama();
    let writer = writer.tensor("output.weight", &[64, 64], F16, row_bytes(99, 64, 128));
    let (checkpoint, _) = gguf::read(&writer.write(&dir, "untied.gguf")).unwrap();
    assert!(!checkpoint.config.tie_word_embeddings);
    let head = &checkpoint.tensors["lm_head.weight"];
    assert_eq!((head.ty.shape.as_slice(), head.ty.dtype), (&[64u64, 64][..], DType::F16));
}

#[test]
fn unsupported_tensor_types_are_reported_together_by_name_and_type() {
    let dir = scratch_dir("unsupported");
    let (mut writer, _) = tiny_llama();
    for t in &mut writer.tensors {
        match t.name.as_str() {
            // Q4_K: 144 bytes per 256 elements; Q6_K: 210. Sizes do not matter: never read.
            "blk.0.ffn_gate.weight" => (t.ggml_type, t.dims, t.data) = (Q4_K, vec![256, 96], vec![0; 96 * 144]),
            "blk.0.ffn_up.weight" => (t.ggml_type, t.dims, t.data) = (Q6_K, vec![256, 96], vec![0; 96 * 210]),
            _ => {}
        }
    }
    let err = gguf::read(&writer.write(&dir, "kquants.gguf")).unwrap_err();
    let message = err.to_string();
    let problems = invalid_problems(err);
    assert_eq!(problems.len(), 1, "one problem listing both tensors: {problems:?}");
    assert!(problems[0].contains("blk.0.ffn_gate.weight (Q4_K)"), "{message}");
    assert!(problems[0].contains("blk.0.ffn_up.weight (Q6_K)"), "{message}");
    assert!(message.contains("kquants.gguf"), "{message}");
}

#[test]
fn unknown_tensor_names_and_missing_metadata_are_all_listed() {
    let dir = scratch_dir("invalid_metadata");
    let (mut writer, _) = tiny_llama();
    writer.metadata.retain(|(k, _)| k != "llama.block_count" && k != "llama.attention.layer_norm_rms_epsilon");
    let err = gguf::read(&writer.write(&dir, "missing.gguf")).unwrap_err();
    let problems = invalid_problems(err);
    assert!(problems.iter().any(|p| p.contains("llama.block_count is missing")), "{problems:?}");
    assert!(problems.iter().any(|p| p.contains("llama.attention.layer_norm_rms_epsilon is missing")), "{problems:?}");

    let (writer, _) = tiny_llama();
    let writer = writer.tensor("blk.0.attn_q.bias", &[64], F32, vec![0; 256]);
    let problems = invalid_problems(gguf::read(&writer.write(&dir, "extra.gguf")).unwrap_err());
    assert_eq!(problems, ["tensor blk.0.attn_q.bias has no Hugging Face llama counterpart"]);

    let (mut writer, _) = tiny_llama();
    writer.metadata[0].1 = Value::Str("gemma".into());
    let problems = invalid_problems(gguf::read(&writer.write(&dir, "gemma.gguf")).unwrap_err());
    assert_eq!(problems, ["architecture \"gemma\" is not supported by the GGUF frontend (only \"llama\")"]);
}

#[test]
fn every_truncation_is_a_clean_error() {
    let dir = scratch_dir("truncated");
    let (writer, _) = tiny_llama();
    let bytes = writer.to_bytes();
    let path = dir.join("cut.gguf");
    // The same file with no tensor data is the header, metadata and directory alone.
    let (mut bare, _) = tiny_llama();
    bare.tensors.iter_mut().for_each(|t| t.data.clear());
    let directory_len = bare.to_bytes().len();
    // Every cut up to a little into the data, then a stride (every tensor is longer than it).
    for len in (0..directory_len + 64).chain((directory_len + 64..bytes.len()).step_by(37)) {
        std::fs::write(&path, &bytes[..len]).unwrap();
        match gguf::read(&path) {
            Err(FrontendError::Format { file, message }) => {
                assert_eq!(file, path);
                assert!(!message.is_empty());
            }
            Err(other) => panic!("cut at {len}: expected a format error, got {other}"),
            Ok(_) => panic!("a GGUF cut to {len} of {} bytes was accepted", bytes.len()),
        }
    }
}

/// Writes `bytes` and returns the format error message reading it gives.
fn format_error_of(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    let err = gguf::read(&path).expect_err(name);
    assert!(err.to_string().contains(name), "the error names the file: {err}");
    format_message(err)
}

#[test]
fn malformed_headers_give_clean_errors() {
    let dir = scratch_dir("malformed");
    let garbage: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    assert!(format_error_of(&dir, "garbage.gguf", &garbage).contains("not a GGUF file"));

    let header = |version: u32, tensors: u64, kvs: u64| {
        let mut h = b"GGUF".to_vec();
        h.extend_from_slice(&version.to_le_bytes());
        h.extend_from_slice(&tensors.to_le_bytes());
        h.extend_from_slice(&kvs.to_le_bytes());
        h
    };
    assert!(format_error_of(&dir, "v1.gguf", &header(1, 0, 0)).contains("version 1"));
    assert!(format_error_of(&dir, "be.gguf", &header(3u32.swap_bytes(), 0, 0)).contains("big-endian"));
    assert!(format_error_of(&dir, "v9.gguf", &header(9, 0, 0)).contains("unknown GGUF version 9"));
    assert!(format_error_of(&dir, "many-tensors.gguf", &header(3, u64::MAX, 0)).contains("tensor entries"));
    assert!(format_error_of(&dir, "many-kvs.gguf", &header(3, 0, 1 << 40)).contains("metadata entries"));

    // One metadata entry whose key claims to be 2^62 bytes long (over the bound on strings), and
    // one claiming 1 MiB (under it, but past the end of the file).
    let mut long_key = header(3, 0, 1);
    long_key.extend_from_slice(&(1u64 << 62).to_le_bytes());
    long_key.extend_from_slice(&[0; 32]);
    assert!(format_error_of(&dir, "long-key.gguf", &long_key).contains("longer than the"));
    let mut past_end = header(3, 0, 1);
    past_end.extend_from_slice(&(1u64 << 20).to_le_bytes());
    past_end.extend_from_slice(&[0; 32]);
    assert!(format_error_of(&dir, "past-end.gguf", &past_end).contains("runs past the end"));

    // Array values claiming 2^20 strings (more than the file holds) and 2^60 (more than anyone).
    let array_header = |count: u64| {
        let mut bytes = header(3, 0, 1);
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.push(b'a');
        bytes.extend_from_slice(&9u32.to_le_bytes());
        bytes.extend_from_slice(&8u32.to_le_bytes());
        bytes.extend_from_slice(&count.to_le_bytes());
        bytes.extend_from_slice(&[0; 64]);
        bytes
    };
    let message = format_error_of(&dir, "long-array.gguf", &array_header(1 << 20));
    assert!(message.contains("metadata entry 0 (a)") && message.contains("1048576 array elements"), "{message}");
    let message = format_error_of(&dir, "huge-array.gguf", &array_header(1 << 60));
    assert!(message.contains("metadata entry 0 (a)") && message.contains("more than the 16777216"), "{message}");

    let mut bad_bool = header(3, 0, 1);
    bad_bool.extend_from_slice(&1u64.to_le_bytes());
    bad_bool.push(b'b');
    bad_bool.extend_from_slice(&7u32.to_le_bytes());
    bad_bool.push(2);
    assert!(format_error_of(&dir, "bad-bool.gguf", &bad_bool).contains("neither 0 nor 1"));

    let mut bad_type = header(3, 0, 1);
    bad_type.extend_from_slice(&1u64.to_le_bytes());
    bad_type.push(b'c');
    bad_type.extend_from_slice(&13u32.to_le_bytes());
    assert!(format_error_of(&dir, "bad-type.gguf", &bad_type).contains("unknown value type 13"));
}

#[test]
fn malformed_tensor_directories_give_errors_naming_the_tensor() {
    let dir = scratch_dir("malformed_tensors");
    let tensor =
        |name: &str, dims: &[u64], ggml_type: u32, data: Vec<u8>| GgufWriter::new().tensor(name, dims, ggml_type, data);
    let cases: [(&str, GgufWriter, &str); 6] = [
        ("ragged.gguf", tensor("w", &[48, 2], Q8_0, vec![0; 100]), "not whole 32-element blocks"),
        ("zero-dim.gguf", tensor("w", &[0, 2], F32, vec![]), "a dimension is 0"),
        ("five-dims.gguf", tensor("w", &[1, 1, 1, 1, 1], F32, vec![0; 4]), "5 dimensions"),
        ("huge-dims.gguf", tensor("w", &[1 << 40, 1 << 40], F32, vec![0; 4]), "more elements than"),
        ("duplicate.gguf", tensor("w", &[8], F32, vec![0; 32]).tensor("w", &[8], F32, vec![0; 32]), "appears twice"),
        (
            "bad-alignment.gguf",
            tensor("w", &[8], F32, vec![0; 32]).kv("general.alignment", Value::U32(24)),
            "power of two",
        ),
    ];
    for (name, writer, expected) in cases {
        let message = format_error_of(&dir, name, &writer.to_bytes());
        assert!(message.contains(expected), "{name}: {message}");
        if !name.starts_with("bad-alignment") {
            assert!(message.contains("tensor w"), "{name}: {message}");
        }
    }

    // Data running past the end of the file: cut the last tensor short.
    let mut bytes = tensor("w", &[8, 4], F32, vec![0; 128]).to_bytes();
    bytes.truncate(bytes.len() - 4);
    let message = format_error_of(&dir, "short-data.gguf", &bytes);
    assert!(message.contains("tensor w (F32 [8, 4])") && message.contains("runs past the end"), "{message}");

    // An offset that is not a multiple of the alignment: rewrite the second tensor's offset field.
    let writer = tensor("a", &[8], F32, vec![0; 32]).tensor("b", &[8], F32, vec![0; 32]);
    let mut bytes = writer.to_bytes();
    let offset_field =
        bytes.windows(9).position(|w| w == b"\x01\x00\x00\x00\x00\x00\x00\x00b").unwrap() + 9 + 4 + 8 + 4;
    bytes[offset_field..offset_field + 8].copy_from_slice(&4u64.to_le_bytes());
    let message = format_error_of(&dir, "misaligned.gguf", &bytes);
    assert!(message.contains("tensor b") && message.contains("not a multiple of the alignment 32"), "{message}");
}

/// A byte-level BPE vocabulary small enough to reason about: "hello" merges to one token,
/// " world" is stored as raw text (with a space, not `Ġ`) and must be respelled.
fn tiny_tokenizer(writer: GgufWriter) -> GgufWriter {
    let tokens = ["<|endoftext|>", "<|im_start|>", "h", "e", "l", "o", "Ġ", "w", "r", "d", "he", "ll", "hell", "hello"]
        .iter()
        .map(|s| s.to_string())
        .chain([" world".to_string(), "Ġw".to_string(), "or".into(), "Ġwor".into(), "ld".into()])
        .collect::<Vec<_>>();
    let mut types = vec![1; tokens.len()];
    types[0] = 3;
    types[1] = 3;
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"];
    writer
        .kv("tokenizer.ggml.model", Value::Str("gpt2".into()))
        .kv("tokenizer.ggml.pre", Value::Str("smollm".into()))
        .kv("tokenizer.ggml.tokens", Value::Strings(tokens))
        .kv("tokenizer.ggml.token_type", Value::I32s(types))
        .kv("tokenizer.ggml.merges", Value::Strings(merges.iter().map(|s| s.to_string()).collect()))
}

#[test]
fn tokenizer_is_rebuilt_from_metadata() {
    let dir = scratch_dir("tokenizer_metadata");
    let (writer, _) = tiny_llama();
    let path = tiny_tokenizer(writer).write(&dir, "tok.gguf");
    let (_, tokenizer) = gguf::read(&path).unwrap();
    let tokenizer = tokenizer.expect("a tokenizer from metadata");
    assert_eq!(tokenizer.source(), path);
    assert_eq!(tokenizer.encode("hello world").unwrap(), [13, 14]);
    assert_eq!(tokenizer.encode("<|im_start|>hello<|endoftext|>").unwrap(), [1, 13, 0]);
    assert_eq!(tokenizer.decode(&[1, 13, 14]).unwrap(), "<|im_start|>hello world");
}

#[test]
fn tokenizer_json_beside_the_file_wins() {
    let dir = scratch_dir("tokenizer_beside");
    let (writer, _) = tiny_llama();
    let path = tiny_tokenizer(writer).write(&dir, "tok.gguf");
    let word_level = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": {"hello": 7, "world": 3}, "unk_token": "hello"}}"#;
    std::fs::write(dir.join("tokenizer.json"), word_level).unwrap();
    let (_, tokenizer) = gguf::read(&path).unwrap();
    let tokenizer = tokenizer.unwrap();
    assert_eq!(tokenizer.source(), dir.join("tokenizer.json"));
    assert_eq!(tokenizer.encode("hello world").unwrap(), [7, 3]);
}

#[test]
fn files_without_tokenizer_metadata_have_no_tokenizer_and_unknown_ones_are_reported() {
    let dir = scratch_dir("tokenizer_absent");
    let (writer, _) = tiny_llama();
    let (_, tokenizer) = gguf::read(&writer.write(&dir, "bare.gguf")).unwrap();
    assert!(tokenizer.is_none());

    let (writer, _) = tiny_llama();
    let writer = writer.kv("tokenizer.ggml.model", Value::Str("llama".into()));
    let problems = invalid_problems(gguf::read(&writer.write(&dir, "spm.gguf")).unwrap_err());
    assert!(problems[0].contains("tokenizer.ggml.model \"llama\"") && problems[0].contains("tokenizer.json"));

    let (writer, _) = tiny_llama();
    let mut writer = tiny_tokenizer(writer);
    for (key, value) in &mut writer.metadata {
        if key == "tokenizer.ggml.pre" {
            *value = Value::Str("mystery".into());
        }
    }
    let problems = invalid_problems(gguf::read(&writer.write(&dir, "mystery.gguf")).unwrap_err());
    assert!(problems[0].contains("tokenizer.ggml.pre \"mystery\""), "{problems:?}");
}

/// Corrupting any byte of the header, metadata or directory (tokenizer included) gives a result
/// or an error, never a panic.
#[test]
fn corrupted_bytes_never_panic() {
    let dir = scratch_dir("corrupted");
    let (writer, _) = tiny_llama();
    let writer = tiny_tokenizer(writer);
    let bytes = writer.to_bytes();
    let (mut bare, _) = tiny_llama();
    bare = tiny_tokenizer(bare);
    bare.tensors.iter_mut().for_each(|t| t.data.clear());
    let directory_len = bare.to_bytes().len();
    let path = dir.join("corrupt.gguf");
    let mut rejected = 0;
    for at in 0..directory_len {
        for corrupt in [0x00, 0xFF, bytes[at] ^ 0x01, bytes[at] ^ 0x80] {
            if corrupt == bytes[at] {
                continue;
            }
            let mut damaged = bytes.clone();
            damaged[at] = corrupt;
            std::fs::write(&path, &damaged).unwrap();
            let outcome = std::panic::catch_unwind(|| gguf::read(&path).is_err());
            match outcome {
                Ok(is_err) => rejected += usize::from(is_err),
                Err(_) => panic!("byte {at} set to {corrupt:#04x}: the frontend panicked"),
            }
        }
    }
    assert!(rejected > directory_len, "most corruptions of the directory are caught ({rejected} were)");
}

#[test]
fn version_2_files_read_like_version_3() {
    let dir = scratch_dir("version2");
    let (mut writer, _) = tiny_llama();
    writer.version = 2;
    let (v2, _) = gguf::read(&writer.write(&dir, "v2.gguf")).expect("GGUF v2 reads");
    let (writer, _) = tiny_llama();
    let (v3, _) = gguf::read(&writer.write(&dir, "v3.gguf")).unwrap();
    assert_eq!(v2.config, v3.config);
    assert!(v2.tensors.iter().zip(&v3.tensors).all(|((a, x), (b, y))| a == b && x.data.bytes() == y.data.bytes()));
}

/// Each `tokenizer.ggml.pre` family transformers knows gets its split regex, and each compiles.
#[test]
fn pre_tokenizer_names_select_their_split() {
    let dir = scratch_dir("pre_tokenizers");
    for pre in ["gpt2", "llama-bpe", "qwen2", "tekken"] {
        let (writer, _) = tiny_llama();
        let mut writer = tiny_tokenizer(writer);
        for (key, value) in &mut writer.metadata {
            if key == "tokenizer.ggml.pre" {
                *value = Value::Str(pre.into());
            }
        }
        let (_, tokenizer) = gguf::read(&writer.write(&dir, &format!("{pre}.gguf"))).unwrap();
        assert_eq!(tokenizer.unwrap().encode("hello world").unwrap(), [13, 14], "{pre}");
    }
}
