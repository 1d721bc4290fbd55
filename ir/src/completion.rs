//! Which instructions have finished all their work, on every PE, before a value's first element
//! exists: the order a PE's working buffers may share SRAM by (`wafer::PeImage`). An operand
//! buffer is written no earlier than its value's first element exists and is dead once its
//! instruction is done, so the buffers of `a` and `b` may overlap when `a` is done before `b`'s
//! operand exists, or the other way round.
//!
//! Dataflow gives the relation at two grains, per value `v`:
//!
//! * `whole(v)`: instructions done before `v`'s *last* element exists. An instruction is done
//!   once its whole result exists (its last work produces its last element: a matvec's last
//!   reduction, attention's last head), so `whole(v)` holds `v` and, since the whole result
//!   needs the whole of each operand, `whole(o)` of every operand `o`. A slice is the exception:
//!   its whole needs only its part of the source, so slices of one source are counted by the
//!   elements they cover, and the source (with its `whole`) joins once they cover all of it
//!   (attention reading the q, k and v of one fused matvec; a product of its gate and up halves).
//! * `first(v)`: instructions done before `v`'s *first* element exists. For an op each of whose
//!   output elements reads every input element (a matvec, a norm of one group, the router's
//!   top-k) it is the `whole` of its operands; for the others (elementwise ops, rope, per-head
//!   norms, attention, which works per head, and the views) the union of the operands' `first`.
//!
//! A result is dead once every instruction that reads it (through slices) is done, so a PE's
//! result regions share SRAM by the same relation ([`Completion::dead_before`]). Only a result
//! read within its own layer is ever dead: a layer's values live in one region of the wafer, and
//! with several sequences in flight a region may start the next sequence while the next region
//! still reads this one's last value (the residual stream crossing). The step's output (read
//! by no instruction) is never dead.
//!
//! An expert's values may be absent (an unchosen expert does no work and receives nothing), so
//! only instructions computed without an `expert_dispatch` are tracked ([`Completion::done_before`]
//! is false for the others), and an `expert_combine` keeps what every expert's value has in
//! common: any chosen expert may be the one whose value comes first.

use std::ops::Range;

use crate::dependency::DataReaders;
use crate::module::Module;
use crate::op::Op;
use crate::types::ValueType;

/// The relation described in the module documentation, as bit sets over the tracked
/// instructions.
pub struct Completion {
    /// Per instruction, its bit among the tracked ones.
    slot: Vec<Option<u32>>,
    words: usize,
    /// `first(v)` of instruction `v`: `words` words from `v * words`.
    first: Vec<u64>,
    /// Per instruction, the instructions that read its result (through slices), when they are
    /// all in its layer; `None` when its result lives to the end of the step.
    readers: Vec<Option<Box<[u32]>>>,
}

/// `whole(v)`: the instructions wholly done, and sliced sources partly covered.
#[derive(Clone, Default)]
struct Whole {
    done: Vec<u64>,
    covered: Vec<(usize, Vec<Range<u64>>)>,
}

impl Completion {
    pub fn new(module: &Module) -> Completion {
        let n = module.body.len();
        let mut absent = vec![false; n];
        let mut slot = vec![None; n];
        let mut tracked = 0u32;
        for (handle, instr) in module.body.iter() {
            let i = handle.index();
            absent[i] = match &instr.op {
                Op::ExpertDispatch { .. } => true,
                Op::ExpertCombine { .. } => false,
                op => op.operands().iter().any(|o| absent.get(o.index()).copied().unwrap_or(false)),
            };
            if !absent[i] {
                slot[i] = Some(tracked);
                tracked += 1;
            }
        }
        let words = (tracked as usize).div_ceil(64);
        let mut first = vec![0u64; n * words];
        let mut whole: Vec<Whole> = Vec::with_capacity(n);
        let len = |v: usize| match module.body.get(crate::Handle::new(v)).map(|i| &i.ty) {
            Some(ValueType::Tensor(t)) => t.elements(),
            _ => 0,
        };
        for (handle, instr) in module.body.iter() {
            let i = handle.index();
            let operands: Vec<usize> = instr.op.operands().iter().map(|o| o.index()).filter(|&o| o < i).collect();
            let first_of = |o: usize| -> &[u64] {
                let src = match &module.body[crate::Handle::new(o)].op {
                    Op::Slice { x, .. } if x.index() < o => x.index(),
                    _ => o,
                };
                &first[src * words..(src + 1) * words]
            };
            // What the whole of operand `o` needs (a slice does no work: it is done as it is named).
            let needs = |o: usize| -> Whole {
                match &module.body[crate::Handle::new(o)].op {
                    Op::Slice { x, offset, len } if x.index() < o => {
                        let mut done = first_of(x.index()).to_vec();
                        if let Some(s) = slot[o] {
                            done[s as usize / 64] |= 1 << (s % 64);
                        }
                        let part = *offset as u64..*offset as u64 + *len as u64;
                        Whole { done, covered: vec![(x.index(), Vec::from([part]))] }
                    }
                    _ => whole[o].clone(),
                }
            };
            let mut own = Whole { done: vec![0; words], covered: Vec::new() };
            let mut first_own = vec![0u64; words];
            match &instr.op {
                Op::ExpertCombine { routing, experts } => {
                    own.join(&needs(routing.index()), &whole, &len);
                    union(&mut first_own, first_of(routing.index()));
                    let mut common: Option<(Vec<u64>, Vec<u64>)> = None;
                    for e in experts.iter().map(|e| e.index()).filter(|&e| e < i) {
                        let (w, f) = (needs(e).done, first_of(e).to_vec());
                        common = Some(match common {
                            None => (w, f),
                            Some((cw, cf)) => (intersect(cw, &w), intersect(cf, &f)),
                        });
                    }
                    if let Some((w, f)) = common {
                        union(&mut own.done, &w);
                        union(&mut first_own, &f);
                    }
                }
                op => {
                    for &o in &operands {
                        own.join(&needs(o), &whole, &len);
                    }
                    match reads_every_element(module, op) {
                        true => first_own.copy_from_slice(&own.done),
                        false => operands.iter().for_each(|&o| union(&mut first_own, first_of(o))),
                    }
                }
            }
            if let Some(s) = slot[i] {
                own.done[s as usize / 64] |= 1 << (s % 64);
            }
            first[i * words..(i + 1) * words].copy_from_slice(&first_own);
            whole.push(own);
        }
        Completion { slot, words, first, readers: same_layer_readers(module) }
    }

    /// Whether instruction `a` has finished all its work before value `v`'s first element exists
    /// (false when `a` is not tracked, or either names no instruction).
    pub fn done_before(&self, a: usize, v: usize) -> bool {
        match self.slot.get(a).copied().flatten() {
            Some(s) if v < self.slot.len() => self.first[v * self.words + s as usize / 64] & (1 << (s % 64)) != 0,
            _ => false,
        }
    }

    /// Whether value `a` is dead before value `v`'s first element exists: every instruction that
    /// reads `a` (through slices), all in `a`'s layer, is done by then (false when `a` is read
    /// outside its layer or by nothing, or either names no instruction).
    pub fn dead_before(&self, a: usize, v: usize) -> bool {
        match self.readers.get(a) {
            Some(Some(readers)) => readers.iter().all(|&r| self.done_before(r as usize, v)),
            _ => false,
        }
    }
}

/// Per instruction, its readers (a view's readers count as its source's, [`DataReaders`]) when
/// there are some and all share its layer.
fn same_layer_readers(module: &Module) -> Vec<Option<Box<[u32]>>> {
    let layer = |i: usize| module.body[crate::Handle::new(i)].layer;
    DataReaders::new(module)
        .readers
        .into_iter()
        .enumerate()
        .map(|(i, list)| {
            let local = !list.is_empty() && list.iter().all(|&r| layer(r as usize) == layer(i));
            local.then(|| list.into_boxed_slice())
        })
        .collect()
}

impl Whole {
    /// Adds what `other` needs; a source whose slices now cover it joins with its own `whole`.
    fn join(&mut self, other: &Whole, whole: &[Whole], len: &dyn Fn(usize) -> u64) {
        union(&mut self.done, &other.done);
        for (source, ranges) in &other.covered {
            match self.covered.iter_mut().find(|(s, _)| s == source) {
                Some((_, mine)) => mine.extend(ranges.iter().cloned()),
                None => self.covered.push((*source, ranges.clone())),
            }
        }
        let mut promoted = Vec::new();
        self.covered.retain_mut(|(source, ranges)| {
            ranges.sort_by_key(|r| r.start);
            let mut reach = 0;
            for r in ranges.iter() {
                if r.start > reach {
                    break;
                }
                reach = reach.max(r.end);
            }
            let all = reach >= len(*source) && len(*source) > 0;
            if all {
                promoted.push(*source);
            }
            !all
        });
        for source in promoted {
            union(&mut self.done, &whole[source].done);
        }
    }
}

/// Whether every output element of `op` reads every element of its operand.
fn reads_every_element(module: &Module, op: &Op) -> bool {
    match op {
        Op::MatVec { .. } | Op::RouterTopK { .. } => true,
        Op::RmsNorm { x, weight, .. } => {
            let groups = module.weights.get(*weight).and_then(|w| w.ty.shape.first().copied());
            let len = match module.body.get(*x).map(|i| &i.ty) {
                Some(ValueType::Tensor(t)) => Some(t.elements()),
                _ => None,
            };
            groups.is_some() && groups == len
        }
        _ => false,
    }
}

fn union(into: &mut [u64], other: &[u64]) {
    into.iter_mut().zip(other).for_each(|(a, b)| *a |= b);
}

fn intersect(mut a: Vec<u64>, b: &[u64]) -> Vec<u64> {
    a.iter_mut().zip(b).for_each(|(x, y)| *x &= y);
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One dense layer with fused q/k/v and gate/up, then a second layer's norm and q/k/v.
    const LAYER: &str = "
module architecture=test vocab_size=4 num_layers=2 eos_token_ids=[]
weight @table : f32[4, 64]
weight @n1 : f32[64]
weight @qkv : f32[128, 64]
weight @o : f32[64, 64]
weight @n2 : f32[64]
weight @gu : f32[256, 64]
weight @down : f32[64, 128]
weight @qkv1 : f32[128, 64]
kv_cache #0 layer=0 kv_heads=2 head_dim=16
%0 = embed @table : f32[64]
layer 0 {
  %1 = rms_norm %0, @n1 eps=1e-5 : f32[64]
  %2 = matvec %1, @qkv : f32[128]
  %3 = slice %2 offset=0 len=64 : f32[64]
  %4 = slice %2 offset=64 len=32 : f32[32]
  %5 = slice %2 offset=96 len=32 : f32[32]
  %6 = rope %3 head_dim=16 theta=10000.0 : f32[64]
  %7 = rope %4 head_dim=16 theta=10000.0 : f32[32]
  %8 = attention %6, %7, %5, #0 heads=4 scale=0.25 : f32[64]
  %9 = matvec %8, @o : f32[64]
  %10 = add %0, %9 : f32[64]
  %11 = rms_norm %10, @n2 eps=1e-5 : f32[64]
  %12 = matvec %11, @gu : f32[256]
  %13 = slice %12 offset=0 len=128 : f32[128]
  %14 = slice %12 offset=128 len=128 : f32[128]
  %15 = silu %13 : f32[128]
  %16 = mul %15, %14 : f32[128]
  %17 = matvec %16, @down : f32[64]
  %18 = add %10, %17 : f32[64]
}
layer 1 {
  %19 = rms_norm %18, @n1 eps=1e-5 : f32[64]
  %20 = matvec %19, @qkv1 : f32[128]
}
output %20
";

    /// `done_before(a, v)` for every pair, as the instructions `a` done before each `v`.
    fn done(text: &str) -> Vec<Vec<usize>> {
        let module = crate::text::parse(text).expect("test module parses");
        let completion = Completion::new(&module);
        let n = module.body.len();
        (0..n).map(|v| (0..n).filter(|&a| completion.done_before(a, v)).collect()).collect()
    }

    #[test]
    fn a_head_wise_value_waits_for_no_matvec_before_it_but_a_norm_waits_for_all() {
        let done = done(LAYER);
        // Attention works per head: its first head's output needs one head of q/k/v only, so
        // the q/k/v matvec may still be busy elsewhere (its buffers cannot share with o's).
        assert_eq!(done[8], vec![0, 1]);
        // o's result reads every element of attention's output, which needs all of q/k/v.
        assert_eq!(done[9], (0..=8).collect::<Vec<_>>());
        // The norm reads every element of the residual, which needs every head, so the whole
        // of q/k/v (its three slices cover it) and o.
        assert_eq!(done[11], (0..=10).collect::<Vec<_>>());
        // The down projection's input starts with one gate/up row pair: gate/up may still run.
        assert_eq!(done[16], (0..=11).collect::<Vec<_>>());
        // The next layer's norm waits for everything before it.
        assert_eq!(done[19], (0..=18).collect::<Vec<_>>());
    }

    #[test]
    fn a_result_is_dead_once_its_readers_in_its_layer_are_done() {
        let module = crate::text::parse(LAYER).expect("test module parses");
        let completion = Completion::new(&module);
        let dead =
            |a: usize| -> Vec<usize> { (0..module.body.len()).filter(|&v| completion.dead_before(a, v)).collect() };
        // o's result is read by the residual add alone, which the norm after it waits for.
        assert_eq!(dead(9), (11..=20).collect::<Vec<_>>());
        // gate/up is read through its slices, by SiLU and the product: dead once the down
        // projection (which reads every element of the product) has its first element.
        assert_eq!(dead(12), (17..=20).collect::<Vec<_>>());
        // The residual after attention is read twice in its layer, last by the layer's last add.
        assert_eq!(dead(10), (19..=20).collect::<Vec<_>>());
        // A value read in the next layer (the residual stream crossing), from outside any layer
        // (the embedding) or by nothing (the step's output) lives to the end of the step.
        assert!(dead(18).is_empty() && dead(0).is_empty() && dead(20).is_empty());
    }

    #[test]
    fn experts_are_not_tracked_and_their_combine_keeps_what_every_expert_waits_for() {
        let moe = "
module architecture=test vocab_size=4 num_layers=1 eos_token_ids=[]
weight @table : f32[4, 64]
weight @n : f32[64]
weight @router : f32[2, 64]
weight @up0 : f32[64, 64]
weight @up1 : f32[64, 64]
%0 = embed @table : f32[64]
layer 0 {
  %1 = rms_norm %0, @n eps=1e-5 : f32[64]
  %2 = matvec %1, @router : f32[2]
  %3 = router_topk %2 top_k=1 normalize : routing[2, top1]
  %4 = expert_dispatch %1, %3 expert=0 : f32[64]
  %5 = matvec %4, @up0 : f32[64]
  %6 = expert_dispatch %1, %3 expert=1 : f32[64]
  %7 = matvec %6, @up1 : f32[64]
  %8 = expert_combine %3, %5, %7 : f32[64]
  %9 = rms_norm %8, @n eps=1e-5 : f32[64]
}
output %9
";
        let done = done(moe);
        // An expert's matvec may never run (an unchosen expert receives nothing), so nothing
        // is said to wait for it, not even the norm after the combine.
        assert!(done.iter().all(|waits| !waits.contains(&5) && !waits.contains(&7)), "{done:?}");
        // An expert's matvec reads its whole input, which exists once the router has chosen.
        assert_eq!(done[5], vec![0, 1, 2, 3]);
        // The combine waits for what every expert waits for; the norm after it, for the combine.
        assert_eq!(done[8], vec![0, 1, 2, 3]);
        assert_eq!(done[9], vec![0, 1, 2, 3, 8]);
    }

    #[test]
    fn a_slice_that_does_not_cover_its_source_keeps_the_source_pending() {
        // Drop the v slice from attention's reads (k read twice): the norm after it no longer
        // waits for the whole q/k/v matvec.
        let partial = LAYER.replace("%8 = attention %6, %7, %5,", "%8 = attention %6, %7, %4,");
        let done = done(&partial);
        assert!(!done[11].contains(&2), "{:?}", done[11]);
        assert!(done[11].contains(&9));
    }
}
