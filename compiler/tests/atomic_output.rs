//! `waferc compile` never leaves a partial artifact at the output path: the artifact is written
//! to a temporary file beside it and renamed into place. Faults are injected deterministically
//! with the child's file-size limit (RLIMIT_FSIZE): with SIGXFSZ ignored a write past the limit
//! fails like a full disk; with the default action the process is killed mid-write.
#![cfg(unix)]

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Well under the artifact of `llama31-gqa-bf16` (about 1.6 MB), well over everything else
/// the compile writes (nothing: the limit applies to the artifact alone).
const FILE_LIMIT: u64 = 256 * 1024;

const PREVIOUS: &[u8] = b"an artifact from an earlier compile";

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("waferc-atomic-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `waferc compile` of a small fixture to `out`, its file size limited to `FILE_LIMIT`; on
/// reaching it the child is killed (`killed`) or its write fails.
fn compile_with_file_limit(out: &Path, killed: bool) -> Output {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testsuite/fixtures/hf/llama31-gqa-bf16");
    let mut command = Command::new(env!("CARGO_BIN_EXE_waferc"));
    command.args(["compile", model.to_str().unwrap(), "--target", "grid:64x64", "--max-context", "64", "-o"]);
    command.arg(out);
    // SAFETY: only async-signal-safe calls (setrlimit, signal) between fork and exec.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit { rlim_cur: FILE_LIMIT, rlim_max: FILE_LIMIT };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if !killed {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            }
            Ok(())
        });
    }
    command.output().expect("waferc runs")
}

fn leftovers(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn a_full_disk_leaves_the_previous_artifact_and_no_temporary_file() {
    let dir = scratch("full");
    let out = dir.join("model.wafer");
    std::fs::write(&out, PREVIOUS).unwrap();
    let output = compile_with_file_limit(&out, false);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "expected a clean error, got {}:\n{stderr}", output.status);
    assert!(stderr.contains("model.wafer"), "the error names the output: {stderr}");
    assert_eq!(std::fs::read(&out).unwrap(), PREVIOUS, "the previous artifact is untouched");
    assert_eq!(leftovers(&dir), ["model.wafer"], "the temporary file is removed");
}

#[test]
fn a_compile_killed_mid_write_leaves_no_artifact_at_the_output_path() {
    let dir = scratch("killed");
    let out = dir.join("model.wafer");
    let output = compile_with_file_limit(&out, true);
    assert_eq!(output.status.signal(), Some(libc::SIGXFSZ), "killed while writing: {}", output.status);
    assert!(!out.exists(), "no partial artifact at the output path: {:?}", leftovers(&dir));
    // The killed process could not clean up: its partial temporary file is all that is left.
    let names = leftovers(&dir);
    assert!(names.len() == 1 && names[0].starts_with("model.wafer.tmp-"), "{names:?}");
    assert!(std::fs::metadata(dir.join(&names[0])).unwrap().len() <= FILE_LIMIT);
}

#[test]
fn an_output_path_that_cannot_be_replaced_leaves_no_temporary_file() {
    let dir = scratch("occupied");
    let out = dir.join("model.wafer");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep"), b"not an artifact").unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testsuite/fixtures/hf/llama31-gqa-bf16");
    let output = Command::new(env!("CARGO_BIN_EXE_waferc"))
        .args(["compile", model.to_str().unwrap(), "--target", "grid:64x64", "--max-context", "64", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "expected a clean error, got {}:\n{stderr}", output.status);
    assert!(stderr.contains("model.wafer"), "{stderr}");
    assert_eq!(leftovers(&dir), ["model.wafer"]);
    assert_eq!(std::fs::read(out.join("keep")).unwrap(), b"not an artifact");
}
