//! The text form: exact round trips, readable errors, and no panic on any input.

mod common;

use waferc_ir::text::{parse, print};
use waferc_ir::{verify, DType, IrError, KvCache, ModelMeta, Module, Op, Rope, RopeScaling, TensorType, WeightBytes};

/// `print(parse(print(m))) == print(m)`, and the parsed module verifies.
fn assert_round_trip(module: &Module) -> String {
    let text = print(module);
    let parsed = parse(&text).unwrap_or_else(|e| panic!("printed module does not parse: {e}\n{text}"));
    verify(&parsed).unwrap_or_else(|e| panic!("parsed module does not verify: {e}\n{text}"));
    assert_eq!(print(&parsed), text);
    text
}

#[test]
fn dense_and_moe_models_round_trip() {
    for module in [common::dense(), common::moe()] {
        verify(&module).unwrap();
        let text = assert_round_trip(&module);
        let from_crlf = parse(&text.replace('\n', "\r\n")).expect("CRLF line endings parse");
        assert_eq!(print(&from_crlf), text);
    }
}

#[test]
fn printed_form_reads_as_documented() {
    let text = print(&common::dense());
    for line in [
        "module architecture=llama vocab_size=128 num_layers=2 bos_token_id=1 eos_token_ids=[2, 7]\n",
        "weight @model.layers.0.self_attn.q_proj.weight : bf16[64, 64]\n",
        "kv_cache #1 layer=1 kv_heads=2 head_dim=16\n",
        "%0 = embed @model.embed_tokens.weight : f32[64]\nlayer 0 {\n",
        "  %1 = rms_norm %0, @model.layers.0.input_layernorm.weight eps=1e-6 : f32[64]\n",
        "  %7 = attention %5, %6, %4, #0 heads=4 scale=0.25 : f32[64]\n",
        "  %16 = add %9, %15 : f32[64]\n}\nlayer 1 {\n",
        "}\n%33 = rms_norm %32, @model.norm.weight eps=1e-5 : f32[64]\n",
        "output %34\n",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    let moe = print(&common::moe());
    assert!(moe.contains("%14 = router_topk %13 top_k=2 normalize : routing[4, top2]\n"), "{moe}");
    assert!(moe.contains("%39 = expert_combine %14, %20, %26, %32, %38 : f32[64]\n"), "{moe}");
}

/// A module with one weight, one norm and a head, for tests that vary one detail.
fn tiny(architecture: &str, norm_name: &str, eps: f32) -> Module {
    let meta = ModelMeta {
        architecture: architecture.into(),
        vocab_size: 4,
        num_layers: 0,
        bos_token_id: None,
        eos_token_ids: vec![],
    };
    let mut m = Module::new(meta);
    let table = m.add_weight("embed", TensorType::new(DType::F32, [4, 8]), WeightBytes::Absent);
    let norm = m.add_weight(norm_name, TensorType::new(DType::F32, [8]), WeightBytes::Absent);
    let x = m.push(Op::Embed { table }, None).unwrap();
    let y = m.push(Op::RmsNorm { x, weight: norm, eps }, None).unwrap();
    let head = m.add_weight("head", TensorType::new(DType::F32, [4, 8]), WeightBytes::Absent);
    m.output = Some(m.push(Op::MatVec { x: y, weight: head, bias: None }, None).unwrap());
    m
}

#[test]
fn unusual_names_are_quoted_and_round_trip() {
    for name in [
        "blk.0.attn_q.weight",
        "with space",
        "quote\"inside",
        "back\\slash",
        "new\nline\ttab\rreturn",
        "bell\u{7}",
        "ünïcødé/权重",
        "1e-6",
        "a+b",
        "",
        "@%#;:,=[]{}",
    ] {
        let module = tiny(name, name, 1e-6);
        let text = assert_round_trip(&module);
        let parsed = parse(&text).unwrap();
        assert_eq!(parsed.meta.architecture, name);
        assert_eq!(parsed.weights.iter().nth(1).unwrap().1.name, name, "{text}");
    }
    let text = print(&tiny("x", "with space", 1e-6));
    assert!(text.contains("weight @\"with space\" : f32[8]\n"), "{text}");
}

#[test]
fn floats_round_trip_bit_for_bit() {
    for eps in [1e-6, 1e-5, 0.1, 1.0 / 3.0, 1e-45, f32::MIN_POSITIVE, f32::MAX, 123456.79, 3e38, 7.0e-39] {
        let parsed = parse(&assert_round_trip(&tiny("llama", "norm", eps))).unwrap();
        match &parsed.body[waferc_ir::Handle::new(1)].op {
            Op::RmsNorm { eps: back, .. } => assert_eq!(back.to_bits(), eps.to_bits(), "eps {eps:?}"),
            other => panic!("expected rms_norm, found {other:?}"),
        }
    }
}

#[test]
fn rope_scalings_and_biases_round_trip() {
    let mut m = tiny("llama", "norm", 1e-6);
    let x = m.output.unwrap();
    let scalings = [
        RopeScaling::None,
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Llama3 { factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 },
        RopeScaling::Yarn {
            factor: 32.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position: 4096,
            truncate: false,
        },
        RopeScaling::Yarn { factor: 4.0, beta_fast: 16.0, beta_slow: 2.0, original_max_position: 64, truncate: true },
    ];
    for scaling in &scalings {
        m.push(Op::Rope { x, head_dim: 2, rope: Rope { theta: 10000.0, scaling: scaling.clone() } }, Some(3)).unwrap();
    }
    let text = assert_round_trip(&m);
    let parsed = parse(&text).unwrap();
    let parsed_scalings: Vec<RopeScaling> = parsed
        .body
        .iter()
        .filter_map(|(_, i)| match &i.op {
            Op::Rope { rope, .. } => Some(rope.scaling.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(parsed_scalings, scalings);
    assert!(text.contains("scaling=llama3 factor=32.0 low_freq_factor=1.0 high_freq_factor=4.0"), "{text}");
}

#[test]
fn parser_accepts_any_labels_and_prints_densely() {
    let text = "\
; hand-written, with sparse labels and comments
module architecture=test vocab_size=4 num_layers=1 eos_token_ids=[]
weight @table : f32[4, 8]   ; the embedding
weight @head : f32[4, 8]
kv_cache #kv layer=0 kv_heads=1 head_dim=8

%embedded = embed @table : f32[8]
layer 0 {
  %100 = attention %embedded, %embedded, %embedded, #kv heads=1 scale=0.5 : f32[8]
}
layer 0 {
  %7 = add %100, %embedded : f32[8]
}
%logits = matvec %7, @head : f32[4]
output %logits
";
    let module = parse(text).unwrap();
    verify(&module).unwrap();
    let printed = print(&module);
    assert!(
        printed.contains("  %1 = attention %0, %0, %0, #0 heads=1 scale=0.5 : f32[8]\n  %2 = add %1, %0"),
        "{printed}"
    );
    assert!(printed.contains("%3 = matvec %2, @head : f32[4]\noutput %3\n"), "{printed}");
    assert_eq!(module.body.iter().map(|(_, i)| i.layer).collect::<Vec<_>>(), [None, Some(0), Some(0), None]);
}

#[test]
fn a_wrong_result_type_parses_and_the_verifier_names_it() {
    let text = print(&tiny("llama", "norm", 1e-6)).replace("embed @embed : f32[8]", "embed @embed : f32[9]");
    let module = parse(&text).unwrap();
    let err = verify(&module).unwrap_err().to_string();
    assert_eq!(err, "%0 = embed: recorded type f32[9] but operands give f32[8]");
}

fn parse_error(text: &str) -> (usize, usize, String) {
    match parse(text) {
        Err(IrError::Parse { line, column, message }) => (line, column, message),
        Err(other) => panic!("expected a parse error, found {other}"),
        Ok(m) => panic!("expected a parse error, parsed:\n{}", print(&m)),
    }
}

const HEADER: &str = "module architecture=llama vocab_size=4 num_layers=1\nweight @w : f32[4, 8]\n";

#[test]
fn parse_errors_name_line_column_and_what_was_expected() {
    let cases: &[(&str, (usize, usize), &str)] = &[
        ("", (1, 1), "expected the header `module architecture=... vocab_size=... num_layers=...`, found the end"),
        ("modul x=1\n", (1, 1), "expected the header `module ...`, found `modul`"),
        ("module architecture=llama vocab_size=x num_layers=1\n", (1, 38), "expected an unsigned 32-bit integer for `vocab_size`, found `x`"),
        ("module architecture=llama num_layers=1\n", (1, 1), "module header: missing attribute `vocab_size` (an unsigned 32-bit integer)"),
        ("module architecture=llama vocab_size=4 num_layers=1 colour=red\n", (1, 53), "unexpected attribute `colour`: module header takes only `architecture`, `vocab_size`, `num_layers`, `bos_token_id`, `eos_token_ids`"),
        ("module architecture=llama vocab_size=4 vocab_size=5 num_layers=1\n", (1, 40), "attribute `vocab_size` given twice (first at line 1, column 27)"),
        ("module architecture=\"llama vocab_size=4\n", (1, 21), "unterminated string: expected a closing `\"`"),
        ("%0 = embed @w : f32[8]\n", (1, 1), "expected the header"),
        ("HEADER%0 = embed @v : f32[8]\n", (3, 12), "weight @v is not declared (declare it with `weight @name : type`)"),
        ("HEADER%0 = silu %1 : f32[8]\n", (3, 11), "value %1 is not defined before this use"),
        ("HEADER%0 = embed @w : f32[8]\n%0 = silu %0 : f32[8]\n", (4, 1), "value %0 defined twice (first at line 3, column 1)"),
        ("HEADER%0 = embed @w f32[8]\n", (3, 15), "unexpected attribute `f32`: embed takes no attributes"),
        ("HEADER%0 = embed @w : f32[8\n", (3, 22), "expected `,` or `]`, found the end of the line"),
        ("HEADER%0 = embed @w : f33[8]\n", (3, 17), "unknown element type `f33`: expected one of f32, bf16, f16, q8_0, q4_0, q4_1"),
        ("HEADER%0 = embed @w : f32[8] extra\n", (3, 24), "expected the end of the line, found `extra`"),
        ("HEADER%0 = embeds @w : f32[8]\n", (3, 6), "unknown op `embeds`"),
        ("HEADER%0 = embed @w\n%1 = matvec @w, %0 : f32[4]\n", (3, 14), "expected `:` before the result type, found the end of the line"),
        ("HEADER%0 = embed @w : f32[8]\n%1 = matvec @w, %0 : f32[4]\n", (4, 6), "`matvec` takes operands `%x, @weight[, @bias]`, found `@weight, %value`"),
        ("HEADER%0 = embed @w : f32[8]\n%1 = rms_norm %0, @w : f32[8]\n", (4, 6), "rms_norm: missing attribute `eps` (a float)"),
        ("HEADER%0 = embed @w : f32[8]\n%1 = rms_norm %0, @w eps=tiny : f32[8]\n", (4, 26), "expected a float for `eps`, found `tiny`"),
        ("HEADER%0 = embed @w : f32[8]\n%1 = silu %0 eps=1 : f32[8]\n", (4, 14), "unexpected attribute `eps`: silu takes no attributes"),
        ("HEADER%0 = embed @w : f32[8]\n%1 = router_topk %0 top_k=2 normalize=yes : routing[8, top2]\n", (4, 39), "`normalize` is a flag and takes no value"),
        ("HEADER%0 = embed @w : f32[8]\n%1 = router_topk %0 top_k=2 : routing[8, two]\n", (4, 42), "expected `topK` (such as `top2`), found `two`"),
        ("HEADER%0 = embed @w : f32[8]\n%1 = rope %0 head_dim=2 theta=1.0 scaling=ntk : f32[8]\n", (4, 43), "unknown rope scaling `ntk`"),
        ("HEADER%0 = embed @w : f32[8]\n%1 = attention %0, %0, %0, #9 heads=1 scale=1.0 : f32[8]\n", (4, 28), "KV cache #9 is not declared"),
        ("HEADERlayer 0 {\n%0 = embed @w : f32[8]\n", (5, 1), "expected `}` closing `layer 0` (opened at line 3, column 1), found the end of the text"),
        ("HEADERlayer 0 {\nlayer 1 {\n", (4, 1), "expected an instruction `%label = ...` or `}` closing the layer block, found `layer`"),
        ("HEADERweight @w : f32[8]\n", (3, 8), "weight @w declared twice (first at line 2, column 8)"),
        ("HEADERweight @x : routing[2, top1]\n", (3, 13), "unknown element type `routing`"),
        ("HEADER%0 = embed @w : f32[8]\noutput %0\noutput %0\n", (5, 1), "a second `output`: the output is already %0"),
        ("HEADERoutput @w\n", (3, 1), "`output` takes a value `%label`"),
        ("HEADER% = embed @w : f32[8]\n", (3, 1), "expected a value label (letters, digits, `_`) after the sigil"),
        ("HEADER%0 = embed @w : f32[8] ! \n", (3, 24), "unexpected character '!'"),
        ("module architecture=\"a\\qb\" vocab_size=4 num_layers=1\n", (1, 23), "unknown escape"),
        ("module architecture=\"a\\u{d800}\" vocab_size=4 num_layers=1\n", (1, 23), "bad unicode escape"),
    ];
    let mut mismatches = String::new();
    for &(text, (line, column), expected) in cases {
        let text = text.replace("HEADER", HEADER);
        let got = parse_error(&text);
        if !(got.0 == line && got.1 == column && got.2.contains(expected)) {
            mismatches += &format!(
                "for {text:?}\nexpected line {line}, column {column}: {expected}\n   found line {}, column {}: {}\n",
                got.0, got.1, got.2
            );
        }
    }
    assert!(mismatches.is_empty(), "{mismatches}");
}

/// A tiny deterministic generator, so the garbling test needs no dependency and never flakes.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Whatever a variant parses to must verify or fail cleanly, and print stably.
fn check_variant(text: &str) {
    if let Ok(module) = parse(text) {
        let _ = verify(&module);
        let printed = print(&module);
        let again = parse(&printed).unwrap_or_else(|e| panic!("reprint of a parsed variant fails: {e}\n{printed}"));
        assert_eq!(print(&again), printed);
    }
}

#[test]
fn parser_never_panics_on_truncated_or_garbled_text() {
    let mut module = common::moe();
    module.weights[waferc_ir::Handle::new(1)].name = "odd \"name\" \u{7}".into();
    module.add_cache(KvCache { layer: 9, kv_heads: 1, head_dim: 2 });
    let text = print(&module);
    let chars: Vec<char> = text.chars().collect();

    for end in 0..=chars.len() {
        check_variant(&chars[..end].iter().collect::<String>());
    }

    let lines: Vec<&str> = text.lines().collect();
    for skip in 0..lines.len() {
        let without: Vec<&str> = lines.iter().enumerate().filter(|&(i, _)| i != skip).map(|(_, l)| *l).collect();
        check_variant(&without.join("\n"));
        let mut swapped = lines.clone();
        swapped.swap(skip, (skip + 1) % lines.len());
        check_variant(&swapped.join("\n"));
    }

    let alphabet: Vec<char> = "%@#\"\\[]{}=,:; \n\t0123456789abcxyz_.-+éNaninf\u{0}".chars().collect();
    let mut rng = SplitMix(0x5eed);
    for _ in 0..3000 {
        let mut garbled = chars.clone();
        for _ in 0..1 + rng.below(3) {
            let at = rng.below(garbled.len());
            match rng.below(3) {
                0 => garbled[at] = alphabet[rng.below(alphabet.len())],
                1 => {
                    garbled.remove(at);
                }
                _ => garbled.insert(at, alphabet[rng.below(alphabet.len())]),
            }
        }
        check_variant(&garbled.iter().collect::<String>());
    }
}

#[test]
fn a_broken_module_still_prints_and_the_text_names_the_problem() {
    let mut m = tiny("llama", "norm", 1e-6);
    m.body[waferc_ir::Handle::new(0)].op = Op::Embed { table: waferc_ir::Handle::new(42) };
    let text = print(&m);
    assert!(text.contains("%0 = embed @\"<missing weight #42>\" : f32[8]\n"), "{text}");
    let (line, _, message) = parse_error(&text);
    assert_eq!(
        (line, message.as_str()),
        (7, "weight @\"<missing weight #42>\" is not declared (declare it with `weight @name : type`)")
    );
}
