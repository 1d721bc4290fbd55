//! The chunk tree sum of NUMERICS.md, the one way every sum in waferc is grouped.
//!
//! `tree_sum(t[0..n))`:
//! 1. cut `t` into chunks of [`BLOCK`] = 32 consecutive terms (the last may be short);
//! 2. a chunk's value: [`LANES`] = 8 lanes, lane `l` accumulates terms `l, l+8, l+16, l+24` in
//!    that order starting from +0.0 (missing terms of a short chunk are skipped), then
//!    `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))` ([`combine_lanes`]);
//! 3. chunk values combine by a binary tree: one chunk is its own value; `c > 1` chunks, with
//!    `p` the smallest power of two `>= c` and `h = p / 2`, give `tree(0..h) + tree(h..c)`.
//!
//! The tree is the perfect binary tree over the chunks padded with +0.0 to a power of two: no
//! accumulator ever holds -0.0 (each starts at +0.0, and in round-to-nearest `x + -x` is +0.0),
//! so adding a +0.0 padding term or chunk is the identity. Hence a run of `2^j` chunks starting
//! at a multiple of `2^j` is a subtree: its [`tree_sum`] (short at the end of the row or not) is
//! the subtree's value, and [`tree_combine`] of consecutive equal-sized runs' values, in order,
//! reproduces the whole sum bit for bit. [`dot_run`] is that partial for one matvec tile.
//!
//! Sums are written `left + right` in tree order (clippy's `assign_op_pattern` would flip them;
//! IEEE addition is commutative, but the code should read like the rule).
//!
//! Only the grouping above is fixed; which instructions compute it is free. The portable code
//! here is the definition (products and sums are rounded separately: Rust never contracts
//! `a * b + c` into a fused multiply-add); on x86-64 CPUs with AVX2, [`dot`] runs the same
//! operations in the same order with intrinsics (`super::avx2`), so results never depend on CPU
//! features or thread count.

#![allow(clippy::assign_op_pattern)]

use std::ops::Range;

use waferc_ir::wafer::Lanes;
use waferc_ir::{DType, BLOCK};

use super::weights::{widen_mxfp4, widen_q4_0, widen_q4_1, widen_q8_0, RowView};

/// Accumulator lanes of one chunk.
pub const LANES: usize = 8;

/// The lane combine of a chunk: `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
#[inline(always)]
pub fn combine_lanes(l: [f32; LANES]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// The value of one full chunk of products `a[i] * b[i]`.
#[inline(always)]
fn chunk_dot(a: &[f32; BLOCK], b: &[f32; BLOCK]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    for step in 0..BLOCK / LANES {
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane += a[step * LANES + l] * b[step * LANES + l];
        }
    }
    combine_lanes(lanes)
}

/// The value of one chunk of at most [`BLOCK`] terms.
#[inline(always)]
pub fn chunk_sum(terms: &[f32]) -> f32 {
    assert!(terms.len() <= BLOCK, "a chunk holds at most {BLOCK} terms, got {}", terms.len());
    let mut lanes = [0.0f32; LANES];
    for group in terms.chunks(LANES) {
        for (lane, &t) in lanes.iter_mut().zip(group) {
            *lane += t;
        }
    }
    combine_lanes(lanes)
}

/// Streaming form of the chunk tree: push chunk values (or the values of aligned runs of
/// chunks) in order, then [`TreeSum::finish`].
///
/// It keeps one pending subtree per level, merging two equal-sized neighbours as soon as both
/// exist, so memory is one value per level and the grouping is exactly the padded perfect tree.
#[derive(Clone, Debug)]
pub struct TreeSum {
    /// Pending subtree values and their levels (a level-`j` subtree covers `2^j` chunks);
    /// levels strictly decrease from the bottom of the stack.
    values: [f32; 64],
    levels: [u8; 64],
    len: usize,
    /// Chunks covered so far.
    chunks: u64,
}

impl Default for TreeSum {
    fn default() -> Self {
        TreeSum { values: [0.0; 64], levels: [0; 64], len: 0, chunks: 0 }
    }
}

impl TreeSum {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends one chunk's value.
    #[inline(always)]
    pub fn push(&mut self, chunk_value: f32) {
        self.push_subtree(chunk_value, 0)
    }

    /// Appends the value of a run of `2^level` chunks (its own `tree_sum`). Panics unless the
    /// chunks pushed so far are a multiple of `2^level`, i.e. unless the run is aligned.
    #[inline(always)]
    pub fn push_subtree(&mut self, value: f32, level: u8) {
        assert!(
            self.chunks.trailing_zeros() >= level as u32,
            "run of 2^{level} chunks pushed at chunk {}",
            self.chunks
        );
        self.chunks += 1 << level;
        let (mut value, mut level) = (value, level);
        while self.len > 0 && self.levels[self.len - 1] == level {
            self.len -= 1;
            value = self.values[self.len] + value;
            level += 1;
        }
        self.values[self.len] = value;
        self.levels[self.len] = level;
        self.len += 1;
    }

    /// The tree's value: the pending subtrees combined right to left (the last one is the
    /// right operand of its left neighbour, as in `tree(0..h) + tree(h..c)`). +0.0 if empty.
    #[inline(always)]
    pub fn finish(&self) -> f32 {
        let mut pending = self.values[..self.len].iter().rev();
        let Some(&last) = pending.next() else { return 0.0 };
        pending.fold(last, |right, &left| left + right)
    }
}

/// Combines the values of consecutive runs (or chunks) with the tree. Given the values of the
/// aligned `2^j`-chunk runs of a sum, in order, it returns the whole sum's bits.
pub fn tree_combine(values: &[f32]) -> f32 {
    let mut tree = TreeSum::new();
    values.iter().for_each(|&v| tree.push(v));
    tree.finish()
}

/// `tree_sum` of precomputed terms (a softmax denominator, say).
pub fn tree_sum(terms: &[f32]) -> f32 {
    let mut tree = TreeSum::new();
    terms.chunks(BLOCK).for_each(|chunk| tree.push(chunk_sum(chunk)));
    tree.finish()
}

/// `tree_sum` over a KV block's rows of terms given for the rows it holds (`lanes` of each
/// chunk): the other lanes' rows are +0.0 terms, so a block of some lanes of a chunk sums to its
/// lanes' subtree of the lane combine, the value its leaf carries in the reductions over the
/// blocks.
pub fn tree_sum_lanes(terms: &[f32], lanes: Lanes) -> f32 {
    if lanes.is_all() {
        return tree_sum(terms);
    }
    let rows = terms.len().checked_sub(1).map_or(0, |k| lanes.row(k) + 1);
    let mut all = vec![0.0f32; rows];
    for (k, &t) in terms.iter().enumerate() {
        all[lanes.row(k)] = t;
    }
    tree_sum(&all)
}

/// The weighted sum over a KV block's rows, `out[d] = tree_sum_rows(weights[k] * values[k][d])`
/// for the rows it holds (`lanes` of each chunk; `values` holds them `out.len()` f32 each), the
/// other lanes' rows +0.0 terms as in [`tree_sum_lanes`].
pub fn weighted_sum_lanes(weights: &[f32], values: &[f32], lanes: Lanes, out: &mut [f32]) {
    let dim = out.len();
    let mut sum = VectorTreeSum::new(dim);
    let mut next = 0;
    for (k, &weight) in weights.iter().enumerate() {
        let row = lanes.row(k);
        (next..row).for_each(|_| sum.push_zero());
        sum.push_scaled(weight, &values[k * dim..(k + 1) * dim]);
        next = row + 1;
    }
    sum.finish(out);
}

/// `tree_sum` of `n` terms computed on the fly, `term(i)` for `i` in `0..n`, in order (an
/// attention sum over positions, say), without storing them.
pub fn tree_sum_with(n: usize, mut term: impl FnMut(usize) -> f32) -> f32 {
    let mut tree = TreeSum::new();
    let mut chunk = [0.0f32; BLOCK];
    for start in (0..n).step_by(BLOCK) {
        let len = (n - start).min(BLOCK);
        for (i, t) in chunk[..len].iter_mut().enumerate() {
            *t = term(start + i);
        }
        tree.push(chunk_sum(&chunk[..len]));
    }
    tree.finish()
}

/// `tree_sum(a[i] * b[i])` over two f32 vectors of equal length (attention scores).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot of vectors of different lengths");
    let mut tree = TreeSum::new();
    let mut a_chunks = a.chunks_exact(BLOCK);
    let mut b_chunks = b.chunks_exact(BLOCK);
    for (ca, cb) in (&mut a_chunks).zip(&mut b_chunks) {
        tree.push(chunk_dot(ca.try_into().expect("full chunk"), cb.try_into().expect("full chunk")));
    }
    let (ra, rb) = (a_chunks.remainder(), b_chunks.remainder());
    if !ra.is_empty() {
        let (mut pa, mut pb) = ([0.0; BLOCK], [0.0; BLOCK]);
        pa[..ra.len()].copy_from_slice(ra);
        pb[..rb.len()].copy_from_slice(rb);
        tree.push(chunk_dot(&pa, &pb));
    }
    tree.finish()
}

/// `tree_sum(x[i] * x[i])`, the sum of squares of RMSNorm.
pub fn sum_squares(x: &[f32]) -> f32 {
    dot_f32(x, x)
}

/// `tree_sum(row[k] * x[k])`: one row of a matvec, the weight widened chunk by chunk.
/// Panics if `x.len() != row.len()`.
#[inline]
pub fn dot(x: &[f32], row: RowView) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU supports AVX2 and F16C, checked just above.
        return unsafe { super::avx2::dot(x, row) };
    }
    dot_portable_inline(x, row)
}

/// [`dot`] without SIMD intrinsics: the definition every vectorised build must reproduce bit
/// for bit (the tests compare them).
pub fn dot_portable(x: &[f32], row: RowView) -> f32 {
    dot_portable_inline(x, row)
}

/// The partial of one matvec tile: `tree_sum` over chunks `chunks` of `row`, i.e. the value of
/// that subtree when the range is an aligned power-of-two run (clamped to the row's chunks).
/// `x` holds the run's elements only: `x.len() == row.sub(chunks).len()`.
pub fn dot_run(x: &[f32], row: RowView, chunks: Range<usize>) -> f32 {
    dot(x, row.sub(chunks))
}

/// The body of [`dot_portable`], also inlined into the AVX2 kernel for the rows it leaves to it.
#[inline(always)]
pub(super) fn dot_portable_inline(x: &[f32], row: RowView) -> f32 {
    assert_eq!(x.len(), row.len(), "dot of a {}-element input with a {}-element row", x.len(), row.len());
    let bytes = row.bytes();
    match row.dtype() {
        DType::Q4_1 => dot_chunks(x, row.chunks(), Blocks::<20>(bytes, widen_q4_1)),
        DType::Q8_0 => dot_chunks(x, row.chunks(), Blocks::<34>(bytes, widen_q8_0)),
        DType::Q4_0 => dot_chunks(x, row.chunks(), Blocks::<18>(bytes, widen_q4_0)),
        DType::Mxfp4 => dot_chunks(x, row.chunks(), Blocks::<17>(bytes, widen_mxfp4)),
        DType::F32 | DType::BF16 | DType::F16 => dot_chunks(x, row.chunks(), row),
    }
}

/// Something that widens chunk `c` of a row into 32 f32 (zero-padded past a short end).
/// A trait rather than a closure so that `#[inline(always)]` reaches the widening code.
trait Widen {
    fn widen(&self, c: usize, out: &mut [f32; BLOCK]);
}

impl Widen for RowView<'_> {
    #[inline(always)]
    fn widen(&self, c: usize, out: &mut [f32; BLOCK]) {
        self.widen_chunk(c, out)
    }
}

/// A row of quantisation blocks of `N` bytes and the function widening one.
struct Blocks<'a, const N: usize>(&'a [u8], fn(&[u8; N], &mut [f32; BLOCK]));

impl<const N: usize> Widen for Blocks<'_, N> {
    #[inline(always)]
    fn widen(&self, c: usize, out: &mut [f32; BLOCK]) {
        (self.1)(self.0[c * N..][..N].try_into().expect("whole block"), out)
    }
}

#[inline(always)]
fn dot_chunks(x: &[f32], chunks: usize, row: impl Widen) -> f32 {
    let mut tree = TreeSum::new();
    let mut w = [0.0f32; BLOCK];
    let full = x.len() / BLOCK;
    for c in 0..chunks {
        row.widen(c, &mut w);
        let value = if c < full {
            chunk_dot(&w, x[c * BLOCK..][..BLOCK].try_into().expect("full chunk"))
        } else {
            let mut padded = [0.0f32; BLOCK];
            let tail = &x[c * BLOCK..];
            padded[..tail.len()].copy_from_slice(tail);
            chunk_dot(&w, &padded)
        };
        tree.push(value);
    }
    tree.finish()
}

/// Elementwise `tree_sum` of vector-valued terms, `out[d] = tree_sum_t(terms[t][d])`: the
/// attention-weighted sum of values, one tree per output element, computed for all elements
/// together. Push each term (`weight * row`, product rounded), then [`VectorTreeSum::finish`].
#[derive(Clone, Debug)]
pub struct VectorTreeSum {
    dim: usize,
    /// Terms pushed into the current chunk.
    in_chunk: usize,
    /// The current chunk's lanes, `LANES` vectors of `dim`.
    lanes: Vec<f32>,
    /// Pending subtrees (value vector, level), as in [`TreeSum`].
    pending: Vec<(Vec<f32>, u8)>,
}

impl VectorTreeSum {
    pub fn new(dim: usize) -> Self {
        VectorTreeSum { dim, in_chunk: 0, lanes: vec![0.0; LANES * dim], pending: Vec::new() }
    }

    /// Adds the term `weight * row[d]` for every `d`.
    #[inline]
    pub fn push_scaled(&mut self, weight: f32, row: &[f32]) {
        assert_eq!(row.len(), self.dim, "term of length {} in a sum of length {}", row.len(), self.dim);
        let lane = &mut self.lanes[(self.in_chunk % LANES) * self.dim..][..self.dim];
        for (acc, &v) in lane.iter_mut().zip(row) {
            *acc += weight * v;
        }
        self.in_chunk += 1;
        if self.in_chunk == BLOCK {
            self.close_chunk();
        }
    }

    /// Adds a +0.0 term (a row another PE holds): the identity, which only moves the chunk on.
    #[inline]
    fn push_zero(&mut self) {
        self.in_chunk += 1;
        if self.in_chunk == BLOCK {
            self.close_chunk();
        }
    }

    fn close_chunk(&mut self) {
        let dim = self.dim;
        let mut value: Vec<f32> =
            (0..dim).map(|d| combine_lanes(std::array::from_fn(|l| self.lanes[l * dim + d]))).collect();
        self.lanes.iter_mut().for_each(|v| *v = 0.0);
        self.in_chunk = 0;
        let mut level = 0u8;
        while self.pending.last().is_some_and(|(_, top)| *top == level) {
            let (left, _) = self.pending.pop().expect("checked non-empty");
            value.iter_mut().zip(&left).for_each(|(v, l)| *v = *l + *v);
            level += 1;
        }
        self.pending.push((value, level));
    }

    /// Writes the sums into `out` (+0.0 everywhere if nothing was pushed).
    pub fn finish(mut self, out: &mut [f32]) {
        assert_eq!(out.len(), self.dim, "output of length {} for a sum of length {}", out.len(), self.dim);
        if self.in_chunk > 0 {
            self.close_chunk();
        }
        let mut pending = self.pending.into_iter().rev();
        match pending.next() {
            None => out.iter_mut().for_each(|o| *o = 0.0),
            Some((last, _)) => {
                out.copy_from_slice(&last);
                for (left, _) in pending {
                    out.iter_mut().zip(&left).for_each(|(o, l)| *o = *l + *o);
                }
            }
        }
    }
}
