use waferc_targets::{list, Target, TargetError};

#[test]
fn built_ins_resolve_by_name_with_facts_values() {
    let names: Vec<String> = list().into_iter().map(|t| t.name).collect();
    assert_eq!(names, ["wse2", "wse3", "wse3x4"]);
    let wse3 = Target::resolve("wse3").unwrap();
    assert_eq!((wse3.grid_cols.value, wse3.grid_rows.value, wse3.wafers.value), (755, 1170, 1));
    let wse2 = Target::resolve("wse2").unwrap();
    assert_eq!((wse2.grid_cols.value, wse2.grid_rows.value), (750, 994));
    assert!(!wse2.sram_bytes_per_pe.assumed && wse3.sram_bytes_per_pe.assumed);
    let x4 = Target::resolve("wse3x4").unwrap();
    assert_eq!(x4.wafers.value, 4);
    assert!(x4.inter_wafer_latency_cycles.assumed && x4.code_reserve_bytes.assumed && x4.f32_fma_per_cycle.assumed);
    assert_eq!(x4.params().wafers, 4);
}

#[test]
fn grid_specs_are_rows_by_columns() {
    let t = Target::resolve("grid:4x8").unwrap();
    assert_eq!((t.grid_rows.value, t.grid_cols.value), (4, 8));
    assert_eq!(t.name, "grid:4x8");
    for bad in ["grid:4", "grid:0x8", "grid:axb", "grid:4x70000"] {
        assert!(matches!(Target::resolve(bad), Err(TargetError::BadGrid { .. })), "{bad}");
    }
}

#[test]
fn unknown_spec_lists_the_built_ins() {
    let err = Target::resolve("wse9").unwrap_err().to_string();
    assert!(err.contains("wse9") && err.contains("wse3x4") && err.contains("grid:RxC"), "{err}");
}

#[test]
fn target_file_overrides_a_base_and_records_sources() {
    let text = r#"
        name = "half"
        base = "wse3"
        grid_cols = 377
        [sources]
        grid_cols = "half the user rectangle"
        assumed = ["grid_cols"]
    "#;
    let t = Target::from_toml(text, "half.toml").unwrap();
    assert_eq!(t.grid_cols.value, 377);
    assert_eq!(t.grid_cols.source, "half the user rectangle");
    assert!(t.grid_cols.assumed);
    assert_eq!(t.grid_rows.value, 1170);
}

#[test]
fn target_file_from_disk_via_resolve() {
    let dir = std::env::temp_dir().join(format!("waferc-targets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("small.toml");
    std::fs::write(
        &path,
        "name = \"small\"\ngrid_cols = 4\ngrid_rows = 3\nwafers = 1\nsram_bytes_per_pe = 49152\n\
         code_reserve_bytes = 4096\nclock_hz = 1e9\nlink_bytes_per_cycle = 4\nhop_latency_cycles = 1\n\
         colours_per_pe = 24\nf32_fma_per_cycle = 1\ninter_wafer_latency_cycles = 100\n\
         inter_wafer_bytes_per_cycle = 8.0\n",
    )
    .unwrap();
    let t = Target::resolve(path.to_str().unwrap()).unwrap();
    assert_eq!((t.grid_cols.value, t.grid_rows.value, t.clock_hz.value), (4, 3, 1e9));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn target_file_errors_name_the_field() {
    let cases = [
        ("name = \"x\"\nbase = \"wse3\"\ngrid_colz = 3\n", "grid_colz"),
        ("name = \"x\"\nbase = \"wse3\"\ngrid_cols = -3\n", "grid_cols"),
        ("name = \"x\"\nbase = \"wse3\"\nclock_hz = \"fast\"\n", "clock_hz"),
        ("name = \"x\"\ngrid_cols = 3\n", "grid_rows"),
        ("base = \"wse3\"\n", "name"),
        ("name = \"x\"\nbase = \"wse7\"\n", "base"),
        ("name = \"x\"\nbase = \"wse3\"\ncode_reserve_bytes = 60000\n", "code_reserve_bytes"),
        ("name = \"x\"\nbase = \"wse3\"\n[sources]\nclock_hz = \"me\"\n", "sources.clock_hz"),
    ];
    for (text, field) in cases {
        match Target::from_toml(text, "t.toml") {
            Err(TargetError::Field { field: f, path, .. }) => {
                assert_eq!(f, field, "{text}");
                assert_eq!(path, "t.toml");
            }
            other => panic!("{text}: expected an error naming `{field}`, got {other:?}"),
        }
    }
    assert!(matches!(Target::from_toml("name = ", "t.toml"), Err(TargetError::Read { .. })));
}

#[test]
fn descriptions_mark_assumptions() {
    let t = Target::wse3();
    let text = t.to_string();
    assert!(text.contains("wse3") && text.contains("(assumed)") && text.contains("grid_cols"));
    let json = t.to_json();
    assert_eq!(json["grid_cols"]["value"], 755);
    assert_eq!(json["clock_hz"]["assumed"], true);
}

/// The checked-in two-wafer target (bench_scale's capacity rows) is wse3x4 with two wafers.
#[test]
fn the_checked_in_wse3x2_file_is_two_wse3_wafers() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("files/wse3x2.toml");
    let t = Target::resolve(path.to_str().unwrap()).unwrap();
    assert_eq!((t.name.as_str(), t.wafers.value), ("wse3x2", 2));
    let mut four = Target::wse3x4();
    four.name = t.name.clone();
    four.description = t.description.clone();
    four.wafers = t.wafers.clone();
    assert_eq!(t, four);
}
