//! The rollout engine: batch invariance (continuous batching, chunked prefill, replicas give
//! the same trajectories as running each request alone), preemption under a pool too small for
//! the batch (recompute and swap to host: same tokens and log-probs as an unconstrained run),
//! stop conditions, weight-swap bookkeeping, router counters, and errors.

mod common;

use common::*;
use sluice_kernels::testing::Rng;
use sluice_kernels::Backend;
use sluice_model::{ModelConfig, Precision};
use sluice_runtime::engine::replicas::Replicas;
use sluice_runtime::engine::{
    EngineConfig, EngineError, Event, PreemptMode, Request, StopConfig, StopReason, SwapMode,
};
use sluice_runtime::trajectory::{SamplingParams, TerminalReason, WeightVersion};

/// An engine config whose pool (sized in bytes) holds `num_blocks` blocks of `model`'s f32
/// cache.
fn config(
    model: &ModelConfig,
    num_blocks: usize,
    block_size: usize,
    max_batch_tokens: usize,
) -> EngineConfig {
    EngineConfig {
        kv_bytes: EngineConfig::kv_bytes_for_blocks(model, Precision::F32, block_size, num_blocks),
        block_size,
        max_batch_tokens,
        max_seqs: 16,
        preempt: PreemptMode::Recompute,
        swap: SwapMode::Continue,
        precision: Precision::F32,
    }
}

const SUBMIT: [u64; 5] = [0, 0, 1, 4, 2];

/// Tokens, log-prob bits, versions, masks and turns of two result sets are equal.
fn assert_same(a: &Results, b: &Results, what: &str) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (k, x) in a {
        let y = &b[k];
        assert_eq!(x.tokens, y.tokens, "{what}: {k:?} tokens");
        let bits = |s: &sluice_runtime::trajectory::Sample| {
            s.behavior_logp
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(x), bits(y), "{what}: {k:?} logps");
        assert_eq!(x.loss_mask, y.loss_mask, "{what}: {k:?} mask");
        assert_eq!(x.weight_version, y.weight_version, "{what}: {k:?} versions");
        assert_eq!(x.turns, y.turns, "{what}: {k:?} turns");
    }
}

fn reference_run() -> (sluice_model::Model, Vec<Job>, Results) {
    let m = model(ModelConfig::small(), 3, &Backend::Cpu);
    let jobs = workload(m.config.vocab, 11);
    let mut eng = engine(&m, Backend::Cpu, config(&m.config, 256, 4, 48));
    let res = drive(&mut eng, &jobs, &SUBMIT, |_, _| {});
    (m, jobs, res)
}

#[test]
fn continuous_batching_equals_each_request_alone() {
    let (m, jobs, together) = reference_run();
    let mut alone = Results::new();
    for j in &jobs {
        let mut eng = engine(&m, Backend::Cpu, config(&m.config, 256, 4, 48));
        alone.extend(drive(&mut eng, std::slice::from_ref(j), &[0], |_, _| {}));
    }
    assert_same(&together, &alone, "together vs alone");
    // Chunked prefill (3 tokens per step), one sequence at a time, block size 16: same again.
    let mut eng = engine(
        &m,
        Backend::Cpu,
        EngineConfig {
            max_seqs: 1,
            ..config(&m.config, 64, 16, 3)
        },
    );
    let res = drive(&mut eng, &jobs, &SUBMIT, |_, _| {});
    assert_same(&together, &res, "chunked, one at a time");
    // A group's samples differ from each other (distinct request ids).
    let a: Vec<_> = (0..4)
        .map(|g| &together[&("a".to_string(), g)].tokens)
        .collect();
    assert!(
        a.windows(2).any(|w| w[0] != w[1]),
        "identical group samples"
    );
}

#[test]
fn preemption_under_a_small_pool_gives_the_unconstrained_trajectories() {
    let (m, jobs, free) = reference_run();
    for mode in [PreemptMode::Recompute, PreemptMode::SwapToHost] {
        for blocks in [16, 22] {
            let mut eng = engine(
                &m,
                Backend::Cpu,
                EngineConfig {
                    preempt: mode,
                    ..config(&m.config, blocks, 4, 48)
                },
            );
            let res = drive(&mut eng, &jobs, &SUBMIT, |_, _| {});
            let st = eng.stats();
            assert!(
                st.preempted_recompute + st.preempted_swap > 0,
                "{mode:?} {blocks}: no preemption"
            );
            if mode == PreemptMode::SwapToHost {
                assert!(st.swapped_out_tokens > 0);
            }
            assert_same(&free, &res, &format!("{mode:?} with {blocks} blocks"));
            // Everything released: the pool is free or cached.
            assert_eq!(st.kv.blocks_used, 0, "{st:?}");
        }
    }
}

#[test]
fn runs_are_deterministic() {
    let (m, jobs, a) = reference_run();
    let mut eng = engine(&m, Backend::Cpu, config(&m.config, 256, 4, 48));
    let b = drive(&mut eng, &jobs, &SUBMIT, |_, _| {});
    assert_same(&a, &b, "two runs");
}

#[test]
fn stop_conditions() {
    let m = model(ModelConfig::small(), 3, &Backend::Cpu);
    let mut rng = Rng::new(5);
    let p = prompt(&mut rng, 7, m.config.vocab);
    let greedy = |stop: StopConfig, max_new: u32| {
        let mut eng = engine(&m, Backend::Cpu, config(&m.config, 64, 4, 48));
        let mut r = Request::new("s", p.clone(), max_new);
        r.sampling.temperature = 0.0;
        r.stop = stop;
        eng.submit(r).unwrap();
        let ev = eng.run_until_idle().unwrap();
        match &ev[..] {
            [Event::Finished { reason, sample, .. }] => (*reason, sample.clone()),
            other => panic!("{other:?}"),
        }
    };
    let (reason, full) = greedy(StopConfig::default(), 10);
    assert_eq!(reason, StopReason::MaxNewTokens);
    assert_eq!(full.terminal_reason, TerminalReason::Budget);
    let gen = full.tokens[7..].to_vec();
    assert_eq!(gen.len(), 10);
    // EOS = the 4th greedy token (first occurrence): stops right there, EOS kept.
    let first = gen.iter().position(|&t| t == gen[3]).unwrap();
    let (reason, s) = greedy(
        StopConfig {
            eos: Some(gen[3]),
            stop_sequences: vec![],
        },
        10,
    );
    assert_eq!(reason, StopReason::Eos);
    assert_eq!(s.tokens[7..], gen[..=first]);
    assert_eq!(s.terminal_reason, TerminalReason::Success);
    // A stop sequence: the 5th and 6th greedy tokens.
    let seq = gen[4..6].to_vec();
    let end = (2..=gen.len()).find(|&n| gen[..n].ends_with(&seq)).unwrap();
    let (reason, s) = greedy(
        StopConfig {
            eos: None,
            stop_sequences: vec![vec![63, 63, 63], seq],
        },
        10,
    );
    assert_eq!(reason, StopReason::StopSequence);
    assert_eq!(s.tokens[7..], gen[..end]);
    // Greedy log-probs are the temperature-1 log-probs of the argmax: the learner agrees.
    let generated = full.loss_mask.iter().filter(|&&g| g).count();
    assert!(generated > 0);
    let mut r = Results::new();
    r.insert(("s".into(), 0), *full);
    assert_eq!(assert_bit_identical(&m, &r, |_| true), generated);
}

#[test]
fn mixed_sampling_parameters_in_one_batch() {
    let m = model(ModelConfig::small(), 3, &Backend::Cpu);
    let mut jobs = workload(m.config.vocab, 11);
    jobs[0].req.sampling.temperature = 0.7;
    jobs[1].req.sampling.top_k = 5;
    jobs[2].req.sampling.top_p = 0.8;
    jobs[3].req.sampling.seed = 99;
    let mut eng = engine(&m, Backend::Cpu, config(&m.config, 256, 4, 48));
    let together = drive(&mut eng, &jobs, &SUBMIT, |_, _| {});
    let mut alone = Results::new();
    for j in &jobs {
        let mut eng = engine(&m, Backend::Cpu, config(&m.config, 256, 4, 48));
        alone.extend(drive(&mut eng, std::slice::from_ref(j), &[0], |_, _| {}));
    }
    assert_same(&together, &alone, "mixed parameters");
    // At temperature 1 the recorded log-prob is under the full distribution even with top-k or
    // top-p cuts (DESIGN 3.3), so those tokens still match the learner bit for bit.
    let t1: Results = together
        .iter()
        .filter(|(_, s)| s.sampling.temperature == 1.0)
        .map(|(k, s)| (k.clone(), s.clone()))
        .collect();
    assert!(t1.len() >= 6);
    assert!(assert_bit_identical(&m, &t1, |_| true) > 50);
    // Each trajectory records the parameters it was sampled with.
    for s in together.values() {
        s.validate().unwrap();
        assert_eq!(
            s.sampling,
            jobs.iter()
                .find(|j| j.req.session_id == s.session_id)
                .unwrap()
                .req
                .sampling
        );
    }
}

#[test]
fn weight_swap_bookkeeping() {
    let m0 = model(ModelConfig::small(), 3, &Backend::Cpu);
    let m1 = model(ModelConfig::small(), 4, &Backend::Cpu);
    let tiny = model(ModelConfig::tiny(), 4, &Backend::Cpu);
    let mut eng = engine(&m0, Backend::Cpu, config(&m0.config, 64, 4, 48));
    let mut rng = Rng::new(1);
    let r = Request::new("w", prompt(&mut rng, 10, 64), 8);
    eng.submit(r.clone()).unwrap();
    for _ in 0..3 {
        eng.step().unwrap();
    }
    // A wrong architecture or an older version is refused, and nothing changes.
    assert!(eng
        .swap_weights(&tiny.params, WeightVersion(1), None)
        .is_err());
    eng.swap_weights(&m1.params, WeightVersion(2), None)
        .unwrap();
    assert!(matches!(
        eng.swap_weights(&m0.params, WeightVersion(1), None),
        Err(EngineError::Invalid(_))
    ));
    let ev = eng.run_until_idle().unwrap();
    let Event::Finished { sample, .. } = &ev[0] else {
        panic!("{ev:?}")
    };
    let gen: Vec<u64> = (0..sample.tokens.len())
        .filter(|&j| sample.loss_mask[j])
        .map(|j| sample.weight_version[j].0)
        .collect();
    assert_eq!(gen, vec![0, 0, 0, 2, 2, 2, 2, 2]);
    assert_eq!(sample.clocks.behavior_version, WeightVersion(2));
    // After the swap the prefix cache holds nothing from v0: a new request with the same
    // prompt computes every token.
    let before = eng.stats().kv.prefix_hit_tokens;
    eng.submit(r).unwrap();
    eng.run_until_idle().unwrap();
    let hits = eng.stats().kv.prefix_hit_tokens - before;
    assert_eq!(hits, 0, "a v0 block was reused after the swap");
}

#[test]
fn prefix_cache_is_reused_across_requests_of_one_version() {
    let m = model(ModelConfig::small(), 3, &Backend::Cpu);
    let mut eng = engine(&m, Backend::Cpu, config(&m.config, 64, 4, 48));
    let mut rng = Rng::new(2);
    let r = Request::new("p", prompt(&mut rng, 21, 64), 3);
    eng.submit(r.clone()).unwrap();
    let a = eng.run_until_idle().unwrap();
    eng.submit(r).unwrap();
    let b = eng.run_until_idle().unwrap();
    assert_eq!(eng.stats().kv.prefix_hit_tokens, 20);
    let (Event::Finished { sample: x, .. }, Event::Finished { sample: y, .. }) = (&a[0], &b[0])
    else {
        panic!()
    };
    assert_eq!(x.tokens, y.tokens);
    assert_eq!(x.behavior_logp, y.behavior_logp);
}

#[test]
fn replicas_route_by_session_and_export_counters() {
    let (m, jobs, single) = reference_run();
    let engines = (0..3)
        .map(|_| engine(&m, Backend::Cpu, config(&m.config, 256, 4, 48)))
        .collect();
    let mut reps = Replicas::new(engines).unwrap();
    let mut owner = std::collections::BTreeMap::new();
    let mut out = Results::new();
    for j in &jobs {
        let (r, hs) = reps.submit(j.req.clone()).unwrap();
        assert_eq!(r, reps.router().route(&j.req.session_id).unwrap());
        for (gi, h) in hs.into_iter().enumerate() {
            owner.insert((r, h), (j.req.session_id.clone(), gi as u32, j.turns));
        }
    }
    let mut rounds = 0;
    while out.len() < single.len() {
        rounds += 1;
        assert!(rounds < 50);
        for (r, ev) in reps.run_until_idle().unwrap() {
            match ev {
                Event::Finished { handle, sample, .. } => {
                    let (s, gi, _) = owner[&(r, handle)].clone();
                    out.insert((s, gi), *sample);
                }
                Event::TurnEnded { handle, .. } => {
                    let (s, gi, left) = owner[&(r, handle)].clone();
                    if left == 0 {
                        let sample = reps
                            .finish(r, handle, 1.0, TerminalReason::Success)
                            .unwrap();
                        out.insert((s, gi), sample);
                    } else {
                        let obs = observation(&format!("{s}/{gi}"), left, 64);
                        reps.observe(r, handle, &obs, 5).unwrap();
                        owner.insert((r, handle), (s, gi, left - 1));
                    }
                }
            }
        }
    }
    assert_same(&single, &out, "replicas vs one engine");
    let snap = reps.snapshot().unwrap();
    let routed: u64 = snap.iter().map(|s| s.routed).sum();
    assert_eq!(
        routed,
        jobs.iter().map(|j| j.req.group_size as u64).sum::<u64>()
    );
    assert!(snap.iter().all(|s| s.in_flight == 0), "{snap:?}");
    let prompt: u64 = snap.iter().map(|s| s.prompt_tokens).sum();
    let engine_prompt: u64 = reps
        .replicas()
        .map(|r| reps.engine(r).unwrap().stats().kv.prompt_tokens)
        .sum();
    assert_eq!(prompt, engine_prompt);
    assert!(
        snap.iter().filter(|s| s.routed > 0).count() >= 2,
        "{snap:?}"
    );
}

#[test]
fn bad_requests_are_clear_errors() {
    let m = model(ModelConfig::small(), 3, &Backend::Cpu);
    let mut eng = engine(&m, Backend::Cpu, config(&m.config, 4, 4, 48));
    let msg = |r: Request, eng: &mut sluice_runtime::engine::Engine| match eng.submit(r) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted"),
    };
    assert!(msg(Request::new("e", vec![], 4), &mut eng).contains("prompt is empty"));
    assert!(msg(Request::new("e", vec![1, 64], 4), &mut eng).contains("prompt[1] = 64"));
    assert!(msg(Request::new("e", vec![1; 16], 4), &mut eng).contains("longer than the KV pool"));
    assert!(msg(Request::new("e", vec![1; 3], 0), &mut eng).contains("max_new_tokens"));
    let mut r = Request::new("e", vec![1; 3], 4);
    r.group_size = 0;
    assert!(msg(r, &mut eng).contains("group_size"));
    let mut r = Request::new("e", vec![1; 3], 4);
    r.sampling = SamplingParams {
        temperature: -1.0,
        ..r.sampling
    };
    assert!(msg(r, &mut eng).contains("temperature"));
    let mut r = Request::new("e", vec![1; 3], 4);
    r.stop.stop_sequences = vec![vec![]];
    assert!(msg(r, &mut eng).contains("stop_sequences[0] is empty"));
    let mut r = Request::new("e", vec![1; 3], 4);
    r.stop.eos = Some(100);
    assert!(msg(r, &mut eng).contains("stop.eos"));
    // Unknown handles and out-of-turn observations.
    let bogus = sluice_runtime::engine::SeqHandle(999);
    assert!(matches!(
        eng.observe(bogus, &[1], 2),
        Err(EngineError::UnknownHandle(_))
    ));
    let h = eng.submit(Request::new("ok", vec![1, 2, 3], 2)).unwrap()[0];
    assert!(eng
        .observe(h, &[1], 2)
        .unwrap_err()
        .to_string()
        .contains("generating"));
    // A sequence that outgrows the whole pool stops with a budget end, not a panic.
    let mut r = Request::new("long", vec![5; 10], 100);
    r.multi_turn = false;
    eng.submit(r).unwrap();
    let ev = eng.run_until_idle().unwrap();
    let long = ev
        .iter()
        .find_map(|e| match e {
            Event::Finished { reason, sample, .. } if sample.session_id == "long" => {
                Some((*reason, sample.tokens.len()))
            }
            _ => None,
        })
        .unwrap();
    assert_eq!(long.0, StopReason::Capacity);
    assert_eq!(
        long.1,
        16 + 1,
        "the pool holds 16 tokens; the 17th was sampled"
    );
    // A config with no room is refused.
    assert!(sluice_runtime::engine::Engine::new(
        Backend::Cpu,
        &m.config,
        &m.params,
        WeightVersion(0),
        EngineConfig {
            max_seqs: 0,
            ..config(&m.config, 4, 4, 4)
        }
    )
    .is_err());
}

#[test]
fn multi_turn_sessions_keep_their_kv_between_turns() {
    let m = model(ModelConfig::small(), 3, &Backend::Cpu);
    let mut eng = engine(&m, Backend::Cpu, config(&m.config, 64, 4, 48));
    let mut rng = Rng::new(9);
    let mut r = Request::new("mt", prompt(&mut rng, 6, 64), 3);
    r.multi_turn = true;
    let h = eng.submit(r).unwrap()[0];
    let ev = eng.run_until_idle().unwrap();
    assert!(matches!(
        ev[..],
        [Event::TurnEnded {
            reason: StopReason::MaxNewTokens,
            ..
        }]
    ));
    let prefill_before = eng.stats().prefill_tokens;
    eng.observe(h, &[4, 5, 6, 7], 2).unwrap();
    eng.run_until_idle().unwrap();
    // Only the last sampled token and the observation were prefilled (no recompute).
    assert_eq!(eng.stats().prefill_tokens - prefill_before, 5);
    let s = eng.finish(h, 0.5, TerminalReason::Failure).unwrap();
    assert_eq!(s.tokens.len(), 6 + 3 + 4 + 2);
    assert_eq!(
        s.turns.iter().map(|t| t.start).collect::<Vec<_>>(),
        vec![6, 9, 13]
    );
    assert_eq!(s.reward, 0.5);
    assert_eq!(s.terminal_reason, TerminalReason::Failure);
    assert!(!s.loss_mask[9..13].iter().any(|&x| x));
    assert!(eng.is_empty() && !eng.has_work());
    assert_eq!(eng.stats().kv.blocks_used, 0);
    let mut res = Results::new();
    res.insert(("mt".into(), 0), s);
    // Both turns' generated tokens: 3 and 2.
    assert_eq!(assert_bit_identical(&m, &res, |_| true), 5);
}

#[test]
fn emu_preemption_and_batching_give_the_same_trajectories() {
    // On the emulator: copy-on-write, swap to host and back, and recompute run through the
    // device entry points (embedding gather, kv_append); the constrained runs must equal the
    // unconstrained one bit for bit on the same device.
    let m = model(ModelConfig::tiny(), 5, &Backend::Cpu);
    let mut jobs = workload(m.config.vocab, 13);
    jobs.truncate(3);
    for j in &mut jobs {
        j.req.sampling.max_new_tokens = 4;
        j.req.group_size = j.req.group_size.min(2);
        j.turns = j.turns.min(1);
    }
    let run = |blocks: usize, mode: PreemptMode| {
        let mut eng = engine(
            &m,
            Backend::emu_with_seed(1),
            EngineConfig {
                preempt: mode,
                ..config(&m.config, blocks, 4, 48)
            },
        );
        let res = drive(&mut eng, &jobs, &[0, 0, 1], |_, _| {});
        (res, eng.stats())
    };
    let (free, _) = run(64, PreemptMode::Recompute);
    for mode in [PreemptMode::Recompute, PreemptMode::SwapToHost] {
        let (res, st) = run(12, mode);
        assert!(
            st.preempted_recompute + st.preempted_swap > 0,
            "{mode:?}: {st:?}"
        );
        assert_same(&free, &res, &format!("emu {mode:?}"));
    }
}

/// The KV pool is sized in bytes: the same `kv_bytes` holds twice the blocks (and tokens) in
/// bf16 as in f32, in the same cache bytes; a budget below one block is an error naming
/// `kv_bytes`.
#[test]
fn kv_pool_from_a_byte_budget_holds_twice_the_tokens_in_bf16() {
    let bytes = EngineConfig::kv_bytes_for_blocks(&ModelConfig::small(), Precision::F32, 4, 64);
    let mut pools = Vec::new();
    for p in [Precision::F32, Precision::Bf16] {
        let m = model_in(ModelConfig::small(), 3, &Backend::Cpu, p);
        let cfg = EngineConfig {
            kv_bytes: bytes,
            ..config(&m.config, 1, 4, 48)
        };
        let eng = engine(&m, Backend::Cpu, cfg);
        assert_eq!(eng.precision(), p);
        pools.push((eng.num_blocks(), eng.kv_cache_bytes()));
    }
    assert_eq!(pools[0].0, 64);
    assert_eq!(pools[1].0, 128, "bf16 pool: {pools:?}");
    assert_eq!(pools[0].1, pools[1].1);
    assert!(pools[0].1 <= bytes);
    let m = model(ModelConfig::small(), 3, &Backend::Cpu);
    let small = EngineConfig {
        kv_bytes: 100,
        ..config(&m.config, 1, 4, 48)
    };
    let err = sluice_runtime::engine::Engine::new(
        Backend::Cpu,
        &m.config,
        &m.params,
        WeightVersion(0),
        small,
    )
    .err()
    .expect("a 100-byte pool was accepted")
    .to_string();
    assert!(err.contains("kv_bytes"), "{err}");
}

#[test]
fn trajectory_view_follows_each_step_and_matches_the_sample() {
    // A server streams a turn's tokens from this view after every step and reports its
    // log-probs and versions while the session stays open: the view must grow one token per
    // step and end equal to what `finish` returns.
    let m = model(ModelConfig::small(), 3, &Backend::Cpu);
    let mut rng = Rng::new(9);
    let p = prompt(&mut rng, 5, m.config.vocab);
    let mut eng = engine(&m, Backend::Cpu, config(&m.config, 64, 4, 48));
    let mut r = Request::new("view", p.clone(), 6);
    r.multi_turn = true;
    let h = eng.submit(r).unwrap()[0];
    let mut seen = Vec::new();
    let mut ended = None;
    while eng.has_work() {
        for e in eng.step().unwrap() {
            ended = Some(e);
        }
        let v = eng.trajectory(h).unwrap();
        assert_eq!(
            v.tokens.len(),
            p.len() + seen.len() + 1,
            "one new token per step"
        );
        assert_eq!(&v.tokens[..p.len() + seen.len()][p.len()..], &seen[..]);
        seen.push(*v.tokens.last().unwrap());
        assert_eq!(v.behavior_logp.len(), v.tokens.len());
        assert_eq!(v.versions.len(), v.tokens.len());
    }
    assert_eq!(seen.len(), 6);
    assert!(eng.trajectory(h).unwrap().paused);
    match ended {
        Some(Event::TurnEnded { generated, .. }) => assert_eq!(generated, seen),
        other => panic!("{other:?}"),
    }
    let v = eng.trajectory(h).unwrap();
    let (tokens, logp) = (v.tokens.to_vec(), v.behavior_logp.to_vec());
    let s = eng.finish(h, 0.0, TerminalReason::Budget).unwrap();
    assert_eq!(s.tokens, tokens);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&s.behavior_logp), bits(&logp));
    assert!(
        eng.trajectory(h).is_none(),
        "a finished trajectory is no longer held"
    );
}
