//! Checkpoint -> tensor IR.
//!
//! Lowering first derives from the config the full list of tensors the model needs (a
//! [`ModelPlan`]: Hugging Face names and shapes), checks the checkpoint against it and reports
//! every missing, unexpected, mis-shaped or unreadable tensor at once. Only then does it emit one
//! decode step, following transformers' modeling code op by op:
//!
//! ```text
//! x = embed
//! per layer: h = rms_norm(x); q, k, v = matvec(h) (+bias, Qwen2); q, k = rms_norm per head (Qwen3)
//!            q, k = rope; a = attention(q, k, v); x = x + matvec(a)
//!            h = rms_norm(x); x = x + ffn(h)      ffn: down(silu(gate(h)) * up(h)), or a routed MoE of those
//! logits = matvec(rms_norm(x), lm_head or the embedding table when tied)
//! ```

use std::collections::{BTreeMap, BTreeSet};

use waferc_ir::{DType, Handle, KvCache, ModelMeta, Module, Op, TensorType, Value, Weight, WeightBytes};

use super::{Architecture, Checkpoint, FrontendError, ModelConfig, TensorEntry};

/// Lowers a checkpoint to one decode step of IR, verified.
pub fn lower(checkpoint: &Checkpoint) -> Result<Module, FrontendError> {
    lower_with_unusable(checkpoint, &BTreeMap::new())
}

/// [`lower`], where `unusable` names tensors the reader found but could not represent (name ->
/// why): they are reported with every other problem, rather than as missing.
pub(crate) fn lower_with_unusable(
    checkpoint: &Checkpoint,
    unusable: &BTreeMap<String, String>,
) -> Result<Module, FrontendError> {
    let plan = ModelPlan::new(&checkpoint.config);
    let problems = check(checkpoint, &plan, unusable);
    if !problems.is_empty() {
        return Err(FrontendError::Invalid { path: checkpoint.path.clone(), problems });
    }
    Builder::new(checkpoint).build(&plan)
}

/// A tensor the model needs: its Hugging Face name and shape.
#[derive(Clone, Debug)]
struct TensorSpec {
    name: String,
    shape: Vec<u64>,
}

/// A gated feed-forward network: `down(silu(gate(x)) * up(x))`.
#[derive(Debug)]
struct GatedMlp {
    gate: TensorSpec,
    up: TensorSpec,
    down: TensorSpec,
}

#[derive(Debug)]
enum FeedForward {
    Dense(GatedMlp),
    Moe { router: TensorSpec, top_k: u32, normalize: bool, experts: Vec<GatedMlp> },
    GptOss(GptOssMoe),
}

/// gpt-oss's MoE block: a router with a bias, and all experts fused in four tensors (gate and up
/// interleaved along one axis), each expert with biases and the clamped SwiGLU.
#[derive(Debug)]
struct GptOssMoe {
    router: TensorSpec,
    router_bias: TensorSpec,
    /// transformers' layout `[E, H, 2I]`, or the MXFP4 release layout `[E, 2I, H]` (rows = outputs).
    gate_up: TensorSpec,
    gate_up_bias: TensorSpec,
    /// `[E, I, H]`, or `[E, H, I]` in the release layout.
    down: TensorSpec,
    down_bias: TensorSpec,
    experts: u32,
    top_k: u32,
    width: u64,
    hidden: u64,
    /// Rows are outputs (the release layout) rather than transformers' in-memory `[in, out]`.
    rows_are_outputs: bool,
    alpha: f32,
    limit: f32,
}

#[derive(Debug)]
struct LayerPlan {
    input_norm: TensorSpec,
    q: TensorSpec,
    k: TensorSpec,
    v: TensorSpec,
    /// q/k/v biases (Qwen2).
    qkv_bias: Option<[TensorSpec; 3]>,
    /// Per-head q/k RMSNorm weights (Qwen3).
    qk_norm: Option<[TensorSpec; 2]>,
    o: TensorSpec,
    /// The output projection's bias and the per-head sink logits (gpt-oss).
    o_bias_and_sinks: Option<[TensorSpec; 2]>,
    /// The sliding window, on a sliding layer.
    window: Option<u32>,
    post_attention_norm: TensorSpec,
    ffn: FeedForward,
}

/// Every tensor the config calls for, in model order.
#[derive(Debug)]
struct ModelPlan {
    embed: TensorSpec,
    layers: Vec<LayerPlan>,
    final_norm: TensorSpec,
    /// `None` when the head is the embedding table (tied).
    lm_head: Option<TensorSpec>,
}

fn spec(name: impl Into<String>, shape: impl Into<Vec<u64>>) -> TensorSpec {
    TensorSpec { name: name.into(), shape: shape.into() }
}

fn gated_mlp(prefix: &str, [gate, up, down]: [&str; 3], hidden: u64, width: u64) -> GatedMlp {
    GatedMlp {
        gate: spec(format!("{prefix}.{gate}.weight"), [width, hidden]),
        up: spec(format!("{prefix}.{up}.weight"), [width, hidden]),
        down: spec(format!("{prefix}.{down}.weight"), [hidden, width]),
    }
}

impl ModelPlan {
    fn new(c: &ModelConfig) -> ModelPlan {
        let hidden = c.hidden_size as u64;
        let head_dim = c.head_dim as u64;
        let q_width = c.num_heads as u64 * head_dim;
        let kv_width = c.num_kv_heads as u64 * head_dim;
        let layers = (0..c.num_layers)
            .map(|layer| {
                let p = format!("model.layers.{layer}");
                let attn = |proj: &str, what: &str| format!("{p}.self_attn.{proj}.{what}");
                let dense_mlp = || {
                    gated_mlp(
                        &format!("{p}.mlp"),
                        ["gate_proj", "up_proj", "down_proj"],
                        hidden,
                        c.intermediate_size as u64,
                    )
                };
                let ffn = match &c.moe {
                    Some(moe) if moe.gpt_oss_experts.is_some() => {
                        let (e, width) = (moe.num_experts as u64, moe.expert_intermediate_size as u64);
                        let (alpha, limit) = moe.gpt_oss_experts.unwrap_or_default();
                        let experts = |what: &str| format!("{p}.mlp.experts.{what}");
                        let release = moe.mxfp4_experts;
                        FeedForward::GptOss(GptOssMoe {
                            router: spec(format!("{p}.mlp.router.weight"), [e, hidden]),
                            router_bias: spec(format!("{p}.mlp.router.bias"), [e]),
                            gate_up: spec(
                                experts("gate_up_proj"),
                                if release { [e, 2 * width, hidden] } else { [e, hidden, 2 * width] },
                            ),
                            gate_up_bias: spec(experts("gate_up_proj_bias"), [e, 2 * width]),
                            down: spec(
                                experts("down_proj"),
                                if release { [e, hidden, width] } else { [e, width, hidden] },
                            ),
                            down_bias: spec(experts("down_proj_bias"), [e, hidden]),
                            experts: moe.num_experts,
                            top_k: moe.top_k,
                            width,
                            hidden,
                            rows_are_outputs: release,
                            alpha,
                            limit,
                        })
                    }
                    Some(moe) if !moe.dense_layers.contains(&layer) => {
                        let width = moe.expert_intermediate_size as u64;
                        // Mixtral: block_sparse_moe.{gate, experts.E.w1 (gate) / w3 (up) / w2 (down)};
                        // Qwen3-MoE: mlp.{gate, experts.E.gate_proj / up_proj / down_proj}.
                        let (block, projections) = match c.architecture {
                            Architecture::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
                            _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
                        };
                        FeedForward::Moe {
                            router: spec(format!("{p}.{block}.gate.weight"), [moe.num_experts as u64, hidden]),
                            top_k: moe.top_k,
                            normalize: moe.normalize_top_k,
                            experts: (0..moe.num_experts)
                                .map(|e| gated_mlp(&format!("{p}.{block}.experts.{e}"), projections, hidden, width))
                                .collect(),
                        }
                    }
                    _ => FeedForward::Dense(dense_mlp()),
                };
                LayerPlan {
                    input_norm: spec(format!("{p}.input_layernorm.weight"), [hidden]),
                    q: spec(attn("q_proj", "weight"), [q_width, hidden]),
                    k: spec(attn("k_proj", "weight"), [kv_width, hidden]),
                    v: spec(attn("v_proj", "weight"), [kv_width, hidden]),
                    qkv_bias: c.attention_bias.then(|| {
                        [
                            spec(attn("q_proj", "bias"), [q_width]),
                            spec(attn("k_proj", "bias"), [kv_width]),
                            spec(attn("v_proj", "bias"), [kv_width]),
                        ]
                    }),
                    qk_norm: c.qk_norm.then(|| {
                        [spec(attn("q_norm", "weight"), [head_dim]), spec(attn("k_norm", "weight"), [head_dim])]
                    }),
                    o: spec(attn("o_proj", "weight"), [hidden, q_width]),
                    o_bias_and_sinks: c.attention_sinks.then(|| {
                        [
                            spec(attn("o_proj", "bias"), [hidden]),
                            spec(format!("{p}.self_attn.sinks"), [c.num_heads as u64]),
                        ]
                    }),
                    window: c.sliding_window.as_ref().filter(|w| w.layers.contains(&layer)).map(|w| w.window),
                    post_attention_norm: spec(format!("{p}.post_attention_layernorm.weight"), [hidden]),
                    ffn,
                }
            })
            .collect();
        ModelPlan {
            embed: spec("model.embed_tokens.weight", [c.vocab_size as u64, hidden]),
            layers,
            final_norm: spec("model.norm.weight", [hidden]),
            lm_head: (!c.tie_word_embeddings).then(|| spec("lm_head.weight", [c.vocab_size as u64, hidden])),
        }
    }

    fn tensors(&self) -> Vec<&TensorSpec> {
        let mut all = vec![&self.embed];
        for l in &self.layers {
            all.extend([&l.input_norm, &l.q, &l.k, &l.v]);
            all.extend(l.qkv_bias.iter().flatten());
            all.extend(l.qk_norm.iter().flatten());
            all.push(&l.o);
            all.extend(l.o_bias_and_sinks.iter().flatten());
            all.push(&l.post_attention_norm);
            let mlps = match &l.ffn {
                FeedForward::Dense(mlp) => std::slice::from_ref(mlp),
                FeedForward::GptOss(m) => {
                    all.extend([&m.router, &m.router_bias, &m.gate_up, &m.gate_up_bias, &m.down, &m.down_bias]);
                    &[]
                }
                FeedForward::Moe { router, experts, .. } => {
                    all.push(router);
                    experts.as_slice()
                }
            };
            for mlp in mlps {
                all.extend([&mlp.gate, &mlp.up, &mlp.down]);
            }
        }
        all.push(&self.final_norm);
        all.extend(&self.lm_head);
        all
    }
}

/// Buffers some exporters save that no computation reads.
fn is_ignorable(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

/// Every way the checkpoint's tensors differ from the plan, in model order, then the unexpected
/// tensors by name.
fn check(checkpoint: &Checkpoint, plan: &ModelPlan, unusable: &BTreeMap<String, String>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut expected = BTreeSet::new();
    let mut missing = Vec::new();
    for want in plan.tensors() {
        expected.insert(want.name.as_str());
        let Some(entry) = checkpoint.tensors.get(&want.name) else {
            problems.push(match unusable.get(&want.name) {
                Some(why) => why.clone(),
                None => {
                    missing.push(want);
                    format!("missing tensor {} (expected shape {:?})", want.name, want.shape)
                }
            });
            continue;
        };
        let file = entry.file.display();
        if entry.ty.shape != want.shape {
            problems.push(format!("{file}: tensor {}: expected shape {:?}, found {}", want.name, want.shape, entry.ty));
            continue;
        }
        let needed = entry.ty.bytes();
        match (entry.data.bytes().map(<[u8]>::len), needed) {
            (_, None) => problems.push(format!(
                "{file}: tensor {} is {}: a {} row must be a whole number of {}-element blocks",
                want.name,
                entry.ty,
                entry.ty.dtype,
                waferc_ir::BLOCK
            )),
            (Some(held), Some(needed)) if held as u64 != needed => problems
                .push(format!("{file}: tensor {} holds {held} bytes, but {} needs {needed}", want.name, entry.ty)),
            _ => {}
        }
    }
    let config = &checkpoint.config;
    let model = format!("{} with {} layers", config.architecture.model_type(), config.num_layers);
    let unexpected: Vec<(&String, &TensorEntry)> = checkpoint
        .tensors
        .iter()
        .filter(|(name, _)| !expected.contains(name.as_str()) && !is_ignorable(name))
        .collect();
    // The missing tensor of the same shape a few edits away, if any. Pairing is quadratic: only
    // when there are few of each.
    let suggest = missing.len() * unexpected.len() <= 10_000;
    let misnamed = |name: &str, shape: &[u64]| {
        missing
            .iter()
            .filter(|m| suggest && m.shape == shape)
            .map(|m| (edit_distance(&m.name, name), m))
            .filter(|&(distance, _)| distance <= 4)
            .min_by_key(|&(distance, _)| distance)
            .map(|(_, m)| m.name.as_str())
    };
    for (name, entry) in unexpected {
        let hint = if name == "lm_head.weight" && config.tie_word_embeddings {
            " (tie_word_embeddings is true: the head is the embedding table)".to_string()
        } else if name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj") {
            " (experts fused into one tensor: waferc reads the per-expert layout transformers saves, \
             mlp.experts.E.gate_proj.weight and so on)"
                .to_string()
        } else if let Some(intended) = misnamed(name, &entry.ty.shape) {
            format!(" (misnamed {intended}?)")
        } else {
            String::new()
        };
        problems.push(format!(
            "{}: unexpected tensor {name} {}: {model} does not use it{hint}",
            entry.file.display(),
            entry.ty
        ));
    }
    for (name, why) in unusable {
        if !expected.contains(name.as_str()) && !is_ignorable(name) {
            problems.push(format!("{why} (and {model} does not use it)"));
        }
    }
    problems
}

/// Levenshtein distance over bytes, for pairing a misnamed tensor with the missing one it was meant to be.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, &ca) in a.iter().enumerate() {
        let mut current = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            current[j + 1] = (previous[j] + usize::from(ca != cb)).min(previous[j + 1] + 1).min(current[j] + 1);
        }
        previous = current;
    }
    previous[b.len()]
}

/// The `size`-byte items of `tensor` at `indices`, concatenated (absent when the tensor is).
fn gather(tensor: &TensorEntry, size: usize, indices: impl IntoIterator<Item = usize>) -> WeightBytes {
    let Some(bytes) = tensor.data.bytes() else { return WeightBytes::Absent };
    let mut out = Vec::new();
    for index in indices {
        out.extend_from_slice(&bytes[index * size..(index + 1) * size]);
    }
    WeightBytes::owned(out)
}

/// Emits the IR for a checked checkpoint.
struct Builder<'a> {
    checkpoint: &'a Checkpoint,
    module: Module,
    /// Weights already added, by name (a tied head reuses the embedding table).
    weights: BTreeMap<String, Handle<Weight>>,
}

impl<'a> Builder<'a> {
    fn new(checkpoint: &'a Checkpoint) -> Self {
        let c = &checkpoint.config;
        let meta = ModelMeta {
            architecture: c.architecture.model_type().to_string(),
            vocab_size: c.vocab_size,
            num_layers: c.num_layers,
            bos_token_id: c.bos_token_id,
            eos_token_ids: c.eos_token_ids.clone(),
        };
        Builder { checkpoint, module: Module::new(meta), weights: BTreeMap::new() }
    }

    fn weight(&mut self, spec: &TensorSpec) -> Result<Handle<Weight>, FrontendError> {
        if let Some(&handle) = self.weights.get(&spec.name) {
            return Ok(handle);
        }
        // `check` has established that every planned tensor is present.
        let entry = self.checkpoint.tensors.get(&spec.name).ok_or_else(|| FrontendError::Invalid {
            path: self.checkpoint.path.clone(),
            problems: vec![format!("missing tensor {}", spec.name)],
        })?;
        let handle = self.module.add_weight(spec.name.clone(), entry.ty.clone(), entry.data.clone());
        self.weights.insert(spec.name.clone(), handle);
        Ok(handle)
    }

    fn push(&mut self, op: Op, layer: Option<u32>) -> Result<Value, FrontendError> {
        self.module
            .push(op, layer)
            .map_err(|source| FrontendError::Lower { path: self.checkpoint.path.clone(), source })
    }

    fn matvec(
        &mut self,
        x: Value,
        weight: &TensorSpec,
        bias: Option<&TensorSpec>,
        layer: Option<u32>,
    ) -> Result<Value, FrontendError> {
        let weight = self.weight(weight)?;
        let bias = bias.map(|b| self.weight(b)).transpose()?;
        self.push(Op::MatVec { x, weight, bias }, layer)
    }

    fn rms_norm(&mut self, x: Value, weight: &TensorSpec, layer: Option<u32>) -> Result<Value, FrontendError> {
        let weight = self.weight(weight)?;
        let eps = self.checkpoint.config.rms_norm_eps;
        self.push(Op::RmsNorm { x, weight, eps }, layer)
    }

    fn build(mut self, plan: &ModelPlan) -> Result<Module, FrontendError> {
        let table = self.weight(&plan.embed)?;
        let mut x = self.push(Op::Embed { table }, None)?;
        for (index, layer) in plan.layers.iter().enumerate() {
            x = self.layer(x, index as u32, layer)?;
        }
        let normed = self.rms_norm(x, &plan.final_norm, None)?;
        let logits = self.matvec(normed, plan.lm_head.as_ref().unwrap_or(&plan.embed), None, None)?;
        self.module.output = Some(logits);
        waferc_ir::verify(&self.module)
            .map_err(|source| FrontendError::Lower { path: self.checkpoint.path.clone(), source })?;
        Ok(self.module)
    }

    fn layer(&mut self, x: Value, index: u32, plan: &LayerPlan) -> Result<Value, FrontendError> {
        let c = &self.checkpoint.config;
        let (heads, kv_heads, head_dim, rope) = (c.num_heads, c.num_kv_heads, c.head_dim, c.rope.clone());
        let at = Some(index);

        let h = self.rms_norm(x, &plan.input_norm, at)?;
        let [q_bias, k_bias, v_bias] = match &plan.qkv_bias {
            Some([q, k, v]) => [Some(q), Some(k), Some(v)],
            None => [None; 3],
        };
        let mut q = self.matvec(h, &plan.q, q_bias, at)?;
        let mut k = self.matvec(h, &plan.k, k_bias, at)?;
        let v = self.matvec(h, &plan.v, v_bias, at)?;
        if let Some([q_norm, k_norm]) = &plan.qk_norm {
            // A [head_dim] weight: the IR's RmsNorm normalises each head separately.
            q = self.rms_norm(q, q_norm, at)?;
            k = self.rms_norm(k, k_norm, at)?;
        }
        let q = self.push(Op::Rope { x: q, head_dim, rope: rope.clone() }, at)?;
        let k = self.push(Op::Rope { x: k, head_dim, rope }, at)?;
        let cache = self.module.add_cache(KvCache { layer: index, kv_heads, head_dim });
        // transformers' scaling is head_dim ** -0.5 in f64, applied as an f32 scalar.
        let scale = (1.0 / f64::from(head_dim).sqrt()) as f32;
        let (o_bias, sinks) = match &plan.o_bias_and_sinks {
            Some([bias, sinks]) => (Some(bias), Some(self.weight(sinks)?)),
            None => (None, None),
        };
        let window = plan.window;
        let attended = self.push(Op::Attention { q, k, v, cache, heads, scale, window, sinks }, at)?;
        let projected = self.matvec(attended, &plan.o, o_bias, at)?;
        let x = self.push(Op::Add { a: x, b: projected }, at)?;

        let h = self.rms_norm(x, &plan.post_attention_norm, at)?;
        let ffn = match &plan.ffn {
            FeedForward::Dense(mlp) => self.gated_mlp(h, mlp, at)?,
            FeedForward::Moe { router, top_k, normalize, experts } => {
                let logits = self.matvec(h, router, None, at)?;
                let routing = self.push(Op::RouterTopK { logits, top_k: *top_k, normalize: *normalize }, at)?;
                let mut outputs = Vec::with_capacity(experts.len());
                for (expert, mlp) in experts.iter().enumerate() {
                    let routed = self.push(Op::ExpertDispatch { x: h, routing, expert: expert as u32 }, at)?;
                    outputs.push(self.gated_mlp(routed, mlp, at)?);
                }
                self.push(Op::ExpertCombine { routing, experts: outputs }, at)?
            }
            FeedForward::GptOss(moe) => self.gpt_oss_moe(h, moe, at)?,
        };
        self.push(Op::Add { a: x, b: ffn }, at)
    }

    /// Router (with bias), top-k softmax over the chosen logits (the same function as a softmax
    /// over all, top-k and renormalised: `RouterTopK` with `normalize`), then per expert
    /// `down(swiglu(gate(x), up(x)))`, every projection with its bias.
    fn gpt_oss_moe(&mut self, h: Value, moe: &GptOssMoe, at: Option<u32>) -> Result<Value, FrontendError> {
        let logits = self.matvec(h, &moe.router, Some(&moe.router_bias), at)?;
        let routing = self.push(Op::RouterTopK { logits, top_k: moe.top_k, normalize: true }, at)?;
        let mut outputs = Vec::with_capacity(moe.experts as usize);
        for expert in 0..moe.experts {
            let w = self.expert_weights(moe, expert)?;
            let x = self.push(Op::ExpertDispatch { x: h, routing, expert }, at)?;
            let gate = self.push(Op::MatVec { x, weight: w[0], bias: Some(w[1]) }, at)?;
            let up = self.push(Op::MatVec { x, weight: w[2], bias: Some(w[3]) }, at)?;
            let act = self.push(Op::SwiGlu { gate, up, alpha: moe.alpha, limit: moe.limit }, at)?;
            outputs.push(self.push(Op::MatVec { x: act, weight: w[4], bias: Some(w[5]) }, at)?);
        }
        self.push(Op::ExpertCombine { routing, experts: outputs }, at)
    }

    /// One expert's `[gate, gate bias, up, up bias, down, down bias]` cut out of the fused
    /// tensors: gate rows are the even rows of gate_up (columns in transformers' layout), up the
    /// odd ones; transformers' `[in, out]` matrices are transposed to the IR's `[out, in]`.
    /// Copies (the fused layout has no per-expert row-major view); shape-only tensors stay absent.
    fn expert_weights(&mut self, moe: &GptOssMoe, expert: u32) -> Result<[Handle<Weight>; 6], FrontendError> {
        let (e, i, h) = (expert as usize, moe.width as usize, moe.hidden as usize);
        let tensors = &self.checkpoint.tensors;
        let entry = |spec: &TensorSpec| &tensors[&spec.name];
        let (gate_up, down) = (entry(&moe.gate_up), entry(&moe.down));
        let (gate_up_bias, down_bias) = (entry(&moe.gate_up_bias), entry(&moe.down_bias));
        let dtype = gate_up.ty.dtype;
        for t in [gate_up, down] {
            let fits = if moe.rows_are_outputs { t.ty.dtype == DType::Mxfp4 } else { !t.ty.dtype.is_block_quantized() };
            if !fits || t.ty.dtype != dtype {
                return Err(FrontendError::Invalid {
                    path: self.checkpoint.path.clone(),
                    problems: vec![format!(
                        "{}: tensor {} is {}: expected {} (gate_up_proj is {})",
                        t.file.display(),
                        if std::ptr::eq(t, gate_up) { &moe.gate_up.name } else { &moe.down.name },
                        t.ty,
                        if moe.rows_are_outputs { "MXFP4 _blocks/_scales" } else { "f32, bf16 or f16" },
                        gate_up.ty
                    )],
                });
            }
        }
        let prefix = moe.gate_up.name.trim_end_matches("gate_up_proj");
        let name = |what: &str| format!("{prefix}{expert}.{what}");
        let element = |t: &TensorEntry| t.ty.dtype.row_bytes(1).unwrap_or(0) as usize;
        let (gate, up, down_w) = if moe.rows_are_outputs {
            // Release layout: whole MXFP4 rows.
            let row = dtype.row_bytes(moe.hidden).unwrap_or(0) as usize;
            let down_row = dtype.row_bytes(moe.width).unwrap_or(0) as usize;
            (
                gather(gate_up, row, (0..i).map(|r| e * 2 * i + 2 * r)),
                gather(gate_up, row, (0..i).map(|r| e * 2 * i + 2 * r + 1)),
                gather(down, down_row * h, [e]),
            )
        } else {
            // transformers' [E, H, 2I] and [E, I, H]: transpose element by element.
            let size = element(gate_up);
            let down_size = element(down);
            (
                gather(gate_up, size, (0..i).flat_map(|r| (0..h).map(move |k| (e * h + k) * 2 * i + 2 * r))),
                gather(gate_up, size, (0..i).flat_map(|r| (0..h).map(move |k| (e * h + k) * 2 * i + 2 * r + 1))),
                gather(down, down_size, (0..h).flat_map(|r| (0..i).map(move |k| (e * i + k) * h + r))),
            )
        };
        let bias_size = element(gate_up_bias);
        let gate_bias = gather(gate_up_bias, bias_size, (0..i).map(|r| e * 2 * i + 2 * r));
        let up_bias = gather(gate_up_bias, bias_size, (0..i).map(|r| e * 2 * i + 2 * r + 1));
        let down_bias_bytes = gather(down_bias, element(down_bias) * h, [e]);
        let bias_dtype = gate_up_bias.ty.dtype;
        let parts = [
            (name("gate_proj.weight"), TensorType::new(dtype, [moe.width, moe.hidden]), gate),
            (name("gate_proj.bias"), TensorType::new(bias_dtype, [moe.width]), gate_bias),
            (name("up_proj.weight"), TensorType::new(dtype, [moe.width, moe.hidden]), up),
            (name("up_proj.bias"), TensorType::new(bias_dtype, [moe.width]), up_bias),
            (name("down_proj.weight"), TensorType::new(down.ty.dtype, [moe.hidden, moe.width]), down_w),
            (name("down_proj.bias"), TensorType::new(down_bias.ty.dtype, [moe.hidden]), down_bias_bytes),
        ];
        Ok(parts.map(|(name, ty, data)| self.module.add_weight(name, ty, data)))
    }

    fn gated_mlp(&mut self, x: Value, mlp: &GatedMlp, layer: Option<u32>) -> Result<Value, FrontendError> {
        let gate = self.matvec(x, &mlp.gate, None, layer)?;
        let activated = self.push(Op::Silu { x: gate }, layer)?;
        let up = self.matvec(x, &mlp.up, None, layer)?;
        let product = self.push(Op::Mul { a: activated, b: up }, layer)?;
        self.matvec(product, &mlp.down, None, layer)
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::frontend::config::parse_config;

    /// A shape-only checkpoint holding exactly the tensors `config` calls for, in f32.
    fn checkpoint(config: serde_json::Value) -> Checkpoint {
        let config = parse_config(&config.to_string(), Path::new("config.json")).unwrap();
        let tensors = ModelPlan::new(&config)
            .tensors()
            .into_iter()
            .map(|t| (t.name.clone(), entry(DType::F32, &t.shape, WeightBytes::Absent)))
            .collect();
        Checkpoint { config, tensors, path: PathBuf::from("ckpt") }
    }

    fn entry(dtype: DType, shape: &[u64], data: WeightBytes) -> TensorEntry {
        TensorEntry { ty: TensorType::new(dtype, shape), data, file: PathBuf::from("model.safetensors") }
    }

    fn qwen3_moe(extra: serde_json::Value) -> serde_json::Value {
        let mut c = serde_json::json!({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 40, "moe_intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2});
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        c
    }

    fn problems(checkpoint: &Checkpoint) -> Vec<String> {
        match lower(checkpoint) {
            Err(FrontendError::Invalid { problems, .. }) => problems,
            other => panic!("expected Invalid, found {other:?}"),
        }
    }

    #[test]
    fn qwen3_moe_dense_layers_keep_a_dense_mlp() {
        let ckpt = checkpoint(qwen3_moe(serde_json::json!({"mlp_only_layers": [1], "norm_topk_prob": false})));
        let module = lower(&ckpt).unwrap();
        let ops_in = |layer: u32, name: &str| {
            module.body.iter().filter(|(_, i)| i.layer == Some(layer) && i.op.name() == name).count()
        };
        assert_eq!([0, 1, 2].map(|l| ops_in(l, "expert_dispatch")), [4, 0, 4]);
        assert_eq!([0, 1, 2].map(|l| ops_in(l, "router_topk")), [1, 0, 1]);
        assert!(module.weight_by_name("model.layers.1.mlp.gate_proj.weight").is_some());
        let normalize: Vec<bool> = module
            .body
            .iter()
            .filter_map(|(_, i)| match i.op {
                Op::RouterTopK { normalize, .. } => Some(normalize),
                _ => None,
            })
            .collect();
        assert_eq!(normalize, [false, false]);
    }

    #[test]
    fn fused_experts_are_named_as_such() {
        let mut ckpt = checkpoint(qwen3_moe(serde_json::json!({})));
        ckpt.tensors.retain(|name, _| !name.starts_with("model.layers.2.mlp.experts."));
        let fused = entry(DType::F32, &[4, 16, 32], WeightBytes::Absent);
        ckpt.tensors.insert("model.layers.2.mlp.experts.gate_up_proj".into(), fused);
        let p = problems(&ckpt);
        assert_eq!(p.len(), 4 * 3 + 1, "{p:#?}");
        assert_eq!(p[0], "missing tensor model.layers.2.mlp.experts.0.gate_proj.weight (expected shape [8, 32])");
        assert!(p[12].starts_with(
            "model.safetensors: unexpected tensor model.layers.2.mlp.experts.gate_up_proj f32[4, 16, 32]"
        ));
        assert!(p[12].contains("experts fused into one tensor"), "{}", p[12]);
    }

    #[test]
    fn byte_counts_and_quantised_rows_are_checked() {
        let llama = serde_json::json!({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2, "tie_word_embeddings": true});
        let mut ckpt = checkpoint(llama);
        // A GGUF-style quantised table is fine; a quantised down_proj with 48-wide rows is not.
        ckpt.tensors.insert("model.embed_tokens.weight".into(), entry(DType::Q8_0, &[64, 32], WeightBytes::Absent));
        let down = "model.layers.0.mlp.down_proj.weight";
        ckpt.tensors.insert(down.into(), entry(DType::Q4_0, &[32, 48], WeightBytes::Absent));
        let norm = "model.norm.weight";
        ckpt.tensors.insert(norm.into(), entry(DType::F32, &[32], WeightBytes::owned(vec![0u8; 100])));
        // Harmless buffers are not reported as unexpected.
        let inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq";
        ckpt.tensors.insert(inv_freq.into(), entry(DType::F32, &[8], WeightBytes::Absent));
        assert_eq!(
            problems(&ckpt),
            [
                format!("model.safetensors: tensor {down} is q4_0[32, 48]: a q4_0 row must be a whole number of 32-element blocks"),
                format!("model.safetensors: tensor {norm} holds 100 bytes, but f32[32] needs 128"),
            ]
        );
    }

    #[test]
    fn unusable_tensors_are_reported_in_place_of_missing_ones() {
        let mut ckpt = checkpoint(qwen3_moe(serde_json::json!({})));
        ckpt.tensors.remove("model.norm.weight");
        let unusable = BTreeMap::from([
            ("model.norm.weight".to_string(), "f: tensor model.norm.weight is F64[32]".to_string()),
            ("extra".to_string(), "f: tensor extra is I64[1]".to_string()),
        ]);
        match lower_with_unusable(&ckpt, &unusable) {
            Err(FrontendError::Invalid { problems, .. }) => assert_eq!(
                problems,
                [
                    "f: tensor model.norm.weight is F64[32]",
                    "f: tensor extra is I64[1] (and qwen3_moe with 3 layers does not use it)"
                ]
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn edit_distance_counts_single_byte_edits() {
        assert_eq!(edit_distance("q_proj.bias", "q_proj.bias"), 0);
        assert_eq!(edit_distance("q_proj.bias", "q_proj.biases"), 2);
        assert_eq!(edit_distance("w1", "w3"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
