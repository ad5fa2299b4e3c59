//! paged_attention: one query per sequence over its block table (the decode), its CPU reference
//! and its input checks.

use super::{check_block_table, check_cache, slot_of, HostCaches, PagedDims};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::ops::attention::{attend_row, resolve_scale, MAX_HEAD_DIM};
use crate::ops::attention_tile::{self, AttentionPath, PagedArgs, RowOrder};
use crate::ops::attention_wgmma;
use crate::par;
use crate::tensor::Tensor;

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
pub(super) fn validate_inputs_on(
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
