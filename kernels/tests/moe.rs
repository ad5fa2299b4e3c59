//! moe_forward / moe_backward: the CPU reference against an f64 oracle (a naive per-token loop)
//! and central finite differences of it; emu and cuda against the reference; determinism,
//! batch invariance, routing edge cases, bad input.

use sluice_kernels::device::cuda_for_tests;
use sluice_kernels::ops::gemm::GemmPath;
use sluice_kernels::ops::moe::{
    moe_backward, moe_backward_reference, moe_backward_saved, moe_forward, moe_forward_reference,
    moe_forward_saved, moe_route_reference, moe_sort, moe_sort_reference, MoeConfig, MoeDims,
    MoeGradTensors, MoeOutput, ScoreFn,
};
use sluice_kernels::testing::{lost_outputs, rel_norm, Rng, BF16_TOL, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

// ---------------------------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
struct Case {
    dims: MoeDims,
    cfg: MoeConfig,
    x: Vec<f32>,
    wr: Vec<f32>,
    w1: Vec<f32>,
    w3: Vec<f32>,
    w2: Vec<f32>,
    dy: Vec<f32>,
}

fn case(t: usize, d: usize, f: usize, e: usize, cfg: MoeConfig, seed: u64) -> Case {
    let mut rng = Rng::new(seed);
    // Scales keep the activations O(1): router logits of a few units (distinct scores),
    // expert pre-activations around 1.
    let sd = 1.0 / (d as f32).sqrt();
    let sf = 1.0 / (f as f32).sqrt();
    Case {
        dims: MoeDims { t, d, f, e },
        cfg,
        x: rng.normal_vec(t * d, 1.0),
        wr: rng.normal_vec(e * d, 2.0 * sd),
        w1: rng.normal_vec(e * f * d, sd),
        w3: rng.normal_vec(e * f * d, sd),
        w2: rng.normal_vec(e * d * f, sf),
        dy: rng.normal_vec(t * d, 1.0),
    }
}

fn cfg(k: usize, score_fn: ScoreFn, renorm: bool) -> MoeConfig {
    MoeConfig {
        k,
        score_fn,
        renorm,
        aux_alpha: 0.0,
    }
}

fn with_aux(mut c: MoeConfig, alpha: f32) -> MoeConfig {
    c.aux_alpha = alpha;
    c
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

// ---------------------------------------------------------------------------------------------
// The f64 oracle: one token at a time, every expert's FFN written out.
// ---------------------------------------------------------------------------------------------

struct Oracle {
    y: Vec<f64>,
    idx: Vec<i32>,
    gate: Vec<f64>,
    /// Per token: the gap between the k-th and the (k+1)-th score (infinite when k = E).
    margin: Vec<f64>,
    /// alpha * E * sum_e f_e P_e.
    aux: f64,
}

fn silu(a: f64) -> f64 {
    a / (1.0 + (-a).exp())
}

#[allow(clippy::too_many_arguments)]
fn oracle(
    x: &[f64],
    wr: &[f64],
    w1: &[f64],
    w3: &[f64],
    w2: &[f64],
    dims: MoeDims,
    cfg: MoeConfig,
) -> Oracle {
    let MoeDims { t, d, f, e } = dims;
    let k = cfg.k;
    let mut out = Oracle {
        y: vec![0.0; t * d],
        idx: vec![0; t * k],
        gate: vec![0.0; t * k],
        margin: vec![f64::INFINITY; t],
        aux: 0.0,
    };
    let mut mean_score = vec![0.0; e];
    for tok in 0..t {
        let xr = &x[tok * d..(tok + 1) * d];
        let logits: Vec<f64> = (0..e)
            .map(|ex| (0..d).map(|c| xr[c] * wr[ex * d + c]).sum())
            .collect();
        let scores: Vec<f64> = match cfg.score_fn {
            ScoreFn::Softmax => {
                let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let s: f64 = logits.iter().map(|z| (z - m).exp()).sum();
                logits.iter().map(|z| (z - m).exp() / s).collect()
            }
            ScoreFn::Sigmoid => logits.iter().map(|z| 1.0 / (1.0 + (-z).exp())).collect(),
        };
        for (m, s) in mean_score.iter_mut().zip(&scores) {
            *m += s / t as f64;
        }
        let mut order: Vec<usize> = (0..e).collect();
        // Stable sort by score descending: equal scores keep ascending index.
        order.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap());
        if k < e {
            out.margin[tok] = scores[order[k - 1]] - scores[order[k]];
        }
        let kept: Vec<f64> = order[..k].iter().map(|&i| scores[i]).collect();
        let sum: f64 = kept.iter().sum();
        for j in 0..k {
            let ex = order[j];
            let g = if cfg.renorm { kept[j] / sum } else { kept[j] };
            out.idx[tok * k + j] = ex as i32;
            out.gate[tok * k + j] = g;
            let mut h = vec![0.0; f];
            for (i, hv) in h.iter_mut().enumerate() {
                let a: f64 = (0..d).map(|c| w1[(ex * f + i) * d + c] * xr[c]).sum();
                let b: f64 = (0..d).map(|c| w3[(ex * f + i) * d + c] * xr[c]).sum();
                *hv = silu(a) * b;
            }
            for c in 0..d {
                let v: f64 = (0..f).map(|i| w2[(ex * d + c) * f + i] * h[i]).sum();
                out.y[tok * d + c] += g * v;
            }
        }
    }
    let alpha = cfg.aux_alpha as f64;
    for (ex, m) in mean_score.iter().enumerate() {
        let routed = out.idx.iter().filter(|&&i| i as usize == ex).count();
        out.aux += alpha * e as f64 * (routed as f64 / (t * k) as f64) * m;
    }
    out
}

fn oracle_of(c: &Case) -> Oracle {
    oracle(
        &widen(&c.x),
        &widen(&c.wr),
        &widen(&c.w1),
        &widen(&c.w3),
        &widen(&c.w2),
        c.dims,
        c.cfg,
    )
}

// ---------------------------------------------------------------------------------------------
// The reference against the oracle
// ---------------------------------------------------------------------------------------------

/// Tolerance of the f32 reference against the f64 oracle: a few chained f32 dot products of
/// length <= 64 (relative error ~ sqrt(len) * 6e-8 each) plus exp: well under 1e-5.
const REF_TOL: f64 = F32_TOL;

#[test]
fn forward_reference_matches_f64_oracle() {
    let shapes = [
        (1, 8, 4, 4, 1),
        (17, 16, 8, 8, 2),
        (127, 32, 16, 16, 4),
        (33, 24, 12, 5, 5),
    ];
    for (si, &(t, d, f, e, k)) in shapes.iter().enumerate() {
        for score_fn in [ScoreFn::Softmax, ScoreFn::Sigmoid] {
            for renorm in [true, false] {
                let c = case(t, d, f, e, cfg(k, score_fn, renorm), 100 + si as u64);
                let got = moe_forward_reference(&c.x, &c.wr, &c.w1, &c.w3, &c.w2, c.dims, c.cfg);
                let want = oracle_of(&c);
                let what = format!("T={t} d={d} f={f} E={e} k={k} {score_fn:?} renorm={renorm}");
                // Indices agree wherever the k-th/(k+1)-th gap is wider than f32 noise.
                for tok in 0..t {
                    if want.margin[tok] > 1e-5 {
                        assert_eq!(
                            got.topk_idx[tok * k..(tok + 1) * k],
                            want.idx[tok * k..(tok + 1) * k],
                            "{what}: token {tok}"
                        );
                    }
                }
                let ey = rel_norm(&got.y, &want.y);
                let eg = rel_norm(&got.topk_gate, &want.gate);
                assert!(ey <= REF_TOL, "{what}: y rel err {ey:e}");
                assert!(eg <= REF_TOL, "{what}: gate rel err {eg:e}");
                assert_eq!(got.aux_loss, 0.0, "{what}: aux is off");
            }
        }
    }
}

#[test]
fn aux_loss_matches_f64_oracle() {
    for (i, &(t, e, k)) in [(1, 4, 2), (37, 8, 2), (64, 16, 4)].iter().enumerate() {
        let c = case(
            t,
            8,
            4,
            e,
            with_aux(cfg(k, ScoreFn::Softmax, true), 0.01),
            200 + i as u64,
        );
        let got = moe_forward_reference(&c.x, &c.wr, &c.w1, &c.w3, &c.w2, c.dims, c.cfg);
        let want = oracle_of(&c).aux;
        let err = ((got.aux_loss as f64 - want) / want).abs();
        assert!(
            err <= REF_TOL,
            "T={t} E={e}: aux {} vs {want}",
            got.aux_loss
        );
    }
}

#[test]
fn kept_indices_are_distinct_and_sorted_by_score() {
    // A token can never be routed to the same expert at two ranks: top-k returns k distinct
    // positions of the score row. Checked on a case with many near-equal scores (a router of
    // zeros gives E equal scores: ties go to the lower index, so the first k experts).
    let mut c = case(40, 8, 4, 8, cfg(4, ScoreFn::Softmax, true), 7);
    for v in c.wr[..2 * 8].iter_mut() {
        *v = 0.0;
    }
    let r = moe_route_reference(&c.x, &c.wr, c.dims, c.cfg);
    for tok in 0..40 {
        let row = &r.idx[tok * 4..tok * 4 + 4];
        for a in 0..4 {
            for b in a + 1..4 {
                assert_ne!(row[a], row[b], "token {tok}: {row:?}");
            }
            if a > 0 {
                let (p, q) = (row[a - 1] as usize, row[a] as usize);
                let (sp, sq) = (r.probs[tok * 8 + p], r.probs[tok * 8 + q]);
                assert!(sp > sq || (sp == sq && p < q), "token {tok}: {row:?}");
            }
        }
    }
    let zero = case(3, 8, 4, 8, cfg(3, ScoreFn::Softmax, true), 8);
    let mut z = zero.clone();
    z.wr.iter_mut().for_each(|v| *v = 0.0);
    let r = moe_route_reference(&z.x, &z.wr, z.dims, z.cfg);
    assert_eq!(r.idx, [0, 1, 2, 0, 1, 2, 0, 1, 2]);
    // Stable sort: expert segments hold ascending slots.
    assert_eq!(r.offsets, [0, 3, 6, 9, 9, 9, 9, 9, 9]);
    assert_eq!(r.perm, [0, 3, 6, 1, 4, 7, 2, 5, 8]);
}

// ---------------------------------------------------------------------------------------------
// Finite differences
// ---------------------------------------------------------------------------------------------

/// L = sum(dy * y) under the f64 oracle.
fn loss(c: &Case, x: &[f64], wr: &[f64], w1: &[f64], w3: &[f64], w2: &[f64]) -> f64 {
    let o = oracle(x, wr, w1, w3, w2, c.dims, c.cfg);
    o.y.iter()
        .zip(&c.dy)
        .map(|(y, &g)| y * g as f64)
        .sum::<f64>()
        + o.aux
}

/// Central differences of L for every element of one input (which = 0..5: x, wr, w1, w3, w2).
fn fd_grad(c: &Case, which: usize) -> Vec<f64> {
    let base = [
        widen(&c.x),
        widen(&c.wr),
        widen(&c.w1),
        widen(&c.w3),
        widen(&c.w2),
    ];
    let h = 1e-5;
    let mut g = vec![0.0; base[which].len()];
    for (i, gi) in g.iter_mut().enumerate() {
        let mut p = base.clone();
        p[which][i] += h;
        let lp = loss(c, &p[0], &p[1], &p[2], &p[3], &p[4]);
        p[which][i] -= 2.0 * h;
        let lm = loss(c, &p[0], &p[1], &p[2], &p[3], &p[4]);
        *gi = (lp - lm) / (2.0 * h);
    }
    g
}

/// A case whose every token has a top-k margin far above what an FD step can move (so the
/// function is smooth around the point): draws seeds until one fits.
fn smooth_case(t: usize, d: usize, f: usize, e: usize, cfg: MoeConfig, seed: u64) -> Case {
    for s in 0..1000 {
        let c = case(t, d, f, e, cfg, seed * 1000 + s);
        if oracle_of(&c).margin.iter().all(|&m| m > 1e-3) {
            return c;
        }
    }
    panic!("no smooth case found for T={t} E={e} k={}", cfg.k);
}

/// Tolerance of the f32 gradients against f64 central differences: the FD truncation error
/// is O(h^2) ~ 1e-10 and its rounding error ~ 1e-16 / h ~ 1e-11, so what remains is the f32
/// reference's own rounding, a few 1e-7 relative on these tiny shapes; 1e-5 leaves margin.
const FD_TOL: f64 = 1e-5;

fn check_fd(c: &Case, what: &str) {
    let g = moe_backward_reference(&c.x, &c.wr, &c.w1, &c.w3, &c.w2, &c.dy, c.dims, c.cfg);
    let outs = [
        ("dx", &g.dx),
        ("dw_router", &g.dw_router),
        ("dw1", &g.dw1),
        ("dw3", &g.dw3),
        ("dw2", &g.dw2),
    ];
    for (which, (name, got)) in outs.iter().enumerate() {
        let want = fd_grad(c, which);
        let err = rel_norm(got, &want);
        assert!(err <= FD_TOL, "{what}: {name} rel err {err:e}");
    }
}

#[test]
fn backward_reference_matches_finite_differences() {
    for score_fn in [ScoreFn::Softmax, ScoreFn::Sigmoid] {
        for renorm in [true, false] {
            let c = smooth_case(5, 6, 4, 6, cfg(2, score_fn, renorm), 1);
            check_fd(&c, &format!("T=5 E=6 k=2 {score_fn:?} renorm={renorm}"));
        }
    }
    // T = 1, k = 3 of 4.
    let c = smooth_case(1, 5, 3, 4, cfg(3, ScoreFn::Softmax, true), 2);
    check_fd(&c, "T=1 k=3");
    // k = 1 with renorm: the gate is 1, so the router gets no gradient (and FD agrees).
    let c = smooth_case(4, 4, 3, 3, cfg(1, ScoreFn::Softmax, true), 3);
    check_fd(&c, "k=1 renorm");
    // The load-balancing loss: its gradient reaches the router through every score.
    for score_fn in [ScoreFn::Softmax, ScoreFn::Sigmoid] {
        let c = smooth_case(6, 5, 3, 5, with_aux(cfg(2, score_fn, true), 0.3), 5);
        check_fd(&c, &format!("aux {score_fn:?}"));
    }
}

#[test]
fn backward_with_experts_that_receive_no_tokens() {
    // Column 0 of x is 1 for every token and experts 4 and 5 weigh it by -30, so their
    // softmax scores are ~e-30 of the others': they never make the top 2.
    let mut c = smooth_case(6, 5, 3, 6, cfg(2, ScoreFn::Softmax, true), 4);
    for tok in 0..6 {
        c.x[tok * 5] = 1.0;
    }
    for ex in [4, 5] {
        c.wr[ex * 5] = -30.0;
    }
    let r = moe_route_reference(&c.x, &c.wr, c.dims, c.cfg);
    assert_eq!(r.offsets[4], r.offsets[6], "experts 4 and 5 must be empty");
    let g = moe_backward_reference(&c.x, &c.wr, &c.w1, &c.w3, &c.w2, &c.dy, c.dims, c.cfg);
    // An expert without tokens gets exactly zero weight gradients.
    let fd3 = 3 * 5;
    assert!(g.dw1[4 * fd3..].iter().all(|&v| v == 0.0));
    assert!(g.dw3[4 * fd3..].iter().all(|&v| v == 0.0));
    assert!(g.dw2[4 * fd3..].iter().all(|&v| v == 0.0));
    check_fd(&c, "empty experts");
}

// ---------------------------------------------------------------------------------------------
// Devices against the reference
// ---------------------------------------------------------------------------------------------

struct Uploaded {
    x: Tensor,
    wr: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    dy: Tensor,
}

fn upload(b: &Backend, c: &Case, dtype: DType) -> Uploaded {
    let MoeDims { t, d, f, e } = c.dims;
    let up = |shape: &[usize], v: &[f32]| Tensor::from_f32_as(b, shape, dtype, v).unwrap();
    Uploaded {
        x: up(&[t, d], &c.x),
        wr: up(&[e, d], &c.wr),
        w1: up(&[e, f, d], &c.w1),
        w3: up(&[e, f, d], &c.w3),
        w2: up(&[e, d, f], &c.w2),
        dy: up(&[t, d], &c.dy),
    }
}

struct DevOut {
    y: Vec<f32>,
    idx: Vec<i32>,
    gate: Vec<f32>,
    aux: f32,
    grads: [Vec<f32>; 5],
}

impl DevOut {
    fn bits(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.y.iter().map(|x| x.to_bits()).collect();
        v.extend(self.idx.iter().map(|&i| i as u32));
        v.extend(self.gate.iter().map(|x| x.to_bits()));
        v.push(self.aux.to_bits());
        for g in &self.grads {
            v.extend(g.iter().map(|x| x.to_bits()));
        }
        v
    }
}

fn run_device(b: &Backend, c: &Case, dtype: DType) -> DevOut {
    let u = upload(b, c, dtype);
    let MoeOutput {
        y,
        topk_idx,
        topk_gate,
        aux_loss,
        offsets,
    } = moe_forward(b, &u.x, &u.wr, &u.w1, &u.w3, &u.w2, c.cfg).unwrap();
    // The expert bounds the forward returns are the stable sort's of its own top-k.
    let idx = topk_idx.to_vec::<i32>().unwrap();
    assert_eq!(
        offsets.to_vec::<i32>().unwrap(),
        moe_sort_reference(&idx, c.dims.e).0,
        "offsets"
    );
    let MoeGradTensors {
        dx,
        dw_router,
        dw1,
        dw3,
        dw2,
    } = moe_backward(b, &u.x, &u.wr, &u.w1, &u.w3, &u.w2, &u.dy, c.cfg).unwrap();
    let v = |t: &Tensor| t.to_vec::<f32>().unwrap();
    DevOut {
        y: v(&y),
        idx,
        gate: v(&topk_gate),
        aux: v(&aux_loss)[0],
        grads: [v(&dx), v(&dw_router), v(&dw1), v(&dw3), v(&dw2)],
    }
}

/// Compares a device run with the CPU reference (on the case's values rounded to `dtype`).
/// `tol`: F32_TOL for f32 math on both sides; BF16_TOL where the device rounds GEMM operands
/// to bf16 (BF16 inputs on emu/cuda).
fn check_against_reference(got: &DevOut, c: &Case, dtype: DType, tol: f64, what: &str) {
    let r = |v: &[f32]| -> Vec<f32> {
        match dtype {
            DType::BF16 => v
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect(),
            _ => v.to_vec(),
        }
    };
    let (x, wr, w1, w3, w2, dy) = (r(&c.x), r(&c.wr), r(&c.w1), r(&c.w3), r(&c.w2), r(&c.dy));
    let f = moe_forward_reference(&x, &wr, &w1, &w3, &w2, c.dims, c.cfg);
    let g = moe_backward_reference(&x, &wr, &w1, &w3, &w2, &dy, c.dims, c.cfg);
    assert_eq!(got.idx, f.topk_idx, "{what}: topk_idx");
    let aux_err = (got.aux - f.aux_loss).abs() as f64 / (f.aux_loss.abs() as f64).max(1e-30);
    assert!(
        aux_err <= tol || got.aux == f.aux_loss,
        "{what}: aux {} vs {}",
        got.aux,
        f.aux_loss
    );
    let pairs = [
        ("y", &got.y, &f.y),
        ("topk_gate", &got.gate, &f.topk_gate),
        ("dx", &got.grads[0], &g.dx),
        ("dw_router", &got.grads[1], &g.dw_router),
        ("dw1", &got.grads[2], &g.dw1),
        ("dw3", &got.grads[3], &g.dw3),
        ("dw2", &got.grads[4], &g.dw2),
    ];
    for (name, a, b) in pairs {
        let err = rel_norm(a, &widen(b));
        assert!(err <= tol, "{what}: {name} rel err {err:e}");
        // The norm hides a few zeroed outputs; none may be.
        assert_eq!(
            lost_outputs(a, b),
            0,
            "{what}: {name} has exact zeros where the reference has none"
        );
    }
}

/// Tiny emu shapes (T <= 17, d <= 32, f <= 16, E <= 8, k <= 2).
fn emu_cases() -> Vec<Case> {
    vec![
        case(1, 8, 4, 4, cfg(1, ScoreFn::Softmax, true), 11),
        case(17, 32, 16, 8, cfg(2, ScoreFn::Softmax, true), 12),
        case(9, 12, 5, 3, cfg(2, ScoreFn::Sigmoid, false), 13),
        case(13, 16, 8, 8, cfg(2, ScoreFn::Sigmoid, true), 14),
        case(
            10,
            8,
            4,
            4,
            with_aux(cfg(2, ScoreFn::Softmax, true), 0.3),
            21,
        ),
        case(
            6,
            8,
            4,
            4,
            with_aux(cfg(1, ScoreFn::Sigmoid, false), 0.3),
            22,
        ),
    ]
}

#[test]
fn emu_matches_reference_and_seeds_agree() {
    for (i, c) in emu_cases().iter().enumerate() {
        let a = run_device(&Backend::emu_with_seed(1), c, DType::F32);
        check_against_reference(&a, c, DType::F32, F32_TOL, &format!("emu case {i}"));
        let b = run_device(&Backend::emu_with_seed(2), c, DType::F32);
        assert_eq!(a.bits(), b.bits(), "emu case {i}: seeds 1 and 2 differ");
    }
}

#[test]
fn emu_sort_across_several_chunks() {
    // T*k = 600 slots: three 256-slot chunks of the counting sort (the other emu cases fit in
    // one), with experts whose segments span chunk boundaries.
    let c = case(300, 8, 4, 8, cfg(2, ScoreFn::Softmax, true), 23);
    let a = run_device(&Backend::emu_with_seed(1), &c, DType::F32);
    check_against_reference(&a, &c, DType::F32, F32_TOL, "emu 3 chunks");
    let b = run_device(&Backend::emu_with_seed(2), &c, DType::F32);
    assert_eq!(a.bits(), b.bits(), "emu 3 chunks: seeds 1 and 2 differ");
}

#[test]
fn sort_is_stable_and_exact_on_every_device() {
    // Random expert ids (repeats allowed: the sort itself does not need distinct ids), T*k =
    // 2100 slots over 9 chunks; the device's stable order must equal the reference's exactly.
    let mut rng = Rng::new(24);
    let (t, k, e) = (700, 3, 5);
    let idx: Vec<i32> = (0..t * k).map(|_| rng.below(e) as i32).collect();
    let want = moe_sort_reference(&idx, e);
    for b in [
        Backend::Cpu,
        Backend::emu_with_seed(1),
        Backend::emu_with_seed(2),
    ] {
        let it = Tensor::from_slice(&b, &[t, k], &idx).unwrap();
        let (o, p, q) = moe_sort(&b, &it, e).unwrap();
        let got = (
            o.to_vec::<i32>().unwrap(),
            p.to_vec::<i32>().unwrap(),
            q.to_vec::<i32>().unwrap(),
        );
        assert_eq!(got, want, "{b:?}");
        // Stable: inside each expert's segment the slots ascend.
        for ex in 0..e {
            let seg = &got.1[got.0[ex] as usize..got.0[ex + 1] as usize];
            assert!(seg.windows(2).all(|w| w[0] < w[1]), "{b:?}: expert {ex}");
        }
    }
    let bad = Tensor::from_slice(&Backend::Cpu, &[1, 2], &[0i32, 5]).unwrap();
    let err = moe_sort(&Backend::Cpu, &bad, 5).err().unwrap().to_string();
    assert!(err.contains("idx"), "{err}");
}

#[test]
fn emu_bf16_tensor_core_path() {
    let c = case(7, 16, 8, 4, cfg(2, ScoreFn::Softmax, true), 15);
    let a = run_device(&Backend::emu_with_seed(1), &c, DType::BF16);
    check_against_reference(&a, &c, DType::BF16, BF16_TOL, "emu bf16");
    let b = run_device(&Backend::emu_with_seed(2), &c, DType::BF16);
    assert_eq!(a.bits(), b.bits(), "emu bf16: seeds 1 and 2 differ");
    let cpu = run_device(&Backend::Cpu, &c, DType::BF16);
    check_against_reference(&cpu, &c, DType::BF16, BF16_TOL, "cpu bf16");
}

/// BF16 inputs: the cpu device and the emulated kernels give the same bits for every output
/// (y, indices, gates, aux loss and all five gradients). The cpu path rounds at the device's
/// points (h, d(ye), da, db), sums the bf16 GEMMs and the router's f32 products as one FMA chain
/// over K (the device's order), the softmax in the block reduction's order with the host expf,
/// and the router backward in moe_router_backward's order. The cases reach what the small
/// model does not: k = 3 and 4 (the router backward's sum over the kept experts), d = 300 (a
/// router product longer than the f32 reference's 256-long chunks), T = 300 (weight gradients
/// over more rows than a chunk), sigmoid scores and the auxiliary loss.
#[test]
fn cpu_and_emu_bf16_are_bit_identical() {
    let cases = [
        case(7, 16, 8, 4, cfg(2, ScoreFn::Softmax, true), 15),
        case(17, 300, 8, 6, cfg(3, ScoreFn::Softmax, true), 16),
        case(
            127,
            24,
            6,
            5,
            with_aux(cfg(3, ScoreFn::Sigmoid, false), 0.3),
            17,
        ),
        case(
            1,
            8,
            4,
            4,
            with_aux(cfg(4, ScoreFn::Softmax, true), 0.3),
            18,
        ),
        case(300, 8, 4, 8, cfg(3, ScoreFn::Softmax, false), 19),
    ];
    for (i, c) in cases.iter().enumerate() {
        let cpu = run_device(&Backend::Cpu, c, DType::BF16);
        let emu = run_device(&Backend::emu_with_seed(1), c, DType::BF16);
        assert!(!cpu.bits().is_empty());
        assert_eq!(cpu.idx, emu.idx, "case {i}: cpu and emu route differently");
        let names = ["dx", "dw_router", "dw1", "dw3", "dw2"];
        for ((name, x), y) in names.iter().zip(&cpu.grads).zip(&emu.grads) {
            let same = x.iter().zip(y).filter(|(p, q)| p.to_bits() == q.to_bits());
            assert_eq!(same.count(), x.len(), "case {i}: {name} bits differ");
        }
        assert_eq!(
            cpu.bits(),
            emu.bits(),
            "case {i}: y, gates or aux bits differ"
        );
    }
}

#[test]
fn emu_with_an_empty_expert() {
    let mut c = case(5, 8, 4, 4, cfg(2, ScoreFn::Softmax, true), 16);
    for tok in 0..5 {
        c.x[tok * 8] = 1.0;
    }
    c.wr[3 * 8] = -30.0;
    let r = moe_route_reference(&c.x, &c.wr, c.dims, c.cfg);
    assert_eq!(r.offsets[3], r.offsets[4], "expert 3 must be empty");
    let a = run_device(&Backend::emu_with_seed(1), &c, DType::F32);
    check_against_reference(&a, &c, DType::F32, F32_TOL, "emu empty expert");
    assert!(
        a.grads[2][3 * 32..].iter().all(|&v| v == 0.0),
        "dw1 of empty expert"
    );
    // BF16: the weight gradients run per expert on tensor cores; the empty one is skipped.
    let a = run_device(&Backend::emu_with_seed(1), &c, DType::BF16);
    check_against_reference(&a, &c, DType::BF16, BF16_TOL, "emu bf16 empty expert");
    for g in &a.grads[2..] {
        assert!(g[3 * 32..].iter().all(|&v| v == 0.0), "bf16 empty expert");
    }
}

#[test]
fn cpu_is_deterministic() {
    let c = case(64, 32, 16, 8, cfg(2, ScoreFn::Softmax, true), 17);
    let a = run_device(&Backend::Cpu, &c, DType::F32);
    let b = run_device(&Backend::Cpu, &c, DType::F32);
    assert_eq!(a.bits(), b.bits());
    check_against_reference(&a, &c, DType::F32, F32_TOL, "cpu");
}

/// A token's y and dx are bit-identical whether it runs alone or among others, at any place.
fn check_batch_invariance(b: &Backend, what: &str) {
    let c = case(11, 16, 8, 6, cfg(2, ScoreFn::Softmax, true), 18);
    let full = run_device(b, &c, DType::F32);
    let d = c.dims.d;
    for tok in [0, 5, 10] {
        let mut one = c.clone();
        one.dims.t = 1;
        one.x = c.x[tok * d..(tok + 1) * d].to_vec();
        one.dy = c.dy[tok * d..(tok + 1) * d].to_vec();
        let alone = run_device(b, &one, DType::F32);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&alone.y),
            bits(&full.y[tok * d..(tok + 1) * d]),
            "{what}: y of token {tok}"
        );
        assert_eq!(
            bits(&alone.grads[0]),
            bits(&full.grads[0][tok * d..(tok + 1) * d]),
            "{what}: dx of token {tok}"
        );
    }
}

#[test]
fn cpu_packed_decode_path_equals_the_large_batch_path() {
    // Up to 64 tokens the cpu forward multiplies by expert weights packed once and kept with
    // the weight tensors (the decode path); more tokens go through the general GEMM. A token's
    // y must be the same bits either way (the rollout engine decodes one token at a time, the
    // learner sees 2048).
    let c = case(130, 32, 24, 8, cfg(2, ScoreFn::Softmax, true), 19);
    let full = run_device(&Backend::Cpu, &c, DType::F32);
    let d = c.dims.d;
    let u = upload(&Backend::Cpu, &c, DType::F32);
    for tok in [0usize, 64, 129] {
        let x = Tensor::from_slice(&Backend::Cpu, &[1, d], &c.x[tok * d..(tok + 1) * d]).unwrap();
        let y = moe_forward(&Backend::Cpu, &x, &u.wr, &u.w1, &u.w3, &u.w2, c.cfg)
            .unwrap()
            .y
            .to_vec::<f32>()
            .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&y),
            bits(&full.y[tok * d..(tok + 1) * d]),
            "token {tok}"
        );
    }
}

/// The gradients' bits, output by output.
fn grad_bits(g: &MoeGradTensors) -> Vec<Vec<u32>> {
    [&g.dx, &g.dw_router, &g.dw1, &g.dw3, &g.dw2]
        .iter()
        .map(|t| {
            t.to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

#[test]
fn backward_from_saved_state_equals_recomputed() {
    // The learner's backward takes the forward's state instead of recomputing it: the same
    // gradients bit for bit on cpu and emu, F32 and BF16, and a state of other sizes or from
    // another device is an error, not wrong gradients.
    let c = case(70, 16, 12, 6, cfg(2, ScoreFn::Softmax, true), 20);
    let small = case(5, 16, 12, 6, cfg(2, ScoreFn::Softmax, true), 21);
    let emu = Backend::emu_with_seed(2);
    let mut compared = 0;
    for b in [&Backend::Cpu, &emu] {
        for dtype in [DType::F32, DType::BF16] {
            let u = upload(b, &c, dtype);
            let (_, saved) = moe_forward_saved(b, &u.x, &u.wr, &u.w1, &u.w3, &u.w2, c.cfg).unwrap();
            let from_saved = moe_backward_saved(
                b,
                &u.x,
                &u.wr,
                &u.w1,
                &u.w3,
                &u.w2,
                &u.dy,
                c.cfg,
                Some(&saved),
            )
            .unwrap();
            let recomputed =
                moe_backward(b, &u.x, &u.wr, &u.w1, &u.w3, &u.w2, &u.dy, c.cfg).unwrap();
            assert_eq!(
                grad_bits(&from_saved),
                grad_bits(&recomputed),
                "{} {dtype}",
                b.device()
            );
            compared += 1;
            // A state from a call of another size.
            let us = upload(b, &small, dtype);
            let (_, other) =
                moe_forward_saved(b, &us.x, &us.wr, &us.w1, &us.w3, &us.w2, c.cfg).unwrap();
            let err = moe_backward_saved(
                b,
                &u.x,
                &u.wr,
                &u.w1,
                &u.w3,
                &u.w2,
                &u.dy,
                c.cfg,
                Some(&other),
            );
            assert!(matches!(err, Err(Error::Invalid(m)) if m.contains("saved forward state")));
        }
    }
    assert_eq!(compared, 4);
    // A cpu state on emu.
    let (uc, ue) = (
        upload(&Backend::Cpu, &c, DType::F32),
        upload(&emu, &c, DType::F32),
    );
    let (_, cpu_state) =
        moe_forward_saved(&Backend::Cpu, &uc.x, &uc.wr, &uc.w1, &uc.w3, &uc.w2, c.cfg).unwrap();
    let err = moe_backward_saved(
        &emu,
        &ue.x,
        &ue.wr,
        &ue.w1,
        &ue.w3,
        &ue.w2,
        &ue.dy,
        c.cfg,
        Some(&cpu_state),
    );
    assert!(matches!(err, Err(Error::Invalid(m)) if m.contains("another device")));
}

#[test]
fn cpu_batch_invariance() {
    check_batch_invariance(&Backend::Cpu, "cpu");
}

#[test]
fn emu_batch_invariance_and_determinism() {
    let b = Backend::emu_with_seed(3);
    check_batch_invariance(&b, "emu");
    let c = &emu_cases()[1];
    assert_eq!(
        run_device(&b, c, DType::F32).bits(),
        run_device(&b, c, DType::F32).bits(),
        "emu: two runs differ"
    );
}

#[test]
fn cuda_matches_reference() {
    let Some(gpu) = cuda_for_tests("moe cuda_matches_reference") else {
        return;
    };
    for (i, c) in emu_cases()
        .iter()
        .chain(&[case(300, 64, 32, 16, cfg(4, ScoreFn::Softmax, true), 19)])
        .enumerate()
    {
        let a = run_device(&gpu, c, DType::F32);
        check_against_reference(&a, c, DType::F32, F32_TOL, &format!("cuda case {i}"));
        let b = run_device(&gpu, c, DType::F32);
        assert_eq!(a.bits(), b.bits(), "cuda case {i}: two runs differ");
        let a = run_device(&gpu, c, DType::BF16);
        check_against_reference(&a, c, DType::BF16, BF16_TOL, &format!("cuda bf16 case {i}"));
        let b = run_device(&gpu, c, DType::BF16);
        assert_eq!(a.bits(), b.bits(), "cuda bf16 case {i}: two runs differ");
    }
}

/// On an sm_90 GPU: the BF16 cases with every expert GEMM on the Hopper path (wgmma, TMA; the
/// grouped `_nn`, `_segment_tn` and SwiGLU forms), against the reference by norm and two runs by
/// bits. Skips, saying so, without a GPU or on another architecture. (On emu the same path gives
/// the CPU's bits: `SLUICE_GEMM_PATH=wgmma cargo test --release -p sluice-kernels --test moe`.)
#[test]
fn cuda_wgmma_matches_reference() {
    let Some(gpu) = cuda_for_tests("moe cuda_wgmma_matches_reference") else {
        return;
    };
    if !gpu
        .cuda()
        .is_some_and(|c| c.arch() == sluice_kernels::cuda::PtxArch::Sm90a)
    {
        println!("moe cuda_wgmma_matches_reference: not an sm_90 GPU; skipped");
        return;
    }
    let _path = GemmPath::scoped(GemmPath::Wgmma);
    let mut compared = 0;
    for (i, c) in emu_cases()
        .iter()
        .chain(&[case(300, 64, 32, 16, cfg(4, ScoreFn::Softmax, true), 19)])
        .enumerate()
    {
        let a = run_device(&gpu, c, DType::BF16);
        check_against_reference(&a, c, DType::BF16, BF16_TOL, &format!("wgmma case {i}"));
        let b = run_device(&gpu, c, DType::BF16);
        assert_eq!(a.bits(), b.bits(), "wgmma case {i}: two runs differ");
        compared += 1;
    }
    assert!(compared >= 2);
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

#[test]
fn bad_input_is_an_error_naming_the_tensor() {
    let b = Backend::Cpu;
    let c = case(4, 8, 4, 4, cfg(2, ScoreFn::Softmax, true), 20);
    let u = upload(&b, &c, DType::F32);
    let t = |shape: &[usize]| Tensor::zeros(&b, shape, DType::F32).unwrap();
    let msg = |e: Error| e.to_string();

    let e = moe_forward(&b, &u.x, &t(&[4, 7]), &u.w1, &u.w3, &u.w2, c.cfg)
        .err()
        .unwrap();
    assert!(matches!(e, Error::Shape { .. }) && msg(e).contains("w_router"));
    let e = moe_forward(&b, &u.x, &u.wr, &t(&[4, 4, 7]), &u.w3, &u.w2, c.cfg)
        .err()
        .unwrap();
    assert!(msg(e).contains("w1"));
    let e = moe_forward(&b, &u.x, &u.wr, &u.w1, &t(&[4, 5, 8]), &u.w2, c.cfg)
        .err()
        .unwrap();
    assert!(msg(e).contains("`w3`"));
    let e = moe_forward(&b, &u.x, &u.wr, &u.w1, &u.w3, &t(&[4, 4, 8]), c.cfg)
        .err()
        .unwrap();
    let m = msg(e);
    assert!(m.contains("`w2`") && m.contains("[4,8,4]"), "{m}");
    let e = moe_forward(&b, &t(&[0, 8]), &u.wr, &u.w1, &u.w3, &u.w2, c.cfg)
        .err()
        .unwrap();
    assert!(msg(e).contains("`x`"));
    for k in [0, 5, 17] {
        let e = moe_forward(
            &b,
            &u.x,
            &u.wr,
            &u.w1,
            &u.w3,
            &u.w2,
            cfg(k, ScoreFn::Softmax, true),
        )
        .err()
        .unwrap();
        assert!(matches!(e, Error::Param { .. }), "k = {k}");
    }
    let e = moe_backward(&b, &u.x, &u.wr, &u.w1, &u.w3, &u.w2, &t(&[3, 8]), c.cfg)
        .err()
        .unwrap();
    assert!(msg(e).contains("`dy`"));
    let xi = Tensor::zeros(&b, &[4, 8], DType::I32).unwrap();
    let e = moe_forward(&b, &xi, &u.wr, &u.w1, &u.w3, &u.w2, c.cfg)
        .err()
        .unwrap();
    assert!(matches!(e, Error::DType { .. }));
    let wb = Tensor::zeros(&b, &[4, 8], DType::BF16).unwrap();
    let e = moe_forward(&b, &u.x, &wb, &u.w1, &u.w3, &u.w2, c.cfg)
        .err()
        .unwrap();
    assert!(matches!(e, Error::DType { .. }) && msg(e).contains("w_router"));
    assert!(ScoreFn::parse("relu").is_err());
    // A cpu tensor on emu is an error, not a crash.
    let emu = Backend::emu_with_seed(1);
    let ex = Tensor::zeros(&emu, &[4, 8], DType::F32).unwrap();
    assert!(moe_forward(&emu, &ex, &u.wr, &u.w1, &u.w3, &u.w2, c.cfg).is_err());
}
