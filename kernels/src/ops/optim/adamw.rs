//! AdamW over the arena's segments: the step's scalars, the segment table, the CPU reference
//! and the one-launch device update.

use super::{check_arena, finite};
use crate::device::Backend;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::ops::elementwise::{ew_blocks, EW_THREADS};
use crate::par;
use crate::tensor::Tensor;

/// A contiguous window of the arena updated by AdamW, with its weight decay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Segment {
    pub start: usize,
    pub len: usize,
    pub weight_decay: f32,
}

/// The scalars of one AdamW step (see the `optim` module doc for the formula).
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
