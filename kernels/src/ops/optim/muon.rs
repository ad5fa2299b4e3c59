//! Muon's arena kernels: the momentum fused into the gather of the blocks, and the scatter of
//! the orthogonalised update (Newton-Schulz itself is the `newton_schulz` family).

use super::blocks::{check_blocks, BlockTable, StridedBlock};
use super::{check_arena, finite, THREADS};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::tensor::Tensor;
use rayon::prelude::*;

/// The scalars of Muon's momentum (fused into the gather).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MuonMomentum {
    pub mu: f32,
    pub grad_scale: f32,
    pub nesterov: bool,
}

/// The scalars of Muon's apply: `p = p (1 - lr wd) - (lr scale) x`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MuonApply {
    pub lr: f32,
    pub weight_decay: f32,
    pub scale: f32,
}

impl MuonMomentum {
    pub fn validate(&self) -> Result<()> {
        finite("mu", self.mu)?;
        finite("grad_scale", self.grad_scale)?;
        if !(0.0..1.0).contains(&self.mu) {
            return Err(Error::param("mu", format!("{} is outside [0, 1)", self.mu)));
        }
        Ok(())
    }
}

impl MuonApply {
    pub fn validate(&self) -> Result<()> {
        finite("lr", self.lr)?;
        finite("weight_decay", self.weight_decay)?;
        finite("scale", self.scale)?;
        if self.lr < 0.0 {
            return Err(Error::param("lr", format!("{} is negative", self.lr)));
        }
        if self.weight_decay < 0.0 {
            return Err(Error::param(
                "weight_decay",
                format!("{} is negative", self.weight_decay),
            ));
        }
        Ok(())
    }
}

/// Muon's momentum over the blocks, gathered: `m = mu m + g'` in place in `mom`, and returns
/// the dense `[n, rows, cols]` batch of `g' + mu m` (Nesterov) or `m`.
pub fn muon_gather_reference(
    g: &[f32],
    mom: &mut [f32],
    blocks: &[StridedBlock],
    rows: usize,
    cols: usize,
    hp: &MuonMomentum,
) -> Result<Vec<f32>> {
    hp.validate()?;
    if mom.len() != g.len() {
        return Err(Error::shape(
            "mom",
            format!("[{}] (the length of `g`)", g.len()),
            &[mom.len()],
        ));
    }
    check_blocks(blocks, rows, cols, g.len())?;
    let size = rows * cols;
    let mut out = vec![0.0f32; blocks.len() * size];
    if size == 0 {
        return Ok(out);
    }
    let h = *hp;
    // The batch of new momenta first (parallel over blocks, reading `mom`), then the momenta
    // written back and the output finished block by block.
    let mut new_m = vec![0.0f32; blocks.len() * size];
    {
        let mom: &[f32] = mom;
        new_m
            .par_chunks_mut(size)
            .zip(out.par_chunks_mut(size))
            .zip(blocks)
            .for_each(|((nm, o), b)| {
                for r in 0..rows {
                    let s = b.offset + r * b.row_stride;
                    for c in 0..cols {
                        let gi = h.grad_scale * g[s + c];
                        let mi = h.mu * mom[s + c] + gi;
                        nm[r * cols + c] = mi;
                        o[r * cols + c] = if h.nesterov { gi + h.mu * mi } else { mi };
                    }
                }
            });
    }
    for (nm, b) in new_m.chunks(size).zip(blocks) {
        for (r, row) in nm.chunks(cols).enumerate() {
            let s = b.offset + r * b.row_stride;
            mom[s..s + cols].copy_from_slice(row);
        }
    }
    Ok(out)
}

/// Scatters the orthogonalised batch `x` `[n, rows, cols]` into `p`:
/// `p = p (1 - lr wd) - (lr scale) x` on each block.
pub fn muon_apply_reference(
    p: &mut [f32],
    x: &[f32],
    blocks: &[StridedBlock],
    rows: usize,
    cols: usize,
    hp: &MuonApply,
) -> Result<()> {
    hp.validate()?;
    check_blocks(blocks, rows, cols, p.len())?;
    let size = rows * cols;
    if x.len() != blocks.len() * size {
        return Err(Error::shape(
            "x",
            format!("[{}, {rows}, {cols}] (one matrix per block)", blocks.len()),
            &[x.len()],
        ));
    }
    let decay = 1.0 - hp.lr * hp.weight_decay;
    let step = hp.lr * hp.scale;
    for (xb, b) in x.chunks(size.max(1)).zip(blocks) {
        for r in 0..rows {
            let s = b.offset + r * b.row_stride;
            for (pv, &xv) in p[s..s + cols].iter_mut().zip(&xb[r * cols..(r + 1) * cols]) {
                *pv = *pv * decay - step * xv;
            }
        }
    }
    Ok(())
}

/// Muon's momentum on the table's blocks (`mom` updated in place) and the gathered batch
/// `[n, rows, cols]` that Newton-Schulz orthogonalises.
pub fn muon_gather(
    backend: &Backend,
    g: &Tensor,
    mom: &mut Tensor,
    table: &BlockTable,
    hp: &MuonMomentum,
) -> Result<Tensor> {
    hp.validate()?;
    g.expect_rank("g", 1, "[n] (an arena)")?;
    let len = g.numel();
    check_arena("g", g, len)?;
    check_arena("mom", mom, len)?;
    check_blocks(table.blocks(), table.rows, table.cols, len)?;
    let shape = [table.blocks.len(), table.rows, table.cols];
    if let Backend::Cpu = backend {
        let out = muon_gather_reference(
            g.host_slice()?,
            mom.host_slice_mut()?,
            table.blocks(),
            table.rows,
            table.cols,
            hp,
        )?;
        return Tensor::from_slice(backend, &shape, &out);
    }
    let out = Tensor::poisoned(backend, &shape, DType::F32)?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let (offs, strides) = table.device_tables("optim_muon_gather_f32")?;
    // Each arena element of a block is read and written by one thread (blocks are disjoint).
    backend.launch(
        &Launch::new("optim_muon_gather_f32", table.grid(), [THREADS, 1, 1])
            .arg_tensor(g)
            .arg_tensor(mom)
            .arg_tensor(&out)
            .arg_tensor(offs)
            .arg_tensor(strides)
            .arg_i32(table.rows as i32)
            .arg_i32(table.cols as i32)
            .arg_f32(hp.mu)
            .arg_f32(hp.grad_scale)
            .arg_i32(hp.nesterov as i32),
    )?;
    Ok(out)
}

/// Scatters the orthogonalised batch `x` `[n, rows, cols]` into the arena `p`:
/// `p = p (1 - lr wd) - (lr scale) x` on each block.
pub fn muon_apply(
    backend: &Backend,
    p: &mut Tensor,
    x: &Tensor,
    table: &BlockTable,
    hp: &MuonApply,
) -> Result<()> {
    hp.validate()?;
    p.expect_rank("p", 1, "[n] (an arena)")?;
    check_arena("p", p, p.numel())?;
    check_blocks(table.blocks(), table.rows, table.cols, p.numel())?;
    x.expect_dtype("x", DType::F32)?;
    let shape = [table.blocks.len(), table.rows, table.cols];
    if x.shape() != shape {
        return Err(Error::shape(
            "x",
            format!("{shape:?} (one matrix per block)"),
            x.shape(),
        ));
    }
    if let Backend::Cpu = backend {
        return muon_apply_reference(
            p.host_slice_mut()?,
            x.host_slice()?,
            table.blocks(),
            table.rows,
            table.cols,
            hp,
        );
    }
    if x.numel() == 0 {
        return Ok(());
    }
    let (offs, strides) = table.device_tables("optim_muon_apply_f32")?;
    backend.launch(
        &Launch::new("optim_muon_apply_f32", table.grid(), [THREADS, 1, 1])
            .arg_tensor(p)
            .arg_tensor(x)
            .arg_tensor(offs)
            .arg_tensor(strides)
            .arg_i32(table.rows as i32)
            .arg_i32(table.cols as i32)
            .arg_f32(hp.lr)
            .arg_f32(hp.weight_decay)
            .arg_f32(hp.scale),
    )
}
