//! optim: the references against f64 oracles written here, emu (two schedule seeds, outputs
//! poisoned) and cuda against the references, determinism, untouched elements outside the
//! segments/blocks, and bad input.

use half::bf16;
use sluice_kernels::ops::optim::{
    adamw, adamw_reference, cast_bf16_into, cast_bf16_reference, gather_blocks,
    gather_blocks_reference, muon_apply, muon_apply_reference, muon_gather, muon_gather_reference,
    sq_norm, sq_norm_reference, AdamWStep, BlockTable, MuonApply, MuonMomentum, Segment,
    SegmentTable, StridedBlock, NORM_CHUNK,
};
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn arena(backend: &Backend, v: &[f32]) -> Tensor {
    Tensor::from_slice(backend, &[v.len()], v).unwrap()
}

/// Segments with gaps between them, of the given lengths, and the arena length.
fn segments(lens: &[usize]) -> (Vec<Segment>, usize) {
    let mut out = Vec::new();
    let mut at = 3;
    for (k, &len) in lens.iter().enumerate() {
        out.push(Segment {
            start: at,
            len,
            weight_decay: if k % 2 == 0 { 0.1 } else { 0.0 },
        });
        at += len + 5;
    }
    (out, at)
}

/// Column blocks of a `[rows, heads*hd]` matrix at offset 7 of an arena (W_o's head split),
/// then row blocks of a `[heads*hd', ...]`-style matrix are covered by `row_blocks`.
fn col_blocks(rows: usize, heads: usize, hd: usize) -> (Vec<StridedBlock>, usize) {
    let blocks = (0..heads)
        .map(|h| StridedBlock {
            offset: 7 + h * hd,
            row_stride: heads * hd,
        })
        .collect();
    (blocks, 7 + rows * heads * hd + 4)
}

fn hp(t: i32) -> AdamWStep {
    let (b1, b2) = (0.9f64, 0.999f64);
    AdamWStep {
        lr: 1e-2,
        beta1: b1 as f32,
        beta2: b2 as f32,
        eps: 1e-8,
        bc1: (1.0 - b1.powi(t)) as f32,
        bc2: (1.0 - b2.powi(t)) as f32,
        grad_scale: 0.5,
    }
}

// ---------------------------------------------------------------------------------------------
// Squared norm
// ---------------------------------------------------------------------------------------------

const NORM_SIZES: &[usize] = &[1, 17, 127, NORM_CHUNK, NORM_CHUNK + 1, 20_000];

#[test]
fn sq_norm_reference_matches_f64_oracle() {
    for &n in NORM_SIZES {
        let x = Rng::new(n as u64).normal_vec(n, 1.0);
        let want: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
        let got = sq_norm_reference(&x);
        // f64 sums of f32 squares in another grouping: ~1e-15 relative.
        assert!(
            ((got - want) / want).abs() < 1e-12,
            "n {n}: {got} vs {want}"
        );
    }
}

#[test]
fn sq_norm_emu_matches_reference_two_seeds() {
    for &n in NORM_SIZES {
        let x = Rng::new(n as u64 + 1).normal_vec(n, 1.0);
        let want = sq_norm_reference(&x);
        let mut results = Vec::new();
        for seed in [1, 2] {
            let be = Backend::emu_with_seed(seed);
            let got = sq_norm(&be, &arena(&be, &x)).unwrap();
            // f32 partial sums over <= 8192 elements: relative error ~1e-6.
            assert!(
                ((got - want) / want).abs() < F32_TOL,
                "n {n}: {got} vs {want}"
            );
            results.push(got.to_bits());
        }
        assert_eq!(results[0], results[1], "n {n}: seeds differ");
    }
    let be = Backend::emu_with_seed(1);
    assert_eq!(sq_norm(&be, &arena(&be, &[])).unwrap(), 0.0);
}

// ---------------------------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------------------------

fn adamw_oracle(
    p: &[f32],
    g: &[f32],
    m: &[f32],
    v: &[f32],
    segs: &[Segment],
    h: &AdamWStep,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut p, mut m, mut v) = (f64s(p), f64s(m), f64s(v));
    let (b1, b2) = (h.beta1 as f64, h.beta2 as f64);
    for s in segs {
        for i in s.start..s.start + s.len {
            let gi = h.grad_scale as f64 * g[i] as f64;
            m[i] = b1 * m[i] + (1.0 - b1) * gi;
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
            let step = (m[i] / h.bc1 as f64) / ((v[i] / h.bc2 as f64).sqrt() + h.eps as f64);
            p[i] = p[i] * (1.0 - h.lr as f64 * s.weight_decay as f64) - h.lr as f64 * step;
        }
    }
    (p, m, v)
}

struct AdamInputs {
    p: Vec<f32>,
    g: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

fn adam_inputs(seed: u64, len: usize) -> AdamInputs {
    let mut rng = Rng::new(seed);
    AdamInputs {
        p: rng.normal_vec(len, 1.0),
        g: rng.normal_vec(len, 1.0),
        m: rng.normal_vec(len, 0.1),
        v: rng.normal_vec(len, 0.1).iter().map(|x| x * x).collect(),
    }
}

/// Ragged segments; the last case has 37 segments (lengths 1..13) so the kernel's binary search
/// over the table takes every path.
const SEG_LENS: &[&[usize]] = &[
    &[1],
    &[17, 127],
    &[3, 1, 300, 17],
    &[
        1, 8, 2, 9, 3, 10, 4, 11, 5, 12, 6, 13, 7, 1, 8, 2, 9, 3, 10, 4, 11, 5, 12, 6, 13, 7, 1, 8,
        2, 9, 3, 10, 4, 11, 5, 12, 6,
    ],
];

#[test]
fn adamw_reference_matches_f64_oracle_and_leaves_gaps() {
    for (k, lens) in SEG_LENS.iter().enumerate() {
        let (segs, len) = segments(lens);
        let x = adam_inputs(k as u64 + 10, len);
        let h = hp(3);
        let (mut p, mut m, mut v) = (x.p.clone(), x.m.clone(), x.v.clone());
        adamw_reference(&mut p, &x.g, &mut m, &mut v, &segs, &h).unwrap();
        let (wp, wm, wv) = adamw_oracle(&x.p, &x.g, &x.m, &x.v, &segs, &h);
        // A dozen f32 operations per element: relative error ~1e-7.
        assert!(rel_norm(&p, &wp) <= F32_TOL, "p {lens:?}");
        assert!(rel_norm(&m, &wm) <= F32_TOL, "m {lens:?}");
        assert!(rel_norm(&v, &wv) <= F32_TOL, "v {lens:?}");
        // Elements outside every segment are untouched, bit for bit.
        let inside = |i: usize| segs.iter().any(|s| (s.start..s.start + s.len).contains(&i));
        for i in (0..len).filter(|&i| !inside(i)) {
            assert_eq!(p[i].to_bits(), x.p[i].to_bits(), "gap element {i} changed");
            assert_eq!(m[i].to_bits(), x.m[i].to_bits());
            assert_eq!(v[i].to_bits(), x.v[i].to_bits());
        }
    }
}

fn adamw_on(be: &Backend, x: &AdamInputs, segs: &[Segment], h: &AdamWStep) -> [Vec<f32>; 3] {
    let len = x.p.len();
    let table = SegmentTable::new(be, segs.to_vec(), len).unwrap();
    let (mut p, g, mut m, mut v) = (
        arena(be, &x.p),
        arena(be, &x.g),
        arena(be, &x.m),
        arena(be, &x.v),
    );
    adamw(be, &mut p, &g, &mut m, &mut v, &table, h).unwrap();
    [
        p.to_vec::<f32>().unwrap(),
        m.to_vec::<f32>().unwrap(),
        v.to_vec::<f32>().unwrap(),
    ]
}

#[test]
fn adamw_emu_matches_reference_two_seeds() {
    for (k, lens) in SEG_LENS.iter().enumerate() {
        let (segs, len) = segments(lens);
        let x = adam_inputs(k as u64 + 20, len);
        let h = hp(2);
        let want = adamw_on(&Backend::Cpu, &x, &segs, &h);
        let a = adamw_on(&Backend::emu_with_seed(1), &x, &segs, &h);
        let b = adamw_on(&Backend::emu_with_seed(2), &x, &segs, &h);
        for i in 0..3 {
            assert!(
                rel_norm(&a[i], &f64s(&want[i])) <= F32_TOL,
                "{lens:?} out {i}"
            );
            assert_eq!(bits(&a[i]), bits(&b[i]), "{lens:?} out {i}: seeds differ");
        }
        // Host g++ without FMA contraction computes the same operations: same bits as cpu.
        assert_eq!(bits(&a[0]), bits(&want[0]), "{lens:?}: emu vs cpu bits");
    }
}

// ---------------------------------------------------------------------------------------------
// Gather, Muon momentum, Muon apply
// ---------------------------------------------------------------------------------------------

/// (rows, heads, head_dim) of column-split matrices; rows split is the same with row_stride = cols.
const BLOCK_SHAPES: &[(usize, usize, usize)] = &[(1, 1, 1), (17, 3, 5), (5, 2, 127)];

#[test]
fn gather_emu_is_exact_and_poisoned_output_is_overwritten() {
    for &(rows, heads, hd) in BLOCK_SHAPES {
        let (blocks, len) = col_blocks(rows, heads, hd);
        let src = Rng::new(3).normal_vec(len, 1.0);
        let want = gather_blocks_reference(&src, &blocks, rows, hd).unwrap();
        // Oracle: block h's (r, c) is src[7 + r*heads*hd + h*hd + c].
        for h in 0..heads {
            for r in 0..rows {
                for c in 0..hd {
                    assert_eq!(
                        want[(h * rows + r) * hd + c],
                        src[7 + r * heads * hd + h * hd + c]
                    );
                }
            }
        }
        for seed in [1, 2] {
            let be = Backend::emu_with_seed(seed);
            let table = BlockTable::new(&be, blocks.clone(), rows, hd, len).unwrap();
            // gather_blocks allocates its output poisoned (NaN); a missed element would fail.
            let got = gather_blocks(&be, &arena(&be, &src), &table).unwrap();
            assert_eq!(got.shape(), [heads, rows, hd]);
            assert_eq!(bits(&got.to_vec::<f32>().unwrap()), bits(&want));
        }
    }
}

#[test]
fn muon_gather_matches_oracle_emu_two_seeds() {
    for &(rows, heads, hd) in BLOCK_SHAPES {
        for nesterov in [true, false] {
            let (blocks, len) = col_blocks(rows, heads, hd);
            let mut rng = Rng::new(4);
            let g = rng.normal_vec(len, 1.0);
            let mom0 = rng.normal_vec(len, 1.0);
            let h = MuonMomentum {
                mu: 0.95,
                grad_scale: 0.7,
                nesterov,
            };
            let mut mom = mom0.clone();
            let out = muon_gather_reference(&g, &mut mom, &blocks, rows, hd, &h).unwrap();
            // Oracle in f64.
            let mut want_mom = f64s(&mom0);
            let mut want_out = vec![0.0f64; out.len()];
            for (b, blk) in blocks.iter().enumerate() {
                for r in 0..rows {
                    for c in 0..hd {
                        let i = blk.offset + r * blk.row_stride + c;
                        let gi = 0.7f64 * g[i] as f64;
                        let m = 0.95f32 as f64 * mom0[i] as f64 + gi;
                        want_mom[i] = m;
                        want_out[(b * rows + r) * hd + c] =
                            if nesterov { gi + 0.95f32 as f64 * m } else { m };
                    }
                }
            }
            assert!(rel_norm(&out, &want_out) <= F32_TOL);
            assert!(rel_norm(&mom, &want_mom) <= F32_TOL);
            let mut runs = Vec::new();
            for seed in [1, 2] {
                let be = Backend::emu_with_seed(seed);
                let table = BlockTable::new(&be, blocks.clone(), rows, hd, len).unwrap();
                let mut m = arena(&be, &mom0);
                let o = muon_gather(&be, &arena(&be, &g), &mut m, &table, &h).unwrap();
                let (o, m) = (o.to_vec::<f32>().unwrap(), m.to_vec::<f32>().unwrap());
                assert_eq!(bits(&o), bits(&out), "[{rows},{hd}] x{heads}: out vs cpu");
                assert_eq!(bits(&m), bits(&mom), "[{rows},{hd}] x{heads}: mom vs cpu");
                runs.push(o);
            }
            assert_eq!(bits(&runs[0]), bits(&runs[1]));
        }
    }
}

#[test]
fn muon_apply_matches_oracle_emu_two_seeds() {
    for &(rows, heads, hd) in BLOCK_SHAPES {
        let (blocks, len) = col_blocks(rows, heads, hd);
        let mut rng = Rng::new(5);
        let p0 = rng.normal_vec(len, 1.0);
        let x = rng.normal_vec(heads * rows * hd, 1.0);
        let h = MuonApply {
            lr: 0.02,
            weight_decay: 0.1,
            scale: 0.2 * (rows.max(hd) as f32).sqrt(),
        };
        let mut p = p0.clone();
        muon_apply_reference(&mut p, &x, &blocks, rows, hd, &h).unwrap();
        let mut want = f64s(&p0);
        for (b, blk) in blocks.iter().enumerate() {
            for r in 0..rows {
                for c in 0..hd {
                    let i = blk.offset + r * blk.row_stride + c;
                    want[i] = p0[i] as f64 * (1.0 - 0.02 * 0.1)
                        - 0.02 * h.scale as f64 * x[(b * rows + r) * hd + c] as f64;
                }
            }
        }
        assert!(rel_norm(&p, &want) <= F32_TOL);
        // Outside the blocks: untouched.
        for i in (0..7).chain(len - 4..len) {
            assert_eq!(p[i].to_bits(), p0[i].to_bits());
        }
        let mut runs = Vec::new();
        for seed in [1, 2] {
            let be = Backend::emu_with_seed(seed);
            let table = BlockTable::new(&be, blocks.clone(), rows, hd, len).unwrap();
            let xt = Tensor::from_slice(&be, &[heads, rows, hd], &x).unwrap();
            let mut pt = arena(&be, &p0);
            muon_apply(&be, &mut pt, &xt, &table, &h).unwrap();
            let got = pt.to_vec::<f32>().unwrap();
            assert!(rel_norm(&got, &f64s(&p)) <= F32_TOL);
            runs.push(got);
        }
        assert_eq!(bits(&runs[0]), bits(&runs[1]));
    }
}

#[test]
fn cast_bf16_emu_matches_reference() {
    for n in [1usize, 17, 127, 5000] {
        let src = Rng::new(n as u64).normal_vec(n, 3.0);
        let want = cast_bf16_reference(&src);
        for (i, w) in want.iter().enumerate() {
            assert_eq!(w.to_bits(), bf16::from_f64(src[i] as f64).to_bits());
        }
        for seed in [1, 2] {
            let be = Backend::emu_with_seed(seed);
            let mut dst = Tensor::poisoned(&be, &[n], DType::BF16).unwrap();
            cast_bf16_into(&be, &arena(&be, &src), &mut dst).unwrap();
            let got = dst.to_vec::<bf16>().unwrap();
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Determinism on cpu, and cuda against the references
// ---------------------------------------------------------------------------------------------

#[test]
fn cpu_runs_are_bit_identical() {
    let (segs, len) = segments(&[17, 127]);
    let x = adam_inputs(9, len);
    let a = adamw_on(&Backend::Cpu, &x, &segs, &hp(1));
    let b = adamw_on(&Backend::Cpu, &x, &segs, &hp(1));
    assert_eq!(bits(&a[0]), bits(&b[0]));
    let big = Rng::new(1).normal_vec(100_003, 1.0);
    assert_eq!(
        sq_norm_reference(&big).to_bits(),
        sq_norm_reference(&big).to_bits()
    );
}

#[test]
fn cuda_matches_reference() {
    let Some(gpu) = sluice_kernels::device::cuda_for_tests("optim::cuda_matches_reference") else {
        return;
    };
    let big = Rng::new(2).normal_vec(300_001, 1.0);
    let want = sq_norm_reference(&big);
    let a = sq_norm(&gpu, &arena(&gpu, &big)).unwrap();
    let b = sq_norm(&gpu, &arena(&gpu, &big)).unwrap();
    assert!(((a - want) / want).abs() < F32_TOL);
    assert_eq!(a.to_bits(), b.to_bits());

    let (segs, len) = segments(&[3, 1, 3000, 17]);
    let x = adam_inputs(7, len);
    let want = adamw_on(&Backend::Cpu, &x, &segs, &hp(4));
    let a = adamw_on(&gpu, &x, &segs, &hp(4));
    let b = adamw_on(&gpu, &x, &segs, &hp(4));
    for i in 0..3 {
        assert!(rel_norm(&a[i], &f64s(&want[i])) <= F32_TOL);
        assert_eq!(bits(&a[i]), bits(&b[i]));
    }

    let (rows, heads, hd) = (64, 4, 32);
    let (blocks, len) = col_blocks(rows, heads, hd);
    let g = Rng::new(8).normal_vec(len, 1.0);
    let h = MuonMomentum {
        mu: 0.95,
        grad_scale: 1.0,
        nesterov: true,
    };
    let mut mom = vec![0.5f32; len];
    let want = muon_gather_reference(&g, &mut mom, &blocks, rows, hd, &h).unwrap();
    let table = BlockTable::new(&gpu, blocks.clone(), rows, hd, len).unwrap();
    let mut m = arena(&gpu, &vec![0.5f32; len]);
    let got = muon_gather(&gpu, &arena(&gpu, &g), &mut m, &table, &h).unwrap();
    assert!(rel_norm(&got.to_vec::<f32>().unwrap(), &f64s(&want)) <= F32_TOL);
    let ap = MuonApply {
        lr: 0.02,
        weight_decay: 0.1,
        scale: 2.0,
    };
    let mut p_ref = g.clone();
    muon_apply_reference(&mut p_ref, &want, &blocks, rows, hd, &ap).unwrap();
    let mut p = arena(&gpu, &g);
    muon_apply(&gpu, &mut p, &got, &table, &ap).unwrap();
    assert!(rel_norm(&p.to_vec::<f32>().unwrap(), &f64s(&p_ref)) <= F32_TOL);
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

fn param_name(e: Error) -> String {
    match e {
        Error::Param { name, .. } => name,
        Error::Shape { tensor, .. } | Error::DType { tensor, .. } => tensor,
        other => panic!("unexpected error kind: {other}"),
    }
}

#[test]
fn bad_input_is_an_error_naming_it() {
    for be in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let (segs, len) = segments(&[4, 4]);
        let x = adam_inputs(1, len);
        let table = SegmentTable::new(&be, segs.clone(), len).unwrap();
        let (mut p, g, mut m, mut v) = (
            arena(&be, &x.p),
            arena(&be, &x.g),
            arena(&be, &x.m),
            arena(&be, &x.v),
        );
        let mut bad = hp(1);
        bad.lr = f32::NAN;
        let e = adamw(&be, &mut p, &g, &mut m, &mut v, &table, &bad).unwrap_err();
        assert_eq!(param_name(e), "lr");
        let mut bad = hp(1);
        bad.beta2 = 1.0;
        let e = adamw(&be, &mut p, &g, &mut m, &mut v, &table, &bad).unwrap_err();
        assert_eq!(param_name(e), "beta2");
        // Nothing was changed by the failed calls.
        assert_eq!(bits(&p.to_vec::<f32>().unwrap()), bits(&x.p));
        let short = arena(&be, &x.g[..len - 1]);
        let e = adamw(&be, &mut p, &short, &mut m, &mut v, &table, &hp(1)).unwrap_err();
        assert_eq!(param_name(e), "g");
        let as_bf16 = Tensor::zeros(&be, &[len], DType::BF16).unwrap();
        let e = adamw(&be, &mut p, &as_bf16, &mut m, &mut v, &table, &hp(1)).unwrap_err();
        assert_eq!(param_name(e), "g");

        let past = vec![Segment {
            start: len - 2,
            len: 3,
            weight_decay: 0.0,
        }];
        assert_eq!(
            param_name(SegmentTable::new(&be, past, len).err().unwrap()),
            "segments"
        );
        let neg = vec![Segment {
            start: 0,
            len: 3,
            weight_decay: -0.1,
        }];
        assert_eq!(
            param_name(SegmentTable::new(&be, neg, len).err().unwrap()),
            "weight_decay"
        );
        let overlap = vec![
            Segment {
                start: 0,
                len: 3,
                weight_decay: 0.0,
            },
            Segment {
                start: 2,
                len: 3,
                weight_decay: 0.0,
            },
        ];
        assert_eq!(
            param_name(SegmentTable::new(&be, overlap, len).err().unwrap()),
            "segments"
        );

        let rows_overlap = vec![StridedBlock {
            offset: 0,
            row_stride: 2,
        }];
        assert_eq!(
            param_name(BlockTable::new(&be, rows_overlap, 2, 3, 100).err().unwrap()),
            "blocks"
        );
        let overlapping = vec![
            StridedBlock {
                offset: 0,
                row_stride: 8,
            },
            StridedBlock {
                offset: 10,
                row_stride: 8,
            },
        ];
        assert_eq!(
            param_name(BlockTable::new(&be, overlapping, 3, 4, 100).err().unwrap()),
            "blocks"
        );
        let past = vec![StridedBlock {
            offset: 90,
            row_stride: 4,
        }];
        assert_eq!(
            param_name(BlockTable::new(&be, past, 4, 4, 100).err().unwrap()),
            "blocks"
        );

        let blocks = vec![StridedBlock {
            offset: 0,
            row_stride: 4,
        }];
        let t = BlockTable::new(&be, blocks, 2, 4, 8).unwrap();
        let g8 = arena(&be, &[1.0; 8]);
        let mut m8 = arena(&be, &[0.0; 8]);
        let bad_mu = MuonMomentum {
            mu: f32::NAN,
            grad_scale: 1.0,
            nesterov: true,
        };
        assert_eq!(
            param_name(muon_gather(&be, &g8, &mut m8, &t, &bad_mu).unwrap_err()),
            "mu"
        );
        let x = Tensor::zeros(&be, &[1, 2, 4], DType::F32).unwrap();
        let mut p8 = arena(&be, &[1.0; 8]);
        let bad_wd = MuonApply {
            lr: 0.1,
            weight_decay: -1.0,
            scale: 1.0,
        };
        assert_eq!(
            param_name(muon_apply(&be, &mut p8, &x, &t, &bad_wd).unwrap_err()),
            "weight_decay"
        );
        let x_wrong = Tensor::zeros(&be, &[1, 4, 2], DType::F32).unwrap();
        let ok = MuonApply {
            lr: 0.1,
            weight_decay: 0.0,
            scale: 1.0,
        };
        assert_eq!(
            param_name(muon_apply(&be, &mut p8, &x_wrong, &t, &ok).unwrap_err()),
            "x"
        );
        let mut dst = Tensor::zeros(&be, &[7], DType::BF16).unwrap();
        assert_eq!(
            param_name(cast_bf16_into(&be, &g8, &mut dst).unwrap_err()),
            "dst"
        );
    }
}
