//! The precision the model computes in (docs/model.md, "Precision and rounding points").
//!
//! - [`Precision::F32`]: every op on f32 tensors in true f32 (the master weights are the
//!   compute weights).
//! - [`Precision::Bf16`]: mixed precision. The forward and backward read the weights from the
//!   bf16 compute copy of the f32 master weights, and every GEMM operand is bf16 (the weight
//!   from the copy, the activation or gradient rounded to nearest even at the GEMM's input),
//!   accumulated in f32; q, k and v are rounded to bf16 after RoPE (the attention inputs and
//!   the KV cache); norms, softmax statistics, the residual stream, the loss, the gradients,
//!   the master weights and the optimizer state stay f32.

use sluice_kernels::{DType, Device, Error, Result};
use std::fmt;

/// How the model computes: see the module documentation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    #[default]
    F32,
    Bf16,
}

impl Precision {
    /// Parses `f32` or `bf16`.
    pub fn parse(s: &str) -> Result<Precision> {
        match s.trim() {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(Error::param(
                "precision",
                format!("`{other}` is not a precision; use `f32` or `bf16`"),
            )),
        }
    }

    /// The precision a device computes in unless told otherwise: bf16 on `cuda` (the tensor
    /// cores) and on `emu` (which runs what cuda runs, DESIGN 2; its bf16 layer pieces give
    /// the cpu reference's bits), f32 on `cpu` (where bf16 arithmetic is emulated and slower).
    pub fn default_for(device: Device) -> Precision {
        match device {
            Device::Cuda(_) | Device::Emu => Precision::Bf16,
            Device::Cpu => Precision::F32,
        }
    }

    /// The dtype of the compute weights, of every GEMM operand and of the KV cache.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// The precision whose compute dtype is `dtype` (F32 or BF16).
    pub fn of_dtype(dtype: DType) -> Result<Precision> {
        match dtype {
            DType::F32 => Ok(Precision::F32),
            DType::BF16 => Ok(Precision::Bf16),
            other => Err(Error::DType {
                tensor: "compute weights".into(),
                expected: "F32 or BF16".into(),
                got: other.to_string(),
            }),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_names() {
        for p in [Precision::F32, Precision::Bf16] {
            assert_eq!(Precision::parse(p.as_str()).unwrap(), p);
            assert_eq!(Precision::of_dtype(p.dtype()).unwrap(), p);
        }
        let e = Precision::parse("fp16").unwrap_err().to_string();
        assert!(e.contains("fp16") && e.contains("bf16"), "{e}");
        assert!(Precision::of_dtype(DType::I32).is_err());
        assert_eq!(Precision::default_for(Device::Cpu), Precision::F32);
        assert_eq!(Precision::default_for(Device::Emu), Precision::Bf16);
        assert_eq!(Precision::default_for(Device::Cuda(0)), Precision::Bf16);
    }
}
