//! Packed varlen batches: boundaries, positions, and bad input as errors.

use sluice_model::PackedBatch;

#[test]
fn packs_ragged_sequences() {
    let seqs: Vec<Vec<i32>> = vec![vec![1], vec![2, 3, 4], (0..17).map(|i| i % 11).collect()];
    let b = PackedBatch::pack(&seqs, 11).unwrap();
    assert_eq!(b.len(), 21);
    assert_eq!(b.n_seqs(), 3);
    assert_eq!(b.cu_seqlens(), &[0, 1, 4, 21]);
    assert_eq!(b.max_seqlen(), 17);
    assert_eq!(&b.positions()[..4], &[0, 0, 1, 2]);
    assert_eq!(b.positions()[20], 16);
    for (i, s) in seqs.iter().enumerate() {
        assert_eq!(&b.tokens()[b.seq_range(i)], s.as_slice());
    }
}

#[test]
fn bad_batches_are_errors() {
    let none: [Vec<i32>; 0] = [];
    assert!(PackedBatch::pack(&none, 5).is_err());
    let e = PackedBatch::pack(&[vec![1], vec![]], 5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sequence 1") && e.contains("empty"), "{e}");
    let e = PackedBatch::pack(&[vec![1, 5]], 5).unwrap_err().to_string();
    assert!(e.contains("token id 5") && e.contains("position 1"), "{e}");
    let e = PackedBatch::pack(&[vec![-1]], 5).unwrap_err().to_string();
    assert!(e.contains("-1"), "{e}");
}
