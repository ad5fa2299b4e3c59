//! `sluice kernel` rows of the model ops (rmsnorm, rope, swiglu, embedding, residual add,
//! softmax, forward and backward): inputs written to safetensors, run through
//! `run_kernel`, outputs read back and checked against computations written here in f64;
//! misnamed and misshapen tensors give errors that name them and the shape expected.

// Index loops mirror the formulas of the independent computations.
#![allow(clippy::needless_range_loop)]

mod support;

use sluice_kernels::io::read_safetensors;
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Device, Error, Tensor};
use sluice_trainer::kernel_cmd::run_kernel;
use std::collections::BTreeMap;
use support::{scratch_dir, write_tensors};

enum Input<'a> {
    F32(&'a [usize], &'a [f32]),
    I32(&'a [usize], &'a [i32]),
}

/// Writes the inputs and params, runs `op` on `device`, returns the outputs by name as f32
/// (or the error).
fn run(
    op: &str,
    inputs: &[(&str, Input)],
    params: &[(&str, &str)],
    device: Device,
) -> Result<BTreeMap<String, Vec<f32>>, Error> {
    let dir = scratch_dir(&format!("model-ops-{op}"));
    let (inp, out) = (
        dir.join("in.safetensors"),
        dir.join(format!("out-{device}.safetensors")),
    );
    let cpu = Backend::Cpu;
    let tensors: Vec<(&str, Tensor)> = inputs
        .iter()
        .map(|(name, i)| {
            let t = match i {
                Input::F32(shape, data) => Tensor::from_slice(&cpu, shape, data).unwrap(),
                Input::I32(shape, data) => Tensor::from_slice(&cpu, shape, data).unwrap(),
            };
            (*name, t)
        })
        .collect();
    write_tensors(&inp, &tensors, params);
    let result = run_kernel(op, &inp, &out, device);
    let file = result.map(|_| read_safetensors(&out, &cpu).unwrap());
    std::fs::remove_dir_all(&dir).ok();
    let file = file?;
    Ok(file
        .tensors
        .into_iter()
        .map(|(k, t)| {
            assert_eq!(t.dtype(), DType::F32, "output {k} of {op}");
            (k, t.to_f32_vec().unwrap())
        })
        .collect())
}

fn close(got: &[f32], want: &[f64], what: &str) {
    // Every op here is a few f32 operations per element (or an f32 row sum of <= 40 terms).
    let err = rel_norm(got, want);
    assert!(err <= F32_TOL, "{what}: rel err {err}");
}

const T: usize = 5;
const D: usize = 6;

fn data(seed: u64, n: usize) -> Vec<f32> {
    Rng::new(seed).normal_vec(n, 1.0)
}

#[test]
fn rmsnorm_rows() {
    let (x, w, dy) = (data(1, T * D), data(2, D), data(3, T * D));
    let eps = 0.01f64;
    let out = run(
        "rmsnorm",
        &[("x", Input::F32(&[T, D], &x)), ("w", Input::F32(&[D], &w))],
        &[("eps", "0.01")],
        Device::Cpu,
    )
    .unwrap();
    let mut want_y = vec![0.0; T * D];
    let mut want_dx = vec![0.0; T * D];
    let mut want_dw = vec![0.0; D];
    for t in 0..T {
        let row: Vec<f64> = (0..D).map(|j| x[t * D + j] as f64).collect();
        let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / D as f64 + eps).sqrt();
        let dot: f64 = (0..D)
            .map(|j| dy[t * D + j] as f64 * w[j] as f64 * row[j])
            .sum();
        for j in 0..D {
            want_y[t * D + j] = row[j] * r * w[j] as f64;
            want_dx[t * D + j] =
                r * dy[t * D + j] as f64 * w[j] as f64 - row[j] * dot * r.powi(3) / D as f64;
            want_dw[j] += dy[t * D + j] as f64 * row[j] * r;
        }
    }
    close(&out["y"], &want_y, "rmsnorm y");
    let out = run(
        "rmsnorm_backward",
        &[
            ("x", Input::F32(&[T, D], &x)),
            ("w", Input::F32(&[D], &w)),
            ("dy", Input::F32(&[T, D], &dy)),
        ],
        &[("eps", "0.01")],
        Device::Cpu,
    )
    .unwrap();
    close(&out["dx"], &want_dx, "rmsnorm_backward dx");
    close(&out["dw"], &want_dw, "rmsnorm_backward dw");
    // The default eps (1e-6) applies when the metadata has none.
    let out = run(
        "rmsnorm",
        &[("x", Input::F32(&[T, D], &x)), ("w", Input::F32(&[D], &w))],
        &[],
        Device::Cpu,
    )
    .unwrap();
    let r0 = 1.0 / ((0..D).map(|j| (x[j] as f64).powi(2)).sum::<f64>() / D as f64 + 1e-6).sqrt();
    assert!((out["y"][0] as f64 - x[0] as f64 * r0 * w[0] as f64).abs() < 1e-5);
}

#[test]
fn rope_rows() {
    let (h, dim) = (2, 4);
    let x = data(4, T * h * dim);
    let pos = [0i32, 1, 2, 0, 7];
    let theta = 100.0f64;
    let out = run(
        "rope",
        &[
            ("x", Input::F32(&[T, h, dim], &x)),
            ("positions", Input::I32(&[T], &pos)),
        ],
        &[("theta", "100")],
        Device::Cpu,
    )
    .unwrap();
    let back = run(
        "rope_backward",
        &[
            ("dy", Input::F32(&[T, h, dim], &x)),
            ("positions", Input::I32(&[T], &pos)),
        ],
        &[("theta", "100")],
        Device::Cpu,
    )
    .unwrap();
    let mut want = vec![0.0; x.len()];
    let mut want_back = vec![0.0; x.len()];
    for t in 0..T {
        for hh in 0..h {
            let base = (t * h + hh) * dim;
            for i in 0..dim / 2 {
                let a = pos[t] as f64 * theta.powf(-2.0 * i as f64 / dim as f64);
                let (x1, x2) = (x[base + i] as f64, x[base + i + dim / 2] as f64);
                want[base + i] = x1 * a.cos() - x2 * a.sin();
                want[base + i + dim / 2] = x2 * a.cos() + x1 * a.sin();
                want_back[base + i] = x1 * a.cos() + x2 * a.sin();
                want_back[base + i + dim / 2] = x2 * a.cos() - x1 * a.sin();
            }
        }
    }
    close(&out["y"], &want, "rope y");
    close(&back["dx"], &want_back, "rope_backward dx");
}

#[test]
fn swiglu_rows() {
    let (a, b, dh) = (data(5, T * D), data(6, T * D), data(7, T * D));
    let inputs = [
        ("a", Input::F32(&[T, D], &a)),
        ("b", Input::F32(&[T, D], &b)),
    ];
    let out = run("swiglu", &inputs, &[], Device::Cpu).unwrap();
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    let want: Vec<f64> = (0..T * D)
        .map(|i| a[i] as f64 * sig(a[i] as f64) * b[i] as f64)
        .collect();
    close(&out["h"], &want, "swiglu h");
    let out = run(
        "swiglu_backward",
        &[
            ("a", Input::F32(&[T, D], &a)),
            ("b", Input::F32(&[T, D], &b)),
            ("dh", Input::F32(&[T, D], &dh)),
        ],
        &[],
        Device::Cpu,
    )
    .unwrap();
    let want_da: Vec<f64> = (0..T * D)
        .map(|i| {
            let (av, s) = (a[i] as f64, sig(a[i] as f64));
            dh[i] as f64 * b[i] as f64 * (s + av * s * (1.0 - s))
        })
        .collect();
    let want_db: Vec<f64> = (0..T * D)
        .map(|i| dh[i] as f64 * a[i] as f64 * sig(a[i] as f64))
        .collect();
    close(&out["da"], &want_da, "swiglu_backward da");
    close(&out["db"], &want_db, "swiglu_backward db");
}

#[test]
fn embedding_rows() {
    let v = 4;
    let table = data(8, v * D);
    let tokens = [3i32, 0, 3, 1, 3];
    let out = run(
        "embedding",
        &[
            ("table", Input::F32(&[v, D], &table)),
            ("tokens", Input::I32(&[T], &tokens)),
        ],
        &[],
        Device::Cpu,
    )
    .unwrap();
    let want: Vec<f64> = tokens
        .iter()
        .flat_map(|&t| (0..D).map(move |j| (t as usize, j)))
        .map(|(t, j)| table[t * D + j] as f64)
        .collect();
    close(&out["out"], &want, "embedding out");
    let dout = data(9, T * D);
    let out = run(
        "embedding_backward",
        &[
            ("dout", Input::F32(&[T, D], &dout)),
            ("tokens", Input::I32(&[T], &tokens)),
        ],
        &[("vocab", "4")],
        Device::Cpu,
    )
    .unwrap();
    let mut want = vec![0.0; v * D];
    for (t, &tok) in tokens.iter().enumerate() {
        for j in 0..D {
            want[tok as usize * D + j] += dout[t * D + j] as f64;
        }
    }
    close(&out["dtable"], &want, "embedding_backward dtable");
    // vocab is required; a token outside it names `tokens`.
    let err = run(
        "embedding_backward",
        &[
            ("dout", Input::F32(&[T, D], &dout)),
            ("tokens", Input::I32(&[T], &tokens)),
        ],
        &[],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Param { name, .. } if name == "vocab"),
        "{err}"
    );
    let err = run(
        "embedding_backward",
        &[
            ("dout", Input::F32(&[T, D], &dout)),
            ("tokens", Input::I32(&[T], &tokens)),
        ],
        &[("vocab", "3")],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        err.is_bad_input() && err.to_string().contains("`tokens`[0] = 3"),
        "{err}"
    );
}

#[test]
fn residual_add_and_softmax_rows() {
    let (a, b) = (data(10, T * D), data(11, T * D));
    let out = run(
        "residual_add",
        &[
            ("a", Input::F32(&[T, D], &a)),
            ("b", Input::F32(&[T, D], &b)),
        ],
        &[],
        Device::Cpu,
    )
    .unwrap();
    let want: Vec<f64> = (0..T * D).map(|i| a[i] as f64 + b[i] as f64).collect();
    close(&out["y"], &want, "residual_add y");
    let out = run(
        "softmax",
        &[("x", Input::F32(&[T, D], &a))],
        &[],
        Device::Cpu,
    )
    .unwrap();
    let mut want = vec![0.0; T * D];
    for t in 0..T {
        let s: f64 = (0..D).map(|j| (a[t * D + j] as f64).exp()).sum();
        for j in 0..D {
            want[t * D + j] = (a[t * D + j] as f64).exp() / s;
        }
    }
    close(&out["y"], &want, "softmax y");
    let y = out["y"].clone();
    let out = run(
        "softmax_backward",
        &[
            ("y", Input::F32(&[T, D], &y)),
            ("dy", Input::F32(&[T, D], &b)),
        ],
        &[],
        Device::Cpu,
    )
    .unwrap();
    let mut want = vec![0.0; T * D];
    for t in 0..T {
        let dot: f64 = (0..D)
            .map(|j| y[t * D + j] as f64 * b[t * D + j] as f64)
            .sum();
        for j in 0..D {
            want[t * D + j] = y[t * D + j] as f64 * (b[t * D + j] as f64 - dot);
        }
    }
    close(&out["dx"], &want, "softmax_backward dx");
}

#[test]
fn transpose_rows() {
    // Ragged sizes, one of them past a 32-wide tile.
    for (r, c) in [(1usize, 1usize), (T, D), (17, 33)] {
        let x = data(15 + r as u64, r * c);
        let want: Vec<f32> = (0..c * r).map(|i| x[(i % r) * c + i / r]).collect();
        for device in [Device::Cpu, Device::Emu] {
            let out = run("transpose", &[("x", Input::F32(&[r, c], &x))], &[], device).unwrap();
            // A copy: bit for bit.
            assert_eq!(out["y"], want, "transpose [{r},{c}] on {device}");
        }
    }
    // BF16 stays BF16, bits unchanged.
    let (r, c) = (3, 40);
    let x: Vec<half::bf16> = data(16, r * c)
        .iter()
        .map(|&v| half::bf16::from_f32(v))
        .collect();
    let want: Vec<u16> = (0..c * r)
        .map(|i| x[(i % r) * c + i / r].to_bits())
        .collect();
    for device in [Device::Cpu, Device::Emu] {
        let dir = scratch_dir("model-ops-transpose-bf16");
        let (inp, out) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
        let xt = Tensor::from_slice(&Backend::Cpu, &[r, c], &x).unwrap();
        write_tensors(&inp, &[("x", xt)], &[]);
        run_kernel("transpose", &inp, &out, device).unwrap();
        let file = read_safetensors(&out, &Backend::Cpu).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let y = &file.tensors["y"];
        assert_eq!((y.shape(), y.dtype()), (&[c, r][..], DType::BF16));
        let got: Vec<u16> = y
            .to_vec::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got, want, "bf16 transpose on {device}");
    }
    // Rank 3 names x and the form [R,C].
    let x = data(17, 8);
    let err = run(
        "transpose",
        &[("x", Input::F32(&[2, 2, 2], &x))],
        &[],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "x")
            && err.to_string().contains("[R,C]"),
        "{err}"
    );
    let err = run(
        "transpose",
        &[("a", Input::F32(&[2, 4], &x))],
        &[],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        err.is_bad_input() && err.to_string().contains("`a`") && err.to_string().contains("x[R,C]"),
        "{err}"
    );
}

#[test]
fn misnamed_and_misshapen_tensors_are_named() {
    let x = data(12, T * D);
    // A misnamed input names itself and the op's inputs with their shapes.
    let err = run(
        "rmsnorm",
        &[
            ("xx", Input::F32(&[T, D], &x)),
            ("w", Input::F32(&[D], &x[..D])),
        ],
        &[],
        Device::Cpu,
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        err.is_bad_input() && msg.contains("`xx`") && msg.contains("x[T,d]"),
        "{msg}"
    );
    // A missing input names itself and its shape.
    let err = run(
        "softmax_backward",
        &[("y", Input::F32(&[T, D], &x))],
        &[],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("`dy`") && err.to_string().contains("[T,n]"),
        "{err}"
    );
    // Misshapen: the error names the tensor and the shape expected.
    let err = run(
        "rmsnorm",
        &[
            ("x", Input::F32(&[T, D], &x)),
            ("w", Input::F32(&[D - 1], &x[..D - 1])),
        ],
        &[],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "w"),
        "{err}"
    );
    assert!(err.to_string().contains(&format!("[{D}]")), "{err}");
    let err = run(
        "rope",
        &[
            ("x", Input::F32(&[T, D], &x)),
            ("positions", Input::I32(&[T], &[0; T])),
        ],
        &[],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "x")
            && err.to_string().contains("[T,H,D]"),
        "{err}"
    );
    let err = run(
        "swiglu",
        &[
            ("a", Input::F32(&[T, D], &x)),
            ("b", Input::F32(&[D, T], &x)),
        ],
        &[],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "b")
            && err.to_string().contains(&format!("[{T}, {D}]")),
        "{err}"
    );
    let err = run(
        "embedding",
        &[
            ("table", Input::F32(&[T * D], &x)),
            ("tokens", Input::I32(&[1], &[0])),
        ],
        &[],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "table")
            && err.to_string().contains("[V,d]"),
        "{err}"
    );
    // A bad parameter names itself.
    let err = run(
        "rope",
        &[
            ("x", Input::F32(&[T, 1, D], &x)),
            ("positions", Input::I32(&[T], &[0; T])),
        ],
        &[("theta", "ten")],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Param { name, .. } if name == "theta"),
        "{err}"
    );
}

#[test]
fn list_shows_every_model_op() {
    let list = sluice_kernels::runner::list();
    for op in [
        "rmsnorm ",
        "rmsnorm_backward",
        "rope ",
        "rope_backward",
        "swiglu ",
        "swiglu_backward",
        "embedding ",
        "embedding_backward",
        "residual_add",
        "softmax ",
        "softmax_backward",
        "transpose ",
    ] {
        assert!(list.contains(op), "--list lacks {op}:\n{list}");
    }
    assert!(
        list.contains("eps=1e-6")
            && list.contains("theta=10000")
            && list.contains("vocab (required)")
    );
}

/// One runner call: op, named inputs, parameters.
type Case<'a> = (&'a str, Vec<(&'a str, Input<'a>)>, Vec<(&'a str, &'a str)>);

#[test]
fn emu_rows_match_cpu_rows() {
    // The runner's emu path goes through the same launch code as cuda.
    let (x, w) = (data(13, T * D), data(14, D));
    let pos = [0i32, 3, 1, 9, 2];
    let cases: Vec<Case> = vec![
        (
            "rmsnorm",
            vec![("x", Input::F32(&[T, D], &x)), ("w", Input::F32(&[D], &w))],
            vec![],
        ),
        (
            "rmsnorm_backward",
            vec![
                ("x", Input::F32(&[T, D], &x)),
                ("w", Input::F32(&[D], &w)),
                ("dy", Input::F32(&[T, D], &x)),
            ],
            vec![],
        ),
        (
            "rope",
            vec![
                ("x", Input::F32(&[T, 1, D], &x)),
                ("positions", Input::I32(&[T], &pos)),
            ],
            vec![],
        ),
        (
            "rope_backward",
            vec![
                ("dy", Input::F32(&[T, 1, D], &x)),
                ("positions", Input::I32(&[T], &pos)),
            ],
            vec![],
        ),
        (
            "swiglu",
            vec![
                ("a", Input::F32(&[T, D], &x)),
                ("b", Input::F32(&[T, D], &x)),
            ],
            vec![],
        ),
        (
            "swiglu_backward",
            vec![
                ("a", Input::F32(&[T, D], &x)),
                ("b", Input::F32(&[T, D], &x)),
                ("dh", Input::F32(&[T, D], &x)),
            ],
            vec![],
        ),
        (
            "embedding",
            vec![
                ("table", Input::F32(&[T, D], &x)),
                ("tokens", Input::I32(&[T], &[4, 0, 4, 2, 1])),
            ],
            vec![],
        ),
        (
            "embedding_backward",
            vec![
                ("dout", Input::F32(&[T, D], &x)),
                ("tokens", Input::I32(&[T], &[4, 0, 4, 2, 1])),
            ],
            vec![("vocab", "6")],
        ),
        (
            "residual_add",
            vec![
                ("a", Input::F32(&[T, D], &x)),
                ("b", Input::F32(&[T, D], &x)),
            ],
            vec![],
        ),
        ("softmax", vec![("x", Input::F32(&[T, D], &x))], vec![]),
        (
            "softmax_backward",
            vec![
                ("y", Input::F32(&[T, D], &x)),
                ("dy", Input::F32(&[T, D], &x)),
            ],
            vec![],
        ),
    ];
    for (op, inputs, params) in &cases {
        let cpu = run(op, inputs, params, Device::Cpu).unwrap();
        let emu =
            run(op, inputs, params, Device::Emu).unwrap_or_else(|e| panic!("{op} on emu: {e}"));
        for (name, want) in &cpu {
            let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
            close(&emu[name], &want, &format!("{op} {name} emu vs cpu"));
        }
    }
}
