//! The executor's error type. Every variant names the instruction it happened in (`%value`, its
//! op and layer, [`InstrSite`]) and, where one is involved, the PE and the route, so a broken
//! program or artifact points at the placement that caused it.

use std::fmt;
use std::ops::Range;

use waferc_ir::wafer::{Pe, Phase, RouteId};

use crate::error::RuntimeError;

/// An instruction of the placed program: `%value = op`, its decoder layer and MoE expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstrSite {
    pub value: u32,
    pub op: String,
    pub layer: Option<u32>,
    pub expert: Option<u32>,
}

impl fmt::Display for InstrSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{} = {}", self.value, self.op)?;
        if let Some(layer) = self.layer {
            write!(f, " (layer {layer}")?;
            if let Some(expert) = self.expert {
                write!(f, ", expert {expert}")?;
            }
            f.write_str(")")?;
        } else if let Some(expert) = self.expert {
            write!(f, " (expert {expert})")?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ExecError {
    #[error("the module does not verify: {0}")]
    InvalidModule(#[from] waferc_ir::IrError),
    #[error("the program has {program} instruction placements but the module has {module} instructions")]
    InstructionCount { program: usize, module: usize },
    #[error("placement {index} is for %{instr} = {op}, but the module's instruction {index} is {module_op}")]
    PlacementMismatch { index: usize, instr: u32, op: String, module_op: &'static str },
    #[error("{site}: {problem}")]
    Malformed { site: InstrSite, problem: String },
    #[error("{site} on {pe}: {problem}")]
    MalformedOnPe { site: InstrSite, pe: Pe, problem: String },
    #[error("the schedule: {problem}")]
    Schedule { problem: String },
    #[error("{site}: route {route} does not exist (the program has {routes} routes)")]
    MissingRoute { site: InstrSite, route: RouteId, routes: usize },
    #[error("{site}: route {route} is {found}, but it is used as {expected}")]
    RouteKind { site: InstrSite, route: RouteId, expected: &'static str, found: String },
    #[error("{site}: {pe} sends on route {route} in the {phase:?} phase, but no {phase:?} step of the instruction lists the route")]
    RouteNotInStep { site: InstrSite, route: RouteId, phase: Phase, pe: Pe },
    #[error("{site}: {pe} sends on route {route}, but it is not one of the route's sources")]
    NotASource { site: InstrSite, route: RouteId, pe: Pe },
    #[error("{site}: {pe} receives on route {route}, but it is not one of the route's destinations")]
    NotADestination { site: InstrSite, route: RouteId, pe: Pe },
    #[error("{site}: {pe} expects a message from {sender} on route {route}, but none was sent")]
    MissingMessage { site: InstrSite, route: RouteId, sender: Pe, pe: Pe },
    #[error("{site}: {sender} sends a second message on route {route} in one decode step")]
    DuplicateMessage { site: InstrSite, route: RouteId, sender: Pe },
    #[error("{site}: route {route} carries {found} values from {sender} to {pe}, expected {expected}")]
    MessageLength { site: InstrSite, route: RouteId, sender: Pe, pe: Pe, expected: usize, found: usize },
    #[error("{site}: {pe} needs elements {elements:?} of %{value}, but {problem}")]
    MissingOperand { site: InstrSite, pe: Pe, value: u32, elements: Range<u64>, problem: String },
    #[error("{site}: the path of route {route} is malformed: {problem}")]
    RoutePath { site: InstrSite, route: RouteId, problem: String },
    #[error("a timing-only executor computes no logits")]
    TimingOnly,
    #[error("seeking to position {position} needs a timing-only executor: with values, every earlier position's keys and values must be computed")]
    SeekWithValues { position: u32 },
    #[error("the program's weights are not present (a shape-only compile); only timing_only execution is possible")]
    NoWeights,
    #[error("the tile blob has {found} bytes, the program expects {expected}")]
    TileBlobLength { expected: u64, found: u64 },
    #[error("{0}")]
    WeightRegion(Box<WeightRegionError>),
    #[error("{site}: token {token} is outside the embedding table of {rows} rows")]
    TokenOutOfRange { site: InstrSite, token: u32, rows: u64 },
    #[error("position {position} is past the program's KV capacity of {max_context}")]
    ContextFull { position: u32, max_context: u32 },
    #[error("sequence {sequence} is not one of the program's {max_sequences} sequences in flight (compile with --max-sequences {})", sequence + 1)]
    NoSuchSequence { sequence: u32, max_sequences: u32 },
    #[error("the reference decoder: {0}")]
    Reference(Box<RuntimeError>),
    #[error("{0}")]
    Mismatch(Box<super::validate::Mismatch>),
}

impl From<RuntimeError> for ExecError {
    fn from(error: RuntimeError) -> Self {
        ExecError::Reference(Box::new(error))
    }
}

/// A weight region whose description or bytes do not fit what the instruction needs.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[error("{site} on {pe}: weight region {region} ({weight}, rows {rows:?}, cols {cols:?}): {problem}")]
pub struct WeightRegionError {
    pub site: InstrSite,
    pub pe: Pe,
    pub region: usize,
    pub weight: String,
    pub rows: Range<u64>,
    pub cols: Range<u64>,
    pub problem: String,
}
