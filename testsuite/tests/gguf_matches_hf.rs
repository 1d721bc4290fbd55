//! A Hugging Face checkpoint converted to GGUF the way llama.cpp's `convert_hf_to_gguf.py` does
//! (llama metadata keys, GGUF tensor names, dimensions innermost first, q/k rows permuted into
//! llama.cpp's rotary order) reads back into the very module the Hugging Face directory gives:
//! same printed IR, same weight bytes.

mod gguf_writer;

use std::path::PathBuf;

use gguf_writer::{scratch_dir, GgufWriter, Value, F32};
use waferc::frontend::{gguf, load, lower};
use waferc_ir::text::print;

fn hf_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf").join(name)
}

/// llama.cpp's `LlamaModel.permute`: `w.reshape(n_head, 2, rows / n_head / 2, K).swapaxes(1, 2)`,
/// so GGUF row (h, i, j) is Hugging Face row (h, j, i).
fn llama_cpp_permute(rows: &[u8], n_rows: usize, heads: usize) -> Vec<u8> {
    let row_len = rows.len() / n_rows;
    let half = n_rows / heads / 2;
    let mut out = Vec::with_capacity(rows.len());
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let hf_row = h * 2 * half + j * half + i;
                out.extend_from_slice(&rows[hf_row * row_len..(hf_row + 1) * row_len]);
            }
        }
    }
    out
}

/// The GGUF name llama.cpp gives a Hugging Face llama tensor.
fn gguf_name(hf: &str) -> String {
    let whole = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = whole.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").expect("a layer tensor");
    let (layer, part) = rest.split_once('.').unwrap();
    let part = match part {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{layer}.{part}")
}

#[test]
fn converted_llama_lowers_to_the_same_module_as_its_hugging_face_directory() {
    let dir = hf_fixture("llama-tiny-tok");
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let int = |key: &str| config[key].as_u64().unwrap_or_else(|| panic!("config {key}")) as u32;
    let (heads, kv_heads) = (int("num_attention_heads"), int("num_key_value_heads"));

    let mut writer = GgufWriter::new()
        .kv("general.architecture", Value::Str("llama".into()))
        .kv("llama.context_length", Value::U32(int("max_position_embeddings")))
        .kv("llama.embedding_length", Value::U32(int("hidden_size")))
        .kv("llama.block_count", Value::U32(int("num_hidden_layers")))
        .kv("llama.feed_forward_length", Value::U32(int("intermediate_size")))
        .kv("llama.attention.head_count", Value::U32(heads))
        .kv("llama.attention.head_count_kv", Value::U32(kv_heads))
        .kv("llama.attention.key_length", Value::U32(int("head_dim")))
        .kv("llama.attention.value_length", Value::U32(int("head_dim")))
        .kv("llama.rope.dimension_count", Value::U32(int("head_dim")))
        .kv("llama.rope.freq_base", Value::F32(config["rope_theta"].as_f64().unwrap() as f32))
        .kv("llama.attention.layer_norm_rms_epsilon", Value::F32(config["rms_norm_eps"].as_f64().unwrap() as f32))
        .kv("llama.vocab_size", Value::U32(int("vocab_size")))
        .kv("tokenizer.ggml.bos_token_id", Value::U32(int("bos_token_id")))
        .kv("tokenizer.ggml.eos_token_id", Value::U32(int("eos_token_id")));
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = tensors.names();
    names.sort();
    for name in names {
        let view = tensors.tensor(name).unwrap();
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
        let shape: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
        let data = match name {
            n if n.ends_with("q_proj.weight") => llama_cpp_permute(view.data(), shape[0] as usize, heads as usize),
            n if n.ends_with("k_proj.weight") => llama_cpp_permute(view.data(), shape[0] as usize, kv_heads as usize),
            _ => view.data().to_vec(),
        };
        let dims: Vec<u64> = shape.iter().rev().copied().collect();
        writer = writer.tensor(&gguf_name(name), &dims, F32, data);
    }
    let path = writer.write(&scratch_dir("matches_hf"), "llama-tiny.gguf");

    let (checkpoint, _) = gguf::read(&path).unwrap();
    let from_gguf = lower(&checkpoint).unwrap();
    let from_hf = load(&dir).unwrap().module;
    assert_eq!(print(&from_gguf), print(&from_hf));
    let weights = |m: &waferc_ir::Module| -> Vec<(String, Vec<u8>)> {
        m.weights.iter().map(|(_, w)| (w.name.clone(), w.data.bytes().unwrap().to_vec())).collect()
    };
    let (gguf_weights, hf_weights) = (weights(&from_gguf), weights(&from_hf));
    assert_eq!(gguf_weights.len(), hf_weights.len());
    for ((name, a), (_, b)) in gguf_weights.iter().zip(&hf_weights) {
        assert!(a == b, "{name}: bytes differ between the GGUF and the Hugging Face checkpoint");
    }
}
