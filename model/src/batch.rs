//! Packed variable-length batches: the forward's input (DESIGN.md section 3.5, varlen via
//! cu_seqlens).
//!
//! B sequences of lengths L_0 .. L_{B-1} are concatenated into one token row of T = sum L_b
//! tokens; `cu_seqlens` = [0, L_0, L_0 + L_1, ..., T] marks the boundaries, and each token's RoPE
//! position is its index within its own sequence. Nothing depends on where a sequence sits in
//! the pack, which is what makes a sequence's logits bit-identical whether packed alone or with
//! others.

use sluice_kernels::{Error, Result};

/// Token ids of B sequences packed into one row, with their boundaries and positions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedBatch {
    tokens: Vec<i32>,
    cu_seqlens: Vec<i32>,
    positions: Vec<i32>,
    max_seqlen: usize,
}

impl PackedBatch {
    /// Packs `sequences` (each non-empty; ids in `0..vocab`).
    pub fn pack<S: AsRef<[i32]>>(sequences: &[S], vocab: usize) -> Result<PackedBatch> {
        if sequences.is_empty() {
            return Err(Error::Invalid(
                "a packed batch needs at least one sequence; got none".into(),
            ));
        }
        let total: usize = sequences.iter().map(|s| s.as_ref().len()).sum();
        if total > i32::MAX as usize {
            return Err(Error::Invalid(format!(
                "a packed batch of {total} tokens exceeds the I32 offsets of cu_seqlens"
            )));
        }
        let mut tokens = Vec::with_capacity(total);
        let mut positions = Vec::with_capacity(total);
        let mut cu_seqlens = Vec::with_capacity(sequences.len() + 1);
        cu_seqlens.push(0);
        let mut max_seqlen = 0;
        for (b, seq) in sequences.iter().enumerate() {
            let seq = seq.as_ref();
            if seq.is_empty() {
                return Err(Error::Invalid(format!(
                    "sequence {b} of the batch is empty; every sequence needs at least one token"
                )));
            }
            if let Some((i, &t)) = seq
                .iter()
                .enumerate()
                .find(|(_, &t)| t < 0 || t as usize >= vocab)
            {
                return Err(Error::Invalid(format!(
                    "sequence {b}, position {i}: token id {t} is outside the vocabulary 0..{vocab}"
                )));
            }
            tokens.extend_from_slice(seq);
            positions.extend(0..seq.len() as i32);
            cu_seqlens.push(tokens.len() as i32);
            max_seqlen = max_seqlen.max(seq.len());
        }
        Ok(PackedBatch {
            tokens,
            cu_seqlens,
            positions,
            max_seqlen,
        })
    }

    /// All tokens, sequence after sequence: `[T]`.
    pub fn tokens(&self) -> &[i32] {
        &self.tokens
    }

    /// Sequence boundaries: `[B + 1]`, starting at 0 and ending at T.
    pub fn cu_seqlens(&self) -> &[i32] {
        &self.cu_seqlens
    }

    /// Each token's position within its own sequence (the RoPE position): `[T]`.
    pub fn positions(&self) -> &[i32] {
        &self.positions
    }

    /// Number of tokens T.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Always false: a batch holds at least one token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Number of sequences B.
    pub fn n_seqs(&self) -> usize {
        self.cu_seqlens.len() - 1
    }

    /// The longest sequence's length.
    pub fn max_seqlen(&self) -> usize {
        self.max_seqlen
    }

    /// The token range of sequence `b`.
    pub fn seq_range(&self, b: usize) -> std::ops::Range<usize> {
        self.cu_seqlens[b] as usize..self.cu_seqlens[b + 1] as usize
    }
}
