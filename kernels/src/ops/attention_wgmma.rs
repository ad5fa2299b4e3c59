//! Attention v3: FlashAttention-3-style kernels on sm_90a (wgmma, tensor copies, a
//! warp-specialised producer and consumer warpgroups): the training forward
//! (kernels/cuda/attention_wgmma.cu), the paged decode and prefill
//! (kernels/cuda/paged_attention_wgmma.cu), all on the tile routine of
//! kernels/cuda/common/attention_wgmma.cuh. Chosen with `SLUICE_ATTENTION=wgmma` (or `v3`),
//! which switches the three together ([`crate::ops::attention_tile::AttentionPath`]), and the
//! training backward (kernels/cuda/attention_wgmma_bwd.cu: v2's two passes on wgmma, with v2's
//! bits).
//!
//! THE ORDER of v3 is v2's over tiles of [`KEY_TILE`] = 128 keys (the header of
//! attention_wgmma.cuh has it in full). Its CPU twin is v2's, generalised by tile width
//! ([`crate::ops::attention_tile::attend_row_tiles`] with W = 128): cpu and emu give the same
//! bits; cuda agrees with both to bf16 tolerance (the tensor cores' internal summation order is
//! not the fmaf chain), and decode equals training within each device.
//!
//! Head dims: BF16 with D <= 128, zero-padded to DP = 64 or 128 (the wgmma tiles' K for
//! S = Q K^T and N for P V); so the small models' D = 4 .. 32 run here too, at the cost of the
//! padding's FLOPs. Tensor copies bring K and V where D == DP and the tensors are 16-byte
//! aligned; otherwise (and for every paged tile, read through the block table) the producer warp
//! gathers rows with cp.async into the same layout. Which of the two fills a stage changes no
//! bits: the stage holds the same values.

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::ops::attention_tile::PagedArgs;
use crate::tensor::Tensor;
use crate::tensor_map::{Swizzle, TensorMap, TiledMap};

/// Keys per online-softmax step of v3, for training, decode and prefill alike (part of the bits
/// contract: independent of D and the device). It equals the query rows of a training block, so
/// a causal block's two consumer warpgroups visit the same tiles and no real row meets a fully
/// masked one; the S tile (64 x 128 f32) fits the consumers' registers beside O and bf16 P.
pub const KEY_TILE: usize = 128;
/// Query positions per block of the training forward and the prefill (two warpgroups of 64).
pub const QUERY_TILE: usize = 128;
/// Query rows of the decode kernel's m64 tile (the GQA group's heads, 64 at a time).
pub const DECODE_ROWS: usize = 64;
/// Ring stages (K and V tiles of KEY_TILE keys each).
const STAGES: usize = 2;
/// Head-dim elements per 128-byte swizzled row (one tensor-copy box).
const BOX: usize = 64;

/// The head dim the v3 kernels pad `d` to (64 or 128).
pub fn padded_head_dim(d: usize) -> usize {
    if d <= 64 {
        64
    } else {
        128
    }
}

/// Dynamic shared memory of a block with `consumers` warpgroups and `regions` tiles of its own
/// rows (attention_wgmma.cuh's Layout::SHARED_BYTES): the regions (Q; or Q and dO, K and V in
/// the backward), the ring's stages of two tiles, its barriers, 1024 bytes of alignment.
fn shared_bytes_with(d: usize, consumers: usize, regions: usize) -> u32 {
    let dp = padded_head_dim(d);
    let region = consumers * 64 * dp * 2;
    let stage = 2 * KEY_TILE * dp * 2;
    (regions * region + STAGES * stage + 2 * STAGES * 8 + 1024) as u32
}

fn shared_bytes(d: usize, consumers: usize) -> u32 {
    shared_bytes_with(d, consumers, 1)
}

/// v3 needs sm_90a on `cuda`; the emulator runs its portable version, the cpu its twin.
pub fn check_device(backend: &Backend) -> Result<()> {
    if let Some(cuda) = backend.cuda() {
        if cuda.arch() != crate::cuda::PtxArch::Sm90a {
            let (major, minor) = cuda.compute_capability();
            return Err(Error::Device(format!(
                "SLUICE_ATTENTION=wgmma needs an sm_90 GPU (H100/H200); cuda:{} is {} with \
                 compute capability {major}.{minor}; unset SLUICE_ATTENTION (v2, mma.sync) or \
                 set it to tiles",
                cuda.ordinal(),
                cuda.name()
            )));
        }
    }
    Ok(())
}

/// Blocks of the training forward and the prefill: every sequence's 128-position tiles (at most
/// T / 128 + B for the forward, T / 128 + 2 B for a prefill, whose new tokens may start inside a
/// tile); the blocks past the last tile exit at once.
fn query_tile_blocks(t: usize, b: usize, per_sequence_extra: usize) -> Result<u32> {
    let n = t.div_ceil(QUERY_TILE) + per_sequence_extra * b;
    u32::try_from(n)
        .ok()
        .filter(|&n| n < (1 << 31))
        .ok_or_else(|| Error::Invalid(format!("{n} query tiles exceed a grid's x dimension")))
}

thread_local! {
    /// Set while a [`GatherOnly`] guard lives on this thread.
    static GATHER_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, the v3 forward on this thread gathers every K/V tile with cp.async instead of
/// using tensor copies: what a test needs to show that the producer changes no bits.
pub struct GatherOnly {
    previous: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl GatherOnly {
    pub fn scoped() -> GatherOnly {
        GatherOnly {
            previous: GATHER_ONLY.with(|g| g.replace(true)),
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for GatherOnly {
    fn drop(&mut self) {
        GATHER_ONLY.with(|g| g.set(self.previous));
    }
}

/// The tensor map of a [T, Hx, D] tensor (k, v; q, dout) for the producer's copies: boxes of 64
/// head dims x 1 head x KEY_TILE tokens in the 128-byte swizzle. None where a copy cannot read
/// whole boxes (D not 64 or 128) or the driver's rules refuse the tensor (alignment): the gather
/// kernel runs.
fn kv_map<'t>(
    backend: &Backend,
    x: &'t Tensor,
    name: &str,
    hkv: usize,
    d: usize,
) -> Option<TensorMap<'t>> {
    if d != padded_head_dim(d) || GATHER_ONLY.with(|g| g.get()) {
        return None;
    }
    let t = x.shape()[0];
    TensorMap::tiled(
        backend,
        x,
        name,
        &TiledMap {
            dims: &[d as u64, hkv as u64, t as u64],
            strides: &[(d * 2) as u64, (hkv * d * 2) as u64],
            boxes: &[BOX as u32, 1, KEY_TILE as u32],
            swizzle: Swizzle::B128,
        },
    )
    .ok()
}

/// Launches the v3 training forward: out[T,H,D], lse[T,H] (F32, written once each).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_forward(
    backend: &Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    (t, h, hkv, d): (usize, usize, usize, usize),
    causal: bool,
    scale: f32,
    out: &Tensor,
    lse: &Tensor,
) -> Result<()> {
    check_device(backend)?;
    let b = cu_seqlens.numel() - 1;
    let dp = padded_head_dim(d);
    let maps = kv_map(backend, k, "k", hkv, d).zip(kv_map(backend, v, "v", hkv, d));
    let name = match (&maps, dp) {
        (Some(_), 64) => "attention_wgmma_forward_d64",
        (Some(_), _) => "attention_wgmma_forward_d128",
        (None, 64) => "attention_wgmma_forward_gather_d64",
        (None, _) => "attention_wgmma_forward_gather_d128",
    };
    let mut launch = Launch::new(
        name,
        [query_tile_blocks(t, b, 1)?, h as u32, 1],
        [384, 1, 1],
    )
    .shared_bytes(shared_bytes(d, 2));
    if let Some((mk, mv)) = &maps {
        launch = launch.arg_tensor_map(mk).arg_tensor_map(mv);
    }
    backend.launch(
        &launch
            .arg_tensor(q)
            .arg_tensor(k)
            .arg_tensor(v)
            .arg_tensor(cu_seqlens)
            .arg_i32(b as i32)
            .arg_i32(h as i32)
            .arg_i32(hkv as i32)
            .arg_i32(d as i32)
            .arg_i32(causal as i32)
            .arg_f32(scale)
            .arg_tensor(out)
            .arg_tensor(lse),
    )
}

/// Alignment of a sequence's part of the backward's statistics, in positions (STAT_PAD of
/// kernels/cuda/common/attention_bwd_stats.cuh: the dK/dV pass's query step).
const STAT_PAD: usize = 64;

/// Floats per head of the backward's statistics in fragment order (attention_bwd_stats.cuh's
/// stat_stride): every sequence's part starts STAT_PAD-aligned.
fn stat_stride(t: usize, b: usize) -> usize {
    t.div_ceil(STAT_PAD) * STAT_PAD + STAT_PAD * b
}

/// v3's prep: delta = rowsum(dO * O) in v2's order and lse, both [H, stat_stride(T, B)] in the
/// fragment order the passes read with 16-byte loads (attention_bwd_stats.cuh). The slots
/// between sequences are never written and never read as values (the passes mask them).
fn launch_backward_prep(
    backend: &Backend,
    dout: &Tensor,
    out: &Tensor,
    lse_rows: &Tensor,
    cu_seqlens: &Tensor,
    (t, h, d): (usize, usize, usize),
) -> Result<(Tensor, Tensor)> {
    let b = cu_seqlens.numel() - 1;
    let stride = stat_stride(t, b);
    if stride > i32::MAX as usize {
        return Err(Error::Invalid(format!(
            "{t} tokens in {b} sequences exceed the backward's 32-bit statistics offsets"
        )));
    }
    let delta = Tensor::poisoned(backend, &[h, stride], DType::F32)?;
    let lse = Tensor::poisoned(backend, &[h, stride], DType::F32)?;
    let rows = u32::try_from((t * h).div_ceil(4))
        .map_err(|_| Error::Invalid(format!("{t} x {h} rows exceed a grid's x dimension")))?;
    backend.launch(
        &Launch::new("attention_wgmma_bwd_prep", [rows, 1, 1], [128, 1, 1])
            .arg_tensor(dout)
            .arg_tensor(out)
            .arg_tensor(lse_rows)
            .arg_tensor(cu_seqlens)
            .arg_i32(b as i32)
            .arg_i32(t as i32)
            .arg_i32(h as i32)
            .arg_i32(d as i32)
            .arg_tensor(&delta)
            .arg_tensor(&lse),
    )?;
    Ok((delta, lse))
}

/// Launches the v3 backward: its prep (delta = rowsum(dO * O) and lse in fragment order), then
/// the dK/dV pass per 128 keys of a kv head and the dQ pass per 128 queries of a head
/// (kernels/cuda/attention_wgmma_bwd.cu), each output row written once, no atomics.
/// `inputs`: q, k, v, cu_seqlens, dout (BF16), out, lse (F32); `grads`: dq, dk, dv (F32). The
/// bits are v2's backward's on emu (the same operations in the same order).
pub(crate) fn launch_backward(
    backend: &Backend,
    inputs: [&Tensor; 7],
    (t, h, hkv, d): (usize, usize, usize, usize),
    causal: bool,
    scale: f32,
    grads: [&Tensor; 3],
) -> Result<()> {
    check_device(backend)?;
    let [q, k, v, cu_seqlens, dout, out, lse_rows] = inputs;
    let [dq, dk, dv] = grads;
    let b = cu_seqlens.numel() - 1;
    let (delta, lse) = launch_backward_prep(backend, dout, out, lse_rows, cu_seqlens, (t, h, d))?;
    let blocks = query_tile_blocks(t, b, 1)?;
    let dp = padded_head_dim(d);
    let smem = shared_bytes_with(d, 2, 2);
    let (lse, delta) = (&lse, &delta);
    // The arguments after the maps, the same for both passes.
    fn rest<'t>(
        l: Launch<'t>,
        tensors: [&'t Tensor; 7],
        ints: [i32; 6],
        scale: f32,
        smem: u32,
    ) -> Launch<'t> {
        let mut l = l.shared_bytes(smem);
        for x in tensors {
            l = l.arg_tensor(x);
        }
        for i in ints {
            l = l.arg_i32(i);
        }
        l.arg_f32(scale)
    }
    let tensors = [q, k, v, cu_seqlens, dout, lse, delta];
    let ints = [
        b as i32,
        t as i32,
        h as i32,
        hkv as i32,
        d as i32,
        causal as i32,
    ];
    // dK, dV: the stream is Q and dO of the group's heads.
    let maps = kv_map(backend, q, "q", h, d).zip(kv_map(backend, dout, "dout", h, d));
    let name = match (&maps, dp) {
        (Some(_), 64) => "attention_wgmma_bwd_dkdv_d64",
        (Some(_), _) => "attention_wgmma_bwd_dkdv_d128",
        (None, 64) => "attention_wgmma_bwd_dkdv_gather_d64",
        (None, _) => "attention_wgmma_bwd_dkdv_gather_d128",
    };
    let mut l = Launch::new(name, [blocks, hkv as u32, 1], [384, 1, 1]);
    if let Some((mq, mdo)) = &maps {
        l = l.arg_tensor_map(mq).arg_tensor_map(mdo);
    }
    backend.launch(
        &rest(l, tensors, ints, scale, smem)
            .arg_tensor(dk)
            .arg_tensor(dv),
    )?;
    // dQ: the stream is K and V, as in the forward.
    let maps = kv_map(backend, k, "k", hkv, d).zip(kv_map(backend, v, "v", hkv, d));
    let name = match (&maps, dp) {
        (Some(_), 64) => "attention_wgmma_bwd_dq_d64",
        (Some(_), _) => "attention_wgmma_bwd_dq_d128",
        (None, 64) => "attention_wgmma_bwd_dq_gather_d64",
        (None, _) => "attention_wgmma_bwd_dq_gather_d128",
    };
    let mut l = Launch::new(name, [blocks, h as u32, 1], [384, 1, 1]);
    if let Some((mk, mv)) = &maps {
        l = l.arg_tensor_map(mk).arg_tensor_map(mv);
    }
    backend.launch(&rest(l, tensors, ints, scale, smem).arg_tensor(dq))
}

/// Launches the v3 decode: out[B,H,D] (F32), one block per (sequence, kv head, 64 query heads).
pub(crate) fn launch_decode(
    backend: &Backend,
    q: &Tensor,
    c: &PagedArgs<'_>,
    (b, h, d): (usize, usize, usize),
    scale: f32,
    out: &Tensor,
) -> Result<()> {
    check_device(backend)?;
    let groups = (h / c.hkv).div_ceil(DECODE_ROWS);
    let name = if padded_head_dim(d) == 64 {
        "paged_attention_wgmma_decode_d64"
    } else {
        "paged_attention_wgmma_decode_d128"
    };
    backend.launch(
        &c.decode_args(
            Launch::new(name, [b as u32, c.hkv as u32, groups as u32], [256, 1, 1])
                .shared_bytes(shared_bytes(d, 1)),
            q,
            (h, d),
            scale,
            out,
        ),
    )
}

/// Launches the v3 chunked prefill: out[T,H,D] (F32) for the new tokens of B sequences.
pub(crate) fn launch_prefill(
    backend: &Backend,
    q: &Tensor,
    c: &PagedArgs<'_>,
    cu_seqlens: &Tensor,
    (t, h, d): (usize, usize, usize),
    scale: f32,
    out: &Tensor,
) -> Result<()> {
    check_device(backend)?;
    let b = cu_seqlens.numel() - 1;
    let name = if padded_head_dim(d) == 64 {
        "paged_attention_wgmma_prefill_d64"
    } else {
        "paged_attention_wgmma_prefill_d128"
    };
    backend.launch(
        &c.prefill_args(
            Launch::new(
                name,
                [query_tile_blocks(t, b, 2)?, h as u32, 1],
                [384, 1, 1],
            )
            .shared_bytes(shared_bytes(d, 2)),
            q,
            cu_seqlens,
            (b, h, d),
            scale,
            out,
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_dims_pad_to_64_or_128() {
        let got: Vec<usize> = [1, 8, 64, 65, 128]
            .iter()
            .map(|&d| padded_head_dim(d))
            .collect();
        assert_eq!(got, vec![64, 64, 64, 128, 128]);
    }

    #[test]
    fn shared_memory_matches_the_kernels_layout() {
        // Layout<128, 2>: Q 2 x 128 x 128 B = 32 KiB, 2 stages of 64 KiB, 4 barriers, 1 KiB.
        assert_eq!(shared_bytes(128, 2), 32768 + 131072 + 32 + 1024);
        // Layout<64, 1>: Q 8 KiB, 2 stages of 32 KiB.
        assert_eq!(shared_bytes(64, 1), 8192 + 65536 + 32 + 1024);
        // The backward's Layout<128, 2, 2>: two regions of 32 KiB.
        assert_eq!(shared_bytes_with(128, 2, 2), 65536 + 131072 + 32 + 1024);
        assert!(shared_bytes_with(128, 2, 2) <= 227 * 1024);
        assert!(shared_bytes(128, 2) <= 227 * 1024);
    }
}
