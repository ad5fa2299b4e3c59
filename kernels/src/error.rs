//! The error type of every sluice op: messages say what is wrong and what to do.

use std::fmt;

/// Result of sluice operations.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in a sluice op, with enough context to act on it.
#[derive(Debug)]
pub enum Error {
    /// A device cannot be opened or used (no driver, no such ordinal, unsupported GPU).
    Device(String),
    /// A tensor has the wrong shape; names the tensor and the shape expected.
    Shape {
        tensor: String,
        expected: String,
        got: Vec<usize>,
    },
    /// A tensor has the wrong dtype.
    DType {
        tensor: String,
        expected: String,
        got: String,
    },
    /// A tensor the op needs is missing.
    MissingTensor { tensor: String, expected: String },
    /// A scalar parameter is malformed or out of range.
    Param { name: String, message: String },
    /// A kernel launch failed (driver error, emulator check, bad launch configuration).
    Launch {
        kernel: String,
        device: String,
        message: String,
    },
    /// The CUDA driver returned an error outside a launch (allocation, copy, module load).
    Cuda(String),
    /// Input that is invalid for a reason not covered above.
    Invalid(String),
    /// File input/output.
    Io { path: String, message: String },
}

impl Error {
    /// Whether the error is the caller's input (exit code 2 in the CLI) rather than the system.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            Error::Shape { .. }
                | Error::DType { .. }
                | Error::MissingTensor { .. }
                | Error::Param { .. }
                | Error::Invalid(_)
        )
    }

    pub fn shape(tensor: impl Into<String>, expected: impl Into<String>, got: &[usize]) -> Self {
        Error::Shape {
            tensor: tensor.into(),
            expected: expected.into(),
            got: got.to_vec(),
        }
    }

    pub fn param(name: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Param {
            name: name.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Device(m) => write!(f, "{m}"),
            Error::Shape {
                tensor,
                expected,
                got,
            } => write!(
                f,
                "tensor `{tensor}` has shape {got:?}; expected {expected}"
            ),
            Error::DType {
                tensor,
                expected,
                got,
            } => write!(f, "tensor `{tensor}` has dtype {got}; expected {expected}"),
            Error::MissingTensor { tensor, expected } => {
                write!(f, "tensor `{tensor}` is missing; expected {expected}")
            }
            Error::Param { name, message } => write!(f, "parameter `{name}`: {message}"),
            Error::Launch {
                kernel,
                device,
                message,
            } => write!(f, "kernel `{kernel}` on {device}: {message}"),
            Error::Cuda(m) => write!(f, "CUDA driver: {m}"),
            Error::Invalid(m) => write!(f, "{m}"),
            Error::Io { path, message } => write!(f, "{path}: {message}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Cuda(e.to_string())
    }
}
