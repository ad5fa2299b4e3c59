//! `arith`: a reasoning task answered in one turn: the sum of two non-negative integers.
//!
//! ```text
//! <bos><user>372+45<eot><assistant>417<eot>
//! ```
//!
//! Each operand has 1..=`digits` digits (the count uniform, then the value uniform among the
//! numbers of that many digits). The reward is 1 (`success`) when the turn is exactly the sum's
//! decimal digits then `<eot>`, else 0 (`failure`): a leading zero, a space, a tool call or
//! anything else is wrong. Writing the most significant digit first needs the carries, which is
//! what makes it a (small) reasoning problem for a small transformer; `digits` sets how hard.
//!
//! Measured (2026-12-01, configs/model/small.toml on cpu, `sluice sft`'s learning rates, 16
//! demonstrations per step): after 200 supervised steps the greedy held-out pass rate is 0.03
//! with `digits = 2` and 0.02 with 3; with `digits = 1` (100 problems) the model memorises the
//! training half (loss 0.01) and passes 0.2-0.3 of the held-out half. Sums are a slow task for
//! a small model; `sort` shows progress in short runs.
//!
//! Held-out problems are those whose spec (`"372+45"`) hashes odd, training problems those that
//! hash even, so the two streams never share a problem.

use super::text::TextTokenizer;
use super::{end, in_split, template, MAX_DIGITS};
use sluice_kernels::testing::Rng;
use sluice_runtime::engine::StopConfig;
use sluice_runtime::env::{Demonstration, Problem, Reply, Split, Task, TaskError};
use sluice_runtime::trajectory::{ArtifactVersions, TokenId};
use std::sync::Arc;

/// The environment version recorded on trajectories.
pub const ENV_VERSION: &str = "arith-add-1";

/// Seed of the split hash (distinct per task kind).
const SPLIT_SEED: u64 = 0xa817;

/// Multi-digit addition in one turn (see the module docs).
#[derive(Clone, Debug)]
pub struct Arith {
    name: String,
    digits: u32,
    tok: Arc<TextTokenizer>,
}

impl Arith {
    /// Operands of 1..=`digits` digits (1..=9; the registry's default is [`super::DEFAULT_DIGITS`]).
    pub fn new(name: &str, digits: u32) -> Result<Arith, TaskError> {
        if !(1..=MAX_DIGITS).contains(&digits) {
            return Err(TaskError(format!(
                "task {name}: digits must be in 1..={MAX_DIGITS}, got {digits}"
            )));
        }
        Ok(Arith {
            name: name.into(),
            digits,
            tok: TextTokenizer::char(),
        })
    }

    /// The same task on another tokenizer (the character one by default).
    pub fn with_tokenizer(mut self, tok: Arc<TextTokenizer>) -> Self {
        self.tok = tok;
        self
    }

    pub fn digits(&self) -> u32 {
        self.digits
    }

    fn operand(&self, rng: &mut Rng) -> i64 {
        let d = 1 + rng.below(self.digits as usize) as u32;
        let lo = if d == 1 { 0 } else { 10i64.pow(d - 1) };
        lo + rng.below((10i64.pow(d) - lo) as usize) as i64
    }

    /// The operands of a spec this task made (`"A+B"`, each at most `digits` digits).
    fn parse(&self, spec: &str) -> Result<(i64, i64), TaskError> {
        let bad = || {
            TaskError(format!(
                "task {}: problem spec {spec:?} is not A+B with operands of at most {} digits",
                self.name, self.digits
            ))
        };
        let (a, b) = spec.split_once('+').ok_or_else(bad)?;
        let num = |s: &str| -> Result<i64, TaskError> {
            if s.is_empty()
                || s.len() > self.digits as usize
                || !s.bytes().all(|c| c.is_ascii_digit())
            {
                return Err(bad());
            }
            s.parse().map_err(|_| bad())
        };
        Ok((num(a)?, num(b)?))
    }
}

impl Task for Arith {
    fn name(&self) -> &str {
        &self.name
    }

    fn multi_turn(&self) -> bool {
        false
    }

    fn problem(&self, rng: &mut Rng, split: Split) -> Problem {
        loop {
            let (a, b) = (self.operand(rng), self.operand(rng));
            let spec = format!("{a}+{b}");
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
        let (a, b) = self.parse(&p.spec)?;
        if turn != 0 {
            return Err(TaskError(format!(
                "task {}: arith has one turn, got turn {turn}",
                self.name
            )));
        }
        let want = (a + b).to_string();
        Ok(end(
            template::answer_text(&self.tok, generated).is_some_and(|t| t == want)
        ))
    }

    fn stop(&self) -> StopConfig {
        StopConfig {
            eos: Some(self.tok.specials().eot),
            stop_sequences: Vec::new(),
        }
    }

    fn versions(&self) -> ArtifactVersions {
        ArtifactVersions {
            template: template::VERSION.into(),
            tokenizer: self.tok.version(),
            environment: ENV_VERSION.into(),
        }
    }

    fn demonstration(&self, p: &Problem, _rng: &mut Rng) -> Option<Demonstration> {
        let (a, b) = self.parse(&p.spec).ok()?;
        let mut d = template::DemoBuilder::default();
        d.given(&p.prompt);
        d.model(&template::answer(
            &self.tok.specials(),
            &self.tok.number(a + b),
        ));
        Some(d.finish())
    }
}
