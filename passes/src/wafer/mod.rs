//! Lowering an IR module onto a wafer target: tiling, placement, routing, schedule.
//!
//! [`compile`] runs four stages, each deterministic and linear in the number of tiles:
//!
//! 1. **Sizing** (`size`): every instruction gets a shape that fits one PE's SRAM: a matvec a grid
//!    of tiles (rows x an aligned power-of-two run of 32-element chunks, chosen to need the fewest
//!    PEs), the embedding row blocks, attention KV blocks of power-of-two position runs for
//!    `max_context`, vectors segments. A model that does not fit stops here, saying by how much
//!    and what would fit.
//! 2. **Placement** (`place`): layers go to wafers in a pipeline balanced on the PEs each layer
//!    really takes. A wafer is filled in shelves (bands of up to 8 PE rows), each filled column
//!    by column, instructions in program order, so consecutive layers are neighbours. A matvec's
//!    tiles form stripes of whole columns: a tile row runs along a PE row (its reduction is a
//!    straight line) and a tile column down PE columns (where its activation slice arrives); each
//!    result segment sits beside the tile row that completes it. Vector ops go on the PEs of
//!    their newest operand when the cut suits them and SRAM has room, so most activations never
//!    move. Each MoE expert gets a region of its own (no two experts share a PE), so the top-k
//!    the router picks never contend for PEs: they share only the multicast bringing their input
//!    and the gather into the combine. (Interleaving the experts' tile rows was tried: it
//!    stretches every expert's result gathers over the whole layer and runs out of colours.)
//!    The order of a layer's experts comes from the routing profile (`experts`): the hottest
//!    are placed last, beside the combine that gathers their outputs, and experts often picked
//!    together next to each other; without a profile, index order (uniform routing).
//! 3. **Routing** (`route`): dimension-ordered paths kept inside shelves where they can be (a
//!    multicast goes down one column into each shelf holding destinations, then along a row and
//!    down the destination columns; gathers the other way round), inter-wafer traffic leaving
//!    and entering a wafer at the west end of its rows, and DSatur colouring under the target's
//!    colour limit.
//! 4. **Schedule**: the steps of one decode step, each naming the routes it uses.
//!
//! [`check`] re-verifies a program independently of the placer's bookkeeping.

mod check;
mod detour;
mod experts;
mod partition;
mod place;
mod precedence;
mod route;
mod size;
mod stacked;

use std::fmt;

pub use check::{check, CheckError, Problem, MAX_PROBLEMS};
pub use experts::{expert_order, ExpertOrder, ReplicaPolicy};
pub use stacked::{tiles_estimate as stacked_tiles_estimate, TILE_SHARE as STACKED_TILE_SHARE};
use waferc_ir::wafer::{Pe, Plan, RoutingProfile, WaferProgram};
use waferc_ir::{IrError, Module};
use waferc_targets::Target;

/// Options of [`compile`].
#[derive(Clone, Debug, PartialEq)]
pub struct CompileOptions {
    /// KV capacity in positions (the longest prompt plus generated tokens the program supports).
    pub max_context: u32,
    /// The matvec plan: the default [`Plan::Tiled`], or WaferLLM's [`Plan::MeshGemv`].
    pub plan: Plan,
    /// Sequences in flight at once: each KV block holds this many sequences' positions.
    pub max_sequences: u32,
    /// Router statistics to place experts by (`None`: uniform routing assumed); stored in the
    /// program.
    pub profile: Option<RoutingProfile>,
    /// How experts are ordered within an MoE layer's region.
    pub expert_order: ExpertOrder,
    /// Which hot experts get copies on free PEs (with a guiding profile and `max_sequences`
    /// above 1; `experts::place_replicas`). `compile --expert-replicas auto` decides it from
    /// the pipeline model (`waferc::replica_choice`).
    pub expert_replicas: ReplicaPolicy,
}

impl CompileOptions {
    /// The default plan with KV capacity `max_context`.
    pub fn new(max_context: u32) -> Self {
        CompileOptions {
            max_context,
            plan: Plan::Tiled,
            max_sequences: 1,
            profile: None,
            expert_order: ExpertOrder::Profile,
            expert_replicas: ReplicaPolicy::Off,
        }
    }
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions::new(4096)
    }
}

/// Why a module could not be compiled for a target.
#[derive(Debug, thiserror::Error)]
pub enum WaferError {
    #[error("invalid module: {0}")]
    Module(#[from] IrError),
    #[error("compile options: {0}")]
    Options(String),
    #[error("{0}")]
    DoesNotFit(Box<NotFit>),
    #[error("%{instr} = {op}{}: {message}", layer_suffix(*layer))]
    Unsupported { instr: u32, op: &'static str, layer: Option<u32>, message: String },
    #[error(
        "{pe}: route {route} of %{instr} = {op}{} needs a colour, but its path meets routes that may run \
         alongside it holding all {limit} colours of a router ({holders}); {pe} is where the path meets the \
         most colours",
        layer_suffix(*layer)
    )]
    Colours { pe: Pe, route: u32, instr: u32, op: &'static str, layer: Option<u32>, limit: u8, holders: String },
}

fn layer_suffix(layer: Option<u32>) -> String {
    layer.map(|l| format!(" (layer {l})")).unwrap_or_default()
}

/// The does-not-fit report: how far the module is over, and what would fit.
#[derive(Debug, Clone, PartialEq)]
pub struct NotFit {
    pub target: String,
    pub needed_pes: u64,
    pub available_pes: u64,
    pub sram_bytes_per_pe: u32,
    /// When the total fits but one wafer of a pipeline does not: that wafer and its need.
    pub wafer: Option<(u16, u64)>,
    /// Targets and quantisations that would fit, e.g. `wse3x4`, `q8_0 on wse3`.
    pub would_fit: Vec<String>,
    /// With several sequences in flight (`max_sequences`): how many, and the PEs the KV blocks
    /// of all but the first take.
    pub kv_sequences: Option<(u32, u64)>,
}

impl NotFit {
    /// PEs short (on the wafer that overflows, for a pipeline).
    pub fn short_pes(&self) -> u64 {
        match self.wafer {
            Some((_, need)) => need.saturating_sub(self.available_pes),
            None => self.needed_pes.saturating_sub(self.available_pes),
        }
    }

    pub fn short_bytes(&self) -> u64 {
        self.short_pes() * self.sram_bytes_per_pe as u64
    }
}

impl fmt::Display for NotFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.wafer {
            Some((wafer, need)) => write!(
                f,
                "the module does not fit target {}: wafer {wafer} of the pipeline needs {need} PEs but a wafer has {}",
                self.target, self.available_pes
            )?,
            None => write!(
                f,
                "the module does not fit target {}: it needs {} PEs but the target has {}",
                self.target, self.needed_pes, self.available_pes
            )?,
        }
        write!(
            f,
            "; short by {} PEs ({} of SRAM at {} bytes per PE)",
            self.short_pes(),
            decimal_bytes(self.short_bytes()),
            self.sram_bytes_per_pe
        )?;
        if let Some((sequences, pes)) = self.kv_sequences {
            write!(
                f,
                "; the KV blocks of {} extra sequence(s) in flight (max sequences {sequences}) take {pes} PEs",
                sequences - 1
            )?;
        }
        if self.would_fit.is_empty() {
            write!(f, "; no built-in target or q8_0/q4_0 quantisation would fit it either")
        } else {
            write!(f, "; it would fit: {}", self.would_fit.join(", "))?;
            // Entries read `q4_0 on wse3`: show the pass that makes the first of them true.
            match self.would_fit.iter().find_map(|option| option.split_once(" on ").map(|(format, _)| format)) {
                Some(format) => write!(f, " (quantise with `--passes \"quantize {format}:all\"`)"),
                None => Ok(()),
            }
        }
    }
}

/// `1.92 MB`, `65.06 GB`: shortfalls range from a test grid's kilobytes to a wafer's gigabytes.
fn decimal_bytes(bytes: u64) -> String {
    let units = [(1e9, "GB"), (1e6, "MB"), (1e3, "kB")];
    match units.iter().find(|(scale, _)| bytes as f64 >= *scale) {
        Some((scale, unit)) => format!("{:.2} {unit}", bytes as f64 / scale),
        None => format!("{bytes} bytes"),
    }
}

/// Compiles `module` for `target`: tiles, placement, routes and schedule. Deterministic: the
/// same module, target and options always give the same program.
pub fn compile(module: &Module, target: &Target, options: &CompileOptions) -> Result<WaferProgram, WaferError> {
    waferc_ir::verify(module)?;
    if options.max_context == 0 {
        return Err(WaferError::Options("max_context must be at least 1".into()));
    }
    if options.max_sequences == 0 {
        return Err(WaferError::Options("max_sequences must be at least 1".into()));
    }
    if let Some(profile) = &options.profile {
        experts::check_profile(module, profile).map_err(WaferError::Options)?;
    }
    if let Plan::MeshGemv { p, group_num } = options.plan {
        if p == 0 || group_num == 0 {
            return Err(WaferError::Options(format!(
                "MeshGemv needs p >= 1 and group_num >= 1, got p {p}, group_num {group_num}"
            )));
        }
    }
    let params = target.params();
    let analysis = size::Analysis::new(module);
    let full = size::size_module(module, &params, options, None, size::Grain::DENSE)?;
    if let Plan::Stacked { layers_per_region, wafer_percent, kv_copies, experts_per_lane, kv_spread, kv_slices } =
        options.plan
    {
        if layers_per_region == 0
            || !(1..=100).contains(&wafer_percent)
            || kv_copies == 0
            || experts_per_lane == 0
            || !matches!(kv_spread, 1 | 2 | 4 | 8)
            || !matches!(kv_slices, 1 | 2 | 4 | 8)
        {
            return Err(WaferError::Options(format!(
                "stacked needs at least 1 layer per region, 1 to 100 percent of the wafer, at least one copy \
                 of each KV head, at least one expert per lane, KV blocks over 1, 2, 4 or 8 PEs and 1, 2, 4 or 8 \
                 slices of a KV head, got {}",
                options.plan
            )));
        }
        if experts_per_lane > 1 && !module.has_moe() {
            return Err(WaferError::Options(format!(
                "{}: share{experts_per_lane} shares MoE experts' lanes, and this model has no MoE layer",
                options.plan
            )));
        }
        // The densest sizing must fit before a spread one can.
        size::assign_wafers(module, &full.pes, &params)
            .map_err(|overflow| {
                WaferError::DoesNotFit(Box::new(NotFit {
                    target: target.name.clone(),
                    needed_pes: full.total_pes(),
                    available_pes: overflow.available,
                    sram_bytes_per_pe: params.sram_bytes_per_pe,
                    wafer: overflow.wafer,
                    would_fit: size::what_would_fit(module, target, options),
                    kv_sequences: None,
                }))
            })
            .map_err(|e| with_sequences(e, module, &full, options))?;
        return stacked::place(module, &analysis, &params, options, layers_per_region, wafer_percent)
            .map_err(|e| with_sequences(e, module, &full, options));
    }
    // The default plan spreads its tiles and vectors over a target with PEs to spare, finest
    // first; a spread placement that does not work out (stripes wasted more than sizing
    // estimated, or colours ran out) gives way to a coarser one, and at last to the dense sizes.
    let finer: Vec<size::Sizes> = match options.plan {
        Plan::Tiled => [size::FINE_SEGMENT, size::MAX_SEGMENT]
            .into_iter()
            .filter_map(|max_segment| size::spread_tiles(module, &params, options, &full, max_segment))
            .collect(),
        Plan::MeshGemv { .. } | Plan::Stacked { .. } => Vec::new(),
    };
    for sizes in &finer {
        if let Ok(program) = lower(module, target, &analysis, sizes, options) {
            return Ok(program);
        }
    }
    lower(module, target, &analysis, &full, options).map_err(|e| with_sequences(e, module, &full, options))
}

/// A does-not-fit error with several sequences in flight says what their KV blocks take.
fn with_sequences(error: WaferError, module: &Module, sizes: &size::Sizes, options: &CompileOptions) -> WaferError {
    match error {
        WaferError::DoesNotFit(mut not_fit) if options.max_sequences > 1 => {
            let extra = size::kv_block_pes(module, sizes) * (options.max_sequences as u64 - 1);
            not_fit.kv_sequences = Some((options.max_sequences, extra));
            WaferError::DoesNotFit(not_fit)
        }
        other => other,
    }
}

/// Wafer assignment and placement of sized instructions.
fn lower(
    module: &Module,
    target: &Target,
    analysis: &size::Analysis,
    sizes: &size::Sizes,
    options: &CompileOptions,
) -> Result<WaferProgram, WaferError> {
    let params = target.params();
    // A pipeline is balanced on what each instruction really takes once laid out.
    let loads =
        if params.wafers > 1 { place::measure(module, analysis, sizes, &params, options)? } else { sizes.pes.clone() };
    let wafer_of = size::assign_wafers(module, &loads, &params).map_err(|overflow| {
        let would_fit = size::what_would_fit(module, target, options);
        WaferError::DoesNotFit(Box::new(NotFit {
            target: target.name.clone(),
            needed_pes: loads.iter().sum(),
            available_pes: overflow.available,
            sram_bytes_per_pe: params.sram_bytes_per_pe,
            wafer: overflow.wafer,
            would_fit,
            kv_sequences: None,
        }))
    })?;
    place::place(module, analysis, sizes, &wafer_of, &params, options).map_err(|e| match e {
        WaferError::DoesNotFit(mut not_fit) => {
            not_fit.needed_pes = not_fit.needed_pes.max(sizes.total_pes());
            not_fit.would_fit = size::what_would_fit(module, target, options);
            WaferError::DoesNotFit(not_fit)
        }
        other => other,
    })
}
