//! The finite-difference checker itself, on a loss whose gradient is known in closed form.

use sluice_model::config::ModelConfig;
use sluice_model::gradcheck::check_views;
use sluice_model::kernels::Backend;
use sluice_model::Model;

/// L = sum_i c_i * p_i^2 / 2 + sin(p_i), with c_i = 1 + (i mod 7) / 7: dL/dp_i = c_i p_i + cos(p_i).
fn loss(p: &[f32]) -> f64 {
    p.iter()
        .enumerate()
        .map(|(i, &x)| {
            let x = x as f64;
            (1.0 + (i % 7) as f64 / 7.0) * x * x / 2.0 + x.sin()
        })
        .sum()
}

fn grad(p: &[f32]) -> Vec<f32> {
    p.iter()
        .enumerate()
        .map(|(i, &x)| ((1.0 + (i % 7) as f64 / 7.0) * x as f64 + (x as f64).cos()) as f32)
        .collect()
}

#[test]
fn accepts_a_right_gradient_and_catches_a_wrong_one() {
    let mut m = Model::new(ModelConfig::tiny(), &Backend::Cpu).unwrap();
    let before: Vec<u32> = m
        .params
        .as_slice()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    m.grads
        .as_mut_slice()
        .unwrap()
        .copy_from_slice(&grad(m.params.as_slice().unwrap()));
    let checks = check_views(
        &mut m.params,
        &m.grads,
        |a| Ok(loss(a.as_slice()?)),
        6,
        1e-2,
        1e-3,
        1,
    )
    .unwrap();
    assert_eq!(checks.len(), m.layout().views().len());
    for c in &checks {
        // The loss sums ~10^4 f32 terms in f64: the central difference is exact to O(eps^2)
        // for this smooth loss (third derivative bounded by 1), so 1e-3 is generous.
        assert!(c.rel_err < 1e-3, "{}: {}", c.name, c.rel_err);
        assert!(c.indices.contains(&0));
    }
    let after: Vec<u32> = m
        .params
        .as_slice()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert_eq!(
        before, after,
        "gradcheck must restore every perturbed element"
    );

    // Break one view's gradient: only that view fails.
    let wk = m.layout().view("layers.1.attn.wk").unwrap().range();
    m.grads.as_mut_slice().unwrap()[wk]
        .iter_mut()
        .for_each(|g| *g *= 1.1);
    let checks = check_views(
        &mut m.params,
        &m.grads,
        |a| Ok(loss(a.as_slice()?)),
        6,
        1e-2,
        1e-3,
        1,
    )
    .unwrap();
    for c in &checks {
        let bad = c.name == "layers.1.attn.wk";
        assert_eq!(c.rel_err > 0.05, bad, "{}: {}", c.name, c.rel_err);
    }
}
