//! The files of `sluice determinism`: a record (one run's digest of every output, with what
//! produced it) and the versioned JSON they are written in.
//!
//! A tensor's digest is blake3 over a self-describing header and its bytes ([`digest`]): the
//! scheme's name and version, the dtype, the rank and each dimension, then the elements as they
//! lie in memory (little endian). Two digests are equal exactly when dtype, shape and every bit
//! agree. The scheme's version is [`DIGEST_VERSION`]; the file layout's is [`VERSION`]. A file
//! of another version is refused by name (exit 2), never read as if it were this one.

use super::class::{Class, Machine};
use super::DetError;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sluice_kernels::DType;
use std::collections::BTreeMap;
use std::path::Path;

/// The `format` field of every file this tool writes.
pub const FORMAT: &str = "sluice-determinism";
/// The layout version of records and goldens; bump it when a field changes meaning.
pub const VERSION: u64 = 1;
/// The digest scheme ([`digest`]); part of the header every digest hashes.
pub const DIGEST_VERSION: u64 = 1;

/// blake3 of `"sluice-tensor/" DIGEST_VERSION 0x00 dtype 0x00 rank shape... bytes` (rank and
/// each dimension as u64 little endian), in hex.
pub fn digest(dtype: DType, shape: &[usize], bytes: &[u8]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(format!("sluice-tensor/{DIGEST_VERSION}").as_bytes());
    h.update(&[0]);
    h.update(dtype.name().as_bytes());
    h.update(&[0]);
    h.update(&(shape.len() as u64).to_le_bytes());
    for &d in shape {
        h.update(&(d as u64).to_le_bytes());
    }
    h.update(bytes);
    h.finalize().to_hex().to_string()
}

/// One digested output: which workload (`op`), which of its cases, which tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub op: String,
    pub case: String,
    pub tensor: String,
    pub shape: Vec<usize>,
    pub dtype: String,
    pub digest: String,
}

impl Entry {
    /// The entry's identity in a record: `op [case] tensor`.
    pub fn key(&self) -> String {
        format!("{} [{}] {}", self.op, self.case, self.tensor)
    }

    /// `op [case] tensor [shape] DTYPE`, as messages name an entry.
    pub fn describe(&self) -> String {
        format!("{} {:?} {}", self.key(), self.shape, self.dtype)
    }
}

/// One run of every selected workload, digested.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub format: String,
    pub kind: String,
    pub version: u64,
    pub digest_version: u64,
    pub preset: String,
    pub device: String,
    pub class: Class,
    pub machine: Machine,
    /// The commit the binary was built from (`-dirty` when the tree differed at build time).
    pub commit: String,
    /// Threads of the CPU references' pool (rayon) in the process that computed the record.
    pub threads: usize,
    /// `SLUICE_EMU_THREADS` and `SLUICE_EMU_SEED` of that process (emu only; None elsewhere).
    pub emu_threads: Option<String>,
    pub emu_seed: Option<u64>,
    /// Processes whose records agreed (1 for a single record; N after `run --runs N`).
    pub runs: usize,
    /// The ops selected by `--ops` (empty: every workload).
    pub ops: Vec<String>,
    /// Seconds each workload took in that process (informative; never compared).
    pub seconds: BTreeMap<String, f64>,
    pub entries: Vec<Entry>,
}

impl Record {
    /// The entries by key (the file guarantees keys are unique).
    pub fn by_key(&self) -> BTreeMap<String, &Entry> {
        self.entries.iter().map(|e| (e.key(), e)).collect()
    }
}

/// Reads a JSON file of this tool: checks, in this order, that it is complete JSON, that it is
/// one of ours (`format`), of the expected `kind`, and of this version; then its fields. Every
/// failure is bad input naming the file and what is wrong.
pub fn read_file<T: for<'de> Deserialize<'de>>(path: &Path, kind: &str) -> Result<T, DetError> {
    let bytes = std::fs::read(path)
        .map_err(|e| DetError::Input(format!("{}: cannot read it: {e}", path.display())))?;
    parse(&bytes, kind).map_err(|m| DetError::Input(format!("{}: {m}", path.display())))
}

/// [`read_file`] on bytes already read; the message does not name a file.
pub fn parse<T: for<'de> Deserialize<'de>>(bytes: &[u8], kind: &str) -> Result<T, String> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        if e.is_eof() {
            format!("the JSON ends early ({e}): the file is truncated")
        } else {
            format!("not valid JSON: {e}")
        }
    })?;
    let field = |name: &str| value.get(name);
    match field("format").and_then(Value::as_str) {
        Some(FORMAT) => {}
        Some(other) => {
            return Err(format!(
                "its format is {other:?}, not {FORMAT:?}: not a file of `sluice determinism`"
            ))
        }
        None => {
            return Err(format!(
                "no \"format\": {FORMAT:?} field: not a file of `sluice determinism`"
            ))
        }
    }
    match field("version").and_then(Value::as_u64) {
        Some(VERSION) => {}
        Some(v) => {
            return Err(format!(
                "format version {v}; this sluice reads version {VERSION} (write it again with \
                 this sluice, or read it with the one that wrote it)"
            ))
        }
        None => return Err("no numeric \"version\" field".to_string()),
    }
    match field("kind").and_then(Value::as_str) {
        Some(k) if k == kind => {}
        Some(k) => return Err(format!("a {k} file, where a {kind} file is expected")),
        None => return Err("no \"kind\" field".to_string()),
    }
    match field("digest_version").and_then(Value::as_u64) {
        Some(DIGEST_VERSION) => {}
        Some(v) => {
            return Err(format!(
                "digest scheme version {v}; this sluice digests with version {DIGEST_VERSION}, \
                 so no digest in it can be compared"
            ))
        }
        None => return Err("no numeric \"digest_version\" field".to_string()),
    }
    let parsed: T = serde_json::from_value(value).map_err(|e| format!("{e}"))?;
    Ok(parsed)
}

/// Checks what serde cannot: every entry's dtype, digest and uniqueness.
pub fn validate_entries(entries: &[Entry]) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    for e in entries {
        if !["F32", "BF16", "I32", "U8", "U64"].contains(&e.dtype.as_str()) {
            return Err(format!("{}: unknown dtype {:?}", e.key(), e.dtype));
        }
        if e.digest.len() != 64 || !e.digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "{}: digest {:?} is not 64 hex digits",
                e.key(),
                e.digest
            ));
        }
        if !seen.insert(e.key()) {
            return Err(format!("{} appears twice", e.key()));
        }
    }
    Ok(())
}

/// Reads a record file (`run --json`, `record`), validated.
pub fn read_record(path: &Path) -> Result<Record, DetError> {
    let r: Record = read_file(path, "record")?;
    validate_entries(&r.entries)
        .map_err(|m| DetError::Input(format!("{}: {m}", path.display())))?;
    Ok(r)
}

/// A file with an `entries` array at its top level (a record, a golden).
pub trait WithEntries: Serialize + Clone {
    fn entries(&self) -> &[Entry];
    /// The same value with no entries (the rest is written as it is).
    fn without_entries(&self) -> Self;
}

impl WithEntries for Record {
    fn entries(&self) -> &[Entry] {
        &self.entries
    }
    fn without_entries(&self) -> Self {
        Record {
            entries: Vec::new(),
            ..self.clone()
        }
    }
}

/// Pretty JSON, except that each entry takes one line: a golden's diff in review then shows one
/// line per changed tensor.
pub fn to_json_text<T: WithEntries>(value: &T) -> Result<String, DetError> {
    let enc = |e: serde_json::Error| DetError::Run(format!("internal: cannot encode JSON: {e}"));
    let mut text = serde_json::to_string_pretty(&value.without_entries()).map_err(enc)?;
    let entries = value.entries();
    if !entries.is_empty() {
        const HOLE: &str = "\n  \"entries\": []";
        let lines = entries
            .iter()
            .map(|e| serde_json::to_string(e).map(|t| format!("    {t}")))
            .collect::<Result<Vec<_>, _>>()
            .map_err(enc)?;
        if text.matches(HOLE).count() != 1 {
            return Err(DetError::Run(
                "internal: no single top-level `entries` in the JSON written".to_string(),
            ));
        }
        text = text.replacen(
            HOLE,
            &format!("\n  \"entries\": [\n{}\n  ]", lines.join(",\n")),
            1,
        );
    }
    text.push('\n');
    Ok(text)
}

/// Writes a record or golden as [`to_json_text`] does.
pub fn write_entries_json<T: WithEntries>(path: &Path, value: &T) -> Result<(), DetError> {
    write_text(path, &to_json_text(value)?)
}

/// Writes `value` as pretty JSON with a final newline.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), DetError> {
    let mut text = serde_json::to_string_pretty(value)
        .map_err(|e| DetError::Run(format!("internal: cannot encode JSON: {e}")))?;
    text.push('\n');
    write_text(path, &text)
}

fn write_text(path: &Path, text: &str) -> Result<(), DetError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| DetError::Input(format!("{}: cannot create it: {e}", dir.display())))?;
    }
    std::fs::write(path, text)
        .map_err(|e| DetError::Input(format!("{}: cannot write it: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_see_dtype_shape_and_every_bit() {
        let bytes = 1.0f32.to_le_bytes().repeat(6);
        let base = digest(DType::F32, &[2, 3], &bytes);
        assert_eq!(base.len(), 64);
        assert_eq!(base, digest(DType::F32, &[2, 3], &bytes));
        assert_ne!(base, digest(DType::F32, &[3, 2], &bytes));
        assert_ne!(base, digest(DType::I32, &[2, 3], &bytes));
        let mut flipped = bytes.clone();
        flipped[23] ^= 1;
        assert_ne!(base, digest(DType::F32, &[2, 3], &flipped));
    }

    #[test]
    fn foreign_truncated_and_other_version_files_are_named() {
        let bad = |text: &str| parse::<Value>(text.as_bytes(), "record").unwrap_err();
        assert!(bad("{\"format\": \"sluice-determinism\", \"ver").contains("truncated"));
        assert!(bad("[1, 2").contains("truncated"));
        assert!(bad("{\"a\": 1}").contains("not a file of `sluice determinism`"));
        let v2 = bad(
            "{\"format\": \"sluice-determinism\", \"version\": 2, \"kind\": \"record\", \
             \"digest_version\": 1}",
        );
        assert!(v2.contains("format version 2"), "{v2}");
        let golden = bad(
            "{\"format\": \"sluice-determinism\", \"version\": 1, \"kind\": \"golden\", \
             \"digest_version\": 1}",
        );
        assert!(
            golden.contains("a golden file, where a record file"),
            "{golden}"
        );
    }

    #[test]
    fn entries_take_one_line_each_and_read_back() {
        let e = Entry {
            op: "gemm".into(),
            case: "c".into(),
            tensor: "c".into(),
            shape: vec![2, 3],
            dtype: "F32".into(),
            digest: "a".repeat(64),
        };
        let r = Record {
            format: FORMAT.into(),
            kind: "record".into(),
            version: VERSION,
            digest_version: DIGEST_VERSION,
            preset: "ci".into(),
            device: "cpu".into(),
            class: Class::detect(&sluice_kernels::Backend::Cpu),
            machine: Machine::detect(),
            commit: "c".into(),
            threads: 1,
            emu_threads: None,
            emu_seed: None,
            runs: 1,
            ops: vec![],
            seconds: BTreeMap::new(),
            entries: vec![
                e.clone(),
                Entry {
                    tensor: "d".into(),
                    ..e
                },
            ],
        };
        let text = to_json_text(&r).unwrap();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("\"digest\"")).collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].starts_with("    {\"op\":\"gemm\",\"case\""),
            "{text}"
        );
        let back: Record = parse(text.as_bytes(), "record").unwrap();
        assert_eq!(back.entries, r.entries);
    }

    #[test]
    fn entries_are_checked() {
        let e = Entry {
            op: "gemm".into(),
            case: "c".into(),
            tensor: "c".into(),
            shape: vec![1],
            dtype: "F32".into(),
            digest: "0".repeat(64),
        };
        assert!(validate_entries(std::slice::from_ref(&e)).is_ok());
        assert!(validate_entries(&[e.clone(), e.clone()])
            .unwrap_err()
            .contains("twice"));
        let odd = Entry {
            dtype: "F16".into(),
            ..e.clone()
        };
        assert!(validate_entries(&[odd]).unwrap_err().contains("dtype"));
        let short = Entry {
            digest: "abc".into(),
            ..e
        };
        assert!(validate_entries(&[short]).unwrap_err().contains("64 hex"));
    }
}
