//! The kernels against NUMERICS.md: widening of hand-written blocks, the chunk tree bit for bit
//! against a literal implementation of the rule, tile partials (`dot_run` + `tree_combine`)
//! against whole sums, the SIMD path against the portable one, and each op against f64.

mod common;

use common::{decode, dot64, encode, max_abs_diff, Rng};
use waferc_ir::wafer::Lanes;
use waferc_ir::{DType, Rope, RopeScaling, TensorType, Weight, WeightBytes};
use waferc_runtime::kernels::{self, AttentionShape, RopeAngles, RowView, TreeSum, VectorTreeSum, WeightView};

fn weight(dtype: DType, shape: &[u64], bytes: Vec<u8>) -> Weight {
    Weight { name: "w".into(), ty: TensorType::new(dtype, shape.to_vec()), data: WeightBytes::owned(bytes) }
}

fn widen(dtype: DType, len: u64, bytes: Vec<u8>) -> Vec<f32> {
    let w = weight(dtype, &[len], bytes);
    WeightView::new(&w).expect("valid weight").widen_vector()
}

// ---- The rule, written literally (NUMERICS.md "Sums: the chunk tree"). ----

fn spec_chunk(terms: &[f32]) -> f32 {
    let mut l = [0.0f32; 8];
    for (i, &t) in terms.iter().enumerate() {
        l[i % 8] += t;
    }
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

fn spec_tree(chunks: &[f32]) -> f32 {
    match chunks.len() {
        0 => 0.0,
        1 => chunks[0],
        c => {
            let h = c.next_power_of_two() / 2;
            spec_tree(&chunks[..h]) + spec_tree(&chunks[h..])
        }
    }
}

fn spec_tree_sum(terms: &[f32]) -> f32 {
    let chunks: Vec<f32> = terms.chunks(32).map(spec_chunk).collect();
    spec_tree(&chunks)
}

/// Terms spanning many binades, so that any change of grouping changes the bits.
fn wild_terms(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.signed() * 2f32.powi(rng.below(24) as i32 - 12)).collect()
}

// ---- Widening of hand-written blocks. ----

#[test]
fn widens_q8_0_block() {
    let mut block = vec![0x00, 0x38]; // d = 0.5
    block.extend((0..32i32).map(|i| (i * 8 - 128) as i8 as u8));
    let expected: Vec<f32> = (0..32).map(|i| 0.5 * (i as f32 * 8.0 - 128.0)).collect();
    assert_eq!(widen(DType::Q8_0, 32, block), expected);
}

#[test]
fn widens_q4_0_block_low_nibbles_first() {
    let mut block = vec![0x00, 0x40]; // d = 2.0
    block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut expected: Vec<f32> = (0..16).map(|j| 2.0 * (j as f32 - 8.0)).collect();
    expected.extend((0..16).map(|j| 2.0 * (7.0 - j as f32)));
    assert_eq!(widen(DType::Q4_0, 32, block), expected);
}

#[test]
fn widens_q4_1_block_as_scaled_plus_min() {
    let mut block = vec![0x66, 0x2E, 0x00, 0xBC]; // d = f16 0.0999755859375, m = -1.0
    block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let d = half::f16::from_bits(0x2E66).to_f32();
    let mut expected: Vec<f32> = (0..16).map(|q| d * q as f32 + -1.0).collect();
    expected.extend((0..16).map(|j| d * (15 - j) as f32 + -1.0));
    assert_eq!(widen(DType::Q4_1, 32, block), expected);
}

#[test]
fn widens_half_floats_exactly() {
    let bf = vec![0x80, 0x3F, 0x00, 0xC0, 0x01, 0x00]; // 1.0, -2.0, the smallest bf16 subnormal
    assert_eq!(widen(DType::BF16, 3, bf), vec![1.0, -2.0, f32::from_bits(0x0001_0000)]);
    let h = vec![0x00, 0x3C, 0x01, 0x00, 0xFF, 0x7B]; // 1.0, 2^-24, 65504
    assert_eq!(widen(DType::F16, 3, h), vec![1.0, 2f32.powi(-24), 65504.0]);
    let f = encode(DType::F32, &[1.5, -0.0]);
    let widened = widen(DType::F32, 2, f);
    assert_eq!(widened[0], 1.5);
    assert!(widened[1] == 0.0 && widened[1].is_sign_negative());
}

#[test]
fn rejects_weights_whose_bytes_do_not_match_their_type() {
    let short = weight(DType::Q4_1, &[2, 32], vec![0; 39]);
    assert!(matches!(
        WeightView::new(&short),
        Err(waferc_runtime::RuntimeError::WeightByteLength { expected: 40, found: 39, .. })
    ));
    let ragged = weight(DType::Q8_0, &[40], vec![0; 34]);
    assert!(matches!(WeightView::new(&ragged), Err(waferc_runtime::RuntimeError::UnsupportedWeight { .. })));
    let absent = Weight { name: "gone".into(), ty: TensorType::f32([4]), data: WeightBytes::Absent };
    assert!(matches!(WeightView::new(&absent), Err(waferc_runtime::RuntimeError::MissingWeightData { .. })));
}

// ---- The chunk tree. ----

#[test]
fn tree_sum_follows_the_rule_bit_for_bit() {
    let mut rng = Rng(1);
    for n in (0..300).chain([511, 512, 513, 1000, 1024, 1025, 4097]) {
        let terms = wild_terms(&mut rng, n);
        let expected = spec_tree_sum(&terms);
        assert_eq!(kernels::tree_sum(&terms).to_bits(), expected.to_bits(), "n = {n}");
        let ones = vec![1.0; n];
        assert_eq!(kernels::dot_f32(&terms, &ones).to_bits(), expected.to_bits(), "dot_f32, n = {n}");
        assert_eq!(kernels::tree_sum_with(n, |i| terms[i]).to_bits(), expected.to_bits(), "on the fly, n = {n}");
    }
}

#[test]
fn tree_sum_is_not_a_left_to_right_sum() {
    // 1 + 2^-24 * 32 terms: left to right, each tiny term vanishes against 1.0; the chunk tree
    // sums the tiny terms first (lanes 1..8 and the other chunks), so they survive.
    let mut terms = vec![2f32.powi(-24); 64];
    terms[0] = 1.0;
    let left_to_right = terms.iter().fold(0.0f32, |a, t| a + t);
    assert_eq!(left_to_right, 1.0);
    assert_eq!(kernels::tree_sum(&terms), spec_tree_sum(&terms));
    assert!(kernels::tree_sum(&terms) > 1.0);
}

#[test]
fn streaming_subtrees_equal_leaf_pushes() {
    let mut rng = Rng(2);
    for chunks in 1..70 {
        let values = wild_terms(&mut rng, chunks);
        let expected = spec_tree(&values);
        assert_eq!(kernels::tree_combine(&values).to_bits(), expected.to_bits());
        // Push aligned groups of 4 as level-2 subtrees, the rest as leaves.
        let mut tree = TreeSum::new();
        let mut c = 0;
        while c < chunks {
            if c % 4 == 0 && c + 4 <= chunks {
                tree.push_subtree(spec_tree(&values[c..c + 4]), 2);
                c += 4;
            } else {
                tree.push(values[c]);
                c += 1;
            }
        }
        assert_eq!(tree.finish().to_bits(), expected.to_bits(), "{chunks} chunks");
    }
}

#[test]
#[should_panic(expected = "run of 2^2 chunks pushed at chunk 2")]
fn misaligned_subtree_push_panics() {
    let mut tree = TreeSum::new();
    tree.push(1.0);
    tree.push(1.0);
    tree.push_subtree(1.0, 2);
}

const ALL_DTYPES: [DType; 7] = DType::ALL;

/// A random row of `dtype` (length rounded up to whole blocks for quantised dtypes).
fn random_row(rng: &mut Rng, dtype: DType, len: usize) -> (usize, Vec<u8>) {
    let len = if dtype.is_block_quantized() { len.div_ceil(32).max(1) * 32 } else { len };
    (len, encode(dtype, &wild_terms(rng, len)))
}

#[test]
fn dot_is_the_tree_sum_of_widened_products() {
    let mut rng = Rng(3);
    for dtype in ALL_DTYPES {
        for i in 0..60 {
            // Whole chunks on even iterations: the SIMD path's fast case for f32 and bf16.
            let len = if i % 2 == 0 { 32 * (1 + rng.below(30)) } else { 1 + rng.below(900) };
            let (len, bytes) = random_row(&mut rng, dtype, len);
            let row = RowView::new(dtype, &bytes, len).expect("row bytes");
            let x = wild_terms(&mut rng, len);
            let products: Vec<f32> = row.widen().iter().zip(&x).map(|(w, x)| w * x).collect();
            let expected = spec_tree_sum(&products);
            assert_eq!(kernels::dot(&x, row).to_bits(), expected.to_bits(), "{dtype} len {len}");
            assert_eq!(kernels::dot_portable(&x, row).to_bits(), expected.to_bits(), "portable {dtype} len {len}");
        }
    }
}

#[test]
fn tile_partials_combine_to_the_whole_dot_for_every_aligned_split() {
    let mut rng = Rng(4);
    for dtype in ALL_DTYPES {
        for _ in 0..40 {
            let len = 1 + rng.below(1500);
            let (len, bytes) = random_row(&mut rng, dtype, len);
            let row = RowView::new(dtype, &bytes, len).expect("row bytes");
            let x = wild_terms(&mut rng, len);
            let whole = kernels::dot(&x, row);
            let chunks = row.chunks();
            let mut run = 1;
            while run <= chunks.next_power_of_two() {
                let partials: Vec<f32> = (0..chunks)
                    .step_by(run)
                    .map(|start| {
                        let tile = row.sub(start..start + run);
                        let xs = &x[start * 32..start * 32 + tile.len()];
                        kernels::dot_run(xs, row, start..start + run)
                    })
                    .collect();
                assert_eq!(
                    kernels::tree_combine(&partials).to_bits(),
                    whole.to_bits(),
                    "{dtype}, {len} elements, runs of {run} chunks"
                );
                run *= 2;
            }
        }
    }
}

/// A KV head cut in 2, 4 or 8 slices of its head dimension: each slice's part of a score,
/// combined by the chunk tree in dims order and scaled, is the whole head's score bit for bit.
#[test]
fn attention_score_parts_combine_to_the_whole_score() {
    let mut rng = Rng(11);
    for head_dim in [64usize, 128, 256] {
        for _ in 0..50 {
            let (q, k) = (wild_terms(&mut rng, head_dim), wild_terms(&mut rng, head_dim));
            let scale = 1.0 / (head_dim as f32).sqrt();
            let whole = kernels::attention_score(&q, &k, scale);
            for slices in [2usize, 4, 8].into_iter().filter(|&s| head_dim / s >= 32) {
                let width = head_dim / slices;
                let parts: Vec<f32> = (0..slices)
                    .map(|s| {
                        kernels::attention_score_part(&q[s * width..(s + 1) * width], &k[s * width..(s + 1) * width])
                    })
                    .collect();
                let combined = kernels::scaled_score(kernels::tree_combine(&parts), scale);
                assert_eq!(combined.to_bits(), whole.to_bits(), "head_dim {head_dim}, {slices} slices");
            }
        }
    }
}

#[test]
fn vector_tree_sum_is_an_elementwise_tree_sum() {
    let mut rng = Rng(5);
    for terms in [0, 1, 7, 31, 32, 33, 64, 100, 257] {
        let dim = 1 + rng.below(40);
        let weights = wild_terms(&mut rng, terms);
        let rows: Vec<Vec<f32>> = (0..terms).map(|_| wild_terms(&mut rng, dim)).collect();
        let mut sum = VectorTreeSum::new(dim);
        for (w, row) in weights.iter().zip(&rows) {
            sum.push_scaled(*w, row);
        }
        let mut out = vec![f32::NAN; dim];
        sum.finish(&mut out);
        for d in 0..dim {
            let column: Vec<f32> = weights.iter().zip(&rows).map(|(w, r)| w * r[d]).collect();
            assert_eq!(out[d].to_bits(), spec_tree_sum(&column).to_bits(), "{terms} terms, element {d}");
        }
    }
}

/// A chunk's rows spread over lane groups (a KV block each): every group's sum, scalar or
/// vector, is its subtree of the lane combine, so the groups' sums combined in lane order by the
/// tree give the whole chunk's bits, full or partly filled.
#[test]
fn lane_group_sums_combine_to_the_chunk_sum() {
    let mut rng = Rng(11);
    for filled in [1, 3, 8, 13, 31, 32] {
        let terms = wild_terms(&mut rng, filled);
        let dim = 1 + rng.below(9);
        let rows: Vec<Vec<f32>> = (0..filled).map(|_| wild_terms(&mut rng, dim)).collect();
        let whole = spec_tree_sum(&terms);
        for groups in [1u8, 2, 4, 8] {
            let mut scalar = Vec::new();
            let mut vectors: Vec<Vec<f32>> = Vec::new();
            for g in 0..groups {
                let lanes = Lanes::group(g, groups);
                // The group's rows, in order, as its block holds them.
                let held: Vec<usize> = (0..filled).filter(|&r| lanes.holds(r as u32)).collect();
                assert!(held.iter().enumerate().all(|(k, &r)| lanes.row(k) == r));
                let own: Vec<f32> = held.iter().map(|&r| terms[r]).collect();
                scalar.push(kernels::tree_sum_lanes(&own, lanes));
                let values: Vec<f32> = held.iter().flat_map(|&r| rows[r].iter().copied()).collect();
                let mut out = vec![f32::NAN; dim];
                kernels::weighted_sum_lanes(&own, &values, lanes, &mut out);
                vectors.push(out);
            }
            let combined = kernels::tree_combine(&scalar);
            assert_eq!(combined.to_bits(), whole.to_bits(), "{filled} rows in {groups} groups");
            for d in 0..dim {
                let column: Vec<f32> = (0..filled).map(|r| terms[r] * rows[r][d]).collect();
                let parts: Vec<f32> = vectors.iter().map(|v| v[d]).collect();
                assert_eq!(
                    kernels::tree_combine(&parts).to_bits(),
                    spec_tree_sum(&column).to_bits(),
                    "{filled} rows in {groups} groups, element {d}"
                );
            }
        }
    }
}

// ---- Ops against f64. ----

#[test]
fn matvec_matches_f64_and_its_own_rows() {
    let mut rng = Rng(6);
    for dtype in ALL_DTYPES {
        let (rows, cols) = (70u64, 96u64);
        let bytes = encode(dtype, &rng.vector((rows * cols) as usize, 0.5));
        let decoded = decode(dtype, &bytes);
        let w = weight(dtype, &[rows, cols], bytes);
        let view = WeightView::new(&w).expect("valid weight");
        let x = rng.vector(cols as usize, 1.0);
        let bias = rng.vector(rows as usize, 1.0);
        let mut out = vec![0.0; rows as usize];
        kernels::matvec(&x, &view, Some(&bias), &mut out);
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let expected: Vec<f64> = (0..rows as usize)
            .map(|n| dot64(&decoded[n * cols as usize..][..cols as usize], &x64) + bias[n] as f64)
            .collect();
        assert!(max_abs_diff(&out, &expected) < 1e-4, "{dtype}: {}", max_abs_diff(&out, &expected));
        for (n, y) in out.iter().enumerate() {
            assert_eq!(y.to_bits(), (kernels::dot(&x, view.row(n)) + bias[n]).to_bits());
        }
    }
}

#[test]
fn rms_norm_matches_f64_per_group() {
    let mut rng = Rng(7);
    let x = rng.vector(96, 3.0);
    let w = rng.vector(32, 1.0);
    let mut out = vec![0.0; 96];
    kernels::rms_norm(&x, &w, 1e-6, &mut out);
    let expected: Vec<f64> = x
        .chunks(32)
        .flat_map(|g| {
            let ms = g.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 32.0;
            let r = 1.0 / (ms + 1e-6).sqrt();
            g.iter().zip(&w).map(move |(&v, &w)| v as f64 * r * w as f64)
        })
        .collect();
    assert!(max_abs_diff(&out, &expected) < 1e-5);
}

#[test]
fn rope_frequencies_match_transformers() {
    // transformers 5.23, ROPE_INIT_FUNCTIONS[...] for head_dim 32 (float32 results).
    let llama3 = Rope {
        theta: 500000.0,
        scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        },
    };
    let expected_llama3 = [
        1.0,
        0.44036662578582764,
        0.07940301299095154,
        0.010674637742340565,
        0.004700753837823868,
        0.0020700551103800535,
        0.0009115831344388425,
        0.00040143076330423355,
        0.00017677668074611574,
        7.784655463183299e-05,
        3.428102354519069e-05,
        1.5096217794052791e-05,
        6.647869668086059e-06,
        2.927499735960737e-06,
        1.289173155782919e-06,
        5.677088097399974e-07,
    ];
    let linear = Rope { theta: 10000.0, scaling: RopeScaling::Linear { factor: 4.0 } };
    let expected_linear = [
        0.25,
        0.14058533310890198,
        0.07905694097280502,
        0.04445698484778404,
        0.02500000037252903,
        0.014058532193303108,
        0.007905694656074047,
        0.004445698577910662,
        0.0024999999441206455,
        0.0014058533124625683,
        0.0007905694656074047,
        0.00044456985779106617,
        0.0002500000118743628,
        0.00014058532542549074,
        7.905694656074047e-05,
        4.4456985051510856e-05,
    ];
    for (rope, expected) in [(llama3, expected_llama3), (linear, expected_linear)] {
        let table = kernels::rope_frequencies(32, &rope);
        assert_eq!(table.attention_factor, 1.0);
        let freqs = table.freqs;
        assert_eq!(freqs.len(), 16);
        for (f, e) in freqs.iter().zip(expected) {
            assert!(((*f as f64) - e).abs() <= e * 1e-6, "{rope:?}: {f} vs {e}");
        }
    }
    let plain = kernels::rope_frequencies(8, &Rope { theta: 10000.0, scaling: RopeScaling::None });
    assert_eq!(plain.freqs, vec![1.0, 0.1, 0.01, 0.001]);
}

#[test]
fn rope_rotates_halves_like_rotate_half() {
    let mut rng = Rng(8);
    let freqs = kernels::rope_frequencies(16, &Rope { theta: 10000.0, scaling: RopeScaling::None });
    let x = rng.vector(48, 1.0);
    for position in [0usize, 1, 17, 500] {
        let angles = RopeAngles::new(&freqs, position);
        let mut out = vec![0.0; 48];
        kernels::rope(&x, &angles, &mut out);
        let mut expected = vec![0.0f64; 48];
        for head in 0..3 {
            for i in 0..8 {
                let angle = position as f64 * freqs.freqs[i] as f64;
                let (a, b) = (x[head * 16 + i] as f64, x[head * 16 + i + 8] as f64);
                expected[head * 16 + i] = a * angle.cos() - b * angle.sin();
                expected[head * 16 + i + 8] = b * angle.cos() + a * angle.sin();
            }
        }
        assert!(max_abs_diff(&out, &expected) < 1e-4, "position {position}");
        if position == 0 {
            assert_eq!(out, x);
        }
    }
}

/// A head rotated in parts of 32 elements, each with its twin half a head away (the stacked
/// plan's rope pairs), gives the whole head's bits.
#[test]
fn rope_parts_give_the_whole_heads_bits() {
    let mut rng = Rng(81);
    for head_dim in [64usize, 128, 256] {
        let freqs = kernels::rope_frequencies(head_dim, &Rope { theta: 500000.0, scaling: RopeScaling::None });
        let x = rng.vector(head_dim, 3.0);
        for position in [0usize, 5, 4095] {
            let angles = RopeAngles::new(&freqs, position);
            let mut whole = vec![0.0; head_dim];
            kernels::rope(&x, &angles, &mut whole);
            let half = head_dim / 2;
            for start in (0..head_dim).step_by(32) {
                let twin = if start < half { start + half } else { start - half };
                let mut part = vec![0.0; 32];
                kernels::rope_part(&x[start..start + 32], &x[twin..twin + 32], &angles, start, &mut part);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&part), bits(&whole[start..start + 32]), "head_dim {head_dim}, part {start}");
            }
        }
    }
}

#[test]
fn attention_matches_f64_with_grouped_kv_heads() {
    let mut rng = Rng(9);
    let shape = AttentionShape { heads: 4, kv_heads: 2, head_dim: 40 };
    let positions = 37;
    let q = rng.vector(shape.heads * shape.head_dim, 1.0);
    let keys = rng.vector(positions * shape.kv_row(), 1.0);
    let values = rng.vector(positions * shape.kv_row(), 1.0);
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let mut out = vec![0.0; q.len()];
    kernels::attention(&q, &keys, &values, shape, scale, None, &mut out);
    let mut expected = vec![0.0f64; q.len()];
    for h in 0..shape.heads {
        let kv = h / 2;
        let qh: Vec<f64> = q[h * 40..][..40].iter().map(|&v| v as f64).collect();
        let at = |t: usize| t * shape.kv_row() + kv * 40;
        let scores: Vec<f64> = (0..positions)
            .map(|t| dot64(&qh, &keys[at(t)..at(t) + 40].iter().map(|&v| v as f64).collect::<Vec<_>>()) * scale as f64)
            .collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
        for d in 0..40 {
            expected[h * 40 + d] = (0..positions).map(|t| (scores[t] - m).exp() / z * values[at(t) + d] as f64).sum();
        }
    }
    assert!(max_abs_diff(&out, &expected) < 1e-5, "{}", max_abs_diff(&out, &expected));
}

#[test]
fn elementwise_ops_match_f64() {
    let mut rng = Rng(10);
    let (a, b) = (rng.vector(50, 8.0), rng.vector(50, 8.0));
    let silu: Vec<f64> = a.iter().map(|&v| v as f64 / (1.0 + (-(v as f64)).exp())).collect();
    assert!(max_abs_diff(&kernels::silu(&a), &silu) < 1e-5);
    let mul: Vec<f64> = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).collect();
    assert!(max_abs_diff(&kernels::mul(&a, &b), &mul) < 1e-5);
    let add: Vec<f64> = a.iter().zip(&b).map(|(x, y)| *x as f64 + *y as f64).collect();
    assert!(max_abs_diff(&kernels::add(&a, &b), &add) < 1e-5);
}

#[test]
fn router_takes_the_top_k_with_ties_to_the_lower_index() {
    let routing = kernels::router_topk(&[0.5, 2.0, 2.0, -1.0, 2.0], 2, false);
    let p = kernels::softmax(&[0.5, 2.0, 2.0, -1.0, 2.0]);
    assert_eq!(routing.chosen, vec![(1, p[1]), (2, p[2])]);
    assert_eq!(routing.experts, 5);
    let top1 = kernels::router_topk(&[3.0, 1.0, 3.0], 1, true);
    assert_eq!(top1.chosen, vec![(0, 1.0)]);
    // Normalised weights: the softmax of the chosen logits alone, summed in descending-logit
    // order; within rounding of the full softmax's chosen probabilities renormalised.
    let logits = [0.1f32, 1.5, -0.3, 0.9];
    let routing = kernels::router_topk(&logits, 3, true);
    let e = |l: f32| (l - 1.5f32).exp();
    let total = (e(1.5) + e(0.9)) + e(0.1);
    assert_eq!(routing.chosen, vec![(0, e(0.1) / total), (1, e(1.5) / total), (3, e(0.9) / total)]);
    assert_eq!(routing.weight_of(3), Some(e(0.9) / total));
    let p = kernels::softmax(&logits);
    let renormalised = (p[1] + p[3]) + p[0];
    for (expert, w) in &routing.chosen {
        assert!((w - p[*expert as usize] / renormalised).abs() < 1e-6, "expert {expert}: {w}");
    }
    assert_eq!(routing.weight_of(2), None);
}

#[test]
fn softmax_matches_f64_and_sums_to_one() {
    let mut rng = Rng(11);
    let s = rng.vector(70, 10.0);
    let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = s.iter().map(|&v| (v as f64 - m).exp()).sum();
    let expected: Vec<f64> = s.iter().map(|&v| (v as f64 - m).exp() / z).collect();
    let p = kernels::softmax(&s);
    assert!(max_abs_diff(&p, &expected) < 1e-6);
}

#[test]
fn expert_combine_accumulates_in_the_given_order_from_zero() {
    let (y0, y2) = (vec![1.0, -0.0, 1e8], vec![2.0, -0.0, 1.0]);
    let mut out = vec![f32::NAN; 3];
    kernels::expert_combine(&[(0.25, &y0), (0.5, &y2)], &mut out);
    assert_eq!(out[0], 0.25 + 1.0);
    assert!(out[1] == 0.0 && out[1].is_sign_positive(), "starts from +0.0");
    assert_eq!(out[2], (0.0 + 0.25 * 1e8) + 0.5);
}
