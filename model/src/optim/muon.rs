//! Muon over the Muon views, with the per-head and per-expert split (DESIGN.md section 3.7).
//!
//! Every Muon view contributes its blocks ([`ViewSpec::muon_blocks`]): one per attention head
//! (rows of W_q/W_k/W_v, columns of W_o), one per expert matrix, or the whole matrix. Blocks are
//! grouped by shape (rows, cols), in a fixed order, and each group is one pipeline:
//!
//! 1. momentum + gather (one launch): m = mu m + g' in the state arena, and the Nesterov input
//!    g' + mu m copied into a dense `[n, rows, cols]` batch (g' = clip factor * g);
//! 2. Newton-Schulz on the batch (one batched `newton_schulz` call; 5 steps by default): each
//!    block orthogonalised on its own, so a head's update never sees another head's gradient;
//!    in the precision of [`MuonConfig::ns_precision`] (default: bf16 GEMM operands with f32
//!    accumulation on `cuda`, f32 on `cpu` and `emu`);
//! 3. apply (one launch): p = p (1 - lr wd) - lr * 0.2 sqrt(max(rows, cols)) * x, scattered back
//!    to each block's strided window (the scale makes the update's RMS match AdamW's).
//!
//! The batch is the only scratch memory (the largest group's size, freed after the group).

use super::{MuonConfig, NsPrecision, OptimState};
use crate::arena::Arena;
use crate::layout::{Layout, ViewSpec};
use sluice_kernels::ops::newton_schulz::{
    newton_schulz, newton_schulz_bf16_reference, newton_schulz_reference,
    newton_schulz_with_precision,
};
use sluice_kernels::ops::optim::{
    gather_blocks, muon_apply, muon_apply_reference, muon_gather, muon_gather_reference,
    BlockTable, MuonApply, MuonMomentum, StridedBlock,
};
use sluice_kernels::{Backend, Result, Tensor};
use std::collections::BTreeMap;

/// The blocks of one shape, and the update scale 0.2 sqrt(max(rows, cols)).
pub struct MuonGroup {
    pub rows: usize,
    pub cols: usize,
    pub scale: f32,
    pub table: BlockTable,
}

/// The update scale of a `rows` x `cols` block (RMS matching with AdamW).
pub fn update_scale(rows: usize, cols: usize) -> f32 {
    (0.2 * (rows.max(cols) as f64).sqrt()) as f32
}

fn strided(view: &ViewSpec) -> Vec<((usize, usize), StridedBlock)> {
    view.muon_blocks()
        .into_iter()
        .map(|b| {
            (
                (b.rows, b.cols),
                StridedBlock {
                    offset: b.offset,
                    row_stride: b.row_stride,
                },
            )
        })
        .collect()
}

/// Every Muon block of `layout`, grouped by shape (ascending (rows, cols); within a group in
/// arena order), as tables on `backend`.
pub fn groups(backend: &Backend, layout: &Layout) -> Result<Vec<MuonGroup>> {
    let mut by_shape: BTreeMap<(usize, usize), Vec<StridedBlock>> = BTreeMap::new();
    for view in layout.views().iter().filter(|v| v.class.is_muon()) {
        for (shape, block) in strided(view) {
            by_shape.entry(shape).or_default().push(block);
        }
    }
    by_shape
        .into_iter()
        .filter(|((r, c), _)| r * c > 0)
        .map(|((rows, cols), blocks)| {
            Ok(MuonGroup {
                rows,
                cols,
                scale: update_scale(rows, cols),
                table: BlockTable::new(backend, blocks, rows, cols, layout.len())?,
            })
        })
        .collect()
}

/// One Muon step over every group (in place in `params` and `state.m`).
#[allow(clippy::too_many_arguments)]
pub fn step(
    backend: &Backend,
    groups: &[MuonGroup],
    config: &MuonConfig,
    params: &mut Arena,
    grads: &Arena,
    state: &mut OptimState,
    lr_factor: f32,
    grad_scale: f32,
) -> Result<()> {
    let momentum = MuonMomentum {
        mu: config.momentum,
        grad_scale,
        nesterov: config.nesterov,
    };
    let lr = config.lr * lr_factor;
    let precision = config.ns_precision_on(backend);
    for g in groups {
        let apply = MuonApply {
            lr,
            weight_decay: config.weight_decay,
            scale: g.scale,
        };
        let blocks = g.table.blocks();
        if let Backend::Cpu = backend {
            // The references over the arenas' host slices (no tensor copies); Newton-Schulz
            // runs rayon-parallel over the group's matrices.
            let batch = muon_gather_reference(
                grads.as_slice()?,
                state.m.as_mut_slice()?,
                blocks,
                g.rows,
                g.cols,
                &momentum,
            )?;
            let ns = match precision {
                NsPrecision::F32 => newton_schulz_reference,
                NsPrecision::Bf16 => newton_schulz_bf16_reference,
            };
            let x = ns(&batch, blocks.len(), g.rows, g.cols, config.ns_steps);
            muon_apply_reference(params.as_mut_slice()?, &x, blocks, g.rows, g.cols, &apply)?;
        } else {
            let batch = muon_gather(
                backend,
                grads.tensor(),
                state.m.tensor_mut(),
                &g.table,
                &momentum,
            )?;
            let x = newton_schulz_with_precision(backend, &batch, config.ns_steps, precision)?;
            muon_apply(backend, params.tensor_mut(), &x, &g.table, &apply)?;
        }
    }
    Ok(())
}

/// The orthogonalised blocks of one Muon view of `src` (no momentum, no update): the gather of
/// its blocks and one batched f32 Newton-Schulz, `[n_blocks, rows, cols]` F32 on `backend`. What
/// the step does to a view's (momentum-mixed) gradient, exposed for tests and tools.
pub fn orthogonalize_view(
    backend: &Backend,
    src: &Arena,
    view: &ViewSpec,
    ns_steps: usize,
) -> Result<Tensor> {
    let blocks = strided(view);
    let Some(&((rows, cols), _)) = blocks.first() else {
        return Err(sluice_kernels::Error::param(
            "view",
            format!("`{}` is not a Muon view (class {})", view.name, view.class),
        ));
    };
    let table = BlockTable::new(
        backend,
        blocks.into_iter().map(|(_, b)| b).collect(),
        rows,
        cols,
        src.layout().len(),
    )?;
    let batch = gather_blocks(backend, src.tensor(), &table)?;
    newton_schulz(backend, &batch, ns_steps)
}
