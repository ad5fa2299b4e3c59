//! Paged KV cache: kv_append, and paged_attention against an f64 oracle and, bit for bit,
//! against the training forward (the same query over the same keys) on cpu, emu and cuda.

use sluice_kernels::ops::attention::attention_forward;
use sluice_kernels::ops::attention_tile::RowOrder;
use sluice_kernels::ops::paged_attention::{
    kv_append, paged_attention, paged_attention_reference, paged_prefill, PagedDims,
};
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Tensor};

/// A batch of sequences: packed K/V/Q as for training, and a paged cache layout for them.
struct Batch {
    lens: Vec<usize>,
    h: usize,
    hkv: usize,
    d: usize,
    bs: usize,
    mb: usize,
    nb: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    table: Vec<i32>,
    slots: Vec<i32>,
}

impl Batch {
    fn new(
        seed: u64,
        lens: &[usize],
        h: usize,
        hkv: usize,
        d: usize,
        bs: usize,
        dtype: DType,
    ) -> Batch {
        let mut rng = Rng::new(seed);
        let t: usize = lens.iter().sum();
        let round = |x: Vec<f32>| -> Vec<f32> {
            if dtype == DType::BF16 {
                x.iter()
                    .map(|&a| half::bf16::from_f32(a).to_f32())
                    .collect()
            } else {
                x
            }
        };
        let mb = lens
            .iter()
            .map(|l| l.div_ceil(bs))
            .max()
            .unwrap_or(1)
            .max(1)
            + 1;
        let nb = lens.len() * mb + 2;
        // Blocks handed out in a shuffled order, so neighbouring keys live in far-apart blocks.
        let mut perm: Vec<i32> = (0..nb as i32).collect();
        for i in (1..nb).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        let mut table = vec![-1i32; lens.len() * mb];
        let mut next = 0;
        let mut slots = Vec::new();
        for (b, &l) in lens.iter().enumerate() {
            for i in 0..l.div_ceil(bs) {
                table[b * mb + i] = perm[next];
                next += 1;
            }
            for j in 0..l {
                slots.push(table[b * mb + j / bs] * bs as i32 + (j % bs) as i32);
            }
        }
        Batch {
            lens: lens.to_vec(),
            h,
            hkv,
            d,
            bs,
            mb,
            nb,
            q: round(rng.normal_vec(t * h * d, 1.0)),
            k: round(rng.normal_vec(t * hkv * d, 1.0)),
            v: round(rng.normal_vec(t * hkv * d, 1.0)),
            table,
            slots,
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
    /// The query of each sequence's last token (zeros for an empty sequence): [B,H,D].
    fn last_queries(&self) -> Vec<f32> {
        let hd = self.h * self.d;
        let cu = self.cu();
        let mut out = vec![0.0; self.lens.len() * hd];
        for b in 0..self.lens.len() {
            if self.lens[b] > 0 {
                let t = cu[b + 1] as usize - 1;
                out[b * hd..(b + 1) * hd].copy_from_slice(&self.q[t * hd..(t + 1) * hd]);
            }
        }
        out
    }
    fn ctx(&self) -> Vec<i32> {
        self.lens.iter().map(|&l| l as i32).collect()
    }
    /// The caches filled through kv_append on `be` (poisoned first: unused slots stay NaN).
    fn caches(&self, be: &Backend, dtype: DType) -> (Tensor, Tensor) {
        let shape = [self.nb, self.bs, self.hkv, self.d];
        let mut kc = Tensor::poisoned(be, &shape, dtype).unwrap();
        let mut vc = Tensor::poisoned(be, &shape, dtype).unwrap();
        let t = self.t();
        let kn = Tensor::from_f32_as(be, &[t, self.hkv, self.d], dtype, &self.k).unwrap();
        let vn = Tensor::from_f32_as(be, &[t, self.hkv, self.d], dtype, &self.v).unwrap();
        let sm = Tensor::from_slice(be, &[t], &self.slots).unwrap();
        kv_append(be, &kn, &vn, &sm, &mut kc, &mut vc).unwrap();
        (kc, vc)
    }
    fn decode(&self, be: &Backend, dtype: DType) -> Vec<f32> {
        let (kc, vc) = self.caches(be, dtype);
        let b = self.lens.len();
        let q = Tensor::from_f32_as(be, &[b, self.h, self.d], dtype, &self.last_queries()).unwrap();
        let bt = Tensor::from_slice(be, &[b, self.mb], &self.table).unwrap();
        let cl = Tensor::from_slice(be, &[b], &self.ctx()).unwrap();
        paged_attention(be, &q, &kc, &vc, &bt, &cl, None)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    }
    /// attention_forward (causal) on `be`, the rows of each sequence's last token.
    fn training_last_rows(&self, be: &Backend, dtype: DType) -> Vec<f32> {
        let t = self.t();
        let q = Tensor::from_f32_as(be, &[t, self.h, self.d], dtype, &self.q).unwrap();
        let k = Tensor::from_f32_as(be, &[t, self.hkv, self.d], dtype, &self.k).unwrap();
        let v = Tensor::from_f32_as(be, &[t, self.hkv, self.d], dtype, &self.v).unwrap();
        let cu = Tensor::from_slice(be, &[self.lens.len() + 1], &self.cu()).unwrap();
        let out = attention_forward(be, &q, &k, &v, &cu, true, None)
            .unwrap()
            .out
            .to_vec::<f32>()
            .unwrap();
        let hd = self.h * self.d;
        let cu = self.cu();
        let mut rows = vec![0.0; self.lens.len() * hd];
        for b in 0..self.lens.len() {
            if self.lens[b] > 0 {
                let t = cu[b + 1] as usize - 1;
                rows[b * hd..(b + 1) * hd].copy_from_slice(&out[t * hd..(t + 1) * hd]);
            }
        }
        rows
    }
    /// Naive f64 softmax attention of each sequence's last query over all its keys.
    fn oracle(&self) -> Vec<f64> {
        let (h, hkv, d) = (self.h, self.hkv, self.d);
        let cu = self.cu();
        let q = self.last_queries();
        let mut out = vec![0.0; self.lens.len() * h * d];
        let scale = 1.0 / (d as f64).sqrt();
        for b in 0..self.lens.len() {
            let (s0, s1) = (cu[b] as usize, cu[b + 1] as usize);
            for head in 0..h {
                let g = head / (h / hkv);
                let qi = (b * h + head) * d;
                let s: Vec<f64> = (s0..s1)
                    .map(|j| {
                        (0..d)
                            .map(|x| q[qi + x] as f64 * self.k[(j * hkv + g) * d + x] as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|a| (a - mx).exp()).sum();
                for (n, j) in (s0..s1).enumerate() {
                    let p = (s[n] - mx).exp() / z;
                    for x in 0..d {
                        out[qi + x] += p * self.v[(j * hkv + g) * d + x] as f64;
                    }
                }
            }
        }
        out
    }
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

#[test]
fn reference_matches_f64_oracle() {
    for (seed, h, hkv, d, bs) in [(1u64, 4, 1, 16, 16), (2, 2, 2, 32, 5), (3, 4, 2, 24, 64)] {
        let bt = Batch::new(seed, &[1, 17, 33, 127], h, hkv, d, bs, DType::F32);
        let got = bt.decode(&Backend::Cpu, DType::F32);
        let err = rel_norm(&got, &bt.oracle());
        assert!(err <= F32_TOL, "h {h} hkv {hkv} d {d} bs {bs}: {err}");
    }
}

#[test]
fn reference_function_directly() {
    let bt = Batch::new(4, &[9, 40], 2, 1, 16, 16, DType::F32);
    // The caches built by hand (not through kv_append).
    let row = bt.hkv * bt.d;
    let mut kc = vec![f32::NAN; bt.nb * bt.bs * row];
    let mut vc = kc.clone();
    for (t, &s) in bt.slots.iter().enumerate() {
        kc[s as usize * row..(s as usize + 1) * row].copy_from_slice(&bt.k[t * row..(t + 1) * row]);
        vc[s as usize * row..(s as usize + 1) * row].copy_from_slice(&bt.v[t * row..(t + 1) * row]);
    }
    let dims = PagedDims {
        b: 2,
        h: 2,
        hkv: 1,
        d: 16,
        nb: bt.nb,
        bs: bt.bs,
        mb: bt.mb,
    };
    let mut out = vec![f32::NAN; 2 * 2 * 16];
    paged_attention_reference(
        &bt.last_queries(),
        &kc,
        &vc,
        &bt.table,
        &bt.ctx(),
        dims,
        0.25,
        RowOrder::Chunks,
        &mut out,
    )
    .unwrap();
    assert!(rel_norm(&out, &bt.oracle()) <= F32_TOL);
}

/// The decode of each sequence's last query equals the training forward's last row, bit for bit.
fn check_bit_identity(be: &Backend) {
    for dtype in [DType::F32, DType::BF16] {
        for (seed, h, hkv, d, bs) in [(11u64, 4, 1, 16, 16), (12, 2, 2, 32, 5), (13, 4, 2, 16, 64)]
        {
            let bt = Batch::new(seed, &[1, 6, 33], h, hkv, d, bs, dtype);
            let decode = bt.decode(be, dtype);
            let train = bt.training_last_rows(be, dtype);
            assert_bits_eq(
                &decode,
                &train,
                &format!("{be:?} {dtype} h {h} hkv {hkv} d {d} bs {bs}"),
            );
        }
    }
}

#[test]
fn cpu_decode_bit_identical_to_training_forward() {
    check_bit_identity(&Backend::Cpu);
}

#[test]
fn emu_decode_bit_identical_to_training_forward() {
    check_bit_identity(&Backend::emu_with_seed(1));
}

/// The bits contract of the tile path at the edges of a query tile: one 128-token sequence; the
/// decode of the query at position p over a context of p + 1 keys equals the training forward's
/// row p, for p at the start, inside and at the ends of warps and key tiles (0, 1, 31, 32, 63, 64,
/// 127), with a GQA group of 8 heads in the decode's m16 tile.
fn check_decode_positions(be: &Backend, dtype: DType) {
    let (h, hkv, d, bs) = (8, 1, 16, 16);
    let bt = Batch::new(61, &[128], h, hkv, d, bs, dtype);
    let train = {
        let q = Tensor::from_f32_as(be, &[128, h, d], dtype, &bt.q).unwrap();
        let k = Tensor::from_f32_as(be, &[128, hkv, d], dtype, &bt.k).unwrap();
        let v = Tensor::from_f32_as(be, &[128, hkv, d], dtype, &bt.v).unwrap();
        let cu = Tensor::from_slice(be, &[2], &[0i32, 128]).unwrap();
        attention_forward(be, &q, &k, &v, &cu, true, None)
            .unwrap()
            .out
            .to_vec::<f32>()
            .unwrap()
    };
    let (kc, vc) = bt.caches(be, dtype);
    let positions = [0usize, 1, 31, 32, 63, 64, 127];
    // One decode batch: sequence i is the same cache rows with context positions[i] + 1.
    let n = positions.len();
    let hd = h * d;
    let mut q = Vec::new();
    let mut table = Vec::new();
    for &p in &positions {
        q.extend_from_slice(&bt.q[p * hd..(p + 1) * hd]);
        table.extend_from_slice(&bt.table[..bt.mb]);
    }
    let ctx: Vec<i32> = positions.iter().map(|&p| p as i32 + 1).collect();
    let qt = Tensor::from_f32_as(be, &[n, h, d], dtype, &q).unwrap();
    let tb = Tensor::from_slice(be, &[n, bt.mb], &table).unwrap();
    let cl = Tensor::from_slice(be, &[n], &ctx).unwrap();
    let got = paged_attention(be, &qt, &kc, &vc, &tb, &cl, None)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    for (i, &p) in positions.iter().enumerate() {
        assert_bits_eq(
            &got[i * hd..(i + 1) * hd],
            &train[p * hd..(p + 1) * hd],
            &format!("{be:?} {dtype} decode at position {p} vs training row {p}"),
        );
    }
}

#[test]
fn cpu_decode_equals_training_at_tile_edges() {
    check_decode_positions(&Backend::Cpu, DType::BF16);
    check_decode_positions(&Backend::Cpu, DType::F32);
}

#[test]
fn emu_decode_equals_training_at_tile_edges() {
    check_decode_positions(&Backend::emu_with_seed(1), DType::BF16);
}

fn check_device(be1: &Backend, be2: &Backend) {
    for dtype in [DType::F32, DType::BF16] {
        let bt = Batch::new(21, &[1, 17, 0, 40], 4, 1, 32, 16, dtype);
        let want = bt.decode(&Backend::Cpu, dtype);
        let got1 = bt.decode(be1, dtype);
        let got2 = bt.decode(be2, dtype);
        let want64: Vec<f64> = want.iter().map(|&a| a as f64).collect();
        // Same f32 arithmetic on the same values; only exp/log may differ by an ulp.
        assert!(rel_norm(&got1, &want64) <= F32_TOL, "{be1:?} {dtype}");
        assert_bits_eq(&got1, &got2, &format!("{be1:?} vs {be2:?} {dtype}"));
        // The empty context (sequence 2) gives zeros.
        assert!(got1[2 * 4 * 32..3 * 4 * 32].iter().all(|&x| x == 0.0));
    }
}

/// Chunked prefill of each sequence's last `n_new[b]` tokens over the cache (holding the whole
/// sequence) equals attention_forward's rows for those tokens, bit for bit; and the f64 oracle.
fn check_prefill(be: &Backend) {
    for dtype in [DType::F32, DType::BF16] {
        for (seed, h, hkv, d, bs) in [(31u64, 4, 1, 16, 16), (32, 2, 2, 32, 5)] {
            let bt = Batch::new(seed, &[1, 6, 33], h, hkv, d, bs, dtype);
            let n_new = [1usize, 6, 20];
            let (kc, vc) = bt.caches(be, dtype);
            let hd = h * d;
            let cu_full = bt.cu();
            let mut q_new = Vec::new();
            let mut rows = Vec::new();
            let mut cu_new = vec![0i32];
            for (b, &n) in n_new.iter().enumerate() {
                let end = cu_full[b + 1] as usize;
                for tok in end - n..end {
                    q_new.extend_from_slice(&bt.q[tok * hd..(tok + 1) * hd]);
                    rows.push(tok);
                }
                cu_new.push(cu_new[b] + n as i32);
            }
            let t = rows.len();
            let q = Tensor::from_f32_as(be, &[t, h, d], dtype, &q_new).unwrap();
            let tb = Tensor::from_slice(be, &[3, bt.mb], &bt.table).unwrap();
            let cu = Tensor::from_slice(be, &[4], &cu_new).unwrap();
            let cl = Tensor::from_slice(be, &[3], &bt.ctx()).unwrap();
            let got = paged_prefill(be, &q, &kc, &vc, &tb, &cu, &cl, None)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            // attention_forward over the whole batch, the rows of the new tokens.
            let tt = bt.t();
            let fq = Tensor::from_f32_as(be, &[tt, h, d], dtype, &bt.q).unwrap();
            let fk = Tensor::from_f32_as(be, &[tt, hkv, d], dtype, &bt.k).unwrap();
            let fv = Tensor::from_f32_as(be, &[tt, hkv, d], dtype, &bt.v).unwrap();
            let fcu = Tensor::from_slice(be, &[4], &cu_full).unwrap();
            let full = attention_forward(be, &fq, &fk, &fv, &fcu, true, None)
                .unwrap()
                .out
                .to_vec::<f32>()
                .unwrap();
            let want: Vec<f32> = rows
                .iter()
                .flat_map(|&tok| full[tok * hd..(tok + 1) * hd].to_vec())
                .collect();
            assert_bits_eq(
                &got,
                &want,
                &format!("{be:?} {dtype} prefill h {h} hkv {hkv} bs {bs}"),
            );
        }
    }
}

#[test]
fn cpu_prefill_bit_identical_to_training_forward() {
    check_prefill(&Backend::Cpu);
}

#[test]
fn emu_prefill_bit_identical_to_training_forward() {
    check_prefill(&Backend::emu_with_seed(1));
    check_prefill(&Backend::emu_with_seed(2));
}

#[test]
fn prefill_rejects_more_new_tokens_than_context() {
    let cpu = Backend::Cpu;
    let q = Tensor::from_slice(&cpu, &[3, 2, 8], &[0.5f32; 48]).unwrap();
    let kc = Tensor::from_slice(&cpu, &[2, 4, 1, 8], &[0.5f32; 64]).unwrap();
    let tb = Tensor::from_slice(&cpu, &[1, 2], &[0i32, 1]).unwrap();
    let cu = Tensor::from_slice(&cpu, &[2], &[0i32, 3]).unwrap();
    let ok = Tensor::from_slice(&cpu, &[1], &[5i32]).unwrap();
    let short = Tensor::from_slice(&cpu, &[1], &[2i32]).unwrap();
    assert!(paged_prefill(&cpu, &q, &kc, &kc, &tb, &cu, &ok, None).is_ok());
    let e = paged_prefill(&cpu, &q, &kc, &kc, &tb, &cu, &short, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("context_lens"), "{e}");
    let bad_cu = Tensor::from_slice(&cpu, &[2], &[0i32, 4]).unwrap();
    let e = paged_prefill(&cpu, &q, &kc, &kc, &tb, &bad_cu, &ok, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cu_seqlens"), "{e}");
}

#[test]
fn emu_matches_reference_and_seeds_agree() {
    check_device(&Backend::emu_with_seed(1), &Backend::emu_with_seed(2));
}

#[test]
fn cuda_matches_reference_bit_identical_and_deterministic() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("paged_attention cuda") {
        check_device(&gpu, &gpu);
        check_bit_identity(&gpu);
        check_decode_positions(&gpu, DType::BF16);
    }
}

fn check_kv_append(be: Backend) {
    {
        for dtype in [DType::F32, DType::BF16] {
            let shape = [3, 4, 2, 8];
            let mut kc = Tensor::zeros(&be, &shape, dtype).unwrap();
            let mut vc = Tensor::zeros(&be, &shape, dtype).unwrap();
            let mut rng = Rng::new(5);
            let kn: Vec<f32> = rng.normal_vec(3 * 16, 1.0);
            let vn: Vec<f32> = rng.normal_vec(3 * 16, 1.0);
            let slots = [7i32, -1, 0];
            let k = Tensor::from_f32_as(&be, &[3, 2, 8], dtype, &kn).unwrap();
            let v = Tensor::from_f32_as(&be, &[3, 2, 8], dtype, &vn).unwrap();
            let sm = Tensor::from_slice(&be, &[3], &slots).unwrap();
            kv_append(&be, &k, &v, &sm, &mut kc, &mut vc).unwrap();
            let (kc, vc) = (kc.to_f32_vec().unwrap(), vc.to_f32_vec().unwrap());
            let r = |x: f32| {
                if dtype == DType::BF16 {
                    half::bf16::from_f32(x).to_f32()
                } else {
                    x
                }
            };
            for slot in 0..12 {
                let src = match slot {
                    7 => Some(0),
                    0 => Some(2),
                    _ => None,
                };
                for x in 0..16 {
                    let (wk, wv) = match src {
                        Some(t) => (r(kn[t * 16 + x]), r(vn[t * 16 + x])),
                        None => (0.0, 0.0),
                    };
                    assert_eq!(kc[slot * 16 + x], wk, "{be:?} {dtype} slot {slot}");
                    assert_eq!(vc[slot * 16 + x], wv, "{be:?} {dtype} slot {slot}");
                }
            }
        }
    }
}

#[test]
fn cpu_kv_append_writes_slots_and_skips_padding() {
    check_kv_append(Backend::Cpu);
}

#[test]
fn emu_kv_append_writes_slots_and_skips_padding() {
    check_kv_append(Backend::emu_with_seed(1));
}

#[test]
fn bad_inputs_are_errors_naming_the_tensor() {
    let cpu = Backend::Cpu;
    let f = |shape: &[usize], dtype: DType| {
        let n: usize = shape.iter().product();
        Tensor::from_f32_as(&cpu, shape, dtype, &vec![0.5; n]).unwrap()
    };
    let i = |shape: &[usize], v: &[i32]| Tensor::from_slice(&cpu, shape, v).unwrap();
    let q = f(&[2, 4, 16], DType::F32);
    let kc = f(&[4, 16, 2, 16], DType::F32);
    let bt = i(&[2, 2], &[0, 1, 2, -1]);
    let cl = i(&[2], &[20, 16]);
    let run = |q: &Tensor, kc: &Tensor, vc: &Tensor, bt: &Tensor, cl: &Tensor| -> String {
        match paged_attention(&cpu, q, kc, vc, bt, cl, None) {
            Ok(_) => "ok".into(),
            Err(e) => e.to_string(),
        }
    };
    assert_eq!(run(&q, &kc, &kc, &bt, &cl), "ok");
    assert!(run(&f(&[2, 64], DType::F32), &kc, &kc, &bt, &cl).contains("`q`"));
    assert!(run(&q, &f(&[4, 16, 2, 8], DType::F32), &kc, &bt, &cl).contains("`k_cache`"));
    assert!(run(
        &q,
        &f(&[4, 16, 3, 16], DType::F32),
        &f(&[4, 16, 3, 16], DType::F32),
        &bt,
        &cl
    )
    .contains("`k_cache`"));
    assert!(run(&q, &kc, &f(&[4, 8, 2, 16], DType::F32), &bt, &cl).contains("`v_cache`"));
    assert!(run(&q, &kc, &f(&[4, 16, 2, 16], DType::BF16), &bt, &cl).contains("`v_cache`"));
    assert!(run(&q, &kc, &kc, &i(&[3, 2], &[0; 6]), &cl).contains("`block_table`"));
    assert!(run(&q, &kc, &kc, &i(&[2, 2], &[0, 9, 2, 3]), &cl).contains("`block_table`"));
    assert!(run(&q, &kc, &kc, &bt, &i(&[2], &[33, 1])).contains("`context_lens`"));
    assert!(run(&q, &kc, &kc, &bt, &i(&[2], &[-1, 1])).contains("`context_lens`"));
    assert!(run(&q, &kc, &kc, &bt, &i(&[3], &[1, 1, 1])).contains("`context_lens`"));

    let mut k2 = f(&[4, 16, 2, 16], DType::F32);
    let mut v2 = f(&[4, 16, 2, 16], DType::F32);
    let kn = f(&[2, 2, 16], DType::F32);
    let mut app = |kn: &Tensor, sm: &Tensor| -> String {
        match kv_append(&cpu, kn, kn, sm, &mut k2, &mut v2) {
            Ok(()) => "ok".into(),
            Err(e) => e.to_string(),
        }
    };
    assert_eq!(app(&kn, &i(&[2], &[3, 63])), "ok");
    assert!(app(&kn, &i(&[2], &[3, 64])).contains("`slot_mapping`"));
    assert!(app(&kn, &i(&[2], &[5, 5])).contains("`slot_mapping`"));
    assert!(app(&kn, &i(&[3], &[1, 2, 3])).contains("`slot_mapping`"));
    assert!(app(&f(&[2, 2, 8], DType::F32), &i(&[2], &[1, 2])).contains("`k_new`"));
    assert!(app(&f(&[2, 2, 16], DType::BF16), &i(&[2], &[1, 2])).contains("`k_new`"));
}
