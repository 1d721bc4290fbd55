//! The pass manager: verification after every pass, dumps, `--print-after` and the report.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use waferc_ir::{text, KvCache, ModelMeta, Module, Op, TensorType, WeightBytes};
use waferc_passes::{registry, Pass, PassError, PassManager};

/// `%0 = embed`, a dead attention (with its cache) and the head.
fn module() -> Module {
    let meta = ModelMeta { architecture: "test".into(), vocab_size: 4, num_layers: 1, ..Default::default() };
    let mut m = Module::new(meta);
    let table = m.add_weight("table", TensorType::f32([4, 32]), WeightBytes::Absent);
    let cache = m.add_cache(KvCache { layer: 0, kv_heads: 1, head_dim: 32 });
    let x = m.push(Op::Embed { table }, None).unwrap();
    m.push(Op::Attention { q: x, k: x, v: x, cache, heads: 1, scale: 0.5, window: None, sinks: None }, Some(0))
        .unwrap();
    let head = m.add_weight("head", TensorType::f32([4, 32]), WeightBytes::Absent);
    m.output = Some(m.push(Op::MatVec { x, weight: head, bias: None }, None).unwrap());
    m
}

/// A scratch directory unique to one test, removed when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("waferc-passes-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        ScratchDir(dir)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn listing(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn dumps_one_file_per_step_and_clears_old_dumps() {
    let scratch = ScratchDir::new("dump");
    std::fs::create_dir_all(&scratch.0).unwrap();
    std::fs::write(scratch.0.join("07-stale.ir"), "old").unwrap();
    std::fs::write(scratch.0.join("notes.txt"), "kept").unwrap();

    let passes = registry::parse_pipeline("quantize q8_0, dce").unwrap();
    let input = module();
    let (out, report) = PassManager::new(passes).with_dump_dir(&scratch.0).run(input.clone()).unwrap();

    assert_eq!(listing(&scratch.0), ["00-frontend.ir", "01-quantize.ir", "02-dce.ir", "notes.txt"]);
    let read = |name: &str| std::fs::read_to_string(scratch.0.join(name)).unwrap();
    assert_eq!(read("00-frontend.ir"), text::print(&input));
    assert_eq!(read("02-dce.ir"), text::print(&out));
    assert!(read("01-quantize.ir").contains("weight @head : q8_0[4, 32]\n"));
    assert!(!read("02-dce.ir").contains("attention"));
    let names: Vec<&str> = report.records.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["frontend", "quantize", "dce"]);
    assert_eq!(report.records[2].text.as_deref(), Some(read("02-dce.ir").as_str()));
}

/// A `Write` whose bytes the test can read after the manager is done with it.
#[derive(Clone, Default)]
struct SharedBuffer(Arc<Mutex<Vec<u8>>>);

impl Write for SharedBuffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn prints_after_the_named_passes_only() {
    let sink = SharedBuffer::default();
    let passes = registry::parse_pipeline("verify, dce").unwrap();
    let (out, report) =
        PassManager::new(passes).with_print_after(["dce"]).with_print_sink(sink.clone()).run(module()).unwrap();
    let printed = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    assert_eq!(printed, format!("; ==== IR after dce (step 2 of 2) ====\n{}", text::print(&out)));
    assert!(report.records[1].text.is_none(), "text kept only where asked for");
}

#[test]
fn print_after_must_name_a_pass_in_the_pipeline() {
    let passes = registry::parse_pipeline("dce").unwrap();
    let err = PassManager::new(passes).with_print_after(["quantize"]).run(module()).unwrap_err();
    assert_eq!(err.to_string(), "--print-after quantize: the pipeline has no such pass (it runs: dce)");
}

/// Makes the attention's scale infinite, which the verifier rejects.
struct BreakScale;

impl Pass for BreakScale {
    fn name(&self) -> &'static str {
        "break-scale"
    }
    fn run(&self, module: &mut Module) -> Result<(), PassError> {
        for handle in module.body.handles() {
            if let Op::Attention { scale, .. } = &mut module.body[handle].op {
                *scale = f32::INFINITY;
            }
        }
        Ok(())
    }
}

#[test]
fn a_pass_that_breaks_the_ir_is_named_and_its_output_dumped() {
    let scratch = ScratchDir::new("broken");
    let passes: Vec<Box<dyn Pass>> = vec![registry::build("verify", &[]).unwrap(), Box::new(BreakScale)];
    let err = PassManager::new(passes).with_dump_dir(&scratch.0).run(module()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "pass `break-scale` left a module that does not verify: %1 = attention: scale must be finite, found inf"
    );
    assert!(matches!(err, PassError::BrokeIr { ref pass, .. } if pass == "break-scale"));
    let broken = std::fs::read_to_string(scratch.0.join("02-break-scale.ir")).unwrap();
    assert!(broken.contains("scale=inf"), "{broken}");
}

#[test]
fn an_invalid_input_is_rejected_before_any_pass() {
    let mut m = module();
    m.output = None;
    let err = PassManager::new(registry::parse_pipeline("dce").unwrap()).run(m).unwrap_err();
    assert_eq!(err.to_string(), "the module given to the pass pipeline does not verify: module has no output value");
}

#[test]
fn the_time_table_has_a_row_per_step_and_a_total() {
    let passes = registry::parse_pipeline("quantize q4_0, dce").unwrap();
    let (_, report) = PassManager::new(passes).run(module()).unwrap();
    let table = report.time_table();
    let rows: Vec<&str> = table.lines().skip(4).map(|l| l.rsplit("  ").next().unwrap()).collect();
    // Each pass's row ends with what it changed.
    assert_eq!(rows, ["frontend", "quantize (weight bytes -440)", "dce (instrs -1)", "total"], "{table}");
    assert!(report.records.iter().all(|r| r.peak_rss.is_some()), "VmHWM is readable on Linux");
    assert!(table.lines().nth(2).unwrap().contains("pass ms  verify ms"), "{table}");
}
