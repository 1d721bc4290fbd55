//! The executor's modeled timeline as a Chrome trace-event file (the JSON object format that
//! Perfetto and chrome://tracing read): one process for the wafer, one track per decoder layer
//! (plus one for the embedding and head, and one for whole tokens), a complete event ("X") per
//! schedule step, named by op and phase, categorised as compute or collective, with its compute,
//! communication and waiting cycles as args; a nested "waiting for links" slice (category `wait`)
//! at the end of a step shows how much later link contention made it end, and whose message held
//! the link its longest-waiting route waited for (`held_by`); each token's slice
//! carries its critical path by layer (compute, communication, waiting).

use std::collections::BTreeSet;

use serde_json::{json, Value};
use waferc_ir::wafer::{Phase, WaferProgram};
use waferc_runtime::executor::StepTiming;

/// Track ids: 0 holds whole tokens, 1 the instructions outside any layer, `2 + l` layer `l`.
const TOKEN_TRACK: u64 = 0;
const OUTSIDE_LAYERS_TRACK: u64 = 1;

fn track_of(layer: Option<u32>) -> u64 {
    layer.map_or(OUTSIDE_LAYERS_TRACK, |l| 2 + l as u64)
}

/// Whether a phase moves data between PEs (a collective) rather than computing locally.
fn is_collective(phase: Phase) -> bool {
    !matches!(phase, Phase::Compute | Phase::Finish)
}

/// The trace of `steps` (one per position run), laid end to end in modeled time.
pub fn chrome_trace(program: &WaferProgram, steps: &[StepTiming]) -> Value {
    let micros = |cycles: u64| cycles as f64 / program.target.clock_hz * 1e6;
    let mut events = Vec::new();
    let mut layers = BTreeSet::new();
    let mut offset = 0u64;
    for step in steps {
        events.push(json!({
            "name": format!("position {}", step.position),
            "cat": "token",
            "ph": "X",
            "pid": 0,
            "tid": TOKEN_TRACK,
            "ts": micros(offset),
            "dur": micros(step.cycles),
            "args": {
                "cycles": step.cycles,
                "critical_path": step.layers.iter().map(|l| json!({
                    "layer": l.layer,
                    "cycles": l.cycles,
                    "compute_cycles": l.compute_cycles,
                    "comm_cycles": l.comm_cycles,
                    "wait_cycles": l.wait_cycles,
                })).collect::<Vec<_>>(),
            },
        }));
        for span in &step.spans {
            layers.insert(span.layer);
            let mut args = json!({
                "instr": span.instr,
                "step": span.step,
                "cycles": span.duration_cycles,
                "compute_cycles": span.compute_cycles,
                "comm_cycles": span.comm_cycles,
                "wait_cycles": span.wait_cycles,
                "pes": span.pes,
                "routes": span.routes,
            });
            if let Some(expert) = span.expert {
                args["expert"] = json!(expert);
            }
            events.push(json!({
                "name": format!("{} %{} {:?}", span.op, span.instr, span.phase),
                "cat": if is_collective(span.phase) { "collective" } else { "compute" },
                "ph": "X",
                "pid": 0,
                "tid": track_of(span.layer),
                "ts": micros(offset + span.start_cycle),
                "dur": micros(span.duration_cycles),
                "args": args,
            }));
            // Waiting for busy links, nested at the end of the step it delays.
            if span.wait_cycles > 0 {
                let start = span.start_cycle + span.duration_cycles - span.wait_cycles;
                let mut args = json!({ "cycles": span.wait_cycles, "step": span.step });
                let held_by = span.waited_on.map(|i| {
                    args["held_by"] = json!(i);
                    match program.instrs.get(i as usize) {
                        _ if i == span.instr => " its own routes hold".to_string(),
                        Some(p) => format!(" held by {} %{i}", p.op),
                        None => format!(" held by %{i}"),
                    }
                });
                events.push(json!({
                    "name": format!("{} %{} {:?} waiting for links{}", span.op, span.instr, span.phase, held_by.unwrap_or_default()),
                    "cat": "wait",
                    "ph": "X",
                    "pid": 0,
                    "tid": track_of(span.layer),
                    "ts": micros(offset + start),
                    "dur": micros(span.wait_cycles),
                    "args": args,
                }));
            }
        }
        offset += step.cycles;
    }
    let name_track = |tid: u64, name: String| json!({ "name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": { "name": name } });
    let mut metadata = vec![
        json!({ "name": "process_name", "ph": "M", "pid": 0, "args": { "name": format!("wafer ({})", program.target.name) } }),
        name_track(TOKEN_TRACK, "tokens".into()),
    ];
    for layer in layers {
        let name = layer.map_or("embedding and head".to_string(), |l| format!("layer {l}"));
        metadata.push(name_track(track_of(layer), name));
    }
    metadata.extend(events);
    json!({ "traceEvents": metadata, "displayTimeUnit": "ns", "otherData": { "target": program.target.name, "clock_hz": program.target.clock_hz } })
}
