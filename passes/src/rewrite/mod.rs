//! `rewrite`: equality saturation with egg over each decoder block.
//!
//! Each block (a maximal run of instructions of one layer) becomes an e-graph ([`lang`]): values
//! from outside the block are leaves, every instruction a node, so duplicate computations merge
//! on insertion. The rules fuse matvecs that read the same input (q/k/v, gate/up, per expert)
//! into one matvec over the stacked weights, each original result a `slice` of the fused one.
//! [`extract`] chooses, by a cost that counts what a form needs on the wafer under the plan the
//! module will be lowered with ([`PlanKind`]: fusion pays where a region's matvecs share its
//! PEs and run one after another, not where each has PEs of its own), which form each value
//! takes; only the block's live outputs (values read after it, and its attentions, which
//! append to their caches) are extracted, so dead code goes.
//!
//! Every rule keeps every bit (NUMERICS.md, "Rewrites"): no sum is reassociated and no norm
//! weight is folded into a matrix. The runner has node and iteration limits and no time limit,
//! and egg is built `deterministic`, so the output depends on the input only.
//!
//! A fused weight is a new module weight (`@"q+k+v"`), its rows those of its parts in order; its
//! bytes are the parts' bytes end to end (absent if any part is absent, as in a shape-only
//! compile). The parts are left unused for `dce` to remove.

pub mod extract;
pub mod lang;

use std::cell::Cell;
use std::collections::BTreeMap;

use egg::{EGraph, Id, Runner, SimpleScheduler, Symbol};
use waferc_ir::wafer::Plan;
use waferc_ir::{Handle, Instr, Module, Op, TensorType, Value, Weight, WeightBytes};

use crate::error::PassError;
use crate::manager::Pass;
use lang::{BlockAnalysis, BlockLang};

/// E-graph nodes per block before saturation stops (a Mixtral block peaks near 400).
pub const NODE_LIMIT: usize = 20_000;
/// Saturation iterations per block (fusing three matvecs needs two, slices of slices a third).
pub const ITER_LIMIT: usize = 12;

/// How a plan lays matvecs out, which is what the extraction's cost depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PlanKind {
    /// Every matvec on PEs of its own (the tiled and MeshGEMV plans): matvecs reading one input
    /// run side by side.
    Tiled,
    /// Every matvec of a region tiled over all of its PEs (the stacked plan): they run one
    /// after another.
    Stacked,
}

impl PlanKind {
    pub const ALL: [PlanKind; 2] = [PlanKind::Tiled, PlanKind::Stacked];

    /// The kind of `plan`.
    pub fn of(plan: &Plan) -> PlanKind {
        match plan {
            Plan::Tiled | Plan::MeshGemv { .. } => PlanKind::Tiled,
            Plan::Stacked { .. } => PlanKind::Stacked,
        }
    }

    /// The spelling of `rewrite plan=KIND`.
    pub fn name(self) -> &'static str {
        match self {
            PlanKind::Tiled => "tiled",
            PlanKind::Stacked => "stacked",
        }
    }

    pub fn parse(text: &str) -> Option<PlanKind> {
        PlanKind::ALL.into_iter().find(|k| k.name() == text)
    }
}

impl std::fmt::Display for PlanKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The pass, its extraction costed for `plan`.
pub struct Rewrite {
    pub plan: PlanKind,
}

impl Pass for Rewrite {
    fn name(&self) -> &'static str {
        "rewrite"
    }

    fn costed_for(&self) -> Option<PlanKind> {
        Some(self.plan)
    }

    fn run(&self, module: &mut Module) -> Result<(), PassError> {
        *module = rewrite_module(module, self.plan)?;
        Ok(())
    }
}

/// The module with every decoder block rewritten, extraction costed for `plan`.
pub fn rewrite_module(module: &Module, plan: PlanKind) -> Result<Module, PassError> {
    let mut out = Module::new(module.meta.clone());
    out.weights = module.weights.clone();
    out.caches = module.caches.clone();
    let mut value_map: Vec<Option<Value>> = vec![None; module.body.len()];
    let mut fused_weights: BTreeMap<Vec<u32>, Handle<Weight>> = BTreeMap::new();

    let instrs: Vec<(Value, &Instr)> = module.body.iter().collect();
    let mut start = 0;
    while start < instrs.len() {
        let layer = instrs[start].1.layer;
        let mut end = start + 1;
        while end < instrs.len() && instrs[end].1.layer == layer && layer.is_some() {
            end += 1;
        }
        match layer {
            None => {
                for &(handle, instr) in &instrs[start..end] {
                    let op = remap_values(&instr.op, &value_map)?;
                    value_map[handle.index()] = Some(push(&mut out, op, None)?);
                }
            }
            Some(_) => {
                let block = &instrs[start..end];
                let used_later = |v: usize| {
                    module.output.is_some_and(|o| o.index() == v)
                        || instrs[end..].iter().any(|(_, i)| i.op.operands().iter().any(|o| o.index() == v))
                };
                let roots: Vec<usize> = block
                    .iter()
                    .map(|(h, _)| h.index())
                    .filter(|&v| used_later(v) || matches!(module.body[Handle::new(v)].op, Op::Attention { .. }))
                    .collect();
                rewrite_block(module, block, &roots, plan, &mut out, &mut value_map, &mut fused_weights)?;
            }
        }
        start = end;
    }
    out.output = match module.output {
        Some(o) => Some(lookup(&value_map, o)?),
        None => None,
    };
    Ok(out)
}

fn internal(message: String) -> PassError {
    PassError::Internal { pass: "rewrite", message }
}

fn lookup(map: &[Option<Value>], v: Value) -> Result<Value, PassError> {
    map.get(v.index())
        .copied()
        .flatten()
        .ok_or_else(|| internal(format!("%{} is used before its block was rewritten", v.index())))
}

fn remap_values(op: &Op, map: &[Option<Value>]) -> Result<Op, PassError> {
    for v in op.operands() {
        lookup(map, v)?;
    }
    Ok(op.remap(|v| map[v.index()].expect("checked above"), |w| w, |c| c))
}

fn push(module: &mut Module, op: Op, layer: Option<u32>) -> Result<Value, PassError> {
    let name = op.name();
    module.push(op, layer).map_err(|source| internal(format!("emitting {name}: {source}")))
}

/// The key of an op with its operands erased: equal keys and equal operands are the same
/// computation.
fn op_key(op: &Op) -> String {
    format!("{:?}", op.remap(|_| Handle::new(0), |w| w, |c| c))
}

/// Builds the block's e-graph, saturates it, extracts it and appends the result to `out`.
fn rewrite_block(
    module: &Module,
    block: &[(Value, &Instr)],
    roots: &[usize],
    plan: PlanKind,
    out: &mut Module,
    value_map: &mut [Option<Value>],
    fused_weights: &mut BTreeMap<Vec<u32>, Handle<Weight>>,
) -> Result<(), PassError> {
    let layer = block[0].1.layer;
    let mut egraph: EGraph<BlockLang, BlockAnalysis> = EGraph::default();
    let mut class_of: BTreeMap<usize, Id> = BTreeMap::new();
    // Op templates by key, and what outer value each `%N` leaf names.
    let mut templates: BTreeMap<Symbol, Op> = BTreeMap::new();
    let mut outer: BTreeMap<Symbol, Value> = BTreeMap::new();

    let weight_term = |egraph: &mut EGraph<BlockLang, BlockAnalysis>, w: Handle<Weight>| {
        let weight = &module.weights[w];
        let rows = weight.ty.shape.first().copied().unwrap_or(0) as u32;
        let rows = egraph.add(BlockLang::Num(rows));
        let dtype = egraph.add(BlockLang::Other(Symbol::from(weight.ty.dtype.name()), vec![]));
        let index = egraph.add(BlockLang::Num(w.index() as u32));
        egraph.add(BlockLang::Weight([rows, dtype, index]))
    };

    for &(handle, instr) in block {
        let mut operand_class = |v: Value, egraph: &mut EGraph<BlockLang, BlockAnalysis>| match class_of.get(&v.index())
        {
            Some(&id) => Ok(id),
            None => {
                let new = lookup(value_map, v)?;
                let name = Symbol::from(format!("%{}", new.index()));
                outer.insert(name, new);
                Ok::<Id, PassError>(egraph.add(BlockLang::Other(name, vec![])))
            }
        };
        let id = match &instr.op {
            Op::MatVec { x, weight, bias } => {
                let x = operand_class(*x, &mut egraph)?;
                let w = weight_term(&mut egraph, *weight);
                let b = match bias {
                    Some(b) => weight_term(&mut egraph, *b),
                    None => egraph.add(BlockLang::NoBias),
                };
                egraph.add(BlockLang::MatVec([w, b, x]))
            }
            Op::Slice { x, offset, len } => {
                let x = operand_class(*x, &mut egraph)?;
                let offset = egraph.add(BlockLang::Num(*offset));
                let len = egraph.add(BlockLang::Num(*len));
                egraph.add(BlockLang::Slice([offset, len, x]))
            }
            op => {
                let mut children = Vec::new();
                for v in op.operands() {
                    children.push(operand_class(v, &mut egraph)?);
                }
                let key = Symbol::from(op_key(op));
                templates.entry(key).or_insert_with(|| op.clone());
                egraph.add(BlockLang::Other(key, children))
            }
        };
        class_of.insert(handle.index(), id);
    }

    let root_classes: Vec<Id> = roots.iter().map(|r| class_of[r]).collect();
    let runner = Runner::default()
        .with_egraph(egraph)
        .with_node_limit(NODE_LIMIT)
        .with_iter_limit(ITER_LIMIT)
        .with_time_limit(std::time::Duration::MAX)
        .with_scheduler(SimpleScheduler)
        .run(&lang::rules());
    let egraph = runner.egraph;
    let choice = extract::extract(&egraph, &root_classes, plan);

    let mut emitter = Emitter {
        module,
        egraph: &egraph,
        choice: &choice.nodes,
        templates: &templates,
        outer: &outer,
        out,
        layer,
        emitted: BTreeMap::new(),
        fused_weights,
    };
    // In the block's order, each kept value where its first original instruction stood (its
    // operands first): a block whose extraction changes nothing comes out as it went in, and the
    // placer, which lays a layer out in program order, sees the order the frontend chose.
    for &(handle, _) in block {
        let class = egraph.find(class_of[&handle.index()]);
        if choice.nodes.contains_key(&class) {
            emitter.value(class)?;
        }
    }
    for (&root, &class) in roots.iter().zip(&root_classes) {
        value_map[root] = Some(emitter.value(class)?);
    }
    Ok(())
}

struct Emitter<'a> {
    module: &'a Module,
    egraph: &'a EGraph<BlockLang, BlockAnalysis>,
    choice: &'a BTreeMap<Id, BlockLang>,
    templates: &'a BTreeMap<Symbol, Op>,
    outer: &'a BTreeMap<Symbol, Value>,
    out: &'a mut Module,
    layer: Option<u32>,
    emitted: BTreeMap<Id, Value>,
    fused_weights: &'a mut BTreeMap<Vec<u32>, Handle<Weight>>,
}

impl Emitter<'_> {
    fn node(&self, class: Id) -> Result<&BlockLang, PassError> {
        let class = self.egraph.find(class);
        self.choice.get(&class).ok_or_else(|| internal(format!("e-class {class} has no extracted node")))
    }

    fn num(&self, class: Id) -> Result<u32, PassError> {
        match self.node(class)? {
            BlockLang::Num(n) => Ok(*n),
            other => Err(internal(format!("expected a number, found {other:?}"))),
        }
    }

    /// The value of `class`, emitting it (operands first) if it is not yet.
    fn value(&mut self, class: Id) -> Result<Value, PassError> {
        let class = self.egraph.find(class);
        if let Some(&v) = self.emitted.get(&class) {
            return Ok(v);
        }
        let node = self.node(class)?.clone();
        let op = match &node {
            BlockLang::MatVec([w, b, x]) => {
                let x = self.value(*x)?;
                let weight = self.weight(*w)?.ok_or_else(|| internal("a matvec without a weight".into()))?;
                let bias = self.weight(*b)?;
                Op::MatVec { x, weight, bias }
            }
            BlockLang::Slice([offset, len, x]) => {
                let (offset, len) = (self.num(*offset)?, self.num(*len)?);
                Op::Slice { x: self.value(*x)?, offset, len }
            }
            BlockLang::Other(name, args) if args.is_empty() => {
                let v = *self.outer.get(name).ok_or_else(|| internal(format!("unknown leaf {name}")))?;
                self.emitted.insert(class, v);
                return Ok(v);
            }
            BlockLang::Other(key, args) => {
                let template = self.templates.get(key).ok_or_else(|| internal(format!("unknown op {key}")))?.clone();
                let mut operands = Vec::with_capacity(args.len());
                for arg in args {
                    operands.push(self.value(*arg)?);
                }
                let next = Cell::new(0);
                template.remap(
                    |_| {
                        let i = next.get();
                        next.set(i + 1);
                        operands[i]
                    },
                    |w| w,
                    |c| c,
                )
            }
            other => return Err(internal(format!("{other:?} is not a value"))),
        };
        let v = push(self.out, op, self.layer)?;
        self.emitted.insert(class, v);
        Ok(v)
    }

    /// The module weight a weight term names (`None` for `nobias`), creating fused ones.
    fn weight(&mut self, class: Id) -> Result<Option<Handle<Weight>>, PassError> {
        match self.node(class)?.clone() {
            BlockLang::NoBias => Ok(None),
            BlockLang::Weight([_, _, index]) => Ok(Some(Handle::new(self.num(index)? as usize))),
            BlockLang::Cat(parts) => {
                let mut indices = Vec::with_capacity(parts.len());
                for part in parts.iter() {
                    match self.node(*part)? {
                        BlockLang::Weight([_, _, index]) => indices.push(self.num(*index)?),
                        other => return Err(internal(format!("a fused weight's part is {other:?}"))),
                    }
                }
                if let Some(&w) = self.fused_weights.get(&indices) {
                    return Ok(Some(w));
                }
                let fused = stacked_weight(self.module, &indices)?;
                let handle = self.out.weights.append(fused);
                self.fused_weights.insert(indices, handle);
                Ok(Some(handle))
            }
            other => Err(internal(format!("{other:?} is not a weight"))),
        }
    }
}

/// Weights `indices` stacked along their first axis: names joined by `+`, bytes end to end
/// (row-major storage of whole rows, so this is exact for every dtype), absent if any part is.
fn stacked_weight(module: &Module, indices: &[u32]) -> Result<Weight, PassError> {
    let parts: Vec<&Weight> = indices.iter().map(|&i| &module.weights[Handle::new(i as usize)]).collect();
    let first = parts[0];
    let rows: u64 = parts.iter().map(|w| w.ty.shape.first().copied().unwrap_or(0)).sum();
    let mut shape = first.ty.shape.clone();
    if let Some(r) = shape.first_mut() {
        *r = rows;
    }
    for part in &parts {
        if part.ty.dtype != first.ty.dtype || part.ty.shape.get(1..) != first.ty.shape.get(1..) {
            return Err(internal(format!(
                "cannot stack {} ({}) with {} ({})",
                part.name, part.ty, first.name, first.ty
            )));
        }
    }
    let name = parts.iter().map(|w| w.name.as_str()).collect::<Vec<_>>().join("+");
    let data = match parts.iter().map(|w| w.data.bytes()).collect::<Option<Vec<&[u8]>>>() {
        Some(bytes) => WeightBytes::owned(bytes.concat()),
        None => WeightBytes::Absent,
    };
    Ok(Weight { name, ty: TensorType::new(first.ty.dtype, shape), data })
}
