//! The grouped backward forms of the gemm family (kernels/src/ops/gemm/segments.rs):
//! `gemm_nn` / `gemm_grouped_nn` (B stored [K,N], read in place) and `gemm_segment_tn`
//! (out[g] = P_g^T · Q_g over row segments, ragged K). Against an f64 oracle by relative norm;
//! against the [N,K] forms on transposed copies bit for bit (the promise: the same values reach
//! the same instructions in the same order); emu against cpu bit for bit for `gemm_segment_tn`
//! (both one FMA chain over the segment's rows). Ragged sizes (1, 17, 127 rows; columns that are
//! and are not multiples of 8, so both loaders run), empty segments, poisoned outputs (tests run
//! in debug mode: an element a kernel misses is NaN), bad input named.

use sluice_kernels::ops::gemm::{
    gemm, gemm_grouped, gemm_grouped_nn, gemm_nn, gemm_segment_tn, gemm_segment_tn_reference,
};
use sluice_kernels::testing::{rel_norm, Rng, BF16_TOL, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Values of `dtype` (BF16: rounded first, so the f64 oracle sees the operands the kernel does).
fn values(rng: &mut Rng, n: usize, dtype: DType) -> Vec<f32> {
    let v = rng.normal_vec(n, 1.0);
    match dtype {
        DType::BF16 => v
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect(),
        _ => v,
    }
}

fn up(b: &Backend, shape: &[usize], v: &[f32], dtype: DType) -> Tensor {
    Tensor::from_f32_as(b, shape, dtype, v).unwrap()
}

fn offsets(b: &Backend, o: &[i32]) -> Tensor {
    Tensor::from_slice(b, &[o.len()], o).unwrap()
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::BF16 {
        BF16_TOL
    } else {
        F32_TOL
    }
}

/// [G,K,N] -> [G,N,K].
fn transpose_stack(v: &[f32], g: usize, k: usize, n: usize) -> Vec<f32> {
    let mut t = vec![0.0; v.len()];
    for gi in 0..g {
        for kk in 0..k {
            for j in 0..n {
                t[gi * n * k + j * k + kk] = v[gi * k * n + kk * n + j];
            }
        }
    }
    t
}

/// Segment sets over `rows`: empty, one-row and long segments, and one covering everything.
fn segment_sets(rows: i32) -> Vec<Vec<i32>> {
    vec![
        vec![0, rows],
        vec![0, 0, 1.min(rows), rows, rows],
        vec![0, rows / 3, rows / 3, rows - 1.min(rows), rows],
    ]
}

fn emu() -> Backend {
    Backend::emu_with_seed(7)
}

#[test]
fn segment_tn_matches_the_oracle_and_emu_equals_cpu_bit_for_bit() {
    let mut rng = Rng::new(41);
    let mut checked = 0;
    let e = emu();
    for dtype in [DType::F32, DType::BF16] {
        for (rows, p, q) in [(1usize, 17usize, 8usize), (17, 24, 127), (127, 136, 40)] {
            for off in segment_sets(rows as i32) {
                let pv = values(&mut rng, rows * p, dtype);
                let qv = values(&mut rng, rows * q, dtype);
                let g = off.len() - 1;
                let mut oracle = vec![0.0f64; g * p * q];
                for gi in 0..g {
                    for r in off[gi] as usize..off[gi + 1] as usize {
                        for i in 0..p {
                            for j in 0..q {
                                oracle[(gi * p + i) * q + j] +=
                                    pv[r * p + i] as f64 * qv[r * q + j] as f64;
                            }
                        }
                    }
                }
                let mut outs = Vec::new();
                for b in [&Backend::Cpu, &e] {
                    let out = gemm_segment_tn(
                        b,
                        &up(b, &[rows, p], &pv, dtype),
                        &up(b, &[rows, q], &qv, dtype),
                        &offsets(b, &off),
                    )
                    .unwrap();
                    assert_eq!(out.shape(), [g, p, q]);
                    let got = out.to_vec::<f32>().unwrap();
                    let r = rel_norm(&got, &oracle);
                    let label = format!("{} {dtype} rows {rows} p {p} q {q} {off:?}", b.device());
                    assert!(r < tol(dtype), "{label}: relative norm {r:e}");
                    // Empty segments are exact zeros, not left-over poison.
                    for gi in 0..g {
                        if off[gi] == off[gi + 1] {
                            assert!(
                                got[gi * p * q..][..p * q].iter().all(|&x| x == 0.0),
                                "{label}"
                            );
                        }
                    }
                    outs.push(bits(&out));
                }
                assert_eq!(
                    outs[0], outs[1],
                    "{dtype} rows {rows} p {p} q {q} {off:?}: emu != cpu"
                );
                let bounds: Vec<usize> = off.iter().map(|&o| o as usize).collect();
                let reference = gemm_segment_tn_reference(&pv, &qv, &bounds, p, q);
                let rb: Vec<u32> = reference.iter().map(|v| v.to_bits()).collect();
                assert_eq!(outs[0], rb, "the op on cpu is its reference");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 2 * 3 * 3);
}

#[test]
fn segment_tn_equals_gemm_on_each_transposed_segment_bit_for_bit() {
    // The per-expert path it replaced: gemm(P_g^T, Q_g^T) on transposed copies, one per group.
    let e = emu();
    let mut rng = Rng::new(43);
    let (rows, p, q) = (75usize, 40usize, 33usize);
    let off = [0i32, 30, 30, 75];
    for dtype in [DType::F32, DType::BF16] {
        let pv = values(&mut rng, rows * p, dtype);
        let qv = values(&mut rng, rows * q, dtype);
        let all = bits(
            &gemm_segment_tn(
                &e,
                &up(&e, &[rows, p], &pv, dtype),
                &up(&e, &[rows, q], &qv, dtype),
                &offsets(&e, &off),
            )
            .unwrap(),
        );
        let mut groups = 0;
        for g in 0..off.len() - 1 {
            let (r0, r1) = (off[g] as usize, off[g + 1] as usize);
            if r1 == r0 {
                continue;
            }
            let n = r1 - r0;
            let seg_t = |v: &[f32], cols: usize| -> Vec<f32> {
                let mut t = vec![0.0; cols * n];
                for r in 0..n {
                    for c in 0..cols {
                        t[c * n + r] = v[(r0 + r) * cols + c];
                    }
                }
                t
            };
            let c = gemm(
                &e,
                &up(&e, &[p, n], &seg_t(&pv, p), dtype),
                &up(&e, &[q, n], &seg_t(&qv, q), dtype),
            )
            .unwrap();
            assert_eq!(all[g * p * q..][..p * q], bits(&c)[..], "{dtype} group {g}");
            groups += 1;
        }
        assert_eq!(groups, 2);
    }
}

#[test]
fn nn_forms_equal_the_nk_forms_on_transposed_weights_bit_for_bit() {
    let mut rng = Rng::new(47);
    let mut checked = 0;
    for b in [&Backend::Cpu, &emu()] {
        for dtype in [DType::F32, DType::BF16] {
            for (rows, k, n) in [(1usize, 16usize, 17usize), (17, 17, 24), (127, 40, 127)] {
                // Grouped.
                let off = [0, rows as i32 / 2, rows as i32 / 2, rows as i32];
                let g = off.len() - 1;
                let av = values(&mut rng, rows * k, dtype);
                let bv = values(&mut rng, g * k * n, dtype);
                let a = up(b, &[rows, k], &av, dtype);
                let ot = offsets(b, &off);
                let nn = gemm_grouped_nn(b, &a, &up(b, &[g, k, n], &bv, dtype), &ot).unwrap();
                let nk = gemm_grouped(
                    b,
                    &a,
                    &up(b, &[g, n, k], &transpose_stack(&bv, g, k, n), dtype),
                    &ot,
                )
                .unwrap();
                let label = format!("{} {dtype} rows {rows} k {k} n {n}", b.device());
                assert_eq!(bits(&nn), bits(&nk), "grouped {label}");
                // The oracle, so the two agreeing is not two copies of one mistake.
                let mut oracle = vec![0.0f64; rows * n];
                for gi in 0..g {
                    for r in off[gi] as usize..off[gi + 1] as usize {
                        for j in 0..n {
                            oracle[r * n + j] = (0..k)
                                .map(|kk| av[r * k + kk] as f64 * bv[(gi * k + kk) * n + j] as f64)
                                .sum();
                        }
                    }
                }
                let r = rel_norm(&nn.to_vec::<f32>().unwrap(), &oracle);
                assert!(r < tol(dtype), "grouped {label}: relative norm {r:e}");
                // Plain.
                let bp = &bv[..k * n];
                let nn = gemm_nn(b, &a, &up(b, &[k, n], bp, dtype)).unwrap();
                let nk =
                    gemm(b, &a, &up(b, &[n, k], &transpose_stack(bp, 1, k, n), dtype)).unwrap();
                assert_eq!(bits(&nn), bits(&nk), "plain {label}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 2 * 2 * 3);
}

#[test]
fn bad_input_is_an_error_naming_the_tensor() {
    let b = Backend::Cpu;
    let t = |shape: &[usize]| Tensor::zeros(&b, shape, DType::F32).unwrap();
    let named = |r: sluice_kernels::Result<Tensor>, name: &str| {
        let Err(e) = r else {
            panic!("expected an error naming {name}")
        };
        let m = e.to_string();
        assert!(m.contains(name), "{m} should name {name}");
        e
    };
    let a = t(&[10, 8]);
    named(
        gemm_grouped_nn(&b, &a, &t(&[2, 7, 5]), &offsets(&b, &[0, 4, 10])),
        "b_stack",
    );
    named(
        gemm_grouped_nn(&b, &a, &t(&[3, 8, 5]), &offsets(&b, &[0, 4, 10])),
        "b_stack",
    );
    named(
        gemm_grouped_nn(&b, &a, &t(&[2, 8, 5]), &offsets(&b, &[0, 11, 10])),
        "offsets",
    );
    named(gemm_nn(&b, &a, &t(&[7, 5])), "b");
    named(
        gemm_segment_tn(&b, &a, &t(&[9, 4]), &offsets(&b, &[0, 10])),
        "q",
    );
    named(
        gemm_segment_tn(&b, &a, &t(&[10, 4]), &offsets(&b, &[0, 9])),
        "offsets",
    );
    let bf = Tensor::zeros(&b, &[10, 4], DType::BF16).unwrap();
    let e = named(gemm_segment_tn(&b, &a, &bf, &offsets(&b, &[0, 10])), "q");
    assert!(matches!(e, Error::DType { .. }));
    assert!(gemm_segment_tn(&b, &a, &t(&[10, 4]), &offsets(&b, &[0, 10])).is_ok());
}

/// Where a GPU exists (scripts/gpu-check): both forms against the CPU by relative norm (tensor
/// cores sum a k16 step in their own order), and two runs with the same bits. Says it skipped
/// without a GPU.
#[test]
fn cuda_matches_the_cpu() {
    let Some(gpu) = sluice_kernels::device::cuda_for_tests("gemm_segments cuda") else {
        return;
    };
    let cpu = Backend::Cpu;
    let mut rng = Rng::new(53);
    let (rows, p, q) = (1000usize, 264usize, 136usize);
    let off = [0i32, 1, 1, 517, 1000];
    for dtype in [DType::F32, DType::BF16] {
        let pv = values(&mut rng, rows * p, dtype);
        let qv = values(&mut rng, rows * q, dtype);
        let bv = values(&mut rng, 4 * q * p, dtype);
        let run = |b: &Backend| {
            let o = offsets(b, &off);
            let pt = up(b, &[rows, p], &pv, dtype);
            let tn = gemm_segment_tn(b, &pt, &up(b, &[rows, q], &qv, dtype), &o).unwrap();
            let nn = gemm_grouped_nn(b, &pt, &up(b, &[4, p, q], &bv, dtype), &o).unwrap();
            (tn.to_vec::<f32>().unwrap(), nn.to_vec::<f32>().unwrap())
        };
        let (want_tn, want_nn) = run(&cpu);
        let (tn, nn) = run(&gpu);
        let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        for (name, got, want) in [("segment_tn", &tn, &want_tn), ("grouped_nn", &nn, &want_nn)] {
            let r = rel_norm(got, &f64s(want));
            assert!(r < tol(dtype), "cuda {name} {dtype}: relative norm {r:e}");
        }
        let (tn2, nn2) = run(&gpu);
        let b32 = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(b32(&tn2), b32(&tn), "cuda segment_tn {dtype}: two runs");
        assert_eq!(b32(&nn2), b32(&nn), "cuda grouped_nn {dtype}: two runs");
    }
}
