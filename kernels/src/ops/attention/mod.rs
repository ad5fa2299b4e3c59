//! Training attention (DESIGN.md 3.5): `attention_forward` / `attention_backward` over varlen
//! packed batches (cu_seqlens), causal or not, with GQA.
//!
//! Shapes: q[T,H,D], k[T,Hkv,D], v[T,Hkv,D] (F32 or BF16, all the same dtype), cu_seqlens[B+1]
//! I32 (sequence b holds packed tokens cu_seqlens[b] .. cu_seqlens[b+1]-1; cu_seqlens[0] = 0,
//! non-decreasing, cu_seqlens[B] = T). Head h reads kv head h / (H / Hkv). Outputs are F32:
//! out[T,H,D] and the per-row logsumexp lse[T,H] (natural log, of the scaled scores), which the
//! backward reuses. BF16 inputs are widened to f32 exactly; every sum and the softmax statistics
//! are f32.
//!
//! Two paths (docs/perf/attention.md, "Two paths, one selector"): v2, the tensor-core tiles of
//! kernels/cuda/attention_tc.cu for BF16 inputs with D <= 128 (its order and CPU twin in
//! [`crate::ops::attention_tile`]), and v1, below, for the rest or with `SLUICE_ATTENTION=simt`.
//!
//! Files: `row.rs` (one row in either order), `reference.rs` (the CPU forward and backward),
//! `spec.rs` (the `sluice kernel` rows); this file holds the shapes, the checks and the dispatch.
//!
//! THE ORDER (v1). A query row visits its keys in chunks of [`KEY_CHUNK`] = 32 keys counted from
//! the first key of its sequence, ascending, with the online-softmax update of [`RowState`] per
//! chunk. The CUDA kernels (kernels/cuda/attention.cu, kernels/cuda/paged_attention.cu) call one
//! device function, `chunk_step` of kernels/cuda/common/attention_chunk.cuh, with the same
//! operations in the same order; [`RowState`] is its Rust twin and the only Rust routine that
//! computes attention rows: the training reference here and the decode reference of
//! [`crate::ops::paged_attention`] both go through [`attend_row`]. So a row is a pure function
//! of its query and its keys/values (batch-invariant), and the paged decode of a query equals the
//! training forward's output for it bit for bit, on each device.

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::ops::attention_tile::{self, attend_row_tiles, RowOrder};
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;

// The FMA dispatch of the CPU reference (defined before the submodules, which use it).
/// Defines `$name`, which runs `$body_fn` compiled with hardware FMA (and AVX2 vectors) when the
/// CPU has them. The results are the same either way (a fused multiply-add rounds once, in
/// hardware or in the software `fmaf`, and vectorisation only spans independent output dims); without it every `mul_add` of the reference is a library call, several
/// times slower. The bodies are `#[inline(always)]` so they compile into the FMA-enabled wrapper.
macro_rules! fma_dispatch {
    ($(#[$m:meta])* $vis:vis fn $name:ident<$($lt:lifetime,)* $($g:ident: $bound:path),*>($($a:ident: $t:ty),* $(,)?) -> $r:ty = $body_fn:ident;) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name<$($lt,)* $($g: $bound),*>($($a: $t),*) -> $r {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn fast<$($lt,)* $($g: $bound),*>($($a: $t),*) -> $r {
                    $body_fn($($a),*)
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: `fast` only needs AVX2 and FMA instructions, and the CPU has them.
                    return unsafe { fast($($a),*) };
                }
            }
            $body_fn($($a),*)
        }
    };
}

mod reference;
mod row;
mod spec;

pub use reference::{attention_backward_reference, attention_forward_reference};
pub use row::{attend_row, dot_fma, KeyValueFn, RowState};
pub(crate) use row::{dots8, DOT_LANES};
pub use spec::{scale_param, BACKWARD_SPEC, FORWARD_SPEC, SCALE_DEFAULT};

/// Keys per online-softmax step (the warp size: lane j of the warp owns key j of a chunk).
pub const KEY_CHUNK: usize = 32;
/// The largest head dimension the kernels take.
pub const MAX_HEAD_DIM: usize = 256;
/// Warps per block of the training kernels (one warp per row; must match attention.cu).
const WARPS: usize = 4;

/// The sizes of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// Packed tokens.
    pub t: usize,
    /// Query heads.
    pub h: usize,
    /// Key/value heads (divides `h`).
    pub hkv: usize,
    /// Head dimension.
    pub d: usize,
}

impl AttnDims {
    fn check_lens(&self, q: usize, k: usize, v: usize) -> Result<()> {
        let (nq, nk) = (self.t * self.h * self.d, self.t * self.hkv * self.d);
        for (name, got, want, shape) in [
            ("q", q, nq, "[T,H,D]"),
            ("k", k, nk, "[T,Hkv,D]"),
            ("v", v, nk, "[T,Hkv,D]"),
        ] {
            if got != want {
                return Err(Error::Invalid(format!(
                    "`{name}` has {got} elements; {shape} with {self:?} needs {want}"
                )));
            }
        }
        if self.hkv == 0 || !self.h.is_multiple_of(self.hkv) {
            return Err(Error::param(
                "Hkv",
                format!(
                    "{} query heads are not a multiple of {} kv heads",
                    self.h, self.hkv
                ),
            ));
        }
        if self.d == 0 || self.d > MAX_HEAD_DIM {
            return Err(Error::param(
                "D",
                format!("head dim {} is not in 1..={MAX_HEAD_DIM}", self.d),
            ));
        }
        Ok(())
    }
}

/// Checks cu_seqlens: starts at 0, non-decreasing, ends at `t`.
pub fn check_cu_seqlens(cu: &[i32], t: usize) -> Result<()> {
    let bad = |why: String| Error::Invalid(format!("`cu_seqlens`: {why}"));
    if cu.len() < 2 {
        return Err(bad(format!(
            "has {} entries; expected [B+1] with B >= 1",
            cu.len()
        )));
    }
    if cu[0] != 0 {
        return Err(bad(format!("starts at {}; expected 0", cu[0])));
    }
    if let Some(w) = cu.windows(2).position(|w| w[1] < w[0]) {
        return Err(bad(format!(
            "decreases at entry {}: {} then {}",
            w + 1,
            cu[w],
            cu[w + 1]
        )));
    }
    if cu[cu.len() - 1] as i64 != t as i64 {
        return Err(bad(format!(
            "ends at {}; expected T = {t} (the tokens of q)",
            cu[cu.len() - 1]
        )));
    }
    Ok(())
}

/// The sequence holding packed token `t`: its start and end.
fn sequence_of(cu: &[i32], t: usize) -> (usize, usize) {
    // The last b with cu[b] <= t (empty sequences before it are skipped).
    let b = cu.partition_point(|&c| c as usize <= t) - 1;
    (cu[b] as usize, cu[b + 1] as usize)
}

/// The length of the longest sequence of a varlen batch (what a row's work is sized by).
fn longest_sequence(cu: &[i32]) -> usize {
    cu.windows(2)
        .map(|w| (w[1] - w[0]).max(0) as usize)
        .max()
        .unwrap_or(0)
        .max(1)
}

/// The keys query `t` sees: the start of its sequence and how many keys.
fn key_range(cu: &[i32], t: usize, causal: bool) -> (usize, usize) {
    let (s0, s1) = sequence_of(cu, t);
    (s0, if causal { t + 1 - s0 } else { s1 - s0 })
}

/// The forward's outputs: out[T,H,D] and lse[T,H], both F32.
#[derive(Debug)]
pub struct AttentionOutput {
    pub out: Tensor,
    pub lse: Tensor,
}

/// The backward's outputs, F32: dq[T,H,D], dk[T,Hkv,D], dv[T,Hkv,D].
#[derive(Debug)]
pub struct AttentionGrads {
    pub dq: Tensor,
    pub dk: Tensor,
    pub dv: Tensor,
}

/// Checks q, k, v and cu_seqlens (shapes, dtypes, values); returns the sizes.
pub fn validate_inputs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
) -> Result<AttnDims> {
    q.expect_rank("q", 3, "[T,H,D]")?;
    if !q.dtype().is_float() {
        return Err(Error::DType {
            tensor: "q".into(),
            expected: "F32 or BF16".into(),
            got: q.dtype().to_string(),
        });
    }
    let (t, h, d) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    k.expect_rank("k", 3, "[T,Hkv,D]")?;
    let hkv = k.shape()[1];
    let kv_shape = format!("[T,Hkv,D] = [{t},Hkv,{d}] (T and D from q)");
    if k.shape()[0] != t || k.shape()[2] != d {
        return Err(Error::shape("k", kv_shape, k.shape()));
    }
    if v.shape() != k.shape() {
        return Err(Error::shape(
            "v",
            format!("[T,Hkv,D] = {:?} (the shape of k)", k.shape()),
            v.shape(),
        ));
    }
    k.expect_dtype("k", q.dtype())?;
    v.expect_dtype("v", q.dtype())?;
    if hkv == 0 || !h.is_multiple_of(hkv) {
        return Err(Error::shape(
            "k",
            format!("[T,Hkv,D] with Hkv >= 1 dividing H = {h} (GQA)"),
            k.shape(),
        ));
    }
    if d == 0 || d > MAX_HEAD_DIM {
        return Err(Error::shape(
            "q",
            format!("[T,H,D] with D in 1..={MAX_HEAD_DIM}"),
            q.shape(),
        ));
    }
    if h == 0 {
        return Err(Error::shape("q", "[T,H,D] with H >= 1", q.shape()));
    }
    if t > i32::MAX as usize / 2 {
        return Err(Error::shape("q", "[T,H,D] with T < 2^30", q.shape()));
    }
    cu_seqlens.expect_rank("cu_seqlens", 1, "[B+1]")?;
    cu_seqlens.expect_dtype("cu_seqlens", DType::I32)?;
    // On a device only in debug mode (a copy and a sync): the packed batch that builds them
    // checks them (sluice_model::PackedBatch).
    if crate::debug::reads_back(cu_seqlens) {
        check_cu_seqlens(&cu_seqlens.to_vec::<i32>()?, t)?;
    }
    Ok(AttnDims { t, h, hkv, d })
}

/// The softmax scale: the given one (finite) or 1/sqrt(D).
pub fn resolve_scale(scale: Option<f32>, d: usize) -> Result<f32> {
    match scale {
        None => Ok(1.0 / (d as f32).sqrt()),
        Some(s) if s.is_finite() => Ok(s),
        Some(s) => Err(Error::param("scale", format!("{s} is not a finite number"))),
    }
}

fn kernel_name(dtype: DType, f32_name: &'static str, bf16_name: &'static str) -> &'static str {
    if dtype == DType::BF16 {
        bf16_name
    } else {
        f32_name
    }
}

/// The attention forward on `backend`: out[T,H,D] and lse[T,H] (F32). `scale` defaults to
/// 1/sqrt(D).
pub fn attention_forward(
    backend: &Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttentionOutput> {
    attention_forward_on(
        attention_tile::attention_path()?,
        backend,
        q,
        k,
        v,
        cu_seqlens,
        causal,
        scale,
    )
}

/// [`attention_forward`] on an explicit attention path (v1 or v2) instead of the process's.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_on(
    path: attention_tile::AttentionPath,
    backend: &Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttentionOutput> {
    let dims = validate_inputs(q, k, v, cu_seqlens)?;
    let scale = resolve_scale(scale, dims.d)?;
    let AttnDims { t, h, hkv, d } = dims;
    let order = RowOrder::of(path, q.dtype(), d);
    match backend {
        Backend::Cpu => {
            let mut out = vec![0.0f32; t * h * d];
            let mut lse = vec![0.0f32; t * h];
            attention_forward_reference(
                &q.f32_data()?,
                &k.f32_data()?,
                &v.f32_data()?,
                &cu_seqlens.to_vec::<i32>()?,
                dims,
                causal,
                scale,
                order,
                &mut out,
                &mut lse,
            )?;
            Ok(AttentionOutput {
                out: Tensor::from_slice(backend, &[t, h, d], &out)?,
                lse: Tensor::from_slice(backend, &[t, h], &lse)?,
            })
        }
        _ => {
            let out = Tensor::poisoned(backend, &[t, h, d], DType::F32)?;
            let lse = Tensor::poisoned(backend, &[t, h], DType::F32)?;
            if t > 0 && order == RowOrder::Wgmma {
                // v3: every (query tile, head) block writes its rows' out and lse once.
                crate::ops::attention_wgmma::launch_forward(
                    backend,
                    q,
                    k,
                    v,
                    cu_seqlens,
                    (t, h, hkv, d),
                    causal,
                    scale,
                    &out,
                    &lse,
                )?;
            } else if t > 0 && order == RowOrder::Tiles {
                // Every (query tile, head) block writes its rows' out and lse once.
                attention_tile::launch_forward(
                    backend,
                    q,
                    k,
                    v,
                    cu_seqlens,
                    (t, h, hkv, d),
                    causal,
                    scale,
                    &out,
                    &lse,
                )?;
            } else if t > 0 {
                let b = cu_seqlens.numel() - 1;
                let name =
                    kernel_name(q.dtype(), "attention_forward_f32", "attention_forward_bf16");
                // The kernel reads q/k/v rows of tokens < T and cu_seqlens[0..=B], all checked
                // above; it writes each out/lse row exactly once.
                backend.launch(
                    &Launch::new(
                        name,
                        [blocks_for(t, WARPS), h as u32, 1],
                        [32 * WARPS as u32, 1, 1],
                    )
                    .arg_tensor(q)
                    .arg_tensor(k)
                    .arg_tensor(v)
                    .arg_tensor(cu_seqlens)
                    .arg_i32(b as i32)
                    .arg_i32(t as i32)
                    .arg_i32(h as i32)
                    .arg_i32(hkv as i32)
                    .arg_i32(d as i32)
                    .arg_i32(causal as i32)
                    .arg_f32(scale)
                    .arg_tensor(&out)
                    .arg_tensor(&lse),
                )?;
            }
            Ok(AttentionOutput { out, lse })
        }
    }
}

/// The attention backward on `backend`: runs the forward for `out` and `lse`, then the backward.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    backend: &Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    dout: &Tensor,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttentionGrads> {
    let fwd = attention_forward(backend, q, k, v, cu_seqlens, causal, scale)?;
    attention_backward_saved(
        backend, q, k, v, cu_seqlens, &fwd.out, &fwd.lse, dout, causal, scale,
    )
}

/// The attention backward from the forward's saved `out` [T,H,D] and `lse` [T,H] (F32), and
/// dout[T,H,D] (the dtype of q, or F32 for BF16 inputs). Returns dq, dk, dv (F32).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_saved(
    backend: &Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttentionGrads> {
    attention_backward_saved_on(
        attention_tile::attention_path()?,
        backend,
        q,
        k,
        v,
        cu_seqlens,
        out,
        lse,
        dout,
        causal,
        scale,
    )
}

/// [`attention_backward_saved`] on an explicit attention path (v1 or v2) instead of the
/// process's. BF16 inputs with a BF16 dout take v2's kernels on the tile path; an F32 dout takes
/// v1 on widened copies (the tile kernels' operands are bf16).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_saved_on(
    path: attention_tile::AttentionPath,
    backend: &Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttentionGrads> {
    let dims = validate_inputs(q, k, v, cu_seqlens)?;
    let scale = resolve_scale(scale, dims.d)?;
    let AttnDims { t, h, hkv, d } = dims;
    let q_shape = format!("[T,H,D] = [{t},{h},{d}] (the shape of q)");
    if dout.shape() != q.shape() {
        return Err(Error::shape("dout", q_shape, dout.shape()));
    }
    if dout.dtype() == DType::F32 && q.dtype() == DType::BF16 && !matches!(backend, Backend::Cpu) {
        // An f32 gradient for bf16 inputs: the bf16 kernels widen every input to f32 exactly,
        // so running the f32 kernels on widened copies gives the same bits a mixed kernel would
        // (at the cost of the copies).
        let widen = |t: &Tensor| t.cast(backend, DType::F32);
        return attention_backward_saved_on(
            path,
            backend,
            &widen(q)?,
            &widen(k)?,
            &widen(v)?,
            cu_seqlens,
            out,
            lse,
            dout,
            causal,
            Some(scale),
        );
    }
    if dout.dtype() != q.dtype() && !(dout.dtype() == DType::F32 && q.dtype() == DType::BF16) {
        return Err(Error::DType {
            tensor: "dout".into(),
            expected: format!("{} (the dtype of q) or F32", q.dtype()),
            got: dout.dtype().to_string(),
        });
    }
    if out.shape() != q.shape() {
        return Err(Error::shape("out", q_shape, out.shape()));
    }
    out.expect_dtype("out", DType::F32)?;
    if lse.shape() != [t, h] {
        return Err(Error::shape(
            "lse",
            format!("[T,H] = [{t},{h}]"),
            lse.shape(),
        ));
    }
    lse.expect_dtype("lse", DType::F32)?;
    // The order of the backward: the tiles' only when every operand is bf16 (v3's kernels
    // compute v2's order: RowOrder::backward).
    let kernels = RowOrder::of(path, dout.dtype(), d).min_with(RowOrder::of(path, q.dtype(), d));
    let order = kernels.backward();
    match backend {
        Backend::Cpu => {
            let mut dq = vec![0.0f32; t * h * d];
            let mut dk = vec![0.0f32; t * hkv * d];
            let mut dv = vec![0.0f32; t * hkv * d];
            attention_backward_reference(
                &q.f32_data()?,
                &k.f32_data()?,
                &v.f32_data()?,
                &cu_seqlens.to_vec::<i32>()?,
                dims,
                causal,
                scale,
                order,
                &out.to_vec::<f32>()?,
                &lse.to_vec::<f32>()?,
                &dout.f32_data()?,
                &mut dq,
                &mut dk,
                &mut dv,
            )?;
            Ok(AttentionGrads {
                dq: Tensor::from_slice(backend, &[t, h, d], &dq)?,
                dk: Tensor::from_slice(backend, &[t, hkv, d], &dk)?,
                dv: Tensor::from_slice(backend, &[t, hkv, d], &dv)?,
            })
        }
        _ => {
            let dq = Tensor::poisoned(backend, &[t, h, d], DType::F32)?;
            let dk = Tensor::poisoned(backend, &[t, hkv, d], DType::F32)?;
            let dv = Tensor::poisoned(backend, &[t, hkv, d], DType::F32)?;
            if t == 0 {
                return Ok(AttentionGrads { dq, dk, dv });
            }
            if kernels == RowOrder::Wgmma {
                // v3: the same prep, then the two passes on wgmma, each output row written once.
                crate::ops::attention_wgmma::launch_backward(
                    backend,
                    [q, k, v, cu_seqlens, dout, out, lse],
                    (t, h, hkv, d),
                    causal,
                    scale,
                    [&dq, &dk, &dv],
                )?;
                return Ok(AttentionGrads { dq, dk, dv });
            }
            if order == RowOrder::Tiles {
                // delta and lse head-major, then the two passes, each output row written once.
                attention_tile::launch_backward(
                    backend,
                    [q, k, v, cu_seqlens, dout, out, lse],
                    (t, h, hkv, d),
                    causal,
                    scale,
                    [&dq, &dk, &dv],
                )?;
                return Ok(AttentionGrads { dq, dk, dv });
            }
            let delta = Tensor::poisoned(backend, &[t, h], DType::F32)?;
            let bf = q.dtype() == DType::BF16;
            let b = (cu_seqlens.numel() - 1) as i32;
            let rows = t * h;
            // delta[r] = dout[r] . out[r]: one thread per row, each written once.
            backend.launch(
                &Launch::new(
                    if bf {
                        "attention_bwd_delta_bf16"
                    } else {
                        "attention_bwd_delta_f32"
                    },
                    [blocks_for(rows, 128), 1, 1],
                    [128, 1, 1],
                )
                .arg_tensor(dout)
                .arg_tensor(out)
                .arg_i32(rows as i32)
                .arg_i32(d as i32)
                .arg_tensor(&delta),
            )?;
            // dq: one warp per (token, head) row, each written once.
            backend.launch(
                &Launch::new(
                    if bf {
                        "attention_bwd_dq_bf16"
                    } else {
                        "attention_bwd_dq_f32"
                    },
                    [blocks_for(t, WARPS), h as u32, 1],
                    [32 * WARPS as u32, 1, 1],
                )
                .arg_tensor(q)
                .arg_tensor(k)
                .arg_tensor(v)
                .arg_tensor(cu_seqlens)
                .arg_tensor(dout)
                .arg_tensor(lse)
                .arg_tensor(&delta)
                .arg_i32(b)
                .arg_i32(t as i32)
                .arg_i32(h as i32)
                .arg_i32(hkv as i32)
                .arg_i32(d as i32)
                .arg_i32(causal as i32)
                .arg_f32(scale)
                .arg_tensor(&dq),
            )?;
            // dk, dv: one warp per (token, kv head) row, each written once (no atomics).
            backend.launch(
                &Launch::new(
                    if bf {
                        "attention_bwd_dkdv_bf16"
                    } else {
                        "attention_bwd_dkdv_f32"
                    },
                    [blocks_for(t, WARPS), hkv as u32, 1],
                    [32 * WARPS as u32, 1, 1],
                )
                .arg_tensor(q)
                .arg_tensor(k)
                .arg_tensor(v)
                .arg_tensor(cu_seqlens)
                .arg_tensor(dout)
                .arg_tensor(lse)
                .arg_tensor(&delta)
                .arg_i32(b)
                .arg_i32(t as i32)
                .arg_i32(h as i32)
                .arg_i32(hkv as i32)
                .arg_i32(d as i32)
                .arg_i32(causal as i32)
                .arg_f32(scale)
                .arg_tensor(&dk)
                .arg_tensor(&dv),
            )?;
            Ok(AttentionGrads { dq, dk, dv })
        }
    }
}
