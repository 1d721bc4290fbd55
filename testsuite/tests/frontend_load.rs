//! Every Hugging Face fixture loads, lowers to IR that verifies, and the IR has the shape the
//! architecture calls for: one weight per stored tensor (under its Hugging Face name, with its
//! stored shape and dtype), the expected instruction count and op sequence per layer.

use std::collections::BTreeMap;
use std::path::PathBuf;

use waferc::frontend::{load, LoadedModel};
use waferc_ir::{DType, Module, Op, ValueType};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf").join(name)
}

fn load_fixture(name: &str) -> LoadedModel {
    load(&fixture(name)).unwrap_or_else(|e| panic!("{name} does not load: {e}"))
}

/// Name -> (dtype, shape) of every tensor in the fixture's safetensors files.
fn stored_tensors(name: &str) -> BTreeMap<String, (DType, Vec<u64>)> {
    let mut all = BTreeMap::new();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        let file_name = path.file_name().unwrap().to_str().unwrap();
        if !file_name.starts_with("model") || !file_name.ends_with(".safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (tensor, view) in tensors.tensors() {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::BF16 => DType::BF16,
                other => panic!("unexpected fixture dtype {other:?}"),
            };
            all.insert(tensor, (dtype, view.shape().iter().map(|&d| d as u64).collect()));
        }
    }
    all
}

fn op_names(module: &Module, layer: Option<u32>) -> Vec<&'static str> {
    module.body.iter().filter(|(_, i)| i.layer == layer).map(|(_, i)| i.op.name()).collect()
}

fn count_ops(module: &Module, name: &str) -> usize {
    module.body.iter().filter(|(_, i)| i.op.name() == name).count()
}

/// Checks what every fixture shares and returns the module.
fn check_fixture(name: &str, architecture: &str, vocab: u32, layers: u32, per_layer: usize) -> Module {
    let loaded = load_fixture(name);
    assert_eq!(loaded.checkpoint_path, fixture(name));
    let module = loaded.module;
    waferc_ir::verify(&module).unwrap();
    assert_eq!(module.meta.architecture, architecture);
    assert_eq!(module.meta.vocab_size, vocab);
    assert_eq!(module.meta.num_layers, layers);

    let stored = stored_tensors(name);
    let weights: BTreeMap<String, (DType, Vec<u64>)> =
        module.weights.iter().map(|(_, w)| (w.name.clone(), (w.ty.dtype, w.ty.shape.clone()))).collect();
    assert_eq!(weights, stored, "{name}: the module's weights are not exactly the stored tensors");
    for (_, w) in module.weights.iter() {
        let bytes = w.data.bytes().expect("weights are mapped from the checkpoint");
        assert_eq!(bytes.len() as u64, w.ty.bytes().unwrap(), "{}", w.name);
        assert!(w.data.file().is_some(), "{} should be memory-mapped", w.name);
    }

    assert_eq!(module.caches.len(), layers as usize);
    for layer in 0..layers {
        assert_eq!(op_names(&module, Some(layer)).len(), per_layer, "{name}: layer {layer}");
    }
    assert_eq!(op_names(&module, None), ["embed", "rms_norm", "matvec"]);
    assert_eq!(module.body.len(), 3 + per_layer * layers as usize);
    let output = module.output.unwrap();
    assert_eq!(module.value_type(output), &ValueType::Tensor(waferc_ir::TensorType::f32([vocab as u64])));
    module
}

const DENSE_LAYER: [&str; 16] = [
    "rms_norm",
    "matvec",
    "matvec",
    "matvec",
    "rope",
    "rope",
    "attention",
    "matvec",
    "add",
    "rms_norm",
    "matvec",
    "silu",
    "matvec",
    "mul",
    "matvec",
    "add",
];

/// The head's matvec reads this weight.
fn head_weight(module: &Module) -> &str {
    match &module.body[module.output.unwrap()].op {
        Op::MatVec { weight, .. } => &module.weights[*weight].name,
        other => panic!("the output is {}, not a matvec", other.name()),
    }
}

#[test]
fn llama_tied_embeddings() {
    let module = check_fixture("llama-tiny-tok", "llama", 49152, 2, 16);
    assert_eq!(op_names(&module, Some(0)), DENSE_LAYER);
    assert_eq!(head_weight(&module), "model.embed_tokens.weight");
    assert_eq!(module.meta.bos_token_id, Some(1));
    assert_eq!(module.meta.eos_token_ids, [2]);
    let attention = module.body.iter().find_map(|(_, i)| match &i.op {
        Op::Attention { heads, scale, cache, .. } => Some((*heads, *scale, module.caches[*cache].clone())),
        _ => None,
    });
    let (heads, scale, cache) = attention.unwrap();
    assert_eq!((heads, scale), (4, 0.25));
    assert_eq!((cache.layer, cache.kv_heads, cache.head_dim), (0, 2, 16));
}

#[test]
fn llama31_bf16_gqa_rope_scaling() {
    let module = check_fixture("llama31-gqa-bf16", "llama", 512, 3, 16);
    assert_eq!(head_weight(&module), "lm_head.weight");
    assert!(module.weights.iter().all(|(_, w)| w.ty.dtype == DType::BF16));
    let rope = module.body.iter().find_map(|(_, i)| match &i.op {
        Op::Rope { rope, head_dim, .. } => Some((rope.clone(), *head_dim)),
        _ => None,
    });
    let (rope, head_dim) = rope.unwrap();
    assert_eq!(head_dim, 16);
    assert_eq!(rope.theta, 500000.0);
    assert_eq!(
        rope.scaling,
        waferc_ir::RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64
        }
    );
    let heads: Vec<(u32, u32)> = module
        .body
        .iter()
        .filter_map(|(_, i)| match &i.op {
            Op::Attention { heads, cache, .. } => Some((*heads, module.caches[*cache].kv_heads)),
            _ => None,
        })
        .collect();
    assert_eq!(heads, [(6, 2); 3]);
}

#[test]
fn qwen2_biases() {
    let module = check_fixture("qwen2-bias", "qwen2", 512, 2, 16);
    let biased: Vec<&str> = module
        .body
        .iter()
        .filter_map(|(_, i)| match &i.op {
            Op::MatVec { bias: Some(b), .. } if i.layer == Some(0) => Some(module.weights[*b].name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        biased,
        [
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.self_attn.v_proj.bias"
        ]
    );
    assert_eq!(module.meta.bos_token_id, None);
    assert!(module.meta.eos_token_ids.is_empty());
}

#[test]
fn qwen3_per_head_qk_norm() {
    let module = check_fixture("qwen3-dense", "qwen3", 512, 2, 18);
    let mut expected = DENSE_LAYER.to_vec();
    expected.splice(4..4, ["rms_norm", "rms_norm"]);
    assert_eq!(op_names(&module, Some(1)), expected);
    // The q norm's weight is one head wide and normalises the 4 x 32 query heads one by one.
    let norms: Vec<(String, u64, u64)> = module
        .body
        .iter()
        .filter_map(|(_, i)| match &i.op {
            Op::RmsNorm { x, weight, .. } if i.layer == Some(0) => {
                let w = &module.weights[*weight];
                Some((w.name.clone(), w.ty.shape[0], module.value_type(*x).tensor().unwrap().shape[0]))
            }
            _ => None,
        })
        .collect();
    assert_eq!(norms[1], ("model.layers.0.self_attn.q_norm.weight".to_string(), 32, 128));
    assert_eq!(norms[2], ("model.layers.0.self_attn.k_norm.weight".to_string(), 32, 64));
    assert_eq!(head_weight(&module), "model.embed_tokens.weight");
}

/// MoE layers: the router, one dispatch + gated MLP per expert, then the combine.
fn moe_layer(experts: usize, qk_norm: bool) -> Vec<&'static str> {
    let mut ops = DENSE_LAYER[..10].to_vec();
    if qk_norm {
        ops.splice(4..4, ["rms_norm", "rms_norm"]);
    }
    ops.extend(["matvec", "router_topk"]);
    for _ in 0..experts {
        ops.extend(["expert_dispatch", "matvec", "silu", "matvec", "mul", "matvec"]);
    }
    ops.extend(["expert_combine", "add"]);
    ops
}

fn routers(module: &Module) -> Vec<(String, u32, bool)> {
    module
        .body
        .iter()
        .filter_map(|(_, i)| match &i.op {
            Op::RouterTopK { logits, top_k, normalize } => match &module.body[*logits].op {
                Op::MatVec { weight, .. } => Some((module.weights[*weight].name.clone(), *top_k, *normalize)),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// The weights of expert `e`'s gated MLP in layer 0, in gate, up, down order.
fn expert_weights(module: &Module, expert: u32) -> Vec<String> {
    let dispatch = module
        .body
        .iter()
        .position(|(_, i)| matches!(i.op, Op::ExpertDispatch { expert: e, .. } if e == expert))
        .unwrap();
    module
        .body
        .iter()
        .skip(dispatch + 1)
        .take(5)
        .filter_map(|(_, i)| match &i.op {
            Op::MatVec { weight, .. } => Some(module.weights[*weight].name.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn mixtral_moe() {
    let module = check_fixture("mixtral-tiny", "mixtral", 512, 2, moe_layer(8, false).len());
    assert_eq!(op_names(&module, Some(0)), moe_layer(8, false));
    assert_eq!(
        routers(&module),
        [
            ("model.layers.0.block_sparse_moe.gate.weight".to_string(), 2, true),
            ("model.layers.1.block_sparse_moe.gate.weight".to_string(), 2, true)
        ]
    );
    let prefix = "model.layers.0.block_sparse_moe.experts.3";
    assert_eq!(
        expert_weights(&module, 3),
        [format!("{prefix}.w1.weight"), format!("{prefix}.w3.weight"), format!("{prefix}.w2.weight")]
    );
}

#[test]
fn qwen3_moe() {
    let module = check_fixture("qwen3-moe-tiny", "qwen3_moe", 512, 2, moe_layer(16, true).len());
    assert_eq!(op_names(&module, Some(1)), moe_layer(16, true));
    assert_eq!(routers(&module)[0], ("model.layers.0.mlp.gate.weight".to_string(), 4, true));
    let prefix = "model.layers.0.mlp.experts.15";
    assert_eq!(
        expert_weights(&module, 15),
        [
            format!("{prefix}.gate_proj.weight"),
            format!("{prefix}.up_proj.weight"),
            format!("{prefix}.down_proj.weight")
        ]
    );
    assert_eq!(count_ops(&module, "expert_combine"), 2);
}

#[test]
fn mixtral_sharded_bf16_mqa() {
    let module = check_fixture("mixtral-sharded-bf16", "mixtral", 512, 3, moe_layer(4, false).len());
    let shards: std::collections::BTreeSet<String> = module
        .weights
        .iter()
        .map(|(_, w)| w.data.file().unwrap().file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(shards.len(), 8, "weights come from all eight shards: {shards:?}");
    assert!(module.caches.iter().all(|(_, c)| c.kv_heads == 1 && c.head_dim == 16));
}

#[test]
fn tokenizer_matches_transformers() {
    let loaded = load_fixture("llama-tiny-tok");
    let tokenizer = loaded.tokenizer.expect("llama-tiny-tok ships tokenizer.json");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("llama-tiny-tok").join("golden.json")).unwrap()).unwrap();
    let cases = golden["tokenizer"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let ids: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|id| id.as_u64().unwrap() as u32).collect();
        assert_eq!(tokenizer.encode(text).unwrap(), ids, "encoding {text:?}");
        assert_eq!(tokenizer.decode(&ids).unwrap(), text, "decoding {ids:?}");
    }
    assert_eq!(tokenizer.vocab_size(), 49152);
    assert_eq!(tokenizer.token_id("<|im_end|>"), Some(2));
}

#[test]
fn fixtures_without_tokenizer_json_have_none() {
    assert!(load_fixture("qwen2-bias").tokenizer.is_none());
}

/// gpt-oss in both layouts: windowed attention with sinks on the sliding layers (0 and 2),
/// full attention with sinks on the others, YaRN rope, a biased router and eight experts of
/// `matvec, matvec, swiglu, matvec` with biases; the release layout's expert matrices stay MXFP4
/// (the same values as the bf16 layout's). The printed IR parses back to the same text.
#[test]
fn gpt_oss_layouts_lower_alike() {
    let mut printed = Vec::new();
    for (name, expert_dtype) in [("gpt-oss-tiny-bf16", DType::BF16), ("gpt-oss-tiny-mxfp4", DType::Mxfp4)] {
        let module = load_fixture(name).module;
        let attention: Vec<(Option<u32>, bool)> = module
            .body
            .iter()
            .filter_map(|(_, i)| match i.op {
                Op::Attention { window, sinks, .. } => Some((window, sinks.is_some())),
                _ => None,
            })
            .collect();
        assert_eq!(attention, [(Some(8), true), (None, true), (Some(8), true), (None, true)], "{name}");
        assert_eq!(module.body.iter().filter(|(_, i)| i.op.name() == "swiglu").count(), 4 * 8, "{name}");
        let gate = module.weight_by_name("model.layers.3.mlp.experts.5.gate_proj.weight").unwrap();
        assert_eq!(module.weights[gate].ty, waferc_ir::TensorType::new(expert_dtype, [64, 64]), "{name}");
        let text = waferc_ir::text::print(&module);
        assert!(
            text.contains("scaling=yarn factor=32.0 beta_fast=32.0 beta_slow=1.0 original_max_position=64"),
            "{text}"
        );
        let parsed = waferc_ir::text::parse(&text).unwrap();
        assert_eq!(waferc_ir::text::print(&parsed), text, "{name}: text round trip");
        printed.push(text.replace("mxfp4[", "bf16["));
    }
    assert_eq!(printed[0], printed[1], "the two layouts lower to the same program");
}
