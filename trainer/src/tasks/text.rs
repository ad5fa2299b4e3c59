//! The text tokenizer of a run, at the token gateway: the character [`tokenizer`] (the
//! default, 64 ids) or a BPE ([`bpe`]) loaded from a Hugging Face tokenizer.json
//! (`[tokenizer] kind = "bpe"`, `path = ...`).
//!
//! Either way the text tasks see the same interface: text from an environment or a task is
//! encoded here once, the chat's special tokens are ids of this tokenizer, and the ids the
//! engine sampled are only ever decoded (for rewards, tool programs and reports), never
//! re-encoded: a BPE's decode-then-encode round trip can give other ids than the sampled ones
//! (`trainer/tests/bpe.rs` finds such texts), and the learner must train on what was sampled.
//!
//! [`tokenizer`]: super::tokenizer
//! [`bpe`]: super::bpe

use super::bpe::Bpe;
use super::tokenizer::{self, Special};
use sluice_runtime::trajectory::TokenId;
use std::sync::Arc;

/// The ids of the chat's special tokens in one tokenizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Specials {
    pub bos: TokenId,
    pub user: TokenId,
    pub assistant: TokenId,
    pub observation: TokenId,
    pub call: TokenId,
    pub end_call: TokenId,
    pub eot: TokenId,
}

impl Specials {
    /// The character tokenizer's (and a trained BPE's: it puts the specials first, in the
    /// same order).
    pub const CHAR: Specials = Specials {
        bos: tokenizer::BOS,
        user: tokenizer::USER,
        assistant: tokenizer::ASSISTANT,
        observation: tokenizer::OBSERVATION,
        call: tokenizer::CALL,
        end_call: tokenizer::END_CALL,
        eot: tokenizer::EOT,
    };

    /// Reads the ids through `id_of` (a special's text to its id).
    pub(crate) fn from_lookup(
        mut id_of: impl FnMut(Special) -> Option<TokenId>,
    ) -> Result<Specials, Special> {
        let mut get = |s: Special| id_of(s).ok_or(s);
        Ok(Specials {
            bos: get(Special::Bos)?,
            user: get(Special::User)?,
            assistant: get(Special::Assistant)?,
            observation: get(Special::Observation)?,
            call: get(Special::Call)?,
            end_call: get(Special::EndCall)?,
            eot: get(Special::Eot)?,
        })
    }
}

/// A run's text tokenizer (see the module docs). Cheap to clone.
#[derive(Clone, Debug, Default)]
pub enum TextTokenizer {
    /// The 64-id character tokenizer ([`tokenizer`](super::tokenizer)).
    #[default]
    Char,
    /// A BPE from a tokenizer.json.
    Bpe(Arc<Bpe>),
}

impl TextTokenizer {
    /// The default, shared.
    pub fn char() -> Arc<TextTokenizer> {
        Arc::new(TextTokenizer::Char)
    }

    pub fn specials(&self) -> Specials {
        match self {
            TextTokenizer::Char => Specials::CHAR,
            TextTokenizer::Bpe(b) => b.specials(),
        }
    }

    /// The number of ids (the model's vocabulary follows it).
    pub fn vocab_size(&self) -> usize {
        match self {
            TextTokenizer::Char => tokenizer::VOCAB_SIZE,
            TextTokenizer::Bpe(b) => b.vocab_size(),
        }
    }

    /// Recorded on every trajectory: `sluice-char64-1`, or `bpe-` and a hash of the
    /// tokenizer.json.
    pub fn version(&self) -> String {
        match self {
            TextTokenizer::Char => tokenizer::VERSION.into(),
            TextTokenizer::Bpe(b) => b.version().into(),
        }
    }

    /// Encodes text, special tokens written `<name>`, once (at the gateway).
    pub fn encode(&self, text: &str) -> Result<Vec<TokenId>, String> {
        match self {
            TextTokenizer::Char => tokenizer::encode(text).map_err(|e| e.to_string()),
            TextTokenizer::Bpe(b) => b.encode(text),
        }
    }

    /// Decodes ids to text, specials written `<name>`; an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[TokenId]) -> Result<String, String> {
        match self {
            TextTokenizer::Char => tokenizer::decode(ids).map_err(|e| e.to_string()),
            TextTokenizer::Bpe(b) => b.decode(ids),
        }
    }

    /// Decodes for reports: an id outside the vocabulary is written `<?ID>`.
    pub fn render(&self, ids: &[TokenId]) -> String {
        match self {
            TextTokenizer::Char => tokenizer::render(ids),
            TextTokenizer::Bpe(b) => b.render(ids),
        }
    }

    /// The text of ids that must hold no special token (an answer, a tool program); `None`
    /// when a special or an unknown id is among them.
    pub fn plain_text(&self, ids: &[TokenId]) -> Option<String> {
        match self {
            TextTokenizer::Char => tokenizer::plain_text(ids),
            TextTokenizer::Bpe(b) => b.plain_text(ids),
        }
    }

    /// The ids of an integer in decimal. Infallible for both kinds: the character vocabulary
    /// has digits and `-`, and a byte-level BPE encodes any text.
    pub fn number(&self, n: i64) -> Vec<TokenId> {
        match self {
            TextTokenizer::Char => tokenizer::number(n),
            TextTokenizer::Bpe(b) => b.encode_infallible(&n.to_string()),
        }
    }

    /// Encodes text that this crate wrote (prompts, programs, calculator messages) and that
    /// every supported tokenizer encodes: the character vocabulary's characters, which a
    /// byte-level BPE covers too (a test checks every message of the built-in tasks).
    pub fn encode_known(&self, text: &str) -> Vec<TokenId> {
        match self {
            TextTokenizer::Char => text.chars().filter_map(tokenizer::char_id).collect(),
            TextTokenizer::Bpe(b) => b.encode_infallible(text),
        }
    }
}
