use std::path::PathBuf;

use waferc_ir::wafer::artifact::{self, Artifact, ArtifactError};
use waferc_ir::wafer::region_bytes;
use waferc_passes::wafer::{check, compile, CompileOptions};
use waferc_targets::Target;
use waferc_testsuite::models::{build, Shape};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("waferc-artifact-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn compiled(shape: &Shape) -> Artifact {
    let module = build(shape, 7);
    let program = compile(&module, &Target::resolve("grid:16x16").unwrap(), &CompileOptions::new(64)).unwrap();
    Artifact::new(program, module)
}

#[test]
fn round_trip_keeps_program_module_and_every_tile() {
    let dir = temp_dir("round-trip");
    let path = dir.join("tiny.wafer");
    let original = compiled(&Shape::tiny());
    artifact::write(&path, &original).unwrap();
    let back = artifact::read(&path).unwrap();
    assert_eq!(back.program, original.program);
    assert_eq!(waferc_ir::text::print(&back.module), waferc_ir::text::print(&original.module));
    for ((_, a), (_, b)) in back.module.weights.iter().zip(original.module.weights.iter()) {
        assert_eq!(a.data.bytes(), b.data.bytes(), "IR weight {}", a.name);
    }
    let mut tiles = 0;
    for (at, index, blob) in back.program.blob_ranges() {
        let (pe, region) = (back.program.pes[at].pe, &back.program.pes[at].regions[index]);
        let from_file = back.region_bytes(&region.kind, blob).unwrap();
        assert_eq!(Some(from_file), region_bytes(&original.module, &region.kind), "{pe}");
        tiles += 1;
    }
    assert!(tiles > 0);
    check(&back.program, &back.module).unwrap();
    // A re-written read artifact is the same file.
    let again = dir.join("again.wafer");
    artifact::write(&again, &back).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), std::fs::read(&again).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compiling_twice_writes_identical_bytes() {
    let dir = temp_dir("determinism");
    let shape = Shape { moe: Some((4, 2)), ..Shape::tiny() };
    let (a, b) = (dir.join("a.wafer"), dir.join("b.wafer"));
    artifact::write(&a, &compiled(&shape)).unwrap();
    artifact::write(&b, &compiled(&shape)).unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn shape_only_artifact_has_no_tile_blob() {
    let dir = temp_dir("shape-only");
    let path = dir.join("shape.wafer");
    artifact::write(&path, &compiled(&Shape { bytes: false, ..Shape::tiny() })).unwrap();
    let back = artifact::read(&path).unwrap();
    assert!(!back.program.weights_present);
    assert!(back.tiles.bytes().is_none());
    assert!(back.module.weights.iter().all(|(_, w)| w.data.bytes().is_none()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupt_truncated_foreign_and_future_files_are_refused() {
    let dir = temp_dir("corrupt");
    let path = dir.join("good.wafer");
    artifact::write(&path, &compiled(&Shape::tiny())).unwrap();
    let good = std::fs::read(&path).unwrap();
    let bad = dir.join("bad.wafer");
    let try_read = |bytes: &[u8]| {
        std::fs::write(&bad, bytes).unwrap();
        artifact::read(&bad).unwrap_err()
    };

    // One flipped bit in the last tile bytes and in the IR blob's last byte.
    for offset in [good.len() / 2, good.len() - 1] {
        let mut flipped = good.clone();
        flipped[offset] ^= 0x10;
        assert!(matches!(try_read(&flipped), ArtifactError::Checksum { .. }), "offset {offset}");
    }
    assert!(matches!(try_read(&good[..good.len() - 7]), ArtifactError::Truncated { .. }));
    assert!(matches!(try_read(&good[..20]), ArtifactError::Truncated { .. }));
    assert!(matches!(try_read(b"PK\x03\x04 a zip file, not an artifact"), ArtifactError::Foreign { .. }));
    assert!(matches!(try_read(b""), ArtifactError::Foreign { .. }));
    let mut future = good.clone();
    future[8] = 99;
    let err = try_read(&future);
    assert!(matches!(err, ArtifactError::Version { found: 99, .. }), "{err}");
    assert!(err.to_string().contains("bad.wafer"));
    assert!(matches!(artifact::read(&dir.join("missing.wafer")), Err(ArtifactError::Io { .. })));
    std::fs::remove_dir_all(&dir).unwrap();
}
