//! `sluice kernel adamw` / `sq_norm` / `muon_gather` / `muon_apply` through the runner:
//! safetensors in, safetensors out, on cpu and emu, compared with f64 computations written
//! here; misnamed and misshapen tensors and bad parameters give errors that name them.

// Index loops mirror the formulas of the independent computations.
#![allow(clippy::needless_range_loop)]

mod support;

use sluice_kernels::io::read_safetensors;
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Device, Error, Tensor};
use sluice_trainer::kernel_cmd::run_kernel;
use std::collections::BTreeMap;
use support::{scratch_dir, write_input};

/// Writes the inputs and params, runs `op` on `device`, returns the F32 outputs by name.
fn run(
    op: &str,
    tensors: &[(&str, Tensor)],
    params: &[(&str, &str)],
    device: Device,
) -> Result<BTreeMap<String, Vec<f32>>, Error> {
    let dir = scratch_dir(&format!("optim-{op}"));
    let input = write_input(&dir, tensors, params);
    let out = dir.join(format!("out-{device}.safetensors"));
    let result = run_kernel(op, &input, &out, device)
        .map(|_| read_safetensors(&out, &Backend::Cpu).unwrap().tensors);
    std::fs::remove_dir_all(&dir).ok();
    Ok(result?
        .into_iter()
        .map(|(k, t)| {
            assert_eq!(t.dtype(), DType::F32, "output {k} of {op}");
            (k, t.to_vec::<f32>().unwrap())
        })
        .collect())
}

fn f32s(shape: &[usize], data: &[f32]) -> Tensor {
    Tensor::from_slice(&Backend::Cpu, shape, data).unwrap()
}

fn i32s(shape: &[usize], data: &[i32]) -> Tensor {
    Tensor::from_slice(&Backend::Cpu, shape, data).unwrap()
}

fn close(got: &[f32], want: &[f64], what: &str) {
    let err = rel_norm(got, want);
    assert!(err <= F32_TOL, "{what}: rel err {err}");
}

struct Adam {
    lr: f64,
    b1: f64,
    b2: f64,
    eps: f64,
    wd: f64,
    step: i32,
    gs: f64,
}

/// One AdamW step in f64: (p, m, v).
fn adamw_f64(p: &[f32], g: &[f32], m: &[f32], v: &[f32], h: &Adam) -> [Vec<f64>; 3] {
    let (bc1, bc2) = (1.0 - h.b1.powi(h.step), 1.0 - h.b2.powi(h.step));
    let mut out = [vec![], vec![], vec![]];
    for i in 0..p.len() {
        let gi = h.gs * g[i] as f64;
        let mi = h.b1 * m[i] as f64 + (1.0 - h.b1) * gi;
        let vi = h.b2 * v[i] as f64 + (1.0 - h.b2) * gi * gi;
        let pi =
            p[i] as f64 * (1.0 - h.lr * h.wd) - h.lr * (mi / bc1) / ((vi / bc2).sqrt() + h.eps);
        out[0].push(pi);
        out[1].push(mi);
        out[2].push(vi);
    }
    out
}

fn adam_inputs(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let p = rng.normal_vec(n, 1.0);
    let g = rng.normal_vec(n, 1.0);
    let m = rng.normal_vec(n, 0.1);
    // The second moment is non-negative.
    let v: Vec<f32> = rng.normal_vec(n, 0.1).iter().map(|x| x * x).collect();
    (p, g, m, v)
}

fn adam_tensors(p: &[f32], g: &[f32], m: &[f32], v: &[f32]) -> Vec<(&'static str, Tensor)> {
    let n = p.len();
    vec![
        ("p", f32s(&[n], p)),
        ("g", f32s(&[n], g)),
        ("m", f32s(&[n], m)),
        ("v", f32s(&[n], v)),
    ]
}

#[test]
fn adamw_step_matches_f64_on_cpu_and_emu() {
    for n in [1usize, 17, 127] {
        let (p, g, m, v) = adam_inputs(n, 50 + n as u64);
        let params = [
            ("lr", "0.01"),
            ("beta1", "0.8"),
            ("beta2", "0.99"),
            ("eps", "1e-6"),
            ("weight_decay", "0.05"),
            ("step", "3"),
            ("grad_scale", "0.5"),
        ];
        let h = Adam {
            lr: 0.01,
            b1: 0.8,
            b2: 0.99,
            eps: 1e-6,
            wd: 0.05,
            step: 3,
            gs: 0.5,
        };
        let want = adamw_f64(&p, &g, &m, &v, &h);
        let mut cpu = BTreeMap::new();
        for device in [Device::Cpu, Device::Emu] {
            let out = run("adamw", &adam_tensors(&p, &g, &m, &v), &params, device).unwrap();
            for (k, name) in ["p", "m", "v"].iter().enumerate() {
                close(
                    &out[*name],
                    &want[k],
                    &format!("adamw {name} n={n} on {device}"),
                );
            }
            if device == Device::Cpu {
                cpu = out;
            } else {
                for (name, c) in &cpu {
                    let c: Vec<f64> = c.iter().map(|&x| x as f64).collect();
                    close(&out[name], &c, &format!("adamw {name} n={n} emu vs cpu"));
                }
            }
        }
    }
    // The defaults are the model's OptimConfig: lr 3e-3, betas 0.9/0.95, eps 1e-8, wd 0.1,
    // step 1, no gradient scaling.
    let (p, g, m, v) = adam_inputs(17, 60);
    let out = run("adamw", &adam_tensors(&p, &g, &m, &v), &[], Device::Cpu).unwrap();
    let h = Adam {
        lr: 3e-3,
        b1: 0.9,
        b2: 0.95,
        eps: 1e-8,
        wd: 0.1,
        step: 1,
        gs: 1.0,
    };
    let want = adamw_f64(&p, &g, &m, &v, &h);
    close(&out["p"], &want[0], "adamw defaults p");
    close(&out["m"], &want[1], "adamw defaults m");
    close(&out["v"], &want[2], "adamw defaults v");
    let list = sluice_kernels::runner::list();
    assert!(
        list.contains("lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1"),
        "{list}"
    );
}

#[test]
fn adamw_bad_input_is_named() {
    let (p, g, m, v) = adam_inputs(17, 70);
    // Misnamed.
    let mut inputs = adam_tensors(&p, &g, &m, &v);
    inputs[1].0 = "grad";
    let err = run("adamw", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        err.is_bad_input()
            && err.to_string().contains("`grad`")
            && err.to_string().contains("g[N]"),
        "{err}"
    );
    // Misshapen g and v.
    let mut inputs = adam_tensors(&p, &g, &m, &v);
    inputs[1].1 = f32s(&[16], &g[..16]);
    let err = run("adamw", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "g")
            && err.to_string().contains("[N] = [17]"),
        "{err}"
    );
    let mut inputs = adam_tensors(&p, &g, &m, &v);
    inputs[3].1 = f32s(&[1, 17], &v);
    let err = run("adamw", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "v")
            && err.to_string().contains("[N] = [17]"),
        "{err}"
    );
    let mut inputs = adam_tensors(&p, &g, &m, &v);
    inputs[0].1 = f32s(&[1, 17], &p);
    let err = run("adamw", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "p")
            && err.to_string().contains("[N]"),
        "{err}"
    );
    // Bad parameters name themselves.
    for (name, value) in [
        ("step", "0"),
        ("step", "two"),
        ("beta1", "1.5"),
        ("beta2", "-0.1"),
        ("lr", "fast"),
        ("lr", "-1"),
        ("eps", "0"),
        ("weight_decay", "-0.1"),
        ("grad_scale", "inf"),
    ] {
        let err = run(
            "adamw",
            &adam_tensors(&p, &g, &m, &v),
            &[(name, value)],
            Device::Cpu,
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::Param { name: n, .. } if n == name),
            "{name}={value}: {err}"
        );
    }
}

#[test]
fn sq_norm_matches_f64_on_cpu_and_emu() {
    // 20000 elements: three chunks of 8192, the last ragged.
    for n in [1usize, 17, 20000] {
        let x = Rng::new(80 + n as u64).normal_vec(n, 1.0);
        let want: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        for device in [Device::Cpu, Device::Emu] {
            let out = run("sq_norm", &[("x", f32s(&[n], &x))], &[], device).unwrap();
            assert_eq!(out["sq_norm"].len(), 1);
            close(
                &out["sq_norm"],
                &[want],
                &format!("sq_norm n={n} on {device}"),
            );
            // Deterministic: a second run gives the same bits.
            let again = run("sq_norm", &[("x", f32s(&[n], &x))], &[], device).unwrap();
            assert_eq!(out["sq_norm"][0].to_bits(), again["sq_norm"][0].to_bits());
        }
    }
    let err = run(
        "sq_norm",
        &[("x", f32s(&[2, 3], &[1.0; 6]))],
        &[],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "x")
            && err.to_string().contains("[N]"),
        "{err}"
    );
    let err = run("sq_norm", &[("y", f32s(&[3], &[1.0; 3]))], &[], Device::Cpu).unwrap_err();
    assert!(
        err.is_bad_input() && err.to_string().contains("`y`") && err.to_string().contains("x[N]"),
        "{err}"
    );
}

// Muon: two disjoint strided [3,4] blocks of a 40-element vector.
const N: usize = 40;
const R: usize = 3;
const C: usize = 4;
const OFFSETS: [i32; 2] = [1, 20];
const STRIDES: [i32; 2] = [5, 6];

fn at(k: usize, r: usize, c: usize) -> usize {
    OFFSETS[k] as usize + r * STRIDES[k] as usize + c
}

#[test]
fn muon_gather_and_apply_match_f64_on_cpu_and_emu() {
    let mut rng = Rng::new(90);
    let g = rng.normal_vec(N, 1.0);
    let mom = rng.normal_vec(N, 1.0);
    let p = rng.normal_vec(N, 1.0);
    let x = rng.normal_vec(2 * R * C, 1.0);
    let (mu, gs) = (0.9f64, 0.5f64);
    for nesterov in [true, false] {
        let mut want_x = vec![0.0; 2 * R * C];
        let mut want_mom: Vec<f64> = mom.iter().map(|&v| v as f64).collect();
        for k in 0..2 {
            for r in 0..R {
                for c in 0..C {
                    let i = at(k, r, c);
                    let gi = gs * g[i] as f64;
                    let mi = mu * mom[i] as f64 + gi;
                    want_mom[i] = mi;
                    want_x[(k * R + r) * C + c] = if nesterov { gi + mu * mi } else { mi };
                }
            }
        }
        let nest = if nesterov { "true" } else { "false" };
        let params = [
            ("r", "3"),
            ("c", "4"),
            ("mu", "0.9"),
            ("grad_scale", "0.5"),
            ("nesterov", nest),
        ];
        for device in [Device::Cpu, Device::Emu] {
            let out = run(
                "muon_gather",
                &[
                    ("g", f32s(&[N], &g)),
                    ("mom", f32s(&[N], &mom)),
                    ("offsets", i32s(&[2], &OFFSETS)),
                    ("row_strides", i32s(&[2], &STRIDES)),
                ],
                &params,
                device,
            )
            .unwrap();
            close(
                &out["x"],
                &want_x,
                &format!("muon_gather x nesterov={nest} on {device}"),
            );
            close(
                &out["mom"],
                &want_mom,
                &format!("muon_gather mom on {device}"),
            );
        }
    }
    // Apply with an explicit scale, then with the default 0.2 sqrt(max(r, c)).
    for (scale, params) in [
        (
            0.7f64,
            vec![("lr", "0.02"), ("weight_decay", "0.1"), ("scale", "0.7")],
        ),
        (
            0.2 * 4f64.sqrt(),
            vec![("lr", "0.02"), ("weight_decay", "0.1")],
        ),
    ] {
        let mut want: Vec<f64> = p.iter().map(|&v| v as f64).collect();
        for k in 0..2 {
            for r in 0..R {
                for c in 0..C {
                    let i = at(k, r, c);
                    want[i] = p[i] as f64 * (1.0 - 0.02 * 0.1)
                        - 0.02 * scale * x[(k * R + r) * C + c] as f64;
                }
            }
        }
        for device in [Device::Cpu, Device::Emu] {
            let out = run(
                "muon_apply",
                &[
                    ("p", f32s(&[N], &p)),
                    ("x", f32s(&[2, R, C], &x)),
                    ("offsets", i32s(&[2], &OFFSETS)),
                    ("row_strides", i32s(&[2], &STRIDES)),
                ],
                &params,
                device,
            )
            .unwrap();
            close(
                &out["p"],
                &want,
                &format!("muon_apply p scale={scale} on {device}"),
            );
        }
    }
}

#[test]
fn muon_bad_input_is_named() {
    let p = Rng::new(91).normal_vec(N, 1.0);
    let x = vec![0.5f32; 2 * R * C];
    let apply = |x_shape: &[usize], offsets: Tensor, strides: Tensor, params: &[(&str, &str)]| {
        run(
            "muon_apply",
            &[
                ("p", f32s(&[N], &p)),
                ("x", f32s(x_shape, &x)),
                ("offsets", offsets),
                ("row_strides", strides),
            ],
            params,
            Device::Cpu,
        )
        .unwrap_err()
    };
    // Misshapen x, offsets.
    let err = apply(&[2, R * C], i32s(&[2], &OFFSETS), i32s(&[2], &STRIDES), &[]);
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "x")
            && err.to_string().contains("[n,r,c]"),
        "{err}"
    );
    let err = apply(
        &[2, R, C],
        i32s(&[1], &OFFSETS[..1]),
        i32s(&[2], &STRIDES),
        &[],
    );
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "offsets")
            && err.to_string().contains("[n] = [2]"),
        "{err}"
    );
    // A negative offset names offsets; overlapping or out-of-range blocks name blocks.
    let err = apply(&[2, R, C], i32s(&[2], &[-1, 20]), i32s(&[2], &STRIDES), &[]);
    assert!(
        err.is_bad_input() && err.to_string().contains("`offsets`[0]"),
        "{err}"
    );
    let err = apply(&[2, R, C], i32s(&[2], &[1, 2]), i32s(&[2], &STRIDES), &[]);
    assert!(
        matches!(&err, Error::Param { name, .. } if name == "blocks")
            && err.to_string().contains("overlap"),
        "{err}"
    );
    let err = apply(&[2, R, C], i32s(&[2], &[1, 30]), i32s(&[2], &STRIDES), &[]);
    assert!(
        matches!(&err, Error::Param { name, .. } if name == "blocks"),
        "{err}"
    );
    // Bad parameters.
    for (name, value) in [("lr", "-1"), ("weight_decay", "x"), ("scale", "big")] {
        let err = apply(
            &[2, R, C],
            i32s(&[2], &OFFSETS),
            i32s(&[2], &STRIDES),
            &[(name, value)],
        );
        assert!(
            matches!(&err, Error::Param { name: n, .. } if n == name),
            "{name}={value}: {err}"
        );
    }
    // muon_gather: r and c are required; mu in [0, 1); nesterov a boolean; mom misshapen.
    let gather = |mom_len: usize, params: &[(&str, &str)]| {
        run(
            "muon_gather",
            &[
                ("g", f32s(&[N], &p)),
                ("mom", f32s(&[mom_len], &p[..mom_len])),
                ("offsets", i32s(&[2], &OFFSETS)),
                ("row_strides", i32s(&[2], &STRIDES)),
            ],
            params,
            Device::Cpu,
        )
        .unwrap_err()
    };
    for (name, params) in [
        ("r", vec![("c", "4")]),
        ("c", vec![("r", "3")]),
        ("mu", vec![("r", "3"), ("c", "4"), ("mu", "1")]),
        (
            "nesterov",
            vec![("r", "3"), ("c", "4"), ("nesterov", "maybe")],
        ),
    ] {
        let err = gather(N, &params);
        assert!(
            matches!(&err, Error::Param { name: n, .. } if n == name),
            "{name}: {err}"
        );
    }
    let err = gather(N - 1, &[("r", "3"), ("c", "4")]);
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "mom")
            && err.to_string().contains(&format!("[N] = [{N}]")),
        "{err}"
    );
}

/// bf16 of an f32 by round to nearest even on the bits (finite inputs).
fn bf16_rne(x: f32) -> u16 {
    let b = x.to_bits();
    let lsb = (b >> 16) & 1;
    ((b + 0x7fff + lsb) >> 16) as u16
}

#[test]
fn cast_bf16_rounds_to_nearest_even_on_cpu_and_emu() {
    let mut x = Rng::new(95).normal_vec(17 * 3, 100.0);
    // Exact ties: round to the even neighbour, both ways.
    x[0] = f32::from_bits(0x3f80_8000); // 1.00390625: tie, even below
    x[1] = f32::from_bits(0x3f81_8000); // tie, even above
    x[2] = 0.0;
    let want: Vec<u16> = x.iter().map(|&v| bf16_rne(v)).collect();
    assert_eq!(&want[..2], &[0x3f80, 0x3f82]);
    for device in [Device::Cpu, Device::Emu] {
        let dir = scratch_dir("optim-cast");
        let input = write_input(&dir, &[("x", f32s(&[17, 3], &x))], &[]);
        let out = dir.join("out.safetensors");
        run_kernel("cast_bf16", &input, &out, device).unwrap();
        let file = read_safetensors(&out, &Backend::Cpu).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let y = &file.tensors["y"];
        assert_eq!((y.shape(), y.dtype()), (&[17, 3][..], DType::BF16));
        let got: Vec<u16> = y
            .to_vec::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got, want, "cast_bf16 on {device}");
    }
    // A BF16 input names x and the dtype expected; a misnamed one names itself.
    let xb: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let err = run(
        "cast_bf16",
        &[("x", Tensor::from_slice(&Backend::Cpu, &[51], &xb).unwrap())],
        &[],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::DType { tensor, .. } if tensor == "x"),
        "{err}"
    );
    let err = run("cast_bf16", &[("src", f32s(&[51], &x))], &[], Device::Cpu).unwrap_err();
    assert!(
        err.is_bad_input()
            && err.to_string().contains("`src`")
            && err.to_string().contains("x[...]"),
        "{err}"
    );
}
