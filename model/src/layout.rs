//! The parameter layout: every named view of the model, where it sits in the arena, its shape,
//! how the optimizers treat it and how it is initialised (DESIGN.md section 5).
//!
//! Views are laid out in forward order (embedding, then each layer, then the final norm and the
//! LM head), each starting at a multiple of [`ALIGN`] elements, so a kernel can use 16-byte
//! vector loads on any view in f32 or bf16 (and 256-byte aligned starts in f32). The gap after a
//! view up to the next aligned offset is padding that is always zero and belongs to no view.
//! One layout is shared (by `Arc`) by the parameter arena, the gradient arena, any optimizer
//! state arenas and a bf16 compute copy: offsets are in elements, whatever the element type.

use crate::config::ModelConfig;
use sluice_kernels::{Error, Result};
use std::collections::HashMap;
use std::fmt;

/// Alignment of every view's offset, in elements (64 f32 = 256 bytes, 64 bf16 = 128 bytes).
pub const ALIGN: usize = 64;

/// Which axis of a projection is split into heads for Muon Split (DESIGN.md section 3.7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HeadAxis {
    /// Head h owns rows `h*head_dim .. (h+1)*head_dim` (W_q, W_k, W_v: `[heads*head_dim, d]`).
    Rows,
    /// Head h owns columns `h*head_dim .. (h+1)*head_dim` (W_o: `[d, heads*head_dim]`).
    Cols,
}

/// How the optimizers treat a view (DESIGN.md sections 3.7 and 5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OptimClass {
    /// Muon, each head's block orthogonalised on its own.
    MuonPerHead {
        axis: HeadAxis,
        n_heads: usize,
        head_dim: usize,
    },
    /// Muon on a stack `[n_experts, rows, cols]`, each expert's matrix on its own.
    MuonPerExpert { n_experts: usize },
    /// Muon on the whole matrix.
    Muon,
    /// AdamW, elementwise.
    AdamW,
}

/// The optimizer class without its parameters, for filtering.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OptimKind {
    MuonPerHead,
    MuonPerExpert,
    Muon,
    AdamW,
}

impl OptimClass {
    pub fn kind(&self) -> OptimKind {
        match self {
            OptimClass::MuonPerHead { .. } => OptimKind::MuonPerHead,
            OptimClass::MuonPerExpert { .. } => OptimKind::MuonPerExpert,
            OptimClass::Muon => OptimKind::Muon,
            OptimClass::AdamW => OptimKind::AdamW,
        }
    }

    /// Whether any Muon variant (as opposed to AdamW) updates this view.
    pub fn is_muon(&self) -> bool {
        !matches!(self, OptimClass::AdamW)
    }
}

impl fmt::Display for OptimClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OptimClass::MuonPerHead {
                axis,
                n_heads,
                head_dim,
            } => {
                let axis = match axis {
                    HeadAxis::Rows => "rows",
                    HeadAxis::Cols => "cols",
                };
                write!(f, "muon-per-head({axis}, {n_heads}x{head_dim})")
            }
            OptimClass::MuonPerExpert { n_experts } => write!(f, "muon-per-expert({n_experts})"),
            OptimClass::Muon => f.write_str("muon"),
            OptimClass::AdamW => f.write_str("adamw"),
        }
    }
}

/// How a view is initialised (see [`crate::init`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InitRule {
    /// Independent normal draws with mean 0 and standard deviation `scale * init_std`
    /// (`init_std` from the config; the scale is 1, or 1/sqrt(2 n_layers) for output
    /// projections). The layout holds the scale, not the std, so it depends on the architecture
    /// alone.
    Normal { scale: f64 },
    /// All ones (RMSNorm scales).
    Ones,
}

/// One 2-D block the Muon optimizer orthogonalises on its own, as a strided window of the
/// arena: element (r, c) of the block is at `offset + r * row_stride + c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixBlock {
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
}

/// One named parameter: a row-major window `offset .. offset + numel` of the arena.
#[derive(Clone, Debug, PartialEq)]
pub struct ViewSpec {
    pub name: String,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub class: OptimClass,
    pub init: InitRule,
}

impl ViewSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The element range of this view in the arena.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.numel()
    }

    /// The blocks Muon orthogonalises separately, following the view's class: one per head
    /// (rows or columns), one per expert, or the whole matrix. Empty for AdamW views.
    pub fn muon_blocks(&self) -> Vec<MatrixBlock> {
        let (rows, cols) = match self.shape.as_slice() {
            [r, c] => (*r, *c),
            [_, r, c] => (*r, *c),
            _ => return Vec::new(),
        };
        match self.class {
            OptimClass::AdamW => Vec::new(),
            OptimClass::Muon => vec![MatrixBlock {
                offset: self.offset,
                rows,
                cols,
                row_stride: cols,
            }],
            OptimClass::MuonPerExpert { n_experts } => (0..n_experts)
                .map(|e| MatrixBlock {
                    offset: self.offset + e * rows * cols,
                    rows,
                    cols,
                    row_stride: cols,
                })
                .collect(),
            OptimClass::MuonPerHead {
                axis: HeadAxis::Rows,
                n_heads,
                head_dim,
            } => (0..n_heads)
                .map(|h| MatrixBlock {
                    offset: self.offset + h * head_dim * cols,
                    rows: head_dim,
                    cols,
                    row_stride: cols,
                })
                .collect(),
            OptimClass::MuonPerHead {
                axis: HeadAxis::Cols,
                n_heads,
                head_dim,
            } => (0..n_heads)
                .map(|h| MatrixBlock {
                    offset: self.offset + h * head_dim,
                    rows,
                    cols: head_dim,
                    row_stride: cols,
                })
                .collect(),
        }
    }
}

/// Names of the views, in one place (docs/model.md lists them).
pub mod names {
    pub const EMBED: &str = "embed.weight";
    pub const FINAL_NORM: &str = "final_norm.scale";
    pub const LM_HEAD: &str = "lm_head.weight";

    /// `layers.{layer}.{suffix}`, e.g. `layers.0.attn.wq`.
    pub fn layer(layer: usize, suffix: &str) -> String {
        format!("layers.{layer}.{suffix}")
    }
}

/// Indices (into [`Layout::views`]) of one layer's views, for the forward and backward.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerViews {
    pub attn_norm: usize,
    pub wq: usize,
    pub wk: usize,
    pub wv: usize,
    pub wo: usize,
    pub ffn_norm: usize,
    pub ffn: FfnViews,
}

/// The FFN of one layer: dense SwiGLU, or MoE with an optional shared expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FfnViews {
    Dense {
        w1: usize,
        w3: usize,
        w2: usize,
    },
    Moe {
        router: usize,
        w1: usize,
        w3: usize,
        w2: usize,
        /// `(w1, w3, w2)` of the shared expert.
        shared: Option<(usize, usize, usize)>,
    },
}

/// The table of named views and the arena length.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    views: Vec<ViewSpec>,
    index: HashMap<String, usize>,
    layers: Vec<LayerViews>,
    embed: usize,
    final_norm: usize,
    lm_head: usize,
    len: usize,
}

/// Builds the view list, checking every size product for overflow.
struct Builder {
    views: Vec<ViewSpec>,
    next: usize,
}

fn overflow(name: &str) -> Error {
    Error::Invalid(format!(
        "model config: parameter `{name}` would have more elements than fit in memory \
         (size overflow); reduce the model dimensions"
    ))
}

impl Builder {
    fn push(
        &mut self,
        name: String,
        shape: Vec<usize>,
        class: OptimClass,
        init: InitRule,
    ) -> Result<usize> {
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .ok_or_else(|| overflow(&name))?;
        let offset = self.next;
        let end = offset.checked_add(numel).ok_or_else(|| overflow(&name))?;
        self.next = end
            .checked_next_multiple_of(ALIGN)
            .ok_or_else(|| overflow(&name))?;
        self.views.push(ViewSpec {
            name,
            offset,
            shape,
            class,
            init,
        });
        Ok(self.views.len() - 1)
    }
}

impl Layout {
    /// The layout of a config. Does not validate the config's value ranges (that is
    /// [`ModelConfig::validate`], which calls this); only checks the sizes for overflow.
    pub fn new(cfg: &ModelConfig) -> Result<Layout> {
        let d = cfg.d_model;
        // Output projections (W_o, W2) write into the residual stream, which sums 2 per layer:
        // scaling their init by 1/sqrt(2 n_layers) keeps the stream's variance O(1) at init.
        let normal = InitRule::Normal { scale: 1.0 };
        let out_normal = InitRule::Normal {
            scale: 1.0 / ((2 * cfg.n_layers) as f64).sqrt(),
        };
        let mut b = Builder {
            views: Vec::new(),
            next: 0,
        };
        let embed = b.push(
            names::EMBED.into(),
            vec![cfg.vocab, d],
            OptimClass::AdamW,
            normal,
        )?;
        let heads = |n_heads: usize, axis: HeadAxis| OptimClass::MuonPerHead {
            axis,
            n_heads,
            head_dim: cfg.head_dim,
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |s: &str| names::layer(l, s);
            let attn_norm = b.push(
                n("attn_norm.scale"),
                vec![d],
                OptimClass::AdamW,
                InitRule::Ones,
            )?;
            let wq = b.push(
                n("attn.wq"),
                vec![cfg.q_dim(), d],
                heads(cfg.n_heads, HeadAxis::Rows),
                normal,
            )?;
            let wk = b.push(
                n("attn.wk"),
                vec![cfg.kv_dim(), d],
                heads(cfg.n_kv_heads, HeadAxis::Rows),
                normal,
            )?;
            let wv = b.push(
                n("attn.wv"),
                vec![cfg.kv_dim(), d],
                heads(cfg.n_kv_heads, HeadAxis::Rows),
                normal,
            )?;
            let wo = b.push(
                n("attn.wo"),
                vec![d, cfg.q_dim()],
                heads(cfg.n_heads, HeadAxis::Cols),
                out_normal,
            )?;
            let ffn_norm = b.push(
                n("ffn_norm.scale"),
                vec![d],
                OptimClass::AdamW,
                InitRule::Ones,
            )?;
            let ffn = if let Some(f) = cfg.dense_ffn_width().filter(|_| cfg.is_dense_layer(l)) {
                FfnViews::Dense {
                    w1: b.push(n("ffn.w1"), vec![f, d], OptimClass::Muon, normal)?,
                    w3: b.push(n("ffn.w3"), vec![f, d], OptimClass::Muon, normal)?,
                    w2: b.push(n("ffn.w2"), vec![d, f], OptimClass::Muon, out_normal)?,
                }
            } else {
                let e = cfg.n_experts;
                let f = cfg.expert_ffn_dim;
                let per_expert = OptimClass::MuonPerExpert { n_experts: e };
                let router = b.push(n("moe.router"), vec![e, d], OptimClass::AdamW, normal)?;
                let w1 = b.push(n("moe.w1"), vec![e, f, d], per_expert, normal)?;
                let w3 = b.push(n("moe.w3"), vec![e, f, d], per_expert, normal)?;
                let w2 = b.push(n("moe.w2"), vec![e, d, f], per_expert, out_normal)?;
                let shared = match cfg.shared_expert_width() {
                    Some(fs) => Some((
                        b.push(n("moe.shared.w1"), vec![fs, d], OptimClass::Muon, normal)?,
                        b.push(n("moe.shared.w3"), vec![fs, d], OptimClass::Muon, normal)?,
                        b.push(
                            n("moe.shared.w2"),
                            vec![d, fs],
                            OptimClass::Muon,
                            out_normal,
                        )?,
                    )),
                    None => None,
                };
                FfnViews::Moe {
                    router,
                    w1,
                    w3,
                    w2,
                    shared,
                }
            };
            layers.push(LayerViews {
                attn_norm,
                wq,
                wk,
                wv,
                wo,
                ffn_norm,
                ffn,
            });
        }
        let final_norm = b.push(
            names::FINAL_NORM.into(),
            vec![d],
            OptimClass::AdamW,
            InitRule::Ones,
        )?;
        let lm_head = b.push(
            names::LM_HEAD.into(),
            vec![cfg.vocab, d],
            OptimClass::AdamW,
            normal,
        )?;
        let index = b
            .views
            .iter()
            .enumerate()
            .map(|(i, v)| (v.name.clone(), i))
            .collect();
        Ok(Layout {
            views: b.views,
            index,
            layers,
            embed,
            final_norm,
            lm_head,
            len: b.next,
        })
    }

    /// Every view, in arena order.
    pub fn views(&self) -> &[ViewSpec] {
        &self.views
    }

    /// The arena length in elements (the end of the last view, rounded up to [`ALIGN`]).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sum of the views' element counts (the arena minus its alignment padding).
    pub fn param_count(&self) -> usize {
        self.views.iter().map(ViewSpec::numel).sum()
    }

    /// The view called `name`, if any.
    pub fn get(&self, name: &str) -> Option<&ViewSpec> {
        self.index.get(name).map(|&i| &self.views[i])
    }

    /// The index of the view called `name`, or an error naming it.
    pub fn index_of(&self, name: &str) -> Result<usize> {
        self.index.get(name).copied().ok_or_else(|| {
            Error::Invalid(format!(
                "the model has no parameter named `{name}` (names look like `{}` or `{}`)",
                names::EMBED,
                names::layer(0, "attn.wq")
            ))
        })
    }

    /// The view called `name`, or an error naming it.
    pub fn view(&self, name: &str) -> Result<&ViewSpec> {
        self.index_of(name).map(|i| &self.views[i])
    }

    /// The views the optimizer of `kind` updates, in arena order.
    pub fn views_of(&self, kind: OptimKind) -> impl Iterator<Item = &ViewSpec> + '_ {
        self.views.iter().filter(move |v| v.class.kind() == kind)
    }

    /// Per-layer view indices, for the forward and backward.
    pub fn layers(&self) -> &[LayerViews] {
        &self.layers
    }

    pub fn embed(&self) -> usize {
        self.embed
    }

    pub fn final_norm(&self) -> usize {
        self.final_norm
    }

    pub fn lm_head(&self) -> usize {
        self.lm_head
    }
}
