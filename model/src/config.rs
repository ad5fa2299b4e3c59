//! The model config: architecture and initialisation, read from TOML (configs/model/*.toml).
//!
//! Every key is checked by [`ModelConfig::validate`]; a bad value is an
//! [`Error::Param`] whose name is the config key (`model.<key>`) and
//! whose message says what is wrong and what is allowed. Unknown keys are rejected when parsing,
//! so a typo (`n_expert = 8`) is an error, not a silently ignored line.

use serde::{Deserialize, Serialize};
use sluice_kernels::{Error, Result};
use std::path::Path;

/// The largest number of experts the router top-k supports (DESIGN.md section 3.2: E <= 512).
pub const MAX_EXPERTS: usize = 512;
/// The largest top-k the router supports (DESIGN.md section 3.2: k <= 16).
pub const MAX_TOP_K: usize = 16;
/// The largest head dimension the attention kernels take (kernels/src/ops/attention/mod.rs).
pub const MAX_HEAD_DIM: usize = 256;

/// How the router turns logits into gate scores (DESIGN.md section 3.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ScoreFn {
    /// Softmax over all experts' logits.
    #[default]
    Softmax,
    /// Independent sigmoid of each logit.
    Sigmoid,
}

impl ScoreFn {
    pub fn name(self) -> &'static str {
        match self {
            ScoreFn::Softmax => "softmax",
            ScoreFn::Sigmoid => "sigmoid",
        }
    }
}

/// A decoder-only MoE transformer (DESIGN.md section 5). See docs/model.md for each key.
///
/// The embedding and the LM head are separate matrices (no weight tying): the LM head is an AdamW
/// view of its own, and tying would make one arena view serve two optimizer roles.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Vocabulary size (rows of the embedding and of the LM head).
    pub vocab: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA); must divide `n_heads`.
    pub n_kv_heads: usize,
    /// Width of one head; even, because RoPE rotates pairs.
    pub head_dim: usize,
    /// Routed experts per MoE layer (1..=512).
    pub n_experts: usize,
    /// Experts each token is routed to (1..=min(16, n_experts)).
    pub top_k: usize,
    /// Hidden width of one routed expert's SwiGLU FFN.
    pub expert_ffn_dim: usize,
    /// Whether layer 0 has a dense SwiGLU FFN instead of an MoE.
    #[serde(default)]
    pub dense_first_layer: bool,
    /// Hidden width of the dense first layer's FFN; only with `dense_first_layer = true`.
    /// Default: `top_k * expert_ffn_dim` (the active FFN width of an MoE layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dense_ffn_dim: Option<usize>,
    /// Whether every MoE layer also has a shared expert that sees every token (gate 1).
    #[serde(default)]
    pub shared_expert: bool,
    /// Hidden width of the shared expert; only with `shared_expert = true`.
    /// Default: `expert_ffn_dim`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_expert_ffn_dim: Option<usize>,
    /// RoPE base.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// Router scores: `softmax` or `sigmoid`.
    #[serde(default)]
    pub score_fn: ScoreFn,
    /// Renormalise the k kept gates to sum 1.
    #[serde(default = "default_true")]
    pub renorm: bool,
    /// Seed of the parameter initialisation (init only: not part of the architecture).
    #[serde(default)]
    pub seed: u64,
    /// Standard deviation of the normal initialisation of matrices (init only).
    #[serde(default = "default_init_std")]
    pub init_std: f64,
}

fn default_rope_theta() -> f64 {
    10000.0
}
fn default_norm_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}
fn default_init_std() -> f64 {
    0.02
}

fn bad(key: &str, message: impl Into<String>) -> Error {
    Error::param(format!("model.{key}"), message)
}

impl ModelConfig {
    /// Parses and validates a config from TOML text.
    pub fn from_toml_str(text: &str) -> Result<ModelConfig> {
        // toml's message names the line and the key (`unknown field `n_expert``,
        // `missing field `vocab``, `invalid type ...`).
        let cfg: ModelConfig =
            toml::from_str(text).map_err(|e| Error::Invalid(format!("model config: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads, parses and validates a TOML config file.
    pub fn from_file(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::from_toml_str(&text).map_err(|e| match e {
            Error::Invalid(m) => Error::Invalid(format!("{}: {m}", path.display())),
            Error::Param { name, message } => Error::Param {
                name,
                message: format!("{message} (in {})", path.display()),
            },
            other => other,
        })
    }

    /// The config as TOML text (round-trips through [`ModelConfig::from_toml_str`]).
    pub fn to_toml_string(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| Error::Invalid(format!("model config to TOML: {e}")))
    }

    /// The config as one-line JSON (the checkpoint metadata form).
    pub fn to_json(&self) -> String {
        // Serialising plain numbers, strings and booleans cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parses and validates a config from JSON (the checkpoint metadata form).
    pub fn from_json(text: &str) -> Result<ModelConfig> {
        let cfg: ModelConfig = serde_json::from_str(text)
            .map_err(|e| Error::Invalid(format!("model config JSON: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The small CPU model of the model issue: d_model 128, 4 layers, 8 experts top-2,
    /// 4 query heads x 32 with 2 KV heads, expert FFN 256, vocab 64. Same as
    /// configs/model/small.toml.
    pub fn small() -> ModelConfig {
        ModelConfig {
            vocab: 64,
            d_model: 128,
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 32,
            n_experts: 8,
            top_k: 2,
            expert_ffn_dim: 256,
            dense_first_layer: false,
            dense_ffn_dim: None,
            shared_expert: false,
            shared_expert_ffn_dim: None,
            rope_theta: default_rope_theta(),
            norm_eps: default_norm_eps(),
            score_fn: ScoreFn::Softmax,
            renorm: true,
            seed: 0,
            init_std: default_init_std(),
        }
    }

    /// The tiny model of the gradient tests: every feature on (dense first layer, shared
    /// expert, GQA), with shapes small enough for finite differences. Same as
    /// configs/model/tiny.toml.
    pub fn tiny() -> ModelConfig {
        ModelConfig {
            vocab: 11,
            d_model: 8,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 4,
            n_experts: 4,
            top_k: 2,
            expert_ffn_dim: 6,
            dense_first_layer: true,
            dense_ffn_dim: Some(10),
            shared_expert: true,
            shared_expert_ffn_dim: Some(5),
            rope_theta: default_rope_theta(),
            norm_eps: default_norm_eps(),
            score_fn: ScoreFn::Softmax,
            renorm: true,
            seed: 0,
            init_std: 0.2,
        }
    }

    /// Hidden width of the dense first layer, if there is one.
    pub fn dense_ffn_width(&self) -> Option<usize> {
        self.dense_first_layer.then(|| {
            self.dense_ffn_dim
                .unwrap_or(self.top_k * self.expert_ffn_dim)
        })
    }

    /// Hidden width of the shared expert, if there is one.
    pub fn shared_expert_width(&self) -> Option<usize> {
        self.shared_expert
            .then(|| self.shared_expert_ffn_dim.unwrap_or(self.expert_ffn_dim))
    }

    /// Whether layer `layer` has the dense FFN (else an MoE FFN).
    pub fn is_dense_layer(&self, layer: usize) -> bool {
        layer == 0 && self.dense_first_layer
    }

    /// Query projection width, `n_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Key/value projection width, `n_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Checks every key; the error names the first bad key and says what is allowed.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab", self.vocab),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("n_experts", self.n_experts),
            ("top_k", self.top_k),
            ("expert_ffn_dim", self.expert_ffn_dim),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(bad(key, "must be at least 1, got 0"));
            }
        }
        if self.vocab > i32::MAX as usize {
            return Err(bad(
                "vocab",
                format!(
                    "{} does not fit the I32 token ids (at most {})",
                    self.vocab,
                    i32::MAX
                ),
            ));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(bad(
                "n_kv_heads",
                format!(
                    "n_heads = {} is not a multiple of n_kv_heads = {} (GQA shares each KV head \
                     among n_heads / n_kv_heads query heads)",
                    self.n_heads, self.n_kv_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(bad(
                "head_dim",
                format!(
                    "{} is odd; RoPE rotates pairs of dimensions, so head_dim must be even",
                    self.head_dim
                ),
            ));
        }
        if self.head_dim > MAX_HEAD_DIM {
            return Err(bad(
                "head_dim",
                format!(
                    "{} exceeds the attention kernels' limit of {MAX_HEAD_DIM}",
                    self.head_dim
                ),
            ));
        }
        if self.n_experts > MAX_EXPERTS {
            return Err(bad(
                "n_experts",
                format!(
                    "{} exceeds the router top-k limit of {MAX_EXPERTS} experts",
                    self.n_experts
                ),
            ));
        }
        if self.top_k > MAX_TOP_K {
            return Err(bad(
                "top_k",
                format!(
                    "{} exceeds the router top-k limit of {MAX_TOP_K}",
                    self.top_k
                ),
            ));
        }
        if self.top_k > self.n_experts {
            return Err(bad(
                "top_k",
                format!(
                    "{} is more than n_experts = {}; a token cannot be routed to more experts \
                     than exist",
                    self.top_k, self.n_experts
                ),
            ));
        }
        match (self.dense_first_layer, self.dense_ffn_dim) {
            (false, Some(_)) => {
                return Err(bad(
                    "dense_ffn_dim",
                    "is set but dense_first_layer = false; set dense_first_layer = true or \
                     remove dense_ffn_dim",
                ))
            }
            (true, Some(0)) => return Err(bad("dense_ffn_dim", "must be at least 1, got 0")),
            _ => {}
        }
        match (self.shared_expert, self.shared_expert_ffn_dim) {
            (false, Some(_)) => {
                return Err(bad(
                    "shared_expert_ffn_dim",
                    "is set but shared_expert = false; set shared_expert = true or remove \
                     shared_expert_ffn_dim",
                ))
            }
            (true, Some(0)) => {
                return Err(bad("shared_expert_ffn_dim", "must be at least 1, got 0"))
            }
            _ => {}
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(bad(
                "rope_theta",
                format!("{} is not a finite number greater than 1", self.rope_theta),
            ));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0 && self.norm_eps < 1.0) {
            return Err(bad(
                "norm_eps",
                format!("{} is not a finite number in (0, 1)", self.norm_eps),
            ));
        }
        if !(self.init_std.is_finite() && self.init_std > 0.0) {
            return Err(bad(
                "init_std",
                format!("{} is not a finite positive number", self.init_std),
            ));
        }
        // The arena's element count must fit in usize (and the layout checks each product);
        // computing it here turns an absurd config into an error before any allocation.
        crate::layout::Layout::new(self).map(|_| ())
    }

    /// The first architecture key (everything except the init-only `seed` and `init_std`)
    /// whose value differs from `other`'s, as `key: self vs other`. `None` when the two
    /// configs describe the same architecture, so parameters of one fit the other.
    pub fn architecture_diff(&self, other: &ModelConfig) -> Option<String> {
        // Compare the effective widths, so an explicit default equals an omitted one.
        let normal = |c: &ModelConfig| {
            let mut c = c.clone();
            c.dense_ffn_dim = c.dense_ffn_width();
            c.shared_expert_ffn_dim = c.shared_expert_width();
            serde_json::to_value(c).ok()
        };
        let (a, b) = (normal(self)?, normal(other)?);
        let (a, b) = (a.as_object()?, b.as_object()?);
        let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
        keys.sort();
        keys.dedup();
        for key in keys {
            if key == "seed" || key == "init_std" {
                continue;
            }
            let (va, vb) = (a.get(key), b.get(key));
            if va != vb {
                let show = |v: Option<&serde_json::Value>| {
                    v.map(|v| v.to_string()).unwrap_or_else(|| "unset".into())
                };
                return Some(format!("{key}: {} vs {}", show(va), show(vb)));
            }
        }
        None
    }
}
