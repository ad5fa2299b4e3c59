//! The `sluice kernel` rows of the paged cache ops: paged_attention, kv_append, paged_prefill.

use super::{kv_append, paged_attention, paged_prefill};
use crate::device::Backend;
use crate::error::Result;
use crate::ops::attention::{scale_param, SCALE_DEFAULT};
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};

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
