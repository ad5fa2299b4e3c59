//! Over-sampling with abort (issue 28 item 2): the engine's group controls (a suspended and
//! resumed group gives the uninterrupted trajectories bit for bit; an abort frees everything),
//! and sync stages on the virtual clock over a heavy-tailed environment: a step takes its
//! groups as soon as they are complete and is shorter at equal samples; discarded aborts train
//! only fresh tokens; partial rollout resumes the aborted groups across a weight version with
//! zero-lag tokens still matching bit for bit; a checkpoint barrier drops suspended groups;
//! every count is asserted.

mod common;
mod stage;

use common::{engine, model};
use sluice_kernels::Backend;
use sluice_model::{ModelConfig, Precision};
use sluice_runtime::clock::Micros;
use sluice_runtime::engine::{EngineConfig, Event, Request, StopConfig};
use sluice_runtime::env::faults::FaultRates;
use sluice_runtime::env::latency::LatencyModel;
use sluice_runtime::system::{Mode, OverSampling, StageReport};
use sluice_runtime::trajectory::{Sample, SamplingParams, TerminalReason};
use stage::{lookup, task_spec, Recorder, Setup};

fn group_request(instance: &str, prompt_len: usize, vocab: usize) -> Request {
    Request {
        session_id: format!("s/{instance}"),
        instance_id: instance.to_string(),
        task: "t".into(),
        group_size: 3,
        prompt: (0..prompt_len).map(|i| (i * 7 % vocab) as u32).collect(),
        sampling: SamplingParams {
            temperature: 1.0,
            max_new_tokens: 12,
            seed: 9,
            ..SamplingParams::default()
        },
        stop: StopConfig::default(),
        multi_turn: false,
    }
}

fn finished(events: Vec<Event>) -> Vec<Sample> {
    events
        .into_iter()
        .filter_map(|e| match e {
            Event::Finished { sample, .. } => Some(*sample),
            _ => None,
        })
        .collect()
}

fn bits(s: &Sample) -> Vec<u32> {
    s.behavior_logp.iter().map(|v| v.to_bits()).collect()
}

/// Suspending a group mid-generation frees its blocks and stops it; resumed, it recomputes its
/// K/V and ends with the tokens, log-prob bits and versions of a run never interrupted. An
/// abort ends every member without a sample and reports their generated tokens.
#[test]
fn a_suspended_group_resumes_to_the_uninterrupted_trajectories_and_an_abort_frees_it() {
    let m = model(ModelConfig::tiny(), 4, &Backend::Cpu);
    let vocab = m.config.vocab;
    let cfg = EngineConfig {
        kv_bytes: EngineConfig::kv_bytes_for_blocks(&m.config, Precision::F32, 4, 64),
        block_size: 4,
        ..EngineConfig::default()
    };
    let mut plain = engine(&m, Backend::Cpu, cfg.clone());
    plain.submit(group_request("g", 5, vocab)).unwrap();
    let mut want = finished(plain.run_until_idle().unwrap());
    want.sort_by_key(|s| s.group_index);
    assert_eq!(want.len(), 3);

    let mut eng = engine(&m, Backend::Cpu, cfg.clone());
    eng.submit(group_request("g", 5, vocab)).unwrap();
    let mut got = Vec::new();
    for _ in 0..4 {
        got.extend(finished(eng.step().unwrap()));
    }
    assert!(got.is_empty(), "12 tokens take more than 4 steps");
    let suspended = eng.suspend_group("g").unwrap();
    assert_eq!(suspended.len(), 3, "every member");
    assert!(suspended.iter().all(|&n| n >= 1), "{suspended:?}");
    assert!(!eng.has_work(), "a suspended group takes no step");
    assert_eq!(eng.stats().kv.blocks_used, 0, "its blocks are free");
    assert_eq!(
        eng.suspend_group("g").unwrap(),
        suspended,
        "suspended twice: no change"
    );
    let resumed = eng.resume_group("g").unwrap();
    assert_eq!(resumed, suspended);
    got.extend(finished(eng.run_until_idle().unwrap()));
    got.sort_by_key(|s| s.group_index);
    assert_eq!(got.len(), 3);
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(bits(a), bits(b));
        assert_eq!(a.weight_version, b.weight_version);
    }

    let mut eng = engine(&m, Backend::Cpu, cfg);
    eng.submit(group_request("a", 5, vocab)).unwrap();
    eng.submit(group_request("b", 6, vocab)).unwrap();
    for _ in 0..3 {
        assert!(finished(eng.step().unwrap()).is_empty());
    }
    let aborted = eng.abort_group("a").unwrap();
    assert_eq!(aborted.len(), 3);
    assert!(
        aborted.iter().all(|&n| n == aborted[0] && n >= 1),
        "{aborted:?}"
    );
    assert_eq!(eng.len(), 3, "only group b is left");
    assert_eq!(eng.abort_group("a").unwrap(), Vec::<usize>::new());
    assert_eq!(finished(eng.run_until_idle().unwrap()).len(), 3);
    assert_eq!(eng.stats().kv.blocks_used, 0);
}

/// One lookup task whose environment is heavy-tailed (lognormal, p99 40x the median).
fn heavy_tailed(over_sampling: Option<OverSampling>) -> Setup {
    let mut s = Setup::new(vec![task_spec(
        lookup(),
        LatencyModel::LogNormal {
            median_ms: 20.0,
            p99_ms: 800.0,
        },
        FaultRates::default(),
    )]);
    s.mode = Mode::Sync;
    s.replicas = 1;
    s.groups_per_step = 4;
    s.steps = 6;
    s.over_sampling = over_sampling;
    s
}

fn run(s: &Setup) -> (StageReport, Recorder) {
    let mut rec = Recorder::default();
    let (report, _) = s.run(&mut rec);
    (report, rec)
}

fn samples(rec: &Recorder) -> usize {
    rec.batches.iter().flatten().map(|g| g.samples.len()).sum()
}

#[test]
fn discarding_aborts_shortens_a_sync_step_at_equal_samples() {
    let (base, base_rec) = run(&heavy_tailed(None));
    let os = OverSampling {
        ratio: 2.0,
        keep_partial: false,
    };
    let (over, rec) = run(&heavy_tailed(Some(os)));
    // Equal samples: every step trains groups_per_step whole groups in both runs.
    assert_eq!(rec.batches.len(), 6);
    assert!(rec.batches.iter().all(|b| b.len() == 4));
    assert_eq!(samples(&rec), 6 * 4 * 4);
    assert_eq!(samples(&base_rec), samples(&rec));
    // The tail no longer sets the pace: the virtual clock's stage time falls.
    assert!(
        over.elapsed.0 < base.elapsed.0,
        "over-sampled {} us, baseline {} us",
        over.elapsed.0,
        base.elapsed.0
    );
    let c = &over.rollout;
    // 8 groups start per batch, 4 train: the other 4 of each batch are aborted.
    assert_eq!(c.groups_aborted, 6 * 4, "{c:?}");
    assert_eq!(c.trajectories_started, 6 * 8 * 4);
    assert!(c.trajectories_discarded > 0 && c.trajectories_discarded <= 6 * 4 * 4);
    assert!(c.aborted_tokens > 0);
    assert_eq!(
        c.discarded_tokens, c.aborted_tokens,
        "discarding keeps nothing"
    );
    assert_eq!((c.groups_resumed, c.resumed_tokens), (0, 0));
    // Every trajectory that started is in the length histogram once: ended or discarded.
    assert_eq!(
        c.started_lengths.count,
        c.trajectories_finished + c.trajectories_discarded,
    );
    assert_eq!(c.trained_lengths.count, 6 * 4 * 4);
    // Discarded aborts keep every trained token on-policy: lag 0, and bit-exact.
    assert_eq!(
        over.learner.lag_hist.len(),
        1,
        "{:?}",
        over.learner.lag_hist
    );
    assert!(over.learner.zero_lag_tokens > 0);
    assert_eq!(over.learner.zero_lag_mismatch_tokens, 0);
    // Without over-sampling nothing is aborted.
    assert_eq!(base.rollout.groups_aborted, 0);
    assert_eq!(base.rollout.trajectories_discarded, 0);
}

#[test]
fn partial_rollout_resumes_aborted_groups_across_a_weight_version() {
    let os = OverSampling {
        ratio: 1.5,
        keep_partial: true,
    };
    let mut s = heavy_tailed(Some(os));
    // Generation as slow as the environment's median, so aborts catch groups mid-turn.
    s.cost.engine_step_us = 5000.0;
    let (report, rec) = run(&s);
    assert_eq!(rec.batches.len(), 6);
    assert_eq!(samples(&rec), 6 * 4 * 4);
    let c = &report.rollout;
    assert!(c.groups_aborted > 0, "{c:?}");
    assert!(c.aborted_tokens >= c.resumed_tokens);
    assert!(c.groups_resumed > 0 && c.groups_resumed <= c.groups_aborted);
    assert!(c.resumed_tokens > 0, "{c:?}");
    assert_eq!(
        c.trajectories_discarded, 0,
        "nothing is thrown away mid-stage"
    );
    // Resumed trajectories carry tokens of an earlier version: some trained tokens lag.
    let mixed = rec
        .batches
        .iter()
        .flatten()
        .flat_map(|g| g.samples.iter())
        .filter(|s| {
            let gen: Vec<_> = s
                .weight_version
                .iter()
                .zip(&s.loss_mask)
                .filter(|(_, &m)| m)
                .map(|(v, _)| *v)
                .collect();
            gen.windows(2).any(|w| w[0] != w[1])
        })
        .count();
    assert!(mixed > 0, "no trained trajectory spans two versions");
    assert!(
        report.learner.lag_hist.len() >= 2,
        "{:?}",
        report.learner.lag_hist
    );
    assert!(report.learner.zero_lag_tokens > 0);
    assert_eq!(report.learner.zero_lag_mismatch_tokens, 0);
    // The same seed replays to the same counts.
    let (again, _) = run(&s);
    assert_eq!(again.rollout, report.rollout);
    assert_eq!(again.elapsed, report.elapsed);
}

#[test]
fn a_checkpoint_barrier_discards_suspended_groups() {
    let mut s = heavy_tailed(Some(OverSampling {
        ratio: 2.0,
        keep_partial: true,
    }));
    s.barrier_every = Some(2);
    let (report, rec) = run(&s);
    assert_eq!(rec.batches.len(), 6);
    assert_eq!(rec.barriers.len(), 2, "barriers after steps 2 and 4");
    let c = &report.rollout;
    assert!(c.trajectories_discarded > 0, "{c:?}");
    assert!(c.discarded_tokens > 0);
    assert!(c.groups_resumed > 0);
    assert_eq!(report.learner.zero_lag_mismatch_tokens, 0);
    assert!(report.elapsed > Micros(0));
    let ended_environment = c.by_terminal.get(TerminalReason::Environment.as_str());
    assert_eq!(
        ended_environment, None,
        "aborts are not environment failures"
    );
}
