//! `POST /weights`: a full checkpoint or a verified delta, uploaded as the body or named by a
//! path on a filesystem the server shares with the trainer.
//!
//! - A full checkpoint is a safetensors file as `sluice train` writes it (its model config in
//!   the metadata); its version is the `version` query parameter (or the JSON's `version`).
//!   Its config must be the served model's.
//! - A delta is the weight-sync codec's (runtime/src/sync/delta.rs, magic `SLUICEDL`) of the
//!   *image* the server holds: the little-endian bytes of the weights in the engine's
//!   precision (`sluice_runtime::sync::lane::arena_bytes`). Its header names both versions and
//!   both blake3 hashes; it is applied only to the image it was made from, and the result is
//!   installed only if it hashes to the header's. A delta for another base (version, length
//!   or hash) is a 409 and nothing changes. `GET /version` gives the version and blake3 a
//!   trainer needs to make the next delta.
//!
//! The server keeps one copy of the image (the delta's base) beside the engine's weights.

use super::api::ApiError;
use serde::Deserialize;
use sluice_model::{Arena, ModelConfig};
use sluice_runtime::engine::Engine;
use sluice_runtime::health::BackendSpec;
use sluice_runtime::sync::delta::{self, DeltaError, Image};
use sluice_runtime::sync::lane::{arena_bytes, arena_from_bytes};
use sluice_runtime::sync::ContentHash;
use sluice_runtime::trajectory::WeightVersion;
use std::path::PathBuf;

/// What one `/weights` request asks to install (parsed on the HTTP side, installed on the
/// engine thread between steps).
#[derive(Debug)]
pub enum WeightUpdate {
    /// A safetensors checkpoint's bytes, to be installed at `version`.
    Full {
        bytes: Vec<u8>,
        version: WeightVersion,
        origin: String,
    },
    /// A codec delta's bytes (the versions are in its header).
    Delta { bytes: Vec<u8>, origin: String },
    /// The engine's image itself (what a trainer's full sync sends), at `version`, checked
    /// against `hash`.
    Image {
        bytes: Vec<u8>,
        version: WeightVersion,
        hash: ContentHash,
    },
}

/// The JSON form of `/weights`: a file on a shared filesystem.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PathBody {
    path: PathBuf,
    /// Required for a full checkpoint; a delta carries its own.
    version: Option<u64>,
}

/// Reads a `/weights` request: `json` when its content type is JSON (a path), else the body
/// is the file itself; `query_version` and `query_hash` are the `version` and `blake3` query
/// parameters (with `blake3`, a body that is not a delta is the raw image).
pub fn parse_update(
    body: Vec<u8>,
    json: bool,
    query_version: Option<u64>,
    query_hash: Option<ContentHash>,
) -> Result<WeightUpdate, ApiError> {
    let (bytes, version, origin) = if json {
        let p: PathBody = super::api::parse_body("/weights", &body)?;
        let bytes = std::fs::read(&p.path).map_err(|e| {
            ApiError::bad_request(format!("/weights: cannot read {}: {e}", p.path.display()))
        })?;
        (
            bytes,
            p.version.or(query_version),
            p.path.display().to_string(),
        )
    } else {
        (body, query_version, "the uploaded body".to_string())
    };
    if bytes.starts_with(&delta::MAGIC) {
        return Ok(WeightUpdate::Delta { bytes, origin });
    }
    if let Some(hash) = query_hash {
        let Some(v) = version else {
            return Err(ApiError::bad_request(
                "/weights: a raw image (blake3=HEX) needs its version=N too",
            ));
        };
        return Ok(WeightUpdate::Image {
            bytes,
            version: WeightVersion(v),
            hash,
        });
    }
    let Some(v) = version else {
        return Err(ApiError::bad_request(format!(
            "/weights: {origin} is a full checkpoint (not a delta): give its version \
             (`?version=N`, or \"version\" with a path)"
        )));
    };
    Ok(WeightUpdate::Full {
        bytes,
        version: WeightVersion(v),
        origin,
    })
}

/// The image the engine runs on, kept as a delta's base.
pub struct HeldImage {
    pub version: WeightVersion,
    pub hash: ContentHash,
    bytes: Vec<u8>,
    /// Where a delta is decoded before it is checked and swapped in.
    scratch: Vec<u8>,
}

impl HeldImage {
    pub fn of(arena: &Arena, version: WeightVersion) -> Result<HeldImage, String> {
        let bytes = arena_bytes(arena)?;
        Ok(HeldImage {
            version,
            hash: ContentHash::of(&bytes),
            bytes,
            scratch: Vec::new(),
        })
    }
}

/// What an install did.
#[derive(Clone, Copy, Debug)]
pub struct Installed {
    pub version: WeightVersion,
    pub hash: ContentHash,
    pub delta: bool,
}

fn not_older(new: WeightVersion, current: WeightVersion) -> Result<(), ApiError> {
    if new < current {
        return Err(ApiError::conflict(format!(
            "/weights: version {new} is older than the served {current}; versions only move \
             forward"
        )));
    }
    Ok(())
}

/// Installs `update` into `engine` (between steps) and `held`; on any error nothing changes.
pub fn install(
    engine: &mut Engine,
    held: &mut HeldImage,
    update: WeightUpdate,
) -> Result<Installed, ApiError> {
    let dtype = engine.precision().dtype();
    let delta_used = matches!(update, WeightUpdate::Delta { .. });
    if let WeightUpdate::Image {
        bytes,
        version,
        hash,
    } = update
    {
        return install_image(engine, held, bytes, version, hash);
    }
    // The new weights as an arena in the engine's precision, and the image they make.
    let (arena, image) = match update {
        WeightUpdate::Full {
            bytes,
            version,
            origin,
        } => {
            not_older(version, engine.version())?;
            let backend = engine.backend();
            let (config, arena, _) = sluice_model::checkpoint::load_new_from_bytes(
                bytes,
                std::path::Path::new(&origin),
                backend,
            )
            .map_err(|e| ApiError::bad_request(format!("/weights: {origin}: {e}")))?;
            same_model(&config, engine.model_config(), &origin)?;
            let arena = if arena.dtype() == dtype {
                arena
            } else {
                arena
                    .cast_copy(backend, dtype)
                    .map_err(|e| ApiError::internal(format!("/weights: {e}")))?
            };
            let image = HeldImage::of(&arena, version).map_err(ApiError::internal)?;
            (arena, image)
        }
        WeightUpdate::Delta { bytes, origin } => {
            let base = Image {
                version: held.version,
                bytes: &held.bytes,
                hash: held.hash,
            };
            let mut out = std::mem::take(&mut held.scratch);
            let header = delta::apply(&bytes, base, &mut out);
            let header = match header {
                Ok(h) => h,
                Err(e) => {
                    held.scratch = out;
                    return Err(delta_error(&origin, e));
                }
            };
            not_older(header.new_version, engine.version())?;
            let layout = sluice_model::Layout::new(engine.model_config())
                .map(std::sync::Arc::new)
                .map_err(|e| ApiError::internal(format!("/weights: {e}")))?;
            let arena = arena_from_bytes(engine.backend(), &layout, &out)
                .map_err(|e| ApiError::bad_request(format!("/weights: {origin}: {e}")))?;
            let image = HeldImage {
                version: header.new_version,
                hash: header.new_hash,
                bytes: out,
                scratch: Vec::new(),
            };
            (arena, image)
        }
        WeightUpdate::Image { .. } => unreachable!("installed above"),
    };
    engine
        .swap_weights(&arena, image.version, None)
        .map_err(|e| ApiError::internal(format!("/weights: {e}")))?;
    // The old image's buffer becomes the next delta's scratch.
    let old = std::mem::replace(held, image);
    held.scratch = old.bytes;
    Ok(Installed {
        version: held.version,
        hash: held.hash,
        delta: delta_used,
    })
}

/// Checks the engine's image `bytes` (as long as the held one, hashing to `hash`) and makes
/// the arena it holds.
fn check_image(
    engine: &Engine,
    held: &HeldImage,
    bytes: &[u8],
    hash: ContentHash,
) -> Result<Arena, ApiError> {
    if bytes.len() != held.bytes.len() {
        return Err(ApiError::bad_request(format!(
            "the image is {} bytes and the served model's is {}: another model or precision \
             (the server's config must be the trainer's)",
            bytes.len(),
            held.bytes.len()
        )));
    }
    let got = ContentHash::of(bytes);
    if got != hash {
        return Err(ApiError::bad_request(format!(
            "the image hashes to {} and blake3={} was given: damaged in transit; nothing was \
             installed",
            got.to_hex(),
            hash.to_hex()
        )));
    }
    let layout = sluice_model::Layout::new(engine.model_config())
        .map(std::sync::Arc::new)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    arena_from_bytes(engine.backend(), &layout, bytes).map_err(ApiError::bad_request)
}

/// Replaces the held image (its old buffer becomes the next delta's scratch).
fn hold(held: &mut HeldImage, version: WeightVersion, hash: ContentHash, bytes: Vec<u8>) {
    let old = std::mem::replace(
        held,
        HeldImage {
            version,
            hash,
            bytes,
            scratch: Vec::new(),
        },
    );
    held.scratch = old.bytes;
}

/// Installs the engine's image `bytes` as `version` (not older than the served one) when it
/// is as long as the held one and hashes to `hash`. On any error nothing changes.
pub fn install_image(
    engine: &mut Engine,
    held: &mut HeldImage,
    bytes: Vec<u8>,
    version: WeightVersion,
    hash: ContentHash,
) -> Result<Installed, ApiError> {
    not_older(version, engine.version())?;
    let arena = check_image(engine, held, &bytes, hash).map_err(|mut e| {
        e.message = format!("/weights: {}", e.message);
        e
    })?;
    engine
        .swap_weights(&arena, version, None)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    hold(held, version, hash, bytes);
    Ok(Installed {
        version,
        hash,
        delta: false,
    })
}

/// A fresh engine (same backend kind and settings, no sequence) on the image `bytes` at any
/// `version`: what a joining trainer starts from. Returns the sequences the old engine held.
/// On any error nothing changes. (For a moment both engines' KV pools exist.)
pub fn restart_on_image(
    engine: &mut Engine,
    held: &mut HeldImage,
    bytes: Vec<u8>,
    version: WeightVersion,
    hash: ContentHash,
) -> Result<usize, ApiError> {
    let arena = check_image(engine, held, &bytes, hash)?;
    let backend = BackendSpec::of(engine.backend())
        .open()
        .map_err(ApiError::internal)?;
    let fresh = Engine::new(
        backend,
        engine.model_config(),
        &arena,
        version,
        engine.config().clone(),
    )
    .map_err(|e| ApiError::internal(e.to_string()))?;
    let held_sequences = engine.len();
    *engine = fresh;
    hold(held, version, hash, bytes);
    Ok(held_sequences)
}

/// A delta that does not apply: another base is a conflict (409), a damaged one a 400.
fn delta_error(origin: &str, e: DeltaError) -> ApiError {
    let message = format!("/weights: {origin}: {e}; nothing was installed");
    match e {
        DeltaError::BaseVersion { .. }
        | DeltaError::BaseHash { .. }
        | DeltaError::Length { .. } => ApiError::conflict(message),
        _ => ApiError::bad_request(message),
    }
}

fn same_model(got: &ModelConfig, served: &ModelConfig, origin: &str) -> Result<(), ApiError> {
    // The initialisation fields say how a model started, not what it is.
    let mut same = got.clone();
    same.seed = served.seed;
    same.init_std = served.init_std;
    if same != *served {
        return Err(ApiError::bad_request(format!(
            "/weights: {origin} is a checkpoint of another model ({} layers, width {}, \
             vocabulary {}) than the one served ({} layers, width {}, vocabulary {})",
            got.n_layers, got.d_model, got.vocab, served.n_layers, served.d_model, served.vocab
        )));
    }
    Ok(())
}
