//! Tokens of the text form. Every declaration and instruction is one line, so newlines are
//! tokens; other whitespace only separates tokens, and `;` starts a comment that runs to the
//! end of the line.

use crate::error::IrError;

/// A 1-based line and column (in characters), for error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Pos {
    pub line: usize,
    pub column: usize,
}

impl Pos {
    pub fn error(self, message: impl Into<String>) -> IrError {
        IrError::Parse { line: self.line, column: self.column, message: message.into() }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Tok {
    /// `%label`: an SSA value.
    Value(String),
    /// `@name` or `@"quoted name"`: a weight.
    Weight(String),
    /// `#label`: a KV cache.
    Cache(String),
    /// A bare word: keyword, op name, attribute key, number, dtype.
    Word(String),
    /// A `"quoted string"` (with escapes resolved).
    Str(String),
    Punct(char),
    Newline,
    Eof,
}

impl Tok {
    /// How the token reads in an error message.
    pub fn describe(&self) -> String {
        match self {
            Tok::Value(v) => format!("`%{v}`"),
            Tok::Weight(w) => format!("`@{}`", super::quote_if_needed(w)),
            Tok::Cache(c) => format!("`#{c}`"),
            Tok::Word(w) => format!("`{w}`"),
            Tok::Str(s) => format!("`{}`", super::quote(s)),
            Tok::Punct(c) => format!("`{c}`"),
            Tok::Newline => "the end of the line".into(),
            Tok::Eof => "the end of the text".into(),
        }
    }
}

/// Characters of a bare word. Includes `+` and `-` so that every float `{:?}` prints
/// (`1e-6`, `-0.0`, `inf`, `NaN`) is a single word.
pub(super) fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '+')
}

fn is_label_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

struct Cursor<'a> {
    chars: std::iter::Peekable<std::str::Chars<'a>>,
    pos: Pos,
}

impl Cursor<'_> {
    fn peek(&mut self) -> Option<char> {
        self.chars.peek().copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.chars.next()?;
        if c == '\n' {
            self.pos.line += 1;
            self.pos.column = 1;
        } else {
            self.pos.column += 1;
        }
        Some(c)
    }

    fn take_while(&mut self, accept: impl Fn(char) -> bool) -> String {
        let mut out = String::new();
        while let Some(c) = self.peek().filter(|&c| accept(c)) {
            out.push(c);
            self.bump();
        }
        out
    }

    /// A label after a sigil (`%`, `#`); `what` names the sigil's meaning for the error.
    fn label(&mut self, sigil_pos: Pos, what: &str) -> Result<String, IrError> {
        let label = self.take_while(is_label_char);
        if label.is_empty() {
            return Err(sigil_pos.error(format!("expected a {what} label (letters, digits, `_`) after the sigil")));
        }
        Ok(label)
    }

    /// The body of a quoted string, the opening quote already consumed.
    fn string(&mut self, open: Pos) -> Result<String, IrError> {
        let mut out = String::new();
        loop {
            let at = self.pos;
            match self.bump() {
                None | Some('\n') => return Err(open.error("unterminated string: expected a closing `\"`")),
                Some('"') => return Ok(out),
                Some('\\') => match self.bump() {
                    Some('"') => out.push('"'),
                    Some('\\') => out.push('\\'),
                    Some('n') => out.push('\n'),
                    Some('t') => out.push('\t'),
                    Some('r') => out.push('\r'),
                    Some('u') => out.push(self.unicode_escape(at)?),
                    _ => {
                        return Err(at.error("unknown escape: expected one of \\\" \\\\ \\n \\t \\r \\u{hex}"));
                    }
                },
                Some(c) => out.push(c),
            }
        }
    }

    /// `{hex}` after `\u`.
    fn unicode_escape(&mut self, at: Pos) -> Result<char, IrError> {
        let bad = || at.error("bad unicode escape: expected \\u{hex} naming a character");
        if self.bump() != Some('{') {
            return Err(bad());
        }
        let hex = self.take_while(|c| c.is_ascii_hexdigit());
        if self.bump() != Some('}') || hex.is_empty() || hex.len() > 6 {
            return Err(bad());
        }
        u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32).ok_or_else(bad)
    }
}

pub(super) fn tokenize(text: &str) -> Result<Vec<(Tok, Pos)>, IrError> {
    let mut cur = Cursor { chars: text.chars().peekable(), pos: Pos { line: 1, column: 1 } };
    let mut tokens = Vec::new();
    loop {
        let pos = cur.pos;
        let Some(c) = cur.peek() else {
            tokens.push((Tok::Eof, pos));
            return Ok(tokens);
        };
        let tok = match c {
            '\n' => {
                cur.bump();
                Tok::Newline
            }
            c if c.is_whitespace() => {
                cur.bump();
                continue;
            }
            ';' => {
                cur.take_while(|c| c != '\n');
                continue;
            }
            '%' => {
                cur.bump();
                Tok::Value(cur.label(pos, "value")?)
            }
            '#' => {
                cur.bump();
                Tok::Cache(cur.label(pos, "KV cache")?)
            }
            '@' => {
                cur.bump();
                if cur.peek() == Some('"') {
                    let open = cur.pos;
                    cur.bump();
                    Tok::Weight(cur.string(open)?)
                } else {
                    let name = cur.take_while(is_word_char);
                    if name.is_empty() {
                        return Err(pos.error("expected a weight name after `@` (bare, or quoted with `\"`)"));
                    }
                    Tok::Weight(name)
                }
            }
            '"' => {
                cur.bump();
                Tok::Str(cur.string(pos)?)
            }
            '=' | ',' | ':' | '[' | ']' | '{' | '}' => {
                cur.bump();
                Tok::Punct(c)
            }
            c if is_word_char(c) => Tok::Word(cur.take_while(is_word_char)),
            other => return Err(pos.error(format!("unexpected character {other:?}"))),
        };
        tokens.push((tok, pos));
    }
}
