//! gemm_batched_epilogue: the bf16 GEMM with its epilogue v = fmaf(beta, E, alpha acc), written
//! as f32 / bf16, as is / transposed (kernels/src/ops/gemm_epilogue.rs).
//!
//! - emu against cpu, bit for bit (both sum each output in one ascending FMA chain and apply the
//!   same formula), every output, with and without E, ragged shapes (1, 17, 127, 130 rows and
//!   columns: partial tiles and partial 32-row slabs), a shared B;
//! - emu against the unfused composition on emu (the plain `gemm_batched`, then the combine
//!   formula on the host): the bits the removed `newton_schulz_combine_bf16` produced;
//! - the identity epilogue against the plain GEMM, bit for bit;
//! - the grouped SwiGLU form (`gemm_grouped_swiglu`): emu against cpu and against the unfused
//!   grouped GEMM, `swiglu` and rounding on emu, bit for bit, ragged segments;
//! - bad input.
//!
//! Outputs are allocated poisoned (NaN) and every element is compared, so a missed element
//! fails.

use half::bf16;
use sluice_kernels::ops::gemm::{gemm_batched_with_path, gemm_grouped_with_path, GemmPath};
use sluice_kernels::ops::swiglu::swiglu;

/// The plain GEMM on the path the epilogue kernel shares its main loop with (mma.sync), whatever
/// `SLUICE_GEMM_PATH` says.
fn gemm_batched(backend: &Backend, a: &Tensor, b: &Tensor) -> sluice_kernels::Result<Tensor> {
    gemm_batched_with_path(backend, a, b, GemmPath::Mma)
}
use sluice_kernels::ops::gemm_epilogue::{
    gemm_batched_epilogue, gemm_grouped_swiglu, GemmEpilogue,
};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Error, Tensor};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The four outputs of one run, as f32 (bf16 widened exactly).
struct Outs {
    c: Vec<f32>,
    c_t: Vec<f32>,
    c_b: Vec<f32>,
    c_bt: Vec<f32>,
}

/// Shapes: (batch, M, N, K, B shared).
type Case = (usize, usize, usize, usize, bool);

/// A [batch,M,K], B, E [batch,M,N] from `seed` (non-zero; A and B are bf16 values).
fn inputs((batch, m, n, k, shared): Case, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let round =
        |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect() };
    let a = round(rng.normal_vec(batch * m * k, 1.0));
    let b = round(rng.normal_vec(if shared { n * k } else { batch * n * k }, 1.0));
    let e = rng.normal_vec(batch * m * n, 1.0);
    (a, b, e)
}

fn run(backend: &Backend, case: Case, seed: u64, (alpha, beta, with_e): (f32, f32, bool)) -> Outs {
    let (batch, m, n, k, shared) = case;
    let (a, b, e) = inputs(case, seed);
    let at = Tensor::from_f32_as(backend, &[batch, m, k], DType::BF16, &a).unwrap();
    let bshape: Vec<usize> = if shared {
        vec![n, k]
    } else {
        vec![batch, n, k]
    };
    let bt = Tensor::from_f32_as(backend, &bshape, DType::BF16, &b).unwrap();
    let et = Tensor::from_slice(backend, &[batch, m, n], &e).unwrap();
    let mut c = Tensor::poisoned(backend, &[batch, m, n], DType::F32).unwrap();
    let mut c_t = Tensor::poisoned(backend, &[batch, n, m], DType::F32).unwrap();
    let mut c_b = Tensor::poisoned(backend, &[batch, m, n], DType::BF16).unwrap();
    let mut c_bt = Tensor::poisoned(backend, &[batch, n, m], DType::BF16).unwrap();
    let mut ep = if with_e {
        GemmEpilogue::scaled_plus(alpha, beta, &et)
    } else {
        GemmEpilogue::scaled(alpha)
    };
    ep.c = Some(&mut c);
    ep.c_t = Some(&mut c_t);
    ep.c_b = Some(&mut c_b);
    ep.c_bt = Some(&mut c_bt);
    gemm_batched_epilogue(backend, &at, &bt, ep).unwrap();
    Outs {
        c: c.to_f32_vec().unwrap(),
        c_t: c_t.to_f32_vec().unwrap(),
        c_b: c_b.to_f32_vec().unwrap(),
        c_bt: c_bt.to_f32_vec().unwrap(),
    }
}

const CASES: &[Case] = &[
    (2, 1, 17, 127, false),
    (1, 17, 1, 5, false),
    (2, 17, 127, 1, false),
    (1, 127, 17, 33, true),
    (2, 130, 130, 40, false),
    (1, 33, 300, 260, false),
];

#[test]
fn emu_equals_cpu_bit_for_bit_on_every_output() {
    let mut compared = 0;
    for (i, &case) in CASES.iter().enumerate() {
        for params in [
            (1.0, 0.0, false),
            (2.0315, -4.775, true),
            (1.0, 3.4445, true),
        ] {
            let cpu = run(&Backend::Cpu, case, 80 + i as u64, params);
            let emu = run(
                &Backend::emu_with_seed(1 + i as u64),
                case,
                80 + i as u64,
                params,
            );
            for (name, got, want) in [
                ("c", &emu.c, &cpu.c),
                ("c_t", &emu.c_t, &cpu.c_t),
                ("c_b", &emu.c_b, &cpu.c_b),
                ("c_bt", &emu.c_bt, &cpu.c_bt),
            ] {
                assert!(got.iter().all(|v| v.is_finite()), "{case:?} {name}: NaN");
                assert_eq!(
                    bits(got),
                    bits(want),
                    "{case:?} {params:?} {name}: emu != cpu"
                );
                compared += 1;
            }
            // The outputs are one value in four forms.
            let (_, m, n, _, _) = case;
            for (j, &v) in cpu.c.iter().enumerate() {
                let (b, rc) = (j / (m * n), j % (m * n));
                let t = b * m * n + (rc % n) * m + rc / n;
                assert_eq!(cpu.c_t[t].to_bits(), v.to_bits());
                assert_eq!(cpu.c_b[j], bf16::from_f32(v).to_f32());
                assert_eq!(cpu.c_bt[t], cpu.c_b[j]);
            }
        }
    }
    assert_eq!(compared, CASES.len() * 3 * 4);
}

/// The fused epilogue against the unfused path it replaced in Newton-Schulz: the plain GEMM on
/// emu, then v = fmaf(beta, E, alpha * P) on the host (the formula of the removed
/// `newton_schulz_combine_bf16`, whose f32 ops are the same in the same order).
#[test]
fn the_fused_epilogue_has_the_unfused_bits_on_emu() {
    let mut compared = 0;
    for (i, &case) in CASES.iter().enumerate() {
        let (batch, m, n, k, shared) = case;
        let emu = Backend::emu_with_seed(3);
        let (a, b, e) = inputs(case, 90 + i as u64);
        let at = Tensor::from_f32_as(&emu, &[batch, m, k], DType::BF16, &a).unwrap();
        let bshape: Vec<usize> = if shared {
            vec![n, k]
        } else {
            vec![batch, n, k]
        };
        let bt = Tensor::from_f32_as(&emu, &bshape, DType::BF16, &b).unwrap();
        let p = gemm_batched(&emu, &at, &bt)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let (alpha, beta) = (2.0315f32, -4.775f32);
        let unfused: Vec<f32> = p
            .iter()
            .zip(&e)
            .map(|(&p, &e)| beta.mul_add(e, alpha * p))
            .collect();
        let fused = run(&emu, case, 90 + i as u64, (alpha, beta, true));
        assert_eq!(bits(&fused.c), bits(&unfused), "{case:?}: fused != unfused");
        let rounded: Vec<f32> = unfused
            .iter()
            .map(|&v| bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(bits(&fused.c_b), bits(&rounded), "{case:?}: bf16");
        compared += 1;
    }
    assert_eq!(compared, CASES.len());
}

#[test]
fn the_identity_epilogue_is_the_plain_gemm() {
    for backend in [Backend::Cpu, Backend::emu_with_seed(2)] {
        let (batch, m, n, k) = (2, 130, 17, 300);
        let (a, b, _) = inputs((batch, m, n, k, false), 7);
        let at = Tensor::from_f32_as(&backend, &[batch, m, k], DType::BF16, &a).unwrap();
        let bt = Tensor::from_f32_as(&backend, &[batch, n, k], DType::BF16, &b).unwrap();
        let plain = gemm_batched(&backend, &at, &bt)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let mut c = Tensor::poisoned(&backend, &[batch, m, n], DType::F32).unwrap();
        gemm_batched_epilogue(&backend, &at, &bt, GemmEpilogue::identity(&mut c)).unwrap();
        let got = c.to_vec::<f32>().unwrap();
        assert!(plain.iter().all(|v| v.is_finite()));
        assert_eq!(bits(&got), bits(&plain), "{}", backend.device());
    }
}

#[test]
fn bad_input_is_an_error_naming_the_tensor() {
    for backend in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let a = Tensor::from_f32_as(&backend, &[2, 3, 4], DType::BF16, &[1.0; 24]).unwrap();
        let b = Tensor::from_f32_as(&backend, &[2, 5, 4], DType::BF16, &[1.0; 40]).unwrap();
        let e = Tensor::from_slice(&backend, &[2, 3, 5], &[1.0f32; 30]).unwrap();
        let name = |err: Error| match err {
            Error::Shape { tensor, .. } | Error::DType { tensor, .. } => tensor,
            other => format!("other: {other}"),
        };
        // No output.
        let err = gemm_batched_epilogue(&backend, &a, &b, GemmEpilogue::scaled(1.0)).unwrap_err();
        assert!(err.to_string().contains("no output"), "{err}");
        // c transposed given the untransposed shape.
        let mut wrong = Tensor::poisoned(&backend, &[2, 3, 5], DType::F32).unwrap();
        let mut ep = GemmEpilogue::scaled(1.0);
        ep.c_t = Some(&mut wrong);
        assert_eq!(
            name(gemm_batched_epilogue(&backend, &a, &b, ep).unwrap_err()),
            "c_t"
        );
        // A bf16 output of the wrong dtype.
        let mut f32_out = Tensor::poisoned(&backend, &[2, 3, 5], DType::F32).unwrap();
        let mut ep = GemmEpilogue::scaled(1.0);
        ep.c_b = Some(&mut f32_out);
        assert_eq!(
            name(gemm_batched_epilogue(&backend, &a, &b, ep).unwrap_err()),
            "c_b"
        );
        // E of the wrong shape.
        let e_bad = Tensor::from_slice(&backend, &[2, 5, 3], &[1.0f32; 30]).unwrap();
        let mut c = Tensor::poisoned(&backend, &[2, 3, 5], DType::F32).unwrap();
        let mut ep = GemmEpilogue::scaled_plus(1.0, 1.0, &e_bad);
        ep.c = Some(&mut c);
        assert_eq!(
            name(gemm_batched_epilogue(&backend, &a, &b, ep).unwrap_err()),
            "e"
        );
        // F32 operands: the epilogue is on the bf16 path only.
        let af = Tensor::from_slice(&backend, &[2, 3, 4], &[1.0f32; 24]).unwrap();
        let mut c = Tensor::poisoned(&backend, &[2, 3, 5], DType::F32).unwrap();
        assert_eq!(
            name(
                gemm_batched_epilogue(&backend, &af, &b, GemmEpilogue::identity(&mut c))
                    .unwrap_err()
            ),
            "a"
        );
        // K disagrees.
        let b_bad = Tensor::from_f32_as(&backend, &[2, 5, 3], DType::BF16, &[1.0; 30]).unwrap();
        let mut c = Tensor::poisoned(&backend, &[2, 3, 5], DType::F32).unwrap();
        let mut ep = GemmEpilogue::scaled_plus(1.0, 1.0, &e);
        ep.c = Some(&mut c);
        assert_eq!(
            name(gemm_batched_epilogue(&backend, &a, &b_bad, ep).unwrap_err()),
            "b"
        );
    }
}

/// On a GPU: against cpu by relative norm (the tensor cores add each mma's 16 products in an
/// order the ISA leaves open, so bits may differ from the emulated chain in the last places:
/// `BF16_TOL` is generous for K <= 300 of f32 accumulation), two runs bit-identical, and the
/// identity epilogue bit-identical to the plain GEMM (the same main loop, then 1 * acc).
#[test]
fn cuda_matches_cpu_and_repeats() {
    let Some(gpu) =
        sluice_kernels::device::cuda_for_tests("gemm_epilogue::cuda_matches_cpu_and_repeats")
    else {
        return;
    };
    use sluice_kernels::testing::{rel_norm, BF16_TOL};
    for (i, &case) in CASES.iter().enumerate() {
        let params = (2.0315, -4.775, true);
        let want = run(&Backend::Cpu, case, 60 + i as u64, params);
        let got = run(&gpu, case, 60 + i as u64, params);
        let again = run(&gpu, case, 60 + i as u64, params);
        for (name, g, a, w) in [
            ("c", &got.c, &again.c, &want.c),
            ("c_t", &got.c_t, &again.c_t, &want.c_t),
            ("c_b", &got.c_b, &again.c_b, &want.c_b),
            ("c_bt", &got.c_bt, &again.c_bt, &want.c_bt),
        ] {
            let w64: Vec<f64> = w.iter().map(|&v| v as f64).collect();
            let err = rel_norm(g, &w64);
            assert!(err <= BF16_TOL, "{case:?} {name}: rel err {err:e}");
            assert_eq!(bits(g), bits(a), "{case:?} {name}: two runs differ");
        }
    }
    let (batch, m, n, k) = (2, 130, 17, 300);
    let (a, b, _) = inputs((batch, m, n, k, false), 8);
    let at = Tensor::from_f32_as(&gpu, &[batch, m, k], DType::BF16, &a).unwrap();
    let bt = Tensor::from_f32_as(&gpu, &[batch, n, k], DType::BF16, &b).unwrap();
    let plain = gemm_batched(&gpu, &at, &bt)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let mut c = Tensor::poisoned(&gpu, &[batch, m, n], DType::F32).unwrap();
    gemm_batched_epilogue(&gpu, &at, &bt, GemmEpilogue::identity(&mut c)).unwrap();
    assert_eq!(
        bits(&c.to_vec::<f32>().unwrap()),
        bits(&plain),
        "cuda identity"
    );
}

#[test]
fn the_swiglu_epilogue_has_the_unfused_bits_on_emu_and_cpu() {
    let emu = Backend::emu_with_seed(3);
    let mut rng = Rng::new(61);
    let mut checked = 0;
    // (T, K, N, offsets): ragged segments, an empty one, partial tiles and 32-row slabs.
    for (t, k, n, off) in [
        (1usize, 16usize, 17usize, vec![0, 1]),
        (17, 40, 24, vec![0, 0, 9, 17]),
        (130, 24, 127, vec![0, 127, 127, 130]),
    ] {
        let g = off.len() - 1;
        let av: Vec<f32> = rng.normal_vec(t * k, 1.0);
        let bv: Vec<f32> = rng.normal_vec(g * n * k, 0.3);
        let gate: Vec<f32> = rng.normal_vec(t * n, 2.0);
        let mut outs = Vec::new();
        for b in [&Backend::Cpu, &emu] {
            let a = Tensor::from_f32_as(b, &[t, k], DType::BF16, &av).unwrap();
            let w = Tensor::from_f32_as(b, &[g, n, k], DType::BF16, &bv).unwrap();
            let o = Tensor::from_slice(b, &[g + 1], &off).unwrap();
            let gt = Tensor::from_slice(b, &[t, n], &gate).unwrap();
            let p = gemm_grouped_swiglu(b, &a, &w, &o, &gt).unwrap();
            let b16 = |t: &Tensor| -> Vec<u16> {
                t.to_vec::<bf16>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            };
            let rounded = |v: &[f32]| -> Vec<u16> {
                v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
            };
            // The unfused chain on the same device: grouped GEMM (mma.sync), swiglu, rounding.
            let plain = gemm_grouped_with_path(b, &a, &w, &o, GemmPath::Mma).unwrap();
            let h32 = swiglu(b, &gt, &plain).unwrap().to_vec::<f32>().unwrap();
            let label = format!("{} T {t} K {k} N {n} {off:?}", b.device());
            let got = (b16(&p.h), b16(&p.gate), b16(&p.b));
            assert_eq!(got.0, rounded(&h32), "{label}: h");
            assert_eq!(got.1, rounded(&gate), "{label}: gate");
            assert_eq!(
                got.2,
                rounded(&plain.to_vec::<f32>().unwrap()),
                "{label}: b"
            );
            assert!(got.0.iter().any(|&x| x != 0), "{label}: h is all zeros");
            outs.push(got);
        }
        assert_eq!(outs[0], outs[1], "T {t} K {k} N {n}: emu != cpu");
        checked += 1;
    }
    assert_eq!(checked, 3);
    // Bad input names the tensor.
    let cpu = Backend::Cpu;
    let a = Tensor::zeros(&cpu, &[4, 8], DType::BF16).unwrap();
    let w = Tensor::zeros(&cpu, &[1, 5, 8], DType::BF16).unwrap();
    let o = Tensor::from_slice(&cpu, &[2], &[0i32, 4]).unwrap();
    let bad_gate = Tensor::zeros(&cpu, &[4, 6], DType::F32).unwrap();
    let Err(e) = gemm_grouped_swiglu(&cpu, &a, &w, &o, &bad_gate) else {
        panic!("a gate of the wrong shape is an error")
    };
    assert!(e.to_string().contains("gate"), "{e}");
}

/// Where a GPU exists: the SwiGLU form against the cpu by relative norm (tensor cores sum a k16
/// step in their own order), and two runs with the same bits. Says it skipped without one.
#[test]
fn cuda_swiglu_epilogue_matches_cpu_and_repeats() {
    let Some(gpu) = sluice_kernels::device::cuda_for_tests("gemm_epilogue::cuda_swiglu") else {
        return;
    };
    use sluice_kernels::testing::{rel_norm, BF16_TOL};
    let mut rng = Rng::new(67);
    let (t, k, n, off) = (700usize, 264usize, 136usize, [0i32, 1, 1, 517, 700]);
    let av = rng.normal_vec(t * k, 1.0);
    let bv = rng.normal_vec(4 * n * k, 0.1);
    let gate = rng.normal_vec(t * n, 2.0);
    let run = |b: &Backend| {
        let a = Tensor::from_f32_as(b, &[t, k], DType::BF16, &av).unwrap();
        let w = Tensor::from_f32_as(b, &[4, n, k], DType::BF16, &bv).unwrap();
        let o = Tensor::from_slice(b, &[5], &off).unwrap();
        let gt = Tensor::from_slice(b, &[t, n], &gate).unwrap();
        let p = gemm_grouped_swiglu(b, &a, &w, &o, &gt).unwrap();
        let f = |t: &Tensor| -> Vec<f32> {
            t.to_vec::<bf16>()
                .unwrap()
                .iter()
                .map(|x| x.to_f32())
                .collect()
        };
        (f(&p.b), f(&p.h))
    };
    let want = run(&Backend::Cpu);
    let got = run(&gpu);
    let again = run(&gpu);
    for (name, g, a, w) in [
        ("b", &got.0, &again.0, &want.0),
        ("h", &got.1, &again.1, &want.1),
    ] {
        let w64: Vec<f64> = w.iter().map(|&v| v as f64).collect();
        let err = rel_norm(g, &w64);
        assert!(err < BF16_TOL, "cuda {name}: relative norm {err:e}");
        assert_eq!(bits(g), bits(a), "cuda {name}: two runs");
    }
}
