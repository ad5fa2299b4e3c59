//! Environment faults inside a run (issue 12, item 5): crashes, timeouts and garbage are
//! retried within each task's budget; a task that answers with malformed observations (empty,
//! outside the vocabulary), a non-finite reward or an error, or makes a prompt the engine
//! refuses, ends the trajectory as `environment`; none of it is trained and none of it stops
//! the run; every failed call is accounted for.

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
    assert_eq!(report.learner.zero_lag_mismatch_tokens, 0);
}
