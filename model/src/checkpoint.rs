//! Checkpoints: safetensors files with one F32 tensor per named view (docs/model.md,
//! "Checkpoints"). A BF16 arena (the bf16 compute copy) is saved widened to F32, exactly.
//!
//! Metadata (all strings, as safetensors requires):
//! - `sluice.format` = `sluice-checkpoint`, `sluice.format_version` = `1`;
//! - `sluice.config`: the [`ModelConfig`] as JSON;
//! - `sluice.groups`: JSON array of the arena groups in the file: `""` for the parameters
//!   (tensors named by the view, e.g. `layers.0.attn.wq`) and one prefix per extra arena
//!   (tensors named `<prefix>.<view>`, e.g. `adam_m.embed.weight`);
//! - `sluice.checksums`: JSON object, tensor name -> FNV-1a 64 of its little-endian bytes as 16
//!   hex digits, so a flipped byte in the data is caught, not trained on.
//!
//! Loading reads the whole file, checks the header (a truncated file fails here), the format
//! version, the config (same architecture; `seed` and `init_std` may differ), then every tensor
//! of every requested group: present, nothing unexpected, dtype F32, shape, checksum. Only when
//! all of that passes are the new arenas built and swapped in, so a failed load leaves the
//! model as it was.
//!
//! Saving is crash-safe ([`write_atomic`]): the bytes go to `<path>.tmp` in the same folder,
//! which is flushed to disk (fsync) and then renamed over `<path>`, and the folder is fsynced so
//! the rename itself survives a power loss. A process killed at any point leaves `<path>` either
//! the previous checkpoint or the new one, whole; never a mix or a truncated file. A stale
//! `<path>.tmp` from a killed writer is never read and is overwritten by the next save. One
//! writer per path is assumed (two processes saving the same path at once share the temp name).

use crate::arena::Arena;
use crate::config::ModelConfig;
use crate::init::fnv1a64;
use crate::layout::Layout;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use sluice_kernels::{Backend, DType, Error, Result, Tensor};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

pub const FORMAT_KEY: &str = "sluice.format";
pub const FORMAT: &str = "sluice-checkpoint";
pub const VERSION_KEY: &str = "sluice.format_version";
pub const VERSION: &str = "1";
pub const CONFIG_KEY: &str = "sluice.config";
pub const GROUPS_KEY: &str = "sluice.groups";
pub const CHECKSUMS_KEY: &str = "sluice.checksums";
/// Prefix of the caller's own metadata entries (e.g. `sluice.meta.optim_step`): scalars that
/// travel with the arenas, such as the optimizer's step count.
pub const META_PREFIX: &str = "sluice.meta.";

fn io(path: &Path, message: impl Into<String>) -> Error {
    Error::Io {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// The tensor name of view `view` in group `prefix`.
pub fn tensor_name(prefix: &str, view: &str) -> String {
    if prefix.is_empty() {
        view.to_string()
    } else {
        format!("{prefix}.{view}")
    }
}

fn check_prefix(prefix: &str) -> Result<()> {
    let ok = !prefix.is_empty()
        && prefix
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !prefix.starts_with("layers")
        && !matches!(prefix, "embed" | "final_norm" | "lm_head");
    if !ok {
        return Err(Error::param(
            "extra arena prefix",
            format!(
                "`{prefix}` must be non-empty lowercase letters, digits and `_`, and not a \
                 parameter name's first part (embed, layers, final_norm, lm_head)"
            ),
        ));
    }
    Ok(())
}

/// Saves the parameters.
pub fn save(path: &Path, config: &ModelConfig, params: &Arena) -> Result<()> {
    save_with_extra(path, config, params, &[])
}

/// Saves the parameters and extra arenas of the same model (optimizer state), each extra
/// tensor named `<prefix>.<view>`. Extra arenas may have their own layout (e.g. only the views
/// one optimizer updates), but must be f32.
pub fn save_with_extra(
    path: &Path,
    config: &ModelConfig,
    params: &Arena,
    extra: &[(&str, &Arena)],
) -> Result<()> {
    save_with_meta(path, config, params, extra, &[])
}

/// [`save_with_extra`] plus caller metadata: each `(key, value)` is stored as the string entry
/// `sluice.meta.<key>` of the safetensors header (keys: lowercase letters, digits, `_`).
pub fn save_with_meta(
    path: &Path,
    config: &ModelConfig,
    params: &Arena,
    extra: &[(&str, &Arena)],
    meta: &[(&str, String)],
) -> Result<()> {
    let out = to_bytes_with_meta(config, params, extra, meta)?;
    write_atomic(path, &out)
}

/// The bytes [`save_with_meta`] writes, without writing them (for callers that hash or send
/// the file, such as the disk weight-sync path).
pub fn to_bytes_with_meta(
    config: &ModelConfig,
    params: &Arena,
    extra: &[(&str, &Arena)],
    meta: &[(&str, String)],
) -> Result<Vec<u8>> {
    let path = Path::new("<checkpoint>");
    for (i, (key, _)) in meta.iter().enumerate() {
        check_meta_key(key)?;
        if meta[..i].iter().any(|(k, _)| k == key) {
            return Err(Error::param(
                "checkpoint metadata key",
                format!("`{key}` is given twice"),
            ));
        }
    }
    let mut groups: Vec<(&str, &Arena)> = vec![("", params)];
    for &(prefix, arena) in extra {
        check_prefix(prefix)?;
        if groups.iter().any(|(p, _)| *p == prefix) {
            return Err(Error::param(
                "extra arena prefix",
                format!("`{prefix}` is given twice"),
            ));
        }
        groups.push((prefix, arena));
    }
    let expected = Layout::new(config)?;
    if **params.layout() != expected {
        return Err(Error::Invalid(
            "save: the parameter arena's layout is not the config's layout".into(),
        ));
    }
    // One download per arena (a single copy from the GPU), then views into those bytes. A
    // BF16 arena (a bf16 compute copy) is written widened to F32, which is exact: loading it
    // and rounding back to bf16 gives the same bits.
    let mut downloads = Vec::with_capacity(groups.len());
    for (prefix, arena) in &groups {
        let bytes = match arena.dtype() {
            DType::BF16 => arena
                .to_vec()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            _ => {
                arena
                    .tensor()
                    .expect_dtype(&format!("arena `{prefix}`"), DType::F32)?;
                arena.tensor().to_bytes()?
            }
        };
        downloads.push(bytes);
    }
    let mut views: Vec<(String, TensorView<'_>)> = Vec::new();
    let mut checksums = BTreeMap::new();
    for ((prefix, arena), bytes) in groups.iter().zip(&downloads) {
        for spec in arena.layout().views() {
            let name = tensor_name(prefix, &spec.name);
            let data = &bytes[spec.offset * 4..(spec.offset + spec.numel()) * 4];
            checksums.insert(name.clone(), format!("{:016x}", fnv1a64(data)));
            let view = TensorView::new(StDtype::F32, spec.shape.clone(), data)
                .map_err(|e| io(path, format!("tensor `{name}`: {e}")))?;
            views.push((name, view));
        }
    }
    let group_names: Vec<&str> = groups.iter().map(|(p, _)| *p).collect();
    let metadata: HashMap<String, String> = [
        (FORMAT_KEY, FORMAT.to_string()),
        (VERSION_KEY, VERSION.to_string()),
        (CONFIG_KEY, config.to_json()),
        (
            GROUPS_KEY,
            serde_json::to_string(&group_names).unwrap_or_default(),
        ),
        (
            CHECKSUMS_KEY,
            serde_json::to_string(&checksums).unwrap_or_default(),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .chain(
        meta.iter()
            .map(|(k, v)| (format!("{META_PREFIX}{k}"), v.clone())),
    )
    .collect();
    let mut out =
        safetensors::serialize(views, Some(metadata)).map_err(|e| io(path, e.to_string()))?;
    canonical_header(&mut out);
    Ok(out)
}

/// The temp file [`write_atomic`] writes before renaming it to `path`: `<path>.tmp`, in the
/// same folder (a rename is atomic only within one file system).
pub fn temp_path(path: &Path) -> std::path::PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    path.with_file_name(format!("{name}.tmp"))
}

/// Writes `bytes` to `path` so that a crash at any moment leaves `path` either as it was or
/// holding exactly `bytes`: write `<path>.tmp`, fsync it, rename it over `path`, fsync the
/// folder (so the rename is on disk too; Unix only, elsewhere the rename is the last step). On
/// an error the temp file is removed and `path` is untouched.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = temp_path(path);
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        // The data must be on disk before the rename makes it visible under the real name;
        // otherwise a power loss could leave the new name pointing at unwritten blocks.
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(&tmp, e.to_string()));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(path, format!("renaming {}: {e}", tmp.display())));
    }
    sync_parent_dir(path)
}

/// Fsyncs the folder holding `path`, which makes a rename inside it durable.
#[cfg(unix)]
fn sync_parent_dir(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, format!("fsync of the folder after a rename: {e}")))
}

/// Folders cannot be opened for fsync off Unix; the rename is the last step there.
#[cfg(not(unix))]
fn sync_parent_dir(_path: &Path) -> Result<()> {
    Ok(())
}

/// Rewrites the JSON header of serialised safetensors bytes with its keys sorted, in place.
///
/// The safetensors crate takes the metadata as a `HashMap`, whose iteration order is random
/// per process, so two saves of the same model would differ in the header's byte order. Sorting
/// makes a checkpoint's bytes a function of its contents (digests compare across runs). The
/// sorted header is the same JSON with keys reordered, so it has exactly the original length
/// and the tensor offsets are unchanged; if that ever did not hold, the bytes are left as
/// they were.
fn canonical_header(bytes: &mut [u8]) {
    let Some(n) = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize)
    else {
        return;
    };
    let Some(header) = bytes.get(8..8 + n) else {
        return;
    };
    let Ok(parsed) = serde_json::from_slice::<BTreeMap<String, serde_json::Value>>(header) else {
        return;
    };
    // Nested objects (the metadata map) sorted too, whatever serde_json's map ordering is.
    let sorted: BTreeMap<String, serde_json::Value> = parsed
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                serde_json::Value::Object(m) => {
                    let m: BTreeMap<String, serde_json::Value> = m.into_iter().collect();
                    serde_json::to_value(m).unwrap_or_default()
                }
                other => other,
            };
            (k, v)
        })
        .collect();
    let Ok(text) = serde_json::to_vec(&sorted) else {
        return;
    };
    if text.len() <= n {
        bytes[8..8 + text.len()].copy_from_slice(&text);
        bytes[8 + text.len()..8 + n].fill(b' ');
    }
}

/// A checkpoint file read and checked at the file level (header, format, config, checksums).
struct Parsed {
    bytes: Vec<u8>,
    config: ModelConfig,
    groups: Vec<String>,
    checksums: BTreeMap<String, String>,
    /// The caller metadata (`sluice.meta.<key>` entries), keyed without the prefix.
    meta: BTreeMap<String, String>,
}

fn parse(path: &Path) -> Result<Parsed> {
    let bytes = std::fs::read(path).map_err(|e| io(path, e.to_string()))?;
    parse_bytes(bytes, path)
}

/// [`parse`] of bytes already read; `path` only names them in errors.
fn parse_bytes(bytes: Vec<u8>, path: &Path) -> Result<Parsed> {
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| {
        io(
            path,
            format!("not a valid safetensors file (truncated or corrupt header): {e}"),
        )
    })?;
    let meta = header.metadata().clone().unwrap_or_default();
    let get = |key: &str| {
        meta.get(key).ok_or_else(|| {
            io(
                path,
                format!(
                    "metadata key `{key}` is missing: not a sluice checkpoint (written by \
                     another tool, or by an incompatible version)"
                ),
            )
        })
    };
    if get(FORMAT_KEY)? != FORMAT {
        return Err(io(
            path,
            format!(
                "metadata `{FORMAT_KEY}` is `{}`, not `{FORMAT}`",
                meta[FORMAT_KEY]
            ),
        ));
    }
    let version = get(VERSION_KEY)?;
    if version != VERSION {
        return Err(io(
            path,
            format!(
                "checkpoint format version `{version}` is not supported (this build reads \
                 version {VERSION})"
            ),
        ));
    }
    let config = ModelConfig::from_json(get(CONFIG_KEY)?)
        .map_err(|e| io(path, format!("metadata `{CONFIG_KEY}`: {e}")))?;
    let groups: Vec<String> = serde_json::from_str(get(GROUPS_KEY)?).map_err(|e| {
        io(
            path,
            format!("metadata `{GROUPS_KEY}` is not a JSON string array: {e}"),
        )
    })?;
    let checksums: BTreeMap<String, String> =
        serde_json::from_str(get(CHECKSUMS_KEY)?).map_err(|e| {
            io(
                path,
                format!("metadata `{CHECKSUMS_KEY}` is not a JSON object of strings: {e}"),
            )
        })?;
    let caller_meta = meta
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(META_PREFIX)?.to_string(), v.clone())))
        .collect();
    Ok(Parsed {
        bytes,
        config,
        groups,
        checksums,
        meta: caller_meta,
    })
}

/// The config stored in a checkpoint (to build a model of the right shape before loading).
pub fn read_config(path: &Path) -> Result<ModelConfig> {
    parse(path).map(|p| p.config)
}

/// Loads the parameters into `params`, leaving it untouched on any error. Returns the
/// checkpoint's config (same architecture as `config`).
pub fn load_into(
    path: &Path,
    backend: &Backend,
    config: &ModelConfig,
    params: &mut Arena,
) -> Result<ModelConfig> {
    load_with_extra(path, backend, config, params, &mut [])
}

/// Loads the parameters and the requested extra arenas (by prefix), all or nothing: on any
/// error no arena is changed. Groups in the file that are not requested are ignored (loading
/// weights only from a checkpoint with optimizer state is fine); a requested group that the
/// file lacks is an error. Returns the checkpoint's config.
pub fn load_with_extra(
    path: &Path,
    backend: &Backend,
    config: &ModelConfig,
    params: &mut Arena,
    extra: &mut [(&str, &mut Arena)],
) -> Result<ModelConfig> {
    load_with_meta(path, backend, config, params, extra).map(|(config, _)| config)
}

/// [`load_with_extra`] that also returns the caller metadata written by [`save_with_meta`]
/// (keys without the `sluice.meta.` prefix). Returns the checkpoint's config and that map.
pub fn load_with_meta(
    path: &Path,
    backend: &Backend,
    config: &ModelConfig,
    params: &mut Arena,
    extra: &mut [(&str, &mut Arena)],
) -> Result<(ModelConfig, BTreeMap<String, String>)> {
    let mut parsed = parse(path)?;
    let meta = std::mem::take(&mut parsed.meta);
    let config = load_parsed(parsed, path, backend, config, params, extra)?;
    Ok((config, meta))
}

/// A caller metadata key: non-empty, lowercase ASCII letters, digits and `_`.
fn check_meta_key(key: &str) -> Result<()> {
    let ok = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if !ok {
        return Err(Error::param(
            "checkpoint metadata key",
            format!("`{key}` must be non-empty lowercase letters, digits and `_`"),
        ));
    }
    Ok(())
}

/// Reads a checkpoint into a new parameter arena on `backend`, shaped by the checkpoint's own
/// config (the file is read once). Returns the config and the arena.
pub fn load_new(path: &Path, backend: &Backend) -> Result<(ModelConfig, Arena)> {
    let parsed = parse(path)?;
    load_new_parsed(parsed, path, backend).map(|(config, params, _)| (config, params))
}

/// [`load_new`] of a checkpoint file's bytes already in memory (read once, e.g. after checking
/// their hash), also returning the caller metadata. `origin` only names the bytes in errors.
pub fn load_new_from_bytes(
    bytes: Vec<u8>,
    origin: &Path,
    backend: &Backend,
) -> Result<(ModelConfig, Arena, BTreeMap<String, String>)> {
    let parsed = parse_bytes(bytes, origin)?;
    load_new_parsed(parsed, origin, backend)
}

fn load_new_parsed(
    mut parsed: Parsed,
    path: &Path,
    backend: &Backend,
) -> Result<(ModelConfig, Arena, BTreeMap<String, String>)> {
    let meta = std::mem::take(&mut parsed.meta);
    let config = parsed.config.clone();
    let layout = Arc::new(Layout::new(&config)?);
    let mut params = Arena::zeros(backend, layout, DType::F32)?;
    let config = load_parsed(parsed, path, backend, &config, &mut params, &mut [])?;
    Ok((config, params, meta))
}

fn load_parsed(
    parsed: Parsed,
    path: &Path,
    backend: &Backend,
    config: &ModelConfig,
    params: &mut Arena,
    extra: &mut [(&str, &mut Arena)],
) -> Result<ModelConfig> {
    params
        .tensor()
        .expect_dtype("parameter arena", DType::F32)?;
    for (prefix, arena) in extra.iter() {
        arena
            .tensor()
            .expect_dtype(&format!("arena `{prefix}`"), DType::F32)?;
    }
    if let Some(diff) = config.architecture_diff(&parsed.config) {
        return Err(io(
            path,
            format!(
                "the checkpoint was written for a different model: {diff} (this model vs the \
                 checkpoint)"
            ),
        ));
    }
    for &(prefix, _) in extra.iter() {
        check_prefix(prefix)?;
        if !parsed.groups.iter().any(|g| g == prefix) {
            return Err(io(
                path,
                format!(
                    "the checkpoint has no arena `{prefix}` (it holds {:?})",
                    parsed.groups
                ),
            ));
        }
    }
    if !parsed.groups.iter().any(|g| g.is_empty()) {
        return Err(io(path, "the checkpoint holds no parameters (group \"\")"));
    }
    let st = SafeTensors::deserialize(&parsed.bytes).map_err(|e| {
        io(
            path,
            format!("not a valid safetensors file (truncated or corrupt): {e}"),
        )
    })?;

    // Every tensor in the file must belong to a group the file declares and be a view of it.
    let param_layout = Arc::new(Layout::new(&parsed.config)?);
    if **params.layout() != *param_layout {
        return Err(Error::Invalid(
            "load: the parameter arena's layout is not the config's layout".into(),
        ));
    }
    let file_names: BTreeSet<String> = st.names().into_iter().map(String::from).collect();
    let requested: Vec<(&str, Arc<Layout>)> = std::iter::once(("", params.layout().clone()))
        .chain(extra.iter().map(|(p, a)| (*p, a.layout().clone())))
        .collect();
    for name in &file_names {
        let belongs = parsed.groups.iter().any(|g| {
            if g.is_empty() {
                param_layout.get(name).is_some()
            } else if let Some(rest) = name.strip_prefix(&format!("{g}.")) {
                // A requested group must match its arena's layout; others only need the prefix.
                match requested.iter().find(|(p, _)| p == g) {
                    Some((_, layout)) => layout.get(rest).is_some(),
                    None => true,
                }
            } else {
                false
            }
        });
        if !belongs {
            return Err(io(
                path,
                format!("unexpected tensor `{name}`: not a view of this model"),
            ));
        }
    }

    // Build every requested arena's new contents on the host, checking each tensor.
    let mut scratch: Vec<Vec<f32>> = Vec::with_capacity(requested.len());
    for (prefix, layout) in &requested {
        let mut values = vec![0.0f32; layout.len()];
        for spec in layout.views() {
            let name = tensor_name(prefix, &spec.name);
            let view = st.tensor(&name).map_err(|_| Error::MissingTensor {
                tensor: name.clone(),
                expected: format!("F32 {:?} in checkpoint {}", spec.shape, path.display()),
            })?;
            if view.dtype() != StDtype::F32 {
                return Err(Error::DType {
                    tensor: name,
                    expected: format!("F32 (checkpoint {})", path.display()),
                    got: format!("{:?}", view.dtype()),
                });
            }
            if view.shape() != spec.shape.as_slice() {
                return Err(Error::shape(
                    name,
                    format!("{:?} (checkpoint {})", spec.shape, path.display()),
                    view.shape(),
                ));
            }
            let want = parsed.checksums.get(&name).ok_or_else(|| {
                io(
                    path,
                    format!("metadata `{CHECKSUMS_KEY}` has no entry for `{name}`"),
                )
            })?;
            let got = format!("{:016x}", fnv1a64(view.data()));
            if *want != got {
                return Err(io(
                    path,
                    format!(
                        "tensor `{name}`: data does not match its checksum ({got} vs {want} \
                         recorded): the file is corrupt"
                    ),
                ));
            }
            let dst = &mut values[spec.range()];
            for (d, b) in dst.iter_mut().zip(view.data().chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        scratch.push(values);
    }

    // Upload everything before touching any arena, so a device error also leaves them as is.
    let mut tensors = Vec::with_capacity(scratch.len());
    for (values, (_, layout)) in scratch.iter().zip(&requested) {
        tensors.push(Tensor::from_slice(backend, &[layout.len()], values)?);
    }
    let mut tensors = tensors.into_iter();
    if let Some(t) = tensors.next() {
        params.replace_tensor(t)?;
    }
    for ((_, arena), t) in extra.iter_mut().zip(tensors) {
        arena.replace_tensor(t)?;
    }
    Ok(parsed.config)
}
