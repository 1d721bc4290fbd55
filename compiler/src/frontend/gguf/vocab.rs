//! A tokenizer rebuilt from GGUF metadata (`tokenizer.ggml.*`), the way transformers' GGUF
//! loader builds it (`integrations/gguf/gguf_tokenizer_mapping.py`), so both give the same ids.
//! Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is rebuilt; any other vocabulary needs
//! a `tokenizer.json` beside the file.

use std::collections::BTreeSet;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::container::{GgufFile, MetadataValue};

/// llama.cpp's `token_type` values.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The splits transformers' GGUF loader pairs with `tokenizer.ggml.pre` names
/// (`GGUF_PRE_TOKENIZER_SPLITS`), applied before a regex-free ByteLevel.
const LLAMA3_SPLIT: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const QWEN2_SPLIT: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const TEKKEN_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// How text is split into words before BPE, by `tokenizer.ggml.pre`.
enum PreSplit {
    /// GPT-2's own split, ByteLevel's built-in regex. `smollm` is one of these: transformers gives
    /// it GPT-2's split, and so does SmolLM2's tokenizer.json.
    Gpt2,
    Regex(&'static str),
}

/// `None` for a name we do not know.
fn pre_split(pre: &str) -> Option<PreSplit> {
    Some(match pre {
        "default" | "gpt-2" | "gpt2" | "smollm" => PreSplit::Gpt2,
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" | "dbrx"
        | "smaug-bpe" => PreSplit::Regex(LLAMA3_SPLIT),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => PreSplit::Regex(QWEN2_SPLIT),
        "tekken" => PreSplit::Regex(TEKKEN_SPLIT),
        _ => return None,
    })
}

/// The byte-level BPE tokenizer the metadata describes; `None` when the file has no tokenizer;
/// an error message for one that cannot be rebuilt.
pub(super) fn from_metadata(file: &GgufFile) -> Result<Option<Tokenizer>, String> {
    let Some(model) = file.get("tokenizer.ggml.model") else {
        return Ok(None);
    };
    let fix = "put the model's tokenizer.json beside the GGUF file";
    match model.as_str() {
        Some("gpt2") => {}
        Some(other) => {
            return Err(format!(
                "tokenizer.ggml.model {other:?} cannot be rebuilt from GGUF metadata (only byte-level BPE, \
                 \"gpt2\"); {fix}"
            ))
        }
        None => return Err("tokenizer.ggml.model is not a string".into()),
    }
    let pre = match file.get("tokenizer.ggml.pre") {
        None => "default",
        Some(value) => value.as_str().ok_or("tokenizer.ggml.pre is not a string")?,
    };
    let pre_tokenizer: PreTokenizerWrapper = match pre_split(pre) {
        Some(PreSplit::Gpt2) => ByteLevel::new(false, true, true).into(),
        Some(PreSplit::Regex(regex)) => {
            let split = Split::new(SplitPattern::Regex(regex.into()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| format!("the split regex for tokenizer.ggml.pre {pre:?} does not compile: {e}"))?;
            Sequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into()
        }
        None => return Err(format!("tokenizer.ggml.pre {pre:?} names a pre-tokenizer waferc does not know; {fix}")),
    };

    let tokens = string_array(file, "tokenizer.ggml.tokens")?.ok_or("tokenizer.ggml.tokens is missing")?;
    let merges = string_array(file, "tokenizer.ggml.merges")?.ok_or("tokenizer.ggml.merges is missing")?;
    let token_types = match file.get("tokenizer.ggml.token_type") {
        None => Vec::new(),
        Some(value) => value
            .as_array()
            .and_then(|items| items.iter().map(MetadataValue::as_i64).collect::<Option<Vec<_>>>())
            .ok_or("tokenizer.ggml.token_type is not an array of integers")?,
    };

    let alphabet = byte_alphabet();
    let spelled: BTreeSet<char> = alphabet.iter().copied().collect();
    let in_alphabet = |token: &str| token.chars().all(|c| spelled.contains(&c));
    // Some converters store tokens as raw text rather than in the byte alphabet; respell those.
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, token)| {
            let spelling = if in_alphabet(token) {
                token.to_string()
            } else {
                token.bytes().map(|b| alphabet[b as usize]).collect()
            };
            (spelling, id as u32)
        })
        .collect();
    let merges = merges
        .iter()
        .map(|merge| {
            merge
                .split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| format!("tokenizer.ggml.merges entry {merge:?} is not two tokens separated by a space"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| format!("tokenizer.ggml.tokens/merges do not make a BPE model: {e}"))?;

    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    // Control tokens (`<|im_start|>`) are special and kept whole; user-defined ones (`<think>`)
    // are kept whole but are ordinary text. Like transformers, only tokens spelled in the byte
    // alphabet qualify: a "control" token outside it is a llama.cpp mislabel.
    let typed = |wanted: i64| {
        tokens.iter().zip(&token_types).filter(move |&(token, &ty)| ty == wanted && in_alphabet(token)).map(|(t, _)| t)
    };
    let control: Vec<AddedToken> =
        typed(TOKEN_TYPE_CONTROL).map(|t| AddedToken::from(t.to_string(), true).normalized(false)).collect();
    let user_defined: Vec<AddedToken> =
        typed(TOKEN_TYPE_USER_DEFINED).map(|t| AddedToken::from(t.to_string(), false).normalized(false)).collect();
    tokenizer.add_special_tokens(&control);
    tokenizer.add_tokens(&user_defined);
    Ok(Some(tokenizer))
}

/// An array-of-strings metadata value, `None` when absent.
fn string_array<'a>(file: &'a GgufFile, key: &str) -> Result<Option<Vec<&'a str>>, String> {
    let Some(value) = file.get(key) else {
        return Ok(None);
    };
    value
        .as_array()
        .and_then(|items| items.iter().map(MetadataValue::as_str).collect::<Option<Vec<_>>>())
        .map(Some)
        .ok_or_else(|| format!("{key} is not an array of strings"))
}

/// GPT-2's `bytes_to_unicode`: the printable character that spells each byte.
fn byte_alphabet() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut alphabet = ['\0'; 256];
    let mut next_unprintable = 256u32;
    for b in 0..=255u8 {
        alphabet[b as usize] = if printable(b) {
            char::from(b)
        } else {
            next_unprintable += 1;
            // 256..=323: all Unicode scalar values.
            char::from_u32(next_unprintable - 1).expect("U+0100..U+0143 are characters")
        };
    }
    alphabet
}
