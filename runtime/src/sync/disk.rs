//! The disk publication path: the learner writes each version as a safetensors checkpoint and
//! then a small pointer file naming it; engines poll the pointer and hot-reload a new version.
//!
//! Writes are atomic ([`checkpoint::write_atomic`]: temp file in the same folder, fsync, rename,
//! fsync of the folder), and the pointer is written last, so a reader following the pointer
//! finds a whole file. The pointer also records the file's length and blake3, and the poller
//! checks both before parsing: a file that is shorter or different (a writer that died, a
//! pointer written out of order by a broken writer, a disk error) is refused with
//! [`DiskError::Incomplete`] and the engine keeps what it runs. Temp files (`*.tmp`) are never
//! read. The checkpoint's own checks (header, per-tensor checksums, architecture) follow.
//!
//! Files in the folder: `weights-v<N>.safetensors` (the last `keep` versions; older ones are
//! removed after the pointer moves on) and `weights.version`, one line of JSON:
//! `{"blake3":"<64 hex>","bytes":N,"file":"weights-vN.safetensors","format":"sluice-weights-pointer","version":N}`.

use super::content_hash::ContentHash;
use crate::trajectory::WeightVersion;
use sluice_model::checkpoint;
use sluice_model::kernels::Backend;
use sluice_model::{Arena, ModelConfig};
use std::collections::VecDeque;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The pointer file's name in the publication folder.
pub const POINTER_FILE: &str = "weights.version";
/// The pointer's `format` field.
pub const POINTER_FORMAT: &str = "sluice-weights-pointer";
/// The checkpoint metadata key (under `sluice.meta.`) holding the weight version.
pub const VERSION_META_KEY: &str = "weight_version";

/// The file name of version `v`.
pub fn weights_file_name(v: WeightVersion) -> String {
    format!("weights-v{}.safetensors", v.0)
}

/// What can go wrong on the disk path. A poller error leaves the engine on what it runs.
#[derive(Debug)]
pub enum DiskError {
    /// A file or folder could not be read or written.
    Io { path: PathBuf, message: String },
    /// The pointer file is not a pointer this build reads.
    Pointer { path: PathBuf, message: String },
    /// The file the pointer names is missing, shorter or different from what the pointer says:
    /// being written or left by a writer that died. Not loaded; poll again later.
    Incomplete { path: PathBuf, message: String },
    /// The file is whole but not a loadable checkpoint of the expected version.
    Checkpoint { path: PathBuf, message: String },
    /// Versions must increase.
    NotNewer {
        version: WeightVersion,
        latest: WeightVersion,
    },
}

impl fmt::Display for DiskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiskError::Io { path, message } => write!(f, "{}: {message}", path.display()),
            DiskError::Pointer { path, message } => {
                write!(f, "weights pointer {}: {message}", path.display())
            }
            DiskError::Incomplete { path, message } => write!(
                f,
                "published weights {} are incomplete or damaged, not loaded: {message}",
                path.display()
            ),
            DiskError::Checkpoint { path, message } => {
                write!(f, "published weights {}: {message}", path.display())
            }
            DiskError::NotNewer { version, latest } => write!(
                f,
                "cannot publish {version}: versions must increase and {latest} is already published"
            ),
        }
    }
}

impl std::error::Error for DiskError {}

fn io_err(path: &Path, e: impl fmt::Display) -> DiskError {
    DiskError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// One version written to disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskPublication {
    pub version: WeightVersion,
    pub path: PathBuf,
    /// The file's length (DESIGN 9 `sync_bytes` for the disk path).
    pub bytes: u64,
    pub hash: ContentHash,
}

/// The pointer file's contents.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Pointer {
    version: WeightVersion,
    file: String,
    bytes: u64,
    hash: ContentHash,
}

impl Pointer {
    fn to_json(&self) -> String {
        serde_json::json!({
            "format": POINTER_FORMAT,
            "version": self.version.0,
            "file": self.file,
            "bytes": self.bytes,
            "blake3": self.hash.to_hex(),
        })
        .to_string()
            + "\n"
    }

    fn parse(text: &str) -> Result<Pointer, String> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        if v["format"] != POINTER_FORMAT {
            return Err(format!(
                "`format` is {}, not `{POINTER_FORMAT}`",
                v["format"]
            ));
        }
        let field = |k: &str| {
            v[k].as_u64()
                .ok_or_else(|| format!("`{k}` is not an integer"))
        };
        let file = v["file"]
            .as_str()
            .ok_or("`file` is not a string")?
            .to_string();
        // A plain name in the folder: the pointer cannot send the reader anywhere else.
        if file.is_empty() || file.contains(['/', '\\']) || file.starts_with('.') {
            return Err(format!("`file` {file:?} is not a file name in the folder"));
        }
        let hash = v["blake3"]
            .as_str()
            .and_then(ContentHash::from_hex)
            .ok_or("`blake3` is not 64 hex digits")?;
        Ok(Pointer {
            version: WeightVersion(field("version")?),
            file,
            bytes: field("bytes")?,
            hash,
        })
    }
}

/// The learner's side: writes versions into a folder.
#[derive(Debug)]
pub struct DiskPublisher {
    dir: PathBuf,
    keep: usize,
    /// Versions written, oldest first.
    written: VecDeque<WeightVersion>,
    /// The newest file's bytes (to rewrite it if a reader finds it damaged, see [`repair`]).
    last: Option<Arc<[u8]>>,
}

impl DiskPublisher {
    /// Publishes into `dir` (created if missing), keeping the last `keep` files (at least 2, so
    /// a reader that has just read the pointer still finds its file after one more publish).
    pub fn new(dir: &Path, keep: usize) -> Result<DiskPublisher, DiskError> {
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        Ok(DiskPublisher {
            dir: dir.to_path_buf(),
            keep: keep.max(2),
            written: VecDeque::new(),
            last: None,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The bytes of the newest file written (one copy of the file, kept in memory).
    pub fn last_file(&self) -> Option<Arc<[u8]>> {
        self.last.clone()
    }

    /// Writes `params` as version `version` (newer than any before), then points the pointer at
    /// it. A crash at any moment leaves the pointer naming a whole earlier file (or no pointer).
    pub fn publish(
        &mut self,
        version: WeightVersion,
        config: &ModelConfig,
        params: &Arena,
    ) -> Result<DiskPublication, DiskError> {
        if let Some(&latest) = self.written.back() {
            if version <= latest {
                return Err(DiskError::NotNewer { version, latest });
            }
        }
        let file = weights_file_name(version);
        let path = self.dir.join(&file);
        let bytes = checkpoint::to_bytes_with_meta(
            config,
            params,
            &[],
            &[(VERSION_META_KEY, version.0.to_string())],
        )
        .map_err(|e| DiskError::Checkpoint {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let hash = ContentHash::of(&bytes);
        checkpoint::write_atomic(&path, &bytes).map_err(|e| io_err(&path, e))?;
        let len = bytes.len() as u64;
        self.last = Some(Arc::from(bytes));
        let pointer = Pointer {
            version,
            file,
            bytes: len,
            hash,
        };
        let pointer_path = self.dir.join(POINTER_FILE);
        checkpoint::write_atomic(&pointer_path, pointer.to_json().as_bytes())
            .map_err(|e| io_err(&pointer_path, e))?;
        self.written.push_back(version);
        while self.written.len() > self.keep {
            if let Some(old) = self.written.pop_front() {
                // A reader still holding the old file open keeps reading it (Unix); one that
                // opens it after this sees it missing and polls again.
                let _ = std::fs::remove_file(self.dir.join(weights_file_name(old)));
            }
        }
        Ok(DiskPublication {
            version,
            path,
            bytes: len,
            hash,
        })
    }
}

/// Rewrites the file of `publication` whole from `bytes` (atomically), after a reader found it
/// short or damaged; the pointer already names it with its length and hash. Refuses bytes
/// that are not the published file.
pub fn repair(publication: &DiskPublication, bytes: &[u8]) -> Result<(), DiskError> {
    let got = ContentHash::of(bytes);
    if got != publication.hash || bytes.len() as u64 != publication.bytes {
        return Err(DiskError::Checkpoint {
            path: publication.path.clone(),
            message: format!(
                "repair with {} bytes hashing to {got}, but {} was published as {} bytes \
                 hashing to {}",
                bytes.len(),
                publication.version,
                publication.bytes,
                publication.hash
            ),
        });
    }
    checkpoint::write_atomic(&publication.path, bytes).map_err(|e| io_err(&publication.path, e))
}

/// A version loaded by the poller.
#[derive(Debug)]
pub struct DiskUpdate {
    pub version: WeightVersion,
    pub config: ModelConfig,
    pub params: Arena,
    /// blake3 of the file.
    pub hash: ContentHash,
    /// The file's length.
    pub bytes: u64,
    pub path: PathBuf,
}

/// Counts of what a poller did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PollerStats {
    pub polls: u64,
    pub loads: u64,
    /// Polls that found a newer version they could not load (each returned an error).
    pub refused: u64,
}

/// The engine's side: polls the pointer and loads newer versions.
#[derive(Debug)]
pub struct DiskPoller {
    dir: PathBuf,
    installed: Option<WeightVersion>,
    stats: PollerStats,
}

impl DiskPoller {
    /// A poller of `dir` that has loaded nothing.
    pub fn new(dir: &Path) -> DiskPoller {
        DiskPoller {
            dir: dir.to_path_buf(),
            installed: None,
            stats: PollerStats::default(),
        }
    }

    /// A poller of `dir` whose engine already runs `version` (it loads only newer ones).
    pub fn starting_at(dir: &Path, version: WeightVersion) -> DiskPoller {
        DiskPoller {
            installed: Some(version),
            ..DiskPoller::new(dir)
        }
    }

    /// The version last loaded.
    pub fn installed(&self) -> Option<WeightVersion> {
        self.installed
    }

    pub fn stats(&self) -> PollerStats {
        self.stats
    }

    /// Loads the pointed-at version onto `backend` if it is newer than the last one loaded.
    /// `Ok(None)`: nothing new (or nothing published yet). `Err`: a newer version exists but
    /// cannot be loaded now; nothing changes, and a later poll tries again.
    pub fn poll(&mut self, backend: &Backend) -> Result<Option<DiskUpdate>, DiskError> {
        self.stats.polls += 1;
        let result = self.try_poll(backend);
        match &result {
            Ok(Some(update)) => {
                self.installed = Some(update.version);
                self.stats.loads += 1;
            }
            Ok(None) => {}
            Err(_) => self.stats.refused += 1,
        }
        result
    }

    fn try_poll(&self, backend: &Backend) -> Result<Option<DiskUpdate>, DiskError> {
        let pointer_path = self.dir.join(POINTER_FILE);
        let text = match std::fs::read_to_string(&pointer_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&pointer_path, e)),
        };
        let pointer = Pointer::parse(&text).map_err(|message| DiskError::Pointer {
            path: pointer_path.clone(),
            message,
        })?;
        if self.installed.is_some_and(|v| pointer.version <= v) {
            return Ok(None);
        }
        let path = self.dir.join(&pointer.file);
        let incomplete = |message: String| DiskError::Incomplete {
            path: path.clone(),
            message,
        };
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(incomplete(format!(
                    "the pointer names {} ({}), which does not exist",
                    pointer.file, pointer.version
                )))
            }
            Err(e) => return Err(io_err(&path, e)),
        };
        if bytes.len() as u64 != pointer.bytes {
            return Err(incomplete(format!(
                "{} bytes, the pointer says {}",
                bytes.len(),
                pointer.bytes
            )));
        }
        let hash = ContentHash::of(&bytes);
        if hash != pointer.hash {
            return Err(incomplete(format!(
                "blake3 {hash}, the pointer says {}",
                pointer.hash
            )));
        }
        let checkpoint_err = |message: String| DiskError::Checkpoint {
            path: path.clone(),
            message,
        };
        let (config, params, meta) = checkpoint::load_new_from_bytes(bytes, &path, backend)
            .map_err(|e| checkpoint_err(e.to_string()))?;
        let recorded = meta.get(VERSION_META_KEY).map(String::as_str);
        if recorded != Some(pointer.version.0.to_string().as_str()) {
            return Err(checkpoint_err(format!(
                "its metadata `sluice.meta.{VERSION_META_KEY}` is {recorded:?}, the pointer says {}",
                pointer.version.0
            )));
        }
        Ok(Some(DiskUpdate {
            version: pointer.version,
            config,
            params,
            hash,
            bytes: pointer.bytes,
            path,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_round_trips_and_rejects_paths_outside_the_folder() {
        let p = Pointer {
            version: WeightVersion(7),
            file: weights_file_name(WeightVersion(7)),
            bytes: 1234,
            hash: ContentHash::of(b"x"),
        };
        assert_eq!(Pointer::parse(&p.to_json()), Ok(p.clone()));
        for bad in ["../w.safetensors", "/etc/passwd", ".hidden", ""] {
            let text = p.to_json().replace(&p.file, bad);
            let err = Pointer::parse(&text).unwrap_err();
            assert!(err.contains("`file`"), "{bad}: {err}");
        }
        let err = Pointer::parse("{\"format\":\"other\"}").unwrap_err();
        assert!(err.contains("format"), "{err}");
    }
}
