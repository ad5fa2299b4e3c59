//! `sort`: a reasoning task answered in one turn: the digits of the prompt in ascending order.
//!
//! ```text
//! <bos><user>sort 83169<eot><assistant>13689<eot>
//! ```
//!
//! A problem has 2..=`digits` digits (the count uniform, each digit uniform). The reward is 1
//! (`success`) when the turn is exactly the sorted digits then `<eot>`, else 0 (`failure`).
//! Unlike `arith`'s sums, whose carries a small model learns slowly, sorting is something a
//! small transformer learns in a few hundred steps and that generalises to unseen problems
//! (counting each digit through attention), so it suits short runs that must show progress on
//! held-out problems.
//!
//! Measured (2026-12-01, configs/model/small.toml on cpu, Muon+AdamW at `sluice sft`'s default
//! learning rates, 16 demonstrations per step, a shared 2-core machine; 128 held-out problems
//! of 2..=5 digits): greedy pass rate 0.48 after 75 supervised steps, 0.57 after 200 (0.27 and
//! 0.37 sampled at temperature 1).
//!
//! Held-out problems are those whose spec (the digit string) hashes odd, training problems
//! those that hash even.

use super::text::TextTokenizer;
use super::{end, in_split, template, MAX_DIGITS};
use sluice_kernels::testing::Rng;
use sluice_runtime::engine::StopConfig;
use sluice_runtime::env::{Demonstration, Problem, Reply, Split, Task, TaskError};
use sluice_runtime::trajectory::{ArtifactVersions, TokenId};
use std::sync::Arc;

/// The environment version recorded on trajectories.
pub const ENV_VERSION: &str = "sort-digits-1";

/// Seed of the split hash (distinct per task kind).
const SPLIT_SEED: u64 = 0x5087;

/// Sorting digits in one turn (see the module docs).
#[derive(Clone, Debug)]
pub struct Sort {
    name: String,
    digits: u32,
    tok: Arc<TextTokenizer>,
}

impl Sort {
    /// Problems of 2..=`digits` digits (`digits` in 2..=9).
    pub fn new(name: &str, digits: u32) -> Result<Sort, TaskError> {
        if !(2..=MAX_DIGITS).contains(&digits) {
            return Err(TaskError(format!(
                "task {name}: digits must be in 2..={MAX_DIGITS} for sort, got {digits}"
            )));
        }
        Ok(Sort {
            name: name.into(),
            digits,
            tok: TextTokenizer::char(),
        })
    }

    /// The same task on another tokenizer (the character one by default).
    pub fn with_tokenizer(mut self, tok: Arc<TextTokenizer>) -> Sort {
        self.tok = tok;
        self
    }

    /// The digits of a spec this task made.
    fn parse<'a>(&self, spec: &'a str) -> Result<&'a str, TaskError> {
        let n = spec.len();
        if (2..=self.digits as usize).contains(&n) && spec.bytes().all(|c| c.is_ascii_digit()) {
            Ok(spec)
        } else {
            Err(TaskError(format!(
                "task {}: problem spec {spec:?} is not a string of 2..={} digits",
                self.name, self.digits
            )))
        }
    }
}

fn sorted(digits: &str) -> String {
    let mut b = digits.as_bytes().to_vec();
    b.sort_unstable();
    // ASCII digits stay ASCII.
    b.into_iter().map(char::from).collect()
}

impl Task for Sort {
    fn name(&self) -> &str {
        &self.name
    }

    fn multi_turn(&self) -> bool {
        false
    }

    fn problem(&self, rng: &mut Rng, split: Split) -> Problem {
        loop {
            let n = 2 + rng.below(self.digits as usize - 1);
            let spec: String = (0..n)
                .map(|_| char::from(b'0' + rng.below(10) as u8))
                .collect();
            if !in_split(SPLIT_SEED, &spec, split) {
                continue;
            }
            return Problem {
                id: format!("{}:{spec}", self.name),
                prompt: template::prompt(
                    &self.tok.specials(),
                    &self.tok.encode_known(&format!("sort {spec}")),
                ),
                spec,
            };
        }
    }

    fn respond(&self, p: &Problem, turn: u32, generated: &[TokenId]) -> Result<Reply, TaskError> {
        let digits = self.parse(&p.spec)?;
        if turn != 0 {
            return Err(TaskError(format!(
                "task {}: sort has one turn, got turn {turn}",
                self.name
            )));
        }
        let want = sorted(digits);
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
        let digits = self.parse(&p.spec).ok()?;
        let mut d = template::DemoBuilder::default();
        d.given(&p.prompt);
        d.model(&template::answer(
            &self.tok.specials(),
            &self.tok.encode_known(&sorted(digits)),
        ));
        Some(d.finish())
    }
}
