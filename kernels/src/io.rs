//! safetensors in and out: the kernel runner's file format and the checkpoint format.

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
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
                expected: "F32, BF16, I32, U8 or U64".into(),
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

/// Reads a safetensors file into tensors on `backend`.
pub fn read_safetensors(path: &Path, backend: &Backend) -> Result<TensorFile> {
    let io = |message: String| Error::Io {
        path: path.display().to_string(),
        message,
    };
    let bytes = std::fs::read(path).map_err(|e| io(e.to_string()))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| io(format!("not a valid safetensors file: {e}")))?;
    let metadata: BTreeMap<String, String> = header
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| io(format!("not a valid safetensors file: {e}")))?;
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
