//! `optim`: the optimizer kernels over a parameter arena (kernels in kernels/cuda/optim.cu):
//! the global squared norm, AdamW over a segment table, the gather of strided 2-D blocks (with
//! Muon's momentum fused in), the scatter of Muon's orthogonalised update, and the f32 -> bf16
//! compute copy. The model's optimizer (sluice-model, `optim`) drives them; Newton-Schulz itself
//! is the `newton_schulz` family.
//!
//! Arenas are 1-D F32 tensors. A *segment* is a contiguous window of the arena (one AdamW view);
//! a *block* is a strided 2-D window (`rows` x `cols`, element (r, c) at
//! `offset + r * row_stride + c`): a head's rows or columns of a projection, one expert's
//! matrix, or a whole matrix. Segments and blocks must not overlap each other (the model's
//! layout guarantees it, and [`SegmentTable::new`] / [`BlockTable::new`] check it; each element
//! then has one writer per launch).
//!
//! Formulas (f32 on every device, in this operation order):
//! - AdamW, per element with `g' = grad_scale * g`:
//!   `m = b1 m + (1 - b1) g'`, `v = b2 v + (1 - b2) g'^2`,
//!   `p = p (1 - lr wd_segment) - lr (m / bc1) / (sqrt(v / bc2) + eps)`, with `bc1 = 1 - b1^t`,
//!   `bc2 = 1 - b2^t` computed by the caller;
//! - Muon momentum (fused into the gather): `m = mu m + g'`; the gathered value is
//!   `g' + mu m` (Nesterov) or `m`;
//! - Muon apply: `p = p (1 - lr wd) - (lr scale) x`;
//! - squared norm: device: per-chunk ([`NORM_CHUNK`] elements) fixed-order block sums in f32,
//!   then one block sums the partials in a fixed order; cpu: f64 per chunk, chunks summed in
//!   order. Both orders depend only on the length: deterministic, no atomics.
//!
//! `sluice kernel` rows (end of this file): `adamw`, `sq_norm`, `muon_gather`, `muon_apply`,
//! `cast_bf16`, over flat F32 vectors (AdamW: one segment covering the vector; Muon: the block
//! table given as `offsets[n]` and `row_strides[n]` I32 tensors).

use super::elementwise::{ew_blocks, EW_THREADS};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;
use half::bf16;
use rayon::prelude::*;

/// Elements per block of the squared-norm partials (256 threads x 32 elements).
pub const NORM_CHUNK: usize = 8192;
/// Threads per block of every optim kernel (optim.cu has the same number).
const THREADS: u32 = 256;
/// Most grid-stride blocks per matrix in the gather and apply launches.
const MAX_BLOCKS_PER_MATRIX: usize = 1024;
/// Most blocks in one gather/apply launch (CUDA's grid.y limit).
pub const MAX_BLOCKS: usize = 65535;

/// A contiguous window of the arena updated by AdamW, with its weight decay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Segment {
    pub start: usize,
    pub len: usize,
    pub weight_decay: f32,
}

/// One strided 2-D block of the arena: element (r, c) at `offset + r * row_stride + c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedBlock {
    pub offset: usize,
    pub row_stride: usize,
}

/// The scalars of one AdamW step (see the module doc for the formula).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// `1 - beta1^t`.
    pub bc1: f32,
    /// `1 - beta2^t`.
    pub bc2: f32,
    /// Multiplies the gradient first (gradient clipping); 1 for none.
    pub grad_scale: f32,
}

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

// ---------------------------------------------------------------------------------------------
// Validation shared by the references and the device entry points
// ---------------------------------------------------------------------------------------------

fn finite(name: &str, v: f32) -> Result<()> {
    if !v.is_finite() {
        return Err(Error::param(name, format!("{v} is not a finite number")));
    }
    Ok(())
}

impl AdamWStep {
    /// Checks every scalar: finite, lr and eps >= 0 / > 0, betas in [0, 1), bc in (0, 1].
    pub fn validate(&self) -> Result<()> {
        for (n, v) in [
            ("lr", self.lr),
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("eps", self.eps),
            ("bc1", self.bc1),
            ("bc2", self.bc2),
            ("grad_scale", self.grad_scale),
        ] {
            finite(n, v)?;
        }
        if self.lr < 0.0 {
            return Err(Error::param("lr", format!("{} is negative", self.lr)));
        }
        for (n, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(Error::param(n, format!("{b} is outside [0, 1)")));
            }
        }
        if self.eps <= 0.0 {
            return Err(Error::param("eps", format!("{} must be > 0", self.eps)));
        }
        for (n, b) in [("bc1", self.bc1), ("bc2", self.bc2)] {
            if !(b > 0.0 && b <= 1.0) {
                return Err(Error::param(n, format!("{b} is outside (0, 1]")));
            }
        }
        Ok(())
    }
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

/// Checks segments against an arena of `len` elements: in bounds, ascending, disjoint, finite
/// non-negative weight decay.
pub fn check_segments(segments: &[Segment], len: usize) -> Result<()> {
    let mut end = 0usize;
    for (k, s) in segments.iter().enumerate() {
        let stop = s.start.checked_add(s.len).filter(|&e| e <= len);
        let Some(stop) = stop else {
            return Err(Error::param(
                "segments",
                format!(
                    "segment {k} ({}..+{}) runs past the arena's {len} elements",
                    s.start, s.len
                ),
            ));
        };
        if k > 0 && s.start < end {
            return Err(Error::param(
                "segments",
                format!("segment {k} starts at {}, inside the previous one (ends {end}); segments must be ascending and disjoint", s.start),
            ));
        }
        if !s.weight_decay.is_finite() || s.weight_decay < 0.0 {
            return Err(Error::param(
                "weight_decay",
                format!("segment {k}: {} must be finite and >= 0", s.weight_decay),
            ));
        }
        end = stop;
    }
    Ok(())
}

/// Checks blocks of `rows` x `cols` against an arena of `len` elements: each in bounds and its
/// rows non-overlapping (`cols <= row_stride` when rows > 1). Disjointness between blocks is
/// checked once by [`BlockTable::new`] ([`check_disjoint`]).
pub fn check_blocks(blocks: &[StridedBlock], rows: usize, cols: usize, len: usize) -> Result<()> {
    if blocks.len() > MAX_BLOCKS {
        return Err(Error::param(
            "blocks",
            format!("{} blocks in one batch; at most {MAX_BLOCKS}", blocks.len()),
        ));
    }
    if rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Err(Error::param(
            "blocks",
            format!("block shape [{rows},{cols}] exceeds 32-bit indices"),
        ));
    }
    for (k, b) in blocks.iter().enumerate() {
        if rows > 1 && cols > b.row_stride {
            return Err(Error::param(
                "blocks",
                format!(
                    "block {k}: {cols} columns but row stride {}: its rows would overlap",
                    b.row_stride
                ),
            ));
        }
        let end = if rows == 0 || cols == 0 {
            Some(b.offset)
        } else {
            (rows - 1)
                .checked_mul(b.row_stride)
                .and_then(|x| x.checked_add(b.offset))
                .and_then(|x| x.checked_add(cols))
        };
        if end.is_none_or(|e| e > len) {
            return Err(Error::param(
                "blocks",
                format!(
                    "block {k} (offset {}, [{rows},{cols}], row stride {}) runs past the arena's {len} elements",
                    b.offset, b.row_stride
                ),
            ));
        }
    }
    Ok(())
}

/// Checks that no two blocks share an element (every element then has one writer per launch):
/// the blocks' row windows sorted by start must not overlap. O(R log R) in the number of rows R.
pub fn check_disjoint(blocks: &[StridedBlock], rows: usize, cols: usize) -> Result<()> {
    if cols == 0 {
        return Ok(());
    }
    let mut rows_of: Vec<(usize, usize)> = blocks
        .iter()
        .enumerate()
        .flat_map(|(k, b)| (0..rows).map(move |r| (b.offset + r * b.row_stride, k)))
        .collect();
    rows_of.sort_unstable();
    for w in rows_of.windows(2) {
        if w[1].0 < w[0].0 + cols {
            return Err(Error::param(
                "blocks",
                format!(
                    "blocks {} and {} overlap (rows at arena offsets {} and {}, {cols} columns); \
                     blocks must be disjoint",
                    w[0].1, w[1].1, w[0].0, w[1].0
                ),
            ));
        }
    }
    Ok(())
}

fn check_arena(name: &str, t: &Tensor, len: usize) -> Result<()> {
    t.expect_dtype(name, DType::F32)?;
    if t.shape() != [len] {
        return Err(Error::shape(
            name,
            format!("[{len}] (the arena's length)"),
            t.shape(),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// CPU references
// ---------------------------------------------------------------------------------------------

/// The squared norm of `x` in f64: each [`NORM_CHUNK`] summed in ascending order, then the
/// chunk sums in ascending order (rayon over chunks; the order is fixed).
pub fn sq_norm_reference(x: &[f32]) -> f64 {
    #[cfg(feature = "planted-faults")]
    if let Some(planted) = crate::planted::sq_norm(x) {
        return planted;
    }
    let partials: Vec<f64> = x
        .par_chunks(NORM_CHUNK)
        .map(|c| c.iter().map(|&v| v as f64 * v as f64).sum::<f64>())
        .collect();
    partials.iter().sum()
}

/// AdamW in place over the segments of the arena slices `p`, `g`, `m`, `v` (equal lengths).
pub fn adamw_reference(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    segments: &[Segment],
    hp: &AdamWStep,
) -> Result<()> {
    hp.validate()?;
    let len = p.len();
    for (name, l) in [("g", g.len()), ("m", m.len()), ("v", v.len())] {
        if l != len {
            return Err(Error::shape(
                name,
                format!("[{len}] (the length of `p`)"),
                &[l],
            ));
        }
    }
    check_segments(segments, len)?;
    let h = *hp;
    for s in segments {
        let r = s.start..s.start + s.len;
        let wd = s.weight_decay;
        let gs = &g[r.clone()];
        // Elementwise: any cut of the segment gives the same bits.
        par::chunks3_mut(
            &mut p[r.clone()],
            &mut m[r.clone()],
            &mut v[r],
            16,
            |i0, p, m, v| {
                for (i, ((p, m), v)) in p.iter_mut().zip(m).zip(v).enumerate() {
                    let gi = h.grad_scale * gs[i0 + i];
                    let mi = h.beta1 * *m + (1.0 - h.beta1) * gi;
                    let vi = h.beta2 * *v + (1.0 - h.beta2) * (gi * gi);
                    *m = mi;
                    *v = vi;
                    let step = (mi / h.bc1) / ((vi / h.bc2).sqrt() + h.eps);
                    *p = *p * (1.0 - h.lr * wd) - h.lr * step;
                }
            },
        );
    }
    Ok(())
}

/// Copies the blocks of `src` into a dense `[n, rows, cols]` batch.
pub fn gather_blocks_reference(
    src: &[f32],
    blocks: &[StridedBlock],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>> {
    check_blocks(blocks, rows, cols, src.len())?;
    let size = rows * cols;
    let mut out = vec![0.0f32; blocks.len() * size];
    if size == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(size).zip(blocks).for_each(|(o, b)| {
        for (r, orow) in o.chunks_mut(cols).enumerate() {
            let s = b.offset + r * b.row_stride;
            orow.copy_from_slice(&src[s..s + cols]);
        }
    });
    Ok(out)
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

/// `bf16(src)` elementwise, rounding to nearest even.
pub fn cast_bf16_reference(src: &[f32]) -> Vec<bf16> {
    src.par_iter().map(|&x| bf16::from_f32(x)).collect()
}

/// [`cast_bf16_reference`] into an existing slice of the same length (rayon, no allocation).
pub fn cast_bf16_reference_into(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::shape(
            "dst",
            format!("[{}] (the length of `src`)", src.len()),
            &[dst.len()],
        ));
    }
    dst.par_chunks_mut(1 << 14)
        .zip(src.par_chunks(1 << 14))
        .for_each(|(d, s)| {
            for (d, &x) in d.iter_mut().zip(s) {
                *d = bf16::from_f32(x);
            }
        });
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Tables uploaded once per optimizer
// ---------------------------------------------------------------------------------------------

/// AdamW's segment table on a device: arena starts, the prefix sum of lengths, weight decays.
pub struct SegmentTable {
    segments: Vec<Segment>,
    total: usize,
    /// (starts U64 [S], cum U64 [S+1], wd F32 [S]) on emu/cuda; None on cpu or when empty.
    device: Option<(Tensor, Tensor, Tensor)>,
}

impl SegmentTable {
    /// Validates `segments` against an arena of `len` elements and uploads them to `backend`.
    pub fn new(backend: &Backend, segments: Vec<Segment>, len: usize) -> Result<SegmentTable> {
        check_segments(&segments, len)?;
        let total = segments.iter().map(|s| s.len).sum::<usize>();
        let device = if matches!(backend, Backend::Cpu) || segments.is_empty() {
            None
        } else {
            if segments.len() > i32::MAX as usize {
                return Err(Error::param("segments", "too many segments"));
            }
            let starts: Vec<u64> = segments.iter().map(|s| s.start as u64).collect();
            let mut cum = vec![0u64];
            for s in &segments {
                cum.push(cum.last().copied().unwrap_or(0) + s.len as u64);
            }
            let wd: Vec<f32> = segments.iter().map(|s| s.weight_decay).collect();
            Some((
                Tensor::from_slice(backend, &[starts.len()], &starts)?,
                Tensor::from_slice(backend, &[cum.len()], &cum)?,
                Tensor::from_slice(backend, &[wd.len()], &wd)?,
            ))
        };
        Ok(SegmentTable {
            segments,
            total,
            device,
        })
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The number of elements the segments cover.
    pub fn total(&self) -> usize {
        self.total
    }
}

/// A batch of same-shape blocks on a device: offsets and row strides (U64).
pub struct BlockTable {
    blocks: Vec<StridedBlock>,
    rows: usize,
    cols: usize,
    device: Option<(Tensor, Tensor)>,
}

impl BlockTable {
    /// Validates the blocks against an arena of `len` elements and uploads them to `backend`.
    pub fn new(
        backend: &Backend,
        blocks: Vec<StridedBlock>,
        rows: usize,
        cols: usize,
        len: usize,
    ) -> Result<BlockTable> {
        check_blocks(&blocks, rows, cols, len)?;
        check_disjoint(&blocks, rows, cols)?;
        let device = if matches!(backend, Backend::Cpu) || blocks.is_empty() {
            None
        } else {
            let offs: Vec<u64> = blocks.iter().map(|b| b.offset as u64).collect();
            let strides: Vec<u64> = blocks.iter().map(|b| b.row_stride as u64).collect();
            Some((
                Tensor::from_slice(backend, &[offs.len()], &offs)?,
                Tensor::from_slice(backend, &[strides.len()], &strides)?,
            ))
        };
        Ok(BlockTable {
            blocks,
            rows,
            cols,
            device,
        })
    }

    pub fn blocks(&self) -> &[StridedBlock] {
        &self.blocks
    }

    /// The block shape `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    fn grid(&self) -> [u32; 3] {
        let size = self.rows * self.cols;
        [
            blocks_for(
                size.min(MAX_BLOCKS_PER_MATRIX * THREADS as usize),
                THREADS as usize,
            ),
            self.blocks.len() as u32,
            1,
        ]
    }

    fn device_tables(&self, kernel: &str) -> Result<&(Tensor, Tensor)> {
        self.device.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "{kernel}: the block table was built for the cpu device; build it on the launch's device"
            ))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Device entry points (cpu: the references over host slices; emu/cuda: launches)
// ---------------------------------------------------------------------------------------------

/// The squared global norm of a 1-D F32 tensor, as f64 (cpu: f64 accumulation; emu/cuda: two
/// launches with f32 fixed-order block sums, then a 4-byte download).
pub fn sq_norm(backend: &Backend, x: &Tensor) -> Result<f64> {
    x.expect_dtype("x", DType::F32)?;
    x.expect_rank("x", 1, "[n]")?;
    let n = x.numel();
    if let Backend::Cpu = backend {
        return Ok(sq_norm_reference(x.host_slice::<f32>()?));
    }
    if n == 0 {
        return Ok(0.0);
    }
    let nb = n.div_ceil(NORM_CHUNK);
    if nb > i32::MAX as usize {
        return Err(Error::shape("x", "[n] with n < 2^31 * 8192", x.shape()));
    }
    let partials = Tensor::poisoned(backend, &[nb], DType::F32)?;
    let out = Tensor::poisoned(backend, &[1], DType::F32)?;
    // Block b reads x[b*chunk .. min((b+1)*chunk, n)) and writes partials[b] only.
    backend.launch(
        &Launch::new(
            "optim_sq_norm_partials_f32",
            [nb as u32, 1, 1],
            [THREADS, 1, 1],
        )
        .arg_tensor(x)
        .arg_tensor(&partials)
        .arg_i64(n as i64)
        .arg_i64(NORM_CHUNK as i64),
    )?;
    // One block reads all nb partials and writes out[0].
    backend.launch(
        &Launch::new("optim_sum_partials_f32", [1, 1, 1], [THREADS, 1, 1])
            .arg_tensor(&partials)
            .arg_tensor(&out)
            .arg_i64(nb as i64),
    )?;
    Ok(out.to_vec::<f32>()?[0] as f64)
}

/// AdamW in place over the table's segments of the arenas `p`, `g`, `m`, `v` (1-D F32, equal
/// lengths), one launch on emu/cuda.
pub fn adamw(
    backend: &Backend,
    p: &mut Tensor,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    table: &SegmentTable,
    hp: &AdamWStep,
) -> Result<()> {
    hp.validate()?;
    p.expect_rank("p", 1, "[n] (an arena)")?;
    let len = p.numel();
    check_arena("p", p, len)?;
    check_arena("g", g, len)?;
    check_arena("m", m, len)?;
    check_arena("v", v, len)?;
    check_segments(table.segments(), len)?;
    if let Backend::Cpu = backend {
        return adamw_reference(
            p.host_slice_mut()?,
            g.host_slice()?,
            m.host_slice_mut()?,
            v.host_slice_mut()?,
            table.segments(),
            hp,
        );
    }
    let total = table.total();
    if total == 0 {
        return Ok(());
    }
    let Some((starts, cum, wd)) = &table.device else {
        return Err(Error::Invalid(
            "optim_adamw_f32: the segment table was built for the cpu device; build it on the \
             launch's device"
                .into(),
        ));
    };
    // Grid-stride over the compact index k in [0, total): thread k updates p/m/v at the one
    // arena index its segment maps k to.
    backend.launch(
        &Launch::new(
            "optim_adamw_f32",
            [ew_blocks(total), 1, 1],
            [EW_THREADS, 1, 1],
        )
        .arg_tensor(p)
        .arg_tensor(g)
        .arg_tensor(m)
        .arg_tensor(v)
        .arg_tensor(starts)
        .arg_tensor(cum)
        .arg_tensor(wd)
        .arg_i32(table.segments().len() as i32)
        .arg_i64(total as i64)
        .arg_f32(hp.lr)
        .arg_f32(hp.beta1)
        .arg_f32(hp.beta2)
        .arg_f32(hp.eps)
        .arg_f32(hp.bc1)
        .arg_f32(hp.bc2)
        .arg_f32(hp.grad_scale),
    )
}

/// The table's blocks of `src` (1-D F32) as a dense `[n, rows, cols]` F32 tensor.
pub fn gather_blocks(backend: &Backend, src: &Tensor, table: &BlockTable) -> Result<Tensor> {
    src.expect_rank("src", 1, "[n] (an arena)")?;
    check_arena("src", src, src.numel())?;
    check_blocks(table.blocks(), table.rows, table.cols, src.numel())?;
    let shape = [table.blocks.len(), table.rows, table.cols];
    if let Backend::Cpu = backend {
        let out =
            gather_blocks_reference(src.host_slice()?, table.blocks(), table.rows, table.cols)?;
        return Tensor::from_slice(backend, &shape, &out);
    }
    let out = Tensor::poisoned(backend, &shape, DType::F32)?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let (offs, strides) = table.device_tables("optim_gather_blocks_f32")?;
    // Block (x, y): matrix y, grid-stride over its elements; writes out[y] only.
    backend.launch(
        &Launch::new("optim_gather_blocks_f32", table.grid(), [THREADS, 1, 1])
            .arg_tensor(src)
            .arg_tensor(&out)
            .arg_tensor(offs)
            .arg_tensor(strides)
            .arg_i32(table.rows as i32)
            .arg_i32(table.cols as i32),
    )?;
    Ok(out)
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

/// Writes `bf16(src)` into `dst` (same shape; F32 -> BF16), one launch on emu/cuda.
pub fn cast_bf16_into(backend: &Backend, src: &Tensor, dst: &mut Tensor) -> Result<()> {
    src.expect_dtype("src", DType::F32)?;
    dst.expect_dtype("dst", DType::BF16)?;
    if dst.shape() != src.shape() {
        return Err(Error::shape(
            "dst",
            format!("{:?} (the shape of `src`)", src.shape()),
            dst.shape(),
        ));
    }
    if let Backend::Cpu = backend {
        return cast_bf16_reference_into(src.host_slice()?, dst.host_slice_mut::<bf16>()?);
    }
    let n = src.numel();
    if n == 0 {
        return Ok(());
    }
    backend.launch(
        &Launch::new(
            "optim_cast_bf16_f32",
            [ew_blocks(n), 1, 1],
            [EW_THREADS, 1, 1],
        )
        .arg_tensor(src)
        .arg_tensor(dst)
        .arg_i64(n as i64),
    )
}

// ---------------------------------------------------------------------------------------------
// `sluice kernel` rows: one step over flat F32 parameter vectors (AdamW: one segment covering
// the whole vector; Muon: a block table given as offsets and row strides).
// ---------------------------------------------------------------------------------------------

/// The default of muon_apply's `scale`: the model's RMS-matching update scale of the blocks.
const MUON_SCALE_DEFAULT: &str = "0.2*sqrt(max(r,c))";

/// A 1-D F32 input of the runner, or an error naming it and `[N]`.
/// With `len = Some((n, of))` it must have the length `n` of the input `of`.
fn flat_input<'a>(call: &'a OpCall, name: &str, len: Option<(usize, &str)>) -> Result<&'a Tensor> {
    let t = call.tensor(name)?;
    t.expect_dtype(name, DType::F32)?;
    match len {
        None => t.expect_rank(name, 1, "[N]")?,
        Some((n, of)) if t.shape() != [n] => {
            return Err(Error::shape(
                name,
                format!("[N] = [{n}] (the length of `{of}`)"),
                t.shape(),
            ))
        }
        Some(_) => {}
    }
    Ok(t)
}

/// The runner's block table: `offsets[n]` and `row_strides[n]` (I32, >= 0) as strided blocks.
fn runner_blocks(call: &OpCall, n: usize) -> Result<Vec<StridedBlock>> {
    let mut cols = Vec::with_capacity(2);
    for name in ["offsets", "row_strides"] {
        let t = call.tensor(name)?;
        if t.shape() != [n] {
            return Err(Error::shape(
                name,
                format!("[n] = [{n}] (one entry per block)"),
                t.shape(),
            ));
        }
        t.expect_dtype(name, DType::I32)?;
        let v = t.to_vec::<i32>()?;
        if let Some((k, &x)) = v.iter().enumerate().find(|(_, &x)| x < 0) {
            return Err(Error::Invalid(format!("`{name}`[{k}] = {x} is negative")));
        }
        cols.push(v);
    }
    Ok(cols[0]
        .iter()
        .zip(&cols[1])
        .map(|(&o, &s)| StridedBlock {
            offset: o as usize,
            row_stride: s as usize,
        })
        .collect())
}

fn run_adamw(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let p = flat_input(call, "p", None)?;
    let n = p.numel();
    let g = flat_input(call, "g", Some((n, "p")))?;
    let (m, v) = (
        flat_input(call, "m", Some((n, "p")))?,
        flat_input(call, "v", Some((n, "p")))?,
    );
    let step = call.param_usize("step")?;
    if step == 0 || step > i32::MAX as usize {
        return Err(Error::param(
            "step",
            format!(
                "{step} is not in 1..=2^31-1 (the step count t of the bias correction, from 1)"
            ),
        ));
    }
    let (beta1, beta2) = (call.param_f32("beta1")?, call.param_f32("beta2")?);
    // The bias corrections as the model's optimizer computes them (f64 on the host).
    let hp = AdamWStep {
        lr: call.param_f32("lr")?,
        beta1,
        beta2,
        eps: call.param_f32("eps")?,
        bc1: (1.0 - (beta1 as f64).powi(step as i32)) as f32,
        bc2: (1.0 - (beta2 as f64).powi(step as i32)) as f32,
        grad_scale: call.param_f32("grad_scale")?,
    };
    hp.validate()?;
    let table = SegmentTable::new(
        backend,
        vec![Segment {
            start: 0,
            len: n,
            weight_decay: call.param_f32("weight_decay")?,
        }],
        n,
    )?;
    let mut p = p.to_backend(backend)?;
    let mut m = m.to_backend(backend)?;
    let mut v = v.to_backend(backend)?;
    adamw(backend, &mut p, g, &mut m, &mut v, &table, &hp)?;
    Ok(vec![("p", p), ("m", m), ("v", v)])
}

fn run_sq_norm(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let x = flat_input(call, "x", None)?;
    let s = sq_norm(backend, x)? as f32;
    Ok(vec![("sq_norm", Tensor::from_slice(backend, &[1], &[s])?)])
}

fn run_muon_gather(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let g = flat_input(call, "g", None)?;
    let n = g.numel();
    let mom = flat_input(call, "mom", Some((n, "g")))?;
    let offsets = call.tensor("offsets")?;
    offsets.expect_rank("offsets", 1, "[n]")?;
    let blocks = runner_blocks(call, offsets.numel())?;
    let (rows, cols) = (call.param_usize("r")?, call.param_usize("c")?);
    let hp = MuonMomentum {
        mu: call.param_f32("mu")?,
        grad_scale: call.param_f32("grad_scale")?,
        nesterov: call.param_bool("nesterov")?,
    };
    hp.validate()?;
    let table = BlockTable::new(backend, blocks, rows, cols, n)?;
    let mut mom = mom.to_backend(backend)?;
    let x = muon_gather(backend, g, &mut mom, &table, &hp)?;
    Ok(vec![("x", x), ("mom", mom)])
}

fn run_muon_apply(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let p = flat_input(call, "p", None)?;
    let x = call.tensor("x")?;
    x.expect_rank("x", 3, "[n,r,c]")?;
    x.expect_dtype("x", DType::F32)?;
    let (nb, rows, cols) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    let blocks = runner_blocks(call, nb)?;
    let scale = match call.param("scale")?.trim() {
        MUON_SCALE_DEFAULT => (0.2 * (rows.max(cols) as f64).sqrt()) as f32,
        _ => call.param_f32("scale")?,
    };
    let hp = MuonApply {
        lr: call.param_f32("lr")?,
        weight_decay: call.param_f32("weight_decay")?,
        scale,
    };
    hp.validate()?;
    let table = BlockTable::new(backend, blocks, rows, cols, p.numel())?;
    let mut p = p.to_backend(backend)?;
    muon_apply(backend, &mut p, x, &table, &hp)?;
    Ok(vec![("p", p)])
}

fn run_cast_bf16(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let x = call.tensor("x")?;
    x.expect_dtype("x", DType::F32)?;
    let mut y = Tensor::poisoned(backend, x.shape(), DType::BF16)?;
    cast_bf16_into(backend, x, &mut y)?;
    Ok(vec![("y", y)])
}

const F32_FLAT: &str = "F32";

/// `sluice kernel adamw`.
pub static ADAMW_SPEC: OpSpec = OpSpec {
    name: "adamw",
    summary: "one AdamW step over a flat parameter vector: g' = grad_scale g, m = b1 m + (1-b1) g', v = b2 v + (1-b2) g'^2, p = p (1 - lr wd) - lr (m/bc1) / (sqrt(v/bc2) + eps), bc = 1 - beta^step (defaults: the model's OptimConfig)",
    inputs: &[
        TensorSpec { name: "p", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "g", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "m", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "v", shape: "[N]", dtypes: F32_FLAT },
    ],
    params: &[
        ParamSpec { name: "lr", default: Some("3e-3"), help: "learning rate (>= 0)" },
        ParamSpec { name: "beta1", default: Some("0.9"), help: "first-moment decay, in [0, 1)" },
        ParamSpec { name: "beta2", default: Some("0.95"), help: "second-moment decay, in [0, 1)" },
        ParamSpec { name: "eps", default: Some("1e-8"), help: "denominator epsilon (> 0)" },
        ParamSpec { name: "weight_decay", default: Some("0.1"), help: "decoupled weight decay (>= 0)" },
        ParamSpec { name: "step", default: Some("1"), help: "the step count t (from 1) of the bias corrections" },
        ParamSpec { name: "grad_scale", default: Some("1"), help: "multiplies g first (gradient clipping)" },
    ],
    outputs: &[
        TensorSpec { name: "p", shape: "[N]", dtypes: "F32" },
        TensorSpec { name: "m", shape: "[N]", dtypes: "F32" },
        TensorSpec { name: "v", shape: "[N]", dtypes: "F32" },
    ],
    run: run_adamw,
};

/// `sluice kernel sq_norm`.
pub static SQ_NORM_SPEC: OpSpec = OpSpec {
    name: "sq_norm",
    summary: "the global squared norm sum x^2 in a fixed order (8192-element chunks, then the chunk sums); deterministic, no atomics",
    inputs: &[TensorSpec { name: "x", shape: "[N]", dtypes: F32_FLAT }],
    params: &[],
    outputs: &[TensorSpec { name: "sq_norm", shape: "[1]", dtypes: "F32" }],
    run: run_sq_norm,
};

/// `sluice kernel muon_gather`.
pub static MUON_GATHER_SPEC: OpSpec = OpSpec {
    name: "muon_gather",
    summary: "Muon's momentum on n disjoint strided blocks [r,c] of a flat vector (element (i,j) of block k at offsets[k] + i row_strides[k] + j): mom = mu mom + grad_scale g; x[k] = grad_scale g + mu mom (nesterov) or mom",
    inputs: &[
        TensorSpec { name: "g", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "mom", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "offsets", shape: "[n]", dtypes: "I32" },
        TensorSpec { name: "row_strides", shape: "[n]", dtypes: "I32" },
    ],
    params: &[
        ParamSpec { name: "r", default: None, help: "rows of each block" },
        ParamSpec { name: "c", default: None, help: "columns of each block" },
        ParamSpec { name: "mu", default: Some("0.95"), help: "momentum, in [0, 1)" },
        ParamSpec { name: "grad_scale", default: Some("1"), help: "multiplies g first (gradient clipping)" },
        ParamSpec { name: "nesterov", default: Some("true"), help: "Nesterov momentum" },
    ],
    outputs: &[
        TensorSpec { name: "x", shape: "[n,r,c]", dtypes: "F32" },
        TensorSpec { name: "mom", shape: "[N]", dtypes: "F32" },
    ],
    run: run_muon_gather,
};

/// `sluice kernel muon_apply`.
pub static MUON_APPLY_SPEC: OpSpec = OpSpec {
    name: "muon_apply",
    summary: "scatters Muon's orthogonalised update x[n,r,c] into n disjoint strided blocks of p (as muon_gather): p = p (1 - lr wd) - lr scale x",
    inputs: &[
        TensorSpec { name: "p", shape: "[N]", dtypes: F32_FLAT },
        TensorSpec { name: "x", shape: "[n,r,c]", dtypes: F32_FLAT },
        TensorSpec { name: "offsets", shape: "[n]", dtypes: "I32" },
        TensorSpec { name: "row_strides", shape: "[n]", dtypes: "I32" },
    ],
    params: &[
        ParamSpec { name: "lr", default: Some("3e-3"), help: "learning rate (>= 0)" },
        ParamSpec { name: "weight_decay", default: Some("0.1"), help: "decoupled weight decay (>= 0)" },
        ParamSpec { name: "scale", default: Some(MUON_SCALE_DEFAULT), help: "update scale (the model's RMS matching with AdamW)" },
    ],
    outputs: &[TensorSpec { name: "p", shape: "[N]", dtypes: "F32" }],
    run: run_muon_apply,
};

/// `sluice kernel cast_bf16`.
pub static CAST_BF16_SPEC: OpSpec = OpSpec {
    name: "cast_bf16",
    summary: "y = bf16(x) elementwise, round to nearest even (the optimizer's bf16 compute copy of the arena; y is BF16)",
    inputs: &[TensorSpec { name: "x", shape: "[...]", dtypes: F32_FLAT }],
    params: &[],
    outputs: &[TensorSpec { name: "y", shape: "[...]", dtypes: "BF16" }],
    run: run_cast_bf16,
};
