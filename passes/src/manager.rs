//! The [`Pass`] trait and the [`PassManager`] that runs a pipeline of passes.
//!
//! The manager verifies the input module, then after every pass runs [`waferc_ir::verify()`],
//! so a pass that breaks the IR is named at once rather than by a confusing failure three
//! passes later (Cranelift and MLIR do the same in their debug pipelines). For each pass it
//! records the wall time of the pass and of its verification, and the process's peak memory,
//! for `--time-passes`; it writes the module's text after each pass to `--dump-ir DIR`
//! (`00-frontend.ir`, `01-<pass>.ir`, ...) and prints it for `--print-after PASS`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use waferc_ir::{text, verify, Module};

use crate::error::PassError;

/// An IR-to-IR rewrite. A pass receives a module that verifies and must leave one that does;
/// the [`PassManager`] checks the second half of that contract after every pass.
pub trait Pass {
    /// The pass's name: how the registry, `--print-after` and the dump files name it. A file
    /// name component, so letters, digits, `_` and `-` only.
    fn name(&self) -> &'static str;

    /// The plan kind the pass's choices are costed for, if they depend on one (`rewrite`'s
    /// extraction does): a driver lowering under several plans runs such a pipeline per kind.
    fn costed_for(&self) -> Option<crate::rewrite::PlanKind> {
        None
    }

    fn run(&self, module: &mut Module) -> Result<(), PassError>;
}

/// The label of the module a pipeline starts from, in dump file names and reports.
pub const INPUT_LABEL: &str = "frontend";

/// Measurements of one step of a pipeline: the input's verification, or one pass.
#[derive(Clone, Debug)]
pub struct PassRecord {
    /// The pass, or [`INPUT_LABEL`] for the input.
    pub name: String,
    /// Wall time of the pass itself (zero for the input).
    pub wall: Duration,
    /// Wall time of verifying the module after the pass.
    pub verify_wall: Duration,
    /// The process's peak resident set after the step, in bytes: `VmHWM` of
    /// `/proc/self/status`. `None` where that file is not available (not Linux).
    pub peak_rss: Option<u64>,
    /// How much the step raised that peak. A process-wide high-water mark cannot be split
    /// per step otherwise: a step whose peak stays below an earlier one shows 0.
    pub peak_rss_growth: Option<u64>,
    /// The module's text after the step, kept only when a dump or `--print-after` asked for it.
    pub text: Option<String>,
    /// What the step changed in the module (`None` for the input and lowering stages).
    pub changes: Option<ModuleChanges>,
}

/// The size of a module before and after a pass: what `--time-passes` and `--json` report as
/// the pass's effect (a fusion shows as fewer matvecs, a removal as fewer instructions or
/// weight bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModuleChanges {
    pub instrs: (usize, usize),
    pub matvecs: (usize, usize),
    /// Bytes of weights the module holds (by their types, so also for shape-only modules).
    pub weight_bytes: (u64, u64),
}

/// Instructions, matvecs and weight bytes of `module`.
fn module_size(module: &Module) -> (usize, usize, u64) {
    let matvecs = module.body.iter().filter(|(_, i)| matches!(i.op, waferc_ir::Op::MatVec { .. })).count();
    let bytes = module.weights.iter().map(|(_, w)| w.ty.bytes().unwrap_or(0)).sum();
    (module.body.len(), matvecs, bytes)
}

impl ModuleChanges {
    /// `instrs -3, matvecs -2, weights -1.5 MB`, or `no change`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        let delta = |(a, b): (usize, usize)| b as i64 - a as i64;
        if delta(self.instrs) != 0 {
            parts.push(format!("instrs {:+}", delta(self.instrs)));
        }
        if delta(self.matvecs) != 0 {
            parts.push(format!("matvecs {:+}", delta(self.matvecs)));
        }
        let bytes = self.weight_bytes.1 as i64 - self.weight_bytes.0 as i64;
        if bytes != 0 {
            parts.push(format!("weight bytes {bytes:+}"));
        }
        if parts.is_empty() {
            "no change".into()
        } else {
            parts.join(", ")
        }
    }
}

/// What a pipeline run measured, one record per step, the input first.
#[derive(Clone, Debug, Default)]
pub struct PassReport {
    pub records: Vec<PassRecord>,
}

impl PassReport {
    /// Dumps and prints the steps of a run made [`with_kept_text`](PassManager::with_kept_text),
    /// as a manager with this dump directory and `--print-after` list would have while running.
    /// Only the pipeline's steps carry text: call it before appending other records.
    pub fn emit(&self, dump_dir: Option<&Path>, print_after: &[String], sink: &mut dyn Write) -> Result<(), PassError> {
        if let Some(dir) = dump_dir {
            prepare_dump_dir(dir)?;
        }
        let steps = self.records.len().saturating_sub(1);
        for (index, record) in self.records.iter().enumerate() {
            let print = print_after.contains(&record.name);
            if let Some(text) = &record.text {
                emit_step(dump_dir, print, sink, index, steps, &record.name, text)?;
            }
        }
        Ok(())
    }

    /// Total wall time of passes and verification.
    pub fn total_wall(&self) -> Duration {
        self.records.iter().map(|r| r.wall + r.verify_wall).sum()
    }

    /// The `--time-passes` table, in the style of Cranelift's `-time-passes` and MLIR's
    /// `-mlir-timing`: one row per step, then the total.
    pub fn time_table(&self) -> String {
        let total = self.total_wall();
        let percent = |d: Duration| {
            if total.is_zero() {
                0.0
            } else {
                100.0 * d.as_secs_f64() / total.as_secs_f64()
            }
        };
        let mib = |bytes: Option<u64>| match bytes {
            Some(b) => format!("{:.1}", b as f64 / (1024.0 * 1024.0)),
            None => "-".into(),
        };
        let ms = |d: Duration| format!("{:.3}", d.as_secs_f64() * 1e3);
        let mut out = String::new();
        out.push_str("pass timing: wall time of each pass and of verifying its output; memory is the process's\n");
        out.push_str("peak resident set (VmHWM) after the pass, and how much the pass raised it\n");
        out.push_str("  pass ms  verify ms       %  peak MiB    +MiB  pass\n");
        out.push_str("---------  ---------  ------  --------  ------  --------------------\n");
        for r in &self.records {
            let changes = r.changes.map(|c| format!(" ({})", c.describe())).unwrap_or_default();
            out.push_str(&format!(
                "{:>9}  {:>9}  {:>5.1}%  {:>8}  {:>6}  {}{}\n",
                ms(r.wall),
                ms(r.verify_wall),
                percent(r.wall + r.verify_wall),
                mib(r.peak_rss),
                mib(r.peak_rss_growth),
                r.name,
                changes
            ));
        }
        let pass_total: Duration = self.records.iter().map(|r| r.wall).sum();
        let verify_total: Duration = self.records.iter().map(|r| r.verify_wall).sum();
        let peak = self.records.last().and_then(|r| r.peak_rss);
        out.push_str(&format!(
            "{:>9}  {:>9}  {:>5.1}%  {:>8}  {:>6}  total\n",
            ms(pass_total),
            ms(verify_total),
            if total.is_zero() { 0.0 } else { 100.0 },
            mib(peak),
            ""
        ));
        out
    }
}

/// Runs passes in order, verifying after each; see the module documentation.
///
/// ```no_run
/// # use waferc_passes::{registry, PassManager};
/// # fn demo(module: waferc_ir::Module) -> Result<(), waferc_passes::PassError> {
/// let passes = registry::parse_pipeline("quantize q8_0, dce")?;
/// let (module, report) = PassManager::new(passes)
///     .with_dump_dir("ir-dump")
///     .with_print_after(["dce"])
///     .run(module)?;
/// eprint!("{}", report.time_table());
/// # Ok(()) }
/// ```
pub struct PassManager {
    passes: Vec<Box<dyn Pass>>,
    dump_dir: Option<PathBuf>,
    print_after: Vec<String>,
    print_sink: Box<dyn Write>,
    keep_text: bool,
}

impl PassManager {
    pub fn new(passes: Vec<Box<dyn Pass>>) -> Self {
        PassManager {
            passes,
            dump_dir: None,
            print_after: Vec::new(),
            print_sink: Box::new(std::io::stderr()),
            keep_text: false,
        }
    }

    /// Writes the module's text before the first pass and after each pass into `dir`, as
    /// `00-frontend.ir`, `01-<pass>.ir`, ... Each file is written to a temporary name and
    /// renamed, so a reader never sees half a file. Dump files of an earlier run (names
    /// `NN-*.ir`) are removed first, so the directory describes one run only.
    pub fn with_dump_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dump_dir = Some(dir.into());
        self
    }

    /// Prints the module's text after each pass with one of these names (`frontend` names the
    /// input), to standard error unless [`with_print_sink`](Self::with_print_sink) says otherwise.
    pub fn with_print_after<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.print_after.extend(names.into_iter().map(Into::into));
        self
    }

    /// Keeps the module's text after each step in its record, without dumping or printing it:
    /// for a driver that runs a pipeline more than once and shows one run afterwards
    /// ([`PassReport::emit`]).
    pub fn with_kept_text(mut self) -> Self {
        self.keep_text = true;
        self
    }

    /// Where `--print-after` output goes.
    pub fn with_print_sink(mut self, sink: impl Write + 'static) -> Self {
        self.print_sink = Box::new(sink);
        self
    }

    /// The passes' names, in pipeline order.
    pub fn pass_names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    /// Verifies `module`, runs every pass (verifying after each), and returns the result with
    /// what was measured. A pass whose output does not verify fails the run with
    /// [`PassError::BrokeIr`]; its broken output is still dumped and printed first, since that
    /// is the text one needs to see.
    pub fn run(&mut self, module: Module) -> Result<(Module, PassReport), PassError> {
        let names = self.pass_names();
        if let Some(unknown) = self.print_after.iter().find(|n| *n != INPUT_LABEL && !names.contains(&n.as_str())) {
            return Err(PassError::NotInPipeline {
                name: unknown.clone(),
                pipeline: names.join(", "),
                option: "--print-after",
            });
        }
        if let Some(dir) = &self.dump_dir {
            prepare_dump_dir(dir)?;
        }

        let mut module = module;
        let mut report = PassReport::default();
        let peak_before = peak_rss();
        let started = Instant::now();
        let verified = verify(&module);
        let verify_wall = started.elapsed();
        verified.map_err(PassError::InvalidInput)?;
        let input = self.record(0, INPUT_LABEL, &module, Duration::ZERO, verify_wall, peak_before)?;
        report.records.push(input);

        for step in 0..self.passes.len() {
            let pass = &self.passes[step];
            let name = pass.name();
            let peak_before = peak_rss();
            let before = module_size(&module);
            let started = Instant::now();
            pass.run(&mut module)?;
            let wall = started.elapsed();
            let started = Instant::now();
            let verified = verify(&module);
            let verify_wall = started.elapsed();
            let mut record = self.record(step + 1, name, &module, wall, verify_wall, peak_before)?;
            let after = module_size(&module);
            record.changes = Some(ModuleChanges {
                instrs: (before.0, after.0),
                matvecs: (before.1, after.1),
                weight_bytes: (before.2, after.2),
            });
            verified.map_err(|source| PassError::BrokeIr { pass: name.to_string(), source })?;
            report.records.push(record);
        }
        Ok((module, report))
    }

    /// Measures memory, and prints and dumps the module's text if asked to, after step `index`.
    fn record(
        &mut self,
        index: usize,
        name: &str,
        module: &Module,
        wall: Duration,
        verify_wall: Duration,
        peak_before: Option<u64>,
    ) -> Result<PassRecord, PassError> {
        let peak = peak_rss();
        let print = self.print_after.iter().any(|n| n == name);
        let text = (print || self.dump_dir.is_some() || self.keep_text).then(|| text::print(module));
        if let Some(text) = &text {
            let steps = self.passes.len();
            emit_step(self.dump_dir.as_deref(), print, &mut self.print_sink, index, steps, name, text)?;
        }
        Ok(PassRecord {
            name: name.to_string(),
            wall,
            verify_wall,
            peak_rss: peak,
            peak_rss_growth: peak.zip(peak_before).map(|(after, before)| after.saturating_sub(before)),
            text,
            changes: None,
        })
    }
}

/// Writes step `index`'s text to `dump_dir` (as `NN-name.ir`) and, if `print`, to `sink`.
fn emit_step(
    dump_dir: Option<&Path>,
    print: bool,
    sink: &mut dyn Write,
    index: usize,
    steps: usize,
    name: &str,
    text: &str,
) -> Result<(), PassError> {
    if let Some(dir) = dump_dir {
        write_atomically(&dir.join(format!("{index:02}-{name}.ir")), text)?;
    }
    if print {
        let header = format!("; ==== IR after {name} (step {index} of {steps}) ====\n");
        sink.write_all(header.as_bytes())
            .and_then(|()| sink.write_all(text.as_bytes()))
            .and_then(|()| sink.flush())
            .map_err(|source| PassError::PrintAfter { pass: name.to_string(), source })?;
    }
    Ok(())
}

/// The process's peak resident set size in bytes: `VmHWM` in `/proc/self/status` (Linux).
/// Read rather than tracked by a counting allocator, so it covers memory-mapped weights that
/// were touched as well as the heap, and costs nothing while passes run.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.trim_start_matches("VmHWM:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// Whether `file_name` looks like a dump file this module writes (`NN-name.ir`).
fn is_dump_file_name(file_name: &str) -> bool {
    let Some(stem) = file_name.strip_suffix(".ir") else { return false };
    match stem.split_once('-') {
        Some((index, name)) => !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()) && !name.is_empty(),
        None => false,
    }
}

/// Creates `dir` if needed and removes dump files of an earlier run from it.
fn prepare_dump_dir(dir: &Path) -> Result<(), PassError> {
    let io = |source| PassError::Dump { path: dir.to_path_buf(), source };
    std::fs::create_dir_all(dir).map_err(io)?;
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.file_name().and_then(|n| n.to_str()).is_some_and(is_dump_file_name) {
            std::fs::remove_file(&path).map_err(|source| PassError::Dump { path, source })?;
        }
    }
    Ok(())
}

/// Writes `contents` to `path` through a temporary file in the same directory and a rename,
/// so that `path` holds either its old contents or all of the new ones, never a torn write.
pub fn write_atomically(path: &Path, contents: &str) -> Result<(), PassError> {
    let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("dump");
    let temp = path.with_file_name(format!(".{file_name}.{}.tmp", std::process::id()));
    let written = std::fs::write(&temp, contents).and_then(|()| std::fs::rename(&temp, path));
    written.map_err(|source| {
        let _ = std::fs::remove_file(&temp);
        PassError::Dump { path: path.to_path_buf(), source }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dump_file_names_are_recognised() {
        assert!(is_dump_file_name("00-frontend.ir"));
        assert!(is_dump_file_name("12-quantize.ir"));
        assert!(is_dump_file_name("100-dce.ir"));
        assert!(!is_dump_file_name("notes.ir"));
        assert!(!is_dump_file_name("00-.ir"));
        assert!(!is_dump_file_name("-dce.ir"));
        assert!(!is_dump_file_name("00-frontend.ir.bak"));
        assert!(!is_dump_file_name("x1-dce.ir"));
    }

    #[test]
    fn peak_rss_reads_vmhwm() {
        if std::path::Path::new("/proc/self/status").exists() {
            let peak = peak_rss().expect("VmHWM in /proc/self/status");
            assert!(peak > 1024 * 1024, "a test process peaks above 1 MiB, found {peak} bytes");
        }
    }
}
