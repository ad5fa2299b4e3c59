//! Forward properties: determinism and batch invariance (a sequence's logits are bit-identical
//! whether it is packed alone or with others, at any offset).

use sluice_model::config::ModelConfig;
use sluice_model::forward::{logits, loss_and_grad};
use sluice_model::kernels::testing::Rng;
use sluice_model::kernels::Backend;
use sluice_model::{Model, PackedBatch};

fn seqs(vocab: usize, lens: &[usize], seed: u64) -> Vec<Vec<i32>> {
    let mut rng = Rng::new(seed);
    lens.iter()
        .map(|&n| (0..n).map(|_| rng.below(vocab) as i32).collect())
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn forward_and_backward_are_deterministic() {
    let cfg = ModelConfig::tiny();
    let mut m = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    let b = PackedBatch::pack(&seqs(cfg.vocab, &[3, 17, 1], 1), cfg.vocab).unwrap();
    let targets: Vec<i32> = b.tokens().iter().map(|&x| (x + 1) % 11).collect();
    let mask = vec![1.0; b.len()];
    let l1 = loss_and_grad(&mut m, &b, &targets, &mask).unwrap();
    let g1 = bits(m.grads.as_slice().unwrap());
    let l2 = loss_and_grad(&mut m, &b, &targets, &mask).unwrap();
    assert_eq!(l1.to_bits(), l2.to_bits());
    assert_eq!(g1, bits(m.grads.as_slice().unwrap()));
    assert_eq!(
        bits(&logits(&m, &b).unwrap()),
        bits(&logits(&m, &b).unwrap())
    );
}

#[test]
fn a_sequences_logits_do_not_depend_on_its_batch() {
    for cfg in [ModelConfig::tiny(), {
        let mut s = ModelConfig::small();
        s.n_layers = 2;
        s
    }] {
        let m = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
        let all = seqs(cfg.vocab, &[5, 33, 1, 64, 17], 2);
        let target = &all[3];
        let alone = logits(&m, &PackedBatch::pack(&[target], cfg.vocab).unwrap()).unwrap();
        // The same sequence at offsets 0 and after others, with others after it.
        for order in [
            vec![3, 0, 1],
            vec![0, 1, 3],
            vec![4, 3, 2, 0],
            vec![1, 2, 4, 0, 3],
        ] {
            let packed: Vec<&Vec<i32>> = order.iter().map(|&i| &all[i]).collect();
            let b = PackedBatch::pack(&packed, cfg.vocab).unwrap();
            let l = logits(&m, &b).unwrap();
            let pos = order.iter().position(|&i| i == 3).unwrap();
            let r = b.seq_range(pos);
            assert_eq!(
                bits(&l[r.start * cfg.vocab..r.end * cfg.vocab]),
                bits(&alone),
                "order {order:?}"
            );
        }
    }
}
