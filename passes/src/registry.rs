//! Every pass by name: what `--passes`, the snapshot suite's `; run:` lines and the CLI build
//! pipelines from. A new pass adds one [`PassInfo`] to [`PASSES`] and is then reachable from
//! all of them.

use waferc_ir::{verify, Module};

use crate::dce::Dce;
use crate::error::PassError;
use crate::interleave_experts::InterleaveExperts;
use crate::manager::Pass;
use crate::quantize::Quantize;
use crate::rewrite::{PlanKind, Rewrite};

/// Builds a pass from its arguments (the words after its name in a pipeline) and the plan kind
/// the module will be lowered with, when the caller knows it (`None`: a pipeline run on its own).
pub type BuildPass = fn(args: &[&str], plan: Option<PlanKind>) -> Result<Box<dyn Pass>, PassError>;

/// How to build one pass from its arguments.
pub struct PassInfo {
    pub name: &'static str,
    /// The pass with its arguments, as a pipeline spells it.
    pub usage: &'static str,
    pub summary: &'static str,
    pub build: BuildPass,
}

pub const PASSES: &[PassInfo] = &[
    PassInfo {
        name: "verify",
        usage: "verify",
        summary: "check the module (the pass manager also does after every pass)",
        build: |args, _| no_arguments("verify", "verify", args).map(|()| Box::new(Verify) as Box<dyn Pass>),
    },
    PassInfo {
        name: "rewrite",
        usage: REWRITE_USAGE,
        summary: "per decoder block, with egg: fuse matvecs reading one input (q/k/v, gate/up) where the wafer cost \
                  under the plan says so (the plan being lowered, or plan=KIND; stacked when none is known), merge \
                  duplicates, drop dead code",
        build: build_rewrite,
    },
    PassInfo {
        name: "dce",
        usage: "dce",
        summary: "remove instructions, weights and KV caches the output does not depend on",
        build: |args, _| no_arguments("dce", "dce", args).map(|()| Box::new(Dce) as Box<dyn Pass>),
    },
    PassInfo {
        name: "interleave-experts",
        usage: "interleave-experts",
        summary: "order each MoE block's experts stage by stage (every expert's gate/up before any expert's next \
                  step), so experts sharing PEs overlap one's compute with another's deliveries",
        build: |args, _| {
            no_arguments("interleave-experts", "interleave-experts", args)
                .map(|()| Box::new(InterleaveExperts) as Box<dyn Pass>)
        },
    },
    PassInfo {
        name: "quantize",
        usage: QUANTIZE_USAGE,
        summary:
            "quantise weights with ggml's reference rules; WHAT picks parts: layers, embedding, lm_head (joined by +) \
                  or all; a bare FORMAT is every matvec weight",
        build: build_quantize,
    },
];

fn no_arguments(pass: &'static str, usage: &'static str, args: &[&str]) -> Result<(), PassError> {
    match args {
        [] => Ok(()),
        _ => Err(PassError::BadArguments {
            pass,
            message: format!("takes no arguments, found `{}`", args.join(" ")),
            usage,
        }),
    }
}

const REWRITE_USAGE: &str = "rewrite [plan=tiled|stacked]";

/// `rewrite` costs its extraction for `plan=KIND` if given, else for the plan the caller lowers
/// with, else for the stacked plan (the one fusion is for).
fn build_rewrite(args: &[&str], plan: Option<PlanKind>) -> Result<Box<dyn Pass>, PassError> {
    let bad = |message: String| PassError::BadArguments { pass: "rewrite", message, usage: REWRITE_USAGE };
    let plan = match args {
        [] => plan.unwrap_or(PlanKind::Stacked),
        [arg] => match arg.strip_prefix("plan=") {
            Some(kind) => PlanKind::parse(kind)
                .ok_or_else(|| bad(format!("unknown plan kind `{kind}` in `{arg}` (kinds: tiled, stacked)")))?,
            None => return Err(bad(format!("unknown argument `{arg}`"))),
        },
        _ => return Err(bad(format!("takes at most one argument, found `{}`", args.join(" ")))),
    };
    Ok(Box::new(Rewrite { plan }))
}

const QUANTIZE_USAGE: &str =
    "quantize FORMAT[:WHAT]..., FORMAT one of q8_0 q4_0 q4_1, WHAT parts layers embedding lm_head joined by + or all";

fn build_quantize(args: &[&str], _plan: Option<PlanKind>) -> Result<Box<dyn Pass>, PassError> {
    Quantize::from_args(args).map(|pass| Box::new(pass) as Box<dyn Pass>).map_err(|message| PassError::BadArguments {
        pass: "quantize",
        message,
        usage: QUANTIZE_USAGE,
    })
}

/// The registered pass called `name`.
pub fn lookup(name: &str) -> Option<&'static PassInfo> {
    PASSES.iter().find(|p| p.name == name)
}

/// The pipeline `waferc compile` runs when `--passes` is not given: `rewrite` fuses matvecs
/// (fewer schedule steps and routes) and leaves the unfused weights behind, which `dce` removes;
/// `interleave-experts` orders an MoE block's experts stage by stage (a dense model is unchanged).
pub const DEFAULT_PIPELINE: &str = "rewrite, dce, interleave-experts";

/// Whether `spec` without the passes in `skip` does different things under the tiled and the
/// stacked plan: a driver that lowers under both then runs it once per kind.
pub fn depends_on_plan(spec: &str, skip: &[String]) -> Result<bool, PassError> {
    let costs = |kind| -> Result<Vec<Option<PlanKind>>, PassError> {
        Ok(without_passes(parse_pipeline_for(spec, Some(kind))?, skip)?.iter().map(|p| p.costed_for()).collect())
    };
    Ok(costs(PlanKind::Tiled)? != costs(PlanKind::Stacked)?)
}

/// `pipeline` without the passes named in `skip`; a name that is not in the pipeline is an
/// error naming the pipeline.
pub fn without_passes(pipeline: Vec<Box<dyn Pass>>, skip: &[String]) -> Result<Vec<Box<dyn Pass>>, PassError> {
    for name in skip {
        if !pipeline.iter().any(|p| p.name() == name) {
            return Err(PassError::NotInPipeline {
                name: name.clone(),
                pipeline: pipeline.iter().map(|p| p.name()).collect::<Vec<_>>().join(", "),
                option: "--skip-pass",
            });
        }
    }
    Ok(pipeline.into_iter().filter(|p| !skip.iter().any(|s| s == p.name())).collect())
}

/// Builds the pass `name` with `args`, for no known plan.
pub fn build(name: &str, args: &[&str]) -> Result<Box<dyn Pass>, PassError> {
    build_for(name, args, None)
}

/// Builds the pass `name` with `args`, for lowering under a plan of kind `plan`.
pub fn build_for(name: &str, args: &[&str], plan: Option<PlanKind>) -> Result<Box<dyn Pass>, PassError> {
    let info = lookup(name).ok_or_else(|| PassError::UnknownPass {
        name: name.to_string(),
        known: PASSES.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
    })?;
    (info.build)(args, plan)
}

/// Builds a pipeline from its spelling: passes separated by commas, each a name followed by
/// its arguments separated by spaces, e.g. `quantize q4_0:layers q8_0:embedding+lm_head, dce`.
/// No plan is known: a bare `rewrite` is costed for the stacked plan.
pub fn parse_pipeline(spec: &str) -> Result<Vec<Box<dyn Pass>>, PassError> {
    parse_pipeline_for(spec, None)
}

/// [`parse_pipeline`] for a module that will be lowered under a plan of kind `plan`: a bare
/// `rewrite` is costed for it.
pub fn parse_pipeline_for(spec: &str, plan: Option<PlanKind>) -> Result<Vec<Box<dyn Pass>>, PassError> {
    if spec.trim().is_empty() {
        return Ok(Vec::new());
    }
    spec.split(',')
        .map(|step| {
            let words: Vec<&str> = step.split_whitespace().collect();
            match words.split_first() {
                Some((name, args)) => build_for(name, args, plan),
                None => Err(PassError::BadPipeline {
                    spec: spec.to_string(),
                    message: "an empty step between commas".into(),
                }),
            }
        })
        .collect()
}

/// Checks the module and changes nothing: a pipeline of just `verify` checks a file. (The pass
/// manager verifies its input anyway; this pass makes the same check usable on its own.)
struct Verify;

impl Pass for Verify {
    fn name(&self) -> &'static str {
        "verify"
    }

    fn run(&self, module: &mut Module) -> Result<(), PassError> {
        verify(module).map_err(PassError::InvalidInput)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(spec: &str) -> Result<Vec<&'static str>, String> {
        parse_pipeline(spec).map(|p| p.iter().map(|pass| pass.name()).collect()).map_err(|e| e.to_string())
    }

    #[test]
    fn pipelines_parse_from_their_spelling() {
        assert_eq!(names("quantize q8_0, dce"), Ok(vec!["quantize", "dce"]));
        assert_eq!(
            names(" quantize   q4_0:layers q8_0:embedding+lm_head ,dce,verify "),
            Ok(vec!["quantize", "dce", "verify"])
        );
        assert_eq!(names(""), Ok(vec![]));
    }

    #[test]
    fn bad_pipelines_say_what_is_wrong() {
        assert_eq!(
            names("dce, fold"),
            Err("unknown pass `fold` (known passes: verify, rewrite, dce, interleave-experts, quantize)".into())
        );
        assert_eq!(names("dce,,dce"), Err("bad pass pipeline `dce,,dce`: an empty step between commas".into()));
        assert_eq!(names("dce now"), Err("pass `dce`: takes no arguments, found `now` (usage: dce)".into()));
        let usage = format!("(usage: {QUANTIZE_USAGE})");
        assert_eq!(names("quantize"), Err(format!("pass `quantize`: needs a format {usage}")));
        assert_eq!(names("quantize q2_k"), Err(format!("pass `quantize`: unknown format `q2_k` {usage}")));
        assert_eq!(names("quantize q8_0 lm_head"), Err(format!("pass `quantize`: unknown format `lm_head` {usage}")));
        assert_eq!(
            names("quantize q8_0:head"),
            Err(format!(
                "pass `quantize`: unknown part `head` in `q8_0:head` (parts: layers, embedding, lm_head, all) {usage}"
            ))
        );
        assert_eq!(
            names("quantize q4_0 q8_0:lm_head"),
            Err(format!("pass `quantize`: `q8_0:lm_head` chooses a format for lm_head a second time {usage}"))
        );
    }

    #[test]
    fn quantize_arguments_choose_a_format_per_part() {
        use crate::quantize::QuantFormat::{Q4_0, Q4_1, Q8_0};
        let parse = |args: &[&str]| Quantize::from_args(args).unwrap();
        assert_eq!(parse(&["q4_1"]), Quantize::matvecs(Q4_1));
        assert_eq!(parse(&["q8_0:all"]), Quantize::all(Q8_0));
        assert_eq!(
            parse(&["q4_0:layers", "q8_0:embedding+lm_head"]),
            Quantize { layers: Some(Q4_0), embedding: Some(Q8_0), lm_head: Some(Q8_0), keep_shared: false }
        );
        assert_eq!(
            parse(&["q8_0:lm_head"]),
            Quantize { layers: None, embedding: None, lm_head: Some(Q8_0), keep_shared: false }
        );
    }

    #[test]
    fn registered_names_match_the_passes_they_build() {
        for info in PASSES {
            let args: &[&str] = if info.name == "quantize" { &["q8_0"] } else { &[] };
            assert_eq!((info.build)(args, None).unwrap().name(), info.name);
        }
    }

    #[test]
    fn rewrite_is_costed_for_the_plan_given_or_known() {
        let costed = |spec: &str, plan| parse_pipeline_for(spec, plan).unwrap()[0].costed_for();
        assert_eq!(costed("rewrite", None), Some(PlanKind::Stacked));
        assert_eq!(costed("rewrite", Some(PlanKind::Tiled)), Some(PlanKind::Tiled));
        assert_eq!(costed("rewrite plan=tiled", None), Some(PlanKind::Tiled));
        assert_eq!(costed("rewrite plan=stacked", Some(PlanKind::Tiled)), Some(PlanKind::Stacked));
        assert_eq!(costed("dce", Some(PlanKind::Tiled)), None);
        assert!(depends_on_plan("rewrite, dce", &[]).unwrap());
        assert!(!depends_on_plan("rewrite, dce", &["rewrite".into()]).unwrap());
        assert!(!depends_on_plan("rewrite plan=tiled, dce", &[]).unwrap());
        assert!(!depends_on_plan("quantize q8_0, dce", &[]).unwrap());
        let usage = format!("(usage: {REWRITE_USAGE})");
        assert_eq!(
            names("rewrite plan=mesh"),
            Err(format!("pass `rewrite`: unknown plan kind `mesh` in `plan=mesh` (kinds: tiled, stacked) {usage}"))
        );
        assert_eq!(names("rewrite tiled"), Err(format!("pass `rewrite`: unknown argument `tiled` {usage}")));
        assert_eq!(
            names("rewrite plan=tiled plan=stacked"),
            Err(format!("pass `rewrite`: takes at most one argument, found `plan=tiled plan=stacked` {usage}"))
        );
    }
}
