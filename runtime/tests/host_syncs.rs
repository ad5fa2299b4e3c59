//! No host round trips on the hot path (issue 23 item 5), counted on emu with the debug switch
//! OFF (as the main job runs; kernels/src/debug.rs): for one decode step and one train step of
//! the tiny model, the host syncs (downloads and waits), the device-to-host copies made inside
//! ops, the fresh storage allocations of a second, steady-state step (the caching allocator,
//! kernels/src/tensor/pool.rs), and the launches of one MoE layer (the table in
//! docs/perf/moe.md).
//!
//! Its own test binary: the debug switch is process-wide, and every other test runs with it on.

use sluice_kernels::counters::{self, Counts};
use sluice_kernels::ops::moe::{moe_backward_saved, moe_forward_saved, MoeConfig};
use sluice_kernels::testing::Rng;
use sluice_kernels::{debug, Backend, DType, Tensor};
use sluice_model::optim::OptimConfig;
use sluice_model::{Model, ModelConfig, Precision};
use sluice_runtime::buffer::ReadyGroup;
use sluice_runtime::engine::{Engine, EngineConfig, Event, Request};
use sluice_runtime::learner::{Learner, LearnerConfig};
use sluice_runtime::trajectory::{SamplingParams, WeightVersion};

/// Counts of `f` on this thread.
fn counted<T>(f: impl FnOnce() -> T) -> (T, Counts) {
    let before = counters::snapshot();
    let out = f();
    (out, counters::snapshot().since(before))
}

fn engine_for(m: &Model, cfg: &ModelConfig, p: Precision) -> Engine {
    Engine::new(
        Backend::emu_with_seed(1),
        cfg,
        m.compute_weights(),
        WeightVersion(0),
        EngineConfig {
            kv_bytes: EngineConfig::kv_bytes_for_blocks(cfg, p, 16, 16),
            max_seqs: 4,
            precision: p,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

/// Prefill, then decode steps: the third step's counts (the second decode step, with the same
/// batch of 2 sequences and the same [2, 1] block table as the first) and the finished group.
fn decode_counts(m: &Model, cfg: &ModelConfig, p: Precision) -> (Counts, ReadyGroup) {
    let mut engine = engine_for(m, cfg, p);
    let mut req = Request::new("s0", vec![1, 5, 2, 7, 3], 6);
    req.instance_id = "inst".into();
    req.group_size = 2;
    req.sampling = SamplingParams {
        max_new_tokens: 6,
        seed: 3,
        ..SamplingParams::default()
    };
    engine.submit(req).unwrap();
    let mut events = engine.step().unwrap(); // prefill + first token
    events.extend(engine.step().unwrap()); // decode, warms the cache
    let (ev, c) = counted(|| engine.step().unwrap()); // decode, steady state
    events.extend(ev);
    events.extend(engine.run_until_idle().unwrap());
    let mut samples = Vec::new();
    for e in events {
        if let Event::Finished { sample, .. } = e {
            samples.push(*sample);
        }
    }
    assert_eq!(samples.len(), 2, "both sequences of the group finish");
    // Different rewards, so the advantages (and the gradient) are not zero.
    for (i, s) in samples.iter_mut().enumerate() {
        s.reward = i as f32;
    }
    let group = ReadyGroup {
        instance_id: "inst".into(),
        task: "t".into(),
        samples,
        duplicated: 0,
    };
    (c, group)
}

/// The counts of two train steps on `group`, and the bits of both losses.
fn train_counts(m: Model, group: &ReadyGroup) -> (Counts, Counts, [u64; 2]) {
    let be = Backend::emu_with_seed(1);
    let mut learner =
        Learner::new(be, m, OptimConfig::default(), LearnerConfig::default(), 0).unwrap();
    let groups = std::slice::from_ref(group);
    let (r1, first) = counted(|| learner.train(groups).unwrap());
    assert!(r1.loss.is_finite());
    let (r2, second) = counted(|| learner.train(groups).unwrap());
    (first, second, [r1.loss.to_bits(), r2.loss.to_bits()])
}

/// A run's results, bit for bit: every sample's tokens and log-probs.
fn sample_bits(g: &ReadyGroup) -> Vec<(Vec<u32>, Vec<u32>)> {
    g.samples
        .iter()
        .map(|s| {
            let logp = s.behavior_logp.iter().map(|x| x.to_bits()).collect();
            (s.tokens.clone(), logp)
        })
        .collect()
}

fn tiny(p: Precision) -> (Model, ModelConfig) {
    let cfg = ModelConfig::tiny();
    let be = Backend::emu_with_seed(1);
    let mut m = Model::new(cfg.clone(), &be).unwrap();
    m.set_precision(&be, p).unwrap();
    (m, cfg)
}

#[test]
fn decode_and_train_steps_of_the_tiny_model_make_no_host_round_trips() {
    debug::set(false);
    for p in [Precision::F32, Precision::Bf16] {
        let (m, cfg) = tiny(p);
        let (d, group) = decode_counts(&m, &cfg, p);
        // One download: the sampled tokens and their log-probs, together.
        assert_eq!(d.host_syncs, 1, "{p:?} decode step: {d:?}");
        assert_eq!(d.op_downloads, 0, "{p:?} decode step: {d:?}");
        assert_eq!(d.storage_allocs, 0, "{p:?} steady decode step: {d:?}");

        let (first, second, losses) = train_counts(m, &group);
        // Two: the loss outputs with the MoE layers' expert bounds (model/src/forward.rs,
        // one copy), and the optimizer's gradient norm (NaN check and clipping).
        for (what, c) in [("first", first), ("second", second)] {
            assert_eq!(c.host_syncs, 2, "{p:?} {what} train step: {c:?}");
            assert_eq!(c.op_downloads, 0, "{p:?} {what} train step: {c:?}");
        }
        assert_eq!(
            second.storage_allocs, 0,
            "{p:?} steady train step: {second:?}"
        );

        // The same run again on this thread's warm cache (every output recycled, holding the
        // first run's values, nothing poisoned): the same bits.
        let (m, cfg) = tiny(p);
        let (_, again) = decode_counts(&m, &cfg, p);
        assert_eq!(sample_bits(&again), sample_bits(&group), "{p:?} samples");
        let (.., losses_again) = train_counts(m, &again);
        assert_eq!(losses_again, losses, "{p:?} losses");
    }
}

/// Launches of one MoE layer (the moe family's forward and backward) at the tiny model's
/// sizes: the numbers docs/perf/moe.md states and explains, kernel by kernel.
#[test]
fn launches_of_one_moe_layer() {
    debug::set(false);
    let be = Backend::emu_with_seed(1);
    let (t, d, f, e) = (9, 8, 6, 4);
    let cfg = MoeConfig::new(2);
    let mut rng = Rng::new(11);
    for dtype in [DType::F32, DType::BF16] {
        let mut up = |shape: &[usize]| {
            let n = shape.iter().product();
            Tensor::from_f32_as(&be, shape, dtype, &rng.normal_vec(n, 0.5)).unwrap()
        };
        let (x, wr, w1, w3, w2) = (
            up(&[t, d]),
            up(&[e, d]),
            up(&[e, f, d]),
            up(&[e, f, d]),
            up(&[e, d, f]),
        );
        let dy = up(&[t, d]);
        let ((_, saved), fwd) =
            counted(|| moe_forward_saved(&be, &x, &wr, &w1, &w3, &w2, cfg).unwrap());
        let (_, bwd) = counted(|| {
            moe_backward_saved(&be, &x, &wr, &w1, &w3, &w2, &dy, cfg, Some(&saved)).unwrap()
        });
        let (want_fwd, want_bwd) = match dtype {
            // Forward 14; backward 12 from the forward's saved state, whatever the routing.
            DType::F32 => (14, 12),
            // Forward 15: 2 widenings more, and SwiGLU with h's rounding in the second
            // up-projection's epilogue (2 launches fewer); backward 12 + 3 narrowings (d(ye),
            // da, db) + 1 widening (dy is BF16 here; the model passes an F32 dy).
            _ => (15, 12 + 3 + 1),
        };
        assert_eq!(fwd.launches, want_fwd, "{dtype} forward: {fwd:?}");
        assert_eq!(bwd.launches, want_bwd, "{dtype} backward: {bwd:?}");
        for c in [fwd, bwd] {
            assert_eq!((c.host_syncs, c.op_downloads), (0, 0), "{dtype}: {c:?}");
        }
    }
}
