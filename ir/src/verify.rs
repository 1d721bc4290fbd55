//! Type inference and the verifier. `Module::push` infers each result type; `verify` re-checks a
//! whole module (after parsing or after a pass): operands defined before use, handles in range,
//! shapes and dtypes consistent, recorded types equal to inferred ones.

use crate::arena::Handle;
use crate::error::IrError;
use crate::module::{Instr, Module};
use crate::op::{Op, Value};
use crate::types::{DType, TensorType, ValueType};

/// Checks the whole module.
pub fn verify(module: &Module) -> Result<(), IrError> {
    for (handle, instr) in module.body.iter() {
        let inferred = infer_type(module, handle, &instr.op)?;
        if inferred != instr.ty {
            return Err(err(handle, &instr.op, format!("recorded type {} but operands give {}", instr.ty, inferred)));
        }
    }
    let output = module.output.ok_or(IrError::NoOutput)?;
    let vocab = module.meta.vocab_size as u64;
    match module.body.get(output).map(|i| &i.ty) {
        Some(ValueType::Tensor(t)) if t.shape == [vocab] => Ok(()),
        Some(ty) => Err(IrError::Verify {
            value: output.index(),
            op: module.body[output].op.name(),
            message: format!("output must be f32[{vocab}] (the vocabulary), found {ty}"),
        }),
        None => {
            Err(IrError::Verify { value: output.index(), op: "output", message: "output names no instruction".into() })
        }
    }
}

fn err(at: Handle<Instr>, op: &Op, message: String) -> IrError {
    IrError::Verify { value: at.index(), op: op.name(), message }
}

/// The result type of `op` if it were the instruction `at` of `module`.
pub fn infer_type(module: &Module, at: Handle<Instr>, op: &Op) -> Result<ValueType, IrError> {
    let fail = |message: String| err(at, op, message);
    for operand in op.operands() {
        if operand.index() >= at.index() {
            return Err(fail(format!("operand %{} is not defined before use", operand.index())));
        }
    }
    for w in op.weights() {
        if module.weights.get(w).is_none() {
            return Err(fail(format!("weight #{} does not exist", w.index())));
        }
    }
    let vector = |v: Value| -> Result<u64, IrError> {
        match &module.body[v].ty {
            ValueType::Tensor(t) if t.dtype == DType::F32 && t.shape.len() == 1 => Ok(t.shape[0]),
            other => Err(fail(format!("operand %{} must be an f32 vector, found {other}", v.index()))),
        }
    };
    let routing = |v: Value| -> Result<(u32, u32), IrError> {
        match &module.body[v].ty {
            ValueType::Routing { experts, top_k } => Ok((*experts, *top_k)),
            other => Err(fail(format!("operand %{} must be a routing, found {other}", v.index()))),
        }
    };
    let weight = |w: Handle<crate::module::Weight>| &module.weights[w];
    let vec_ty = |n: u64| Ok(ValueType::Tensor(TensorType::f32([n])));

    match op {
        Op::Embed { table } => {
            let t = &weight(*table).ty;
            if t.shape.len() != 2 {
                return Err(fail(format!("embedding table {} must be 2-D, found {}", weight(*table).name, t)));
            }
            vec_ty(t.shape[1])
        }
        Op::RmsNorm { x, weight: w, eps } => {
            let n = vector(*x)?;
            let wt = &weight(*w).ty;
            if wt.shape.len() != 1 || wt.shape[0] == 0 || n % wt.shape[0] != 0 {
                return Err(fail(format!(
                    "norm weight {} is {} but the input has {n} elements (need one group length dividing it)",
                    weight(*w).name,
                    wt
                )));
            }
            if eps.is_nan() || *eps <= 0.0 {
                return Err(fail(format!("eps must be positive, found {eps}")));
            }
            vec_ty(n)
        }
        Op::MatVec { x, weight: w, bias } => {
            let n = vector(*x)?;
            let wt = &weight(*w).ty;
            if wt.shape.len() != 2 || wt.shape[1] != n {
                return Err(fail(format!("weight {} is {} but the input has {n} elements", weight(*w).name, wt)));
            }
            if let Some(b) = bias {
                let bt = &weight(*b).ty;
                if bt.shape != [wt.shape[0]] {
                    return Err(fail(format!(
                        "bias {} is {} but the weight has {} rows",
                        weight(*b).name,
                        bt,
                        wt.shape[0]
                    )));
                }
            }
            vec_ty(wt.shape[0])
        }
        Op::Rope { x, head_dim, .. } => {
            let n = vector(*x)?;
            if *head_dim == 0 || head_dim % 2 != 0 || n % *head_dim as u64 != 0 {
                return Err(fail(format!("head_dim {head_dim} must be even and divide the input's {n} elements")));
            }
            vec_ty(n)
        }
        Op::Attention { q, k, v, cache, heads, scale, window, sinks } => {
            let c =
                module.caches.get(*cache).ok_or_else(|| fail(format!("cache #{} does not exist", cache.index())))?;
            let (nq, nk, nv) = (vector(*q)?, vector(*k)?, vector(*v)?);
            let kv_len = c.kv_heads as u64 * c.head_dim as u64;
            if *heads == 0 || c.kv_heads == 0 || heads % c.kv_heads != 0 {
                return Err(fail(format!("{heads} query heads cannot share {} KV heads evenly", c.kv_heads)));
            }
            if nq != *heads as u64 * c.head_dim as u64 {
                return Err(fail(format!("q has {nq} elements, expected {heads} heads x {}", c.head_dim)));
            }
            if nk != kv_len || nv != kv_len {
                return Err(fail(format!("k has {nk} and v {nv} elements, the cache holds {kv_len} per position")));
            }
            if !scale.is_finite() {
                return Err(fail(format!("scale must be finite, found {scale}")));
            }
            if *window == Some(0) {
                return Err(fail("a sliding window must hold at least one position".to_string()));
            }
            if let Some(s) = sinks {
                let st = &weight(*s).ty;
                if st.shape != [*heads as u64] || st.dtype.is_block_quantized() {
                    return Err(fail(format!(
                        "sinks {} is {st} but there are {heads} query heads (one unquantised logit each)",
                        weight(*s).name
                    )));
                }
            }
            vec_ty(nq)
        }
        Op::Silu { x } => vec_ty(vector(*x)?),
        Op::SwiGlu { alpha, limit, .. } if !alpha.is_finite() || limit.is_nan() || *limit <= 0.0 => {
            Err(fail(format!("alpha {alpha} must be finite and limit {limit} positive")))
        }
        Op::SwiGlu { gate: a, up: b, .. } | Op::Mul { a, b } | Op::Add { a, b } => {
            let (na, nb) = (vector(*a)?, vector(*b)?);
            if na != nb {
                return Err(fail(format!("operands have {na} and {nb} elements")));
            }
            vec_ty(na)
        }
        Op::RouterTopK { logits, top_k, .. } => {
            let n = vector(*logits)?;
            if *top_k == 0 || *top_k as u64 > n {
                return Err(fail(format!("top_k {top_k} must be between 1 and the {n} experts")));
            }
            Ok(ValueType::Routing { experts: n as u32, top_k: *top_k })
        }
        Op::ExpertDispatch { x, routing: r, expert } => {
            let n = vector(*x)?;
            let (experts, _) = routing(*r)?;
            if *expert >= experts {
                return Err(fail(format!("expert {expert} out of range for {experts} experts")));
            }
            vec_ty(n)
        }
        Op::ExpertCombine { routing: r, experts } => {
            let (count, _) = routing(*r)?;
            if experts.len() != count as usize {
                return Err(fail(format!("{} expert outputs for a routing over {count} experts", experts.len())));
            }
            let mut n = None;
            for e in experts {
                let len = vector(*e)?;
                if n.is_some_and(|n| n != len) {
                    return Err(fail(format!("expert outputs differ in length ({} vs {len})", n.unwrap())));
                }
                n = Some(len);
            }
            vec_ty(n.unwrap_or(0))
        }
        Op::Slice { x, offset, len } => {
            let n = vector(*x)?;
            if *len == 0 || *offset as u64 + *len as u64 > n {
                return Err(fail(format!("slice {offset}..{} of {n} elements", *offset as u64 + *len as u64)));
            }
            vec_ty(*len as u64)
        }
    }
}
