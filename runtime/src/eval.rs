//! Held-out pass rates: a task's held-out problems run through an engine and answered by the
//! task's environment directly (no latency, no injected faults), greedy or sampled.

use crate::engine::{Engine, EngineError, Request};
use crate::env::{Problem, Reply, Split, Task};
use crate::hash::{hash_str, mix64};
use crate::trajectory::{SamplingParams, TerminalReason};
use sluice_kernels::testing::Rng;
use std::collections::{BTreeMap, BTreeSet};

/// The outcome of an evaluation.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PassRate {
    pub task: String,
    /// Distinct problems evaluated (fewer than asked for only when the held-out split has
    /// fewer).
    pub problems: usize,
    /// Problems asked for.
    #[serde(default)]
    pub requested: usize,
    pub passed: usize,
    /// The first problems' full token sequences and rewards (as many as asked for).
    #[serde(default)]
    pub transcripts: Vec<(Vec<crate::trajectory::TokenId>, f32)>,
}

impl PassRate {
    /// `passed/problems distinct problems`, saying so when the held-out split had fewer than
    /// were asked for.
    pub fn counts(&self) -> String {
        let mut s = format!("{}/{} distinct problems", self.passed, self.problems);
        if self.problems < self.requested {
            s.push_str(&format!(
                ", every one the held-out split has ({} asked for)",
                self.requested
            ));
        }
        s
    }

    pub fn rate(&self) -> f64 {
        if self.problems == 0 {
            0.0
        } else {
            self.passed as f64 / self.problems as f64
        }
    }
}

/// Runs `problems` distinct held-out problems of `task` on `engine` (which must hold no
/// trajectory) with `sampling` (temperature 0: greedy); a problem passes when its episode ends
/// with a reward > 0 within `max_turns` model turns. Problems are drawn without replacement:
/// draw k comes from a stream keyed by (seed, task, k) and a problem already drawn (same id)
/// is skipped, so every evaluation with the same seed sees the same problems, each once. When
/// the held-out split has fewer distinct problems than asked for, all of them are evaluated
/// (`PassRate::problems` < `requested`).
pub fn pass_rate(
    engine: &mut Engine,
    task: &dyn Task,
    problems: usize,
    seed: u64,
    sampling: SamplingParams,
    max_turns: u32,
) -> Result<PassRate, EngineError> {
    pass_rate_with(engine, task, problems, seed, sampling, max_turns, 0)
}

/// [`pass_rate`] that also keeps the transcripts of the first `keep` problems.
pub fn pass_rate_with(
    engine: &mut Engine,
    task: &dyn Task,
    problems: usize,
    seed: u64,
    sampling: SamplingParams,
    max_turns: u32,
    keep: usize,
) -> Result<PassRate, EngineError> {
    if !engine.is_empty() {
        return Err(EngineError::Invalid(
            "evaluation needs an engine that holds no trajectory".into(),
        ));
    }
    let name = task.name().to_string();
    let probs = distinct_problems(task, problems, seed);
    // handle -> (problem index, turn)
    let mut live = BTreeMap::new();
    for (i, p) in probs.iter().enumerate() {
        let req = Request {
            session_id: format!("eval/{name}/{i}"),
            instance_id: format!("eval/{}#{i}", p.id),
            task: name.clone(),
            group_size: 1,
            prompt: p.prompt.clone(),
            sampling,
            stop: task.stop(),
            multi_turn: task.multi_turn(),
        };
        let h = engine.submit(req)?;
        live.insert(h[0], (i, 0u32));
    }
    let mut passed = 0;
    let mut kept: BTreeMap<usize, (Vec<crate::trajectory::TokenId>, f32)> = BTreeMap::new();
    let mut steps = 0u64;
    while !live.is_empty() {
        if !engine.has_work() {
            return Err(EngineError::Invalid(format!(
                "evaluation of {name}: {} episodes wait but the engine has no work",
                live.len()
            )));
        }
        steps += 1;
        if steps > 1_000_000 {
            return Err(EngineError::Invalid(format!(
                "evaluation of {name} made no progress"
            )));
        }
        for ev in engine.step()? {
            let ev = ev.into_ended_turn();
            let (handle, single) = (ev.handle, ev.sample.is_some());
            let Some((i, turn)) = live.remove(&handle) else {
                continue;
            };
            // As in training: a turn cut by a length limit is still scored by the task, and
            // the episode ends with it.
            let (cut, generated) = (ev.cut, ev.generated);
            let reply = task
                .respond(&probs[i], turn, &generated)
                .unwrap_or(Reply::End {
                    reward: 0.0,
                    reason: TerminalReason::Environment,
                });
            let reply = match reply {
                Reply::Observe(_) if cut => Reply::End {
                    reward: 0.0,
                    reason: TerminalReason::Budget,
                },
                r => r,
            };
            let mut ended = |tokens: Option<Vec<crate::trajectory::TokenId>>, reward: f32| {
                if i < keep {
                    let t = tokens.unwrap_or_default();
                    kept.insert(i, (t, reward));
                }
            };
            let single_tokens = |g: &[crate::trajectory::TokenId]| {
                let mut t = probs[i].prompt.clone();
                t.extend_from_slice(g);
                t
            };
            match reply {
                Reply::End { reward, reason } => {
                    if reward > 0.0 {
                        passed += 1;
                    }
                    if single {
                        ended(Some(single_tokens(&generated)), reward);
                    } else {
                        let s = engine.finish(handle, reward, reason)?;
                        ended(Some(s.tokens), reward);
                    }
                }
                Reply::Observe(obs) => {
                    if single || turn + 1 >= max_turns {
                        if single {
                            ended(Some(single_tokens(&generated)), 0.0);
                        } else {
                            let s = engine.finish(handle, 0.0, TerminalReason::Budget)?;
                            ended(Some(s.tokens), 0.0);
                        }
                    } else if engine
                        .observe(handle, &obs, sampling.max_new_tokens)
                        .is_ok()
                    {
                        live.insert(handle, (i, turn + 1));
                    } else {
                        let s = engine.finish(handle, 0.0, TerminalReason::Budget)?;
                        ended(Some(s.tokens), 0.0);
                    }
                }
            }
        }
    }
    Ok(PassRate {
        task: name,
        problems: probs.len(),
        requested: problems,
        passed,
        transcripts: kept.into_values().collect(),
    })
}

/// Up to `n` distinct held-out problems of `task` (by id), in draw order: draw k is keyed by
/// (seed, task, k), and a repeat is skipped. Stops after `16 n + 1024` draws, which finds every
/// problem of a split smaller than `n` (a coupon collector needs about m ln m draws for m
/// problems) long before it could loop.
pub fn distinct_problems(task: &dyn Task, n: usize, seed: u64) -> Vec<Problem> {
    let name = task.name();
    let max_draws = 16 * n as u64 + 1024;
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(n);
    let mut k = 0u64;
    while out.len() < n && k < max_draws {
        let mut rng = Rng::new(mix64(hash_str(seed ^ 0xe7a1, name) ^ mix64(k)));
        k += 1;
        let p = task.problem(&mut rng, Split::HeldOut);
        if seen.insert(p.id.clone()) {
            out.push(p);
        }
    }
    out
}

/// One finished episode of [`run_episodes`]: the index of its problem and the whole
/// trajectory (tokens, loss mask, reward and terminal reason set by the task).
#[derive(Clone, Debug)]
pub struct Episode {
    pub problem: usize,
    pub sample: crate::trajectory::Sample,
}

/// Runs `samples` episodes of each of `problems` on `engine` (which must hold no trajectory)
/// with `sampling`, answered by `task` directly (no latency, no faults), each ending as in
/// [`pass_rate`]: a turn cut by a length limit is scored and ends the episode, and a call past
/// `max_turns` model turns ends it as `budget` with reward 0. `tag` keys the sessions (and so
/// the sampling streams): the same tag, seed and problems give the same episodes. Episodes
/// come back ordered by (problem, sample).
pub fn run_episodes(
    engine: &mut Engine,
    task: &dyn Task,
    problems: &[Problem],
    samples: usize,
    sampling: SamplingParams,
    max_turns: u32,
    tag: &str,
) -> Result<Vec<Episode>, EngineError> {
    if !engine.is_empty() {
        return Err(EngineError::Invalid(
            "episodes need an engine that holds no trajectory".into(),
        ));
    }
    let name = task.name().to_string();
    // handle -> (problem index, sample index, turn)
    let mut live = BTreeMap::new();
    for (i, p) in problems.iter().enumerate() {
        let req = Request {
            session_id: format!("{tag}/{name}/{i}"),
            instance_id: format!("{tag}/{}#{i}", p.id),
            task: name.clone(),
            group_size: samples as u32,
            prompt: p.prompt.clone(),
            sampling,
            stop: task.stop(),
            multi_turn: task.multi_turn(),
        };
        for (j, h) in engine.submit(req)?.into_iter().enumerate() {
            live.insert(h, (i, j, 0u32));
        }
    }
    let mut done: BTreeMap<(usize, usize), crate::trajectory::Sample> = BTreeMap::new();
    let mut steps = 0u64;
    while !live.is_empty() {
        if !engine.has_work() {
            return Err(EngineError::Invalid(format!(
                "episodes of {name}: {} wait but the engine has no work",
                live.len()
            )));
        }
        steps += 1;
        if steps > 10_000_000 {
            return Err(EngineError::Invalid(format!(
                "episodes of {name} made no progress"
            )));
        }
        for ev in engine.step()? {
            let ev = ev.into_ended_turn();
            let handle = ev.handle;
            let Some((i, j, turn)) = live.remove(&handle) else {
                continue;
            };
            let reply = task
                .respond(&problems[i], turn, &ev.generated)
                .unwrap_or(Reply::End {
                    reward: 0.0,
                    reason: TerminalReason::Environment,
                });
            let (reward, reason) = match reply {
                Reply::End { reward, reason } => (reward, reason),
                Reply::Observe(_) if ev.cut || ev.sample.is_some() || turn + 1 >= max_turns => {
                    (0.0, TerminalReason::Budget)
                }
                Reply::Observe(obs) => {
                    if engine
                        .observe(handle, &obs, sampling.max_new_tokens)
                        .is_ok()
                    {
                        live.insert(handle, (i, j, turn + 1));
                        continue;
                    }
                    (0.0, TerminalReason::Budget)
                }
            };
            let sample = match ev.sample {
                // A single-turn sequence the engine already ended.
                Some(mut s) => {
                    s.reward = reward;
                    s.terminal_reason = reason;
                    s
                }
                None => engine.finish(handle, reward, reason)?,
            };
            done.insert((i, j), sample);
        }
    }
    Ok(done
        .into_iter()
        .map(|((problem, _), sample)| Episode { problem, sample })
        .collect())
}

/// Sampled pass rates of `problems` distinct held-out problems: `k` episodes each (see
/// [`run_episodes`]). `pass_at_1` is the share of all episodes that passed (the sampled pass
/// rate), `pass_at_k` the share of problems with at least one passing episode.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PassAtK {
    pub task: String,
    pub problems: usize,
    pub k: usize,
    pub pass_at_1: f64,
    pub pass_at_k: f64,
}

/// [`PassAtK`] of `task` on `problems` distinct held-out problems (drawn as [`pass_rate`]
/// draws them, so greedy and sampled rates are over the same problems).
pub fn pass_at_k(
    engine: &mut Engine,
    task: &dyn Task,
    problems: usize,
    k: usize,
    seed: u64,
    sampling: SamplingParams,
    max_turns: u32,
) -> Result<PassAtK, EngineError> {
    let probs = distinct_problems(task, problems, seed);
    let eps = run_episodes(engine, task, &probs, k.max(1), sampling, max_turns, "eval")?;
    let mut solved = vec![false; probs.len()];
    let mut passed = 0usize;
    for e in &eps {
        if e.sample.reward > 0.0 {
            passed += 1;
            solved[e.problem] = true;
        }
    }
    let frac = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    Ok(PassAtK {
        task: task.name().to_string(),
        problems: probs.len(),
        k: k.max(1),
        pass_at_1: frac(passed, eps.len()),
        pass_at_k: frac(solved.iter().filter(|&&s| s).count(), probs.len()),
    })
}
