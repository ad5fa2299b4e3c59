//! `sluice kernel moe_forward` / `moe_backward`: the rows' parameters, inputs and outputs.

use super::{moe_backward_saved, moe_forward, moe_forward_saved, MoeConfig, ScoreFn};
use crate::device::Backend;
use crate::error::Result;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};

fn config_of(call: &OpCall) -> Result<MoeConfig> {
    Ok(MoeConfig {
        k: call.param_usize("k")?,
        score_fn: ScoreFn::parse(call.param("score_fn")?)?,
        renorm: call.param_bool("renorm")?,
        // DESIGN 7's rows have no aux parameter: the auxiliary loss is a Rust API option.
        aux_alpha: 0.0,
    })
}

fn run_forward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let out = moe_forward(
        backend,
        call.tensor("x")?,
        call.tensor("w_router")?,
        call.tensor("w1")?,
        call.tensor("w3")?,
        call.tensor("w2")?,
        config_of(call)?,
    )?;
    Ok(vec![
        ("y", out.y),
        ("topk_idx", out.topk_idx),
        ("topk_gate", out.topk_gate),
    ])
}

/// The forward of the same inputs first, for the state the backward starts from (the model's
/// training step keeps it from its own forward): under the profiler it runs but is not
/// recorded, so the backward's profile is the backward's launches alone.
fn run_backward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let (x, w_router, w1, w3, w2) = (
        call.tensor("x")?,
        call.tensor("w_router")?,
        call.tensor("w1")?,
        call.tensor("w3")?,
        call.tensor("w2")?,
    );
    let cfg = config_of(call)?;
    let (_, saved) = {
        let _setup = crate::emu::profile::Unrecorded::start();
        moe_forward_saved(backend, x, w_router, w1, w3, w2, cfg)?
    };
    let g = moe_backward_saved(
        backend,
        x,
        w_router,
        w1,
        w3,
        w2,
        call.tensor("dy")?,
        cfg,
        Some(&saved),
    )?;
    Ok(vec![
        ("dx", g.dx),
        ("dw_router", g.dw_router),
        ("dw1", g.dw1),
        ("dw3", g.dw3),
        ("dw2", g.dw2),
    ])
}

const FLOATS: &str = "F32|BF16 (as x)";

const FORWARD_INPUTS: &[TensorSpec] = &[
    TensorSpec {
        name: "x",
        shape: "[T,d]",
        dtypes: "F32|BF16 (BF16: tensor-core expert GEMMs)",
    },
    TensorSpec {
        name: "w_router",
        shape: "[E,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w1",
        shape: "[E,f,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w3",
        shape: "[E,f,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w2",
        shape: "[E,d,f]",
        dtypes: FLOATS,
    },
];

const BACKWARD_INPUTS: &[TensorSpec] = &[
    TensorSpec {
        name: "x",
        shape: "[T,d]",
        dtypes: "F32|BF16 (BF16: tensor-core expert GEMMs)",
    },
    TensorSpec {
        name: "w_router",
        shape: "[E,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w1",
        shape: "[E,f,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w3",
        shape: "[E,f,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w2",
        shape: "[E,d,f]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "dy",
        shape: "[T,d]",
        dtypes: FLOATS,
    },
];

const PARAMS: &[ParamSpec] = &[
    ParamSpec {
        name: "k",
        default: None,
        help: "experts per token, 1 <= k <= min(E, 16); required",
    },
    ParamSpec {
        name: "score_fn",
        default: Some("softmax"),
        help: "softmax (over all E) or sigmoid",
    },
    ParamSpec {
        name: "renorm",
        default: Some("true"),
        help: "divide the k kept scores by their sum",
    },
];

/// `sluice kernel moe_forward` (DESIGN.md section 7).
pub static FORWARD_SPEC: OpSpec = OpSpec {
    name: "moe_forward",
    summary: "MoE layer: router, deterministic top-k gates, stable expert sort, grouped SwiGLU \
              FFN, combine (dropless; F32 in f32, BF16 expert GEMMs on tensor cores)",
    inputs: FORWARD_INPUTS,
    params: PARAMS,
    outputs: &[
        TensorSpec {
            name: "y",
            shape: "[T,d]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "topk_idx",
            shape: "[T,k]",
            dtypes: "I32",
        },
        TensorSpec {
            name: "topk_gate",
            shape: "[T,k]",
            dtypes: "F32",
        },
    ],
    run: run_forward,
};

/// `sluice kernel moe_backward` (DESIGN.md section 7).
pub static BACKWARD_SPEC: OpSpec = OpSpec {
    name: "moe_backward",
    summary: "MoE layer backward: dx and every weight gradient of sum(dy * y); router gradient \
              through the kept gates; no atomics, fixed reduction order",
    inputs: BACKWARD_INPUTS,
    params: PARAMS,
    outputs: &[
        TensorSpec {
            name: "dx",
            shape: "[T,d]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dw_router",
            shape: "[E,d]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dw1",
            shape: "[E,f,d]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dw3",
            shape: "[E,f,d]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dw2",
            shape: "[E,d,f]",
            dtypes: "F32",
        },
    ],
    run: run_backward,
};
