//! Dead code elimination.
//!
//! Removes every instruction the output does not depend on, then every weight and KV cache
//! no remaining instruction uses, and renumbers what is left densely in its original order.
//! Frontends emit only live code, but rewrites leave dead code behind (a pass that replaces
//! a subgraph leaves the old one), and an unused weight would otherwise be placed on the
//! wafer and loaded for nothing.
//!
//! The only side effect in the IR is `attention` appending to its KV cache, and only that
//! same attention reads the cache (in this and later decode steps), so an attention whose
//! result is dead is dead in every step and goes with its cache.

use waferc_ir::{Arena, DependencyGraph, Handle, Module};

use crate::error::PassError;
use crate::manager::Pass;

pub struct Dce;

impl Pass for Dce {
    fn name(&self) -> &'static str {
        "dce"
    }

    fn run(&self, module: &mut Module) -> Result<(), PassError> {
        *module = eliminate_dead_code(module);
        Ok(())
    }
}

/// A new handle for each kept entity of an arena of `len` items: `None` for dropped ones.
fn renumber(keep: &[bool]) -> Vec<Option<usize>> {
    let mut next = 0;
    keep.iter()
        .map(|&k| {
            k.then(|| {
                next += 1;
                next - 1
            })
        })
        .collect()
}

/// The module without the instructions, weights and caches its output does not depend on.
pub fn eliminate_dead_code(module: &Module) -> Module {
    // Live: what the output depends on in the dependency graph.
    let live = match module.output {
        Some(output) => DependencyGraph::new(module).depended_on_by(output.index()),
        None => vec![false; module.body.len()],
    };

    let mut weight_used = vec![false; module.weights.len()];
    let mut cache_used = vec![false; module.caches.len()];
    for (handle, instr) in module.body.iter() {
        if !live[handle.index()] {
            continue;
        }
        for w in instr.op.weights() {
            if let Some(flag) = weight_used.get_mut(w.index()) {
                *flag = true;
            }
        }
        if let Some(flag) = instr.op.cache().and_then(|c| cache_used.get_mut(c.index())) {
            *flag = true;
        }
    }

    let value_map = renumber(&live);
    let weight_map = renumber(&weight_used);
    let cache_map = renumber(&cache_used);
    // Every handle a live instruction holds maps to a kept entity; the fallback only keeps a
    // malformed (unverified) input from panicking here: the verifier will name it.
    let remap = |map: &[Option<usize>], index: usize| map.get(index).copied().flatten().unwrap_or(index);

    let mut out = Module::new(module.meta.clone());
    out.weights = keep(&module.weights, &weight_used);
    out.caches = keep(&module.caches, &cache_used);
    for (handle, instr) in module.body.iter() {
        if live[handle.index()] {
            let mut instr = instr.clone();
            instr.op = instr.op.remap(
                |v| Handle::new(remap(&value_map, v.index())),
                |w| Handle::new(remap(&weight_map, w.index())),
                |c| Handle::new(remap(&cache_map, c.index())),
            );
            out.body.append(instr);
        }
    }
    out.output = module.output.map(|o| Handle::new(remap(&value_map, o.index())));
    out
}

fn keep<T: Clone>(arena: &Arena<T>, kept: &[bool]) -> Arena<T> {
    let mut out = Arena::new();
    for (handle, item) in arena.iter() {
        if kept[handle.index()] {
            out.append(item.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use waferc_ir::{text, verify, KvCache, ModelMeta, Op, TensorType, WeightBytes};

    fn module_with_dead_code() -> Module {
        let meta = ModelMeta { architecture: "test".into(), vocab_size: 4, num_layers: 1, ..Default::default() };
        let mut m = Module::new(meta);
        m.add_weight("unused", TensorType::f32([4, 8]), WeightBytes::Absent);
        let table = m.add_weight("table", TensorType::f32([4, 8]), WeightBytes::owned(vec![0u8; 128]));
        let dead_cache = m.add_cache(KvCache { layer: 0, kv_heads: 1, head_dim: 8 });
        let live_cache = m.add_cache(KvCache { layer: 1, kv_heads: 1, head_dim: 8 });
        let x = m.push(Op::Embed { table }, None).unwrap();
        let dead = m
            .push(
                Op::Attention { q: x, k: x, v: x, cache: dead_cache, heads: 1, scale: 0.5, window: None, sinks: None },
                Some(0),
            )
            .unwrap();
        m.push(Op::Silu { x: dead }, Some(0)).unwrap();
        let a = m
            .push(
                Op::Attention { q: x, k: x, v: x, cache: live_cache, heads: 1, scale: 0.5, window: None, sinks: None },
                Some(1),
            )
            .unwrap();
        let head = m.add_weight("head", TensorType::f32([4, 8]), WeightBytes::Absent);
        m.output = Some(m.push(Op::MatVec { x: a, weight: head, bias: None }, None).unwrap());
        m
    }

    #[test]
    fn removes_dead_instructions_weights_and_caches_and_renumbers() {
        let m = module_with_dead_code();
        verify(&m).unwrap();
        let out = eliminate_dead_code(&m);
        verify(&out).unwrap();
        assert_eq!(
            text::print(&out),
            "module architecture=test vocab_size=4 num_layers=1 eos_token_ids=[]\n\
             \n\
             weight @table : f32[4, 8]\n\
             weight @head : f32[4, 8]\n\
             \n\
             kv_cache #0 layer=1 kv_heads=1 head_dim=8\n\
             \n\
             %0 = embed @table : f32[8]\n\
             layer 1 {\n\
             \x20 %1 = attention %0, %0, %0, #0 heads=1 scale=0.5 : f32[8]\n\
             }\n\
             %2 = matvec %1, @head : f32[4]\n\
             output %2\n"
        );
        assert_eq!(out.weights[Handle::new(0)].data.bytes().map(<[u8]>::len), Some(128), "bytes kept by reference");
    }

    #[test]
    fn a_module_without_dead_code_is_unchanged() {
        let m = eliminate_dead_code(&module_with_dead_code());
        assert_eq!(text::print(&eliminate_dead_code(&m)), text::print(&m));
    }
}
