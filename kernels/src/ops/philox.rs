//! Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
//! SC 2011), the counter-based generator of the sampler. Mirrored exactly, operation for
//! operation, by `kernels/cuda/common/philox.cuh`: integer arithmetic only, so every device
//! produces the same bits.
//!
//! The sampler's stream layout (one 32-bit word per (row, vocabulary entry)):
//! key = (seed low 32 bits, seed high 32 bits);
//! counter = (vocab index / 4, position, request id low 32 bits, request id high 32 bits);
//! the word is output word `vocab index % 4`. A row's randomness therefore depends on its seed,
//! request id, position and vocabulary index only: never on the batch around it.

/// Multiplier of the first S-box lane (Salmon et al., table 2).
pub const PHILOX_M0: u32 = 0xD251_1F53;
/// Multiplier of the second S-box lane.
pub const PHILOX_M1: u32 = 0xCD9E_8D57;
/// Key schedule increments (golden ratio and sqrt(3) - 1, in 32 bits).
pub const PHILOX_W0: u32 = 0x9E37_79B9;
pub const PHILOX_W1: u32 = 0xBB67_AE85;

#[inline(always)]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

#[inline(always)]
fn round(c: [u32; 4], k: [u32; 2]) -> [u32; 4] {
    let (hi0, lo0) = mulhilo(PHILOX_M0, c[0]);
    let (hi1, lo1) = mulhilo(PHILOX_M1, c[2]);
    [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
}

/// Philox4x32 with 10 rounds: four 32-bit words from a 128-bit counter and a 64-bit key.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for r in 0..10 {
        if r > 0 {
            k = [k[0].wrapping_add(PHILOX_W0), k[1].wrapping_add(PHILOX_W1)];
        }
        c = round(c, k);
    }
    c
}

/// The sampler's key for a seed.
#[inline]
pub fn sampler_key(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

/// The sampler's counter for a group of four vocabulary entries of one (request, position).
#[inline]
pub fn sampler_counter(request_id: u64, position: i32, vocab_group: u32) -> [u32; 4] {
    [
        vocab_group,
        position as u32,
        request_id as u32,
        (request_id >> 32) as u32,
    ]
}

/// A 32-bit word as a uniform in the open interval (0, 1): its top 23 bits plus one half,
/// times 2^-23. Exact in f32 (at most 24 significant bits), never 0 or 1, so the Gumbel noise
/// below is always finite.
#[inline]
pub fn uniform_open(word: u32) -> f32 {
    ((word >> 9) as f32 + 0.5) * (1.0 / 8_388_608.0)
}

/// Gumbel noise -log(-log u) for u in (0, 1); finite: within [-2.8, 16.6].
#[inline]
pub fn gumbel(word: u32) -> f32 {
    -(-uniform_open(word).ln()).ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer vectors of the Random123 distribution (kat_vectors, philox4x32_10).
    #[test]
    fn known_answers() {
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn uniform_is_open() {
        assert!(uniform_open(0) > 0.0);
        assert!(uniform_open(u32::MAX) < 1.0);
        assert!(gumbel(0).is_finite() && gumbel(u32::MAX).is_finite());
    }
}
