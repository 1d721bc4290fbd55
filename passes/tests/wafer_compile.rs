mod wafer_common;

use wafer_common::{build, Shape};
use waferc_ir::wafer::Plan;
use waferc_passes::wafer::{check, compile, CompileOptions, WaferError};
use waferc_targets::Target;

#[test]
fn tiny_llama_compiles_and_checks_on_8x8() {
    let module = build(&Shape::tiny());
    let target = Target::resolve("grid:8x8").unwrap();
    let program = compile(&module, &target, &CompileOptions::new(64)).unwrap();
    check(&program, &module).unwrap();
    assert_eq!(program.instrs.len(), module.body.len());
    assert!(program.pes.len() <= 64);
    assert!(program.weights_present);
}

#[test]
fn llama8b_shape_compiles_for_wse3() {
    let module = build(&Shape::llama8b());
    let target = Target::resolve("wse3").unwrap();
    let start = std::time::Instant::now();
    let program = compile(&module, &target, &CompileOptions::new(8192)).unwrap();
    let compile_time = start.elapsed();
    let start = std::time::Instant::now();
    check(&program, &module).unwrap();
    eprintln!(
        "8B: compile {compile_time:?}, check {:?}, {} PEs, {} routes, {} steps, blob {} bytes",
        start.elapsed(),
        program.pes.len(),
        program.routes.len(),
        program.schedule.len(),
        program.tile_blob_len
    );
    assert!(!program.weights_present);
}
