//! The matvec row kernel with AVX2 intrinsics, chosen at run time when the CPU has AVX2 and
//! F16C (every AVX2 CPU has F16C; its f16 to f32 conversion is exact, like the portable one).
//!
//! It performs the portable kernel's operations in the portable kernel's order: a chunk's 8
//! lanes are one 256-bit register (lane `l` accumulates terms `l, l+8, l+16, l+24` starting
//! from +0.0), weights are widened with the same roundings, and [`combine_lanes`] is done with
//! horizontal adds that pair `(l0, l1), (l2, l3), (l4, l5), (l6, l7)`, then the quads.
//! Chunks are reduced eight at a time: eight aligned chunks are a subtree of the chunk tree
//! whose shape is again `combine_lanes`, so their eight values are combined in registers and
//! pushed as one level-3 subtree. (IEEE addition is commutative, so `hadd`'s `a1 + a0` is
//! `a0 + a1`.) Its results are the portable kernel's bits (the tests compare it with
//! [`super::dot_portable`]); only the speed differs.
//!
//! [`combine_lanes`]: super::combine_lanes

use std::arch::x86_64::*;

use waferc_ir::{DType, BLOCK};

use super::tree::{dot_portable_inline, TreeSum};
use super::weights::RowView;

/// The chunk tree over a row of whole chunks stored as `$n`-byte units, `$lanes(block, x)`
/// giving a chunk's 8 lane accumulators. A macro rather than a generic function so that every
/// call is direct and inlines into the AVX2 context (closures would not).
macro_rules! dot_blocks {
    ($x:expr, $bytes:expr, $n:literal, $lanes:ident) => {{
        let (x, bytes): (&[f32], &[u8]) = ($x, $bytes);
        let chunks = bytes.len() / $n;
        let block = |c: usize| -> &[u8; $n] { bytes[c * $n..][..$n].try_into().expect("whole block") };
        let xs = |c: usize| -> &[f32; BLOCK] { x[c * BLOCK..][..BLOCK].try_into().expect("whole chunk") };
        let mut tree = TreeSum::new();
        let mut c = 0;
        while c < chunks {
            // Eight aligned chunks at a time, then four, then one by one.
            let group = match chunks - c {
                8.. => 8,
                4..=7 => 4,
                _ => 1,
            };
            let mut lanes = [_mm256_setzero_ps(); 8];
            for (k, lane) in lanes[..group].iter_mut().enumerate() {
                *lane = $lanes(block(c + k), xs(c + k));
            }
            match group {
                8 => {
                    let low = combine4([lanes[0], lanes[1], lanes[2], lanes[3]]);
                    let high = combine4([lanes[4], lanes[5], lanes[6], lanes[7]]);
                    tree.push_subtree(combine_lanes(_mm256_set_m128(high, low)), 3);
                }
                4 => {
                    let values = combine4([lanes[0], lanes[1], lanes[2], lanes[3]]);
                    let pairs = _mm_hadd_ps(values, values); // v0+v1, v2+v3, ..
                    tree.push_subtree(_mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs))), 2);
                }
                _ => tree.push(combine_lanes(lanes[0])),
            }
            c += group;
        }
        tree.finish()
    }};
}

/// `tree_sum(row[k] * x[k])`. Safety: the CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dot(x: &[f32], row: RowView) -> f32 {
    assert_eq!(x.len(), row.len(), "dot of a {}-element input with a {}-element row", x.len(), row.len());
    let bytes = row.bytes();
    match row.dtype() {
        DType::Q4_1 => dot_q4_1(x, bytes),
        DType::Q8_0 => dot_q8_0(x, bytes),
        DType::Q4_0 => dot_q4_0(x, bytes),
        DType::F32 if x.len() % BLOCK == 0 => dot_f32_row(x, bytes),
        DType::BF16 if x.len() % BLOCK == 0 => dot_bf16(x, bytes),
        // Short last chunks, f16 and MXFP4 rows take the portable body.
        DType::F32 | DType::BF16 | DType::F16 | DType::Mxfp4 => dot_portable_inline(x, row),
    }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn dot_q4_1(x: &[f32], bytes: &[u8]) -> f32 {
    dot_blocks!(x, bytes, 20, chunk_q4_1)
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn dot_q8_0(x: &[f32], bytes: &[u8]) -> f32 {
    dot_blocks!(x, bytes, 34, chunk_q8_0)
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn dot_q4_0(x: &[f32], bytes: &[u8]) -> f32 {
    dot_blocks!(x, bytes, 18, chunk_q4_0)
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn dot_f32_row(x: &[f32], bytes: &[u8]) -> f32 {
    dot_blocks!(x, bytes, 128, chunk_f32)
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn dot_bf16(x: &[f32], bytes: &[u8]) -> f32 {
    dot_blocks!(x, bytes, 64, chunk_bf16)
}

/// Rows `first..first + out.len()` of a matvec. Safety: the CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn matvec_rows(x: &[f32], weight: &super::WeightView, first: usize, out: &mut [f32]) {
    for (i, y) in out.iter_mut().enumerate() {
        *y = dot(x, weight.row(first + i));
    }
}

/// `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn combine_lanes(lanes: __m256) -> f32 {
    let low = _mm256_castps256_ps128(lanes);
    let high = _mm256_extractf128_ps::<1>(lanes);
    let pairs = _mm_hadd_ps(low, high); // l0+l1, l2+l3, l4+l5, l6+l7
    let quads = _mm_hadd_ps(pairs, pairs); // (l0+l1)+(l2+l3), (l4+l5)+(l6+l7), ..
    _mm_cvtss_f32(_mm_add_ss(quads, _mm_movehdup_ps(quads)))
}

/// [`combine_lanes`] of four chunks at once: `[v0, v1, v2, v3]`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn combine4(a: [__m256; 4]) -> __m128 {
    // Per 128-bit half: [a0 l0+l1, a0 l2+l3, a1 l0+l1, a1 l2+l3 | the same for l4..l7].
    let h01 = _mm256_hadd_ps(a[0], a[1]);
    let h23 = _mm256_hadd_ps(a[2], a[3]);
    // [a0 (l0+l1)+(l2+l3), a1 .., a2 .., a3 .. | a0 (l4+l5)+(l6+l7), a1 .., a2 .., a3 ..].
    let quads = _mm256_hadd_ps(h01, h23);
    _mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps::<1>(quads))
}

/// A chunk's lanes from its widened weights, 8 at a time: `acc = acc + w[j] * x[j]`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn chunk_lanes(w: [__m256; 4], x: &[f32; BLOCK]) -> __m256 {
    let mut acc = _mm256_setzero_ps();
    for (j, w) in w.into_iter().enumerate() {
        let xs = _mm256_loadu_ps(x.as_ptr().add(j * 8));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(w, xs));
    }
    acc
}

/// The f16 at `bytes[at..at + 2]` widened exactly, broadcast to 8 lanes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn scale(bytes: &[u8], at: usize) -> __m256 {
    let bits = u16::from_le_bytes([bytes[at], bytes[at + 1]]);
    _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// The 32 nibbles of 16 bytes as four vectors of 8 i32: low nibbles are elements 0..16,
/// high nibbles 16..32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn nibbles(bytes: &[u8]) -> [__m256i; 4] {
    // Widen bytes 0..8 and 8..16 to i32 first: then a byte's low nibble is `& 15` and its high
    // nibble `>> 4`, with no byte shuffling.
    let first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.as_ptr() as *const __m128i));
    let second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.as_ptr().add(8) as *const __m128i));
    let mask = _mm256_set1_epi32(0x0F);
    [
        _mm256_and_si256(first, mask),
        _mm256_and_si256(second, mask),
        _mm256_srli_epi32::<4>(first),
        _mm256_srli_epi32::<4>(second),
    ]
}

/// q4_1: `w = (d * q) + m`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn chunk_q4_1(block: &[u8; 20], x: &[f32; BLOCK]) -> __m256 {
    let d = scale(block, 0);
    let m = scale(block, 2);
    let w = nibbles(&block[4..]).map(|q| _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m));
    chunk_lanes(w, x)
}

/// q4_0: `w = d * (q - 8)`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn chunk_q4_0(block: &[u8; 18], x: &[f32; BLOCK]) -> __m256 {
    let d = scale(block, 0);
    let eight = _mm256_set1_epi32(8);
    let w = nibbles(&block[2..]).map(|q| _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, eight))));
    chunk_lanes(w, x)
}

/// q8_0: `w = d * q`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn chunk_q8_0(block: &[u8; 34], x: &[f32; BLOCK]) -> __m256 {
    let d = scale(block, 0);
    let w = [0, 1, 2, 3].map(|j| {
        let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(block.as_ptr().add(2 + 8 * j) as *const __m128i));
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(q))
    });
    chunk_lanes(w, x)
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn chunk_f32(block: &[u8; 128], x: &[f32; BLOCK]) -> __m256 {
    let w = [0, 1, 2, 3].map(|j| _mm256_loadu_ps(block.as_ptr().add(32 * j) as *const f32));
    chunk_lanes(w, x)
}

/// bf16: the 16 bits are the top half of the f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn chunk_bf16(block: &[u8; 64], x: &[f32; BLOCK]) -> __m256 {
    let w = [0, 1, 2, 3].map(|j| {
        let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(block.as_ptr().add(16 * j) as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
    });
    chunk_lanes(w, x)
}
