//! Training attention: the CPU reference against an f64 oracle (forward, gradients, finite
//! differences), batch invariance and determinism; emu and CUDA against the reference; bad input.

use sluice_kernels::ops::attention::{
    attention_backward, attention_backward_reference, attention_backward_saved,
    attention_backward_saved_on, attention_forward, attention_forward_on,
    attention_forward_reference, AttnDims,
};
use sluice_kernels::ops::attention_tile::{AttentionPath, RowOrder};
use sluice_kernels::testing::{rel_norm, Rng, BF16_TOL, F32_TOL};
use sluice_kernels::{Backend, DType, Tensor};

/// One attention problem in host memory.
#[derive(Clone)]
struct Case {
    lens: Vec<usize>,
    h: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
}

impl Case {
    fn new(seed: u64, lens: &[usize], h: usize, hkv: usize, d: usize, causal: bool) -> Case {
        let mut rng = Rng::new(seed);
        let t: usize = lens.iter().sum();
        Case {
            lens: lens.to_vec(),
            h,
            hkv,
            d,
            causal,
            q: rng.normal_vec(t * h * d, 1.0),
            k: rng.normal_vec(t * hkv * d, 1.0),
            v: rng.normal_vec(t * hkv * d, 1.0),
            dout: rng.normal_vec(t * h * d, 1.0),
        }
    }
    fn t(&self) -> usize {
        self.lens.iter().sum()
    }
    fn cu(&self) -> Vec<i32> {
        let mut cu = vec![0i32];
        for &l in &self.lens {
            cu.push(cu.last().unwrap() + l as i32);
        }
        cu
    }
    fn dims(&self) -> AttnDims {
        AttnDims {
            t: self.t(),
            h: self.h,
            hkv: self.hkv,
            d: self.d,
        }
    }
    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }
    /// Rounds q, k, v and dout to bf16 values (kept as f32).
    fn rounded_to_bf16(&self) -> Case {
        let r = |x: &Vec<f32>| {
            x.iter()
                .map(|&a| half::bf16::from_f32(a).to_f32())
                .collect()
        };
        Case {
            q: r(&self.q),
            k: r(&self.k),
            v: r(&self.v),
            dout: r(&self.dout),
            ..self.clone()
        }
    }
    fn reference(&self) -> (Vec<f32>, Vec<f32>) {
        let (t, h, d) = (self.t(), self.h, self.d);
        let mut out = vec![f32::NAN; t * h * d];
        let mut lse = vec![f32::NAN; t * h];
        attention_forward_reference(
            &self.q,
            &self.k,
            &self.v,
            &self.cu(),
            self.dims(),
            self.causal,
            self.scale(),
            RowOrder::Chunks,
            &mut out,
            &mut lse,
        )
        .unwrap();
        (out, lse)
    }
    fn reference_grads(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (out, lse) = self.reference();
        let (t, h, hkv, d) = (self.t(), self.h, self.hkv, self.d);
        let mut dq = vec![f32::NAN; t * h * d];
        let mut dk = vec![f32::NAN; t * hkv * d];
        let mut dv = vec![f32::NAN; t * hkv * d];
        attention_backward_reference(
            &self.q,
            &self.k,
            &self.v,
            &self.cu(),
            self.dims(),
            self.causal,
            self.scale(),
            RowOrder::Chunks,
            &out,
            &lse,
            &self.dout,
            &mut dq,
            &mut dk,
            &mut dv,
        )
        .unwrap();
        (dq, dk, dv)
    }
    fn tensors(&self, b: &Backend, dtype: DType) -> [Tensor; 5] {
        let (t, h, hkv, d) = (self.t(), self.h, self.hkv, self.d);
        [
            Tensor::from_f32_as(b, &[t, h, d], dtype, &self.q).unwrap(),
            Tensor::from_f32_as(b, &[t, hkv, d], dtype, &self.k).unwrap(),
            Tensor::from_f32_as(b, &[t, hkv, d], dtype, &self.v).unwrap(),
            Tensor::from_slice(b, &[self.lens.len() + 1], &self.cu()).unwrap(),
            Tensor::from_f32_as(b, &[t, h, d], dtype, &self.dout).unwrap(),
        ]
    }
}

/// Naive softmax attention in f64: out and the gradients of sum(out * dout).
fn oracle(c: &Case) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (t, h, hkv, d) = (c.t(), c.h, c.hkv, c.d);
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; t * h * d];
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; t * h * d],
        vec![0.0; t * hkv * d],
        vec![0.0; t * hkv * d],
    );
    let cu = c.cu();
    let f = |x: &[f32], i: usize| x[i] as f64;
    for b in 0..c.lens.len() {
        let (s0, s1) = (cu[b] as usize, cu[b + 1] as usize);
        for head in 0..h {
            let g = head / (h / hkv);
            for i in s0..s1 {
                let keys: Vec<usize> = (s0..if c.causal { i + 1 } else { s1 }).collect();
                let qi = (i * h + head) * d;
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        (0..d)
                            .map(|x| f(&c.q, qi + x) * f(&c.k, (j * hkv + g) * d + x))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                let p: Vec<f64> = s.iter().map(|x| (x - mx).exp() / z).collect();
                for (pj, &j) in p.iter().zip(&keys) {
                    for x in 0..d {
                        out[qi + x] += pj * f(&c.v, (j * hkv + g) * d + x);
                    }
                }
                // dP_j = dout . v_j; dS_j = P_j (dP_j - sum_l P_l dP_l)
                let dp: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        (0..d)
                            .map(|x| f(&c.dout, qi + x) * f(&c.v, (j * hkv + g) * d + x))
                            .sum()
                    })
                    .collect();
                let dsum: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for ((pj, dpj), &j) in p.iter().zip(&dp).zip(&keys) {
                    let ds = pj * (dpj - dsum);
                    let kj = (j * hkv + g) * d;
                    for x in 0..d {
                        dv[kj + x] += pj * f(&c.dout, qi + x);
                        dq[qi + x] += ds * f(&c.k, kj + x) * scale;
                        dk[kj + x] += ds * f(&c.q, qi + x) * scale;
                    }
                }
            }
        }
    }
    (out, dq, dk, dv)
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let mut seed = 10;
    for &(h, hkv) in &[(2, 2), (4, 1)] {
        for &d in &[16, 32] {
            for &causal in &[true, false] {
                seed += 1;
                v.push(Case::new(seed, &[1, 17, 33], h, hkv, d, causal));
            }
        }
    }
    // Several chunks, a sequence of length 1 and an empty sequence in one batch.
    v.push(Case::new(99, &[127, 0, 1, 40], 4, 2, 24, true));
    v
}

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&a| a as f64).collect()
}

#[test]
fn reference_forward_matches_f64_oracle() {
    for c in cases() {
        let (out, lse) = c.reference();
        let (want, ..) = oracle(&c);
        let err = rel_norm(&out, &want);
        // f32 sums of <= 127 products of O(1) values: relative error ~1e-7, far inside 1e-5.
        assert!(
            err <= F32_TOL,
            "lens {:?} h {} hkv {} d {} causal {}: {err}",
            c.lens,
            c.h,
            c.hkv,
            c.d,
            c.causal
        );
        assert!(lse.iter().all(|x| x.is_finite()));
    }
}

#[test]
fn reference_lse_is_the_logsumexp() {
    let c = Case::new(5, &[3, 40], 2, 1, 16, true);
    let (_, lse) = c.reference();
    let scale = 1.0 / 4.0f64;
    let cu = c.cu();
    for b in 0..2 {
        for i in cu[b] as usize..cu[b + 1] as usize {
            for head in 0..2 {
                let qi = (i * 2 + head) * 16;
                let z: f64 = (cu[b] as usize..=i)
                    .map(|j| {
                        ((0..16)
                            .map(|x| c.q[qi + x] as f64 * c.k[j * 16 + x] as f64)
                            .sum::<f64>()
                            * scale)
                            .exp()
                    })
                    .sum();
                let got = lse[i * 2 + head] as f64;
                assert!(
                    (got - z.ln()).abs() <= 1e-5 * z.ln().abs().max(1.0),
                    "{got} vs {}",
                    z.ln()
                );
            }
        }
    }
}

#[test]
fn reference_backward_matches_f64_oracle_gradients() {
    for c in cases() {
        let (dq, dk, dv) = c.reference_grads();
        let (_, odq, odk, odv) = oracle(&c);
        // Gradients sum up to 4 heads x 127 queries of f32 products; the worst case measured
        // is ~1e-6, so the f32 tolerance 1e-5 holds with margin.
        for (name, got, want) in [("dq", &dq, &odq), ("dk", &dk, &odk), ("dv", &dv, &odv)] {
            let err = rel_norm(got, want);
            assert!(
                err <= F32_TOL,
                "{name} lens {:?} h {} hkv {} causal {}: {err}",
                c.lens,
                c.h,
                c.hkv,
                c.causal
            );
        }
    }
}

#[test]
fn reference_gradient_matches_central_differences() {
    // L = sum(out * dout) through the f32 reference; central differences in f64 arithmetic of
    // f32 evaluations with eps = 1e-2: truncation ~eps^2 * |L'''| ~ 1e-4, roundoff
    // ~ 1e-7 * |L| / eps ~ 1e-4, hence the tolerance 2e-3 (absolute, gradients are O(1)).
    for (seed, hkv, causal) in [(7u64, 1usize, true), (8, 4, false)] {
        let c = Case::new(seed, &[5, 1, 9], 4, hkv, 16, causal);
        let (dq, dk, dv) = c.reference_grads();
        let loss = |cc: &Case| -> f64 {
            let (out, _) = cc.reference();
            out.iter()
                .zip(&cc.dout)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum()
        };
        let mut rng = Rng::new(seed);
        for which in 0..3 {
            for _ in 0..6 {
                let mut plus = c.clone();
                let mut minus = c.clone();
                let (buf_p, buf_m, grad) = match which {
                    0 => (&mut plus.q, &mut minus.q, &dq),
                    1 => (&mut plus.k, &mut minus.k, &dk),
                    _ => (&mut plus.v, &mut minus.v, &dv),
                };
                let i = rng.below(grad.len());
                let eps = 1e-2f32;
                buf_p[i] += eps;
                buf_m[i] -= eps;
                let fd = (loss(&plus) - loss(&minus)) / (2.0 * eps as f64);
                assert!(
                    (fd - grad[i] as f64).abs() <= 2e-3,
                    "input {which} index {i}: fd {fd} vs {}",
                    grad[i]
                );
            }
        }
    }
}

#[test]
fn reference_bf16_inputs_within_bf16_tolerance() {
    let c = Case::new(3, &[17, 33], 4, 1, 32, true);
    let rounded = c.rounded_to_bf16();
    let cpu = Backend::Cpu;
    let [q, k, v, cu, dout] = rounded.tensors(&cpu, DType::BF16);
    let (_, odq, odk, odv) = oracle(&rounded);
    // v2 (tiles): P is rounded to bf16 before it multiplies V, so the forward is within bf16's
    // tolerance of the oracle on the rounded inputs, not f32's; the gradients follow from it.
    let got =
        attention_forward_on(AttentionPath::Tiles, &cpu, &q, &k, &v, &cu, true, None).unwrap();
    let out = got.out.to_vec::<f32>().unwrap();
    assert!(rel_norm(&out, &oracle(&c).0) <= BF16_TOL);
    let err = rel_norm(&out, &oracle(&rounded).0);
    assert!(
        err <= BF16_TOL && err > F32_TOL,
        "tiles forward vs the rounded oracle: {err}"
    );
    let g = attention_backward_saved_on(
        AttentionPath::Tiles,
        &cpu,
        &q,
        &k,
        &v,
        &cu,
        &got.out,
        &got.lse,
        &dout,
        true,
        None,
    )
    .unwrap();
    assert!(rel_norm(&g.dq.to_vec::<f32>().unwrap(), &odq) <= BF16_TOL);
    assert!(rel_norm(&g.dk.to_vec::<f32>().unwrap(), &odk) <= BF16_TOL);
    assert!(rel_norm(&g.dv.to_vec::<f32>().unwrap(), &odv) <= BF16_TOL);
    // v1 (chunks): f32 arithmetic on exact bf16 values.
    let got = attention_forward_on(AttentionPath::Simt, &cpu, &q, &k, &v, &cu, true, None).unwrap();
    assert!(rel_norm(&got.out.to_vec::<f32>().unwrap(), &oracle(&rounded).0) <= F32_TOL);
    let g = attention_backward_saved_on(
        AttentionPath::Simt,
        &cpu,
        &q,
        &k,
        &v,
        &cu,
        &got.out,
        &got.lse,
        &dout,
        true,
        None,
    )
    .unwrap();
    assert!(rel_norm(&g.dq.to_vec::<f32>().unwrap(), &odq) <= F32_TOL);
    assert!(rel_norm(&g.dk.to_vec::<f32>().unwrap(), &odk) <= F32_TOL);
    assert!(rel_norm(&g.dv.to_vec::<f32>().unwrap(), &odv) <= F32_TOL);
}

/// Runs forward and backward on `b`; returns out, lse, dq, dk, dv as host vectors.
fn run_all(b: &Backend, c: &Case, dtype: DType) -> [Vec<f32>; 5] {
    let [q, k, v, cu, dout] = c.tensors(b, dtype);
    let f = attention_forward(b, &q, &k, &v, &cu, c.causal, None).unwrap();
    let g = attention_backward(b, &q, &k, &v, &cu, &dout, c.causal, None).unwrap();
    [f.out, f.lse, g.dq, g.dk, g.dv].map(|t| t.to_vec::<f32>().unwrap())
}

/// Asserts bit-identical slices; on failure reports the count and the first mismatch (not the
/// whole slices).
#[track_caller]
fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let bad: Vec<usize> = (0..a.len())
        .filter(|&i| a[i].to_bits() != b[i].to_bits())
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} of {} values differ in bits; first at {i}: {} vs {}",
            bad.len(),
            a.len(),
            a[i],
            b[i]
        );
    }
}

/// A sequence packed alone and at several offsets among others gives bit-identical rows
/// (forward, lse and all three gradients): rows depend only on their own sequence. The sequence
/// has 33 tokens, so its rows span two key chunks.
fn check_batch_invariance(b: &Backend, dtype: DType) {
    let (h, hkv, d) = (4, 2, 16);
    for causal in [true, false] {
        let alone = Case::new(21, &[33], h, hkv, d, causal);
        let a = run_all(b, &alone, dtype);
        // (lens of the packed batch, index of the slot holding `alone`'s sequence)
        for (lens, slot) in [
            (vec![5, 33, 2], 1),
            (vec![33, 7], 0),
            (vec![1, 0, 6, 33], 3),
        ] {
            let mut packed = Case::new(22, &lens, h, hkv, d, causal);
            let s: usize = lens[..slot].iter().sum();
            let e = s + 33;
            packed.q[s * h * d..e * h * d].copy_from_slice(&alone.q);
            packed.k[s * hkv * d..e * hkv * d].copy_from_slice(&alone.k);
            packed.v[s * hkv * d..e * hkv * d].copy_from_slice(&alone.v);
            packed.dout[s * h * d..e * h * d].copy_from_slice(&alone.dout);
            let p = run_all(b, &packed, dtype);
            let widths = [h * d, h, h * d, hkv * d, hkv * d];
            for (i, w) in widths.into_iter().enumerate() {
                assert_bits_eq(
                    &a[i],
                    &p[i][s * w..e * w],
                    &format!("output {i} causal {causal} lens {lens:?} on {b:?} {dtype}"),
                );
            }
        }
    }
}

#[test]
fn cpu_batch_invariant_bitwise() {
    check_batch_invariance(&Backend::Cpu, DType::F32);
    check_batch_invariance(&Backend::Cpu, DType::BF16);
}

#[test]
fn cpu_deterministic() {
    let c = Case::new(31, &[1, 17, 33], 4, 1, 32, true);
    let a = run_all(&Backend::Cpu, &c, DType::F32);
    let b = run_all(&Backend::Cpu, &c, DType::F32);
    for i in 0..5 {
        assert_bits_eq(&a[i], &b[i], &format!("cpu run twice, output {i}"));
    }
}

/// Device against the CPU reference, and two runs (or emulator seeds) bit-identical. F32 inputs
/// (v1) within f32 tolerance; BF16 inputs take v2 (tiles) whose CPU twin performs the emulated
/// kernels' operations in their order, so on the emulator every output equals cpu's bit for bit
/// (on a GPU the tensor cores' internal sums differ: bf16 tolerance).
fn check_device(b1: &Backend, b2: &Backend) {
    let emu_cases = [
        Case::new(41, &[1, 6, 33], 4, 1, 16, true),   // GQA 4
        Case::new(42, &[1, 17, 22], 2, 2, 32, false), // GQA 1, non-causal
        Case::new(43, &[3, 0, 37], 4, 2, 32, true),   // an empty sequence, 2 key tiles
        Case::new(44, &[127, 1], 8, 1, 4, true),      // GQA 8, head dim 4 padded to 16
    ];
    let bits_on_emu = matches!(b1, Backend::Emu(_));
    for c in &emu_cases {
        for dtype in [DType::F32, DType::BF16] {
            let cc = if dtype == DType::BF16 {
                c.rounded_to_bf16()
            } else {
                c.clone()
            };
            let want = run_all(&Backend::Cpu, &cc, DType::F32);
            let twin = run_all(&Backend::Cpu, &cc, dtype);
            let got1 = run_all(b1, &cc, dtype);
            let got2 = run_all(b2, &cc, dtype);
            let tol = if dtype == DType::BF16 {
                BF16_TOL
            } else {
                F32_TOL
            };
            for i in 0..5 {
                let err = rel_norm(&got1[i], &to64(&want[i]));
                assert!(
                    err <= tol,
                    "{b1:?} output {i} {dtype} lens {:?}: {err}",
                    cc.lens
                );
                assert_bits_eq(
                    &got1[i],
                    &got2[i],
                    &format!("{b1:?} vs {b2:?} output {i} {dtype}"),
                );
                if bits_on_emu {
                    assert_bits_eq(
                        &got1[i],
                        &twin[i],
                        &format!("{b1:?} vs cpu output {i} {dtype} lens {:?}", cc.lens),
                    );
                }
            }
        }
    }
}

/// Head dim 128, the widest of the tile path (one case: the emulator is slow).
#[test]
fn emu_head_dim_128_equals_cpu_bits() {
    let c = Case::new(45, &[130, 17], 2, 1, 128, true).rounded_to_bf16();
    let emu = Backend::emu_with_seed(1);
    let [q, k, v, cu, _] = c.tensors(&emu, DType::BF16);
    let got = attention_forward(&emu, &q, &k, &v, &cu, true, None).unwrap();
    let [q, k, v, cu, _] = c.tensors(&Backend::Cpu, DType::BF16);
    let want = attention_forward(&Backend::Cpu, &q, &k, &v, &cu, true, None).unwrap();
    for (a, b, what) in [(&got.out, &want.out, "out"), (&got.lse, &want.lse, "lse")] {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        assert!(a.iter().all(|x| x.is_finite()), "{what}: every row written");
        assert_bits_eq(&a, &b, &format!("D = 128 emu vs cpu {what}"));
    }
    assert!(rel_norm(&got.out.to_vec::<f32>().unwrap(), &oracle(&c).0) <= BF16_TOL);
    // The backward's two passes at D = 128 (a shorter batch).
    let c = Case::new(46, &[70, 17], 2, 1, 128, true).rounded_to_bf16();
    let got = run_all(&emu, &c, DType::BF16);
    let want = run_all(&Backend::Cpu, &c, DType::BF16);
    for i in 2..5 {
        assert!(
            got[i].iter().all(|x| x.is_finite()),
            "gradient {i}: every row written"
        );
        assert_bits_eq(
            &got[i],
            &want[i],
            &format!("D = 128 emu vs cpu gradient {i}"),
        );
    }
    let (_, odq, odk, odv) = oracle(&c);
    for (i, o) in [(2, odq), (3, odk), (4, odv)] {
        assert!(
            rel_norm(&got[i], &o) <= BF16_TOL,
            "gradient {i} vs the f64 oracle"
        );
    }
}

/// BF16 inputs with an F32 dout give the same bits as F32 inputs holding the same (bf16) values.
fn check_mixed_dout(be: &Backend) {
    let c = Case::new(51, &[1, 6, 33], 4, 2, 16, true).rounded_to_bf16();
    let [q, k, v, cu, _] = c.tensors(be, DType::BF16);
    let [q32, k32, v32, _, dout] = c.tensors(be, DType::F32);
    // The same saved forward for both (the bf16 forward takes the tiles, the f32 one v1).
    let f = attention_forward(be, &q, &k, &v, &cu, true, None).unwrap();
    let g =
        attention_backward_saved(be, &q, &k, &v, &cu, &f.out, &f.lse, &dout, true, None).unwrap();
    let w = attention_backward_saved(be, &q32, &k32, &v32, &cu, &f.out, &f.lse, &dout, true, None)
        .unwrap();
    for (a, b) in [(&g.dq, &w.dq), (&g.dk, &w.dk), (&g.dv, &w.dv)] {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        assert_bits_eq(&a, &b, &format!("{be:?} bf16 inputs with f32 dout"));
    }
}

#[test]
fn mixed_dout_dtype_cpu_and_emu() {
    check_mixed_dout(&Backend::Cpu);
    check_mixed_dout(&Backend::emu_with_seed(1));
}

#[test]
fn emu_matches_reference_and_seeds_agree() {
    check_device(&Backend::emu_with_seed(1), &Backend::emu_with_seed(2));
}

#[test]
fn emu_batch_invariant_bitwise() {
    check_batch_invariance(&Backend::emu_with_seed(1), DType::F32);
    check_batch_invariance(&Backend::emu_with_seed(2), DType::BF16);
}

#[test]
fn cuda_matches_reference_and_is_deterministic() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("attention cuda") {
        check_device(&gpu, &gpu);
        check_batch_invariance(&gpu, DType::BF16);
    }
}

#[test]
fn bad_inputs_are_errors_naming_the_tensor() {
    let cpu = Backend::Cpu;
    let f = |shape: &[usize], dtype: DType| {
        let n: usize = shape.iter().product();
        Tensor::from_f32_as(&cpu, shape, dtype, &vec![0.5; n]).unwrap()
    };
    let cu = |v: &[i32]| Tensor::from_slice(&cpu, &[v.len()], v).unwrap();
    let q = f(&[6, 4, 16], DType::F32);
    let k = f(&[6, 2, 16], DType::F32);
    let v = f(&[6, 2, 16], DType::F32);
    let good = cu(&[0, 2, 6]);
    let msg = |r: sluice_kernels::Result<_>| -> String {
        match r {
            Ok::<_, _>(()) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    };
    let fwd = |q: &Tensor, k: &Tensor, v: &Tensor, c: &Tensor, s: Option<f32>| {
        attention_forward(&cpu, q, k, v, c, true, s).map(|_| ())
    };
    assert!(fwd(&q, &k, &v, &good, None).is_ok());
    assert!(msg(fwd(&f(&[6, 64], DType::F32), &k, &v, &good, None)).contains("`q`"));
    assert!(msg(fwd(&q, &f(&[6, 2, 8], DType::F32), &v, &good, None)).contains("`k`"));
    assert!(msg(fwd(
        &q,
        &f(&[6, 3, 16], DType::F32),
        &f(&[6, 3, 16], DType::F32),
        &good,
        None
    ))
    .contains("`k`"));
    assert!(msg(fwd(&q, &k, &f(&[6, 1, 16], DType::F32), &good, None)).contains("`v`"));
    assert!(msg(fwd(&q, &f(&[6, 2, 16], DType::BF16), &v, &good, None)).contains("`k`"));
    assert!(msg(fwd(&q, &k, &v, &cu(&[0, 2, 5]), None)).contains("cu_seqlens"));
    assert!(msg(fwd(&q, &k, &v, &cu(&[0, 4, 2, 6]), None)).contains("cu_seqlens"));
    assert!(msg(fwd(&q, &k, &v, &cu(&[1, 6]), None)).contains("cu_seqlens"));
    assert!(msg(fwd(&q, &k, &v, &f(&[3], DType::F32), None)).contains("cu_seqlens"));
    assert!(msg(fwd(&q, &k, &v, &good, Some(f32::NAN))).contains("scale"));
    let big = f(&[2, 1, 300], DType::F32);
    assert!(msg(fwd(&big, &big, &big, &cu(&[0, 2]), None)).contains("`q`"));
    let bwd =
        |dout: &Tensor| attention_backward(&cpu, &q, &k, &v, &good, dout, true, None).map(|_| ());
    assert!(msg(bwd(&f(&[6, 4, 8], DType::F32))).contains("`dout`"));
    let bf = |t: &Tensor| t.cast(&cpu, DType::BF16).unwrap();
    let bwd_bf = |dout: &Tensor| {
        attention_backward(&cpu, &bf(&q), &bf(&k), &bf(&v), &good, dout, true, None).map(|_| ())
    };
    assert!(msg(bwd_bf(&cu(&[0; 384]).reshape(&[6, 4, 16]).unwrap())).contains("`dout`"));
    assert!(bwd_bf(&f(&[6, 4, 16], DType::F32)).is_ok());
    assert!(bwd(&f(&[6, 4, 16], DType::F32)).is_ok());
}
