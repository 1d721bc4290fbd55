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

use super::{Architecture, FrontendError, ModelConfig, MoeConfig, SlidingWindow};

/// Reads and parses `path` (a `config.json`).
pub fn read_config(path: &Path) -> Result<ModelConfig, FrontendError> {
    let text = super::read_bounded_text(path, super::MAX_CONFIG_BYTES)?;
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

const ALL_ARCHITECTURES: [Architecture; 7] = [
    Architecture::Llama,
    Architecture::Mistral,
    Architecture::Qwen2,
    Architecture::Qwen3,
    Architecture::Mixtral,
    Architecture::Qwen3Moe,
    Architecture::GptOss,
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
        Got::Absent if arch == GptOss => Some(64),
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

    let default_eps = if matches!(arch, Mixtral | GptOss) { 1e-5 } else { 1e-6 };
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
        // gpt-oss's q/k/v/o projections carry biases; its configuration class defaults to that.
        GptOss => {
            if f.optional(p, "attention_bias", "a boolean", Value::as_bool).or_default(Some(true)) == Some(false) {
                p.push("attention_bias false is not supported for gpt_oss (its release has biases)".to_string());
            }
            true
        }
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

    let default_max_position = match arch {
        Llama => 2048,
        Mistral | Mixtral | GptOss => 131_072,
        Qwen2 | Qwen3 | Qwen3Moe => 32_768,
    };
    let max_position = f
        .optional(p, "max_position_embeddings", "a positive integer", positive_u32)
        .or_default(Some(default_max_position));
    let sliding_window = parse_sliding_window(arch, f, num_layers, max_position, p);
    let rope = parse_rope(f, max_position, p);

    let (default_bos, default_eos) = match arch {
        Llama | Mistral | Mixtral => (Some(1), vec![2]),
        Qwen2 | Qwen3 | Qwen3Moe | GptOss => (None, vec![]),
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
        Mixtral | Qwen3Moe | GptOss => parse_moe(arch, f, num_layers, intermediate_size, p).map(Some),
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
        attention_sinks: arch == GptOss,
        sliding_window: sliding_window?,
        qk_norm: matches!(arch, Qwen3 | Qwen3Moe),
        moe: moe?,
        bos_token_id,
        eos_token_ids,
    })
}

/// The sliding window in force, if it changes attention at some position the model supports
/// (`Some(None)`: none; `None`: a field it depends on is unusable, its problem recorded).
/// Mistral and Mixtral apply `sliding_window` to every layer when it is set (Mistral's default is
/// 4096); the Qwen models only when `use_sliding_window` is on, and Qwen2/Qwen3 only on the layers
/// `layer_types` (or `max_window_layers`) marks as sliding; gpt-oss on the layers `layer_types`
/// marks (by default every other layer, starting with the first; window 128).
fn parse_sliding_window(
    arch: Architecture,
    f: &Fields,
    num_layers: Option<u32>,
    max_position: Option<u32>,
    p: &mut Vec<String>,
) -> Option<Option<SlidingWindow>> {
    use Architecture::*;
    // An unusable max_position_embeddings is already reported.
    let max_position = max_position?;
    let default_window = match arch {
        Llama => return Some(None),
        Mistral | Qwen2 | Qwen3 | Qwen3Moe => Some(4096),
        GptOss => Some(128),
        Mixtral => None,
    };
    let window = match f.optional(p, "sliding_window", "a positive integer", positive_u32) {
        Got::Value(w) => Some(w),
        Got::Absent if f.is_null("sliding_window") => None,
        Got::Absent => default_window,
        Got::Invalid => return None,
    };
    let enabled = match arch {
        Mistral | Mixtral | GptOss => true,
        _ => match f.optional(p, "use_sliding_window", "a boolean", Value::as_bool) {
            Got::Value(on) => on,
            Got::Absent => false,
            Got::Invalid => return None,
        },
    };
    let layer_types = match arch {
        Qwen2 | Qwen3 | GptOss => f.optional(p, "layer_types", "a list of strings", string_list),
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
                    other => p.push(format!(
                        "layer_types[{layer}] `{other}` is not supported (full_attention or sliding_attention)"
                    )),
                }
            }
        }
        Got::Invalid => return None,
        Got::Absent => {
            let all_layers = 0..num_layers.unwrap_or(0);
            sliding_layers = match arch {
                Qwen2 | Qwen3 => {
                    let first = match f.optional(p, "max_window_layers", "an integer", as_u32) {
                        Got::Value(n) => n,
                        Got::Absent => 28,
                        Got::Invalid => return None,
                    };
                    all_layers.filter(|&l| l >= first).collect()
                }
                GptOss => all_layers.filter(|l| l % 2 == 0).collect(),
                _ => all_layers.collect(),
            };
        }
    }
    let (Some(window), true) = (window, enabled) else { return Some(None) };
    // A window at least as long as the longest context never drops a position.
    if window >= max_position || sliding_layers.is_empty() {
        return Some(None);
    }
    Some(Some(SlidingWindow { window, layers: sliding_layers }))
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
            let original = r
                .optional(p, "original_max_position_embeddings", "a positive integer", positive_u32)
                .or_default(max_position);
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
        "yarn" => {
            let factor = r.required(p, "factor", "a positive number", positive_f32);
            let beta_fast = r.optional(p, "beta_fast", "a positive number", positive_f32).or_default(Some(32.0));
            let beta_slow = r.optional(p, "beta_slow", "a positive number", positive_f32).or_default(Some(1.0));
            let original = r
                .optional(p, "original_max_position_embeddings", "a positive integer", positive_u32)
                .or_default(max_position);
            let truncate = r.optional(p, "truncate", "a boolean", Value::as_bool).or_default(Some(true));
            for key in ["attention_factor", "mscale", "mscale_all_dim"] {
                if r.get(key).is_some() {
                    p.push(format!(
                        "{params_key}.{key} is not supported (yarn's attention factor is 0.1 ln(factor) + 1)"
                    ));
                }
            }
            Some(RopeScaling::Yarn {
                factor: factor?,
                beta_fast: beta_fast?,
                beta_slow: beta_slow?,
                original_max_position: original?,
                truncate: truncate?,
            })
        }
        other => {
            p.push(format!(
                "{params_key}.rope_type `{other}` is not supported (supported: default, linear, llama3, yarn)"
            ));
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
        Architecture::Mixtral | Architecture::GptOss => ("num_local_experts", "num_experts"),
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
    let gpt_oss_experts = match arch {
        Architecture::GptOss => {
            let alpha = f.optional(p, "swiglu_alpha", "a positive number", positive_f32).or_default(Some(1.702));
            let limit = f.optional(p, "swiglu_limit", "a positive number", positive_f32).or_default(Some(7.0));
            Some(Some((alpha?, limit?)))
        }
        _ => Some(None),
    };
    // Other families' quantization_config (bitsandbytes and such) is not read.
    let quantization = f.get("quantization_config").filter(|_| arch == Architecture::GptOss);
    let mxfp4_experts = match quantization {
        None => Some(false),
        Some(Value::Object(q)) => match q.get("quant_method").and_then(Value::as_str) {
            Some("mxfp4") => Some(true),
            other => {
                p.push(format!(
                    "quantization_config.quant_method {} is not supported (only mxfp4, for gpt_oss)",
                    other.map_or("(absent)".to_string(), |m| format!("`{m}`"))
                ));
                None
            }
        },
        Some(v) => {
            p.push(format!("field `quantization_config` must be an object, found {}", kind(v)));
            None
        }
    };
    Some(MoeConfig {
        gpt_oss_experts: gpt_oss_experts?,
        mxfp4_experts: mxfp4_experts?,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: Value) -> Result<ModelConfig, FrontendError> {
        parse_config(&json.to_string(), Path::new("config.json"))
    }

    fn problems(json: Value) -> Vec<String> {
        match parse(json) {
            Err(FrontendError::Invalid { problems, .. }) => problems,
            other => panic!("expected Invalid, found {other:?}"),
        }
    }

    /// A small model of `model_type`, plus `extra` fields (overriding).
    fn config(model_type: &str, extra: Value) -> Value {
        let mut c = serde_json::json!({
            "model_type": model_type, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        });
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        c
    }

    #[test]
    fn llama_defaults() {
        let c = parse(config("llama", serde_json::json!({"num_key_value_heads": null}))).unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (4, 4, 16));
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(c.rope, Rope { theta: 10_000.0, scaling: RopeScaling::None });
        assert_eq!((c.tie_word_embeddings, c.attention_bias, c.qk_norm), (false, false, false));
        assert_eq!((c.bos_token_id, c.eos_token_ids.as_slice()), (Some(1), &[2][..]));
        assert_eq!(c.moe, None);
    }

    #[test]
    fn rope_in_both_layouts() {
        let llama3 = serde_json::json!({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"});
        let expected = Rope {
            theta: 500_000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            },
        };
        let classic = parse(config("llama", serde_json::json!({"rope_theta": 500000.0, "rope_scaling": llama3})));
        assert_eq!(classic.unwrap().rope, expected);
        let mut params = llama3.clone();
        params["rope_theta"] = 500000.0.into();
        let modern = parse(config("llama", serde_json::json!({"rope_parameters": params})));
        assert_eq!(modern.unwrap().rope, expected);

        // The older `type` key; original_max_position_embeddings falling back to max_position_embeddings.
        let linear = serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}, "sliding_window": null});
        assert_eq!(parse(config("mistral", linear)).unwrap().rope.scaling, RopeScaling::Linear { factor: 2.0 });
        let fallback = serde_json::json!({"max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}});
        match parse(config("llama", fallback)).unwrap().rope.scaling {
            RopeScaling::Llama3 { original_max_position, .. } => assert_eq!(original_max_position, 4096),
            other => panic!("{other:?}"),
        }
        let default = serde_json::json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}});
        assert_eq!(parse(config("qwen2", default)).unwrap().rope, Rope { theta: 1e6, scaling: RopeScaling::None });
    }

    #[test]
    fn unsupported_rope() {
        let p = problems(config(
            "llama",
            serde_json::json!({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}, "partial_rotary_factor": 0.5}),
        ));
        assert_eq!(
            p,
            [
                "partial_rotary_factor 0.5 is not supported (only 1.0)",
                "missing field `rope_parameters.low_freq_factor` (a positive number)",
                "missing field `rope_parameters.high_freq_factor` (a positive number)",
            ]
        );
    }

    #[test]
    fn qwen_variants() {
        let qwen2 = parse(config("qwen2", serde_json::json!({"eos_token_id": [5, 7], "bos_token_id": null}))).unwrap();
        assert!(qwen2.attention_bias && !qwen2.qk_norm);
        assert_eq!((qwen2.bos_token_id, qwen2.eos_token_ids), (None, vec![5, 7]));
        // Qwen3's head_dim is its own (transformers' default is 128, not hidden / heads).
        let qwen3 = parse(config("qwen3", serde_json::json!({"eos_token_id": 9}))).unwrap();
        assert!(qwen3.qk_norm && !qwen3.attention_bias);
        assert_eq!((qwen3.head_dim, qwen3.eos_token_ids), (128, vec![9]));
        let p = problems(config("qwen3", serde_json::json!({"attention_bias": true})));
        assert_eq!(p, ["attention_bias true (biases on q/k/v/o projections) is not supported"]);
    }

    #[test]
    fn mixtral_moe() {
        let c =
            parse(config("mixtral", serde_json::json!({"num_local_experts": 8, "num_experts_per_tok": 2}))).unwrap();
        assert_eq!(
            c.moe,
            Some(MoeConfig {
                num_experts: 8,
                top_k: 2,
                expert_intermediate_size: 128,
                normalize_top_k: true,
                dense_layers: vec![],
                gpt_oss_experts: None,
                mxfp4_experts: false,
            })
        );
        assert_eq!(c.rms_norm_eps, 1e-5);
        let alias = parse(config("mixtral", serde_json::json!({"num_experts": 4, "num_experts_per_tok": 1})));
        assert_eq!(alias.unwrap().moe.unwrap().num_experts, 4);
        let p = problems(config(
            "mixtral",
            serde_json::json!({"num_local_experts": 4, "num_experts": 8, "num_experts_per_tok": 2}),
        ));
        assert_eq!(p, ["num_local_experts 4 and num_experts 8 disagree"]);
        let p = problems(config("mixtral", serde_json::json!({"num_local_experts": 2, "num_experts_per_tok": 3})));
        assert_eq!(p, ["num_experts_per_tok 3 exceeds the 2 experts"]);
    }

    #[test]
    fn qwen3_moe_dense_layers_and_normalisation() {
        let moe = serde_json::json!({"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 48,
            "mlp_only_layers": [0], "decoder_sparse_step": 2});
        let c = parse(config("qwen3_moe", moe)).unwrap().moe.unwrap();
        // Layer 0 is listed; layer 2 fails (2 + 1) % 2 == 0; 1 and 3 are sparse.
        assert_eq!(c.dense_layers, [0, 2]);
        assert!(!c.normalize_top_k, "norm_topk_prob defaults to false");
        assert_eq!(c.expert_intermediate_size, 48);

        let moe = serde_json::json!({"num_local_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 48,
            "norm_topk_prob": true, "mlp_only_layers": null});
        let c = parse(config("qwen3_moe", moe)).unwrap().moe.unwrap();
        assert!(c.normalize_top_k);
        assert!(c.dense_layers.is_empty());

        let p = problems(config("qwen3_moe", serde_json::json!({"num_experts_per_tok": 4, "mlp_only_layers": [9]})));
        assert_eq!(
            p,
            [
                "missing field `num_experts`",
                "missing field `moe_intermediate_size` (a positive integer)",
                "mlp_only_layers names layer 9, but there are 4 layers"
            ]
        );
    }

    #[test]
    fn sliding_windows_only_when_in_force() {
        let window = |json: Value| parse(json).unwrap().sliding_window.map(|w| (w.window, w.layers));
        // Mistral's window applies to every layer, unless it covers the whole context.
        // (transformers' defaults: a 4096 window, 131072 positions.)
        assert_eq!(window(config("mistral", serde_json::json!({}))), Some((4096, vec![0, 1, 2, 3])));
        let covering = serde_json::json!({"sliding_window": 32768, "max_position_embeddings": 32768});
        assert_eq!(window(config("mistral", covering)), None);
        assert_eq!(window(config("mistral", serde_json::json!({"sliding_window": null}))), None);
        // Qwen: only with use_sliding_window, and only from max_window_layers on.
        let off = serde_json::json!({"sliding_window": 128, "use_sliding_window": false});
        assert_eq!(window(config("qwen2", off)), None);
        let late = serde_json::json!({"sliding_window": 128, "use_sliding_window": true, "max_window_layers": 4});
        assert_eq!(window(config("qwen3", late)), None);
        let on = serde_json::json!({"sliding_window": 128, "use_sliding_window": true, "max_window_layers": 3});
        assert_eq!(window(config("qwen3", on)), Some((128, vec![3])));
        // gpt-oss: every other layer from the first by default, window 128.
        let gpt_oss = serde_json::json!({"num_local_experts": 8, "num_experts_per_tok": 2});
        assert_eq!(window(config("gpt_oss", gpt_oss)), Some((128, vec![0, 2])));
    }

    #[test]
    fn gpt_oss_fields() {
        let release = serde_json::json!({"num_local_experts": 8, "num_experts_per_tok": 2, "swiglu_limit": 5.0,
            "quantization_config": {"quant_method": "mxfp4"},
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false}, "rope_theta": 150000.0});
        let c = parse(config("gpt_oss", release)).unwrap();
        let moe = c.moe.unwrap();
        assert_eq!((moe.gpt_oss_experts, moe.mxfp4_experts, moe.normalize_top_k), (Some((1.702, 5.0)), true, true));
        assert!(c.attention_bias && c.attention_sinks);
        assert_eq!(
            c.rope.scaling,
            RopeScaling::Yarn {
                factor: 32.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position: 4096,
                truncate: false
            }
        );
        let other = serde_json::json!({"num_local_experts": 8, "num_experts_per_tok": 2,
            "quantization_config": {"quant_method": "fp8"}, "rope_scaling": {"rope_type": "yarn"}});
        assert_eq!(
            problems(config("gpt_oss", other)),
            [
                "missing field `rope_scaling.factor` (a positive number)",
                "quantization_config.quant_method `fp8` is not supported (only mxfp4, for gpt_oss)",
            ]
        );
    }

    #[test]
    fn every_field_problem_is_collected() {
        let bad = serde_json::json!({"model_type": "llama", "vocab_size": -3, "hidden_size": 60,
            "num_attention_heads": 8, "num_key_value_heads": 3, "intermediate_size": "big", "tie_word_embeddings": "yes",
            "eos_token_id": [1, "two"], "hidden_act": "gelu"});
        assert_eq!(
            problems(bad),
            [
                "field `vocab_size` must be a positive integer, found -3",
                "field `intermediate_size` must be a positive integer, found \"big\"",
                "missing field `num_hidden_layers` (a positive integer)",
                "head_dim is absent and hidden_size 60 is not a multiple of num_attention_heads 8",
                "num_attention_heads 8 is not a multiple of num_key_value_heads 3",
                "hidden_act `gelu` is not supported (only silu)",
                "field `tie_word_embeddings` must be a boolean, found \"yes\"",
                "field `eos_token_id` must be a token id or a list of token ids, found [1,\"two\"]",
            ]
        );
    }

    #[test]
    fn model_type_problems_stand_alone() {
        assert_eq!(problems(serde_json::json!({"hidden_size": 8})), ["missing field `model_type` (a string)"]);
        let p = problems(serde_json::json!({"model_type": "gemma2", "hidden_size": "x"}));
        assert_eq!(
            p,
            ["model_type `gemma2` is not supported (supported: llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, gpt_oss)"]
        );
    }

    #[test]
    fn malformed_json_is_a_format_error() {
        match parse_config("{\"model_type\": ", Path::new("dir/config.json")) {
            Err(FrontendError::Format { file, message }) => {
                assert_eq!(file, Path::new("dir/config.json"));
                assert!(message.starts_with("invalid JSON"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
}
