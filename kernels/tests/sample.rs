//! sample: greedy and argmax cases, top-k / top-p sets, chi-square goodness of fit, batch
//! invariance, the shared log-prob (bit-identical to is_gate_loss's logp), emu and cuda against
//! the reference, determinism, bad input.

// Rows are compared index by index against several parallel arrays.
#![allow(clippy::needless_range_loop)]

use half::bf16;
use sluice_kernels::ops::is_gate_loss::{is_gate_loss, GateParams, TokenBatch};
use sluice_kernels::ops::sample::{sample, sample_reference, SampleParams};
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

struct Batch {
    b: usize,
    v: usize,
    logits: Vec<f32>,
    ids: Vec<u64>,
    pos: Vec<i32>,
}

impl Batch {
    fn random(seed: u64, b: usize, v: usize, scale: f32) -> Batch {
        let mut rng = Rng::new(seed);
        Batch {
            b,
            v,
            logits: rng.normal_vec(b * v, scale),
            ids: (0..b).map(|_| rng.next_u64()).collect(),
            pos: (0..b).map(|_| rng.below(100_000) as i32).collect(),
        }
    }
    fn rows(&self, idx: &[usize]) -> Batch {
        Batch {
            b: idx.len(),
            v: self.v,
            logits: idx
                .iter()
                .flat_map(|&r| self.logits[r * self.v..(r + 1) * self.v].iter().cloned())
                .collect(),
            ids: idx.iter().map(|&r| self.ids[r]).collect(),
            pos: idx.iter().map(|&r| self.pos[r]).collect(),
        }
    }
    fn run(&self, be: &Backend, dtype: DType, p: &SampleParams) -> (Vec<i32>, Vec<f32>) {
        let logits = Tensor::from_f32_as(be, &[self.b, self.v], dtype, &self.logits).unwrap();
        let ids = Tensor::from_slice(be, &[self.b], &self.ids).unwrap();
        let pos = Tensor::from_slice(be, &[self.b], &self.pos).unwrap();
        let (t, l) = sample(be, &logits, &ids, &pos, p).expect("sample runs");
        (t.to_vec().unwrap(), l.to_vec().unwrap())
    }
    fn reference(&self, p: &SampleParams) -> (Vec<i32>, Vec<f32>) {
        sample_reference(&self.logits, self.b, self.v, &self.ids, &self.pos, p).unwrap()
    }
}

fn log_softmax64(row: &[f32], t: f64) -> Vec<f64> {
    let z: Vec<f64> = row.iter().map(|&x| x as f64 / t).collect();
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let l = m + z.iter().map(|&x| (x - m).exp()).sum::<f64>().ln();
    z.iter().map(|&x| x - l).collect()
}

fn argmax_lower(row: &[f32]) -> usize {
    let mut best = 0;
    for (j, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = j;
        }
    }
    best
}

fn sp(seed: u64, temperature: f32, top_k: usize, top_p: f32) -> SampleParams {
    SampleParams {
        seed,
        temperature,
        top_k,
        top_p,
    }
}

fn bits(r: &(Vec<i32>, Vec<f32>)) -> (Vec<i32>, Vec<u32>) {
    (r.0.clone(), r.1.iter().map(|x| x.to_bits()).collect())
}

#[test]
fn greedy_is_argmax_with_lower_index_ties_and_logprob_at_t1() {
    let mut bt = Batch::random(1, 17, 127, 1.5);
    // Ties: row 0 has its max at 5 and 90; row 1 is constant.
    bt.logits[5] = 9.0;
    bt.logits[90] = 9.0;
    for j in 0..127 {
        bt.logits[127 + j] = 0.5;
    }
    let (tok, lp) = bt.reference(&sp(3, 0.0, 0, 1.0));
    for r in 0..bt.b {
        let row = &bt.logits[r * 127..(r + 1) * 127];
        assert_eq!(tok[r] as usize, argmax_lower(row), "row {r}");
    }
    assert_eq!((tok[0], tok[1]), (5, 0));
    let want: Vec<f64> = (0..bt.b)
        .map(|r| log_softmax64(&bt.logits[r * 127..(r + 1) * 127], 1.0)[tok[r] as usize])
        .collect();
    assert!(rel_norm(&lp, &want) <= F32_TOL);
}

#[test]
fn top_k_1_and_tiny_top_p_give_the_argmax() {
    let bt = Batch::random(2, 64, 300, 2.0);
    for p in [
        sp(9, 1.0, 1, 1.0),
        sp(9, 0.7, 0, 1e-6),
        sp(9, 1.3, 0, 0.0),
        sp(9, 1.0, 40, 0.0),
    ] {
        let (tok, _) = bt.reference(&p);
        for r in 0..bt.b {
            assert_eq!(
                tok[r] as usize,
                argmax_lower(&bt.logits[r * 300..(r + 1) * 300]),
                "{p:?}"
            );
        }
    }
}

/// The top-k / top-p set of a row in f64: sorted by (value desc, index asc).
fn kept_set(row: &[f32], t: f64, k: usize, top_p: f64) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
    if k > 0 {
        idx.truncate(k);
    }
    let lp = log_softmax64(row, t);
    let total: f64 = idx.iter().map(|&j| lp[j].exp()).sum();
    let mut acc = 0.0;
    let mut out = vec![];
    for &j in &idx {
        out.push(j);
        acc += lp[j].exp();
        if acc >= top_p * total {
            break;
        }
    }
    out
}

#[test]
fn sampled_tokens_stay_inside_the_top_k_top_p_set() {
    let v = 50;
    for (k, top_p, t) in [
        (5usize, 1.0f32, 1.0f32),
        (0, 0.5, 1.0),
        (8, 0.7, 0.8),
        (0, 0.9, 1.5),
    ] {
        let mut bt = Batch::random(5, 200, v, 1.0);
        // One row repeated at many positions: the samples cover the set.
        for r in 1..bt.b {
            let (head, tail) = bt.logits.split_at_mut(r * v);
            tail[..v].copy_from_slice(&head[..v]);
            bt.pos[r] = r as i32;
        }
        let set = kept_set(&bt.logits[..v], t as f64, k, top_p as f64);
        let (tok, _) = bt.reference(&sp(11, t, k, top_p));
        let mut seen = std::collections::BTreeSet::new();
        for &x in &tok {
            assert!(
                set.contains(&(x as usize)),
                "k={k} p={top_p}: {x} outside {set:?}"
            );
            seen.insert(x);
        }
        assert!(seen.len() > 1, "more than one token sampled from {set:?}");
    }
}

/// Pearson chi-square of counts against probabilities.
fn chi_square(counts: &[u64], probs: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| {
            let e = p * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

#[test]
fn chi_square_goodness_of_fit() {
    // Critical values of chi-square at p = 1e-4 for 4 and 2 degrees of freedom.
    const CRIT_4: f64 = 23.51;
    const CRIT_2: f64 = 18.42;
    let row = [0.3f32, -1.0, 1.2, 0.0, 0.7];
    let n = 20_000;
    for (t, k, crit) in [(1.0f32, 0usize, CRIT_4), (0.6, 0, CRIT_4), (1.0, 3, CRIT_2)] {
        let bt = Batch {
            b: n,
            v: 5,
            logits: row.iter().cycle().take(5 * n).cloned().collect(),
            ids: vec![77; n],
            pos: (0..n as i32).collect(),
        };
        let (tok, _) = bt.reference(&sp(2024, t, k, 1.0));
        let mut counts = [0u64; 5];
        for &x in &tok {
            counts[x as usize] += 1;
        }
        let lp = log_softmax64(&row, t as f64);
        let mut probs: Vec<f64> = lp.iter().map(|x| x.exp()).collect();
        let (counts, probs): (Vec<u64>, Vec<f64>) = if k > 0 {
            let keep = kept_set(&row, t as f64, k, 1.0);
            let s: f64 = keep.iter().map(|&j| probs[j]).sum();
            for (j, p) in probs.iter_mut().enumerate() {
                if !keep.contains(&j) {
                    assert_eq!(counts[j], 0, "token {j} is outside the top-{k}");
                }
                *p /= s;
            }
            keep.iter().map(|&j| (counts[j], probs[j])).unzip()
        } else {
            (counts.to_vec(), probs)
        };
        let chi = chi_square(&counts, &probs);
        assert!(
            chi < crit,
            "T={t} k={k}: chi-square {chi} >= {crit} (counts {counts:?})"
        );
    }
}

#[test]
fn logprob_follows_the_temperature() {
    let bt = Batch::random(8, 17, 127, 2.0);
    for t in [0.5f32, 1.0, 2.0] {
        let (tok, lp) = bt.reference(&sp(1, t, 0, 1.0));
        let want: Vec<f64> = (0..bt.b)
            .map(|r| log_softmax64(&bt.logits[r * 127..(r + 1) * 127], t as f64)[tok[r] as usize])
            .collect();
        assert!(rel_norm(&lp, &want) <= F32_TOL, "T={t}");
    }
}

fn check_batch_invariance(be: &Backend, p: &SampleParams, v: usize) {
    let bt = Batch::random(12, 64, v, 1.5);
    let full = bits(&bt.run(be, DType::F32, p));
    // 7 rows in a shuffled order, and every row alone at batch size 1.
    let pick = [40usize, 3, 63, 17, 0, 28, 9];
    let part = bits(&bt.rows(&pick).run(be, DType::F32, p));
    for (i, &r) in pick.iter().enumerate() {
        assert_eq!(
            (part.0[i], part.1[i]),
            (full.0[r], full.1[r]),
            "row {r} in a batch of 7"
        );
    }
    for r in [0usize, 31, 63] {
        let one = bits(&bt.rows(&[r]).run(be, DType::F32, p));
        assert_eq!(
            (one.0[0], one.1[0]),
            (full.0[r], full.1[r]),
            "row {r} alone"
        );
    }
}

#[test]
fn batch_invariance_on_cpu() {
    for p in [sp(5, 1.0, 0, 1.0), sp(5, 0.8, 10, 0.9), sp(5, 0.0, 0, 1.0)] {
        check_batch_invariance(&Backend::Cpu, &p, 300);
    }
}

#[test]
fn batch_invariance_on_emu() {
    check_batch_invariance(&Backend::emu_with_seed(1), &sp(5, 1.0, 0, 1.0), 300);
    // V = 2050: a row's alignment (and so its load path) changes with its place in the batch.
    check_batch_invariance(&Backend::emu_with_seed(1), &sp(5, 1.0, 0, 1.0), 2050);
}

/// The sampler's log-prob equals is_gate_loss's logp bit for bit for the same rows.
fn check_shared_logprob(be: &Backend, dtype: DType) {
    for v in [300, 4104, 2050] {
        check_shared_logprob_v(be, dtype, v);
    }
}

fn check_shared_logprob_v(be: &Backend, dtype: DType, v: usize) {
    let mut bt = Batch::random(13, 5, v, 2.0);
    bt.logits[7] = f32::NEG_INFINITY;
    for p in [
        sp(21, 1.0, 0, 1.0),
        sp(21, 0.0, 0, 1.0),
        sp(21, 1.0, 20, 0.8),
    ] {
        let (tok, lp) = bt.run(be, dtype, &p);
        let logits = Tensor::from_f32_as(be, &[bt.b, bt.v], dtype, &bt.logits).unwrap();
        let t = Tensor::from_slice(be, &[bt.b], &tok).unwrap();
        let zeros = Tensor::from_slice(be, &[bt.b], &vec![0.0f32; bt.b]).unwrap();
        let ones = Tensor::from_slice(be, &[bt.b], &vec![1.0f32; bt.b]).unwrap();
        let batch = TokenBatch {
            tokens: &t,
            behavior_logp: &zeros,
            advantages: &ones,
            mask: &ones,
            weight: None,
            ref_logp: None,
        };
        let (out, _) = is_gate_loss(be, &logits, &batch, &GateParams::default()).unwrap();
        let logp: Vec<f32> = out.logp.to_vec().unwrap();
        let a: Vec<u32> = lp.iter().map(|x| x.to_bits()).collect();
        let b: Vec<u32> = logp.iter().map(|x| x.to_bits()).collect();
        assert_eq!(
            a,
            b,
            "{:?} {dtype} {p:?}: sampler logprob == loss logp",
            be.device()
        );
    }
}

#[test]
fn sampler_logprob_is_loss_logp_bit_for_bit_on_cpu() {
    check_shared_logprob(&Backend::Cpu, DType::F32);
    check_shared_logprob(&Backend::Cpu, DType::BF16);
}

#[test]
fn sampler_logprob_is_loss_logp_bit_for_bit_on_emu() {
    check_shared_logprob(&Backend::emu_with_seed(1), DType::F32);
    check_shared_logprob(&Backend::emu_with_seed(2), DType::BF16);
}

fn device_params() -> Vec<SampleParams> {
    vec![
        sp(1, 1.0, 0, 1.0),
        sp(2, 0.0, 0, 1.0),
        sp(3, 0.7, 5, 1.0),
        sp(4, 1.2, 0, 0.6),
        sp(5, 1.0, 12, 0.9),
    ]
}

fn check_device(be: &Backend, name: &str) {
    for (b, v, dtype) in [
        (7usize, 300usize, DType::F32),
        (1, 1000, DType::F32),
        (5, 257, DType::BF16),
        // Full 2048-entry tiles (16-byte loads) and tails; 2050 misaligns odd f32 rows.
        (2, 4104, DType::F32),
        (3, 2050, DType::F32),
        (2, 4104, DType::BF16),
    ] {
        let mut bt = Batch::random(30 + v as u64, b, v, 2.0);
        if dtype == DType::BF16 {
            for x in &mut bt.logits {
                *x = bf16::from_f32(*x).to_f32();
            }
        }
        for p in device_params() {
            let want = bt.reference(&p);
            let got = bt.run(be, dtype, &p);
            let ctx = format!("{name} {dtype} b={b} v={v} {p:?}");
            assert_eq!(got.0, want.0, "{ctx}: tokens");
            let w: Vec<f64> = want.1.iter().map(|&x| x as f64).collect();
            assert!(rel_norm(&got.1, &w) <= F32_TOL, "{ctx}: logprobs");
            assert_eq!(
                bits(&got),
                bits(&bt.run(be, dtype, &p)),
                "{ctx}: rerun bit-identical"
            );
        }
    }
}

#[test]
fn emu_matches_reference_and_two_seeds_agree() {
    check_device(&Backend::emu_with_seed(1), "emu");
    let bt = Batch::random(40, 7, 300, 2.0);
    for p in device_params() {
        let a = bits(&bt.run(&Backend::emu_with_seed(1), DType::F32, &p));
        let b = bits(&bt.run(&Backend::emu_with_seed(2), DType::F32, &p));
        assert_eq!(a, b, "{p:?}: emu seeds 1 and 2 bit-identical");
    }
}

#[test]
fn cuda_matches_reference() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("sample") {
        check_device(&gpu, "cuda");
        check_shared_logprob(&gpu, DType::F32);
        check_shared_logprob(&gpu, DType::BF16);
        check_batch_invariance(&gpu, &sp(5, 1.0, 0, 1.0), 1000);
    }
}

#[test]
fn cpu_reruns_are_bit_identical() {
    let bt = Batch::random(50, 9, 500, 2.0);
    for p in device_params() {
        assert_eq!(
            bits(&bt.run(&Backend::Cpu, DType::F32, &p)),
            bits(&bt.run(&Backend::Cpu, DType::F32, &p))
        );
    }
}

#[test]
fn neg_inf_entries_and_empty_rows() {
    let mut bt = Batch::random(60, 3, 40, 1.0);
    for j in 0..40 {
        if j % 2 == 0 {
            bt.logits[j] = f32::NEG_INFINITY;
        }
        bt.logits[40 + j] = if j == 33 { 1e4 } else { -1e4 };
        bt.logits[80 + j] = f32::NEG_INFINITY;
    }
    for p in device_params() {
        let (tok, lp) = bt.reference(&p);
        assert_eq!(tok[0] % 2, 1, "{p:?}: a -inf entry is never sampled");
        assert!(lp[0].is_finite());
        assert_eq!((tok[1], lp[1]), (33, 0.0), "{p:?}: +-1e4 row");
        assert_eq!(tok[2], 0, "no-mass row samples token 0");
        assert_eq!(lp[2], f32::NEG_INFINITY, "with log-prob -inf, not NaN");
    }
    let emu = Backend::emu_with_seed(1);
    for p in device_params() {
        let (got, want) = (bt.run(&emu, DType::F32, &p), bt.reference(&p));
        assert_eq!(got.0, want.0, "{p:?}: tokens");
        assert_eq!(got.1[2], f32::NEG_INFINITY, "{p:?}");
        // Devices agree to f32 tolerance (the CPU's exponential is not the device's expf).
        let w: Vec<f64> = want.1[..2].iter().map(|&x| x as f64).collect();
        assert!(rel_norm(&got.1[..2], &w) <= F32_TOL, "{p:?}");
    }
}

#[test]
fn bad_input_is_an_error_naming_it() {
    let be = Backend::Cpu;
    let logits = Tensor::from_slice(&be, &[2, 3], &[0.0f32; 6]).unwrap();
    let ids = Tensor::from_slice(&be, &[2], &[1u64, 2]).unwrap();
    let pos = Tensor::from_slice(&be, &[2], &[0i32, 1]).unwrap();
    let p = SampleParams::default();
    let short = Tensor::from_slice(&be, &[1], &[1u64]).unwrap();
    match sample(&be, &logits, &short, &pos, &p) {
        Err(Error::Shape {
            tensor, expected, ..
        }) => {
            assert_eq!(tensor, "request_ids");
            assert!(expected.contains("B = 2"));
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
    let ids32 = Tensor::from_slice(&be, &[2], &[1i32, 2]).unwrap();
    assert!(matches!(
        sample(&be, &logits, &ids32, &pos, &p),
        Err(Error::DType { .. })
    ));
    let flat = Tensor::from_slice(&be, &[6], &[0.0f32; 6]).unwrap();
    assert!(matches!(
        sample(&be, &flat, &ids, &pos, &p),
        Err(Error::Shape { .. })
    ));
    for bad in [
        sp(0, -1.0, 0, 1.0),
        sp(0, f32::NAN, 0, 1.0),
        sp(0, 1.0, 0, 1.5),
    ] {
        assert!(matches!(
            sample(&be, &logits, &ids, &pos, &bad),
            Err(Error::Param { .. })
        ));
    }
    let wide = Tensor::zeros(&be, &[1, (1 << 18) + 1], DType::F32).unwrap();
    let one_id = Tensor::from_slice(&be, &[1], &[1u64]).unwrap();
    let one_pos = Tensor::from_slice(&be, &[1], &[0i32]).unwrap();
    assert!(matches!(
        sample(&be, &wide, &one_id, &one_pos, &p),
        Err(Error::Shape { .. })
    ));
}

#[test]
fn tokens_equal_an_unpruned_gumbel_argmax() {
    use sluice_kernels::ops::philox::gumbel;
    use sluice_kernels::ops::sample::noise_word;
    // Spread logits (many entries far below the max are pruned) and a flat batch.
    for (scale, t) in [(8.0f32, 1.0f32), (0.5, 0.7)] {
        let bt = Batch::random(70, 9, 777, scale);
        let p = sp(99, t, 0, 1.0);
        let (tok, _) = bt.reference(&p);
        let emu = bt.run(&Backend::emu_with_seed(1), DType::F32, &p);
        for r in 0..bt.b {
            let row = &bt.logits[r * bt.v..(r + 1) * bt.v];
            let mut best = (f32::NEG_INFINITY, 0usize);
            for (j, &x) in row.iter().enumerate() {
                let s = x * (1.0 / t) + gumbel(noise_word(p.seed, bt.ids[r], bt.pos[r], j));
                if s > best.0 {
                    best = (s, j);
                }
            }
            assert_eq!(tok[r] as usize, best.1, "row {r}: cpu");
            assert_eq!(emu.0[r] as usize, best.1, "row {r}: emu");
        }
    }
}
