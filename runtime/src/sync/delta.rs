//! The delta format: what changed between the image a receiver holds (version v) and the new
//! one (v + K), chunk by chunk, with enough in its header to refuse a wrong base and to check
//! the result before anyone installs it.
//!
//! Layout (little-endian; docs/runtime.md, "Weight sync"):
//!
//! ```text
//! offset size
//!      0    8  magic "SLUICEDL"
//!      8    2  format version (1)
//!     10    1  element type (0 u8, 1 f32, 2 bf16, 3 f16): the width of the zstd byte shuffle
//!     11    1  reserved, 0
//!     12    4  chunk size in bytes (the last chunk may be shorter)
//!     16    8  base version (what the receiver must hold)
//!     24    8  new version
//!     32    8  image length in bytes (base and new alike)
//!     40    4  number of chunks = ceil(length / chunk size)
//!     44    4  reserved, 0
//!     48   32  blake3 of the base image
//!     80   32  blake3 of the new image
//!    112  5 n  chunk table: per chunk its encoding (u8) and payload length (u32)
//!      .    .  the payloads, in chunk order
//!  end-32  32  blake3 of every byte before it (a flipped or missing byte fails here)
//! ```
//!
//! Applying checks, in order: the trailing checksum (corruption, truncation), the header and
//! table (sizes add up), the base version and base hash against what the receiver holds (a
//! receiver on another version, or holding other bytes, is refused), then decodes every chunk
//! into the caller's output buffer and compares the blake3 of the whole result with the header's.
//! Every refusal is a [`DeltaError`]; the receiver then needs a full sync.
//!
//! Chunk size: 256 KiB by default. A chunk is the unit of the encoding choice and of
//! parallelism. Smaller chunks follow the layout of changes more closely (a frozen tensor next
//! to a dense one) but each costs 5 table bytes plus a zstd frame header and gives zstd less
//! context; larger ones leave cores idle on small models (the small model's 14 MB arena is 55
//! chunks of 256 KiB, enough for 16 cores; at 4 MiB it would be 4). 256 KiB also keeps a
//! chunk, its XOR and its byte planes inside a core's L2 while it is scanned and compressed.
//! docs/perf/sync.md measures the choice.

use super::chunk::{ChunkCodec, ElemType, Encoding};
use super::content_hash::ContentHash;
use crate::trajectory::WeightVersion;
use rayon::prelude::*;
use std::fmt;

pub const MAGIC: [u8; 8] = *b"SLUICEDL";
pub const FORMAT_VERSION: u16 = 1;
/// Bytes before the chunk table.
pub const HEADER_LEN: usize = 112;
/// Bytes per chunk-table entry: encoding (u8) and payload length (u32).
pub const ENTRY_LEN: usize = 5;
/// The trailing blake3 checksum.
pub const TRAILER_LEN: usize = 32;
pub const DEFAULT_CHUNK_SIZE: usize = 256 * 1024;
/// Chunk sizes allowed: multiples of 8 (every element width divides them) in this range.
pub const MIN_CHUNK_SIZE: usize = 64;
pub const MAX_CHUNK_SIZE: usize = 1 << 30;

/// Why a delta cannot be made or applied. When applying, every variant means the same thing to
/// the caller: nothing was installed, and the receiver needs a full sync.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeltaError {
    /// Bad encoder parameters or inputs (chunk size, zstd level, images of different lengths).
    Params(String),
    /// The trailing checksum does not match: the delta was corrupted or cut short.
    Checksum,
    /// Not a delta, or its header and table do not add up; names what is wrong.
    Malformed(String),
    /// A delta format this build does not read.
    UnsupportedFormat(u16),
    /// The delta applies to another version than the receiver holds (or it holds nothing).
    BaseVersion {
        delta: WeightVersion,
        held: Option<WeightVersion>,
    },
    /// The receiver's bytes are not the delta's base (same version number, other contents).
    BaseHash {
        delta: ContentHash,
        held: ContentHash,
    },
    /// The receiver's image has another length than the delta's.
    Length { delta: u64, held: u64 },
    /// The decoded result does not hash to the header's new hash: it was not installed.
    ResultHash {
        expected: ContentHash,
        got: ContentHash,
    },
}

impl fmt::Display for DeltaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeltaError::Params(m) => write!(f, "cannot encode a delta: {m}"),
            DeltaError::Checksum => write!(
                f,
                "the delta is corrupt or truncated: its blake3 checksum does not match its contents"
            ),
            DeltaError::Malformed(m) => write!(f, "the delta is malformed: {m}"),
            DeltaError::UnsupportedFormat(v) => write!(
                f,
                "delta format version {v} is not supported (this build reads version {FORMAT_VERSION})"
            ),
            DeltaError::BaseVersion { delta, held } => match held {
                Some(h) => write!(f, "the delta applies to {delta}, but the receiver holds {h}"),
                None => write!(f, "the delta applies to {delta}, but the receiver holds no weights"),
            },
            DeltaError::BaseHash { delta, held } => write!(
                f,
                "the delta's base has blake3 {delta}, but the bytes held hash to {held}: another base"
            ),
            DeltaError::Length { delta, held } => write!(
                f,
                "the delta is for a {delta}-byte image, but the receiver holds {held} bytes"
            ),
            DeltaError::ResultHash { expected, got } => write!(
                f,
                "the decoded weights hash to {got}, not {expected} as the delta says: not installed"
            ),
        }
    }
}

impl std::error::Error for DeltaError {}

/// How deltas are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodeParams {
    pub chunk_size: usize,
    /// The image's element type (only its width is used: the zstd byte shuffle).
    pub elem: ElemType,
    /// zstd level: 1 (fast) by default; higher levels trade encode speed for size.
    pub zstd_level: i32,
}

impl Default for EncodeParams {
    fn default() -> Self {
        EncodeParams {
            chunk_size: DEFAULT_CHUNK_SIZE,
            elem: ElemType::F32,
            zstd_level: 1,
        }
    }
}

impl EncodeParams {
    pub fn validate(&self) -> Result<(), DeltaError> {
        let cs = self.chunk_size;
        if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&cs) || !cs.is_multiple_of(8) {
            return Err(DeltaError::Params(format!(
                "chunk size {cs} must be a multiple of 8 in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]"
            )));
        }
        let levels = zstd::zstd_safe::min_c_level()..=zstd::zstd_safe::max_c_level();
        if !levels.contains(&self.zstd_level) {
            return Err(DeltaError::Params(format!(
                "zstd level {} is outside [{}, {}]",
                self.zstd_level,
                levels.start(),
                levels.end()
            )));
        }
        Ok(())
    }
}

/// An image with its version and hash (the hash is trusted: callers compute it once per
/// version and keep it).
#[derive(Clone, Copy, Debug)]
pub struct Image<'a> {
    pub version: WeightVersion,
    pub bytes: &'a [u8],
    pub hash: ContentHash,
}

impl<'a> Image<'a> {
    /// `bytes` at `version`, hashing them.
    pub fn new(version: WeightVersion, bytes: &'a [u8]) -> Image<'a> {
        Image {
            version,
            bytes,
            hash: ContentHash::of(bytes),
        }
    }
}

/// Chunks and payload bytes per encoding, and the delta's total against the full image.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EncodingSummary {
    /// Chunks per encoding, indexed by [`Encoding::index`].
    pub chunks: [u64; 5],
    /// Payload bytes per encoding, indexed by [`Encoding::index`].
    pub payload_bytes: [u64; 5],
    /// Header, chunk table and checksum.
    pub overhead_bytes: u64,
    /// The image's length (what a full sync sends).
    pub full_bytes: u64,
}

impl EncodingSummary {
    fn add(&mut self, encoding: Encoding, payload: usize) {
        self.chunks[encoding.index()] += 1;
        self.payload_bytes[encoding.index()] += payload as u64;
    }

    /// The delta's length in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.overhead_bytes + self.payload_bytes.iter().sum::<u64>()
    }

    /// The delta's length as a fraction of the full image (0 for an empty image).
    pub fn fraction_of_full(&self) -> f64 {
        if self.full_bytes == 0 {
            0.0
        } else {
            self.total_bytes() as f64 / self.full_bytes as f64
        }
    }

    /// `delta:` then `name=chunks` for each encoding used, in tie order, e.g.
    /// `delta:same=40,zstd_xor=15` (the `sync_encoding` metric of DESIGN 9).
    pub fn label(&self) -> String {
        let used: Vec<String> = Encoding::ALL
            .iter()
            .filter(|e| self.chunks[e.index()] > 0)
            .map(|e| format!("{}={}", e.name(), self.chunks[e.index()]))
            .collect();
        format!("delta:{}", used.join(","))
    }
}

/// A delta and its summary.
#[derive(Clone, Debug)]
pub struct Encoded {
    pub bytes: Vec<u8>,
    pub summary: EncodingSummary,
}

/// A delta's header (the fixed part before the chunk table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeltaHeader {
    pub elem: ElemType,
    pub chunk_size: usize,
    pub base_version: WeightVersion,
    pub new_version: WeightVersion,
    pub image_len: u64,
    pub base_hash: ContentHash,
    pub new_hash: ContentHash,
}

/// One chunk of a parsed delta.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkEntry {
    pub encoding: Encoding,
    /// Where the chunk starts in the image, and its length there.
    pub image_offset: usize,
    pub image_len: usize,
    /// Where its payload starts in the delta, and its length.
    pub payload_offset: usize,
    pub payload_len: usize,
}

/// A delta whose checksum, header and table have been checked.
#[derive(Clone, Debug)]
pub struct ParsedDelta<'a> {
    pub header: DeltaHeader,
    pub chunks: Vec<ChunkEntry>,
    bytes: &'a [u8],
}

impl ParsedDelta<'_> {
    /// The delta's total length.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn summary(&self) -> EncodingSummary {
        let mut s = EncodingSummary {
            overhead_bytes: (HEADER_LEN + ENTRY_LEN * self.chunks.len() + TRAILER_LEN) as u64,
            full_bytes: self.header.image_len,
            ..Default::default()
        };
        for c in &self.chunks {
            s.add(c.encoding, c.payload_len);
        }
        s
    }

    fn payload(&self, c: &ChunkEntry) -> &[u8] {
        &self.bytes[c.payload_offset..c.payload_offset + c.payload_len]
    }
}

fn checked_chunks(len: usize, chunk_size: usize) -> usize {
    len.div_ceil(chunk_size)
}

/// Encodes `new` against `base` (the image the receiver holds). Chunks are encoded in
/// parallel; the output does not depend on the number of threads.
pub fn encode(
    params: &EncodeParams,
    base: Image<'_>,
    new: Image<'_>,
) -> Result<Encoded, DeltaError> {
    params.validate()?;
    if base.bytes.len() != new.bytes.len() {
        return Err(DeltaError::Params(format!(
            "the images differ in length ({} bytes at {}, {} at {}): deltas need one layout",
            base.bytes.len(),
            base.version,
            new.bytes.len(),
            new.version
        )));
    }
    let cs = params.chunk_size;
    let n_chunks = checked_chunks(new.bytes.len(), cs);
    let n_chunks_u32 = u32::try_from(n_chunks)
        .map_err(|_| DeltaError::Params(format!("{n_chunks} chunks: too many for the table")))?;
    let encoded: Vec<(Encoding, Vec<u8>)> = base
        .bytes
        .par_chunks(cs)
        .zip(new.bytes.par_chunks(cs))
        .map_init(
            || ChunkCodec::new(params.zstd_level),
            |codec, (b, n)| {
                let codec = codec.as_mut().map_err(|e| e.clone())?;
                let mut payload = Vec::new();
                let e = codec.encode_best(params.elem, b, n, &mut payload);
                Ok((e, payload))
            },
        )
        .collect::<Result<_, DeltaError>>()?;

    let mut summary = EncodingSummary {
        overhead_bytes: (HEADER_LEN + ENTRY_LEN * n_chunks + TRAILER_LEN) as u64,
        full_bytes: new.bytes.len() as u64,
        ..Default::default()
    };
    let payload_total: usize = encoded.iter().map(|(_, p)| p.len()).sum();
    let mut out =
        Vec::with_capacity(HEADER_LEN + ENTRY_LEN * n_chunks + payload_total + TRAILER_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.push(params.elem.code());
    out.push(0);
    out.extend_from_slice(&(cs as u32).to_le_bytes());
    out.extend_from_slice(&base.version.0.to_le_bytes());
    out.extend_from_slice(&new.version.0.to_le_bytes());
    out.extend_from_slice(&(new.bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&n_chunks_u32.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&base.hash.0);
    out.extend_from_slice(&new.hash.0);
    debug_assert_eq!(out.len(), HEADER_LEN);
    for (e, payload) in &encoded {
        out.push(e.code());
        // A payload is never longer than its chunk (raw is always a candidate), and a chunk
        // is at most MAX_CHUNK_SIZE < 2^32 bytes.
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        summary.add(*e, payload.len());
    }
    for (_, payload) in &encoded {
        out.extend_from_slice(payload);
    }
    let checksum = ContentHash::of(&out);
    out.extend_from_slice(&checksum.0);
    Ok(Encoded {
        bytes: out,
        summary,
    })
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}
fn hash_at(b: &[u8], at: usize) -> ContentHash {
    let mut h = [0u8; 32];
    h.copy_from_slice(&b[at..at + 32]);
    ContentHash(h)
}

/// Checks a delta's checksum, header and chunk table (not its payloads: [`apply`] decodes
/// those) and returns what they say.
pub fn parse(delta: &[u8]) -> Result<ParsedDelta<'_>, DeltaError> {
    let malformed = |m: String| DeltaError::Malformed(m);
    if delta.len() < HEADER_LEN + TRAILER_LEN {
        if delta.len() >= 8 && delta[..8] != MAGIC {
            return Err(malformed(
                "it does not start with the magic `SLUICEDL`".into(),
            ));
        }
        return Err(malformed(format!(
            "{} bytes, shorter than the {} bytes of an empty delta (truncated)",
            delta.len(),
            HEADER_LEN + TRAILER_LEN
        )));
    }
    if delta[..8] != MAGIC {
        return Err(malformed(
            "it does not start with the magic `SLUICEDL`".into(),
        ));
    }
    let body = &delta[..delta.len() - TRAILER_LEN];
    if ContentHash::of(body) != hash_at(delta, body.len()) {
        return Err(DeltaError::Checksum);
    }
    let version = u16_at(delta, 8);
    if version != FORMAT_VERSION {
        return Err(DeltaError::UnsupportedFormat(version));
    }
    let elem = ElemType::from_code(delta[10])
        .ok_or_else(|| malformed(format!("unknown element type code {}", delta[10])))?;
    let chunk_size = u32_at(delta, 12) as usize;
    if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&chunk_size) || !chunk_size.is_multiple_of(8) {
        return Err(malformed(format!("chunk size {chunk_size}")));
    }
    let image_len = u64_at(delta, 32);
    let n_chunks = u32_at(delta, 40) as usize;
    let image_len_usize = usize::try_from(image_len).map_err(|_| {
        malformed(format!(
            "image length {image_len} too large for this machine"
        ))
    })?;
    if n_chunks != checked_chunks(image_len_usize, chunk_size) {
        return Err(malformed(format!(
            "{n_chunks} chunks for {image_len} bytes in chunks of {chunk_size}"
        )));
    }
    let header = DeltaHeader {
        elem,
        chunk_size,
        base_version: WeightVersion(u64_at(delta, 16)),
        new_version: WeightVersion(u64_at(delta, 24)),
        image_len,
        base_hash: hash_at(delta, 48),
        new_hash: hash_at(delta, 80),
    };
    let table_end = n_chunks
        .checked_mul(ENTRY_LEN)
        .and_then(|t| t.checked_add(HEADER_LEN))
        .filter(|&end| end <= body.len())
        .ok_or_else(|| malformed(format!("a table of {n_chunks} chunks does not fit")))?;
    let mut chunks = Vec::with_capacity(n_chunks);
    let mut payload_offset = table_end;
    for i in 0..n_chunks {
        let at = HEADER_LEN + i * ENTRY_LEN;
        let encoding = Encoding::from_code(delta[at])
            .ok_or_else(|| malformed(format!("chunk {i}: unknown encoding code {}", delta[at])))?;
        let payload_len = u32_at(delta, at + 1) as usize;
        let image_offset = i * chunk_size;
        let image_len = chunk_size.min(image_len_usize - image_offset);
        let sized_right = match encoding {
            Encoding::Same => payload_len == 0,
            Encoding::Raw => payload_len == image_len,
            Encoding::Positions32 => payload_len.is_multiple_of(5),
            Encoding::Gaps16 | Encoding::ZstdXor => true,
        };
        if !sized_right {
            return Err(malformed(format!(
                "chunk {i}: {} payload of {payload_len} bytes for a {image_len}-byte chunk",
                encoding.name()
            )));
        }
        chunks.push(ChunkEntry {
            encoding,
            image_offset,
            image_len,
            payload_offset,
            payload_len,
        });
        payload_offset = payload_offset
            .checked_add(payload_len)
            .filter(|&end| end <= body.len())
            .ok_or_else(|| malformed(format!("chunk {i}: payload runs past the end")))?;
    }
    if payload_offset != body.len() {
        return Err(malformed(format!(
            "{} bytes after the last payload",
            body.len() - payload_offset
        )));
    }
    Ok(ParsedDelta {
        header,
        chunks,
        bytes: delta,
    })
}

/// Applies `delta` to `held` (the receiver's image), writing the result into `out` (resized),
/// and checks the result's hash. On `Ok`, `out` holds exactly the new image, whose version and
/// hash are the returned header's `new_version` and `new_hash`. On `Err`, `out` holds garbage
/// and must not be installed; `held` is never written.
pub fn apply(delta: &[u8], held: Image<'_>, out: &mut Vec<u8>) -> Result<DeltaHeader, DeltaError> {
    let parsed = parse(delta)?;
    let h = &parsed.header;
    if h.base_version != held.version {
        return Err(DeltaError::BaseVersion {
            delta: h.base_version,
            held: Some(held.version),
        });
    }
    if h.image_len != held.bytes.len() as u64 {
        return Err(DeltaError::Length {
            delta: h.image_len,
            held: held.bytes.len() as u64,
        });
    }
    if h.base_hash != held.hash {
        return Err(DeltaError::BaseHash {
            delta: h.base_hash,
            held: held.hash,
        });
    }
    out.clear();
    out.resize(held.bytes.len(), 0);
    let cs = h.chunk_size;
    out.par_chunks_mut(cs)
        .zip(held.bytes.par_chunks(cs))
        .zip(parsed.chunks.par_iter())
        .try_for_each_init(
            || ChunkCodec::new(1),
            |codec, ((dst, src), c)| {
                let codec = codec.as_mut().map_err(|e| e.clone())?;
                if c.encoding != Encoding::Raw {
                    dst.copy_from_slice(src);
                }
                codec
                    .decode(c.encoding, h.elem, parsed.payload(c), dst)
                    .map_err(|m| {
                        DeltaError::Malformed(format!(
                            "chunk {} (bytes {}..{}): {m}",
                            c.image_offset / cs,
                            c.image_offset,
                            c.image_offset + c.image_len
                        ))
                    })
            },
        )?;
    let got = ContentHash::of(out);
    if got != h.new_hash {
        return Err(DeltaError::ResultHash {
            expected: h.new_hash,
            got,
        });
    }
    Ok(parsed.header)
}
