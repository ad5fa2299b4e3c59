//! `sluice kernel attention_forward` and `attention_backward`: their tensors, parameters and runs.

use super::*;

/// The text of the scale parameter's default in `sluice kernel --list`.
pub const SCALE_DEFAULT: &str = "1/sqrt(D)";

/// Reads the `scale` parameter: its default text means 1/sqrt(D).
pub fn scale_param(call: &OpCall) -> Result<Option<f32>> {
    if call.param("scale")?.trim() == SCALE_DEFAULT {
        Ok(None)
    } else {
        call.param_f32("scale").map(Some)
    }
}

const FWD_INPUTS: &[TensorSpec] = &[
    TensorSpec {
        name: "q",
        shape: "[T,H,D]",
        dtypes: "F32|BF16",
    },
    TensorSpec {
        name: "k",
        shape: "[T,Hkv,D]",
        dtypes: "F32|BF16",
    },
    TensorSpec {
        name: "v",
        shape: "[T,Hkv,D]",
        dtypes: "F32|BF16",
    },
    TensorSpec {
        name: "cu_seqlens",
        shape: "[B+1]",
        dtypes: "I32",
    },
];

const PARAMS: &[ParamSpec] = &[
    ParamSpec {
        name: "causal",
        default: Some("true"),
        help: "a query sees only the keys at or before its position in its sequence",
    },
    ParamSpec {
        name: "scale",
        default: Some(SCALE_DEFAULT),
        help: "softmax scale applied to q.k",
    },
];

fn run_forward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let fwd = attention_forward(
        backend,
        call.tensor("q")?,
        call.tensor("k")?,
        call.tensor("v")?,
        call.tensor("cu_seqlens")?,
        call.param_bool("causal")?,
        scale_param(call)?,
    )?;
    Ok(vec![("out", fwd.out)])
}

fn run_backward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let g = attention_backward(
        backend,
        call.tensor("q")?,
        call.tensor("k")?,
        call.tensor("v")?,
        call.tensor("cu_seqlens")?,
        call.tensor("dout")?,
        call.param_bool("causal")?,
        scale_param(call)?,
    )?;
    Ok(vec![("dq", g.dq), ("dk", g.dk), ("dv", g.dv)])
}

/// `sluice kernel attention_forward`.
pub static FORWARD_SPEC: OpSpec = OpSpec {
    name: "attention_forward",
    summary: "varlen causal/GQA attention forward over 32-key tiles: BF16 on tensor cores (128-query tiles, f32 accumulation), F32 on the SIMT path (SLUICE_ATTENTION=simt puts BF16 there too); out F32",
    inputs: FWD_INPUTS,
    params: PARAMS,
    outputs: &[TensorSpec { name: "out", shape: "[T,H,D]", dtypes: "F32" }],
    run: run_forward,
};

/// `sluice kernel attention_backward`.
pub static BACKWARD_SPEC: OpSpec = OpSpec {
    name: "attention_backward",
    summary: "attention backward: recomputes the forward, then dq, dk, dv without atomics (BF16 on tensor-core tiles, F32 on the SIMT path; outputs F32)",
    inputs: &[
        TensorSpec {
            name: "q",
            shape: "[T,H,D]",
            dtypes: "F32|BF16",
        },
        TensorSpec {
            name: "k",
            shape: "[T,Hkv,D]",
            dtypes: "F32|BF16",
        },
        TensorSpec {
            name: "v",
            shape: "[T,Hkv,D]",
            dtypes: "F32|BF16",
        },
        TensorSpec {
            name: "cu_seqlens",
            shape: "[B+1]",
            dtypes: "I32",
        },
        TensorSpec {
            name: "dout",
            shape: "[T,H,D]",
            dtypes: "F32|BF16 (the dtype of q)",
        },
    ],
    params: PARAMS,
    outputs: &[
        TensorSpec {
            name: "dq",
            shape: "[T,H,D]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dk",
            shape: "[T,Hkv,D]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dv",
            shape: "[T,Hkv,D]",
            dtypes: "F32",
        },
    ],
    run: run_backward,
};
