//! safetensors in and out: the kernel runner's file format and the checkpoint format.

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use safetensors::tensor::{Dtype as StDtype, SafeTensorError, SafeTensors, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

fn from_st(d: StDtype, name: &str) -> Result<DType> {
    Ok(match d {
        StDtype::F32 => DType::F32,
        StDtype::BF16 => DType::BF16,
        StDtype::I32 => DType::I32,
        StDtype::U8 => DType::U8,
        StDtype::U64 => DType::U64,
        other => {
            return Err(Error::DType {
                tensor: name.to_string(),
                expected: "F32, BF16, I32, U8 or U64 (the dtypes sluice holds; convert the \
                           tensor, e.g. F16 or F64 to F32)"
                    .into(),
                got: format!("{other:?}"),
            })
        }
    })
}

fn to_st(d: DType) -> StDtype {
    match d {
        DType::F32 => StDtype::F32,
        DType::BF16 => StDtype::BF16,
        DType::I32 => StDtype::I32,
        DType::U8 => StDtype::U8,
        DType::U64 => StDtype::U64,
    }
}

/// Named tensors and string metadata of one safetensors file.
pub struct TensorFile {
    pub tensors: BTreeMap<String, Tensor>,
    pub metadata: BTreeMap<String, String>,
}

/// The 8-byte little-endian header length that starts every safetensors file.
const HEADER_LEN_BYTES: usize = 8;

/// Says what is wrong with a file safetensors refused, in terms of the file: where it is short,
/// which tensor's extent disagrees with its shape, which bytes are not JSON. `e` is
/// safetensors's own verdict, kept at the end.
fn explain_invalid(bytes: &[u8], e: &SafeTensorError) -> String {
    let len = bytes.len();
    let Some(n) = bytes
        .get(..HEADER_LEN_BYTES)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    else {
        return format!(
            "the file is {len} bytes long, shorter than the {HEADER_LEN_BYTES}-byte header length \
             every safetensors file starts with: it is truncated or not a safetensors file"
        );
    };
    let after = (len - HEADER_LEN_BYTES) as u64;
    if n > after {
        return format!(
            "its first 8 bytes declare a {n}-byte JSON header, but only {after} bytes follow \
             them: the file is truncated, or not a safetensors file ({e})"
        );
    }
    let header = &bytes[HEADER_LEN_BYTES..HEADER_LEN_BYTES + n as usize];
    let json: serde_json::Value = match serde_json::from_slice(header) {
        Ok(v) => v,
        Err(je) => {
            return format!(
                "its header (bytes {HEADER_LEN_BYTES}..{}) is not valid JSON: {je}; the header \
                 is corrupt",
                HEADER_LEN_BYTES as u64 + n
            )
        }
    };
    let data_len = after - n;
    // The tensors' extents as the header declares them, in file order.
    let mut extents: Vec<(String, u64, u64)> = json
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(name, _)| name.as_str() != "__metadata__")
        .filter_map(|(name, info)| {
            let offs = info.get("data_offsets")?.as_array()?;
            Some((
                name.clone(),
                offs.first()?.as_u64()?,
                offs.get(1)?.as_u64()?,
            ))
        })
        .collect();
    extents.sort_by_key(|&(_, begin, end)| (begin, end));
    if let Some((name, _, end)) = extents.iter().find(|(_, _, end)| *end > data_len) {
        return format!(
            "tensor `{name}` needs data up to byte {end} of the data section, which holds only \
             {data_len} bytes: the file is truncated"
        );
    }
    match e {
        SafeTensorError::MetadataIncompleteBuffer => {
            let covered = extents.iter().map(|x| x.2).max().unwrap_or(0);
            format!(
                "the data section holds {data_len} bytes but the header's tensors cover only \
                 {covered}: the header and the data disagree ({e})"
            )
        }
        SafeTensorError::InvalidHeaderDeserialization(_) | SafeTensorError::InvalidHeader(_) => {
            format!("its header is JSON but not a safetensors header: {e}; the header is corrupt")
        }
        SafeTensorError::TensorInvalidInfo | SafeTensorError::InvalidOffset(_) => format!(
            "its header's shapes, dtypes and data_offsets disagree (each tensor must fill exactly \
             shape x dtype bytes, the tensors back to back): the header is corrupt ({e})"
        ),
        _ => format!("not a valid safetensors file: {e}"),
    }
}

/// Reads a safetensors file into tensors on `backend`. A file that is not valid safetensors is
/// an [`Error::Io`] saying what is wrong with it (truncated, a corrupt header); a tensor of a
/// dtype sluice does not hold (F16, F64, ...) is an [`Error::DType`] naming it.
pub fn read_safetensors(path: &Path, backend: &Backend) -> Result<TensorFile> {
    let io = |message: String| Error::Io {
        path: path.display().to_string(),
        message,
    };
    let bytes = std::fs::read(path).map_err(|e| io(e.to_string()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| io(explain_invalid(&bytes, &e)))?;
    let (_, header) =
        SafeTensors::read_metadata(&bytes).map_err(|e| io(explain_invalid(&bytes, &e)))?;
    let metadata: BTreeMap<String, String> = header
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let mut tensors = BTreeMap::new();
    for (name, view) in st.tensors() {
        let dtype = from_st(view.dtype(), &name)?;
        let t = Tensor::from_bytes(backend, view.shape(), dtype, view.data())?;
        tensors.insert(name, t);
    }
    Ok(TensorFile { tensors, metadata })
}

/// Writes named tensors (downloaded from their device) and metadata to a safetensors file.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(&str, &Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let io = |message: String| Error::Io {
        path: path.display().to_string(),
        message,
    };
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, t)| t.to_bytes())
        .collect::<Result<_>>()?;
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, t), b)| {
            TensorView::new(to_st(t.dtype()), t.shape().to_vec(), b)
                .map(|v| (name.to_string(), v))
                .map_err(|e| io(format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<_>>()?;
    let meta: Option<HashMap<String, String>> = if metadata.is_empty() {
        None
    } else {
        Some(
            metadata
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        )
    };
    let out = safetensors::serialize(views, meta).map_err(|e| io(e.to_string()))?;
    std::fs::write(path, out).map_err(|e| io(e.to_string()))
}
