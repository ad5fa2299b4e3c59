//! bf16 mixed precision (docs/model.md, "Precision and rounding points"):
//! - the layer pieces on the cpu device (the references, rounding at the same points and
//!   summing in the kernels' orders) against the emulated CUDA kernels, piece by piece, bit for
//!   bit (DESIGN 2);
//! - the bf16 learner's loss and gradients against the f32 learner's, within a bound derived
//!   from bf16's unit roundoff, and against central finite differences;
//! - the compute copy: bf16 really rounds, is refreshed by the optimizer step, and training in
//!   bf16 lowers the loss.

use sluice_model::config::ModelConfig;
use sluice_model::forward::{logits, loss_and_grad, loss_of};
use sluice_model::gradcheck::check_views;
use sluice_model::kernels::testing::{rel_norm, Rng};
use sluice_model::kernels::{Backend, DType, Tensor};
use sluice_model::layers::{self, BatchTensors, Dims, FfnWeights, ModelWeights};
use sluice_model::optim::{OptimConfig, Optimizer};
use sluice_model::{Model, PackedBatch, Precision};

mod common;
use common::batch;

/// bf16's unit roundoff: round-to-nearest-even to 8 significant bits moves a value by at most
/// 2^-9 of itself.
const U_BF16: f64 = 1.0 / 512.0;

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

type Piece = (String, Vec<f32>);

/// Every layer piece of the bf16 model on `be`, on one input x and one upstream gradient dy for
/// every layer (so each piece is compared on identical inputs).
fn pieces(
    be: &Backend,
    cfg: &ModelConfig,
    x: &[f32],
    dy: &[f32],
    batch: &PackedBatch,
) -> Vec<Piece> {
    let mut m = Model::new(cfg.clone(), be).unwrap();
    m.set_precision(be, Precision::Bf16).unwrap();
    let w = ModelWeights::from_arena(be, m.compute_weights()).unwrap();
    let dims = Dims::new(cfg).unwrap();
    let (t, d) = (batch.len(), cfg.d_model);
    let bt = BatchTensors::upload(be, batch).unwrap();
    let xt = || Tensor::from_slice(be, &[t, d], x).unwrap();
    let dyt = || Tensor::from_slice(be, &[t, d], dy).unwrap();
    let f = |t: &Tensor| t.to_f32_vec().unwrap();
    let mut out: Vec<Piece> = Vec::new();
    let mut push = |name: String, v: Vec<f32>| out.push((name, v));
    for (l, lw) in w.layers.iter().enumerate() {
        let q = layers::qkv(be, &dims, &lw.attn, &xt(), &bt.positions).unwrap();
        assert_eq!(q.q.dtype(), DType::BF16, "q is a bf16 attention input");
        push(format!("L{l} qkv.h"), f(&q.h));
        push(format!("L{l} qkv.q"), f(&q.q));
        push(format!("L{l} qkv.k"), f(&q.k));
        push(format!("L{l} qkv.v"), f(&q.v));
        let (o, lse) = layers::attention(be, &dims, &q, &bt.cu_seqlens).unwrap();
        push(format!("L{l} attention"), f(&o));
        push(format!("L{l} attention.lse"), f(&lse));
        push(
            format!("L{l} attn_output"),
            f(&layers::attn_output(be, &lw.attn, &xt(), &o).unwrap()),
        );
        let (saved, x2) = layers::ffn_block(be, &dims, &lw.ffn_norm, &lw.ffn, xt()).unwrap();
        push(format!("L{l} ffn_block"), f(&x2));
        let (dx, dnorm, g) =
            layers::ffn_block_backward(be, &dims, &lw.ffn_norm, &lw.ffn, saved, dyt()).unwrap();
        push(format!("L{l} ffn_block_backward.dx"), f(&dx));
        push(format!("L{l} ffn_block_backward.dnorm"), f(&dnorm));
        match g {
            FfnWeights::Dense(s) => {
                for (n, v) in [("w1", &s.w1), ("w3", &s.w3), ("w2", &s.w2)] {
                    push(format!("L{l} dense.d{n}"), f(v));
                }
            }
            FfnWeights::Moe(mw) => {
                push(format!("L{l} moe.drouter"), f(&mw.router));
                for (n, v) in [("w1", &mw.w1), ("w3", &mw.w3), ("w2", &mw.w2)] {
                    push(format!("L{l} moe.d{n}"), f(v));
                }
                if let Some(s) = mw.shared {
                    for (n, v) in [("w1", &s.w1), ("w3", &s.w3), ("w2", &s.w2)] {
                        push(format!("L{l} shared.d{n}"), f(v));
                    }
                }
            }
        }
        let (saved, _) = layers::attn_block(be, &dims, &lw.attn, xt(), &bt).unwrap();
        let (dx, ga) = layers::attn_block_backward(be, &dims, &lw.attn, saved, dyt(), &bt).unwrap();
        push(format!("L{l} attn_block_backward.dx"), f(&dx));
        push(format!("L{l} attn_block_backward.dnorm"), f(&ga.norm));
        // The weight gradients: bf16 GEMMs of bf16 operands (the attention backward's dq, dk, dv
        // are bit-identical between the devices, the only inputs of dW_q/k/v besides h).
        for (n, v) in [
            ("wq", &ga.wq),
            ("wk", &ga.wk),
            ("wv", &ga.wv),
            ("wo", &ga.wo),
        ] {
            push(format!("L{l} attn_block_backward.d{n}"), f(v));
        }
    }
    let (hf, logits) = layers::head(be, &dims, &w.final_norm, &w.lm_head, &xt()).unwrap();
    push("head.hf".into(), f(&hf));
    push("head.logits".into(), f(&logits));
    out
}

/// The pieces [`pieces`] returns for `cfg`: 16 per layer (qkv 4, attention 2, attn_output,
/// ffn_block, its backward's dx and dnorm, the attention block backward's dx, dnorm and 4
/// weight gradients) plus the FFN's weight gradients, and the head's 2.
fn piece_count(cfg: &ModelConfig) -> usize {
    let ffn = |l: usize| match (l == 0 && cfg.dense_first_layer, cfg.shared_expert) {
        (true, _) => 3,
        (false, true) => 7,
        (false, false) => 4,
    };
    (0..cfg.n_layers).map(|l| 16 + ffn(l)).sum::<usize>() + 2
}

/// The cpu bf16 reference against the emulated kernels, every piece, bit for bit:
/// - the tiny config (every feature: dense first layer, MoE with a shared expert, GQA) with
///   ragged sequences of 1, 17 and 127 tokens;
/// - two layers of the small config's widths (K = 512 in the FFN's W2 and its weight gradients:
///   GEMM sums longer than the 256-long chunks of the f32 reference; 360 tokens, so the
///   router's weight gradient sums more rows than a chunk);
/// - a wide MoE layer (d_model 320: RMSNorm and router rows longer than the 256 lanes of the
///   block reduction and than one chunk; top-3 of 6 experts with sigmoid scores and no
///   renormalisation: the router backward's sum over 3 kept experts).
#[test]
fn cpu_and_emu_bf16_layer_pieces_agree() {
    let small2 = ModelConfig {
        n_layers: 2,
        ..ModelConfig::small()
    };
    let wide = ModelConfig {
        d_model: 320,
        n_layers: 1,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        n_experts: 6,
        top_k: 3,
        expert_ffn_dim: 24,
        dense_first_layer: false,
        dense_ffn_dim: None,
        shared_expert: false,
        shared_expert_ffn_dim: None,
        score_fn: sluice_model::config::ScoreFn::Sigmoid,
        renorm: false,
        ..ModelConfig::tiny()
    };
    for (name, cfg, lens) in [
        ("tiny", ModelConfig::tiny(), vec![1usize, 17, 127]),
        ("small2", small2, vec![17, 40, 3, 300]),
        ("wide", wide, vec![5, 60]),
    ] {
        let (b, _, _) = batch(&cfg, &lens, 3);
        let mut rng = Rng::new(4);
        let t = b.len();
        let x: Vec<f32> = (0..t * cfg.d_model).map(|_| rng.normal() as f32).collect();
        let dy: Vec<f32> = (0..t * cfg.d_model)
            .map(|_| rng.normal() as f32 * 0.01)
            .collect();
        let c = pieces(&Backend::Cpu, &cfg, &x, &dy, &b);
        let e = pieces(&Backend::emu_with_seed(1), &cfg, &x, &dy, &b);
        assert_eq!(c.len(), piece_count(&cfg), "{name}: pieces compared");
        assert_eq!(e.len(), c.len());
        for ((n, a), (_, g)) in c.iter().zip(&e) {
            assert!(!a.is_empty(), "{name} {n}: an empty piece");
            let same = a
                .iter()
                .zip(g)
                .filter(|(p, q)| p.to_bits() == q.to_bits())
                .count();
            assert_eq!(
                same,
                a.len(),
                "{name} {n}: cpu and emu bits differ (rel {:.2e})",
                rel_norm(g, &f64s(a))
            );
        }
    }
}

/// The whole bf16 forward (embedding, every layer, the head) gives the same logits bits on cpu
/// and emu, for the tiny and the small config, from the same master weights (the models are
/// built on each device from the same seed).
#[test]
fn cpu_and_emu_bf16_logits_are_bit_identical() {
    for (name, cfg, lens) in [
        ("tiny", ModelConfig::tiny(), vec![1usize, 17, 40]),
        ("small", ModelConfig::small(), vec![9, 30]),
    ] {
        let (b, _, _) = batch(&cfg, &lens, 8);
        let on = |be: Backend| {
            let mut m = Model::new(cfg.clone(), &be).unwrap();
            m.set_precision(&be, Precision::Bf16).unwrap();
            logits(&m, &b).unwrap()
        };
        let (c, e) = (on(Backend::Cpu), on(Backend::emu_with_seed(2)));
        assert_eq!(c.len(), b.len() * cfg.vocab, "{name}: logits [T,V]");
        assert_eq!(bits(&c), bits(&e), "{name}: cpu and emu bf16 logits differ");
    }
}

/// Rounding points a gradient element passes through in the tiny model, counted from
/// docs/model.md's table: per layer in the forward the weights and inputs of the q/k/v, W_o,
/// W1/W3 and W2 GEMMs and q/k/v after RoPE (8), in the backward the output gradient at each of
/// those GEMMs (4), and the head (3): 2 * 12 + 3 = 27.
const ROUNDINGS: f64 = 27.0;

/// The bf16 learner against the f32 learner on one batch: the loss, and every view's gradient.
/// Bound: to first order each rounding perturbs the values it touches by at most u = 2^-9
/// relative, and the perturbations of the ~27 rounding points on a gradient's path add, so the
/// gradient moves by at most 27 u = 5.3e-2 of itself (relative norm per view; the loss
/// likewise, as a relative error). Views whose gradient is near zero at init (the attention
/// projections W_q and W_k, attention being almost uniform) have their error measured against
/// the model's whole gradient norm instead (a relative error of a vanishing quantity is not a
/// precision statement). Measured: loss 1.4e-3, worst view well inside (printed).
#[test]
fn bf16_loss_and_gradients_are_within_the_bf16_bound_of_f32() {
    let cfg = ModelConfig::tiny();
    let (b, targets, mask) = batch(&cfg, &[1, 6, 9, 17], 7);
    let mut f = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    let mut h = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    h.set_precision(&Backend::Cpu, Precision::Bf16).unwrap();
    let lf = loss_and_grad(&mut f, &b, &targets, &mask).unwrap();
    let lh = loss_and_grad(&mut h, &b, &targets, &mask).unwrap();
    let bound = ROUNDINGS * U_BF16;
    let loss_err = ((lh - lf) / lf).abs() as f64;
    println!("loss f32 {lf} bf16 {lh}: rel {loss_err:.2e} (bound {bound:.2e})");
    assert!(loss_err <= bound);
    assert_ne!(
        lf.to_bits(),
        lh.to_bits(),
        "bf16 computed the f32 loss: nothing rounded"
    );
    let (gf, gh) = (f.grads.to_vec().unwrap(), h.grads.to_vec().unwrap());
    let total = gf.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
    let mut worst = 0.0f64;
    for spec in f.layout().views() {
        let r = spec.range();
        let (a, w) = (&gh[r.clone()], &gf[r]);
        let diff = a
            .iter()
            .zip(w)
            .map(|(&p, &q)| (p as f64 - q as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm = w.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        let err = diff / norm.max(total * 1e-2);
        println!("{:32} rel {err:.2e}", spec.name);
        worst = worst.max(err);
        assert!(err <= bound, "{}: rel {err:e} > {bound:e}", spec.name);
    }
    println!("worst view {worst:.2e} (bound {bound:.2e})");
}

/// The bf16 gradient against central finite differences of the loss. The bf16 loss itself is a
/// step function of the master weights (a change smaller than half a bf16 step of a weight
/// changes nothing), so the differences are taken of the f32 loss, the function mixed precision
/// approximates: the tolerance is the f32 finite-difference check's (3e-2, model/tests/
/// grad_model.rs) plus the bf16 bound of the test above (27 u = 5.3e-2).
#[test]
fn bf16_gradient_matches_finite_differences() {
    let cfg = ModelConfig::tiny();
    let (b, targets, mask) = batch(&cfg, &[1, 6, 9], 7);
    let mut m = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    m.set_precision(&Backend::Cpu, Precision::Bf16).unwrap();
    let loss = loss_and_grad(&mut m, &b, &targets, &mask).unwrap();
    assert!(loss.is_finite() && loss > 0.0);
    let tol = 3e-2 + ROUNDINGS * U_BF16;
    let checks = check_views(
        &mut m.params,
        &m.grads,
        |a| Ok(loss_of(&cfg, a, &b, &targets, &mask)? as f64),
        8,
        1e-2,
        1e-4,
        3,
    )
    .unwrap();
    let mut worst = 0.0f64;
    for c in &checks {
        println!("{:32} rel_err {:.2e}", c.name, c.rel_err);
        worst = worst.max(c.rel_err);
        assert!(c.rel_err < tol, "{}: rel err {:.3e}", c.name, c.rel_err);
    }
    println!("worst {worst:.2e} (tolerance {tol:.2e})");
}

/// The compute copy holds the master weights rounded to nearest even; logits differ from f32's
/// (something rounds) and are deterministic; the optimizer step refreshes the copy; a few SGD-like
/// optimizer steps in bf16 lower the loss; f32 drops the copy.
#[test]
fn compute_copy_rounds_refreshes_and_trains() {
    let be = Backend::Cpu;
    let cfg = ModelConfig::tiny();
    let (b, targets, mask) = batch(&cfg, &[5, 9, 17], 11);
    let mut m = Model::new(cfg.clone(), &be).unwrap();
    let f32_logits = logits(&m, &b).unwrap();
    m.set_precision(&be, Precision::Bf16).unwrap();
    assert_eq!(m.precision(), Precision::Bf16);
    let rounded = |m: &Model| -> Vec<f32> {
        m.params
            .to_vec()
            .unwrap()
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect()
    };
    let copy = m.compute.as_ref().unwrap();
    assert_eq!(copy.dtype(), DType::BF16);
    assert_eq!(bits(&copy.to_vec().unwrap()), bits(&rounded(&m)));
    let l1 = logits(&m, &b).unwrap();
    assert_ne!(bits(&l1), bits(&f32_logits), "bf16 logits equal f32's");
    assert_eq!(
        bits(&l1),
        bits(&logits(&m, &b).unwrap()),
        "bf16 is not deterministic"
    );
    let opt = Optimizer::new(&be, m.layout().clone(), OptimConfig::default()).unwrap();
    let mut state = opt.new_state(&be).unwrap();
    let first = loss_and_grad(&mut m, &b, &targets, &mask).unwrap();
    let mut last = first;
    for _ in 0..5 {
        last = loss_and_grad(&mut m, &b, &targets, &mask).unwrap();
        opt.step(&be, &mut m.params, &m.grads, &mut state, m.compute.as_mut())
            .unwrap();
        let copy = m.compute.as_ref().unwrap();
        assert_eq!(
            bits(&copy.to_vec().unwrap()),
            bits(&rounded(&m)),
            "copy not refreshed"
        );
    }
    let after = loss_and_grad(&mut m, &b, &targets, &mask).unwrap();
    println!("bf16 loss {first} -> {last} -> {after}");
    assert!(
        after < first,
        "bf16 training did not lower the loss: {first} -> {after}"
    );
    m.set_precision(&be, Precision::F32).unwrap();
    assert!(m.compute.is_none() && m.precision() == Precision::F32);
}
