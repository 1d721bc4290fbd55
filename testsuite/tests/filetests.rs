//! The file-driven snapshot suite, in the spirit of Cranelift's filetests.
//!
//! Every `*.ir` and `*.case` file under `testsuite/filetests/` is a case; its leading comment
//! lines are its header (see `filetests/README.md` for the full list):
//!
//! ```text
//! ; checkpoint: ../../fixtures/hf/mixtral-tiny
//! ; run: quantize q8_0, dce
//! ; target: grid:16x16
//! ; max-context: 64
//! ; plan: stacked:2
//! ```
//!
//! The module is the `.ir` file itself (the IR text form) or, for a `.case` file, the checkpoint
//! its header names, lowered by the frontend. The runner runs the `; run:` pipeline through the
//! pass manager (which verifies after every pass). Without `; target:` the output is the printed
//! module; with one, the module is compiled for that target, the program is re-checked by
//! `waferc_passes::wafer::check`, and the output is `waferc inspect`'s text summary. The output,
//! or the error that stopped the case, is compared with the insta snapshot beside the case:
//! `dce/unused-branch.ir` has `dce/unused-branch.snap`.
//!
//! A new case is a new file. A new pass registers in `waferc_passes::registry` and is then usable
//! in `; run:` lines; the runner fails until some case runs it. It also checks that the text form
//! round-trips on every module it reads or prints, and fails on any `.snap` whose case is gone,
//! so stale snapshots cannot linger.
//!
//! To accept new or changed output: `INSTA_UPDATE=always cargo test -p waferc-testsuite --test
//! filetests`, or `cargo insta review` after a plain run (which leaves `.snap.new` files).

mod gguf_writer;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gguf_writer::{scratch_dir, tiny_llama_metadata, GgufWriter, BF16, F16, F32, Q4_0, Q4_1, Q8_0};
use waferc::inspect::{summary_text, Filter};
use waferc_ir::wafer::Plan;
use waferc_ir::{text, Module};
use waferc_passes::wafer::{check, compile, CompileOptions};
use waferc_passes::{registry, PassManager};
use waferc_targets::Target;

/// The file kinds that are cases, and the file kind of their snapshots.
const CASE_EXTENSIONS: [&str; 2] = ["ir", "case"];
const SNAPSHOT_EXTENSION: &str = "snap";

/// `; checkpoint:` values with this prefix name a checkpoint the runner writes itself.
const GENERATED_PREFIX: &str = "generated:";

fn filetests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("filetests")
}

/// Every file under `dir` whose extension is one of `extensions`, sorted.
fn files_with_extension(dir: &Path, extensions: &[&str]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())).path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().and_then(|e| e.to_str()).is_some_and(|e| extensions.contains(&e)) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// What a case's header says: where the module comes from and what to do with it.
#[derive(Default)]
struct Header {
    /// The IR pipeline (`; run:`), empty when absent.
    run: String,
    /// A checkpoint path relative to the case file, or `generated:NAME` (`; checkpoint:`).
    checkpoint: Option<String>,
    /// A target spec, a `.toml` path being relative to the case file (`; target:`).
    target: Option<String>,
    max_context: Option<u32>,
    plan: Option<Plan>,
    /// The header lines as written, for the snapshot's description.
    lines: Vec<String>,
}

const HEADER_KEYS: [&str; 5] = ["run", "checkpoint", "target", "max-context", "plan"];

/// Reads the header: the `; key: value` lines among the comments before the first line of IR.
/// A comment that starts with a single lowercase word and a colon must be a known key, so a
/// misspelt header fails instead of being read as prose.
fn parse_header(source: &str) -> Result<Header, String> {
    let mut header = Header::default();
    let mut seen = BTreeSet::new();
    let comments = source.lines().map(str::trim).take_while(|l| l.is_empty() || l.starts_with(';'));
    for comment in comments.filter_map(|l| l.strip_prefix(';')) {
        let Some((key, value)) = comment.trim().split_once(':') else { continue };
        let is_key = !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '-');
        if !is_key {
            continue;
        }
        if !seen.insert(key) {
            return Err(format!("more than one `; {key}:` line"));
        }
        let value = value.trim();
        match key {
            "run" => header.run = value.to_string(),
            "checkpoint" => header.checkpoint = Some(value.to_string()),
            "target" => header.target = Some(value.to_string()),
            "max-context" => {
                let n = value.parse().map_err(|_| format!("`; max-context: {value}` is not a whole number"))?;
                header.max_context = Some(n);
            }
            "plan" => header.plan = Some(parse_plan(value)?),
            _ => return Err(format!("unknown header `; {key}:` (known: {})", HEADER_KEYS.join(", "))),
        }
        header.lines.push(format!("{key}: {value}"));
    }
    Ok(header)
}

/// A plan as `waferc compile --plan` spells it.
fn parse_plan(text: &str) -> Result<Plan, String> {
    text.parse().map_err(|e| format!("`; plan: {text}`: {e}"))
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

/// A checkpoint the runner writes, named in a case as `; checkpoint: generated:NAME`.
struct GeneratedCheckpoint {
    name: &'static str,
    /// Writes the checkpoint into the directory and returns its path.
    write: fn(&Path) -> PathBuf,
}

const GENERATED_CHECKPOINTS: &[GeneratedCheckpoint] =
    &[GeneratedCheckpoint { name: "tiny-llama-mixed-types.gguf", write: tiny_llama_gguf }];

/// A one-layer llama GGUF (hidden 64, 4 heads of 16, 2 KV heads, ffn 96, vocab 64, untied
/// head) whose tensors use every ggml type the frontend reads, so its snapshot shows how each
/// becomes an IR dtype. The bytes are arbitrary: lowering looks only at names, types and shapes.
fn tiny_llama_gguf(dir: &Path) -> PathBuf {
    // GGUF name, ggml dims (innermost first; norms have one), ggml type, bytes per row.
    let tensors: [(&str, &[u64], u32, usize); 12] = [
        ("token_embd.weight", &[64, 64], Q8_0, 2 * 34),
        ("blk.0.attn_norm.weight", &[64], F32, 256),
        ("blk.0.attn_q.weight", &[64, 64], Q4_1, 2 * 20),
        ("blk.0.attn_k.weight", &[64, 32], Q4_0, 2 * 18),
        ("blk.0.attn_v.weight", &[64, 32], F16, 128),
        ("blk.0.attn_output.weight", &[64, 64], BF16, 128),
        ("blk.0.ffn_norm.weight", &[64], F32, 256),
        ("blk.0.ffn_gate.weight", &[64, 96], Q8_0, 2 * 34),
        ("blk.0.ffn_up.weight", &[64, 96], F32, 256),
        ("blk.0.ffn_down.weight", &[96, 64], Q4_1, 3 * 20),
        ("output_norm.weight", &[64], F32, 256),
        ("output.weight", &[64, 64], F16, 128),
    ];
    let mut writer = tiny_llama_metadata(GgufWriter::new());
    for (name, dims, ggml_type, row_bytes) in tensors {
        let rows = dims.get(1).copied().unwrap_or(1) as usize;
        // Small bytes keep every f16/bf16 scale finite.
        writer = writer.tensor(name, dims, ggml_type, vec![0x11; rows * row_bytes]);
    }
    writer.write(dir, "tiny-llama-mixed-types.gguf")
}

/// Loads the module a case names: its own IR text, or its checkpoint through the frontend.
/// `Ok(Err(output))` when the IR text does not parse (that message is the case's output).
fn load_module(case: &Path, source: &str, header: &Header) -> Result<Result<Module, String>, String> {
    let is_ir = case.extension().is_some_and(|e| e == "ir");
    let checkpoint = match (&header.checkpoint, is_ir) {
        (None, true) => {
            return Ok(text::parse(source).map_err(|e| format!("parse error: {e}\n")));
        }
        (Some(_), true) => return Err("a `.ir` case holds its module; a checkpoint case is a `.case` file".into()),
        (None, false) => return Err("a `.case` file needs a `; checkpoint:` line".into()),
        (Some(checkpoint), false) => checkpoint,
    };
    let path = match checkpoint.strip_prefix(GENERATED_PREFIX) {
        Some(name) => {
            let generated = GENERATED_CHECKPOINTS.iter().find(|g| g.name == name).ok_or_else(|| {
                let known: Vec<&str> = GENERATED_CHECKPOINTS.iter().map(|g| g.name).collect();
                format!("no generated checkpoint `{name}` (known: {})", known.join(", "))
            })?;
            (generated.write)(&scratch_dir(&format!("filetests-{name}")))
        }
        None => case.parent().ok_or("the case has no folder")?.join(checkpoint),
    };
    let loaded = waferc::frontend::load(&path).map_err(|e| format!("loading checkpoint {checkpoint}: {e}"))?;
    Ok(Ok(loaded.module))
}

/// The case's output: the module after the pipeline, the placement summary when the case has a
/// target, or the error that stopped it.
fn run_case(case: &Path, source: &str, header: &Header) -> Result<String, String> {
    let module = match load_module(case, source, header)? {
        Ok(module) => module,
        Err(parse_error) => return Ok(parse_error),
    };
    check_round_trip(&text::print(&module), "the input module")?;
    let passes = match registry::parse_pipeline(&header.run) {
        Ok(passes) => passes,
        Err(e) => return Ok(format!("pipeline error: {e}\n")),
    };
    let module = match PassManager::new(passes).run(module) {
        Ok((module, _)) => module,
        Err(e) => return Ok(format!("error: {e}\n")),
    };
    let printed = text::print(&module);
    check_round_trip(&printed, "the output module")?;
    match &header.target {
        None => Ok(printed),
        Some(spec) => compile_for_target(case, &module, spec, header),
    }
}

/// Compiles `module` for the case's target and returns the placement summary, or the compile
/// error. A program that `check` rejects fails the case: it is a compiler bug, never output.
fn compile_for_target(case: &Path, module: &Module, spec: &str, header: &Header) -> Result<String, String> {
    let spec = if spec.ends_with(".toml") {
        case.parent().ok_or("the case has no folder")?.join(spec).display().to_string()
    } else {
        spec.to_string()
    };
    let target = Target::resolve(&spec).map_err(|e| e.to_string())?;
    let options = CompileOptions {
        max_context: header.max_context.unwrap_or(CompileOptions::default().max_context),
        plan: header.plan.unwrap_or(Plan::Tiled),
        ..CompileOptions::default()
    };
    let program = match compile(module, &target, &options) {
        Ok(program) => program,
        Err(e) => return Ok(format!("error: {e}\n")),
    };
    check(&program, module).map_err(|e| format!("wafer::check rejects the compiled program: {e}"))?;
    Ok(summary_text(&program, Some(module), &Filter::all(), None))
}

/// Runs one case against its snapshot; `Err` for problems that are not a snapshot mismatch.
/// Returns the passes its pipeline runs.
fn check_case(case: &Path) -> Result<Vec<String>, String> {
    let source = std::fs::read_to_string(case).map_err(|e| format!("reading: {e}"))?;
    let header = parse_header(&source)?;
    if header.run.is_empty() && header.checkpoint.is_none() && header.target.is_none() {
        return Err("no `; run:`, `; checkpoint:` or `; target:` line: the case does nothing".into());
    }
    if header.target.is_none() && (header.max_context.is_some() || header.plan.is_some()) {
        return Err("`; max-context:` and `; plan:` need a `; target:`".into());
    }
    let output = run_case(case, &source, &header)?;
    let name = case.file_stem().and_then(|s| s.to_str()).ok_or("the file name is not UTF-8")?;
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path(case.parent().ok_or("the case has no folder")?);
    settings.set_prepend_module_to_snapshot(false);
    settings.set_input_file(case);
    settings.set_description(header.lines.join("; "));
    settings.set_omit_expression(true);
    settings.bind(|| insta::assert_snapshot!(name, output));
    let pass_names = header.run.split(',').filter_map(|step| step.split_whitespace().next());
    Ok(pass_names.map(str::to_string).collect())
}

/// The first line of a caught panic's message: insta's snapshot mismatch, or a panic of the code
/// under test.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    let message = match (payload.downcast_ref::<String>(), payload.downcast_ref::<&str>()) {
        (Some(message), _) => message.as_str(),
        (None, Some(message)) => message,
        (None, None) => "panicked",
    };
    message.lines().next().unwrap_or("panicked")
}

#[test]
fn filetests() {
    let root = filetests_dir();
    let cases = files_with_extension(&root, &CASE_EXTENSIONS);
    assert!(!cases.is_empty(), "no cases under {}", root.display());
    let relative = |p: &Path| p.strip_prefix(&root).unwrap_or(p).display().to_string();

    let mut failures = Vec::new();
    for snapshot in files_with_extension(&root, &[SNAPSHOT_EXTENSION]) {
        let cases_of_snapshot: Vec<PathBuf> =
            CASE_EXTENSIONS.iter().map(|ext| snapshot.with_extension(ext)).filter(|case| case.is_file()).collect();
        match cases_of_snapshot.as_slice() {
            [_] => {}
            [] => failures.push(format!(
                "{}: no case {} for this snapshot",
                relative(&snapshot),
                CASE_EXTENSIONS.map(|ext| relative(&snapshot.with_extension(ext))).join(" or ")
            )),
            both => failures.push(format!(
                "{}: cases {} share this snapshot; rename one",
                relative(&snapshot),
                both.iter().map(|case| relative(case)).collect::<Vec<_>>().join(" and ")
            )),
        }
    }
    let mut passes_run = BTreeSet::new();
    for case in &cases {
        match std::panic::catch_unwind(|| check_case(case)) {
            Ok(Ok(passes)) => passes_run.extend(passes),
            Ok(Err(problem)) => failures.push(format!("{}: {problem}", relative(case))),
            Err(panic) => failures.push(format!("{}: {} (see above)", relative(case), panic_message(&*panic))),
        }
    }
    for pass in registry::PASSES.iter().filter(|pass| !passes_run.contains(pass.name)) {
        failures.push(format!("pass `{}` is registered but no case runs it; add one under {}/", pass.name, pass.name));
    }
    assert!(failures.is_empty(), "{} of {} filetests failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}
