//! `config.json` -> [`ModelConfig`].
//!
//! Absent fields take transformers' (5.x) defaults for the architecture, except the sizes that
//! define the model (vocabulary, widths, layer and head counts, expert counts), which a real
//! checkpoint always states and which are required here. A JSON `null` counts as absent, as it
//! does in transformers. Every missing, mistyped or unsupported field is collected, so one error
//! lists them all.

use std::path::Path;

use serde_json::{Map, Value};
use waferc_ir::{Rope, RopeScaling};

use super::{Architecture, FrontendError, ModelConfig, MoeConfig};

/// Reads and parses `path` (a `config.json`).
pub fn read_config(path: &Path) -> Result<ModelConfig, FrontendError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| FrontendError::Io { path: path.to_path_buf(), source })?;
    parse_config(&text, path)
}

/// Parses the text of a `config.json`; `file` names it in errors.
pub fn parse_config(text: &str, file: &Path) -> Result<ModelConfig, FrontendError> {
    let format = |message: String| FrontendError::Format { file: file.to_path_buf(), message };
    let json: Value = serde_json::from_str(text).map_err(|e| format(format!("invalid JSON: {e}")))?;
    let Value::Object(map) = json else {
        return Err(format(format!("expected a JSON object, found {}", kind(&json))));
    };
    let invalid = |problems: Vec<String>| FrontendError::Invalid { path: file.to_path_buf(), problems };
    let mut problems = Vec::new();
    let fields = Fields { map: &map, prefix: String::new() };

    // The field names and defaults of everything else depend on the architecture, so an unknown
    // one is the only problem worth reporting.
    let architecture = match fields.required(&mut problems, "model_type", "a string", Value::as_str) {
        Some(model_type) => match architecture(model_type) {
            Some(a) => a,
            None => {
                let supported = ALL_ARCHITECTURES.map(Architecture::model_type).join(", ");
                return Err(invalid(vec![format!(
                    "model_type `{model_type}` is not supported (supported: {supported})"
                )]));
            }
        },
        None => return Err(invalid(problems)),
    };
    let config = parse_fields(architecture, &fields, &mut problems);
    match config {
        Some(config) if problems.is_empty() => Ok(config),
        _ => Err(invalid(problems)),
    }
}

const ALL_ARCHITECTURES: [Architecture; 6] = [
    Architecture::Llama,
    Architecture::Mistral,
    Architecture::Qwen2,
    Architecture::Qwen3,
    Architecture::Mixtral,
    Architecture::Qwen3Moe,
];

fn architecture(model_type: &str) -> Option<Architecture> {
    ALL_ARCHITECTURES.into_iter().find(|a| a.model_type() == model_type)
}

/// Parses everything after `model_type`. Returns `None` when a field the rest depends on is
/// unusable (its problem is already recorded).
fn parse_fields(arch: Architecture, f: &Fields, problems: &mut Vec<String>) -> Option<ModelConfig> {
    use Architecture::*;
    let p = problems;
    let vocab_size = f.required(p, "vocab_size", "a positive integer", positive_u32);
    let hidden_size = f.required(p, "hidden_size", "a positive integer", positive_u32);
    let intermediate_size = f.required(p, "intermediate_size", "a positive integer", positive_u32);
    let num_layers = f.required(p, "num_hidden_layers", "a positive integer", positive_u32);
    let num_heads = f.required(p, "num_attention_heads", "a positive integer", positive_u32);
    // Llama's convention: no num_key_value_heads means one KV head per query head.
    let num_kv_heads = f.optional(p, "num_key_value_heads", "a positive integer", positive_u32).or_default(num_heads);
    let head_dim = match f.optional(p, "head_dim", "a positive integer", positive_u32) {
        Got::Value(d) => Some(d),
        Got::Invalid => None,
        // Qwen3's configuration class defaults head_dim to 128; the others derive it.
        Got::Absent if arch == Qwen3 => Some(128),
        Got::Absent => match (hidden_size, num_heads) {
            (Some(hidden), Some(heads)) if hidden % heads == 0 => Some(hidden / heads),
            (Some(hidden), Some(heads)) => {
                p.push(format!(
                    "head_dim is absent and hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
                ));
                None
            }
            _ => None,
        },
    };
    if let (Some(heads), Some(kv)) = (num_heads, num_kv_heads) {
        if heads % kv != 0 {
            p.push(format!("num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"));
        }
    }
    if let Some(d) = head_dim.filter(|d| d % 2 != 0) {
        p.push(format!("head_dim {d} must be even (rotary embeddings rotate pairs)"));
    }

    let default_eps = if arch == Mixtral { 1e-5 } else { 1e-6 };
    let rms_norm_eps = f.optional(p, "rms_norm_eps", "a positive number", positive_f32).or_default(Some(default_eps));
    match f.optional(p, "hidden_act", "a string", Value::as_str) {
        // transformers' "swish" is the same SiLU.
        Got::Absent | Got::Value("silu" | "swish") | Got::Invalid => {}
        Got::Value(other) => p.push(format!("hidden_act `{other}` is not supported (only silu)")),
    }
    let tie_word_embeddings = f.optional(p, "tie_word_embeddings", "a boolean", Value::as_bool).or_default(Some(false));

    let attention_bias = match arch {
        // Qwen2's q/k/v projections always carry biases; it has no field for it.
        Qwen2 => true,
        Mistral | Mixtral => false,
        Llama | Qwen3 | Qwen3Moe => {
            if f.optional(p, "attention_bias", "a boolean", Value::as_bool).or_default(Some(false)) == Some(true) {
                p.push("attention_bias true (biases on q/k/v/o projections) is not supported".to_string());
            }
            false
        }
    };
    if arch == Llama && f.optional(p, "mlp_bias", "a boolean", Value::as_bool).or_default(Some(false)) == Some(true) {
        p.push("mlp_bias true (biases on the MLP projections) is not supported".to_string());
    }

    let max_position = f.optional(p, "max_position_embeddings", "a positive integer", positive_u32).or_default(None);
    check_sliding_window(arch, f, num_layers, max_position, p);
    let rope = parse_rope(f, max_position, p);

    let (default_bos, default_eos) = match arch {
        Llama | Mistral | Mixtral => (Some(1), vec![2]),
        Qwen2 | Qwen3 | Qwen3Moe => (None, vec![]),
    };
    let bos_token_id = match f.optional(p, "bos_token_id", "a token id", as_u32) {
        Got::Value(id) => Some(id),
        Got::Absent if f.is_null("bos_token_id") => None,
        Got::Absent => default_bos,
        Got::Invalid => None,
    };
    let eos_token_ids = match f.optional(p, "eos_token_id", "a token id or a list of token ids", token_ids) {
        Got::Value(ids) => ids,
        Got::Absent if f.is_null("eos_token_id") => vec![],
        Got::Absent => default_eos,
        Got::Invalid => vec![],
    };

    let moe = match arch {
        Mixtral | Qwen3Moe => parse_moe(arch, f, num_layers, intermediate_size, p).map(Some),
        Llama | Mistral | Qwen2 | Qwen3 => Some(None),
    };

    Some(ModelConfig {
        architecture: arch,
        vocab_size: vocab_size?,
        hidden_size: hidden_size?,
        intermediate_size: intermediate_size?,
        num_layers: num_layers?,
        num_heads: num_heads?,
        num_kv_heads: num_kv_heads?,
        head_dim: head_dim?,
        rms_norm_eps: rms_norm_eps?,
        rope: rope?,
        tie_word_embeddings: tie_word_embeddings?,
        attention_bias,
        qk_norm: matches!(arch, Qwen3 | Qwen3Moe),
        moe: moe?,
        bos_token_id,
        eos_token_ids,
    })
}

/// Reports a sliding window that would change attention at some position the model supports.
/// Mistral and Mixtral apply `sliding_window` to every layer when it is set (Mistral's default is
/// 4096); the Qwen models only when `use_sliding_window` is on, and Qwen2/Qwen3 only on the layers
/// `layer_types` (or `max_window_layers`) marks as sliding.
fn check_sliding_window(
    arch: Architecture,
    f: &Fields,
    num_layers: Option<u32>,
    max_position: Option<u32>,
    p: &mut Vec<String>,
) {
    use Architecture::*;
    let default_window = match arch {
        Llama => return,
        Mistral | Qwen2 | Qwen3 | Qwen3Moe => Some(4096),
        Mixtral => None,
    };
    let window = match f.optional(p, "sliding_window", "a positive integer", positive_u32) {
        Got::Value(w) => Some(w),
        Got::Absent if f.is_null("sliding_window") => None,
        Got::Absent => default_window,
        Got::Invalid => return,
    };
    let enabled = match arch {
        Mistral | Mixtral => true,
        _ => match f.optional(p, "use_sliding_window", "a boolean", Value::as_bool) {
            Got::Value(on) => on,
            Got::Absent => false,
            Got::Invalid => return,
        },
    };
    let layer_types = match arch {
        Qwen2 | Qwen3 => f.optional(p, "layer_types", "a list of strings", string_list),
        _ => Got::Absent,
    };
    let mut sliding_layers = Vec::new();
    match layer_types {
        Got::Value(types) => {
            if let Some(n) = num_layers.filter(|&n| n as usize != types.len()) {
                p.push(format!("layer_types lists {} layers but num_hidden_layers is {n}", types.len()));
            }
            for (layer, t) in types.iter().enumerate() {
                match t.as_str() {
                    "full_attention" => {}
                    "sliding_attention" => sliding_layers.push(layer as u32),
                    other => p.push(format!("layer_types[{layer}] `{other}` is not supported (only full_attention)")),
                }
            }
        }
        Got::Invalid => return,
        Got::Absent => {
            let all_layers = 0..num_layers.unwrap_or(0);
            sliding_layers = match arch {
                Qwen2 | Qwen3 => {
                    let first = match f.optional(p, "max_window_layers", "an integer", as_u32) {
                        Got::Value(n) => n,
                        Got::Absent => 28,
                        Got::Invalid => return,
                    };
                    all_layers.filter(|&l| l >= first).collect()
                }
                _ => all_layers.collect(),
            };
        }
    }
    let (Some(window), true) = (window, enabled) else { return };
    // A window at least as long as the longest context never drops a position.
    if max_position.is_some_and(|max| window >= max) || sliding_layers.is_empty() {
        return;
    }
    p.push(format!(
        "sliding_window {window} is in force on layers {sliding_layers:?} (max_position_embeddings {}); \
         only full attention is supported",
        max_position.map_or("absent".to_string(), |m| m.to_string())
    ));
}

/// Rotary embedding parameters, from either layout: `rope_theta` + `rope_scaling` (older hub
/// configs; `rope_scaling` wins over `rope_parameters` as in transformers) or `rope_parameters`.
fn parse_rope(f: &Fields, max_position: Option<u32>, p: &mut Vec<String>) -> Option<Rope> {
    let (params_key, params) = match (f.get("rope_scaling"), f.get("rope_parameters")) {
        (Some(Value::Object(m)), _) if !m.is_empty() => ("rope_scaling", Some(m)),
        (Some(v @ (Value::Bool(_) | Value::Number(_) | Value::String(_) | Value::Array(_))), _) => {
            p.push(format!("field `rope_scaling` must be an object, found {}", kind(v)));
            return None;
        }
        (_, Some(Value::Object(m))) => ("rope_parameters", Some(m)),
        (_, Some(v)) => {
            p.push(format!("field `rope_parameters` must be an object, found {}", kind(v)));
            return None;
        }
        _ => ("rope_parameters", None),
    };
    // Per-layer-type parameters: only full attention layers exist here.
    let params = match params.and_then(|m| m.get("full_attention")) {
        Some(Value::Object(nested)) => Some(nested),
        _ => params,
    };
    let empty = Map::new();
    let r = Fields { map: params.unwrap_or(&empty), prefix: format!("{params_key}.") };

    let theta = match r.optional(p, "rope_theta", "a positive number", positive_f32) {
        Got::Value(t) => Some(t),
        Got::Invalid => None,
        Got::Absent => f.optional(p, "rope_theta", "a positive number", positive_f32).or_default(Some(10_000.0)),
    };
    for fields in [&r, f] {
        if let Got::Value(factor) = fields.optional(p, "partial_rotary_factor", "a number", Value::as_f64) {
            if factor != 1.0 {
                p.push(format!("{}partial_rotary_factor {factor} is not supported (only 1.0)", fields.prefix));
            }
        }
    }
    let rope_type = match r.optional(p, "rope_type", "a string", Value::as_str) {
        Got::Value(t) => Some(t),
        Got::Invalid => return None,
        Got::Absent => r.optional(p, "type", "a string", Value::as_str).or_default(Some("default")),
    }?;
    let scaling = match rope_type {
        "default" => Some(RopeScaling::None),
        "linear" => {
            r.required(p, "factor", "a positive number", positive_f32).map(|factor| RopeScaling::Linear { factor })
        }
        "llama3" => {
            let factor = r.required(p, "factor", "a positive number", positive_f32);
            let low = r.required(p, "low_freq_factor", "a positive number", positive_f32);
            let high = r.required(p, "high_freq_factor", "a positive number", positive_f32);
            // transformers falls back to max_position_embeddings.
            let original = match r.optional(p, "original_max_position_embeddings", "a positive integer", positive_u32) {
                Got::Absent => max_position.or_else(|| {
                    p.push(format!(
                        "{params_key}.original_max_position_embeddings and max_position_embeddings are both absent"
                    ));
                    None
                }),
                got => got.or_default(None),
            };
            if let (Some(low), Some(high)) = (low, high) {
                if high <= low {
                    p.push(format!(
                        "{params_key}.high_freq_factor {high} must exceed low_freq_factor {low} (llama3 rope)"
                    ));
                }
            }
            Some(RopeScaling::Llama3 {
                factor: factor?,
                low_freq_factor: low?,
                high_freq_factor: high?,
                original_max_position: original?,
            })
        }
        other => {
            p.push(format!("{params_key}.rope_type `{other}` is not supported (supported: default, linear, llama3)"));
            None
        }
    };
    Some(Rope { theta: theta?, scaling: scaling? })
}

/// The mixture-of-experts fields (`None` when one is unusable; its problem is recorded).
fn parse_moe(
    arch: Architecture,
    f: &Fields,
    num_layers: Option<u32>,
    intermediate_size: Option<u32>,
    p: &mut Vec<String>,
) -> Option<MoeConfig> {
    // Mixtral calls it num_local_experts, Qwen3-MoE num_experts; each accepts the other's name.
    let (primary, alias) = match arch {
        Architecture::Mixtral => ("num_local_experts", "num_experts"),
        _ => ("num_experts", "num_local_experts"),
    };
    let num_experts = match (
        f.optional(p, primary, "a positive integer", positive_u32),
        f.optional(p, alias, "a positive integer", positive_u32),
    ) {
        (Got::Value(a), Got::Value(b)) if a != b => {
            p.push(format!("{primary} {a} and {alias} {b} disagree"));
            None
        }
        (Got::Value(n), _) | (Got::Absent, Got::Value(n)) => Some(n),
        (Got::Absent, Got::Absent) => {
            p.push(format!("missing field `{primary}`"));
            None
        }
        _ => None,
    };
    let top_k = f.required(p, "num_experts_per_tok", "a positive integer", positive_u32);
    if let (Some(n), Some(k)) = (num_experts, top_k) {
        if k > n {
            p.push(format!("num_experts_per_tok {k} exceeds the {n} experts"));
        }
    }
    let (expert_intermediate_size, normalize_top_k, dense_layers) = match arch {
        Architecture::Qwen3Moe => {
            let size = f.required(p, "moe_intermediate_size", "a positive integer", positive_u32);
            let normalize = f.optional(p, "norm_topk_prob", "a boolean", Value::as_bool).or_default(Some(false));
            let step = f.optional(p, "decoder_sparse_step", "a positive integer", positive_u32).or_default(Some(1));
            let dense_only =
                f.optional(p, "mlp_only_layers", "a list of layer indices", u32_list).or_default(Some(vec![]));
            if let (Some(n), Some(listed)) = (num_layers, &dense_only) {
                for layer in listed.iter().filter(|&&l| l >= n) {
                    p.push(format!("mlp_only_layers names layer {layer}, but there are {n} layers"));
                }
            }
            // transformers: layer i is sparse iff it is not in mlp_only_layers and (i + 1) % step == 0.
            let dense = match (num_layers, step, &dense_only) {
                (Some(n), Some(step), Some(listed)) => {
                    Some((0..n).filter(|l| listed.contains(l) || (l + 1) % step != 0).collect())
                }
                _ => None,
            };
            (size, normalize, dense)
        }
        // Mixtral's experts are as wide as intermediate_size, and it always renormalises.
        _ => (intermediate_size, Some(true), Some(vec![])),
    };
    Some(MoeConfig {
        num_experts: num_experts?,
        top_k: top_k?,
        expert_intermediate_size: expert_intermediate_size?,
        normalize_top_k: normalize_top_k?,
        dense_layers: dense_layers?,
    })
}

/// A field lookup: absent (or `null`), present but unusable (problem recorded), or a value.
enum Got<T> {
    Absent,
    Invalid,
    Value(T),
}

impl<T> Got<T> {
    /// The value, `default` when absent, `None` when invalid.
    fn or_default(self, default: Option<T>) -> Option<T> {
        match self {
            Got::Value(v) => Some(v),
            Got::Absent => default,
            Got::Invalid => None,
        }
    }
}

/// One JSON object of the config; `prefix` names it in problems (`rope_scaling.`).
struct Fields<'a> {
    map: &'a Map<String, Value>,
    prefix: String,
}

impl<'a> Fields<'a> {
    /// The field's value, `None` if absent or `null`.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn is_null(&self, key: &str) -> bool {
        self.map.get(key).is_some_and(Value::is_null)
    }

    fn optional<T>(
        &self,
        problems: &mut Vec<String>,
        key: &str,
        expected: &str,
        parse: impl Fn(&'a Value) -> Option<T>,
    ) -> Got<T> {
        match self.get(key) {
            None => Got::Absent,
            Some(value) => match parse(value) {
                Some(v) => Got::Value(v),
                None => {
                    problems.push(format!(
                        "field `{}{key}` must be {expected}, found {}",
                        self.prefix,
                        describe(value)
                    ));
                    Got::Invalid
                }
            },
        }
    }

    fn required<T>(
        &self,
        problems: &mut Vec<String>,
        key: &str,
        expected: &str,
        parse: impl Fn(&'a Value) -> Option<T>,
    ) -> Option<T> {
        match self.optional(problems, key, expected, parse) {
            Got::Value(v) => Some(v),
            Got::Invalid => None,
            Got::Absent => {
                problems.push(format!("missing field `{}{key}` ({expected})", self.prefix));
                None
            }
        }
    }
}

fn as_u32(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

fn positive_u32(v: &Value) -> Option<u32> {
    as_u32(v).filter(|&n| n > 0)
}

fn positive_f32(v: &Value) -> Option<f32> {
    v.as_f64().map(|x| x as f32).filter(|x| x.is_finite() && *x > 0.0)
}

fn token_ids(v: &Value) -> Option<Vec<u32>> {
    match v {
        Value::Array(items) => items.iter().map(as_u32).collect(),
        _ => as_u32(v).map(|id| vec![id]),
    }
}

fn u32_list(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?.iter().map(as_u32).collect()
}

fn string_list(v: &Value) -> Option<Vec<String>> {
    v.as_array()?.iter().map(|s| s.as_str().map(str::to_string)).collect()
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A short rendering of a value for a problem message.
fn describe(v: &Value) -> String {
    let text = v.to_string();
    if text.len() <= 40 {
        text
    } else {
        kind(v).to_string()
    }
}
