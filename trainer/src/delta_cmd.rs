//! `sluice delta diff BASE NEW --out D` / `apply BASE D --out NEW2` / `inspect D` (DESIGN 7):
//! the weight-sync delta (runtime/src/sync) between two safetensors files with identical
//! tensor tables (same tensors, dtypes, shapes and order), so users can measure deltas between
//! their own checkpoints.
//!
//! The delta file holds NEW's safetensors header verbatim (metadata may differ from BASE's),
//! the blake3 of the whole NEW file, and the codec delta of the data section:
//!
//! ```text
//! offset size
//!      0    8  magic "SLUICEDF"
//!      8    2  format version (1)
//!     10    6  reserved, 0
//!     16    8  H: length of NEW's header (its 8-byte length prefix and JSON)
//!     24   32  blake3 of the whole NEW file
//!     56   32  blake3 of NEW's header
//!     88    H  NEW's header
//!   88+H    .  the delta of the data sections (magic "SLUICEDL", docs/runtime.md)
//! ```
//!
//! `apply` checks NEW's header against its hash (a corrupt delta) and BASE's tensor table
//! against it (the wrong BASE), rebuilds NEW in memory, checks the data's hash (inside the
//! codec) and the whole file's hash, and only then writes `--out` atomically; on any error
//! nothing is written.
//! Bad input (a missing or unreadable file, a file that is not safetensors, tensor tables
//! that differ, a corrupt delta, a delta made from another BASE) is exit code 2.

use clap::Subcommand;
use sluice_kernels::{Error, Result};
use sluice_model::checkpoint::write_atomic;
use sluice_runtime::sync::delta::{self, DeltaError, EncodeParams, Image, DEFAULT_CHUNK_SIZE};
use sluice_runtime::sync::{ContentHash, ElemType, Encoding};
use sluice_runtime::trajectory::WeightVersion;
use std::io::Write;
use std::path::{Path, PathBuf};

pub const MAGIC: [u8; 8] = *b"SLUICEDF";
pub const FORMAT_VERSION: u16 = 1;
const PREFIX_LEN: usize = 88;
/// File deltas have no weight versions: the base is named by its hash. The codec header
/// records BASE as version 0 and NEW as version 1.
const BASE_VERSION: WeightVersion = WeightVersion(0);
const NEW_VERSION: WeightVersion = WeightVersion(1);

#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum DeltaCommand {
    /// Encode NEW against BASE (safetensors files with identical tensor tables) into --out.
    Diff {
        base: PathBuf,
        new: PathBuf,
        /// The delta file to write.
        #[arg(long)]
        out: PathBuf,
        /// Bytes per chunk (a multiple of 8, 64 to 2^30): the unit of the encoding choice.
        #[arg(long, default_value_t = DEFAULT_CHUNK_SIZE)]
        chunk_size: usize,
        /// zstd level for the zstd-of-XOR candidate.
        #[arg(long, default_value_t = 1)]
        zstd_level: i32,
    },
    /// Rebuild NEW from BASE and a delta; writes --out only if the result's hash matches.
    Apply {
        base: PathBuf,
        delta: PathBuf,
        /// The file to write (NEW, byte for byte).
        #[arg(long)]
        out: PathBuf,
    },
    /// Print a delta's chunks, the encoding of each, and its bytes against the full size.
    Inspect { delta: PathBuf },
}

/// Runs one `sluice delta` subcommand, printing its report to `out`.
pub fn run(cmd: &DeltaCommand, out: &mut dyn Write) -> Result<()> {
    let report = match cmd {
        DeltaCommand::Diff {
            base,
            new,
            out: path,
            chunk_size,
            zstd_level,
        } => diff(base, new, path, *chunk_size, *zstd_level)?,
        DeltaCommand::Apply {
            base,
            delta,
            out: path,
        } => apply(base, delta, path)?,
        DeltaCommand::Inspect { delta } => inspect(delta)?,
    };
    out.write_all(report.as_bytes()).map_err(|e| Error::Io {
        path: "<stdout>".into(),
        message: e.to_string(),
    })
}

fn bad(message: String) -> Error {
    Error::Invalid(message)
}

fn read(role: &str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| bad(format!("{role} {}: cannot read it: {e}", path.display())))
}

/// One row of a safetensors tensor table.
#[derive(Clone, Debug, PartialEq, Eq)]
struct TensorRow {
    name: String,
    dtype: String,
    shape: Vec<usize>,
    offsets: (usize, usize),
}

/// A safetensors file split into its header (length prefix and JSON) and data section, with
/// its tensor table in data order.
struct StFile<'a> {
    header: &'a [u8],
    data: &'a [u8],
    table: Vec<TensorRow>,
}

/// The tensor table of a safetensors JSON header, in data order (`__metadata__` skipped).
fn table_of(json: &[u8]) -> std::result::Result<Vec<TensorRow>, String> {
    let parsed: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(json).map_err(|e| format!("its header is not JSON: {e}"))?;
    let mut rows = Vec::new();
    for (name, info) in parsed {
        if name == "__metadata__" {
            continue;
        }
        let field = |k: &str| {
            info.get(k)
                .ok_or_else(|| format!("tensor `{name}` has no `{k}`"))
        };
        let dtype = field("dtype")?
            .as_str()
            .ok_or_else(|| format!("tensor `{name}`: `dtype` is not a string"))?
            .to_string();
        let ints = |k: &str| -> std::result::Result<Vec<usize>, String> {
            field(k)?
                .as_array()
                .and_then(|a| a.iter().map(|v| v.as_u64().map(|x| x as usize)).collect())
                .ok_or_else(|| format!("tensor `{name}`: `{k}` is not a list of integers"))
        };
        let shape = ints("shape")?;
        let offsets = match ints("data_offsets")?.as_slice() {
            &[a, b] => (a, b),
            _ => {
                return Err(format!(
                    "tensor `{name}`: `data_offsets` is not [begin, end]"
                ))
            }
        };
        rows.push(TensorRow {
            name,
            dtype,
            shape,
            offsets,
        });
    }
    rows.sort_by_key(|r| (r.offsets, r.name.clone()));
    Ok(rows)
}

/// Parses `bytes` (read from `path`, playing `role`) as a safetensors file.
fn st_file<'a>(role: &str, path: &Path, bytes: &'a [u8]) -> Result<StFile<'a>> {
    let what = |m: String| {
        bad(format!(
            "{role} {}: not a valid safetensors file: {m}",
            path.display()
        ))
    };
    let (n, _) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| what(e.to_string()))?;
    let table = table_of(&bytes[8..8 + n]).map_err(what)?;
    Ok(StFile {
        header: &bytes[..8 + n],
        data: &bytes[8 + n..],
        table,
    })
}

/// The first difference between two tensor tables, as a sentence; `None` when identical.
fn first_difference(base: &[TensorRow], new: &[TensorRow]) -> Option<String> {
    for (i, (b, n)) in base.iter().zip(new).enumerate() {
        if b.name != n.name {
            return Some(format!(
                "tensor {i} (in data order) is `{}` in BASE but `{}` in NEW",
                b.name, n.name
            ));
        }
        if b.dtype != n.dtype {
            return Some(format!(
                "tensor `{}` is {} in BASE but {} in NEW",
                b.name, b.dtype, n.dtype
            ));
        }
        if b.shape != n.shape {
            return Some(format!(
                "tensor `{}` has shape {:?} in BASE but {:?} in NEW",
                b.name, b.shape, n.shape
            ));
        }
        if b.offsets != n.offsets {
            return Some(format!(
                "tensor `{}` lies at bytes {:?} of the data in BASE but {:?} in NEW",
                b.name, b.offsets, n.offsets
            ));
        }
    }
    match base.len().cmp(&new.len()) {
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Less => Some(format!(
            "BASE has {} tensors and NEW has {}: `{}` is only in NEW",
            base.len(),
            new.len(),
            new[base.len()].name
        )),
        std::cmp::Ordering::Greater => Some(format!(
            "BASE has {} tensors and NEW has {}: `{}` is only in BASE",
            base.len(),
            new.len(),
            base[new.len()].name
        )),
    }
}

/// The element type the zstd shuffle should use: the tensors' one dtype, or bytes if mixed.
fn elem_of(table: &[TensorRow]) -> ElemType {
    let mut dtypes = table.iter().map(|r| r.dtype.as_str());
    let Some(first) = dtypes.next() else {
        return ElemType::U8;
    };
    if dtypes.any(|d| d != first) {
        return ElemType::U8;
    }
    match first {
        "F32" => ElemType::F32,
        "BF16" => ElemType::Bf16,
        "F16" => ElemType::F16,
        _ => ElemType::U8,
    }
}

fn codec_error(role: &str, path: &Path, e: DeltaError) -> Error {
    let why = match &e {
        DeltaError::BaseHash { .. } | DeltaError::Length { .. } => {
            format!("{e} (BASE is not the file this delta was made from)")
        }
        _ => e.to_string(),
    };
    bad(format!("{role} {}: {why}", path.display()))
}

fn diff(
    base_path: &Path,
    new_path: &Path,
    out: &Path,
    chunk_size: usize,
    zstd_level: i32,
) -> Result<String> {
    let base_bytes = read("BASE", base_path)?;
    let new_bytes = read("NEW", new_path)?;
    let base = st_file("BASE", base_path, &base_bytes)?;
    let new = st_file("NEW", new_path, &new_bytes)?;
    if let Some(d) = first_difference(&base.table, &new.table) {
        return Err(bad(format!(
            "BASE {} and NEW {} do not have identical tensor tables: {d}",
            base_path.display(),
            new_path.display()
        )));
    }
    let params = EncodeParams {
        chunk_size,
        elem: elem_of(&new.table),
        zstd_level,
    };
    params.validate().map_err(|e| bad(e.to_string()))?;
    let encoded = delta::encode(
        &params,
        Image::new(BASE_VERSION, base.data),
        Image::new(NEW_VERSION, new.data),
    )
    .map_err(|e| bad(e.to_string()))?;
    let mut file = Vec::with_capacity(PREFIX_LEN + new.header.len() + encoded.bytes.len());
    file.extend_from_slice(&MAGIC);
    file.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    file.extend_from_slice(&[0u8; 6]);
    file.extend_from_slice(&(new.header.len() as u64).to_le_bytes());
    file.extend_from_slice(&ContentHash::of(&new_bytes).0);
    file.extend_from_slice(&ContentHash::of(new.header).0);
    file.extend_from_slice(new.header);
    file.extend_from_slice(&encoded.bytes);
    write_atomic(out, &file)?;
    let s = &encoded.summary;
    Ok(format!(
        "wrote {}: {} bytes for a {}-byte NEW ({:.2}%); {} chunks: {}\n",
        out.display(),
        file.len(),
        new_bytes.len(),
        100.0 * file.len() as f64 / new_bytes.len().max(1) as f64,
        s.chunks.iter().sum::<u64>(),
        s.label().trim_start_matches("delta:")
    ))
}

/// A delta file split into its parts.
struct DeltaFile<'a> {
    new_header: &'a [u8],
    new_table: Vec<TensorRow>,
    new_hash: ContentHash,
    codec: &'a [u8],
}

fn delta_file<'a>(path: &Path, bytes: &'a [u8]) -> Result<DeltaFile<'a>> {
    let what = |m: String| bad(format!("delta {}: {m}", path.display()));
    if bytes.len() < PREFIX_LEN || bytes[..8] != MAGIC {
        return Err(what(
            "not a sluice delta file (no `SLUICEDF` magic, or shorter than its prefix)".into(),
        ));
    }
    if bytes[10..16] != [0; 6] {
        return Err(what(
            "reserved bytes 10..16 are not zero (corrupt delta)".into(),
        ));
    }
    let version = u16::from_le_bytes([bytes[8], bytes[9]]);
    if version != FORMAT_VERSION {
        return Err(what(format!(
            "delta file format {version} is not supported (this build reads {FORMAT_VERSION})"
        )));
    }
    let mut h = [0u8; 8];
    h.copy_from_slice(&bytes[16..24]);
    let header_len = u64::from_le_bytes(h);
    let end = usize::try_from(header_len)
        .ok()
        .and_then(|h| h.checked_add(PREFIX_LEN))
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| {
            what(format!(
                "NEW's header length {header_len} runs past the end (truncated or corrupt)"
            ))
        })?;
    let mut hash = [0u8; 32];
    hash.copy_from_slice(&bytes[24..56]);
    let mut header_hash = [0u8; 32];
    header_hash.copy_from_slice(&bytes[56..88]);
    let new_header = &bytes[PREFIX_LEN..end];
    if ContentHash::of(new_header) != ContentHash(header_hash) {
        return Err(what(
            "NEW's header does not match its blake3 (corrupt or truncated delta)".into(),
        ));
    }
    let new_table = new_header
        .get(8..)
        .ok_or_else(|| "shorter than its length prefix".to_string())
        .and_then(table_of)
        .map_err(|m| what(format!("NEW's header: {m}")))?;
    Ok(DeltaFile {
        new_header,
        new_table,
        new_hash: ContentHash(hash),
        codec: &bytes[end..],
    })
}

fn apply(base_path: &Path, delta_path: &Path, out: &Path) -> Result<String> {
    let base_bytes = read("BASE", base_path)?;
    let delta_bytes = read("delta", delta_path)?;
    let base = st_file("BASE", base_path, &base_bytes)?;
    let d = delta_file(delta_path, &delta_bytes)?;
    if let Some(diff) = first_difference(&base.table, &d.new_table) {
        return Err(bad(format!(
            "BASE {} does not have the delta's tensor table: {diff}",
            base_path.display()
        )));
    }
    let mut data = Vec::new();
    delta::apply(d.codec, Image::new(BASE_VERSION, base.data), &mut data)
        .map_err(|e| codec_error("delta", delta_path, e))?;
    // The codec checked the data and NEW's header its hash; the whole file is checked too.
    let mut file = Vec::with_capacity(d.new_header.len() + data.len());
    file.extend_from_slice(d.new_header);
    file.extend_from_slice(&data);
    let got = ContentHash::of(&file);
    if got != d.new_hash {
        return Err(bad(format!(
            "delta {}: the rebuilt file hashes to {got}, not {} as the delta says (corrupt \
             delta); nothing written",
            delta_path.display(),
            d.new_hash
        )));
    }
    write_atomic(out, &file)?;
    Ok(format!(
        "wrote {}: {} bytes, blake3 {got} (verified)\n",
        out.display(),
        file.len()
    ))
}

fn inspect(delta_path: &Path) -> Result<String> {
    let bytes = read("delta", delta_path)?;
    let d = delta_file(delta_path, &bytes)?;
    let parsed = delta::parse(d.codec).map_err(|e| codec_error("delta", delta_path, e))?;
    let h = &parsed.header;
    let full = d.new_header.len() as u64 + h.image_len;
    let mut s = String::new();
    use std::fmt::Write as _;
    let _ = writeln!(
        s,
        "{}: sluice delta file format {FORMAT_VERSION}; NEW is {full} bytes ({}-byte header, blake3 {})",
        delta_path.display(),
        d.new_header.len(),
        d.new_hash
    );
    let _ = writeln!(
        s,
        "data: {} bytes as {}, {} chunks of {} bytes; base blake3 {}, new blake3 {}",
        h.image_len,
        h.elem.name(),
        parsed.chunks.len(),
        h.chunk_size,
        h.base_hash,
        h.new_hash
    );
    let _ = writeln!(
        s,
        "{:>7} {:>14} {:>10} {:<9} {:>10}",
        "chunk", "offset", "length", "encoding", "bytes"
    );
    for (i, c) in parsed.chunks.iter().enumerate() {
        let _ = writeln!(
            s,
            "{i:>7} {:>14} {:>10} {:<9} {:>10}",
            c.image_offset,
            c.image_len,
            c.encoding.name(),
            c.payload_len
        );
    }
    let summary = parsed.summary();
    let _ = writeln!(s, "{:<9} {:>7} {:>14}", "encoding", "chunks", "bytes");
    for e in Encoding::ALL {
        let _ = writeln!(
            s,
            "{:<9} {:>7} {:>14}",
            e.name(),
            summary.chunks[e.index()],
            summary.payload_bytes[e.index()]
        );
    }
    let overhead = summary.overhead_bytes + (PREFIX_LEN + d.new_header.len()) as u64;
    let _ = writeln!(
        s,
        "total: {} bytes = {:.2}% of NEW's {full} bytes (overhead: {overhead} bytes of prefix, NEW header, delta header, table and checksum)",
        bytes.len(),
        100.0 * bytes.len() as f64 / full.max(1) as f64
    );
    Ok(s)
}
