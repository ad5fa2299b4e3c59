//! The rollout engine (DESIGN 6.3): continuous batching over the paged KV cache.
//!
//! An [`Engine`] owns one backend, the model's weights as tensors ([`InferWeights`]), the K/V
//! caches ([`KvCache`]) and a [`BlockManager`]. It is driven step by step:
//!
//! - [`Engine::submit`] queues a [`Request`]: a prompt, a GRPO group size G, sampling
//!   parameters, stop conditions. The prompt is prefilled once and forked G ways (the children
//!   share its blocks; a shared partial block is copied on write, the copy run on the caches).
//! - [`Engine::step`] runs one scheduling step: sequences needing blocks get them (preempting
//!   when the pool is short), waiting sequences are admitted while the token and sequence limits
//!   allow, then one `prefill` call computes the K/V of every pending chunk (new prompts,
//!   observations, recomputed sequences; long ones chunked across steps) and one `decode` call
//!   the next token of every generating sequence; every sequence whose K/V is complete samples
//!   its next token with the batch-invariant sampler keyed by (seed, request id, position).
//! - A turn stops on the EOS id, a stop sequence, `max_new_tokens`, or when the sequence alone
//!   outgrows the pool. A single-turn request then finishes and its [`Sample`] is emitted; a
//!   multi-turn one pauses (keeping its KV) until [`Engine::observe`] appends an observation
//!   (prefilled, loss-masked) and generation resumes, or [`Engine::finish`] ends it.
//! - [`Engine::swap_weights`] (between steps) installs a new weight version. In-flight
//!   sequences continue with their KV ([`SwapMode::Continue`], the default; tokens sampled
//!   afterwards record the new version) or are recomputed at the new version
//!   ([`SwapMode::Recompute`]). The prefix cache is invalidated either way.
//! - Preemption when blocks run out: [`PreemptMode::Recompute`] (drop the KV, prefill again on
//!   readmission) or [`PreemptMode::SwapToHost`] (copy the sequence's K/V rows to host memory
//!   and back into fresh blocks on readmission). Either way no sequence is lost, and under the
//!   same weights the tokens and log-probs are the ones an unconstrained run produces.
//! - A whole group can be stopped from outside (over-sampling): aborted, or
//!   suspended with its tokens kept and resumed later under whatever weights are installed
//!   ([`Engine::abort_group`], [`Engine::suspend_group`], [`Engine::resume_group`]).
//!
//! Every ordering is deterministic (ordered maps, FIFO queues, admission order), so a run is
//! reproducible; and since every op is batch-invariant, a request's tokens do not depend on
//! what else is in the batch.
//!
//! Files: this one (the engine's state, the request lifecycle and one step), `api` (the
//! contract: configuration, requests, events, views, counters, errors), `schedule` (blocks,
//! admission, preemption, the step's batches, forks), `groups` (a group stopped from outside)
//! and `replicas` (several engines behind a router, for tests and benches).

mod api;
mod groups;
pub mod replicas;
mod schedule;

pub use api::*;

use crate::hash::{hash_str, mix64};
use crate::kv_blocks::{BlockManager, KvError, SeqId};
use crate::trajectory::{
    ArtifactVersions, ClockStamps, Sample, SamplingParams, TerminalReason, TokenId, TurnBoundary,
    WeightVersion,
};
use sluice_kernels::ops::embedding::embedding;
use sluice_kernels::ops::sample::{sample, SampleParams};
use sluice_kernels::tensor::PoolScope;
use sluice_kernels::{Backend, Tensor};
use sluice_model::infer::{self, DecodeBatch, InferWeights, KvCache, PrefillBatch};
use sluice_model::{Arena, ModelConfig, Precision};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Where a sequence's K/V lives.
enum Kv {
    /// Nowhere: everything is computed on admission.
    None,
    /// In the pool (the block manager holds the sequence).
    Device,
    /// In host memory: per layer (K rows, V rows) of `kv_len` tokens, each `[kv_len, Hkv*D]`
    /// host tensors in the cache's dtype.
    Host(Vec<(Tensor, Tensor)>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Generating (running or waiting for admission).
    Active,
    /// A multi-turn trajectory between turns.
    Paused,
    /// Stopped from outside with its tokens kept and its K/V freed (partial rollout), until
    /// [`Engine::resume_group`].
    Suspended,
}

struct Meta {
    session_id: String,
    instance_id: String,
    task: String,
    sampling: SamplingParams,
    stop: StopConfig,
    multi_turn: bool,
}

struct Seq {
    meta: std::sync::Arc<Meta>,
    group_index: u32,
    /// The sampler's request id.
    request_id: u64,
    /// Group members 1..G still to fork from this one when its prompt's K/V completes.
    fork: Vec<(SeqHandle, u32)>,
    tokens: Vec<TokenId>,
    loss_mask: Vec<bool>,
    logp: Vec<f32>,
    versions: Vec<WeightVersion>,
    prompt_len: usize,
    turns: Vec<TurnBoundary>,
    /// Index of the first token of the current generation turn.
    turn_start: usize,
    max_new: u32,
    /// Tokens whose K/V is in the cache (or on host).
    kv_len: usize,
    /// Tokens registered with the block manager.
    bm_len: usize,
    kv: Kv,
    /// The weight epoch whose prefill produced this K/V from token 0.
    kv_epoch: u64,
    phase: Phase,
    /// Admission order (the newest admitted is preempted first).
    order: u64,
}

/// The rollout engine. See the module docs.
pub struct Engine {
    backend: Backend,
    weights: InferWeights,
    cache: KvCache,
    /// Blocks in the pool (from `cfg.kv_bytes`).
    num_blocks: usize,
    bm: BlockManager,
    cfg: EngineConfig,
    seqs: BTreeMap<SeqHandle, Seq>,
    /// Active sequences holding blocks, in admission order.
    running: Vec<SeqHandle>,
    /// Active sequences waiting for admission (preempted ones at the front).
    waiting: VecDeque<SeqHandle>,
    next_handle: u64,
    next_order: u64,
    /// Bumped on every weight swap.
    epoch: u64,
    stats: EngineStats,
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::Invalid(msg.into())
}

impl Engine {
    /// An engine on `backend` for the model `config` with the weights in `arena`, at `version`.
    pub fn new(
        backend: Backend,
        config: &ModelConfig,
        arena: &Arena,
        version: WeightVersion,
        cfg: EngineConfig,
    ) -> Result<Engine> {
        if cfg.max_batch_tokens == 0 || cfg.max_seqs == 0 {
            return Err(bad(format!(
                "max_batch_tokens ({}) and max_seqs ({}) must be >= 1",
                cfg.max_batch_tokens, cfg.max_seqs
            )));
        }
        let dtype = cfg.precision.dtype();
        let num_blocks = KvCache::blocks_for_bytes(config, dtype, cfg.block_size, cfg.kv_bytes)?;
        let bm = BlockManager::new(num_blocks, cfg.block_size)?;
        let weights = InferWeights::from_arena(&backend, config, arena, version.0, cfg.precision)?;
        let cache = KvCache::new(&backend, config, num_blocks, cfg.block_size, dtype)?;
        Ok(Engine {
            backend,
            weights,
            cache,
            num_blocks,
            bm,
            cfg,
            seqs: BTreeMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            next_handle: 1,
            next_order: 0,
            epoch: 0,
            stats: EngineStats::default(),
        })
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Blocks in the KV pool (as many as `kv_bytes` holds in the engine's precision).
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The engine's precision (its weights' and KV cache's).
    pub fn precision(&self) -> Precision {
        self.cfg.precision
    }

    /// Bytes of the KV caches.
    pub fn kv_cache_bytes(&self) -> usize {
        self.cache.bytes()
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.weights.config
    }

    pub fn version(&self) -> WeightVersion {
        WeightVersion(self.weights.version)
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            kv: self.bm.stats(),
            ..self.stats
        }
    }

    /// Whether any sequence still has work (running or waiting; paused ones do not count).
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Trajectories held (active or paused).
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// The tokens, log-probs and versions of a trajectory held (active or paused); None for a
    /// handle the engine does not hold (finished, aborted or never issued).
    pub fn trajectory(&self, handle: SeqHandle) -> Option<TrajectoryView<'_>> {
        self.seqs.get(&handle).map(|s| TrajectoryView {
            tokens: &s.tokens,
            behavior_logp: &s.logp,
            versions: &s.versions,
            paused: s.phase == Phase::Paused,
        })
    }

    /// Queues a request; returns the handles of its G trajectories (group indices 0..G).
    pub fn submit(&mut self, req: Request) -> Result<Vec<SeqHandle>> {
        let vocab = self.weights.config.vocab;
        if req.prompt.is_empty() {
            return Err(bad(format!(
                "request of session {:?}: the prompt is empty; at least one token is needed",
                req.session_id
            )));
        }
        check_ids(&req.prompt, vocab, "prompt")?;
        let capacity = self.num_blocks * self.cfg.block_size;
        if req.prompt.len() + 1 > capacity {
            return Err(bad(format!(
                "prompt of {} tokens (plus one generated) is longer than the KV pool of {} slots \
                 ({} blocks of {})",
                req.prompt.len(),
                capacity,
                self.num_blocks,
                self.cfg.block_size
            )));
        }
        if req.group_size == 0 {
            return Err(bad("group_size must be >= 1"));
        }
        check_sampling(&req.sampling)?;
        if let Some(eos) = req.stop.eos {
            check_ids(&[eos], vocab, "stop.eos")?;
        }
        for (i, s) in req.stop.stop_sequences.iter().enumerate() {
            if s.is_empty() {
                return Err(bad(format!("stop.stop_sequences[{i}] is empty")));
            }
            check_ids(s, vocab, &format!("stop.stop_sequences[{i}]"))?;
        }
        let meta = std::sync::Arc::new(Meta {
            session_id: req.session_id,
            instance_id: req.instance_id,
            task: req.task,
            sampling: req.sampling,
            stop: req.stop,
            multi_turn: req.multi_turn,
        });
        let handles: Vec<SeqHandle> = (0..req.group_size)
            .map(|_| {
                let h = SeqHandle(self.next_handle);
                self.next_handle += 1;
                h
            })
            .collect();
        let n = req.prompt.len();
        let version = self.version();
        let lead = Seq {
            request_id: request_id(&meta, 0),
            meta: meta.clone(),
            group_index: 0,
            fork: handles[1..]
                .iter()
                .enumerate()
                .map(|(i, &h)| (h, i as u32 + 1))
                .collect(),
            tokens: req.prompt,
            loss_mask: vec![false; n],
            logp: vec![0.0; n],
            versions: vec![version; n],
            prompt_len: n,
            turns: Vec::new(),
            turn_start: n,
            max_new: meta.sampling.max_new_tokens,
            kv_len: 0,
            bm_len: 0,
            kv: Kv::None,
            kv_epoch: self.epoch,
            phase: Phase::Active,
            order: 0,
        };
        self.seqs.insert(handles[0], lead);
        self.waiting.push_back(handles[0]);
        Ok(handles)
    }

    /// Appends observation tokens (loss-masked) to a paused multi-turn trajectory and resumes
    /// generation for at most `max_new_tokens` tokens.
    pub fn observe(
        &mut self,
        handle: SeqHandle,
        observation: &[TokenId],
        max_new_tokens: u32,
    ) -> Result<()> {
        let vocab = self.weights.config.vocab;
        let version = self.version();
        let capacity = self.num_blocks * self.cfg.block_size;
        let s = self
            .seqs
            .get_mut(&handle)
            .ok_or(EngineError::UnknownHandle(handle))?;
        if s.phase != Phase::Paused {
            return Err(bad(format!(
                "observe: trajectory {} is generating; observations go in between turns",
                handle.0
            )));
        }
        if observation.is_empty() {
            return Err(EngineError::Observation(
                "observe: the observation is empty".into(),
            ));
        }
        if max_new_tokens == 0 {
            return Err(bad("observe: max_new_tokens must be >= 1"));
        }
        check_ids(observation, vocab, "observation").map_err(|e| match e {
            EngineError::Invalid(m) => EngineError::Observation(format!("observe: {m}")),
            e => e,
        })?;
        if s.tokens.len() + observation.len() + 1 > capacity {
            return Err(EngineError::Capacity(format!(
                "observe: the trajectory would hold {} tokens (plus one generated), more than \
                 the KV pool's {capacity} slots",
                s.tokens.len() + observation.len()
            )));
        }
        s.turns.push(TurnBoundary {
            start: s.tokens.len(),
        });
        let m = observation.len();
        s.tokens.extend_from_slice(observation);
        s.loss_mask.extend(std::iter::repeat_n(false, m));
        s.logp.extend(std::iter::repeat_n(0.0, m));
        s.versions.extend(std::iter::repeat_n(version, m));
        s.turn_start = s.tokens.len();
        s.max_new = max_new_tokens;
        s.phase = Phase::Active;
        if matches!(s.kv, Kv::Device) {
            s.order = self.next_order;
            self.next_order += 1;
            self.running.push(handle);
        } else {
            self.waiting.push_back(handle);
        }
        Ok(())
    }

    /// Ends a trajectory (any phase) and returns it, with `reward` and `reason`.
    pub fn finish(
        &mut self,
        handle: SeqHandle,
        reward: f32,
        reason: TerminalReason,
    ) -> Result<Sample> {
        if !self.seqs.contains_key(&handle) {
            return Err(EngineError::UnknownHandle(handle));
        }
        self.release(handle)?;
        let s = self
            .seqs
            .remove(&handle)
            .ok_or(EngineError::UnknownHandle(handle))?;
        self.to_sample(s, reward, reason)
    }

    /// Installs new weights (from `arena`, same architecture) at `version` (not older than
    /// the current one), between steps. `mode` None uses the engine's configured default.
    pub fn swap_weights(
        &mut self,
        arena: &Arena,
        version: WeightVersion,
        mode: Option<SwapMode>,
    ) -> Result<()> {
        if version < self.version() {
            return Err(bad(format!(
                "swap_weights: version {version} is older than the current {}",
                self.version()
            )));
        }
        let config = self.weights.config.clone();
        let w =
            InferWeights::from_arena(&self.backend, &config, arena, version.0, self.cfg.precision)?;
        self.weights = w;
        self.epoch += 1;
        self.stats.weight_swaps += 1;
        self.bm.invalidate_prefix_cache();
        if mode.unwrap_or(self.cfg.swap) == SwapMode::Recompute {
            let holders: Vec<SeqHandle> = self
                .seqs
                .iter()
                .filter(|(_, s)| !matches!(s.kv, Kv::None))
                .map(|(&h, _)| h)
                .collect();
            let mut requeue = Vec::new();
            for h in holders {
                self.drop_kv(h)?;
                if let Some(i) = self.running.iter().position(|&r| r == h) {
                    self.running.remove(i);
                    requeue.push(h);
                }
            }
            for h in requeue.into_iter().rev() {
                self.waiting.push_front(h);
            }
        }
        Ok(())
    }

    /// Drops every trajectory (generating, waiting or paused) and frees its blocks, e.g. at
    /// the end of a stage; returns how many there were.
    pub fn abort_all(&mut self) -> Result<usize> {
        let handles: Vec<SeqHandle> = self.seqs.keys().copied().collect();
        for &h in &handles {
            self.release(h)?;
        }
        self.seqs.clear();
        Ok(handles.len())
    }

    /// Forgets every cached prefix block, so the next requests compute from scratch (a run's
    /// barrier does this, so a run resumed from it computes exactly what the original did).
    pub fn reset_prefix_cache(&mut self) {
        self.bm.invalidate_prefix_cache();
    }

    /// Steps until no sequence has work; returns every event.
    pub fn run_until_idle(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        while self.has_work() {
            events.extend(self.step()?);
        }
        Ok(events)
    }

    /// One scheduling step (see the module docs).
    pub fn step(&mut self) -> Result<Vec<Event>> {
        // The step's temporaries go back to this thread's cache when dropped and serve the
        // next step (kernels/src/tensor/pool.rs): a steady-state step allocates nothing.
        let _pool = PoolScope::enter();
        let mut events = Vec::new();
        self.stats.steps += 1;
        let mut budget = self.cfg.max_batch_tokens;
        let mut decode: Vec<SeqHandle> = Vec::new();
        let mut prefill: Vec<(SeqHandle, usize)> = Vec::new();
        let mut preempted: BTreeSet<SeqHandle> = BTreeSet::new();
        // 1. Running sequences: register their new tokens with the block manager (preempting
        //    the newest holders when the pool is short) and plan their work.
        let mut i = 0;
        while i < self.running.len() {
            let h = self.running[i];
            match self.register(h)? {
                Ok(()) => {}
                Err(KvError::OutOfBlocks { .. }) => {
                    match self.victim(Some(h)) {
                        Some(v) => {
                            self.preempt(v)?;
                            preempted.insert(v);
                        }
                        None => {
                            // Nothing else holds blocks: this sequence alone outgrows the pool.
                            self.running.remove(i);
                            events.extend(self.end_turn(h, StopReason::Capacity)?);
                        }
                    }
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
            self.plan(h, &mut budget, &mut decode, &mut prefill);
            i += 1;
        }
        // 2. Admission, FIFO, within the limits.
        while let Some(&h) = self.waiting.front() {
            // A group leader brings its G - 1 siblings when its prompt completes: count them.
            let need = 1 + self.seq(h)?.fork.len();
            let full = !self.running.is_empty() && self.running.len() + need > self.cfg.max_seqs;
            if full || budget == 0 || preempted.contains(&h) {
                break;
            }
            match self.admit(h)? {
                Ok(()) => {
                    self.waiting.pop_front();
                    self.seqs
                        .get_mut(&h)
                        .ok_or(EngineError::UnknownHandle(h))?
                        .order = self.next_order;
                    self.next_order += 1;
                    self.running.push(h);
                    match self.register(h)? {
                        Ok(()) => {}
                        Err(KvError::OutOfBlocks { .. }) => {
                            // Admitted with its K/V but no room for its pending tokens yet:
                            // back to the queue front.
                            self.preempt(h)?;
                            preempted.insert(h);
                            break;
                        }
                        Err(e) => return Err(e.into()),
                    }
                    self.plan(h, &mut budget, &mut decode, &mut prefill);
                }
                Err(KvError::OutOfBlocks { .. }) => {
                    if let Some(v) = self.victim(None).filter(|v| self.is_paused(*v)) {
                        self.preempt(v)?;
                        continue;
                    }
                    if self.running.is_empty() {
                        // Nothing holds blocks and it still does not fit.
                        self.waiting.pop_front();
                        events.extend(self.end_turn(h, StopReason::Capacity)?);
                        continue;
                    }
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
        // 3. Compute: one prefill call and one decode call; collect the rows to sample.
        let mut to_sample: Vec<(SeqHandle, usize, usize)> = Vec::new(); // (seq, source, row)
        let mut logits: Vec<Tensor> = Vec::new();
        if !prefill.is_empty() {
            let (batch, rows) = self.prefill_batch(&prefill)?;
            let l = infer::prefill(&self.backend, &self.weights, &mut self.cache, &batch)?;
            self.stats.prefill_tokens += batch.tokens.len() as u64;
            for &(h, n) in &prefill {
                let s = self.seq_mut(h)?;
                let start = s.kv_len;
                s.kv_len += n;
                self.note_kv_computed(h, start..start + n)?;
            }
            for (h, r) in rows {
                to_sample.push((h, logits.len(), r));
            }
            logits.push(l);
        }
        if !decode.is_empty() {
            let batch = self.decode_batch(&decode)?;
            let l = infer::decode(&self.backend, &self.weights, &mut self.cache, &batch)?;
            self.stats.decode_tokens += decode.len() as u64;
            for (r, &h) in decode.iter().enumerate() {
                let s = self.seq_mut(h)?;
                let p = s.kv_len;
                s.kv_len += 1;
                self.note_kv_computed(h, p..p + 1)?;
                to_sample.push((h, logits.len(), r));
            }
            logits.push(l);
        }
        // 4. Forks: group leaders whose prompt is complete spawn their siblings, which sample
        //    from the same logits row.
        let mut rows: Vec<(SeqHandle, usize, usize)> = Vec::new();
        for (h, src, r) in to_sample {
            rows.push((h, src, r));
            for child in self.fork_group(h)? {
                rows.push((child, src, r));
            }
        }
        // 5. Sample and stop.
        let drawn = self.sample_rows(&rows, &logits)?;
        for ((h, _, _), (tok, lp)) in rows.iter().zip(drawn) {
            if let Some(reason) = self.push_token(*h, tok, lp)? {
                if let Some(i) = self.running.iter().position(|r| r == h) {
                    self.running.remove(i);
                }
                events.extend(self.end_turn(*h, reason)?);
            }
        }
        Ok(events)
    }

    /// Samples one token per row: rows grouped by sampling parameters (one sampler call each),
    /// gathered from their step's logits.
    fn sample_rows(
        &self,
        rows: &[(SeqHandle, usize, usize)],
        logits: &[Tensor],
    ) -> Result<Vec<(TokenId, f32)>> {
        let mut out = vec![(0u32, 0.0f32); rows.len()];
        // Group by (logits source, sampling parameters).
        let mut groups: BTreeMap<(usize, u64, u32, u32, u32), Vec<usize>> = BTreeMap::new();
        for (i, &(h, src, _)) in rows.iter().enumerate() {
            let sp = &self.seq(h)?.meta.sampling;
            groups
                .entry((
                    src,
                    sp.seed,
                    sp.temperature.to_bits(),
                    sp.top_k,
                    sp.top_p.to_bits(),
                ))
                .or_default()
                .push(i);
        }
        for ((src, seed, temp, top_k, top_p), members) in groups {
            let idx: Vec<i32> = members.iter().map(|&i| rows[i].2 as i32).collect();
            let l = &logits[src];
            let identity =
                idx.len() == l.shape()[0] && idx.iter().enumerate().all(|(i, &r)| r as usize == i);
            let picked;
            let table = if identity {
                l
            } else {
                let t = Tensor::from_slice(&self.backend, &[idx.len()], &idx)?;
                picked = embedding(&self.backend, l, &t)?;
                &picked
            };
            let mut ids = Vec::with_capacity(members.len());
            let mut pos = Vec::with_capacity(members.len());
            for &i in &members {
                let s = self.seq(rows[i].0)?;
                ids.push(s.request_id);
                pos.push(s.tokens.len() as i32);
            }
            let ids = Tensor::from_slice(&self.backend, &[ids.len()], &ids)?;
            let pos = Tensor::from_slice(&self.backend, &[pos.len()], &pos)?;
            let p = SampleParams {
                seed,
                temperature: f32::from_bits(temp),
                top_k: top_k as usize,
                top_p: f32::from_bits(top_p),
            };
            let (toks, lps) = sample(&self.backend, table, &ids, &pos, &p)?;
            // Tokens and log-probs in one copy: the decode step's one host sync.
            let got = Tensor::download_many(&[&toks, &lps])?;
            let word = |b: &[u8], j: usize| -> Result<[u8; 4]> {
                b.get(4 * j..4 * j + 4)
                    .and_then(|w| w.try_into().ok())
                    .ok_or_else(|| bad("internal: the sampler returned fewer rows than asked"))
            };
            for (j, &i) in members.iter().enumerate() {
                let tok = i32::from_le_bytes(word(&got[0], j)?);
                let lp = f32::from_le_bytes(word(&got[1], j)?);
                out[i] = (tok as TokenId, lp);
            }
        }
        Ok(out)
    }

    /// Appends a sampled token; returns the stop reason if the turn ends.
    fn push_token(&mut self, h: SeqHandle, tok: TokenId, lp: f32) -> Result<Option<StopReason>> {
        let version = self.version();
        self.stats.sampled_tokens += 1;
        let s = self.seq_mut(h)?;
        if s.tokens.len() == s.turn_start {
            s.turns.push(TurnBoundary {
                start: s.tokens.len(),
            });
        }
        s.tokens.push(tok);
        s.loss_mask.push(true);
        s.logp.push(lp);
        s.versions.push(version);
        let gen = &s.tokens[s.turn_start..];
        let stop = &s.meta.stop;
        Ok(if stop.eos == Some(tok) {
            Some(StopReason::Eos)
        } else if stop.stop_sequences.iter().any(|q| gen.ends_with(q)) {
            Some(StopReason::StopSequence)
        } else if gen.len() >= s.max_new as usize {
            Some(StopReason::MaxNewTokens)
        } else {
            None
        })
    }

    /// A turn stopped: pause a multi-turn trajectory (keeping its K/V), or finish a single-turn
    /// one and emit its sample. The sequence is already off the running list.
    fn end_turn(&mut self, h: SeqHandle, reason: StopReason) -> Result<Vec<Event>> {
        let s = self.seq_mut(h)?;
        if s.meta.multi_turn {
            s.phase = Phase::Paused;
            return Ok(vec![Event::TurnEnded {
                handle: h,
                session_id: s.meta.session_id.clone(),
                group_index: s.group_index,
                reason,
                generated: s.tokens[s.turn_start..].to_vec(),
            }]);
        }
        self.release(h)?;
        let s = self.seqs.remove(&h).ok_or(EngineError::UnknownHandle(h))?;
        let sample = self.to_sample(s, 0.0, reason.terminal())?;
        Ok(vec![Event::Finished {
            handle: h,
            reason,
            sample: Box::new(sample),
        }])
    }

    fn to_sample(&self, s: Seq, reward: f32, reason: TerminalReason) -> Result<Sample> {
        let sample = Sample {
            instance_id: s.meta.instance_id.clone(),
            group_index: s.group_index,
            session_id: s.meta.session_id.clone(),
            task: s.meta.task.clone(),
            prompt_len: s.prompt_len,
            tokens: s.tokens,
            loss_mask: s.loss_mask,
            behavior_logp: s.logp,
            weight_version: s.versions,
            reward,
            terminal_reason: reason,
            turns: s.turns,
            clocks: ClockStamps {
                behavior_version: self.version(),
                inference_refresh: self.stats.weight_swaps,
                ..ClockStamps::default()
            },
            versions: ArtifactVersions::default(),
            sampling: s.meta.sampling,
        };
        sample.validate().map_err(EngineError::Trajectory)?;
        Ok(sample)
    }
}

/// The sampler's request id of group member `gi`: a stable hash of (session, instance, gi).
pub fn request_id_of(session_id: &str, instance_id: &str, group_index: u32) -> u64 {
    let a = hash_str(0x7365_7373, session_id);
    let b = hash_str(0x696e_7374, instance_id);
    mix64(a ^ mix64(b ^ mix64(group_index as u64 + 1)))
}

fn request_id(meta: &Meta, gi: u32) -> u64 {
    request_id_of(&meta.session_id, &meta.instance_id, gi)
}

fn check_ids(ids: &[TokenId], vocab: usize, what: &str) -> Result<()> {
    if let Some((i, &t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(bad(format!(
            "{what}[{i}] = {t} is outside the model's vocabulary 0..{vocab}"
        )));
    }
    Ok(())
}

fn check_sampling(p: &SamplingParams) -> Result<()> {
    if p.max_new_tokens == 0 {
        return Err(bad("sampling.max_new_tokens must be >= 1"));
    }
    SampleParams {
        seed: p.seed,
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: p.top_p,
    }
    .validate()
    .map_err(|e| bad(format!("sampling: {e}")))
}
