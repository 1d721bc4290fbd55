//! The `waferc` binary end to end: every fixture compiled and run validated, determinism of
//! artifacts across thread counts, the trace and IR dump files, and clean failures on bad input.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn waferc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_waferc")).args(args).output().expect("waferc runs")
}

fn waferc_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_waferc"));
    command.args(args);
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("waferc runs")
}

fn ok(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "waferc failed ({}):\n{stderr}", output.status);
    String::from_utf8(output.stdout.clone()).expect("utf-8 stdout")
}

/// A failed run: exit code 1 (an error, not a panic's 101) and the stderr text.
fn fails(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(1), "expected a clean error, got {}:\n{stderr}", output.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// `waferc compile MODEL --target TARGET -o OUT EXTRA...`
fn compile(model: &Path, target: &str, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["compile", model.to_str().unwrap(), "--target", target, "-o", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    waferc(&args)
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testsuite/fixtures/hf").join(name)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("waferc-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn golden_prompt(name: &str) -> String {
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("golden.json")).unwrap()).unwrap();
    let ids: Vec<String> = golden["prompts"][1]["prompt"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
    ids.join(",")
}

const FIXTURES: [&str; 7] = [
    "llama-tiny-tok",
    "llama31-gqa-bf16",
    "mixtral-sharded-bf16",
    "mixtral-tiny",
    "qwen2-bias",
    "qwen3-dense",
    "qwen3-moe-tiny",
];

#[test]
fn every_fixture_compiles_and_runs_bit_exact() {
    let dir = scratch("fixtures");
    for name in FIXTURES {
        let artifact = dir.join(format!("{name}.wafer"));
        let model = fixture(name);
        ok(&compile(&model, "grid:64x64", &artifact, &["--max-context", "64"]));
        let prompt = golden_prompt(name);
        let out = ok(&waferc(&[
            "run",
            artifact.to_str().unwrap(),
            "--tokens",
            &prompt,
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--validate",
            "--json",
        ]));
        let report: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(report["bit_exact"], true, "{name}");
        assert_eq!(report["tokens"].as_array().unwrap().len(), 12, "{name}");
        // The executor's tokens are the reference decoder's, which are transformers' here.
        let reference = ok(&waferc(&[
            "reference",
            model.to_str().unwrap(),
            "--tokens",
            &prompt,
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--json",
        ]));
        let reference: Value = serde_json::from_str(&reference).unwrap();
        assert_eq!(report["tokens"], reference["tokens"], "{name}");
        assert!(report["modeled_decode_tok_s"].as_f64().unwrap() > 0.0);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn artifacts_are_byte_identical_across_runs_and_thread_counts() {
    let dir = scratch("determinism");
    let model = fixture("qwen3-moe-tiny");
    let mut artifacts = Vec::new();
    for threads in ["1", "2", "2"] {
        let path = dir.join(format!("t{threads}-{}.wafer", artifacts.len()));
        ok(&waferc_env(
            &[
                "compile",
                model.to_str().unwrap(),
                "--target",
                "grid:64x64",
                "--max-context",
                "256",
                "-o",
                path.to_str().unwrap(),
            ],
            &[("RAYON_NUM_THREADS", threads)],
        ));
        artifacts.push(std::fs::read(&path).unwrap());
    }
    assert!(artifacts.windows(2).all(|w| w[0] == w[1]), "artifacts differ between runs or thread counts");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn trace_is_chrome_trace_events_with_every_layer() {
    let dir = scratch("trace");
    let artifact = dir.join("m.wafer");
    let trace = dir.join("trace.json");
    let model = fixture("llama31-gqa-bf16");
    ok(&compile(&model, "grid:48x48", &artifact, &[]));
    ok(&waferc(&[
        "run",
        artifact.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--max-new-tokens",
        "2",
        "--trace",
        trace.to_str().unwrap(),
    ]));
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().expect("a traceEvents array");
    let mut layer_tracks = std::collections::BTreeMap::new();
    for e in events.iter().filter(|e| e["ph"] == "M" && e["name"] == "thread_name") {
        layer_tracks.insert(e["tid"].as_u64().unwrap(), e["args"]["name"].as_str().unwrap().to_string());
    }
    for layer in 0..3 {
        let name = format!("layer {layer}");
        let (&tid, _) = layer_tracks.iter().find(|(_, n)| **n == name).unwrap_or_else(|| panic!("no track {name}"));
        let spans: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X" && e["tid"] == tid).collect();
        assert!(spans.iter().any(|e| e["cat"] == "compute"), "{name} has no compute span");
        assert!(spans.iter().any(|e| e["cat"] == "collective"), "{name} has no collective span");
        for span in spans {
            assert!(span["ts"].as_f64().unwrap() >= 0.0 && span["dur"].as_f64().unwrap() >= 0.0);
            assert!(span["name"].as_str().unwrap().contains('%'));
        }
    }
    // Five positions (three prompt tokens, two generated, the last not fed back: four steps).
    let tokens: Vec<&Value> = events.iter().filter(|e| e["cat"] == "token").collect();
    assert_eq!(tokens.len(), 4);
    // Each token's critical path by layer adds up to its cycles; each slice says what waited.
    for token in tokens {
        let path = token["args"]["critical_path"].as_array().expect("a critical path");
        let sum: u64 = path.iter().map(|l| l["cycles"].as_u64().unwrap()).sum();
        assert_eq!(sum, token["args"]["cycles"].as_u64().unwrap());
    }
    for span in events.iter().filter(|e| e["cat"] == "compute" || e["cat"] == "collective") {
        assert!(span["args"]["wait_cycles"].is_u64(), "{span}");
    }
    // Each wait names the instruction whose message held the link it waited for.
    let waits: Vec<&Value> = events.iter().filter(|e| e["cat"] == "wait").collect();
    assert!(!waits.is_empty(), "this grid's reductions queue on shared links");
    for wait in waits {
        assert!(wait["args"]["held_by"].is_u64(), "{wait}");
    }

    // `run --json`: the critical path by layer, the costliest steps, the prefill estimates.
    let json =
        ok(&waferc(&["run", artifact.to_str().unwrap(), "--tokens", "1,2,3", "--max-new-tokens", "1", "--json"]));
    let json: Value = serde_json::from_str(&json).unwrap();
    let layers = json["layers"].as_array().expect("layers");
    assert!(layers.iter().filter(|l| l["layer"].is_u64()).count() == 3, "{layers:?}");
    for layer in layers {
        let part = |key: &str| layer[key].as_u64().unwrap();
        assert_eq!(part("cycles"), part("compute_cycles") + part("comm_cycles") + part("wait_cycles"));
    }
    assert!(json["mean_layer"]["cycles"].as_u64().unwrap() > 0);
    let steps = json["costliest_steps"].as_array().expect("costliest_steps");
    assert_eq!(steps.len(), 10);
    assert!(json["modeled_ttft_prefill_us"].as_f64().unwrap() > 0.0);
    let prefill = json["prefill"].as_array().expect("prefill");
    assert_eq!(prefill.iter().map(|p| p["prompt_tokens"].as_u64().unwrap()).collect::<Vec<_>>(), [1024, 8192]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dumped_ir_files_parse_back_to_the_same_text() {
    let dir = scratch("dump");
    let dump = dir.join("ir");
    let model = fixture("mixtral-tiny");
    ok(&compile(
        &model,
        "grid:32x32",
        &dir.join("m.wafer"),
        &["--passes", "quantize q8_0, dce", "--dump-ir", dump.to_str().unwrap()],
    ));
    let mut files: Vec<_> =
        std::fs::read_dir(&dump).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(files, ["00-frontend.ir", "01-quantize.ir", "02-dce.ir"]);
    for file in files {
        let text = std::fs::read_to_string(dump.join(&file)).unwrap();
        let module = waferc_ir::text::parse(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(waferc_ir::text::print(&module), text, "{file} does not round-trip");
    }
    assert!(std::fs::read_to_string(dump.join("01-quantize.ir")).unwrap().contains("q8_0["));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--plan auto` (the default) lists every candidate with its modeled rate, chooses the fastest
/// and says why each other one lost; `--plan` pins one and lists none.
#[test]
fn plan_search_lists_candidates_and_pinning_skips_it() {
    let dir = scratch("plan-search");
    let model = fixture("llama31-gqa-bf16");
    let json: Value =
        serde_json::from_str(&ok(&compile(&model, "grid:64x48", &dir.join("a.wafer"), &["--json"]))).unwrap();
    let candidates = json["plan_search"].as_array().expect("plan_search lists the candidates");
    assert!(candidates.len() >= 4, "{candidates:?}");
    let chosen: Vec<&Value> = candidates.iter().filter(|c| c["chosen"] == true).collect();
    assert_eq!(chosen.len(), 1, "{candidates:?}");
    assert_eq!(chosen[0]["plan"], json["plan"]);
    let best = chosen[0]["cycles_per_token"].as_u64().unwrap();
    for c in candidates.iter().filter(|c| c["chosen"] == false) {
        let why = c["lost_because"].as_str().unwrap_or_else(|| panic!("no reason for {c}"));
        if let Some(cycles) = c["cycles_per_token"].as_u64() {
            assert!(cycles >= best && why.starts_with("slower"), "{c}");
        }
    }
    let stacked = candidates.iter().find(|c| c["plan"] == "stacked:1").expect("stacked:1 is a candidate");
    assert!(stacked["cycles_per_token"].as_u64().is_some(), "stacked:1 lowers on a fixture: {stacked}");
    // At position 0 a KV block holds one position: spreading blocks over PEs is not tried.
    let spread = candidates.iter().find(|c| c["plan"].as_str().unwrap().contains(",spread"));
    assert!(spread.is_none(), "{spread:?}");

    let pinned = compile(&model, "grid:64x48", &dir.join("p.wafer"), &["--json", "--plan", "stacked:1,50"]);
    let pinned: Value = serde_json::from_str(&ok(&pinned)).unwrap();
    assert_eq!(pinned["plan"], "stacked:1,50");
    assert_eq!(pinned["plan_search"].as_array().map(Vec::len), Some(0));
    let bad = fails(&compile(&model, "grid:64x48", &dir.join("b.wafer"), &["--plan", "stacked:1,0"]));
    assert!(bad.contains("percentage"), "{bad}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn print_after_and_time_passes() {
    let dir = scratch("print-after");
    let model = fixture("qwen2-bias");
    let out = compile(
        &model,
        "grid:32x32",
        &dir.join("m.wafer"),
        &["--passes", "dce", "--print-after", "dce", "--time-passes"],
    );
    let stdout = ok(&out);
    assert!(stdout.contains("matvec"), "no IR printed:\n{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for stage in ["frontend", "dce", "plan-search", "write-artifact", "total"] {
        assert!(stderr.contains(stage), "--time-passes lacks {stage}:\n{stderr}");
    }
    let pinned = compile(&model, "grid:32x32", &dir.join("m.wafer"), &["--plan", "tiled", "--time-passes"]);
    ok(&pinned);
    let stderr = String::from_utf8_lossy(&pinned.stderr);
    for stage in ["wafer-lowering", "check"] {
        assert!(stderr.contains(stage), "--time-passes with a pinned plan lacks {stage}:\n{stderr}");
    }
    let unknown = fails(&compile(&model, "grid:32x32", &dir.join("m.wafer"), &["--print-after", "tiling-typo"]));
    assert!(unknown.contains("tiling-typo"), "{unknown}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_inputs_give_clean_errors_and_no_output_file() {
    let dir = scratch("bad");
    let out = dir.join("m.wafer");
    let missing = fails(&compile(Path::new("/nonexistent/model"), "wse3", &out, &[]));
    assert!(missing.contains("/nonexistent/model"), "{missing}");
    let target = fails(&compile(&fixture("mixtral-tiny"), "wse9", &out, &[]));
    assert!(target.contains("wse9"), "{target}");
    let too_small = fails(&compile(&fixture("mixtral-tiny"), "grid:4x4", &out, &[]));
    assert!(too_small.contains("does not fit") && too_small.contains("short by"), "{too_small}");
    assert!(!out.exists(), "a failed compile left {}", out.display());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "a failed compile left a temporary file");

    // Artifacts: foreign, truncated, corrupted.
    let good = dir.join("good.wafer");
    ok(&compile(&fixture("qwen3-dense"), "grid:32x32", &good, &[]));
    let bytes = std::fs::read(&good).unwrap();
    let cases: [(&str, Vec<u8>, &str); 3] = [
        ("foreign", b"not an artifact at all".to_vec(), "not a waferc artifact"),
        ("truncated", bytes[..bytes.len() / 2].to_vec(), "truncated"),
        (
            "corrupt",
            {
                let mut b = bytes.clone();
                let i = b.len() - 100;
                b[i] ^= 0x40;
                b
            },
            "checksum",
        ),
    ];
    for (name, content, expected) in cases {
        let path = dir.join(format!("{name}.wafer"));
        std::fs::write(&path, content).unwrap();
        let error = fails(&waferc(&["run", path.to_str().unwrap(), "--tokens", "1"]));
        assert!(error.contains(expected) && error.contains(&*path.to_string_lossy()), "{name}: {error}");
        let error = fails(&waferc(&["inspect", path.to_str().unwrap()]));
        assert!(error.contains(expected), "{name}: {error}");
    }
    let bad_token = fails(&waferc(&["run", good.to_str().unwrap(), "--tokens", "99999"]));
    assert!(bad_token.contains("99999") && bad_token.contains("vocabulary"), "{bad_token}");
    let no_tokenizer = fails(&waferc(&["run", good.to_str().unwrap(), "--prompt", "hello"]));
    assert!(no_tokenizer.contains("tokenizer"), "{no_tokenizer}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn prompts_as_text_use_the_tokenizer_stored_in_the_artifact() {
    let dir = scratch("text");
    let artifact = dir.join("m.wafer");
    let model = fixture("llama-tiny-tok");
    ok(&compile(&model, "grid:64x64", &artifact, &["--max-context", "32"]));
    let wafer: Value = serde_json::from_str(&ok(&waferc(&[
        "run",
        artifact.to_str().unwrap(),
        "--prompt",
        "The wafer",
        "--max-new-tokens",
        "4",
        "--validate",
        "--json",
    ])))
    .unwrap();
    let reference: Value = serde_json::from_str(&ok(&waferc(&[
        "reference",
        model.to_str().unwrap(),
        "--prompt",
        "The wafer",
        "--max-new-tokens",
        "4",
        "--json",
    ])))
    .unwrap();
    assert_eq!(wafer["tokens"], reference["tokens"]);
    assert_eq!(wafer["text"], reference["text"]);
    assert!(wafer["text"].as_str().is_some_and(|t| !t.is_empty()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn reference_logits_file_holds_every_step() {
    let dir = scratch("logits");
    let file = dir.join("logits.safetensors");
    ok(&waferc(&[
        "reference",
        fixture("qwen3-dense").to_str().unwrap(),
        "--tokens",
        "5,6,7",
        "--force-tokens",
        "10,11,12,13",
        "--logits",
        file.to_str().unwrap(),
    ]));
    let bytes = std::fs::read(&file).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits = tensors.tensor("logits").unwrap();
    assert_eq!(logits.shape(), [4, 512]);
    assert_eq!(logits.dtype(), safetensors::Dtype::F32);
    let tokens = tensors.tensor("tokens").unwrap();
    assert_eq!(tokens.dtype(), safetensors::Dtype::I64);
    let ids: Vec<i64> = tokens.data().chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(ids, [10, 11, 12, 13]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn demo_runs_validated() {
    let out = ok(&waferc(&["demo"]));
    assert!(out.contains("bit-identical to the reference decoder"), "{out}");
    assert!(out.contains("tokens/s decode"), "{out}");
}

#[test]
fn inspect_svg_and_json_write_files() {
    let dir = scratch("inspect");
    let artifact = dir.join("m.wafer");
    ok(&compile(&fixture("mixtral-tiny"), "grid:32x32", &artifact, &[]));
    let svg = dir.join("p.svg");
    ok(&waferc(&["inspect", artifact.to_str().unwrap(), "--format", "svg", "-o", svg.to_str().unwrap()]));
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    let json = dir.join("p.json");
    ok(&waferc(&[
        "inspect",
        artifact.to_str().unwrap(),
        "--format",
        "json",
        "--layer",
        "1",
        "-o",
        json.to_str().unwrap(),
    ]));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["filter"]["layer"], 1);
    let bad = fails(&waferc(&["inspect", artifact.to_str().unwrap(), "--layer", "7"]));
    assert!(bad.contains("--layer 7"), "{bad}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn three_prompts_in_flight_are_each_bit_exact_and_equal_to_their_solo_runs() {
    let dir = scratch("sequences");
    let model = fixture("qwen3-moe-tiny");
    let artifact = dir.join("q.wafer");
    // The tiled plan: a region per layer, so sequences in flight overlap. (The search's pick for
    // this two-layer fixture, `stacked:2,35`, puts both layers in one region, where sequences
    // cannot overlap; the stacked plan's sequences have a test of their own.)
    let args = ["--max-context", "64", "--max-sequences", "3", "--plan", "tiled"];
    ok(&compile(&model, "grid:64x64", &artifact, &args));
    let prompts = ["1,17,5,42,9", "300,2", "7,7,7,100,64,3,250,11"];
    let file = dir.join("prompts.txt");
    std::fs::write(&file, prompts.join("\n") + "\n").unwrap();
    let run = |extra: &[&str]| -> Value {
        let mut args =
            vec!["run", artifact.to_str().unwrap(), "--max-new-tokens", "6", "--ignore-eos", "--validate", "--json"];
        args.extend_from_slice(extra);
        serde_json::from_str(&ok(&waferc(&args))).unwrap()
    };
    let together = run(&["--prompts", file.to_str().unwrap(), "--sequences", "3"]);
    let sequences = together["sequences"].as_array().unwrap();
    assert_eq!(sequences.len(), 3);
    assert_eq!(together["sequences_in_flight"], 3);
    for (prompt, sequence) in prompts.iter().zip(sequences) {
        assert_eq!(sequence["bit_exact"], true, "{prompt}");
        let solo = run(&["--tokens", prompt]);
        assert_eq!(sequence["tokens"], solo["tokens"], "{prompt}");
        assert_eq!(sequence["tokens"].as_array().unwrap().len(), 6);
        assert!(sequence["modeled_tok_s"].as_f64().unwrap() > 0.0);
        assert!(sequence["modeled_ttft_us"].as_f64().unwrap() > 0.0);
        // Sharing the pipeline never makes a sequence faster than running alone.
        let (shared, alone) =
            (sequence["modeled_tok_s"].as_f64().unwrap(), solo["sequences"][0]["modeled_tok_s"].as_f64().unwrap());
        assert!(shared <= alone * 1.0001, "{prompt}: {shared} tok/s in flight, {alone} alone");
    }
    let tokens: Vec<&Value> = sequences.iter().map(|s| &s["tokens"]).collect();
    assert!(tokens[0] != tokens[1] || tokens[1] != tokens[2], "different prompts, different continuations");
    // Three in flight beat one at a time in aggregate.
    let serial = run(&["--prompts", file.to_str().unwrap(), "--sequences", "1"]);
    let (three, one) =
        (together["aggregate_modeled_tok_s"].as_f64().unwrap(), serial["aggregate_modeled_tok_s"].as_f64().unwrap());
    assert!(three > one, "3 in flight {three} tok/s vs 1 at a time {one}");

    // KV capacity is fixed at compile time, each sequence's blocks on PEs of their own: too
    // many sequences for the grid is a compile error saying what their KV blocks take.
    let err =
        fails(&waferc(&["run", artifact.to_str().unwrap(), "--prompts", file.to_str().unwrap(), "--sequences", "4"]));
    assert!(err.contains("KV capacity for 3 sequence(s)") && err.contains("--max-sequences 4"), "{err}");
    let crowded = dir.join("crowded.wafer");
    let err = fails(&compile(&model, "grid:64x64", &crowded, &["--max-context", "64", "--max-sequences", "2000"]));
    assert!(err.contains("does not fit") && err.contains("1999 extra sequence(s) in flight"), "{err}");
    assert!(!crowded.exists());
    std::fs::write(dir.join("bad.txt"), "1,2\n3,x\n").unwrap();
    let err = fails(&waferc(&["run", artifact.to_str().unwrap(), "--prompts", dir.join("bad.txt").to_str().unwrap()]));
    assert!(err.contains("bad.txt line 2"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The stacked plan holds every sequence's KV blocks in its heads' bands: three prompts in
/// flight are each bit-exact and generate what they generate one at a time, and the pipeline
/// model overlaps them across the layer groups.
#[test]
fn the_stacked_plan_runs_three_prompts_in_flight_bit_exact() {
    let dir = scratch("stacked-sequences");
    let artifact = dir.join("s.wafer");
    let args = ["--max-context", "64", "--max-sequences", "3", "--plan", "stacked:1", "--json"];
    let compiled: Value =
        serde_json::from_str(&ok(&compile(&fixture("llama31-gqa-bf16"), "grid:64x48", &artifact, &args))).unwrap();
    assert_eq!(compiled["plan"], "stacked:1");
    assert_eq!(compiled["max_sequences"], 3);
    let file = dir.join("prompts.txt");
    std::fs::write(&file, "1,17,5,42,9\n300,2\n7,7,7,100,64,3,250,11\n").unwrap();
    let (three, one) = (validated_run(&artifact, &file, 3, 4), validated_run(&artifact, &file, 1, 4));
    for (together, alone) in three["sequences"].as_array().unwrap().iter().zip(one["sequences"].as_array().unwrap()) {
        assert_eq!(together["tokens"], alone["tokens"]);
    }
    let aggregate = |v: &Value| v["aggregate_modeled_tok_s"].as_f64().unwrap();
    // Overlapped, though a layer group of this two-layer model is a large share of a token's walk.
    assert!(
        aggregate(&three) > 1.1 * aggregate(&one) && aggregate(&three) <= 3.0 * aggregate(&one),
        "{} vs {}",
        aggregate(&three),
        aggregate(&one)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn timing_only_sequences_report_an_aggregate() {
    let dir = scratch("timing-sequences");
    let artifact = dir.join("m.wafer");
    ok(&compile(&fixture("mixtral-tiny"), "grid:32x32", &artifact, &["--max-context", "64", "--max-sequences", "4"]));
    let run = |n: &str| -> Value {
        let out = ok(&waferc(&[
            "run",
            artifact.to_str().unwrap(),
            "--tokens",
            "1,2,3",
            "--max-new-tokens",
            "4",
            "--timing-only",
            "--sequences",
            n,
            "--json",
        ]));
        serde_json::from_str(&out).unwrap()
    };
    let (one, four) = (run("1"), run("4"));
    assert_eq!(four["sequences"].as_array().unwrap().len(), 4);
    let aggregate = |v: &Value| v["aggregate_modeled_tok_s"].as_f64().unwrap();
    assert!(aggregate(&four) > aggregate(&one), "{} vs {}", aggregate(&four), aggregate(&one));
    let per_sequence = four["sequences"][0]["modeled_tok_s"].as_f64().unwrap();
    assert!(per_sequence <= aggregate(&one) * 1.0001 && aggregate(&four) <= 4.0 * aggregate(&one) * 1.0001);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `run --timing-only --from-position POSITION --json` of a one-token prompt: the step there.
fn step_at(artifact: &Path, position: &str) -> Value {
    let args = ["--tokens", "1", "--max-new-tokens", "1", "--timing-only", "--from-position", position, "--json"];
    let out = ok(&waferc(&[&["run", artifact.to_str().unwrap()][..], &args[..]].concat()));
    serde_json::from_str(&out).unwrap()
}

/// `--from-position` runs a timing-only prompt deep into the context: the JSON says where it
/// started, the step there costs more than at position 0 (its attention reads more positions),
/// and the batched prefill, which starts from position 0, is left out. It needs --timing-only
/// and room for the prompt after that position.
#[test]
fn timing_only_runs_from_a_position_deep_in_the_context() {
    let dir = scratch("from-position");
    let artifact = dir.join("m.wafer");
    ok(&compile(&fixture("llama31-gqa-bf16"), "grid:32x32", &artifact, &["--max-context", "1024"]));
    let run = |extra: &[&str]| {
        let mut args = vec!["run", artifact.to_str().unwrap(), "--tokens", "1", "--max-new-tokens", "1", "--json"];
        args.extend_from_slice(extra);
        waferc(&args)
    };
    let (start, deep) = (step_at(&artifact, "0"), step_at(&artifact, "1000"));
    assert_eq!((start["first_position"].as_u64(), deep["first_position"].as_u64()), (Some(0), Some(1000)));
    let cycles = |v: &Value| v["cycles_per_token"].as_u64().unwrap();
    assert!(cycles(&deep) > cycles(&start), "{} at 1000 against {} at 0", cycles(&deep), cycles(&start));
    assert!(start["prefill"][0]["cycles"].is_u64());
    assert!(deep["prefill"].as_array().unwrap().iter().all(|p| p["cycles"].is_null()), "{}", deep["prefill"]);
    let past = fails(&run(&["--timing-only", "--from-position", "1023"]));
    assert!(past.contains("from position 1023") && past.contains("needs 1025 positions"), "{past}");
    // A usage error: clap's exit status 2.
    let with_values = run(&["--from-position", "5"]);
    let stderr = String::from_utf8_lossy(&with_values.stderr);
    assert!(!with_values.status.success() && stderr.contains("--timing-only"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--search-position P` times every candidate of the plan search at position P: the chosen
/// candidate's cycles are the written artifact's step at P (`run --from-position P`). It needs
/// the search (not a pinned `--plan`) and a position inside the KV capacity.
#[test]
fn plan_search_times_candidates_at_the_search_position() {
    let dir = scratch("search-position");
    let artifact = dir.join("m.wafer");
    let model = fixture("llama31-gqa-bf16");
    let compiled: Value = serde_json::from_str(&ok(&compile(
        &model,
        "grid:64x64",
        &artifact,
        &["--max-context", "1024", "--search-position", "1000", "--json"],
    )))
    .unwrap();
    assert_eq!(compiled["search_position"], 1000);
    let chosen = compiled["plan_search"].as_array().unwrap().iter().find(|c| c["chosen"] == true).unwrap().clone();
    assert_eq!(chosen["cycles_per_token"], step_at(&artifact, "1000")["cycles_per_token"], "{chosen}");
    // Deep in the context, full blocks' work split over PEs by lane wins here (1,000 positions:
    // 32 full chunks a KV head), and the same plan without the spread was a candidate too.
    let plan = chosen["plan"].as_str().unwrap();
    let (unspread, spread) = plan.split_once(",spread").unwrap_or_else(|| panic!("{chosen}"));
    assert!(spread.parse::<u8>().is_ok_and(|l| l > 1), "{chosen}");
    let candidates = compiled["plan_search"].as_array().unwrap();
    let before = candidates.iter().find(|c| c["plan"] == unspread).unwrap();
    assert!(before["cycles_per_token"].as_u64() > chosen["cycles_per_token"].as_u64(), "{before}");
    // Each wafer share's fastest plan is tried spread, not only the fastest plan's share (here
    // the 35% share's `stacked:2,35`, whose KV copies were slower).
    let share = |plan: &str| plan.strip_prefix("stacked:").map(|p| p.split(',').nth(1).unwrap_or("100").to_owned());
    let lowered: BTreeSet<String> = candidates
        .iter()
        .filter(|c| c["cycles_per_token"].is_u64())
        .filter_map(|c| share(c["plan"].as_str()?))
        .collect();
    let spread: BTreeSet<String> = candidates
        .iter()
        .filter_map(|c| c["plan"].as_str().filter(|p| p.contains(",spread")).and_then(share))
        .collect();
    assert_eq!(spread, lowered, "{candidates:#?}");
    let pinned = fails(&compile(&model, "grid:32x32", &artifact, &["--plan", "tiled", "--search-position", "5"]));
    assert!(pinned.contains("--plan tiled pins one"), "{pinned}");
    let past = fails(&compile(&model, "grid:32x32", &artifact, &["--max-context", "64", "--search-position", "64"]));
    assert!(past.contains("holds positions 0 to 63"), "{past}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `run --validate --json` of `artifact` on the prompts file, `sequences` in flight, each
/// generating `new_tokens` (EOS ignored): the run's report, every sequence asserted bit-exact.
fn validated_run(artifact: &Path, prompts: &Path, sequences: usize, new_tokens: usize) -> Value {
    let (sequences, new_tokens) = (sequences.to_string(), new_tokens.to_string());
    let run = ok(&waferc(&[
        "run",
        artifact.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--sequences",
        &sequences,
        "--max-new-tokens",
        &new_tokens,
        "--ignore-eos",
        "--validate",
        "--json",
    ]));
    let run: Value = serde_json::from_str(&run).unwrap();
    for sequence in run["sequences"].as_array().unwrap() {
        assert_eq!(sequence["bit_exact"], true, "{sequence}");
    }
    run
}

/// KV blocks spread over four PEs by lane, two sequences in flight, each past its first chunk
/// of positions: both bit-exact against the reference decoder.
#[test]
fn kv_blocks_spread_by_lane_serve_two_sequences_bit_exact() {
    let dir = scratch("spread-sequences");
    let artifact = dir.join("s.wafer");
    let args = ["--max-context", "128", "--max-sequences", "2", "--plan", "stacked:1,100,kv3,spread4"];
    ok(&compile(&fixture("llama31-gqa-bf16"), "grid:64x64", &artifact, &args));
    let prompts = dir.join("prompts.txt");
    let long: Vec<String> = (1..=37).map(|t| (t * 11 % 250).to_string()).collect();
    std::fs::write(&prompts, format!("{}\n300,2\n", long.join(","))).unwrap();
    assert_eq!(validated_run(&artifact, &prompts, 2, 12)["sequences"].as_array().unwrap().len(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn replicas_of_hot_experts_are_reported_shown_and_bit_exact_with_three_sequences() {
    let dir = scratch("replicas");
    let model = fixture("qwen3-moe-tiny");
    let prompts = dir.join("prompts.txt");
    std::fs::write(&prompts, "1,17,5,42,9\n300,2\n7,7,7,100,64,3,250,11\n").unwrap();
    let artifact = dir.join("r.wafer");
    let args = [
        "--max-context",
        "64",
        "--max-sequences",
        "3",
        "--calibrate",
        prompts.to_str().unwrap(),
        "--plan",
        "tiled",
        "--expert-replicas",
        "always",
    ];
    let out = ok(&compile(&model, "grid:64x64", &artifact, &args));
    assert!(out.contains("extra copies of hot experts on free PEs"), "{out}");
    assert!(out.contains("no more because"), "{out}");
    let inspect = ok(&waferc(&["inspect", artifact.to_str().unwrap()]));
    assert!(inspect.contains("(3 copies; extra at w0 x"), "{inspect}");
    validated_run(&artifact, &prompts, 3, 4);
    // With one sequence there is nothing to replicate for: the report says why.
    let out = ok(&compile(
        &model,
        "grid:64x64",
        &dir.join("one.wafer"),
        &args[..2].iter().chain(&args[4..]).copied().collect::<Vec<_>>(),
    ));
    assert!(out.contains("with --max-sequences 1 a copy would serve no sequence"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--expert-replicas auto` (the default) asks the pipeline model: on a fixture a token's walk
/// through the layers is far longer than any expert's queue of three sequences, so no sequence
/// would wait for an expert and no copy is placed; the program is the one `off` gives.
#[test]
fn auto_declines_replicas_where_no_sequence_waits_for_an_expert() {
    let dir = scratch("replicas-auto");
    let model = fixture("qwen3-moe-tiny");
    let prompts = dir.join("prompts.txt");
    std::fs::write(&prompts, "1,17,5,42,9\n300,2\n7,7,7,100,64,3,250,11\n").unwrap();
    let args = |mode: &'static str| {
        vec![
            "--max-context".to_string(),
            "64".into(),
            "--max-sequences".into(),
            "3".into(),
            "--calibrate".into(),
            prompts.to_str().unwrap().into(),
            "--plan".into(),
            "tiled".into(),
            "--json".into(),
            "--expert-replicas".into(),
            mode.into(),
        ]
    };
    let compiled = |mode: &'static str| -> (Value, Vec<u8>) {
        let artifact = dir.join(format!("{mode}.wafer"));
        let args = args(mode);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let json = serde_json::from_str(&ok(&compile(&model, "grid:64x64", &artifact, &args))).unwrap();
        (json, std::fs::read(&artifact).unwrap())
    };
    let (auto, auto_bytes) = compiled("auto");
    let (off, off_bytes) = compiled("off");
    let (always, _) = compiled("always");
    assert_eq!(auto["expert_replicas"]["mode"], "auto", "{auto}");
    assert_eq!(auto["expert_replicas"]["copies"], 0, "{auto}");
    let decision = auto["expert_replicas"]["decision"].as_str().unwrap();
    assert!(decision.starts_with("no copies: with 3 sequences in flight a round lasts"), "{decision}");
    assert!(decision.contains("so no sequence waits for an expert"), "{decision}");
    assert!(auto["expert_placement"].as_str().unwrap().contains("--expert-replicas auto"), "{auto}");
    assert_eq!(off["expert_replicas"]["copies"], 0);
    assert!(auto_bytes == off_bytes, "auto without copies writes the artifact off writes");
    assert!(always["expert_replicas"]["copies"].as_u64().unwrap() > 0, "{always}");
    // The default is auto.
    let without_flag = args("auto");
    let without_flag: Vec<&str> = without_flag[..without_flag.len() - 2].iter().map(String::as_str).collect();
    let default: Value =
        serde_json::from_str(&ok(&compile(&model, "grid:64x64", &dir.join("default.wafer"), &without_flag))).unwrap();
    assert_eq!(default["expert_replicas"], auto["expert_replicas"]);
    let bad = compile(&model, "grid:64x64", &dir.join("bad.wafer"), &["--expert-replicas", "some"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--expert-replicas"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn profile_then_compile_with_it_and_inspect_shows_expert_heat() {
    let dir = scratch("profile");
    let model = fixture("mixtral-tiny");
    let prompts = dir.join("prompts.txt");
    std::fs::write(&prompts, "1,17,5,42,9,300,2\n7,7,7,100,64,3,250,11\n").unwrap();
    let profile = dir.join("profile.json");
    ok(&waferc(&[
        "profile",
        model.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "-o",
        profile.to_str().unwrap(),
    ]));
    let written: Value = serde_json::from_str(&std::fs::read_to_string(&profile).unwrap()).unwrap();
    assert_eq!(written["layers"].as_array().unwrap().len(), 2);
    assert_eq!(written["layers"][0]["tokens"], 15);

    let artifact = dir.join("m.wafer");
    let out =
        ok(&compile(&model, "grid:32x32", &artifact, &["--max-context", "64", "--profile", profile.to_str().unwrap()]));
    assert!(out.contains("experts placed by the routing profile"), "{out}");
    let inspect = ok(&waferc(&["inspect", artifact.to_str().unwrap()]));
    assert!(inspect.contains("expert heat (routing profile from"), "{inspect}");
    assert!(inspect.contains("layer 1 (15 tokens, top 2 of 8"), "{inspect}");
    let run = ok(&waferc(&[
        "run",
        artifact.to_str().unwrap(),
        "--tokens",
        "4,5,6",
        "--max-new-tokens",
        "4",
        "--validate",
        "--json",
    ]));
    assert_eq!(serde_json::from_str::<Value>(&run).unwrap()["bit_exact"], true);
    // --calibrate profiles the same prompts first: the same artifact.
    let calibrated = dir.join("c.wafer");
    ok(&compile(&model, "grid:32x32", &calibrated, &["--max-context", "64", "--calibrate", prompts.to_str().unwrap()]));
    assert_eq!(std::fs::read(&artifact).unwrap(), std::fs::read(&calibrated).unwrap());

    // Without a profile the report says uniform routing is assumed.
    let out = ok(&compile(&model, "grid:32x32", &dir.join("u.wafer"), &["--max-context", "64"]));
    assert!(out.contains("uniform routing is assumed"), "{out}");
    // A profile of another model is refused by name.
    let other = dir.join("other.json");
    ok(&waferc(&[
        "profile",
        fixture("qwen3-moe-tiny").to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "-o",
        other.to_str().unwrap(),
    ]));
    let err = fails(&compile(&model, "grid:32x32", &dir.join("x.wafer"), &["--profile", other.to_str().unwrap()]));
    assert!(err.contains("routing profile"), "{err}");
    assert!(!dir.join("x.wafer").exists());
    let err = fails(&waferc(&[
        "profile",
        fixture("qwen3-dense").to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "-o",
        other.to_str().unwrap(),
    ]));
    assert!(err.contains("no MoE layers"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn default_pipeline_dumps_one_file_per_pass_each_round_tripping() {
    let dir = scratch("default-pipeline");
    let dump = dir.join("ir");
    let model = fixture("llama31-gqa-bf16");
    let stdout =
        ok(&compile(&model, "grid:32x32", &dir.join("m.wafer"), &["--dump-ir", dump.to_str().unwrap(), "--json"]));
    let mut files: Vec<_> =
        std::fs::read_dir(&dump).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(files, ["00-frontend.ir", "01-rewrite.ir", "02-dce.ir", "03-interleave-experts.ir"]);
    for file in &files {
        let text = std::fs::read_to_string(dump.join(file)).unwrap();
        let module = waferc_ir::text::parse(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(waferc_ir::text::print(&module), text, "{file} does not round-trip");
    }
    assert!(std::fs::read_to_string(dump.join("01-rewrite.ir")).unwrap().contains("= slice %"));
    // --json says what each pass changed: rewrite fused matvecs, dce removed the unfused weights.
    let json: Value = serde_json::from_str(&stdout).unwrap();
    let passes = json["passes"].as_array().unwrap();
    let changes = |name: &str| passes.iter().find(|p| p["name"] == name).unwrap()["changes"].clone();
    let rewrite = changes("rewrite");
    assert!(rewrite["matvecs"][1].as_u64() < rewrite["matvecs"][0].as_u64(), "{rewrite}");
    let dce = changes("dce");
    assert!(dce["weight_bytes"][1].as_u64() < dce["weight_bytes"][0].as_u64(), "{dce}");
    // A dense model has no experts to interleave: its dump equals dce's.
    assert_eq!(
        std::fs::read_to_string(dump.join("03-interleave-experts.ir")).unwrap(),
        std::fs::read_to_string(dump.join("02-dce.ir")).unwrap()
    );

    // --skip-pass leaves a pass out; a name not in the pipeline is a clean error.
    ok(&compile(
        &model,
        "grid:32x32",
        &dir.join("m.wafer"),
        &["--dump-ir", dump.to_str().unwrap(), "--skip-pass", "rewrite"],
    ));
    let mut files: Vec<_> =
        std::fs::read_dir(&dump).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(files, ["00-frontend.ir", "01-dce.ir", "02-interleave-experts.ir"]);
    let unknown = fails(&compile(&model, "grid:32x32", &dir.join("m.wafer"), &["--skip-pass", "fold"]));
    assert!(unknown.contains("--skip-pass fold") && unknown.contains("rewrite, dce"), "{unknown}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// In an MoE model the search shares experts' lanes from the fastest plan of every group size
/// it refined with KV copies, not only from the overall fastest, and a group's doublings stop
/// at the first that is not faster.
#[test]
fn plan_search_shares_lanes_from_every_refined_group_size() {
    use waferc_ir::wafer::Plan;
    let dir = scratch("share-lanes");
    let out = ok(&compile(&fixture("qwen3-moe-tiny"), "grid:64x48", &dir.join("q.wafer"), &["--json"]));
    let json: Value = serde_json::from_str(&out).unwrap();
    // (group size, KV copies, experts per lane, cycles) of each stacked candidate.
    let stacked: Vec<(Plan, Option<u64>)> = json["plan_search"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["plan"].as_str().unwrap().parse::<Plan>().unwrap(), c["cycles_per_token"].as_u64()))
        .filter(|(p, _)| matches!(p, Plan::Stacked { .. }))
        .collect();
    let cycles = |plan: Plan| stacked.iter().find(|(p, _)| *p == plan).and_then(|(_, c)| *c);
    let with_lanes = |plan: Plan, e: u8| match plan {
        Plan::Stacked { layers_per_region, wafer_percent, kv_copies, kv_spread, .. } => {
            Plan::Stacked { layers_per_region, wafer_percent, kv_copies, experts_per_lane: e, kv_spread, kv_slices: 1 }
        }
        other => other,
    };
    let refined: std::collections::BTreeSet<u16> = stacked
        .iter()
        .filter_map(|(p, _)| match *p {
            Plan::Stacked { layers_per_region, kv_copies, experts_per_lane: 1, .. } if kv_copies > 1 => {
                Some(layers_per_region)
            }
            _ => None,
        })
        .collect();
    assert!(refined.len() >= 2, "two group sizes are refined: {stacked:?}");
    for k in refined {
        let shared: Vec<Plan> = stacked
            .iter()
            .map(|(p, _)| *p)
            .filter(|p| matches!(p, Plan::Stacked { layers_per_region, experts_per_lane, .. } if *layers_per_region == k && *experts_per_lane > 1))
            .collect();
        assert!(
            shared.iter().any(|p| matches!(p, Plan::Stacked { experts_per_lane: 2, .. })),
            "stacked:{k} is tried with lanes of two: {stacked:?}"
        );
        // A doubling past two follows one that was faster than the plan it doubled.
        for plan in shared {
            let Plan::Stacked { experts_per_lane: e, .. } = plan else { continue };
            if e > 2 {
                let (half, start) = (with_lanes(plan, e / 2), with_lanes(plan, e / 4));
                assert!(
                    cycles(half).zip(cycles(start)).is_some_and(|(h, s)| h < s),
                    "{plan} follows {half}, which beat {start}: {stacked:?}"
                );
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--plan auto` with the default pipeline runs it once per plan kind: tiled candidates are
/// lowered from the module whose `rewrite` was costed for the tiled plan (which fuses nothing),
/// stacked ones from the stacked-costed module (which fuses q/k/v and gate/up). `--json` says
/// which module each candidate used, and the artifact and `--dump-ir` hold the chosen one's.
#[test]
fn plan_search_lowers_each_candidate_from_its_plan_kinds_module() {
    let dir = scratch("per-kind-modules");
    let dump = dir.join("ir");
    let model = fixture("llama31-gqa-bf16");
    let artifact = dir.join("m.wafer");
    let stdout = ok(&compile(&model, "grid:32x32", &artifact, &["--dump-ir", dump.to_str().unwrap(), "--json"]));
    let json: Value = serde_json::from_str(&stdout).unwrap();
    let kind_of = |plan: &str| if plan.starts_with("stacked") { "stacked" } else { "tiled" };
    let candidates = json["plan_search"].as_array().unwrap();
    assert!(candidates.iter().any(|c| c["plan"] == "tiled") && candidates.iter().any(|c| c["plan"] == "stacked:1"));
    for c in candidates {
        assert_eq!(c["module"], kind_of(c["plan"].as_str().unwrap()), "{c}");
    }
    let modules = json["modules"].as_array().unwrap();
    let costed: Vec<&str> = modules.iter().map(|m| m["costed_for"].as_str().unwrap()).collect();
    assert_eq!(costed, ["tiled", "stacked"]);
    let fused = |m: &Value| m["fused_weights"].as_array().unwrap().len();
    assert_eq!(fused(&modules[0]), 0, "the tiled cost declines every fusion: {}", modules[0]);
    assert!(fused(&modules[1]) > 0, "the stacked cost fuses: {}", modules[1]);
    assert!(modules[1]["fused_weights"].as_array().unwrap().iter().any(|w| w.as_str().unwrap().contains("q_proj")));
    let chosen: Vec<&Value> = modules.iter().filter(|m| m["chosen"] == true).collect();
    assert_eq!(chosen.len(), 1);
    assert_eq!(chosen[0]["costed_for"], kind_of(json["plan"].as_str().unwrap()));
    // The artifact's module is the chosen one, as the dump's last file shows it.
    let compiled = waferc_ir::wafer::artifact::read(&artifact).unwrap();
    let last = std::fs::read_to_string(dump.join("02-dce.ir")).unwrap();
    assert_eq!(waferc_ir::text::print(&compiled.module), last);
    assert_eq!(last.contains("= slice %"), chosen[0]["costed_for"] == "stacked");

    // A pinned plan runs the pipeline once, costed for it.
    for (plan, kind) in [("tiled", "tiled"), ("stacked:1", "stacked")] {
        let out = ok(&compile(&model, "grid:32x32", &dir.join("p.wafer"), &["--plan", plan, "--json"]));
        let json: Value = serde_json::from_str(&out).unwrap();
        let modules = json["modules"].as_array().unwrap();
        assert_eq!(modules.len(), 1, "{plan}");
        assert_eq!(modules[0]["costed_for"], kind, "{plan}");
        assert_eq!(fused(&modules[0]) > 0, kind == "stacked", "{plan}");
    }
    // `rewrite plan=KIND` pins the cost: one module for every candidate.
    let out =
        ok(&compile(&model, "grid:32x32", &dir.join("p.wafer"), &["--passes", "rewrite plan=tiled, dce", "--json"]));
    let json: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["modules"].as_array().unwrap().len(), 1);
    assert!(json["plan_search"].as_array().unwrap().iter().all(|c| c.get("module").is_none()));
    let err = fails(&compile(&model, "grid:32x32", &dir.join("x.wafer"), &["--passes", "rewrite plan=mesh"]));
    assert!(err.contains("unknown plan kind `mesh`") && err.contains("rewrite [plan=tiled|stacked]"), "{err}");
    assert!(!dir.join("x.wafer").exists());
    // A pipeline that fails under the search says which kind's run failed, and still dumps the
    // steps before the failure.
    let tied = fixture("llama-tiny-tok");
    let bad = ["--passes", "rewrite, quantize q8_0:lm_head", "--dump-ir", dump.to_str().unwrap()];
    let err = fails(&compile(&tied, "grid:32x32", &dir.join("x.wafer"), &bad));
    assert!(err.contains("costed for the tiled plan") && err.contains("one tensor has one format"), "{err}");
    assert!(dump.join("01-rewrite.ir").exists() && !dump.join("02-quantize.ir").exists());
    assert!(!dir.join("x.wafer").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The compile report counts each storage format's weights, bytes and PEs: one format per part
/// here, so every format the pass chose shows up, and the tile bytes add up to the blob.
#[test]
fn compile_report_counts_pes_per_weight_format() {
    let dir = scratch("formats");
    let out = ok(&compile(
        &fixture("llama31-gqa-bf16"),
        "grid:32x32",
        &dir.join("f.wafer"),
        &["--passes", "quantize q4_1:layers q8_0:embedding q4_0:lm_head", "--json"],
    ));
    let report: Value = serde_json::from_str(&out).unwrap();
    let formats = report["weight_formats"].as_array().unwrap();
    let names: Vec<&str> = formats.iter().map(|f| f["dtype"].as_str().unwrap()).collect();
    assert_eq!(names, ["bf16", "q8_0", "q4_0", "q4_1"], "norms stay bf16: {out}");
    let count = |name: &str| formats.iter().find(|f| f["dtype"] == name).unwrap()["weights"].as_u64().unwrap();
    assert_eq!((count("q8_0"), count("q4_0")), (1, 1), "the embedding and the LM head are one weight each");
    let layers = report["weight_formats"][3]["weights"].as_u64().unwrap();
    assert_eq!(layers % 7, 0, "seven matvecs per layer: {layers}");
    let tiles: u64 = formats.iter().map(|f| f["tile_bytes"].as_u64().unwrap()).sum();
    assert_eq!(tiles, report["tile_bytes"].as_u64().unwrap());
    let pes: u64 = formats.iter().map(|f| f["pes"].as_u64().unwrap()).sum::<u64>()
        + report["pes_without_weights"].as_u64().unwrap();
    assert!(pes >= report["pes_used"].as_u64().unwrap(), "every PE is counted at least once");
    assert!(formats.iter().all(|f| f["pes"].as_u64().unwrap() > 0));
    let text =
        ok(&compile(&fixture("llama31-gqa-bf16"), "grid:32x32", &dir.join("g.wafer"), &["--passes", "quantize q4_1"]));
    assert!(text.contains("weights by storage format"), "{text}");
    assert!(text.lines().any(|l| l.trim_start().starts_with("q4_1") && l.contains("PEs")), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}
