//! The rollout engine's identities (DESIGN 6.3): a sequence that shares its prompt's blocks
//! (a GRPO group forked from one prefill, a prompt found in the prefix cache, copy-on-write of
//! a shared partial block) and a sequence preempted and recomputed under a short KV pool both
//! produce the tokens and log-probs, bit for bit, of a fresh run of the same request alone.

use super::Verdict;
use crate::determinism::workloads::Preset;
use crate::determinism::DetError;
use sluice_kernels::testing::Rng;
use sluice_kernels::Backend;
use sluice_model::{Model, Precision};
use sluice_runtime::engine::{Engine, EngineConfig, Event, PreemptMode, Request};
use sluice_runtime::trajectory::{Sample, SamplingParams, WeightVersion};
use std::collections::BTreeMap;

/// A request and the engine step it is submitted at.
#[derive(Clone)]
struct Job {
    req: Request,
    at: u64,
}

type Results = BTreeMap<(String, u32), Sample>;

fn err(probe: &str) -> impl Fn(String) -> DetError + '_ {
    move |e| DetError::Run(format!("{probe}: {e}"))
}

/// Another backend on the same device (an engine owns its backend).
fn reopen(backend: &Backend) -> Result<Backend, String> {
    match backend {
        Backend::Cpu => Ok(Backend::Cpu),
        Backend::Emu(e) => Ok(Backend::emu_with_seed(e.seed)),
        Backend::Cuda(_) => Backend::open(backend.device()).map_err(|e| e.to_string()),
    }
}

struct Setup {
    model: Model,
    precision: Precision,
}

impl Setup {
    fn new(backend: &Backend, preset: Preset) -> Result<Setup, String> {
        let mut cfg = preset.model().map_err(|e| e.to_string())?;
        cfg.init_std = 0.15;
        let precision = Precision::default_for(backend.device());
        let mut model = Model::new(cfg, backend).map_err(|e| e.to_string())?;
        model
            .set_precision(backend, precision)
            .map_err(|e| e.to_string())?;
        Ok(Setup { model, precision })
    }

    /// An engine with a pool of `blocks` blocks of 4 slots.
    fn engine(
        &self,
        backend: &Backend,
        blocks: usize,
        preempt: PreemptMode,
    ) -> Result<Engine, String> {
        let cfg = &self.model.config;
        let ec = EngineConfig {
            kv_bytes: EngineConfig::kv_bytes_for_blocks(cfg, self.precision, 4, blocks),
            block_size: 4,
            max_batch_tokens: 48,
            max_seqs: 64,
            preempt,
            precision: self.precision,
            ..EngineConfig::default()
        };
        Engine::new(
            reopen(backend)?,
            cfg,
            self.model.compute_weights(),
            WeightVersion(0),
            ec,
        )
        .map_err(|e| e.to_string())
    }
}

fn request(name: &str, prompt: Vec<u32>, group: u32, max_new: u32) -> Request {
    let mut r = Request::new(name, prompt, max_new);
    r.instance_id = format!("inst-{name}");
    r.group_size = group;
    r.sampling = SamplingParams {
        max_new_tokens: max_new,
        seed: 7,
        ..SamplingParams::default()
    };
    r
}

fn prompt(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

/// Steps `eng` until every job's trajectories finished (single-turn requests).
fn drive(eng: &mut Engine, jobs: &[Job]) -> Result<Results, String> {
    let expected: usize = jobs.iter().map(|j| j.req.group_size as usize).sum();
    let mut owner = BTreeMap::new();
    let mut out = Results::new();
    let mut submitted = vec![false; jobs.len()];
    let mut step = 0u64;
    while out.len() < expected {
        for (i, j) in jobs.iter().enumerate() {
            if !submitted[i] && j.at <= step {
                for (g, h) in eng
                    .submit(j.req.clone())
                    .map_err(|e| e.to_string())?
                    .into_iter()
                    .enumerate()
                {
                    owner.insert(h, (j.req.session_id.clone(), g as u32));
                }
                submitted[i] = true;
            }
        }
        for ev in eng.step().map_err(|e| e.to_string())? {
            if let Event::Finished { handle, sample, .. } = ev {
                let key = owner.get(&handle).cloned().ok_or_else(|| {
                    format!("a finished trajectory with an unknown handle {}", handle.0)
                })?;
                out.insert(key, *sample);
            }
        }
        step += 1;
        if step > 100_000 {
            return Err("the engine made no progress in 100000 steps".to_string());
        }
    }
    Ok(out)
}

/// The first trajectory of `got` that differs from `want` (tokens or log-prob bits).
fn first_mismatch(want: &Results, got: &Results, what: &str) -> Option<String> {
    for (key, w) in want {
        let Some(g) = got.get(key) else {
            return Some(format!("{what}: trajectory {}/{} is missing", key.0, key.1));
        };
        if let Some(i) =
            (0..w.tokens.len().max(g.tokens.len())).find(|&i| w.tokens.get(i) != g.tokens.get(i))
        {
            return Some(format!(
                "{what}: session {} sample {}, token {i}: fresh {:?}, here {:?}",
                key.0,
                key.1,
                w.tokens.get(i),
                g.tokens.get(i)
            ));
        }
        if let Some(i) = (0..w.behavior_logp.len())
            .find(|&i| w.behavior_logp[i].to_bits() != g.behavior_logp[i].to_bits())
        {
            return Some(format!(
                "{what}: session {} sample {}, log-prob of token {i}: fresh {:e} (0x{:08x}), here \
                 {:e} (0x{:08x})",
                key.0,
                key.1,
                w.behavior_logp[i],
                w.behavior_logp[i].to_bits(),
                g.behavior_logp[i],
                g.behavior_logp[i].to_bits()
            ));
        }
    }
    None
}

/// Each job alone in a fresh engine with a large pool.
fn fresh(s: &Setup, backend: &Backend, jobs: &[Job]) -> Result<Results, String> {
    let mut out = Results::new();
    for j in jobs {
        let mut eng = s.engine(backend, 1024, PreemptMode::Recompute)?;
        let alone = Job {
            req: j.req.clone(),
            at: 0,
        };
        out.extend(drive(&mut eng, std::slice::from_ref(&alone))?);
    }
    Ok(out)
}

/// Prefix-shared sequences = fresh ones. One engine runs a long unrelated request R, a GRPO
/// group P of 4 (one prefill, forked, a shared partial block copied on write) and, a step
/// later, Q, whose prompt starts with P's first 33 tokens (found in the prefix cache). Every
/// trajectory must equal the same request run alone in a fresh engine; P's member 0 also
/// equals a fresh single-sample request (no fork at all).
pub fn prefix_shared(backend: &Backend, preset: Preset) -> Result<Verdict, DetError> {
    let e = err("prefix_shared");
    let s = Setup::new(backend, preset).map_err(&e)?;
    let vocab = s.model.config.vocab;
    let mut rng = Rng::new(0x5a4e);
    let p_prompt = prompt(&mut rng, 37, vocab);
    let mut q_prompt = p_prompt[..33].to_vec();
    q_prompt.extend(prompt(&mut rng, 6, vocab));
    let jobs = vec![
        Job {
            req: request("r", prompt(&mut rng, 6, vocab), 1, 24),
            at: 0,
        },
        Job {
            req: request("p", p_prompt.clone(), 4, 8),
            at: 0,
        },
        Job {
            req: request("q", q_prompt, 1, 8),
            at: 2,
        },
    ];
    let mut eng = s
        .engine(backend, 1024, PreemptMode::Recompute)
        .map_err(&e)?;
    let shared = drive(&mut eng, &jobs).map_err(&e)?;
    let st = eng.stats();
    if st.kv.prefix_hit_tokens == 0 {
        return Ok(Verdict::fail(
            "the prefix cache was never hit: the probe did not exercise sharing".to_string(),
        ));
    }
    let alone = fresh(&s, backend, &jobs).map_err(&e)?;
    if let Some(m) = first_mismatch(&alone, &shared, "shared vs fresh") {
        return Ok(Verdict::fail(m));
    }
    let single = fresh(
        &s,
        backend,
        &[Job {
            req: request("p", p_prompt, 1, 8),
            at: 0,
        }],
    )
    .map_err(&e)?;
    if let Some(m) = first_mismatch(&single, &shared, "group member 0 vs a fresh single request") {
        return Ok(Verdict::fail(m));
    }
    Ok(Verdict::pass(format!(
        "{} trajectories ({} prefix-cache hit tokens, {} copy-on-write copies) equal fresh runs bit for bit",
        shared.len(),
        st.kv.prefix_hit_tokens,
        st.kv.cow_copies
    )))
}

/// Preempted-then-recomputed sequences = fresh ones: six requests (two of them groups) in a
/// pool of 24 blocks of 4 slots, too small for all of them, with recompute preemption; every
/// trajectory must equal the same request run alone in a fresh engine with a large pool.
pub fn preempted_recompute(backend: &Backend, preset: Preset) -> Result<Verdict, DetError> {
    let e = err("preempted_recompute");
    let s = Setup::new(backend, preset).map_err(&e)?;
    let vocab = s.model.config.vocab;
    let mut rng = Rng::new(0x9e3e);
    let jobs: Vec<Job> = [
        (5, 2, 12),
        (17, 1, 14),
        (9, 2, 10),
        (30, 1, 12),
        (3, 1, 16),
        (22, 1, 9),
    ]
    .iter()
    .enumerate()
    .map(|(i, &(n, g, max_new))| Job {
        req: request(&format!("j{i}"), prompt(&mut rng, n, vocab), g, max_new),
        at: 0,
    })
    .collect();
    let mut eng = s.engine(backend, 24, PreemptMode::Recompute).map_err(&e)?;
    let constrained = drive(&mut eng, &jobs).map_err(&e)?;
    let st = eng.stats();
    if st.preempted_recompute == 0 {
        return Ok(Verdict::fail(
            "no sequence was preempted: the probe did not exercise recomputation".to_string(),
        ));
    }
    let alone = fresh(&s, backend, &jobs).map_err(&e)?;
    if let Some(m) = first_mismatch(&alone, &constrained, "preempted vs fresh") {
        return Ok(Verdict::fail(m));
    }
    Ok(Verdict::pass(format!(
        "{} trajectories through {} preemptions (recompute) equal fresh runs bit for bit",
        constrained.len(),
        st.preempted_recompute
    )))
}
