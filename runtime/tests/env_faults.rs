//! Environment faults inside a run (issue 12, item 5): crashes, timeouts and garbage are
//! retried within each task's budget; a task that answers with malformed observations (empty,
//! outside the vocabulary), a non-finite reward or an error, or makes a prompt the engine
//! refuses, ends the trajectory as `environment`; none of it is trained and none of it stops
//! the run; every failed call is accounted for. An observation the engine refuses ends as
//! `budget` only when the trajectory would outgrow the KV pool.

mod stage;

use sluice_kernels::testing::Rng;
use sluice_runtime::engine::StopConfig;
use sluice_runtime::env::faults::FaultRates;
use sluice_runtime::env::latency::LatencyModel;
use sluice_runtime::env::{Problem, Reply, Split, Task, TaskError};
use sluice_runtime::hash::hash_str;
use sluice_runtime::trajectory::{ArtifactVersions, TerminalReason, TokenId};
use stage::{lookup, task_spec, Recorder, Setup, VOCAB};
use std::sync::Arc;

/// Lookup, whose environment misbehaves on some problems and turns (chosen by hash, so the
/// same in every run).
struct Misbehaving {
    inner: Arc<dyn Task>,
}

fn pick(spec: &str, salt: u64) -> u64 {
    hash_str(salt, spec) % 8
}

impl Task for Misbehaving {
    fn name(&self) -> &str {
        "misbehaving"
    }
    fn multi_turn(&self) -> bool {
        true
    }
    fn problem(&self, rng: &mut Rng, split: Split) -> Problem {
        let mut p = self.inner.problem(rng, split);
        p.id = format!("misbehaving:{}", p.spec);
        if pick(&p.spec, 1) == 0 {
            // A token the model does not have: the engine refuses the prompt.
            p.prompt.push(VOCAB as TokenId + 3);
        }
        p
    }
    fn respond(&self, p: &Problem, turn: u32, generated: &[TokenId]) -> Result<Reply, TaskError> {
        let reply = self.inner.respond(p, turn, generated)?;
        Ok(match (pick(&p.spec, 2 + turn as u64), reply) {
            (1, Reply::Observe(_)) => Reply::Observe(Vec::new()),
            (2, Reply::Observe(_)) => Reply::Observe(vec![VOCAB as TokenId + 1]),
            (3, Reply::End { reason, .. }) => Reply::End {
                reward: f32::NAN,
                reason,
            },
            (4, _) => return Err(TaskError("the environment lost its state".into())),
            (_, r) => r,
        })
    }
    fn stop(&self) -> StopConfig {
        self.inner.stop()
    }
    fn versions(&self) -> ArtifactVersions {
        self.inner.versions()
    }
}

/// Zero-lag tokens the run compares at least (it has 353; the seed and the virtual clock fix it).
const MIN_ZERO_LAG: u64 = 200;

#[test]
fn environment_faults_are_retried_or_end_as_environment_and_never_stop_the_run() {
    let faults = FaultRates {
        crash: 0.1,
        timeout: 0.05,
        garbage: 0.1,
    };
    let latency = LatencyModel::LogNormal {
        median_ms: 30.0,
        p99_ms: 3000.0,
    };
    let mut flaky = task_spec(lookup(), latency, faults);
    flaky.retries = 2;
    flaky.timeout = sluice_runtime::clock::Micros::from_secs(1.0);
    flaky.target_share = 0.5;
    let mut bad = task_spec(
        Arc::new(Misbehaving { inner: lookup() }),
        LatencyModel::Fixed { ms: 20.0 },
        FaultRates::default(),
    );
    bad.retries = 2;
    bad.target_share = 0.5;
    let mut s = Setup::new(vec![flaky, bad]);
    s.replicas = 1;
    s.steps = 12;
    s.tau = 100;
    let mut rec = Recorder::default();
    let (report, _) = s.run(&mut rec);
    assert_eq!(report.learner.steps, 12);
    let c = &report.rollout;
    let fault = |k: &str| c.env_faults.get(k).copied().unwrap_or(0);
    for kind in [
        "crash",
        "timeout",
        "garbage",
        "malformed",
        "error",
        "submit",
    ] {
        assert!(
            fault(kind) > 0,
            "no `{kind}` fault happened: {:?}",
            c.env_faults
        );
    }
    assert!(c.env_retries > 0);
    println!(
        "faults {:?}, retries {}, ended {:?}",
        c.env_faults, c.env_retries, c.by_terminal
    );
    // Every failed call was either retried or ended its trajectory; a refused submit ended
    // its whole group.
    let g = s.group_size as u64;
    let env_ended = c.by_terminal.get("environment").copied().unwrap_or(0);
    let call_faults: u64 = c.env_faults.values().sum::<u64>() - fault("submit");
    assert_eq!(call_faults, c.env_retries + env_ended - g * fault("submit"));
    // A task's own error and malformed replies are not retried: they would repeat.
    assert!(c.env_retries <= fault("crash") + fault("timeout") + fault("garbage"));
    // None of it reached the loss.
    for grp in rec.batches.iter().flatten() {
        for smp in &grp.samples {
            assert_ne!(smp.terminal_reason, TerminalReason::Environment);
            assert!(smp.tokens.iter().all(|&t| (t as usize) < VOCAB));
            assert!(smp.reward.is_finite());
        }
    }
    // Zero mismatch means something only over enough tokens.
    assert!(
        report.learner.zero_lag_tokens >= MIN_ZERO_LAG,
        "{} zero-lag tokens",
        report.learner.zero_lag_tokens
    );
    assert_eq!(report.learner.zero_lag_mismatch_tokens, 0);
}

/// Lookup whose environment always answers the first turn with an observation.
struct AlwaysObserves {
    inner: Arc<dyn Task>,
}

impl Task for AlwaysObserves {
    fn name(&self) -> &str {
        "always-observes"
    }
    fn multi_turn(&self) -> bool {
        true
    }
    fn problem(&self, rng: &mut Rng, split: Split) -> Problem {
        self.inner.problem(rng, split)
    }
    fn respond(&self, p: &Problem, turn: u32, generated: &[TokenId]) -> Result<Reply, TaskError> {
        match turn {
            0 => Ok(Reply::Observe(vec![4, 5])),
            _ => self.inner.respond(p, turn, generated),
        }
    }
    /// Every token ends the turn: no turn is cut by `max_new_tokens` (a cut turn's episode
    /// ends as `budget` instead of taking the observation).
    fn stop(&self) -> StopConfig {
        StopConfig {
            eos: None,
            stop_sequences: (0..VOCAB as TokenId).map(|t| vec![t]).collect(),
        }
    }
    fn versions(&self) -> ArtifactVersions {
        self.inner.versions()
    }
}

/// What the engine refuses at observe time decides how the trajectory ends: only a trajectory
/// that would outgrow the KV pool is a `budget` end; an observation the engine cannot take is
/// the environment's failure (`environment`, never trained as a policy failure); anything
/// else (here an unknown handle) is a run error, never a silent reward-0 end.
#[test]
fn observe_refusals_end_as_budget_or_environment_or_stop_the_run() {
    use sluice_kernels::Backend;
    use sluice_model::Model;
    use sluice_runtime::clock::Micros;
    use sluice_runtime::engine::{Engine, SeqHandle};
    use sluice_runtime::orchestrator::{
        Action, EngineCmd, EngineResult, ObserveRefusal, Orchestrator, Pace, RolloutPolicy,
    };
    use sluice_runtime::trajectory::{SamplingParams, WeightVersion};
    use std::collections::BTreeMap;

    let cfg = Setup::model_config();
    let model = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    let setup = Setup::new(vec![]);
    let mut engine = Engine::new(
        Backend::Cpu,
        &cfg,
        &model.params,
        WeightVersion(0),
        setup.engine.clone(),
    )
    .unwrap();
    let g = 3u32;
    let policy = RolloutPolicy {
        group_size: g,
        sampling: SamplingParams {
            max_new_tokens: 4,
            seed: 3,
            ..SamplingParams::default()
        },
        max_turns: 3,
        share_correction: false,
        seed: 3,
        vocab: VOCAB,
        max_observation_tokens: 32,
    };
    let spec = task_spec(
        Arc::new(AlwaysObserves { inner: lookup() }),
        LatencyModel::None,
        FaultRates::default(),
    );
    let mut orch = Orchestrator::new(vec![spec], policy, 0).unwrap();
    let pace = Pace {
        step_s: 1.0,
        groups_per_step: 1,
    };
    let now = Micros(0);
    let admitted = orch.admit(now, g as u64, &mut |_| 0, &BTreeMap::new(), pace);
    let [Action::Engine {
        cmd: EngineCmd::Submit { group, request },
        ..
    }] = <[Action; 1]>::try_from(admitted).unwrap()
    else {
        panic!("one submit expected")
    };
    let handles = engine.submit(request).map_err(|e| e.to_string());
    assert!(orch
        .on_result(0, EngineResult::Submitted { group, handles }, now)
        .unwrap()
        .is_empty());
    // Run the first turn of every member, and its environment call: each member's next
    // command is an Observe.
    let mut observes = Vec::new();
    while observes.len() < g as usize {
        assert!(engine.has_work(), "the group's first turns never ended");
        for ev in engine.step().unwrap() {
            for a in orch.on_event(0, ev, now).unwrap() {
                let Action::EnvTimer { at, call } = a else {
                    continue;
                };
                for b in orch.on_env(call, at).unwrap() {
                    if let Action::Engine {
                        cmd: EngineCmd::Observe { member, handle, .. },
                        ..
                    } = b
                    {
                        observes.push((member, handle));
                    }
                }
            }
        }
    }
    let finish_reason = |actions: Vec<Action>| match actions.as_slice() {
        [Action::Engine {
            cmd: EngineCmd::Finish { reason, reward, .. },
            ..
        }] => {
            assert_eq!(*reward, 0.0);
            *reason
        }
        other => panic!("expected one Finish, got {other:?}"),
    };
    // Ids outside the model's vocabulary: the environment's failure.
    let (m0, h0) = observes[0];
    let e = engine.observe(h0, &[VOCAB as TokenId + 2], 4).unwrap_err();
    let refusal = ObserveRefusal::from(e);
    assert!(
        matches!(refusal, ObserveRefusal::Observation(_)),
        "{refusal:?}"
    );
    let a = orch
        .on_result(
            0,
            EngineResult::Observed {
                member: m0,
                result: Err(refusal),
            },
            now,
        )
        .unwrap();
    assert_eq!(finish_reason(a), TerminalReason::Environment);
    // More tokens than the KV pool holds: a length limit.
    let (m1, h1) = observes[1];
    let slots = engine.num_blocks() * setup.engine.block_size;
    let e = engine.observe(h1, &vec![1; slots], 4).unwrap_err();
    let refusal = ObserveRefusal::from(e);
    assert!(
        matches!(refusal, ObserveRefusal::Capacity(_)),
        "{refusal:?}"
    );
    let a = orch
        .on_result(
            0,
            EngineResult::Observed {
                member: m1,
                result: Err(refusal),
            },
            now,
        )
        .unwrap();
    assert_eq!(finish_reason(a), TerminalReason::Budget);
    // Anything else stops the run with the engine's message.
    let (m2, _) = observes[2];
    let e = engine.observe(SeqHandle(999_999), &[1], 4).unwrap_err();
    let refusal = ObserveRefusal::from(e);
    assert!(matches!(refusal, ObserveRefusal::Engine(_)), "{refusal:?}");
    let err = orch
        .on_result(
            0,
            EngineResult::Observed {
                member: m2,
                result: Err(refusal),
            },
            now,
        )
        .unwrap_err();
    assert!(err.to_string().contains("999999"), "{err}");
}
