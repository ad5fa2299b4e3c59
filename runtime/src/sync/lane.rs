//! The three publication paths inside a run (`sync.path`, DESIGN 6.6): what the learner lane
//! makes of a publication ([`SyncSource`]) and what each engine replica lane installs
//! ([`SyncSink`]).
//!
//! - `inprocess`: the learner's arena copy (`Arc<Arena>`: f32, or the bf16 compute copy) goes
//!   to every replica as is.
//! - `delta`: the learner side keeps the last images in a [`Publisher`]; each replica gets a
//!   delta against the version it holds (or the full image when it holds nothing the publisher
//!   still keeps); its [`Receiver`] installs only bytes whose blake3 matches. A refused
//!   publication leaves the replica on what it held and is answered with the full image.
//! - `disk`: the learner side writes safetensors and the pointer file atomically into a folder
//!   ([`DiskPublisher`]); each replica polls the pointer at the start of every unit of work
//!   and hot-reloads a newer version ([`DiskPoller`]), never a partial file. A version the
//!   poller refuses (a file that is short or different from what the pointer says) is answered
//!   by rewriting that file whole from the bytes the writer kept.
//!
//! The image every path is measured and hashed on is the engine's copy: the bytes of the
//! published arena in its dtype (little-endian, padding included: f32, or in bf16 the bf16
//! compute copy, half the bytes), the same bytes the learner publishes. The disk path writes
//! a bf16 copy as an f32 checkpoint (widened exactly); a replica narrows what it loads back to
//! its engine's dtype (exact) before hashing, so the hash is the published image's.
//! Every publication carries the blake3 of that image, and every install reports the blake3 of
//! what the replica now runs on, so a run can check after every publication that each replica
//! holds exactly the learner's weights.
//!
//! [`SyncFault`]s inject damage for tests: a delta corrupted in transit (one flipped byte, a
//! truncation, a wrong base version), a disk file torn after its pointer moved, or a writer
//! killed in the middle of its temp file.

use super::content_hash::ContentHash;
use super::delta::EncodeParams;
use super::disk::{self, DiskPoller, DiskPublication, DiskPublisher};
use super::publish::{Payload, Publication, Publisher, Receiver};
use crate::engine::Engine;
use crate::learner;
use crate::trajectory::WeightVersion;
use sluice_kernels::{Backend, DType, Tensor};
use sluice_model::checkpoint;
use sluice_model::{Arena, Layout, ModelConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Images the delta publisher keeps: the newest, the one receivers hold, and one older (so a
/// receiver one publication behind still gets a delta).
const DELTA_RETAIN: usize = 3;
/// Files the disk publisher keeps.
const DISK_KEEP: usize = 3;

/// Which path publications take (`sync.path`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SyncPath {
    InProcess,
    Delta,
    /// Safetensors files and the pointer in this folder (created if missing; stale weight
    /// files and pointers in it are removed when a stage starts).
    Disk(PathBuf),
}

impl SyncPath {
    pub fn name(&self) -> &'static str {
        match self {
            SyncPath::InProcess => "inprocess",
            SyncPath::Delta => "delta",
            SyncPath::Disk(_) => "disk",
        }
    }
}

/// Damage injected into one publication (tests). Versions are the learner's weight versions,
/// replicas their index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncFault {
    /// Delta path: the bytes sent to `replica` for `version` have one byte flipped (the middle
    /// one) on the way.
    FlipByte { version: u64, replica: usize },
    /// Delta path: the bytes sent to `replica` for `version` are cut to half their length.
    Truncate { version: u64, replica: usize },
    /// Delta path: `replica` is sent a delta for `version` made against an older version than
    /// the one it holds.
    WrongBase { version: u64, replica: usize },
    /// Disk path: the file of `version` is cut to half its length after the pointer names it
    /// (what a reader finds when the data never reached the disk but the pointer did).
    TornFile { version: u64 },
    /// Disk path: the writer dies half way through the temp file of `version`; the pointer
    /// stays on the previous version and `version` is never published.
    KilledWriter { version: u64 },
}

impl SyncFault {
    fn version(&self) -> u64 {
        match *self {
            SyncFault::FlipByte { version, .. }
            | SyncFault::Truncate { version, .. }
            | SyncFault::WrongBase { version, .. }
            | SyncFault::TornFile { version }
            | SyncFault::KilledWriter { version } => version,
        }
    }

    fn replica(&self) -> Option<usize> {
        match *self {
            SyncFault::FlipByte { replica, .. }
            | SyncFault::Truncate { replica, .. }
            | SyncFault::WrongBase { replica, .. } => Some(replica),
            _ => None,
        }
    }
}

/// How a stage publishes.
#[derive(Clone, Debug, PartialEq)]
pub struct SyncOptions {
    pub path: SyncPath,
    /// Delta parameters (chunk size, element type, zstd level).
    pub encode: EncodeParams,
    pub faults: Vec<SyncFault>,
}

impl Default for SyncOptions {
    fn default() -> Self {
        SyncOptions {
            path: SyncPath::InProcess,
            encode: EncodeParams::default(),
            faults: Vec::new(),
        }
    }
}

impl SyncOptions {
    /// Checks the options against the stage: faults name the right path and replicas that
    /// exist.
    pub fn validate(&self, replicas: usize) -> Result<(), String> {
        self.encode.validate().map_err(|e| format!("sync: {e}"))?;
        for f in &self.faults {
            let disk_fault = matches!(
                f,
                SyncFault::TornFile { .. } | SyncFault::KilledWriter { .. }
            );
            let ok = match self.path {
                SyncPath::Disk(_) => disk_fault,
                SyncPath::Delta => !disk_fault,
                SyncPath::InProcess => false,
            };
            if !ok {
                return Err(format!(
                    "sync fault {f:?} does not apply to sync.path = {}",
                    self.path.name()
                ));
            }
            if f.replica().is_some_and(|r| r >= replicas) {
                return Err(format!(
                    "sync fault {f:?} names a replica beyond the {replicas} of the stage"
                ));
            }
            if matches!(f, SyncFault::WrongBase { .. }) && f.version() < 2 {
                return Err(format!(
                    "sync fault {f:?}: a wrong base needs a version older than the one held \
                     (version 2 or later)"
                ));
            }
        }
        Ok(())
    }
}

/// The little-endian bytes of an arena in its dtype (F32, or BF16: 2 bytes a value; padding
/// included), from any device.
pub fn arena_bytes(arena: &Arena) -> Result<Vec<u8>, String> {
    match arena.dtype() {
        DType::BF16 => {
            let values = arena
                .tensor()
                .to_vec::<half::bf16>()
                .map_err(|e| e.to_string())?;
            let mut out = Vec::with_capacity(values.len() * 2);
            for v in values {
                out.extend_from_slice(&v.to_bits().to_le_bytes());
            }
            Ok(out)
        }
        _ => {
            let values = arena.to_vec().map_err(|e| e.to_string())?;
            let mut out = Vec::with_capacity(values.len() * 4);
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
            Ok(out)
        }
    }
}

/// An arena of `layout` on `backend` holding `bytes` (little-endian): F32 when there are 4
/// bytes per value of the layout, BF16 when there are 2 (what [`arena_bytes`] made).
pub fn arena_from_bytes(
    backend: &Backend,
    layout: &Arc<Layout>,
    bytes: &[u8],
) -> Result<Arena, String> {
    let n = layout.len();
    if bytes.len() == n * 4 {
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        return Arena::from_f32(backend, layout.clone(), &values).map_err(|e| e.to_string());
    }
    if bytes.len() == n * 2 {
        let values: Vec<half::bf16> = bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect();
        let t = Tensor::from_slice(backend, &[n], &values).map_err(|e| e.to_string())?;
        return Arena::from_tensor(layout.clone(), t).map_err(|e| e.to_string());
    }
    Err(format!(
        "{} bytes of weights for a layout of {n} values ({} as f32, {} as bf16)",
        bytes.len(),
        n * 4,
        n * 2
    ))
}

/// `arena` in the dtype `engine` computes in: itself when it is, else a converted copy (a disk
/// checkpoint of a bf16 publication is f32 holding bf16 values, so narrowing it back is exact).
fn in_engine_dtype(engine_dtype: DType, backend: &Backend, arena: Arena) -> Result<Arena, String> {
    if arena.dtype() == engine_dtype {
        return Ok(arena);
    }
    arena
        .cast_copy(backend, engine_dtype)
        .map_err(|e| e.to_string())
}

/// The image a stage starts from (what every engine was built with).
#[derive(Clone, Debug)]
pub struct StartImage {
    pub version: WeightVersion,
    pub hash: ContentHash,
    pub bytes: Arc<[u8]>,
}

impl StartImage {
    pub fn of(p: &learner::Publication) -> Result<StartImage, String> {
        let bytes = arena_bytes(&p.params)?;
        Ok(StartImage {
            version: p.version,
            hash: ContentHash::of(&bytes),
            bytes: Arc::from(bytes),
        })
    }
}

/// What one replica is sent for one publication.
#[derive(Clone, Debug)]
pub enum Delivery {
    /// In process: the learner's arena copy.
    Arena {
        publication: Arc<learner::Publication>,
        hash: ContentHash,
    },
    /// A delta or the full image, for the replica's [`Receiver`].
    Bytes(Arc<Publication>),
}

impl Delivery {
    pub fn version(&self) -> WeightVersion {
        match self {
            Delivery::Arena { publication, .. } => publication.version,
            Delivery::Bytes(p) => p.version,
        }
    }
}

/// What the learner lane made of one publication.
#[derive(Debug)]
pub struct Outgoing {
    pub version: WeightVersion,
    /// blake3 of the f32 image.
    pub hash: ContentHash,
    pub image_bytes: u64,
    /// Per replica (by index), what it is sent; None for a replica that is sent nothing (the
    /// disk path sends nothing: replicas poll the pointer).
    pub deliveries: Vec<Option<Delivery>>,
    /// Delta path: the full image, for a replica that refuses its delta or restarts.
    pub full: Option<Arc<Publication>>,
    /// Disk path: the file written and its bytes (kept to rewrite a damaged file).
    pub disk: Option<(DiskPublication, Arc<[u8]>)>,
    /// Deltas encoded for this publication (the virtual clock charges each).
    pub deltas_encoded: u64,
    /// Disk path: the writer died; nothing was published (the pointer names the previous
    /// version).
    pub failed: Option<String>,
}

impl Outgoing {
    /// Bytes sent to the replicas and how they were encoded (DESIGN 9 `sync_bytes`,
    /// `sync_encoding`): in process, the image once per replica; delta, each replica's bytes
    /// (label of the delta, or `full`; distinct labels joined by `|`); disk, the file once per
    /// live replica (each reads it whole).
    pub fn sync_metric(&self, path: &SyncPath, live_replicas: usize) -> (u64, String) {
        match path {
            SyncPath::InProcess => (self.image_bytes * live_replicas as u64, "inprocess".into()),
            SyncPath::Delta => {
                let mut bytes = 0;
                let mut labels: Vec<String> = Vec::new();
                for d in self.deliveries.iter().flatten() {
                    if let Delivery::Bytes(p) = d {
                        bytes += p.sync_bytes();
                        let l = p.sync_encoding();
                        if !labels.contains(&l) {
                            labels.push(l);
                        }
                    }
                }
                (bytes, labels.join("|"))
            }
            SyncPath::Disk(_) => match (&self.disk, &self.failed) {
                (Some((d, _)), None) => (d.bytes * live_replicas as u64, "disk".into()),
                _ => (0, "disk:failed".into()),
            },
        }
    }
}

enum SourcePath {
    InProcess,
    Delta(Publisher),
    Disk(DiskPublisher),
}

/// The learner lane's side of weight sync.
pub struct SyncSource {
    path: SourcePath,
    faults: Vec<SyncFault>,
    config: ModelConfig,
}

impl std::fmt::Debug for SyncSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = match self.path {
            SourcePath::InProcess => "inprocess",
            SourcePath::Delta(_) => "delta",
            SourcePath::Disk(_) => "disk",
        };
        write!(f, "SyncSource({p})")
    }
}

impl SyncSource {
    /// The learner side, with the stage's start weights already published (the engines were
    /// built with them): the delta publisher keeps their image, the disk path writes them.
    pub fn new(
        opts: &SyncOptions,
        config: &ModelConfig,
        start: &learner::Publication,
        image: &StartImage,
    ) -> Result<SyncSource, String> {
        let path = match &opts.path {
            SyncPath::InProcess => SourcePath::InProcess,
            SyncPath::Delta => {
                let mut p = Publisher::new(opts.encode, DELTA_RETAIN).map_err(|e| e.to_string())?;
                p.publish(image.version, &image.bytes)
                    .map_err(|e| e.to_string())?;
                SourcePath::Delta(p)
            }
            SyncPath::Disk(dir) => {
                clear_stale_files(dir)?;
                let mut p = DiskPublisher::new(dir, DISK_KEEP).map_err(|e| e.to_string())?;
                p.publish(start.version, config, &start.params)
                    .map_err(|e| e.to_string())?;
                SourcePath::Disk(p)
            }
        };
        Ok(SyncSource {
            path,
            faults: opts.faults.clone(),
            config: config.clone(),
        })
    }

    /// Publishes `p` to replicas that hold `bases` (per replica: the version it will hold
    /// when this publication reaches it; None for one that holds nothing or is down).
    pub fn publish(
        &mut self,
        p: Arc<learner::Publication>,
        bases: &[Option<WeightVersion>],
    ) -> Result<Outgoing, String> {
        let image = arena_bytes(&p.params)?;
        let hash = ContentHash::of(&image);
        let version = p.version;
        let mut out = Outgoing {
            version,
            hash,
            image_bytes: image.len() as u64,
            deliveries: Vec::with_capacity(bases.len()),
            full: None,
            disk: None,
            deltas_encoded: 0,
            failed: None,
        };
        let faults: Vec<SyncFault> = self
            .faults
            .iter()
            .copied()
            .filter(|f| f.version() == version.0)
            .collect();
        match &mut self.path {
            SourcePath::InProcess => {
                for _ in bases {
                    out.deliveries.push(Some(Delivery::Arena {
                        publication: p.clone(),
                        hash,
                    }));
                }
            }
            SourcePath::Delta(publisher) => {
                let encoded_before = publisher.stats().deltas_encoded;
                publisher
                    .publish(version, &image)
                    .map_err(|e| e.to_string())?;
                drop(image);
                out.full = Some(publisher.full().map_err(|e| e.to_string())?);
                for (i, base) in bases.iter().enumerate() {
                    let mut publication = publisher
                        .publication_for(*base)
                        .map_err(|e| e.to_string())?;
                    for f in faults.iter().filter(|f| f.replica() == Some(i)) {
                        publication = damage(publisher, publication, f, *base)?;
                    }
                    out.deliveries.push(Some(Delivery::Bytes(publication)));
                }
                out.deltas_encoded = publisher.stats().deltas_encoded - encoded_before;
            }
            SourcePath::Disk(publisher) => {
                out.deliveries = vec![None; bases.len()];
                if faults
                    .iter()
                    .any(|f| matches!(f, SyncFault::KilledWriter { .. }))
                {
                    out.failed = Some(kill_writer(publisher.dir(), &self.config, &p)?);
                    return Ok(out);
                }
                let written = publisher
                    .publish(version, &self.config, &p.params)
                    .map_err(|e| e.to_string())?;
                let bytes = publisher
                    .last_file()
                    .ok_or("the disk publisher kept no file")?;
                if faults
                    .iter()
                    .any(|f| matches!(f, SyncFault::TornFile { .. }))
                {
                    tear(&written.path, written.bytes / 2)?;
                }
                out.disk = Some((written, bytes));
            }
        }
        Ok(out)
    }
}

/// Removes what an earlier writer left in a publication folder (weight files, temp files, the
/// pointer), so a poller can never pick up a version of another run.
fn clear_stale_files(dir: &Path) -> Result<(), String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let ours = name == disk::POINTER_FILE
            || name == format!("{}.tmp", disk::POINTER_FILE)
            || (name.starts_with("weights-v")
                && (name.ends_with(".safetensors") || name.ends_with(".safetensors.tmp")));
        if ours {
            std::fs::remove_file(e.path())
                .map_err(|err| format!("{}: {err}", e.path().display()))?;
        }
    }
    Ok(())
}

/// A corrupted copy of `p` as `fault` describes.
fn damage(
    publisher: &mut Publisher,
    p: Arc<Publication>,
    fault: &SyncFault,
    base: Option<WeightVersion>,
) -> Result<Arc<Publication>, String> {
    let with_bytes = |bytes: Vec<u8>| {
        let payload = match &p.payload {
            Payload::Full(_) => Payload::Full(Arc::from(bytes)),
            Payload::Delta { base, summary, .. } => Payload::Delta {
                base: *base,
                bytes: Arc::from(bytes),
                summary: summary.clone(),
            },
        };
        Arc::new(Publication {
            version: p.version,
            hash: p.hash,
            full_bytes: p.full_bytes,
            payload,
        })
    };
    let bytes = match &p.payload {
        Payload::Full(b) => b.to_vec(),
        Payload::Delta { bytes, .. } => bytes.to_vec(),
    };
    match fault {
        SyncFault::FlipByte { .. } => {
            let mut b = bytes;
            let mid = b.len() / 2;
            if let Some(x) = b.get_mut(mid) {
                *x ^= 0x5a;
            }
            Ok(with_bytes(b))
        }
        SyncFault::Truncate { .. } => {
            let mut b = bytes;
            b.truncate(b.len() / 2);
            Ok(with_bytes(b))
        }
        SyncFault::WrongBase { .. } => {
            let older = publisher
                .retained()
                .into_iter()
                .find(|&v| Some(v) != base && v < p.version)
                .ok_or_else(|| {
                    format!(
                        "sync fault {fault:?}: the publisher keeps no version older than {:?}",
                        base
                    )
                })?;
            publisher
                .publication_for(Some(older))
                .map_err(|e| e.to_string())
        }
        SyncFault::TornFile { .. } | SyncFault::KilledWriter { .. } => Ok(p),
    }
}

/// What a writer killed half way through `p`'s temp file leaves behind: the temp file with
/// half the bytes, the pointer untouched. Returns the message for the run's counters.
fn kill_writer(
    dir: &Path,
    config: &ModelConfig,
    p: &learner::Publication,
) -> Result<String, String> {
    let path = dir.join(disk::weights_file_name(p.version));
    let bytes = checkpoint::to_bytes_with_meta(
        config,
        &p.params,
        &[],
        &[(disk::VERSION_META_KEY, p.version.0.to_string())],
    )
    .map_err(|e| e.to_string())?;
    let tmp = checkpoint::temp_path(&path);
    std::fs::write(&tmp, &bytes[..bytes.len() / 2])
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    Ok(format!(
        "the writer of {} died after {} of {} bytes of {}",
        p.version,
        bytes.len() / 2,
        bytes.len(),
        tmp.display()
    ))
}

fn tear(path: &Path, len: u64) -> Result<(), String> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.set_len(len))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// What a replica did with its sync work.
#[derive(Clone, Debug, PartialEq)]
pub enum SyncReport {
    /// The engine now runs on `version`, whose image hashes to `hash`.
    Installed {
        version: WeightVersion,
        hash: ContentHash,
        /// Bytes that reached the replica (delta or image; the file on the disk path; the
        /// image in process).
        sent_bytes: u64,
        /// The image's length (what an install applies and verifies).
        image_bytes: u64,
        /// `inprocess`, `full`, `delta:...` or `disk`.
        encoding: String,
    },
    /// The publication was refused; the replica still runs what it ran.
    Refused {
        version: Option<WeightVersion>,
        reason: String,
    },
    /// Not tried: an earlier delivery of the same batch was refused, so this delta's base is
    /// not what the replica holds.
    Skipped { version: WeightVersion },
}

/// A replica lane's side of weight sync: what it holds and how it installs.
#[derive(Debug)]
pub enum SyncSink {
    InProcess {
        version: Option<WeightVersion>,
        hash: Option<ContentHash>,
    },
    Delta {
        receiver: Receiver,
        layout: Arc<Layout>,
    },
    Disk {
        poller: DiskPoller,
        version: Option<WeightVersion>,
        hash: Option<ContentHash>,
    },
}

impl SyncSink {
    /// A sink holding the stage's start image (what its engine was built with).
    pub fn new(path: &SyncPath, config: &ModelConfig, start: &StartImage) -> Result<Self, String> {
        Ok(match path {
            SyncPath::InProcess => SyncSink::InProcess {
                version: Some(start.version),
                hash: Some(start.hash),
            },
            SyncPath::Delta => {
                let mut receiver = Receiver::new();
                receiver
                    .install(&Publication {
                        version: start.version,
                        hash: start.hash,
                        full_bytes: start.bytes.len() as u64,
                        payload: Payload::Full(start.bytes.clone()),
                    })
                    .map_err(|e| e.to_string())?;
                SyncSink::Delta {
                    receiver,
                    layout: layout_of(config)?,
                }
            }
            SyncPath::Disk(dir) => SyncSink::Disk {
                poller: DiskPoller::starting_at(dir, start.version),
                version: Some(start.version),
                hash: Some(start.hash),
            },
        })
    }

    /// The version the replica runs on (None: nothing installed yet).
    pub fn version(&self) -> Option<WeightVersion> {
        match self {
            SyncSink::InProcess { version, .. } | SyncSink::Disk { version, .. } => *version,
            SyncSink::Delta { receiver, .. } => receiver.version(),
        }
    }

    /// The blake3 of the image the replica runs on.
    pub fn hash(&self) -> Option<ContentHash> {
        match self {
            SyncSink::InProcess { hash, .. } | SyncSink::Disk { hash, .. } => *hash,
            SyncSink::Delta { receiver, .. } => receiver.hash(),
        }
    }

    /// Installs `d` into `engine`. Err: the engine failed to take weights that passed every
    /// check (an engine error, not a sync one).
    pub fn install(&mut self, d: &Delivery, engine: &mut Engine) -> Result<SyncReport, String> {
        match (self, d) {
            (
                SyncSink::InProcess { version, hash },
                Delivery::Arena {
                    publication,
                    hash: h,
                },
            ) => {
                engine
                    .swap_weights(&publication.params, publication.version, None)
                    .map_err(|e| e.to_string())?;
                *version = Some(publication.version);
                *hash = Some(*h);
                let image = publication.params.tensor().len_bytes() as u64;
                Ok(SyncReport::Installed {
                    version: publication.version,
                    hash: *h,
                    sent_bytes: image,
                    image_bytes: image,
                    encoding: "inprocess".into(),
                })
            }
            (SyncSink::Delta { receiver, layout }, Delivery::Bytes(p)) => {
                let bytes = match receiver.install(p) {
                    Ok(b) => b,
                    Err(refusal) => {
                        return Ok(SyncReport::Refused {
                            version: Some(p.version),
                            reason: refusal.to_string(),
                        })
                    }
                };
                let arena = arena_from_bytes(engine.backend(), layout, bytes)?;
                engine
                    .swap_weights(&arena, p.version, None)
                    .map_err(|e| e.to_string())?;
                Ok(SyncReport::Installed {
                    version: p.version,
                    hash: p.hash,
                    sent_bytes: p.sync_bytes(),
                    image_bytes: p.full_bytes,
                    encoding: p.sync_encoding(),
                })
            }
            (sink, d) => Err(format!(
                "internal: a {} delivery of {} reached a {} replica",
                match d {
                    Delivery::Arena { .. } => "in-process",
                    Delivery::Bytes(_) => "delta",
                },
                d.version(),
                sink.path_name()
            )),
        }
    }

    fn path_name(&self) -> &'static str {
        match self {
            SyncSink::InProcess { .. } => "inprocess",
            SyncSink::Delta { .. } => "delta",
            SyncSink::Disk { .. } => "disk",
        }
    }

    /// Disk path: polls the pointer and hot-reloads a newer version into `engine`. None: not
    /// the disk path, or nothing new.
    pub fn poll(&mut self, engine: &mut Engine) -> Result<Option<SyncReport>, String> {
        let SyncSink::Disk {
            poller,
            version,
            hash,
        } = self
        else {
            return Ok(None);
        };
        let update = match poller.poll(engine.backend()) {
            Ok(Some(u)) => u,
            Ok(None) => return Ok(None),
            Err(e) => {
                return Ok(Some(SyncReport::Refused {
                    version: None,
                    reason: e.to_string(),
                }))
            }
        };
        let params = in_engine_dtype(engine.precision().dtype(), engine.backend(), update.params)?;
        let image = arena_bytes(&params)?;
        let h = ContentHash::of(&image);
        engine
            .swap_weights(&params, update.version, None)
            .map_err(|e| e.to_string())?;
        *version = Some(update.version);
        *hash = Some(h);
        Ok(Some(SyncReport::Installed {
            version: update.version,
            hash: h,
            sent_bytes: update.bytes,
            image_bytes: image.len() as u64,
            encoding: "disk".into(),
        }))
    }
}

fn layout_of(config: &ModelConfig) -> Result<Arc<Layout>, String> {
    Layout::new(config).map(Arc::new).map_err(|e| e.to_string())
}

/// What a restarted replica is built from: the newest weights, by a full sync of the stage's
/// path.
pub enum FullSync<'a> {
    /// In process: the learner's newest arena copy and its hash.
    Arena(&'a learner::Publication, ContentHash),
    /// Delta path: the full image of the newest version.
    Bytes(&'a Publication),
    /// Disk path: whatever the pointer names now.
    Disk(&'a Path),
}

/// Builds a fresh engine for a restarted replica on `backend`: a new sink, filled by a full
/// sync, and an engine on those weights. Err names what failed (a refused image, an unreadable
/// file, an engine error); the caller tries again later.
pub fn restart_replica(
    backend: Backend,
    config: &ModelConfig,
    engine_config: crate::engine::EngineConfig,
    full: FullSync<'_>,
) -> Result<(Engine, SyncSink, SyncReport), String> {
    let engine_err = |e: crate::engine::EngineError| e.to_string();
    match full {
        FullSync::Arena(p, hash) => {
            let engine = Engine::new(backend, config, &p.params, p.version, engine_config)
                .map_err(engine_err)?;
            let image = p.params.tensor().len_bytes() as u64;
            Ok((
                engine,
                SyncSink::InProcess {
                    version: Some(p.version),
                    hash: Some(hash),
                },
                SyncReport::Installed {
                    version: p.version,
                    hash,
                    sent_bytes: image,
                    image_bytes: image,
                    encoding: "inprocess".into(),
                },
            ))
        }
        FullSync::Bytes(p) => {
            if p.is_delta() {
                return Err(format!(
                    "internal: a restart needs the full image of {}, not a delta",
                    p.version
                ));
            }
            let layout = layout_of(config)?;
            let mut receiver = Receiver::new();
            let bytes = receiver.install(p).map_err(|e| e.to_string())?;
            let arena = arena_from_bytes(&backend, &layout, bytes)?;
            let engine = Engine::new(backend, config, &arena, p.version, engine_config)
                .map_err(engine_err)?;
            Ok((
                engine,
                SyncSink::Delta { receiver, layout },
                SyncReport::Installed {
                    version: p.version,
                    hash: p.hash,
                    sent_bytes: p.sync_bytes(),
                    image_bytes: p.full_bytes,
                    encoding: "full".into(),
                },
            ))
        }
        FullSync::Disk(dir) => {
            let mut poller = DiskPoller::new(dir);
            let update = poller
                .poll(&backend)
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("{}: nothing is published", dir.display()))?;
            let params = in_engine_dtype(engine_config.precision.dtype(), &backend, update.params)?;
            let image = arena_bytes(&params)?;
            let hash = ContentHash::of(&image);
            let engine = Engine::new(backend, config, &params, update.version, engine_config)
                .map_err(engine_err)?;
            Ok((
                engine,
                SyncSink::Disk {
                    poller,
                    version: Some(update.version),
                    hash: Some(hash),
                },
                SyncReport::Installed {
                    version: update.version,
                    hash,
                    sent_bytes: update.bytes,
                    image_bytes: image.len() as u64,
                    encoding: "disk".into(),
                },
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_must_match_the_path_and_the_replicas() {
        let mut o = SyncOptions {
            path: SyncPath::Delta,
            faults: vec![SyncFault::FlipByte {
                version: 3,
                replica: 1,
            }],
            ..SyncOptions::default()
        };
        assert!(o.validate(2).is_ok());
        assert!(o.validate(1).unwrap_err().contains("replica"));
        o.faults = vec![SyncFault::TornFile { version: 3 }];
        assert!(o.validate(2).unwrap_err().contains("delta"));
        o.faults = vec![SyncFault::WrongBase {
            version: 1,
            replica: 0,
        }];
        assert!(o.validate(2).unwrap_err().contains("version 2"));
        o.path = SyncPath::InProcess;
        o.faults = vec![SyncFault::FlipByte {
            version: 3,
            replica: 0,
        }];
        assert!(o.validate(2).is_err());
    }

    #[test]
    fn arena_bytes_round_trip() {
        let cfg = ModelConfig::tiny();
        let m = sluice_model::Model::new(cfg.clone(), &Backend::Cpu).unwrap();
        let bytes = arena_bytes(&m.params).unwrap();
        assert_eq!(bytes.len(), m.params.tensor().numel() * 4);
        let back = arena_from_bytes(&Backend::Cpu, m.params.layout(), &bytes).unwrap();
        assert_eq!(arena_bytes(&back).unwrap(), bytes);
        let err = arena_from_bytes(&Backend::Cpu, m.params.layout(), &bytes[1..]).unwrap_err();
        assert!(err.contains("bytes of weights"), "{err}");
    }
}
