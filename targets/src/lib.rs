//! Wafer targets: the built-in WSE-2, WSE-3 and four-WSE-3 pipeline, small `grid:RxC` test grids,
//! and user TOML files.
//!
//! Every parameter carries where its value comes from (`/work/shared/reference/wafer-facts.md`
//! rows for the built-ins) and whether it is an assumption no public source states. Compilation
//! uses [`Target::params`], a plain copy stored in every compiled program.
//!
//! A target file is flat TOML; `base` starts from a built-in and the other keys override it:
//!
//! ```toml
//! name = "half-wse3"
//! base = "wse3"
//! grid_cols = 377
//! [sources]
//! grid_cols = "half the WSE-3 user rectangle"
//! assumed = ["grid_cols"]
//! ```

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use waferc_ir::wafer::TargetParams;

/// A target parameter: its value, where it comes from, and whether that source is an assumption.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Param<T> {
    pub value: T,
    pub source: String,
    pub assumed: bool,
}

impl<T> Param<T> {
    fn sourced(value: T, source: &str) -> Self {
        Param { value, source: source.to_string(), assumed: false }
    }
    fn assumed(value: T, source: &str) -> Self {
        Param { value, source: source.to_string(), assumed: true }
    }
}

/// The largest target file read (real ones are a few kilobytes).
pub const MAX_TARGET_FILE_BYTES: u64 = 1 << 20;

/// A wafer-scale target. Field names are the TOML keys of a target file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Target {
    pub name: String,
    pub description: String,
    /// PE columns of the usable rectangle of one wafer.
    pub grid_cols: Param<u16>,
    /// PE rows of the usable rectangle of one wafer.
    pub grid_rows: Param<u16>,
    /// Wafers in a pipeline (layers split across them).
    pub wafers: Param<u16>,
    pub sram_bytes_per_pe: Param<u32>,
    /// SRAM per PE kept for code and runtime state.
    pub code_reserve_bytes: Param<u32>,
    pub clock_hz: Param<f64>,
    /// Bytes per cycle per direction on a link between neighbour PEs.
    pub link_bytes_per_cycle: Param<u32>,
    pub hop_latency_cycles: Param<u32>,
    pub colours_per_pe: Param<u8>,
    pub f32_fma_per_cycle: Param<f64>,
    /// Cycles one hop between wafers takes.
    pub inter_wafer_latency_cycles: Param<u64>,
    /// Bytes per cycle between consecutive wafers.
    pub inter_wafer_bytes_per_cycle: Param<f64>,
}

/// Why a target spec could not be resolved. Each variant names the spec, file or field.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("unknown target `{spec}`: expected one of {known}, `grid:RxC` (e.g. grid:8x8), or a path to a .toml file")]
    Unknown { spec: String, known: String },
    #[error("target `{spec}`: {message}")]
    BadGrid { spec: String, message: String },
    #[error("target file {path}: {message}")]
    Read { path: String, message: String },
    #[error("target file {path}: field `{field}`: {message}")]
    Field { path: String, field: String, message: String },
}

impl Target {
    /// WSE-3 parameters on a `cols x rows` grid of `wafers` wafers.
    fn wse3_like(name: &str, description: &str, cols: Param<u16>, rows: Param<u16>, wafers: Param<u16>) -> Target {
        Target {
            name: name.to_string(),
            description: description.to_string(),
            grid_cols: cols,
            grid_rows: rows,
            wafers,
            sram_bytes_per_pe: Param::assumed(48 * 1024, "48 KiB, assumed the same as WSE-2 (wafer-facts.md)"),
            code_reserve_bytes: Param::assumed(
                2048,
                "2 KiB for program text and runtime state (decode kernels are a few hundred instructions); no public figure",
            ),
            clock_hz: Param::assumed(1.1e9, "1.1 GHz, assumed the same as WSE-2 (wafer-facts.md)"),
            link_bytes_per_cycle: Param::sourced(4, "one 32-bit wavelet per cycle per direction (Cerebras SDK)"),
            hop_latency_cycles: Param::assumed(1, "about 1 cycle per hop (SDK; assumed for WSE-3)"),
            colours_per_pe: Param::sourced(24, "24 routable colours per PE (Cerebras SDK)"),
            f32_fma_per_cycle: Param::assumed(1.0, "1 fp32 FMA per cycle per PE (derived from fp16 peak, assumed)"),
            inter_wafer_latency_cycles: Param::assumed(
                2200,
                "2 us at 1.1 GHz through SwarmX; per-hop latency is not public (wafer-facts.md)",
            ),
            inter_wafer_bytes_per_cycle: Param::assumed(
                136.0,
                "12 x 100 GbE = 150 GB/s per system at 1.1 GHz; multi-wafer links are not public",
            ),
        }
    }

    /// The WSE-2: 750 x 994 user rectangle, 48 KiB per PE, 1.1 GHz.
    pub fn wse2() -> Target {
        let mut t = Target::wse3_like(
            "wse2",
            "Cerebras WSE-2 (CS-2), one wafer, largest user rectangle",
            Param::sourced(750, "757 fabric columns minus 7 for host I/O (wafer-facts.md, WaferLLM compile.py)"),
            Param::sourced(994, "996 fabric rows minus 2 for host I/O (wafer-facts.md, WaferLLM compile.py)"),
            Param::sourced(1, "one wafer"),
        );
        t.sram_bytes_per_pe = Param::sourced(48 * 1024, "48 KiB in 8 banks of 6 KiB (Cerebras SDK, CSL appendix)");
        t.clock_hz = Param::sourced(1.1e9, "1.1 GHz (Hot Chips 34, 2022)");
        t.hop_latency_cycles = Param::sourced(1, "about 1 cycle per hop (Cerebras SDK; WaferLLM de-skews by x + y)");
        t
    }

    /// The WSE-3: 755 x 1170 user rectangle.
    pub fn wse3() -> Target {
        Target::wse3_like(
            "wse3",
            "Cerebras WSE-3 (CS-3), one wafer, largest user rectangle",
            Param::sourced(755, "762 fabric columns minus 7 for host I/O (wafer-facts.md, WaferLLM compile.py)"),
            Param::sourced(1170, "1172 fabric rows minus 2 for host I/O (wafer-facts.md, WaferLLM compile.py)"),
            Param::sourced(1, "one wafer"),
        )
    }

    /// Four WSE-3 wafers in a pipeline (how Llama 3.1 70B was served at 16 bits).
    pub fn wse3x4() -> Target {
        let mut t = Target::wse3();
        t.name = "wse3x4".to_string();
        t.description = "four Cerebras WSE-3 wafers in a layer pipeline (as for Llama 3.1 70B, 16-bit)".to_string();
        t.wafers = Param::sourced(4, "four CS-3 systems, pipelined (Hot Chips 2024 coverage, wafer-facts.md)");
        t
    }

    /// A `rows x cols` test grid with WSE-3's per-PE parameters.
    pub fn grid(rows: u16, cols: u16) -> Target {
        Target::wse3_like(
            &format!("grid:{rows}x{cols}"),
            &format!("{rows} x {cols} PEs with WSE-3 per-PE parameters (for tests)"),
            Param::sourced(cols, "grid spec"),
            Param::sourced(rows, "grid spec"),
            Param::sourced(1, "grid spec"),
        )
    }

    /// Resolves a target spec: a built-in name, `grid:RxC` (R rows, C columns), or a path to a
    /// `.toml` target file.
    pub fn resolve(spec: &str) -> Result<Target, TargetError> {
        if let Some(target) = list().into_iter().find(|t| t.name == spec) {
            return Ok(target);
        }
        if let Some(dims) = spec.strip_prefix("grid:") {
            return parse_grid(spec, dims);
        }
        if spec.ends_with(".toml") || Path::new(spec).is_file() {
            return Target::from_file(Path::new(spec));
        }
        let known: Vec<String> = list().into_iter().map(|t| t.name).collect();
        Err(TargetError::Unknown { spec: spec.to_string(), known: known.join(", ") })
    }

    /// Reads a target file (see the crate documentation for its form).
    pub fn from_file(path: &Path) -> Result<Target, TargetError> {
        use std::io::Read;
        let shown = path.display().to_string();
        let read_error = |message: String| TargetError::Read { path: shown.clone(), message };
        let file = std::fs::File::open(path).map_err(|e| read_error(e.to_string()))?;
        let mut text = String::new();
        // One byte past the limit tells "exactly at the limit" from "larger".
        file.take(MAX_TARGET_FILE_BYTES + 1).read_to_string(&mut text).map_err(|e| read_error(e.to_string()))?;
        if text.len() as u64 > MAX_TARGET_FILE_BYTES {
            return Err(read_error(format!("larger than the {MAX_TARGET_FILE_BYTES} bytes a target file may have")));
        }
        Target::from_toml(&text, &shown)
    }

    /// Parses target-file text; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Target, TargetError> {
        let table: toml::Table =
            toml::from_str(text).map_err(|e| TargetError::Read { path: origin.to_string(), message: e.to_string() })?;
        file::build(table, origin)
    }

    /// The plain parameters a compiled program records.
    pub fn params(&self) -> TargetParams {
        TargetParams {
            name: self.name.clone(),
            grid_cols: self.grid_cols.value,
            grid_rows: self.grid_rows.value,
            wafers: self.wafers.value,
            sram_bytes_per_pe: self.sram_bytes_per_pe.value,
            code_reserve_bytes: self.code_reserve_bytes.value,
            clock_hz: self.clock_hz.value,
            link_bytes_per_cycle: self.link_bytes_per_cycle.value,
            hop_latency_cycles: self.hop_latency_cycles.value,
            colours_per_pe: self.colours_per_pe.value,
            f32_fma_per_cycle: self.f32_fma_per_cycle.value,
            inter_wafer_latency_cycles: self.inter_wafer_latency_cycles.value,
            inter_wafer_bytes_per_cycle: self.inter_wafer_bytes_per_cycle.value,
        }
    }

    /// PEs over all wafers.
    pub fn total_pes(&self) -> u64 {
        self.grid_cols.value as u64 * self.grid_rows.value as u64 * self.wafers.value as u64
    }

    /// SRAM over all wafers, in bytes.
    pub fn total_sram_bytes(&self) -> u64 {
        self.total_pes() * self.sram_bytes_per_pe.value as u64
    }

    /// The target as JSON (for `waferc targets --json`).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("a target is plain data")
    }

    /// `(field, value, source, assumed)` rows in a fixed order, for descriptions.
    pub fn rows(&self) -> Vec<(&'static str, String, &str, bool)> {
        fn row<'a, T: fmt::Display>(name: &'static str, p: &'a Param<T>) -> (&'static str, String, &'a str, bool) {
            (name, p.value.to_string(), &p.source, p.assumed)
        }
        vec![
            row("grid_cols", &self.grid_cols),
            row("grid_rows", &self.grid_rows),
            row("wafers", &self.wafers),
            row("sram_bytes_per_pe", &self.sram_bytes_per_pe),
            row("code_reserve_bytes", &self.code_reserve_bytes),
            row("clock_hz", &self.clock_hz),
            row("link_bytes_per_cycle", &self.link_bytes_per_cycle),
            row("hop_latency_cycles", &self.hop_latency_cycles),
            row("colours_per_pe", &self.colours_per_pe),
            row("f32_fma_per_cycle", &self.f32_fma_per_cycle),
            row("inter_wafer_latency_cycles", &self.inter_wafer_latency_cycles),
            row("inter_wafer_bytes_per_cycle", &self.inter_wafer_bytes_per_cycle),
        ]
    }
}

/// The text description `waferc targets` prints: the name, totals, then one line per parameter
/// with its source, assumptions marked.
impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}: {}", self.name, self.description)?;
        writeln!(f, "  {} PEs, {:.1} GB SRAM in total", self.total_pes(), self.total_sram_bytes() as f64 / 1e9)?;
        for (field, value, source, assumed) in self.rows() {
            let mark = if assumed { " (assumed)" } else { "" };
            writeln!(f, "  {field:<28} {value:>12}  {source}{mark}")?;
        }
        Ok(())
    }
}

/// The built-in targets, in a fixed order (`grid:RxC` is a family, not listed).
pub fn list() -> Vec<Target> {
    vec![Target::wse2(), Target::wse3(), Target::wse3x4()]
}

fn parse_grid(spec: &str, dims: &str) -> Result<Target, TargetError> {
    let bad = |message: &str| TargetError::BadGrid { spec: spec.to_string(), message: message.to_string() };
    let (rows, cols) = dims.split_once('x').ok_or_else(|| bad("expected grid:RxC, e.g. grid:8x8"))?;
    let parse = |s: &str, what: &str| -> Result<u16, TargetError> {
        match s.parse::<u16>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(bad(&format!("{what} `{s}` must be a whole number from 1 to {}", u16::MAX))),
        }
    };
    Ok(Target::grid(parse(rows, "rows")?, parse(cols, "columns")?))
}

/// Target files: `base`, then field overrides, then `[sources]`.
mod file {
    use super::{list, Param, Target, TargetError};

    pub(super) fn build(mut table: toml::Table, origin: &str) -> Result<Target, TargetError> {
        let field_error = |field: &str, message: String| TargetError::Field {
            path: origin.to_string(),
            field: field.to_string(),
            message,
        };
        let name = match table.remove("name") {
            Some(toml::Value::String(s)) if !s.is_empty() => s,
            Some(other) => return Err(field_error("name", format!("must be a non-empty string, found {other}"))),
            None => return Err(field_error("name", "missing (every target file names its target)".into())),
        };
        let sources = match table.remove("sources") {
            Some(toml::Value::Table(t)) => t,
            Some(other) => return Err(field_error("sources", format!("must be a table, found {other}"))),
            None => toml::Table::new(),
        };
        let mut target = match table.remove("base") {
            Some(toml::Value::String(base)) => list().into_iter().find(|t| t.name == base).ok_or_else(|| {
                let known: Vec<String> = list().into_iter().map(|t| t.name).collect();
                field_error("base", format!("`{base}` is not a built-in target (known: {})", known.join(", ")))
            })?,
            Some(other) => return Err(field_error("base", format!("must be a built-in target name, found {other}"))),
            None => Target::empty(),
        };
        target.name = name;
        target.description = match table.remove("description") {
            Some(toml::Value::String(s)) => s,
            Some(other) => return Err(field_error("description", format!("must be a string, found {other}"))),
            None => format!("target file {origin}"),
        };

        let mut fields = Fields { table, sources, origin, error: &field_error };
        fields.int("grid_cols", &mut target.grid_cols, 1)?;
        fields.int("grid_rows", &mut target.grid_rows, 1)?;
        fields.int("wafers", &mut target.wafers, 1)?;
        fields.int("sram_bytes_per_pe", &mut target.sram_bytes_per_pe, 1)?;
        fields.int("code_reserve_bytes", &mut target.code_reserve_bytes, 0)?;
        fields.float("clock_hz", &mut target.clock_hz)?;
        fields.int("link_bytes_per_cycle", &mut target.link_bytes_per_cycle, 1)?;
        fields.int("hop_latency_cycles", &mut target.hop_latency_cycles, 0)?;
        fields.int("colours_per_pe", &mut target.colours_per_pe, 1)?;
        fields.float("f32_fma_per_cycle", &mut target.f32_fma_per_cycle)?;
        fields.int("inter_wafer_latency_cycles", &mut target.inter_wafer_latency_cycles, 0)?;
        fields.float("inter_wafer_bytes_per_cycle", &mut target.inter_wafer_bytes_per_cycle)?;
        fields.finish()?;

        if target.code_reserve_bytes.value >= target.sram_bytes_per_pe.value {
            return Err(field_error(
                "code_reserve_bytes",
                format!(
                    "{} leaves nothing of sram_bytes_per_pe = {}",
                    target.code_reserve_bytes.value, target.sram_bytes_per_pe.value
                ),
            ));
        }
        Ok(target)
    }

    impl Target {
        /// A target whose every field is missing (zero, source "missing"): a file without `base`
        /// must set them all, which `Fields::finish` checks.
        fn empty() -> Target {
            let missing = || "missing".to_string();
            fn m<T: Default>(source: String) -> Param<T> {
                Param { value: T::default(), source, assumed: false }
            }
            Target {
                name: String::new(),
                description: String::new(),
                grid_cols: m(missing()),
                grid_rows: m(missing()),
                wafers: m(missing()),
                sram_bytes_per_pe: m(missing()),
                code_reserve_bytes: m(missing()),
                clock_hz: m(missing()),
                link_bytes_per_cycle: m(missing()),
                hop_latency_cycles: m(missing()),
                colours_per_pe: m(missing()),
                f32_fma_per_cycle: m(missing()),
                inter_wafer_latency_cycles: m(missing()),
                inter_wafer_bytes_per_cycle: m(missing()),
            }
        }
    }

    struct Fields<'a, E: Fn(&str, String) -> TargetError> {
        table: toml::Table,
        sources: toml::Table,
        origin: &'a str,
        error: &'a E,
    }

    impl<E: Fn(&str, String) -> TargetError> Fields<'_, E> {
        fn source_of<T>(&mut self, field: &str, param: &mut Param<T>) -> Result<(), TargetError> {
            match self.sources.remove(field) {
                Some(toml::Value::String(s)) => param.source = s,
                Some(other) => {
                    return Err((self.error)(field, format!("[sources] entry must be a string, found {other}")))
                }
                None => param.source = format!("target file {}", self.origin),
            }
            param.assumed = match self.sources.get("assumed") {
                Some(toml::Value::Array(names)) => names.iter().any(|n| n.as_str() == Some(field)),
                _ => false,
            };
            Ok(())
        }

        fn int<T: TryFrom<i64> + Copy>(
            &mut self,
            field: &str,
            param: &mut Param<T>,
            min: i64,
        ) -> Result<(), TargetError> {
            match self.table.remove(field) {
                Some(toml::Value::Integer(n)) => {
                    let value = T::try_from(n).ok().filter(|_| n >= min).ok_or_else(|| {
                        (self.error)(
                            field,
                            format!("{n} is out of range (at least {min}, and must fit {})", type_name::<T>()),
                        )
                    })?;
                    param.value = value;
                    self.source_of(field, param)
                }
                Some(other) => Err((self.error)(field, format!("must be a whole number, found {other}"))),
                None if param.source == "missing" => {
                    Err((self.error)(field, "missing (set it, or start from a built-in with `base`)".into()))
                }
                None => Ok(()),
            }
        }

        fn float(&mut self, field: &str, param: &mut Param<f64>) -> Result<(), TargetError> {
            let value = match self.table.remove(field) {
                Some(toml::Value::Float(x)) => x,
                Some(toml::Value::Integer(n)) => n as f64,
                Some(other) => return Err((self.error)(field, format!("must be a number, found {other}"))),
                None if param.source == "missing" => {
                    return Err((self.error)(field, "missing (set it, or start from a built-in with `base`)".into()))
                }
                None => return Ok(()),
            };
            if !(value.is_finite() && value > 0.0) {
                return Err((self.error)(field, format!("must be a positive number, found {value}")));
            }
            param.value = value;
            self.source_of(field, param)
        }

        /// Rejects keys no field consumed (typos must not silently fall back to the base).
        fn finish(mut self) -> Result<(), TargetError> {
            if let Some(key) = self.table.keys().next() {
                return Err((self.error)(key, "is not a target field".into()));
            }
            self.sources.remove("assumed");
            if let Some(key) = self.sources.keys().next() {
                return Err((self.error)(
                    &format!("sources.{key}"),
                    "names no target field that this file sets".into(),
                ));
            }
            Ok(())
        }
    }

    fn type_name<T>() -> &'static str {
        std::any::type_name::<T>()
    }
}
