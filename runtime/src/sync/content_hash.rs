//! The content hash of a weight image: blake3 over its bytes. The publisher records it with
//! every version, a delta names the hash of its base and of its result, and a receiver installs
//! bytes only after their hash matches (so wrong weights are never installed).

use std::fmt;

/// Inputs at least this long are hashed with blake3's rayon mode (same result, every core).
const PARALLEL_FROM: usize = 1 << 17;

/// blake3 of a byte image (32 bytes; printed as 64 hex digits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ContentHash(pub [u8; 32]);

impl ContentHash {
    /// The hash of `bytes`.
    pub fn of(bytes: &[u8]) -> ContentHash {
        let mut hasher = blake3::Hasher::new();
        if bytes.len() >= PARALLEL_FROM {
            hasher.update_rayon(bytes);
        } else {
            hasher.update(bytes);
        }
        ContentHash(*hasher.finalize().as_bytes())
    }

    /// The hash as 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 64 hex digits (either case).
    pub fn from_hex(text: &str) -> Option<ContentHash> {
        let text = text.as_bytes();
        if text.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (o, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
            let s = std::str::from_utf8(pair).ok()?;
            *o = u8::from_str_radix(s, 16).ok()?;
        }
        Some(ContentHash(out))
    }
}

impl fmt::Display for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentHash({})", self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_and_serial_hashing_agree_and_hex_round_trips() {
        let bytes: Vec<u8> = (0..PARALLEL_FROM * 3 + 17)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let serial = ContentHash(*blake3::hash(&bytes).as_bytes());
        assert_eq!(ContentHash::of(&bytes), serial);
        assert_eq!(ContentHash::from_hex(&serial.to_hex()), Some(serial));
        assert_eq!(ContentHash::from_hex("zz"), None);
        // blake3's published hash of the empty input.
        assert_eq!(
            ContentHash::of(&[]).to_hex(),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
    }
}
