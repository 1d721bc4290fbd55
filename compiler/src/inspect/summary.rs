//! The text summary: what the program uses of the target, and where each layer went.

use std::collections::BTreeMap;
use std::fmt::Write;

use waferc_ir::wafer::{Pe, Plan, RouteKind, WaferProgram};
use waferc_ir::Module;

use super::analysis::{median, Analysis, BBox, CellGrid, Part, SramKind};
use super::Filter;

/// Widest ASCII map, in characters (plus a 6-character row label): fits 100 columns.
const MAP_MAX_COLS: u32 = 96;
/// Most map rows when each character covers more than one PE.
const MAP_MAX_ROWS: u32 = 80;

/// The placement summary `waferc inspect` prints:
///
/// * the target (grid, wafers, SRAM, colours), the plan and KV capacity, the filter, and
///   `modeled_speed` verbatim when given (the executor's timing line, e.g. `"modeled speed:
///   1,812 tokens/s (607,000 cycles per token at 1.1 GHz)"`);
/// * PEs used, of the PEs in view (the grid, or the filter's rectangle), per wafer for a pipeline;
/// * SRAM per used PE, min / median / max and total, for all of it and by kind (weights, KV
///   cache, buffers = operands + partial sums + results + scratch, code reserve); with a layer
///   filter these are the whole SRAM of the PEs holding that layer;
/// * colours per PE (every route through a router counts, filtered or not): the maximum, the
///   target's limit and how many PEs are at it;
/// * routes by kind, the link bytes they move per token, and the busiest link;
/// * per part (embedding, each layer, head) and wafer, the bounding box of the PEs holding it,
///   and for MoE layers the same per expert;
/// * an ASCII map of each wafer shown: one character per PE on grids up to 96 x 96 PEs, else one
///   per block of `b x 2b` PEs (characters are about twice as tall as wide), showing the layer
///   holding most of the block's PEs (`0-9a-z` cycling, `E` embedding, `H` head, `.` empty).
pub fn summary_text(
    program: &WaferProgram,
    module: Option<&Module>,
    filter: &Filter,
    modeled_speed: Option<&str>,
) -> String {
    let view = Analysis::new(program, module, filter);
    let mut out = String::new();
    header(&view, modeled_speed, &mut out);
    pe_use(&view, &mut out);
    sram(&view, &mut out);
    colours(&view, &mut out);
    routes(&view, &mut out);
    footprints(&view, &mut out);
    expert_heat(program, filter, &mut out);
    for wafer in view.wafers() {
        map(&view, wafer, &mut out);
    }
    out
}

fn header(view: &Analysis, modeled_speed: Option<&str>, out: &mut String) {
    let t = &view.program.target;
    let _ = match view.model_name() {
        Some(model) => writeln!(out, "placement of {model} on {}", t.name),
        None => writeln!(out, "placement on {}", t.name),
    };
    let _ = writeln!(
        out,
        "target: {} x {} PEs (columns x rows) x {} wafer{}, {} bytes SRAM per PE ({} reserved for code), {} colours per PE",
        t.grid_cols,
        t.grid_rows,
        t.wafers,
        plural(t.wafers as u64),
        thousands(t.sram_bytes_per_pe as u64),
        thousands(t.code_reserve_bytes as u64),
        t.colours_per_pe
    );
    let plan = match view.program.plan {
        Plan::Tiled => "tiled".to_string(),
        Plan::MeshGemv { p, group_num } => format!("MeshGemv (p {p}, group_num {group_num})"),
        Plan::Stacked { layers_per_region, wafer_percent, kv_copies, experts_per_lane, kv_spread, kv_slices } => {
            let mut text = format!("stacked ({layers_per_region} layers per region, {wafer_percent}% of the wafer");
            if kv_copies > 1 {
                text += &format!(", {kv_copies} copies of each KV head");
            }
            if experts_per_lane > 1 {
                text += &format!(", {experts_per_lane} experts a lane");
            }
            if kv_spread > 1 {
                text += &format!(", each KV block over {kv_spread} PEs by lane");
            }
            if kv_slices > 1 {
                text += &format!(", each KV head's cache in {kv_slices} slices of its head dimension");
            }
            text + ")"
        }
    };
    let _ = writeln!(
        out,
        "plan: {plan}, KV capacity {} positions, weights {}",
        thousands(view.program.max_context as u64),
        if view.program.weights_present { "present" } else { "absent (shape-only compile)" }
    );
    if !view.filter.is_all() {
        let _ = writeln!(out, "filter: {}", view.filter.describe());
    }
    if let Some(speed) = modeled_speed {
        let _ = writeln!(out, "{}", speed.trim_end());
    }
}

fn pe_use(view: &Analysis, out: &mut String) {
    let extent = view.extent();
    let wafers = view.wafers();
    let per_wafer = extent.cols as u64 * extent.rows as u64;
    let mut used: BTreeMap<u16, u64> = wafers.iter().map(|&w| (w, 0)).collect();
    for image in view.kept_images() {
        *used.entry(image.pe.wafer).or_insert(0) += 1;
    }
    let total: u64 = used.values().sum();
    let what = match view.filter.layer {
        Some(layer) => format!("PEs holding layer {layer}"),
        None => "PEs used".to_string(),
    };
    let _ = writeln!(out, "\n{what}: {}", share(total, per_wafer * wafers.len() as u64));
    if wafers.len() > 1 {
        for (wafer, count) in used {
            let _ = writeln!(out, "  wafer {wafer}: {}", share(count, per_wafer));
        }
    }
}

fn sram(view: &Analysis, out: &mut String) {
    let mut all = Vec::new();
    let mut by_kind: [Vec<u64>; 4] = Default::default();
    for image in view.kept_images() {
        all.push(image.used_bytes());
        let mut kinds = [0u64; 4];
        for region in &image.regions {
            kinds[SramKind::of(&region.kind) as usize] += region.bytes as u64;
        }
        for (values, bytes) in by_kind.iter_mut().zip(kinds) {
            values.push(bytes);
        }
    }
    let capacity = view.program.target.sram_bytes_per_pe as u64;
    let _ = writeln!(
        out,
        "\nSRAM per PE (bytes, over the {} PEs above; capacity {}):",
        thousands(all.len() as u64),
        thousands(capacity)
    );
    let _ = writeln!(out, "  {:<9} {:>10} {:>10} {:>10} {:>12}", "", "min", "median", "max", "total");
    let mut row = |name: &str, values: &mut Vec<u64>| {
        let min = values.iter().min().copied().unwrap_or(0);
        let max = values.iter().max().copied().unwrap_or(0);
        let total: u64 = values.iter().sum();
        let median = median(values);
        let _ = writeln!(
            out,
            "  {name:<9} {:>10} {:>10} {:>10} {:>12}",
            thousands(min),
            thousands(median),
            thousands(max),
            human_bytes(total)
        );
    };
    row("all", &mut all);
    for (kind, values) in SramKind::ALL.iter().zip(&mut by_kind) {
        row(kind.name(), values);
    }
}

fn colours(view: &Analysis, out: &mut String) {
    let t = &view.program.target;
    let extent = view.extent();
    let limit = t.colours_per_pe as u16;
    let (mut routing_pes, mut max, mut at_limit) = (0u64, 0u16, 0u64);
    let mut count = |colours: u16| {
        if colours > 0 {
            routing_pes += 1;
            max = max.max(colours);
            at_limit += (colours >= limit) as u64;
        }
    };
    for wafer in view.wafers() {
        let in_use = view.colours_in_use(wafer);
        // A PE outside the grid (a malformed program) routes nothing the count can see.
        let at = |x: u16, y: u16| {
            if x < t.grid_cols && y < t.grid_rows {
                in_use[y as usize * t.grid_cols as usize + x as usize]
            } else {
                0
            }
        };
        if view.filter.layer.is_some() {
            // Only the PEs holding the layer; their routers also carry other layers' routes.
            for image in view.wafer_images(wafer).iter().filter(|image| view.pe_kept(image)) {
                count(at(image.pe.x, image.pe.y));
            }
        } else {
            for y in extent.y0..extent.y0 + extent.rows {
                for x in extent.x0..extent.x0 + extent.cols {
                    count(at(x, y));
                }
            }
        }
    }
    let _ = writeln!(
        out,
        "\ncolours per PE: max {max} of {limit}; {} PE{} at the limit; {} PE{} route something",
        thousands(at_limit),
        plural(at_limit),
        thousands(routing_pes),
        plural(routing_pes)
    );
}

fn routes(view: &Analysis, out: &mut String) {
    let mut kinds: BTreeMap<&str, u64> = BTreeMap::new();
    for route in view.kept_routes() {
        *kinds.entry(route_kind_name(&route.kind)).or_insert(0) += 1;
    }
    let total: u64 = kinds.values().sum();
    let by_kind: Vec<String> = kinds.iter().map(|(kind, n)| format!("{kind} {}", thousands(*n))).collect();
    let _ = writeln!(out, "routes: {}{}", thousands(total), paren(&by_kind.join(", ")));

    let t = &view.program.target;
    let mut moved = 0u64;
    let mut busiest = None;
    for wafer in view.wafers() {
        let loads = view.link_loads(wafer);
        moved += loads.total();
        if let Some(max) = loads.max(wafer) {
            if busiest.is_none_or(|(b, _, _)| max.0 > b) {
                busiest = Some(max);
            }
        }
    }
    let _ = write!(out, "link bytes per token: {} over all on-wafer links", human_bytes(moved));
    match busiest {
        Some((bytes, from, to)) => {
            let cycles = bytes.div_ceil(t.link_bytes_per_cycle.max(1) as u64);
            let _ = writeln!(
                out,
                "; busiest link {from} -> {to}: {} bytes per token ({} cycles at {} bytes per cycle)",
                thousands(bytes),
                thousands(cycles),
                t.link_bytes_per_cycle
            );
        }
        None => out.push('\n'),
    }
    let inter = view.inter_wafer_loads();
    if let Some(((from, to), bytes)) = inter.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0))) {
        let total: u64 = inter.values().sum();
        let _ = writeln!(
            out,
            "inter-wafer bytes per token: {} over {} link{}; busiest {from} -> {to}: {} bytes",
            human_bytes(total),
            inter.len(),
            plural(inter.len() as u64),
            thousands(*bytes)
        );
    }
}

pub(super) fn route_kind_name(kind: &RouteKind) -> &'static str {
    match kind {
        RouteKind::Operand { .. } => "operand",
        RouteKind::Gather { .. } => "gather",
        RouteKind::Collect { .. } => "collect",
        RouteKind::Reduce { .. } => "reduce",
        RouteKind::Statistic { .. } => "statistic",
        RouteKind::Routing => "routing",
    }
}

fn footprints(view: &Analysis, out: &mut String) {
    let footprints = view.footprints();
    let _ = writeln!(out, "\nlayers (bounding box of the PEs holding each part, per wafer):");
    let _ = writeln!(out, "  {:<10} {:>5} {:>9}  {:<11} y", "part", "wafer", "PEs", "x");
    for ((part, wafer), bbox) in &footprints.parts {
        let _ = writeln!(out, "  {:<10} {:>5} {:>9}  {}", part.label(), wafer, thousands(bbox.pes), spans(bbox));
    }
    if footprints.experts.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nexperts (bounding box of the PEs holding each expert of each layer, per wafer):");
    let _ = writeln!(out, "  {:<10} {:>6} {:>5} {:>9}  {:<11} y", "part", "expert", "wafer", "PEs", "x");
    for ((part, expert, wafer), bbox) in &footprints.experts {
        let _ = writeln!(
            out,
            "  {:<10} {:>6} {:>5} {:>9}  {}",
            part.label(),
            expert,
            wafer,
            thousands(bbox.pes),
            spans(bbox)
        );
    }
}

/// The routing profile the experts were placed by: per MoE layer, the hottest experts' shares
/// of the picks, as numbers and bars, and how many copies each has (with replicas: each copy's
/// PEs' bounding box); nothing when the program has no profile.
fn expert_heat(program: &WaferProgram, filter: &Filter, out: &mut String) {
    let Some(profile) = &program.routing_profile else {
        return;
    };
    let _ = writeln!(out, "\nexpert heat (routing profile from {}; each expert's share of the picks):", profile.source);
    for layer in profile.layers.iter().filter(|l| filter.layer.is_none_or(|f| f == l.layer)) {
        let mut experts: Vec<u32> = (0..layer.experts).collect();
        experts.sort_by(|&a, &b| layer.picks[b as usize].cmp(&layer.picks[a as usize]).then(a.cmp(&b)));
        let _ = writeln!(
            out,
            "  layer {} ({} tokens, top {} of {}; uniform share {:.1}%):",
            layer.layer,
            layer.tokens,
            layer.top_k,
            layer.experts,
            100.0 / layer.experts as f64
        );
        const SHOWN: usize = 8;
        for &e in experts.iter().take(SHOWN) {
            let heat = layer.heat(e);
            let bar = "#".repeat((heat * 100.0).round() as usize);
            let replica = program.replicas.iter().find(|r| r.layer == layer.layer && r.expert == e);
            let copies = match replica {
                Some(r) => {
                    let boxes = r
                        .copies
                        .iter()
                        .map(|copy| {
                            let pes: Vec<Pe> = copy.iter().flat_map(|p| p.compute_pes()).collect();
                            let (x0, x1) = (pes.iter().map(|p| p.x).min(), pes.iter().map(|p| p.x).max());
                            let (y0, y1) = (pes.iter().map(|p| p.y).min(), pes.iter().map(|p| p.y).max());
                            match (x0, x1, y0, y1, pes.first()) {
                                (Some(x0), Some(x1), Some(y0), Some(y1), Some(pe)) => {
                                    format!("w{} x{x0}-{x1} y{y0}-{y1}", pe.wafer)
                                }
                                _ => "no PEs".into(),
                            }
                        })
                        .collect::<Vec<_>>()
                        .join("; ");
                    format!(" ({} copies; extra at {boxes})", r.count())
                }
                None => String::new(),
            };
            let _ = writeln!(out, "    expert {e:>4} {:>5.1}% {bar}{copies}", 100.0 * heat);
        }
        if experts.len() > SHOWN {
            let rest: f64 = experts[SHOWN..].iter().map(|&e| layer.heat(e)).sum();
            let _ = writeln!(out, "    {} more experts {:.1}%", experts.len() - SHOWN, 100.0 * rest);
        }
    }
}

fn spans(bbox: &BBox) -> String {
    let columns = format!("{}-{}", bbox.x0, bbox.x1);
    format!("{columns:<11} {}-{}", bbox.y0, bbox.y1)
}

/// Block size of the map: 1 x 1 on small grids, else `b x 2b` to fit the width and height limits.
fn map_blocks(cols: u16, rows: u16) -> (u16, u16) {
    if cols as u32 <= MAP_MAX_COLS && rows as u32 <= MAP_MAX_COLS {
        return (1, 1);
    }
    let b = (cols as u32).div_ceil(MAP_MAX_COLS).max((rows as u32).div_ceil(2 * MAP_MAX_ROWS)).max(1);
    (b as u16, (2 * b).min(u16::MAX as u32) as u16)
}

fn map(view: &Analysis, wafer: u16, out: &mut String) {
    let extent = view.extent();
    let (block_w, block_h) = map_blocks(extent.cols, extent.rows);
    let grid = view.cell_grid(wafer, block_w, block_h);
    let scale = if block_w == 1 && block_h == 1 {
        "one character per PE".to_string()
    } else {
        format!("each character {block_w} x {block_h} PEs (columns x rows)")
    };
    let _ = writeln!(
        out,
        "\nmap of wafer {wafer}, x {}..{}, y {}..{} ({scale}, showing the part holding most PEs):",
        extent.x0,
        extent.x0 as u32 + extent.cols as u32,
        extent.y0,
        extent.y0 as u32 + extent.rows as u32
    );
    out.push_str(&ruler(&grid));
    let mut parts_shown: Vec<Part> = Vec::new();
    let mut hidden_shown = false;
    for cy in 0..grid.rows {
        let (_, y, _, _) = grid.cell_box(0, cy);
        let _ = write!(out, "{y:>5} ");
        for cx in 0..grid.cols {
            let cell = &grid.cells[(cy * grid.cols + cx) as usize];
            let symbol = match cell.part {
                Some(part) => {
                    if !parts_shown.contains(&part) {
                        parts_shown.push(part);
                    }
                    part.symbol()
                }
                None if cell.hidden > 0 => {
                    hidden_shown = true;
                    ':'
                }
                None => '.',
            };
            out.push(symbol);
        }
        out.push('\n');
    }
    out.push_str(&legend(&mut parts_shown, hidden_shown));
}

/// Column labels every 10 characters: the first PE column of the character below.
fn ruler(grid: &CellGrid) -> String {
    let mut line = vec![b' '; 6 + grid.cols as usize + 8];
    for cx in (0..grid.cols).step_by(10) {
        let (x, _, _, _) = grid.cell_box(cx, 0);
        for (i, digit) in x.to_string().bytes().enumerate() {
            line[6 + cx as usize + i] = digit;
        }
    }
    format!("{}\n", String::from_utf8_lossy(&line).trim_end())
}

fn legend(parts: &mut [Part], hidden: bool) -> String {
    parts.sort_unstable();
    let mut entries = Vec::new();
    let layers: Vec<u32> = parts.iter().filter_map(|p| if let Part::Layer(l) = p { Some(*l) } else { None }).collect();
    if parts.contains(&Part::Embedding) {
        entries.push("E embedding".to_string());
    }
    match (layers.first(), layers.last()) {
        (Some(first), Some(last)) if first == last => {
            entries.push(format!("{} layer {first}", Part::Layer(*first).symbol()))
        }
        (Some(first), Some(last)) => {
            let mut entry =
                format!("{}-{} layers {first}-{last}", Part::Layer(*first).symbol(), Part::Layer(*last).symbol());
            if *last >= 36 {
                entry.push_str(" (the symbols repeat every 36 layers: 0 is layer 0, 36, 72, ...)");
            }
            entries.push(entry);
        }
        _ => {}
    }
    if parts.contains(&Part::Head) {
        entries.push("H head".to_string());
    }
    if hidden {
        entries.push(": other layers (filtered out)".to_string());
    }
    entries.push(". empty".to_string());
    format!("legend: {}\n", entries.join(", "))
}

fn share(count: u64, of: u64) -> String {
    let percent = if of == 0 { 0.0 } else { 100.0 * count as f64 / of as f64 };
    format!("{} of {} ({percent:.2}%)", thousands(count), thousands(of))
}

fn paren(text: &str) -> String {
    if text.is_empty() {
        String::new()
    } else {
        format!(" ({text})")
    }
}

fn plural(n: u64) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// `1234567` as `1,234,567`.
pub(super) fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let groups: Vec<&str> =
        digits.as_bytes().rchunks(3).rev().map(|group| std::str::from_utf8(group).unwrap_or_default()).collect();
    groups.join(",")
}

/// Bytes in binary units: `512 B`, `1.50 KiB`, `3.25 GiB`.
pub(super) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}
