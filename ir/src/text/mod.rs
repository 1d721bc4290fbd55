//! The IR's text form: stable, line-oriented and diff-friendly, in the spirit of Cranelift's
//! CLIF and MLIR's generic form. [`print()`] and [`parse()`] round-trip every module exactly,
//! except weight bytes, which the text names but does not carry (a parsed weight is
//! [`WeightBytes::Absent`](crate::WeightBytes::Absent)).
//!
//! ```text
//! ; comments run from `;` to the end of the line
//! module architecture=llama vocab_size=256 num_layers=1 bos_token_id=1 eos_token_ids=[2]
//!
//! weight @model.embed_tokens.weight : bf16[256, 64]
//! weight @model.layers.0.input_layernorm.weight : bf16[64]
//! weight @"names/with odd \"characters\"" : f32[64]
//!
//! kv_cache #0 layer=0 kv_heads=2 head_dim=16
//!
//! %0 = embed @model.embed_tokens.weight : f32[64]
//! layer 0 {
//!   %1 = rms_norm %0, @model.layers.0.input_layernorm.weight eps=1e-6 : f32[64]
//!   %2 = rope %1 head_dim=16 theta=10000.0 scaling=linear factor=2.0 : f32[64]
//!   %3 = attention %2, %4, %5, #0 heads=4 scale=0.25 : f32[64]
//!   %9 = router_topk %8 top_k=2 normalize : routing[8, top2]
//!   %10 = expert_dispatch %1, %9 expert=3 : f32[64]
//! }
//! %40 = matvec %39, @lm_head.weight : f32[256]
//! output %40
//! ```
//!
//! Each instruction is `%label = op operands attributes : result-type`. Operands come in the
//! order [`Op::operands`] and [`Op::weights`] list them, then a cache; attributes are
//! `key=value` or bare flags. Instructions of a decoder layer sit in a `layer N { ... }`
//! block; the embedding and the head sit outside any block. Floats print with Rust's `{:?}`,
//! the shortest text that parses back to the same bits. Names made of letters, digits, `_`,
//! `.` and `-` print bare; any other name is quoted with `\"`, `\\`, `\n`, `\t`, `\r` and
//! `\u{hex}` escapes. The printer numbers values and caches by their handles, so a compacted
//! module prints densely; the parser accepts any labels and numbers in definition order.
//!
//! The parser checks syntax and that every name is declared before use; the result type of
//! each instruction is kept as written, so [`verify()`](crate::verify()) reports a wrong one.

mod lexer;
mod parse;

use std::fmt::Write;

use crate::module::Module;
use crate::op::{Op, RopeScaling};

pub use parse::parse;

/// The module's text form. Never fails: a dangling handle in an invalid module prints as a
/// name the parser will reject, so a broken module can still be dumped and read.
pub fn print(module: &Module) -> String {
    let mut out = String::new();
    print_header(module, &mut out);

    if !module.weights.is_empty() {
        out.push('\n');
    }
    for (_, weight) in module.weights.iter() {
        let _ = writeln!(out, "weight @{} : {}", quote_if_needed(&weight.name), weight.ty);
    }

    if !module.caches.is_empty() {
        out.push('\n');
    }
    for (handle, cache) in module.caches.iter() {
        let _ = writeln!(
            out,
            "kv_cache #{} layer={} kv_heads={} head_dim={}",
            handle.index(),
            cache.layer,
            cache.kv_heads,
            cache.head_dim
        );
    }

    if !module.body.is_empty() {
        out.push('\n');
    }
    let mut open_layer: Option<u32> = None;
    for (handle, instr) in module.body.iter() {
        if instr.layer != open_layer {
            if open_layer.is_some() {
                out.push_str("}\n");
            }
            if let Some(layer) = instr.layer {
                let _ = writeln!(out, "layer {layer} {{");
            }
            open_layer = instr.layer;
        }
        let indent = if open_layer.is_some() { "  " } else { "" };
        let _ = writeln!(out, "{indent}%{} = {} : {}", handle.index(), op_text(module, &instr.op), instr.ty);
    }
    if open_layer.is_some() {
        out.push_str("}\n");
    }

    if let Some(output) = module.output {
        let _ = writeln!(out, "output %{}", output.index());
    }
    out
}

fn print_header(module: &Module, out: &mut String) {
    let meta = &module.meta;
    let _ = write!(
        out,
        "module architecture={} vocab_size={} num_layers={}",
        quote_if_needed(&meta.architecture),
        meta.vocab_size,
        meta.num_layers
    );
    if let Some(bos) = meta.bos_token_id {
        let _ = write!(out, " bos_token_id={bos}");
    }
    let eos: Vec<String> = meta.eos_token_ids.iter().map(u32::to_string).collect();
    let _ = writeln!(out, " eos_token_ids=[{}]", eos.join(", "));
}

/// `op operands attributes`, without the result.
fn op_text(module: &Module, op: &Op) -> String {
    let mut operands: Vec<String> = op.operands().iter().map(|v| format!("%{}", v.index())).collect();
    operands.extend(op.weights().iter().map(|&w| match module.weights.get(w) {
        Some(weight) => format!("@{}", quote_if_needed(&weight.name)),
        None => format!("@{}", quote(&format!("<missing weight #{}>", w.index()))),
    }));
    let mut attrs = Vec::new();
    match op {
        Op::Embed { .. } | Op::MatVec { .. } | Op::Silu { .. } | Op::Mul { .. } | Op::Add { .. } => {}
        Op::SwiGlu { alpha, limit, .. } => {
            attrs.push(format!("alpha={alpha:?}"));
            attrs.push(format!("limit={limit:?}"));
        }
        Op::ExpertCombine { .. } => {}
        Op::RmsNorm { eps, .. } => attrs.push(format!("eps={eps:?}")),
        Op::Rope { head_dim, rope, .. } => {
            attrs.push(format!("head_dim={head_dim}"));
            attrs.push(format!("theta={:?}", rope.theta));
            match &rope.scaling {
                RopeScaling::None => {}
                RopeScaling::Linear { factor } => {
                    attrs.push("scaling=linear".into());
                    attrs.push(format!("factor={factor:?}"));
                }
                RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                    attrs.push("scaling=llama3".into());
                    attrs.push(format!("factor={factor:?}"));
                    attrs.push(format!("low_freq_factor={low_freq_factor:?}"));
                    attrs.push(format!("high_freq_factor={high_freq_factor:?}"));
                    attrs.push(format!("original_max_position={original_max_position}"));
                }
                RopeScaling::Yarn { factor, beta_fast, beta_slow, original_max_position, truncate } => {
                    attrs.push("scaling=yarn".into());
                    attrs.push(format!("factor={factor:?}"));
                    attrs.push(format!("beta_fast={beta_fast:?}"));
                    attrs.push(format!("beta_slow={beta_slow:?}"));
                    attrs.push(format!("original_max_position={original_max_position}"));
                    if *truncate {
                        attrs.push("truncate".into());
                    }
                }
            }
        }
        Op::Attention { cache, heads, scale, window, .. } => {
            operands.push(format!("#{}", cache.index()));
            attrs.push(format!("heads={heads}"));
            attrs.push(format!("scale={scale:?}"));
            if let Some(window) = window {
                attrs.push(format!("window={window}"));
            }
        }
        Op::RouterTopK { top_k, normalize, .. } => {
            attrs.push(format!("top_k={top_k}"));
            if *normalize {
                attrs.push("normalize".into());
            }
        }
        Op::ExpertDispatch { expert, .. } => attrs.push(format!("expert={expert}")),
        Op::Slice { offset, len, .. } => {
            attrs.push(format!("offset={offset}"));
            attrs.push(format!("len={len}"));
        }
    }
    let mut text = op.name().to_string();
    if !operands.is_empty() {
        text.push(' ');
        text.push_str(&operands.join(", "));
    }
    for attr in attrs {
        text.push(' ');
        text.push_str(&attr);
    }
    text
}

/// Whether `name` can print without quotes after `@`. Excludes `+`, which a bare word may
/// contain only for the sake of float exponents.
fn is_bare_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// A name as it prints: after `@` for a weight, or as a string attribute value.
pub(crate) fn quote_if_needed(name: &str) -> String {
    if is_bare_name(name) {
        name.to_string()
    } else {
        quote(name)
    }
}

pub(crate) fn quote(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
