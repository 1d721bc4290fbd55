//! The fabric: messages on routes. A PE may only send on a route it is a source of, in a step
//! that lists the route, and only read a route it is a destination of; operands, reductions,
//! result collects and deliveries are all built from those checked sends and receives.

use std::ops::Range;

use waferc_ir::wafer::{
    InstrIndex, Pe, Phase, ReduceOp, ResultLayout, Route, RouteId, RouteKind, Segment, WaferProgram, Work,
};

use super::{intersect, relative, span, Data, ExecError, Executor, Held, InstrRun, InstrSite, StepState};
use crate::kernels::{self, Routing};

/// A message on a route.
#[derive(Clone, Debug)]
pub(super) enum Payload {
    Data(Data),
    Routing(Routing),
}

impl<'p> Executor<'p> {
    pub(super) fn route(&self, run: &InstrRun, id: RouteId) -> Result<&'p Route, ExecError> {
        route_of(self.program, &run.site, id)
    }

    /// `sender` sends `payload` on route `id` in the current phase.
    pub(super) fn send(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        id: RouteId,
        sender: Pe,
        payload: Payload,
    ) -> Result<(), ExecError> {
        let route = self.route(run, id)?;
        if !run.current_lists(id) {
            return Err(ExecError::RouteNotInStep { site: run.site.clone(), route: id, phase: run.phase, pe: sender });
        }
        if !route.sources.contains(&sender) {
            return Err(ExecError::NotASource { site: run.site.clone(), route: id, pe: sender });
        }
        if state.messages.insert((id, sender), payload).is_some() {
            return Err(ExecError::DuplicateMessage { site: run.site.clone(), route: id, sender });
        }
        run.sent(id);
        Ok(())
    }

    /// A reduction edge's partial of `expected` values, sent by leaf PE `sender` and taken at
    /// once by `receiver`; the route must be the current step's, as for [`Executor::send`]. The
    /// tree names both ends and each leaf sends once, so the partial goes straight to its
    /// receiver rather than through the step's message map (a message per tile, and a source
    /// check scanning the route's leaves per edge).
    fn send_partial(
        &self,
        run: &mut InstrRun,
        id: RouteId,
        (sender, receiver): (Pe, Pe),
        partial: Data,
        expected: usize,
    ) -> Result<Data, ExecError> {
        if !run.current_lists(id) {
            return Err(ExecError::RouteNotInStep { site: run.site.clone(), route: id, phase: run.phase, pe: sender });
        }
        if partial.len() != expected {
            return Err(ExecError::MessageLength {
                site: run.site.clone(),
                route: id,
                sender,
                pe: receiver,
                expected,
                found: partial.len(),
            });
        }
        run.sent(id);
        Ok(partial)
    }

    /// The message `sender` sent on route `id`, as read by `receiver`, which must be one of the
    /// route's destinations.
    fn receive<'s>(
        &self,
        state: &'s StepState,
        run: &InstrRun,
        id: RouteId,
        sender: Pe,
        receiver: Pe,
    ) -> Result<&'s Payload, ExecError> {
        self.route(run, id)?;
        if self.destinations[id as usize].binary_search(&receiver).is_err() {
            return Err(ExecError::NotADestination { site: run.site.clone(), route: id, pe: receiver });
        }
        self.message(state, run, id, sender, receiver)
    }

    fn message<'s>(
        &self,
        state: &'s StepState,
        run: &InstrRun,
        id: RouteId,
        sender: Pe,
        receiver: Pe,
    ) -> Result<&'s Payload, ExecError> {
        state.messages.get(&(id, sender)).ok_or_else(|| missing_message(run, id, sender, receiver))
    }

    /// The message `sender` sent on route `id`, taken by `receiver` (a reduction's partial, which
    /// only its receiver reads, right after it is sent): a step's reductions send a message per
    /// tile, and the step's message map holds only the rest.
    fn take_message(
        &self,
        state: &mut StepState,
        run: &InstrRun,
        id: RouteId,
        sender: Pe,
        receiver: Pe,
    ) -> Result<Payload, ExecError> {
        state.messages.remove(&(id, sender)).ok_or_else(|| missing_message(run, id, sender, receiver))
    }

    /// A data message of exactly `expected` values.
    pub(super) fn receive_data(
        &self,
        state: &StepState,
        run: &InstrRun,
        id: RouteId,
        sender: Pe,
        receiver: Pe,
        expected: usize,
    ) -> Result<Data, ExecError> {
        let payload = self.receive(state, run, id, sender, receiver)?;
        data_of(run, id, sender, receiver, payload, expected)
    }

    /// A routing decision `sender` sent on route `id`, as read by `receiver`.
    pub(super) fn receive_routing<'s>(
        &self,
        state: &'s StepState,
        run: &InstrRun,
        id: RouteId,
        sender: Pe,
        receiver: Pe,
    ) -> Result<&'s Routing, ExecError> {
        match self.receive(state, run, id, sender, receiver)? {
            Payload::Routing(routing) => Ok(routing),
            Payload::Data(_) => Err(ExecError::RouteKind {
                site: run.site.clone(),
                route: id,
                expected: "a routing decision",
                found: "a data message".into(),
            }),
        }
    }

    /// Whether the expert `instr` belongs to was chosen, as every PE of the instruction learns
    /// from the router's `Routing` route (always true outside experts).
    pub(super) fn gate_open(
        &self,
        state: &StepState,
        run: &mut InstrRun,
        instr: InstrIndex,
    ) -> Result<bool, ExecError> {
        let Some(gate) = self.gates[instr as usize] else { return Ok(true) };
        // A copy of the expert learns the routing on its own route.
        let gate_route = match self.placement(gate.dispatch).work {
            Work::Dispatch { routing } => routing,
            _ => gate.route,
        };
        let route = self.route(run, gate_route)?;
        let sender = *route.sources.first().ok_or_else(|| ExecError::Malformed {
            site: run.site.clone(),
            problem: format!("routing route {} has no source", gate.route),
        })?;
        let mut chosen = None;
        for &pe in &self.instr_pes[instr as usize][run.copy as usize] {
            let routing = self.receive_routing(state, run, gate_route, sender, pe)?;
            chosen = Some(routing.weight_of(gate.expert).is_some());
        }
        Ok(chosen.unwrap_or(false))
    }

    /// Elements `elements` of `value` as PE `pe` sees them while computing `consumer`: from its
    /// own result segments of the value, or from the operand routes of `consumer` reaching it.
    pub(super) fn operand(
        &self,
        state: &StepState,
        run: &InstrRun,
        pe: Pe,
        value: InstrIndex,
        elements: Range<u64>,
    ) -> Result<Data, ExecError> {
        let source = self.alias[value as usize];
        let shift = self.alias_offset[value as usize];
        let elements = elements.start + shift..elements.end + shift;
        let mut pieces: Vec<(Range<u64>, Data)> = Vec::new();
        if let (Held::Segments(held), ResultLayout::Vector(layout)) =
            (&state.held[source as usize], &self.placement(source).result)
        {
            for &s in self.segments_on(source, pe) {
                let (segment, Some(data)) = (&layout.segments[s as usize], held.get(s as usize)) else { continue };
                if let Some(overlap) = intersect(&segment.elements, &elements) {
                    pieces.push((overlap.clone(), data.slice(relative(&overlap, segment.elements.start))));
                }
            }
        }
        for &id in run.operand_routes_to(self.placement(run.instr), &self.destinations, pe) {
            let route = self.route(run, id)?;
            let (carried, carried_elements) = match &route.kind {
                RouteKind::Operand { value, elements } => (*value, elements),
                RouteKind::Gather { value, elements: gathered } => {
                    if *value == source && intersect(gathered, &elements).is_some() {
                        self.gathered(state, run, route, pe, &elements, &mut pieces)?;
                    }
                    continue;
                }
                _ => return Err(route_kind_error(run, route, "an operand route")),
            };
            if carried != source {
                continue;
            }
            let Some(overlap) = intersect(carried_elements, &elements) else { continue };
            let sender = single_source(run, route)?;
            let data = data_of(
                run,
                id,
                sender,
                pe,
                self.message(state, run, id, sender, pe)?,
                span(carried_elements) as usize,
            )?;
            pieces.push((overlap.clone(), data.slice(relative(&overlap, carried_elements.start))));
        }
        pieces.sort_by_key(|(range, _)| range.start);
        let mut covered = elements.start;
        let mut out = if self.options.timing_only { None } else { Some(Vec::with_capacity(span(&elements) as usize)) };
        for (range, data) in &pieces {
            if range.end <= covered {
                continue;
            }
            if range.start > covered {
                break;
            }
            if let Some(out) = out.as_mut() {
                out.extend_from_slice(&data.values()[(covered - range.start) as usize..]);
            }
            covered = range.end;
        }
        if covered < elements.end {
            let gap = covered..elements.end;
            if matches!(state.held[source as usize], Held::Pending) {
                return Err(ExecError::MissingOperand {
                    site: run.site.clone(),
                    pe,
                    value: source,
                    elements: gap,
                    problem: format!("%{source} has not been computed yet: the schedule runs it later"),
                });
            }
            // Name the route that carries the missing elements but does not reach this PE.
            for &id in &self.placement(run.instr).operand_routes {
                let route = self.route(run, id)?;
                if let RouteKind::Operand { value: carried, elements: carried_elements }
                | RouteKind::Gather { value: carried, elements: carried_elements } = &route.kind
                {
                    if *carried == source && intersect(carried_elements, &gap).is_some() {
                        return Err(ExecError::NotADestination { site: run.site.clone(), route: id, pe });
                    }
                }
            }
            return Err(ExecError::MissingOperand {
                site: run.site.clone(),
                pe,
                value: source,
                elements: gap,
                problem: "no operand route of the instruction brings them to this PE".into(),
            });
        }
        Ok(match out {
            Some(values) => Data::Values(values),
            None => Data::Shape(span(&elements) as usize),
        })
    }

    /// The pieces of `elements` (of the value gather `route` carries) that `pe` receives on it:
    /// each source's segment of the value inside the gather's elements, one message per source.
    fn gathered(
        &self,
        state: &StepState,
        run: &InstrRun,
        route: &Route,
        pe: Pe,
        elements: &Range<u64>,
        pieces: &mut Vec<(Range<u64>, Data)>,
    ) -> Result<(), ExecError> {
        let RouteKind::Gather { value, elements: gathered } = &route.kind else {
            return Err(route_kind_error(run, route, "a gather"));
        };
        let ResultLayout::Vector(layout) = &self.placement(*value).result else {
            return Err(route_kind_error(run, route, "a gather of a vector's segments"));
        };
        for (segment, sent) in layout.overlapping(gathered.clone()).filter(|(s, _)| route.sources.contains(&s.pe)) {
            let Some(overlap) = intersect(&sent, elements) else { continue };
            let message = self.message(state, run, route.id, segment.pe, pe)?;
            let data = data_of(run, route.id, segment.pe, pe, message, span(&sent) as usize)?;
            pieces.push((overlap.clone(), data.slice(relative(&overlap, sent.start))));
        }
        Ok(())
    }

    /// Runs one reduction: `leaves[i]` is the partial held by `route.sources[i]`; partials are
    /// combined along [`Route::reduce_edges`] (the lower leaves' partial on the left, wherever
    /// the combine happens), then the root leaf forwards the total to the destination if it is
    /// elsewhere. Returns the total.
    pub(super) fn reduce(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        id: RouteId,
        leaves: Vec<Data>,
    ) -> Result<(Pe, Data), ExecError> {
        let sending = leaves.len();
        self.reduce_leading(state, run, id, leaves, sending)
    }

    /// [`Executor::reduce`] where only the first `sending` leaves hold anything (attention's KV
    /// blocks holding a position, in position order): an edge whose sender's subtree lies beyond
    /// them is skipped, which changes no bit (an empty subtree's partial is +0.0 for a sum, -inf
    /// for a maximum; NUMERICS.md, "the chunk tree").
    pub(super) fn reduce_leading(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        id: RouteId,
        leaves: Vec<Data>,
        sending: usize,
    ) -> Result<(Pe, Data), ExecError> {
        self.reduce_leading_carrying(state, run, id, leaves, sending, None)
    }

    /// [`Executor::reduce_leading`] with partials of `carried` elements where given, fewer than
    /// the route is sized for (an attention block's score parts at the rows it holds so far):
    /// the timing model charges the messages and the adds for what they carry.
    pub(super) fn reduce_leading_carrying(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        id: RouteId,
        mut leaves: Vec<Data>,
        sending: usize,
        carried: Option<u32>,
    ) -> Result<(Pe, Data), ExecError> {
        let route = self.route(run, id)?;
        let RouteKind::Reduce { op, elements } = route.kind else {
            return Err(route_kind_error(run, route, "a reduction"));
        };
        let elements = match carried {
            Some(carried) if carried <= elements => {
                run.carried(id, carried);
                carried
            }
            Some(carried) => {
                return Err(ExecError::Malformed {
                    site: run.site.clone(),
                    problem: format!("reduction route {id} carries {elements} elements, not {carried}"),
                })
            }
            None => elements,
        };
        if leaves.is_empty() || leaves.len() != route.sources.len() {
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!(
                    "reduction route {id} has {} sources for {} partials",
                    route.sources.len(),
                    leaves.len()
                ),
            });
        }
        let destination = single_destination(run, route)?;
        let root_leaf = route.reduce_root();
        if sending < leaves.len() && root_leaf != 0 {
            // Skipping the trailing subtrees keeps the tree only when they do not hold the root.
            return Err(ExecError::Malformed {
                site: run.site.clone(),
                problem: format!("reduction route {id} ends on leaf {root_leaf}, but only its leading leaves send"),
            });
        }
        for (receiver, sender) in route.reduce_edges() {
            if sender >= sending {
                continue;
            }
            let (from, to) = (route.sources[sender], route.sources[receiver]);
            let partial = std::mem::replace(&mut leaves[sender], Data::Shape(0));
            let sent = self.send_partial(run, id, (from, to), partial, elements as usize)?;
            run.compute(to, self.costs.flops(elements as u64));
            leaves[receiver] = match sender < receiver {
                true => self.combine(op, &sent, &leaves[receiver]),
                false => self.combine(op, &leaves[receiver], &sent),
            };
        }
        let total = leaves.swap_remove(root_leaf);
        let root = route.sources[root_leaf];
        if destination == root {
            return Ok((root, total));
        }
        self.send(state, run, id, root, Payload::Data(total))?;
        let total = data_of(
            run,
            id,
            root,
            destination,
            &self.take_message(state, run, id, root, destination)?,
            elements as usize,
        )?;
        Ok((destination, total))
    }

    /// One edge of a reduction tree: `left` (the lower leaves' subtree) combined with `right`.
    fn combine(&self, op: ReduceOp, left: &Data, right: &Data) -> Data {
        self.compute_data(left.len(), || match op {
            ReduceOp::Sum => kernels::add(left.values(), right.values()),
            // Exact in any order: the maximum rounds nothing.
            ReduceOp::Max => left.values().iter().zip(right.values()).map(|(a, b)| a.max(*b)).collect(),
        })
    }

    /// Sends each result segment along the instruction's deliveries (one per segment).
    pub(super) fn deliver(
        &self,
        state: &mut StepState,
        run: &mut InstrRun,
        segments: &[Segment],
    ) -> Result<(), ExecError> {
        run.begin(Phase::Deliver);
        let placement = self.placement(run.instr);
        let Held::Segments(held) = &state.held[run.instr as usize] else { return Ok(()) };
        let held = held.clone();
        // The value's segments also go to the expert copies serving this step, on their own routes.
        for (id, copies) in self.copy_inputs.get(&run.instr).map_or(&[][..], Vec::as_slice) {
            let id = *id;
            if !self.serves(copies) {
                continue;
            }
            let route = self.route(run, id)?;
            let RouteKind::Operand { elements, .. } = &route.kind else {
                return Err(route_kind_error(run, route, "the delivery of a result segment to an expert copy"));
            };
            let Some(index) = segments.iter().position(|s| s.elements == *elements) else {
                return Err(route_kind_error(run, route, "the delivery of a result segment to an expert copy"));
            };
            self.send(state, run, id, segments[index].pe, Payload::Data(held[index].clone()))?;
        }
        // Deliveries are in segment order; a segment all of whose readers sit on its own PE has none.
        let mut next = 0;
        for &id in &placement.deliveries {
            let route = self.route(run, id)?;
            let (value, elements) = match &route.kind {
                RouteKind::Operand { value, elements } => (value, elements),
                // Each source sends its segment inside the gather's elements.
                RouteKind::Gather { value, elements } if *value == run.instr => {
                    for (segment, data) in segments.iter().zip(&held) {
                        let sent = intersect(&segment.elements, elements);
                        if let Some(sent) = sent.filter(|_| route.sources.contains(&segment.pe)) {
                            let part = data.slice(relative(&sent, segment.elements.start));
                            self.send(state, run, id, segment.pe, Payload::Data(part))?;
                        }
                    }
                    continue;
                }
                _ => return Err(route_kind_error(run, route, "the delivery of a result segment")),
            };
            // A route carries a whole segment or a part of one (a KV head slice's dims).
            let within = |s: &Segment| s.elements.start <= elements.start && elements.end <= s.elements.end;
            let found = segments[next..].iter().position(within).map(|k| next + k);
            let Some(index) = found.filter(|_| *value == run.instr) else {
                return Err(route_kind_error(run, route, "the delivery of a result segment, in segment order"));
            };
            next = index;
            let segment = &segments[index];
            let part = match segment.elements == *elements {
                true => held[index].clone(),
                false => held[index].slice(relative(elements, segment.elements.start)),
            };
            self.send(state, run, id, segment.pe, Payload::Data(part))?;
        }
        Ok(())
    }

    /// The receiving side of a `Collect` route into result segment `segment`: one message per
    /// `(sender, elements)` the placement says sends, assembled in element order.
    pub(super) fn assemble(
        &self,
        state: &StepState,
        run: &InstrRun,
        id: RouteId,
        segment: &Segment,
        mut parts: Vec<(Pe, Range<u64>)>,
    ) -> Result<Data, ExecError> {
        parts.sort_by_key(|(_, r)| r.start);
        // Each sender sent one message: its parts, in order (a KV head's slice holds its dims of
        // each query head, so it may have several in one segment).
        let mut messages: Vec<(Pe, Data, usize)> = Vec::new();
        for (sender, range) in &parts {
            match messages.iter_mut().find(|(pe, _, _)| pe == sender) {
                Some((_, _, len)) => *len += span(range) as usize,
                None => messages.push((*sender, Data::Shape(0), span(range) as usize)),
            }
        }
        for (sender, data, len) in &mut messages {
            *data = self.receive_data(state, run, id, *sender, segment.pe, *len)?;
            *len = 0;
        }
        let mut covered = segment.elements.start;
        let mut out = Vec::new();
        for (sender, range) in &parts {
            if range.start != covered {
                break;
            }
            let Some((_, data, read)) = messages.iter_mut().find(|(pe, _, _)| pe == sender) else { break };
            let take = span(range) as usize;
            out.extend_from_slice(data.slice(*read..*read + take).values());
            *read += take;
            covered = range.end;
        }
        if covered != segment.elements.end {
            return Err(ExecError::MissingOperand {
                site: run.site.clone(),
                pe: segment.pe,
                value: run.instr,
                elements: covered..segment.elements.end,
                problem: format!("no source of collect route {id} holds them"),
            });
        }
        Ok(if self.options.timing_only { Data::Shape(span(&segment.elements) as usize) } else { Data::Values(out) })
    }
}

pub(crate) fn route_of<'a>(program: &'a WaferProgram, site: &InstrSite, id: RouteId) -> Result<&'a Route, ExecError> {
    match program.routes.get(id as usize) {
        Some(route) if route.id == id => Ok(route),
        Some(route) => Err(ExecError::Malformed {
            site: site.clone(),
            problem: format!("routes[{id}] has id {}: route ids must equal their index", route.id),
        }),
        None => Err(ExecError::MissingRoute { site: site.clone(), route: id, routes: program.routes.len() }),
    }
}

pub(super) fn route_kind_error(run: &InstrRun, route: &Route, expected: &'static str) -> ExecError {
    ExecError::RouteKind { site: run.site.clone(), route: route.id, expected, found: format!("{:?}", route.kind) }
}

pub(super) fn single_source(run: &InstrRun, route: &Route) -> Result<Pe, ExecError> {
    match route.sources[..] {
        [source] => Ok(source),
        _ => Err(ExecError::Malformed {
            site: run.site.clone(),
            problem: format!("route {} must have one source, it has {}", route.id, route.sources.len()),
        }),
    }
}

fn single_destination(run: &InstrRun, route: &Route) -> Result<Pe, ExecError> {
    match route.destinations[..] {
        [destination] => Ok(destination),
        _ => Err(ExecError::Malformed {
            site: run.site.clone(),
            problem: format!("route {} must have one destination, it has {}", route.id, route.destinations.len()),
        }),
    }
}

/// `receiver` found no message from `sender` on route `id`.
fn missing_message(run: &InstrRun, id: RouteId, sender: Pe, receiver: Pe) -> ExecError {
    ExecError::MissingMessage { site: run.site.clone(), route: id, sender, pe: receiver }
}

fn data_of(
    run: &InstrRun,
    id: RouteId,
    sender: Pe,
    receiver: Pe,
    payload: &Payload,
    expected: usize,
) -> Result<Data, ExecError> {
    match payload {
        Payload::Data(data) if data.len() == expected => Ok(data.clone()),
        Payload::Data(data) => Err(ExecError::MessageLength {
            site: run.site.clone(),
            route: id,
            sender,
            pe: receiver,
            expected,
            found: data.len(),
        }),
        Payload::Routing(_) => Err(ExecError::RouteKind {
            site: run.site.clone(),
            route: id,
            expected: "a data message",
            found: "a routing decision".into(),
        }),
    }
}
