//! The paged KV cache (DESIGN.md 3.5): `kv_append` writes new K/V rows into cache slots and
//! `paged_attention` decodes one query per sequence over its block table.
//!
//! Cache layout: k_cache and v_cache are [NB, BS, Hkv, D] (NB blocks of BS token slots; any
//! BS >= 1, 16 by default in the engine); token slot s = block * BS + offset. Sequence b's key j
//! (j counted from 0) lives in slot block_table[b, j / BS] * BS + j % BS.
//!
//! The decode computes each query row with [`crate::ops::attention::attend_row`], the routine of the training forward,
//! over the same 32-key chunks counted from the sequence start. A chunk may span several cache
//! blocks: every key is looked up on its own (lane j of the kernel's warp resolves key j's slot),
//! so chunks do not depend on block boundaries and any block size works. Hence a query's decode
//! output equals `attention_forward`'s output for the last row of its sequence (causal), bit for
//! bit on the same device, for F32 and for BF16 (the same dtype as the training inputs).
//!
//! One job per file: this file holds the cache layout (sizes, the block-table check, a key's
//! slot, the host view of the caches); `append` writes the cache (kv_append), `decode` is the
//! one-query decode (paged_attention), `prefill` the chunked prefill (paged_prefill), `runner`
//! their `sluice kernel` rows.

mod append;
mod decode;
mod prefill;
mod runner;

pub use append::{check_slots, kv_append, kv_append_reference};
pub use decode::{paged_attention, paged_attention_on, paged_attention_reference, validate_inputs};
pub use prefill::{paged_prefill, paged_prefill_on, paged_prefill_reference};
pub use runner::{KV_APPEND_SPEC, PREFILL_SPEC, SPEC};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use half::bf16;

/// The block size of the engine's cache unless configured otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// The sizes of one paged-attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedDims {
    /// Sequences (one query each).
    pub b: usize,
    /// Query heads.
    pub h: usize,
    /// Key/value heads.
    pub hkv: usize,
    /// Head dimension.
    pub d: usize,
    /// Cache blocks.
    pub nb: usize,
    /// Slots per block.
    pub bs: usize,
    /// Block-table entries per sequence.
    pub mb: usize,
}

/// Checks the block table and context lengths: every context fits its table row
/// (context_lens[b] <= MB * BS) and every block a context uses is in 0..NB.
pub fn check_block_table(block_table: &[i32], context_lens: &[i32], dims: PagedDims) -> Result<()> {
    let PagedDims { b, nb, bs, mb, .. } = dims;
    if block_table.len() != b * mb || context_lens.len() != b {
        return Err(Error::Invalid(format!(
            "`block_table` has {} entries and `context_lens` {}; expected [B,MB] = {} and [B] = {b}",
            block_table.len(),
            context_lens.len(),
            b * mb
        )));
    }
    for (s, &len) in context_lens.iter().enumerate() {
        if len < 0 || len as usize > mb * bs {
            return Err(Error::Invalid(format!(
                "`context_lens`[{s}] = {len} is not in 0..={} (MB * BS = {mb} * {bs})",
                mb * bs
            )));
        }
        for i in 0..(len as usize).div_ceil(bs) {
            let blk = block_table[s * mb + i];
            if blk < 0 || blk as usize >= nb {
                return Err(Error::Invalid(format!(
                    "`block_table`[{s},{i}] = {blk} is not a block of the cache (0..{nb}); sequence {s} uses it for keys {}..",
                    i * bs
                )));
            }
        }
    }
    Ok(())
}

/// The cache slot of a sequence's key `j` through its block-table row: block `j / bs`, offset
/// `j % bs`, with shifts when the block size is a power of two (the usual 16): this runs once
/// per key of every attended row, and an integer division there was a visible part of a decode
/// step.
#[inline(always)]
fn slot_of(table: &[i32], j: usize, bs: usize) -> usize {
    if bs.is_power_of_two() {
        let shift = bs.trailing_zeros();
        ((table[j >> shift] as usize) << shift) | (j & (bs - 1))
    } else {
        table[j / bs] as usize * bs + j % bs
    }
}

fn check_cache(name: &str, cache: &Tensor) -> Result<[usize; 4]> {
    cache.expect_rank(name, 4, "[NB,BS,Hkv,D]")?;
    if !cache.dtype().is_float() {
        return Err(Error::DType {
            tensor: name.into(),
            expected: "F32 or BF16".into(),
            got: cache.dtype().to_string(),
        });
    }
    let s = cache.shape();
    if s.contains(&0) {
        return Err(Error::shape(name, "[NB,BS,Hkv,D] with every size >= 1", s));
    }
    Ok([s[0], s[1], s[2], s[3]])
}

/// The caches as the CPU references read them (f32): F32 caches as they are (no copy); BF16
/// caches as only the blocks the call reads, widened exactly, with the block table renumbered
/// into them (widening the whole pool on every call would cost a pass over it per step). The
/// values each query attends to, and their order, are unchanged, so the bits are too.
struct HostCaches<'a> {
    k: std::borrow::Cow<'a, [f32]>,
    v: std::borrow::Cow<'a, [f32]>,
    table: std::borrow::Cow<'a, [i32]>,
    dims: PagedDims,
}

impl<'a> HostCaches<'a> {
    fn new(
        k_cache: &'a Tensor,
        v_cache: &'a Tensor,
        table: &'a [i32],
        context_lens: &[i32],
        dims: PagedDims,
    ) -> Result<HostCaches<'a>> {
        use std::borrow::Cow;
        if k_cache.dtype() != DType::BF16 {
            return Ok(HostCaches {
                k: k_cache.f32_data()?,
                v: v_cache.f32_data()?,
                table: Cow::Borrowed(table),
                dims,
            });
        }
        // Every block a context uses must exist before it is read here.
        check_block_table(table, context_lens, dims)?;
        let PagedDims { bs, hkv, d, mb, .. } = dims;
        let block = bs * hkv * d;
        let (k_all, v_all) = (k_cache.host_slice::<bf16>()?, v_cache.host_slice::<bf16>()?);
        let mut index: std::collections::BTreeMap<i32, i32> = Default::default();
        let mut renumbered = vec![0i32; table.len()];
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (s, &len) in context_lens.iter().enumerate() {
            for i in 0..(len.max(0) as usize).div_ceil(bs) {
                let old = table[s * mb + i];
                let new = *index.entry(old).or_insert_with(|| {
                    let o = old as usize * block;
                    k.extend(k_all[o..o + block].iter().map(|x| x.to_f32()));
                    v.extend(v_all[o..o + block].iter().map(|x| x.to_f32()));
                    (k.len() / block - 1) as i32
                });
                renumbered[s * mb + i] = new;
            }
        }
        let nb = index.len().max(1);
        k.resize(nb * block, 0.0);
        v.resize(nb * block, 0.0);
        Ok(HostCaches {
            k: Cow::Owned(k),
            v: Cow::Owned(v),
            table: Cow::Owned(renumbered),
            dims: PagedDims { nb, ..dims },
        })
    }
}
