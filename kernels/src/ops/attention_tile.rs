//! Attention v2: the tensor-core tile path (kernels/cuda/attention_tc.cu,
//! kernels/cuda/paged_attention_tc.cu, the step in kernels/cuda/common/attention_tile.cuh) and
//! the selector between it and v1, the SIMT chunk path (attention.cu, paged_attention.cu).
//!
//! Which path a call takes: BF16 inputs with head dim <= [`TILE_MAX_HEAD_DIM`] take the tiles
//! unless `SLUICE_ATTENTION=simt` (or `v1`) is set in the environment; F32 inputs and wider heads
//! always take v1. The choice is made the same way for the training forward, the paged decode
//! and the prefill, so the three switch together and a query's decode output keeps equal to its
//! training output bit for bit on each device.
//!
//! THE TILE ORDER (the header of attention_tile.cuh has it in full): keys in tiles of
//! [`KEY_TILE`] = 32 from the sequence start; S = Q K^T as a dot in ascending head dim (f32 fmaf
//! chain from 0: what the emulated mma.sync computes); scale; max; p = exp(s - m'); the row sum
//! in the order of the mma fragment (four lanes' partial sums, then (l0 + l1) + (l2 + l3));
//! O = O * alpha, then O += bf16(p) v for the keys ascending. [`attend_row_tiles`] is the Rust
//! twin: cpu and emu give the same bits; cuda agrees with both to bf16 tolerance (the tensor
//! cores' internal summation order is not the fmaf chain).

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::tensor::Tensor;
use half::bf16;
use std::sync::OnceLock;

/// Keys per online-softmax step of the tile path (training and decode alike).
pub const KEY_TILE: usize = 32;
/// The widest head dimension the tile kernels take (wider heads take v1).
pub const TILE_MAX_HEAD_DIM: usize = 128;
/// Query rows per block of the training forward and the prefill (4 warps of 32 rows).
pub const QUERY_TILE: usize = 128;
/// Query rows of the decode kernel's one m16 tile (the GQA group's heads, 16 at a time).
pub const DECODE_ROWS: usize = 16;
/// bf16 elements of padding per shared-memory row (attention_tile.cuh's ROW_PAD).
const ROW_PAD: usize = 8;

/// The attention kernels a process runs: v1 (SIMT, one warp per row), v2 (tensor-core tiles on
/// mma.sync) or v3 (wgmma and tensor copies on sm_90a, [`crate::ops::attention_wgmma`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    Simt,
    Tiles,
    Wgmma,
}

impl AttentionPath {
    /// Parses `simt`/`v1`, `tiles`/`v2` or `wgmma`/`v3`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "simt" | "v1" => Ok(AttentionPath::Simt),
            "tiles" | "v2" => Ok(AttentionPath::Tiles),
            "wgmma" | "v3" => Ok(AttentionPath::Wgmma),
            other => Err(Error::param(
                "SLUICE_ATTENTION",
                format!(
                    "`{other}` is not an attention path (simt or v1, tiles or v2, wgmma or v3)"
                ),
            )),
        }
    }
}

/// The process's attention path: `SLUICE_ATTENTION` (read once), tiles by default.
pub fn attention_path() -> Result<AttentionPath> {
    static PATH: OnceLock<std::result::Result<AttentionPath, String>> = OnceLock::new();
    PATH.get_or_init(|| match std::env::var("SLUICE_ATTENTION") {
        Ok(v) => AttentionPath::parse(&v).map_err(|e| e.to_string()),
        Err(_) => Ok(AttentionPath::Tiles),
    })
    .clone()
    .map_err(Error::Invalid)
}

/// The order in which a call computes its rows (and hence its bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowOrder {
    /// v1: chunks of 32 keys, f32 throughout (common/attention_chunk.cuh).
    Chunks,
    /// v2: tiles of 32 keys, P rounded to bf16 before it multiplies V.
    Tiles,
    /// v3: v2's order over tiles of 128 keys (common/attention_wgmma.cuh), forward, decode and
    /// prefill; v3's backward kernels compute v2's backward order ([`RowOrder::backward`]).
    Wgmma,
}

impl RowOrder {
    /// The order of a call with inputs of `dtype` and head dim `d` on `path`: BF16 with
    /// d <= 128 takes the path's tiles, anything else v1's chunks.
    pub fn of(path: AttentionPath, dtype: DType, d: usize) -> Self {
        if dtype != DType::BF16 || d > TILE_MAX_HEAD_DIM {
            return RowOrder::Chunks;
        }
        match path {
            AttentionPath::Simt => RowOrder::Chunks,
            AttentionPath::Tiles => RowOrder::Tiles,
            AttentionPath::Wgmma => RowOrder::Wgmma,
        }
    }

    /// The order both of two operands' orders allow (a call with several operand dtypes): the
    /// same order, else v2's tiles between v2 and v3, else v1's chunks.
    pub fn min_with(self, other: RowOrder) -> RowOrder {
        match (self, other) {
            (a, b) if a == b => a,
            (RowOrder::Chunks, _) | (_, RowOrder::Chunks) => RowOrder::Chunks,
            _ => RowOrder::Tiles,
        }
    }

    /// The order of the backward that goes with a forward in this order: v3's backward kernels
    /// (attention_wgmma_bwd.cu) compute v2's order, element by element (the tile widths of the
    /// backward change no sum), so its CPU twin is v2's; the other orders are their own.
    pub fn backward(self) -> RowOrder {
        match self {
            RowOrder::Wgmma => RowOrder::Tiles,
            other => other,
        }
    }

    /// Keys per online-softmax step of a tile order (None for v1's chunks).
    pub fn key_tile(self) -> Option<usize> {
        match self {
            RowOrder::Chunks => None,
            RowOrder::Tiles => Some(KEY_TILE),
            RowOrder::Wgmma => Some(crate::ops::attention_wgmma::KEY_TILE),
        }
    }

    /// The order the process's path gives a call with inputs of `dtype` and head dim `d`.
    pub fn for_inputs(dtype: DType, d: usize) -> Result<Self> {
        Ok(Self::of(attention_path()?, dtype, d))
    }
}

/// The head dim the tile kernels pad `d` to (16, 32, 64 or 128).
pub fn padded_head_dim(d: usize) -> usize {
    d.next_power_of_two().clamp(16, TILE_MAX_HEAD_DIM)
}

/// Dynamic shared memory of a tile block with `rows` query rows: the query tile and two stages of
/// (K, V) tiles, rows of DP + 8 bf16 (attention_tile.cuh's block_smem_bytes).
fn block_smem_bytes(rows: usize, d: usize) -> u32 {
    ((rows + 4 * KEY_TILE) * (padded_head_dim(d) + ROW_PAD) * 2) as u32
}

fn kernel_for(prefix: &str, d: usize) -> &'static str {
    match (prefix, padded_head_dim(d)) {
        ("forward", 16) => "attention_tc_forward_d16",
        ("forward", 32) => "attention_tc_forward_d32",
        ("forward", 64) => "attention_tc_forward_d64",
        ("forward", _) => "attention_tc_forward_d128",
        ("decode", 16) => "paged_attention_tc_decode_d16",
        ("decode", 32) => "paged_attention_tc_decode_d32",
        ("decode", 64) => "paged_attention_tc_decode_d64",
        ("decode", _) => "paged_attention_tc_decode_d128",
        ("prefill", 16) => "paged_attention_tc_prefill_d16",
        ("prefill", 32) => "paged_attention_tc_prefill_d32",
        ("prefill", 64) => "paged_attention_tc_prefill_d64",
        (_, _) => "paged_attention_tc_prefill_d128",
    }
}

/// Blocks of the training forward and the prefill: enough for every sequence's 128-row tiles
/// (at most T / 128 + B of them for the forward, T / 128 + 2 B for a prefill, whose new tokens
/// may start inside a tile); the blocks past the last tile exit at once.
fn query_tile_blocks(t: usize, b: usize, per_sequence_extra: usize) -> Result<u32> {
    let n = t.div_ceil(QUERY_TILE) + per_sequence_extra * b;
    u32::try_from(n)
        .ok()
        .filter(|&n| n < (1 << 31))
        .ok_or_else(|| Error::Invalid(format!("{n} query tiles exceed a grid's x dimension")))
}

/// Launches the v2 training forward: out[T,H,D], lse[T,H] (F32, written once each).
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
    let b = cu_seqlens.numel() - 1;
    backend.launch(
        &Launch::new(
            kernel_for("forward", d),
            [query_tile_blocks(t, b, 1)?, h as u32, 1],
            [128, 1, 1],
        )
        .shared_bytes(block_smem_bytes(QUERY_TILE, d))
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

/// Blocks of 64 rows (keys for dK/dV, queries for dQ) per sequence in the backward.
const BWD_ROWS: usize = 64;
/// Queries per step of the dK/dV pass.
const BWD_QT: usize = 32;

/// The backward's prep kernel (v2's and v3's): delta = rowsum(dO * O) and the forward's lse,
/// both head-major [H, T] (F32), for the passes' whole-sector reads. Returns (delta, lse).
pub(crate) fn launch_backward_prep(
    backend: &Backend,
    dout: &Tensor,
    out: &Tensor,
    lse_rows: &Tensor,
    (t, h, d): (usize, usize, usize),
) -> Result<(Tensor, Tensor)> {
    let delta = Tensor::poisoned(backend, &[h, t], DType::F32)?;
    let lse = Tensor::poisoned(backend, &[h, t], DType::F32)?;
    let rows = u32::try_from((t * h).div_ceil(4))
        .map_err(|_| Error::Invalid(format!("{t} x {h} rows exceed a grid's x dimension")))?;
    backend.launch(
        &Launch::new("attention_tc_bwd_prep", [rows, 1, 1], [128, 1, 1])
            .arg_tensor(dout)
            .arg_tensor(out)
            .arg_tensor(lse_rows)
            .arg_i32(t as i32)
            .arg_i32(h as i32)
            .arg_i32(d as i32)
            .arg_tensor(&delta)
            .arg_tensor(&lse),
    )?;
    Ok((delta, lse))
}

/// Launches the v2 backward: the prep kernel (delta = rowsum(dO * O) and lse, head-major), then
/// the two passes: dK/dV per 64 keys of a kv head, dQ per 64 queries of a head. `inputs`: q, k,
/// v, cu_seqlens, dout (BF16), out, lse (F32); `grads`: dq, dk, dv (F32, written once each).
pub(crate) fn launch_backward(
    backend: &Backend,
    inputs: [&Tensor; 7],
    (t, h, hkv, d): (usize, usize, usize, usize),
    causal: bool,
    scale: f32,
    grads: [&Tensor; 3],
) -> Result<()> {
    let [q, k, v, cu_seqlens, dout, out, lse_rows] = inputs;
    let [dq, dk, dv] = grads;
    let b = cu_seqlens.numel() - 1;
    let (delta, lse) = launch_backward_prep(backend, dout, out, lse_rows, (t, h, d))?;
    let (lse, delta) = (&lse, &delta);
    let row = (padded_head_dim(d) + ROW_PAD) * 2;
    let blocks = t.div_ceil(BWD_ROWS) + b;
    let blocks = u32::try_from(blocks)
        .map_err(|_| Error::Invalid(format!("{blocks} row tiles exceed a grid's x dimension")))?;
    let (dkdv, dqk) = match padded_head_dim(d) {
        16 => ("attention_tc_bwd_dkdv_d16", "attention_tc_bwd_dq_d16"),
        32 => ("attention_tc_bwd_dkdv_d32", "attention_tc_bwd_dq_d32"),
        64 => ("attention_tc_bwd_dkdv_d64", "attention_tc_bwd_dq_d64"),
        _ => ("attention_tc_bwd_dkdv_d128", "attention_tc_bwd_dq_d128"),
    };
    let common = |name: &'static str, heads: usize, smem: usize| {
        Launch::new(name, [blocks, heads as u32, 1], [128, 1, 1])
            .shared_bytes(smem as u32)
            .arg_tensor(q)
            .arg_tensor(k)
            .arg_tensor(v)
            .arg_tensor(cu_seqlens)
            .arg_tensor(dout)
            .arg_tensor(lse)
            .arg_tensor(delta)
            .arg_i32(b as i32)
            .arg_i32(t as i32)
            .arg_i32(h as i32)
            .arg_i32(hkv as i32)
            .arg_i32(d as i32)
            .arg_i32(causal as i32)
            .arg_f32(scale)
    };
    // dkdv_smem_bytes / dq_smem_bytes of attention_tc.cu.
    let dkdv_smem = 2 * BWD_ROWS * row + 2 * (2 * BWD_QT * row + 2 * BWD_QT * 4);
    let dq_smem = 2 * BWD_ROWS * row + 2 * (2 * KEY_TILE * row);
    backend.launch(&common(dkdv, hkv, dkdv_smem).arg_tensor(dk).arg_tensor(dv))?;
    backend.launch(&common(dqk, h, dq_smem).arg_tensor(dq))
}

/// The paged-cache arguments shared by the decode and the prefill launches.
pub(crate) struct PagedArgs<'a> {
    pub k_cache: &'a Tensor,
    pub v_cache: &'a Tensor,
    pub block_table: &'a Tensor,
    pub context_lens: &'a Tensor,
    pub hkv: usize,
    pub bs: usize,
    pub mb: usize,
}

impl<'a> PagedArgs<'a> {
    /// The decode kernels' parameter list (v2's and v3's are the same): q, the caches, the
    /// block table, the context lengths, H, Hkv, D, block size, blocks per sequence, scale, out.
    pub(crate) fn decode_args(
        &self,
        launch: Launch<'a>,
        q: &'a Tensor,
        (h, d): (usize, usize),
        scale: f32,
        out: &'a Tensor,
    ) -> Launch<'a> {
        launch
            .arg_tensor(q)
            .arg_tensor(self.k_cache)
            .arg_tensor(self.v_cache)
            .arg_tensor(self.block_table)
            .arg_tensor(self.context_lens)
            .arg_i32(h as i32)
            .arg_i32(self.hkv as i32)
            .arg_i32(d as i32)
            .arg_i32(self.bs as i32)
            .arg_i32(self.mb as i32)
            .arg_f32(scale)
            .arg_tensor(out)
    }

    /// The chunked-prefill kernels' parameter list (v2's and v3's are the same): q, the
    /// caches, the block table, cu_seqlens, the context lengths, B, H, Hkv, D, block size,
    /// blocks per sequence, scale, out.
    pub(crate) fn prefill_args(
        &self,
        launch: Launch<'a>,
        q: &'a Tensor,
        cu_seqlens: &'a Tensor,
        (b, h, d): (usize, usize, usize),
        scale: f32,
        out: &'a Tensor,
    ) -> Launch<'a> {
        launch
            .arg_tensor(q)
            .arg_tensor(self.k_cache)
            .arg_tensor(self.v_cache)
            .arg_tensor(self.block_table)
            .arg_tensor(cu_seqlens)
            .arg_tensor(self.context_lens)
            .arg_i32(b as i32)
            .arg_i32(h as i32)
            .arg_i32(self.hkv as i32)
            .arg_i32(d as i32)
            .arg_i32(self.bs as i32)
            .arg_i32(self.mb as i32)
            .arg_f32(scale)
            .arg_tensor(out)
    }
}

/// Launches the v2 decode: out[B,H,D] (F32), one warp per (sequence, kv head, 16 query heads).
pub(crate) fn launch_decode(
    backend: &Backend,
    q: &Tensor,
    c: &PagedArgs<'_>,
    (b, h, d): (usize, usize, usize),
    scale: f32,
    out: &Tensor,
) -> Result<()> {
    let groups = (h / c.hkv).div_ceil(DECODE_ROWS);
    backend.launch(
        &c.decode_args(
            Launch::new(
                kernel_for("decode", d),
                [b as u32, c.hkv as u32, groups as u32],
                [32, 1, 1],
            )
            .shared_bytes(block_smem_bytes(DECODE_ROWS, d)),
            q,
            (h, d),
            scale,
            out,
        ),
    )
}

/// Launches the v2 chunked prefill: out[T,H,D] (F32) for the new tokens of B sequences.
pub(crate) fn launch_prefill(
    backend: &Backend,
    q: &Tensor,
    c: &PagedArgs<'_>,
    cu_seqlens: &Tensor,
    (t, h, d): (usize, usize, usize),
    scale: f32,
    out: &Tensor,
) -> Result<()> {
    let b = cu_seqlens.numel() - 1;
    backend.launch(
        &c.prefill_args(
            Launch::new(
                kernel_for("prefill", d),
                [query_tile_blocks(t, b, 2)?, h as u32, 1],
                [128, 1, 1],
            )
            .shared_bytes(block_smem_bytes(QUERY_TILE, d)),
            q,
            cu_seqlens,
            (b, h, d),
            scale,
            out,
        ),
    )
}

/// delta = rowsum(dO * O) as attention_tc_bwd_prep computes it: lane l of a warp adds the dims
/// l, l + 32, ... ascending (fused multiply-adds from 0), then the 32 partial sums meet in the
/// xor tree of halves 16, 8, 4, 2, 1.
pub fn delta_tiles(dout: &[f32], out: &[f32]) -> f32 {
    let mut part = [0.0f32; 32];
    for (i, (&a, &b)) in dout.iter().zip(out).enumerate() {
        part[i % 32] = a.mul_add(b, part[i % 32]);
    }
    let mut half = 16;
    while half >= 1 {
        for i in 0..half {
            part[i] += part[i + half];
        }
        half /= 2;
    }
    part[0]
}

/// `x` rounded to bf16 at nearest (ties to even) and widened back: the A operand of the PV mma.
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// The row sum of one key tile of W keys as the mma (W = 32) or wgmma (W = 128) fragment
/// computes it: lane t of the quad adds keys 8n + 2t and 8n + 2t + 1 for n ascending, from 0;
/// then (l0 + l1) + (l2 + l3).
#[inline(always)]
pub fn tile_row_sum<const W: usize>(p: &[f32; W]) -> f32 {
    let mut part = [0.0f32; 4];
    for (t, s) in part.iter_mut().enumerate() {
        for n in 0..W / 8 {
            *s += p[8 * n + 2 * t];
            *s += p[8 * n + 2 * t + 1];
        }
    }
    (part[0] + part[1]) + (part[2] + part[3])
}

/// The online-softmax state of one query row in the tile order (the twin of one row of
/// attention_tile.cuh's WarpRows and of attention_wgmma.cuh's WgRows: the same steps, tiles of
/// W keys).
#[derive(Clone, Debug)]
pub struct TileRowState {
    m: f32,
    l: f32,
    acc: [f32; TILE_MAX_HEAD_DIM],
    d: usize,
}

impl TileRowState {
    /// The state before any key (D <= TILE_MAX_HEAD_DIM values).
    pub fn new(d: usize) -> Self {
        assert!(
            d <= TILE_MAX_HEAD_DIM,
            "TileRowState: head dim {d} > {TILE_MAX_HEAD_DIM}"
        );
        TileRowState {
            m: f32::NEG_INFINITY,
            l: 0.0,
            acc: [0.0; TILE_MAX_HEAD_DIM],
            d,
        }
    }

    /// Advances over one key tile of W keys given its scaled scores `s` (the visible keys
    /// first, `n` of them; the rest of the tile is masked) and the visible keys' values.
    #[inline(always)]
    pub fn tile_step<const W: usize>(&mut self, s: &[f32; W], n: usize, values: &[&[f32]]) {
        let cm = s[..n].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let m_new = self.m.max(cm);
        let alpha = if self.m == f32::NEG_INFINITY {
            0.0
        } else {
            (self.m - m_new).exp()
        };
        let mut p = [0.0f32; W];
        for j in 0..n {
            p[j] = (s[j] - m_new).exp();
        }
        self.l = self.l.mul_add(alpha, tile_row_sum(&p));
        self.m = m_new;
        let acc = &mut self.acc[..self.d];
        for a in acc.iter_mut() {
            *a *= alpha;
        }
        for (pj, vj) in p.iter().zip(values) {
            let pj = round_bf16(*pj);
            for (a, &x) in acc.iter_mut().zip(vj.iter()) {
                *a = pj.mul_add(x, *a);
            }
        }
    }

    /// Writes out[d] = acc[d] / l; returns the row's logsumexp m + ln(l).
    #[inline(always)]
    pub fn finish(&self, out: &mut [f32]) -> f32 {
        for (o, &a) in out.iter_mut().zip(&self.acc[..self.d]) {
            *o = a / self.l;
        }
        self.m + self.l.ln()
    }
}

/// One row in the tile order with tiles of W keys (32: v2, 128: v3): `n_keys` keys (key j's
/// rows from `kv(j)`), `dots(q, keys)` giving the dot products of up to 8 keys at a time.
/// Returns the logsumexp; with no keys the output is zero and the logsumexp -inf.
#[inline(always)]
pub(crate) fn attend_row_tiles<'a, const W: usize, F: Fn(usize) -> (&'a [f32], &'a [f32])>(
    q: &[f32],
    n_keys: usize,
    scale: f32,
    kv: F,
    out: &mut [f32],
    dots: impl Fn(&[f32], &[&[f32]; 8]) -> [f32; 8],
) -> f32 {
    if n_keys == 0 {
        out.fill(0.0);
        return f32::NEG_INFINITY;
    }
    let mut st = TileRowState::new(q.len());
    let mut j0 = 0;
    while j0 < n_keys {
        let n = W.min(n_keys - j0);
        let mut keys: [&[f32]; W] = [&[]; W];
        let mut values: [&[f32]; W] = [&[]; W];
        for j in 0..n {
            let (kr, vr) = kv(j0 + j);
            keys[j] = &kr[..q.len()];
            values[j] = vr;
        }
        let mut s = [f32::NEG_INFINITY; W];
        let mut g = 0;
        while g < n {
            let m = 8.min(n - g);
            let group: [&[f32]; 8] = std::array::from_fn(|i| keys[if i < m { g + i } else { 0 }]);
            let acc = dots(q, &group);
            for i in 0..m {
                s[g + i] = acc[i] * scale;
            }
            g += 8;
        }
        st.tile_step(&s, n, &values[..n]);
        j0 += W;
    }
    st.finish(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_head_dims() {
        let got: Vec<usize> = [1, 4, 16, 17, 32, 33, 64, 65, 128]
            .iter()
            .map(|&d| padded_head_dim(d))
            .collect();
        assert_eq!(got, vec![16, 16, 16, 32, 32, 64, 64, 128, 128]);
    }

    #[test]
    fn paths_parse_and_pick_the_order() {
        assert_eq!(AttentionPath::parse("v1").unwrap(), AttentionPath::Simt);
        assert_eq!(AttentionPath::parse("tiles").unwrap(), AttentionPath::Tiles);
        let e = AttentionPath::parse("fast").unwrap_err().to_string();
        assert!(e.contains("SLUICE_ATTENTION") && e.contains("fast"), "{e}");
        assert_eq!(
            RowOrder::of(AttentionPath::Tiles, DType::BF16, 128),
            RowOrder::Tiles
        );
        assert_eq!(
            RowOrder::of(AttentionPath::Tiles, DType::BF16, 129),
            RowOrder::Chunks
        );
        assert_eq!(
            RowOrder::of(AttentionPath::Tiles, DType::F32, 64),
            RowOrder::Chunks
        );
        assert_eq!(
            RowOrder::of(AttentionPath::Simt, DType::BF16, 64),
            RowOrder::Chunks
        );
        assert_eq!(AttentionPath::parse("v3").unwrap(), AttentionPath::Wgmma);
        assert_eq!(AttentionPath::parse("wgmma").unwrap(), AttentionPath::Wgmma);
        assert_eq!(
            RowOrder::of(AttentionPath::Wgmma, DType::BF16, 4),
            RowOrder::Wgmma
        );
        assert_eq!(
            RowOrder::of(AttentionPath::Wgmma, DType::F32, 64),
            RowOrder::Chunks
        );
        assert_eq!(
            RowOrder::of(AttentionPath::Wgmma, DType::BF16, 129),
            RowOrder::Chunks
        );
        assert_eq!(RowOrder::Wgmma.backward(), RowOrder::Tiles);
        assert_eq!(RowOrder::Wgmma.min_with(RowOrder::Tiles), RowOrder::Tiles);
        assert_eq!(RowOrder::Wgmma.min_with(RowOrder::Chunks), RowOrder::Chunks);
        assert_eq!(RowOrder::Wgmma.min_with(RowOrder::Wgmma), RowOrder::Wgmma);
        assert_eq!(RowOrder::Wgmma.key_tile(), Some(128));
    }

    #[test]
    fn wide_tile_row_sum_generalises_the_quad_order() {
        // Lane t of the quad adds keys 8n + 2t, 8n + 2t + 1 (n ascending), then (l0+l1)+(l2+l3):
        // with values 2^-k the partial sums are exact, and the total is the plain sum.
        let p: [f32; 128] = std::array::from_fn(|k| (-(k as f32 % 24.0)).exp2());
        let got = tile_row_sum(&p);
        let mut part = [0.0f32; 4];
        for (k, &x) in p.iter().enumerate() {
            part[(k % 8) / 2] += x;
        }
        assert_eq!(
            got.to_bits(),
            ((part[0] + part[1]) + (part[2] + part[3])).to_bits()
        );
        let small: [f32; 32] = std::array::from_fn(|k| p[k]);
        assert!(tile_row_sum(&small) < got);
    }
}
