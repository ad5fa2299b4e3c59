//! The transformer layer's supporting ops forward and backward (RMSNorm backward, SwiGLU,
//! RoPE, embedding, softmax backward), at the doc shapes of the layers they serve: RMSNorm
//! T = 16384, d = 2048 (DESIGN 9.1); SwiGLU over the MoE's T*k = 131072 rows of f = 1024;
//! RoPE over the attention's 8 x 4096 tokens, 32 heads of 128; the embedding of 16384 tokens
//! of d = 2048 from a 152064-row table; softmax backward 8192 x 8192.
//!
//! Bytes: every input read once, every output written once (gradients in f32); FLOPs the
//! op's arithmetic per element, a handful, so these rows are bandwidth rows.

use super::{dtype_name, random};
use crate::bench::{BenchCase, BenchRun, Pass};
use crate::device::Backend;
use crate::dtype::DType;
use crate::ops;
use crate::tensor::Tensor;

fn case(
    op: &'static str,
    pass: Pass,
    check: &'static str,
    shape: String,
    bytes: usize,
    flops: usize,
    prepare: crate::bench::BenchPrepare,
) -> BenchCase {
    BenchCase {
        op,
        pass,
        path: "default",
        check,
        cuda_only: false,
        shape,
        bytes: bytes as f64,
        flops: flops as f64,
        prepare,
    }
}

/// dx and dw of RMSNorm from x, w and dy.
pub fn rmsnorm_backward_case(t: usize, d: usize, dtype: DType) -> BenchCase {
    let s = dtype.size_bytes();
    case(
        "rmsnorm_backward",
        Pass::Backward,
        "rmsnorm::cuda_matches_reference",
        format!("T={t} d={d} {}", dtype_name(dtype)),
        2 * t * d * s + d * s + t * d * 4 + d * 4,
        8 * t * d,
        Box::new(move |b| {
            let x = random(b, &[t, d], dtype, 2)?;
            let w = random(b, &[d], dtype, 3)?;
            let dy = random(b, &[t, d], dtype, 25)?;
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::rmsnorm::rmsnorm_backward(b, &x, &w, &dy, 1e-6).map(|_| ())
            });
            Ok(run)
        }),
    )
}

/// h = silu(a) * b, and its backward (da, db from a, b, dh).
pub fn swiglu_cases(t: usize, f: usize, dtype: DType) -> [BenchCase; 2] {
    let s = dtype.size_bytes();
    let shape = format!("T={t} f={f} {}", dtype_name(dtype));
    let fwd = case(
        "swiglu",
        Pass::Forward,
        "swiglu::cuda_matches_reference",
        shape.clone(),
        2 * t * f * s + t * f * 4,
        5 * t * f,
        Box::new(move |b| {
            let a = random(b, &[t, f], dtype, 26)?;
            let g = random(b, &[t, f], dtype, 27)?;
            let run: BenchRun =
                Box::new(move |b: &Backend| ops::swiglu::swiglu(b, &a, &g).map(|_| ()));
            Ok(run)
        }),
    );
    let bwd = case(
        "swiglu_backward",
        Pass::Backward,
        "swiglu::cuda_matches_reference",
        shape,
        3 * t * f * s + 2 * t * f * 4,
        10 * t * f,
        Box::new(move |b| {
            let a = random(b, &[t, f], dtype, 26)?;
            let g = random(b, &[t, f], dtype, 27)?;
            let dh = random(b, &[t, f], dtype, 28)?;
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::swiglu::swiglu_backward(b, &a, &g, &dh).map(|_| ())
            });
            Ok(run)
        }),
    );
    [fwd, bwd]
}

/// RoPE over x[T,H,D] at positions 0..T, and its backward (the inverse rotation of dy).
pub fn rope_cases(t: usize, h: usize, d: usize, dtype: DType) -> [BenchCase; 2] {
    let s = dtype.size_bytes();
    let shape = format!("T={t} H={h} D={d} {}", dtype_name(dtype));
    let bytes = t * h * d * (s + 4) + t * 4;
    let flops = 3 * t * h * d;
    let make = |pass: Pass, op: &'static str, sign: bool| {
        case(
            op,
            pass,
            "rope::cuda_matches_reference",
            shape.clone(),
            bytes,
            flops,
            Box::new(move |b| {
                let x = random(b, &[t, h, d], dtype, 29)?;
                let pos: Vec<i32> = (0..t as i32).collect();
                let pos = Tensor::from_slice(b, &[t], &pos)?;
                let run: BenchRun = Box::new(move |b: &Backend| {
                    if sign {
                        ops::rope::rope(b, &x, &pos, 10000.0).map(|_| ())
                    } else {
                        ops::rope::rope_backward(b, &x, &pos, 10000.0).map(|_| ())
                    }
                });
                Ok(run)
            }),
        )
    };
    [
        make(Pass::Forward, "rope", true),
        make(Pass::Backward, "rope_backward", false),
    ]
}

/// The embedding gather of `t` tokens from a [vocab, d] table, and its backward (the
/// deterministic scatter into dtable, which writes the whole table).
pub fn embedding_cases(t: usize, vocab: usize, d: usize, dtype: DType) -> [BenchCase; 2] {
    let s = dtype.size_bytes();
    let shape = format!("T={t} V={vocab} d={d} {}", dtype_name(dtype));
    let tokens = move |b: &Backend| {
        let ids: Vec<i32> = (0..t).map(|i| ((i * 7919) % vocab) as i32).collect();
        Tensor::from_slice(b, &[t], &ids)
    };
    let fwd = case(
        "embedding",
        Pass::Forward,
        "embedding::cuda_matches_reference",
        shape.clone(),
        t * d * (s + 4) + t * 4,
        0,
        Box::new(move |b| {
            let table = random(b, &[vocab, d], dtype, 30)?;
            let ids = tokens(b)?;
            let run: BenchRun =
                Box::new(move |b: &Backend| ops::embedding::embedding(b, &table, &ids).map(|_| ()));
            Ok(run)
        }),
    );
    let bwd = case(
        "embedding_backward",
        Pass::Backward,
        "embedding::cuda_matches_reference",
        shape,
        t * d * s + t * 4 + vocab * d * 4,
        t * d,
        Box::new(move |b| {
            let dout = random(b, &[t, d], dtype, 31)?;
            let ids = tokens(b)?;
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::embedding::embedding_backward(b, &dout, &ids, vocab).map(|_| ())
            });
            Ok(run)
        }),
    );
    [fwd, bwd]
}

/// dx = y * (dy - sum(y * dy)) per row.
pub fn softmax_backward_case(t: usize, n: usize, dtype: DType) -> BenchCase {
    case(
        "softmax_backward",
        Pass::Backward,
        "elementwise::cuda_matches_reference",
        format!("T={t} n={n} {}", dtype_name(dtype)),
        2 * t * n * dtype.size_bytes() + t * n * 4,
        4 * t * n,
        Box::new(move |b| {
            let y = random(b, &[t, n], dtype, 32)?;
            let dy = random(b, &[t, n], dtype, 33)?;
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::elementwise::softmax_backward(b, &y, &dy).map(|_| ())
            });
            Ok(run)
        }),
    )
}

/// The layer ops of a preset's sizes: (rmsnorm T, d), (swiglu rows, f), (rope T, H, D),
/// (embedding T, vocab, d), (softmax T, n), in `dtype`.
pub fn layer_cases(
    norm: (usize, usize),
    glu: (usize, usize),
    rope: (usize, usize, usize),
    emb: (usize, usize, usize),
    soft: (usize, usize),
    dtype: DType,
) -> Vec<BenchCase> {
    let mut v = vec![rmsnorm_backward_case(norm.0, norm.1, dtype)];
    v.extend(swiglu_cases(glu.0, glu.1, dtype));
    v.extend(rope_cases(rope.0, rope.1, rope.2, dtype));
    v.extend(embedding_cases(emb.0, emb.1, emb.2, dtype));
    v.push(softmax_backward_case(soft.0, soft.1, dtype));
    v
}
