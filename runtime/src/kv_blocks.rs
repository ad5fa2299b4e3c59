//! The paged KV block manager (DESIGN 6.3): which cache slots hold which sequence's keys and
//! values. It owns no tensors: it hands the engine slot numbers to write (`slot_mapping` for
//! `kv_append`), block-table rows to read (`paged_attention`), and copy instructions for
//! copy-on-write; the engine executes those on the K/V caches [NB, BS, Hkv, D].
//!
//! - A pool of `num_blocks` blocks of `block_size` token slots; slot = block * block_size + offset.
//! - Reference counts: a block is held by every sequence whose block table names it.
//! - Prefix caching: when a block fills, it gets a chained hash (its parent block's hash and its
//!   tokens, [`crate::hash::hash_block`]) and enters the cache; a new sequence whose prompt starts
//!   with cached full blocks shares them (tokens compared too, so a hash collision cannot share
//!   wrong KV). Full blocks are immutable, so sharing them is safe. Freed hashed blocks stay
//!   reusable until evicted, least recently released first, when the free list runs dry.
//! - Fork (a GRPO group): children share all the parent's blocks. A shared partial last block is
//!   copied on a sharer's first append ([`CopyOp`]); the last remaining holder writes in place.
//! - Every allocation is checked before anything changes: when the pool cannot fit it the call
//!   returns [`KvError::OutOfBlocks`] and the state is untouched, so the caller can preempt a
//!   sequence ([`BlockManager::preempt`], which returns its tokens) and retry, and later readmit
//!   it ([`BlockManager::join`] with those tokens; cached blocks may spare recompute).
//!
//! All maps are ordered (BTreeMap/VecDeque) and hashes are stable, so the same call sequence
//! gives the same block numbers on every run.

use crate::hash::hash_block;
use sluice_kernels::ops::paged_attention::{check_block_table, PagedDims};
use std::collections::{BTreeMap, VecDeque};
use std::fmt;

/// Default slots per block (DESIGN 6.3).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Parent hash of a sequence's first block.
const ROOT_HASH: u64 = 0x736c_7569_6365_6b76;

/// A block of the pool (an index into the caches' first dimension).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);

/// A sequence known to the manager (a request, or one sample of a group).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sequence {}", self.0)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvError {
    /// The pool cannot supply `needed` blocks (`available` are free or evictable): preempt a
    /// sequence and retry. Nothing was changed.
    OutOfBlocks {
        needed: usize,
        available: usize,
    },
    UnknownSequence(SeqId),
    DuplicateSequence(SeqId),
    /// `join` with no tokens: a sequence needs at least one token.
    EmptyPrompt(SeqId),
    /// A block table wider than `max_blocks` was asked for in `block_tables`.
    TableTooNarrow {
        seq: SeqId,
        blocks: usize,
        max_blocks: usize,
    },
    /// num_blocks or block_size out of range.
    BadConfig(String),
    /// A block table that the paged-attention kernels would reject (the kernels' named error,
    /// `sluice_kernels::ops::paged_attention::check_block_table`): checked here, where the
    /// tables are built, so the kernels need not read them back from the device.
    BadTable(String),
}

impl fmt::Display for KvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvError::OutOfBlocks { needed, available } => write!(
                f,
                "KV pool out of blocks: {needed} needed, {available} free or evictable; preempt a sequence and retry"
            ),
            KvError::UnknownSequence(s) => write!(f, "{s} is not held by the block manager"),
            KvError::DuplicateSequence(s) => write!(f, "{s} is already held by the block manager"),
            KvError::EmptyPrompt(s) => write!(f, "{s} joined with no tokens; at least one is needed"),
            KvError::TableTooNarrow { seq, blocks, max_blocks } => write!(
                f,
                "{seq} uses {blocks} blocks but the block table has {max_blocks} columns (MB)"
            ),
            KvError::BadConfig(m) => write!(f, "block manager configuration: {m}"),
            KvError::BadTable(m) => write!(f, "block table: {m}"),
        }
    }
}

impl std::error::Error for KvError {}

/// Copy the first `tokens` slots of block `src` to block `dst` (all layers, K and V): the
/// engine runs this before writing the new tokens returned with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOp {
    pub src: BlockId,
    pub dst: BlockId,
    pub tokens: usize,
}

/// What the engine must do after `join` or `append`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct WritePlan {
    /// Leading tokens of the call whose KV is already in the cache (prefix hits; join only):
    /// the engine computes KV from token `cached_tokens` on.
    pub cached_tokens: usize,
    /// Copy-on-write copies to execute first.
    pub copies: Vec<CopyOp>,
    /// The slot of each token to compute, in order (kv_append's slot_mapping).
    pub slots: Vec<i32>,
}

/// Counters of the pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    pub num_blocks: usize,
    /// Blocks held by at least one sequence.
    pub blocks_used: usize,
    /// Blocks on the free list (no content worth keeping).
    pub blocks_free: usize,
    /// Unheld blocks kept for their cached prefix (reusable or evictable).
    pub blocks_cached: usize,
    /// Prompt tokens asked for in `join`.
    pub prompt_tokens: u64,
    /// Of those, tokens found in the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Copy-on-write copies issued.
    pub cow_copies: u64,
    /// Cached blocks evicted to satisfy an allocation.
    pub evictions: u64,
}

#[derive(Clone, Debug, Default)]
struct Block {
    refs: u32,
    /// The tokens written so far (all holders agree on them: only a sole holder writes).
    tokens: Vec<u32>,
    /// Set when full.
    hash: Option<u64>,
    /// Key in `evictable` while cached and unheld.
    released_at: u64,
}

#[derive(Clone, Debug)]
struct Seq {
    blocks: Vec<BlockId>,
    /// Chained hashes of the full blocks, in order.
    hashes: Vec<u64>,
    len: usize,
    /// Whether blocks this sequence fills enter the prefix cache (false once its KV may differ
    /// from a fresh prefill's: after [`BlockManager::invalidate_prefix_cache`], or when joined
    /// with KV restored from elsewhere).
    cacheable: bool,
}

/// The block manager. See the module docs.
#[derive(Clone, Debug)]
pub struct BlockManager {
    block_size: usize,
    blocks: Vec<Block>,
    free: VecDeque<BlockId>,
    /// Hash -> the block that holds that prefix (held or cached).
    cache: BTreeMap<u64, BlockId>,
    /// Unheld hashed blocks, by release tick (oldest evicted first).
    evictable: BTreeMap<u64, BlockId>,
    seqs: BTreeMap<SeqId, Seq>,
    tick: u64,
    stats: KvStats,
}

impl BlockManager {
    /// A pool of `num_blocks` blocks of `block_size` slots (slots must fit an i32).
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if num_blocks == 0 || block_size == 0 {
            return Err(KvError::BadConfig(format!(
                "num_blocks {num_blocks} and block_size {block_size} must both be >= 1"
            )));
        }
        if num_blocks
            .checked_mul(block_size)
            .is_none_or(|s| s > i32::MAX as usize)
        {
            return Err(KvError::BadConfig(format!(
                "num_blocks {num_blocks} * block_size {block_size} slots do not fit an i32 slot index"
            )));
        }
        Ok(BlockManager {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            free: (0..num_blocks as u32).map(BlockId).collect(),
            cache: BTreeMap::new(),
            evictable: BTreeMap::new(),
            seqs: BTreeMap::new(),
            tick: 0,
            stats: KvStats::default(),
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// How many sequences hold `block` (0 for an unknown block).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks.get(block.0 as usize).map_or(0, |b| b.refs)
    }

    /// Blocks an allocation may take now (free plus evictable cached ones).
    pub fn available_blocks(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    pub fn stats(&self) -> KvStats {
        KvStats {
            num_blocks: self.blocks.len(),
            blocks_used: self.blocks.iter().filter(|b| b.refs > 0).count(),
            blocks_free: self.free.len(),
            blocks_cached: self.evictable.len(),
            ..self.stats
        }
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// The sequences held, in id order.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Tokens held for `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize, KvError> {
        Ok(self.seq(seq)?.len)
    }

    /// The block table of `seq`: its j-th token lives in slot
    /// `table[j / block_size] * block_size + j % block_size`.
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId], KvError> {
        Ok(&self.seq(seq)?.blocks)
    }

    /// The token ids `seq` holds, in order (what a preempted sequence is readmitted with).
    pub fn tokens(&self, seq: SeqId) -> Result<Vec<u32>, KvError> {
        let s = self.seq(seq)?;
        let mut out = Vec::with_capacity(s.len);
        for &b in &s.blocks {
            let want = (s.len - out.len()).min(self.block_size);
            out.extend_from_slice(&self.blocks[b.0 as usize].tokens[..want]);
        }
        Ok(out)
    }

    /// The slot of token `pos` of `seq`.
    pub fn slot(&self, seq: SeqId, pos: usize) -> Result<i32, KvError> {
        let s = self.seq(seq)?;
        match s.blocks.get(pos / self.block_size) {
            Some(b) if pos < s.len => Ok(self.slot_of(*b, pos)),
            _ => Err(KvError::BadConfig(format!(
                "{seq} has {} tokens; no slot for token {pos}",
                s.len
            ))),
        }
    }

    /// The inputs of paged_attention for `seqs`: block_table [B, max_blocks] (i32, padded with
    /// block 0, which the kernel never reads past a context) and context_lens [B].
    pub fn block_tables(
        &self,
        seqs: &[SeqId],
        max_blocks: usize,
    ) -> Result<(Vec<i32>, Vec<i32>), KvError> {
        let mut table = vec![0i32; seqs.len() * max_blocks];
        let mut lens = Vec::with_capacity(seqs.len());
        for (row, &id) in seqs.iter().enumerate() {
            let s = self.seq(id)?;
            if s.blocks.len() > max_blocks {
                return Err(KvError::TableTooNarrow {
                    seq: id,
                    blocks: s.blocks.len(),
                    max_blocks,
                });
            }
            for (i, b) in s.blocks.iter().enumerate() {
                table[row * max_blocks + i] = b.0 as i32;
            }
            lens.push(s.len as i32);
        }
        // The decode kernel's own check, here where the table is built (on a device the op
        // checks it only in debug mode).
        let dims = PagedDims {
            b: seqs.len(),
            h: 0,
            hkv: 0,
            d: 0,
            nb: self.blocks.len(),
            bs: self.block_size,
            mb: max_blocks,
        };
        check_block_table(&table, &lens, dims).map_err(|e| KvError::BadTable(e.to_string()))?;
        Ok((table, lens))
    }

    /// Admits `seq` with `tokens` (a new prompt, or a preempted sequence's tokens on readmit).
    /// Leading full blocks found in the prefix cache are shared, but never the block holding the
    /// last token: its KV (and the logits it yields) is always computed by this call's prefill.
    pub fn join(&mut self, seq: SeqId, tokens: &[u32]) -> Result<WritePlan, KvError> {
        self.join_with(seq, tokens, true, true)
    }

    /// [`BlockManager::join`] with options: `share_prefix` = false takes no block from the
    /// prefix cache (every token gets a fresh slot: for KV restored from host memory);
    /// `cacheable` = false keeps the blocks this sequence fills out of the prefix cache (for KV
    /// that a fresh prefill at the current weights would not reproduce).
    pub fn join_with(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        share_prefix: bool,
        cacheable: bool,
    ) -> Result<WritePlan, KvError> {
        if self.seqs.contains_key(&seq) {
            return Err(KvError::DuplicateSequence(seq));
        }
        if tokens.is_empty() {
            return Err(KvError::EmptyPrompt(seq));
        }
        let bs = self.block_size;
        let mut hits = Vec::new();
        let mut hashes = Vec::new();
        let mut parent = ROOT_HASH;
        for chunk in tokens[..tokens.len() - 1].chunks_exact(bs) {
            let h = hash_block(parent, chunk);
            match self.cache.get(&h) {
                Some(&b) if share_prefix && self.blocks[b.0 as usize].tokens == chunk => {
                    hits.push(b);
                    hashes.push(h);
                    parent = h;
                }
                _ => break,
            }
        }
        let hits_unheld = hits
            .iter()
            .filter(|b| self.blocks[b.0 as usize].refs == 0)
            .count();
        let needed = tokens.len().div_ceil(bs) - hits.len();
        let available = self.available_blocks() - hits_unheld;
        if needed > available {
            return Err(KvError::OutOfBlocks { needed, available });
        }
        for &b in &hits {
            let blk = &mut self.blocks[b.0 as usize];
            if blk.refs == 0 {
                self.evictable.remove(&blk.released_at);
            }
            blk.refs += 1;
        }
        let cached = hits.len() * bs;
        self.stats.prompt_tokens += tokens.len() as u64;
        self.stats.prefix_hit_tokens += cached as u64;
        let mut s = Seq {
            blocks: hits,
            hashes,
            len: cached,
            cacheable,
        };
        let slots = self.push_tokens(&mut s, &tokens[cached..]);
        self.seqs.insert(seq, s);
        Ok(WritePlan {
            cached_tokens: cached,
            copies: Vec::new(),
            slots,
        })
    }

    /// Appends `tokens` (generated tokens, or an observation turn) to `seq`. A shared partial
    /// last block is first copied (copy-on-write); new blocks are taken as the last one fills.
    pub fn append(&mut self, seq: SeqId, tokens: &[u32]) -> Result<WritePlan, KvError> {
        let bs = self.block_size;
        let s = self.seq(seq)?;
        let in_last = s.len % bs;
        let cow = in_last != 0
            && !tokens.is_empty()
            && s.blocks
                .last()
                .is_some_and(|b| self.blocks[b.0 as usize].refs > 1);
        let room = if in_last == 0 { 0 } else { bs - in_last };
        let needed = tokens.len().saturating_sub(room).div_ceil(bs) + cow as usize;
        let available = self.available_blocks();
        if needed > available {
            return Err(KvError::OutOfBlocks { needed, available });
        }
        let mut s = self
            .seqs
            .remove(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        let mut copies = Vec::new();
        if cow {
            let last = s.blocks.len() - 1;
            let src = s.blocks[last];
            let dst = self.take_block();
            let content = self.blocks[src.0 as usize].tokens[..in_last].to_vec();
            self.blocks[src.0 as usize].refs -= 1;
            let d = &mut self.blocks[dst.0 as usize];
            d.tokens = content;
            d.refs = 1;
            s.blocks[last] = dst;
            copies.push(CopyOp {
                src,
                dst,
                tokens: in_last,
            });
            self.stats.cow_copies += 1;
        }
        let slots = self.push_tokens(&mut s, tokens);
        self.seqs.insert(seq, s);
        Ok(WritePlan {
            cached_tokens: 0,
            copies,
            slots,
        })
    }

    /// Forks `parent` into `children` (a GRPO group): each child holds all the parent's blocks
    /// and tokens. Takes no blocks, so it cannot run out.
    pub fn fork(&mut self, parent: SeqId, children: &[SeqId]) -> Result<(), KvError> {
        let p = self.seq(parent)?.clone();
        for (i, &c) in children.iter().enumerate() {
            if self.seqs.contains_key(&c) || children[..i].contains(&c) {
                return Err(KvError::DuplicateSequence(c));
            }
        }
        for &b in &p.blocks {
            self.blocks[b.0 as usize].refs += children.len() as u32;
        }
        for &c in children {
            self.seqs.insert(c, p.clone());
        }
        Ok(())
    }

    /// Releases a finished sequence's blocks. Unheld full blocks stay cached (evictable);
    /// the others return to the free list.
    pub fn finish(&mut self, seq: SeqId) -> Result<(), KvError> {
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        // Tail first: a prefix's later blocks are released earlier, so they are evicted first
        // and the shared start of a prompt lives longest.
        for &b in s.blocks.iter().rev() {
            self.tick += 1;
            let blk = &mut self.blocks[b.0 as usize];
            blk.refs -= 1;
            if blk.refs > 0 {
                continue;
            }
            match blk.hash {
                Some(h) if self.cache.get(&h) == Some(&b) => {
                    blk.released_at = self.tick;
                    self.evictable.insert(self.tick, b);
                }
                _ => {
                    blk.hash = None;
                    blk.tokens.clear();
                    self.free.push_back(b);
                }
            }
        }
        Ok(())
    }

    /// Preempts `seq`: releases its blocks and returns its tokens, to be readmitted later with
    /// `join(seq, &tokens)` (its KV is recomputed, except prefix blocks still cached).
    pub fn preempt(&mut self, seq: SeqId) -> Result<Vec<u32>, KvError> {
        let tokens = self.tokens(seq)?;
        self.finish(seq)?;
        Ok(tokens)
    }

    /// Forgets the prefix cache (after a weight swap, cached KV belongs to the old weights):
    /// unheld cached blocks return to the free list, held blocks are released to the free list
    /// when their holders finish, and blocks that live sequences fill from now on are not
    /// cached (their KV mixes versions). Sequences joined later cache as usual.
    pub fn invalidate_prefix_cache(&mut self) {
        self.cache.clear();
        for (_, b) in std::mem::take(&mut self.evictable) {
            let blk = &mut self.blocks[b.0 as usize];
            blk.hash = None;
            blk.tokens.clear();
            self.free.push_back(b);
        }
        for s in self.seqs.values_mut() {
            s.cacheable = false;
        }
    }

    fn seq(&self, seq: SeqId) -> Result<&Seq, KvError> {
        self.seqs.get(&seq).ok_or(KvError::UnknownSequence(seq))
    }

    fn slot_of(&self, b: BlockId, pos: usize) -> i32 {
        (b.0 as usize * self.block_size + pos % self.block_size) as i32
    }

    /// A block with no holder and no content: from the free list, else the least recently
    /// released cached block. Callers check `available_blocks` first.
    fn take_block(&mut self) -> BlockId {
        if let Some(b) = self.free.pop_front() {
            return b;
        }
        let (_, b) = self
            .evictable
            .pop_first()
            .expect("caller checked available_blocks");
        let blk = &mut self.blocks[b.0 as usize];
        if let Some(h) = blk.hash.take() {
            if self.cache.get(&h) == Some(&b) {
                self.cache.remove(&h);
            }
        }
        blk.tokens.clear();
        self.stats.evictions += 1;
        b
    }

    /// Writes `tokens` at the end of `s` (capacity checked by the caller, last block not shared
    /// unless full), hashing and caching each block that fills. Returns their slots.
    fn push_tokens(&mut self, s: &mut Seq, tokens: &[u32]) -> Vec<i32> {
        let bs = self.block_size;
        let mut slots = Vec::with_capacity(tokens.len());
        for &t in tokens {
            if s.len.is_multiple_of(bs) {
                let b = self.take_block();
                self.blocks[b.0 as usize].refs = 1;
                s.blocks.push(b);
            }
            let b = s.blocks[s.len / bs];
            slots.push(self.slot_of(b, s.len));
            let blk = &mut self.blocks[b.0 as usize];
            blk.tokens.push(t);
            s.len += 1;
            if blk.tokens.len() == bs {
                let parent = s.hashes.last().copied().unwrap_or(ROOT_HASH);
                let h = hash_block(parent, &blk.tokens);
                blk.hash = Some(h);
                s.hashes.push(h);
                if s.cacheable {
                    self.cache.entry(h).or_insert(b);
                }
            }
        }
        slots
    }
}
