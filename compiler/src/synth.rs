//! `waferc synth`: writes a checkpoint directory of a known shape in the Hugging Face layout
//! (config.json + safetensors, sharded with an index above one shard's size), so the compiler can
//! be exercised at full scale without downloading weights.
//!
//! With `shape_only`, each safetensors file is a real header followed by a sparse hole of the
//! right length: an 8B-shaped checkpoint costs no disk, and the frontend (which maps files and
//! never reads weights it is not asked for) compiles it without touching the data.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Value as Json};

/// Above this many bytes of tensor data, the checkpoint is split into shards with an index.
const SHARD_BYTES: u64 = 4 << 30;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown preset `{0}` (known: {known})", known = Preset::NAMES.join(", "))]
    UnknownPreset(String),
    #[error("{}: already exists; synth writes a new directory", .0.display())]
    Exists(PathBuf),
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SynthError + '_ {
    move |source| SynthError::Io { path: path.to_path_buf(), source }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Llama,
    Mixtral,
    Qwen3Moe,
    /// gpt-oss in its release layout: MXFP4 experts (`_blocks`/`_scales`), biases, sinks,
    /// alternating sliding (128) and full attention, YaRN rope.
    GptOss,
}

/// The shape of a synthetic checkpoint.
#[derive(Clone, Debug)]
pub struct Preset {
    pub name: &'static str,
    family: Family,
    vocab: u64,
    hidden: u64,
    ffn: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    experts: u64,
    top_k: u64,
    tied: bool,
    bf16: bool,
    rope_theta: f64,
    llama3_rope: bool,
}

impl Preset {
    pub const NAMES: [&'static str; 9] = [
        "gpt-oss-20b",
        "gpt-oss-120b",
        "llama3.1-8b",
        "llama3.1-70b",
        "mixtral-8x7b",
        "qwen3-30b-a3b",
        "tiny-llama",
        "tiny-mixtral",
        "tiny-qwen3-moe",
    ];

    pub fn by_name(name: &str) -> Result<Preset, SynthError> {
        let dense = |name, vocab, hidden, ffn, layers, heads, kv_heads| Preset {
            name,
            family: Family::Llama,
            vocab,
            hidden,
            ffn,
            layers,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            experts: 0,
            top_k: 0,
            tied: false,
            bf16: true,
            rope_theta: 500000.0,
            llama3_rope: true,
        };
        Ok(match name {
            "llama3.1-8b" => dense("llama3.1-8b", 128256, 4096, 14336, 32, 32, 8),
            "llama3.1-70b" => dense("llama3.1-70b", 128256, 8192, 28672, 80, 64, 8),
            "mixtral-8x7b" => Preset {
                family: Family::Mixtral,
                experts: 8,
                top_k: 2,
                rope_theta: 1e6,
                llama3_rope: false,
                ..dense("mixtral-8x7b", 32000, 4096, 14336, 32, 32, 8)
            },
            "qwen3-30b-a3b" => Preset {
                family: Family::Qwen3Moe,
                head_dim: 128,
                experts: 128,
                top_k: 8,
                rope_theta: 1e6,
                llama3_rope: false,
                ..dense("qwen3-30b-a3b", 151936, 2048, 768, 48, 32, 4)
            },
            // openai/gpt-oss-20b and -120b's config.json.
            "gpt-oss-20b" | "gpt-oss-120b" => Preset {
                family: Family::GptOss,
                head_dim: 64,
                experts: if name == "gpt-oss-20b" { 32 } else { 128 },
                top_k: 4,
                rope_theta: 150000.0,
                llama3_rope: false,
                ..dense(
                    if name == "gpt-oss-20b" { "gpt-oss-20b" } else { "gpt-oss-120b" },
                    201088,
                    2880,
                    2880,
                    if name == "gpt-oss-20b" { 24 } else { 36 },
                    64,
                    8,
                )
            },
            "tiny-llama" => Preset { tied: true, bf16: false, ..dense("tiny-llama", 256, 64, 128, 2, 4, 2) },
            "tiny-mixtral" => Preset {
                family: Family::Mixtral,
                experts: 8,
                top_k: 2,
                bf16: false,
                rope_theta: 1e6,
                llama3_rope: false,
                ..dense("tiny-mixtral", 256, 64, 96, 2, 4, 2)
            },
            "tiny-qwen3-moe" => Preset {
                family: Family::Qwen3Moe,
                head_dim: 32,
                experts: 8,
                top_k: 2,
                bf16: false,
                rope_theta: 1e6,
                llama3_rope: false,
                ..dense("tiny-qwen3-moe", 256, 64, 48, 2, 4, 2)
            },
            other => return Err(SynthError::UnknownPreset(other.to_string())),
        })
    }

    fn config(&self) -> Json {
        let mut c = json!({
            "architectures": [match self.family {
                Family::Llama => "LlamaForCausalLM",
                Family::Mixtral => "MixtralForCausalLM",
                Family::Qwen3Moe => "Qwen3MoeForCausalLM",
                Family::GptOss => "GptOssForCausalLM",
            }],
            "model_type": match self.family {
                Family::Llama => "llama",
                Family::Mixtral => "mixtral",
                Family::Qwen3Moe => "qwen3_moe",
                Family::GptOss => "gpt_oss",
            },
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": self.tied,
            "torch_dtype": if self.bf16 { "bfloat16" } else { "float32" },
            "bos_token_id": 1,
            "eos_token_id": 2,
        });
        if self.llama3_rope {
            c["rope_scaling"] = json!({
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192
            });
        }
        match self.family {
            Family::Llama => {}
            Family::Mixtral => {
                c["num_local_experts"] = json!(self.experts);
                c["num_experts_per_tok"] = json!(self.top_k);
            }
            Family::Qwen3Moe => {
                c["num_experts"] = json!(self.experts);
                c["num_experts_per_tok"] = json!(self.top_k);
                c["moe_intermediate_size"] = json!(self.ffn);
                c["norm_topk_prob"] = json!(true);
                c["decoder_sparse_step"] = json!(1);
                c["mlp_only_layers"] = json!([]);
            }
            Family::GptOss => {
                c["num_local_experts"] = json!(self.experts);
                c["num_experts_per_tok"] = json!(self.top_k);
                c["experts_per_token"] = json!(self.top_k);
                c["attention_bias"] = json!(true);
                c["sliding_window"] = json!(128);
                let types: Vec<&str> =
                    (0..self.layers).map(|l| if l % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect();
                c["layer_types"] = json!(types);
                c["swiglu_alpha"] = json!(1.702);
                c["swiglu_limit"] = json!(7.0);
                c["initial_context_length"] = json!(4096);
                c["rope_scaling"] = json!({
                    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "original_max_position_embeddings": 4096, "truncate": false
                });
                c["quantization_config"] = json!({"quant_method": "mxfp4", "modules_to_not_convert":
                    ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]});
                c["bos_token_id"] = json!(199998);
                c["eos_token_id"] = json!(200002);
            }
        }
        c
    }

    /// Every tensor in Hugging Face naming, in checkpoint order, with its shape.
    fn tensors(&self) -> Vec<(String, Vec<u64>)> {
        let (h, q, kv) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            t.push((format!("{p}.input_layernorm.weight"), vec![h]));
            t.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
            t.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
            t.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
            t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            if self.family == Family::GptOss {
                t.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
                t.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
                t.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
                t.push((format!("{p}.self_attn.o_proj.bias"), vec![h]));
                t.push((format!("{p}.self_attn.sinks"), vec![self.heads]));
            }
            if self.family == Family::Qwen3Moe {
                t.push((format!("{p}.self_attn.q_norm.weight"), vec![self.head_dim]));
                t.push((format!("{p}.self_attn.k_norm.weight"), vec![self.head_dim]));
            }
            t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            let f = self.ffn;
            match self.family {
                Family::Llama => {
                    t.push((format!("{p}.mlp.gate_proj.weight"), vec![f, h]));
                    t.push((format!("{p}.mlp.up_proj.weight"), vec![f, h]));
                    t.push((format!("{p}.mlp.down_proj.weight"), vec![h, f]));
                }
                Family::Mixtral => {
                    t.push((format!("{p}.block_sparse_moe.gate.weight"), vec![self.experts, h]));
                    for e in 0..self.experts {
                        let ep = format!("{p}.block_sparse_moe.experts.{e}");
                        t.push((format!("{ep}.w1.weight"), vec![f, h]));
                        t.push((format!("{ep}.w2.weight"), vec![h, f]));
                        t.push((format!("{ep}.w3.weight"), vec![f, h]));
                    }
                }
                Family::GptOss => {
                    let (e, ep) = (self.experts, format!("{p}.mlp.experts"));
                    t.push((format!("{p}.mlp.router.weight"), vec![e, h]));
                    t.push((format!("{p}.mlp.router.bias"), vec![e]));
                    t.push((format!("{ep}.gate_up_proj_blocks"), vec![e, 2 * f, h / 32, 16]));
                    t.push((format!("{ep}.gate_up_proj_scales"), vec![e, 2 * f, h / 32]));
                    t.push((format!("{ep}.gate_up_proj_bias"), vec![e, 2 * f]));
                    t.push((format!("{ep}.down_proj_blocks"), vec![e, h, f / 32, 16]));
                    t.push((format!("{ep}.down_proj_scales"), vec![e, h, f / 32]));
                    t.push((format!("{ep}.down_proj_bias"), vec![e, h]));
                }
                Family::Qwen3Moe => {
                    t.push((format!("{p}.mlp.gate.weight"), vec![self.experts, h]));
                    for e in 0..self.experts {
                        let ep = format!("{p}.mlp.experts.{e}");
                        t.push((format!("{ep}.gate_proj.weight"), vec![f, h]));
                        t.push((format!("{ep}.up_proj.weight"), vec![f, h]));
                        t.push((format!("{ep}.down_proj.weight"), vec![h, f]));
                    }
                }
            }
        }
        t.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tied {
            t.push(("lm_head.weight".to_string(), vec![self.vocab, h]));
        }
        t
    }

    /// A tensor's safetensors dtype and element bytes: MXFP4 blocks and scales are bytes.
    fn stored(&self, name: &str) -> (&'static str, u64) {
        if name.ends_with("_blocks") || name.ends_with("_scales") {
            ("U8", 1)
        } else if self.bf16 {
            ("BF16", 2)
        } else {
            ("F32", 4)
        }
    }
}

/// What `synth` wrote.
#[derive(Debug)]
pub struct SynthReport {
    pub files: Vec<PathBuf>,
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
}

/// Writes the preset's checkpoint into `dir`, which must not exist yet. The directory appears
/// whole or not at all: everything is written into a sibling temporary directory, then renamed.
pub fn synth(preset: &Preset, dir: &Path, shape_only: bool) -> Result<SynthReport, SynthError> {
    if dir.exists() {
        return Err(SynthError::Exists(dir.to_path_buf()));
    }
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    let staging = parent.join(format!(
        ".{}.synth-{}",
        dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        std::process::id()
    ));
    let result = write_into(preset, &staging, shape_only);
    match result {
        Ok(mut report) => {
            std::fs::rename(&staging, dir).map_err(io_err(dir))?;
            for f in &mut report.files {
                *f = dir.join(f.file_name().expect("synth writes plain file names"));
            }
            Ok(report)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            Err(e)
        }
    }
}

fn write_into(preset: &Preset, dir: &Path, shape_only: bool) -> Result<SynthReport, SynthError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let config_path = dir.join("config.json");
    let config = serde_json::to_string_pretty(&preset.config()).expect("a json! value serialises");
    std::fs::write(&config_path, config + "\n").map_err(io_err(&config_path))?;

    let tensors = preset.tensors();
    let mut shards: Vec<Vec<(String, Vec<u64>)>> = vec![vec![]];
    let mut shard_bytes = 0u64;
    for (name, shape) in &tensors {
        let bytes = shape.iter().product::<u64>() * preset.stored(name).1;
        if shard_bytes > 0 && shard_bytes + bytes > SHARD_BYTES {
            shards.push(vec![]);
            shard_bytes = 0;
        }
        shard_bytes += bytes;
        shards.last_mut().expect("at least one shard").push((name.clone(), shape.clone()));
    }

    let mut report = SynthReport { files: vec![config_path], tensors: tensors.len(), parameters: 0, bytes: 0 };
    let mut rng = SplitMix64(0x5eed_0000 ^ preset.name.len() as u64);
    let mut weight_map = BTreeMap::new();
    let count = shards.len();
    for (i, shard) in shards.iter().enumerate() {
        let file_name = if count == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", i + 1)
        };
        let path = dir.join(&file_name);
        let bytes = write_safetensors(&path, shard, preset, shape_only, &mut rng)?;
        for (name, shape) in shard {
            weight_map.insert(name.clone(), file_name.clone());
            report.parameters += shape.iter().product::<u64>();
        }
        report.bytes += bytes;
        report.files.push(path);
    }
    if count > 1 {
        let index_path = dir.join("model.safetensors.index.json");
        let index = json!({ "metadata": { "total_size": report.bytes }, "weight_map": weight_map });
        std::fs::write(&index_path, serde_json::to_string_pretty(&index).expect("json") + "\n")
            .map_err(io_err(&index_path))?;
        report.files.push(index_path);
    }
    Ok(report)
}

/// Writes one safetensors file; returns its tensor-data bytes.
fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<u64>)],
    preset: &Preset,
    shape_only: bool,
    rng: &mut SplitMix64,
) -> Result<u64, SynthError> {
    let mut header = serde_json::Map::new();
    let mut metadata = json!({ "format": "pt" });
    if shape_only {
        metadata[crate::frontend::safetensors::SHAPE_ONLY_KEY] = json!("true");
    }
    header.insert("__metadata__".into(), metadata);
    let mut offset = 0u64;
    for (name, shape) in tensors {
        let (dtype, elem) = preset.stored(name);
        let bytes = shape.iter().product::<u64>() * elem;
        header.insert(
            name.clone(),
            json!({
                "dtype": dtype,
                "shape": shape,
                "data_offsets": [offset, offset + bytes],
            }),
        );
        offset += bytes;
    }
    let mut header_text = serde_json::to_string(&header).expect("json");
    // The data section starts 8-aligned, as the safetensors writer pads it.
    while !(8 + header_text.len()).is_multiple_of(8) {
        header_text.push(' ');
    }
    let file = File::create(path).map_err(io_err(path))?;
    let mut out = BufWriter::new(file);
    out.write_all(&(header_text.len() as u64).to_le_bytes()).map_err(io_err(path))?;
    out.write_all(header_text.as_bytes()).map_err(io_err(path))?;
    if shape_only {
        let file = out.into_inner().map_err(|e| io_err(path)(e.into_error()))?;
        file.set_len(8 + header_text.len() as u64 + offset).map_err(io_err(path))?;
        return Ok(offset);
    }
    for (name, shape) in tensors {
        let n = shape.iter().product::<u64>();
        let is_norm = name.ends_with("norm.weight");
        // Small random weights keep activations in range through the layers; norm weights sit
        // near 1 but not at 1, so a skipped norm changes the output.
        let scale = 1.0 / (shape.last().copied().unwrap_or(1) as f32).sqrt();
        if name.ends_with("_blocks") || name.ends_with("_scales") {
            // Random e2m1 codes; scales 2^-8 or 2^-7, so weights stay below ~0.05 like the others.
            let is_scale = name.ends_with("_scales");
            let bytes: Vec<u8> =
                (0..n).map(|_| if is_scale { 119 + (rng.next() & 1) as u8 } else { rng.next() as u8 }).collect();
            out.write_all(&bytes).map_err(io_err(path))?;
            continue;
        }
        for _ in 0..n {
            let u = rng.next_unit() * 2.0 - 1.0;
            let v = if is_norm { 1.0 + 0.1 * u } else { u * scale * 1.7 };
            if preset.bf16 {
                out.write_all(&half::bf16::from_f32(v).to_le_bytes()).map_err(io_err(path))?;
            } else {
                out.write_all(&v.to_le_bytes()).map_err(io_err(path))?;
            }
        }
    }
    out.flush().map_err(io_err(path))?;
    Ok(offset)
}

/// A tiny deterministic generator: synthetic weights must be identical on every machine.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1) with 24 bits of precision.
    fn next_unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_only_llama8b_is_sparse_and_sharded() {
        let tmp = std::env::temp_dir().join(format!("waferc-synth-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let dir = tmp.join("llama8b");
        let report = synth(&Preset::by_name("llama3.1-8b").unwrap(), &dir, true).unwrap();
        assert_eq!(report.parameters, 8_030_261_248);
        assert!(dir.join("model.safetensors.index.json").exists());
        assert!(report.files.len() > 3, "expected several shards: {:?}", report.files);
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn shape_only_checkpoints_load_without_weight_data() {
        let tmp = std::env::temp_dir().join(format!("waferc-synth-shape-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let dir = tmp.join("tiny");
        synth(&Preset::by_name("tiny-mixtral").unwrap(), &dir, true).unwrap();
        let loaded = crate::frontend::load(&dir).unwrap();
        assert!(loaded.module.weights.iter().all(|(_, w)| !w.data.is_present()));
        std::fs::remove_dir_all(&tmp).unwrap();
        synth(&Preset::by_name("tiny-mixtral").unwrap(), &dir, false).unwrap();
        let loaded = crate::frontend::load(&dir).unwrap();
        assert!(loaded.module.weights.iter().all(|(_, w)| w.data.is_present()));
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn existing_directory_is_refused() {
        let tmp = std::env::temp_dir().join(format!("waferc-synth-exists-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let err = synth(&Preset::by_name("tiny-llama").unwrap(), &tmp, false).unwrap_err();
        assert!(matches!(err, SynthError::Exists(_)));
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn unknown_preset_lists_the_known_ones() {
        let err = Preset::by_name("gpt-5").unwrap_err().to_string();
        assert!(err.contains("gpt-5") && err.contains("llama3.1-8b"), "{err}");
    }
}
