//! Shared by the executor tests: compiling a test model (`waferc_testsuite::models`) for a
//! grid, and packing the tile blob the way the artifact lays it out (each weight region's rows,
//! `cols` slice of each, at its `blob_ranges` range).

#![allow(dead_code)] // each test binary uses a different subset

use waferc_ir::wafer::{region_bytes, WaferProgram};
use waferc_ir::Module;
use waferc_passes::wafer::{check, compile, CompileOptions};
use waferc_targets::Target;

/// Compiles `module` for `target` (a spec such as `grid:8x8`) with KV capacity `max_context`.
pub fn compile_for(module: &Module, target: &str, max_context: u32) -> WaferProgram {
    compile_with(module, target, CompileOptions::new(max_context))
}

/// Compiles `module` for `target` with `options`; the placement checker must accept the program.
pub fn compile_with(module: &Module, target: &str, options: CompileOptions) -> WaferProgram {
    let target = Target::resolve(target).expect("a known target");
    let program = compile(module, &target, &options)
        .unwrap_or_else(|e| panic!("the test module compiles for {}: {e}", target.name));
    check(&program, module).unwrap_or_else(|e| panic!("{} {}: {e}", target.name, options.plan));
    program
}

/// The tile blob of `program`, as the artifact writer lays it out: every weight region's bytes
/// (cut from the module by `region_bytes`) at its range (`WaferProgram::blob_ranges`).
pub fn pack_tile_blob(program: &WaferProgram, module: &Module) -> Vec<u8> {
    let mut blob = vec![0u8; program.tile_blob_len as usize];
    for (at, index, range) in program.blob_ranges() {
        let bytes = region_bytes(module, &program.pes[at].regions[index].kind).expect("weights present");
        blob[range.start as usize..range.end as usize].copy_from_slice(&bytes);
    }
    blob
}
