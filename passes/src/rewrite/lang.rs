//! The e-graph language of one decoder block, its analysis and the rewrite rules.
//!
//! Terms:
//! - `(w ROWS DTYPE INDEX)`: weight `INDEX` of the module, `ROWS` output rows, stored as `DTYPE`;
//! - `(cat W...)`: weights stacked along the output axis (a fused matvec's weight or bias);
//! - `(matvec W B X)`: `W x (+ B)`, `B` a weight term or `nobias`;
//! - `(slice OFFSET LEN X)`: elements `OFFSET..OFFSET + LEN` of `X` (IR `slice`);
//! - `(KEY ARGS...)` for every other op: `KEY` names the op with its attributes, weights and
//!   cache (so equal keys with equal operands are the same computation), `%N` for a value
//!   defined outside the block.
//!
//! Every rule keeps every bit (NUMERICS.md): a fused matvec computes each output row from the
//! same weight row and the same `x` with the same chunk tree, and a slice copies elements.

use egg::{define_language, Analysis, Applier, DidMerge, EGraph, Id, PatternAst, Rewrite, Subst, Symbol};

define_language! {
    pub enum BlockLang {
        Num(u32),
        "nobias" = NoBias,
        "w" = Weight([Id; 3]),
        "cat" = Cat(Box<[Id]>),
        "matvec" = MatVec([Id; 3]),
        "slice" = Slice([Id; 3]),
        Other(Symbol, Vec<Id>),
    }
}

/// What the analysis knows of an e-class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Facts {
    Num(u32),
    /// A weight term: its leaves (`w` classes, in row order), total rows, storage type.
    Weights {
        leaves: Vec<Id>,
        indices: Vec<u32>,
        rows: u32,
        dtype: Symbol,
    },
    NoBias,
    /// A value (vector or routing); the length when the term says it (matvec, slice).
    Value {
        len: Option<u32>,
    },
}

/// Computes [`Facts`]; no module data is needed, so tests build e-graphs from text alone.
#[derive(Default)]
pub struct BlockAnalysis;

fn num(egraph: &EGraph<BlockLang, BlockAnalysis>, id: Id) -> Option<u32> {
    match egraph[id].data {
        Facts::Num(n) => Some(n),
        _ => None,
    }
}

impl Analysis<BlockLang> for BlockAnalysis {
    type Data = Facts;

    fn make(egraph: &mut EGraph<BlockLang, Self>, enode: &BlockLang) -> Facts {
        match enode {
            BlockLang::Num(n) => Facts::Num(*n),
            BlockLang::NoBias => Facts::NoBias,
            BlockLang::Weight([rows, dtype, index]) => {
                let dtype = match egraph[*dtype].nodes.first() {
                    Some(BlockLang::Other(s, args)) if args.is_empty() => *s,
                    _ => Symbol::from("?"),
                };
                let id = egraph.lookup(enode.clone()).unwrap_or_else(|| Id::from(usize::MAX));
                Facts::Weights {
                    leaves: vec![id],
                    indices: vec![num(egraph, *index).unwrap_or(u32::MAX)],
                    rows: num(egraph, *rows).unwrap_or(0),
                    dtype,
                }
            }
            BlockLang::Cat(parts) => {
                let (mut leaves, mut indices, mut rows, mut dtype) = (Vec::new(), Vec::new(), 0u32, None);
                for part in parts.iter() {
                    if let Facts::Weights { leaves: l, indices: i, rows: r, dtype: d } = &egraph[*part].data {
                        leaves.extend(l.iter().copied());
                        indices.extend(i.iter().copied());
                        rows = rows.saturating_add(*r);
                        dtype = Some(*d);
                    }
                }
                Facts::Weights { leaves, indices, rows, dtype: dtype.unwrap_or_else(|| Symbol::from("?")) }
            }
            BlockLang::MatVec([w, _, _]) => match &egraph[*w].data {
                Facts::Weights { rows, .. } => Facts::Value { len: Some(*rows) },
                _ => Facts::Value { len: None },
            },
            BlockLang::Slice([_, len, _]) => Facts::Value { len: num(egraph, *len) },
            BlockLang::Other(..) => Facts::Value { len: None },
        }
    }

    fn merge(&mut self, a: &mut Facts, b: Facts) -> DidMerge {
        // Equal classes have equal facts, except that a value's length may be known from one
        // side only (an opaque op's class unioned with a slice of a fused matvec).
        match (&mut *a, b) {
            (Facts::Value { len: la @ None }, Facts::Value { len: Some(n) }) => {
                *la = Some(n);
                DidMerge(true, false)
            }
            _ => DidMerge(false, true),
        }
    }

    fn modify(egraph: &mut EGraph<BlockLang, Self>, id: Id) {
        // A leaf weight's own class is only known once it is added: record it.
        if let Facts::Weights { leaves, .. } = &egraph[id].data {
            if leaves.len() == 1 && leaves[0] == Id::from(usize::MAX) {
                if let Facts::Weights { leaves, .. } = &mut egraph[id].data {
                    leaves[0] = id;
                }
            }
        }
    }
}

/// The rules of the `rewrite` pass. Duplicate subexpressions need no rule (the e-graph's
/// hash-consing merges them) and dead ones none either (extraction starts from the block's
/// live outputs).
pub fn rules() -> Vec<Rewrite<BlockLang, BlockAnalysis>> {
    vec![
        Rewrite::new(
            "fuse-matvecs",
            "?a = (matvec ?w1 ?b1 ?x), ?c = (matvec ?w2 ?b2 ?x)"
                .parse::<egg::MultiPattern<BlockLang>>()
                .expect("pattern"),
            FuseMatVecs,
        )
        .expect("rule"),
        Rewrite::new(
            "slice-of-slice",
            "(slice ?o1 ?n1 (slice ?o2 ?n2 ?x))".parse::<egg::Pattern<BlockLang>>().expect("pattern"),
            SliceOfSlice,
        )
        .expect("rule"),
    ]
}

fn var(name: &str) -> egg::Var {
    name.parse().expect("variable")
}

/// `(matvec W1 B1 x)` and `(matvec W2 B2 x)` become slices of `(matvec (cat W1 W2) (cat B1 B2) x)`
/// when both weights have one storage type, both or neither have a bias, and every weight of
/// `W1` comes before every weight of `W2` in the module (so q/k/v fuse as q|k|v, in one order).
struct FuseMatVecs;

impl Applier<BlockLang, BlockAnalysis> for FuseMatVecs {
    fn apply_one(
        &self,
        egraph: &mut EGraph<BlockLang, BlockAnalysis>,
        _eclass: Id,
        subst: &Subst,
        _ast: Option<&PatternAst<BlockLang>>,
        _rule: Symbol,
    ) -> Vec<Id> {
        let get = |name: &str| subst[var(name)];
        let (a, c, x) = (get("?a"), get("?c"), get("?x"));
        let weights = |id: Id| match &egraph[id].data {
            Facts::Weights { leaves, indices, rows, dtype } => Some((leaves.clone(), indices.clone(), *rows, *dtype)),
            _ => None,
        };
        let (Some((l1, i1, rows1, d1)), Some((l2, i2, rows2, d2))) = (weights(get("?w1")), weights(get("?w2"))) else {
            return vec![];
        };
        let (Some(&last1), Some(&first2)) = (i1.last(), i2.first()) else { return vec![] };
        if d1 != d2 || last1 >= first2 {
            return vec![];
        }
        let bias = match (weights(get("?b1")), weights(get("?b2"))) {
            (None, None) => egraph.add(BlockLang::NoBias),
            (Some((b1, _, _, bd1)), Some((b2, _, _, bd2))) if bd1 == bd2 => {
                egraph.add(BlockLang::Cat(b1.into_iter().chain(b2).collect()))
            }
            _ => return vec![],
        };
        let weight = egraph.add(BlockLang::Cat(l1.into_iter().chain(l2).collect()));
        let fused = egraph.add(BlockLang::MatVec([weight, bias, x]));
        let zero = egraph.add(BlockLang::Num(0));
        let (n1, n2) = (egraph.add(BlockLang::Num(rows1)), egraph.add(BlockLang::Num(rows2)));
        let first = egraph.add(BlockLang::Slice([zero, n1, fused]));
        let second = egraph.add(BlockLang::Slice([n1, n2, fused]));
        let mut changed = Vec::new();
        if egraph.union(a, first) {
            changed.push(a);
        }
        if egraph.union(c, second) {
            changed.push(c);
        }
        changed
    }
}

/// `(slice o1 n1 (slice o2 n2 x))` is `(slice o1+o2 n1 x)`.
struct SliceOfSlice;

impl Applier<BlockLang, BlockAnalysis> for SliceOfSlice {
    fn apply_one(
        &self,
        egraph: &mut EGraph<BlockLang, BlockAnalysis>,
        eclass: Id,
        subst: &Subst,
        _ast: Option<&PatternAst<BlockLang>>,
        _rule: Symbol,
    ) -> Vec<Id> {
        let (Some(o1), Some(o2)) = (num(egraph, subst[var("?o1")]), num(egraph, subst[var("?o2")])) else {
            return vec![];
        };
        let Some(offset) = o1.checked_add(o2) else { return vec![] };
        let offset = egraph.add(BlockLang::Num(offset));
        let slice = egraph.add(BlockLang::Slice([offset, subst[var("?n1")], subst[var("?x")]]));
        if egraph.union(eclass, slice) {
            vec![eclass]
        } else {
            vec![]
        }
    }
}
