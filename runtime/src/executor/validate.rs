//! Validation: the executor and the reference decoder side by side, token by token, every
//! instruction's value compared bit for bit. On the first difference the report names the
//! instruction (op, value, layer, expert), the first differing element and the PE holding it,
//! and, when one of the instruction's weight regions holds bytes that differ from the module's
//! weight, that PE and region: the usual cause of a wrong tile.

use std::fmt;

use waferc_ir::wafer::{region_bytes, wide, Pe, RegionKind, ResultLayout, WaferProgram};
use waferc_ir::Module;

use super::{ExecError, ExecOptions, Executor, InstrSite};
use crate::reference::{argmax, InstrValue, ReferenceDecoder};

/// What to feed after the prompt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ValidationOptions {
    /// Tokens to generate after the prompt (each compared, as are the prompt's steps).
    pub max_new_tokens: usize,
    /// Tokens to feed instead of the argmax, while they last (teacher forcing).
    pub force_tokens: Option<Vec<u32>>,
    /// Stop after generating one of these.
    pub stop_tokens: Vec<u32>,
}

/// A successful validation.
#[derive(Clone, Debug, PartialEq)]
pub struct Validation {
    /// Steps run on both and found bit-identical (prompt and generated).
    pub steps: usize,
    /// The generated tokens (the reference's choice, equal to the executor's).
    pub tokens: Vec<u32>,
}

/// The first difference between the executor and the reference decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// The position whose step differed, and the token fed there.
    pub position: u32,
    pub token: u32,
    /// The first instruction, in schedule order, whose value differs.
    pub site: InstrSite,
    pub difference: Difference,
    /// The PE holding the first differing element (the router's PE for a routing).
    pub pe: Option<Pe>,
    /// A weight region of the instruction whose bytes differ from the module's weight.
    pub corrupt_region: Option<CorruptRegion>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Difference {
    /// Element `element` differs: the executor's and the reference's values.
    Element { element: u64, executor: f32, reference: f32 },
    /// The vectors have different lengths.
    Length { executor: usize, reference: usize },
    /// The routings differ: chosen `(expert, weight)` of each.
    Routing { executor: Vec<(u32, f32)>, reference: Vec<(u32, f32)> },
    /// One side computed a value the other did not (an expert chosen by only one, say).
    Presence { executor: &'static str, reference: &'static str },
}

#[derive(Clone, Debug, PartialEq)]
pub struct CorruptRegion {
    pub pe: Pe,
    pub region: usize,
    pub weight: String,
    /// The first row of the region whose bytes differ.
    pub row: u64,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "position {} (token {}): {} differs from the reference decoder: ",
            self.position, self.token, self.site
        )?;
        match &self.difference {
            Difference::Element { element, executor, reference } => write!(
                f,
                "element {element} is {executor:e} ({:#010x}) on the wafer, {reference:e} ({:#010x}) in the reference",
                executor.to_bits(),
                reference.to_bits()
            )?,
            Difference::Length { executor, reference } => {
                write!(f, "{executor} elements on the wafer, {reference} in the reference")?
            }
            Difference::Routing { executor, reference } => {
                write!(f, "the wafer chose {executor:?}, the reference {reference:?}")?
            }
            Difference::Presence { executor, reference } => {
                write!(f, "{executor} on the wafer, {reference} in the reference")?
            }
        }
        if let Some(pe) = self.pe {
            write!(f, "; held on {pe}")?;
        }
        if let Some(corrupt) = &self.corrupt_region {
            write!(
                f,
                "; {} region {} ({}, from row {}) holds bytes that differ from the module's weight",
                corrupt.pe, corrupt.region, corrupt.weight, corrupt.row
            )?;
        }
        Ok(())
    }
}

/// Runs `program` and the reference decoder on `module` side by side: feeds `prompt`, then up to
/// `options.max_new_tokens` tokens (forced, else the reference's argmax), comparing every
/// instruction's value of every step bit for bit. The first difference is
/// [`ExecError::Mismatch`]; any other failure of either side is returned as is.
pub fn validate(
    program: &WaferProgram,
    module: &Module,
    tile_blob: Option<&[u8]>,
    prompt: &[u32],
    options: &ValidationOptions,
) -> Result<Validation, ExecError> {
    if prompt.is_empty() {
        return Err(crate::RuntimeError::EmptyPrompt.into());
    }
    let mut executor =
        Executor::new(program, module, tile_blob, ExecOptions { timing_only: false, record_values: true })?;
    let mut reference = ReferenceDecoder::new(module, program.max_context as usize)?;
    reference.record_values(true);
    let order = executor.schedule_order();

    let mut validation = Validation { steps: 0, tokens: Vec::new() };
    let mut feed = prompt[0];
    let mut fed_prompt = 1;
    loop {
        let position = executor.position();
        executor.step(feed)?;
        let logits = reference.step(feed)?;
        let (ours, theirs) =
            (executor.last_values().expect("recording is on"), reference.last_values().expect("recording is on"));
        if let Some(mismatch) = first_mismatch(&executor, &order, ours, theirs, position, feed) {
            return Err(ExecError::Mismatch(Box::new(mismatch)));
        }
        validation.steps += 1;
        if fed_prompt < prompt.len() {
            feed = prompt[fed_prompt];
            fed_prompt += 1;
            continue;
        }
        if validation.tokens.len() == options.max_new_tokens {
            break;
        }
        let forced = options.force_tokens.as_ref().and_then(|f| f.get(validation.tokens.len()));
        let next = forced.copied().unwrap_or_else(|| argmax(&logits));
        validation.tokens.push(next);
        if options.stop_tokens.contains(&next) || validation.tokens.len() == options.max_new_tokens {
            break;
        }
        feed = next;
    }
    Ok(validation)
}

fn presence(value: &InstrValue) -> &'static str {
    match value {
        InstrValue::Tensor(_) => "a vector",
        InstrValue::Routing(_) => "a routing",
        InstrValue::Absent => "absent",
    }
}

fn first_mismatch(
    executor: &Executor,
    order: &[u32],
    ours: &[InstrValue],
    theirs: &[InstrValue],
    position: u32,
    token: u32,
) -> Option<Mismatch> {
    let program = executor.program();
    for &instr in order {
        let (a, b) = (&ours[instr as usize], &theirs[instr as usize]);
        // The copy that computed it, for an instruction of a replicated expert.
        let placement = executor.placement(instr);
        let (difference, pe) = match (a, b) {
            (InstrValue::Tensor(x), InstrValue::Tensor(y)) => {
                if x.len() != y.len() {
                    (Difference::Length { executor: x.len(), reference: y.len() }, None)
                } else {
                    let Some(element) = x.iter().zip(y).position(|(p, q)| p.to_bits() != q.to_bits()) else {
                        continue;
                    };
                    let pe = match &placement.result {
                        ResultLayout::Vector(layout) => {
                            layout.overlapping(element as u64..element as u64 + 1).next().map(|(s, _)| s.pe)
                        }
                        ResultLayout::Routing { pe } => Some(*pe),
                    };
                    (Difference::Element { element: element as u64, executor: x[element], reference: y[element] }, pe)
                }
            }
            (InstrValue::Routing(x), InstrValue::Routing(y)) => {
                let bits = |r: &crate::kernels::Routing| -> Vec<(u32, u32)> {
                    r.chosen.iter().map(|&(e, w)| (e, w.to_bits())).collect()
                };
                if bits(x) == bits(y) {
                    continue;
                }
                let pe = match placement.result {
                    ResultLayout::Routing { pe } => Some(pe),
                    ResultLayout::Vector(_) => None,
                };
                (Difference::Routing { executor: x.chosen.clone(), reference: y.chosen.clone() }, pe)
            }
            (InstrValue::Absent, InstrValue::Absent) => continue,
            _ => (Difference::Presence { executor: presence(a), reference: presence(b) }, None),
        };
        return Some(Mismatch {
            position,
            token,
            site: super::site_of(program, instr),
            difference,
            pe,
            corrupt_region: corrupt_region(executor, instr),
        });
    }
    None
}

/// The first weight region of `instr` (in PE order) whose SRAM bytes differ from the module's
/// weight bytes for the same rows and elements.
fn corrupt_region(executor: &Executor, instr: u32) -> Option<CorruptRegion> {
    let (program, module) = (executor.program(), executor.module());
    for (pe_index, image) in program.pes.iter().enumerate() {
        for (region_index, region) in image.regions.iter().enumerate() {
            let RegionKind::Weight { weight, rows, cols, .. } = &region.kind else { continue };
            let (rows, cols) = (wide(rows), wide(cols));
            if region.instr != Some(instr) {
                continue;
            }
            let spec = module.weights.get(waferc_ir::Handle::new(*weight as usize))?;
            let expected = region_bytes(module, &region.kind)?;
            // Ranges from the artifact: an inverted one finds no corrupt region, it is no underflow.
            let row_bytes = spec.ty.dtype.row_bytes(cols.end.checked_sub(cols.start)?)? as usize;
            let held = executor.region_bytes(pe_index, region_index)?;
            let differing = (0..rows.end.checked_sub(rows.start)?).find(|&k| {
                let row = k as usize * row_bytes..(k as usize + 1) * row_bytes;
                held.get(row.clone()) != expected.get(row)
            });
            if let Some(k) = differing {
                return Some(CorruptRegion {
                    pe: image.pe,
                    region: region_index,
                    weight: spec.name.clone(),
                    row: rows.start + k,
                });
            }
        }
    }
    None
}
