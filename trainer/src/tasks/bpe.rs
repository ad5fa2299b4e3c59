//! A BPE tokenizer at the token gateway: any Hugging Face tokenizer.json that has the chat's
//! special tokens ([`Bpe::load`]), or a byte-level BPE trained here on the tasks' text with the
//! same crate ([`train`], `sluice tokenizer train`).
//!
//! The trained one splits digits one per token by default (a number's ids are its digits, as
//! with the character tokenizer, so arithmetic stays digit by digit) or, with a larger
//! `digits`, cuts numbers into runs of up to that many digits that the BPE may merge (digit
//! pairs and triples, as the pre-tokenizers of Llama 3 and GPT-4 group numbers in threes); it
//! maps every byte to a token (any text encodes), and puts the special tokens first, at the
//! character tokenizer's ids (`<pad>` 0 ... `<eot>` 8).

use super::text::Specials;
use super::tokenizer::Special;
use sluice_runtime::trajectory::TokenId;
use std::collections::HashSet;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// The vocabulary `sluice tokenizer train` aims at when `--vocab` is not given.
pub const DEFAULT_TRAIN_VOCAB: usize = 512;

/// A loaded BPE tokenizer, checked: every chat special is one token, ids are `0..vocab_size`.
#[derive(Debug)]
pub struct Bpe {
    inner: Tokenizer,
    specials: Specials,
    /// Every id that is a special (added) token: never part of plain text.
    special_ids: HashSet<TokenId>,
    vocab_size: usize,
    version: String,
    /// Where it came from, for error messages.
    source: String,
}

impl Bpe {
    /// Loads a tokenizer.json; the error names the file and what is wrong with it.
    pub fn load(path: &Path) -> Result<Bpe, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Bpe::from_bytes(&bytes, &path.display().to_string())
    }

    /// Parses tokenizer.json bytes; `source` names them in errors.
    pub fn from_bytes(bytes: &[u8], source: &str) -> Result<Bpe, String> {
        let inner = Tokenizer::from_bytes(bytes)
            .map_err(|e| format!("{source}: not a valid Hugging Face tokenizer.json: {e}"))?;
        let specials = Specials::from_lookup(|s| inner.token_to_id(s.text())).map_err(|s| {
            format!(
                "{source}: the special token {} is missing (the chat template needs {}; \
                 `sluice tokenizer train` adds them)",
                s.text(),
                Special::ALL.map(Special::text).join(" ")
            )
        })?;
        let vocab = inner.get_vocab(true);
        let max_id = vocab
            .values()
            .copied()
            .max()
            .ok_or_else(|| format!("{source}: the tokenizer has an empty vocabulary"))?;
        let vocab_size = max_id as usize + 1;
        if vocab.len() != vocab_size {
            return Err(format!(
                "{source}: the ids are not contiguous ({} tokens, the largest id {max_id}): \
                 every id below the vocabulary size must be a token",
                vocab.len()
            ));
        }
        let mut special_ids: HashSet<TokenId> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        for s in Special::ALL {
            if let Some(id) = inner.token_to_id(s.text()) {
                special_ids.insert(id);
            }
        }
        let hash = blake3::hash(bytes).to_hex();
        Ok(Bpe {
            inner,
            specials,
            special_ids,
            vocab_size,
            version: format!("bpe-{}", &hash[..16]),
            source: source.into(),
        })
    }

    pub fn specials(&self) -> Specials {
        self.specials
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// `bpe-` and the first 16 hex digits of the tokenizer.json's blake3 hash.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Encodes text; special tokens written in it (`<eot>`) become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<TokenId>, String> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| format!("tokenizer {}: cannot encode {text:?}: {e}", self.source))?;
        Ok(enc.get_ids().to_vec())
    }

    /// [`encode`](Self::encode) for text this crate wrote (the built-in tasks' prompts and
    /// messages), which only fails on a broken tokenizer: then nothing (no ids).
    pub fn encode_infallible(&self, text: &str) -> Vec<TokenId> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }

    /// Decodes ids (specials written as their text); an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[TokenId]) -> Result<String, String> {
        if let Some((at, &id)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= self.vocab_size)
        {
            return Err(format!(
                "token id {id} at index {at} is outside the vocabulary 0..{} of tokenizer {}",
                self.vocab_size, self.version
            ));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| format!("tokenizer {}: cannot decode: {e}", self.source))
    }

    /// Decodes for reports: runs of valid ids decoded together, others written `<?ID>`.
    pub fn render(&self, ids: &[TokenId]) -> String {
        let mut out = String::new();
        for run in ids.chunk_by(|a, b| self.known(*a) == self.known(*b)) {
            if self.known(run[0]) {
                out.push_str(&self.inner.decode(run, false).unwrap_or_default());
            } else {
                for id in run {
                    out.push_str(&format!("<?{id}>"));
                }
            }
        }
        out
    }

    fn known(&self, id: TokenId) -> bool {
        (id as usize) < self.vocab_size
    }

    /// The text of ids holding no special token; `None` otherwise.
    pub fn plain_text(&self, ids: &[TokenId]) -> Option<String> {
        if ids.iter().any(|id| self.special_ids.contains(id)) {
            return None;
        }
        self.decode(ids).ok()
    }
}

/// Digits per pre-token when `sluice tokenizer train` is not given `--digits`: one, so a
/// number's ids are its digits.
pub const DEFAULT_TRAIN_DIGITS: usize = 1;

/// Trains a byte-level BPE of at most `vocab` ids on `texts` (each split at the special
/// tokens written in it, which never merge with text) and returns its tokenizer.json.
/// Numbers are cut into runs of at most `digits` digits before the BPE sees them (left to
/// right: `13689` in threes is `136` `89`), so merges never cross such a cut; with 1 every
/// digit is its own token. The nine chat specials take ids 0..=8. Deterministic: the same
/// texts give the same file (a test checks).
pub fn train(texts: &[String], vocab: usize, digits: usize) -> Result<String, String> {
    if digits == 0 {
        return Err("--digits 0: a token holds at least one digit".into());
    }
    let base = Special::ALL.len() + ByteLevel::alphabet().len();
    if vocab < base {
        return Err(format!(
            "--vocab {vocab}: a byte-level BPE needs at least {base} ids (the {} specials and \
             256 bytes)",
            Special::ALL.len()
        ));
    }
    let specials: Vec<AddedToken> = Special::ALL
        .iter()
        .map(|s| AddedToken::from(s.text(), true))
        .collect();
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let mut trainer = TrainerWrapper::BpeTrainer(
        BpeTrainerBuilder::new()
            .vocab_size(vocab)
            .min_frequency(2)
            .show_progress(false)
            .special_tokens(specials)
            .initial_alphabet(alphabet)
            .build(),
    );
    let mut tok = Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(Sequence::new(vec![
        digit_runs(digits)?,
        ByteLevel::new(false, true, true).into(),
    ])));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let mut pieces = Vec::new();
    for t in texts {
        pieces.extend(split_specials(t));
    }
    tok.train(&mut trainer, pieces.into_iter())
        .map_err(|e| format!("training the BPE: {e}"))?;
    tok.to_string(true)
        .map_err(|e| format!("writing the BPE's tokenizer.json: {e}"))
}

/// The pre-tokenizer that cuts numbers into runs of at most `digits` digits: the `Digits`
/// one for 1 (the file configs/bpe.toml's BPE was trained with), a regex split otherwise.
/// The byte-level pre-tokenizer after it keeps a run whole (its pattern ` ?\p{N}+` takes
/// every digit of one).
fn digit_runs(digits: usize) -> Result<PreTokenizerWrapper, String> {
    if digits == 1 {
        return Ok(Digits::new(true).into());
    }
    let pattern = format!("\\p{{N}}{{1,{digits}}}");
    Split::new(
        SplitPattern::Regex(pattern),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map(Into::into)
    .map_err(|e| format!("--digits {digits}: {e}"))
}

/// The text between the special tokens written in `text`.
fn split_specials(text: &str) -> Vec<String> {
    let mut out = vec![text.to_string()];
    for s in Special::ALL {
        out = out
            .iter()
            .flat_map(|p| p.split(s.text()).map(str::to_string).collect::<Vec<_>>())
            .filter(|p| !p.is_empty())
            .collect();
    }
    out
}
