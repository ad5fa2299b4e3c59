//! The parameter arena: one contiguous allocation holding every view of a [`Layout`]
//! (DESIGN.md section 5).
//!
//! The same type holds the f32 parameters, the f32 gradients, optimizer state, and (on CUDA) the
//! bf16 compute copy of the parameters made by [`Arena::cast_copy`]: all share one `Arc<Layout>`,
//! and offsets are in elements, so view `i` sits at the same element offset in each. Weight sync
//! is then a copy of one buffer, a delta sync a diff of one buffer, and an optimizer a single
//! launch over it.
//!
//! On `cpu` and `emu` the storage is host memory and views are plain slices; on `cuda` the views
//! are device memory and the slice accessors return an error (download with [`Arena::to_vec`]).
//! On every device [`Arena::view_tensor`] copies a view out as a tensor for the ops, and
//! [`Arena::write_view`] copies a tensor into a view.

use crate::layout::{Layout, ViewSpec};
use sluice_kernels::{Backend, DType, Element, Error, Result, Tensor};
use std::sync::Arc;

/// One contiguous buffer of `layout.len()` elements (F32 or BF16) on one device.
pub struct Arena {
    layout: Arc<Layout>,
    data: Tensor,
}

impl Arena {
    /// An arena of zeros (padding included) on `backend`; `dtype` is F32 or BF16.
    pub fn zeros(backend: &Backend, layout: Arc<Layout>, dtype: DType) -> Result<Arena> {
        check_float(dtype)?;
        let data = Tensor::zeros(backend, &[layout.len()], dtype)?;
        Ok(Arena { layout, data })
    }

    /// An f32 arena holding `values` (the whole arena, padding included).
    pub fn from_f32(backend: &Backend, layout: Arc<Layout>, values: &[f32]) -> Result<Arena> {
        if values.len() != layout.len() {
            return Err(Error::shape(
                "arena",
                format!("[{}] (the layout's length)", layout.len()),
                &[values.len()],
            ));
        }
        let data = Tensor::from_slice(backend, &[layout.len()], values)?;
        Ok(Arena { layout, data })
    }

    /// Wraps a 1-D tensor of the layout's length as an arena.
    pub fn from_tensor(layout: Arc<Layout>, data: Tensor) -> Result<Arena> {
        check_float(data.dtype())?;
        if data.shape() != [layout.len()] {
            return Err(Error::shape(
                "arena",
                format!("[{}] (the layout's length)", layout.len()),
                data.shape(),
            ));
        }
        Ok(Arena { layout, data })
    }

    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// The whole arena as a 1-D tensor, for kernels that run over it in one launch.
    pub fn tensor(&self) -> &Tensor {
        &self.data
    }

    pub fn tensor_mut(&mut self) -> &mut Tensor {
        &mut self.data
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// Replaces the storage (same layout, length and dtype); returns the old storage.
    /// Used to swap in a fully validated checkpoint.
    pub fn replace_tensor(&mut self, data: Tensor) -> Result<Tensor> {
        if data.shape() != self.data.shape() || data.dtype() != self.data.dtype() {
            return Err(Error::Invalid(format!(
                "cannot replace an arena of {} {:?} with a tensor of {} {:?}",
                self.data.dtype(),
                self.data.shape(),
                data.dtype(),
                data.shape()
            )));
        }
        Ok(std::mem::replace(&mut self.data, data))
    }

    /// The whole arena as f32 elements in host memory (cpu and emu).
    pub fn as_slice(&self) -> Result<&[f32]> {
        self.data.host_slice::<f32>()
    }

    /// The whole arena, mutable (cpu and emu).
    pub fn as_mut_slice(&mut self) -> Result<&mut [f32]> {
        self.data.host_slice_mut::<f32>()
    }

    /// The elements of view `name` (cpu and emu, f32 arenas).
    pub fn view(&self, name: &str) -> Result<&[f32]> {
        let i = self.layout.index_of(name)?;
        self.view_at(i)
    }

    /// The elements of view `name`, mutable.
    pub fn view_mut(&mut self, name: &str) -> Result<&mut [f32]> {
        let i = self.layout.index_of(name)?;
        self.view_at_mut(i)
    }

    /// The elements of the view with index `i` in [`Layout::views`].
    pub fn view_at(&self, i: usize) -> Result<&[f32]> {
        self.typed_view_at::<f32>(i)
    }

    /// The elements of the view with index `i`, mutable.
    pub fn view_at_mut(&mut self, i: usize) -> Result<&mut [f32]> {
        let range = self.spec(i)?.range();
        Ok(&mut self.data.host_slice_mut::<f32>()?[range])
    }

    /// The elements of view `i` as `T` (e.g. `half::bf16` for a compute copy).
    pub fn typed_view_at<T: Element>(&self, i: usize) -> Result<&[T]> {
        let range = self.spec(i)?.range();
        Ok(&self.data.host_slice::<T>()?[range])
    }

    /// View `i` as a tensor of the view's shape on `backend` (the arena's device): a copy, on
    /// any device (host slice copy on cpu and emu, device-to-device copy on cuda). This is how
    /// the forward and backward take their parameters (docs/model.md, "Forward and backward").
    pub fn view_tensor(&self, backend: &Backend, i: usize) -> Result<Tensor> {
        let spec = self.spec(i)?;
        self.data
            .copy_range(backend, spec.offset, &spec.shape)
            .map_err(|e| Error::Invalid(format!("view `{}`: {e}", spec.name)))
    }

    /// Overwrites view `i` with `values`: same dtype and device as the arena, and the view's
    /// element count (in any shape with that count, e.g. `[E*f, d]` for an `[E, f, d]` view).
    /// The inverse of [`Arena::view_tensor`]: how the backward writes gradients.
    pub fn write_view(&mut self, i: usize, values: &Tensor) -> Result<()> {
        let spec = self.spec(i)?;
        if values.numel() != spec.numel() {
            return Err(Error::shape(
                format!("gradient of `{}`", spec.name),
                format!(
                    "{:?} ({} elements, the view's shape)",
                    spec.shape,
                    spec.numel()
                ),
                values.shape(),
            ));
        }
        let (name, offset) = (spec.name.clone(), spec.offset);
        self.data
            .write_range(offset, values)
            .map_err(|e| Error::Invalid(format!("view `{name}`: {e}")))
    }

    /// Every view at once as disjoint mutable slices, in arena order (what a fused optimizer or
    /// the backward needs when it writes many views in one pass).
    pub fn views_mut(&mut self) -> Result<Vec<(&ViewSpec, &mut [f32])>> {
        let layout = &self.layout;
        let mut rest: &mut [f32] = self.data.host_slice_mut::<f32>()?;
        let mut consumed = 0;
        let mut out = Vec::with_capacity(layout.views().len());
        for spec in layout.views() {
            // Views are in increasing offset order and never overlap (Layout::new), so each
            // split takes a window strictly after the previous one.
            let tail = std::mem::take(&mut rest);
            let (_, tail) = tail.split_at_mut(spec.offset - consumed);
            let (view, tail) = tail.split_at_mut(spec.numel());
            consumed = spec.offset + spec.numel();
            rest = tail;
            out.push((spec, view));
        }
        Ok(out)
    }

    /// Downloads the whole arena as f32 (BF16 widened exactly), from any device.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        self.data.to_f32_vec()
    }

    /// Downloads one view as f32, from any device.
    pub fn view_to_vec(&self, name: &str) -> Result<Vec<f32>> {
        let range = self.layout.view(name)?.range();
        Ok(self.to_vec()?[range].to_vec())
    }

    /// A copy of the arena on `backend` with element type `dtype` (F32 or BF16, rounding to
    /// nearest even): the bf16 compute copy of f32 master weights, or a device upload.
    pub fn cast_copy(&self, backend: &Backend, dtype: DType) -> Result<Arena> {
        check_float(dtype)?;
        Ok(Arena {
            layout: self.layout.clone(),
            data: self.data.cast(backend, dtype)?,
        })
    }

    /// Sets every element (padding included) to zero, e.g. the gradient arena before a backward.
    pub fn fill_zero(&mut self, backend: &Backend) -> Result<()> {
        match self.data.host_slice_mut::<f32>() {
            Ok(s) => s.fill(0.0),
            Err(_) => self.data = Tensor::zeros(backend, self.data.shape(), self.data.dtype())?,
        }
        Ok(())
    }

    /// Copies another arena of the same layout and dtype into this one (weight sync in-process).
    pub fn copy_from(&mut self, backend: &Backend, other: &Arena) -> Result<()> {
        if self.layout != other.layout || self.dtype() != other.dtype() {
            return Err(Error::Invalid(
                "copy_from: the arenas have different layouts or dtypes".into(),
            ));
        }
        let copied = match self.dtype() {
            DType::F32 => copy_host::<f32>(&mut self.data, &other.data),
            _ => copy_host::<half::bf16>(&mut self.data, &other.data),
        };
        if !copied {
            self.data = other.data.to_backend(backend)?;
        }
        Ok(())
    }

    fn spec(&self, i: usize) -> Result<&ViewSpec> {
        self.layout.views().get(i).ok_or_else(|| {
            Error::Invalid(format!(
                "view index {i} is out of range: the layout has {} views",
                self.layout.views().len()
            ))
        })
    }
}

/// Copies host storage in place; false when either side is not in host memory.
fn copy_host<T: Element>(dst: &mut Tensor, src: &Tensor) -> bool {
    match (dst.host_slice_mut::<T>(), src.host_slice::<T>()) {
        (Ok(d), Ok(s)) => {
            d.copy_from_slice(s);
            true
        }
        _ => false,
    }
}

fn check_float(dtype: DType) -> Result<()> {
    if !matches!(dtype, DType::F32 | DType::BF16) {
        return Err(Error::DType {
            tensor: "arena".into(),
            expected: "F32 or BF16".into(),
            got: dtype.to_string(),
        });
    }
    Ok(())
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Arena({} views, {} elements, {:?})",
            self.layout.views().len(),
            self.layout.len(),
            self.data
        )
    }
}
