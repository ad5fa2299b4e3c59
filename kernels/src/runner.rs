//! The kernel runner's op table: `sluice kernel <op>` (DESIGN.md section 7).
//!
//! Each op family contributes one [`OpSpec`]: its named tensors with the shapes expected, its
//! scalar parameters with defaults, and a function that validates the inputs and runs the op.

use crate::device::Backend;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::collections::BTreeMap;

/// A named tensor of an op, as `sluice kernel --list` shows it.
pub struct TensorSpec {
    pub name: &'static str,
    /// The shape in the design's notation, e.g. `[M,K]`.
    pub shape: &'static str,
    /// The dtypes accepted (inputs) or produced (outputs), e.g. `F32|BF16`.
    pub dtypes: &'static str,
}

/// A scalar parameter, passed as a string in the safetensors metadata.
pub struct ParamSpec {
    pub name: &'static str,
    /// The default; `None` means the parameter is required.
    pub default: Option<&'static str>,
    pub help: &'static str,
}

/// The outputs of one run, by name.
pub type OpOutputs = Vec<(&'static str, Tensor)>;

/// One op of the kernel runner.
pub struct OpSpec {
    pub name: &'static str,
    pub summary: &'static str,
    pub inputs: &'static [TensorSpec],
    pub params: &'static [ParamSpec],
    pub outputs: &'static [TensorSpec],
    /// Validates the call and runs the op; returns the outputs by name.
    pub run: fn(&Backend, &OpCall) -> Result<OpOutputs>,
}

/// The inputs of one run: named tensors already on the backend, and the string parameters.
pub struct OpCall {
    spec: &'static OpSpec,
    tensors: BTreeMap<String, Tensor>,
    params: BTreeMap<String, String>,
}

impl OpCall {
    /// Checks that every tensor and parameter is one the op knows (a misnamed tensor is an
    /// error that names it) and that every required input is present.
    pub fn new(
        spec: &'static OpSpec,
        tensors: BTreeMap<String, Tensor>,
        params: BTreeMap<String, String>,
    ) -> Result<OpCall> {
        let expected_inputs = spec
            .inputs
            .iter()
            .map(|t| format!("{}{}", t.name, t.shape))
            .collect::<Vec<_>>()
            .join(", ");
        for name in tensors.keys() {
            if !spec.inputs.iter().any(|t| t.name == name) {
                return Err(Error::Invalid(format!(
                    "tensor `{name}` is not an input of `{}`; its inputs are {expected_inputs}",
                    spec.name
                )));
            }
        }
        for input in spec.inputs {
            if !tensors.contains_key(input.name) && !input.dtypes.contains("optional") {
                return Err(Error::MissingTensor {
                    tensor: input.name.to_string(),
                    expected: format!("{} of dtype {}", input.shape, input.dtypes),
                });
            }
        }
        for name in params.keys() {
            if !spec.params.iter().any(|p| p.name == name) {
                let known = spec.params.iter().map(|p| p.name).collect::<Vec<_>>();
                return Err(Error::param(
                    name.clone(),
                    format!(
                        "`{}` takes no such parameter (it takes {known:?})",
                        spec.name
                    ),
                ));
            }
        }
        Ok(OpCall {
            spec,
            tensors,
            params,
        })
    }

    /// A required input tensor.
    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| {
            let shape = self
                .spec
                .inputs
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.shape)
                .unwrap_or("?");
            Error::MissingTensor {
                tensor: name.to_string(),
                expected: shape.to_string(),
            }
        })
    }

    /// An optional input tensor.
    pub fn optional_tensor(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// The parameter's string value, or its default.
    pub fn param(&self, name: &str) -> Result<&str> {
        if let Some(v) = self.params.get(name) {
            return Ok(v.as_str());
        }
        self.spec
            .params
            .iter()
            .find(|p| p.name == name)
            .and_then(|p| p.default)
            .ok_or_else(|| Error::param(name, "is required and was not given in the metadata"))
    }

    pub fn param_f32(&self, name: &str) -> Result<f32> {
        let s = self.param(name)?;
        s.trim()
            .parse()
            .map_err(|_| Error::param(name, format!("`{s}` is not a number")))
    }

    pub fn param_usize(&self, name: &str) -> Result<usize> {
        let s = self.param(name)?;
        s.trim()
            .parse()
            .map_err(|_| Error::param(name, format!("`{s}` is not a non-negative integer")))
    }

    pub fn param_u64(&self, name: &str) -> Result<u64> {
        let s = self.param(name)?;
        s.trim()
            .parse()
            .map_err(|_| Error::param(name, format!("`{s}` is not an unsigned 64-bit integer")))
    }

    pub fn param_bool(&self, name: &str) -> Result<bool> {
        match self.param(name)?.trim() {
            "true" | "1" => Ok(true),
            "false" | "0" => Ok(false),
            s => Err(Error::param(name, format!("`{s}` is not true or false"))),
        }
    }
}

/// Every op of the kernel runner, in the order `--list` prints them.
pub fn ops() -> &'static [&'static OpSpec] {
    crate::ops::RUNNER_OPS
}

/// The op called `name`.
pub fn find(name: &str) -> Result<&'static OpSpec> {
    ops()
        .iter()
        .copied()
        .find(|o| o.name == name)
        .ok_or_else(|| {
            let names: Vec<_> = ops().iter().map(|o| o.name).collect();
            Error::Invalid(format!(
                "unknown op `{name}`; `sluice kernel --list` shows the ops: {}",
                names.join(", ")
            ))
        })
}

/// The `--list` text.
pub fn list() -> String {
    let mut out = String::new();
    for op in ops() {
        out.push_str(&format!("{}  {}\n", op.name, op.summary));
        let tensors = |ts: &[TensorSpec]| {
            ts.iter()
                .map(|t| format!("{}{} {}", t.name, t.shape, t.dtypes))
                .collect::<Vec<_>>()
                .join(", ")
        };
        out.push_str(&format!("    inputs:  {}\n", tensors(op.inputs)));
        if !op.params.is_empty() {
            let ps = op
                .params
                .iter()
                .map(|p| match p.default {
                    Some(d) => format!("{}={d}", p.name),
                    None => format!("{} (required)", p.name),
                })
                .collect::<Vec<_>>()
                .join(", ");
            out.push_str(&format!("    params:  {ps}\n"));
        }
        out.push_str(&format!("    outputs: {}\n", tensors(op.outputs)));
    }
    out
}
