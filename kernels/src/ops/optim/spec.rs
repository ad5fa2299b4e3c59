//! `sluice kernel` rows: one step over flat F32 parameter vectors (AdamW: one segment covering
//! the whole vector; Muon: a block table given as offsets and row strides).

use super::{
    adamw, cast_bf16_into, muon_apply, muon_gather, sq_norm, AdamWStep, BlockTable, MuonApply,
    MuonMomentum, Segment, SegmentTable, StridedBlock,
};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;

/// The default of muon_apply's `scale`: the model's RMS-matching update scale of the blocks.
const MUON_SCALE_DEFAULT: &str = "0.2*sqrt(max(r,c))";

/// A 1-D F32 input of the runner, or an error naming it and `[N]`.
/// With `len = Some((n, of))` it must have the length `n` of the input `of`.
fn flat_input<'a>(call: &'a OpCall, name: &str, len: Option<(usize, &str)>) -> Result<&'a Tensor> {
    let t = call.tensor(name)?;
    t.expect_dtype(name, DType::F32)?;
    match len {
        None => t.expect_rank(name, 1, "[N]")?,
        Some((n, of)) if t.shape() != [n] => {
            return Err(Error::shape(
                name,
                format!("[N] = [{n}] (the length of `{of}`)"),
                t.shape(),
            ))
        }
        Some(_) => {}
    }
    Ok(t)
}

/// The runner's block table: `offsets[n]` and `row_strides[n]` (I32, >= 0) as strided blocks.
fn runner_blocks(call: &OpCall, n: usize) -> Result<Vec<StridedBlock>> {
    let mut cols = Vec::with_capacity(2);
    for name in ["offsets", "row_strides"] {
        let t = call.tensor(name)?;
        if t.shape() != [n] {
            return Err(Error::shape(
                name,
                format!("[n] = [{n}] (one entry per block)"),
                t.shape(),
            ));
        }
        t.expect_dtype(name, DType::I32)?;
        let v = t.to_vec::<i32>()?;
        if let Some((k, &x)) = v.iter().enumerate().find(|(_, &x)| x < 0) {
            return Err(Error::Invalid(format!("`{name}`[{k}] = {x} is negative")));
        }
        cols.push(v);
    }
    Ok(cols[0]
        .iter()
        .zip(&cols[1])
        .map(|(&o, &s)| StridedBlock {
            offset: o as usize,
            row_stride: s as usize,
        })
        .collect())
}

fn run_adamw(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let p = flat_input(call, "p", None)?;
    let n = p.numel();
    let g = flat_input(call, "g", Some((n, "p")))?;
    let (m, v) = (
        flat_input(call, "m", Some((n, "p")))?,
        flat_input(call, "v", Some((n, "p")))?,
    );
    let step = call.param_usize("step")?;
    if step == 0 || step > i32::MAX as usize {
        return Err(Error::param(
            "step",
            format!(
                "{step} is not in 1..=2^31-1 (the step count t of the bias correction, from 1)"
            ),
        ));
    }
    let (beta1, beta2) = (call.param_f32("beta1")?, call.param_f32("beta2")?);
    // The bias corrections as the model's optimizer computes them (f64 on the host).
    let hp = AdamWStep {
        lr: call.param_f32("lr")?,
        beta1,
        beta2,
        eps: call.param_f32("eps")?,
        bc1: (1.0 - (beta1 as f64).powi(step as i32)) as f32,
        bc2: (1.0 - (beta2 as f64).powi(step as i32)) as f32,
        grad_scale: call.param_f32("grad_scale")?,
    };
    hp.validate()?;
    let table = SegmentTable::new(
        backend,
        vec![Segment {
            start: 0,
            len: n,
            weight_decay: call.param_f32("weight_decay")?,
        }],
        n,
    )?;
    let mut p = p.to_backend(backend)?;
    let mut m = m.to_backend(backend)?;
    let mut v = v.to_backend(backend)?;
    adamw(backend, &mut p, g, &mut m, &mut v, &table, &hp)?;
    Ok(vec![("p", p), ("m", m), ("v", v)])
}

fn run_sq_norm(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let x = flat_input(call, "x", None)?;
    let s = sq_norm(backend, x)? as f32;
    Ok(vec![("sq_norm", Tensor::from_slice(backend, &[1], &[s])?)])
}

fn run_muon_gather(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let g = flat_input(call, "g", None)?;
    let n = g.numel();
    let mom = flat_input(call, "mom", Some((n, "g")))?;
    let offsets = call.tensor("offsets")?;
    offsets.expect_rank("offsets", 1, "[n]")?;
    let blocks = runner_blocks(call, offsets.numel())?;
    let (rows, cols) = (call.param_usize("r")?, call.param_usize("c")?);
    let hp = MuonMomentum {
        mu: call.param_f32("mu")?,
        grad_scale: call.param_f32("grad_scale")?,
        nesterov: call.param_bool("nesterov")?,
    };
    hp.validate()?;
    let table = BlockTable::new(backend, blocks, rows, cols, n)?;
    let mut mom = mom.to_backend(backend)?;
    let x = muon_gather(backend, g, &mut mom, &table, &hp)?;
    Ok(vec![("x", x), ("mom", mom)])
}

fn run_muon_apply(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let p = flat_input(call, "p", None)?;
    let x = call.tensor("x")?;
    x.expect_rank("x", 3, "[n,r,c]")?;
    x.expect_dtype("x", DType::F32)?;
    let (nb, rows, cols) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    let blocks = runner_blocks(call, nb)?;
    let scale = match call.param("scale")?.trim() {
        MUON_SCALE_DEFAULT => (0.2 * (rows.max(cols) as f64).sqrt()) as f32,
        _ => call.param_f32("scale")?,
    };
    let hp = MuonApply {
        lr: call.param_f32("lr")?,
        weight_decay: call.param_f32("weight_decay")?,
        scale,
    };
    hp.validate()?;
    let table = BlockTable::new(backend, blocks, rows, cols, p.numel())?;
    let mut p = p.to_backend(backend)?;
    muon_apply(backend, &mut p, x, &table, &hp)?;
    Ok(vec![("p", p)])
}

fn run_cast_bf16(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let x = call.tensor("x")?;
    x.expect_dtype("x", DType::F32)?;
    let mut y = Tensor::poisoned(backend, x.shape(), DType::BF16)?;
    cast_bf16_into(backend, x, &mut y)?;
    Ok(vec![("y", y)])
}

const F32_FLAT: &str = "F32";

/// `sluice kernel adamw`.
pub static ADAMW_SPEC: OpSpec = OpSpec {
    name: "adamw",
    summary: "one AdamW step over a flat parameter vector: g' = grad_scale g, m = b1 m + (1-b1) g', v = b2 v + (1-b2) g'^2, p = p (1 - lr wd) - lr (m/bc1) / (sqrt(v/bc2) + eps), bc = 1 - beta^step (defaults: the model's OptimConfig)",
    inputs: &[
        TensorSpec { name: "p", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "g", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "m", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "v", shape: "[N]", dtypes: F32_FLAT },
    ],
    params: &[
        ParamSpec { name: "lr", default: Some("3e-3"), help: "learning rate (>= 0)" },
        ParamSpec { name: "beta1", default: Some("0.9"), help: "first-moment decay, in [0, 1)" },
        ParamSpec { name: "beta2", default: Some("0.95"), help: "second-moment decay, in [0, 1)" },
        ParamSpec { name: "eps", default: Some("1e-8"), help: "denominator epsilon (> 0)" },
        ParamSpec { name: "weight_decay", default: Some("0.1"), help: "decoupled weight decay (>= 0)" },
        ParamSpec { name: "step", default: Some("1"), help: "the step count t (from 1) of the bias corrections" },
        ParamSpec { name: "grad_scale", default: Some("1"), help: "multiplies g first (gradient clipping)" },
    ],
    outputs: &[
        TensorSpec { name: "p", shape: "[N]", dtypes: "F32" },
        TensorSpec { name: "m", shape: "[N]", dtypes: "F32" },
        TensorSpec { name: "v", shape: "[N]", dtypes: "F32" },
    ],
    run: run_adamw,
};

/// `sluice kernel sq_norm`.
pub static SQ_NORM_SPEC: OpSpec = OpSpec {
    name: "sq_norm",
    summary: "the global squared norm sum x^2 in a fixed order (8192-element chunks, then the chunk sums); deterministic, no atomics",
    inputs: &[TensorSpec { name: "x", shape: "[N]", dtypes: F32_FLAT }],
    params: &[],
    outputs: &[TensorSpec { name: "sq_norm", shape: "[1]", dtypes: "F32" }],
    run: run_sq_norm,
};

/// `sluice kernel muon_gather`.
pub static MUON_GATHER_SPEC: OpSpec = OpSpec {
    name: "muon_gather",
    summary: "Muon's momentum on n disjoint strided blocks [r,c] of a flat vector (element (i,j) of block k at offsets[k] + i row_strides[k] + j): mom = mu mom + grad_scale g; x[k] = grad_scale g + mu mom (nesterov) or mom",
    inputs: &[
        TensorSpec { name: "g", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "mom", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "offsets", shape: "[n]", dtypes: "I32" },
        TensorSpec { name: "row_strides", shape: "[n]", dtypes: "I32" },
    ],
    params: &[
        ParamSpec { name: "r", default: None, help: "rows of each block" },
        ParamSpec { name: "c", default: None, help: "columns of each block" },
        ParamSpec { name: "mu", default: Some("0.95"), help: "momentum, in [0, 1)" },
        ParamSpec { name: "grad_scale", default: Some("1"), help: "multiplies g first (gradient clipping)" },
        ParamSpec { name: "nesterov", default: Some("true"), help: "Nesterov momentum" },
    ],
    outputs: &[
        TensorSpec { name: "x", shape: "[n,r,c]", dtypes: "F32" },
        TensorSpec { name: "mom", shape: "[N]", dtypes: "F32" },
    ],
    run: run_muon_gather,
};

/// `sluice kernel muon_apply`.
pub static MUON_APPLY_SPEC: OpSpec = OpSpec {
    name: "muon_apply",
    summary: "scatters Muon's orthogonalised update x[n,r,c] into n disjoint strided blocks of p (as muon_gather): p = p (1 - lr wd) - lr scale x",
    inputs: &[
        TensorSpec { name: "p", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "x", shape: "[n,r,c]", dtypes: F32_FLAT },
        TensorSpec { name: "offsets", shape: "[n]", dtypes: "I32" },
        TensorSpec { name: "row_strides", shape: "[n]", dtypes: "I32" },
    ],
    params: &[
        ParamSpec { name: "lr", default: Some("3e-3"), help: "learning rate (>= 0)" },
        ParamSpec { name: "weight_decay", default: Some("0.1"), help: "decoupled weight decay (>= 0)" },
        ParamSpec { name: "scale", default: Some(MUON_SCALE_DEFAULT), help: "update scale (the model's RMS matching with AdamW)" },
    ],
    outputs: &[TensorSpec { name: "p", shape: "[N]", dtypes: "F32" }],
    run: run_muon_apply,
};

/// `sluice kernel cast_bf16`.
pub static CAST_BF16_SPEC: OpSpec = OpSpec {
    name: "cast_bf16",
    summary: "y = bf16(x) elementwise, round to nearest even (the optimizer's bf16 compute copy of the arena; y is BF16)",
    inputs: &[TensorSpec { name: "x", shape: "[...]", dtypes: F32_FLAT }],
    params: &[],
    outputs: &[TensorSpec { name: "y", shape: "[...]", dtypes: "BF16" }],
    run: run_cast_bf16,
};
