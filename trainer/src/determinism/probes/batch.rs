//! The batch-invariance probe (DESIGN 2, promise 2): a row's result does not depend on how many
//! other rows share the launch or where the row sits.
//!
//! For each row-wise op, one probe row (or probe sequence) is placed at several positions of
//! batches of 1, 7, 64, 129 and 1000 rows (the other rows are filler), and every probed row's
//! outputs must have the bits of the 1-row batch. The batches cross the CPU references' size
//! switches: the few-row packed GEMM (M <= 64) against matrixmultiply's 8-row panels cut over
//! the threads (M = 129, 1000; K = 300 is past one 256-chunk), the bf16 chain past 64 rows, the
//! MoE small-row path, the by-row and by-sequence attention backward (2 x threads sequences),
//! and the positions sit on both sides of the 8-, 16-, 32-, 64- and 128-row tile edges and of
//! each thread panel's edge for 2 to 16 threads.

use super::Verdict;
use crate::determinism::op_cases::{host_values, seed_of};
use crate::determinism::DetError;
use sluice_kernels::runner::{self, OpCall};
use sluice_kernels::{Backend, DType, Tensor};
use std::collections::BTreeMap;

/// The batch sizes (rows, or sequences for the attention ops).
pub const BATCHES: [usize; 5] = [1, 7, 64, 129, 1000];

/// The positions probed in a batch of `m`: first and last, both sides of the tile edges, and
/// both sides of the row panel edge of `t` threads for t in 2, 3, 4, 8, 16 (panels are
/// multiples of 8 rows: `ceil(ceil(m / t) / 8) * 8`).
pub fn positions(m: usize) -> Vec<usize> {
    let mut p = vec![0, 1, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128];
    for t in [2, 3, 4, 8, 16] {
        let edge = m.div_ceil(t).div_ceil(8) * 8;
        p.extend([edge.saturating_sub(1), edge]);
    }
    p.push(m.saturating_sub(1));
    p.retain(|&x| x < m);
    p.sort_unstable();
    p.dedup();
    p
}

/// How a row-wise input's rows are made.
#[derive(Clone, Copy)]
enum Col {
    /// Floats: `offset + scale * uniform[-4, 4)`.
    Float(DType, f32, f32),
    /// I32 ids below n.
    Ids(usize),
    /// U64 request ids.
    RequestIds,
    /// I32 positions.
    Positions,
    /// F32 0/1 loss mask.
    Mask,
}

struct RowInput {
    name: &'static str,
    /// The shape of one row (empty: one element per row).
    row: Vec<usize>,
    col: Col,
}

/// A row-wise op of the runner, with inputs shared by every row and the outputs that are
/// row-wise (shape [rows, ...]).
struct RowOp {
    label: String,
    op: &'static str,
    rows: Vec<RowInput>,
    shared: Vec<(&'static str, Vec<usize>, DType, f32)>,
    params: Vec<(&'static str, &'static str)>,
    outputs: Vec<&'static str>,
}

fn row(name: &'static str, row: &[usize], col: Col) -> RowInput {
    RowInput {
        name,
        row: row.to_vec(),
        col,
    }
}

fn row_ops() -> Vec<RowOp> {
    let f32x = |s: f32| Col::Float(DType::F32, s, 0.0);
    let mut v = Vec::new();
    for (dt, k) in [(DType::F32, 300), (DType::BF16, 200)] {
        v.push(RowOp {
            label: format!("gemm {dt} N=40 K={k}"),
            op: "gemm",
            rows: vec![row("a", &[k], Col::Float(dt, 1.0, 0.0))],
            shared: vec![("b", vec![40, k], dt, 1.0)],
            params: vec![],
            outputs: vec!["c"],
        });
    }
    for dt in [DType::F32, DType::BF16] {
        v.push(RowOp {
            label: format!("moe_forward {dt} d=32 E=4 f=16 k=2"),
            op: "moe_forward",
            rows: vec![row("x", &[32], Col::Float(dt, 1.0, 0.0))],
            shared: vec![
                ("w_router", vec![4, 32], dt, 0.1),
                ("w1", vec![4, 16, 32], dt, 0.1),
                ("w3", vec![4, 16, 32], dt, 0.1),
                ("w2", vec![4, 32, 16], dt, 0.1),
            ],
            params: vec![("k", "2")],
            outputs: vec!["y", "topk_idx", "topk_gate"],
        });
    }
    v.push(RowOp {
        label: "rmsnorm F32 d=48".into(),
        op: "rmsnorm",
        rows: vec![row("x", &[48], f32x(1.0))],
        shared: vec![("w", vec![48], DType::F32, 1.0)],
        params: vec![],
        outputs: vec!["y"],
    });
    v.push(RowOp {
        label: "softmax F32 n=100".into(),
        op: "softmax",
        rows: vec![row("x", &[100], f32x(1.0))],
        shared: vec![],
        params: vec![],
        outputs: vec!["y"],
    });
    v.push(RowOp {
        label: "topk F32 E=64 k=4".into(),
        op: "topk",
        rows: vec![row("scores", &[64], f32x(1.0))],
        shared: vec![],
        params: vec![("k", "4")],
        outputs: vec!["values", "indices"],
    });
    v.push(RowOp {
        label: "sample F32 V=1000 t=1".into(),
        op: "sample",
        rows: vec![
            row("logits", &[1000], f32x(1.0)),
            row("request_ids", &[], Col::RequestIds),
            row("positions", &[], Col::Positions),
        ],
        shared: vec![],
        params: vec![("seed", "7")],
        outputs: vec!["tokens", "logprobs"],
    });
    v.push(RowOp {
        label: "is_gate_loss F32 V=300 dis".into(),
        op: "is_gate_loss",
        rows: vec![
            row("logits", &[300], f32x(1.0)),
            row("tokens", &[], Col::Ids(300)),
            row("behavior_logp", &[], Col::Float(DType::F32, 0.05, -7.0)),
            row("advantages", &[], f32x(0.25)),
            row("mask", &[], Col::Mask),
        ],
        shared: vec![],
        params: vec![],
        // The loss and dlogits are means over the batch's masked tokens (not row-wise).
        outputs: vec!["logp", "ratio", "accepted"],
    });
    v.push(RowOp {
        label: "embedding F32 V=50 d=24".into(),
        op: "embedding",
        rows: vec![row("tokens", &[], Col::Ids(50))],
        shared: vec![("table", vec![50, 24], DType::F32, 1.0)],
        params: vec![],
        outputs: vec!["out"],
    });
    v.push(RowOp {
        label: "rope F32 H=4 D=16".into(),
        op: "rope",
        rows: vec![
            row("x", &[4, 16], f32x(1.0)),
            row("positions", &[], Col::Positions),
        ],
        shared: vec![],
        params: vec![],
        outputs: vec!["y"],
    });
    v.push(RowOp {
        label: "swiglu F32 f=40".into(),
        op: "swiglu",
        rows: vec![row("a", &[40], f32x(1.0)), row("b", &[40], f32x(1.0))],
        shared: vec![],
        params: vec![],
        outputs: vec!["h"],
    });
    v
}

/// An op's outputs by name: shape and bytes.
type Outputs = BTreeMap<String, (Vec<usize>, Vec<u8>)>;

/// Runs `op` through the runner with `tensors` and `params`; returns the outputs by name.
fn run_op(
    backend: &Backend,
    op: &str,
    tensors: BTreeMap<String, Tensor>,
    params: &[(&str, &str)],
) -> Result<Outputs, DetError> {
    let err = |e: sluice_kernels::Error| DetError::Run(format!("batch_invariance: {op}: {e}"));
    let spec = runner::find(op).map_err(err)?;
    let params = params
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let call = OpCall::new(spec, tensors, params).map_err(err)?;
    let outs = (spec.run)(backend, &call).map_err(err)?;
    outs.into_iter()
        .map(|(n, t)| {
            Ok((
                n.to_string(),
                (t.shape().to_vec(), t.to_bytes().map_err(err)?),
            ))
        })
        .collect()
}

/// The output `name` of a run.
fn output<'a>(outs: &'a Outputs, name: &str) -> Result<&'a (Vec<usize>, Vec<u8>), DetError> {
    outs.get(name).ok_or_else(|| {
        DetError::Run(format!(
            "batch_invariance: internal: the op gave no output `{name}`"
        ))
    })
}

/// The bytes of rows `rows` (a range of the leading dimension) of an output.
fn rows_of<'a>(shape: &[usize], bytes: &'a [u8], rows: std::ops::Range<usize>) -> &'a [u8] {
    let per = bytes.len() / shape.first().copied().unwrap_or(1).max(1);
    &bytes[rows.start * per..rows.end * per]
}

/// The inputs of `op` for `m` rows, the probe's content at `probed`.
fn row_inputs(
    backend: &Backend,
    op: &RowOp,
    m: usize,
    probed: &[usize],
) -> Result<BTreeMap<String, Tensor>, DetError> {
    let err = |e: sluice_kernels::Error| DetError::Run(format!("batch_invariance: {}: {e}", op.op));
    let mut t = BTreeMap::new();
    for input in &op.rows {
        let len: usize = input.row.iter().product();
        let mut shape = vec![m];
        shape.extend(&input.row);
        let salt = format!("batch/{}/{}", op.label, input.name);
        let is_probe = |r: usize| probed.binary_search(&r).is_ok();
        let tensor = match input.col {
            Col::Float(dt, scale, offset) => {
                let mut v = host_values(m * len, seed_of(&format!("{salt}/fill"))).map_err(err)?;
                let p = host_values(len, seed_of(&format!("{salt}/probe"))).map_err(err)?;
                for &r in probed {
                    v[r * len..(r + 1) * len].copy_from_slice(&p);
                }
                let v: Vec<f32> = v.into_iter().map(|x| offset + scale * x).collect();
                Tensor::from_f32_as(backend, &shape, dt, &v)
            }
            Col::Ids(n) => {
                let v: Vec<i32> = (0..m)
                    .map(|r| {
                        if is_probe(r) {
                            (n / 3) as i32
                        } else {
                            ((r * 7919) % n) as i32
                        }
                    })
                    .collect();
                Tensor::from_slice(backend, &shape, &v)
            }
            Col::RequestIds => {
                let v: Vec<u64> = (0..m)
                    .map(|r| if is_probe(r) { 7 } else { 10_000 + r as u64 })
                    .collect();
                Tensor::from_slice(backend, &shape, &v)
            }
            Col::Positions => {
                let v: Vec<i32> = (0..m)
                    .map(|r| if is_probe(r) { 11 } else { (r % 50) as i32 })
                    .collect();
                Tensor::from_slice(backend, &shape, &v)
            }
            Col::Mask => {
                let v: Vec<f32> = (0..m)
                    .map(|r| if is_probe(r) || r % 3 != 2 { 1.0 } else { 0.0 })
                    .collect();
                Tensor::from_slice(backend, &shape, &v)
            }
        }
        .map_err(err)?;
        t.insert(input.name.to_string(), tensor);
    }
    for (name, shape, dt, scale) in &op.shared {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = host_values(n, seed_of(&format!("batch/{}/{name}", op.label)))
            .map_err(err)?
            .into_iter()
            .map(|x| scale * x)
            .collect();
        t.insert(
            name.to_string(),
            Tensor::from_f32_as(backend, shape, *dt, &v).map_err(err)?,
        );
    }
    Ok(t)
}

/// The row-wise ops: each probe row's outputs against the 1-row batch.
fn probe_row_ops(backend: &Backend, checked: &mut usize) -> Result<Option<String>, DetError> {
    for op in row_ops() {
        let reference = run_op(
            backend,
            op.op,
            row_inputs(backend, &op, 1, &[0])?,
            &op.params,
        )?;
        for &m in &BATCHES[1..] {
            let probed = positions(m);
            let outs = run_op(
                backend,
                op.op,
                row_inputs(backend, &op, m, &probed)?,
                &op.params,
            )?;
            for &name in &op.outputs {
                let (rshape, rbytes) = output(&reference, name)?;
                let (shape, bytes) = output(&outs, name)?;
                let dtype = dtype_of(op.op, name);
                for &p in &probed {
                    let want = rows_of(rshape, rbytes, 0..1);
                    let got = rows_of(shape, bytes, p..p + 1);
                    *checked += 1;
                    if let Some(msg) = differs_typed(
                        &op.label,
                        name,
                        dtype,
                        &rshape[1..],
                        want,
                        got,
                        &format!("row {p} of a {m}-row batch"),
                    ) {
                        return Ok(Some(msg));
                    }
                }
            }
        }
    }
    Ok(None)
}

/// The dtype of a runner output, by op and name (the runner's table says it).
fn dtype_of(op: &str, tensor: &str) -> &'static str {
    runner::find(op)
        .ok()
        .and_then(|s| s.outputs.iter().find(|t| t.name == tensor))
        .map(|t| {
            if t.dtypes.starts_with("I32") {
                "I32"
            } else if t.dtypes.starts_with("U8") {
                "U8"
            } else {
                "F32"
            }
        })
        .unwrap_or("F32")
}

/// [`differs`] with the dtype known.
#[allow(clippy::too_many_arguments)]
fn differs_typed(
    label: &str,
    tensor: &str,
    dtype: &str,
    row_shape: &[usize],
    want: &[u8],
    got: &[u8],
    where_: &str,
) -> Option<String> {
    if want == got {
        return None;
    }
    let detail = crate::determinism::compare::first_difference(dtype, row_shape, want, got)
        .map(|(flat, idx, a, b)| format!(" at {idx:?} (element {flat}): 1-row batch {a}, here {b}"))
        .unwrap_or_default();
    Some(format!(
        "{label}: `{tensor}` of {where_} differs from the 1-row batch{detail}"
    ))
}

/// Lengths of the sequences of a varlen batch of `m`: the probe's where probed, else filler.
fn lengths(
    m: usize,
    probed: &[usize],
    probe: usize,
    filler: impl Fn(usize) -> usize,
) -> Vec<usize> {
    (0..m)
        .map(|s| {
            if probed.binary_search(&s).is_ok() {
                probe
            } else {
                filler(s)
            }
        })
        .collect()
}

/// `n` floats of filler with the probe's block (`rows` rows of `width`) copied in at each of
/// `starts` (in rows).
fn with_probes(
    salt: &str,
    total_rows: usize,
    width: usize,
    starts: &[usize],
    rows: usize,
) -> Result<Vec<f32>, sluice_kernels::Error> {
    let mut v = host_values(total_rows * width, seed_of(&format!("{salt}/fill")))?;
    let p = host_values(rows * width, seed_of(&format!("{salt}/probe")))?;
    for &s in starts {
        v[s * width..(s + rows) * width].copy_from_slice(&p);
    }
    Ok(v)
}

/// Varlen training attention, forward (f32, bf16) and backward (f32): a 37-token probe
/// sequence (past one 32-key chunk) among filler sequences of 1 to 13 tokens; its rows of
/// every output against the batch of one sequence.
fn probe_attention(backend: &Backend, checked: &mut usize) -> Result<Option<String>, DetError> {
    let (h, hkv, d, probe) = (4usize, 2usize, 16usize, 37usize);
    for (dt, backward) in [
        (DType::F32, false),
        (DType::BF16, false),
        (DType::F32, true),
    ] {
        let op = if backward {
            "attention_backward"
        } else {
            "attention_forward"
        };
        let label = format!("{op} {dt} H=4 Hkv=2 D=16");
        let err =
            |e: sluice_kernels::Error| DetError::Run(format!("batch_invariance: {label}: {e}"));
        let run = |m: usize, probed: &[usize]| -> Result<(Vec<usize>, Outputs), DetError> {
            let lens = lengths(m, probed, probe, |s| 1 + (s * 7) % 13);
            let mut cu = vec![0usize];
            for l in &lens {
                cu.push(cu.last().copied().unwrap_or(0) + l);
            }
            let t = cu[m];
            let starts: Vec<usize> = probed.iter().map(|&s| cu[s]).collect();
            let mut tensors = BTreeMap::new();
            let mut names = vec![("q", h), ("k", hkv), ("v", hkv)];
            if backward {
                names.push(("dout", h));
            }
            for (name, heads) in names {
                let v = with_probes(
                    &format!("batch/{label}/{name}"),
                    t,
                    heads * d,
                    &starts,
                    probe,
                )
                .map_err(err)?;
                let tensor = Tensor::from_f32_as(backend, &[t, heads, d], dt, &v).map_err(err)?;
                tensors.insert(name.to_string(), tensor);
            }
            let cu32: Vec<i32> = cu.iter().map(|&c| c as i32).collect();
            tensors.insert(
                "cu_seqlens".to_string(),
                Tensor::from_slice(backend, &[m + 1], &cu32).map_err(err)?,
            );
            Ok((cu, run_op(backend, op, tensors, &[])?))
        };
        let (_, reference) = run(1, &[0])?;
        let outputs: &[&str] = if backward {
            &["dq", "dk", "dv"]
        } else {
            &["out"]
        };
        for &m in &BATCHES[1..] {
            let probed = positions(m);
            let (cu, outs) = run(m, &probed)?;
            for &name in outputs {
                let (rshape, rbytes) = output(&reference, name)?;
                let (shape, bytes) = output(&outs, name)?;
                for &p in &probed {
                    *checked += 1;
                    let want = rows_of(rshape, rbytes, 0..probe);
                    let got = rows_of(shape, bytes, cu[p]..cu[p] + probe);
                    let mut row_shape = vec![probe];
                    row_shape.extend(&rshape[1..]);
                    if let Some(msg) = differs_typed(
                        &label,
                        name,
                        "F32",
                        &row_shape,
                        want,
                        got,
                        &format!("sequence {p} of a batch of {m} sequences"),
                    ) {
                        return Ok(Some(msg));
                    }
                }
            }
        }
    }
    Ok(None)
}

/// Paged decode (f32, bf16): a probe sequence with 37 cached keys among filler sequences of 1
/// to 45, its blocks wherever its place in the batch puts them; its output row against the
/// batch of one.
fn probe_paged(backend: &Backend, checked: &mut usize) -> Result<Option<String>, DetError> {
    let (h, hkv, d, bs, probe) = (4usize, 2usize, 16usize, 16usize, 37usize);
    for dt in [DType::F32, DType::BF16] {
        let label = format!("paged_attention {dt} BS=16 H=4 Hkv=2 D=16");
        let err =
            |e: sluice_kernels::Error| DetError::Run(format!("batch_invariance: {label}: {e}"));
        let run = |m: usize, probed: &[usize]| -> Result<Outputs, DetError> {
            let ctx = lengths(m, probed, probe, |s| 1 + (s * 11) % 45);
            let blocks: Vec<usize> = ctx.iter().map(|c| c.div_ceil(bs)).collect();
            let mut first = vec![0usize];
            for b in &blocks {
                first.push(first.last().copied().unwrap_or(0) + b);
            }
            let nb = first[m];
            let mb = blocks.iter().copied().max().unwrap_or(1);
            let mut table = vec![0i32; m * mb];
            for s in 0..m {
                for i in 0..blocks[s] {
                    table[s * mb + i] = (first[s] + i) as i32;
                }
            }
            let q = with_probes(&format!("batch/{label}/q"), m, h * d, probed, 1).map_err(err)?;
            let mut tensors = BTreeMap::new();
            tensors.insert(
                "q".to_string(),
                Tensor::from_f32_as(backend, &[m, h, d], dt, &q).map_err(err)?,
            );
            let w = hkv * d;
            for name in ["k_cache", "v_cache"] {
                let salt = format!("batch/{label}/{name}");
                let mut c =
                    host_values(nb * bs * w, seed_of(&format!("{salt}/fill"))).map_err(err)?;
                let keys =
                    host_values(probe * w, seed_of(&format!("{salt}/probe"))).map_err(err)?;
                for &s in probed {
                    for j in 0..probe {
                        let slot = (first[s] + j / bs) * bs + j % bs;
                        c[slot * w..(slot + 1) * w].copy_from_slice(&keys[j * w..(j + 1) * w]);
                    }
                }
                tensors.insert(
                    name.to_string(),
                    Tensor::from_f32_as(backend, &[nb, bs, hkv, d], dt, &c).map_err(err)?,
                );
            }
            tensors.insert(
                "block_table".to_string(),
                Tensor::from_slice(backend, &[m, mb], &table).map_err(err)?,
            );
            let ctx32: Vec<i32> = ctx.iter().map(|&c| c as i32).collect();
            tensors.insert(
                "context_lens".to_string(),
                Tensor::from_slice(backend, &[m], &ctx32).map_err(err)?,
            );
            run_op(backend, "paged_attention", tensors, &[])
        };
        let reference = run(1, &[0])?;
        for &m in &BATCHES[1..] {
            let probed = positions(m);
            let outs = run(m, &probed)?;
            let (rshape, rbytes) = output(&reference, "out")?;
            let (shape, bytes) = output(&outs, "out")?;
            for &p in &probed {
                *checked += 1;
                if let Some(msg) = differs_typed(
                    &label,
                    "out",
                    "F32",
                    &rshape[1..],
                    rows_of(rshape, rbytes, 0..1),
                    rows_of(shape, bytes, p..p + 1),
                    &format!("sequence {p} of a batch of {m} sequences"),
                ) {
                    return Ok(Some(msg));
                }
            }
        }
    }
    Ok(None)
}

/// The probe: every row-wise op, then the attention ops.
pub fn probe(backend: &Backend) -> Result<Verdict, DetError> {
    let mut checked = 0;
    let found = match probe_row_ops(backend, &mut checked)? {
        Some(m) => Some(m),
        None => match probe_attention(backend, &mut checked)? {
            Some(m) => Some(m),
            None => probe_paged(backend, &mut checked)?,
        },
    };
    Ok(match found {
        Some(counterexample) => Verdict::fail(counterexample),
        None => Verdict::pass(format!(
            "{} op cases, batches of {:?} rows or sequences, {checked} probed rows bit for bit",
            row_ops().len() + 4,
            BATCHES
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_straddle_tiles_and_panels() {
        assert_eq!(positions(1), vec![0]);
        assert_eq!(positions(7), vec![0, 1, 6]);
        let p = positions(1000);
        for edge in [63, 64, 127, 128, 503, 504, 999] {
            assert!(p.contains(&edge), "{edge} not in {p:?}");
        }
        assert!(p.windows(2).all(|w| w[0] < w[1]));
    }
}
