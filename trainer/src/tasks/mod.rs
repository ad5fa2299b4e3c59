//! The built-in tasks of `sluice train` and the registry that makes them from a config.
//!
//! | kind     | turns | what                                              | options                  |
//! |----------|-------|---------------------------------------------------|--------------------------|
//! | `arith`  | 1     | the sum of two integers ([`arith`])               | `digits`                 |
//! | `sort`   | 1     | the digits of the prompt, sorted ([`sort`])       | `digits`                 |
//! | `tool`   | 1-4   | a product, with a calculator tool ([`tool`])      | `digits`, `min_digits`, `tool_fraction`, `wrong_call_fraction`, `chain_fraction`, `chain_call_fraction` |
//! | `recall` | 1     | raw-id recall (the runtime's synthetic task)      | `items`                  |
//! | `lookup` | 2     | raw-id lookup through an observation (runtime)    | none                     |
//! | `external` | any | a program sluice starts, JSON lines ([`external`]) | `command`, `args`       |
//! | `http`   | any   | a server at a URL, the same messages ([`external`]) | `url`                   |
//!
//! `arith`, `sort`, `tool`, `external` and `http` are text tasks on the run's [`text`] tokenizer
//! (the character [`tokenizer`], 64 ids, by default; or a [`bpe`]) and the chat [`template`];
//! they need a model vocabulary of at least the tokenizer's size.
//! `recall` and `lookup` work on raw ids of any vocabulary of at least
//! [`sluice_runtime::env::synthetic::MIN_VOCAB`] ids, for tiny models and tests.

pub mod arith;
pub mod bpe;
pub mod calc;
pub mod export;
pub mod external;
pub mod round_trip;
pub mod sort;
pub mod template;
pub mod text;
pub mod tokenizer;
pub mod tool;

use sluice_runtime::env::synthetic::{Lookup, Recall};
use sluice_runtime::env::{Reply, Split, Task};
use sluice_runtime::hash::hash_str;
use sluice_runtime::trajectory::TerminalReason;
use std::sync::Arc;
use text::TextTokenizer;

/// The task kinds [`make`] knows, for configs and error messages.
pub const KINDS: [&str; 7] = [
    "arith", "sort", "tool", "recall", "lookup", "external", "http",
];

/// Operand digits of `arith` and `tool` when not set.
pub const DEFAULT_DIGITS: u32 = 3;
/// The longest `sort` problem when not set.
pub const DEFAULT_SORT_DIGITS: u32 = 5;
/// The largest `digits` (sums and products of 9-digit numbers fit an i64).
pub const MAX_DIGITS: u32 = 9;
/// `tool`'s share of tool-using demonstrations when not set: all of them.
pub const DEFAULT_TOOL_FRACTION: f64 = 1.0;
/// `recall`'s symbols per prompt when not set.
pub const DEFAULT_ITEMS: u32 = 4;

/// The optional parameters of a task (`[tasks.NAME]` keys). A kind rejects an option it does
/// not take, so a typo in a config is an error rather than silently ignored.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskOptions {
    /// `arith`: operands of 1..=digits digits; `tool`: operands of exactly `digits` digits
    /// (1..=9, default [`DEFAULT_DIGITS`]); `sort`: problems of 2..=digits digits (2..=9,
    /// default [`DEFAULT_SORT_DIGITS`]).
    pub digits: Option<u32>,
    /// `tool`: the fewest digits of an operand (1..=digits, default `digits`: every operand
    /// has exactly `digits` digits). Each operand's length is drawn uniformly from
    /// min_digits..=digits, so problems range from ones a model can answer in its head to ones
    /// it needs the calculator for.
    pub min_digits: Option<u32>,
    /// `tool`: the fraction of demonstrations that use the tool (the rest answer directly);
    /// in [0, 1], default [`DEFAULT_TOOL_FRACTION`]. See [`tool`] for how it sets the warm-up.
    pub tool_fraction: Option<f64>,
    /// `tool`: the fraction of tool-calling demonstrations that call it with the wrong program
    /// (`A+B`); in [0, 1], default 0. See [`tool`].
    pub wrong_call_fraction: Option<f64>,
    /// `tool`: the share of problems with three operands (`A*B*C`) and, when above 0, a
    /// calculator of one operation per call, so those take two chained calls; in [0, 1],
    /// default 0. See [`tool`].
    pub chain_fraction: Option<f64>,
    /// `tool`: the fraction of three-operand demonstrations that call the tool whose second
    /// step calls too; in [0, 1], default 0 (every demonstration makes one call at most).
    pub chain_call_fraction: Option<f64>,
    /// `recall`: symbols per prompt, >= 1, default [`DEFAULT_ITEMS`].
    pub items: Option<u32>,
    /// `external`: the program to start (found on PATH, or a path relative to the working
    /// directory) and its arguments.
    pub command: Option<String>,
    pub args: Option<Vec<String>>,
    /// `http`: the server's URL (`http://host:port/path`).
    pub url: Option<String>,
}

impl TaskOptions {
    /// The names of the options that are set.
    fn set(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.digits.is_some() {
            v.push("digits");
        }
        if self.min_digits.is_some() {
            v.push("min_digits");
        }
        if self.tool_fraction.is_some() {
            v.push("tool_fraction");
        }
        if self.wrong_call_fraction.is_some() {
            v.push("wrong_call_fraction");
        }
        if self.chain_fraction.is_some() {
            v.push("chain_fraction");
        }
        if self.chain_call_fraction.is_some() {
            v.push("chain_call_fraction");
        }
        if self.items.is_some() {
            v.push("items");
        }
        if self.command.is_some() {
            v.push("command");
        }
        if self.args.is_some() {
            v.push("args");
        }
        if self.url.is_some() {
            v.push("url");
        }
        v
    }
}

/// Whether tasks of `kind` speak text through the run's tokenizer (the others work on raw ids).
pub fn is_text(kind: &str) -> bool {
    matches!(kind, "arith" | "sort" | "tool" | "external" | "http")
}

/// Makes the task `name` of `kind` for a model of `vocab` ids. The error names the task and
/// the kind, option or vocabulary that is wrong. External tasks get a 5 s call timeout, one
/// retry, and record nothing (see [`make_with`]).
pub fn make(
    kind: &str,
    name: &str,
    vocab: usize,
    options: &TaskOptions,
) -> Result<Arc<dyn Task>, String> {
    let io = external::EnvIo {
        timeout: std::time::Duration::from_secs(5),
        retries: 1,
        ..external::EnvIo::default()
    };
    make_with(kind, name, vocab, options, &io, &TextTokenizer::char())
}

/// [`make`] with an external task's call timeout, record and replay, and the text tasks on
/// tokenizer `tok`.
pub fn make_with(
    kind: &str,
    name: &str,
    vocab: usize,
    options: &TaskOptions,
    io: &external::EnvIo,
    tok: &Arc<TextTokenizer>,
) -> Result<Arc<dyn Task>, String> {
    let takes: &[&str] = match kind {
        "arith" | "sort" => &["digits"],
        "tool" => &[
            "digits",
            "min_digits",
            "tool_fraction",
            "wrong_call_fraction",
            "chain_fraction",
            "chain_call_fraction",
        ],
        "recall" => &["items"],
        "lookup" => &[],
        "external" => &["command", "args"],
        "http" => &["url"],
        _ => {
            return Err(format!(
                "task {name}: unknown kind {kind:?} (kinds: {})",
                KINDS.join(", ")
            ))
        }
    };
    if let Some(extra) = options.set().into_iter().find(|o| !takes.contains(o)) {
        return Err(format!(
            "task {name}: kind {kind} has no option {extra} (its options: {})",
            if takes.is_empty() {
                "none".to_string()
            } else {
                takes.join(", ")
            }
        ));
    }
    if is_text(kind) && vocab < tok.vocab_size() {
        return Err(format!(
            "task {name}: kind {kind} needs a model vocabulary of at least {} ids (tokenizer \
             {}), the model has {vocab}",
            tok.vocab_size(),
            tok.version()
        ));
    }
    let digits = options.digits.unwrap_or(DEFAULT_DIGITS);
    let task: Arc<dyn Task> = match kind {
        "arith" => Arc::new(
            arith::Arith::new(name, digits)
                .map_err(|e| e.0)?
                .with_tokenizer(Arc::clone(tok)),
        ),
        "sort" => Arc::new(
            sort::Sort::new(name, options.digits.unwrap_or(DEFAULT_SORT_DIGITS))
                .map_err(|e| e.0)?
                .with_tokenizer(Arc::clone(tok)),
        ),
        "tool" => Arc::new(
            tool::ToolTask::with_sizes(
                name,
                options.min_digits.unwrap_or(digits),
                digits,
                tool::DemoMix {
                    tool_fraction: options.tool_fraction.unwrap_or(DEFAULT_TOOL_FRACTION),
                    wrong_call_fraction: options.wrong_call_fraction.unwrap_or(0.0),
                    chain_call_fraction: options.chain_call_fraction.unwrap_or(0.0),
                },
            )
            .map_err(|e| e.0)?
            .with_chains(options.chain_fraction.unwrap_or(0.0))
            .map_err(|e| e.0)?
            .with_tokenizer(Arc::clone(tok)),
        ),
        "external" => Arc::new(
            external::ExternalTask::new(
                name,
                external::Endpoint::Process {
                    program: options.command.clone().unwrap_or_default(),
                    args: options.args.clone().unwrap_or_default(),
                },
                vocab,
                io.clone(),
            )?
            .with_tokenizer(Arc::clone(tok)),
        ),
        "http" => Arc::new(
            external::ExternalTask::new(
                name,
                external::Endpoint::Http {
                    url: options.url.clone().ok_or_else(|| {
                        format!("task {name}: kind http needs a url (http://host:port/path)")
                    })?,
                },
                vocab,
                io.clone(),
            )?
            .with_tokenizer(Arc::clone(tok)),
        ),
        "recall" => Arc::new(
            Recall::new(name, vocab, options.items.unwrap_or(DEFAULT_ITEMS) as usize)
                .map_err(|e| e.0)?,
        ),
        _ => Arc::new(Lookup::new(name, vocab).map_err(|e| e.0)?),
    };
    Ok(task)
}

/// Whether a problem spec belongs to `split`: held-out specs hash odd, training ones even.
fn in_split(seed: u64, spec: &str, split: Split) -> bool {
    let odd = hash_str(seed, spec) & 1 == 1;
    odd == (split == Split::HeldOut)
}

/// The end of an episode with a binary reward.
fn end(ok: bool) -> Reply {
    if ok {
        Reply::End {
            reward: 1.0,
            reason: TerminalReason::Success,
        }
    } else {
        Reply::End {
            reward: 0.0,
            reason: TerminalReason::Failure,
        }
    }
}
