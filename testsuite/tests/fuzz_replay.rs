//! Replays every fuzz seed and regression input (fuzz/seeds/TARGET, fuzz/regressions/TARGET)
//! through the same entry points the cargo-fuzz targets call, on the stable toolchain and without
//! libFuzzer: each must finish without a panic, and a rejected input must be rejected with an
//! error that names the file it came from.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use waferc_fuzz_entry::TARGETS;

/// The name each file-reading entry gives its input, which every error must mention.
fn file_name(target: &str) -> Option<&'static str> {
    match target {
        "config_json" => Some("config.json"),
        "safetensors_header" => Some("fuzz.safetensors"),
        "gguf" => Some("fuzz.gguf"),
        "artifact" => Some("fuzz.wafer"),
        "target_toml" => Some("fuzz.toml"),
        _ => None,
    }
}

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries.map(|e| e.expect("read corpus entry").path()).collect();
    files.sort();
    files
}

#[test]
fn every_seed_and_regression_replays_without_a_panic() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut failures = Vec::new();
    let mut replayed = 0;
    for target in TARGETS {
        let regressions = inputs(&fuzz.join("regressions").join(target.name));
        for input in inputs(&fuzz.join("seeds").join(target.name)).into_iter().chain(regressions) {
            let data = std::fs::read(&input).expect("read fuzz input");
            replayed += 1;
            match catch_unwind(AssertUnwindSafe(|| (target.entry)(&data))) {
                Err(_) => failures.push(format!("{}: {} panicked", target.name, input.display())),
                Ok(Err(message)) => {
                    let named = file_name(target.name).is_none_or(|name| message.contains(name));
                    if !named {
                        failures.push(format!(
                            "{}: {}: error does not name the file: {message}",
                            target.name,
                            input.display()
                        ));
                    }
                }
                Ok(Ok(())) => {}
            }
        }
    }
    assert!(replayed > 0, "no fuzz inputs found under {}", fuzz.display());
    assert!(failures.is_empty(), "{} of {replayed} inputs failed:\n{}", failures.len(), failures.join("\n"));
}

/// The seeds are real files: each file-reading target accepts its own.
#[test]
fn the_seeds_of_file_readers_are_accepted() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds");
    for target in TARGETS.iter().filter(|t| ["gguf", "artifact", "target_toml", "config_json"].contains(&t.name)) {
        for input in inputs(&fuzz.join(target.name)) {
            let data = std::fs::read(&input).expect("read seed");
            if let Err(message) = (target.entry)(&data) {
                panic!("{}: seed {} rejected: {message}", target.name, input.display());
            }
        }
    }
}
