//! paged_prefill: the chunked prefill of new tokens over the paged cache, each row equal to the
//! training forward's row for that token.

use super::decode::validate_inputs_on;
use super::{check_block_table, slot_of, HostCaches, PagedDims};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::ops::attention::{attend_row, resolve_scale};
use crate::ops::attention_tile::{self, AttentionPath, PagedArgs, RowOrder};
use crate::ops::attention_wgmma;
use crate::par;
use crate::tensor::Tensor;

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
