//! Text in and out of a generative model: its tokenizer (Hugging Face's `tokenizer.json`
//! through the `tokenizers` crate, or a GGUF file's embedded vocabulary turned into the
//! same kind of tokenizer), its chat template (Jinja, through `minijinja`), and the
//! pieces the scheduler streams text with: [`Detokenizer`] never splits a UTF-8
//! character, [`StopStrings`] finds stop strings and holds back text that may become one.
//!
//! Everything here is read from files a user supplies: a bad file is INVALID_ARGUMENT
//! naming the file and what is wrong, a vocabulary kind we cannot reproduce exactly is
//! UNSUPPORTED naming it — never a tokenizer that silently differs from the model's own.

use super::gguf::{Gguf, Value};
use crate::folder::Folder;
use crate::status::{Error, Result};
use serde_json::Value as Json;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

/// Llama 3's (numbers in groups of up to three, case-insensitive contractions).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's (as Llama 3's, digits one by one).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Control tokens that end a turn in the chat formats in use.
const END_OF_TURN: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
];

/// A model's tokenizer and chat template.
pub struct TextCodec {
    tok: Tokenizer,
    /// Prepended to plain text when the vocabulary asks for it (GGUF's
    /// `tokenizer.ggml.add_bos_token`; a `tokenizer.json` does this in its post-processor).
    add_bos: Option<u32>,
    bos_token: String,
    eos_token: String,
    /// The chat template, or why it does not compile (the model still serves ids and
    /// plain text; requests that ask for the template are refused with the reason).
    template: Option<std::result::Result<minijinja::Environment<'static>, String>>,
    /// The tokenizer's own end-of-generation tokens (GGUF's eos/eot/eom ids).
    pub eos_ids: Vec<u32>,
    /// Where the tokenizer came from, for the log.
    pub source: String,
}

/// What a version folder offers for text: a tokenizer, or why there is none.
pub enum TextSource {
    Ready(Box<TextCodec>),
    Missing(String),
}

impl TextCodec {
    /// The tokenizer of a version folder: the `.gguf` file's vocabulary, else
    /// `tokenizer.json` (with `tokenizer_config.json` and `chat_template.jinja` when
    /// present). A folder without either has no text (token ids only); a tokenizer that is
    /// there but cannot be reproduced is an error.
    pub fn load(dir: &Folder) -> Result<TextSource> {
        if let Some(path) = super::llama::gguf_in(dir)? {
            let g = Gguf::open(&path)?;
            return TextCodec::from_gguf(&g);
        }
        if !dir.has_file("tokenizer.json") {
            return Ok(TextSource::Missing(format!(
                "{} has no tokenizer.json",
                dir.path().display()
            )));
        }
        TextCodec::from_hf(dir).map(|t| TextSource::Ready(Box::new(t)))
    }

    /// The vocabulary of a GGUF file.
    pub fn load_gguf(path: &std::path::Path) -> Result<TextSource> {
        TextCodec::from_gguf(&Gguf::open(path)?)
    }

    /// Whether a version folder holds a tokenizer we can use (for config completion).
    pub fn available(dir: &Folder) -> bool {
        matches!(TextCodec::load(dir), Ok(TextSource::Ready(_)))
    }

    /// A Hugging Face folder's `tokenizer.json`, `tokenizer_config.json` (special tokens,
    /// chat template) and `chat_template.jinja`.
    pub fn from_hf(dir: &Folder) -> Result<TextCodec> {
        let path = dir.file("tokenizer.json", "tokenizer")?;
        let shown = path.display().to_string();
        let bytes = dir.read("tokenizer.json", "tokenizer")?;
        let tok = Tokenizer::from_bytes(&bytes).map_err(|e| {
            Error::invalid(format!("{shown}: not a tokenizer this library reads: {e}"))
        })?;
        let mut bos_token = String::new();
        let mut eos_token = String::new();
        let mut template = None;
        if dir.has_file("tokenizer_config.json") {
            let at = dir
                .path()
                .join("tokenizer_config.json")
                .display()
                .to_string();
            let text = dir.read("tokenizer_config.json", "tokenizer config")?;
            let j: Json = serde_json::from_slice(&text)
                .map_err(|e| Error::invalid(format!("{at}: not valid JSON: {e}")))?;
            let special = |k: &str| match j.get(k) {
                Some(Json::String(s)) => s.clone(),
                Some(Json::Object(o)) => o
                    .get("content")
                    .and_then(Json::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                _ => String::new(),
            };
            bos_token = special("bos_token");
            eos_token = special("eos_token");
            template = match j.get("chat_template") {
                None | Some(Json::Null) => None,
                Some(Json::String(s)) => Some(s.clone()),
                // A list of named templates: the one named "default".
                Some(Json::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Json::as_str)
                    .map(str::to_owned),
                Some(other) => {
                    return Err(Error::invalid(format!(
                        "{at}: chat_template is {other}, not a string or a list of named templates"
                    )))
                }
            };
        }
        if dir.has_file("chat_template.jinja") {
            let text = dir.read("chat_template.jinja", "chat template")?;
            template = Some(String::from_utf8(text).map_err(|_| {
                Error::invalid(format!(
                    "{}: not UTF-8 text",
                    dir.path().join("chat_template.jinja").display()
                ))
            })?);
        }
        let template = template.map(|t| compile_template(t, &shown).map_err(|e| e.message));
        Ok(TextCodec {
            tok,
            add_bos: None,
            bos_token,
            eos_token,
            template,
            eos_ids: Vec::new(),
            source: shown,
        })
    }

    /// A GGUF file's vocabulary (`tokenizer.ggml.*`) as the tokenizer llama.cpp builds from
    /// it. Byte-level BPE (`model` "gpt2") with the pre-tokenizers "default", "gpt-2",
    /// "llama-bpe" (Llama 3), "qwen2" and "smollm"; anything else is UNSUPPORTED text.
    pub(crate) fn from_gguf(g: &Gguf) -> Result<TextSource> {
        let at = &g.path;
        let model = match g.get("tokenizer.ggml.model").and_then(Value::as_str) {
            None => {
                return Ok(TextSource::Missing(format!(
                    "{at} has no tokenizer (tokenizer.ggml.model is missing)"
                )))
            }
            Some(m) => m,
        };
        let strings = |key: &str| gguf_strings(g, key);
        let flag = |key: &str, default: bool| match g.get(key) {
            Some(Value::Bool(b)) => *b,
            _ => default,
        };
        let (mut tok, tokens, types, kind) = match model {
            "gpt2" => {
                let pre = g
                    .get("tokenizer.ggml.pre")
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                let tokens = strings("tokenizer.ggml.tokens")?;
                let types = token_types(g, tokens.len())?;
                match byte_level_bpe(g, &tokens, pre)? {
                    Ok(tok) => (
                        tok,
                        tokens,
                        types,
                        format!("byte-level BPE, pre-tokenizer \"{pre}\""),
                    ),
                    Err(why) => return Ok(TextSource::Missing(format!("{at}: {why}"))),
                }
            }
            "llama" => {
                let tokens = strings("tokenizer.ggml.tokens")?;
                let types = token_types(g, tokens.len())?;
                let space = flag("tokenizer.ggml.add_space_prefix", true);
                let tok = sentencepiece_bpe(g, &tokens, &types, space)?;
                (tok, tokens, types, "SentencePiece BPE".to_owned())
            }
            other => {
                return Ok(TextSource::Missing(format!(
                    "{at}: tokenizer.ggml.model \"{other}\" is not supported (\"gpt2\", byte-level BPE, and \"llama\", SentencePiece BPE, are); send token ids"
                )))
            }
        };
        // Control tokens (3) are special: matched in text, left out of decoded text;
        // user-defined ones (4) are matched in text and kept.
        let added = |kind: u64, special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .zip(&types)
                .filter(|(_, &t)| t == kind)
                .map(|(s, _)| AddedToken::from(*s, special).normalized(false))
                .collect()
        };
        let mut specials = added(3, true);
        specials.extend(added(2, true));
        tok.add_special_tokens(specials)
            .map_err(|e| Error::internal(format!("{at}: control tokens: {e}")))?;
        tok.add_tokens(added(4, false))
            .map_err(|e| Error::internal(format!("{at}: user-defined tokens: {e}")))?;
        let id = |k: &str| {
            g.get(&format!("tokenizer.ggml.{k}"))
                .and_then(Value::as_u64)
                .and_then(|i| u32::try_from(i).ok())
                .filter(|&i| (i as usize) < tokens.len())
        };
        let name = |i: Option<u32>| {
            i.and_then(|i| tokens.get(i as usize))
                .map(|s| (*s).to_owned())
                .unwrap_or_default()
        };
        let bos = id("bos_token_id");
        // SentencePiece vocabularies add BOS unless they say otherwise, as llama.cpp does.
        let add_bos = flag("tokenizer.ggml.add_bos_token", model == "llama");
        let mut eos_ids: Vec<u32> = ["eos_token_id", "eot_token_id", "eom_token_id"]
            .into_iter()
            .filter_map(id)
            .collect();
        // Control tokens that end a turn end generation too, as llama.cpp finds them by
        // their text when a file does not name them.
        for (i, (t, &kind)) in tokens.iter().zip(&types).enumerate() {
            if kind == 3 && END_OF_TURN.contains(t) && !eos_ids.contains(&(i as u32)) {
                eos_ids.push(i as u32);
            }
        }
        eos_ids.dedup();
        let template = match g.get("tokenizer.chat_template") {
            Some(Value::Str(s)) => Some(compile_template(s.clone(), at).map_err(|e| e.message)),
            _ => None,
        };
        Ok(TextSource::Ready(Box::new(TextCodec {
            tok,
            add_bos: if add_bos { bos } else { None },
            bos_token: name(bos),
            eos_token: name(id("eos_token_id")),
            template,
            eos_ids,
            source: format!("{at} ({kind}, {} tokens)", tokens.len()),
        })))
    }

    /// The token ids of `text`; `add_special` adds what the tokenizer adds to a plain
    /// prompt (a BOS token, for most).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .tok
            .encode_fast(text, add_special)
            .map_err(|e| Error::invalid(format!("cannot tokenize the text: {e}")))?;
        let ids = enc.get_ids();
        let mut out = Vec::with_capacity(ids.len() + 1);
        if let (true, Some(b)) = (add_special, self.add_bos) {
            if ids.first() != Some(&b) {
                out.push(b);
            }
        }
        out.extend_from_slice(ids);
        Ok(out)
    }

    /// The text of `ids`; special tokens are left out when `skip_special`. Ids the
    /// tokenizer does not know decode to nothing.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        self.tok.decode(ids, skip_special).unwrap_or_default()
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Why the model's chat template cannot be used, if it has one that does not compile.
    pub fn chat_template_error(&self) -> Option<&str> {
        match &self.template {
            Some(Err(why)) => Some(why),
            _ => None,
        }
    }

    /// Renders the model's chat template over `messages` (a JSON array of objects with
    /// `role` and `content`), ending with the assistant's turn opened
    /// (`add_generation_prompt`).
    pub fn apply_chat_template(&self, messages: &Json) -> Result<String> {
        let env = match &self.template {
            None => return Err(Error::invalid("the model has no chat template (tokenizer_config.json chat_template, chat_template.jinja or GGUF tokenizer.chat_template)")),
            Some(Err(why)) => return Err(Error::invalid(why.clone())),
            Some(Ok(env)) => env,
        };
        let list = messages.as_array().ok_or_else(|| {
            Error::invalid(
                "the chat messages must be a JSON array of {\"role\", \"content\"} objects",
            )
        })?;
        for (i, m) in list.iter().enumerate() {
            let ok = m.get("role").is_some_and(Json::is_string) && m.get("content").is_some();
            if !ok {
                return Err(Error::invalid(format!(
                    "chat message {i} must be an object with a string \"role\" and a \"content\""
                )));
            }
        }
        let t = env
            .get_template("chat")
            .map_err(|e| Error::internal(format!("chat template: {e}")))?;
        let ctx = minijinja::Value::from(std::collections::BTreeMap::from([
            ("messages", to_jinja(messages)),
            ("add_generation_prompt", minijinja::Value::from(true)),
            ("bos_token", minijinja::Value::from(self.bos_token.clone())),
            ("eos_token", minijinja::Value::from(self.eos_token.clone())),
        ]));
        t.render(ctx)
            .map_err(|e| Error::invalid(format!("the chat template failed: {}", describe(&e))))
    }
}

/// A metadata array of strings.
fn gguf_strings<'g>(g: &'g Gguf, key: &str) -> Result<Vec<&'g str>> {
    let at = &g.path;
    match g.get(key) {
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .ok_or_else(|| Error::invalid(format!("{at}: {key}[{i}] is not a string")))
            })
            .collect(),
        Some(_) => Err(Error::invalid(format!("{at}: {key} is not an array"))),
        None => Err(Error::invalid(format!("{at}: {key} is missing"))),
    }
}

/// Token to id; a token listed twice keeps its first id.
fn vocab_of(tokens: &[&str]) -> Vocab {
    let mut vocab = Vocab::default();
    for (i, t) in tokens.iter().enumerate() {
        vocab.entry((*t).to_owned()).or_insert(i as u32);
    }
    vocab
}

/// `tokenizer.ggml.token_type`, one per token (1, normal, where the file has none).
fn token_types(g: &Gguf, n: usize) -> Result<Vec<u64>> {
    match g.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) if a.len() == n => {
            Ok(a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
        }
        Some(_) => Err(Error::invalid(format!(
            "{}: tokenizer.ggml.token_type is not an array of {n} integers",
            g.path
        ))),
        None => Ok(vec![1; n]),
    }
}

/// Byte-level BPE from the file's tokens and merges, split before BPE as llama.cpp's
/// pre-tokenizer `pre` splits; Err(why) for a pre-tokenizer not reproduced here.
fn byte_level_bpe(
    g: &Gguf,
    tokens: &[&str],
    pre: &str,
) -> Result<std::result::Result<Tokenizer, String>> {
    let at = &g.path;
    let (split, nfc, ignore_merges) = match pre {
        "default" | "gpt-2" | "gpt2" => (None, false, false),
        "llama-bpe" | "llama3" => (Some(LLAMA3_SPLIT), false, true),
        "qwen2" => (Some(QWEN2_SPLIT), true, false),
        // Digits one by one, then GPT-2's split.
        "smollm" => (None, false, false),
        other => {
            return Ok(Err(format!(
                "tokenizer.ggml.pre \"{other}\" is not supported (default, gpt-2, llama-bpe, qwen2 and smollm are); send token ids"
            )))
        }
    };
    let merges_raw = gguf_strings(g, "tokenizer.ggml.merges")?;
    let vocab = vocab_of(tokens);
    let mut merges: Merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        let (a, b) = m.split_once(' ').ok_or_else(|| {
            Error::invalid(format!(
                "{at}: tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by a space"
            ))
        })?;
        merges.push((a.to_owned(), b.to_owned()));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| Error::invalid(format!("{at}: the BPE vocabulary is not valid: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    let byte_level = |use_regex| ByteLevel::new(false, false, use_regex);
    let split_on = |pattern: &str| -> Result<PreTokenizerWrapper> {
        Split::new(
            SplitPattern::Regex(pattern.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map(Into::into)
        .map_err(|e| Error::internal(format!("pre-tokenizer for \"{pre}\": {e}")))
    };
    let pre_tokenizer: PreTokenizerWrapper = match (pre, split) {
        ("smollm", _) => Sequence::new(vec![split_on(r"\p{N}")?, byte_level(true).into()]).into(),
        (_, Some(pattern)) => {
            Sequence::new(vec![split_on(pattern)?, byte_level(false).into()]).into()
        }
        (_, None) => byte_level(true).into(),
    };
    tok.with_pre_tokenizer(Some(pre_tokenizer));
    if nfc {
        tok.with_normalizer(Some(NFC))
            .map_err(|e| Error::internal(format!("normalizer: {e}")))?;
    }
    tok.with_decoder(Some(ByteLevel::default()));
    Ok(Ok(tok))
}

/// SentencePiece BPE (`tokenizer.ggml.model` "llama": Llama 2, Mistral, TinyLlama) as
/// llama.cpp tokenizes it: spaces become `▁` (one is put before the text and after every
/// special token when `space_prefix`), then adjacent pieces merge while their join is in
/// the vocabulary, the join with the highest score first; a character without a piece
/// becomes its `<0xNN>` byte pieces. The merges are derived from the pieces' scores.
fn sentencepiece_bpe(
    g: &Gguf,
    tokens: &[&str],
    types: &[u64],
    space_prefix: bool,
) -> Result<Tokenizer> {
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::sequence::Sequence as Decoders;
    use tokenizers::decoders::strip::Strip;
    use tokenizers::normalizers::{Prepend, Replace, Sequence as Normalizers};
    use tokenizers::{DecoderWrapper, NormalizerWrapper};
    let at = &g.path;
    let scores: Vec<f32> = match g.get("tokenizer.ggml.scores") {
        Some(Value::Array(a)) if a.len() == tokens.len() => {
            a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect()
        }
        _ => {
            return Err(Error::invalid(format!(
                "{at}: tokenizer.ggml.scores is missing or not {} numbers",
                tokens.len()
            )))
        }
    };
    let vocab = vocab_of(tokens);
    // Every way a normal piece splits into two pieces is a merge, ranked by the piece's
    // score (then by ids, for one order).
    let mut ranked: Vec<(f32, u32, u32, u32)> = Vec::new();
    for (i, piece) in tokens.iter().enumerate() {
        if types[i] != 1 {
            continue;
        }
        for (k, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(k);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                ranked.push((scores[i], i as u32, li, ri));
            }
        }
    }
    ranked.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    let merges: Merges = ranked
        .iter()
        .map(|&(_, _, l, r)| (tokens[l as usize].to_owned(), tokens[r as usize].to_owned()))
        .collect();
    let unk = types
        .iter()
        .position(|&t| t == 2)
        .map(|i| tokens[i].to_owned());
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(u) = unk {
        builder = builder.unk_token(u);
    }
    let bpe = builder.build().map_err(|e| {
        Error::invalid(format!(
            "{at}: the SentencePiece vocabulary is not valid: {e}"
        ))
    })?;
    let mut tok = Tokenizer::new(bpe);
    let replace = |from: &str, to: &str| {
        Replace::new(from, to).map_err(|e| Error::internal(format!("normalizer: {e}")))
    };
    let mut normalizers = Vec::new();
    if space_prefix {
        normalizers.push(NormalizerWrapper::Prepend(Prepend::new("▁".into())));
    }
    normalizers.push(NormalizerWrapper::Replace(replace(" ", "▁")?));
    tok.with_normalizer(Some(Normalizers::new(normalizers)))
        .map_err(|e| Error::internal(format!("normalizer: {e}")))?;
    let mut decoders = vec![
        DecoderWrapper::Replace(replace("▁", " ")?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if space_prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    tok.with_decoder(Some(Decoders::new(decoders)));
    Ok(tok)
}

/// The end-of-sequence ids a Hugging Face folder declares: `eos_token_id` (one id or a
/// list) of `config.json` and of `generation_config.json`, where present.
pub fn hf_eos_ids(dir: &Folder) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for file in ["config.json", "generation_config.json"] {
        if !dir.has_file(file) {
            continue;
        }
        let at = dir.path().join(file).display().to_string();
        let j: Json = serde_json::from_slice(&dir.read(file, "model config")?)
            .map_err(|e| Error::invalid(format!("{at}: not valid JSON: {e}")))?;
        match j.get("eos_token_id") {
            Some(Json::Array(a)) => ids.extend(a.iter().filter_map(Json::as_u64)),
            Some(x) => ids.extend(x.as_u64()),
            None => {}
        }
    }
    let mut out: Vec<u32> = Vec::new();
    for id in ids.into_iter().filter_map(|i| u32::try_from(i).ok()) {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    Ok(out)
}

/// A minijinja error with its causes (a template's `raise_exception` message is the
/// cause's).
fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// A chat template compiled as Hugging Face's `apply_chat_template` runs it: Jinja with
/// `trim_blocks` and `lstrip_blocks`, Python's string methods, `raise_exception` and
/// `strftime_now`.
fn compile_template(source: String, at: &str) -> Result<minijinja::Environment<'static>> {
    use minijinja::{Environment, ErrorKind};
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| Error::internal(format!("template syntax: {e}")))?;
    env.set_syntax(syntax);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<minijinja::Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
    env.add_template_owned("chat", source)
        .map_err(|e| Error::invalid(format!("{at}: the chat template does not compile: {e}")))?;
    Ok(env)
}

/// The local time formatted by C's `strftime` (what Python's `strftime` does).
fn strftime_now(fmt: &str) -> String {
    let Ok(cfmt) = std::ffi::CString::new(fmt) else {
        return String::new();
    };
    let mut buf = [0u8; 256];
    // SAFETY: `time(NULL)` only returns the time; `localtime_r` writes the zeroed `tm` we
    // own; `strftime` writes at most `buf.len()` bytes into `buf` and returns the count.
    let n = unsafe {
        let t = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&t, &mut tm).is_null() {
            return String::new();
        }
        libc::strftime(buf.as_mut_ptr().cast(), buf.len(), cfmt.as_ptr(), &tm)
    };
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn to_jinja(v: &Json) -> minijinja::Value {
    use minijinja::Value as J;
    match v {
        Json::Null => J::from(()),
        Json::Bool(b) => J::from(*b),
        Json::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => J::from(i),
            (None, Some(f)) => J::from(f),
            _ => J::from(()),
        },
        Json::String(s) => J::from(s.clone()),
        Json::Array(a) => J::from(a.iter().map(to_jinja).collect::<Vec<_>>()),
        Json::Object(o) => J::from(
            o.iter()
                .map(|(k, v)| (k.clone(), to_jinja(v)))
                .collect::<std::collections::BTreeMap<_, _>>(),
        ),
    }
}

/// Turns generated tokens into text as they come, never splitting a UTF-8 character:
/// each step decodes a short window of tokens with and without the new ones and emits the
/// difference once it no longer ends in an incomplete character (U+FFFD). Decoding in
/// windows keeps what decoders do across token boundaries (a leading space stripped, bytes
/// joined) the same as decoding everything at once.
#[derive(Clone, Debug, Default)]
pub struct Detokenizer {
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    /// New text after `tokens` (all generated tokens so far) grew; `flush` emits an
    /// incomplete character at the end too (the sequence is over).
    pub fn step(&mut self, codec: &TextCodec, tokens: &[u32], skip: bool, flush: bool) -> String {
        if self.read >= tokens.len() {
            return String::new();
        }
        let before = codec.decode(&tokens[self.prefix..self.read], skip);
        let after = codec.decode(&tokens[self.prefix..], skip);
        if !flush && after.ends_with('\u{FFFD}') {
            return String::new();
        }
        let new = match after.strip_prefix(before.as_str()) {
            Some(rest) => rest.to_owned(),
            // A decoder that changed what it made of the earlier tokens: take what is
            // past the common length, on a character boundary.
            None => {
                let mut at = before.len().min(after.len());
                while !after.is_char_boundary(at) {
                    at -= 1;
                }
                after[at..].to_owned()
            }
        };
        self.prefix = self.read;
        self.read = tokens.len();
        new
    }
}

/// Stop strings over generated text.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    list: Vec<String>,
    longest: usize,
}

impl StopStrings {
    pub fn new(list: Vec<String>) -> StopStrings {
        let longest = list.iter().map(String::len).max().unwrap_or(0);
        StopStrings { list, longest }
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Where the first stop string starts in `text`, looking only where one could end in
    /// the `grown` bytes just appended.
    pub fn find(&self, text: &str, grown: usize) -> Option<usize> {
        let mut from = text.len().saturating_sub(grown + self.longest);
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        self.list
            .iter()
            .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
            .min()
    }

    /// How many bytes at the end of `text` must be held back because they could be the
    /// start of a stop string (on a character boundary).
    pub fn held(&self, text: &str) -> usize {
        let mut held = 0;
        for s in &self.list {
            for n in (1..s.len().min(text.len() + 1)).rev() {
                if n <= held {
                    break;
                }
                if s.is_char_boundary(n) && text.ends_with(&s[..n]) {
                    held = n;
                    break;
                }
            }
        }
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;

    /// A byte-level BPE over the 256 byte symbols and a few merges (no file needed).
    fn byte_level() -> TextCodec {
        let alphabet = ByteLevel::alphabet();
        let mut syms: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
        syms.sort();
        let mut vocab = Vocab::default();
        for (i, s) in syms.iter().enumerate() {
            vocab.insert(s.clone(), i as u32);
        }
        let n = syms.len() as u32;
        vocab.insert("Ġw".into(), n);
        vocab.insert("or".into(), n + 1);
        vocab.insert("<eos>".into(), n + 2);
        let merges = vec![("Ġ".into(), "w".into()), ("o".into(), "r".into())];
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .unwrap();
        let mut tok = Tokenizer::new(bpe);
        tok.with_pre_tokenizer(Some(ByteLevel::new(false, false, true)));
        tok.with_decoder(Some(ByteLevel::default()));
        tok.add_special_tokens([AddedToken::from("<eos>", true)])
            .unwrap();
        TextCodec {
            tok,
            add_bos: None,
            bos_token: String::new(),
            eos_token: "<eos>".into(),
            template: None,
            eos_ids: vec![n + 2],
            source: "test".into(),
        }
    }

    #[test]
    fn encode_decode_round_trip_with_specials() {
        let c = byte_level();
        let text = "hello world, é ü 日本 🙂";
        let ids = c.encode(text, true).unwrap();
        assert_eq!(c.decode(&ids, true), text);
        let with = c.encode("a<eos>b", true).unwrap();
        assert!(with.contains(&c.eos_ids[0]), "{with:?}");
        assert_eq!(c.decode(&with, true), "ab");
        assert_eq!(c.decode(&with, false), "a<eos>b");
    }

    #[test]
    fn streaming_never_splits_a_character() {
        let c = byte_level();
        let text = "a 🙂 é日 world!";
        let ids = c.encode(text, false).unwrap();
        // The emoji is four byte tokens: three steps give nothing, the fourth all of it.
        let mut d = Detokenizer::default();
        let mut out = String::new();
        let mut pieces = Vec::new();
        for n in 1..=ids.len() {
            let p = d.step(&c, &ids[..n], true, false);
            assert!(!p.contains('\u{FFFD}'), "{p:?}");
            out.push_str(&p);
            pieces.push(p);
        }
        assert_eq!(out, text);
        assert!(pieces.contains(&"🙂".to_string()), "{pieces:?}");
        assert!(pieces.iter().filter(|p| p.is_empty()).count() >= 3);
    }

    #[test]
    fn an_incomplete_character_is_flushed_at_the_end() {
        let c = byte_level();
        let ids = c.encode("x🙂", false).unwrap();
        let cut = &ids[..ids.len() - 1];
        let mut d = Detokenizer::default();
        let mut out = String::new();
        for n in 1..=cut.len() {
            out.push_str(&d.step(&c, &cut[..n], true, false));
        }
        assert_eq!(out, "x");
        out.push_str(&d.step(&c, cut, true, true));
        assert!(out.starts_with('x') && out.ends_with('\u{FFFD}'), "{out:?}");
    }

    #[test]
    fn stop_strings_are_found_and_their_starts_held_back() {
        let s = StopStrings::new(vec!["\n\nUser:".into(), "END".into()]);
        assert_eq!(s.find("hello\n\nUser: hi", 3), Some(5));
        assert_eq!(s.find("no stop here", 4), None);
        // Only near the new text: an earlier match was already seen.
        assert_eq!(s.find("xENDyyyyyyyyyyyyyyy", 2), None);
        assert_eq!(s.find("xxEND", 1), Some(2));
        assert_eq!(s.held("hello\n\nUs"), 4);
        assert_eq!(s.held("helloEN"), 2);
        assert_eq!(s.held("hello"), 0);
        assert_eq!(StopStrings::new(vec!["é!".into()]).held("café"), 2);
        assert_eq!(StopStrings::default().held("abc"), 0);
    }

    #[test]
    fn chat_templates_render_as_transformers_does() {
        let mut c = byte_level();
        c.template = Some(Ok(compile_template(
                "{% for m in messages %}\n<|{{ m['role'] }}|>{{ m['content'].strip() }}{{ eos_token }}{% endfor %}\n{% if add_generation_prompt %}<|assistant|>{% endif %}"
                    .into(),
                "test",
            )
            .unwrap()));
        let msgs = serde_json::json!([
            {"role": "system", "content": " Be brief. "},
            {"role": "user", "content": "Hi"}
        ]);
        assert_eq!(
            c.apply_chat_template(&msgs).unwrap(),
            "<|system|>Be brief.<eos><|user|>Hi<eos><|assistant|>"
        );
        let e = c
            .apply_chat_template(&serde_json::json!([{"content": "x"}]))
            .unwrap_err();
        assert!(e.message.contains("role"), "{e}");
        c.template = Some(Ok(compile_template(
            "{{ raise_exception('only user turns') }}".into(),
            "test",
        )
        .unwrap()));
        let e = c.apply_chat_template(&msgs).unwrap_err();
        assert!(e.message.contains("only user turns"), "{e}");
        // A template that does not compile leaves the codec serving text; asking for the
        // template gets the reason.
        let why = compile_template("{% for %}".into(), "t")
            .unwrap_err()
            .message;
        assert!(why.contains("does not compile"), "{why}");
        c.template = Some(Err(why.clone()));
        assert!(c.has_chat_template());
        assert_eq!(c.chat_template_error(), Some(why.as_str()));
        let e = c.apply_chat_template(&msgs).unwrap_err();
        assert_eq!((e.code, e.message), (Code::InvalidArgument, why));
        assert_eq!(c.decode(&c.encode("hello", false).unwrap(), false), "hello");
        assert!(!strftime_now("%Y").is_empty());
    }
}
