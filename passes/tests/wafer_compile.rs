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
