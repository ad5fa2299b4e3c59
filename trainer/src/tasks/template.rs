//! The chat template of the built-in text tasks (ToRA style, on the run tokenizer's specials:
//! [`TextTokenizer`], the character [`tokenizer`]'s ids by default).
//!
//! ```text
//! <bos><user>PROBLEM<eot><assistant>                      the prompt
//! <call>PROGRAM</call>                                    a model turn that calls the tool
//! <observation>RESULT<eot><assistant>                     the environment's reply (loss-masked)
//! ANSWER<eot>                                             the model's final turn
//! ```
//!
//! The templates carry no system message: the models are trained from scratch and learn the
//! format from demonstrations, so instructions would only lengthen every sequence. The
//! `<system>` token exists for templates that want one.
//!
//! [`tokenizer`]: super::tokenizer
//! [`TextTokenizer`]: super::text::TextTokenizer

use super::text::{Specials, TextTokenizer};
use sluice_runtime::env::Demonstration;
use sluice_runtime::trajectory::TokenId;

/// Recorded on every trajectory ([`sluice_runtime::trajectory::ArtifactVersions::template`]).
pub const VERSION: &str = "sluice-chat-1";

/// `<bos><user>BODY<eot><assistant>`: a problem, with the assistant's turn opened.
pub fn prompt(sp: &Specials, body: &[TokenId]) -> Vec<TokenId> {
    wrap(&[sp.bos, sp.user], body, &[sp.eot, sp.assistant])
}

/// `<call>PROGRAM</call>`: a tool call.
pub fn call(sp: &Specials, program: &[TokenId]) -> Vec<TokenId> {
    wrap(&[sp.call], program, &[sp.end_call])
}

/// `<observation>BODY<eot><assistant>`: an environment reply, handing the turn back.
pub fn observation(sp: &Specials, body: &[TokenId]) -> Vec<TokenId> {
    wrap(&[sp.observation], body, &[sp.eot, sp.assistant])
}

/// `BODY<eot>`: a final answer.
pub fn answer(sp: &Specials, body: &[TokenId]) -> Vec<TokenId> {
    wrap(&[], body, &[sp.eot])
}

fn wrap(open: &[TokenId], body: &[TokenId], close: &[TokenId]) -> Vec<TokenId> {
    let mut ids = Vec::with_capacity(open.len() + body.len() + close.len());
    ids.extend_from_slice(open);
    ids.extend_from_slice(body);
    ids.extend_from_slice(close);
    ids
}

/// The text of a final answer turn: the plain characters before its closing `<eot>`. `None`
/// when the turn does not end in `<eot>` or holds any other special or unknown id. The sampled
/// ids are decoded, never re-encoded.
pub fn answer_text(tok: &TextTokenizer, generated: &[TokenId]) -> Option<String> {
    let (&last, body) = generated.split_last()?;
    if last != tok.specials().eot {
        return None;
    }
    tok.plain_text(body)
}

/// A demonstration being built: tokens and which of them the model writes.
#[derive(Default)]
pub(crate) struct DemoBuilder {
    tokens: Vec<TokenId>,
    mask: Vec<bool>,
}

impl DemoBuilder {
    /// Tokens the model does not write (prompt, observations).
    pub fn given(&mut self, ids: &[TokenId]) {
        self.tokens.extend_from_slice(ids);
        self.mask.extend(std::iter::repeat_n(false, ids.len()));
    }

    /// Tokens the model writes (trained on).
    pub fn model(&mut self, ids: &[TokenId]) {
        self.tokens.extend_from_slice(ids);
        self.mask.extend(std::iter::repeat_n(true, ids.len()));
    }

    pub fn finish(self) -> Demonstration {
        Demonstration {
            tokens: self.tokens,
            loss_mask: self.mask,
        }
    }
}
