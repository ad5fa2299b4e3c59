//! embedding: lookup and deterministic backward vs f64 oracles and finite differences, emu and
//! cuda vs the reference (bit-identical for the backward: same additions in the same order),
//! determinism, bad tokens.

use sluice_kernels::ops::embedding::{
    counting_sort, embedding, embedding_backward, embedding_backward_reference, embedding_reference,
};
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

/// (V, d, T): a single token; more tokens than ids (repeats); ids that never occur.
const SHAPES: &[(usize, usize, usize)] = &[(1, 1, 1), (17, 127, 40), (127, 17, 9), (5, 300, 127)];
const EMU_SHAPES: &[(usize, usize, usize)] = &[(1, 1, 1), (17, 127, 40), (37, 5, 17)];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn inputs(seed: u64, v: usize, d: usize, t: usize) -> (Vec<f32>, Vec<i32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let table = rng.normal_vec(v * d, 1.0);
    // Skewed ids: about half the tokens are id 0 (long runs of one id, as padding gives).
    let tokens = (0..t)
        .map(|_| {
            if rng.uniform() < 0.5 {
                0
            } else {
                rng.below(v) as i32
            }
        })
        .collect();
    let dout = rng.normal_vec(t * d, 1.0);
    (table, tokens, dout)
}

fn oracle_backward(dout: &[f64], tokens: &[i32], v: usize, d: usize) -> Vec<f64> {
    let mut dt = vec![0.0; v * d];
    for (t, &tok) in tokens.iter().enumerate() {
        for j in 0..d {
            dt[tok as usize * d + j] += dout[t * d + j];
        }
    }
    dt
}

#[test]
fn counting_sort_is_stable() {
    let (order, offsets) = counting_sort(&[2, 0, 2, 1, 0, 2], 4).unwrap();
    assert_eq!(offsets, vec![0, 2, 3, 6, 6]);
    assert_eq!(order, vec![1, 4, 3, 0, 2, 5]);
}

#[test]
fn reference_matches_f64_oracle() {
    for &(v, d, t) in SHAPES {
        let (table, tokens, dout) = inputs(1, v, d, t);
        let out = embedding_reference(&table, &tokens, v, d).unwrap();
        for (r, &tok) in tokens.iter().enumerate() {
            assert_eq!(
                bits(&out[r * d..(r + 1) * d]),
                bits(&table[tok as usize * d..(tok as usize + 1) * d])
            );
        }
        let dt = embedding_backward_reference(&dout, &tokens, v, d).unwrap();
        let want = oracle_backward(&f64s(&dout), &tokens, v, d);
        // f32 sums of up to T terms: relative error ~ T * 2^-24 ~ 1e-5 at worst for T = 127,
        // far less in norm (errors are random-signed): F32_TOL.
        assert!(
            rel_norm(&dt, &want) <= F32_TOL,
            "{v}x{d} T={t}: {}",
            rel_norm(&dt, &want)
        );
        // Ids that never occur get exact zeros.
        for id in 0..v {
            if !tokens.contains(&(id as i32)) {
                assert!(dt[id * d..(id + 1) * d].iter().all(|&x| x == 0.0));
            }
        }
    }
}

#[test]
fn backward_matches_finite_differences() {
    // L = sum(out * dout) is linear in the table: dL/dtable[v,j] by central differences.
    let (v, d, t) = (4, 3, 7);
    let (table, tokens, dout) = inputs(2, v, d, t);
    let loss = |tab: &[f64]| -> f64 {
        tokens
            .iter()
            .enumerate()
            .map(|(r, &tok)| {
                (0..d)
                    .map(|j| tab[tok as usize * d + j] * dout[r * d + j] as f64)
                    .sum::<f64>()
            })
            .sum()
    };
    let tab = f64s(&table);
    let hstep = 1e-6;
    let fd: Vec<f64> = (0..v * d)
        .map(|i| {
            let (mut p, mut m) = (tab.clone(), tab.clone());
            p[i] += hstep;
            m[i] -= hstep;
            (loss(&p) - loss(&m)) / (2.0 * hstep)
        })
        .collect();
    let dt = embedding_backward_reference(&dout, &tokens, v, d).unwrap();
    assert!(rel_norm(&dt, &fd) <= F32_TOL, "{}", rel_norm(&dt, &fd));
}

fn run_device(
    backend: &Backend,
    dtype: DType,
    v: usize,
    d: usize,
    t: usize,
    seed: u64,
) -> (Vec<f32>, Vec<f32>) {
    let (table, tokens, dout) = inputs(seed, v, d, t);
    let tab = Tensor::from_f32_as(backend, &[v, d], dtype, &table).unwrap();
    let tok = Tensor::from_slice(backend, &[t], &tokens).unwrap();
    let dot = Tensor::from_f32_as(backend, &[t, d], dtype, &dout).unwrap();
    let out = embedding(backend, &tab, &tok).unwrap();
    let dt = embedding_backward(backend, &dot, &tok, v).unwrap();
    (out.to_f32_vec().unwrap(), dt.to_f32_vec().unwrap())
}

fn check_device(backend: &Backend, shapes: &[(usize, usize, usize)]) {
    for &dtype in &[DType::F32, DType::BF16] {
        for &(v, d, t) in shapes {
            let (mut table, tokens, mut dout) = inputs(3, v, d, t);
            if dtype == DType::BF16 {
                let r = |x: &[f32]| {
                    x.iter()
                        .map(|&y| half::bf16::from_f32(y).to_f32())
                        .collect::<Vec<_>>()
                };
                (table, dout) = (r(&table), r(&dout));
            }
            let want_out = embedding_reference(&table, &tokens, v, d).unwrap();
            let want_dt = embedding_backward_reference(&dout, &tokens, v, d).unwrap();
            let (out, dt) = run_device(backend, dtype, v, d, t, 3);
            // The lookup is a copy and the backward adds the same f32 values in the same order
            // on every device: both are bit-identical to the reference.
            assert_eq!(
                bits(&out),
                bits(&want_out),
                "{backend:?} {dtype} out {v}x{d} T={t}"
            );
            assert_eq!(
                bits(&dt),
                bits(&want_dt),
                "{backend:?} {dtype} dtable {v}x{d} T={t}"
            );
            let (out2, dt2) = run_device(backend, dtype, v, d, t, 3);
            assert_eq!(bits(&out), bits(&out2));
            assert_eq!(bits(&dt), bits(&dt2));
        }
    }
}

#[test]
fn cpu_device_matches_reference_and_is_deterministic() {
    check_device(&Backend::Cpu, SHAPES);
}

#[test]
fn emu_matches_reference_and_seeds_agree() {
    let (e1, e2) = (Backend::emu_with_seed(1), Backend::emu_with_seed(2));
    check_device(&e1, EMU_SHAPES);
    for &(v, d, t) in EMU_SHAPES {
        let a = run_device(&e1, DType::F32, v, d, t, 4);
        let b = run_device(&e2, DType::F32, v, d, t, 4);
        assert_eq!(
            (bits(&a.0), bits(&a.1)),
            (bits(&b.0), bits(&b.1)),
            "emu seeds disagree"
        );
    }
}

#[test]
fn cuda_matches_reference() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("embedding") {
        check_device(&gpu, SHAPES);
        check_device(&gpu, &[(32000, 512, 4096)]);
    }
}

#[test]
fn empty_token_list_gives_zero_gradient() {
    for be in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let dout = Tensor::from_slice(&be, &[0, 3], &[] as &[f32]).unwrap();
        let tok = Tensor::from_slice(&be, &[0], &[] as &[i32]).unwrap();
        // On emu this launches with every id's group empty: each thread writes a zero.
        let dt = embedding_backward(&be, &dout, &tok, 2).unwrap();
        assert_eq!(dt.to_f32_vec().unwrap(), vec![0.0; 6], "{be:?}");
    }
}

#[test]
fn bad_inputs_are_errors() {
    for be in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let table = Tensor::from_slice(&be, &[4, 2], &[1.0f32; 8]).unwrap();
        for bad in [4i32, -1] {
            let tok = Tensor::from_slice(&be, &[3], &[0i32, bad, 1]).unwrap();
            let err = embedding(&be, &table, &tok).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("`tokens`[1]")
                    && msg.contains(&bad.to_string())
                    && msg.contains("[0, 4)"),
                "{msg}"
            );
            let dout = Tensor::from_slice(&be, &[3, 2], &[1.0f32; 6]).unwrap();
            let err = embedding_backward(&be, &dout, &tok, 4).unwrap_err();
            assert!(err.to_string().contains("`tokens`[1]"), "{err}");
        }
        let tokf = Tensor::from_slice(&be, &[2], &[0.0f32, 1.0]).unwrap();
        assert!(
            matches!(embedding(&be, &table, &tokf), Err(Error::DType { tensor, .. }) if tensor == "tokens")
        );
        let tok2 = Tensor::from_slice(&be, &[1, 2], &[0i32, 1]).unwrap();
        assert!(
            matches!(embedding(&be, &table, &tok2), Err(Error::Shape { tensor, .. }) if tensor == "tokens")
        );
        let tok = Tensor::from_slice(&be, &[2], &[0i32, 1]).unwrap();
        let dout_bad = Tensor::from_slice(&be, &[3, 2], &[1.0f32; 6]).unwrap();
        let err = embedding_backward(&be, &dout_bad, &tok, 4).unwrap_err();
        assert!(
            matches!(&err, Error::Shape { tensor, .. } if tensor == "dout"),
            "{err}"
        );
        let flat = Tensor::from_slice(&be, &[8], &[1.0f32; 8]).unwrap();
        assert!(
            matches!(embedding(&be, &flat, &tok), Err(Error::Shape { tensor, .. }) if tensor == "table")
        );
    }
    assert!(embedding_reference(&[1.0; 8], &[5], 4, 2).is_err());
    assert!(embedding_backward_reference(&[1.0; 3], &[0, 1], 4, 2).is_err());
}
