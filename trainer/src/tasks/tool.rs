//! `tool`: the agentic tool task. The model is asked for the product of two multi-digit
//! numbers; it can call a calculator ([`super::calc`]) and read the result.
//!
//! ```text
//! <bos><user>372*845<eot><assistant>          prompt
//! <call>372*845</call>                        turn 0: a tool call (ends at </call>)
//! <observation>314340<eot><assistant>         the environment runs it (loss-masked)
//! 314340<eot>                                 turn 1: the answer (ends at <eot>)
//! ```
//!
//! Episodes. Each model turn ends at `</call>` (a stop sequence) or at `<eot>` (the EOS):
//! - a turn that ends in `</call>` is a tool call: the program is the text between the turn's
//!   last `<call>` and the `</call>` (anything before `<call>` is the model's own scratch text
//!   and is ignored). The environment answers `<observation>RESULT<eot><assistant>`, and the
//!   model gets another turn. At most [`MAX_CALLS`] calls per episode: a further call ends the
//!   episode as `budget`, reward 0.
//! - a malformed call (no `<call>`, a special or unknown token inside the program, a program the
//!   calculator rejects: syntax, division by zero, overflow, nesting, length) is answered with an
//!   error observation, e.g. `<observation>error: syntax at 3<eot><assistant>`, so the model may
//!   try again; it is never a panic and never an environment failure (the task chose this over
//!   ending the episode, so a policy can learn from what the tool says).
//! - any other turn is the final answer: reward 1 and `success` when it is exactly the product's
//!   decimal digits then `<eot>`, else reward 0 and `failure`.
//!
//! Why the tool decides success. Both operands have exactly `digits` digits (default 3), so
//! the product has 2·digits-1 or 2·digits digits (5 or 6 by default). A model of a few million
//! parameters cannot multiply 3-digit numbers in its head (it can roughly guess the leading
//! digit and the last one), so answering directly almost always fails; writing the call is
//! copying the prompt, and answering after the observation is copying the observation, both of
//! which such a model learns in a minute. So the pass rate measures whether the policy uses the
//! tool correctly.
//!
//! Demonstrations and the warm-up. [`Task::demonstration`] returns, with probability
//! `tool_fraction`, the tool-using episode above and otherwise a direct answer (the correct
//! product written straight after the prompt, which the model cannot actually compute). A
//! model trained on that mix learns to open its answer with `<call>` with probability about
//! `tool_fraction` and otherwise to write digits, so:
//! - sampled at temperature 1, about `tool_fraction` of its episodes use the tool and succeed:
//!   GRPO groups then have both outcomes, and RL has a signal to push the `<call>` probability
//!   up;
//! - decoded greedily, it writes `<call>` only where that probability beats the most likely
//!   leading digit, which for a small fraction (about 0.1-0.25) is rare: the greedy held-out
//!   pass rate stays low after the warm-up, and rises once RL has made the tool the policy's
//!   first choice.
//!   With `tool_fraction = 1` the demonstrations are all tool use (a warm-up that already
//!   solves the task); with 0 none are (RL would have to discover `<call>` on its own).
//!
//! Held-out problems are those whose spec (`"372*845"`) hashes odd, training problems those
//! that hash even.

use super::calc;
use super::tokenizer::{self, CALL, END_CALL, EOT, TIMES};
use super::{end, in_split, template, MAX_DIGITS};
use sluice_kernels::testing::Rng;
use sluice_runtime::engine::StopConfig;
use sluice_runtime::env::{Demonstration, Problem, Reply, Split, Task, TaskError};
use sluice_runtime::trajectory::{ArtifactVersions, TerminalReason, TokenId};

/// The environment version recorded on trajectories.
pub const ENV_VERSION: &str = "tool-calculator-1";

/// Tool calls allowed per episode; the rollout's `max_turns` should be at least 2 (one call
/// and the answer), and at most `MAX_CALLS + 1` turns can ever be used.
pub const MAX_CALLS: u32 = 3;

/// Seed of the split hash (distinct per task kind).
const SPLIT_SEED: u64 = 0x7001;

/// The agentic tool task (see the module docs).
#[derive(Clone, Debug)]
pub struct ToolTask {
    name: String,
    digits: u32,
    tool_fraction: f64,
}

impl ToolTask {
    /// Operands of exactly `digits` digits (1..=9); `tool_fraction` (in [0, 1]) of the
    /// demonstrations use the tool, the rest answer directly.
    pub fn new(name: &str, digits: u32, tool_fraction: f64) -> Result<ToolTask, TaskError> {
        if !(1..=MAX_DIGITS).contains(&digits) {
            return Err(TaskError(format!(
                "task {name}: digits must be in 1..={MAX_DIGITS}, got {digits}"
            )));
        }
        if !(0.0..=1.0).contains(&tool_fraction) {
            return Err(TaskError(format!(
                "task {name}: tool_fraction must be in [0, 1], got {tool_fraction}"
            )));
        }
        Ok(ToolTask {
            name: name.into(),
            digits,
            tool_fraction,
        })
    }

    pub fn digits(&self) -> u32 {
        self.digits
    }

    pub fn tool_fraction(&self) -> f64 {
        self.tool_fraction
    }

    fn operand(&self, rng: &mut Rng) -> i64 {
        let lo = if self.digits == 1 {
            1
        } else {
            10i64.pow(self.digits - 1)
        };
        lo + rng.below((10i64.pow(self.digits) - lo) as usize) as i64
    }

    /// The operands of a spec this task made (`"A*B"`, each of exactly `digits` digits).
    fn parse(&self, spec: &str) -> Result<(i64, i64), TaskError> {
        let bad = || {
            TaskError(format!(
                "task {}: problem spec {spec:?} is not A*B with operands of {} digits",
                self.name, self.digits
            ))
        };
        let (a, b) = spec.split_once('*').ok_or_else(bad)?;
        let num = |s: &str| -> Result<i64, TaskError> {
            if s.len() != self.digits as usize || !s.bytes().all(|c| c.is_ascii_digit()) {
                return Err(bad());
            }
            s.parse().map_err(|_| bad())
        };
        Ok((num(a)?, num(b)?))
    }

    /// The observation answering a call turn (`generated` ends in `</call>`).
    fn run_call(&self, generated: &[TokenId]) -> Result<Vec<TokenId>, TaskError> {
        let body = &generated[..generated.len() - 1];
        let text = match body.iter().rposition(|&t| t == CALL) {
            None => "error: no call start".to_string(),
            Some(i) => match tokenizer::plain_text(&body[i + 1..]) {
                None => "error: bad token in program".to_string(),
                Some(program) => match calc::eval(&program) {
                    Ok(v) => v.to_string(),
                    Err(e) => e.to_string(),
                },
            },
        };
        // Every message above is in the vocabulary (a test checks); an encoding failure here
        // is this task's bug, reported as the environment's error rather than a panic.
        let ids = tokenizer::encode(&text).map_err(|e| {
            TaskError(format!(
                "task {}: observation {text:?} does not encode: {e}",
                self.name
            ))
        })?;
        Ok(template::observation(&ids))
    }
}

impl Task for ToolTask {
    fn name(&self) -> &str {
        &self.name
    }

    fn multi_turn(&self) -> bool {
        true
    }

    fn problem(&self, rng: &mut Rng, split: Split) -> Problem {
        loop {
            let (a, b) = (self.operand(rng), self.operand(rng));
            let spec = format!("{a}*{b}");
            if !in_split(SPLIT_SEED, &spec, split) {
                continue;
            }
            return Problem {
                id: format!("{}:{spec}", self.name),
                prompt: template::prompt(&product_ids(a, b)),
                spec,
            };
        }
    }

    fn respond(&self, p: &Problem, turn: u32, generated: &[TokenId]) -> Result<Reply, TaskError> {
        let (a, b) = self.parse(&p.spec)?;
        if generated.last() == Some(&END_CALL) {
            // Turn t is call number t + 1: every earlier turn was a call.
            if turn >= MAX_CALLS {
                return Ok(Reply::End {
                    reward: 0.0,
                    reason: TerminalReason::Budget,
                });
            }
            return Ok(Reply::Observe(self.run_call(generated)?));
        }
        let want = (a * b).to_string();
        Ok(end(
            template::answer_text(generated).is_some_and(|t| t == want)
        ))
    }

    fn stop(&self) -> StopConfig {
        StopConfig {
            eos: Some(EOT),
            stop_sequences: vec![vec![END_CALL]],
        }
    }

    fn versions(&self) -> ArtifactVersions {
        ArtifactVersions {
            template: template::VERSION.into(),
            tokenizer: tokenizer::VERSION.into(),
            environment: ENV_VERSION.into(),
        }
    }

    fn demonstration(&self, p: &Problem, rng: &mut Rng) -> Option<Demonstration> {
        let (a, b) = self.parse(&p.spec).ok()?;
        let result = tokenizer::number(a * b);
        let mut d = template::DemoBuilder::default();
        d.given(&p.prompt);
        if rng.uniform() < self.tool_fraction {
            d.model(&template::call(&product_ids(a, b)));
            d.given(&template::observation(&result));
        }
        d.model(&template::answer(&result));
        Some(d.finish())
    }
}

/// `A*B` as ids.
fn product_ids(a: i64, b: i64) -> Vec<TokenId> {
    let mut ids = tokenizer::number(a);
    ids.push(TIMES);
    ids.extend(tokenizer::number(b));
    ids
}
