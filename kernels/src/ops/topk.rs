//! `topk` — router top-k over scores[T,E] (DESIGN.md section 3.2, kernels/cuda/topk.cu).
//!
//! For each row: the `k` largest scores as `values[T,k]` (F32) and their positions as
//! `indices[T,k]` (I32), sorted by value descending. The order is total, so the answer is unique
//! and every device returns the same bits:
//! - ties go to the LOWER index;
//! - NaN (any payload, either sign) ranks below every number, `-inf` included; NaNs tie with each
//!   other (lower index first), and a NaN is returned as the NaN it was when it must be selected
//!   (for example `k = E`);
//! - `-0.0` and `+0.0` are EQUAL (they compare equal as floats; the tie goes to the lower index),
//!   and each is returned with its own sign.
//!
//! Values are the input scores bit for bit (BF16 scores widened to F32, which is exact).
//! Limits of the kernel: 1 <= E <= 512, 1 <= k <= min(E, 16). The CPU reference
//! [`topk_reference`] has no limit besides k <= E; other families (MoE routing) call it directly.

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;
use half::bf16;

/// The largest row length (number of experts) the kernel takes.
pub const MAX_E: usize = 512;
/// The largest `k` the kernel takes.
pub const MAX_K: usize = 16;
/// Rows per 256-thread block: one warp per row (must match `kWarpsPerBlock` in topk.cu).
const ROWS_PER_BLOCK: usize = 8;

/// The order key of a score: unsigned comparison of keys is the op's order on values.
///
/// Numbers map by the usual sign flip (so -inf < finite < +inf), `-0.0` maps like `+0.0`, and
/// every NaN maps to 1, below -inf (whose key is 0x007f_ffff). Key 0 is left free; the kernel
/// uses it for "no element". Same function as `topk::order_key` in kernels/cuda/topk.cu.
pub fn order_key(x: f32) -> u32 {
    let mut bits = x.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return 1;
    }
    if bits == 0x8000_0000 {
        bits = 0;
    }
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

/// One key for (score, index): larger is ranked higher, and no two elements of a row share one,
/// so the top k of a row are unique. Lower index wins a tie because `!index` is larger.
fn rank_key(x: f32, index: usize) -> u64 {
    ((order_key(x) as u64) << 32) | (!(index as u32)) as u64
}

/// The top `k` of one row into `values` / `indices` (both of length k, 1 <= k <= row.len()).
/// `top` is scratch space, reused across the rows of one rayon task.
fn topk_row<S: Score>(row: &[S], values: &mut [f32], indices: &mut [i32], top: &mut Vec<u64>) {
    let k = values.len();
    top.clear();
    // `top` holds rank keys, sorted descending. Elements arrive in ascending index order, so an
    // element whose order key is <= the current k-th one's cannot enter: a smaller key loses,
    // and an equal key loses the tie to the lower index already held. For router rows (E <= 512,
    // k <= 16) almost every element stops at this one u32 comparison.
    let mut kth = 0u32;
    for (i, &x) in row.iter().enumerate() {
        let x = x.widen();
        let okey = order_key(x);
        if top.len() == k {
            if okey <= kth {
                continue;
            }
            top.pop();
        }
        let key = rank_key(x, i);
        let at = top.partition_point(|&t| t > key);
        top.insert(at, key);
        if top.len() == k {
            kth = (top[k - 1] >> 32) as u32;
        }
    }
    for ((key, v), ix) in top.iter().zip(values.iter_mut()).zip(indices.iter_mut()) {
        let i = !(*key as u32) as usize;
        *v = row[i].widen();
        *ix = i as i32;
    }
}

/// A score element the reference reads: f32, or bf16 widened exactly to f32.
trait Score: Copy + Send + Sync {
    fn widen(self) -> f32;
}
impl Score for f32 {
    fn widen(self) -> f32 {
        self
    }
}
impl Score for bf16 {
    fn widen(self) -> f32 {
        // Exact: the bf16 bits are the top half of the f32, NaN payloads included.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// The reference over rows of any score type into `values` / `indices` (t*k each; rayon over
/// rows).
fn topk_rows_into<S: Score>(
    scores: &[S],
    e: usize,
    k: usize,
    values: &mut [f32],
    indices: &mut [i32],
) {
    if k == 0 {
        return;
    }
    par::chunks2_mut(values, k, indices, k, 4 * e, |r0, v, ix| {
        let mut top = Vec::with_capacity(k + 1);
        for (i, (vr, ir)) in v.chunks_mut(k).zip(ix.chunks_mut(k)).enumerate() {
            let row = r0 + i;
            topk_row(&scores[row * e..(row + 1) * e], vr, ir, &mut top);
        }
    });
}

/// The CPU reference: top-k of each of the `t` rows of `scores` (row-major [t, e]), returned as
/// (values[t*k], indices[t*k]) in the order described in the module documentation. Rayon over
/// rows; each row is computed on its own, so the result does not depend on the thread count.
/// A length that is not `t * e`, or `k > e`, is an error naming `scores` or `k`.
pub fn topk_reference(
    scores: &[f32],
    t: usize,
    e: usize,
    k: usize,
) -> Result<(Vec<f32>, Vec<i32>)> {
    if scores.len() != t * e {
        return Err(Error::shape(
            "scores",
            format!("[T,E] = [{t},{e}] ({} elements)", t * e),
            &[scores.len()],
        ));
    }
    if k > e {
        return Err(Error::param(
            "k",
            format!("k = {k} exceeds the row length E = {e}"),
        ));
    }
    let mut values = vec![0f32; t * k];
    let mut indices = vec![0i32; t * k];
    topk_rows_into(scores, e, k, &mut values, &mut indices);
    Ok((values, indices))
}

/// Checks `scores` and `k` against the op's limits; returns (T, E).
fn check(backend: &Backend, scores: &Tensor, k: usize) -> Result<(usize, usize)> {
    let shape = scores.shape();
    if shape.len() != 2 {
        return Err(Error::shape(
            "scores",
            format!("[T,E] (rank 2, 1 <= E <= {MAX_E})"),
            shape,
        ));
    }
    let (t, e) = (shape[0], shape[1]);
    if e == 0 || e > MAX_E {
        return Err(Error::shape(
            "scores",
            format!("[T,E] with 1 <= E <= {MAX_E} (E is the number of experts)"),
            shape,
        ));
    }
    if t > i32::MAX as usize {
        return Err(Error::shape(
            "scores",
            format!("[T,E] with T <= {}", i32::MAX),
            shape,
        ));
    }
    if !scores.dtype().is_float() {
        return Err(Error::DType {
            tensor: "scores".into(),
            expected: "F32 or BF16".into(),
            got: scores.dtype().to_string(),
        });
    }
    if k == 0 || k > MAX_K || k > e {
        return Err(Error::param(
            "k",
            format!(
                "k = {k} is out of range: need 1 <= k <= min(E, {MAX_K}) = {} for scores of shape {shape:?}",
                e.min(MAX_K)
            ),
        ));
    }
    if !scores.is_on(backend.device()) {
        return Err(Error::Invalid(format!(
            "tensor `scores` lives on {}, but the op runs on {}; upload it first",
            scores.device_kind(),
            backend.device()
        )));
    }
    Ok((t, e))
}

/// Slots per lane: the smallest power of two C with 32*C >= E (E <= 512, so C <= 16).
fn slots_per_lane(e: usize) -> usize {
    e.div_ceil(32).next_power_of_two()
}

/// Which kernel of kernels/cuda/topk.cu runs on `emu` and `cuda`. Every version returns the same
/// bits (the order is total); they differ in speed only. See docs/perf/topk.md.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelVersion {
    /// A win clears the taken slot and rescans the lane (the default until a GPU measurement
    /// says otherwise).
    #[default]
    V1,
    /// Each lane also keeps its next-best; a win promotes it, and only a lane's second win in a
    /// row rescans.
    V2,
}

fn kernel_name(dtype: DType, slots: usize, version: KernelVersion) -> Result<&'static str> {
    use KernelVersion::{V1, V2};
    Ok(match (dtype, slots, version) {
        (DType::F32, 1, V1) => "topk_f32_c1",
        (DType::F32, 2, V1) => "topk_f32_c2",
        (DType::F32, 4, V1) => "topk_f32_c4",
        (DType::F32, 8, V1) => "topk_f32_c8",
        (DType::F32, 16, V1) => "topk_f32_c16",
        (DType::BF16, 1, V1) => "topk_bf16_c1",
        (DType::BF16, 2, V1) => "topk_bf16_c2",
        (DType::BF16, 4, V1) => "topk_bf16_c4",
        (DType::BF16, 8, V1) => "topk_bf16_c8",
        (DType::BF16, 16, V1) => "topk_bf16_c16",
        (DType::F32, 1, V2) => "topk_f32_c1_v2",
        (DType::F32, 2, V2) => "topk_f32_c2_v2",
        (DType::F32, 4, V2) => "topk_f32_c4_v2",
        (DType::F32, 8, V2) => "topk_f32_c8_v2",
        (DType::F32, 16, V2) => "topk_f32_c16_v2",
        (DType::BF16, 1, V2) => "topk_bf16_c1_v2",
        (DType::BF16, 2, V2) => "topk_bf16_c2_v2",
        (DType::BF16, 4, V2) => "topk_bf16_c4_v2",
        (DType::BF16, 8, V2) => "topk_bf16_c8_v2",
        (DType::BF16, 16, V2) => "topk_bf16_c16_v2",
        (d, c, v) => {
            return Err(Error::Invalid(format!(
                "topk has no {v:?} kernel for {d} scores with {c} slots per lane"
            )))
        }
    })
}

/// Router top-k of `scores[T,E]` (F32 or BF16) on `backend`: returns `values[T,k]` (F32) and
/// `indices[T,k]` (I32), sorted by value descending, ties to the lower index, NaN last.
/// `cpu` runs the reference; `emu` and `cuda` launch kernels/cuda/topk.cu. The outputs are
/// poisoned (all bits set) before the run, so an unwritten element cannot pass a comparison.
pub fn topk(backend: &Backend, scores: &Tensor, k: usize) -> Result<(Tensor, Tensor)> {
    let (t, _) = check(backend, scores, k)?;
    let mut values = Tensor::poisoned(backend, &[t, k], DType::F32)?;
    let mut indices = Tensor::poisoned(backend, &[t, k], DType::I32)?;
    topk_into(backend, scores, k, &mut values, &mut indices)?;
    Ok((values, indices))
}

/// Checks an output tensor: shape [T,k], dtype, device.
fn check_output(
    backend: &Backend,
    name: &str,
    out: &Tensor,
    t: usize,
    k: usize,
    dtype: DType,
) -> Result<()> {
    if out.shape() != [t, k] {
        return Err(Error::shape(
            name,
            format!("[T,k] = [{t},{k}]"),
            out.shape(),
        ));
    }
    out.expect_dtype(name, dtype)?;
    if !out.is_on(backend.device()) {
        return Err(Error::Invalid(format!(
            "tensor `{name}` lives on {}, but the op runs on {}",
            out.device_kind(),
            backend.device()
        )));
    }
    Ok(())
}

/// [`topk`] into caller-owned outputs (`values[T,k]` F32, `indices[T,k]` I32 on the same
/// device): no allocation, so a caller in a loop (the MoE router, the bench) pays for the op only.
pub fn topk_into(
    backend: &Backend,
    scores: &Tensor,
    k: usize,
    values: &mut Tensor,
    indices: &mut Tensor,
) -> Result<()> {
    topk_into_version(
        backend,
        scores,
        k,
        values,
        indices,
        KernelVersion::default(),
    )
}

/// [`topk_into`] with an explicit kernel version (benches and tests compare them; `cpu` ignores
/// it and runs the reference).
pub fn topk_into_version(
    backend: &Backend,
    scores: &Tensor,
    k: usize,
    values: &mut Tensor,
    indices: &mut Tensor,
    version: KernelVersion,
) -> Result<()> {
    let (t, e) = check(backend, scores, k)?;
    check_output(backend, "values", values, t, k, DType::F32)?;
    check_output(backend, "indices", indices, t, k, DType::I32)?;
    if let Backend::Cpu = backend {
        let (v, ix) = (
            values.host_slice_mut::<f32>()?,
            indices.host_slice_mut::<i32>()?,
        );
        match scores.dtype() {
            DType::F32 => topk_rows_into(scores.host_slice::<f32>()?, e, k, v, ix),
            // BF16 -> F32 is exact and keeps the order, so the F32 reference is the BF16 one;
            // rows are widened element by element, not copied to an f32 buffer first.
            _ => topk_rows_into(scores.host_slice::<bf16>()?, e, k, v, ix),
        }
        return Ok(());
    }
    if t == 0 {
        return Ok(());
    }
    let slots = slots_per_lane(e);
    let name = kernel_name(scores.dtype(), slots, version)?;
    // Vector loads read 4 elements at 4-element-aligned positions: valid when each row starts
    // aligned (E % 4 == 0) and the base is aligned for 4 elements.
    let align = 4 * scores.dtype().size_bytes() as u64;
    let vec_ok = slots >= 4 && e % 4 == 0 && scores.kernel_address()? % align == 0;
    // One warp per row, 8 rows per block; the kernel reads scores and writes every element of
    // both outputs (k per row), whose shapes and devices were checked above.
    backend.launch(
        &Launch::new(
            name,
            [blocks_for(t, ROWS_PER_BLOCK), 1, 1],
            [32 * ROWS_PER_BLOCK as u32, 1, 1],
        )
        .arg_tensor(scores)
        .arg_i32(t as i32)
        .arg_i32(e as i32)
        .arg_i32(k as i32)
        .arg_i32(vec_ok as i32)
        .arg_tensor(values)
        .arg_tensor(indices),
    )
}

fn run(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let scores = call.tensor("scores")?;
    let k = call.param_usize("k")?;
    let (values, indices) = topk(backend, scores, k)?;
    Ok(vec![("values", values), ("indices", indices)])
}

/// The `sluice kernel topk` row (DESIGN.md section 7).
pub static SPEC: OpSpec = OpSpec {
    name: "topk",
    summary: "router top-k per row: values and indices sorted descending, ties to the lower \
              index, NaN below -inf, -0.0 == +0.0 (E <= 512, k <= 16)",
    inputs: &[TensorSpec {
        name: "scores",
        shape: "[T,E]",
        dtypes: "F32|BF16",
    }],
    params: &[ParamSpec {
        name: "k",
        default: None,
        help: "how many to keep per row, 1 <= k <= min(E, 16); required (no default)",
    }],
    outputs: &[
        TensorSpec {
            name: "values",
            shape: "[T,k]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "indices",
            shape: "[T,k]",
            dtypes: "I32",
        },
    ],
    run,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_key_orders_specials() {
        let ordered = [
            f32::NAN,
            f32::NEG_INFINITY,
            -f32::MAX,
            -1.0,
            -f32::MIN_POSITIVE,
            -1e-45,
            0.0,
            1e-45,
            1.0,
            f32::MAX,
            f32::INFINITY,
        ];
        for w in ordered.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{} < {}", w[0], w[1]);
        }
        assert_eq!(order_key(-0.0), order_key(0.0));
        assert_eq!(order_key(-f32::NAN), order_key(f32::NAN));
        assert_eq!(order_key(f32::from_bits(0x7f80_0001)), 1);
        assert!(order_key(f32::NEG_INFINITY) > 1);
    }

    #[test]
    fn slots() {
        let got: Vec<usize> = [1, 32, 33, 64, 65, 128, 129, 256, 257, 512]
            .iter()
            .map(|&e| slots_per_lane(e))
            .collect();
        assert_eq!(got, [1, 1, 2, 2, 4, 4, 8, 8, 16, 16]);
    }
}
