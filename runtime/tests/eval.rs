//! Held-out evaluation draws its problems without replacement: n problems are n distinct
//! problems (a draw with replacement repeats some: 512 draws from a split of about 4,000 hold
//! about 480 distinct ones), and a split smaller than n is evaluated whole, once each.

mod stage;

use sluice_kernels::testing::Rng;
use sluice_kernels::Backend;
use sluice_model::Model;
use sluice_runtime::engine::{Engine, StopConfig};
use sluice_runtime::env::{Problem, Reply, Split, Task, TaskError};
use sluice_runtime::eval::{distinct_problems, pass_rate_with};
use sluice_runtime::trajectory::{
    ArtifactVersions, SamplingParams, TerminalReason, TokenId, WeightVersion,
};
use stage::Setup;
use std::collections::BTreeSet;

/// A single-turn task with `space` held-out problems, numbered; the prompt spells the number
/// (so a transcript tells which problem it was). Every answer passes.
struct Numbered {
    space: usize,
}

impl Numbered {
    fn prompt(id: usize) -> Vec<TokenId> {
        vec![0, 3 + (id % 12) as TokenId, 3 + (id / 12) as TokenId, 1]
    }
}

impl Task for Numbered {
    fn name(&self) -> &str {
        "numbered"
    }
    fn multi_turn(&self) -> bool {
        false
    }
    fn problem(&self, rng: &mut Rng, _split: Split) -> Problem {
        let id = rng.below(self.space);
        Problem {
            id: format!("numbered:{id}"),
            prompt: Numbered::prompt(id),
            spec: id.to_string(),
        }
    }
    fn respond(&self, _p: &Problem, _turn: u32, _g: &[TokenId]) -> Result<Reply, TaskError> {
        Ok(Reply::End {
            reward: 1.0,
            reason: TerminalReason::Success,
        })
    }
    fn stop(&self) -> StopConfig {
        StopConfig::default()
    }
    fn versions(&self) -> ArtifactVersions {
        ArtifactVersions {
            template: "numbered-1".into(),
            tokenizer: "raw-ids".into(),
            environment: "numbered-1".into(),
        }
    }
}

fn engine() -> Engine {
    let cfg = Setup::model_config();
    let model = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    Engine::new(
        Backend::Cpu,
        &cfg,
        &model.params,
        WeightVersion(0),
        Setup::new(vec![]).engine,
    )
    .unwrap()
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_new_tokens: 2,
        seed: 9,
        ..SamplingParams::default()
    }
}

#[test]
fn held_out_problems_are_drawn_without_replacement() {
    // 40 of 100 problems: drawn with replacement, 40 draws would almost surely repeat one.
    let task = Numbered { space: 100 };
    let mut eng = engine();
    let r = pass_rate_with(&mut eng, &task, 40, 7, greedy(), 1, 40).unwrap();
    assert_eq!((r.problems, r.requested, r.passed), (40, 40, 40));
    let prompts: BTreeSet<Vec<TokenId>> =
        r.transcripts.iter().map(|(t, _)| t[..4].to_vec()).collect();
    assert_eq!(
        prompts.len(),
        40,
        "every problem evaluated is a different one"
    );
    assert_eq!(r.counts(), "40/40 distinct problems");
    // The same seed sees the same problems.
    let again = distinct_problems(&task, 40, 7);
    let first: Vec<Vec<TokenId>> = r.transcripts.iter().map(|(t, _)| t[..4].to_vec()).collect();
    let drawn: Vec<Vec<TokenId>> = again.iter().map(|p| p.prompt.clone()).collect();
    assert_eq!(first, drawn);
}

#[test]
fn a_split_smaller_than_asked_is_evaluated_whole_once() {
    let task = Numbered { space: 30 };
    let mut eng = engine();
    let r = pass_rate_with(&mut eng, &task, 64, 7, greedy(), 1, 64).unwrap();
    assert_eq!((r.problems, r.requested), (30, 64));
    let prompts: BTreeSet<Vec<TokenId>> =
        r.transcripts.iter().map(|(t, _)| t[..4].to_vec()).collect();
    let all: BTreeSet<Vec<TokenId>> = (0..30).map(Numbered::prompt).collect();
    assert_eq!(prompts, all, "each of the 30 problems, once");
    assert!(r.counts().contains("64 asked for"), "{}", r.counts());
}
