//! The independent checker: re-derives, from the program and the IR alone, that the placement is
//! sound. It shares no code with the placer: it reads what PEs hold (their SRAM images) and what
//! routes carry, not how the placer decided either.
//!
//! Checked: instruction placements match the IR; every PE's SRAM regions are within the budget,
//! the code reserve first, the resident ones disjoint and the working ones (operand buffers and
//! results) above them, overlapping only where one is dead before the other is first written (by
//! the IR's dataflow, `waferc_ir::completion`, not by anything the placer decided); every matvec
//! and embedding weight element is held exactly
//! once, as a grid of row blocks x aligned power-of-two chunk runs, every norm weight and bias
//! element at least once, and every tile the placement lists is such a region; a norm group
//! split over several segments is cut in aligned power-of-two chunk runs; KV blocks cover
//! `0..max_context` exactly once in aligned power-of-two chunk runs; every route's path is made of
//! straight neighbour runs (or hops between consecutive wafers), each starting where the route
//! already is, and reaches every destination; route endpoints hold what the route moves (a
//! reduction's PEs the instruction's state, a collect's destination the result elements); two
//! routes touching a PE share a colour only if one's instruction reads the other's result
//! (they are never active together), and no colour exceeds the target's limit; every operand a PE expects arrives on a route from a PE
//! holding it (or is already there); every route is used by exactly one schedule step, after the
//! steps that produce what it carries.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

use waferc_ir::completion::Completion;
use waferc_ir::wafer::rope_twin;
use waferc_ir::wafer::serial::SharedPes;
use waferc_ir::wafer::{
    wide, AttentionPlacement, KvHeadPlacement, Lanes, MatVecPlacement, Pe, PeImage, ReduceOp, Region, RegionKind,
    ResultLayout, Route, RouteId, RouteKind, WaferProgram, Work, LANES,
};
use waferc_ir::{DependencyGraph, Handle, Module, Op};
// Fx hashing: the checker hashes millions of (value, PE) and route keys, and nothing it reports
// depends on a map's iteration order.
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

/// One problem the checker found. Each names what it can of the PE, route, instruction and layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub pe: Option<Pe>,
    pub route: Option<u32>,
    pub instr: Option<u32>,
    pub layer: Option<u32>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(instr) = self.instr {
            parts.push(format!("%{instr}"));
        }
        if let Some(layer) = self.layer {
            parts.push(format!("layer {layer}"));
        }
        if let Some(route) = self.route {
            parts.push(format!("route {route}"));
        }
        if let Some(pe) = self.pe {
            parts.push(pe.to_string());
        }
        if parts.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", parts.join(", "), self.message)
        }
    }
}

/// The checker's verdict: every problem found (up to [`MAX_PROBLEMS`]).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub struct CheckError {
    pub problems: Vec<Problem>,
}

/// The checker stops collecting after this many problems.
pub const MAX_PROBLEMS: usize = 100;

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "placement check failed with {} problem(s)", self.problems.len())?;
        for p in self.problems.iter().take(20) {
            write!(f, "\n  {p}")?;
        }
        if self.problems.len() > 20 {
            write!(f, "\n  ... and {} more", self.problems.len() - 20)?;
        }
        Ok(())
    }
}

/// A weight block some PE holds: rows, columns, the PE.
type Piece = (Range<u32>, Range<u32>, Pe);

struct Checker<'a> {
    program: &'a WaferProgram,
    module: &'a Module,
    images: &'a Images<'a>,
    problems: Vec<Problem>,
    /// The PEs of each copy of a replicated expert: `(replica, copy index)`.
    copy_of_pe: HashMap<Pe, (usize, usize)>,
}

/// Each PE's image by the PE's dense grid index: the checker looks up millions of route
/// endpoints and tiles, and a binary search over hundreds of thousands of images misses the
/// cache at every step.
struct Images<'a> {
    program: &'a WaferProgram,
    /// Per dense index, the image's position in `program.pes` (`u32::MAX`: none).
    at: Vec<u32>,
}

impl<'a> Images<'a> {
    fn new(program: &'a WaferProgram) -> Self {
        let params = &program.target;
        let mut at = vec![u32::MAX; params.grid_cols as usize * params.grid_rows as usize * params.wafers as usize];
        for (i, image) in program.pes.iter().enumerate() {
            if let Some(slot) = Self::dense(program, image.pe).and_then(|d| at.get_mut(d)) {
                *slot = i as u32;
            }
        }
        Images { program, at }
    }

    fn dense(program: &WaferProgram, pe: Pe) -> Option<usize> {
        let params = &program.target;
        params.contains(pe).then(|| {
            (pe.wafer as usize * params.grid_rows as usize + pe.y as usize) * params.grid_cols as usize + pe.x as usize
        })
    }

    /// Position in `program.pes` of `pe`'s image, if it holds anything (a PE outside the
    /// target: by binary search).
    fn position(&self, pe: Pe) -> Option<usize> {
        match Self::dense(self.program, pe) {
            Some(d) => self.at.get(d).filter(|&&i| i != u32::MAX).map(|&i| i as usize),
            None => self.program.pes.binary_search_by(|image| image.pe.cmp(&pe)).ok(),
        }
    }

    /// The image of `pe`, if it holds anything.
    fn get(&self, pe: Pe) -> Option<&'a PeImage> {
        self.position(pe).map(|i| &self.program.pes[i])
    }
}

/// The PEs one route's walk has visited, each once: a mark per PE of the target (a set per
/// route rehashes as long routes grow), a list for a PE off the target.
struct Visited {
    cols: usize,
    rows: usize,
    wafers: usize,
    /// Per dense PE index, the walk that last visited it.
    mark: Vec<u32>,
    walk: u32,
    outside: Vec<Pe>,
    /// The visited PEs, in visiting order.
    pes: Vec<Pe>,
}

impl Visited {
    fn new(program: &WaferProgram) -> Self {
        let t = &program.target;
        let (cols, rows, wafers) = (t.grid_cols as usize, t.grid_rows as usize, t.wafers as usize);
        Visited {
            cols,
            rows,
            wafers,
            mark: vec![0; cols * rows * wafers],
            walk: 0,
            outside: Vec::new(),
            pes: Vec::new(),
        }
    }

    fn dense(&self, pe: Pe) -> Option<usize> {
        let (x, y, w) = (pe.x as usize, pe.y as usize, pe.wafer as usize);
        (x < self.cols && y < self.rows && w < self.wafers).then_some((w * self.rows + y) * self.cols + x)
    }

    /// Starts the next walk with nothing visited.
    fn start(&mut self) {
        self.walk += 1;
        self.outside.clear();
        self.pes.clear();
    }

    fn contains(&self, pe: Pe) -> bool {
        match self.dense(pe) {
            Some(d) => self.mark[d] == self.walk,
            None => self.outside.contains(&pe),
        }
    }

    fn insert(&mut self, pe: Pe) {
        if self.contains(pe) {
            return;
        }
        match self.dense(pe) {
            Some(d) => self.mark[d] = self.walk,
            None => self.outside.push(pe),
        }
        self.pes.push(pe);
    }
}

/// Per PE image (position in `program.pes`), the instructions its regions serve, sorted: a
/// reduction's every leaf is checked to hold its instruction's state, and scanning the image's
/// regions for each leaf costs as much as the image is large (a stacked region's PE holds tiles
/// of every layer of its group).
struct InstrsHeld {
    starts: Vec<u32>,
    instrs: Vec<u32>,
}

impl InstrsHeld {
    fn new(program: &WaferProgram) -> Self {
        let mut starts = Vec::with_capacity(program.pes.len() + 1);
        let mut instrs = Vec::new();
        starts.push(0);
        for image in &program.pes {
            let start = instrs.len();
            instrs.extend(image.regions.iter().filter_map(|r| r.instr));
            instrs[start..].sort_unstable();
            let mut kept = start;
            for i in start..instrs.len() {
                if kept == start || instrs[kept - 1] != instrs[i] {
                    instrs[kept] = instrs[i];
                    kept += 1;
                }
            }
            instrs.truncate(kept);
            starts.push(instrs.len() as u32);
        }
        InstrsHeld { starts, instrs }
    }

    /// Whether image `at` holds a region of `instr`.
    fn holds(&self, at: usize, instr: u32) -> bool {
        self.instrs[self.starts[at] as usize..self.starts[at + 1] as usize].binary_search(&instr).is_ok()
    }
}

/// Whether one instruction reads another's result, through any chain of operands: a search in
/// the module's dependency graph, remembered per pair.
struct Reads<'g> {
    search: waferc_ir::dependency::Reads<'g>,
    known: HashMap<(u32, u32), bool>,
}

impl<'g> Reads<'g> {
    fn new(graph: &'g DependencyGraph) -> Self {
        Reads { search: graph.reads(), known: HashMap::default() }
    }

    /// Whether `reader` depends on `source`.
    fn transitively(&mut self, reader: u32, source: u32) -> bool {
        *self
            .known
            .entry((reader, source))
            .or_insert_with(|| self.search.transitively(reader as usize, source as usize))
    }
}

/// Checks `program` against the `module` it was compiled from.
pub fn check(program: &WaferProgram, module: &Module) -> Result<(), CheckError> {
    let images = Images::new(program);
    let completion = Completion::new(module);
    let checker = || Checker { program, module, images: &images, problems: Vec::new(), copy_of_pe: HashMap::default() };
    let mut c = checker();
    c.instrs();
    if c.problems.is_empty() {
        // The SRAM half and the routing half read the program only, so they run side by side;
        // their problems are joined in the order one pass through both would list them.
        let (sram, routing) = rayon::join(
            || {
                let mut c = checker();
                c.sram(&completion);
                c.replicas();
                c.weights();
                c.norm_groups();
                c.rope_parts();
                c.kv();
                c.problems
            },
            || {
                let mut c = checker();
                let routes = c.routes_by_id();
                c.paths_and_colours();
                c.endpoints();
                c.operands(&routes);
                c.schedule(&routes);
                c.problems
            },
        );
        c.problems = sram;
        c.problems.extend(routing);
        c.problems.truncate(MAX_PROBLEMS);
    }
    if c.problems.is_empty() {
        Ok(())
    } else {
        Err(CheckError { problems: c.problems })
    }
}

/// `n` as u32, or `u32::MAX` when larger.
fn saturate(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn overlap(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

impl<'a> Checker<'a> {
    fn layer(&self, instr: u32) -> Option<u32> {
        self.module.body.get(Handle::new(instr as usize)).and_then(|i| i.layer)
    }

    fn report(&mut self, pe: Option<Pe>, route: Option<u32>, instr: Option<u32>, message: String) {
        if self.problems.len() < MAX_PROBLEMS {
            let layer = instr.and_then(|i| self.layer(i));
            self.problems.push(Problem { pe, route, instr, layer, message });
        }
    }

    /// One placement per instruction, in order, naming the same op and layer.
    fn instrs(&mut self) {
        if self.program.instrs.len() != self.module.body.len() {
            self.report(
                None,
                None,
                None,
                format!("{} placements for {} instructions", self.program.instrs.len(), self.module.body.len()),
            );
            return;
        }
        for (i, p) in self.program.instrs.iter().enumerate() {
            let ir = &self.module.body[Handle::new(i)];
            if p.instr as usize != i || p.op != ir.op.name() || p.layer != ir.layer {
                self.report(
                    None,
                    None,
                    Some(i as u32),
                    format!(
                        "placement says %{} = {} (layer {:?}), the IR has {}",
                        p.instr,
                        p.op,
                        p.layer,
                        ir.op.name()
                    ),
                );
            }
        }
    }

    fn sram(&mut self, completion: &Completion) {
        let params = &self.program.target;
        let mut previous: Option<Pe> = None;
        for image in &self.program.pes {
            let pe = image.pe;
            if !params.contains(pe) {
                self.report(Some(pe), None, None, format!("is outside target {}", params.name));
            }
            if previous.is_some_and(|p| p >= pe) {
                self.report(Some(pe), None, None, "PE images are not sorted and unique".into());
            }
            previous = Some(pe);
            match image.regions.first() {
                Some(r) if r.kind == RegionKind::Code && r.offset == 0 && r.bytes >= params.code_reserve_bytes => {}
                _ => self.report(Some(pe), None, None, "the first region is not the code reserve at offset 0".into()),
            }
            let end = |r: &Region| r.offset as u64 + r.bytes as u64;
            let mut resident_end = 0u64;
            for r in image.regions.iter().filter(|r| !r.kind.is_working()) {
                if (r.offset as u64) < resident_end {
                    self.report(
                        Some(pe),
                        None,
                        r.instr,
                        format!("region at offset {} overlaps the resident region before it", r.offset),
                    );
                }
                resident_end = end(r);
            }
            let mut working: Vec<&Region> = image.regions.iter().filter(|r| r.kind.is_working()).collect();
            working.sort_by_key(|r| (r.offset, r.bytes));
            for (at, r) in working.iter().enumerate() {
                if (r.offset as u64) < resident_end {
                    self.report(
                        Some(pe),
                        None,
                        r.instr,
                        format!(
                            "{} at offset {} lies below the resident regions' end {resident_end}",
                            working_name(r),
                            r.offset
                        ),
                    );
                }
                // Overlapping working regions must not be live at once: one is dead (an operand
                // buffer's instruction done, a result's readers done) before the other is first
                // written.
                for other in working[at + 1..].iter().take_while(|o| (o.offset as u64) < end(r)) {
                    if !r.may_share(other, completion) {
                        self.report(
                            Some(pe),
                            None,
                            r.instr,
                            format!(
                                "{} at offset {} and {} at offset {} overlap, but neither is dead before the other \
                                 is first written",
                                working_name(r),
                                r.offset,
                                working_name(other),
                                other.offset,
                            ),
                        );
                    }
                }
            }
            let used = image.regions.iter().map(end).max().unwrap_or(0);
            if used > params.sram_bytes_per_pe as u64 {
                let instr = image.regions.iter().rev().find_map(|r| r.instr);
                self.report(
                    Some(pe),
                    None,
                    instr,
                    format!("uses {used} bytes of SRAM, over the {}-byte budget", params.sram_bytes_per_pe),
                );
            }
        }
    }

    /// Each copy of a replicated expert is its original again on PEs of its own: the same
    /// instructions, the same tiles (rows and chunks, in order), segments and bias, on PEs no
    /// other copy uses; its `expert_dispatch` names a routing route from the router that reaches
    /// all of them. (Its weights are checked like the original's in [`Checker::weights`], its
    /// routes like every route.)
    fn replicas(&mut self) {
        let program = self.program;
        let mut owner: HashMap<Pe, (usize, usize)> = HashMap::default();
        for (r, replica) in program.replicas.iter().enumerate() {
            let originals: Vec<&waferc_ir::wafer::InstrPlacement> =
                replica.instrs.iter().filter_map(|&i| program.instrs.get(i as usize)).collect();
            if originals.len() != replica.instrs.len() || originals.iter().any(|p| p.expert != Some(replica.expert)) {
                self.report(
                    None,
                    None,
                    replica.instrs.first().copied(),
                    format!(
                        "replica table of layer {} expert {} names instructions that are not that expert's",
                        replica.layer, replica.expert
                    ),
                );
                continue;
            }
            let original_pes: HashSet<Pe> = originals.iter().flat_map(|p| p.compute_pes()).collect();
            for (c, copy) in replica.copies.iter().enumerate() {
                let copy_number = c + 1;
                if copy.len() != originals.len() {
                    self.report(
                        None,
                        None,
                        Some(replica.instrs[0]),
                        format!(
                            "copy {copy_number} of expert {} has {} instructions, the original {}",
                            replica.expert,
                            copy.len(),
                            originals.len()
                        ),
                    );
                    continue;
                }
                let mut pes: Vec<Pe> = Vec::new();
                for (p, original) in copy.iter().zip(&originals) {
                    let what = |m: &str| format!("copy {copy_number} of expert {}: {m}", replica.expert);
                    if p.instr != original.instr
                        || p.op != original.op
                        || p.layer != original.layer
                        || p.expert != original.expert
                    {
                        self.report(
                            None,
                            None,
                            Some(original.instr),
                            what(&format!("names %{} = {}, not the original's instruction", p.instr, p.op)),
                        );
                        continue;
                    }
                    let elements = |l: &ResultLayout| match l {
                        ResultLayout::Vector(v) => v.segments.iter().map(|s| s.elements.clone()).collect(),
                        ResultLayout::Routing { .. } => Vec::new(),
                    };
                    if elements(&p.result) != elements(&original.result) {
                        self.report(
                            None,
                            None,
                            Some(p.instr),
                            what("its result segments are cut unlike the original's"),
                        );
                    }
                    match (&p.work, &original.work) {
                        (Work::MatVec(a), Work::MatVec(b)) => {
                            let cut = |m: &waferc_ir::wafer::MatVecPlacement| -> Vec<(Range<u32>, Range<u32>)> {
                                m.tiles.iter().map(|t| (t.rows.clone(), t.chunks.clone())).collect()
                            };
                            if (a.rows, a.cols, a.row_blocks, a.col_blocks, a.bias)
                                != (b.rows, b.cols, b.row_blocks, b.col_blocks, b.bias)
                                || cut(a) != cut(b)
                            {
                                let at = a
                                    .tiles
                                    .iter()
                                    .zip(&b.tiles)
                                    .find(|(x, y)| x.rows != y.rows || x.chunks != y.chunks)
                                    .map(|(x, _)| x.pe);
                                self.report(at, None, Some(p.instr), what("its tiles are not the original's"));
                            }
                        }
                        (Work::Dispatch { routing }, Work::Dispatch { .. }) => {
                            let reaches = program.routes.get(*routing as usize).is_some_and(|route| {
                                route.kind == RouteKind::Routing
                                    && route.instr == replica.router
                                    && copy
                                        .iter()
                                        .flat_map(|q| q.compute_pes())
                                        .all(|pe| route.destinations.contains(&pe))
                            });
                            if !reaches {
                                self.report(
                                    None,
                                    Some(*routing),
                                    Some(p.instr),
                                    what("its routing route does not reach all of its PEs"),
                                );
                            }
                        }
                        (a, b) if std::mem::discriminant(a) == std::mem::discriminant(b) => {}
                        _ => self.report(None, None, Some(p.instr), what("its work is not the original's kind")),
                    }
                    pes.extend(p.compute_pes());
                }
                pes.sort_unstable();
                pes.dedup();
                for pe in pes {
                    let shared = original_pes.contains(&pe) || owner.insert(pe, (r, c)).is_some_and(|o| o != (r, c));
                    if shared {
                        self.report(
                            Some(pe),
                            None,
                            Some(replica.instrs[0]),
                            format!(
                                "copy {copy_number} of layer {} expert {} shares this PE with another copy",
                                replica.layer, replica.expert
                            ),
                        );
                    }
                }
            }
        }
        self.copy_of_pe = owner;
    }

    /// Weight coverage, the tile blob's length, and the tiles the placements list.
    fn weights(&mut self) {
        // Per (instruction, weight, copy): `None` the original, a copy's PEs are its own.
        type Holder = (u32, u32, Option<(usize, usize)>);
        // A matvec's own weight is covered through its tiles (`tile_pieces`), each of which must
        // name one of these regions: here they are only counted, so no list of every tile's
        // piece is held (the 8B's ten million, 0.3 GB at the checker's peak).
        let matvec_weight: Vec<Option<u32>> = (self.module.body.iter())
            .map(|(_, ir)| match &ir.op {
                Op::MatVec { weight, .. } => Some(weight.index() as u32),
                _ => None,
            })
            .collect();
        let mut tile_regions: BTreeMap<Holder, (usize, Pe)> = BTreeMap::new();
        let mut held: BTreeMap<Holder, Vec<Piece>> = BTreeMap::new();
        // The tile blob lays the weight regions' bytes end to end (`WaferProgram::blob_ranges`).
        let mut blob_len = 0u64;
        for image in &self.program.pes {
            let copy = self.copy_of_pe.get(&image.pe).copied();
            for r in &image.regions {
                if let (RegionKind::Weight { weight, rows: narrow_rows, cols: narrow_cols }, Some(instr)) =
                    (&r.kind, r.instr)
                {
                    let (rows, cols) = (&wide(narrow_rows), &wide(narrow_cols));
                    let Some(w) = self.module.weights.get(Handle::new(*weight as usize)) else {
                        self.report(
                            Some(image.pe),
                            None,
                            Some(instr),
                            format!("holds weight #{weight}, which does not exist"),
                        );
                        continue;
                    };
                    let (n_rows, n_cols) = match w.ty.shape.as_slice() {
                        [n] => (1, *n),
                        [r, c] => (*r, *c),
                        _ => (0, 0),
                    };
                    let expect =
                        w.ty.dtype.row_bytes(cols.end.saturating_sub(cols.start)).map(|b| b * (rows.end - rows.start));
                    if rows.end > n_rows || cols.end > n_cols || rows.start >= rows.end || cols.start >= cols.end {
                        self.report(
                            Some(image.pe),
                            None,
                            Some(instr),
                            format!("holds rows {rows:?} x cols {cols:?} of {} ({}), out of range", w.name, w.ty),
                        );
                    } else if expect != Some(r.bytes as u64) {
                        self.report(
                            Some(image.pe),
                            None,
                            Some(instr),
                            format!("region of {} is {} bytes; expected {expect:?}", w.name, r.bytes),
                        );
                    }
                    blob_len += r.bytes as u64;
                    let holder = (instr, *weight, copy);
                    if matvec_weight.get(instr as usize).copied().flatten() == Some(*weight) {
                        tile_regions.entry(holder).or_insert((0, image.pe)).0 += 1;
                    } else {
                        held.entry(holder).or_default().push((narrow_rows.clone(), narrow_cols.clone(), image.pe));
                    }
                }
            }
        }
        if blob_len != self.program.tile_blob_len {
            self.report(
                None,
                None,
                None,
                format!("the weight regions hold {blob_len} bytes, the tile blob {}", self.program.tile_blob_len),
            );
        }
        let program = self.program;
        for (handle, ir) in self.module.body.iter() {
            let instr = handle.index() as u32;
            let (exact, shared): (Vec<_>, Vec<_>) = match &ir.op {
                Op::Embed { table } => (vec![*table], vec![]),
                Op::MatVec { weight, bias, .. } => (vec![*weight], bias.iter().copied().collect()),
                Op::RmsNorm { weight, .. } => (vec![], vec![*weight]),
                Op::Attention { sinks: Some(sinks), .. } => (vec![*sinks], vec![]),
                _ => continue,
            };
            // The original and every copy of a replicated expert each hold the whole weight.
            let original = program.instrs.iter().find(|p| p.instr == instr);
            let copies = original.map(|p| (None, p)).into_iter().chain(program.replicas.iter().enumerate().flat_map(
                |(r, replica)| {
                    replica.copies.iter().enumerate().flat_map(move |(c, copy)| {
                        copy.iter().filter(move |p| p.instr == instr).map(move |p| (Some((r, c)), p))
                    })
                },
            ));
            for (copy, placement) in copies {
                for &w in &exact {
                    let key = (instr, w.index() as u32, copy);
                    let pieces = match &placement.work {
                        Work::MatVec(mv) => {
                            let regions = tile_regions.remove(&key).map_or(0, |(count, _)| count);
                            self.tile_pieces(placement.instr, mv, w.index() as u32, regions)
                        }
                        _ => held.remove(&key).unwrap_or_default(),
                    };
                    self.exactly_once(instr, w, pieces, matches!(ir.op, Op::MatVec { .. }));
                }
                for &w in &shared {
                    let pieces = held.remove(&(instr, w.index() as u32, copy)).unwrap_or_default();
                    self.at_least_once(instr, w, pieces);
                }
            }
        }
        let unread = held.into_iter().map(|(holder, pieces)| (holder, pieces[0].2));
        for ((instr, weight, _), pe) in unread.chain(tile_regions.into_iter().map(|(holder, (_, pe))| (holder, pe))) {
            self.report(
                Some(pe),
                None,
                Some(instr),
                format!("holds weight #{weight}, which the instruction does not read"),
            );
        }
    }

    /// The pieces of weight `weight` that matvec placement `mv`'s tiles hold: each tile must name
    /// a weight region of its instruction with the tile's extent, no two the same, and the grid's
    /// PEs must hold no other region of that weight (`regions` counts them). Then the tiles'
    /// pieces are the regions' pieces, and cover the weight as they do.
    fn tile_pieces(&mut self, instr: u32, mv: &MatVecPlacement, weight: u32, regions: usize) -> Vec<Piece> {
        if mv.tiles.len() != mv.row_blocks as usize * mv.col_blocks as usize {
            self.report(
                None,
                None,
                Some(instr),
                format!("{} tiles for a {} x {} grid", mv.tiles.len(), mv.row_blocks, mv.col_blocks),
            );
        }
        if regions != mv.tiles.len() {
            self.report(
                None,
                None,
                Some(instr),
                format!("its PEs hold {regions} regions of weight #{weight}, but it lists {} tiles", mv.tiles.len()),
            );
        }
        let mut pieces = Vec::with_capacity(mv.tiles.len());
        let mut seen = HashSet::default();
        for t in &mv.tiles {
            let region = self.images.get(t.pe).and_then(|img| img.regions.get(t.region as usize));
            let piece = region.and_then(|r| match &r.kind {
                RegionKind::Weight { weight: w, rows, cols, .. }
                    if r.instr == Some(instr)
                        && *w == weight
                        && *rows == t.rows
                        && cols.start == t.chunks.start * 32
                        && cols.end.div_ceil(32) == t.chunks.end =>
                {
                    Some((rows.clone(), cols.clone(), t.pe))
                }
                _ => None,
            });
            match piece {
                Some(piece) => pieces.push(piece),
                None => self.report(
                    Some(t.pe),
                    None,
                    Some(instr),
                    format!("tile rows {:?} x chunks {:?} is not the weight region it names", t.rows, t.chunks),
                ),
            }
            if !seen.insert((t.pe, t.region)) {
                self.report(
                    Some(t.pe),
                    None,
                    Some(instr),
                    format!("tile rows {:?} x chunks {:?} is placed twice", t.rows, t.chunks),
                );
            }
        }
        pieces
    }

    /// A norm group split over several segments: each segment's part is a leaf of the chunk tree
    /// (an aligned power-of-two run of whole 32-element chunks, all of one length but the last),
    /// so the reduction combines the contract's subtrees of the sum of squares.
    fn norm_groups(&mut self) {
        let program = self.program;
        for p in &program.instrs {
            let (Work::RmsNorm(norm), ResultLayout::Vector(layout)) = (&p.work, &p.result) else { continue };
            let g = norm.group_len.max(1);
            for group in 0..layout.len().div_ceil(g) {
                let parts: Vec<(Pe, Range<u64>)> =
                    layout.overlapping(group * g..(group + 1) * g).map(|(seg, part)| (seg.pe, part)).collect();
                let Some(run) = parts.first().map(|(_, part)| part.end - part.start) else { continue };
                if parts.len() < 2 {
                    continue;
                }
                let chunks = run / 32;
                let bad = parts.iter().enumerate().find(|(k, (_, part))| {
                    let (start, len) = (part.start - group * g, part.end - part.start);
                    !run.is_multiple_of(32)
                        || !chunks.is_power_of_two()
                        || !start.is_multiple_of(run)
                        || (len != run && *k + 1 != parts.len())
                });
                if let Some((_, (pe, part))) = bad {
                    self.report(
                        Some(*pe),
                        None,
                        Some(p.instr),
                        format!(
                            "elements {part:?} of norm group {group} are not an aligned power-of-two run of \
                             32-element chunks like the group's other segments"
                        ),
                    );
                }
            }
        }
    }

    /// A rope's result segments are whole heads, or parts of one half of a head whose PE holds
    /// (or expects, as operand regions `operands` then checks arrive) both its elements and its
    /// twin's half a head away: the two a part's rotation reads.
    fn rope_parts(&mut self) {
        let program = self.program;
        for p in &program.instrs {
            let (Op::Rope { x, head_dim, .. }, ResultLayout::Vector(layout)) =
                (&self.module.body[Handle::new(p.instr as usize)].op, &p.result)
            else {
                continue;
            };
            let hd = *head_dim as u64;
            let (source, shift) = self.source(x.index());
            for seg in &layout.segments {
                let Some(twin) = rope_twin(&seg.elements, hd) else {
                    if !seg.elements.start.is_multiple_of(hd) || !seg.elements.end.is_multiple_of(hd) {
                        self.report(
                            Some(seg.pe),
                            None,
                            Some(p.instr),
                            format!("rope segment {:?} is neither whole heads of {hd} nor inside a half", seg.elements),
                        );
                    }
                    continue;
                };
                let regions = self.images.get(seg.pe).map_or(&[][..], |image| image.regions.as_slice());
                let there = |wanted: &Range<u64>| {
                    let held = wanted.start + shift..wanted.end + shift;
                    regions.iter().any(|r| match &r.kind {
                        RegionKind::Output { elements } => {
                            r.instr == Some(source) && elements.start <= held.start && held.end <= elements.end
                        }
                        RegionKind::Operand { value, elements } => {
                            r.instr == Some(p.instr)
                                && *value as usize == x.index()
                                && elements.start <= wanted.start
                                && wanted.end <= elements.end
                        }
                        _ => false,
                    })
                };
                for (what, wanted) in [("its elements", &seg.elements), ("its twin", &twin)] {
                    if !there(wanted) {
                        self.report(
                            Some(seg.pe),
                            None,
                            Some(p.instr),
                            format!(
                                "rope part {:?} reads {what} {wanted:?} of %{}, which its PE neither holds nor expects",
                                seg.elements,
                                x.index()
                            ),
                        );
                    }
                }
            }
        }
    }

    /// A weight held as a grid: row bands that partition the rows, each band's column pieces
    /// partitioning the columns; for a matvec, column pieces are aligned equal power-of-two
    /// chunk runs (the last may be short). A table (not a matvec's) may instead be held in column
    /// bands, each with a row cut of its own (the embedding on a tight wafer: each segment's band
    /// of PEs cuts the rows as finely as its PEs allow).
    fn exactly_once(&mut self, instr: u32, weight: Handle<waferc_ir::Weight>, pieces: Vec<Piece>, chunk_runs: bool) {
        let w = &self.module.weights[weight];
        // Pieces hold rows and columns in u32; a larger weight is left uncovered, and said so.
        let (n_rows, n_cols) = match w.ty.shape.as_slice() {
            [r, c] => (saturate(*r), saturate(*c)),
            [n] => (1, saturate(*n)),
            _ => return,
        };
        if pieces.is_empty() {
            self.report(None, None, Some(instr), format!("weight {} is held by no PE", w.name));
            return;
        }
        if !chunk_runs {
            let transposed = pieces.iter().map(|(r, c, pe)| (c.clone(), r.clone(), *pe)).collect();
            if grid_problems(transposed, (n_cols, n_rows), false, &w.name).is_empty() {
                return;
            }
        }
        for (pe, problem) in grid_problems(pieces, (n_rows, n_cols), chunk_runs, &w.name) {
            self.report(pe, None, Some(instr), problem);
        }
    }

    fn at_least_once(&mut self, instr: u32, weight: Handle<waferc_ir::Weight>, mut pieces: Vec<Piece>) {
        let w = &self.module.weights[weight];
        let n = saturate(w.ty.elements());
        pieces.sort_by_key(|(_, c, _)| (c.start, c.end));
        let mut covered = 0;
        for (_, cols, _) in &pieces {
            if cols.start > covered {
                break;
            }
            covered = covered.max(cols.end);
        }
        if covered < n {
            self.report(None, None, Some(instr), format!("elements {covered}..{n} of {} are held by no PE", w.name));
        }
    }

    fn kv(&mut self) {
        for p in &self.program.instrs {
            let Work::Attention(att) = &p.work else { continue };
            // A windowed cache holds the window's rows only.
            let max_context = match self.module.body[Handle::new(p.instr as usize)].op {
                Op::Attention { window: Some(window), .. } => window.min(self.program.max_context),
                _ => self.program.max_context,
            };
            // Every sequence in flight has each KV head, on blocks of its own: once, or in copies
            // whose query heads partition the head's group, in order.
            let group = att.heads / att.kv_heads.max(1);
            let mut heads: Vec<(u32, u32, u32, u32)> = att
                .kv_heads_placed
                .iter()
                .map(|h| (h.sequence, h.kv_head, h.query_heads.start, h.query_heads.end))
                .collect();
            heads.sort_unstable();
            // A head's slices serve the same query heads: count them once.
            heads.dedup();
            self.kv_slices(p.instr, att);
            let mut covered: Vec<(u32, u32)> = Vec::new();
            let mut next = 0;
            for &(sequence, kv_head, start, end) in &heads {
                if start != next || end <= start || end > group {
                    self.report(
                        None,
                        None,
                        Some(p.instr),
                        format!(
                            "KV head {kv_head} of sequence {sequence} serves query heads {start}..{end} of its group \
                             of {group}, not the next ones from {next}"
                        ),
                    );
                }
                next = if end >= group { 0 } else { end };
                if end >= group {
                    covered.push((sequence, kv_head));
                }
            }
            let expected: Vec<(u32, u32)> =
                (0..self.program.max_sequences).flat_map(|s| (0..att.kv_heads).map(move |h| (s, h))).collect();
            if covered != expected {
                self.report(
                    None,
                    None,
                    Some(p.instr),
                    format!(
                        "the KV heads placed in full (sequence, head) are {covered:?}, not each of {} KV heads once for each of {} sequences",
                        att.kv_heads, self.program.max_sequences
                    ),
                );
            }
            for head in &att.kv_heads_placed {
                self.kv_blocks_cover_the_cache(p.instr, head, max_context);
            }
        }
    }

    /// The placements of one KV head, sequence and query heads (its slices, one after another in
    /// `kv_heads_placed`) cut `0..head_dim` in equal aligned power-of-two runs of whole chunks, in
    /// order, on blocks of the same positions; with several, the first names per block a sum of
    /// the slices' partial scores over their block's PEs in slice order ending on its own, and a
    /// broadcast from there to the others; no other slice names any.
    fn kv_slices(&mut self, instr: u32, att: &AttentionPlacement) {
        let hd = att.head_dim;
        for slices in att.kv_heads_placed.chunk_by(KvHeadPlacement::same_head) {
            let (first, count) = (&slices[0], slices.len());
            let width = first.dims.end.saturating_sub(first.dims.start);
            let chunks = width / 32;
            let cut = slices.iter().enumerate().all(|(s, h)| {
                h.dims == (s as u32 * width..(s as u32 + 1) * width) && h.blocks.len() == first.blocks.len()
            });
            // A whole head is one slice of any width; slices are runs of whole chunks.
            let aligned =
                width * count as u32 == hd && (count == 1 || (width.is_multiple_of(32) && chunks.is_power_of_two()));
            let same_blocks = slices.iter().all(|h| {
                h.blocks.iter().zip(&first.blocks).all(|(a, b)| (&a.positions, a.lanes) == (&b.positions, b.lanes))
            });
            if !cut || !aligned || !same_blocks {
                let dims: Vec<_> = slices.iter().map(|h| h.dims.clone()).collect();
                self.report(
                    None,
                    None,
                    Some(instr),
                    format!(
                        "KV head {} of sequence {} holds dims {dims:?} of its {hd}: not equal aligned runs of whole \
                         chunks covering them in order on blocks of the same positions",
                        first.kv_head, first.sequence
                    ),
                );
                continue;
            }
            if slices.iter().skip(1).any(|h| !h.score_reduce.is_empty() || !h.score_broadcast.is_empty()) {
                self.report(
                    None,
                    None,
                    Some(instr),
                    format!("KV head {}: a slice other than the first names score routes", first.kv_head),
                );
            }
            let wanted = if count > 1 { first.blocks.len() } else { 0 };
            if first.score_reduce.len() != wanted || first.score_broadcast.len() != wanted {
                self.report(
                    None,
                    None,
                    Some(instr),
                    format!(
                        "KV head {} in {count} slices names {} score sums and {} broadcasts for its {wanted} blocks",
                        first.kv_head,
                        first.score_reduce.len(),
                        first.score_broadcast.len()
                    ),
                );
                continue;
            }
            for (b, (&reduce, &broadcast)) in first.score_reduce.iter().zip(&first.score_broadcast).enumerate() {
                let pes: Vec<Pe> = slices.iter().map(|h| h.blocks[b].pe).collect();
                let route = |id: RouteId| self.program.routes.get(id as usize);
                let summed = route(reduce).is_some_and(|r| {
                    matches!(r.kind, RouteKind::Reduce { op: ReduceOp::Sum, .. })
                        && r.sources == pes
                        && r.destinations == pes[..1]
                });
                let sent_back = route(broadcast).is_some_and(|r| {
                    matches!(r.kind, RouteKind::Statistic { .. }) && r.sources == pes[..1] && r.destinations == pes[1..]
                });
                if !summed || !sent_back {
                    self.report(
                        Some(pes[0]),
                        None,
                        Some(instr),
                        format!(
                            "KV head {} block {b}: routes {reduce} and {broadcast} are not the sum of its slices' \
                             scores on {pes:?} and its broadcast back",
                            first.kv_head
                        ),
                    );
                }
            }
        }
    }

    /// A KV head's blocks, in order, are the cache's aligned power-of-two runs of 32-position
    /// chunks, each whole or cut in equal aligned lane groups (all blocks alike, so the
    /// reductions' tree over the blocks is the chunk tree), each naming its KV region.
    fn kv_blocks_cover_the_cache(&mut self, instr: u32, head: &KvHeadPlacement, max_context: u32) {
        // The run every block has: the first block's, rounded up to a power-of-two run of chunks
        // where that block is also the last (max_context, or a short window, cuts it short; its
        // lane groups, if any, then share it).
        let run = match head.blocks.first() {
            Some(first) if first.positions.end >= max_context => {
                32 * (first.positions.end - first.positions.start).div_ceil(32).next_power_of_two()
            }
            Some(first) => first.positions.end - first.positions.start,
            None => 0,
        };
        let lanes = head.blocks.first().map_or(Lanes::ALL, |b| b.lanes);
        let mut next = 0u32;
        // The chunk whose lane groups are being walked, and the last group seen.
        let mut open: Option<(Range<u32>, Lanes)> = None;
        for b in &head.blocks {
            let len = b.positions.end - b.positions.start;
            let follows = match &open {
                Some((chunk, last)) => b.positions == *chunk && b.lanes.first as u16 == last.end(),
                None => {
                    let aligned = run % 32 == 0 && (run / 32).is_power_of_two() && b.positions.start % run == 0;
                    b.positions.start == next
                        && b.lanes.first == 0
                        && aligned
                        && (len == run || b.positions.end == max_context)
                }
            };
            let split_ok = b.lanes.is_all() || run == 32;
            if !follows || !split_ok || !b.lanes.is_aligned() || b.lanes.count != lanes.count {
                self.report(
                    Some(b.pe),
                    None,
                    Some(instr),
                    format!(
                        "KV head {} block {:?} ({}) is not the next aligned power-of-two run of 32-position chunks \
                         or the next equal lane group of one chunk",
                        head.kv_head, b.positions, b.lanes
                    ),
                );
            }
            let region = self.images.get(b.pe).and_then(|img| img.regions.get(b.region as usize));
            let holds = matches!(region.map(|r| &r.kind), Some(RegionKind::KvCache { kv_head, positions, lanes, dims }) if *kv_head == head.kv_head && *positions == b.positions && *lanes == b.lanes && *dims == head.dims);
            if !holds {
                self.report(
                    Some(b.pe),
                    None,
                    Some(instr),
                    format!("KV head {} block {:?} ({}) names no such KV region", head.kv_head, b.positions, b.lanes),
                );
            }
            match b.lanes.end() >= LANES as u16 {
                true => {
                    open = None;
                    next = b.positions.end;
                }
                false => open = Some((b.positions.clone(), b.lanes)),
            }
        }
        if next != max_context || open.is_some() {
            self.report(
                None,
                None,
                Some(instr),
                format!("KV head {} covers positions 0..{next} in whole chunks, not 0..{max_context}", head.kv_head),
            );
        }
    }

    fn routes_by_id(&mut self) -> HashMap<u32, &'a Route> {
        let program = self.program;
        let mut by_id = HashMap::with_capacity_and_hasher(program.routes.len(), Default::default());
        for (index, r) in program.routes.iter().enumerate() {
            if r.id as usize != index {
                self.report(None, Some(r.id), Some(r.instr), format!("route {} is stored at index {index}", r.id));
            }
            if by_id.insert(r.id, r).is_some() {
                self.report(None, Some(r.id), Some(r.instr), "route id used twice".into());
            }
        }
        by_id
    }

    /// Walks a route's runs, leaving the PEs they visit in `visited`, or gives the problem with
    /// its path.
    fn walk(&self, route: &Route, visited: &mut Visited) -> Result<(), (Option<Pe>, String)> {
        let params = &self.program.target;
        visited.start();
        for &pe in &route.sources {
            visited.insert(pe);
        }
        for run in &route.path {
            if !visited.contains(run.from) {
                return Err((Some(run.from), format!("a run starts at {} where the route has not been", run.from)));
            }
            if !params.contains(run.from) || !params.contains(run.to) {
                return Err((Some(run.to), "a run leaves the target".into()));
            }
            if run.from.wafer != run.to.wafer {
                if run.from.wafer.abs_diff(run.to.wafer) != 1 {
                    return Err((Some(run.from), "an inter-wafer hop skips a wafer".into()));
                }
                visited.insert(run.to);
                continue;
            }
            if run.from.x != run.to.x && run.from.y != run.to.y {
                return Err((Some(run.from), format!("the run {} -> {} is not straight", run.from, run.to)));
            }
            if run.from == run.to {
                return Err((Some(run.from), "a run of no hops".into()));
            }
            let (a, b) = (run.from, run.to);
            for x in a.x.min(b.x)..=a.x.max(b.x) {
                for y in a.y.min(b.y)..=a.y.max(b.y) {
                    visited.insert(Pe::new(a.wafer, x, y));
                }
            }
        }
        for d in &route.destinations {
            if !visited.contains(*d) {
                return Err((Some(*d), "the route never reaches this destination".into()));
            }
        }
        Ok(())
    }

    /// Route endpoints hold what the route moves: a reduction's and a broadcast's PEs hold state
    /// of the route's instruction, a collect ends at a PE holding those result elements, the
    /// routing starts at the router's result.
    fn endpoints(&mut self) {
        let program = self.program;
        let images = self.images;
        let held = InstrsHeld::new(program);
        let holds_instr = |pe: Pe, instr: u32| images.position(pe).is_some_and(|at| held.holds(at, instr));
        let holds_output = |pe: Pe, instr: u32, elements: &Range<u64>| {
            images.get(pe).is_some_and(|img| {
                img.regions.iter().any(|r| {
                    r.instr == Some(instr)
                        && matches!(&r.kind, RegionKind::Output { elements: e } if e.start <= elements.start && elements.end <= e.end)
                })
            })
        };
        for route in &program.routes {
            let bad = match &route.kind {
                RouteKind::Reduce { .. } | RouteKind::Statistic { .. } => {
                    route.sources.iter().chain(&route.destinations).find(|pe| !holds_instr(**pe, route.instr)).copied()
                }
                RouteKind::Collect { elements } => {
                    route.destinations.iter().find(|pe| !holds_output(**pe, route.instr, elements)).copied()
                }
                RouteKind::Routing => route.sources.iter().find(|pe| !holds_instr(**pe, route.instr)).copied(),
                RouteKind::Operand { .. } | RouteKind::Gather { .. } => None,
            };
            if let Some(pe) = bad {
                self.report(
                    Some(pe),
                    Some(route.id),
                    Some(route.instr),
                    "an endpoint of the route holds nothing of what it carries".into(),
                );
            }
        }
    }

    /// Paths are walkable and colours legal: within the limit, and two routes sharing a colour
    /// on a PE belong to instructions one of which reads the other's result (transitively), or
    /// to one instruction's different schedule steps, so they are never active at the same time
    /// (the router switches the colour between them).
    fn paths_and_colours(&mut self) {
        let params = &self.program.target;
        let (cols, rows) = (params.grid_cols as usize, params.grid_rows as usize);
        let colours = params.colours_per_pe.min(32) as usize;
        // Per (PE, colour): the position in `program.routes` of the route that used it last, in
        // instruction order (`u32::MAX`: none yet).
        let mut last: Vec<u32> = vec![u32::MAX; cols * rows * params.wafers as usize * colours.max(1)];
        let index = |pe: Pe, colour: u8| {
            ((pe.wafer as usize * rows + pe.y as usize) * cols + pe.x as usize) * colours + colour as usize
        };
        // The schedule step sending each route: one instruction's steps run one after another.
        let mut step_of: HashMap<u32, usize> = HashMap::default();
        for (s, step) in self.program.schedule.iter().enumerate() {
            for id in &step.routes {
                step_of.entry(*id).or_insert(s);
            }
        }
        let step = |r: &Route| step_of.get(&r.id).copied().unwrap_or(usize::MAX);
        let mut order: Vec<(usize, &Route)> = self.program.routes.iter().enumerate().collect();
        order.sort_by_key(|(_, r)| (r.instr, step(r), r.id));
        let graph = DependencyGraph::new(self.module);
        let mut reads = Reads::new(&graph);
        // Experts sharing a PE run one after the other (`serial`); copies are on PEs of their own.
        let shared = SharedPes::new(&self.program.instrs, !self.program.replicas.is_empty());
        let mut visited = Visited::new(self.program);
        for (position, route) in order {
            if route.sources.is_empty() || route.destinations.is_empty() {
                self.report(None, Some(route.id), Some(route.instr), "has no source or no destination".into());
                continue;
            }
            if route.colour >= params.colours_per_pe || route.colour >= 32 {
                self.report(
                    None,
                    Some(route.id),
                    Some(route.instr),
                    format!("colour {} is over the limit of {}", route.colour, params.colours_per_pe),
                );
                continue;
            }
            if let Err((pe, message)) = self.walk(route, &mut visited) {
                self.report(pe, Some(route.id), Some(route.instr), message);
                continue;
            }
            let mut clash: Option<(Pe, &Route)> = None;
            for pe in &visited.pes {
                let slot = &mut last[index(*pe, route.colour)];
                if *slot != u32::MAX && *slot != position as u32 {
                    let other = &self.program.routes[*slot as usize];
                    let apart = if other.instr == route.instr {
                        step(other) != step(route)
                    } else {
                        reads.transitively(route.instr, other.instr)
                            || shared.share(route.instr as usize, other.instr as usize)
                    };
                    if !apart && clash.is_none_or(|(c, _)| *pe < c) {
                        clash = Some((*pe, other));
                    }
                }
                *slot = position as u32;
            }
            if let Some((pe, other)) = clash {
                self.report(
                    Some(pe),
                    Some(route.id),
                    Some(route.instr),
                    format!(
                        "colour {} is already used at this PE by route {} of %{}, which can be active at \
                         the same time",
                        route.colour, other.id, other.instr
                    ),
                );
            }
        }
    }

    /// Gather `r`'s sources each hold part of `elements` of `value` as a result segment, and
    /// together all of them.
    fn gather_sources(&mut self, r: &Route, value: u32, elements: &Range<u64>) {
        let mut sent: Vec<Range<u64>> = Vec::new();
        for source in &r.sources {
            let before = sent.len();
            for g in self.images.get(*source).into_iter().flat_map(|img| &img.regions) {
                if let (RegionKind::Output { elements: e }, true) = (&g.kind, g.instr == Some(value)) {
                    if overlap(e, elements) {
                        sent.push(e.start.max(elements.start)..e.end.min(elements.end));
                    }
                }
            }
            if sent.len() == before {
                self.report(
                    Some(*source),
                    Some(r.id),
                    Some(value),
                    format!("a source of the gather of elements {elements:?} of %{value} holds none of them"),
                );
            }
        }
        sent.sort_by_key(|e| e.start);
        let covered = sent.iter().fold(elements.start, |c, e| if e.start <= c { c.max(e.end) } else { c });
        if covered < elements.end {
            self.report(
                r.destinations.first().copied(),
                Some(r.id),
                Some(value),
                format!("no source of the gather sends elements {covered}..{} of %{value}", elements.end),
            );
        }
    }

    /// Which value's data value `v` is, and where in it: through expert_dispatch to the
    /// dispatched vector, through slice to the sliced one.
    fn source(&self, mut v: usize) -> (u32, u64) {
        let mut shift = 0u64;
        loop {
            match &self.module.body[Handle::new(v)].op {
                Op::ExpertDispatch { x, .. } => v = x.index(),
                Op::Slice { x, offset, .. } => {
                    shift += *offset as u64;
                    v = x.index();
                }
                _ => return (v as u32, shift),
            }
        }
    }

    /// Every operand region is fed: the PE holds the value itself, or an operand route of the
    /// value's source ends here and is listed by the instruction.
    fn operands(&mut self, routes: &HashMap<u32, &Route>) {
        // Per destination PE's image (position in `program.pes`): the operand routes arriving
        // there (positions in `program.routes`), sorted by the value they carry, in route order
        // within one; the elements are the route's. One flat table indexed by image, of route
        // positions alone: an 8B program has 40 million arrivals (a list per image held twice
        // their bytes, and the value beside each route another 0.16 GB).
        let carried = |r: &'a Route| match &r.kind {
            RouteKind::Operand { value, elements } | RouteKind::Gather { value, elements } => Some((*value, elements)),
            _ => None,
        };
        let mut first = vec![0usize; self.program.pes.len() + 1];
        for r in &self.program.routes {
            match &r.kind {
                RouteKind::Gather { value, elements } => self.gather_sources(r, *value, elements),
                RouteKind::Operand { value, elements } => {
                    let src_ok = self.images.get(r.sources[0]).is_some_and(|img| {
                        img.regions.iter().any(|g| g.instr == Some(*value) && matches!(&g.kind, RegionKind::Output { elements: e } if e.start <= elements.start && elements.end <= e.end))
                    });
                    if !src_ok {
                        self.report(
                            Some(r.sources[0]),
                            Some(r.id),
                            Some(*value),
                            format!("sends elements {elements:?} of %{value}, which this PE does not hold"),
                        );
                    }
                }
                _ => continue,
            }
            for d in &r.destinations {
                if let Some(at) = self.images.position(*d) {
                    first[at + 1] += 1;
                }
            }
        }
        for at in 0..self.program.pes.len() {
            first[at + 1] += first[at];
        }
        let mut filled = first.clone();
        let mut arrivals = vec![0u32; first[self.program.pes.len()]];
        let value_of: Vec<u32> =
            self.program.routes.iter().map(|r| carried(r).map_or(u32::MAX, |(value, _)| value)).collect();
        for (index, r) in self.program.routes.iter().enumerate() {
            if value_of[index] == u32::MAX {
                continue;
            }
            for d in &r.destinations {
                if let Some(at) = self.images.position(*d) {
                    arrivals[filled[at]] = index as u32;
                    filled[at] += 1;
                }
            }
        }
        drop(filled);
        for at in 0..self.program.pes.len() {
            arrivals[first[at]..first[at + 1]].sort_by_key(|&index| value_of[index as usize]);
        }
        let arriving = |at: usize| &arrivals[first[at]..first[at + 1]];
        let slots = waferc_ir::wafer::replica_slots(self.program);
        let listed: Vec<HashSet<u32>> = self
            .program
            .instrs
            .iter()
            .map(|p| {
                // A replicated expert's instruction: what any of its copies lists.
                let mut set: HashSet<u32> = self
                    .program
                    .placements_of(&slots, p.instr)
                    .flat_map(|c| c.operand_routes.iter().copied())
                    .collect();
                if let Work::Attention(att) = &p.work {
                    for h in &att.kv_heads_placed {
                        set.extend(h.q_routes.iter().chain(&h.k_routes).chain(&h.v_routes).copied());
                    }
                }
                set
            })
            .collect();
        for (at, image) in self.program.pes.iter().enumerate() {
            for region in &image.regions {
                let (RegionKind::Operand { value, elements }, Some(instr)) = (&region.kind, region.instr) else {
                    continue;
                };
                let (src, shift) = self.source(*value as usize);
                let elements = &(elements.start + shift..elements.end + shift);
                // What the PE holds of the source's result itself, then what routes bring.
                let mut held: Vec<Range<u64>> = image
                    .regions
                    .iter()
                    .filter(|g| g.instr == Some(src))
                    .filter_map(|g| match &g.kind {
                        RegionKind::Output { elements: e } if overlap(e, elements) => Some(e.clone()),
                        _ => None,
                    })
                    .collect();
                let list = arriving(at);
                let carries = |&index: &u32| value_of[index as usize];
                let of_src =
                    &list[list.partition_point(|a| carries(a) < src)..list.partition_point(|a| carries(a) <= src)];
                let mut pieces: Vec<(Range<u64>, u32)> = of_src
                    .iter()
                    .filter_map(|&index| {
                        let r = &self.program.routes[index as usize];
                        carried(r).map(|(_, e)| (e.clone(), r.id))
                    })
                    .filter(|(e, _)| overlap(e, elements))
                    .collect();
                held.extend(pieces.iter().map(|(e, _)| e.clone()));
                held.sort_by_key(|e| e.start);
                let mut covered = elements.start;
                for e in &held {
                    if e.start <= covered {
                        covered = covered.max(e.end);
                    }
                }
                if covered >= elements.end && pieces.is_empty() {
                    continue;
                }
                pieces.sort_by_key(|(e, _)| e.start);
                for (_, id) in &pieces {
                    if !listed[instr as usize].contains(id) {
                        self.report(
                            Some(image.pe),
                            Some(*id),
                            Some(instr),
                            format!("operand %{value} arrives on route {id}, which the instruction does not list"),
                        );
                    }
                }
                if covered < elements.end {
                    self.report(
                        Some(image.pe),
                        None,
                        Some(instr),
                        format!(
                            "no route from its producer brings elements {covered}..{} of operand %{value}",
                            elements.end
                        ),
                    );
                }
            }
        }
        // Routes every placement (and every copy) names exist.
        let copies = self.program.replicas.iter().flat_map(|r| r.copies.iter().flatten());
        for p in self.program.instrs.iter().chain(copies) {
            let mut named: Vec<u32> = p.operand_routes.iter().chain(&p.deliveries).copied().collect();
            match &p.work {
                Work::Embed { collects, .. } => named.extend(collects),
                Work::MatVec(mv) => named.extend(mv.reductions.iter().chain(&mv.broadcasts).chain(&mv.collects)),
                Work::RmsNorm(n) => named.extend(n.group_routes.iter().flat_map(|g| [g.reduce, g.broadcast])),
                Work::Attention(att) => {
                    named.extend(&att.collects);
                    for h in &att.kv_heads_placed {
                        named.extend(h.q_routes.iter().chain(&h.k_routes).chain(&h.v_routes));
                        named.extend(
                            [h.max_reduce, h.max_broadcast, h.sum_reduce, h.sum_broadcast, h.out_reduce]
                                .into_iter()
                                .flatten(),
                        );
                        named.extend(h.score_reduce.iter().chain(&h.score_broadcast));
                    }
                }
                Work::Router { routing } | Work::Dispatch { routing } => named.push(*routing),
                Work::Combine { routing, collects } => {
                    named.push(*routing);
                    named.extend(collects);
                }
                Work::Elementwise | Work::Slice => {}
            }
            for id in named {
                if !routes.contains_key(&id) {
                    self.report(
                        None,
                        Some(id),
                        Some(p.instr),
                        format!("the placement names route {id}, which does not exist"),
                    );
                }
            }
            if let ResultLayout::Vector(l) = &p.result {
                let mut next = 0;
                for s in &l.segments {
                    if s.elements.start != next || s.elements.end <= s.elements.start {
                        self.report(
                            Some(s.pe),
                            None,
                            Some(p.instr),
                            format!("result segment {:?} does not follow {next}", s.elements),
                        );
                    }
                    next = s.elements.end;
                }
            }
        }
    }

    /// Every route in exactly one step; steps in program order; deliveries before their readers.
    fn schedule(&mut self, routes: &HashMap<u32, &Route>) {
        let mut used: HashMap<u32, usize> = HashMap::default();
        let mut first_step: HashMap<u32, usize> = HashMap::default();
        let mut last_instr = 0;
        for (s, step) in self.program.schedule.iter().enumerate() {
            if step.instr < last_instr {
                self.report(None, None, Some(step.instr), format!("step {s} goes back to an earlier instruction"));
            }
            last_instr = step.instr;
            first_step.entry(step.instr).or_insert(s);
            for id in &step.routes {
                if !routes.contains_key(id) {
                    self.report(
                        None,
                        Some(*id),
                        Some(step.instr),
                        format!("step {s} ({:?}) uses route {id}, which does not exist", step.phase),
                    );
                } else if let Some(prev) = used.insert(*id, s) {
                    self.report(
                        None,
                        Some(*id),
                        Some(step.instr),
                        format!("route {id} is used by steps {prev} and {s}"),
                    );
                }
            }
        }
        // The instructions listing each operand route (an index, not a scan per route: programs
        // have hundreds of thousands of routes).
        let mut readers: HashMap<u32, Vec<u32>> = HashMap::default();
        let copies = self.program.replicas.iter().flat_map(|r| r.copies.iter().flatten());
        for p in self.program.instrs.iter().chain(copies) {
            for id in &p.operand_routes {
                readers.entry(*id).or_default().push(p.instr);
            }
        }
        for r in &self.program.routes {
            match used.get(&r.id) {
                None => self.report(None, Some(r.id), Some(r.instr), "no schedule step uses this route".into()),
                Some(step) => {
                    if let RouteKind::Operand { .. } | RouteKind::Gather { .. } = r.kind {
                        for &reader in readers.get(&r.id).into_iter().flatten() {
                            if first_step.get(&reader).is_some_and(|f| f < step) {
                                self.report(
                                    None,
                                    Some(r.id),
                                    Some(reader),
                                    format!("the instruction starts before step {step} delivers its operand"),
                                );
                            }
                        }
                    }
                }
            }
        }
        for p in &self.program.instrs {
            if !first_step.contains_key(&p.instr) {
                self.report(None, None, Some(p.instr), "no schedule step runs this instruction".into());
            }
        }
    }
}

/// A working region as an overflow or overlap message names it: `%12's operand buffer of %9`,
/// `%12's result`.
fn working_name(region: &Region) -> String {
    let instr = region.instr.map_or("code".to_string(), |i| format!("%{i}"));
    match &region.kind {
        RegionKind::Operand { value, .. } => format!("{instr}'s operand buffer of %{value}"),
        _ => format!("{instr}'s result"),
    }
}

/// What keeps `pieces` from being a grid of `n_rows x n_cols` (see `Checker::exactly_once`): row
/// bands that partition the rows, each band's column pieces partitioning the columns, and with
/// `chunk_runs` column pieces that are aligned equal power-of-two chunk runs. Stops at the first
/// gap or overlap.
fn grid_problems(
    mut pieces: Vec<Piece>,
    (n_rows, n_cols): (u32, u32),
    chunk_runs: bool,
    name: &str,
) -> Vec<(Option<Pe>, String)> {
    let mut problems = Vec::new();
    pieces.sort_by_key(|(r, c, _)| (r.start, c.start, r.end, c.end));
    let mut row = 0;
    let mut i = 0;
    while i < pieces.len() {
        let band = pieces[i].0.clone();
        let pe = pieces[i].2;
        if band.start != row {
            let what = if band.start < row { "held twice" } else { "held by no PE" };
            problems.push((Some(pe), format!("rows {row}..{} of {name} are {what}", band.start.max(row))));
            return problems;
        }
        let mut col = 0;
        let run = pieces[i].1.end - pieces[i].1.start;
        while i < pieces.len() && pieces[i].0 == band {
            let (_, cols, pe) = &pieces[i];
            if cols.start != col {
                let what = if cols.start < col { "held twice" } else { "held by no PE" };
                problems.push((Some(*pe), format!("rows {band:?}, cols {col}.. of {name} are {what}")));
                return problems;
            }
            let aligned = cols.start % run == 0 && (cols.end - cols.start == run || cols.end == n_cols);
            // A tile holding whole rows computes the entire chunk tree itself, whatever its length.
            let whole_rows = cols.start == 0 && cols.end == n_cols;
            if chunk_runs
                && !whole_rows
                && (!run.is_multiple_of(32) && cols.end != n_cols || !(run / 32).max(1).is_power_of_two() || !aligned)
            {
                problems.push((
                    Some(*pe),
                    format!("cols {cols:?} of {name} are not an aligned power-of-two run of 32-element chunks"),
                ));
            }
            col = cols.end;
            i += 1;
        }
        if col != n_cols {
            problems.push((Some(pe), format!("rows {band:?}, cols {col}..{n_cols} of {name} are held by no PE")));
        }
        row = band.end;
    }
    if row != n_rows {
        problems.push((None, format!("rows {row}..{n_rows} of {name} are held by no PE")));
    }
    problems
}
