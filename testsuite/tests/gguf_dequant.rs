//! Hand-written Q8_0, Q4_0 and Q4_1 blocks, stored in a GGUF, read by the frontend and widened by
//! the runtime's kernels, against values worked out by hand from gguf-py's rules (NUMERICS.md,
//! "Values"): q8_0 `d * q`; q4_0 `d * (q - 8)`; q4_1 `(d * q) + m`, rounded after the sum. Low
//! nibbles of a 4-bit block are elements 0..16, high nibbles 16..32.

mod gguf_writer;

use gguf_writer::{scratch_dir, tiny_llama_metadata, GgufWriter, Q4_0, Q4_1, Q8_0};
use waferc::frontend::gguf;
use waferc_runtime::kernels::RowView;

// f16 bit patterns of exactly known values.
const F16_HALF: [u8; 2] = 0x3800u16.to_le_bytes(); // 0.5
const F16_MINUS_QUARTER: [u8; 2] = 0xB400u16.to_le_bytes(); // -0.25
const F16_2_POW_MINUS_14: [u8; 2] = 0x0400u16.to_le_bytes(); // 2^-14, the smallest normal f16
const F16_1024: [u8; 2] = 0x6400u16.to_le_bytes(); // 1024.0
const F16_THIRDISH: [u8; 2] = 0x3555u16.to_le_bytes(); // 0.333251953125 (1365 / 4096)
const F16_MINUS_ONE: [u8; 2] = 0xBC00u16.to_le_bytes(); // -1.0

/// A Q8_0 block: d = 0.5, q = -128, -15, -14, ..., 14, 15, 127.
fn q8_0_block() -> (Vec<u8>, Vec<f32>) {
    let q: Vec<i8> = [-128].into_iter().chain(-15..=14).chain([127]).collect();
    let mut block = F16_HALF.to_vec();
    block.extend(q.iter().map(|&v| v as u8));
    let mut want = vec![-64.0];
    want.extend((-15..=14).map(|v| v as f32 / 2.0));
    want.push(63.5);
    (block, want)
}

/// A Q4_0 block: d = -0.25, byte j holds q = j (low nibble, element j) and 15 - j (high nibble,
/// element j + 16).
fn q4_0_block() -> (Vec<u8>, Vec<f32>) {
    let mut block = F16_MINUS_QUARTER.to_vec();
    block.extend((0..16u8).map(|j| j | (15 - j) << 4));
    // element j: -0.25 * (j - 8) = 2 - j/4; element j + 16: -0.25 * (7 - j) = j/4 - 1.75.
    let mut want: Vec<f32> = (0..16).map(|j| 2.0 - j as f32 / 4.0).collect();
    want.extend((0..16).map(|j| j as f32 / 4.0 - 1.75));
    // q = 8 (element 8, and element 23 whose high nibble is 15 - 7): -0.25 * 0 is -0.0, as in gguf-py.
    want[8] = -0.0;
    want[23] = -0.0;
    (block, want)
}

/// Two Q4_1 blocks. Block 0: d = 2^-14, m = 1024, q = element index mod 16: `d * q` is exact
/// but `+ 1024` rounds to the f32 grid of 2^-13 there, ties to even. Block 1: d = 1365/4096,
/// m = -1, q = 15 - (element index mod 16).
fn q4_1_blocks() -> (Vec<u8>, Vec<f32>) {
    let mut bytes = [F16_2_POW_MINUS_14, F16_1024].concat();
    bytes.extend((0..16u8).map(|j| j | j << 4));
    bytes.extend([F16_THIRDISH, F16_MINUS_ONE].concat());
    bytes.extend((0..16u8).map(|j| (15 - j) | (15 - j) << 4));
    let ulp = 1.0 / 8192.0;
    // q * 2^-14 is q/2 ulps: q = 1 ties down to 1024 (even), q = 3 ties up to 1024 + 2 ulps.
    let rounded_halves = [0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 3.0, 4.0, 4.0, 4.0, 5.0, 6.0, 6.0, 6.0, 7.0, 8.0];
    let block0: Vec<f32> = rounded_halves.iter().map(|&n| 1024.0 + n * ulp).collect();
    let block1: Vec<f32> = (0..16).map(|j| (15 - j) as f32 * 1365.0 / 4096.0 - 1.0).collect();
    let want = [block0.clone(), block0, block1.clone(), block1].concat();
    (bytes, want)
}

#[test]
fn blocks_read_from_gguf_widen_to_gguf_py_values() {
    let dir = scratch_dir("dequant");
    let (q8, want_q8) = q8_0_block();
    let (q4_0, want_q4_0) = q4_0_block();
    let (q4_1, want_q4_1) = q4_1_blocks();
    // Tensors whose rows are not permuted, one row each; the frontend does not check shapes
    // against the config (lowering does), so one-row tensors are fine here.
    let path = tiny_llama_metadata(GgufWriter::new())
        .tensor("token_embd.weight", &[32, 1], Q8_0, q8)
        .tensor("blk.0.attn_v.weight", &[32, 1], Q4_0, q4_0)
        .tensor("blk.0.ffn_down.weight", &[64, 1], Q4_1, q4_1)
        .write(&dir, "blocks.gguf");
    let (checkpoint, _) = gguf::read(&path).unwrap();
    for (name, want) in [
        ("model.embed_tokens.weight", want_q8),
        ("model.layers.0.self_attn.v_proj.weight", want_q4_0),
        ("model.layers.0.mlp.down_proj.weight", want_q4_1),
    ] {
        let entry = &checkpoint.tensors[name];
        let len = entry.ty.shape[1] as usize;
        let got = RowView::new(entry.ty.dtype, entry.data.bytes().unwrap(), len).unwrap().widen();
        let got_bits: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
        let want_bits: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got_bits, want_bits, "{name} ({}): got {got:?}, want {want:?}", entry.ty.dtype);
    }
}
