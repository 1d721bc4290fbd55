//! The module: weights, KV caches and one decode step's instructions, each in its own arena.

use crate::arena::{Arena, Handle};
use crate::error::IrError;
use crate::op::{Op, Value};
use crate::types::{TensorType, ValueType};
use crate::weights::WeightBytes;

/// A named parameter tensor. `data` is never printed: the text form names weights, it does
/// not carry them.
#[derive(Clone, Debug)]
pub struct Weight {
    pub name: String,
    pub ty: TensorType,
    pub data: WeightBytes,
}

/// One layer's key/value cache: `kv_heads` heads of `head_dim`, one row per position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCache {
    pub layer: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
}

/// One instruction: an op, its result type, and the decoder layer it belongs to (`None` for
/// the embedding and the head), which placement and diagnostics use.
#[derive(Clone, Debug, PartialEq)]
pub struct Instr {
    pub op: Op,
    pub ty: ValueType,
    pub layer: Option<u32>,
}

/// Facts about the model that are not part of the computation but that a driver needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelMeta {
    /// The checkpoint's architecture (`llama`, `qwen3_moe`, ...).
    pub architecture: String,
    pub vocab_size: u32,
    pub num_layers: u32,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Clone, Debug, Default)]
pub struct Module {
    pub meta: ModelMeta,
    pub weights: Arena<Weight>,
    pub caches: Arena<KvCache>,
    /// Instructions in program order: an operand always names an earlier instruction.
    pub body: Arena<Instr>,
    /// The logits row.
    pub output: Option<Value>,
}

impl Module {
    pub fn new(meta: ModelMeta) -> Self {
        Module { meta, ..Default::default() }
    }

    pub fn add_weight(&mut self, name: impl Into<String>, ty: TensorType, data: WeightBytes) -> Handle<Weight> {
        self.weights.append(Weight { name: name.into(), ty, data })
    }

    pub fn add_cache(&mut self, cache: KvCache) -> Handle<KvCache> {
        self.caches.append(cache)
    }

    /// Whether the module has an MoE layer (a router's routing decision).
    pub fn has_moe(&self) -> bool {
        self.body.iter().any(|(_, instr)| matches!(instr.ty, ValueType::Routing { .. }))
    }

    /// Appends an instruction, inferring and checking its result type.
    pub fn push(&mut self, op: Op, layer: Option<u32>) -> Result<Value, IrError> {
        let at = Handle::new(self.body.len());
        let ty = crate::verify::infer_type(self, at, &op)?;
        Ok(self.body.append(Instr { op, ty, layer }))
    }

    pub fn value_type(&self, value: Value) -> &ValueType {
        &self.body[value].ty
    }

    pub fn weight_by_name(&self, name: &str) -> Option<Handle<Weight>> {
        self.weights.iter().find(|(_, w)| w.name == name).map(|(h, _)| h)
    }
}
