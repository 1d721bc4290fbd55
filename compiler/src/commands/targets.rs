//! `waferc targets [TARGET] [--json]`: the built-in targets (or one target spec), every parameter
//! with its source and assumptions marked.

use waferc_targets::Target;

#[derive(clap::Args, Debug)]
pub struct TargetsArgs {
    /// Describe only this target: a built-in name, grid:RxC, or a .toml target file.
    pub target: Option<String>,
    /// Print JSON (an array of targets) instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: TargetsArgs) -> anyhow::Result<()> {
    let targets = match &args.target {
        Some(spec) => vec![Target::resolve(spec)?],
        None => waferc_targets::list(),
    };
    if args.json {
        let list: Vec<_> = targets.iter().map(Target::to_json).collect();
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else {
        for (i, target) in targets.iter().enumerate() {
            if i > 0 {
                println!();
            }
            print!("{target}");
        }
        if args.target.is_none() {
            println!(
                "\nAlso: grid:RxC (R rows x C columns of WSE-3 PEs, for tests), or a path to a .toml target file."
            );
        }
    }
    Ok(())
}
