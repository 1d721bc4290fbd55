//! Paths and colours. Paths are dimension-ordered: a multicast runs along the source's row to
//! every destination column, then down each column (matvec tile columns are PE columns); a
//! gather runs along each source column to the destination's row, then along that row; a
//! point-to-point message goes along the row, then the column. Traffic between wafers goes through each wafer's gateway PE `(0, 0)`.

use std::collections::BTreeMap;

use waferc_ir::wafer::{reduce_tree, Pe, Route, Run, TargetParams};

use super::precedence::Precedence;

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

/// A multicast tree from `source` to `destinations`: for each shelf (band of `shelf` rows) of
/// each wafer holding destinations, a path to the destination there nearest the source (through
/// the gateways for another wafer), then along that PE's row and down the destination columns.
/// Keeping each tree inside its shelf keeps long rows out of other instructions' regions.
pub(super) fn multicast(source: Pe, destinations: &[Pe], shelf: u16) -> Vec<Run> {
    let mut groups: BTreeMap<(u16, u16), Vec<Pe>> = BTreeMap::new();
    for d in destinations {
        groups.entry((d.wafer, d.y / shelf)).or_default().push(*d);
    }
    let mut runs = Vec::new();
    let mut left_home = false;
    let (mut east, mut west) = (source.wafer, source.wafer);
    for ((wafer, band), dests) in &groups {
        let from = if *wafer == source.wafer {
            source
        } else {
            if !left_home {
                xy(source, gateway(source.wafer), 1, &mut runs);
                left_home = true;
            }
            if *wafer > east {
                wafer_hops(east, *wafer, 1, &mut runs);
                east = *wafer;
            } else if *wafer < west {
                wafer_hops(west, *wafer, 1, &mut runs);
                west = *wafer;
            }
            gateway(*wafer)
        };
        let entry = if from.y / shelf == *band {
            from
        } else {
            let nearest = dests.iter().min_by_key(|d| (d.distance(from), **d)).copied().expect("groups are non-empty");
            // Down the column first: the trunk crosses other shelves along one column only.
            let corner = Pe::new(from.wafer, from.x, nearest.y);
            runs.push(run(from, corner, 1));
            if corner != nearest {
                runs.push(run(corner, nearest, 1));
            }
            nearest
        };
        row_then_columns(entry, dests, &mut runs);
    }
    runs
}

/// Along the source's row to every destination column, then down or up each column.
fn row_then_columns(source: Pe, dests: &[Pe], runs: &mut Vec<Run>) {
    let mut columns: BTreeMap<u16, (u16, u16)> = BTreeMap::new();
    for d in dests {
        let span = columns.entry(d.x).or_insert((d.y, d.y));
        span.0 = span.0.min(d.y);
        span.1 = span.1.max(d.y);
    }
    let (Some((&west, _)), Some((&east, _))) = (columns.first_key_value(), columns.last_key_value()) else { return };
    let at = |x: u16, y: u16| Pe::new(source.wafer, x, y);
    if west < source.x {
        runs.push(run(source, at(west, source.y), 1));
    }
    if east > source.x {
        runs.push(run(source, at(east, source.y), 1));
    }
    for (&x, &(north, south)) in &columns {
        let start = at(x, source.y);
        if north < source.y {
            runs.push(run(start, at(x, north), 1));
        }
        if south > source.y {
            runs.push(run(start, at(x, south), 1));
        }
    }
}

/// An in-tree from `sources` to `destination`: per shelf of each wafer, along the source
/// columns to the row of the source nearest the destination, along that row to it, then on to
/// the destination (through the gateways from another wafer). Each run's `messages` counts the
/// sources that feed it.
pub(super) fn gather(sources: &[Pe], destination: Pe, shelf: u16) -> Vec<Run> {
    let mut groups: BTreeMap<(u16, u16), Vec<Pe>> = BTreeMap::new();
    for s in sources {
        groups.entry((s.wafer, s.y / shelf)).or_default().push(*s);
    }
    let mut runs = Vec::new();
    for ((wafer, band), srcs) in &groups {
        let count = messages(srcs.len());
        let target = if *wafer == destination.wafer { destination } else { gateway(*wafer) };
        let exit = if target.y / shelf == *band {
            target
        } else {
            *srcs.iter().min_by_key(|s| (s.distance(target), **s)).expect("groups are non-empty")
        };
        columns_then_row(srcs, exit, &mut runs);
        xy(exit, target, count, &mut runs);
        if *wafer != destination.wafer {
            wafer_hops(*wafer, destination.wafer, count, &mut runs);
            xy(gateway(destination.wafer), destination, count, &mut runs);
        }
    }
    runs
}

fn messages(count: usize) -> u16 {
    u16::try_from(count).unwrap_or(u16::MAX)
}

/// Along each source column to the destination's row, then along that row.
fn columns_then_row(sources: &[Pe], dest: Pe, runs: &mut Vec<Run>) {
    // Per column: the northmost and southmost source and how many sources lie on each side.
    let mut columns: BTreeMap<u16, [(u16, usize); 2]> = BTreeMap::new();
    let mut on_column = BTreeMap::<u16, usize>::new();
    for s in sources {
        *on_column.entry(s.x).or_default() += 1;
        let sides = columns.entry(s.x).or_insert([(dest.y, 0), (dest.y, 0)]);
        if s.y < dest.y {
            sides[0] = (sides[0].0.min(s.y), sides[0].1 + 1);
        } else if s.y > dest.y {
            sides[1] = (sides[1].0.max(s.y), sides[1].1 + 1);
        }
    }
    let at = |x: u16, y: u16| Pe::new(dest.wafer, x, y);
    for (&x, sides) in &columns {
        for &(y, count) in sides {
            if count > 0 {
                runs.push(run(at(x, y), at(x, dest.y), messages(count)));
            }
        }
    }
    let west: usize = on_column.range(..dest.x).map(|(_, c)| c).sum();
    let east: usize = on_column.range(dest.x + 1..).map(|(_, c)| c).sum();
    if let Some((&x, _)) = on_column.first_key_value().filter(|(x, _)| **x < dest.x) {
        runs.push(run(at(x, dest.y), dest, messages(west)));
    }
    if let Some((&x, _)) = on_column.last_key_value().filter(|(x, _)| **x > dest.x) {
        runs.push(run(at(x, dest.y), dest, messages(east)));
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

/// Colours routes so that no two routes touching a PE share one while both can be active, by
/// DSatur: repeatedly colour the uncoloured route whose neighbours (routes sharing a PE with it
/// whose instructions are not ordered by [`Precedence`]) already use the most distinct colours
/// (ties: more PEs, then lower route index), with the lowest colour they leave free. Routes of
/// ordered instructions may share a colour: the router switches the colour between them.
/// Deterministic.
pub(super) fn assign_colours(
    routes: &mut [Route],
    params: &TargetParams,
    precedence: &Precedence,
) -> Result<(), ColourClash> {
    let (cols, rows) = (params.grid_cols as usize, params.grid_rows as usize);
    let index = |pe: Pe| (pe.wafer as usize * rows + pe.y as usize) * cols + pe.x as usize;
    let pe_count = cols * rows * params.wafers as usize;
    let limit = params.colours_per_pe.min(32) as u32;
    let all = if limit == 32 { u32::MAX } else { (1u32 << limit) - 1 };

    // Each route's PEs (deduplicated), and each PE's routes (compressed rows).
    let mut route_pes: Vec<Vec<u32>> = Vec::with_capacity(routes.len());
    let mut per_pe_count = vec![0u32; pe_count + 1];
    for route in routes.iter() {
        let mut pes = Vec::new();
        for_each_pe(route, |pe| pes.push(index(pe) as u32));
        pes.sort_unstable();
        pes.dedup();
        for &p in &pes {
            per_pe_count[p as usize + 1] += 1;
        }
        route_pes.push(pes);
    }
    for p in 0..pe_count {
        per_pe_count[p + 1] += per_pe_count[p];
    }
    let starts = per_pe_count;
    let mut fill = starts.clone();
    let mut pe_routes = vec![0u32; *starts.last().unwrap_or(&0) as usize];
    for (r, pes) in route_pes.iter().enumerate() {
        for &p in pes {
            pe_routes[fill[p as usize] as usize] = r as u32;
            fill[p as usize] += 1;
        }
    }

    let mut neighbour_colours = vec![0u32; routes.len()];
    let mut coloured = vec![false; routes.len()];
    let mut used = vec![0u32; pe_count];
    let mut queue: std::collections::BinaryHeap<(u32, usize, std::cmp::Reverse<usize>)> =
        route_pes.iter().enumerate().map(|(r, pes)| (0, pes.len(), std::cmp::Reverse(r))).collect();
    while let Some((saturation, _, std::cmp::Reverse(r))) = queue.pop() {
        if coloured[r] || saturation != neighbour_colours[r].count_ones() {
            continue;
        }
        let free = !neighbour_colours[r] & all;
        if free == 0 {
            let pe = route_pes[r].iter().max_by_key(|p| used[**p as usize].count_ones()).copied().unwrap_or(0) as usize;
            let (wafer, rest) = (pe / (cols * rows), pe % (cols * rows));
            return Err(ColourClash {
                route: r,
                pe: Pe::new(wafer as u16, (rest % cols) as u16, (rest / cols) as u16),
            });
        }
        let colour = free.trailing_zeros();
        routes[r].colour = colour as u8;
        coloured[r] = true;
        let bit = 1u32 << colour;
        for &p in &route_pes[r] {
            used[p as usize] |= bit;
            for &other in &pe_routes[starts[p as usize] as usize..starts[p as usize + 1] as usize] {
                let other = other as usize;
                if !coloured[other]
                    && neighbour_colours[other] & bit == 0
                    && !precedence.ordered(routes[r].instr as usize, routes[other].instr as usize)
                {
                    neighbour_colours[other] |= bit;
                    queue.push((
                        neighbour_colours[other].count_ones(),
                        route_pes[other].len(),
                        std::cmp::Reverse(other),
                    ));
                }
            }
        }
    }
    Ok(())
}
