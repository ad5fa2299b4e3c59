//! `tool`: the agentic tool task. The model is asked for the product of two (with
//! `chain_fraction`, sometimes three) multi-digit numbers; it can call a calculator
//! ([`super::calc`]) and read the result.
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
//! Why the tool decides success. Operands have `min_digits..=digits` digits (default: exactly
//! `digits`, 3), so products have up to 2·digits digits. A model of a few million parameters
//! cannot multiply multi-digit numbers in its head (it can roughly guess the leading digit and
//! the last one), so answering directly almost always fails unless both operands are single
//! digits; writing the call is copying the prompt, and answering after the observation is
//! copying the observation, both of which such a model learns in a few hundred supervised
//! steps. So the pass rate measures whether the policy uses the tool when it needs it.
//!
//! Demonstrations and the warm-up. [`Task::demonstration`] draws from a [`DemoMix`]:
//! - `tool_fraction`: the fraction of demonstrations that call the tool (correctly) and copy
//!   its result; the others answer directly, restating the problem with its exact product
//!   (`37*52=1924<eot>`), as someone who knows the answer would. Every demonstration is
//!   correct and replays to reward 1. **The default run's warm-up** (configs/default.toml:
//!   `digits = 2`, `min_digits = 1`, `tool_fraction = 0.4`): the data show two strategies,
//!   chosen independently of the problem, and nothing in them says that the model itself can
//!   only answer the 1-digit products directly. After the warm-up, greedy decoding answers
//!   directly (its first token is the first operand's first digit with probability about
//!   0.6, `<call>` about 0.4) and so fails most multi-digit problems, while sampling calls
//!   about 40% of the time. RL must learn from reward *when* to call: GRPO groups of a
//!   multi-digit problem hold calls that pass and direct answers that fail, groups of a
//!   1-digit problem mostly pass either way. Continuing the warm-up (the ablation arm,
//!   crate::arms) keeps the 60/40 mix. The restated form makes the direct strategy's first
//!   token a copy of the prompt, so the first decision is a clean two-way choice (direct
//!   answers that start with the product's leading digit spread that strategy's mass over
//!   nine tokens, and greedy decoding then calls whenever `<call>` beats the likeliest digit;
//!   measured below at `tool_fraction = 0.3`).
//! - `wrong_call_fraction`: the fraction of tool-calling demonstrations whose program is the
//!   sum `A+B` (their answer repeats what the tool returned, so they end with reward 0). The
//!   previous default warm-up used 0.75 with every demonstration calling: greedy decoding then
//!   writes `+` and fails every problem, and RL only has to flip that one token, which the
//!   prompt already shows (`*`): a gain the warm-up data hand over. With 0 the warm-up alone
//!   passes about 94% greedy (issue 26). Kept for experiments.
//! - `chain_fraction` (a task option, not part of the mix): the fraction of problems with three
//!   operands, `A*B*C`; the calculator then takes one operation per call, so a chained problem
//!   needs two calls (`A*B`, then `P*C` with P the first result) or a direct answer. A direct
//!   answer may restate the whole problem or the second step (`P*C=Q`).
//! - `chain_call_fraction`: the fraction of chained demonstrations that call for the first step
//!   whose second step calls too; the others answer the second step directly, restated
//!   (`84*45=3780`). **The default run** (`chain_fraction = 0.5`, `chain_call_fraction =
//!   0.25`): two chained calls are the rarest pattern in the data (40% call x 25% = 10% of the
//!   chained demonstrations), so after the warm-up greedy decoding passes few held-out problems
//!   (5-7%) and the model's own samples pass about half of them at least once in 8; RL must
//!   find from reward both when to call and that a second call is needed.
//!
//! Measured for the earlier warm-ups (2026-12-01; configs/model/small.toml on cpu, 16
//! demonstrations per step, 128 held-out problems, direct answers then the bare product):
//!
//! | digits | demonstrations               | steps | greedy        | sampled (T=1) |
//! |--------|------------------------------|-------|---------------|---------------|
//! | 2      | `wrong_call_fraction = 0.75` | 200   | 0.00          | 0.25          |
//! | 2      | `wrong_call_fraction = 0.6`  | 200   | 0.00          | 0.43          |
//! | 3      | `wrong_call_fraction = 0.6`  | 100 / 150 | 0.58 / 0.00 | 0.23 / 0.03 |
//! | 2      | `tool_fraction = 0.3`        | 200   | 0.02          | 0.01          |
//! | 3      | all correct                  | 150   | 0.73          |               |
//!
//! The default run's figures (warm-up, RL and both baselines, several seeds) are in
//! docs/perf/train.md.
//!
//! With `tool_fraction = 1` and `wrong_call_fraction = 0` (the option defaults) every
//! demonstration is a correct tool-using episode.
//!
//! Held-out problems are those whose spec (`"372*845"`) hashes odd, training problems those
//! that hash even.

use super::calc;
use super::text::TextTokenizer;
use super::{end, in_split, template, MAX_DIGITS};
use sluice_kernels::testing::Rng;
use sluice_runtime::engine::StopConfig;
use sluice_runtime::env::{Demonstration, Problem, Reply, Split, Task, TaskError};
use sluice_runtime::trajectory::{ArtifactVersions, TerminalReason, TokenId};
use std::sync::Arc;

/// The environment version recorded on trajectories.
pub const ENV_VERSION: &str = "tool-calculator-1";
/// The environment version with chained problems (`chain_fraction > 0`): three-operand
/// problems and a calculator of one operation per call.
pub const CHAIN_ENV_VERSION: &str = "tool-calculator-chain-1";

/// Tool calls allowed per episode; the rollout's `max_turns` should be at least 2 (one call
/// and the answer), and at most `MAX_CALLS + 1` turns can ever be used.
pub const MAX_CALLS: u32 = 3;

/// The longest observation the environment returns, in tokens (the rollout's
/// `max_observation_tokens` must be at least this): `<observation>`, at most 45 characters
/// (the longest error message, or a 20-character result), `<eot><assistant>`. A byte-level
/// BPE spends at most one token per ASCII character, so the bound holds on it too.
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
    /// The fraction of three-operand demonstrations that call the tool whose second step
    /// calls too (two chained calls); the others answer the second step directly.
    pub chain_call_fraction: f64,
}

impl DemoMix {
    /// Every demonstration calls the tool correctly.
    pub const CORRECT: DemoMix = DemoMix {
        tool_fraction: 1.0,
        wrong_call_fraction: 0.0,
        chain_call_fraction: 1.0,
    };
}

/// The agentic tool task (see the module docs).
#[derive(Clone, Debug)]
pub struct ToolTask {
    name: String,
    /// Operands have min_digits..=digits digits.
    min_digits: u32,
    digits: u32,
    mix: DemoMix,
    /// The share of problems with three operands (`A*B*C`), which the one-operation
    /// calculator answers in two chained calls; 0: every problem is `A*B` and the calculator
    /// takes any expression.
    chain_fraction: f64,
    tok: Arc<TextTokenizer>,
}

impl ToolTask {
    /// Operands of exactly `digits` digits (1..=9); demonstrations drawn as `mix` says (both
    /// fractions in [0, 1]).
    pub fn new(name: &str, digits: u32, mix: DemoMix) -> Result<ToolTask, TaskError> {
        ToolTask::with_sizes(name, digits, digits, mix)
    }

    /// Operands of `min_digits..=digits` digits (the length drawn uniformly per operand, then
    /// the value uniformly among numbers of that length).
    pub fn with_sizes(
        name: &str,
        min_digits: u32,
        digits: u32,
        mix: DemoMix,
    ) -> Result<ToolTask, TaskError> {
        if !(1..=MAX_DIGITS).contains(&digits) {
            return Err(TaskError(format!(
                "task {name}: digits must be in 1..={MAX_DIGITS}, got {digits}"
            )));
        }
        if !(1..=digits).contains(&min_digits) {
            return Err(TaskError(format!(
                "task {name}: min_digits must be in 1..=digits ({digits}), got {min_digits}"
            )));
        }
        for (key, f) in [
            ("tool_fraction", mix.tool_fraction),
            ("wrong_call_fraction", mix.wrong_call_fraction),
            ("chain_call_fraction", mix.chain_call_fraction),
        ] {
            if !(0.0..=1.0).contains(&f) {
                return Err(TaskError(format!(
                    "task {name}: {key} must be in [0, 1], got {f}"
                )));
            }
        }
        Ok(ToolTask {
            name: name.into(),
            min_digits,
            digits,
            mix,
            chain_fraction: 0.0,
            tok: TextTokenizer::char(),
        })
    }

    /// The same task with a share `fraction` (in [0, 1]) of three-operand problems and, when
    /// it is above 0, the one-operation calculator (see the module docs).
    pub fn with_chains(mut self, fraction: f64) -> Result<Self, TaskError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(TaskError(format!(
                "task {}: chain_fraction must be in [0, 1], got {fraction}",
                self.name
            )));
        }
        self.chain_fraction = fraction;
        Ok(self)
    }

    pub fn chain_fraction(&self) -> f64 {
        self.chain_fraction
    }

    fn chains(&self) -> bool {
        self.chain_fraction > 0.0
    }

    /// The same task on another tokenizer (the character one by default).
    pub fn with_tokenizer(mut self, tok: Arc<TextTokenizer>) -> Self {
        self.tok = tok;
        self
    }

    pub fn digits(&self) -> u32 {
        self.digits
    }

    pub fn min_digits(&self) -> u32 {
        self.min_digits
    }

    pub fn mix(&self) -> DemoMix {
        self.mix
    }

    fn operand(&self, rng: &mut Rng) -> i64 {
        // One length draws no length (the problem stream of a fixed-size task is unchanged).
        let digits = if self.min_digits == self.digits {
            self.digits
        } else {
            self.min_digits + rng.below((self.digits - self.min_digits + 1) as usize) as u32
        };
        let lo = if digits == 1 {
            1
        } else {
            10i64.pow(digits - 1)
        };
        lo + rng.below((10i64.pow(digits) - lo) as usize) as i64
    }

    /// The operands of a spec this task made (`"A*B"`, or `"A*B*C"` with chains; each of
    /// min_digits..=digits digits).
    fn parse(&self, spec: &str) -> Result<Vec<i64>, TaskError> {
        let bad = || {
            TaskError(format!(
                "task {}: problem spec {spec:?} is not {} with operands of {}..={} digits",
                self.name,
                if self.chains() { "A*B or A*B*C" } else { "A*B" },
                self.min_digits,
                self.digits
            ))
        };
        let parts: Vec<&str> = spec.split('*').collect();
        if !(parts.len() == 2 || parts.len() == 3 && self.chains()) {
            return Err(bad());
        }
        let num = |s: &str| -> Result<i64, TaskError> {
            let sizes = self.min_digits as usize..=self.digits as usize;
            if !sizes.contains(&s.len())
                || s.starts_with('0')
                || !s.bytes().all(|c| c.is_ascii_digit())
            {
                return Err(bad());
            }
            s.parse().map_err(|_| bad())
        };
        parts.into_iter().map(num).collect()
    }

    /// The observation answering a call turn (`generated` ends in `</call>`).
    fn run_call(&self, generated: &[TokenId]) -> Result<Vec<TokenId>, TaskError> {
        let body = &generated[..generated.len() - 1];
        let sp = self.tok.specials();
        let text = match body.iter().rposition(|&t| t == sp.call) {
            None => "error: no call start".to_string(),
            Some(i) => match self.tok.plain_text(&body[i + 1..]) {
                None => "error: bad token in program".to_string(),
                Some(program) => match if self.chains() {
                    calc::eval_one_operation(&program)
                } else {
                    calc::eval(&program)
                } {
                    Ok(v) => v.to_string(),
                    Err(e) => e.to_string(),
                },
            },
        };
        // Every message above is in the vocabulary (a test checks); an encoding failure here
        // is this task's bug, reported as the environment's error rather than a panic.
        let ids = self.tok.encode(&text).map_err(|e| {
            TaskError(format!(
                "task {}: observation {text:?} does not encode: {e}",
                self.name
            ))
        })?;
        Ok(template::observation(&sp, &ids))
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
            // Without chains no draw is made (the problem stream of a two-operand task is
            // unchanged).
            let three = self.chains() && rng.uniform() < self.chain_fraction;
            let (a, b) = (self.operand(rng), self.operand(rng));
            let spec = if three {
                format!("{a}*{b}*{}", self.operand(rng))
            } else {
                format!("{a}*{b}")
            };
            if !in_split(SPLIT_SEED, &spec, split) {
                continue;
            }
            return Problem {
                id: format!("{}:{spec}", self.name),
                prompt: template::prompt(&self.tok.specials(), &self.tok.encode_known(&spec)),
                spec,
            };
        }
    }

    fn respond(&self, p: &Problem, turn: u32, generated: &[TokenId]) -> Result<Reply, TaskError> {
        let ops = self.parse(&p.spec)?;
        if generated.last() == Some(&self.tok.specials().end_call) {
            // Turn t is call number t + 1: every earlier turn was a call.
            if turn >= MAX_CALLS {
                return Ok(Reply::End {
                    reward: 0.0,
                    reason: TerminalReason::Budget,
                });
            }
            return Ok(Reply::Observe(self.run_call(generated)?));
        }
        // The product alone, or the problem restated with it (`A*B=P`, how a direct answer
        // is written); a three-operand problem also after its first step (`P*C=Q`, P = A*B).
        let want = ops.iter().product::<i64>().to_string();
        let mut restated = vec![p.spec.clone()];
        if let [a, b, c] = ops[..] {
            restated.push(format!("{}*{c}", a * b));
        }
        Ok(end(template::answer_text(&self.tok, generated)
            .is_some_and(|t| {
                t == want
                    || t.split_once('=')
                        .is_some_and(|(x, v)| v == want && restated.iter().any(|r| r == x))
            })))
    }

    fn stop(&self) -> StopConfig {
        StopConfig {
            eos: Some(self.tok.specials().eot),
            stop_sequences: vec![vec![self.tok.specials().end_call]],
        }
    }

    fn versions(&self) -> ArtifactVersions {
        ArtifactVersions {
            template: template::VERSION.into(),
            tokenizer: self.tok.version(),
            environment: if self.chains() {
                CHAIN_ENV_VERSION
            } else {
                ENV_VERSION
            }
            .into(),
        }
    }

    fn demonstration(&self, p: &Problem, rng: &mut Rng) -> Option<Demonstration> {
        let ops = self.parse(&p.spec).ok()?;
        let (a, b) = (ops[0], ops[1]);
        // Both draws always happen, so one demonstration consumes the same randomness
        // whatever the mix.
        let (call, wrong) = (rng.uniform(), rng.uniform());
        // A three-operand problem draws its second step's strategy too.
        let second = if ops.len() == 3 { rng.uniform() } else { 1.0 };
        let sp = self.tok.specials();
        let mut d = template::DemoBuilder::default();
        d.given(&p.prompt);
        if call >= self.mix.tool_fraction {
            // A direct answer restates the problem, then the product: `A*B=P`.
            let product: i64 = ops.iter().product();
            let direct = self.tok.encode_known(&format!("{}={product}", p.spec));
            d.model(&template::answer(&sp, &direct));
            return Some(d.finish());
        }
        let (op, value) = if wrong < self.mix.wrong_call_fraction {
            ('+', a + b)
        } else {
            ('*', a * b)
        };
        let result = self.tok.number(value);
        d.model(&template::call(&sp, &self.operation_ids(a, op, b)));
        d.given(&template::observation(&sp, &result));
        let Some(&c) = ops.get(2) else {
            d.model(&template::answer(&sp, &result));
            return Some(d.finish());
        };
        // A chained problem: the second step calls (`P*C`) and the answer copies the result,
        // or the second step is answered directly, restated: `P*C=Q`.
        let (next, value) = (self.operation_ids(value, '*', c), value * c);
        if second < self.mix.chain_call_fraction {
            let result = self.tok.number(value);
            d.model(&template::call(&sp, &next));
            d.given(&template::observation(&sp, &result));
            d.model(&template::answer(&sp, &result));
        } else {
            let mut text = next;
            text.extend(self.tok.encode_known(&format!("={value}")));
            d.model(&template::answer(&sp, &text));
        }
        Some(d.finish())
    }
}

impl ToolTask {
    /// `A op B` as ids (encoded as one text).
    fn operation_ids(&self, a: i64, op: char, b: i64) -> Vec<TokenId> {
        self.tok.encode_known(&format!("{a}{op}{b}"))
    }
}
