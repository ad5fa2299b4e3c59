//! Element types of sluice tensors.

use half::bf16;
use std::fmt;

/// The dtypes a tensor may hold (DESIGN.md section 7: floats are F32 or BF16, integers I32,
/// flags U8, request ids U64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    I32,
    U8,
    U64,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 => 2,
            DType::U8 => 1,
            DType::U64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::U8 => "U8",
            DType::U64 => "U64",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that can be the element of a tensor.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for u64 {
    const DTYPE: DType = DType::U64;
}
