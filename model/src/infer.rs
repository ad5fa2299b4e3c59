//! The inference forward over a paged KV cache (DESIGN.md 3.5, 6.3): what the rollout engine
//! runs. Built only from the kernels crate's device entry points on [`Tensor`]s (gemm, rmsnorm,
//! rope, kv_append, paged_prefill, paged_attention, swiglu, moe_forward, embedding,
//! residual_add), so the same code runs on `cpu`, `emu` and `cuda`.
//!
//! - [`InferWeights`]: one tensor per view of the layout on the engine's backend, built from a
//!   parameter [`Arena`] in the engine's [`Precision`], with the version it holds.
//! - [`KvCache`]: per layer a K and a V cache of shape [NB, BS, Hkv, D], F32 or BF16 (the
//!   precision's dtype: a bf16 cache holds twice the tokens in the same bytes).
//! - [`prefill`]: new tokens of several sequences (a chunk each; their K/V are appended at the
//!   given slots, and each token attends to its sequence's cached keys plus the chunk's own,
//!   causally) -> logits of the rows asked for.
//! - [`decode`]: one new token per sequence -> logits of every row.
//!
//! Every op is row-wise or batch-invariant with a fixed reduction order, and `paged_prefill` /
//! `paged_attention` give each query row bit-for-bit the row `attention_forward` gives over the
//! whole sequence. So the logits of a token are bit-identical to the training forward's
//! ([`crate::forward::logits`]) on the same device and weights, whichever way the sequence was
//! split into chunks, and whatever else is in the batch. `runtime/tests/zero_mismatch.rs` checks
//! this end to end.
//!
//! The layer pieces are the learner's own ([`crate::layers`]): the weights as tensors
//! ([`ModelWeights`]), the norm, q/k/v projections and RoPE ([`layers::qkv`]), the output
//! projection with its residual ([`layers::attn_output`]), the FFN half
//! ([`layers::ffn_block`]) and the head ([`layers::head`]); only the attention itself differs
//! (the paged cache instead of the packed batch), so the engine and the learner compute a
//! token's activations with the same code and round to bf16 at the same points. In bf16 the
//! cache holds k and v exactly as the learner's attention takes them (bf16, rounded after
//! RoPE), and the paged kernels widen them to f32 as the training kernel does.

use crate::arena::Arena;
use crate::config::ModelConfig;
use crate::layers::{self, Dims, LayerWeights, ModelWeights};
use crate::layout::Layout;
use crate::precision::Precision;
use sluice_kernels::ops::embedding::embedding;
use sluice_kernels::ops::optim::cast_bf16_into;
use sluice_kernels::ops::paged_attention::{kv_append, paged_attention, paged_prefill};
use sluice_kernels::{Backend, DType, Error, Result, Tensor};

/// The model's weights as tensors on one backend, in the engine's precision, and the version
/// they are.
pub struct InferWeights {
    pub config: ModelConfig,
    pub version: u64,
    pub precision: Precision,
    pub weights: ModelWeights,
}

impl InferWeights {
    /// Every view of `arena` (F32 or BF16, on any device) as a tensor on `backend`, in
    /// `precision`: f32 takes F32 weights (a BF16 arena is widened exactly); bf16 takes the
    /// bf16 compute copy as it is, or rounds F32 master weights to bf16 (nearest even, the
    /// `cast_bf16` op: the same bits as the learner's compute copy of those weights).
    pub fn from_arena(
        backend: &Backend,
        config: &ModelConfig,
        arena: &Arena,
        version: u64,
        precision: Precision,
    ) -> Result<InferWeights> {
        config.validate()?;
        let expected = Layout::new(config)?;
        if **arena.layout() != expected {
            return Err(Error::Invalid(
                "InferWeights: the arena's layout is not the layout of the model config".into(),
            ));
        }
        let converted = compute_arena(backend, arena, precision.dtype())?;
        let weights = ModelWeights::from_arena(backend, converted.as_ref().unwrap_or(arena))?;
        Ok(InferWeights {
            config: config.clone(),
            version,
            precision,
            weights,
        })
    }
}

/// `arena` in `dtype` on `backend`: None when it already is (use it as it is: the views are
/// copied out next), the `cast_bf16` op's copy for F32 on the same device, else a converted
/// upload.
fn compute_arena(backend: &Backend, arena: &Arena, dtype: DType) -> Result<Option<Arena>> {
    let here = arena.tensor().is_on(backend.device());
    if here && arena.dtype() == dtype {
        return Ok(None);
    }
    if here && arena.dtype() == DType::F32 && dtype == DType::BF16 {
        let mut c = Arena::zeros(backend, arena.layout().clone(), DType::BF16)?;
        cast_bf16_into(backend, arena.tensor(), c.tensor_mut())?;
        return Ok(Some(c));
    }
    Ok(Some(arena.cast_copy(backend, dtype)?))
}

/// The paged K/V caches: per layer K and V of shape [NB, BS, Hkv, D], in the engine's
/// precision (F32, or BF16: half the bytes per token).
pub struct KvCache {
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    num_blocks: usize,
    block_size: usize,
    row: usize,
}

impl KvCache {
    /// Zeroed caches of `num_blocks` blocks of `block_size` slots of `dtype` (F32 or BF16) for
    /// every layer of `config`.
    pub fn new(
        backend: &Backend,
        config: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        dtype: DType,
    ) -> Result<KvCache> {
        if num_blocks == 0 || block_size == 0 {
            return Err(Error::param(
                "kv_cache",
                format!("num_blocks {num_blocks} and block_size {block_size} must be >= 1"),
            ));
        }
        if !dtype.is_float() {
            return Err(Error::param(
                "kv_cache",
                format!("the cache holds F32 or BF16, not {dtype}"),
            ));
        }
        let shape = [num_blocks, block_size, config.n_kv_heads, config.head_dim];
        let mut k = Vec::with_capacity(config.n_layers);
        let mut v = Vec::with_capacity(config.n_layers);
        for _ in 0..config.n_layers {
            k.push(Tensor::zeros(backend, &shape, dtype)?);
            v.push(Tensor::zeros(backend, &shape, dtype)?);
        }
        Ok(KvCache {
            k,
            v,
            num_blocks,
            block_size,
            row: config.n_kv_heads * config.head_dim,
        })
    }

    /// Bytes of one block in every layer's K and V cache: 2 * n_layers * block_size * Hkv * D
    /// elements of `dtype`.
    pub fn block_bytes(config: &ModelConfig, dtype: DType, block_size: usize) -> usize {
        2 * config.n_layers * block_size * config.kv_dim() * dtype.size_bytes()
    }

    /// The blocks a pool of `bytes` holds (whole blocks; what is left over is not allocated).
    /// Err, naming `kv_bytes`, when not even one block fits.
    pub fn blocks_for_bytes(
        config: &ModelConfig,
        dtype: DType,
        block_size: usize,
        bytes: usize,
    ) -> Result<usize> {
        let per = Self::block_bytes(config, dtype, block_size);
        if block_size == 0 || per == 0 {
            return Err(Error::param("block_size", "must be >= 1"));
        }
        let n = bytes / per;
        if n == 0 {
            return Err(Error::param(
                "kv_bytes",
                format!(
                    "{bytes} bytes hold no block: one block of {block_size} slots is {per} bytes \
                     in {dtype} for this model ({} layers, K and V of {} values per slot)",
                    config.n_layers,
                    config.kv_dim()
                ),
            ));
        }
        Ok(n)
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn layers(&self) -> usize {
        self.k.len()
    }

    /// The caches' dtype.
    pub fn dtype(&self) -> DType {
        self.k.first().map_or(DType::F32, |t| t.dtype())
    }

    /// Bytes of every layer's K and V caches.
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|t| t.len_bytes()).sum()
    }

    /// Values of one slot row (Hkv * D).
    pub fn row_len(&self) -> usize {
        self.row
    }

    /// Reads the K and V rows of `slots` in every layer: per layer ([n, Hkv*D], [n, Hkv*D]) as
    /// tensors of the caches' dtype on `backend` (an exact copy: a gather through the embedding
    /// op, whose f32 rows a BF16 cache's values survive unchanged on the way back to BF16).
    pub fn gather(&mut self, backend: &Backend, slots: &[i32]) -> Result<Vec<(Tensor, Tensor)>> {
        let idx = Tensor::from_slice(backend, &[slots.len()], slots)?;
        let n_slots = self.num_blocks * self.block_size;
        let shape4 = [
            self.num_blocks,
            self.block_size,
            self.row / self.k_head_dim(),
            self.k_head_dim(),
        ];
        let dtype = self.dtype();
        let mut out = Vec::with_capacity(self.layers());
        if let (Backend::Cpu, DType::BF16) = (backend, dtype) {
            // The embedding reference would widen the whole cache to f32 on every call; the
            // rows are copied as they are instead (the same values).
            if let Some(&bad) = slots.iter().find(|&&s| s < 0 || s as usize >= n_slots) {
                return Err(Error::Invalid(format!(
                    "KvCache::gather: slot {bad} is not a slot of the cache (0..{n_slots})"
                )));
            }
            let rows = |t: &Tensor| -> Result<Tensor> {
                let data = t.host_slice::<half::bf16>()?;
                let mut v = Vec::with_capacity(slots.len() * self.row);
                for &s in slots {
                    let s = s as usize;
                    v.extend_from_slice(&data[s * self.row..(s + 1) * self.row]);
                }
                Tensor::from_slice(backend, &[slots.len(), self.row], &v)
            };
            for l in 0..self.layers() {
                out.push((rows(&self.k[l])?, rows(&self.v[l])?));
            }
            return Ok(out);
        }
        for l in 0..self.layers() {
            let k = gather_rows(backend, &mut self.k[l], &idx, [n_slots, self.row], shape4)?;
            let v = gather_rows(backend, &mut self.v[l], &idx, [n_slots, self.row], shape4)?;
            out.push((
                layers::into_dtype(backend, k, dtype)?,
                layers::into_dtype(backend, v, dtype)?,
            ));
        }
        Ok(out)
    }

    /// Writes per-layer K/V rows ([n, Hkv*D] each in the caches' dtype, as from
    /// [`KvCache::gather`]) into `slots`.
    pub fn scatter(
        &mut self,
        backend: &Backend,
        rows: Vec<(Tensor, Tensor)>,
        slots: &[i32],
    ) -> Result<()> {
        if rows.len() != self.layers() {
            return Err(Error::Invalid(format!(
                "KvCache::scatter: {} layers of rows for a cache of {} layers",
                rows.len(),
                self.layers()
            )));
        }
        let slot_t = Tensor::from_slice(backend, &[slots.len()], slots)?;
        let hd = self.k_head_dim();
        let shape3 = [slots.len(), self.row / hd, hd];
        for (l, (k, v)) in rows.into_iter().enumerate() {
            let k = k.reshape(&shape3)?;
            let v = v.reshape(&shape3)?;
            kv_append(backend, &k, &v, &slot_t, &mut self.k[l], &mut self.v[l])?;
        }
        Ok(())
    }

    /// Copies the first `tokens` slots of block `src` into block `dst` in every layer
    /// (the block manager's copy-on-write instruction).
    pub fn copy_block(
        &mut self,
        backend: &Backend,
        src: usize,
        dst: usize,
        tokens: usize,
    ) -> Result<()> {
        if src >= self.num_blocks || dst >= self.num_blocks || tokens > self.block_size {
            return Err(Error::Invalid(format!(
                "KvCache::copy_block: block {src} -> {dst} ({tokens} slots) outside {} blocks of {}",
                self.num_blocks, self.block_size
            )));
        }
        if tokens == 0 || src == dst {
            return Ok(());
        }
        let bs = self.block_size;
        let from: Vec<i32> = (0..tokens).map(|i| (src * bs + i) as i32).collect();
        let to: Vec<i32> = (0..tokens).map(|i| (dst * bs + i) as i32).collect();
        let rows = self.gather(backend, &from)?;
        self.scatter(backend, rows, &to)
    }

    fn k_head_dim(&self) -> usize {
        self.k.first().map_or(1, |t| t.shape()[3])
    }
}

/// Rows `idx` of a cache viewed as [slots, row]: the tensor is reshaped in place and back.
fn gather_rows(
    backend: &Backend,
    cache: &mut Tensor,
    idx: &Tensor,
    flat: [usize; 2],
    shape4: [usize; 4],
) -> Result<Tensor> {
    let placeholder = Tensor::zeros(backend, &[0], cache.dtype())?;
    let whole = std::mem::replace(cache, placeholder).reshape(&flat)?;
    let rows = embedding(backend, &whole, idx);
    *cache = whole.reshape(&shape4)?;
    rows
}

/// One prefill call: chunks of new tokens of B sequences, packed.
#[derive(Clone, Debug, Default)]
pub struct PrefillBatch {
    /// [T] the new tokens, sequence after sequence.
    pub tokens: Vec<i32>,
    /// [T] each token's position in its own sequence.
    pub positions: Vec<i32>,
    /// [T] the cache slot each token's K/V is written to.
    pub slots: Vec<i32>,
    /// [B+1] chunk boundaries in `tokens`.
    pub cu_seqlens: Vec<i32>,
    /// [B, max_blocks] block table rows.
    pub block_table: Vec<i32>,
    pub max_blocks: usize,
    /// [B] keys in each sequence's cache after this chunk (cached ones + the chunk's).
    pub context_lens: Vec<i32>,
    /// Rows of `tokens` whose logits are returned, in this order.
    pub logits_rows: Vec<i32>,
}

/// One decode call: one new token per sequence.
#[derive(Clone, Debug, Default)]
pub struct DecodeBatch {
    /// [B]
    pub tokens: Vec<i32>,
    /// [B]
    pub positions: Vec<i32>,
    /// [B]
    pub slots: Vec<i32>,
    /// [B, max_blocks]
    pub block_table: Vec<i32>,
    pub max_blocks: usize,
    /// [B] keys after this token (its own included).
    pub context_lens: Vec<i32>,
}

/// How a layer's attention reads the cache.
pub enum AttnInputs<'a> {
    Prefill {
        block_table: &'a Tensor,
        cu_seqlens: &'a Tensor,
        context_lens: &'a Tensor,
    },
    Decode {
        block_table: &'a Tensor,
        context_lens: &'a Tensor,
    },
}

/// The attention half of a layer: x + wo(attention(rope(q), cache after appending k, v)).
#[allow(clippy::too_many_arguments)]
pub fn attention_block(
    backend: &Backend,
    dims: &Dims,
    lw: &LayerWeights,
    x: &Tensor,
    positions: &Tensor,
    slots: &Tensor,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    attn: &AttnInputs<'_>,
) -> Result<Tensor> {
    let t = x.shape()[0];
    let layers::Qkv { q, k, v, .. } = layers::qkv(backend, dims, &lw.attn, x, positions)?;
    kv_append(backend, &k, &v, slots, k_cache, v_cache)?;
    let o = match attn {
        AttnInputs::Prefill {
            block_table,
            cu_seqlens,
            context_lens,
        } => paged_prefill(
            backend,
            &q,
            k_cache,
            v_cache,
            block_table,
            cu_seqlens,
            context_lens,
            Some(dims.scale),
        )?,
        AttnInputs::Decode {
            block_table,
            context_lens,
        } => paged_attention(
            backend,
            &q,
            k_cache,
            v_cache,
            block_table,
            context_lens,
            Some(dims.scale),
        )?,
    };
    let o = o.reshape(&[t, dims.n_heads * dims.head_dim])?;
    layers::attn_output(backend, &lw.attn, x, &o)
}

/// One full layer: the attention half over the paged cache, then the learner's FFN half
/// x + ffn(rmsnorm(x)).
#[allow(clippy::too_many_arguments)]
pub fn layer(
    backend: &Backend,
    dims: &Dims,
    lw: &LayerWeights,
    x: &Tensor,
    positions: &Tensor,
    slots: &Tensor,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    attn: &AttnInputs<'_>,
) -> Result<Tensor> {
    let x_mid = attention_block(
        backend, dims, lw, x, positions, slots, k_cache, v_cache, attn,
    )?;
    let (_, x_out) = layers::ffn_block(backend, dims, &lw.ffn_norm, &lw.ffn, x_mid)?;
    Ok(x_out)
}

/// Final norm and LM head of the rows `rows` of x[T, d]: logits [R, vocab].
pub fn lm_head_rows(
    backend: &Backend,
    w: &ModelWeights,
    dims: &Dims,
    x: &Tensor,
    rows: &[i32],
) -> Result<Tensor> {
    let all = rows.len() == x.shape()[0] && rows.iter().enumerate().all(|(i, &r)| r as usize == i);
    let (_, logits) = if all {
        layers::head(backend, dims, &w.final_norm, &w.lm_head, x)?
    } else {
        let idx = Tensor::from_slice(backend, &[rows.len()], rows)?;
        let picked = embedding(backend, x, &idx)?;
        layers::head(backend, dims, &w.final_norm, &w.lm_head, &picked)?
    };
    Ok(logits)
}

fn check_tokens(cfg: &ModelConfig, tokens: &[i32]) -> Result<()> {
    if let Some(&bad) = tokens.iter().find(|&&x| x < 0 || x as usize >= cfg.vocab) {
        return Err(Error::Invalid(format!(
            "token id {bad} is outside the model's vocabulary 0..{}",
            cfg.vocab
        )));
    }
    Ok(())
}

fn check_cache(cfg: &ModelConfig, cache: &KvCache) -> Result<()> {
    if cache.layers() != cfg.n_layers || cache.row_len() != cfg.n_kv_heads * cfg.head_dim {
        return Err(Error::Invalid(format!(
            "the KV cache has {} layers of rows {} wide; the model needs {} layers of {}",
            cache.layers(),
            cache.row_len(),
            cfg.n_layers,
            cfg.n_kv_heads * cfg.head_dim
        )));
    }
    Ok(())
}

/// Prefill: writes the chunk's K/V into the cache and returns the logits [R, vocab] of
/// `batch.logits_rows`.
pub fn prefill(
    backend: &Backend,
    w: &InferWeights,
    cache: &mut KvCache,
    batch: &PrefillBatch,
) -> Result<Tensor> {
    let _stage = sluice_kernels::nvtx::range_on(backend, "prefill");
    let cfg = &w.config;
    check_cache(cfg, cache)?;
    check_tokens(cfg, &batch.tokens)?;
    let t = batch.tokens.len();
    if t == 0 || batch.positions.len() != t || batch.slots.len() != t {
        return Err(Error::Invalid(format!(
            "prefill: {t} tokens, {} positions, {} slots (one each, at least one token)",
            batch.positions.len(),
            batch.slots.len()
        )));
    }
    if let Some(&r) = batch
        .logits_rows
        .iter()
        .find(|&&r| r < 0 || r as usize >= t)
    {
        return Err(Error::Invalid(format!(
            "prefill: logits row {r} is not a row of the {t} tokens"
        )));
    }
    let b = batch.context_lens.len();
    let dims = Dims::new(cfg)?;
    let tokens = Tensor::from_slice(backend, &[t], &batch.tokens)?;
    let positions = Tensor::from_slice(backend, &[t], &batch.positions)?;
    let slots = Tensor::from_slice(backend, &[t], &batch.slots)?;
    let cu = Tensor::from_slice(backend, &[batch.cu_seqlens.len()], &batch.cu_seqlens)?;
    let table = Tensor::from_slice(backend, &[b, batch.max_blocks], &batch.block_table)?;
    let ctx = Tensor::from_slice(backend, &[b], &batch.context_lens)?;
    let attn = AttnInputs::Prefill {
        block_table: &table,
        cu_seqlens: &cu,
        context_lens: &ctx,
    };
    let x = layer_stack(
        backend,
        w,
        &dims,
        cache,
        [&tokens, &positions, &slots],
        &attn,
    )?;
    lm_head_rows(backend, &w.weights, &dims, &x, &batch.logits_rows)
}

/// Embedding and every layer over the cache: the hidden states [T, d] of `tokens` at
/// `positions`, their K/V written at `slots` (the three index tensors, [T] I32 each).
fn layer_stack(
    backend: &Backend,
    w: &InferWeights,
    dims: &Dims,
    cache: &mut KvCache,
    [tokens, positions, slots]: [&Tensor; 3],
    attn: &AttnInputs<'_>,
) -> Result<Tensor> {
    let mut x = embedding(backend, &w.weights.embed, tokens)?;
    for (l, lw) in w.weights.layers.iter().enumerate() {
        x = layer(
            backend,
            dims,
            lw,
            &x,
            positions,
            slots,
            &mut cache.k[l],
            &mut cache.v[l],
            attn,
        )?;
    }
    Ok(x)
}

/// Decode: one token per sequence; writes its K/V and returns the logits [B, vocab].
pub fn decode(
    backend: &Backend,
    w: &InferWeights,
    cache: &mut KvCache,
    batch: &DecodeBatch,
) -> Result<Tensor> {
    let _stage = sluice_kernels::nvtx::range_on(backend, "decode");
    let cfg = &w.config;
    check_cache(cfg, cache)?;
    check_tokens(cfg, &batch.tokens)?;
    let b = batch.tokens.len();
    if b == 0
        || batch.positions.len() != b
        || batch.slots.len() != b
        || batch.context_lens.len() != b
    {
        return Err(Error::Invalid(format!(
            "decode: {b} tokens, {} positions, {} slots, {} context lengths (one each, at least one)",
            batch.positions.len(),
            batch.slots.len(),
            batch.context_lens.len()
        )));
    }
    let dims = Dims::new(cfg)?;
    let tokens = Tensor::from_slice(backend, &[b], &batch.tokens)?;
    let positions = Tensor::from_slice(backend, &[b], &batch.positions)?;
    let slots = Tensor::from_slice(backend, &[b], &batch.slots)?;
    let table = Tensor::from_slice(backend, &[b, batch.max_blocks], &batch.block_table)?;
    let ctx = Tensor::from_slice(backend, &[b], &batch.context_lens)?;
    let attn = AttnInputs::Decode {
        block_table: &table,
        context_lens: &ctx,
    };
    let x = layer_stack(
        backend,
        w,
        &dims,
        cache,
        [&tokens, &positions, &slots],
        &attn,
    )?;
    let rows: Vec<i32> = (0..b as i32).collect();
    lm_head_rows(backend, &w.weights, &dims, &x, &rows)
}

/// FLOPs of one token's pass through the layer stack at position `pos` (0-based): every matrix
/// product counted as 2 m n k (q, k, v, o projections; router; the k routed experts' or the
/// dense FFN's three matrices; the shared expert), and attention as 4 (pos + 1) H hd per layer
/// (QK^T and PV over pos + 1 keys). The LM head (run for sampled rows only) and elementwise ops
/// are not included. What a prefix-cache hit or a shared group prefill saves per token.
pub fn token_flops(cfg: &ModelConfig, pos: usize) -> u64 {
    let d = cfg.d_model as u64;
    let proj = 2 * d * (2 * cfg.q_dim() as u64 + 2 * cfg.kv_dim() as u64);
    let attn = 4 * (pos as u64 + 1) * cfg.q_dim() as u64;
    (0..cfg.n_layers)
        .map(|l| {
            let ffn = if cfg.is_dense_layer(l) {
                6 * d * cfg.dense_ffn_width().unwrap_or(0) as u64
            } else {
                let routed = 6 * d * (cfg.top_k * cfg.expert_ffn_dim) as u64;
                let router = 2 * d * cfg.n_experts as u64;
                let shared = 6 * d * cfg.shared_expert_width().unwrap_or(0) as u64;
                routed + router + shared
            };
            proj + attn + ffn
        })
        .sum()
}
