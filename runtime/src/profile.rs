//! Recording a routing profile: the reference decoder runs each prompt and every MoE router's
//! decision at every position is counted (`waferc profile`, `compile --calibrate`).

use waferc_ir::wafer::{LayerProfile, RoutingProfile};
use waferc_ir::{Module, Op, ValueType};

use crate::reference::{InstrValue, ReferenceDecoder};
use crate::RuntimeError;

/// Runs the reference decoder over each prompt (from position 0, one step per token) and
/// counts, per MoE layer, how often each expert and each pair of experts is picked. `source`
/// says where the prompts came from. A module without MoE layers gives an empty profile.
pub fn record_profile(module: &Module, prompts: &[Vec<u32>], source: &str) -> Result<RoutingProfile, RuntimeError> {
    // (router instruction, its layer profile), in program (= layer) order.
    let mut routers: Vec<(usize, LayerProfile)> = Vec::new();
    for (handle, instr) in module.body.iter() {
        if let Op::RouterTopK { logits, top_k, .. } = &instr.op {
            let experts = match &module.body[*logits].ty {
                ValueType::Tensor(t) => t.elements() as u32,
                ValueType::Routing { .. } => 0,
            };
            let layer = instr.layer.unwrap_or(0);
            routers.push((handle.index(), LayerProfile::new(layer, experts, *top_k)));
        }
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    if !routers.is_empty() && longest > 0 {
        let mut decoder = ReferenceDecoder::new(module, longest)?;
        decoder.record_values(true);
        for prompt in prompts {
            decoder.reset();
            for &token in prompt {
                decoder.step(token)?;
                let values = decoder.last_values().expect("values are recorded");
                for (index, layer) in &mut routers {
                    if let InstrValue::Routing(routing) = &values[*index] {
                        let chosen: Vec<u32> = routing.chosen.iter().map(|(e, _)| *e).collect();
                        layer.record(&chosen);
                    }
                }
            }
        }
    }
    Ok(RoutingProfile { source: source.to_string(), layers: routers.into_iter().map(|(_, l)| l).collect() })
}
