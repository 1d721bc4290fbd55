//! Quantisation on the real SmolLM2-135M-Instruct GGUF (llama.cpp's Q4_1 layers and Q8_0 table):
//! - its blocks are placed on the wafer with the file's own bytes (no dequantise-then-requantise),
//!   read here from the file by a GGUF tensor table parser of this test's own;
//! - the `quantize` pass's q4_1 and q8_0 quantisers, given those blocks widened to f32, write
//!   llama.cpp's bytes back (ggml's reference rules, on tensors ggml wrote);
//! - executor and reference agree bit for bit with every format (smollm2_wafer.rs covers the
//!   GGUF as shipped).

mod executor_common;

use std::collections::BTreeMap;
use std::ops::Range;

use waferc_ir::wafer::artifact::{self, Artifact};
use waferc_ir::wafer::RegionKind;
use waferc_ir::{DType, Module};
use waferc_passes::quantize::{quantize_row_q4_1, quantize_row_q8_0, QuantFormat, Quantize};
use waferc_passes::wafer::{check, compile, CompileOptions};
use waferc_passes::{registry, Pass, PassManager};
use waferc_runtime::executor::{validate, ValidationOptions};
use waferc_runtime::kernels::dequantize;
use waferc_targets::Target;
use waferc_testsuite::smollm2_gguf_path;

/// One tensor of a GGUF file: its ggml type, dims (innermost first) and absolute byte range.
struct GgufTensor {
    ggml_type: u32,
    dims: Vec<u64>,
    bytes: Range<usize>,
}

/// A cursor over a GGUF file's header.
struct Reader<'a> {
    file: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn bytes(&mut self, n: usize) -> &[u8] {
        self.at += n;
        &self.file[self.at - n..self.at]
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes(8).try_into().unwrap())
    }
    fn string(&mut self) -> String {
        let len = self.u64() as usize;
        String::from_utf8_lossy(self.bytes(len)).into_owned()
    }
    /// Skips a metadata value of type `ty`: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32,
    /// 7 bool, 8 string, 9 array (element type, count, elements), 10 u64, 11 i64, 12 f64.
    fn skip_value(&mut self, ty: u32) {
        match ty {
            0 | 1 | 7 => self.at += 1,
            2 | 3 => self.at += 2,
            4..=6 => self.at += 4,
            10..=12 => self.at += 8,
            8 => {
                self.string();
            }
            9 => {
                let element = self.u32();
                for _ in 0..self.u64() {
                    self.skip_value(element);
                }
            }
            other => panic!("GGUF value type {other}"),
        }
    }
}

/// The tensor table of a GGUF v2/v3 file, parsed from the specification (ggml/docs/gguf.md)
/// without the frontend's reader.
fn gguf_tensors(file: &[u8]) -> BTreeMap<String, GgufTensor> {
    let mut r = Reader { file, at: 0 };
    assert_eq!(r.bytes(4), b"GGUF");
    assert!(matches!(r.u32(), 2 | 3));
    let (tensor_count, kv_count) = (r.u64(), r.u64());
    let mut alignment = 32u64;
    for _ in 0..kv_count {
        let key = r.string();
        let ty = r.u32();
        if key == "general.alignment" {
            assert_eq!(ty, 4);
            alignment = r.u32() as u64;
        } else {
            r.skip_value(ty);
        }
    }
    let mut infos = Vec::new();
    for _ in 0..tensor_count {
        let name = r.string();
        let n_dims = r.u32() as usize;
        let dims: Vec<u64> = (0..n_dims).map(|_| r.u64()).collect();
        let ggml_type = r.u32();
        let offset = r.u64();
        infos.push((name, dims, ggml_type, offset));
    }
    let data_start = (r.at as u64).div_ceil(alignment) * alignment;
    infos
        .into_iter()
        .map(|(name, dims, ggml_type, offset)| {
            let dtype = ggml_dtype(ggml_type);
            let elements: u64 = dims.iter().product();
            let bytes = dtype.row_bytes(dims[0]).unwrap() * (elements / dims[0]);
            let start = (data_start + offset) as usize;
            (name, GgufTensor { ggml_type, dims, bytes: start..start + bytes as usize })
        })
        .collect()
}

fn ggml_dtype(ggml_type: u32) -> DType {
    match ggml_type {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        8 => DType::Q8_0,
        30 => DType::BF16,
        other => panic!("ggml type {other} in the SmolLM2 GGUF"),
    }
}

/// The GGUF name of a Hugging Face llama tensor name.
fn gguf_name(hf: &str) -> String {
    if hf == "model.embed_tokens.weight" {
        return "token_embd.weight".into();
    }
    if hf == "model.norm.weight" {
        return "output_norm.weight".into();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, rest) = rest.split_once('.').unwrap();
    let part = match rest {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        other => panic!("unexpected tensor {other}"),
    };
    format!("blk.{layer}.{part}")
}

/// The GGUF row holding Hugging Face row `row` of q (9 heads) or k (3 heads): llama.cpp's
/// converter stores each head's rotary halves interleaved, HF row `j * half + i` as GGUF row
/// `2 * i + j` of the same head.
fn gguf_row(hf: &str, row: u64, rows: u64) -> u64 {
    let heads = if hf.ends_with("q_proj.weight") {
        9
    } else if hf.ends_with("k_proj.weight") {
        3
    } else {
        return row;
    };
    let half = rows / heads / 2;
    let (base, local) = (row - row % (2 * half), row % (2 * half));
    base + 2 * (local % half) + local / half
}

#[test]
fn gguf_blocks_are_placed_with_the_files_own_bytes() {
    let path = smollm2_gguf_path();
    let file = std::fs::read(&path).unwrap();
    let tensors = gguf_tensors(&file);
    assert_eq!(tensors.len(), 2 + 30 * 9);

    let loaded = waferc::frontend::load(&path).unwrap();
    // A quantize pass must leave already-quantised weights alone (no requantising), whatever it
    // is asked for.
    let pipeline = registry::parse_pipeline("quantize q4_0:all").unwrap();
    let (module, _) = PassManager::new(pipeline).run(loaded.module).unwrap();
    for (_, w) in module.weights.iter() {
        let t = &tensors[&gguf_name(&w.name)];
        assert_eq!(w.ty.dtype, ggml_dtype(t.ggml_type), "{} keeps its GGUF type", w.name);
    }

    let program = compile(&module, &Target::resolve("wse3").unwrap(), &CompileOptions::new(64)).unwrap();
    let dir = std::env::temp_dir().join(format!("waferc-quant-placed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let artifact_path = dir.join("smollm2.wafer");
    artifact::write(&artifact_path, &Artifact::new(program, module)).unwrap();
    let compiled = artifact::read(&artifact_path).unwrap();
    let tiles = compiled.tiles.bytes().unwrap();

    let mut regions_by_dtype: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for (at, index, blob) in compiled.program.blob_ranges() {
        {
            let region = &compiled.program.pes[at].regions[index];
            let RegionKind::Weight { weight, rows, cols } = &region.kind else { continue };
            let (rows, cols) = (waferc_ir::wafer::wide(rows), waferc_ir::wafer::wide(cols));
            let w = &compiled.module.weights[waferc_ir::Handle::new(*weight as usize)];
            let t = &tensors[&gguf_name(&w.name)];
            let dtype = ggml_dtype(t.ggml_type);
            let row_bytes = dtype.row_bytes(t.dims[0]).unwrap();
            let (start, len) = (dtype.row_bytes(cols.start).unwrap(), dtype.row_bytes(cols.end - cols.start).unwrap());
            let rows_total = t.dims.get(1).copied().unwrap_or(1);
            let mut expected = Vec::new();
            for row in rows.clone() {
                let at = t.bytes.start as u64 + gguf_row(&w.name, row, rows_total) * row_bytes + start;
                expected.extend_from_slice(&file[at as usize..(at + len) as usize]);
            }
            let held = &tiles[blob.start as usize..blob.end as usize];
            assert!(held == expected.as_slice(), "{}: tile rows {rows:?} cols {cols:?} differ from the GGUF", w.name);
            let entry = regions_by_dtype.entry(dtype.name()).or_default();
            entry.0 += 1;
            entry.1 += blob.end - blob.start;
        }
    }
    // The tied table is placed twice (embedding and LM head), every Q4_1 byte once.
    let q4_1: u64 = tensors.values().filter(|t| t.ggml_type == 3).map(|t| t.bytes.len() as u64).sum();
    let q8_0: u64 = tensors.values().filter(|t| t.ggml_type == 8).map(|t| t.bytes.len() as u64).sum();
    assert_eq!(regions_by_dtype["q4_1"].1, q4_1);
    assert_eq!(regions_by_dtype["q8_0"].1, 2 * q8_0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// llama.cpp wrote the GGUF's blocks with ggml's reference quantisers (no importance matrix);
/// widening them to f32 and quantising again with the pass's q4_1 and q8_0 gives back every byte.
#[test]
fn requantising_ggmls_blocks_gives_back_its_bytes() {
    let path = smollm2_gguf_path();
    let loaded = waferc::frontend::load(&path).unwrap();
    let mut checked = BTreeMap::<&str, usize>::new();
    for (_, weight) in loaded.module.weights.iter() {
        let quantize_row: fn(&[f32], &mut [u8]) = match weight.ty.dtype {
            DType::Q4_1 => quantize_row_q4_1,
            DType::Q8_0 => quantize_row_q8_0,
            _ => continue,
        };
        let widened = dequantize(weight).unwrap();
        let values: Vec<f32> =
            widened.data.bytes().unwrap().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        let original = weight.data.bytes().unwrap();
        let mut again = vec![0u8; original.len()];
        let (rows, cols) = (weight.ty.shape[0] as usize, weight.ty.shape[1] as usize);
        let row_bytes = original.len() / rows;
        for r in 0..rows {
            quantize_row(&values[r * cols..(r + 1) * cols], &mut again[r * row_bytes..(r + 1) * row_bytes]);
        }
        let first_difference = original.iter().zip(&again).position(|(a, b)| a != b);
        assert_eq!(first_difference, None, "{}: requantised bytes differ", weight.name);
        *checked.entry(weight.ty.dtype.name()).or_default() += 1;
    }
    assert_eq!(checked, BTreeMap::from([("q4_1", 210), ("q8_0", 1)]));
}

/// SmolLM2 with every weight widened to f32 and requantised to `spec`, compiled for a WSE-3 and
/// run on the executor: every step bit-identical to the reference decoder.
fn check_format_on_wse3(spec: &str) {
    let loaded = waferc::frontend::load(&smollm2_gguf_path()).unwrap();
    let mut module: Module = loaded.module;
    for handle in module.weights.handles() {
        if module.weights[handle].ty.dtype.is_block_quantized() {
            module.weights[handle] = dequantize(&module.weights[handle]).unwrap();
        }
    }
    let args: Vec<&str> = spec.split_whitespace().collect();
    Quantize::from_args(&args).unwrap().run(&mut module).unwrap();
    let formats: Vec<DType> =
        args.iter().map(|a| QuantFormat::from_name(a.split(':').next().unwrap()).unwrap().dtype()).collect();
    for format in &formats {
        assert!(module.weights.iter().any(|(_, w)| w.ty.dtype == *format), "{spec}: no {format} weight");
    }
    let prompt = [1u32, 9690, 42, 2];
    let new_tokens = 3;
    let program = compile(&module, &Target::resolve("wse3").unwrap(), &CompileOptions::new(8)).unwrap();
    check(&program, &module).unwrap();
    let blob = executor_common::pack_tile_blob(&program, &module);
    let run = ValidationOptions { max_new_tokens: new_tokens, force_tokens: None, stop_tokens: Vec::new() };
    let validation = validate(&program, &module, Some(&blob), &prompt, &run).unwrap_or_else(|e| panic!("{spec}: {e}"));
    assert_eq!(validation.steps, prompt.len() + new_tokens - 1, "{spec}");
}

#[test]
fn smollm2_at_q8_0_is_bit_exact_on_wse3() {
    check_format_on_wse3("q8_0:all");
}

#[test]
fn smollm2_at_q4_0_is_bit_exact_on_wse3() {
    check_format_on_wse3("q4_0:all");
}

#[test]
fn smollm2_at_q4_1_is_bit_exact_on_wse3() {
    check_format_on_wse3("q4_1:all");
}

#[test]
fn smollm2_with_a_format_per_part_is_bit_exact_on_wse3() {
    check_format_on_wse3("q4_0:layers q8_0:embedding+lm_head");
}
