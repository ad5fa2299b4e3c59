//! Small stable 64-bit hashes: the same value on every machine, build and run (unlike std's
//! randomly keyed `HashMap` hasher), so prefix-cache keys and routing decisions are reproducible.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 64 over `bytes`, starting from `seed` mixed into the offset basis.
pub fn fnv1a64(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = FNV_OFFSET ^ mix64(seed);
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// SplitMix64's finalizer: a bijection on u64 whose every output bit depends on every input bit.
/// Applied after FNV-1a, whose low bits mix poorly on short inputs.
pub fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hash of a string key with a seed: FNV-1a then the SplitMix finalizer.
pub fn hash_str(seed: u64, s: &str) -> u64 {
    mix64(fnv1a64(seed, s.as_bytes()))
}

/// Chained hash of a block of token ids: covers the parent block's hash and every token, so two
/// blocks hash alike only if their whole prefixes (with overwhelming probability) agree.
pub fn hash_block(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = FNV_OFFSET ^ mix64(parent);
    for &t in tokens {
        for b in t.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(FNV_PRIME);
        }
    }
    mix64(h ^ tokens.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_are_stable() {
        // FNV-1a 64 of "a" with the plain offset basis is the published test vector; our seeded
        // variant with seed s uses basis OFFSET ^ mix64(s), so check the unseeded core directly.
        let mut h = FNV_OFFSET;
        h ^= b'a' as u64;
        h = h.wrapping_mul(FNV_PRIME);
        assert_eq!(h, 0xaf63_dc4c_8601_ec8c);
        assert_eq!(hash_str(1, "s-1"), hash_str(1, "s-1"));
        assert_ne!(hash_str(1, "s-1"), hash_str(2, "s-1"));
        assert_ne!(hash_block(0, &[1, 2]), hash_block(0, &[2, 1]));
        assert_ne!(hash_block(0, &[1, 2]), hash_block(1, &[1, 2]));
    }
}
