//! The paged KV cache (DESIGN.md 3.5): `kv_append` writes new K/V rows into cache slots and
//! `paged_attention` decodes one query per sequence over its block table.
//!
//! Cache layout: k_cache and v_cache are [NB, BS, Hkv, D] (NB blocks of BS token slots; any
//! BS >= 1, 16 by default in the engine); token slot s = block * BS + offset. Sequence b's key j
//! (j counted from 0) lives in slot block_table[b, j / BS] * BS + j % BS.
//!
//! The decode computes each query row with [`attend_row`], the routine of the training forward,
//! over the same 32-key chunks counted from the sequence start. A chunk may span several cache
//! blocks: every key is looked up on its own (lane j of the kernel's warp resolves key j's slot),
//! so chunks do not depend on block boundaries and any block size works. Hence a query's decode
//! output equals `attention_forward`'s output for the last row of its sequence (causal), bit for
//! bit on the same device, for F32 and for BF16 (the same dtype as the training inputs).

use crate::device::Backend;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::ops::attention::{attend_row, resolve_scale, scale_param, MAX_HEAD_DIM, SCALE_DEFAULT};
use crate::ops::attention_tile::{self, AttentionPath, PagedArgs, RowOrder};
use crate::ops::attention_wgmma;
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
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

/// CPU reference of the decode: out[B,H,D] (f32) for q[B,H,D] over the caches [NB,BS,Hkv,D].
/// Rows in parallel, each through [`attend_row`] (an empty context gives a zero row).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_reference(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    block_table: &[i32],
    context_lens: &[i32],
    dims: PagedDims,
    scale: f32,
    order: RowOrder,
    out: &mut [f32],
) -> Result<()> {
    let PagedDims {
        b,
        h,
        hkv,
        d,
        nb,
        bs,
        mb,
    } = dims;
    check_block_table(block_table, context_lens, dims)?;
    let cache = nb * bs * hkv * d;
    if q.len() != b * h * d
        || out.len() != b * h * d
        || k_cache.len() != cache
        || v_cache.len() != cache
    {
        return Err(Error::Invalid(format!(
            "paged attention buffers: q {}, out {} (expected {}), caches {} and {} (expected {cache})",
            q.len(),
            out.len(),
            b * h * d,
            k_cache.len(),
            v_cache.len()
        )));
    }
    if hkv == 0 || !h.is_multiple_of(hkv) || d == 0 {
        return Err(Error::Invalid(format!(
            "{h} query heads, {hkv} kv heads, head dim {d}: Hkv must divide H and D be >= 1"
        )));
    }
    let group = h / hkv;
    let longest = context_lens
        .iter()
        .map(|&c| c.max(0) as usize)
        .max()
        .unwrap_or(0);
    #[cfg(feature = "planted-faults")]
    let scale = crate::planted::decode_scale(scale);
    par::rows_mut(out, d, 4 * d * longest.max(1), |r, o| {
        let (s, head) = (r / h, r % h);
        let g = head / group;
        let table = &block_table[s * mb..(s + 1) * mb];
        attend_row(
            order,
            &q[r * d..(r + 1) * d],
            context_lens[s] as usize,
            scale,
            |j| {
                let slot = slot_of(table, j, bs);
                let row = (slot * hkv + g) * d;
                (&k_cache[row..row + d], &v_cache[row..row + d])
            },
            o,
        );
    });
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

/// Checks slot_mapping: each slot is < 0 (padding: skipped) or a slot of the cache (< n_slots),
/// and no slot appears twice (two writers of one row would make the result depend on timing).
pub fn check_slots(slot_mapping: &[i32], n_slots: usize) -> Result<()> {
    let mut seen: Vec<i32> = slot_mapping.iter().copied().filter(|&s| s >= 0).collect();
    if let Some((t, &s)) = slot_mapping
        .iter()
        .enumerate()
        .find(|(_, &s)| s >= 0 && s as usize >= n_slots)
    {
        return Err(Error::Invalid(format!(
            "`slot_mapping`[{t}] = {s} is past the cache's {n_slots} slots (NB * BS)"
        )));
    }
    seen.sort_unstable();
    if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::Invalid(format!(
            "`slot_mapping` names slot {} twice",
            w[0]
        )));
    }
    Ok(())
}

/// CPU reference of kv_append: copies row t of k_new/v_new [T,Hkv,D] into slot slot_mapping[t]
/// of the caches [NB,BS,Hkv,D] (rows of width Hkv*D); negative slots are skipped.
pub fn kv_append_reference<E: Copy>(
    k_new: &[E],
    v_new: &[E],
    slot_mapping: &[i32],
    row: usize,
    k_cache: &mut [E],
    v_cache: &mut [E],
) -> Result<()> {
    if row == 0
        || k_new.len() != slot_mapping.len() * row
        || v_new.len() != k_new.len()
        || k_cache.len() != v_cache.len()
        || !k_cache.len().is_multiple_of(row)
    {
        return Err(Error::Invalid(format!(
            "kv_append buffers: k_new {}, v_new {}, {} slots of {row} values, caches {} and {}",
            k_new.len(),
            v_new.len(),
            slot_mapping.len(),
            k_cache.len(),
            v_cache.len()
        )));
    }
    check_slots(slot_mapping, k_cache.len() / row)?;
    for (t, &s) in slot_mapping.iter().enumerate() {
        if s >= 0 {
            let dst = s as usize * row;
            k_cache[dst..dst + row].copy_from_slice(&k_new[t * row..(t + 1) * row]);
            v_cache[dst..dst + row].copy_from_slice(&v_new[t * row..(t + 1) * row]);
        }
    }
    Ok(())
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

fn cpu_append<E: Element>(
    k_new: &Tensor,
    v_new: &Tensor,
    slots: &[i32],
    row: usize,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
) -> Result<()> {
    // In place: the reference checks every length and slot before it writes anything, so an
    // error leaves the caches untouched.
    kv_append_reference(
        k_new.host_slice::<E>()?,
        v_new.host_slice::<E>()?,
        slots,
        row,
        k_cache.host_slice_mut::<E>()?,
        v_cache.host_slice_mut::<E>()?,
    )
}

/// Writes k_new/v_new [T,Hkv,D] into the caches [NB,BS,Hkv,D] at slot_mapping[T] (I32, slot =
/// block * BS + offset; negative = padding, skipped). The new rows have the caches' dtype.
/// The slots are checked (in range, distinct) on the host; on cuda that downloads T ints.
pub fn kv_append(
    backend: &Backend,
    k_new: &Tensor,
    v_new: &Tensor,
    slot_mapping: &Tensor,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
) -> Result<()> {
    let [nb, bs, hkv, d] = check_cache("k_cache", k_cache)?;
    if v_cache.shape() != k_cache.shape() {
        return Err(Error::shape(
            "v_cache",
            format!(
                "[NB,BS,Hkv,D] = {:?} (the shape of k_cache)",
                k_cache.shape()
            ),
            v_cache.shape(),
        ));
    }
    v_cache.expect_dtype("v_cache", k_cache.dtype())?;
    k_new.expect_rank("k_new", 3, "[T,Hkv,D]")?;
    let t = k_new.shape()[0];
    if k_new.shape()[1..] != [hkv, d] {
        return Err(Error::shape(
            "k_new",
            format!("[T,Hkv,D] = [T,{hkv},{d}] (Hkv, D of the cache)"),
            k_new.shape(),
        ));
    }
    if v_new.shape() != k_new.shape() {
        return Err(Error::shape(
            "v_new",
            format!("[T,Hkv,D] = {:?} (the shape of k_new)", k_new.shape()),
            v_new.shape(),
        ));
    }
    k_new.expect_dtype("k_new", k_cache.dtype())?;
    v_new.expect_dtype("v_new", k_cache.dtype())?;
    if slot_mapping.shape() != [t] {
        return Err(Error::shape(
            "slot_mapping",
            format!("[T] = [{t}]"),
            slot_mapping.shape(),
        ));
    }
    slot_mapping.expect_dtype("slot_mapping", DType::I32)?;
    let n_slots = nb * bs;
    // On a device only in debug mode (a copy and a sync): the block manager hands out distinct
    // slots inside the cache (runtime kv_blocks.rs checks its tables where it builds them).
    let slots = if crate::debug::reads_back(slot_mapping) {
        let slots = slot_mapping.to_vec::<i32>()?;
        check_slots(&slots, n_slots)?;
        slots
    } else {
        Vec::new()
    };
    if t == 0 {
        return Ok(());
    }
    let bf = k_cache.dtype() == DType::BF16;
    match backend {
        Backend::Cpu => {
            if bf {
                cpu_append::<bf16>(k_new, v_new, &slots, hkv * d, k_cache, v_cache)
            } else {
                cpu_append::<f32>(k_new, v_new, &slots, hkv * d, k_cache, v_cache)
            }
        }
        _ => {
            // Each (token, kv head) row is written by one warp, slots checked distinct and in
            // range above, so no two warps write the same bytes.
            backend.launch(
                &Launch::new(
                    if bf {
                        "paged_attention_kv_append_bf16"
                    } else {
                        "paged_attention_kv_append_f32"
                    },
                    [blocks_for(t, 4), hkv as u32, 1],
                    [128, 1, 1],
                )
                .arg_tensor(k_new)
                .arg_tensor(v_new)
                .arg_tensor(slot_mapping)
                .arg_i32(t as i32)
                .arg_i32(hkv as i32)
                .arg_i32(d as i32)
                .arg_i64(n_slots as i64)
                .arg_tensor(k_cache)
                .arg_tensor(v_cache),
            )
        }
    }
}

/// Checks the decode's inputs; returns the sizes.
pub fn validate_inputs(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    context_lens: &Tensor,
) -> Result<PagedDims> {
    validate_inputs_on(q, k_cache, v_cache, block_table, context_lens)
}

/// The decode's checks for a query tensor of shape [B,H,D] (`q` may be a host-side probe with
/// that shape and the query's dtype).
fn validate_inputs_on(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    context_lens: &Tensor,
) -> Result<PagedDims> {
    q.expect_rank("q", 3, "[B,H,D]")?;
    let (b, h, d) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let [nb, bs, hkv, cd] = check_cache("k_cache", k_cache)?;
    if cd != d {
        return Err(Error::shape(
            "k_cache",
            format!("[NB,BS,Hkv,D] = [NB,BS,Hkv,{d}] (D of q)"),
            k_cache.shape(),
        ));
    }
    if v_cache.shape() != k_cache.shape() {
        return Err(Error::shape(
            "v_cache",
            format!(
                "[NB,BS,Hkv,D] = {:?} (the shape of k_cache)",
                k_cache.shape()
            ),
            v_cache.shape(),
        ));
    }
    if !q.dtype().is_float() {
        return Err(Error::DType {
            tensor: "q".into(),
            expected: "F32 or BF16".into(),
            got: q.dtype().to_string(),
        });
    }
    k_cache.expect_dtype("k_cache", q.dtype())?;
    v_cache.expect_dtype("v_cache", q.dtype())?;
    if h == 0 || !h.is_multiple_of(hkv) {
        return Err(Error::shape(
            "k_cache",
            format!("[NB,BS,Hkv,D] with Hkv dividing H = {h} (GQA)"),
            k_cache.shape(),
        ));
    }
    if d == 0 || d > MAX_HEAD_DIM {
        return Err(Error::shape(
            "q",
            format!("[B,H,D] with D in 1..={MAX_HEAD_DIM}"),
            q.shape(),
        ));
    }
    block_table.expect_rank("block_table", 2, "[B,MB]")?;
    if block_table.shape()[0] != b || block_table.shape()[1] == 0 {
        return Err(Error::shape(
            "block_table",
            format!("[B,MB] = [{b},MB] with MB >= 1 (B of q)"),
            block_table.shape(),
        ));
    }
    block_table.expect_dtype("block_table", DType::I32)?;
    if context_lens.shape() != [b] {
        return Err(Error::shape(
            "context_lens",
            format!("[B] = [{b}]"),
            context_lens.shape(),
        ));
    }
    context_lens.expect_dtype("context_lens", DType::I32)?;
    let dims = PagedDims {
        b,
        h,
        hkv,
        d,
        nb,
        bs,
        mb: block_table.shape()[1],
    };
    if nb.saturating_mul(bs).saturating_mul(hkv).saturating_mul(d) > i64::MAX as usize / 4
        || dims.mb * bs > i32::MAX as usize
    {
        return Err(Error::shape(
            "k_cache",
            "[NB,BS,Hkv,D] of fewer than 2^61 elements, MB * BS < 2^31",
            k_cache.shape(),
        ));
    }
    // On a device only in debug mode (a copy and a sync); the runtime's block manager checks
    // the tables where it builds them (kv_blocks.rs, the same named errors).
    if crate::debug::reads_back(block_table) || crate::debug::reads_back(context_lens) {
        check_block_table(
            &block_table.to_vec::<i32>()?,
            &context_lens.to_vec::<i32>()?,
            dims,
        )?;
    }
    Ok(dims)
}

/// Decode attention on `backend`: out[B,H,D] (F32) for q[B,H,D] over the paged caches.
/// `scale` defaults to 1/sqrt(D). The block table and context lengths are checked on the host
/// where they live there, and on a device in debug mode (a download of B*(MB+1) ints).
pub fn paged_attention(
    backend: &Backend,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    context_lens: &Tensor,
    scale: Option<f32>,
) -> Result<Tensor> {
    paged_attention_on(
        attention_tile::attention_path()?,
        backend,
        q,
        k_cache,
        v_cache,
        block_table,
        context_lens,
        scale,
    )
}

/// [`paged_attention`] on an explicit attention path (v1 or v2) instead of the process's.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_on(
    path: AttentionPath,
    backend: &Backend,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    context_lens: &Tensor,
    scale: Option<f32>,
) -> Result<Tensor> {
    let dims = validate_inputs(q, k_cache, v_cache, block_table, context_lens)?;
    let PagedDims {
        b,
        h,
        hkv,
        d,
        bs,
        mb,
        ..
    } = dims;
    let scale = resolve_scale(scale, d)?;
    let order = RowOrder::of(path, q.dtype(), d);
    match backend {
        Backend::Cpu => {
            let mut out = vec![0.0f32; b * h * d];
            let table = block_table.to_vec::<i32>()?;
            let ctx = context_lens.to_vec::<i32>()?;
            let c = HostCaches::new(k_cache, v_cache, &table, &ctx, dims)?;
            paged_attention_reference(
                &q.f32_data()?,
                &c.k,
                &c.v,
                &c.table,
                &ctx,
                c.dims,
                scale,
                order,
                &mut out,
            )?;
            Tensor::from_slice(backend, &[b, h, d], &out)
        }
        _ => {
            let out = Tensor::poisoned(backend, &[b, h, d], DType::F32)?;
            if b > 0 && order != RowOrder::Chunks {
                if b > i32::MAX as usize || hkv > 65535 {
                    return Err(Error::shape(
                        "q",
                        "[B,H,D] with B < 2^31, Hkv <= 65535",
                        q.shape(),
                    ));
                }
                // One warp per (sequence, kv head, 16 query heads) writes its rows once; every
                // cache slot it reads was checked against the cache's size above.
                let c = PagedArgs {
                    k_cache,
                    v_cache,
                    block_table,
                    context_lens,
                    hkv,
                    bs,
                    mb,
                };
                if order == RowOrder::Wgmma {
                    // v3: one block per (sequence, kv head, 64 query heads).
                    attention_wgmma::launch_decode(backend, q, &c, (b, h, d), scale, &out)?;
                } else {
                    attention_tile::launch_decode(backend, q, &c, (b, h, d), scale, &out)?;
                }
            } else if b > 0 {
                let name = if q.dtype() == DType::BF16 {
                    "paged_attention_decode_bf16"
                } else {
                    "paged_attention_decode_f32"
                };
                if b > i32::MAX as usize || h > 65535 {
                    return Err(Error::shape("q", "[B,H,D] with H <= 65535", q.shape()));
                }
                // One warp per (sequence, head) writes its out row once; every cache slot it
                // reads was checked against the cache's size above.
                backend.launch(
                    &Launch::new(name, [b as u32, h as u32, 1], [32, 1, 1])
                        .arg_tensor(q)
                        .arg_tensor(k_cache)
                        .arg_tensor(v_cache)
                        .arg_tensor(block_table)
                        .arg_tensor(context_lens)
                        .arg_i32(h as i32)
                        .arg_i32(hkv as i32)
                        .arg_i32(d as i32)
                        .arg_i32(bs as i32)
                        .arg_i32(mb as i32)
                        .arg_f32(scale)
                        .arg_tensor(&out),
                )?;
            }
            Ok(out)
        }
    }
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

/// Checks the prefill's per-sequence sizes: each sequence's new tokens fit in its context
/// (cu_seqlens[b+1] - cu_seqlens[b] <= context_lens[b]).
fn check_prefill_lens(cu: &[i32], context_lens: &[i32]) -> Result<()> {
    for (b, w) in cu.windows(2).enumerate() {
        let n = w[1] - w[0];
        if n > context_lens[b] {
            return Err(Error::Invalid(format!(
                "`context_lens`[{b}] = {} is smaller than sequence {b}'s {n} new tokens (cu_seqlens); the cache must already hold them (kv_append first)",
                context_lens[b]
            )));
        }
    }
    Ok(())
}

/// CPU reference of the chunked prefill: out[T,H,D] for the new queries q[T,H,D] of B sequences
/// (cu_seqlens[B+1] over T) over the caches; sequence b's cache holds context_lens[b] keys, the
/// last n_b of them the new tokens', so new token i sees keys 0 ..= context_lens[b] - n_b + i.
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill_reference(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    block_table: &[i32],
    cu_seqlens: &[i32],
    context_lens: &[i32],
    dims: PagedDims,
    scale: f32,
    order: RowOrder,
    out: &mut [f32],
) -> Result<()> {
    let PagedDims {
        b,
        h,
        hkv,
        d,
        nb,
        bs,
        mb,
    } = dims;
    check_block_table(block_table, context_lens, dims)?;
    if cu_seqlens.len() != b + 1 {
        return Err(Error::Invalid(format!(
            "`cu_seqlens` has {} entries; expected [B+1] = {}",
            cu_seqlens.len(),
            b + 1
        )));
    }
    let t = q.len() / (h * d).max(1);
    crate::ops::attention::check_cu_seqlens(cu_seqlens, t)?;
    check_prefill_lens(cu_seqlens, context_lens)?;
    let cache = nb * bs * hkv * d;
    if q.len() != t * h * d
        || out.len() != q.len()
        || k_cache.len() != cache
        || v_cache.len() != cache
        || hkv == 0
        || !h.is_multiple_of(hkv)
    {
        return Err(Error::Invalid(format!(
            "paged prefill buffers: q {}, out {}, caches {} and {} (expected {cache}), H {h}, Hkv {hkv}",
            q.len(), out.len(), k_cache.len(), v_cache.len()
        )));
    }
    let group = h / hkv;
    let longest = context_lens
        .iter()
        .map(|&c| c.max(0) as usize)
        .max()
        .unwrap_or(0);
    par::rows_mut(out, d, 4 * d * longest.max(1), |r, o| {
        let (tok, head) = (r / h, r % h);
        let g = head / group;
        let s = cu_seqlens.partition_point(|&c| c as usize <= tok) - 1;
        let n_new = (cu_seqlens[s + 1] - cu_seqlens[s]) as usize;
        let n_keys = context_lens[s] as usize - n_new + (tok - cu_seqlens[s] as usize) + 1;
        let table = &block_table[s * mb..(s + 1) * mb];
        #[cfg(feature = "planted-faults")]
        let scale = crate::planted::prefill_scale(scale, context_lens[s] as usize - n_new);
        attend_row(
            order,
            &q[r * d..(r + 1) * d],
            n_keys,
            scale,
            |j| {
                let slot = slot_of(table, j, bs);
                let row = (slot * hkv + g) * d;
                (&k_cache[row..row + d], &v_cache[row..row + d])
            },
            o,
        );
    });
    Ok(())
}

/// Chunked prefill on `backend`: out[T,H,D] (F32) for q[T,H,D], the new tokens of B sequences
/// (cu_seqlens[B+1] I32), over the paged caches, which already hold those tokens' K/V
/// (kv_append first): sequence b's cache holds context_lens[b] keys. Each row equals
/// `attention_forward`'s row for that token over the whole sequence, bit for bit (the same
/// chunk routine). `scale` defaults to 1/sqrt(D).
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill(
    backend: &Backend,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    cu_seqlens: &Tensor,
    context_lens: &Tensor,
    scale: Option<f32>,
) -> Result<Tensor> {
    paged_prefill_on(
        attention_tile::attention_path()?,
        backend,
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens,
        context_lens,
        scale,
    )
}

/// [`paged_prefill`] on an explicit attention path (v1 or v2) instead of the process's.
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill_on(
    path: AttentionPath,
    backend: &Backend,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    cu_seqlens: &Tensor,
    context_lens: &Tensor,
    scale: Option<f32>,
) -> Result<Tensor> {
    q.expect_rank("q", 3, "[T,H,D]")?;
    cu_seqlens.expect_rank("cu_seqlens", 1, "[B+1]")?;
    cu_seqlens.expect_dtype("cu_seqlens", DType::I32)?;
    let b = cu_seqlens.numel().saturating_sub(1);
    // The index inputs on the host: always on `cpu`, on a device only in debug mode (the
    // engine builds them from the block manager's checked tables).
    let host = crate::debug::reads_back(cu_seqlens) || crate::debug::reads_back(context_lens);
    let cu = if host {
        let cu = cu_seqlens.to_vec::<i32>()?;
        crate::ops::attention::check_cu_seqlens(&cu, q.shape()[0])?;
        cu
    } else {
        Vec::new()
    };
    // The decode's checks with B sequences (a [B,H,D] view of the shapes): caches, block table,
    // context lengths.
    let (t, h, d) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    if t > i32::MAX as usize / 2 {
        return Err(Error::shape("q", "[T,H,D] with T < 2^30", q.shape()));
    }
    let probe = Tensor::zeros(&Backend::Cpu, &[b, h, d], q.dtype())?;
    let dims = validate_inputs_on(&probe, k_cache, v_cache, block_table, context_lens)?;
    let ctx = if host {
        let ctx = context_lens.to_vec::<i32>()?;
        check_prefill_lens(&cu, &ctx)?;
        ctx
    } else {
        Vec::new()
    };
    let scale = resolve_scale(scale, d)?;
    let PagedDims { hkv, bs, mb, .. } = dims;
    let order = RowOrder::of(path, q.dtype(), d);
    match backend {
        Backend::Cpu => {
            let mut out = vec![0.0f32; t * h * d];
            let table = block_table.to_vec::<i32>()?;
            let c = HostCaches::new(k_cache, v_cache, &table, &ctx, dims)?;
            paged_prefill_reference(
                &q.f32_data()?,
                &c.k,
                &c.v,
                &c.table,
                &cu,
                &ctx,
                c.dims,
                scale,
                order,
                &mut out,
            )?;
            Tensor::from_slice(backend, &[t, h, d], &out)
        }
        _ => {
            let out = Tensor::poisoned(backend, &[t, h, d], DType::F32)?;
            if t > 0 && order != RowOrder::Chunks {
                // One block per (128-position tile of a sequence, head) writes its new tokens'
                // rows once; every slot it reads is below context_lens[b] (checked above).
                let c = PagedArgs {
                    k_cache,
                    v_cache,
                    block_table,
                    context_lens,
                    hkv,
                    bs,
                    mb,
                };
                if order == RowOrder::Wgmma {
                    attention_wgmma::launch_prefill(
                        backend,
                        q,
                        &c,
                        cu_seqlens,
                        (t, h, d),
                        scale,
                        &out,
                    )?;
                } else {
                    attention_tile::launch_prefill(
                        backend,
                        q,
                        &c,
                        cu_seqlens,
                        (t, h, d),
                        scale,
                        &out,
                    )?;
                }
            } else if t > 0 {
                let name = if q.dtype() == DType::BF16 {
                    "paged_attention_prefill_bf16"
                } else {
                    "paged_attention_prefill_f32"
                };
                // One warp per (token, head) writes its row once; every slot it reads was checked
                // against the cache above (positions < context_lens[b] <= MB * BS).
                backend.launch(
                    &Launch::new(name, [blocks_for(t, 4), h as u32, 1], [128, 1, 1])
                        .arg_tensor(q)
                        .arg_tensor(k_cache)
                        .arg_tensor(v_cache)
                        .arg_tensor(block_table)
                        .arg_tensor(cu_seqlens)
                        .arg_tensor(context_lens)
                        .arg_i32(b as i32)
                        .arg_i32(t as i32)
                        .arg_i32(h as i32)
                        .arg_i32(hkv as i32)
                        .arg_i32(d as i32)
                        .arg_i32(bs as i32)
                        .arg_i32(mb as i32)
                        .arg_f32(scale)
                        .arg_tensor(&out),
                )?;
            }
            Ok(out)
        }
    }
}

fn run_paged(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let out = paged_attention(
        backend,
        call.tensor("q")?,
        call.tensor("k_cache")?,
        call.tensor("v_cache")?,
        call.tensor("block_table")?,
        call.tensor("context_lens")?,
        scale_param(call)?,
    )?;
    Ok(vec![("out", out)])
}

/// `sluice kernel paged_attention`.
pub static SPEC: OpSpec = OpSpec {
    name: "paged_attention",
    summary: "decode attention, one query per sequence over its paged KV cache; the training forward's 32-key tiles counted from the sequence start (BF16: the same tensor-core tile routine), so bit-identical to it (out F32)",
    inputs: &[
        TensorSpec { name: "q", shape: "[B,H,D]", dtypes: "F32|BF16" },
        TensorSpec { name: "k_cache", shape: "[NB,BS,Hkv,D]", dtypes: "F32|BF16 (the dtype of q)" },
        TensorSpec { name: "v_cache", shape: "[NB,BS,Hkv,D]", dtypes: "F32|BF16 (the dtype of q)" },
        TensorSpec { name: "block_table", shape: "[B,MB]", dtypes: "I32" },
        TensorSpec { name: "context_lens", shape: "[B]", dtypes: "I32" },
    ],
    params: &[ParamSpec { name: "scale", default: Some(SCALE_DEFAULT), help: "softmax scale applied to q.k" }],
    outputs: &[TensorSpec { name: "out", shape: "[B,H,D]", dtypes: "F32" }],
    run: run_paged,
};

fn run_kv_append(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    // The caches are inputs and outputs: the run updates copies of them and returns those.
    let mut k_cache = call.tensor("k_cache")?.to_backend(backend)?;
    let mut v_cache = call.tensor("v_cache")?.to_backend(backend)?;
    kv_append(
        backend,
        call.tensor("k_new")?,
        call.tensor("v_new")?,
        call.tensor("slot_mapping")?,
        &mut k_cache,
        &mut v_cache,
    )?;
    Ok(vec![("k_cache", k_cache), ("v_cache", v_cache)])
}

/// `sluice kernel kv_append`.
pub static KV_APPEND_SPEC: OpSpec = OpSpec {
    name: "kv_append",
    summary: "writes row t of k_new/v_new into cache slot slot_mapping[t] (block * BS + offset; < 0: padding, skipped; slots distinct); returns the updated caches",
    inputs: &[
        TensorSpec { name: "k_new", shape: "[T,Hkv,D]", dtypes: "F32|BF16 (the dtype of k_cache)" },
        TensorSpec { name: "v_new", shape: "[T,Hkv,D]", dtypes: "F32|BF16 (the dtype of k_cache)" },
        TensorSpec { name: "slot_mapping", shape: "[T]", dtypes: "I32" },
        TensorSpec { name: "k_cache", shape: "[NB,BS,Hkv,D]", dtypes: "F32|BF16" },
        TensorSpec { name: "v_cache", shape: "[NB,BS,Hkv,D]", dtypes: "F32|BF16 (the dtype of k_cache)" },
    ],
    params: &[],
    outputs: &[
        TensorSpec { name: "k_cache", shape: "[NB,BS,Hkv,D]", dtypes: "F32|BF16 (the caches' dtype)" },
        TensorSpec { name: "v_cache", shape: "[NB,BS,Hkv,D]", dtypes: "F32|BF16 (the caches' dtype)" },
    ],
    run: run_kv_append,
};

fn run_paged_prefill(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let out = paged_prefill(
        backend,
        call.tensor("q")?,
        call.tensor("k_cache")?,
        call.tensor("v_cache")?,
        call.tensor("block_table")?,
        call.tensor("cu_seqlens")?,
        call.tensor("context_lens")?,
        scale_param(call)?,
    )?;
    Ok(vec![("out", out)])
}

/// `sluice kernel paged_prefill`.
pub static PREFILL_SPEC: OpSpec = OpSpec {
    name: "paged_prefill",
    summary: "chunked prefill: the new tokens q[T,H,D] of B sequences (cu_seqlens) over paged caches that already hold them (kv_append first; sequence b holds context_lens[b] keys, its new tokens last), causal; bit-identical to attention_forward's rows (out F32)",
    inputs: &[
        TensorSpec { name: "q", shape: "[T,H,D]", dtypes: "F32|BF16" },
        TensorSpec { name: "k_cache", shape: "[NB,BS,Hkv,D]", dtypes: "F32|BF16 (the dtype of q)" },
        TensorSpec { name: "v_cache", shape: "[NB,BS,Hkv,D]", dtypes: "F32|BF16 (the dtype of q)" },
        TensorSpec { name: "block_table", shape: "[B,MB]", dtypes: "I32" },
        TensorSpec { name: "cu_seqlens", shape: "[B+1]", dtypes: "I32" },
        TensorSpec { name: "context_lens", shape: "[B]", dtypes: "I32" },
    ],
    params: &[ParamSpec { name: "scale", default: Some(SCALE_DEFAULT), help: "softmax scale applied to q.k" }],
    outputs: &[TensorSpec { name: "out", shape: "[T,H,D]", dtypes: "F32" }],
    run: run_paged_prefill,
};
