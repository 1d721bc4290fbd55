//! Views of a compiled placement for `waferc inspect`: a text summary, the full placement as
//! JSON, and an SVG picture of the wafer(s).
//!
//! Every view takes the [`WaferProgram`] (and, when the caller has it, the IR [`Module`] it was
//! compiled from, which supplies the model's name and weight names) and a [`Filter`] that
//! restricts it to one layer and/or a rectangle of PEs. All three are deterministic: the same
//! program and filter always give the same bytes.
//!
//! * [`summary_text`]: target, PEs used, SRAM and colour use per PE, routes and link load, where
//!   each layer and expert went, and a coarse ASCII map of the grid.
//! * [`placement_json`] / [`write_placement_json`]: every tile, KV block, vector segment, route
//!   and PE image, in the schema documented on [`placement_json`].
//! * [`placement_svg`]: PEs coloured by layer or expert, a link-load heat layer, a legend.
//!
//! [`WaferProgram`]: waferc_ir::wafer::WaferProgram
//! [`Module`]: waferc_ir::Module

mod analysis;
mod json;
mod summary;
mod svg;

use std::fmt;
use std::str::FromStr;

use waferc_ir::wafer::{Pe, WaferProgram};

pub use json::{placement_json, write_placement_json, PLACEMENT_SCHEMA};
pub use summary::summary_text;
pub use svg::placement_svg;

/// What the SVG colours PEs by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ColourBy {
    /// Each layer its own colour; the embedding and the head grey.
    #[default]
    Layer,
    /// Each MoE expert its own colour (the same colour in every layer); PEs outside experts
    /// (attention, norms, routers) light grey.
    Expert,
}

/// A rectangle of PEs: columns `x..x + w`, rows `y..y + h` (`--region X,Y,W,H`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rect {
    pub x: u16,
    pub y: u16,
    pub w: u16,
    pub h: u16,
}

impl Rect {
    pub fn contains(&self, x: u16, y: u16) -> bool {
        x >= self.x && x - self.x < self.w && y >= self.y && y - self.y < self.h
    }

    /// Whether the rectangle meets the box spanning columns `x0..=x1` and rows `y0..=y1`.
    fn meets(&self, (x0, x1): (u16, u16), (y0, y1): (u16, u16)) -> bool {
        let (end_x, end_y) = (self.x as u32 + self.w as u32, self.y as u32 + self.h as u32);
        (x1 >= self.x && (x0 as u32) < end_x) && (y1 >= self.y && (y0 as u32) < end_y)
    }
}

impl fmt::Display for Rect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{},{},{},{}", self.x, self.y, self.w, self.h)
    }
}

impl FromStr for Rect {
    type Err = FilterError;

    /// Parses `X,Y,W,H` (column, row, width, height; width and height at least 1).
    fn from_str(text: &str) -> Result<Rect, FilterError> {
        let bad = |reason: String| FilterError::BadRegion { text: text.to_string(), reason };
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        if fields.len() != 4 {
            return Err(bad(format!("expected 4 comma-separated numbers X,Y,W,H, found {}", fields.len())));
        }
        let mut numbers = [0u16; 4];
        for ((name, field), number) in ["X", "Y", "W", "H"].iter().zip(&fields).zip(&mut numbers) {
            *number = field.parse().map_err(|_| bad(format!("{name} = {field:?} is not a number from 0 to 65535")))?;
        }
        let [x, y, w, h] = numbers;
        if w == 0 || h == 0 {
            return Err(bad("width and height must be at least 1".to_string()));
        }
        Ok(Rect { x, y, w, h })
    }
}

/// Restricts every view (`--layer N`, `--region X,Y,W,H`, `--wafer W`).
///
/// * `layer`: only that decoder layer's PEs (those holding any of its regions), tiles, KV blocks,
///   segments and routes (a route belongs to the layer of the instruction it carries or computes,
///   and to the layers of the instructions receiving it as an operand).
/// * `region`: only PEs inside the rectangle (on every wafer unless `wafer` is set), and the
///   tiles, blocks and segments on them; routes with any PE inside it, and of those only the link
///   loads of hops with an end inside it. The map and the SVG zoom to the rectangle.
/// * `wafer`: only that wafer of a pipeline.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    pub layer: Option<u32>,
    pub region: Option<Rect>,
    pub wafer: Option<u16>,
}

impl Filter {
    /// No restriction.
    pub fn all() -> Filter {
        Filter::default()
    }

    pub fn is_all(&self) -> bool {
        *self == Filter::default()
    }

    /// Whether `pe` is on the filter's wafer and inside its rectangle (the layer is not checked).
    pub fn contains(&self, pe: Pe) -> bool {
        self.wafer.is_none_or(|w| w == pe.wafer) && self.region.is_none_or(|r| r.contains(pe.x, pe.y))
    }

    /// Checks the filter against `program`: the layer must be placed, the rectangle must meet the
    /// grid and the wafer must exist, so that an empty view always means an empty placement and
    /// never a typo.
    pub fn check(&self, program: &WaferProgram) -> Result<(), FilterError> {
        let target = &program.target;
        if let Some(wafer) = self.wafer {
            if wafer >= target.wafers {
                return Err(FilterError::NoSuchWafer { wafer, wafers: target.wafers });
            }
        }
        if let Some(rect) = self.region {
            if rect.x >= target.grid_cols || rect.y >= target.grid_rows {
                return Err(FilterError::RegionOutsideGrid {
                    rect,
                    grid_cols: target.grid_cols,
                    grid_rows: target.grid_rows,
                });
            }
        }
        if let Some(layer) = self.layer {
            let mut layers: Vec<u32> = program.instrs.iter().filter_map(|p| p.layer).collect();
            layers.sort_unstable();
            layers.dedup();
            if layers.binary_search(&layer).is_err() {
                let placed = match (layers.first(), layers.last()) {
                    (Some(first), Some(last)) => format!("layers {first} to {last}"),
                    _ => "no decoder layers".to_string(),
                };
                return Err(FilterError::NoSuchLayer { layer, placed });
            }
        }
        Ok(())
    }

    /// The filter in words (`layer 3, x 10..20 y 0..5 on wafer 1`), or `none`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(layer) = self.layer {
            parts.push(format!("layer {layer}"));
        }
        if let Some(r) = self.region {
            let end = |start: u16, len: u16| start as u32 + len as u32;
            parts.push(format!("x {}..{} y {}..{}", r.x, end(r.x, r.w), r.y, end(r.y, r.h)));
        }
        if let Some(wafer) = self.wafer {
            parts.push(format!("wafer {wafer}"));
        }
        if parts.is_empty() {
            "none".to_string()
        } else {
            parts.join(", ")
        }
    }
}

/// A filter that cannot apply to the program (or a `--region` that does not parse).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    #[error("--region {text:?}: {reason}")]
    BadRegion { text: String, reason: String },
    #[error("--region {rect} starts outside the {grid_cols} x {grid_rows} PE grid (columns x rows)")]
    RegionOutsideGrid { rect: Rect, grid_cols: u16, grid_rows: u16 },
    #[error("--wafer {wafer}: the target has {wafers} wafer(s), numbered from 0")]
    NoSuchWafer { wafer: u16, wafers: u16 },
    #[error("--layer {layer}: the program places {placed}")]
    NoSuchLayer { layer: u32, placed: String },
}
