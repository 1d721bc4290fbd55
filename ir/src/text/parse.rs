//! The parser: a recursive descent over the token list, one line per declaration or
//! instruction. Names resolve as they are read, so a use before its definition is an error
//! at the use. Every error names the line, the column and what was expected.

use std::collections::HashMap;

use super::lexer::{tokenize, Pos, Tok};
use crate::arena::Handle;
use crate::error::IrError;
use crate::module::{Instr, KvCache, ModelMeta, Module, Weight};
use crate::op::{Op, Rope, RopeScaling, Value};
use crate::types::{DType, TensorType, ValueType};
use crate::weights::WeightBytes;

/// Parses a module from its text form. Weights get [`WeightBytes::Absent`]. The result is
/// not verified: call [`verify()`](crate::verify()) to check types and shapes.
pub fn parse(text: &str) -> Result<Module, IrError> {
    let tokens = tokenize(text)?;
    let mut parser = Parser {
        tokens,
        at: 0,
        module: Module::default(),
        values: HashMap::new(),
        weights: HashMap::new(),
        caches: HashMap::new(),
        open_layer: None,
    };
    parser.module()?;
    Ok(parser.module)
}

/// An operand as written, resolved to its handle.
enum Operand {
    Value(Value),
    Weight(Handle<Weight>),
    Cache(Handle<KvCache>),
}

enum AttrValue {
    /// A bare word or a quoted string.
    Scalar(String),
    List(Vec<(String, Pos)>),
}

struct Attr {
    key: String,
    pos: Pos,
    value: Option<(AttrValue, Pos)>,
}

/// The attributes of one line. Each lookup removes what it reads and remembers the key, so
/// `finish` can reject leftovers and list what the line accepts.
struct Attrs {
    owner: String,
    owner_pos: Pos,
    items: Vec<Attr>,
    known: Vec<&'static str>,
}

impl Attrs {
    fn take(&mut self, key: &'static str) -> Option<Attr> {
        self.known.push(key);
        let index = self.items.iter().position(|a| a.key == key)?;
        Some(self.items.remove(index))
    }

    fn missing(&self, key: &str, what: &str) -> IrError {
        self.owner_pos.error(format!("{}: missing attribute `{key}` ({what})", self.owner))
    }

    /// The value of `key=value` as a single word or string.
    fn scalar(&mut self, key: &'static str, what: &str) -> Result<Option<(String, Pos)>, IrError> {
        let Some(attr) = self.take(key) else { return Ok(None) };
        match attr.value {
            Some((AttrValue::Scalar(w), pos)) => Ok(Some((w, pos))),
            Some((AttrValue::List(_), pos)) => Err(pos.error(format!("`{key}` takes {what}, not a list"))),
            None => Err(attr.pos.error(format!("expected `=` and {what} after `{key}`"))),
        }
    }

    fn opt_number<T: std::str::FromStr>(&mut self, key: &'static str, what: &str) -> Result<Option<T>, IrError> {
        match self.scalar(key, what)? {
            None => Ok(None),
            Some((word, pos)) => {
                word.parse().map(Some).map_err(|_| pos.error(format!("expected {what} for `{key}`, found `{word}`")))
            }
        }
    }

    fn u32(&mut self, key: &'static str) -> Result<u32, IrError> {
        const WHAT: &str = "an unsigned 32-bit integer";
        self.opt_number(key, WHAT)?.ok_or_else(|| self.missing(key, WHAT))
    }

    fn f32(&mut self, key: &'static str) -> Result<f32, IrError> {
        const WHAT: &str = "a float";
        self.opt_number(key, WHAT)?.ok_or_else(|| self.missing(key, WHAT))
    }

    fn name(&mut self, key: &'static str) -> Result<String, IrError> {
        const WHAT: &str = "a name";
        Ok(self.scalar(key, WHAT)?.ok_or_else(|| self.missing(key, WHAT))?.0)
    }

    fn flag(&mut self, key: &'static str) -> Result<bool, IrError> {
        match self.take(key) {
            None => Ok(false),
            Some(Attr { value: None, .. }) => Ok(true),
            Some(Attr { value: Some((_, pos)), .. }) => Err(pos.error(format!("`{key}` is a flag and takes no value"))),
        }
    }

    fn u32_list(&mut self, key: &'static str) -> Result<Option<Vec<u32>>, IrError> {
        let Some(attr) = self.take(key) else { return Ok(None) };
        match attr.value {
            Some((AttrValue::List(items), _)) => items
                .into_iter()
                .map(|(word, pos)| {
                    word.parse()
                        .map_err(|_| pos.error(format!("expected an unsigned integer in `{key}`, found `{word}`")))
                })
                .collect::<Result<_, _>>()
                .map(Some),
            Some((_, pos)) => Err(pos.error(format!("`{key}` takes a list `[a, b, ...]`"))),
            None => Err(attr.pos.error(format!("expected `=[...]` after `{key}`"))),
        }
    }

    fn finish(self) -> Result<(), IrError> {
        match self.items.first() {
            None => Ok(()),
            Some(extra) => {
                let accepted = if self.known.is_empty() {
                    "no attributes".to_string()
                } else {
                    format!("only {}", self.known.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", "))
                };
                Err(extra.pos.error(format!("unexpected attribute `{}`: {} takes {accepted}", extra.key, self.owner)))
            }
        }
    }
}

struct Parser {
    tokens: Vec<(Tok, Pos)>,
    at: usize,
    module: Module,
    /// Labels as written, to handles. Each map also keeps where the label was defined.
    values: HashMap<String, (Value, Pos)>,
    weights: HashMap<String, (Handle<Weight>, Pos)>,
    caches: HashMap<String, (Handle<KvCache>, Pos)>,
    /// The layer block being read, and where it opened.
    open_layer: Option<(u32, Pos)>,
}

impl Parser {
    fn peek(&self) -> &Tok {
        // The token list always ends with `Eof` and `at` never moves past it.
        self.tokens.get(self.at).map_or(&Tok::Eof, |(t, _)| t)
    }

    fn pos(&self) -> Pos {
        self.tokens.get(self.at).or(self.tokens.last()).map_or(Pos { line: 1, column: 1 }, |(_, p)| *p)
    }

    fn next(&mut self) -> (Tok, Pos) {
        let token = (self.peek().clone(), self.pos());
        if token.0 != Tok::Eof {
            self.at += 1;
        }
        token
    }

    fn unexpected(&self, expected: &str) -> IrError {
        self.pos().error(format!("expected {expected}, found {}", self.peek().describe()))
    }

    /// Consumes the next token if `accept` maps it to something.
    fn take<T>(&mut self, accept: impl Fn(&Tok) -> Option<T>) -> Option<(T, Pos)> {
        let taken = accept(self.peek())?;
        Some((taken, self.next().1))
    }

    fn expect_punct(&mut self, c: char, context: &str) -> Result<(), IrError> {
        if *self.peek() == Tok::Punct(c) {
            self.next();
            Ok(())
        } else {
            Err(self.unexpected(&format!("`{c}` {context}")))
        }
    }

    fn word(&mut self, expected: &str) -> Result<(String, Pos), IrError> {
        self.take(|t| match t {
            Tok::Word(w) => Some(w.clone()),
            _ => None,
        })
        .ok_or_else(|| self.unexpected(expected))
    }

    fn number<T: std::str::FromStr>(&mut self, expected: &str) -> Result<T, IrError> {
        let (word, pos) = self.word(expected)?;
        word.parse().map_err(|_| pos.error(format!("expected {expected}, found `{word}`")))
    }

    fn end_of_line(&mut self) -> Result<(), IrError> {
        match self.peek() {
            Tok::Newline => {
                self.next();
                Ok(())
            }
            Tok::Eof => Ok(()),
            _ => Err(self.unexpected("the end of the line")),
        }
    }

    fn skip_blank_lines(&mut self) {
        while *self.peek() == Tok::Newline {
            self.next();
        }
    }

    fn module(&mut self) -> Result<(), IrError> {
        self.skip_blank_lines();
        self.header()?;
        loop {
            self.skip_blank_lines();
            match self.peek().clone() {
                Tok::Eof => break,
                Tok::Value(label) => {
                    let (_, pos) = self.next();
                    self.instruction(label, pos)?;
                }
                Tok::Punct('}') if self.open_layer.is_some() => {
                    self.next();
                    self.open_layer = None;
                    self.end_of_line()?;
                }
                Tok::Word(w) if self.open_layer.is_none() => match w.as_str() {
                    "weight" => self.weight()?,
                    "kv_cache" => self.cache()?,
                    "layer" => self.layer()?,
                    "output" => self.output()?,
                    _ => return Err(self.unexpected("`weight`, `kv_cache`, `layer`, `output` or an instruction")),
                },
                _ if self.open_layer.is_some() => {
                    return Err(self.unexpected("an instruction `%label = ...` or `}` closing the layer block"));
                }
                _ => return Err(self.unexpected("`weight`, `kv_cache`, `layer`, `output` or an instruction")),
            }
        }
        if let Some((layer, pos)) = self.open_layer {
            return Err(self.unexpected(&format!(
                "`}}` closing `layer {layer}` (opened at line {}, column {})",
                pos.line, pos.column
            )));
        }
        Ok(())
    }

    fn header(&mut self) -> Result<(), IrError> {
        let (keyword, pos) = self.word("the header `module architecture=... vocab_size=... num_layers=...`")?;
        if keyword != "module" {
            return Err(pos.error(format!("expected the header `module ...`, found `{keyword}`")));
        }
        let mut attrs = self.attributes("module header", pos)?;
        let meta = ModelMeta {
            architecture: attrs.name("architecture")?,
            vocab_size: attrs.u32("vocab_size")?,
            num_layers: attrs.u32("num_layers")?,
            bos_token_id: attrs.opt_number("bos_token_id", "an unsigned 32-bit integer")?,
            eos_token_ids: attrs.u32_list("eos_token_ids")?.unwrap_or_default(),
        };
        attrs.finish()?;
        self.module.meta = meta;
        self.end_of_line()
    }

    /// `key=value` and bare flags up to a `:`, the end of the line or the text.
    fn attributes(&mut self, owner: impl Into<String>, owner_pos: Pos) -> Result<Attrs, IrError> {
        let mut attrs = Attrs { owner: owner.into(), owner_pos, items: Vec::new(), known: Vec::new() };
        while let Tok::Word(_) = self.peek() {
            let (key, pos) = self.word("an attribute")?;
            if let Some(first) = attrs.items.iter().find(|a| a.key == key) {
                return Err(pos.error(format!(
                    "attribute `{key}` given twice (first at line {}, column {})",
                    first.pos.line, first.pos.column
                )));
            }
            let value = if *self.peek() == Tok::Punct('=') {
                self.next();
                let value_pos = self.pos();
                let value = match self.peek().clone() {
                    Tok::Word(text) | Tok::Str(text) => {
                        self.next();
                        AttrValue::Scalar(text)
                    }
                    Tok::Punct('[') => {
                        self.next();
                        AttrValue::List(self.list()?)
                    }
                    _ => return Err(self.unexpected(&format!("a value after `{key}=`"))),
                };
                Some((value, value_pos))
            } else {
                None
            };
            attrs.items.push(Attr { key, pos, value });
        }
        Ok(attrs)
    }

    /// Comma-separated words up to `]`, the `[` already consumed.
    fn list(&mut self) -> Result<Vec<(String, Pos)>, IrError> {
        let mut items = Vec::new();
        if *self.peek() == Tok::Punct(']') {
            self.next();
            return Ok(items);
        }
        loop {
            items.push(self.word("a list element")?);
            match self.peek() {
                Tok::Punct(',') => {
                    self.next();
                }
                Tok::Punct(']') => {
                    self.next();
                    return Ok(items);
                }
                _ => return Err(self.unexpected("`,` or `]`")),
            }
        }
    }

    fn tensor_type(&mut self) -> Result<TensorType, IrError> {
        let (name, pos) = self.word("a tensor type such as `f32[64]`")?;
        let dtype = DType::from_name(&name).ok_or_else(|| {
            let known: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
            pos.error(format!("unknown element type `{name}`: expected one of {}", known.join(", ")))
        })?;
        self.expect_punct('[', "opening the shape")?;
        let shape = self
            .list()?
            .into_iter()
            .map(|(dim, pos)| dim.parse().map_err(|_| pos.error(format!("expected a dimension, found `{dim}`"))))
            .collect::<Result<Vec<u64>, _>>()?;
        Ok(TensorType { shape, dtype })
    }

    fn value_type(&mut self) -> Result<ValueType, IrError> {
        if *self.peek() != Tok::Word("routing".into()) {
            return Ok(ValueType::Tensor(self.tensor_type()?));
        }
        self.next();
        self.expect_punct('[', "after `routing`")?;
        let experts = self.number("the expert count")?;
        self.expect_punct(',', "after the expert count")?;
        let (top, pos) = self.word("`topK`, the experts chosen")?;
        let top_k = top
            .strip_prefix("top")
            .and_then(|k| k.parse().ok())
            .ok_or_else(|| pos.error(format!("expected `topK` (such as `top2`), found `{top}`")))?;
        self.expect_punct(']', "closing the routing type")?;
        Ok(ValueType::Routing { experts, top_k })
    }

    fn weight(&mut self) -> Result<(), IrError> {
        self.next();
        let (name, pos) = self
            .take(|t| match t {
                Tok::Weight(name) => Some(name.clone()),
                _ => None,
            })
            .ok_or_else(|| self.unexpected("a weight name `@name`"))?;
        if let Some((_, first)) = self.weights.get(&name) {
            return Err(pos.error(format!(
                "weight @{} declared twice (first at line {}, column {})",
                super::quote_if_needed(&name),
                first.line,
                first.column
            )));
        }
        self.expect_punct(':', "before the weight's type")?;
        let ty = self.tensor_type()?;
        self.end_of_line()?;
        let handle = self.module.add_weight(name.clone(), ty, WeightBytes::Absent);
        self.weights.insert(name, (handle, pos));
        Ok(())
    }

    fn cache(&mut self) -> Result<(), IrError> {
        let (_, keyword_pos) = self.next();
        let (label, pos) = self
            .take(|t| match t {
                Tok::Cache(label) => Some(label.clone()),
                _ => None,
            })
            .ok_or_else(|| self.unexpected("a cache label `#N`"))?;
        if let Some((_, first)) = self.caches.get(&label) {
            return Err(pos.error(format!(
                "KV cache #{label} declared twice (first at line {}, column {})",
                first.line, first.column
            )));
        }
        let mut attrs = self.attributes("kv_cache", keyword_pos)?;
        let cache =
            KvCache { layer: attrs.u32("layer")?, kv_heads: attrs.u32("kv_heads")?, head_dim: attrs.u32("head_dim")? };
        attrs.finish()?;
        self.end_of_line()?;
        let handle = self.module.add_cache(cache);
        self.caches.insert(label, (handle, pos));
        Ok(())
    }

    fn layer(&mut self) -> Result<(), IrError> {
        let (_, pos) = self.next();
        let layer = self.number("the layer index")?;
        self.expect_punct('{', "opening the layer block")?;
        self.end_of_line()?;
        self.open_layer = Some((layer, pos));
        Ok(())
    }

    fn output(&mut self) -> Result<(), IrError> {
        let (_, pos) = self.next();
        if let Some(previous) = self.module.output {
            return Err(pos.error(format!("a second `output`: the output is already %{}", previous.index())));
        }
        let Operand::Value(value) = self.operand()? else {
            return Err(pos.error("`output` takes a value `%label`"));
        };
        self.module.output = Some(value);
        self.end_of_line()
    }

    /// One `%value`, `@weight` or `#cache`, resolved.
    fn operand(&mut self) -> Result<Operand, IrError> {
        if !matches!(self.peek(), Tok::Value(_) | Tok::Weight(_) | Tok::Cache(_)) {
            return Err(self.unexpected("an operand `%value`, `@weight` or `#cache`"));
        }
        match self.next() {
            (Tok::Value(label), pos) => match self.values.get(&label) {
                Some((value, _)) => Ok(Operand::Value(*value)),
                None => Err(pos.error(format!("value %{label} is not defined before this use"))),
            },
            (Tok::Weight(name), pos) => match self.weights.get(&name) {
                Some((weight, _)) => Ok(Operand::Weight(*weight)),
                None => Err(pos.error(format!(
                    "weight @{} is not declared (declare it with `weight @name : type`)",
                    super::quote_if_needed(&name)
                ))),
            },
            (Tok::Cache(label), pos) => match self.caches.get(&label) {
                Some((cache, _)) => Ok(Operand::Cache(*cache)),
                None => Err(pos.error(format!("KV cache #{label} is not declared"))),
            },
            (other, pos) => Err(pos.error(format!("expected an operand, found {}", other.describe()))),
        }
    }

    /// The rest of an instruction whose `%label` has been read.
    fn instruction(&mut self, label: String, label_pos: Pos) -> Result<(), IrError> {
        if let Some((_, first)) = self.values.get(&label) {
            return Err(label_pos.error(format!(
                "value %{label} defined twice (first at line {}, column {})",
                first.line, first.column
            )));
        }
        self.expect_punct('=', &format!("after %{label}"))?;
        let (name, op_pos) = self.word("an op name")?;

        let mut operands = Vec::new();
        if matches!(self.peek(), Tok::Value(_) | Tok::Weight(_) | Tok::Cache(_)) {
            operands.push(self.operand()?);
            while *self.peek() == Tok::Punct(',') {
                self.next();
                operands.push(self.operand()?);
            }
        }
        let mut attrs = self.attributes(name.clone(), op_pos)?;
        let op = build_op(&name, op_pos, &operands, &mut attrs)?;
        attrs.finish()?;
        self.expect_punct(':', "before the result type")?;
        let ty = self.value_type()?;
        self.end_of_line()?;

        let value = self.module.body.append(Instr { op, ty, layer: self.open_layer.map(|(layer, _)| layer) });
        self.values.insert(label, (value, label_pos));
        Ok(())
    }
}

/// The op `name` from its resolved operands and attributes.
fn build_op(name: &str, pos: Pos, operands: &[Operand], attrs: &mut Attrs) -> Result<Op, IrError> {
    use Operand::{Cache as C, Value as V, Weight as W};
    let signature = |expected: &str| {
        pos.error(format!("`{name}` takes operands `{expected}`, found {}", describe_operands(operands)))
    };
    let op = match name {
        "embed" => match operands {
            [W(table)] => Op::Embed { table: *table },
            _ => return Err(signature("@table")),
        },
        "rms_norm" => match operands {
            [V(x), W(weight)] => Op::RmsNorm { x: *x, weight: *weight, eps: attrs.f32("eps")? },
            _ => return Err(signature("%x, @weight")),
        },
        "matvec" => match operands {
            [V(x), W(weight)] => Op::MatVec { x: *x, weight: *weight, bias: None },
            [V(x), W(weight), W(bias)] => Op::MatVec { x: *x, weight: *weight, bias: Some(*bias) },
            _ => return Err(signature("%x, @weight[, @bias]")),
        },
        "rope" => match operands {
            [V(x)] => Op::Rope { x: *x, head_dim: attrs.u32("head_dim")?, rope: rope(attrs)? },
            _ => return Err(signature("%x")),
        },
        "attention" => match operands {
            [V(q), V(k), V(v), sinks @ .., C(cache)] if sinks.len() <= 1 => Op::Attention {
                q: *q,
                k: *k,
                v: *v,
                cache: *cache,
                heads: attrs.u32("heads")?,
                scale: attrs.f32("scale")?,
                window: attrs.opt_number("window", "an unsigned 32-bit integer")?,
                sinks: match sinks {
                    [] => None,
                    [W(sinks)] => Some(*sinks),
                    _ => return Err(signature("%q, %k, %v[, @sinks], #cache")),
                },
            },
            _ => return Err(signature("%q, %k, %v[, @sinks], #cache")),
        },
        "silu" => match operands {
            [V(x)] => Op::Silu { x: *x },
            _ => return Err(signature("%x")),
        },
        "mul" | "add" => match operands {
            [V(a), V(b)] if name == "mul" => Op::Mul { a: *a, b: *b },
            [V(a), V(b)] => Op::Add { a: *a, b: *b },
            _ => return Err(signature("%a, %b")),
        },
        "swiglu" => match operands {
            [V(gate), V(up)] => {
                Op::SwiGlu { gate: *gate, up: *up, alpha: attrs.f32("alpha")?, limit: attrs.f32("limit")? }
            }
            _ => return Err(signature("%gate, %up")),
        },
        "router_topk" => match operands {
            [V(logits)] => {
                Op::RouterTopK { logits: *logits, top_k: attrs.u32("top_k")?, normalize: attrs.flag("normalize")? }
            }
            _ => return Err(signature("%logits")),
        },
        "expert_dispatch" => match operands {
            [V(x), V(routing)] => Op::ExpertDispatch { x: *x, routing: *routing, expert: attrs.u32("expert")? },
            _ => return Err(signature("%x, %routing")),
        },
        "expert_combine" => match operands {
            [V(routing), experts @ ..] => {
                let experts = experts
                    .iter()
                    .map(|e| match e {
                        V(value) => Ok(*value),
                        _ => Err(signature("%routing, %expert0, %expert1, ...")),
                    })
                    .collect::<Result<_, _>>()?;
                Op::ExpertCombine { routing: *routing, experts }
            }
            _ => return Err(signature("%routing, %expert0, %expert1, ...")),
        },
        "slice" => match operands {
            [V(x)] => Op::Slice { x: *x, offset: attrs.u32("offset")?, len: attrs.u32("len")? },
            _ => return Err(signature("%x")),
        },
        _ => {
            return Err(pos.error(format!(
                "unknown op `{name}`: expected one of embed, rms_norm, matvec, rope, attention, silu, mul, add, \
                 swiglu, router_topk, expert_dispatch, expert_combine, slice"
            )))
        }
    };
    Ok(op)
}

fn rope(attrs: &mut Attrs) -> Result<Rope, IrError> {
    let theta = attrs.f32("theta")?;
    let scaling = match attrs.scalar("scaling", "`linear`, `llama3` or `yarn`")? {
        None => RopeScaling::None,
        Some((kind, _)) if kind == "linear" => RopeScaling::Linear { factor: attrs.f32("factor")? },
        Some((kind, _)) if kind == "llama3" => RopeScaling::Llama3 {
            factor: attrs.f32("factor")?,
            low_freq_factor: attrs.f32("low_freq_factor")?,
            high_freq_factor: attrs.f32("high_freq_factor")?,
            original_max_position: attrs.u32("original_max_position")?,
        },
        Some((kind, _)) if kind == "yarn" => RopeScaling::Yarn {
            factor: attrs.f32("factor")?,
            beta_fast: attrs.f32("beta_fast")?,
            beta_slow: attrs.f32("beta_slow")?,
            original_max_position: attrs.u32("original_max_position")?,
            truncate: attrs.flag("truncate")?,
        },
        Some((kind, pos)) => {
            return Err(pos.error(format!("unknown rope scaling `{kind}`: expected `linear`, `llama3` or `yarn`")))
        }
    };
    Ok(Rope { theta, scaling })
}

fn describe_operands(operands: &[Operand]) -> String {
    if operands.is_empty() {
        return "none".into();
    }
    let kinds: Vec<&str> = operands
        .iter()
        .map(|o| match o {
            Operand::Value(_) => "%value",
            Operand::Weight(_) => "@weight",
            Operand::Cache(_) => "#cache",
        })
        .collect();
    format!("`{}`", kinds.join(", "))
}
