//! One-line tests of the `rewrite` pass's extraction under each plan kind, in the style of egg's
//! `test_fn!`: saturate the start term with the pass's rules, extract it costed for the plan, and
//! check the goal pattern against the extracted term. The input `(norm (add r o))` stands for a
//! decoder block's normed residual: its cost is shared by every matvec reading it, which is
//! what once tempted the tiled extraction into fusing.

use egg::{EGraph, Language, Pattern, RecExpr, Runner, Searcher};
use waferc_passes::rewrite::extract::extract;
use waferc_passes::rewrite::lang::{rules, BlockAnalysis, BlockLang};
use waferc_passes::PlanKind::{self, Stacked, Tiled};

/// The term `start` becomes after saturation and extraction costed for `plan`.
fn extracted(start: &str, plan: PlanKind) -> RecExpr<BlockLang> {
    let start: RecExpr<BlockLang> = start.parse().expect("start term");
    let runner = Runner::<BlockLang, BlockAnalysis>::default().with_expr(&start).run(&rules());
    let (egraph, root) = (&runner.egraph, runner.roots[0]);
    let choice = extract(egraph, &[root], plan);
    choice.nodes[&egraph.find(root)].build_recexpr(|id| choice.nodes[&egraph.find(id)].clone())
}

/// Whether `goal` matches the root of `term`.
fn matches(term: &RecExpr<BlockLang>, goal: &str) -> bool {
    let mut egraph: EGraph<BlockLang, BlockAnalysis> = EGraph::default();
    let root = egraph.add_expr(term);
    egraph.rebuild();
    let goal: Pattern<BlockLang> = goal.parse().expect("goal pattern");
    goal.search_eclass(&egraph, root).is_some()
}

macro_rules! extraction_test {
    ($name:ident, $plan:expr, $start:expr => $goal:literal) => {
        #[test]
        fn $name() {
            let term = extracted($start, $plan);
            assert!(matches(&term, $goal), "extracted {term} under {:?}, which does not match {}", $plan, $goal);
        }
    };
}

/// q/k/v of a block: q and k through rope, v straight into the attention.
const QKV: &str = "(attention (rope (matvec (w 576 f32 0) nobias (norm (add r o)))) \
                              (rope (matvec (w 192 f32 1) nobias (norm (add r o)))) \
                                    (matvec (w 192 f32 2) nobias (norm (add r o))))";

/// A SwiGLU MLP's gate and up projections.
const GATE_UP: &str = "(mul (silu (matvec (w 1536 f32 0) nobias (norm (add r o)))) \
                                  (matvec (w 1536 f32 1) nobias (norm (add r o))))";

extraction_test! {
    fuses_q_k_v_for_the_stacked_plan, Stacked,
    QKV => "(attention (rope (slice 0 576 ?f)) (rope (slice 576 192 ?f)) (slice 768 192 ?f))"
}

extraction_test! {
    declines_q_k_v_for_the_tiled_plan, Tiled,
    QKV => "(attention (rope (matvec (w 576 f32 0) nobias ?x)) (rope (matvec (w 192 f32 1) nobias ?x)) (matvec (w 192 f32 2) nobias ?x))"
}

extraction_test! {
    fuses_gate_up_for_the_stacked_plan, Stacked,
    GATE_UP => "(mul (silu (slice 0 1536 ?f)) (slice 1536 1536 ?f))"
}

extraction_test! {
    declines_gate_up_for_the_tiled_plan, Tiled,
    GATE_UP => "(mul (silu (matvec (w 1536 f32 0) nobias ?x)) (matvec (w 1536 f32 1) nobias ?x))"
}
