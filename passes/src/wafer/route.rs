//! Paths and colours. Paths are dimension-ordered: a multicast runs along the source's row to
//! every destination column, then down each column (matvec tile columns are PE columns); a
//! gather runs along each source column to the destination's row, then along that row; a
//! point-to-point message goes along the row, then the column. Traffic between wafers leaves and
//! enters a wafer at the west end of a row ([`gateway`]): along the sender's row to its west
//! edge, across, and along the receiver's row from its west edge.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use petgraph::graph::{NodeIndex, UnGraph};
use rustc_hash::FxHashMap;

use waferc_ir::wafer::serial::SharedPes;
use waferc_ir::wafer::{reduce_root, reduce_tree, Pe, Route, RouteId, RouteKind, Run, TargetParams};

use super::detour::{paths_for_legs, MeshView};
use super::precedence::Precedence;

/// The PE through which traffic on `row` leaves or enters `wafer`: the row's west end, beside
/// the host-I/O border west of the user rectangle, through which the SDK streams data into and
/// out of every row (wafer-facts.md). Which rows carry traffic between wafers is not public:
/// each row having its own way out is assumed. The bandwidth between two wafers stays the
/// system's one link (`inter_wafer_bytes_per_cycle`), which all rows share; before, every
/// route between wafers went through PE (0, 0), and the 70B's residual crossing to the next
/// wafer queued 7,680 cycles on that PE's one link.
pub(super) fn gateway(wafer: u16, row: u16) -> Pe {
    Pe::new(wafer, 0, row)
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

/// Inter-wafer hops from gateway `from` to gateway `to`, through the wafers between on `to`'s row.
fn wafer_hops(from: Pe, to: Pe, messages: u16, runs: &mut Vec<Run>) {
    let mut at = from;
    while at.wafer != to.wafer {
        let next = gateway(if to.wafer > at.wafer { at.wafer + 1 } else { at.wafer - 1 }, to.y);
        runs.push(run(at, next, messages));
        at = next;
    }
}

/// A point-to-point path.
pub(super) fn unicast(from: Pe, to: Pe, runs: &mut Vec<Run>) {
    if from.wafer == to.wafer {
        xy(from, to, 1, runs);
    } else {
        let (exit, entry) = (gateway(from.wafer, from.y), gateway(to.wafer, to.y));
        xy(from, exit, 1, runs);
        wafer_hops(exit, entry, 1, runs);
        xy(entry, to, 1, runs);
    }
}

/// The gateway by which traffic for (or from) `pes` on another wafer enters (or leaves) it: on
/// the row of the one nearest the west edge.
fn gateway_of(pes: &[Pe]) -> Pe {
    let westmost = pes.iter().min_by_key(|p| (p.x, p.y)).expect("groups are non-empty");
    gateway(westmost.wafer, westmost.y)
}

/// A multicast tree from `source` to `destinations`: for each shelf (band of `shelf` rows) of
/// each wafer holding destinations, a path to the destination there nearest the source (through
/// the gateways for another wafer), then along that PE's row and down the destination columns.
/// Keeping each tree inside its shelf keeps long rows out of other instructions' regions.
///
/// Traffic for other wafers crosses on row `crossing` when given (down the source's column to
/// it, then west; on the wafers reached, from the gateway on that row), so that the multicasts
/// of one value's segments cross side by side; else it leaves along the source's row and enters
/// each wafer on the row of its destination nearest the west edge.
pub(super) fn multicast(source: Pe, destinations: &[Pe], shelf: u16, crossing: Option<u16>) -> Vec<Run> {
    let mut groups: BTreeMap<(u16, u16), Vec<Pe>> = BTreeMap::new();
    for d in destinations {
        groups.entry((d.wafer, d.y / shelf)).or_default().push(*d);
    }
    let mut runs = Vec::new();
    let exit = gateway(source.wafer, crossing.unwrap_or(source.y));
    // The gateway by which the message reached each wafer, and the farthest reached each way.
    let mut reached: BTreeMap<u16, Pe> = BTreeMap::new();
    let (mut east, mut west) = (exit, exit);
    for ((wafer, band), dests) in &groups {
        let from = if *wafer == source.wafer {
            source
        } else if let Some(&gateway) = reached.get(wafer) {
            gateway
        } else {
            if reached.is_empty() {
                // Down the source's column to the crossing row, then west along it.
                runs.extend(single_source(source, exit, false));
            }
            let entry = crossing.map_or_else(|| gateway_of(dests), |row| gateway(*wafer, row));
            let last = if *wafer > source.wafer { &mut east } else { &mut west };
            let start = runs.len();
            wafer_hops(*last, entry, 1, &mut runs);
            reached.extend(runs[start..].iter().map(|r| (r.to.wafer, r.to)));
            *last = entry;
            entry
        };
        let entry = if from.y / shelf == *band {
            from
        } else {
            let nearest = dests.iter().min_by_key(|d| (d.distance(from), **d)).copied().expect("groups are non-empty");
            // From a gateway, along its row first (the crossing row is the route's own); else
            // down the column first: the trunk crosses other shelves along one column only.
            let corner = match *wafer != source.wafer {
                true => Pe::new(from.wafer, nearest.x, from.y),
                false => Pe::new(from.wafer, from.x, nearest.y),
            };
            if corner != from {
                runs.push(run(from, corner, 1));
            }
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
/// columns to the row of the source nearest the destination and along that row to it (sources
/// all in one column: along their rows, then its column), then on to
/// the destination (through the gateways from another wafer). Each run's `messages` counts the
/// sources that feed it.
pub(super) fn gather(sources: &[Pe], destination: Pe, shelf: u16) -> Vec<Run> {
    let mut groups: BTreeMap<(u16, u16), Vec<Pe>> = BTreeMap::new();
    for s in sources {
        groups.entry((s.wafer, s.y / shelf)).or_default().push(*s);
    }
    let mut runs = Vec::new();
    let entry = gateway(destination.wafer, destination.y);
    for ((wafer, band), srcs) in &groups {
        let count = messages(srcs.len());
        let target = if *wafer == destination.wafer { destination } else { gateway_of(srcs) };
        let exit = if target.y / shelf == *band {
            target
        } else {
            *srcs.iter().min_by_key(|s| (s.distance(target), **s)).expect("groups are non-empty")
        };
        // Three or more sources in one column (a tile grid's row roots) send along their own
        // rows first, side by side, rather than queueing down the column they share.
        let one_column = srcs.len() > 2 && srcs.iter().all(|s| s.x == srcs[0].x);
        lines_then_cross(srcs, exit, one_column, &mut runs);
        xy(exit, target, count, &mut runs);
        if *wafer != destination.wafer {
            wafer_hops(target, entry, count, &mut runs);
            xy(entry, destination, count, &mut runs);
        }
    }
    runs
}

/// A PE's out-links, for spreading one source's routes over them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Direction {
    North,
    East,
    South,
    West,
}

/// The link a straight move from `from` toward `to` leaves by: along the row when `rows_first`
/// and the columns differ, else along the column (`None` when they are the same PE).
pub(super) fn first_link(from: Pe, to: Pe, rows_first: bool) -> Option<Direction> {
    let along_row = match rows_first {
        true => from.x != to.x,
        false => from.y == to.y,
    };
    match along_row {
        true if to.x > from.x => Some(Direction::East),
        true if to.x < from.x => Some(Direction::West),
        false if to.y > from.y => Some(Direction::South),
        false if to.y < from.y => Some(Direction::North),
        _ => None,
    }
}

/// A single source's path to `destination` on its own wafer, along its row first when
/// `rows_first`, else along its column first (as [`gather`] goes from one source).
pub(super) fn single_source(source: Pe, destination: Pe, rows_first: bool) -> Vec<Run> {
    let mut runs = Vec::new();
    match rows_first {
        true => xy(source, destination, 1, &mut runs),
        false => lines_then_cross(&[source], destination, false, &mut runs),
    }
    runs
}

fn messages(count: usize) -> u16 {
    u16::try_from(count).unwrap_or(u16::MAX)
}

/// Along each source line to the destination's line across, then along that to the
/// destination: columns, then the destination's row; or with `rows_first`, rows, then the
/// destination's column.
fn lines_then_cross(sources: &[Pe], dest: Pe, rows_first: bool, runs: &mut Vec<Run>) {
    // A PE as (its line, where it lies along the line), and back.
    let split = |p: Pe| if rows_first { (p.y, p.x) } else { (p.x, p.y) };
    let join = |line: u16, along: u16| match rows_first {
        true => Pe::new(dest.wafer, along, line),
        false => Pe::new(dest.wafer, line, along),
    };
    let (dest_line, dest_along) = split(dest);
    // Per line: the farthest source on each side of the crossing line and how many lie there.
    let mut lines: BTreeMap<u16, [(u16, usize); 2]> = BTreeMap::new();
    let mut on_line = BTreeMap::<u16, usize>::new();
    for s in sources {
        let (line, along) = split(*s);
        *on_line.entry(line).or_default() += 1;
        let sides = lines.entry(line).or_insert([(dest_along, 0), (dest_along, 0)]);
        if along < dest_along {
            sides[0] = (sides[0].0.min(along), sides[0].1 + 1);
        } else if along > dest_along {
            sides[1] = (sides[1].0.max(along), sides[1].1 + 1);
        }
    }
    for (&line, sides) in &lines {
        for &(along, count) in sides {
            if count > 0 {
                runs.push(run(join(line, along), join(line, dest_along), messages(count)));
            }
        }
    }
    let before: usize = on_line.range(..dest_line).map(|(_, c)| c).sum();
    let after: usize = on_line.range(dest_line + 1..).map(|(_, c)| c).sum();
    if let Some((&line, _)) = on_line.first_key_value().filter(|(line, _)| **line < dest_line) {
        runs.push(run(join(line, dest_along), dest, messages(before)));
    }
    if let Some((&line, _)) = on_line.last_key_value().filter(|(line, _)| **line > dest_line) {
        runs.push(run(join(line, dest_along), dest, messages(after)));
    }
}

/// The path of a reduction: each edge of the chunk tree over `leaves` in order, toward
/// `destination` if it is a leaf (then the tree's total ends there), else toward the first leaf,
/// which then forwards the total to `destination`.
pub(super) fn reduction(leaves: &[Pe], destination: Pe) -> Vec<Run> {
    let root = reduce_root(leaves, destination);
    let mut runs = Vec::new();
    for (receiver, sender) in reduce_tree(leaves.len(), root) {
        unicast(leaves[sender], leaves[receiver], &mut runs);
    }
    if let Some(&last) = leaves.get(root).filter(|&&pe| pe != destination) {
        unicast(last, destination, &mut runs);
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

/// Orders one step's independent routes (deliveries, collects, gathers) in *waves*: each route,
/// in its given order, joins the first wave none of whose routes shares a directed link with
/// it, and the waves are sent one after another. A step's routes start together, and where two
/// share a link one waits for the other (the timing model grants a link first come, first
/// served, in the schedule's order, and a route starts once all its links are free); listed in
/// segment order, routes whose links
/// overlap only their neighbours' (a vector's segments multicast to consumers whose column
/// ranges overlap at their edges) each waited for the one before, a chain as long as the step.
/// In waves, a route waits only for the earlier waves it meets. Past [`MAX_WAVES`] waves the
/// rest keep their order at the end.
pub(super) fn order_in_waves(routes: &[Route], ids: &mut [RouteId]) {
    if ids.len() < 3 {
        return;
    }
    // Per directed link, the waves holding a route on it.
    let mut waves_on: FxHashMap<(Pe, Pe), u64> = FxHashMap::default();
    let mut wave_of = Vec::with_capacity(ids.len());
    let mut links: Vec<(Pe, Pe)> = Vec::new();
    for &id in ids.iter() {
        links.clear();
        links.extend(routes[id as usize].path.iter().flat_map(|run| run.hops()));
        let taken = links.iter().fold(0u64, |taken, link| taken | waves_on.get(link).copied().unwrap_or(0));
        let wave = (!taken).trailing_zeros() as usize;
        if wave < MAX_WAVES {
            for &link in &links {
                *waves_on.entry(link).or_default() |= 1 << wave;
            }
        }
        wave_of.push(wave.min(MAX_WAVES));
    }
    let mut order: Vec<(usize, RouteId)> = wave_of.into_iter().zip(ids.iter().copied()).collect();
    order.sort_by_key(|&(wave, _)| wave);
    for (slot, (_, id)) in ids.iter_mut().zip(order) {
        *slot = id;
    }
}

/// The most waves [`order_in_waves`] tells apart (one bit each per link).
const MAX_WAVES: usize = 63;

/// A route that found every colour taken at `pe`.
pub(super) struct ColourClash {
    pub route: usize,
    pub pe: Pe,
}

/// Dense index of a PE on the target.
fn pe_index(params: &TargetParams, pe: Pe) -> usize {
    let (cols, rows) = (params.grid_cols as usize, params.grid_rows as usize);
    (pe.wafer as usize * rows + pe.y as usize) * cols + pe.x as usize
}

/// Route `route`'s PEs into `out`, deduplicated and sorted by dense index (a route visits most
/// of its PEs more than once: a reduction's runs overlap). The colouring computes a route's
/// list when it needs it rather than holding every route's at once (the 8B's 95 million
/// route-PE pairs were 0.38 GB at the lowering's peak).
fn route_pes_into(route: &Route, params: &TargetParams, out: &mut Vec<u32>) {
    out.clear();
    for_each_pe(route, |pe| out.push(pe_index(params, pe) as u32));
    out.sort_unstable();
    out.dedup();
}

/// When two routes can never be active at the same time, so may share a colour on a PE: their
/// instructions are ordered by [`Precedence`], or are experts sharing a PE (run one after the
/// other: [`SharedPes`]), or they belong to one instruction and are sent in different steps of
/// the schedule (an instruction's steps run one after another, each step's messages delivered
/// before the next begins).
pub(super) struct RouteOrder<'a> {
    pub precedence: &'a Precedence,
    /// The schedule step sending each route (by route index).
    pub step_of: Vec<u32>,
    pub shared: &'a SharedPes,
}

impl RouteOrder<'_> {
    pub(super) fn apart(&self, routes: &[Route], r: usize, s: usize) -> bool {
        self.instrs_apart((r, routes[r].instr as usize), (s, routes[s].instr as usize))
    }

    /// [`RouteOrder::apart`] of routes `r` and `s` of instructions `a` and `b`.
    fn instrs_apart(&self, (r, a): (usize, usize), (s, b): (usize, usize)) -> bool {
        if a == b {
            self.step_of[r] != self.step_of[s]
        } else {
            self.precedence.ordered(a, b) || self.shared.share(a, b)
        }
    }
}

/// The route conflict graph: node `r` is route `r`; two routes are adjacent when they touch a
/// common PE and are not apart by [`RouteOrder`] (routes never active together may share a
/// colour: the router switches the colour between them). Edges are added route by route, by
/// the epoch of the route's instruction ([`Precedence::epoch`]) and then by index, so the graph
/// is the same on every run (the colouring reads only
/// neighbour sets, so the order of the edges does not matter to it).
/// Only routes of one epoch can be active together, so routes are taken epoch by epoch (then by
/// index), and each is compared with the routes of its epoch taken before it at each of its
/// PEs. Those lists live only for the epoch (a linked list of [`MetChunk`]s per PE, reset when
/// the epoch first touches the PE), so the working set is one epoch's region of the wafer
/// rather than every route of every PE (the 8B's 95 million route-PE pairs: reading per-PE
/// lists of the whole program, in route order, was most of the colouring's time in cache
/// misses). Also returns each route's PE count.
pub(super) fn conflict_graph(
    routes: &[Route],
    params: &TargetParams,
    order: &RouteOrder,
) -> (UnGraph<(), ()>, Vec<u32>) {
    const NONE: u32 = u32::MAX;
    let pe_count = params.grid_cols as usize * params.grid_rows as usize * params.wafers as usize;
    // Each route's instruction and epoch, read for every pair: looked up in the routes
    // themselves they were most of the colouring's time in cache misses.
    let instr: Vec<u32> = routes.iter().map(|route| route.instr).collect();
    let epoch: Vec<u32> = instr.iter().map(|&i| order.precedence.epoch(i as usize)).collect();
    let mut visit: Vec<u32> = (0..routes.len() as u32).collect();
    visit.sort_by_key(|&r| (epoch[r as usize], r));
    let mut graph = UnGraph::with_capacity(routes.len(), 0);
    for _ in routes {
        graph.add_node(());
    }
    // Per PE: the epoch its list belongs to, and the list's newest chunk in `met`.
    let mut list_epoch = vec![NONE; pe_count];
    let mut head = vec![NONE; pe_count];
    let mut met: Vec<MetChunk> = Vec::new();
    // `seen_by[s] == r`: the pair (s, r) was already considered.
    let mut seen_by = vec![NONE; routes.len()];
    let mut pe_counts = vec![0u32; routes.len()];
    // `visited_by[p] == r`: route `r` already listed PE `p` (each route's PEs once, in path
    // order: sorting them instead was a third of the graph's time).
    let mut visited_by = vec![NONE; pe_count];
    let mut pes: Vec<u32> = Vec::new();
    let mut current = NONE;
    for &r in &visit {
        let (r_instr, r_epoch) = (instr[r as usize] as usize, epoch[r as usize]);
        if r_epoch != current {
            current = r_epoch;
            met.clear();
        }
        pes.clear();
        for_each_pe(&routes[r as usize], |pe| {
            let p = pe_index(params, pe);
            if visited_by[p] != r {
                visited_by[p] = r;
                pes.push(p as u32);
            }
        });
        pe_counts[r as usize] = pes.len() as u32;
        for &p in &pes {
            let p = p as usize;
            if list_epoch[p] != r_epoch {
                list_epoch[p] = r_epoch;
                head[p] = NONE;
            }
            let mut at = head[p];
            while at != NONE {
                let chunk = &met[at as usize];
                for &s in &chunk.routes[..chunk.len as usize] {
                    if seen_by[s as usize] != r {
                        seen_by[s as usize] = r;
                        if !order.instrs_apart((s as usize, instr[s as usize] as usize), (r as usize, r_instr)) {
                            graph.add_edge(NodeIndex::new(s as usize), NodeIndex::new(r as usize), ());
                        }
                    }
                }
                at = chunk.next;
            }
            match met.get_mut(head[p] as usize).filter(|chunk| (chunk.len as usize) < MetChunk::ROUTES) {
                Some(chunk) => {
                    chunk.routes[chunk.len as usize] = r;
                    chunk.len += 1;
                }
                None => {
                    let mut routes = [0; MetChunk::ROUTES];
                    routes[0] = r;
                    met.push(MetChunk { routes, len: 1, next: head[p] });
                    head[p] = (met.len() - 1) as u32;
                }
            }
        }
    }
    (graph, pe_counts)
}

/// A piece of one PE's list of the routes met there in [`conflict_graph`]: up to
/// [`MetChunk::ROUTES`] routes side by side (a walk reads a cache line per chunk, not per
/// route), and the older chunk's index.
struct MetChunk {
    routes: [u32; MetChunk::ROUTES],
    len: u32,
    next: u32,
}

impl MetChunk {
    const ROUTES: usize = 14;
}

/// Colours routes so that no two routes touching a PE share one while both can be active, by
/// DSatur over the [`conflict_graph`]: repeatedly colour the uncoloured route whose neighbours
/// already use the most distinct colours (ties: more PEs, then lower route index), with the
/// lowest colour they leave free. A route left no free colour by its dimension-ordered path
/// takes a detour where one colour is free all along, if there is one ([`Colouring::detour`]).
/// (petgraph's own `dsatur_coloring` breaks ties by degree and
/// needed one more colour on the `matvec-split-reduction` snapshot, and has no colour limit.)
/// Deterministic.
pub(super) fn assign_colours(
    routes: &mut [Route],
    params: &TargetParams,
    order: &RouteOrder,
) -> Result<(), ColourClash> {
    let (mut graph, pe_counts) = conflict_graph(routes, params, order);
    let mut detoured = Detoured::new(params);
    let mut detours = 0usize;
    let limit = params.colours_per_pe.min(32) as u32;
    let all = if limit == 32 { u32::MAX } else { (1u32 << limit) - 1 };
    let mut neighbour_colours = vec![0u32; routes.len()];
    let mut coloured = vec![false; routes.len()];
    let mut queue: BinaryHeap<(u32, u32, Reverse<usize>)> =
        pe_counts.iter().enumerate().map(|(r, &count)| (0, count, Reverse(r))).collect();
    while let Some((saturation, _, Reverse(r))) = queue.pop() {
        if coloured[r] || saturation != neighbour_colours[r].count_ones() {
            continue;
        }
        let free = !neighbour_colours[r] & all;
        let colour = if free != 0 {
            free.trailing_zeros()
        } else if detours < DETOUR_BUDGET {
            detours += 1;
            let mut state =
                Colouring { params, order, graph: &mut graph, coloured: &coloured, detoured: &mut detoured };
            match state.detour(routes, r, limit) {
                Some(colour) => colour,
                None => return Err(ColourClash { route: r, pe: busiest_pe(routes, params, &coloured, r) }),
            }
        } else {
            return Err(ColourClash { route: r, pe: busiest_pe(routes, params, &coloured, r) });
        };
        routes[r].colour = colour as u8;
        coloured[r] = true;
        let bit = 1u32 << colour;
        for other in graph.neighbors(NodeIndex::new(r)) {
            let other = other.index();
            if !coloured[other] && neighbour_colours[other] & bit == 0 {
                neighbour_colours[other] |= bit;
                queue.push((neighbour_colours[other].count_ones(), pe_counts[other], Reverse(other)));
            }
        }
    }
    Ok(())
}

/// The point-to-point legs a detour may re-route `route` by, in path order, when every run of
/// the route carries one message (so separate paths per leg keep its traffic): a multicast's
/// source to each destination, or a reduction's tree edges in [`Route::reduce_edges`] order and then
/// the forward to the destination. `None` for a gather (its runs count the sources they carry)
/// and for a route that leaves its wafer.
fn legs(route: &Route) -> Option<Vec<(Pe, Pe)>> {
    let wafer = route.sources.first()?.wafer;
    let on_wafer = route.sources.iter().chain(&route.destinations).all(|pe| pe.wafer == wafer);
    if !on_wafer || route.path.iter().any(Run::is_inter_wafer) {
        return None;
    }
    match route.kind {
        _ if route.kind.is_multicast() => {
            let [source] = route.sources[..] else { return None };
            Some(route.destinations.iter().map(|&d| (source, d)).collect())
        }
        RouteKind::Reduce { .. } => {
            let leaves = &route.sources;
            let root = leaves[route.reduce_root()];
            let mut legs: Vec<(Pe, Pe)> =
                route.reduce_edges().into_iter().map(|(receiver, sender)| (leaves[sender], leaves[receiver])).collect();
            legs.extend(route.destinations.iter().filter(|&&d| d != root).map(|&d| (root, d)));
            Some(legs)
        }
        _ => None,
    }
}

/// Detours one colouring may take before it reports a clash: each is an A* search per colour,
/// and a placement needing more is better changed than patched (a bound on compile time).
const DETOUR_BUDGET: usize = 256;

/// How far (in PEs) a detour may stray outside its route's endpoints' bounding box.
const DETOUR_MARGIN: u16 = 4;

/// The routes touching each PE (by dense index), kept up to date as routes take detours.
struct Detoured {
    pe_routes: Vec<Vec<u32>>,
    pe_count: usize,
    built: bool,
}

impl Detoured {
    fn new(params: &TargetParams) -> Detoured {
        let pe_count = params.grid_cols as usize * params.grid_rows as usize * params.wafers as usize;
        Detoured { pe_routes: Vec::new(), pe_count, built: false }
    }

    /// Built on the first detour only: most programs never need one.
    fn touching(&mut self, routes: &[Route], params: &TargetParams) -> &mut [Vec<u32>] {
        if !self.built {
            self.pe_routes = vec![Vec::new(); self.pe_count];
            let mut pes = Vec::new();
            for (r, route) in routes.iter().enumerate() {
                route_pes_into(route, params, &mut pes);
                for &p in &pes {
                    self.pe_routes[p as usize].push(r as u32);
                }
            }
            self.built = true;
        }
        &mut self.pe_routes
    }
}

/// The colouring's state that a detour reads and updates.
struct Colouring<'a, 'g> {
    params: &'a TargetParams,
    order: &'a RouteOrder<'a>,
    graph: &'g mut UnGraph<(), ()>,
    coloured: &'g [bool],
    detoured: &'g mut Detoured,
}

impl Colouring<'_, '_> {
    /// Re-routes route `r` through PEs where some colour is free of every coloured route it
    /// conflicts with: per colour, A* paths on the mesh ([`super::detour`]) for the route's legs
    /// ([`legs`]) avoiding PEs where that colour is taken, each hop costing more where more
    /// colours are in use; the cheapest set of paths wins (ties: the lower colour). Updates the
    /// route's path, its PEs and its conflict-graph edges. `None`: the route has no legs to
    /// re-route, or no colour has paths for all of them.
    fn detour(&mut self, routes: &mut [Route], r: usize, limit: u32) -> Option<u32> {
        let legs = legs(&routes[r])?;
        let params = self.params;
        let touching = self.detoured.touching(routes, params);
        let route = &routes[r];
        // Colours taken at a PE by coloured routes that may be active alongside route `r`.
        let taken = |pe: Pe| -> u32 {
            let mut colours = 0u32;
            for &s in touching.get(pe_index(params, pe)).map_or(&[][..], |v| &v[..]) {
                let s = s as usize;
                if s != r && self.coloured[s] && !self.order.apart(routes, r, s) {
                    colours |= 1 << routes[s].colour;
                }
            }
            colours
        };
        // The search stays within DETOUR_MARGIN PEs of the route's endpoints' bounding box: on
        // a full wafer an unbounded A* per colour would explore most of the mesh.
        let ends = || route.sources.iter().chain(&route.destinations);
        let (x0, x1) = (ends().map(|p| p.x).min()?, ends().map(|p| p.x).max()?);
        let (y0, y1) = (ends().map(|p| p.y).min()?, ends().map(|p| p.y).max()?);
        let within = |pe: Pe| {
            pe.x + DETOUR_MARGIN >= x0
                && pe.x <= x1 + DETOUR_MARGIN
                && pe.y + DETOUR_MARGIN >= y0
                && pe.y <= y1 + DETOUR_MARGIN
        };
        let mut best: Option<(u64, u32, Vec<Run>)> = None;
        for colour in 0..limit {
            let bit = 1u32 << colour;
            let open = |pe: Pe| within(pe) && taken(pe) & bit == 0;
            if !route.sources.iter().chain(&route.destinations).all(|pe| open(*pe)) {
                continue;
            }
            let wafer = route.sources[0].wafer;
            let mesh = MeshView { cols: params.grid_cols, rows: params.grid_rows, wafer, open: &open };
            let pressure = |pe: Pe| taken(pe).count_ones();
            if let Some((runs, cost)) = paths_for_legs(mesh, &legs, &pressure) {
                if best.as_ref().is_none_or(|(c, _, _)| cost < *c) {
                    best = Some((cost, colour, runs));
                }
            }
        }
        let (_, colour, runs) = best?;
        let mut old_pes = Vec::new();
        route_pes_into(&routes[r], params, &mut old_pes);
        routes[r].path = runs;
        let mut new_pes = Vec::new();
        route_pes_into(&routes[r], params, &mut new_pes);
        for &p in &old_pes {
            if let Some(list) = touching.get_mut(p as usize) {
                list.retain(|&s| s as usize != r);
            }
        }
        let node = NodeIndex::new(r);
        while let Some(edge) = self.graph.first_edge(node, petgraph::Direction::Outgoing) {
            self.graph.remove_edge(edge);
        }
        let mut neighbours = Vec::new();
        for &p in &new_pes {
            let list = &mut touching[p as usize];
            neighbours.extend(list.iter().copied());
            list.push(r as u32);
        }
        neighbours.sort_unstable();
        neighbours.dedup();
        for s in neighbours {
            if !self.order.apart(routes, r, s as usize) {
                self.graph.add_edge(node, NodeIndex::new(s as usize), ());
            }
        }
        Some(colour)
    }
}

/// The PE of route `clash` where the routes coloured so far use the most distinct colours (the
/// last such PE in dense order).
fn busiest_pe(routes: &[Route], params: &TargetParams, coloured: &[bool], clash: usize) -> Pe {
    let mut pes = Vec::new();
    route_pes_into(&routes[clash], params, &mut pes);
    let mut used: BTreeMap<u32, u32> = pes.iter().map(|&p| (p, 0)).collect();
    for (r, route) in routes.iter().enumerate().filter(|(r, _)| coloured[*r]) {
        route_pes_into(route, params, &mut pes);
        for p in &pes {
            if let Some(colours) = used.get_mut(p) {
                *colours |= 1 << routes[r].colour;
            }
        }
    }
    let busiest = used.iter().max_by_key(|(_, colours)| colours.count_ones()).map_or(0, |(p, _)| *p as usize);
    let (cols, rows) = (params.grid_cols as usize, params.grid_rows as usize);
    let (wafer, rest) = (busiest / (cols * rows), busiest % (cols * rows));
    Pe::new(wafer as u16, (rest % cols) as u16, (rest / cols) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `%1` and `%2` read `%0` side by side; `%3` reads both.
    fn module_precedence() -> Precedence {
        Precedence::new(&waferc_ir::test_support::siblings())
    }

    /// Each route in its instruction's one step: only precedence orders routes.
    fn one_step_each(routes: &[Route]) -> Vec<u32> {
        routes.iter().map(|r| r.instr).collect()
    }

    fn route(id: u32, instr: u32, from: Pe, to: Pe) -> Route {
        let mut path = Vec::new();
        unicast(from, to, &mut path);
        Route {
            id,
            instr,
            kind: RouteKind::Collect { elements: 0..32 },
            colour: 0,
            sources: vec![from],
            destinations: vec![to],
            path,
            message_bytes: 128,
        }
    }

    #[test]
    fn routes_conflict_when_they_share_a_pe_and_are_not_ordered() {
        let params = waferc_targets::Target::grid(4, 4).params();
        let pe = |x, y| Pe::new(0, x, y);
        let routes = [
            route(0, 1, pe(0, 0), pe(3, 0)),
            // Shares row 0 with route 0; %2 runs beside %1.
            route(1, 2, pe(1, 0), pe(2, 0)),
            // Shares row 0 too, but %3 reads %1 and %2.
            route(2, 3, pe(3, 0), pe(0, 0)),
            // Unordered with %1, but on another row.
            route(3, 2, pe(0, 2), pe(3, 2)),
        ];
        let precedence = module_precedence();
        let order = RouteOrder { precedence: &precedence, step_of: one_step_each(&routes), shared: no_experts() };
        let (graph, _) = conflict_graph(&routes, &params, &order);
        let edges: Vec<(usize, usize)> = graph
            .edge_indices()
            .map(|e| graph.edge_endpoints(e).expect("an edge has endpoints"))
            .map(|(a, b)| (a.index(), b.index()))
            .collect();
        assert_eq!(edges, [(0, 1)]);
    }

    #[test]
    fn colouring_gives_conflicting_routes_distinct_colours_and_reports_a_clash_at_the_limit() {
        let mut params = waferc_targets::Target::grid(4, 4).params();
        let pe = |x, y| Pe::new(0, x, y);
        // %1, %2 and %1 again: three routes through PE (1, 0), pairwise unordered.
        let make =
            || [route(0, 1, pe(0, 0), pe(3, 0)), route(1, 2, pe(1, 0), pe(1, 3)), route(2, 1, pe(1, 1), pe(1, 0))];
        let mut routes = make();
        let precedence = module_precedence();
        let order = RouteOrder { precedence: &precedence, step_of: one_step_each(&routes), shared: no_experts() };
        assert!(assign_colours(&mut routes, &params, &order).is_ok());
        let mut colours: Vec<u8> = routes.iter().map(|r| r.colour).collect();
        colours.sort_unstable();
        assert_eq!(colours, [0, 1, 2]);

        params.colours_per_pe = 2;
        let mut routes = make();
        let precedence = module_precedence();
        let order = RouteOrder { precedence: &precedence, step_of: one_step_each(&routes), shared: no_experts() };
        let Err(clash) = assign_colours(&mut routes, &params, &order) else {
            panic!("three routes need three colours")
        };
        assert_eq!(clash.pe, pe(1, 0));
    }

    #[test]
    fn routes_of_one_instruction_in_different_steps_share_a_colour() {
        let params = waferc_targets::Target::grid(4, 4).params();
        let pe = |x, y| Pe::new(0, x, y);
        let mut routes =
            [route(0, 1, pe(0, 0), pe(3, 0)), route(1, 1, pe(3, 0), pe(0, 0)), route(2, 1, pe(1, 0), pe(1, 3))];
        let precedence = module_precedence();
        // Routes 0 and 1 go in one step, route 2 in the next.
        let order = RouteOrder { precedence: &precedence, step_of: vec![4, 4, 5], shared: no_experts() };
        assert!(assign_colours(&mut routes, &params, &order).is_ok());
        assert_ne!(routes[0].colour, routes[1].colour);
        assert_eq!(routes[2].colour, 0);
    }

    #[test]
    fn ordered_routes_share_a_colour() {
        let params = waferc_targets::Target::grid(4, 4).params();
        let pe = |x, y| Pe::new(0, x, y);
        let mut routes =
            [route(0, 1, pe(0, 0), pe(3, 0)), route(1, 3, pe(3, 0), pe(0, 0)), route(2, 5, pe(0, 0), pe(0, 3))];
        let precedence = module_precedence();
        let order = RouteOrder { precedence: &precedence, step_of: one_step_each(&routes), shared: no_experts() };
        assert!(assign_colours(&mut routes, &params, &order).is_ok());
        assert!(routes.iter().all(|r| r.colour == 0));
    }

    /// No expert instructions: no two routes share a colour for sharing a PE.
    fn no_experts() -> &'static SharedPes {
        Box::leak(Box::new(SharedPes::new(&[], false)))
    }

    /// A placement of instruction `instr` as expert `expert` computing on `pe` alone.
    fn expert_on(instr: u32, expert: Option<u32>, pe: Pe) -> waferc_ir::wafer::InstrPlacement {
        use waferc_ir::wafer::{InstrPlacement, ResultLayout, Segment, VectorLayout, Work};
        InstrPlacement {
            instr,
            op: "matvec".into(),
            layer: Some(0),
            expert,
            result: ResultLayout::Vector(VectorLayout { segments: vec![Segment { pe, elements: 0..32 }] }),
            operand_routes: Vec::new(),
            deliveries: Vec::new(),
            work: Work::Elementwise,
        }
    }

    #[test]
    fn experts_sharing_a_pe_share_a_colour() {
        let params = waferc_targets::Target::grid(4, 4).params();
        let pe = |x, y| Pe::new(0, x, y);
        // %1 and %2 read %0 side by side (unordered); both routes pass (1, 0).
        let make = || [route(0, 1, pe(0, 0), pe(3, 0)), route(1, 2, pe(1, 0), pe(1, 3))];
        let precedence = module_precedence();
        let colours = |placements: &[waferc_ir::wafer::InstrPlacement], copies: bool| {
            let mut routes = make();
            let shared = SharedPes::new(placements, copies);
            let order = RouteOrder { precedence: &precedence, step_of: one_step_each(&routes), shared: &shared };
            assert!(assign_colours(&mut routes, &params, &order).is_ok());
            (routes[0].colour, routes[1].colour)
        };
        let lane = |e1, e2| [expert_on(0, None, pe(0, 0)), expert_on(1, e1, pe(2, 2)), expert_on(2, e2, pe(2, 2))];
        // Two experts on one PE run one after the other: one colour will do.
        assert_eq!(colours(&lane(Some(0), Some(1)), false), (0, 0));
        // Not when the program holds expert copies, nor when one is not an expert, nor when
        // the experts compute on different PEs.
        assert_eq!(colours(&lane(Some(0), Some(1)), true), (0, 1));
        assert_eq!(colours(&lane(None, Some(1)), false), (0, 1));
        let apart = [expert_on(0, None, pe(0, 0)), expert_on(1, Some(0), pe(2, 2)), expert_on(2, Some(1), pe(3, 3))];
        assert_eq!(colours(&apart, false), (0, 1));
    }

    #[test]
    fn a_multicast_left_without_a_colour_detours_round_the_saturated_pe() {
        let mut params = waferc_targets::Target::grid(4, 4).params();
        params.colours_per_pe = 2;
        let pe = |x, y| Pe::new(0, x, y);
        // Two routes of %2 take both colours at (1, 1); a delivery of %1's result along row 1
        // would cross it, so it goes round through row 2.
        let mut delivery = route(2, 1, pe(0, 1), pe(2, 1));
        delivery.kind = RouteKind::Operand { value: 1, elements: 0..32 };
        let mut routes = [route(0, 2, pe(3, 0), pe(1, 1)), route(1, 2, pe(3, 0), pe(1, 1)), delivery];
        let precedence = module_precedence();
        let order = RouteOrder { precedence: &precedence, step_of: one_step_each(&routes), shared: no_experts() };
        assert!(assign_colours(&mut routes, &params, &order).is_ok());
        let detour = &routes[2];
        assert!(detour.colour < 2);
        let mut visited = Vec::new();
        for_each_pe(detour, |p| visited.push(p));
        assert!(!visited.contains(&pe(1, 1)), "the detour avoids the saturated PE: {visited:?}");
        let mut at = pe(0, 1);
        for run in &detour.path {
            assert_eq!(run.from, at);
            at = run.to;
        }
        assert_eq!(at, pe(2, 1));
        visited.sort_unstable();
        visited.dedup();
        assert_eq!(visited.len(), 5, "the shortest way round: {visited:?}");
        // The colours are legal on the new path: no PE has two unordered routes of one colour.
        let precedence = module_precedence();
        let order = RouteOrder { precedence: &precedence, step_of: one_step_each(&routes), shared: no_experts() };
        let (graph, _) = conflict_graph(&routes, &params, &order);
        for e in graph.edge_indices() {
            let (a, b) = graph.edge_endpoints(e).expect("an edge has endpoints");
            assert_ne!(routes[a.index()].colour, routes[b.index()].colour);
        }
    }

    #[test]
    fn a_gather_is_not_rerouted() {
        let mut params = waferc_targets::Target::grid(4, 4).params();
        params.colours_per_pe = 2;
        let pe = |x, y| Pe::new(0, x, y);
        let mut routes =
            [route(0, 2, pe(3, 0), pe(1, 1)), route(1, 2, pe(3, 0), pe(1, 1)), route(2, 1, pe(0, 1), pe(2, 1))];
        let precedence = module_precedence();
        let order = RouteOrder { precedence: &precedence, step_of: one_step_each(&routes), shared: no_experts() };
        assert!(assign_colours(&mut routes, &params, &order).is_err());
    }

    #[test]
    fn deliveries_overlapping_their_neighbours_go_in_two_waves() {
        let pe = |x, y| Pe::new(0, x, y);
        // Each route runs along row 0 over its neighbours' ends: 0..=2, 2..=4, 4..=6, 6..=8.
        let routes: Vec<Route> = (0..4).map(|k| route(k, 1, pe(2 * k as u16, 0), pe(2 * k as u16 + 2, 0))).collect();
        let mut ids: Vec<RouteId> = vec![0, 1, 2, 3];
        order_in_waves(&routes, &mut ids);
        // The runs share PEs at their ends but no directed link: one wave, order kept.
        assert_eq!(ids, [0, 1, 2, 3]);
        let routes: Vec<Route> = (0..5).map(|k| route(k, 1, pe(2 * k as u16, 0), pe(2 * k as u16 + 3, 0))).collect();
        let mut ids: Vec<RouteId> = vec![0, 1, 2, 3, 4];
        order_in_waves(&routes, &mut ids);
        // Now each shares the link from x = 2k + 2 with the next: evens first, then odds.
        assert_eq!(ids, [0, 2, 4, 1, 3]);
    }

    /// Directed on-wafer links of `runs`.
    fn links(runs: &[Run]) -> std::collections::BTreeSet<(Pe, Pe)> {
        runs.iter().filter(|r| !r.is_inter_wafer()).flat_map(|r| r.hops()).collect()
    }

    #[test]
    fn multicasts_crossing_wafers_on_rows_of_their_own_share_no_link() {
        // Two segments beside each other on one row of wafer 0, read on one row of wafer 1.
        let (a, b) = (Pe::new(0, 5, 10), Pe::new(0, 6, 10));
        let (to_a, to_b) = ([Pe::new(1, 3, 20)], [Pe::new(1, 4, 20)]);
        // Through the gateways of their own row, they share its links on wafer 0.
        let (along_a, along_b) = (multicast(a, &to_a, 6, None), multicast(b, &to_b, 6, None));
        assert!(!links(&along_a).is_disjoint(&links(&along_b)));
        let (across_a, across_b) = (multicast(a, &to_a, 6, Some(9)), multicast(b, &to_b, 6, Some(10)));
        assert!(links(&across_a).is_disjoint(&links(&across_b)), "{across_a:?}\n{across_b:?}");
        for (path, row, to) in [(&across_a, 9, to_a[0]), (&across_b, 10, to_b[0])] {
            let hop = path.iter().find(|r| r.is_inter_wafer()).expect("the path crosses");
            assert_eq!((hop.from, hop.to), (gateway(0, row), gateway(1, row)));
            assert_eq!(path.last().map(|r| r.to), Some(to));
        }
    }
}
