//! The chat template of the built-in text tasks (ToRA style, on the [`tokenizer`]'s specials).
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

use super::tokenizer::{self, ASSISTANT, BOS, CALL, END_CALL, EOT, OBSERVATION, USER};
use sluice_runtime::env::Demonstration;
use sluice_runtime::trajectory::TokenId;

/// Recorded on every trajectory ([`sluice_runtime::trajectory::ArtifactVersions::template`]).
pub const VERSION: &str = "sluice-chat-1";

/// `<bos><user>BODY<eot><assistant>`: a problem, with the assistant's turn opened.
pub fn prompt(body: &[TokenId]) -> Vec<TokenId> {
    wrap(&[BOS, USER], body, &[EOT, ASSISTANT])
}

/// `<call>PROGRAM</call>`: a tool call.
pub fn call(program: &[TokenId]) -> Vec<TokenId> {
    wrap(&[CALL], program, &[END_CALL])
}

/// `<observation>BODY<eot><assistant>`: an environment reply, handing the turn back.
pub fn observation(body: &[TokenId]) -> Vec<TokenId> {
    wrap(&[OBSERVATION], body, &[EOT, ASSISTANT])
}

/// `BODY<eot>`: a final answer.
pub fn answer(body: &[TokenId]) -> Vec<TokenId> {
    wrap(&[], body, &[EOT])
}

fn wrap(open: &[TokenId], body: &[TokenId], close: &[TokenId]) -> Vec<TokenId> {
    let mut ids = Vec::with_capacity(open.len() + body.len() + close.len());
    ids.extend_from_slice(open);
    ids.extend_from_slice(body);
    ids.extend_from_slice(close);
    ids
}

/// The text of a final answer turn: the plain characters before its closing `<eot>`. `None`
/// when the turn does not end in `<eot>` or holds any other special or unknown id.
pub fn answer_text(generated: &[TokenId]) -> Option<String> {
    let (&last, body) = generated.split_last()?;
    if last != EOT {
        return None;
    }
    tokenizer::plain_text(body)
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
