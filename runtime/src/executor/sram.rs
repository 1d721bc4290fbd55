//! PE SRAM: each PE image's memory with its weight regions filled from the artifact's tile blob,
//! and the reads of those regions the ops make (finding a region, widening a row of it).

use std::ops::Range;

use waferc_ir::wafer::{wide, Pe, PeImage, RegionKind, WaferProgram};
use waferc_ir::{DType, Module};

use super::{site_of, ExecError, Executor, InstrRun, WeightRegionError};
use crate::kernels::RowView;

impl Executor<'_> {
    /// The bytes of weight region `region` of the `pe_index`-th PE image, as loaded into its SRAM.
    pub(crate) fn region_bytes(&self, pe_index: usize, region: usize) -> Option<&[u8]> {
        let found = self.program.pes.get(pe_index)?.regions.get(region)?;
        let RegionKind::Weight { .. } = &found.kind else { return None };
        self.sram.get(pe_index)?.get(found.offset as usize..)?.get(..found.bytes as usize)
    }

    /// The bytes of weight region `region` of `pe`'s image, with its description.
    pub(super) fn weight_region(&self, run: &InstrRun, pe: Pe, region: usize) -> Result<HeldWeight<'_>, ExecError> {
        let (index, image) = pe_image(self.program, pe).ok_or_else(|| ExecError::MalformedOnPe {
            site: run.site.clone(),
            pe,
            problem: "the PE has no SRAM image".into(),
        })?;
        let found = image.regions.get(region).ok_or_else(|| ExecError::MalformedOnPe {
            site: run.site.clone(),
            pe,
            problem: format!("region {region} does not exist ({} regions)", image.regions.len()),
        })?;
        let RegionKind::Weight { weight, rows, cols } = &found.kind else {
            return Err(ExecError::MalformedOnPe {
                site: run.site.clone(),
                pe,
                problem: format!("region {region} is not a weight region"),
            });
        };
        let malformed = |problem: String| ExecError::MalformedOnPe { site: run.site.clone(), pe, problem };
        let len = found.bytes;
        let bytes: &[u8] = match self.sram.get(index) {
            Some(sram) => sram.get(found.offset as usize..).and_then(|s| s.get(..len as usize)).ok_or_else(|| {
                malformed(format!(
                    "weight region {region} ({len} bytes at offset {}) lies outside the PE's {} bytes of SRAM",
                    found.offset,
                    sram.len()
                ))
            })?,
            None => &[],
        };
        Ok((*weight, wide(rows), wide(cols), bytes))
    }

    /// The index of the weight region of `instr` on `pe` holding weight `weight`, row `row`
    /// and elements `cols`.
    pub(super) fn find_weight_region(
        &self,
        run: &InstrRun,
        pe: Pe,
        weight: u32,
        row: u64,
        cols: &Range<u64>,
    ) -> Result<usize, ExecError> {
        let (_, image) = pe_image(self.program, pe).ok_or_else(|| ExecError::MalformedOnPe {
            site: run.site.clone(),
            pe,
            problem: "the PE has no SRAM image".into(),
        })?;
        image
            .regions
            .iter()
            .position(|r| match &r.kind {
                RegionKind::Weight { weight: w, rows, cols: c, .. } => {
                    r.instr == Some(run.instr)
                        && *w == weight
                        && wide(rows).contains(&row)
                        && c.start as u64 <= cols.start
                        && cols.end <= c.end as u64
                }
                _ => false,
            })
            .ok_or_else(|| ExecError::MalformedOnPe {
                site: run.site.clone(),
                pe,
                problem: format!(
                    "no weight region holds row {row}, elements {cols:?} of weight {}",
                    weight_name(self.module, weight)
                ),
            })
    }

    pub(super) fn weight_dtype(&self, weight: u32) -> DType {
        self.module.weights[waferc_ir::Handle::new(weight as usize)].ty.dtype
    }

    /// Elements `cols` of row `row` of a weight held in region `region` of `pe`, widened.
    pub(super) fn widen_from_region(
        &self,
        run: &InstrRun,
        pe: Pe,
        region: usize,
        row: u64,
        cols: Range<u64>,
    ) -> Result<Vec<f32>, ExecError> {
        let (weight, rows, held_cols, bytes) = self.weight_region(run, pe, region)?;
        // The region's ranges come from the artifact: a row or elements it does not hold are an
        // error naming it, not an underflow.
        let (Some(row_in_region), Some(from), Some(to), Some(width)) = (
            row.checked_sub(rows.start).filter(|_| rows.contains(&row)),
            cols.start.checked_sub(held_cols.start),
            cols.end.checked_sub(held_cols.start),
            held_cols.end.checked_sub(held_cols.start),
        ) else {
            let problem = format!("it does not hold row {row}, elements {cols:?}");
            return Err(self.region_error(run, pe, region, &problem));
        };
        let view = region_row(self.weight_dtype(weight), bytes, row_in_region, width)
            .ok_or_else(|| self.region_error(run, pe, region, "its bytes do not match its rows and elements"))?;
        let widened = view.widen();
        widened.get(from as usize..to as usize).map(<[f32]>::to_vec).ok_or_else(|| {
            let problem = format!("it does not hold elements {cols:?}");
            self.region_error(run, pe, region, &problem)
        })
    }

    pub(super) fn region_error(&self, run: &InstrRun, pe: Pe, region: usize, problem: &str) -> ExecError {
        match self.weight_region(run, pe, region) {
            Ok((weight, rows, cols, _)) => ExecError::WeightRegion(Box::new(WeightRegionError {
                site: run.site.clone(),
                pe,
                region,
                weight: weight_name(self.module, weight),
                rows,
                cols,
                problem: problem.to_string(),
            })),
            Err(error) => error,
        }
    }
}

/// A weight region as a PE holds it: (weight index, rows, elements of each row, bytes).
type HeldWeight<'a> = (u32, Range<u64>, Range<u64>, &'a [u8]);

/// Every PE's SRAM with its weight regions filled from the tile blob, checking each region's
/// byte count against its weight's type.
pub(super) fn load_sram(
    program: &WaferProgram,
    module: &Module,
    tile_blob: Option<&[u8]>,
) -> Result<Vec<Vec<u8>>, ExecError> {
    if !program.weights_present {
        return Err(ExecError::NoWeights);
    }
    let blob = tile_blob.ok_or(ExecError::NoWeights)?;
    if blob.len() as u64 != program.tile_blob_len {
        return Err(ExecError::TileBlobLength { expected: program.tile_blob_len, found: blob.len() as u64 });
    }
    let mut sram = Vec::with_capacity(program.pes.len());
    let mut ranges = program.blob_ranges().peekable();
    for (at, image) in program.pes.iter().enumerate() {
        // Only the weights are held as bytes (operand buffers sit above them, at the top).
        let size = image
            .regions
            .iter()
            .filter(|r| matches!(r.kind, RegionKind::Weight { .. }))
            .map(|r| r.offset as usize + r.bytes as usize)
            .max()
            .unwrap_or(0);
        let mut memory = vec![0u8; size];
        while let Some((_, index, range)) = ranges.next_if(|(of, _, _)| *of == at) {
            let region = &image.regions[index];
            let RegionKind::Weight { weight, rows, cols } = &region.kind else { continue };
            let (rows, cols) = (&wide(rows), &wide(cols));
            let site = site_of(program, region.instr.unwrap_or(0));
            let error = |problem: String| {
                ExecError::WeightRegion(Box::new(WeightRegionError {
                    site: site.clone(),
                    pe: image.pe,
                    region: index,
                    weight: weight_name(module, *weight),
                    rows: rows.clone(),
                    cols: cols.clone(),
                    problem,
                }))
            };
            let Some(spec) = module.weights.get(waferc_ir::Handle::new(*weight as usize)) else {
                return Err(error("the module has no such weight".into()));
            };
            // Every range comes from the artifact file: an inverted one is an error, not an underflow.
            let (Some(row_count), Some(col_count)) =
                (rows.end.checked_sub(rows.start), cols.end.checked_sub(cols.start))
            else {
                return Err(error(format!("inverted range: rows {rows:?}, cols {cols:?}")));
            };
            let held = range.end - range.start;
            let needed = spec.ty.dtype.row_bytes(col_count).and_then(|b| b.checked_mul(row_count));
            if needed != Some(held) {
                let needed = match needed {
                    Some(bytes) => format!("{bytes} bytes"),
                    None => format!("whole {}-element blocks", waferc_ir::BLOCK),
                };
                return Err(error(format!(
                    "it holds {held} bytes, but {row_count} rows of {col_count} {} elements need {needed}",
                    spec.ty.dtype
                )));
            }
            if range.end > blob.len() as u64 {
                return Err(error(format!("its bytes at {range:?} do not fit the tile blob ({} bytes)", blob.len())));
            }
            memory[region.offset as usize..][..held as usize]
                .copy_from_slice(&blob[range.start as usize..range.end as usize]);
        }
        sram.push(memory);
    }
    Ok(sram)
}

/// Weight `weight`'s name, for errors (`#index` if the module has no such weight).
pub(super) fn weight_name(module: &Module, weight: u32) -> String {
    module.weights.get(waferc_ir::Handle::new(weight as usize)).map_or_else(|| format!("#{weight}"), |w| w.name.clone())
}

/// Row `row` of a region holding rows of `cols` elements of `dtype`.
pub(super) fn region_row(dtype: DType, bytes: &[u8], row: u64, cols: u64) -> Option<RowView<'_>> {
    let row_bytes = dtype.row_bytes(cols)? as usize;
    let start = row as usize * row_bytes;
    RowView::new(dtype, bytes.get(start..start + row_bytes)?, cols as usize)
}

pub(super) fn pe_image(program: &WaferProgram, pe: Pe) -> Option<(usize, &PeImage)> {
    program.pes.binary_search_by(|image| image.pe.cmp(&pe)).ok().map(|i| (i, &program.pes[i]))
}
