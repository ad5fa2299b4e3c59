//! The parameter layout and arena: no overlaps, alignment, sizes, optimizer classes, init.

use sluice_model::config::ModelConfig;
use sluice_model::init;
use sluice_model::kernels::{Backend, DType};
use sluice_model::layout::{names, HeadAxis, InitRule, Layout, OptimClass, OptimKind, ALIGN};
use sluice_model::{Arena, Model};
use std::sync::Arc;

fn configs() -> Vec<ModelConfig> {
    let mut plain = ModelConfig::small();
    plain.n_layers = 2;
    let mut odd = ModelConfig::tiny();
    odd.vocab = 17;
    odd.d_model = 127;
    odd.n_kv_heads = 1;
    odd.expert_ffn_dim = 1;
    odd.dense_ffn_dim = Some(3);
    odd.validate().unwrap();
    vec![ModelConfig::small(), ModelConfig::tiny(), plain, odd]
}

#[test]
fn views_are_aligned_disjoint_and_fill_the_arena() {
    for cfg in configs() {
        let layout = Layout::new(&cfg).unwrap();
        let mut end = 0;
        for v in layout.views() {
            assert_eq!(v.offset % ALIGN, 0, "{} is not aligned", v.name);
            assert!(v.offset >= end, "{} overlaps the view before it", v.name);
            // Padding is less than one alignment unit: the layout is dense.
            assert!(v.offset - end < ALIGN, "{} leaves a gap", v.name);
            end = v.offset + v.numel();
        }
        assert_eq!(layout.len(), end.next_multiple_of(ALIGN));
        assert_eq!(layout.len() % ALIGN, 0);
        let sum: usize = layout.views().iter().map(|v| v.numel()).sum();
        assert_eq!(layout.param_count(), sum);
        assert!(layout.len() >= sum && layout.len() - sum < ALIGN * layout.views().len());
        // Names are unique and found by name.
        for (i, v) in layout.views().iter().enumerate() {
            assert_eq!(layout.index_of(&v.name).unwrap(), i);
        }
    }
}

#[test]
fn the_small_model_has_the_expected_views_and_size() {
    let cfg = ModelConfig::small();
    let layout = Layout::new(&cfg).unwrap();
    // embed + lm_head + final norm + per layer (2 norms, 4 attn, router, 3 expert stacks).
    assert_eq!(layout.views().len(), 3 + 4 * 10);
    let d = 128;
    let per_layer = 2 * d + 128 * d + 2 * (64 * d) + d * 128 + 8 * d + 3 * 8 * 256 * d;
    assert_eq!(layout.param_count(), 2 * 64 * d + d + 4 * per_layer);
    let v = layout.view("layers.3.moe.w2").unwrap();
    assert_eq!(v.shape, vec![8, 128, 256]);
    assert_eq!(layout.view(names::EMBED).unwrap().shape, vec![64, 128]);
    assert!(layout.view("layers.4.attn.wq").is_err());
    let e = layout.view("layers.0.attn.wz").unwrap_err().to_string();
    assert!(e.contains("layers.0.attn.wz"), "{e}");
}

#[test]
fn optimizer_classes_follow_the_design() {
    let cfg = ModelConfig::tiny();
    let layout = Layout::new(&cfg).unwrap();
    let class = |n: &str| layout.view(n).unwrap().class;
    let rows = |h| OptimClass::MuonPerHead {
        axis: HeadAxis::Rows,
        n_heads: h,
        head_dim: 4,
    };
    for l in 0..2 {
        let n = |s: &str| names::layer(l, s);
        assert_eq!(class(&n("attn.wq")), rows(4));
        assert_eq!(class(&n("attn.wk")), rows(2));
        assert_eq!(class(&n("attn.wv")), rows(2));
        assert_eq!(
            class(&n("attn.wo")),
            OptimClass::MuonPerHead {
                axis: HeadAxis::Cols,
                n_heads: 4,
                head_dim: 4
            }
        );
        assert_eq!(class(&n("attn_norm.scale")), OptimClass::AdamW);
        assert_eq!(class(&n("ffn_norm.scale")), OptimClass::AdamW);
    }
    // Layer 0 is dense (muon), layer 1 MoE (router adamw, experts per expert, shared muon).
    for w in ["w1", "w3", "w2"] {
        assert_eq!(
            class(&names::layer(0, &format!("ffn.{w}"))),
            OptimClass::Muon
        );
        assert_eq!(
            class(&names::layer(1, &format!("moe.{w}"))),
            OptimClass::MuonPerExpert { n_experts: 4 }
        );
        assert_eq!(
            class(&names::layer(1, &format!("moe.shared.{w}"))),
            OptimClass::Muon
        );
        assert!(layout.get(&names::layer(0, &format!("moe.{w}"))).is_none());
    }
    assert_eq!(class("layers.1.moe.router"), OptimClass::AdamW);
    for n in [names::EMBED, names::LM_HEAD, names::FINAL_NORM] {
        assert_eq!(class(n), OptimClass::AdamW);
    }
    assert_eq!(layout.view("layers.0.ffn.w2").unwrap().shape, vec![8, 10]);
    assert_eq!(
        layout.view("layers.1.moe.shared.w2").unwrap().shape,
        vec![8, 5]
    );
    // Every view is in exactly one class.
    let total: usize = [
        OptimKind::MuonPerHead,
        OptimKind::MuonPerExpert,
        OptimKind::Muon,
        OptimKind::AdamW,
    ]
    .iter()
    .map(|&k| layout.views_of(k).count())
    .sum();
    assert_eq!(total, layout.views().len());
    assert_eq!(layout.views_of(OptimKind::MuonPerHead).count(), 8);
}

#[test]
fn muon_blocks_cover_each_matrix_exactly_once() {
    for cfg in configs() {
        let layout = Layout::new(&cfg).unwrap();
        for v in layout.views() {
            let blocks = v.muon_blocks();
            if v.class == OptimClass::AdamW {
                assert!(blocks.is_empty());
                continue;
            }
            let mut hits = vec![0u8; layout.len()];
            for b in &blocks {
                for r in 0..b.rows {
                    for c in 0..b.cols {
                        hits[b.offset + r * b.row_stride + c] += 1;
                    }
                }
            }
            for (i, &h) in hits.iter().enumerate() {
                let inside = v.range().contains(&i);
                assert_eq!(h, inside as u8, "{}: element {i}", v.name);
            }
            let expected_blocks = match v.class {
                OptimClass::MuonPerHead { n_heads, .. } => n_heads,
                OptimClass::MuonPerExpert { n_experts } => n_experts,
                _ => 1,
            };
            assert_eq!(blocks.len(), expected_blocks, "{}", v.name);
        }
        // W_o's head blocks are column windows of width head_dim.
        let wo = layout.view("layers.0.attn.wo").unwrap();
        let b = wo.muon_blocks();
        assert_eq!((b[1].rows, b[1].cols), (cfg.d_model, cfg.head_dim));
        assert_eq!(b[1].offset, wo.offset + cfg.head_dim);
        assert_eq!(b[1].row_stride, cfg.q_dim());
    }
}

#[test]
fn init_follows_the_rules_and_is_deterministic() {
    let cfg = ModelConfig::small();
    let layout = Layout::new(&cfg).unwrap();
    let a = init::initial_values(&layout, 1, 0.02);
    let b = init::initial_values(&layout, 1, 0.02);
    let c = init::initial_values(&layout, 2, 0.02);
    assert_eq!(
        a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    let mut in_view = vec![false; layout.len()];
    for v in layout.views() {
        in_view[v.range()].iter_mut().for_each(|x| *x = true);
        let (va, vc) = (&a[v.range()], &c[v.range()]);
        match v.init {
            InitRule::Ones => {
                assert!(va.iter().all(|&x| x == 1.0), "{}", v.name);
                assert_eq!(va, vc);
            }
            InitRule::Normal { scale } => {
                let std = scale * 0.02;
                // Sample mean and std within 5 standard errors of the target.
                let n = va.len() as f64;
                let mean = va.iter().map(|&x| x as f64).sum::<f64>() / n;
                let var = va.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
                assert!(mean.abs() < 5.0 * std / n.sqrt(), "{}: mean {mean}", v.name);
                let rel = (var.sqrt() / std - 1.0).abs();
                assert!(
                    rel < 5.0 / (2.0 * n).sqrt() + 1e-3,
                    "{}: std {}",
                    v.name,
                    var.sqrt()
                );
                let differ = va.iter().zip(vc).filter(|(x, y)| x != y).count();
                assert!(differ as f64 > 0.99 * n, "{}: seeds 1 and 2 agree", v.name);
            }
        }
    }
    // Padding is zero.
    for (i, x) in a.iter().enumerate() {
        if !in_view[i] {
            assert_eq!(*x, 0.0, "padding element {i}");
        }
    }
    // Output projections are scaled by 1/sqrt(2 n_layers).
    let wo = layout.view("layers.0.attn.wo").unwrap().init;
    assert_eq!(
        wo,
        InitRule::Normal {
            scale: 1.0 / 8f64.sqrt()
        }
    );
    assert_eq!(layout.view("layers.0.moe.w2").unwrap().init, wo);
    assert_eq!(
        layout.view("layers.0.attn.wq").unwrap().init,
        InitRule::Normal { scale: 1.0 }
    );
}

#[test]
fn a_views_values_depend_only_on_seed_name_and_shape() {
    // Adding layers leaves the shared views' values unchanged.
    let mut two = ModelConfig::small();
    two.n_layers = 2;
    let four = ModelConfig::small();
    let (l2, l4) = (Layout::new(&two).unwrap(), Layout::new(&four).unwrap());
    let (a, b) = (
        init::initial_values(&l2, 5, 0.02),
        init::initial_values(&l4, 5, 0.02),
    );
    for name in ["embed.weight", "layers.1.moe.w1", "layers.0.attn.wq"] {
        let (va, vb) = (l2.view(name).unwrap(), l4.view(name).unwrap());
        assert_eq!(&a[va.range()], &b[vb.range()], "{name}");
    }
}

#[test]
fn model_arenas_on_cpu() {
    let backend = Backend::Cpu;
    let mut m = Model::new(ModelConfig::tiny(), &backend).unwrap();
    assert_eq!(m.params.dtype(), DType::F32);
    assert_eq!(m.params.as_slice().unwrap().len(), m.layout().len());
    assert!(m.grads.as_slice().unwrap().iter().all(|&x| x == 0.0));
    assert!(Arc::ptr_eq(m.params.layout(), m.grads.layout()));
    let want = init::initial_values(m.layout(), 0, 0.2);
    assert_eq!(m.params.as_slice().unwrap(), want.as_slice());
    // Views by name and by index agree; views_mut hands out every view, disjoint.
    let v = m.params.view("layers.1.moe.router").unwrap().to_vec();
    let i = m.layout().index_of("layers.1.moe.router").unwrap();
    assert_eq!(m.params.view_at(i).unwrap(), v.as_slice());
    m.grads.view_mut("lm_head.weight").unwrap().fill(3.0);
    {
        let n_views = m.layout().views().len();
        let views = m.grads.views_mut().unwrap();
        assert_eq!(views.len(), n_views);
        for (spec, slice) in views {
            assert_eq!(slice.len(), spec.numel());
            let want = if spec.name == "lm_head.weight" {
                3.0
            } else {
                0.0
            };
            assert!(slice.iter().all(|&x| x == want), "{}", spec.name);
            slice.fill(1.0);
        }
    }
    let total: f32 = m.grads.as_slice().unwrap().iter().sum();
    assert_eq!(total as usize, m.layout().param_count());
    m.grads.fill_zero(&backend).unwrap();
    assert!(m.grads.as_slice().unwrap().iter().all(|&x| x == 0.0));
    // copy_from (in-process weight sync) and the bf16 compute copy.
    let mut other = Arena::zeros(&backend, m.layout().clone(), DType::F32).unwrap();
    other.copy_from(&backend, &m.params).unwrap();
    assert_eq!(other.as_slice().unwrap(), m.params.as_slice().unwrap());
    let half = m.params.cast_copy(&backend, DType::BF16).unwrap();
    assert_eq!(half.dtype(), DType::BF16);
    let wide = half.to_vec().unwrap();
    for (w, p) in wide.iter().zip(m.params.as_slice().unwrap()) {
        assert!((w - p).abs() <= p.abs() * 2f32.powi(-8), "{w} vs {p}");
    }
    let i = m.layout().index_of("embed.weight").unwrap();
    assert_eq!(
        half.typed_view_at::<half::bf16>(i).unwrap().len(),
        m.layout().views()[i].numel()
    );
    // A bf16 arena has no f32 slice view: an error, not a panic.
    assert!(half.view("embed.weight").is_err());
    assert!(Arena::zeros(&backend, m.layout().clone(), DType::I32).is_err());
    assert!(Arena::from_f32(&backend, m.layout().clone(), &[0.0; 3]).is_err());
}
