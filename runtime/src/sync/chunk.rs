//! One chunk of a weight delta: the candidate encodings, their exact sizes, and how each is
//! written and applied.
//!
//! A chunk is a byte range of the image (the receiver's `base` and the publisher's `new`, same
//! length). The encodings, in the order that breaks ties (cheapest to apply first):
//!
//! | encoding | payload | size for `n` changed bytes |
//! |---|---|---|
//! | `same` | nothing: the chunk did not change | 0 (only when n = 0) |
//! | `raw` | the chunk's new bytes | chunk length |
//! | `pos32` | per changed byte: its position in the chunk (u32 LE), its new value (u8) | 5 n |
//! | `gap16` | per changed byte: the gap since the previous one (u16 LE), its new value; a gap of 65535 or more is preceded by one `0xFFFF` escape per 65535 skipped | 3 n + 2 escapes |
//! | `zstd_xor` | one zstd frame of `base XOR new`, its bytes regrouped by significance (byte-plane shuffle) for elements wider than a byte | measured by compressing |
//!
//! `pos32` is DESIGN's "int32 absolute positions" (unsigned: positions are never negative);
//! positions count from the chunk's start, so a chunk decodes on its own.
//!
//! Why XOR rather than the new bytes under zstd: the XOR is zero wherever nothing changed, so
//! zstd sees long zero runs for sparse updates; for dense small updates of floats, the
//! sign/exponent byte and the high mantissa bytes mostly do not change, and the byte-plane
//! shuffle puts those zero bytes next to each other (a plane of 0x00 compresses to almost
//! nothing). zstd of the new bytes ignores what the receiver already holds: it is a compressed
//! full sync, which loses to the XOR except when the new weights are themselves simpler than
//! the change (a reset to zeros), a case the raw fallback bounds anyway.
//!
//! The choice is exact: the sizes of `same`, `raw`, `pos32` and `gap16` are computed from one
//! scan of the chunk (changed bytes, escapes), zstd's by compressing (with its full worst-case
//! output buffer), and the smallest wins, ties going to the encoding earlier in the table. The
//! chosen payload is therefore never larger than any candidate's (runtime/tests/delta.rs
//! encodes every candidate of every chunk to check this).

use super::delta::DeltaError;

/// The largest gap a `gap16` record holds; a longer gap is preceded by escapes.
const GAP_ESCAPE: u16 = u16::MAX;

/// How one chunk is encoded (the byte stored in the delta's chunk table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Encoding {
    Same,
    Raw,
    Positions32,
    Gaps16,
    ZstdXor,
}

impl Encoding {
    /// Every encoding, in tie-breaking order (cheapest to apply first).
    pub const ALL: [Encoding; 5] = [
        Encoding::Same,
        Encoding::Raw,
        Encoding::Positions32,
        Encoding::Gaps16,
        Encoding::ZstdXor,
    ];

    /// The byte stored in the chunk table.
    pub fn code(self) -> u8 {
        match self {
            Encoding::Same => 0,
            Encoding::Raw => 1,
            Encoding::Positions32 => 2,
            Encoding::Gaps16 => 3,
            Encoding::ZstdXor => 4,
        }
    }

    pub fn from_code(code: u8) -> Option<Encoding> {
        Encoding::ALL.into_iter().find(|e| e.code() == code)
    }

    /// The name printed by `sluice delta inspect` and in `sync_encoding`.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::Same => "same",
            Encoding::Raw => "raw",
            Encoding::Positions32 => "pos32",
            Encoding::Gaps16 => "gap16",
            Encoding::ZstdXor => "zstd_xor",
        }
    }

    /// Index into [`Encoding::ALL`].
    pub fn index(self) -> usize {
        self.code() as usize
    }
}

/// The element type of the image: only its width matters (the byte-plane shuffle before zstd).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemType {
    /// Plain bytes (no shuffle): mixed dtypes, integers.
    U8,
    F32,
    Bf16,
    F16,
}

impl ElemType {
    pub fn width(self) -> usize {
        match self {
            ElemType::U8 => 1,
            ElemType::F32 => 4,
            ElemType::Bf16 | ElemType::F16 => 2,
        }
    }

    pub fn code(self) -> u8 {
        match self {
            ElemType::U8 => 0,
            ElemType::F32 => 1,
            ElemType::Bf16 => 2,
            ElemType::F16 => 3,
        }
    }

    pub fn from_code(code: u8) -> Option<ElemType> {
        [ElemType::U8, ElemType::F32, ElemType::Bf16, ElemType::F16]
            .into_iter()
            .find(|e| e.code() == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            ElemType::U8 => "u8",
            ElemType::F32 => "f32",
            ElemType::Bf16 => "bf16",
            ElemType::F16 => "f16",
        }
    }
}

/// What one pass over a chunk learns: how many bytes changed and how many `gap16` escapes the
/// gaps between them need. Enough to size every encoding but zstd.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ChunkScan {
    pub changed: usize,
    pub gap_escapes: usize,
}

impl ChunkScan {
    /// The exact payload size of `encoding` for a chunk of `len` bytes, or `None` for `same` on
    /// a changed chunk (not a candidate) and for `zstd_xor` (known only by compressing).
    pub fn size_of(&self, encoding: Encoding, len: usize) -> Option<usize> {
        match encoding {
            Encoding::Same => (self.changed == 0).then_some(0),
            Encoding::Raw => Some(len),
            Encoding::Positions32 => Some(5 * self.changed),
            Encoding::Gaps16 => Some(3 * self.changed + 2 * self.gap_escapes),
            Encoding::ZstdXor => None,
        }
    }
}

/// The high bit of every nonzero byte of `x` set, every other bit clear. Per byte b:
/// (b & 0x7f) + 0x7f reaches 0x80 exactly when the low seven bits are not all zero, and never
/// carries into the next byte (at most 0xfe); or-ing b adds its own high bit.
fn nonzero_bytes(x: u64) -> u64 {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    ((x & LOW7).wrapping_add(LOW7) | x) & !LOW7
}

/// Writes `base ^ new` into `xor` and counts the changed bytes and the gap escapes.
pub fn scan_xor(base: &[u8], new: &[u8], xor: &mut [u8]) -> ChunkScan {
    debug_assert!(base.len() == new.len() && new.len() == xor.len());
    let mut scan = ChunkScan::default();
    // Position just past the previous changed byte: a changed byte at p has gap p - cursor.
    let mut cursor = 0usize;
    let escape = GAP_ESCAPE as usize;
    // Eight bytes at a time. Gaps inside one word are under 8 bytes, so only the gap before a
    // word's first changed byte can need escapes.
    let words = new.len() / 8;
    let (b8, n8, x8) = (&base[..words * 8], &new[..words * 8], &mut xor[..words * 8]);
    for (w, ((b, n), x)) in b8
        .chunks_exact(8)
        .zip(n8.chunks_exact(8))
        .zip(x8.chunks_exact_mut(8))
        .enumerate()
    {
        let a = u64::from_le_bytes(b.try_into().unwrap_or_default());
        let c = u64::from_le_bytes(n.try_into().unwrap_or_default());
        let d = a ^ c;
        x.copy_from_slice(&d.to_le_bytes());
        if d != 0 {
            let m = nonzero_bytes(d);
            let at = w * 8;
            scan.changed += m.count_ones() as usize;
            let first = at + (m.trailing_zeros() / 8) as usize;
            let last = at + 7 - (m.leading_zeros() / 8) as usize;
            scan.gap_escapes += (first - cursor) / escape;
            cursor = last + 1;
        }
    }
    for p in words * 8..new.len() {
        xor[p] = base[p] ^ new[p];
        if xor[p] != 0 {
            scan.changed += 1;
            scan.gap_escapes += (p - cursor) / escape;
            cursor = p + 1;
        }
    }
    scan
}

/// Regroups `src` by byte significance: all bytes 0 of each `width`-byte element, then all
/// bytes 1, ...; a tail shorter than one element is copied as is.
pub fn shuffle(src: &[u8], width: usize, dst: &mut [u8]) {
    debug_assert_eq!(src.len(), dst.len());
    let n = src.len() / width;
    let (planes, tail) = dst.split_at_mut(n * width);
    match width {
        1 => planes.copy_from_slice(&src[..n]),
        2 => {
            let (p0, p1) = planes.split_at_mut(n);
            for ((s, a), b) in src.chunks_exact(2).zip(p0).zip(p1) {
                (*a, *b) = (s[0], s[1]);
            }
        }
        4 => {
            let (p01, p23) = planes.split_at_mut(2 * n);
            let ((p0, p1), (p2, p3)) = (p01.split_at_mut(n), p23.split_at_mut(n));
            for ((((s, a), b), c), d) in src.chunks_exact(4).zip(p0).zip(p1).zip(p2).zip(p3) {
                (*a, *b, *c, *d) = (s[0], s[1], s[2], s[3]);
            }
        }
        _ => {
            for (e, element) in src.chunks_exact(width).enumerate() {
                for (k, &b) in element.iter().enumerate() {
                    planes[k * n + e] = b;
                }
            }
        }
    }
    tail.copy_from_slice(&src[n * width..]);
}

/// XORs the shuffled planes `planes` (as written by [`shuffle`]) back into `out`.
fn unshuffle_xor(planes: &[u8], width: usize, out: &mut [u8]) {
    let n = out.len() / width;
    let (planes, tail) = planes.split_at(n * width);
    let (body, out_tail) = out.split_at_mut(n * width);
    match width {
        1 => {
            for (o, p) in body.iter_mut().zip(planes) {
                *o ^= p;
            }
        }
        2 => {
            let (p0, p1) = planes.split_at(n);
            for ((o, a), b) in body.chunks_exact_mut(2).zip(p0).zip(p1) {
                o[0] ^= a;
                o[1] ^= b;
            }
        }
        4 => {
            let (p01, p23) = planes.split_at(2 * n);
            let ((p0, p1), (p2, p3)) = (p01.split_at(n), p23.split_at(n));
            for ((((o, a), b), c), d) in body.chunks_exact_mut(4).zip(p0).zip(p1).zip(p2).zip(p3) {
                o[0] ^= a;
                o[1] ^= b;
                o[2] ^= c;
                o[3] ^= d;
            }
        }
        _ => {
            for (e, element) in body.chunks_exact_mut(width).enumerate() {
                for (k, b) in element.iter_mut().enumerate() {
                    *b ^= planes[k * n + e];
                }
            }
        }
    }
    for (o, p) in out_tail.iter_mut().zip(tail) {
        *o ^= p;
    }
}

/// A chunk encoder/decoder with its reusable buffers and zstd contexts (one per thread).
pub struct ChunkCodec {
    compressor: zstd::bulk::Compressor<'static>,
    decompressor: zstd::bulk::Decompressor<'static>,
    xor: Vec<u8>,
    planes: Vec<u8>,
    frame: Vec<u8>,
}

impl ChunkCodec {
    /// A codec compressing at zstd `level` (1 by default in [`super::EncodeParams`]).
    pub fn new(level: i32) -> Result<ChunkCodec, DeltaError> {
        let zstd_err = |e: std::io::Error| DeltaError::Params(format!("zstd: {e}"));
        let mut compressor = zstd::bulk::Compressor::new(level).map_err(zstd_err)?;
        // The delta has its own checksum and the chunk table knows each chunk's length: the
        // frame needs neither zstd's checksum nor its content size nor a dictionary id.
        use zstd::zstd_safe::CParameter;
        for p in [
            CParameter::ChecksumFlag(false),
            CParameter::ContentSizeFlag(false),
            CParameter::DictIdFlag(false),
        ] {
            compressor.set_parameter(p).map_err(zstd_err)?;
        }
        Ok(ChunkCodec {
            compressor,
            decompressor: zstd::bulk::Decompressor::new().map_err(zstd_err)?,
            xor: Vec::new(),
            planes: Vec::new(),
            frame: Vec::new(),
        })
    }

    /// Scans `base` against `new` (the XOR kept for zstd) and returns the scan.
    fn scan(&mut self, base: &[u8], new: &[u8]) -> ChunkScan {
        self.xor.resize(new.len(), 0);
        scan_xor(base, new, &mut self.xor)
    }

    /// zstd of the (shuffled) XOR left by the last scan into `self.frame`, given `limit` bytes
    /// of output (callers pass zstd's compress bound); returns its size.
    fn compress_xor(&mut self, elem: ElemType, limit: usize) -> Option<usize> {
        let src: &[u8] = if elem.width() > 1 {
            self.planes.resize(self.xor.len(), 0);
            shuffle(&self.xor, elem.width(), &mut self.planes);
            &self.planes
        } else {
            &self.xor
        };
        self.frame.resize(limit, 0);
        // With the compress bound as the limit, zstd fails only on allocation; the chunk then
        // falls back to the other candidates, which stay correct.
        self.compressor
            .compress_to_buffer(src, &mut self.frame[..limit])
            .ok()
    }

    /// Encodes one chunk with the smallest encoding, appending its payload to `out`.
    pub fn encode_best(
        &mut self,
        elem: ElemType,
        base: &[u8],
        new: &[u8],
        out: &mut Vec<u8>,
    ) -> Encoding {
        let scan = self.scan(base, new);
        let (mut best, mut best_size) = (Encoding::Raw, new.len());
        for e in [Encoding::Same, Encoding::Positions32, Encoding::Gaps16] {
            if let Some(size) = scan.size_of(e, new.len()) {
                if (size, e) < (best_size, best) {
                    (best, best_size) = (e, size);
                }
            }
        }
        // zstd is last in the tie order, so it must be strictly smaller. It gets its full
        // worst-case output buffer, not best_size bytes: zstd may refuse a buffer that its
        // final frame would fit (its bit streams write ahead), which would hide a smaller frame.
        if best_size > 0 {
            let bound = zstd::zstd_safe::compress_bound(new.len());
            if let Some(size) = self.compress_xor(elem, bound).filter(|&s| s < best_size) {
                out.extend_from_slice(&self.frame[..size]);
                return Encoding::ZstdXor;
            }
        }
        write_plain(best, &self.xor, new, out);
        best
    }

    /// The payload size of every candidate encoding for this chunk (`None`: not a candidate,
    /// i.e. `same` on a changed chunk). zstd is compressed without a size limit. For tests and
    /// `sluice delta inspect`-style reports; [`ChunkCodec::encode_best`] does not need it.
    pub fn candidate_sizes(
        &mut self,
        elem: ElemType,
        base: &[u8],
        new: &[u8],
    ) -> [Option<usize>; 5] {
        let scan = self.scan(base, new);
        let mut sizes = [None; 5];
        for e in Encoding::ALL {
            sizes[e.index()] = scan.size_of(e, new.len());
        }
        let bound = zstd::zstd_safe::compress_bound(new.len());
        sizes[Encoding::ZstdXor.index()] = self.compress_xor(elem, bound);
        sizes
    }

    /// Encodes one chunk with `encoding` (a candidate for it), appending the payload to `out`.
    /// Returns `false` (nothing appended) when `encoding` is `same` and the chunk changed.
    pub fn encode_as(
        &mut self,
        encoding: Encoding,
        elem: ElemType,
        base: &[u8],
        new: &[u8],
        out: &mut Vec<u8>,
    ) -> bool {
        let scan = self.scan(base, new);
        match encoding {
            Encoding::Same if scan.changed != 0 => false,
            Encoding::ZstdXor => {
                let bound = zstd::zstd_safe::compress_bound(new.len());
                match self.compress_xor(elem, bound) {
                    Some(size) => {
                        out.extend_from_slice(&self.frame[..size]);
                        true
                    }
                    None => false,
                }
            }
            other => {
                write_plain(other, &self.xor, new, out);
                true
            }
        }
    }

    /// Applies one chunk's payload to `out`, which holds the base bytes of the chunk (or, for
    /// `raw`, anything). Every position and length is checked: a payload that does not decode
    /// to exactly this chunk is an error, with `out` partly written.
    pub fn decode(
        &mut self,
        encoding: Encoding,
        elem: ElemType,
        payload: &[u8],
        out: &mut [u8],
    ) -> Result<(), String> {
        let len = out.len();
        match encoding {
            Encoding::Same => {
                if !payload.is_empty() {
                    return Err(format!("`same` with {} payload bytes", payload.len()));
                }
            }
            Encoding::Raw => {
                if payload.len() != len {
                    return Err(format!("`raw` of {} bytes for {len}", payload.len()));
                }
                out.copy_from_slice(payload);
            }
            Encoding::Positions32 => {
                if !payload.len().is_multiple_of(5) {
                    return Err(format!("`pos32` of {} bytes", payload.len()));
                }
                for rec in payload.chunks_exact(5) {
                    let p = u32::from_le_bytes([rec[0], rec[1], rec[2], rec[3]]) as usize;
                    *out.get_mut(p)
                        .ok_or_else(|| format!("`pos32` position {p} past {len}"))? = rec[4];
                }
            }
            Encoding::Gaps16 => {
                let mut cursor = 0usize;
                let mut rest = payload;
                while !rest.is_empty() {
                    let (gap, tail) = match rest {
                        [lo, hi, tail @ ..] => (u16::from_le_bytes([*lo, *hi]), tail),
                        _ => return Err("`gap16` ends inside a gap".into()),
                    };
                    if gap == GAP_ESCAPE {
                        cursor += GAP_ESCAPE as usize;
                        rest = tail;
                        continue;
                    }
                    let (&value, tail) = tail.split_first().ok_or("`gap16` ends before a value")?;
                    let p = cursor + gap as usize;
                    *out.get_mut(p)
                        .ok_or_else(|| format!("`gap16` position {p} past {len}"))? = value;
                    cursor = p + 1;
                    rest = tail;
                }
            }
            Encoding::ZstdXor => {
                let width = elem.width();
                let planes = if width > 1 {
                    &mut self.planes
                } else {
                    &mut self.xor
                };
                planes.resize(len, 0);
                let got = self
                    .decompressor
                    .decompress_to_buffer(payload, &mut planes[..])
                    .map_err(|e| format!("zstd: {e}"))?;
                if got != len {
                    return Err(format!("zstd frame holds {got} bytes for {len}"));
                }
                unshuffle_xor(planes, width, out);
            }
        }
        Ok(())
    }
}

/// Writes a `same`, `raw`, `pos32` or `gap16` payload from the chunk's XOR and new bytes.
fn write_plain(encoding: Encoding, xor: &[u8], new: &[u8], out: &mut Vec<u8>) {
    let changed = || {
        xor.iter()
            .enumerate()
            .filter(|(_, &x)| x != 0)
            .map(|(p, _)| p)
    };
    match encoding {
        Encoding::Same | Encoding::ZstdXor => {}
        Encoding::Raw => out.extend_from_slice(new),
        Encoding::Positions32 => {
            for p in changed() {
                out.extend_from_slice(&(p as u32).to_le_bytes());
                out.push(new[p]);
            }
        }
        Encoding::Gaps16 => {
            let mut cursor = 0usize;
            for p in changed() {
                let mut gap = p - cursor;
                while gap >= GAP_ESCAPE as usize {
                    out.extend_from_slice(&GAP_ESCAPE.to_le_bytes());
                    gap -= GAP_ESCAPE as usize;
                }
                out.extend_from_slice(&(gap as u16).to_le_bytes());
                out.push(new[p]);
                cursor = p + 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gap16_escapes_are_counted_and_written_alike() {
        // Changes at 0, 65535+1 (one escape), and 3*65535+5 past that (three escapes).
        let len = 300_000;
        let base = vec![7u8; len];
        let mut new = base.clone();
        let positions = [0usize, 65_536, 65_537 + 3 * 65_535 + 5];
        for &p in &positions {
            new[p] = 9;
        }
        let mut xor = vec![0; len];
        let scan = scan_xor(&base, &new, &mut xor);
        assert_eq!(scan.changed, 3);
        assert_eq!(scan.gap_escapes, 1 + 3);
        let mut out = Vec::new();
        write_plain(Encoding::Gaps16, &xor, &new, &mut out);
        assert_eq!(Some(out.len()), scan.size_of(Encoding::Gaps16, len));
        let mut codec = ChunkCodec::new(1).unwrap();
        let mut applied = base.clone();
        codec
            .decode(Encoding::Gaps16, ElemType::U8, &out, &mut applied)
            .unwrap();
        assert_eq!(applied, new);
    }

    #[test]
    fn nonzero_byte_mask_marks_exactly_the_nonzero_bytes() {
        let mut rng = 0x1234_5678_9abc_def0u64;
        for _ in 0..10_000 {
            rng = crate::hash::mix64(rng);
            // Bytes drawn from {0, 1, 0x7f, 0x80, 0xff, random} so edge values are common.
            let x = u64::from_le_bytes(std::array::from_fn(|i| {
                let r = crate::hash::mix64(rng ^ i as u64);
                [0, 1, 0x7f, 0x80, 0xff, r as u8][(r >> 8) as usize % 6]
            }));
            let want = (0..8).fold(0u64, |m, i| {
                m | if (x >> (8 * i)) & 0xff != 0 {
                    0x80 << (8 * i)
                } else {
                    0
                }
            });
            assert_eq!(nonzero_bytes(x), want, "{x:#018x}");
        }
    }

    #[test]
    fn shuffle_round_trips_with_a_ragged_tail() {
        for width in [1, 2, 3, 4] {
            let src: Vec<u8> = (0..23u8).map(|i| i.wrapping_mul(37) | 1).collect();
            let mut planes = vec![0; src.len()];
            shuffle(&src, width, &mut planes);
            let mut back = vec![0u8; src.len()];
            unshuffle_xor(&planes, width, &mut back);
            assert_eq!(back, src, "width {width}");
        }
    }
}
