//! How far a corpus gets: runs each input through a target's entry and counts the outcomes (`OK`
//! or the first 90 characters of the error), most common first. A corpus stuck on one early
//! error shows the target needs a better seed or structure.
//!
//! `cargo run --release -p waferc-fuzz-entry --example outcomes -- checkpoint_dir fuzz/corpus/checkpoint_dir/*`

fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().expect("usage: outcomes TARGET INPUT...");
    let target = waferc_fuzz_entry::TARGETS.iter().find(|t| t.name == name).expect("a target name");
    let mut counts = std::collections::BTreeMap::new();
    for path in args {
        let data = std::fs::read(&path).expect("read an input");
        let outcome = match (target.entry)(&data) {
            Ok(()) => "OK".to_string(),
            Err(e) => e.chars().take(90).collect(),
        };
        *counts.entry(outcome).or_insert(0u32) += 1;
    }
    let mut counts: Vec<(String, u32)> = counts.into_iter().collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    for (outcome, n) in counts {
        println!("{n:6} {outcome}");
    }
}
