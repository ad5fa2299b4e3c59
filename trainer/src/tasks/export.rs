//! `sluice tasks export`: a task's problems as JSON lines, so an environment written outside
//! sluice (examples/tool) can serve exactly the built-in task's problems, and a test can hold
//! the two to the same rewards.
//!
//! One line per problem: `{"id": ..., "spec": ..., "prompt": {"text": ...}, "ids": [...]}`
//! (the prompt's text as the run's tokenizer decodes it, and its ids). Held-out problems
//! are the ones the run's evaluation draws ([`distinct_problems`]: the same seed, the same
//! problems, in the same order); training problems come from a stream keyed the same way.

use super::text::TextTokenizer;
use serde_json::{json, Value};
use sluice_kernels::testing::Rng;
use sluice_runtime::env::{Problem, Split, Task};
use sluice_runtime::eval::distinct_problems;
use sluice_runtime::hash::{hash_str, mix64};
use std::collections::BTreeSet;

/// Up to `n` distinct problems of `split`, in draw order.
pub fn problems(task: &dyn Task, split: Split, n: usize, seed: u64) -> Vec<Problem> {
    if split == Split::HeldOut {
        return distinct_problems(task, n, seed);
    }
    let max_draws = 16 * n as u64 + 1024;
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(n);
    for k in 0..max_draws {
        if out.len() == n {
            break;
        }
        let mut rng = Rng::new(mix64(hash_str(seed ^ 0x7a11, task.name()) ^ mix64(k)));
        let p = task.problem(&mut rng, Split::Train);
        if seen.insert(p.id.clone()) {
            out.push(p);
        }
    }
    out
}

/// One exported line.
pub fn line(tok: &TextTokenizer, p: &Problem) -> Value {
    json!({
        "id": p.id,
        "spec": p.spec,
        "prompt": {"text": tok.render(&p.prompt)},
        "ids": p.prompt,
    })
}

/// Parses `train` or `held_out`.
pub fn parse_split(s: &str) -> Result<Split, String> {
    match s {
        "train" => Ok(Split::Train),
        "held_out" | "held-out" => Ok(Split::HeldOut),
        o => Err(format!("--split {o:?}: train or held_out")),
    }
}
