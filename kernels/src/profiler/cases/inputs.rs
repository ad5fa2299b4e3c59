//! Inputs: deterministic value generation and the [`Builder`] that collects a case's tensors,
//! parameters and compulsory bytes.

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::testing::Rng;
use half::bf16;
use rayon::prelude::*;
use std::collections::BTreeMap;

/// 64 uniform bits from (seed, i): SplitMix64 of a hash of the index, as bench_cases' `random`
/// (fast and parallel at any size).
pub(super) fn bits(seed: u64, i: u64) -> u64 {
    Rng::new(seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).next_u64()
}

/// Uniform in [-1, 1).
pub(super) fn unit(seed: u64, i: u64) -> f32 {
    (bits(seed, i) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

/// Uniform in [0, 1).
pub(super) fn frac(seed: u64, i: u64) -> f64 {
    (bits(seed, i) >> 11) as f64 / (1u64 << 53) as f64
}

pub(super) fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// A float tensor of `dtype` whose element i is `f(i)`, generated in parallel.
pub(super) fn generated(
    backend: &Backend,
    shape: &[usize],
    dtype: DType,
    f: impl Fn(u64) -> f32 + Sync + Send,
) -> Result<Tensor> {
    let n = numel(shape) as u64;
    match dtype {
        DType::F32 => {
            let v: Vec<f32> = (0..n).into_par_iter().map(f).collect();
            Tensor::from_slice(backend, shape, &v)
        }
        DType::BF16 => {
            let v: Vec<bf16> = (0..n)
                .into_par_iter()
                .map(|i| bf16::from_f32(f(i)))
                .collect();
            Tensor::from_slice(backend, shape, &v)
        }
        other => Err(Error::Invalid(format!(
            "profile cases: cannot generate a {other} value tensor"
        ))),
    }
}

/// `n` distinct values 0..n in a random order (Fisher-Yates).
pub(super) fn shuffled(n: usize, seed: u64) -> Vec<i32> {
    let mut v: Vec<i32> = (0..n as i32).collect();
    let mut rng = Rng::new(seed);
    for i in (1..n).rev() {
        v.swap(i, rng.below(i + 1));
    }
    v
}

pub(super) fn dt(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

pub(super) fn bytes_of(shape: &[usize], dtype: DType) -> f64 {
    numel(shape) as f64 * dtype.size_bytes() as f64
}

/// Collects a case's tensors, parameters and compulsory bytes.
pub(super) struct Builder<'a> {
    pub(super) backend: &'a Backend,
    /// Doc preset: value tensors are lazy zeros.
    pub(super) lazy: bool,
    pub(super) tensors: BTreeMap<String, Tensor>,
    pub(super) params: BTreeMap<String, String>,
    pub(super) bytes: f64,
    pub(super) seed: u64,
}

impl Builder<'_> {
    pub(super) fn next_seed(&mut self) -> u64 {
        self.seed = self.seed.wrapping_add(0x2545_f491_4f6c_dd1d);
        self.seed
    }

    /// Adds an input; `counted`: its bytes are read once (else the case counts what is touched).
    pub(super) fn put(&mut self, name: &str, t: Tensor, counted: bool) {
        if counted {
            self.bytes += t.len_bytes() as f64;
        }
        self.tensors.insert(name.to_string(), t);
    }

    /// A value tensor whose values steer nothing: `f(seed, i)` at small shapes, zeros (lazy,
    /// untouched) at doc shapes.
    pub(super) fn values_by(
        &mut self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        counted: bool,
        f: fn(u64, u64) -> f32,
    ) -> Result<()> {
        let t = if self.lazy {
            Tensor::zeros(self.backend, shape, dtype)?
        } else {
            let seed = self.next_seed();
            generated(self.backend, shape, dtype, move |i| f(seed, i))?
        };
        self.put(name, t, counted);
        Ok(())
    }

    /// A value tensor uniform in [-1, 1) at small shapes, zeros at doc shapes; read once.
    pub(super) fn values(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<()> {
        self.values_by(name, shape, dtype, true, unit)
    }

    /// A value tensor filled at every preset (its values steer control flow): `f(seed, i)`.
    pub(super) fn filled(
        &mut self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        f: impl Fn(u64, u64) -> f32 + Sync + Send,
    ) -> Result<()> {
        let seed = self.next_seed();
        let t = generated(self.backend, shape, dtype, move |i| f(seed, i))?;
        self.put(name, t, true);
        Ok(())
    }

    pub(super) fn i32s(&mut self, name: &str, shape: &[usize], data: &[i32]) -> Result<()> {
        let t = Tensor::from_slice(self.backend, shape, data)?;
        self.put(name, t, true);
        Ok(())
    }

    pub(super) fn f32s(&mut self, name: &str, shape: &[usize], data: &[f32]) -> Result<()> {
        let t = Tensor::from_slice(self.backend, shape, data)?;
        self.put(name, t, true);
        Ok(())
    }

    /// An output written once.
    pub(super) fn output(&mut self, shape: &[usize], dtype: DType) {
        self.bytes += bytes_of(shape, dtype);
    }

    pub(super) fn param(&mut self, name: &str, value: impl ToString) {
        self.params.insert(name.to_string(), value.to_string());
    }
}
