//! `waferc::inspect` on programs compiled by `passes::wafer::compile`: the Mixtral-tiny fixture
//! on a 24 x 24 grid (every tile in the JSON once, every PE and layer in the SVG, every expert in
//! the summary), and a Llama-8B-shaped program on a WSE-3 (about a million PEs: the views stay
//! small and fast).
//!
//! `WAFERC_DOCS_DIR=$PWD/docs cargo test -p waferc-testsuite --test inspect_compiled` (from the
//! repository root; tests run in `testsuite/`, so give an absolute path) also writes the
//! README's picture, `placement-mixtral-tiny.svg`, into that directory.

mod executor_common;

use std::collections::BTreeSet;
use std::time::Instant;

use serde_json::Value;
use waferc::inspect::{placement_json, placement_svg, summary_text, write_placement_json, ColourBy, Filter};
use waferc_ir::wafer::{WaferProgram, Work};
use waferc_ir::{Module, Op};
use waferc_passes::wafer::{compile, CompileOptions};
use waferc_targets::Target;

/// Roomy enough that placement changes do not push the fixture off the grid, small enough for
/// one SVG element and one map character per PE.
const GRID: &str = "grid:24x24";

fn mixtral_tiny() -> (Module, WaferProgram) {
    let path = waferc_testsuite::fixtures_dir().join("hf/mixtral-tiny");
    let loaded = waferc::frontend::load(&path).unwrap_or_else(|e| panic!("{e}"));
    let target = Target::resolve(GRID).unwrap();
    let program = compile(&loaded.module, &target, &CompileOptions::new(64)).unwrap_or_else(|e| panic!("{e}"));
    (loaded.module, program)
}

/// Every weight tile of the program: `(instr, [wafer, x, y], rows start, chunks or columns start)`.
fn program_tiles(program: &WaferProgram) -> Vec<(u64, [u64; 3], u64, u64)> {
    let mut tiles = Vec::new();
    for (instr, placement) in program.instrs.iter().enumerate() {
        let pe = |p: waferc_ir::wafer::Pe| [p.wafer, p.x, p.y].map(u64::from);
        match &placement.work {
            Work::MatVec(m) => tiles
                .extend(m.tiles.iter().map(|t| (instr as u64, pe(t.pe), t.rows.start as u64, t.chunks.start as u64))),
            Work::Embed { blocks, .. } => {
                tiles.extend(blocks.iter().map(|b| (instr as u64, pe(b.pe), b.rows.start, b.elements.start)))
            }
            _ => {}
        }
    }
    tiles
}

fn listed_tiles(json: &Value) -> Vec<(u64, [u64; 3], u64, u64)> {
    let n = |v: &Value| v.as_u64().unwrap();
    json["tiles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let start = if t["kind"] == "matvec" { n(&t["chunks"][0]) } else { n(&t["elements"][0]) };
            (n(&t["instr"]), [n(&t["pe"][0]), n(&t["pe"][1]), n(&t["pe"][2])], n(&t["rows"][0]), start)
        })
        .collect()
}

#[test]
fn mixtral_tiny_json_lists_every_tile_once_with_its_weight() {
    let (module, program) = mixtral_tiny();
    let json = placement_json(&program, Some(&module), &Filter::all());
    let listed = listed_tiles(&json);
    let expected = program_tiles(&program);
    assert_eq!(listed, expected, "tiles in program order, each once");
    assert_eq!(listed.iter().collect::<BTreeSet<_>>().len(), listed.len());

    for tile in json["tiles"].as_array().unwrap() {
        let instr = tile["instr"].as_u64().unwrap() as usize;
        let ir = &module.body[waferc_ir::Handle::new(instr)];
        let weight = match &ir.op {
            Op::MatVec { weight, .. } => *weight,
            Op::Embed { table } => *table,
            other => panic!("a tile of %{instr} = {}", other.name()),
        };
        assert_eq!(tile["weight"], weight.index() as u64);
        assert_eq!(tile["weight_name"], module.weights[weight].name.as_str());
        assert!(tile["bytes"].as_u64().unwrap() > 0);
    }
    assert_eq!(json["pes"].as_array().unwrap().len(), program.pes.len());
    assert_eq!(json["routes"].as_array().unwrap().len(), program.routes.len());
    assert_eq!(json["model"]["architecture"], module.meta.architecture.as_str());
}

#[test]
fn mixtral_tiny_summary_places_every_layer_and_expert() {
    let (module, program) = mixtral_tiny();
    let text = summary_text(&program, Some(&module), &Filter::all(), None);
    let used = program.pes.iter().filter(|p| p.regions.iter().any(|r| r.instr.is_some())).count();
    let percent = 100.0 * used as f64 / 576.0;
    assert!(text.contains(&format!("PEs used: {used} of 576 ({percent:.2}%)")), "{text}");
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split_whitespace().collect()).collect();
    for part in [vec!["embedding"], vec!["layer", "0"], vec!["layer", "1"], vec!["head"]] {
        assert!(rows.iter().any(|r| r.starts_with(&part) && r.len() == part.len() + 4), "no row for {part:?}:\n{text}");
    }
    for layer in ["0", "1"] {
        for expert in 0..8 {
            let expert = expert.to_string();
            assert!(
                rows.iter().any(|r| r.len() == 7 && r[..4] == ["layer", layer, &expert, "0"]),
                "no box for layer {layer} expert {expert}:\n{text}"
            );
        }
    }
    let map: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("map of wafer 0")).collect();
    assert!(map[0].contains("one character per PE"));
    assert_eq!(map.len(), 1 + 1 + 24 + 1, "{text}");
    assert!(map[2..26].iter().all(|l| l.len() == 6 + 24));
}

#[test]
fn mixtral_tiny_svg_shows_every_pe_layer_and_expert() {
    let (module, program) = mixtral_tiny();
    let svg = placement_svg(&program, Some(&module), &Filter::all(), ColourBy::Layer);
    let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("not XML: {e}"));
    let class = |c: &str| doc.descendants().filter(|n| n.attribute("class") == Some(c)).count();
    let used = program.pes.iter().filter(|p| p.regions.iter().any(|r| r.instr.is_some())).count();
    assert_eq!(class("pe"), used);
    let keys: Vec<&str> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("legend-entry"))
        .map(|n| n.attribute("data-key").unwrap())
        .collect();
    assert_eq!(keys, ["embedding", "layer 0", "layer 1", "head"]);
    assert!(class("link") > 0);
    let title = doc.descendants().find(|n| n.has_tag_name("text")).unwrap().text().unwrap();
    assert_eq!(title, "mixtral, 2 layers on grid:24x24: PEs coloured by layer");

    let by_expert = placement_svg(&program, Some(&module), &Filter::all(), ColourBy::Expert);
    let doc = roxmltree::Document::parse(&by_expert).unwrap();
    let keys: Vec<&str> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("legend-entry"))
        .map(|n| n.attribute("data-key").unwrap())
        .collect();
    let expected: Vec<String> = (0..8).map(|e| format!("expert {e}")).chain(["outside experts".to_string()]).collect();
    assert_eq!(keys, expected);

    if let Some(dir) = std::env::var_os("WAFERC_DOCS_DIR") {
        let path = std::path::Path::new(&dir).join("placement-mixtral-tiny.svg");
        std::fs::write(&path, &svg).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

#[test]
fn mixtral_tiny_layer_filter_keeps_only_that_layer() {
    let (module, program) = mixtral_tiny();
    let filter = Filter { layer: Some(1), ..Filter::all() };
    filter.check(&program).unwrap();
    let json = placement_json(&program, Some(&module), &filter);
    let expected: Vec<_> =
        program_tiles(&program).into_iter().filter(|t| program.instrs[t.0 as usize].layer == Some(1)).collect();
    assert_eq!(listed_tiles(&json), expected);
    for route in json["routes"].as_array().unwrap() {
        let id = route["id"].as_u64().unwrap() as u32;
        let producer = &program.instrs[route["instr"].as_u64().unwrap() as usize];
        let received = program.instrs.iter().any(|p| p.layer == Some(1) && p.operand_routes.contains(&id));
        assert!(producer.layer == Some(1) || received, "route {id} is not layer 1's");
    }
    let text = summary_text(&program, Some(&module), &filter, None);
    assert!(!text.contains("embedding") && !text.contains("\n  layer 0 "), "{text}");
}

#[test]
fn llama8b_shape_on_wse3_gives_views_of_bounded_size() {
    let module = waferc_testsuite::models::build(&waferc_testsuite::models::Shape::llama8b(), 0);
    let program = executor_common::compile_for(&module, "wse3", 8192);
    let start = Instant::now();
    let text = summary_text(&program, Some(&module), &Filter::all(), None);
    let summary_time = start.elapsed();
    let map: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("map of wafer 0")).skip(1).collect();
    assert!(map.iter().all(|l| l.len() <= 102), "{text}");
    assert!(map.len() <= 90, "{} map lines", map.len());

    let start = Instant::now();
    let svg = placement_svg(&program, Some(&module), &Filter::all(), ColourBy::Layer);
    let svg_time = start.elapsed();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let elements = doc.descendants().filter(|n| n.is_element()).count();
    assert!(elements <= 50_000, "{elements} SVG elements");
    let keys = doc.descendants().filter(|n| n.attribute("class") == Some("legend-entry")).count();
    assert_eq!(keys, 32 + 2, "32 layers, the embedding and the head");

    let start = Instant::now();
    let mut bytes = CountingSink(0);
    write_placement_json(&program, Some(&module), &Filter::all(), &mut bytes, false).unwrap();
    let json_time = start.elapsed();
    eprintln!(
        "8B on wse3: {} PEs, {} routes; summary {summary_time:?}, SVG {svg_time:?} ({} bytes, {elements} elements), \
         JSON {json_time:?} ({} bytes)",
        program.pes.len(),
        program.routes.len(),
        svg.len(),
        bytes.0
    );
    let last = Filter { layer: Some(31), ..Filter::all() };
    let json = placement_json(&program, Some(&module), &last);
    let expected: Vec<_> =
        program_tiles(&program).into_iter().filter(|t| program.instrs[t.0 as usize].layer == Some(31)).collect();
    assert_eq!(listed_tiles(&json), expected);
}

/// Counts what is written, so the full JSON can be streamed without keeping it.
struct CountingSink(u64);

impl std::io::Write for CountingSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
