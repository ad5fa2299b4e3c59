//! The character-level tokenizer of the built-in text tasks: 64 ids, one per character, plus the
//! special tokens of a ToRA-style tool-using chat.
//!
//! | ids    | tokens                                                                        |
//! |--------|-------------------------------------------------------------------------------|
//! | 0..=8  | `<pad>` `<bos>` `<system>` `<user>` `<assistant>` `<observation>` `<call>` `</call>` `<eot>` |
//! | 9..=18 | the digits `0`..`9`                                                            |
//! | 19..=44| the lower-case letters `a`..`z`                                               |
//! | 45..=63| space and `+ - * / % = ( ) [ ] , . ? : ; ! ^ _`                                |
//!
//! The whole vocabulary is exactly 64 ids, the vocabulary of the default small model
//! (configs/model/small.toml), so every id a model of that size can sample decodes to something.
//! `<` and `>` are not characters of the vocabulary: in text they only spell special tokens, so
//! [`decode`] and [`encode`] are inverse to each other on every valid id sequence.
//!
//! Text exists only inside a task (its prompts, its environment) and in reports; the learner
//! works on the ids the rollout sampled and never re-tokenises (DESIGN 6.1).

use sluice_runtime::trajectory::TokenId;
use std::fmt;

/// Recorded on every trajectory of a task that uses this tokenizer ([`ArtifactVersions`]);
/// change it whenever an id's meaning changes.
///
/// [`ArtifactVersions`]: sluice_runtime::trajectory::ArtifactVersions
pub const VERSION: &str = "sluice-char64-1";

/// Number of ids: specials plus characters.
pub const VOCAB_SIZE: usize = SPECIALS.len() + CHARS.len();

/// The special tokens, in id order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Special {
    /// Padding (never produced by a task; a model that samples it has written nonsense).
    Pad,
    /// Beginning of a conversation.
    Bos,
    /// Chat roles: each message starts with its role token and ends with [`Special::Eot`].
    System,
    User,
    Assistant,
    Observation,
    /// Begin and end of a tool call inside an assistant turn.
    Call,
    EndCall,
    /// End of a turn (a message); ends the episode when it ends an assistant's answer.
    Eot,
}

const SPECIALS: [Special; 9] = [
    Special::Pad,
    Special::Bos,
    Special::System,
    Special::User,
    Special::Assistant,
    Special::Observation,
    Special::Call,
    Special::EndCall,
    Special::Eot,
];

/// The characters, in id order after the specials.
const CHARS: &str = "0123456789abcdefghijklmnopqrstuvwxyz +-*/%=()[],.?:;!^_";

/// The id of the first digit (`0`); the digits are contiguous.
pub const FIRST_DIGIT: TokenId = SPECIALS.len() as TokenId;

impl Special {
    /// Every special token, in id order.
    pub const ALL: [Special; 9] = SPECIALS;

    pub const fn id(self) -> TokenId {
        self as TokenId
    }

    /// How the token is written in text: `<call>`, `</call>`, `<eot>`, ...
    pub const fn text(self) -> &'static str {
        match self {
            Special::Pad => "<pad>",
            Special::Bos => "<bos>",
            Special::System => "<system>",
            Special::User => "<user>",
            Special::Assistant => "<assistant>",
            Special::Observation => "<observation>",
            Special::Call => "<call>",
            Special::EndCall => "</call>",
            Special::Eot => "<eot>",
        }
    }

    /// The special token with this id, if it is one.
    pub fn from_id(id: TokenId) -> Option<Special> {
        SPECIALS.get(id as usize).copied()
    }
}

pub const PAD: TokenId = Special::Pad.id();
pub const BOS: TokenId = Special::Bos.id();
pub const SYSTEM: TokenId = Special::System.id();
pub const USER: TokenId = Special::User.id();
pub const ASSISTANT: TokenId = Special::Assistant.id();
pub const OBSERVATION: TokenId = Special::Observation.id();
pub const CALL: TokenId = Special::Call.id();
pub const END_CALL: TokenId = Special::EndCall.id();
pub const EOT: TokenId = Special::Eot.id();

/// The number of ids (64).
pub const fn vocab_size() -> usize {
    VOCAB_SIZE
}

/// What [`encode`] or [`decode`] could not handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerError {
    /// A character outside the vocabulary, at a char index of the text.
    UnknownChar { ch: char, at: usize },
    /// `<name>` that is not a special token (or a `<` never closed), at a char index.
    UnknownSpecial { text: String, at: usize },
    /// An id outside `0..VOCAB_SIZE`, at an index of the id sequence.
    UnknownId { id: TokenId, at: usize },
}

impl fmt::Display for TokenizerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizerError::UnknownChar { ch, at } => write!(
                f,
                "character {ch:?} (U+{:04X}) at position {at} is not in the vocabulary of \
                 tokenizer {VERSION} (digits, a-z, specials like <call>, and {:?})",
                *ch as u32,
                &CHARS[36..]
            ),
            TokenizerError::UnknownSpecial { text, at } => write!(
                f,
                "{text:?} at position {at} is not a special token of tokenizer {VERSION} (`<` \
                 only starts one of {})",
                SPECIALS.map(Special::text).join(" ")
            ),
            TokenizerError::UnknownId { id, at } => write!(
                f,
                "token id {id} at index {at} is outside the vocabulary 0..{VOCAB_SIZE} of \
                 tokenizer {VERSION}"
            ),
        }
    }
}

impl std::error::Error for TokenizerError {}

/// The id of a plain character, if it is in the vocabulary.
pub fn char_id(ch: char) -> Option<TokenId> {
    // CHARS is ASCII, so a byte index is a char index.
    CHARS.find(ch).map(|i| FIRST_DIGIT + i as TokenId)
}

/// The id of digit `d` (0..=9).
pub fn digit_id(d: u8) -> Option<TokenId> {
    (d < 10).then_some(FIRST_DIGIT + d as TokenId)
}

/// The id of an ASCII character of the vocabulary, at compile time (a character outside it
/// fails the build where a constant uses it).
const fn ascii_id(c: u8) -> TokenId {
    let bytes = CHARS.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == c {
            return FIRST_DIGIT + i as TokenId;
        }
        i += 1;
    }
    panic!("character not in the vocabulary")
}

pub const PLUS: TokenId = ascii_id(b'+');
pub const MINUS: TokenId = ascii_id(b'-');
pub const TIMES: TokenId = ascii_id(b'*');
pub const EQUALS: TokenId = ascii_id(b'=');
pub const SPACE: TokenId = ascii_id(b' ');

/// The ids of an integer written in decimal (a leading `-` when negative). Infallible: digits
/// and `-` are in the vocabulary.
pub fn number(n: i64) -> Vec<TokenId> {
    let mut ids = Vec::new();
    if n < 0 {
        ids.push(MINUS);
    }
    ids.extend(
        n.unsigned_abs()
            .to_string()
            .bytes()
            .map(|b| FIRST_DIGIT + (b - b'0') as TokenId),
    );
    ids
}

/// Encodes `text`: each character to its id, each special written as `<name>` to its id.
pub fn encode(text: &str) -> Result<Vec<TokenId>, TokenizerError> {
    let mut ids = Vec::with_capacity(text.len());
    let mut chars = text.char_indices().enumerate().peekable();
    while let Some((at, (byte, ch))) = chars.next() {
        if ch == '<' {
            let rest = &text[byte..];
            let special = SPECIALS.iter().find(|s| rest.starts_with(s.text()));
            let Some(s) = special else {
                let end = rest.find('>').map_or(rest.len(), |i| i + 1);
                return Err(TokenizerError::UnknownSpecial {
                    text: rest[..end].to_string(),
                    at,
                });
            };
            // Skip the rest of the special's text (all ASCII, one char per byte).
            for _ in 1..s.text().len() {
                chars.next();
            }
            ids.push(s.id());
            continue;
        }
        ids.push(char_id(ch).ok_or(TokenizerError::UnknownChar { ch, at })?);
    }
    Ok(ids)
}

/// The text of one id, if it is in the vocabulary.
pub fn token_text(id: TokenId) -> Option<&'static str> {
    if let Some(s) = Special::from_id(id) {
        return Some(s.text());
    }
    let i = (id as usize).checked_sub(SPECIALS.len())?;
    CHARS.get(i..i + 1)
}

/// Decodes ids to text, specials written as `<name>`; an id outside the vocabulary is an error.
pub fn decode(ids: &[TokenId]) -> Result<String, TokenizerError> {
    let mut out = String::with_capacity(ids.len());
    for (at, &id) in ids.iter().enumerate() {
        out.push_str(token_text(id).ok_or(TokenizerError::UnknownId { id, at })?);
    }
    Ok(out)
}

/// Decodes for reports: like [`decode`], with an id outside the vocabulary written `<?ID>`.
pub fn render(ids: &[TokenId]) -> String {
    let mut out = String::with_capacity(ids.len());
    for &id in ids {
        match token_text(id) {
            Some(t) => out.push_str(t),
            None => out.push_str(&format!("<?{id}>")),
        }
    }
    out
}

/// Decodes ids that must be plain characters (no specials): the text between two specials,
/// such as a tool program or an answer. `None` when a special or unknown id is among them.
pub fn plain_text(ids: &[TokenId]) -> Option<String> {
    if ids.iter().any(|&id| Special::from_id(id).is_some()) {
        return None;
    }
    decode(ids).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vocabulary_is_64_distinct_ids() {
        assert_eq!(VOCAB_SIZE, 64);
        let mut texts: Vec<&str> = (0..VOCAB_SIZE as TokenId)
            .map(|id| token_text(id).unwrap())
            .collect();
        texts.sort();
        texts.dedup();
        assert_eq!(texts.len(), 64);
        assert_eq!(token_text(64), None);
        for (i, s) in Special::ALL.iter().enumerate() {
            assert_eq!(s.id(), i as TokenId);
            assert_eq!(Special::from_id(s.id()), Some(*s));
        }
        assert_eq!(digit_id(7), char_id('7'));
        assert_eq!(digit_id(10), None);
    }
}
