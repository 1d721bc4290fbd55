//! Every range an artifact supplies is checked to be in order (`start <= end`) before the
//! executor uses it: the ops, the SRAM loader and the timing model take lengths and offsets
//! from these ranges (`end - start`, a row's offset within a region), and a malformed artifact
//! must give an error naming the instruction and the PE, not an underflow. A KV block's lanes
//! are checked here too: its rows' slots are computed from them.

use std::ops::Range;

use waferc_ir::wafer::{Pe, RegionKind};
use waferc_ir::wafer::{ResultLayout, RouteKind, WaferProgram, Work};
use waferc_ir::BLOCK;

use super::{site_of, ExecError};

/// The first inverted range of `program`, as an error naming where it is.
pub(super) fn check_ranges(program: &WaferProgram) -> Result<(), ExecError> {
    for image in &program.pes {
        for (index, region) in image.regions.iter().enumerate() {
            let instr = region.instr.unwrap_or(0);
            let on_pe = |what: String| malformed_on_pe(program, instr, image.pe, format!("region {index}: {what}"));
            match &region.kind {
                RegionKind::Weight { rows, cols, .. } => {
                    in_order(rows, "rows").map_err(on_pe)?;
                    in_order(cols, "elements").map_err(on_pe)?;
                }
                RegionKind::KvCache { positions, .. } => in_order(positions, "positions").map_err(on_pe)?,
                RegionKind::Operand { elements, .. } | RegionKind::Output { elements } => {
                    in_order(elements, "elements").map_err(on_pe)?
                }
                RegionKind::Code | RegionKind::Partial { .. } | RegionKind::Scratch => {}
            }
        }
    }
    for placement in &program.instrs {
        let on_pe = |pe: Pe, what: String| malformed_on_pe(program, placement.instr, pe, what);
        if let ResultLayout::Vector(layout) = &placement.result {
            for segment in &layout.segments {
                in_order(&segment.elements, "result segment elements").map_err(|w| on_pe(segment.pe, w))?;
            }
        }
        match &placement.work {
            Work::Embed { blocks, .. } => {
                for block in blocks {
                    in_order(&block.rows, "embedding block rows").map_err(|w| on_pe(block.pe, w))?;
                    in_order(&block.elements, "embedding block elements").map_err(|w| on_pe(block.pe, w))?;
                }
            }
            Work::MatVec(matvec) => {
                for tile in &matvec.tiles {
                    in_order(&tile.rows, "tile rows").map_err(|w| on_pe(tile.pe, w))?;
                    in_order(&tile.chunks, "tile chunks").map_err(|w| on_pe(tile.pe, w))?;
                }
            }
            Work::Attention(attention) => {
                for head in &attention.kv_heads_placed {
                    for block in &head.blocks {
                        in_order(&block.positions, &format!("KV head {}'s block positions", head.kv_head))
                            .map_err(|w| on_pe(block.pe, w))?;
                        // Rows fall in lanes by their offset in a chunk, so a block of some lanes
                        // is one chunk, starting where a chunk does.
                        let one_chunk = block.positions.start % BLOCK as u32 == 0 && block.positions.len() <= BLOCK;
                        if !block.lanes.is_aligned() || !(block.lanes.is_all() || one_chunk) {
                            return Err(on_pe(
                                block.pe,
                                format!(
                                    "KV head {}'s block {:?} holds {}: not an aligned power-of-two run of the 8 \
                                     lanes of one 32-position chunk",
                                    head.kv_head, block.positions, block.lanes
                                ),
                            ));
                        }
                    }
                }
            }
            _ => {}
        }
    }
    for route in &program.routes {
        if let RouteKind::Operand { elements, .. }
        | RouteKind::Gather { elements, .. }
        | RouteKind::Collect { elements } = &route.kind
        {
            in_order(elements, "elements").map_err(|what| ExecError::Malformed {
                site: site_of(program, route.instr),
                problem: format!("route {}: {what}", route.id),
            })?;
        }
    }
    Ok(())
}

fn in_order<T: PartialOrd + std::fmt::Debug>(range: &Range<T>, what: &str) -> Result<(), String> {
    match range.start <= range.end {
        true => Ok(()),
        false => Err(format!("{what} {range:?} end before they start")),
    }
}

fn malformed_on_pe(program: &WaferProgram, instr: u32, pe: Pe, problem: String) -> ExecError {
    ExecError::MalformedOnPe { site: site_of(program, instr), pe, problem }
}
