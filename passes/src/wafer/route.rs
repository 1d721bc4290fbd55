//! Paths and colours. Paths are dimension-ordered: a multicast runs along the source's column to
//! every destination row, then along each row; a gather runs along each source row to the
//! destination's column, then along that column; a point-to-point message goes along the row,
//! then the column. Traffic between wafers goes through each wafer's gateway PE `(0, 0)`.

use std::collections::BTreeMap;

use waferc_ir::wafer::{reduce_tree, Pe, Route, Run, TargetParams};

/// The PE through which a wafer talks to its neighbours in the pipeline.
pub(super) fn gateway(wafer: u16) -> Pe {
    Pe::new(wafer, 0, 0)
}

fn run(from: Pe, to: Pe, messages: u16) -> Run {
    Run { from, to, messages }
}

/// Row first, then column, on one wafer.
fn xy(from: Pe, to: Pe, messages: u16, runs: &mut Vec<Run>) {
    let corner = Pe::new(from.wafer, to.x, from.y);
    if corner != from {
        runs.push(run(from, corner, messages));
    }
    if corner != to {
        runs.push(run(corner, to, messages));
    }
}

/// Inter-wafer hops from gateway to gateway.
fn wafer_hops(from: u16, to: u16, messages: u16, runs: &mut Vec<Run>) {
    let mut w = from;
    while w != to {
        let next = if to > w { w + 1 } else { w - 1 };
        runs.push(run(gateway(w), gateway(next), messages));
        w = next;
    }
}

/// A point-to-point path.
pub(super) fn unicast(from: Pe, to: Pe, runs: &mut Vec<Run>) {
    if from.wafer == to.wafer {
        xy(from, to, 1, runs);
    } else {
        xy(from, gateway(from.wafer), 1, runs);
        wafer_hops(from.wafer, to.wafer, 1, runs);
        xy(gateway(to.wafer), to, 1, runs);
    }
}

/// A multicast tree from `source` to `destinations`.
pub(super) fn multicast(source: Pe, destinations: &[Pe]) -> Vec<Run> {
    let mut by_wafer: BTreeMap<u16, Vec<Pe>> = BTreeMap::new();
    for d in destinations {
        by_wafer.entry(d.wafer).or_default().push(*d);
    }
    let mut runs = Vec::new();
    if let Some(dests) = by_wafer.get(&source.wafer) {
        column_then_rows(source, dests, &mut runs);
    }
    if by_wafer.keys().any(|w| *w != source.wafer) {
        xy(source, gateway(source.wafer), 1, &mut runs);
    }
    // Hops chain outwards from the source wafer, each wafer's tree hanging off its gateway.
    let (mut east, mut west) = (source.wafer, source.wafer);
    for (wafer, dests) in by_wafer.range(source.wafer + 1..) {
        wafer_hops(east, *wafer, 1, &mut runs);
        east = *wafer;
        column_then_rows(gateway(*wafer), dests, &mut runs);
    }
    for (wafer, dests) in by_wafer.range(..source.wafer).rev() {
        wafer_hops(west, *wafer, 1, &mut runs);
        west = *wafer;
        column_then_rows(gateway(*wafer), dests, &mut runs);
    }
    runs
}

fn column_then_rows(source: Pe, dests: &[Pe], runs: &mut Vec<Run>) {
    let mut rows: BTreeMap<u16, (u16, u16)> = BTreeMap::new();
    for d in dests {
        let span = rows.entry(d.y).or_insert((d.x, d.x));
        span.0 = span.0.min(d.x);
        span.1 = span.1.max(d.x);
    }
    let (Some((&top, _)), Some((&bottom, _))) = (rows.first_key_value(), rows.last_key_value()) else { return };
    let at = |x: u16, y: u16| Pe::new(source.wafer, x, y);
    if top < source.y {
        runs.push(run(source, at(source.x, top), 1));
    }
    if bottom > source.y {
        runs.push(run(source, at(source.x, bottom), 1));
    }
    for (&y, &(west, east)) in &rows {
        let start = at(source.x, y);
        if west < source.x {
            runs.push(run(start, at(west, y), 1));
        }
        if east > source.x {
            runs.push(run(start, at(east, y), 1));
        }
    }
}

/// An in-tree from `sources` to `destination`; each run's `messages` counts the sources that
/// feed it.
pub(super) fn gather(sources: &[Pe], destination: Pe) -> Vec<Run> {
    let mut by_wafer: BTreeMap<u16, Vec<Pe>> = BTreeMap::new();
    for s in sources {
        by_wafer.entry(s.wafer).or_default().push(*s);
    }
    let mut runs = Vec::new();
    for (wafer, srcs) in &by_wafer {
        if *wafer == destination.wafer {
            rows_then_column(srcs, destination, &mut runs);
        } else {
            let count = messages(srcs.len());
            rows_then_column(srcs, gateway(*wafer), &mut runs);
            wafer_hops(*wafer, destination.wafer, count, &mut runs);
            xy(gateway(destination.wafer), destination, count, &mut runs);
        }
    }
    runs
}

fn messages(count: usize) -> u16 {
    u16::try_from(count).unwrap_or(u16::MAX)
}

fn rows_then_column(sources: &[Pe], dest: Pe, runs: &mut Vec<Run>) {
    // Per row: the westmost and eastmost source and how many sources lie on each side.
    let mut rows: BTreeMap<u16, [(u16, usize); 2]> = BTreeMap::new();
    let mut on_row = BTreeMap::<u16, usize>::new();
    for s in sources {
        *on_row.entry(s.y).or_default() += 1;
        let sides = rows.entry(s.y).or_insert([(dest.x, 0), (dest.x, 0)]);
        if s.x < dest.x {
            sides[0] = (sides[0].0.min(s.x), sides[0].1 + 1);
        } else if s.x > dest.x {
            sides[1] = (sides[1].0.max(s.x), sides[1].1 + 1);
        }
    }
    let at = |x: u16, y: u16| Pe::new(dest.wafer, x, y);
    for (&y, sides) in &rows {
        for &(x, count) in sides {
            if count > 0 {
                runs.push(run(at(x, y), at(dest.x, y), messages(count)));
            }
        }
    }
    let above: usize = on_row.range(..dest.y).map(|(_, c)| c).sum();
    let below: usize = on_row.range(dest.y + 1..).map(|(_, c)| c).sum();
    if let Some((&top, _)) = on_row.first_key_value().filter(|(y, _)| **y < dest.y) {
        runs.push(run(at(dest.x, top), dest, messages(above)));
    }
    if let Some((&bottom, _)) = on_row.last_key_value().filter(|(y, _)| **y > dest.y) {
        runs.push(run(at(dest.x, bottom), dest, messages(below)));
    }
}

/// The path of a reduction: each edge of the chunk tree over `leaves` in order, then the total
/// from the first leaf to `destination` if that is elsewhere.
pub(super) fn reduction(leaves: &[Pe], destination: Pe) -> Vec<Run> {
    let mut runs = Vec::new();
    for (receiver, sender) in reduce_tree(leaves.len()) {
        unicast(leaves[sender], leaves[receiver], &mut runs);
    }
    if leaves.first() != Some(&destination) {
        if let Some(first) = leaves.first() {
            unicast(*first, destination, &mut runs);
        }
    }
    runs
}

/// Calls `visit` with every PE a route touches (possibly more than once).
pub(super) fn for_each_pe(route: &Route, mut visit: impl FnMut(Pe)) {
    for pe in route.sources.iter().chain(&route.destinations) {
        visit(*pe);
    }
    for r in &route.path {
        if r.is_inter_wafer() {
            visit(r.from);
            visit(r.to);
            continue;
        }
        let (a, b) = (r.from, r.to);
        if a.y == b.y {
            for x in a.x.min(b.x)..=a.x.max(b.x) {
                visit(Pe::new(a.wafer, x, a.y));
            }
        } else {
            for y in a.y.min(b.y)..=a.y.max(b.y) {
                visit(Pe::new(a.wafer, a.x, y));
            }
        }
    }
}

/// A route that found every colour taken at `pe`.
pub(super) struct ColourClash {
    pub route: usize,
    pub pe: Pe,
}

/// Greedy colouring in route order: each route takes the lowest colour free on every PE it
/// touches.
pub(super) fn assign_colours(routes: &mut [Route], params: &TargetParams) -> Result<(), ColourClash> {
    let (cols, rows) = (params.grid_cols as usize, params.grid_rows as usize);
    let index = |pe: Pe| (pe.wafer as usize * rows + pe.y as usize) * cols + pe.x as usize;
    let mut used = vec![0u32; cols * rows * params.wafers as usize];
    let limit = params.colours_per_pe.min(32) as u32;
    let all = if limit == 32 { u32::MAX } else { (1u32 << limit) - 1 };
    for (i, route) in routes.iter_mut().enumerate() {
        let mut taken = 0u32;
        for_each_pe(route, |pe| taken |= used[index(pe)]);
        if taken & all == all {
            let mut full = None;
            for_each_pe(route, |pe| {
                if full.is_none() && used[index(pe)] & all == all {
                    full = Some(pe);
                }
            });
            return Err(ColourClash { route: i, pe: full.unwrap_or(route.sources[0]) });
        }
        let colour = (!taken & all).trailing_zeros();
        route.colour = colour as u8;
        for_each_pe(route, |pe| used[index(pe)] |= 1 << colour);
    }
    Ok(())
}
