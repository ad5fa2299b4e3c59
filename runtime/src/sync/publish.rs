//! The learner's side and the engine's side of weight sync, as plain byte images.
//!
//! [`Publisher`] keeps the last few published images (their bytes and blake3) and answers, for
//! a receiver holding version `held`, the cheapest [`Publication`] that brings it to the newest
//! version: a delta against `held` when it still keeps that image, the full image otherwise.
//! Deltas for one base are encoded once and shared by every receiver on that base.
//!
//! [`Receiver`] holds one image (what an engine replica runs on) and installs a publication only
//! after the result's blake3 matches the publisher's: a delta is applied into a scratch buffer
//! that is swapped in on success, a full image is hashed before it is copied. A refused
//! publication is a [`NeedsFullSync`]; the receiver still holds what it held, and the caller
//! sends [`Publisher::full`] (and counts the fallback).
//!
//! Neither side knows the engine: the learner passes the bytes of whatever copy the engine runs
//! on (today the f32 parameter arena; a bf16 copy later) and gives the receiver's bytes to the
//! engine after an install.

use super::content_hash::ContentHash;
use super::delta::{self, DeltaError, EncodeParams, EncodingSummary, Image};
use crate::trajectory::WeightVersion;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

/// One published image.
#[derive(Debug)]
struct Snapshot {
    version: WeightVersion,
    bytes: Arc<[u8]>,
    hash: ContentHash,
}

/// What travels to a receiver.
#[derive(Clone, Debug)]
pub enum Payload {
    /// The whole image.
    Full(Arc<[u8]>),
    /// A delta (see [`delta`]) against `base`, with what it is made of.
    Delta {
        base: WeightVersion,
        bytes: Arc<[u8]>,
        summary: EncodingSummary,
    },
}

/// A publication of version `version` (blake3 `hash`, `full_bytes` long) for one receiver.
#[derive(Clone, Debug)]
pub struct Publication {
    pub version: WeightVersion,
    pub hash: ContentHash,
    pub full_bytes: u64,
    pub payload: Payload,
}

impl Publication {
    /// Bytes sent (DESIGN 9 `sync_bytes`).
    pub fn sync_bytes(&self) -> u64 {
        match &self.payload {
            Payload::Full(b) => b.len() as u64,
            Payload::Delta { bytes, .. } => bytes.len() as u64,
        }
    }

    /// `full`, or the delta's [`EncodingSummary::label`] (DESIGN 9 `sync_encoding`).
    pub fn sync_encoding(&self) -> String {
        match &self.payload {
            Payload::Full(_) => "full".into(),
            Payload::Delta { summary, .. } => summary.label(),
        }
    }

    pub fn is_delta(&self) -> bool {
        matches!(self.payload, Payload::Delta { .. })
    }
}

/// Why the publisher cannot publish or answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PublishError {
    /// Nothing has been published yet.
    NothingPublished,
    /// Versions must increase: `version` is not newer than `latest`.
    NotNewer {
        version: WeightVersion,
        latest: WeightVersion,
    },
    /// The delta encoder refused (bad parameters, images of another length).
    Encode(DeltaError),
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PublishError::NothingPublished => write!(f, "no weights have been published yet"),
            PublishError::NotNewer { version, latest } => write!(
                f,
                "cannot publish {version}: versions must increase and {latest} is already published"
            ),
            PublishError::Encode(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for PublishError {}

/// Counts of what the publisher handed out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublisherStats {
    pub published: u64,
    pub full_publications: u64,
    pub delta_publications: u64,
    /// Deltas encoded (fewer than delta publications: receivers on one base share one).
    pub deltas_encoded: u64,
}

/// The learner's side: the last `retain` published images and the deltas to the newest.
#[derive(Debug)]
pub struct Publisher {
    params: EncodeParams,
    retain: usize,
    /// Oldest first; the newest is last.
    history: VecDeque<Snapshot>,
    /// Deltas to the newest version, by base version (cleared on every publish).
    deltas: HashMap<WeightVersion, Arc<Publication>>,
    full: Option<Arc<Publication>>,
    stats: PublisherStats,
}

impl Publisher {
    /// A publisher keeping `retain` images (at least 2: the newest, and the one receivers hold
    /// while it is sent). Memory: `retain` copies of the image.
    pub fn new(params: EncodeParams, retain: usize) -> Result<Publisher, PublishError> {
        params.validate().map_err(PublishError::Encode)?;
        Ok(Publisher {
            params,
            retain: retain.max(2),
            history: VecDeque::new(),
            deltas: HashMap::new(),
            full: None,
            stats: PublisherStats::default(),
        })
    }

    pub fn params(&self) -> &EncodeParams {
        &self.params
    }

    /// The newest published version.
    pub fn latest(&self) -> Option<WeightVersion> {
        self.history.back().map(|s| s.version)
    }

    /// The versions a receiver can get a delta from (oldest first).
    pub fn retained(&self) -> Vec<WeightVersion> {
        self.history.iter().map(|s| s.version).collect()
    }

    pub fn stats(&self) -> PublisherStats {
        self.stats
    }

    /// Records `bytes` (copied) as `version`, newer than any before, and returns its hash. The
    /// oldest image beyond `retain` is dropped.
    pub fn publish(
        &mut self,
        version: WeightVersion,
        bytes: &[u8],
    ) -> Result<ContentHash, PublishError> {
        if let Some(latest) = self.latest() {
            if version <= latest {
                return Err(PublishError::NotNewer { version, latest });
            }
        }
        let hash = ContentHash::of(bytes);
        self.history.push_back(Snapshot {
            version,
            bytes: Arc::from(bytes),
            hash,
        });
        while self.history.len() > self.retain {
            self.history.pop_front();
        }
        self.deltas.clear();
        self.full = None;
        self.stats.published += 1;
        Ok(hash)
    }

    /// The full image of the newest version.
    pub fn full(&mut self) -> Result<Arc<Publication>, PublishError> {
        let newest = self.history.back().ok_or(PublishError::NothingPublished)?;
        let p = self
            .full
            .get_or_insert_with(|| {
                Arc::new(Publication {
                    version: newest.version,
                    hash: newest.hash,
                    full_bytes: newest.bytes.len() as u64,
                    payload: Payload::Full(newest.bytes.clone()),
                })
            })
            .clone();
        self.stats.full_publications += 1;
        Ok(p)
    }

    /// What to send a receiver holding `held` (`None`: nothing) to bring it to the newest
    /// version: a delta when `held` is retained and has the newest image's length, else full.
    pub fn publication_for(
        &mut self,
        held: Option<WeightVersion>,
    ) -> Result<Arc<Publication>, PublishError> {
        let newest = self.history.back().ok_or(PublishError::NothingPublished)?;
        let base = held.and_then(|v| self.history.iter().find(|s| s.version == v));
        let Some(base) = base.filter(|b| b.bytes.len() == newest.bytes.len()) else {
            return self.full();
        };
        if let Some(p) = self.deltas.get(&base.version) {
            self.stats.delta_publications += 1;
            return Ok(p.clone());
        }
        let encoded = delta::encode(
            &self.params,
            Image {
                version: base.version,
                bytes: &base.bytes,
                hash: base.hash,
            },
            Image {
                version: newest.version,
                bytes: &newest.bytes,
                hash: newest.hash,
            },
        )
        .map_err(PublishError::Encode)?;
        let p = Arc::new(Publication {
            version: newest.version,
            hash: newest.hash,
            full_bytes: newest.bytes.len() as u64,
            payload: Payload::Delta {
                base: base.version,
                bytes: Arc::from(encoded.bytes),
                summary: encoded.summary,
            },
        });
        self.deltas.insert(base.version, p.clone());
        self.stats.deltas_encoded += 1;
        self.stats.delta_publications += 1;
        Ok(p)
    }
}

/// A refused publication: the receiver still holds what it held and needs a full sync.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NeedsFullSync {
    /// The version that was refused.
    pub version: WeightVersion,
    pub reason: DeltaError,
}

impl fmt::Display for NeedsFullSync {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "publication of {} refused, a full sync is needed: {}",
            self.version, self.reason
        )
    }
}

impl std::error::Error for NeedsFullSync {}

/// Counts of what a receiver installed and refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    pub full_installs: u64,
    pub delta_installs: u64,
    /// Publications refused (each one means a full sync was needed).
    pub refused: u64,
}

#[derive(Debug)]
struct Held {
    version: WeightVersion,
    bytes: Vec<u8>,
    hash: ContentHash,
}

/// The engine's side: the image it runs on, changed only by verified installs.
#[derive(Debug, Default)]
pub struct Receiver {
    held: Option<Held>,
    /// Where deltas are applied before they are checked; swapped with the held bytes on success.
    scratch: Vec<u8>,
    stats: ReceiverStats,
}

impl Receiver {
    /// A receiver holding nothing (its first publication must be full).
    pub fn new() -> Receiver {
        Receiver::default()
    }

    pub fn version(&self) -> Option<WeightVersion> {
        self.held.as_ref().map(|h| h.version)
    }

    pub fn bytes(&self) -> Option<&[u8]> {
        self.held.as_ref().map(|h| h.bytes.as_slice())
    }

    /// The blake3 of the bytes held (computed when they were installed and checked then).
    pub fn hash(&self) -> Option<ContentHash> {
        self.held.as_ref().map(|h| h.hash)
    }

    pub fn stats(&self) -> ReceiverStats {
        self.stats
    }

    /// Installs `p` if its result hashes to `p.hash`, returning the new bytes; otherwise
    /// changes nothing and returns why a full sync is needed.
    pub fn install(&mut self, p: &Publication) -> Result<&[u8], NeedsFullSync> {
        let result = match &p.payload {
            Payload::Full(bytes) => self.install_full(p, bytes),
            Payload::Delta { bytes, .. } => self.install_delta(p, bytes),
        };
        match result {
            Ok(()) => Ok(self.bytes().unwrap_or_default()),
            Err(reason) => {
                self.stats.refused += 1;
                Err(NeedsFullSync {
                    version: p.version,
                    reason,
                })
            }
        }
    }

    fn install_full(&mut self, p: &Publication, bytes: &[u8]) -> Result<(), DeltaError> {
        let got = ContentHash::of(bytes);
        if got != p.hash {
            return Err(DeltaError::ResultHash {
                expected: p.hash,
                got,
            });
        }
        let mut held = self.held.take().map(|h| h.bytes).unwrap_or_default();
        held.clear();
        held.extend_from_slice(bytes);
        self.held = Some(Held {
            version: p.version,
            bytes: held,
            hash: p.hash,
        });
        self.stats.full_installs += 1;
        Ok(())
    }

    fn install_delta(&mut self, p: &Publication, bytes: &[u8]) -> Result<(), DeltaError> {
        let Some(held) = self.held.as_mut() else {
            return Err(DeltaError::BaseVersion {
                delta: delta::parse(bytes)?.header.base_version,
                held: None,
            });
        };
        let header = delta::apply(
            bytes,
            Image {
                version: held.version,
                bytes: &held.bytes,
                hash: held.hash,
            },
            &mut self.scratch,
        )?;
        // The delta is self-consistent; it must also be the publication it came in.
        if header.new_version != p.version || header.new_hash != p.hash {
            return Err(DeltaError::Malformed(format!(
                "it produces {} with blake3 {}, but the publication is {} with blake3 {}",
                header.new_version, header.new_hash, p.version, p.hash
            )));
        }
        std::mem::swap(&mut held.bytes, &mut self.scratch);
        held.version = header.new_version;
        held.hash = header.new_hash;
        self.stats.delta_installs += 1;
        Ok(())
    }
}
