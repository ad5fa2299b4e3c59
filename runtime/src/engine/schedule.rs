//! Scheduling pieces of [`Engine::step`]: a sequence's blocks (registering new tokens,
//! admission with prefix-cache hits or host K/V, preemption and release), the step's work plan
//! within the token budget, the batches for the prefill and decode calls, and forking a group's
//! members when its prompt completes.

use super::*;

impl Engine {
    pub(super) fn seq(&self, h: SeqHandle) -> Result<&Seq> {
        self.seqs.get(&h).ok_or(EngineError::UnknownHandle(h))
    }

    pub(super) fn seq_mut(&mut self, h: SeqHandle) -> Result<&mut Seq> {
        self.seqs.get_mut(&h).ok_or(EngineError::UnknownHandle(h))
    }

    /// Records that the K/V of positions `range` of `h` was just computed with the current
    /// weights: a prompt or observation token (not trained on) takes the current version, so
    /// a trajectory's versions say which weights produced every entry of its context. A
    /// generated token keeps the version that sampled it. The learner uses this to find the
    /// tokens whose whole context came from one version (zero-lag tokens, DESIGN 6.6).
    pub(super) fn note_kv_computed(
        &mut self,
        h: SeqHandle,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        let version = self.version();
        let s = self.seq_mut(h)?;
        for p in range {
            if !s.loss_mask[p] {
                s.versions[p] = version;
            }
        }
        Ok(())
    }

    pub(super) fn is_paused(&self, h: SeqHandle) -> bool {
        self.seqs.get(&h).is_some_and(|s| s.phase == Phase::Paused)
    }

    /// Registers a running sequence's unregistered tokens with the block manager, executing
    /// any copy-on-write. The inner result is the block manager's (OutOfBlocks: nothing done).
    pub(super) fn register(&mut self, h: SeqHandle) -> Result<std::result::Result<(), KvError>> {
        let s = self.seq(h)?;
        if s.bm_len >= s.tokens.len() {
            return Ok(Ok(()));
        }
        let new = s.tokens[s.bm_len..].to_vec();
        match self.bm.append(SeqId(h.0), &new) {
            Ok(plan) => {
                for c in &plan.copies {
                    self.cache.copy_block(
                        &self.backend,
                        c.src.0 as usize,
                        c.dst.0 as usize,
                        c.tokens,
                    )?;
                }
                let s = self.seq_mut(h)?;
                s.bm_len = s.tokens.len();
                Ok(Ok(()))
            }
            Err(e) => Ok(Err(e)),
        }
    }

    /// Takes the block manager's view of a waiting sequence: joins its tokens (computing from
    /// the prefix-cache hits on) or restores its host K/V.
    pub(super) fn admit(&mut self, h: SeqHandle) -> Result<std::result::Result<(), KvError>> {
        let epoch = self.epoch;
        let s = self.seq(h)?;
        match &s.kv {
            Kv::Device => Ok(Ok(())),
            Kv::None => {
                let tokens = s.tokens.clone();
                match self.bm.join(SeqId(h.0), &tokens) {
                    Ok(plan) => {
                        let s = self.seq_mut(h)?;
                        s.kv_len = plan.cached_tokens;
                        s.bm_len = tokens.len();
                        s.kv = Kv::Device;
                        s.kv_epoch = epoch;
                        // Prefix-cache hits were computed at the current weights (the cache
                        // is invalidated on every swap).
                        self.note_kv_computed(h, 0..plan.cached_tokens)?;
                        Ok(Ok(()))
                    }
                    Err(e) => Ok(Err(e)),
                }
            }
            Kv::Host(_) => {
                let n = s.kv_len;
                let same = s.kv_epoch == epoch;
                let tokens = s.tokens[..n].to_vec();
                match self.bm.join_with(SeqId(h.0), &tokens, same, same) {
                    Ok(plan) => {
                        let s = self.seq_mut(h)?;
                        let Kv::Host(rows) = std::mem::replace(&mut s.kv, Kv::Device) else {
                            return Err(bad("internal: host K/V vanished"));
                        };
                        s.bm_len = n;
                        let c = plan.cached_tokens;
                        let row = self.cache.row_len();
                        // Rows c.. of each host tensor, back on the engine's device.
                        let back = |t: &Tensor| -> Result<Tensor> {
                            Ok(t.copy_range(&Backend::Cpu, c * row, &[n - c, row])?
                                .to_backend(&self.backend)?)
                        };
                        let mut tensors = Vec::with_capacity(rows.len());
                        for (k, v) in &rows {
                            tensors.push((back(k)?, back(v)?));
                        }
                        if n > c {
                            self.cache.scatter(&self.backend, tensors, &plan.slots)?;
                        }
                        Ok(Ok(()))
                    }
                    Err(e) => Ok(Err(e)),
                }
            }
        }
    }

    /// Adds a running sequence's work to this step within the token budget.
    pub(super) fn plan(
        &self,
        h: SeqHandle,
        budget: &mut usize,
        decode: &mut Vec<SeqHandle>,
        prefill: &mut Vec<(SeqHandle, usize)>,
    ) {
        let Some(s) = self.seqs.get(&h) else { return };
        let work = s.tokens.len() - s.kv_len;
        if work == 0 || *budget == 0 {
            return;
        }
        if work == 1 {
            decode.push(h);
            *budget -= 1;
        } else {
            let n = work.min(*budget);
            prefill.push((h, n));
            *budget -= n;
        }
    }

    /// The sequence to preempt: a paused holder first (the oldest), else the newest running
    /// sequence. None when `asking` is the only holder.
    pub(super) fn victim(&self, asking: Option<SeqHandle>) -> Option<SeqHandle> {
        let paused = self
            .seqs
            .iter()
            .filter(|(_, s)| s.phase == Phase::Paused && matches!(s.kv, Kv::Device))
            .min_by_key(|(_, s)| s.order)
            .map(|(&h, _)| h);
        if paused.is_some() {
            return paused;
        }
        let newest = *self.running.last()?;
        if Some(newest) == asking && self.running.len() == 1 {
            return None;
        }
        Some(newest)
    }

    /// Preempts `h` (running or paused) by the configured mode; a running one goes to the
    /// front of the queue.
    pub(super) fn preempt(&mut self, h: SeqHandle) -> Result<()> {
        match self.cfg.preempt {
            PreemptMode::Recompute => {
                self.drop_kv(h)?;
                self.stats.preempted_recompute += 1;
            }
            PreemptMode::SwapToHost => {
                let n = self.seq(h)?.kv_len;
                if n == 0 {
                    self.drop_kv(h)?;
                } else {
                    let slots: Vec<i32> = (0..n)
                        .map(|p| self.bm.slot(SeqId(h.0), p))
                        .collect::<std::result::Result<_, _>>()?;
                    let rows = self.cache.gather(&self.backend, &slots)?;
                    let mut host = Vec::with_capacity(rows.len());
                    for (k, v) in rows {
                        host.push((k.to_backend(&Backend::Cpu)?, v.to_backend(&Backend::Cpu)?));
                    }
                    self.bm.finish(SeqId(h.0))?;
                    let s = self.seq_mut(h)?;
                    s.kv = Kv::Host(host);
                    s.bm_len = 0;
                    self.stats.swapped_out_tokens += n as u64;
                }
                self.stats.preempted_swap += 1;
            }
        }
        if let Some(i) = self.running.iter().position(|&r| r == h) {
            self.running.remove(i);
            self.waiting.push_front(h);
        }
        Ok(())
    }

    /// Releases `h`'s K/V wherever it is; its next admission computes everything.
    pub(super) fn drop_kv(&mut self, h: SeqHandle) -> Result<()> {
        if matches!(self.seq(h)?.kv, Kv::Device) {
            self.bm.finish(SeqId(h.0))?;
        }
        let s = self.seq_mut(h)?;
        s.kv = Kv::None;
        s.kv_len = 0;
        s.bm_len = 0;
        Ok(())
    }

    /// Releases everything `h` holds and takes it off the queues.
    pub(super) fn release(&mut self, h: SeqHandle) -> Result<()> {
        self.drop_kv(h)?;
        self.running.retain(|&r| r != h);
        self.waiting.retain(|&r| r != h);
        Ok(())
    }

    pub(super) fn max_blocks(&self, hs: impl Iterator<Item = SeqHandle>) -> Result<usize> {
        let mut mb = 1;
        for h in hs {
            mb = mb.max(self.bm.block_table(SeqId(h.0))?.len());
        }
        Ok(mb)
    }

    pub(super) fn prefill_batch(
        &self,
        work: &[(SeqHandle, usize)],
    ) -> Result<(PrefillBatch, Vec<(SeqHandle, usize)>)> {
        let ids: Vec<SeqId> = work.iter().map(|(h, _)| SeqId(h.0)).collect();
        let mb = self.max_blocks(work.iter().map(|w| w.0))?;
        let (table, _) = self.bm.block_tables(&ids, mb)?;
        let mut b = PrefillBatch {
            block_table: table,
            max_blocks: mb,
            cu_seqlens: vec![0],
            ..PrefillBatch::default()
        };
        let mut rows = Vec::new();
        for &(h, n) in work {
            let s = self.seq(h)?;
            let start = s.kv_len;
            for p in start..start + n {
                b.tokens.push(s.tokens[p] as i32);
                b.positions.push(p as i32);
                b.slots.push(self.bm.slot(SeqId(h.0), p)?);
            }
            b.cu_seqlens.push(b.tokens.len() as i32);
            b.context_lens.push((start + n) as i32);
            if start + n == s.tokens.len() {
                rows.push((h, b.logits_rows.len()));
                b.logits_rows.push(b.tokens.len() as i32 - 1);
            }
        }
        Ok((b, rows))
    }

    pub(super) fn decode_batch(&self, hs: &[SeqHandle]) -> Result<DecodeBatch> {
        let ids: Vec<SeqId> = hs.iter().map(|h| SeqId(h.0)).collect();
        let mb = self.max_blocks(hs.iter().copied())?;
        let (table, _) = self.bm.block_tables(&ids, mb)?;
        let mut b = DecodeBatch {
            block_table: table,
            max_blocks: mb,
            ..DecodeBatch::default()
        };
        for &h in hs {
            let s = self.seq(h)?;
            let p = s.kv_len;
            b.tokens.push(s.tokens[p] as i32);
            b.positions.push(p as i32);
            b.slots.push(self.bm.slot(SeqId(h.0), p)?);
            b.context_lens.push(p as i32 + 1);
        }
        Ok(b)
    }

    /// Forks a group leader whose prompt K/V just completed into its siblings (sharing its
    /// blocks); returns their handles.
    pub(super) fn fork_group(&mut self, h: SeqHandle) -> Result<Vec<SeqHandle>> {
        let s = self.seq_mut(h)?;
        if s.fork.is_empty() {
            return Ok(Vec::new());
        }
        let fork = std::mem::take(&mut s.fork);
        let children: Vec<SeqId> = fork.iter().map(|(c, _)| SeqId(c.0)).collect();
        self.bm.fork(SeqId(h.0), &children)?;
        let s = self.seq(h)?;
        let mut made = Vec::with_capacity(fork.len());
        let mut new = Vec::with_capacity(fork.len());
        for &(c, gi) in &fork {
            new.push((
                c,
                Seq {
                    meta: s.meta.clone(),
                    group_index: gi,
                    request_id: request_id(&s.meta, gi),
                    fork: Vec::new(),
                    tokens: s.tokens.clone(),
                    loss_mask: s.loss_mask.clone(),
                    logp: s.logp.clone(),
                    versions: s.versions.clone(),
                    prompt_len: s.prompt_len,
                    turns: s.turns.clone(),
                    turn_start: s.turn_start,
                    max_new: s.max_new,
                    kv_len: s.kv_len,
                    bm_len: s.bm_len,
                    kv: Kv::Device,
                    kv_epoch: s.kv_epoch,
                    phase: Phase::Active,
                    order: 0,
                },
            ));
            made.push(c);
        }
        for (c, mut seq) in new {
            seq.order = self.next_order;
            self.next_order += 1;
            self.seqs.insert(c, seq);
            self.running.push(c);
        }
        Ok(made)
    }
}
