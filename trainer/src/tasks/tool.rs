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
//! which such a model learns in a few hundred supervised steps (one to two minutes on 2
//! cores). So the pass rate measures whether the policy uses the tool correctly.
//!
//! Demonstrations and the warm-up. The train issue wants a supervised warm-up after which
//! the greedy held-out pass rate is below 50% but sampling sometimes succeeds, so that RL has
//! something to reinforce. [`Task::demonstration`] draws from a [`DemoMix`]:
//! - `wrong_call_fraction` (recommended for the warm-up): every demonstration calls the tool
//!   and copies its result, but this fraction of them call it with the wrong program, the sum
//!   `A+B`, and so end with reward 0. The model learns all of the mechanics from every
//!   demonstration (copy the operands into the call, copy the observation into the answer) and
//!   learns to write `+` after the first operand with probability about
//!   `wrong_call_fraction`. With a fraction above one half, greedy decoding writes `+` and
//!   fails on every problem, while sampling at temperature 1 writes `*` about
//!   `1 - wrong_call_fraction` of the time and succeeds: GRPO groups then hold both outcomes,
//!   and RL only has to move one decision.
//! - `tool_fraction`: the fraction of demonstrations that call the tool; the others write the
//!   correct product straight after the prompt (which the model cannot compute). Measured,
//!   this is a poor warm-up: the direct answers are noise the model cannot fit, they dilute the
//!   copying it must learn, and greedy decoding still opens with `<call>` as soon as its
//!   probability beats the most likely leading digit (about 0.3 is enough).
//!
//! Measured (2026-12-01; configs/model/small.toml on cpu, Muon+AdamW at `sluice sft`'s default
//! learning rates, 16 demonstrations per step, a 2-core machine shared with other builds):
//! greedy and temperature-1 pass rates on 128 held-out problems after the warm-up, episodes
//! run through [`Task::respond`].
//!
//! | digits | demonstrations               | steps | greedy        | sampled (T=1) |
//! |--------|------------------------------|-------|---------------|---------------|
//! | 2      | `wrong_call_fraction = 0.75` | 200   | 0.00          | 0.25          |
//! | 2      | `wrong_call_fraction = 0.6`  | 200   | 0.00          | 0.43          |
//! | 3      | `wrong_call_fraction = 0.6`  | 100 / 150 | 0.58 / 0.00 | 0.23 / 0.03 |
//! | 2      | `tool_fraction = 0.3`        | 200   | 0.02          | 0.01          |
//! | 3      | all correct                  | 150   | 0.73          |               |
//!
//! Near one half the learned share of `+` drifts with the optimizer's noise (the 3-digit row
//! flips between evaluations), so a warm-up that must stay below 50% greedy wants a clear
//! margin: `wrong_call_fraction` about 0.75.
//!
//! With the defaults (`tool_fraction = 1`, `wrong_call_fraction = 0`) every demonstration is
//! a correct tool-using episode and replays to reward 1.
//!
//! Held-out problems are those whose spec (`"372*845"`) hashes odd, training problems those
//! that hash even.

use super::calc;
use super::tokenizer::{self, CALL, END_CALL, EOT, PLUS, TIMES};
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

/// The longest observation the environment returns, in tokens (the rollout's
/// `max_observation_tokens` must be at least this): `<observation>`, at most 45 characters
/// (the longest error message, or a 20-character result), `<eot><assistant>`.
pub const MAX_OBSERVATION_TOKENS: usize = 48;

/// Seed of the split hash (distinct per task kind).
const SPLIT_SEED: u64 = 0x7001;

/// What [`Task::demonstration`] draws (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DemoMix {
    /// The fraction of demonstrations that call the tool; the rest answer directly.
    pub tool_fraction: f64,
    /// The fraction of tool-calling demonstrations whose program is the sum `A+B` instead of
    /// the product; their answer repeats what the tool returned, so they end with reward 0.
    pub wrong_call_fraction: f64,
}

impl DemoMix {
    /// Every demonstration calls the tool correctly.
    pub const CORRECT: DemoMix = DemoMix {
        tool_fraction: 1.0,
        wrong_call_fraction: 0.0,
    };
}

/// The agentic tool task (see the module docs).
#[derive(Clone, Debug)]
pub struct ToolTask {
    name: String,
    digits: u32,
    mix: DemoMix,
}

impl ToolTask {
    /// Operands of exactly `digits` digits (1..=9); demonstrations drawn as `mix` says (both
    /// fractions in [0, 1]).
    pub fn new(name: &str, digits: u32, mix: DemoMix) -> Result<ToolTask, TaskError> {
        if !(1..=MAX_DIGITS).contains(&digits) {
            return Err(TaskError(format!(
                "task {name}: digits must be in 1..={MAX_DIGITS}, got {digits}"
            )));
        }
        for (key, f) in [
            ("tool_fraction", mix.tool_fraction),
            ("wrong_call_fraction", mix.wrong_call_fraction),
        ] {
            if !(0.0..=1.0).contains(&f) {
                return Err(TaskError(format!(
                    "task {name}: {key} must be in [0, 1], got {f}"
                )));
            }
        }
        Ok(ToolTask {
            name: name.into(),
            digits,
            mix,
        })
    }

    pub fn digits(&self) -> u32 {
        self.digits
    }

    pub fn mix(&self) -> DemoMix {
        self.mix
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
                prompt: template::prompt(&operation_ids(a, TIMES, b)),
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
        // Both draws always happen, so one demonstration consumes the same randomness
        // whatever the mix.
        let (call, wrong) = (rng.uniform(), rng.uniform());
        let mut d = template::DemoBuilder::default();
        d.given(&p.prompt);
        let result = if call < self.mix.tool_fraction {
            let (op, value) = if wrong < self.mix.wrong_call_fraction {
                (PLUS, a + b)
            } else {
                (TIMES, a * b)
            };
            let result = tokenizer::number(value);
            d.model(&template::call(&operation_ids(a, op, b)));
            d.given(&template::observation(&result));
            result
        } else {
            tokenizer::number(a * b)
        };
        d.model(&template::answer(&result));
        Some(d.finish())
    }
}

/// `A op B` as ids.
fn operation_ids(a: i64, op: TokenId, b: i64) -> Vec<TokenId> {
    let mut ids = tokenizer::number(a);
    ids.push(op);
    ids.extend(tokenizer::number(b));
    ids
}
