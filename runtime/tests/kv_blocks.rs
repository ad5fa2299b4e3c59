//! The paged KV block manager: unit cases, then a property test over random
//! join/append/fork/finish/preempt/readmit sequences checked against a shadow KV store.

use sluice_kernels::testing::Rng;
use sluice_runtime::kv_blocks::*;
use std::collections::BTreeMap;

#[test]
fn slots_follow_the_block_table() {
    let mut m = BlockManager::new(8, 4).unwrap();
    let plan = m.join(SeqId(1), &[10, 11, 12, 13, 14, 15]).unwrap();
    assert_eq!(plan.cached_tokens, 0);
    assert!(plan.copies.is_empty());
    let t = m.block_table(SeqId(1)).unwrap().to_vec();
    assert_eq!(t.len(), 2);
    let want: Vec<i32> = (0..6)
        .map(|j| t[j / 4].0 as i32 * 4 + (j % 4) as i32)
        .collect();
    assert_eq!(plan.slots, want);
    let plan = m.append(SeqId(1), &[16, 17, 18]).unwrap();
    let t = m.block_table(SeqId(1)).unwrap().to_vec();
    assert_eq!(t.len(), 3);
    let want: Vec<i32> = (6..9)
        .map(|j| t[j / 4].0 as i32 * 4 + (j % 4) as i32)
        .collect();
    assert_eq!(plan.slots, want);
    assert_eq!(m.tokens(SeqId(1)).unwrap(), (10..19).collect::<Vec<u32>>());
    let (table, lens) = m.block_tables(&[SeqId(1)], 4).unwrap();
    assert_eq!(lens, vec![9]);
    assert_eq!(
        &table[..3],
        &t.iter().map(|b| b.0 as i32).collect::<Vec<_>>()[..]
    );
    assert_eq!(
        m.block_tables(&[SeqId(1)], 2),
        Err(KvError::TableTooNarrow {
            seq: SeqId(1),
            blocks: 3,
            max_blocks: 2
        })
    );
}

#[test]
fn prefix_blocks_are_shared_but_never_the_last_token() {
    let mut m = BlockManager::new(16, 4).unwrap();
    let prompt: Vec<u32> = (0..10).collect();
    m.join(SeqId(1), &prompt).unwrap();
    // Same first 8 tokens (two full blocks), different tail.
    let mut p2 = prompt[..8].to_vec();
    p2.extend([99, 98]);
    let plan = m.join(SeqId(2), &p2).unwrap();
    assert_eq!(plan.cached_tokens, 8);
    assert_eq!(plan.slots.len(), 2);
    let t1 = m.block_table(SeqId(1)).unwrap().to_vec();
    let t2 = m.block_table(SeqId(2)).unwrap().to_vec();
    assert_eq!(t1[..2], t2[..2]);
    assert_ne!(t1[2], t2[2]);
    assert_eq!(m.ref_count(t1[0]), 2);
    // A prompt of exactly the 8 cached tokens shares only the first block: the block with the
    // last token is computed.
    let plan = m.join(SeqId(3), &prompt[..8]).unwrap();
    assert_eq!(plan.cached_tokens, 4);
    // A different first block shares nothing even if later tokens agree (chained hashes).
    let mut p4 = prompt.clone();
    p4[0] = 77;
    assert_eq!(m.join(SeqId(4), &p4).unwrap().cached_tokens, 0);
    let st = m.stats();
    assert_eq!(st.prefix_hit_tokens, 12);
    assert_eq!(st.prompt_tokens, 10 + 10 + 8 + 10);
}

#[test]
fn finished_prefixes_stay_cached_until_evicted() {
    let mut m = BlockManager::new(4, 4).unwrap();
    let prompt: Vec<u32> = (0..9).collect();
    m.join(SeqId(1), &prompt).unwrap();
    m.finish(SeqId(1)).unwrap();
    let st = m.stats();
    assert_eq!(
        (st.blocks_used, st.blocks_cached, st.blocks_free),
        (0, 2, 2)
    );
    // Readmitting the same tokens hits the two cached blocks.
    assert_eq!(m.join(SeqId(2), &prompt).unwrap().cached_tokens, 8);
    m.finish(SeqId(2)).unwrap();
    // A 16-token unrelated prompt needs all 4 blocks: both cached ones are evicted.
    m.join(SeqId(3), &(100..116).collect::<Vec<u32>>()).unwrap();
    assert_eq!(m.stats().evictions, 2);
    m.finish(SeqId(3)).unwrap();
    assert_eq!(m.join(SeqId(4), &prompt).unwrap().cached_tokens, 0);
}

#[test]
fn fork_shares_blocks_and_copies_the_partial_block_on_write() {
    let mut m = BlockManager::new(16, 4).unwrap();
    m.join(SeqId(0), &[1, 2, 3, 4, 5, 6]).unwrap();
    m.fork(SeqId(0), &[SeqId(1), SeqId(2), SeqId(3)]).unwrap();
    let t0 = m.block_table(SeqId(0)).unwrap().to_vec();
    assert_eq!(m.ref_count(t0[0]), 4);
    assert_eq!(m.ref_count(t0[1]), 4);
    let plan = m.append(SeqId(1), &[7]).unwrap();
    let t1 = m.block_table(SeqId(1)).unwrap().to_vec();
    assert_eq!(t1[0], t0[0]);
    assert_ne!(t1[1], t0[1]);
    assert_eq!(
        plan.copies,
        vec![CopyOp {
            src: t0[1],
            dst: t1[1],
            tokens: 2
        }]
    );
    assert_eq!(plan.slots, vec![t1[1].0 as i32 * 4 + 2]);
    assert_eq!(m.ref_count(t0[1]), 3);
    // Parent and the other children still read the original partial block.
    assert_eq!(m.tokens(SeqId(2)).unwrap(), vec![1, 2, 3, 4, 5, 6]);
    m.append(SeqId(2), &[8]).unwrap();
    m.append(SeqId(3), &[9]).unwrap();
    // The parent is the last holder: it writes in place, no copy.
    let plan = m.append(SeqId(0), &[10]).unwrap();
    assert!(plan.copies.is_empty());
    assert_eq!(plan.slots, vec![t0[1].0 as i32 * 4 + 2]);
    assert_eq!(m.stats().cow_copies, 3);
    for (s, last) in [(0, 10), (1, 7), (2, 8), (3, 9)] {
        assert_eq!(m.tokens(SeqId(s)).unwrap(), vec![1, 2, 3, 4, 5, 6, last]);
    }
    assert_eq!(
        m.fork(SeqId(0), &[SeqId(5), SeqId(5)]),
        Err(KvError::DuplicateSequence(SeqId(5)))
    );
    assert_eq!(
        m.fork(SeqId(9), &[SeqId(6)]),
        Err(KvError::UnknownSequence(SeqId(9)))
    );
}

#[test]
fn out_of_blocks_is_an_error_and_changes_nothing() {
    let mut m = BlockManager::new(3, 4).unwrap();
    m.join(SeqId(1), &[1, 2, 3, 4, 5]).unwrap();
    let before = m.stats();
    assert_eq!(
        m.join(SeqId(2), &[9; 9]),
        Err(KvError::OutOfBlocks {
            needed: 3,
            available: 1
        })
    );
    assert_eq!(
        m.append(SeqId(1), &[6; 8]),
        Err(KvError::OutOfBlocks {
            needed: 2,
            available: 1
        })
    );
    assert_eq!(m.stats(), before);
    assert!(!m.contains(SeqId(2)));
    assert_eq!(m.tokens(SeqId(1)).unwrap(), vec![1, 2, 3, 4, 5]);
    // Preempt, admit the other, readmit later: nothing lost.
    let saved = m.preempt(SeqId(1)).unwrap();
    m.join(SeqId(2), &[9; 9]).unwrap();
    m.finish(SeqId(2)).unwrap();
    m.join(SeqId(1), &saved).unwrap();
    assert_eq!(m.tokens(SeqId(1)).unwrap(), vec![1, 2, 3, 4, 5]);
}

#[test]
fn bad_calls_are_errors() {
    assert!(matches!(
        BlockManager::new(0, 16),
        Err(KvError::BadConfig(_))
    ));
    assert!(matches!(
        BlockManager::new(4, 0),
        Err(KvError::BadConfig(_))
    ));
    let mut m = BlockManager::new(4, DEFAULT_BLOCK_SIZE).unwrap();
    assert_eq!(m.join(SeqId(1), &[]), Err(KvError::EmptyPrompt(SeqId(1))));
    m.join(SeqId(1), &[1]).unwrap();
    assert_eq!(
        m.join(SeqId(1), &[1]),
        Err(KvError::DuplicateSequence(SeqId(1)))
    );
    assert_eq!(
        m.append(SeqId(2), &[1]),
        Err(KvError::UnknownSequence(SeqId(2)))
    );
    assert_eq!(m.finish(SeqId(2)), Err(KvError::UnknownSequence(SeqId(2))));
    assert_eq!(m.preempt(SeqId(2)), Err(KvError::UnknownSequence(SeqId(2))));
    assert!(m.slot(SeqId(1), 1).is_err());
}

/// The KV a token would have: a function of its whole prefix (as real K/V are, through
/// attention in earlier layers), so sharing a block across different prefixes would show.
fn kv_chain(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0x1234_5678u64;
    tokens
        .iter()
        .map(|&t| {
            h = (h ^ t as u64)
                .wrapping_mul(0x0000_0100_0000_01b3)
                .rotate_left(17)
                ^ 0x9e37;
            h
        })
        .collect()
}

struct World {
    m: BlockManager,
    bs: usize,
    /// The test's own record of every live sequence's tokens.
    logical: BTreeMap<SeqId, Vec<u32>>,
    preempted: Vec<(SeqId, Vec<u32>)>,
    /// Simulated KV per slot.
    shadow: Vec<Option<u64>>,
    next_id: u64,
}

impl World {
    /// Executes a plan on the shadow store: copies first, then the new tokens' KV.
    fn apply(&mut self, seq: SeqId, plan: &WritePlan, first_new: usize) {
        for c in &plan.copies {
            for i in 0..c.tokens {
                self.shadow[c.dst.0 as usize * self.bs + i] =
                    self.shadow[c.src.0 as usize * self.bs + i];
            }
        }
        let kv = kv_chain(&self.logical[&seq]);
        for (k, &slot) in plan.slots.iter().enumerate() {
            self.shadow[slot as usize] = Some(kv[first_new + k]);
        }
    }

    fn check(&self, ctx: &str) {
        let n = self.m.num_blocks();
        let mut refs = vec![0u32; n];
        // Per block: the (index in table, tokens of the holder in that block) of each holder.
        let mut holders: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n];
        for (&id, toks) in &self.logical {
            assert_eq!(&self.m.tokens(id).unwrap(), toks, "{ctx}: tokens of {id}");
            let table = self.m.block_table(id).unwrap();
            assert_eq!(
                table.len(),
                toks.len().div_ceil(self.bs),
                "{ctx}: table of {id}"
            );
            let kv = kv_chain(toks);
            for (j, want) in kv.iter().enumerate() {
                let slot = table[j / self.bs].0 as usize * self.bs + j % self.bs;
                assert_eq!(
                    self.shadow[slot],
                    Some(*want),
                    "{ctx}: {id} token {j} slot {slot}"
                );
            }
            for (i, b) in table.iter().enumerate() {
                refs[b.0 as usize] += 1;
                let fill = (toks.len() - i * self.bs).min(self.bs);
                holders[b.0 as usize].push((i, fill));
            }
        }
        for b in 0..n {
            assert_eq!(
                self.m.ref_count(BlockId(b as u32)),
                refs[b],
                "{ctx}: refs of block {b}"
            );
            let h = &holders[b];
            if h.len() > 1 && h.iter().any(|&(_, fill)| fill < self.bs) {
                // A shared partial block: every holder is before its copy-on-write, at the
                // same position with the same fill.
                assert!(
                    h.iter().all(|&x| x == h[0]),
                    "{ctx}: block {b} shared unevenly: {h:?}"
                );
            }
        }
        let st = self.m.stats();
        assert_eq!(
            st.blocks_used + st.blocks_free + st.blocks_cached,
            n,
            "{ctx}: {st:?}"
        );
        assert_eq!(
            st.blocks_used,
            refs.iter().filter(|&&r| r > 0).count(),
            "{ctx}"
        );
    }

    /// Preempts a random live sequence other than `keep`; false if there is none.
    fn preempt_one(&mut self, rng: &mut Rng, keep: Option<SeqId>) -> bool {
        let ids: Vec<SeqId> = self
            .logical
            .keys()
            .copied()
            .filter(|&s| Some(s) != keep)
            .collect();
        if ids.is_empty() {
            return false;
        }
        let victim = ids[rng.below(ids.len())];
        let toks = self.m.preempt(victim).unwrap();
        assert_eq!(toks, self.logical.remove(&victim).unwrap());
        self.preempted.push((victim, toks));
        true
    }

    /// Admits `seq` with `tokens`, preempting others while the pool is short.
    fn admit(&mut self, rng: &mut Rng, seq: SeqId, tokens: Vec<u32>) -> bool {
        loop {
            let before = self.m.stats();
            match self.m.join(seq, &tokens) {
                Ok(plan) => {
                    self.logical.insert(seq, tokens);
                    self.apply(seq, &plan, plan.cached_tokens);
                    return true;
                }
                Err(KvError::OutOfBlocks { .. }) => {
                    assert_eq!(self.m.stats(), before, "failed join changed the pool");
                    assert!(!self.m.contains(seq));
                    if !self.preempt_one(rng, None) {
                        return false;
                    }
                }
                Err(e) => panic!("join {seq}: {e}"),
            }
        }
    }
}

const MAX_LEN: usize = 90;

fn run_seed(seed: u64, bs: usize, num_blocks: usize, steps: usize) -> KvStats {
    let mut rng = Rng::new(seed);
    let bases: Vec<Vec<u32>> = (0..3)
        .map(|_| (0..40).map(|_| rng.below(50) as u32).collect())
        .collect();
    let mut w = World {
        m: BlockManager::new(num_blocks, bs).unwrap(),
        bs,
        logical: BTreeMap::new(),
        preempted: Vec::new(),
        shadow: vec![None; num_blocks * bs],
        next_id: 0,
    };
    for step in 0..steps {
        let ctx = format!("seed {seed} bs {bs} step {step}");
        let live: Vec<SeqId> = w.logical.keys().copied().collect();
        let pick = |rng: &mut Rng| live[rng.below(live.len())];
        match rng.below(100) {
            0..=24 => {
                let base = &bases[rng.below(3)];
                let mut p = base[..1 + rng.below(base.len())].to_vec();
                p.extend((0..rng.below(10)).map(|_| rng.below(50) as u32));
                let id = SeqId(w.next_id);
                w.next_id += 1;
                w.admit(&mut rng, id, p);
            }
            25..=59 if !live.is_empty() => {
                let id = pick(&mut rng);
                let k = 1 + rng.below(20);
                if w.logical[&id].len() + k > MAX_LEN {
                    w.m.finish(id).unwrap();
                    w.logical.remove(&id);
                } else {
                    let new: Vec<u32> = (0..k).map(|_| rng.below(50) as u32).collect();
                    loop {
                        let before = w.m.stats();
                        match w.m.append(id, &new) {
                            Ok(plan) => {
                                let start = w.logical[&id].len();
                                w.logical.get_mut(&id).unwrap().extend(&new);
                                w.apply(id, &plan, start);
                                break;
                            }
                            Err(KvError::OutOfBlocks { .. }) => {
                                assert_eq!(
                                    w.m.stats(),
                                    before,
                                    "{ctx}: failed append changed the pool"
                                );
                                if !w.preempt_one(&mut rng, Some(id)) {
                                    // Alone and still too big: preempt itself.
                                    let toks = w.m.preempt(id).unwrap();
                                    w.logical.remove(&id);
                                    w.preempted.push((id, toks));
                                    break;
                                }
                            }
                            Err(e) => panic!("{ctx}: append: {e}"),
                        }
                    }
                }
            }
            60..=69 if !live.is_empty() => {
                let parent = pick(&mut rng);
                let kids: Vec<SeqId> = (0..1 + rng.below(4))
                    .map(|_| {
                        w.next_id += 1;
                        SeqId(w.next_id - 1)
                    })
                    .collect();
                w.m.fork(parent, &kids).unwrap();
                let toks = w.logical[&parent].clone();
                for k in kids {
                    w.logical.insert(k, toks.clone());
                }
            }
            70..=84 if !live.is_empty() => {
                let id = pick(&mut rng);
                w.m.finish(id).unwrap();
                w.logical.remove(&id);
            }
            85..=92 if !live.is_empty() => {
                w.preempt_one(&mut rng, None);
            }
            _ if !w.preempted.is_empty() => {
                let (id, toks) = w.preempted.remove(rng.below(w.preempted.len()));
                if !w.admit(&mut rng, id, toks.clone()) {
                    w.preempted.push((id, toks));
                }
            }
            _ => {}
        }
        w.check(&ctx);
    }
    // Drain: finish everything live, then readmit every preempted sequence with its tokens
    // (nothing is lost) and finish it.
    let live: Vec<SeqId> = w.logical.keys().copied().collect();
    for id in live {
        w.m.finish(id).unwrap();
        w.logical.remove(&id);
    }
    while let Some((id, toks)) = w.preempted.pop() {
        assert!(
            w.admit(&mut rng, id, toks.clone()),
            "seed {seed}: {id} cannot be readmitted alone"
        );
        w.check(&format!("seed {seed} readmit {id}"));
        w.m.finish(id).unwrap();
        w.logical.remove(&id);
    }
    let st = w.m.stats();
    assert_eq!(st.blocks_used, 0, "seed {seed}: {st:?}");
    assert_eq!(
        st.blocks_free + st.blocks_cached,
        num_blocks,
        "seed {seed}: {st:?}"
    );
    assert_eq!(w.m.available_blocks(), num_blocks);
    for b in 0..num_blocks {
        assert_eq!(w.m.ref_count(BlockId(b as u32)), 0);
    }
    st
}

/// The random runs must actually exercise prefix hits, copy-on-write and eviction.
fn assert_exercised(all: &[KvStats]) {
    let sum = |f: fn(&KvStats) -> u64| all.iter().map(f).sum::<u64>();
    assert!(sum(|s| s.prefix_hit_tokens) > 0);
    assert!(sum(|s| s.cow_copies) > 0);
    assert!(sum(|s| s.evictions) > 0);
}

#[test]
fn random_operations_never_leak_or_corrupt_default_block_size() {
    // 90-token sequences need up to 6 blocks of 16; 12 blocks force preemption often.
    let all: Vec<KvStats> = (0..150)
        .map(|seed| run_seed(seed, DEFAULT_BLOCK_SIZE, 12, 250))
        .collect();
    assert_exercised(&all);
}

#[test]
fn random_operations_never_leak_or_corrupt_small_blocks() {
    let mut all: Vec<KvStats> = (0..150)
        .map(|seed| run_seed(1000 + seed, 4, 40, 250))
        .collect();
    all.extend((0..50).map(|seed| run_seed(5000 + seed, 1, 150, 200)));
    assert_exercised(&all);
}

#[test]
fn invalidating_the_prefix_cache_frees_cached_blocks_and_stops_caching_live_ones() {
    let mut m = BlockManager::new(8, 4).unwrap();
    let prompt: Vec<u32> = (0..9).collect();
    m.join(SeqId(1), &prompt).unwrap();
    m.finish(SeqId(1)).unwrap();
    assert_eq!(m.stats().blocks_cached, 2);
    m.join(SeqId(2), &prompt).unwrap();
    assert_eq!(m.stats().prefix_hit_tokens, 8);
    m.invalidate_prefix_cache();
    // Held blocks stay held; nothing is shared with a new join any more.
    assert_eq!(m.stats().blocks_cached, 0);
    let plan = m.join(SeqId(3), &prompt).unwrap();
    assert_eq!(plan.cached_tokens, 0);
    // Sequence 2 (live across the invalidation) fills a block: it is not cached...
    m.append(SeqId(2), &[9, 10, 11]).unwrap();
    m.finish(SeqId(2)).unwrap();
    assert_eq!(m.stats().blocks_cached, 0, "{:?}", m.stats());
    // ...while sequence 3 (joined after it) caches as usual.
    m.finish(SeqId(3)).unwrap();
    assert_eq!(m.stats().blocks_cached, 2);
    assert_eq!(m.join(SeqId(4), &prompt).unwrap().cached_tokens, 8);
}

#[test]
fn join_with_options() {
    let mut m = BlockManager::new(8, 4).unwrap();
    let prompt: Vec<u32> = (0..9).collect();
    m.join(SeqId(1), &prompt).unwrap();
    // No sharing: fresh blocks for every token even though the prefix is cached.
    let plan = m.join_with(SeqId(2), &prompt, false, false).unwrap();
    assert_eq!(plan.cached_tokens, 0);
    assert_eq!(plan.slots.len(), 9);
    let t1 = m.block_table(SeqId(1)).unwrap().to_vec();
    let t2 = m.block_table(SeqId(2)).unwrap().to_vec();
    assert!(t1.iter().all(|b| !t2.contains(b)));
    // Not cacheable: once finished, its blocks return to the free list.
    m.finish(SeqId(2)).unwrap();
    assert_eq!(m.stats().blocks_cached, 0);
    assert_eq!(m.stats().blocks_free, 8 - 3);
}
