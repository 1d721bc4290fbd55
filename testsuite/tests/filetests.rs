//! The file-driven snapshot suite, in the spirit of Cranelift's filetests.
//!
//! Every `*.ir` file under `testsuite/filetests/` is a case. Its header names a pipeline:
//!
//! ```text
//! ; run: quantize q8_0, dce
//! ```
//!
//! The runner parses the file, runs the pipeline through the pass manager (which verifies
//! after every pass; `; run: verify` just checks the file), and compares the printed result,
//! or the error, with the insta snapshot beside the case: `dce/unused-branch.ir` has
//! `dce/unused-branch.snap`. A new case is a new `.ir` file; a new pass registers in
//! `waferc_passes::registry` and is then usable in `; run:` lines. The runner also checks
//! that the text form round-trips on every input and output, and fails on any `.snap` whose
//! case is gone, so stale snapshots cannot linger.
//!
//! To accept new or changed output: `INSTA_UPDATE=always cargo test -p waferc-testsuite --test
//! filetests`, or `cargo insta review` after a plain run (which leaves `.snap.new` files).

use std::path::{Path, PathBuf};

use waferc_ir::text;
use waferc_passes::{registry, PassManager};

fn filetests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("filetests")
}

/// Every file under `dir` whose name ends with `suffix`, sorted.
fn files_ending_with(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())).path();
            if path.is_dir() {
                pending.push(path);
            } else if path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(suffix)) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The pipeline named by the case's `; run:` line.
fn run_line(case: &str) -> Result<&str, String> {
    let mut lines = case.lines().filter_map(|l| l.trim().strip_prefix(';')?.trim().strip_prefix("run:"));
    match (lines.next(), lines.next()) {
        (Some(pipeline), None) => Ok(pipeline.trim()),
        (None, _) => Err("no `; run: PIPELINE` line".into()),
        (Some(_), Some(_)) => Err("more than one `; run:` line".into()),
    }
}

/// `print(parse(text)) == text` for a printed module.
fn check_round_trip(printed: &str, what: &str) -> Result<(), String> {
    let reparsed = text::parse(printed).map_err(|e| format!("{what} does not parse back: {e}\n{printed}"))?;
    let reprinted = text::print(&reparsed);
    if reprinted != printed {
        return Err(format!("{what} does not round-trip:\n--- printed\n{printed}\n--- reprinted\n{reprinted}"));
    }
    Ok(())
}

/// The case's output: the module after the pipeline, or the error that stopped it.
fn run_case(source: &str, pipeline: &str) -> Result<String, String> {
    let module = match text::parse(source) {
        Ok(module) => module,
        Err(e) => return Ok(format!("parse error: {e}\n")),
    };
    check_round_trip(&text::print(&module), "the parsed input")?;
    let passes = match registry::parse_pipeline(pipeline) {
        Ok(passes) => passes,
        Err(e) => return Ok(format!("pipeline error: {e}\n")),
    };
    match PassManager::new(passes).run(module) {
        Ok((module, _)) => {
            let printed = text::print(&module);
            check_round_trip(&printed, "the output")?;
            Ok(printed)
        }
        Err(e) => Ok(format!("error: {e}\n")),
    }
}

/// Runs one case against its snapshot; `Err` for problems that are not a snapshot mismatch.
fn check_case(case: &Path) -> Result<(), String> {
    let source = std::fs::read_to_string(case).map_err(|e| format!("reading: {e}"))?;
    let pipeline = run_line(&source)?;
    let output = run_case(&source, pipeline)?;
    let name = case.file_stem().and_then(|s| s.to_str()).ok_or("the file name is not UTF-8")?;
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path(case.parent().ok_or("the case has no folder")?);
    settings.set_prepend_module_to_snapshot(false);
    settings.set_input_file(case);
    settings.set_description(format!("run: {pipeline}"));
    settings.set_omit_expression(true);
    settings.bind(|| insta::assert_snapshot!(name, output));
    Ok(())
}

#[test]
fn filetests() {
    let root = filetests_dir();
    let cases = files_ending_with(&root, ".ir");
    assert!(!cases.is_empty(), "no cases under {}", root.display());
    let relative = |p: &Path| p.strip_prefix(&root).unwrap_or(p).display().to_string();

    let mut failures = Vec::new();
    for snapshot in files_ending_with(&root, ".snap") {
        if !snapshot.with_extension("ir").is_file() {
            failures.push(format!(
                "{}: no case {} for this snapshot",
                relative(&snapshot),
                relative(&snapshot.with_extension("ir"))
            ));
        }
    }
    for case in &cases {
        match std::panic::catch_unwind(|| check_case(case)) {
            Ok(Ok(())) => {}
            Ok(Err(problem)) => failures.push(format!("{}: {problem}", relative(case))),
            Err(_) => failures.push(format!("{}: output differs from its snapshot (see above)", relative(case))),
        }
    }
    assert!(failures.is_empty(), "{} of {} filetests failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}
