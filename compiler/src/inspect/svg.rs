//! The SVG picture: one panel per wafer, PEs coloured by layer or expert, link load as heat.

use std::collections::BTreeSet;
use std::fmt::Write;

use waferc_ir::wafer::{Pe, WaferProgram};
use waferc_ir::Module;

use super::analysis::{Analysis, Cell, CellGrid, LinkLoads, Part, EAST, NORTH, SOUTH, WEST};
use super::summary::{human_bytes, thousands};
use super::{ColourBy, Filter};

/// Grids with at most this many PEs in view are drawn PE by PE, links included.
const MAX_PE_CELLS: u64 = 10_000;
/// Larger grids are drawn in square blocks of PEs, at most this many blocks over all panels
/// (and as many heat blocks), so that a WSE-3 picture stays under 50,000 elements.
const MAX_BLOCK_CELLS: u64 = 20_000;
/// Target size of a panel's longer side, in pixels.
const PANEL_PIXELS: u32 = 720;
const MARGIN: u32 = 16;
const TITLE_HEIGHT: u32 = 64;
const PANEL_LABEL: u32 = 18;
const PANEL_GAP: u32 = 28;
const LEGEND_ROW: u32 = 16;
const LEGEND_COLUMN: u32 = 210;

const EMPTY_FILL: &str = "#f4f4f4";
const HIDDEN_FILL: &str = "#dcdcdc";
const OUTSIDE_EXPERTS_FILL: &str = "#c4c4c4";
const EMBEDDING_FILL: &str = "#707070";
const HEAD_FILL: &str = "#303030";
/// Used PEs under the links of a heat panel.
const SHADOW_FILL: &str = "#e2e2e2";

/// An SVG picture of the placement (`waferc inspect --svg`). Per wafer shown, side by side: a panel
/// of PEs, each PE (grids up to 10,000 PEs in view) or each square block of PEs (larger grids, at
/// most 20,000 blocks in all, e.g. 7 x 7 PEs on a WSE-3) filled with the colour of the layer (or
/// expert) holding most of it; and a heat panel of link load per token, coloured on a log scale
/// from the least to the most loaded link shown (on PE grids a line per used link over the used
/// PEs, on block grids each block coloured by the busiest link leaving it), beside the PE panel for
/// tall or square grids and below it for wide ones. Links between wafers are dashed lines between
/// heat panels. A legend lists every layer (or expert) shown and the heat scale; the title names
/// the model and target. The [`Filter`] restricts what is coloured and which routes load the links,
/// and a rectangle zooms the panels to it.
///
/// Structure, for tools and tests: `<g id="wafer-W">` per wafer holding `<rect class="pe">`
/// (`data-pe="W,X,Y"`, with a `<title>`) or `<rect class="block">` (`data-block="W,X,Y,WIDTH,
/// HEIGHT"`) per PE or block holding anything; `<g id="heat">` with `class="link"` lines or
/// `class="heat-block"` rects (`data-bytes` = bytes per token) and `class="inter-wafer"` lines;
/// `<g id="legend">` with one `<g class="legend-entry" data-key="...">` per layer (`embedding`,
/// `layer N`, `head`) or expert (`expert N`, `outside experts`) shown, plus `other layers
/// (filtered out)` under a layer filter.
pub fn placement_svg(program: &WaferProgram, module: Option<&Module>, filter: &Filter, colour_by: ColourBy) -> String {
    let view = Analysis::new(program, module, filter);
    Picture::new(&view, colour_by).draw()
}

/// A legend key: what a colour stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Part(Part),
    Expert(u32),
    OutsideExperts,
    Hidden,
}

impl Key {
    fn label(self) -> String {
        match self {
            Key::Part(part) => part.label(),
            Key::Expert(expert) => format!("expert {expert}"),
            Key::OutsideExperts => "outside experts".to_string(),
            Key::Hidden => "other layers (filtered out)".to_string(),
        }
    }

    fn fill(self) -> String {
        match self {
            Key::Part(Part::Embedding) => EMBEDDING_FILL.to_string(),
            Key::Part(Part::Head) => HEAD_FILL.to_string(),
            Key::Part(Part::Layer(layer)) => distinct_colour(layer, 0.0),
            Key::Expert(expert) => distinct_colour(expert, 200.0),
            Key::OutsideExperts => OUTSIDE_EXPERTS_FILL.to_string(),
            Key::Hidden => HIDDEN_FILL.to_string(),
        }
    }
}

struct Picture<'v, 'a> {
    view: &'v Analysis<'a>,
    colour_by: ColourBy,
    wafers: Vec<u16>,
    grids: Vec<CellGrid>,
    loads: Vec<LinkLoads>,
    /// Side of a cell in pixels.
    cell_px: u32,
    per_pe: bool,
    panel_w: u32,
    panel_h: u32,
    /// Heat panels beside the PE panels (tall or square grids) rather than below them (wide grids).
    heat_beside: bool,
    /// The least and most loaded links drawn, inter-wafer links included: the heat scale's ends.
    min_load: u64,
    max_load: u64,
}

impl<'v, 'a> Picture<'v, 'a> {
    fn new(view: &'v Analysis<'a>, colour_by: ColourBy) -> Self {
        let wafers = view.wafers();
        let extent = view.extent();
        let panels = wafers.len().max(1) as u64;
        let per_pe = extent.cols as u64 * extent.rows as u64 * panels <= MAX_PE_CELLS;
        let mut block = 1u16;
        while !per_pe
            && (extent.cols as u64).div_ceil(block as u64) * (extent.rows as u64).div_ceil(block as u64) * panels
                > MAX_BLOCK_CELLS
        {
            block += 1;
        }
        let grids: Vec<CellGrid> = wafers.iter().map(|&w| view.cell_grid(w, block, block)).collect();
        let (cols, rows) = grids.first().map_or((1, 1), |g| (g.cols.max(1), g.rows.max(1)));
        let cell_px = (PANEL_PIXELS / cols.max(rows)).clamp(2, 28);
        let loads: Vec<LinkLoads> = wafers.iter().map(|&w| view.link_loads(w)).collect();
        let mut picture = Picture {
            view,
            colour_by,
            wafers,
            grids,
            loads,
            cell_px,
            per_pe,
            panel_w: cols * cell_px,
            panel_h: rows * cell_px,
            heat_beside: rows >= cols,
            min_load: 0,
            max_load: 0,
        };
        let inter_wafer = view.inter_wafer_loads();
        let loads = picture.heat_values().map(|(_, _, load)| load).chain(inter_wafer.values().copied());
        let (min, max) = loads.fold((u64::MAX, 0), |(min, max), load| (min.min(load), max.max(load)));
        (picture.min_load, picture.max_load) = (min.min(max), max);
        picture
    }

    fn key(&self, cell: &Cell) -> Option<Key> {
        match self.colour_by {
            ColourBy::Layer => cell.part.map(Key::Part),
            ColourBy::Expert => cell.expert.map(|e| e.map_or(Key::OutsideExperts, Key::Expert)),
        }
        .or((cell.hidden > 0).then_some(Key::Hidden))
    }

    /// Top left corner of wafer panel `index`.
    fn pe_panel(&self, index: usize) -> (u32, u32) {
        let stride = if self.heat_beside { 2 * self.panel_w + PANEL_GAP } else { self.panel_w };
        (MARGIN + index as u32 * (stride + PANEL_GAP), TITLE_HEIGHT + PANEL_LABEL)
    }

    /// Top left corner of the heat panel of wafer `index`.
    fn heat_panel(&self, index: usize) -> (u32, u32) {
        let (x, y) = self.pe_panel(index);
        if self.heat_beside {
            (x + self.panel_w + PANEL_GAP, y)
        } else {
            (x, y + self.panel_h + PANEL_GAP + PANEL_LABEL)
        }
    }

    fn draw(&self) -> String {
        let panels = self.grids.len().max(1);
        let (last_x, last_y) = self.heat_panel(panels - 1);
        let panels_right = last_x + self.panel_w;
        let panels_bottom = last_y + self.panel_h;
        let keys = self.keys();
        let top = self.pe_panel(0).1;
        let rows_per_column = ((panels_bottom - top) / LEGEND_ROW).max(12);
        let legend_columns = (keys.len() as u32).div_ceil(rows_per_column).max(1);
        let legend_x = panels_right + 2 * MARGIN;
        let legend_bottom = top + rows_per_column.min(keys.len() as u32) * LEGEND_ROW + 60;
        let (title, subtitle) = self.titles();
        // Bold 18 px text is about 11 px a character, 12 px text about 7.
        let text_width = (title.chars().count() as u32 * 11).max(subtitle.chars().count() as u32 * 7);
        let width = (legend_x + legend_columns * LEGEND_COLUMN).max(MARGIN + text_width) + MARGIN;
        let height = panels_bottom.max(legend_bottom) + MARGIN;

        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
        );
        let stops: String =
            HEAT_STOPS.iter().map(|(at, colour)| format!(r#"<stop offset="{at}" stop-color="{colour}"/>"#)).collect();
        let _ = writeln!(
            svg,
            r#"<defs><linearGradient id="heat-scale" x1="0" x2="1" y1="0" y2="0">{stops}</linearGradient></defs>"#
        );
        let _ = writeln!(svg, r#"<rect width="{width}" height="{height}" fill="white"/>"#);
        let _ =
            writeln!(svg, r#"<text x="{MARGIN}" y="24" font-size="18" font-weight="bold">{}</text>"#, escape(&title));
        let _ = writeln!(svg, r##"<text x="{MARGIN}" y="44" fill="#444">{}</text>"##, escape(&subtitle));
        for (index, grid) in self.grids.iter().enumerate() {
            self.pe_panel_svg(index, grid, &mut svg);
        }
        self.heat(&mut svg);
        self.legend(&keys, legend_x, rows_per_column, &mut svg);
        svg.push_str("</svg>\n");
        svg
    }

    fn titles(&self) -> (String, String) {
        let t = &self.view.program.target;
        let model = self.view.model_name().unwrap_or_else(|| "placement".to_string());
        let by = match self.colour_by {
            ColourBy::Layer => "layer",
            ColourBy::Expert => "expert",
        };
        let title = format!("{model} on {}: PEs coloured by {by}", t.name);
        let shown = self.grids.iter().flat_map(|g| &g.cells).map(|c| c.shown as u64).sum::<u64>();
        let mut subtitle = format!(
            "{} x {} PEs (columns x rows) x {} wafer(s); {} PEs shown",
            t.grid_cols,
            t.grid_rows,
            t.wafers,
            thousands(shown)
        );
        if let Some(g) = self.grids.first().filter(|_| !self.per_pe) {
            let _ = write!(subtitle, "; each cell {} x {} PEs", g.block_w, g.block_h);
        }
        if !self.view.filter.is_all() {
            let _ = write!(subtitle, "; filter: {}", self.view.filter.describe());
        }
        (title, subtitle)
    }

    fn pe_panel_svg(&self, index: usize, grid: &CellGrid, svg: &mut String) {
        let (x0, y0) = self.pe_panel(index);
        let e = grid.extent;
        let label = format!(
            "wafer {}: x {}..{}, y {}..{}",
            grid.wafer,
            e.x0,
            e.x0 as u32 + e.cols as u32,
            e.y0,
            e.y0 as u32 + e.rows as u32
        );
        let _ = writeln!(svg, r#"<g id="wafer-{}">"#, grid.wafer);
        let _ = writeln!(svg, r#"<text x="{x0}" y="{}">{}</text>"#, y0 - 5, escape(&label));
        let _ = writeln!(
            svg,
            r##"<rect class="panel" x="{x0}" y="{y0}" width="{}" height="{}" fill="{EMPTY_FILL}" stroke="#999"/>"##,
            self.panel_w, self.panel_h
        );
        let px = self.cell_px;
        for cy in 0..grid.rows {
            for cx in 0..grid.cols {
                let cell = &grid.cells[(cy * grid.cols + cx) as usize];
                let Some(key) = self.key(cell) else { continue };
                let (x, y) = (x0 + cx * px, y0 + cy * px);
                let (bx, by, bw, bh) = grid.cell_box(cx, cy);
                if self.per_pe {
                    let _ = writeln!(
                        svg,
                        r#"<rect class="pe" data-pe="{},{bx},{by}" x="{x}" y="{y}" width="{px}" height="{px}" fill="{}" stroke="white" stroke-width="0.5"><title>{}</title></rect>"#,
                        grid.wafer,
                        key.fill(),
                        escape(&self.pe_tooltip(Pe::new(grid.wafer, bx, by), key))
                    );
                } else {
                    let _ = writeln!(
                        svg,
                        r#"<rect class="block" data-block="{},{bx},{by},{bw},{bh}" x="{x}" y="{y}" width="{px}" height="{px}" fill="{}"/>"#,
                        grid.wafer,
                        key.fill()
                    );
                }
            }
        }
        svg.push_str("</g>\n");
    }

    fn pe_tooltip(&self, pe: Pe, key: Key) -> String {
        let used = self.view.program.pe(pe).map_or(0, |image| image.used_bytes());
        format!("{pe}: {}, {} bytes of SRAM", key.label(), thousands(used))
    }

    /// Link loads to draw: on PE grids, per undirected link inside the extent (the busier
    /// direction), as `(panel index, (from, to), bytes)`; on block grids, per block, the busiest
    /// link leaving any of its PEs, as `(panel index, (block corner, block corner), bytes)`.
    fn heat_values(&self) -> impl Iterator<Item = (usize, (Pe, Pe), u64)> + '_ {
        self.grids.iter().zip(&self.loads).enumerate().flat_map(move |(index, (grid, loads))| {
            let e = grid.extent;
            let wafer = grid.wafer;
            let mut values = Vec::new();
            if self.per_pe {
                for y in e.y0..e.y0 + e.rows {
                    for x in e.x0..e.x0 + e.cols {
                        let here = loads.at(x, y);
                        if x + 1 < e.x0 + e.cols {
                            let load = here[EAST].max(loads.at(x + 1, y)[WEST]);
                            values.push((index, (Pe::new(wafer, x, y), Pe::new(wafer, x + 1, y)), load));
                        }
                        if y + 1 < e.y0 + e.rows {
                            let load = here[SOUTH].max(loads.at(x, y + 1)[NORTH]);
                            values.push((index, (Pe::new(wafer, x, y), Pe::new(wafer, x, y + 1)), load));
                        }
                    }
                }
            } else {
                for cy in 0..grid.rows {
                    for cx in 0..grid.cols {
                        let (bx, by, bw, bh) = grid.cell_box(cx, cy);
                        let busiest = (by..by + bh)
                            .flat_map(|y| (bx..bx + bw).map(move |x| (x, y)))
                            .map(|(x, y)| loads.at(x, y).iter().copied().max().unwrap_or(0))
                            .max()
                            .unwrap_or(0);
                        let corner = Pe::new(wafer, bx, by);
                        values.push((index, (corner, Pe::new(wafer, bx + bw - 1, by + bh - 1)), busiest));
                    }
                }
            }
            values.into_iter().filter(|(_, _, load)| *load > 0)
        })
    }

    /// The heat panels: on PE grids, the PEs in light grey and a line per used link; on block
    /// grids, each block coloured by the busiest link leaving it. Then the links between wafers.
    fn heat(&self, svg: &mut String) {
        let px = self.cell_px;
        svg.push_str("<g id=\"heat\">\n");
        for (index, grid) in self.grids.iter().enumerate() {
            let (x0, y0) = self.heat_panel(index);
            let _ = writeln!(svg, r#"<text x="{x0}" y="{}">wafer {}: link bytes per token</text>"#, y0 - 5, grid.wafer);
            let _ = writeln!(
                svg,
                r##"<rect class="panel" x="{x0}" y="{y0}" width="{}" height="{}" fill="white" stroke="#999"/>"##,
                self.panel_w, self.panel_h
            );
            if self.per_pe {
                for (i, cell) in grid.cells.iter().enumerate().filter(|(_, c)| c.shown + c.hidden > 0) {
                    let (cx, cy) = (i as u32 % grid.cols, i as u32 / grid.cols);
                    let _ = writeln!(
                        svg,
                        r#"<rect x="{}" y="{}" width="{px}" height="{px}" fill="{}" stroke="white" stroke-width="0.5"/>"#,
                        x0 + cx * px,
                        y0 + cy * px,
                        if cell.shown > 0 { SHADOW_FILL } else { EMPTY_FILL }
                    );
                }
            }
        }
        for (index, (from, to), load) in self.heat_values() {
            let colour = heat_colour(self.heat_level(load));
            let grid = &self.grids[index];
            if self.per_pe {
                let (x1, y1) = self.heat_centre(index, grid, from);
                let (x2, y2) = self.heat_centre(index, grid, to);
                // Colour on the log scale, width linear: both the spread and the hot spots show.
                let width = px as f64 * (0.12 + 0.3 * load as f64 / self.max_load.max(1) as f64);
                let _ = writeln!(
                    svg,
                    r#"<line class="link" data-bytes="{load}" x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{colour}" stroke-width="{width:.1}" stroke-linecap="round"><title>{}</title></line>"#,
                    escape(&format!("{from} - {to}: {} bytes per token (busier direction)", thousands(load)))
                );
            } else {
                let Some(cell) = grid.cell_of(from.x, from.y) else { continue };
                let (cx, cy) = (cell as u32 % grid.cols, cell as u32 / grid.cols);
                let (x0, y0) = self.heat_panel(index);
                let (x, y) = (x0 + cx * px, y0 + cy * px);
                let _ = writeln!(
                    svg,
                    r#"<rect class="heat-block" data-bytes="{load}" x="{x}" y="{y}" width="{px}" height="{px}" fill="{colour}"/>"#
                );
            }
        }
        for ((from, to), load) in &self.view.inter_wafer_loads() {
            let ends = [from, to].map(|pe| {
                let index = self.wafers.iter().position(|w| *w == pe.wafer)?;
                let grid = &self.grids[index];
                grid.cell_of(pe.x, pe.y)?;
                Some(self.heat_centre(index, grid, *pe))
            });
            if let [Some((x1, y1)), Some((x2, y2))] = ends {
                let _ = writeln!(
                    svg,
                    r#"<line class="inter-wafer" data-bytes="{load}" x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{}" stroke-width="2" stroke-dasharray="6 3"><title>{}</title></line>"#,
                    heat_colour(self.heat_level(*load)),
                    escape(&format!("{from} -> {to}: {} bytes per token", thousands(*load)))
                );
            }
        }
        svg.push_str("</g>\n");
    }

    /// Where `load` sits on the heat scale from the least to the most loaded link, 0 to 1:
    /// logarithmic, because link loads span orders of magnitude (an embedding gather beside a
    /// norm's statistic) and a linear scale would show only the busiest few links.
    fn heat_level(&self, load: u64) -> f64 {
        if self.max_load <= self.min_load {
            return 1.0;
        }
        let span = (self.max_load as f64 / self.min_load.max(1) as f64).ln();
        ((load.max(1) as f64 / self.min_load.max(1) as f64).ln() / span).clamp(0.0, 1.0)
    }

    /// The centre of `pe` in the heat panel of wafer panel `index`.
    fn heat_centre(&self, index: usize, grid: &CellGrid, pe: Pe) -> (f64, f64) {
        let e = grid.extent;
        let (x0, y0) = self.heat_panel(index);
        let scale = self.cell_px as f64 / grid.block_w as f64;
        let x = x0 as f64 + (pe.x - e.x0) as f64 * scale + scale / 2.0;
        let y = y0 as f64 + (pe.y - e.y0) as f64 * scale + scale / 2.0;
        (x, y)
    }

    /// The legend keys of every cell drawn, in order.
    fn keys(&self) -> Vec<Key> {
        let keys: BTreeSet<Key> = self.grids.iter().flat_map(|g| &g.cells).filter_map(|c| self.key(c)).collect();
        keys.into_iter().collect()
    }

    fn legend(&self, keys: &[Key], x0: u32, rows_per_column: u32, svg: &mut String) {
        let top = self.pe_panel(0).1;
        svg.push_str("<g id=\"legend\">\n");
        let _ = writeln!(svg, r#"<text x="{x0}" y="{}" font-weight="bold">legend</text>"#, top - 5);
        for (i, key) in keys.iter().enumerate() {
            let (column, row) = (i as u32 / rows_per_column, i as u32 % rows_per_column);
            let (x, y) = (x0 + column * LEGEND_COLUMN, top + row * LEGEND_ROW);
            let label = escape(&key.label());
            let _ = writeln!(
                svg,
                r##"<g class="legend-entry" data-key="{label}"><rect x="{x}" y="{y}" width="12" height="12" fill="{}" stroke="#666" stroke-width="0.5"/><text x="{}" y="{}">{label}</text></g>"##,
                key.fill(),
                x + 16,
                y + 10
            );
        }
        let y = top + (keys.len() as u32).min(rows_per_column) * LEGEND_ROW + 16;
        // The scale's middle: the load at level 0.5 of the logarithmic scale.
        let middle = (self.min_load.max(1) as f64 * self.max_load as f64).sqrt().round() as u64;
        let _ = writeln!(
            svg,
            r##"<g id="heat-legend"><text x="{x0}" y="{y}">link bytes per token (log scale)</text><rect x="{x0}" y="{}" width="200" height="10" fill="url(#heat-scale)" stroke="#666" stroke-width="0.5"/><text x="{x0}" y="{}">{}</text><text x="{}" y="{}" text-anchor="middle">{}</text><text x="{}" y="{}" text-anchor="end">{}</text></g>"##,
            y + 6,
            y + 30,
            human_bytes(self.min_load),
            x0 + 100,
            y + 30,
            human_bytes(middle),
            x0 + 200,
            y + 30,
            human_bytes(self.max_load)
        );
        svg.push_str("</g>\n");
    }
}

/// The heat scale, light yellow to dark red (ColorBrewer YlOrRd).
const HEAT_STOPS: [(f64, &str); 5] =
    [(0.0, "#ffffb2"), (0.25, "#fecc5c"), (0.5, "#fd8d3c"), (0.75, "#f03b20"), (1.0, "#bd0026")];

/// The heat colour of `t` in `0..=1`.
fn heat_colour(t: f64) -> String {
    let t = t.clamp(0.0, 1.0);
    let upper = HEAT_STOPS.iter().position(|(at, _)| *at >= t).unwrap_or(HEAT_STOPS.len() - 1).max(1);
    let (a, ca) = HEAT_STOPS[upper - 1];
    let (b, cb) = HEAT_STOPS[upper];
    let f = if b > a { (t - a) / (b - a) } else { 0.0 };
    let (ra, rb) = (rgb(ca), rgb(cb));
    let mix = |i: usize| (ra[i] as f64 + (rb[i] as f64 - ra[i] as f64) * f).round() as u8;
    format!("#{:02x}{:02x}{:02x}", mix(0), mix(1), mix(2))
}

fn rgb(hex: &str) -> [u8; 3] {
    let channel = |i: usize| u8::from_str_radix(&hex[1 + 2 * i..3 + 2 * i], 16).unwrap_or(0);
    [channel(0), channel(1), channel(2)]
}

/// Colour `index` of a sequence whose neighbours differ clearly: hues a golden angle apart,
/// alternating lightness.
fn distinct_colour(index: u32, hue_offset: f64) -> String {
    let hue = (index as f64 * 137.507_764 + hue_offset) % 360.0;
    let lightness = [0.48, 0.64][index as usize & 1];
    let [r, g, b] = hsl_to_rgb(hue, 0.68, lightness);
    format!("#{r:02x}{g:02x}{b:02x}")
}

fn hsl_to_rgb(hue: f64, saturation: f64, lightness: f64) -> [u8; 3] {
    let chroma = (1.0 - (2.0 * lightness - 1.0).abs()) * saturation;
    let h = hue / 60.0;
    let x = chroma * (1.0 - (h % 2.0 - 1.0).abs());
    let (r, g, b) = match h as u32 {
        0 => (chroma, x, 0.0),
        1 => (x, chroma, 0.0),
        2 => (0.0, chroma, x),
        3 => (0.0, x, chroma),
        4 => (x, 0.0, chroma),
        _ => (chroma, 0.0, x),
    };
    let m = lightness - chroma / 2.0;
    [r, g, b].map(|c| ((c + m) * 255.0).round().clamp(0.0, 255.0) as u8)
}

/// Escapes text for SVG content and attribute values.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_covers_markup_characters() {
        assert_eq!(escape(r#"a<b>&"c'"#), "a&lt;b&gt;&amp;&quot;c&apos;");
    }

    #[test]
    fn heat_scale_runs_from_light_to_dark() {
        assert_eq!(heat_colour(0.0), "#ffffb2");
        assert_eq!(heat_colour(1.0), "#bd0026");
        assert_eq!(heat_colour(2.0), "#bd0026");
    }

    #[test]
    fn neighbouring_layers_get_different_colours() {
        let colours: BTreeSet<String> = (0..100).map(|i| distinct_colour(i, 0.0)).collect();
        assert_eq!(colours.len(), 100);
    }
}
