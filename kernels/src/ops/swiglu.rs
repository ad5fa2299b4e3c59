//! SwiGLU gate h = silu(a) * b over a[T,f], b[T,f] (kernels in kernels/cuda/swiglu.cu).
//!
//! s = sigmoid(a) = 1 / (1 + exp(-a)); h = (a * s) * b.
//! Backward: da = dh * b * (s * (1 + a * (1 - s))), db = dh * (a * s).
//! Inputs F32 or BF16 (shared by a call's float inputs; the backward's dh may also be F32 with
//! BF16 a and b: saved BF16 activations and an f32 gradient); math and outputs f32. Elementwise:
//! deterministic and batch-invariant. Any shape is accepted as long as a, b (and dh) agree;
//! [T,f] is the model's use.

use super::elementwise::{
    by_dtype, check_len, ew_blocks, expect_shape, float_dtype, host_tensor, EW_THREADS, FLOAT,
};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::Result;
use crate::launch::Launch;
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, TensorSpec};
use crate::tensor::Tensor;

fn sigmoid(a: f32) -> f32 {
    1.0 / (1.0 + (-a).exp())
}

/// h = silu(a) * b elementwise.
pub fn swiglu_reference(a: &[f32], b: &[f32]) -> Result<Vec<f32>> {
    check_len("b", b, a.len(), "the length of `a`")?;
    Ok(par::map_collect(a.len(), 16, |i| {
        let (av, bv) = (a[i], b[i]);
        av * sigmoid(av) * bv
    }))
}

/// [`swiglu_reference`] into `out` (same length), on the calling thread: one MoE expert's
/// segment inside a task of its own.
pub fn swiglu_reference_into(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<()> {
    check_len("b", b, a.len(), "the length of `a`")?;
    check_len("out", out, a.len(), "the length of `a`")?;
    for ((o, &av), &bv) in out.iter_mut().zip(a).zip(b) {
        *o = av * sigmoid(av) * bv;
    }
    Ok(())
}

/// (da, db) of swiglu from a, b and dh.
pub fn swiglu_backward_reference(a: &[f32], b: &[f32], dh: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
    check_len("b", b, a.len(), "the length of `a`")?;
    check_len("dh", dh, a.len(), "the length of `a`")?;
    let mut da = vec![0.0f32; a.len()];
    let mut db = vec![0.0f32; a.len()];
    par::rows2_mut(&mut da, 1, &mut db, 1, 20, |i, da, db| {
        let (av, bv, g) = (a[i], b[i], dh[i]);
        let s = sigmoid(av);
        da[0] = g * bv * (s * (1.0 + av * (1.0 - s)));
        db[0] = g * (av * s);
    });
    Ok((da, db))
}

/// SwiGLU forward on any device: a, b (same shape, F32 or BF16) -> h F32.
pub fn swiglu(backend: &Backend, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let dtype = float_dtype(&[("a", a), ("b", b)])?;
    expect_shape("b", b, a.shape(), "[T,f], the shape of `a`")?;
    if let Backend::Cpu = backend {
        return host_tensor(
            backend,
            a.shape(),
            swiglu_reference(&a.f32_data()?, &b.f32_data()?)?,
        );
    }
    let n = a.numel();
    let h = Tensor::poisoned(backend, a.shape(), DType::F32)?;
    if n > 0 {
        // Grid-stride; thread i reads a[i], b[i] and writes h[i] only (all hold n elements).
        backend.launch(
            &Launch::new(
                by_dtype(dtype, "swiglu_forward_f32", "swiglu_forward_bf16"),
                [ew_blocks(n), 1, 1],
                [EW_THREADS, 1, 1],
            )
            .arg_tensor(a)
            .arg_tensor(b)
            .arg_tensor(&h)
            .arg_i64(n as i64),
        )?;
    }
    Ok(h)
}

/// SwiGLU backward on any device: (da, db), both F32. `dh` has the dtype of `a` and `b`, or is
/// F32 with BF16 `a` and `b`.
pub fn swiglu_backward(
    backend: &Backend,
    a: &Tensor,
    b: &Tensor,
    dh: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let mixed = a.dtype() == DType::BF16 && dh.dtype() == DType::F32;
    let dtype = if mixed {
        float_dtype(&[("a", a), ("b", b)])?
    } else {
        float_dtype(&[("a", a), ("b", b), ("dh", dh)])?
    };
    expect_shape("b", b, a.shape(), "[T,f], the shape of `a`")?;
    expect_shape("dh", dh, a.shape(), "[T,f], the shape of `a`")?;
    if let Backend::Cpu = backend {
        let (da, db) = swiglu_backward_reference(&a.f32_data()?, &b.f32_data()?, &dh.f32_data()?)?;
        return Ok((
            host_tensor(backend, a.shape(), da)?,
            host_tensor(backend, a.shape(), db)?,
        ));
    }
    let n = a.numel();
    let da = Tensor::poisoned(backend, a.shape(), DType::F32)?;
    let db = Tensor::poisoned(backend, a.shape(), DType::F32)?;
    if n > 0 {
        backend.launch(
            &Launch::new(
                if mixed {
                    "swiglu_backward_bf16_f32dh"
                } else {
                    by_dtype(dtype, "swiglu_backward_f32", "swiglu_backward_bf16")
                },
                [ew_blocks(n), 1, 1],
                [EW_THREADS, 1, 1],
            )
            .arg_tensor(a)
            .arg_tensor(b)
            .arg_tensor(dh)
            .arg_tensor(&da)
            .arg_tensor(&db)
            .arg_i64(n as i64),
        )?;
    }
    Ok((da, db))
}

fn run_forward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    Ok(vec![(
        "h",
        swiglu(backend, call.tensor("a")?, call.tensor("b")?)?,
    )])
}

fn run_backward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let (da, db) = swiglu_backward(
        backend,
        call.tensor("a")?,
        call.tensor("b")?,
        call.tensor("dh")?,
    )?;
    Ok(vec![("da", da), ("db", db)])
}

/// `sluice kernel swiglu`.
pub static SPEC: OpSpec = OpSpec {
    name: "swiglu",
    summary: "h = silu(a) * b elementwise (the SwiGLU gate; a is the gate, b the up projection)",
    inputs: &[
        TensorSpec {
            name: "a",
            shape: "[T,f]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "b",
            shape: "[T,f]",
            dtypes: FLOAT,
        },
    ],
    params: &[],
    outputs: &[TensorSpec {
        name: "h",
        shape: "[T,f]",
        dtypes: "F32",
    }],
    run: run_forward,
};

/// `sluice kernel swiglu_backward`.
pub static BACKWARD_SPEC: OpSpec = OpSpec {
    name: "swiglu_backward",
    summary: "da, db of swiglu from a, b and dh",
    inputs: &[
        TensorSpec {
            name: "a",
            shape: "[T,f]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "b",
            shape: "[T,f]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "dh",
            shape: "[T,f]",
            dtypes: "F32|BF16 (as a, or F32 with BF16 a and b)",
        },
    ],
    params: &[],
    outputs: &[
        TensorSpec {
            name: "da",
            shape: "[T,f]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "db",
            shape: "[T,f]",
            dtypes: "F32",
        },
    ],
    run: run_backward,
};
