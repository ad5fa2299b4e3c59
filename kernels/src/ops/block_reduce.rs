//! The CPU side of `kernels/cuda/common/block_reduce.cuh`: a row's sum in the exact order of the
//! device's 256-thread block reduction, so that the row ops built on it (RMSNorm forward and
//! backward, softmax forward and backward) give the same bits on `cpu` as the kernels under the
//! emulator.
//!
//! The order, shared with the device (`block_sum<8>`):
//! 1. [`BLOCK_THREADS`] = 256 lanes. Lane `l` adds the row's terms `l, l + 256, l + 512, ...`
//!    in increasing order to an accumulator that starts at +0.
//! 2. Each warp of 32 lanes is reduced by a xor butterfly over masks 16, 8, 4, 2, 1. Lane 0's
//!    result is the tree that adds lane `i + s` to lane `i` (for `i < s`) at strides
//!    s = 16, 8, 4, 2, 1 (every lane ends with the same bits, since `a + b == b + a` in IEEE).
//! 3. The 8 warp sums are added to +0 in ascending warp order.
//!
//! Products and sums are rounded separately, as the emulator's host compiler does (no fused
//! multiply-add on the x86-64 baseline); the terms are computed by the caller exactly as the
//! kernel writes them. nvcc contracts `acc += a * b` into an FMA on a GPU, so cuda bits may
//! differ from these in the last place (DESIGN 2 compares cuda to cpu by tolerance).

/// Threads of the device's row blocks (`THREADS` in rmsnorm.cu and elementwise.cu).
pub const BLOCK_THREADS: usize = 256;
const WARP: usize = 32;

/// The sum of `term(0), ..., term(n - 1)` in the device block reduction's order.
#[inline]
pub fn block_sum(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    let mut lanes = [0.0f32; BLOCK_THREADS];
    let mut base = 0;
    while base < n {
        let width = (n - base).min(BLOCK_THREADS);
        for (l, acc) in lanes[..width].iter_mut().enumerate() {
            *acc += term(base + l);
        }
        base += BLOCK_THREADS;
    }
    reduce_lanes(lanes)
}

/// Steps 2 and 3 of the order above: the sum of the 256 lane accumulators `lanes` (lane `l`
/// is thread `l`'s value), as `block_sum<8>` on the device adds them. For kernels whose lanes
/// accumulate in their own way (newton_schulz's sum of squares: groups of 8 elements, FMA).
#[inline]
pub fn reduce_lanes(lanes: [f32; BLOCK_THREADS]) -> f32 {
    let mut total = 0.0f32;
    for warp in lanes.chunks_exact(WARP) {
        let mut w = [0.0f32; WARP];
        w.copy_from_slice(warp);
        total += reduce_warp(w);
    }
    total
}

/// Step 2 of the order above for one warp: its 32 lane values summed by the xor butterfly
/// (masks 16, 8, 4, 2, 1), as lane 0 (and every lane) of `__shfl_xor_sync` reductions ends.
#[inline(always)]
pub fn reduce_warp(mut warp: [f32; WARP]) -> f32 {
    let mut stride = WARP / 2;
    while stride > 0 {
        for i in 0..stride {
            warp[i] += warp[i + stride];
        }
        stride /= 2;
    }
    warp[0]
}

/// A warp's dot product (moe.cu's dgate): lane `l` takes the terms `l, l + 32, ...` in
/// increasing order as one FMA chain from +0 (`fmaf`, written out in the kernel so nvcc, the
/// emulator's host compiler and this function all fuse), then [`reduce_warp`]. With hardware
/// FMA where the CPU has it (the same bits: a fused multiply-add rounds once either way).
pub fn warp_dot_fma(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "fma")]
        fn fast(a: &[f32], b: &[f32]) -> f32 {
            warp_dot_body(a, b)
        }
        if std::is_x86_feature_detected!("fma") {
            // SAFETY: `fast` only needs FMA instructions, and the CPU has them.
            return unsafe { fast(a, b) };
        }
    }
    warp_dot_body(a, b)
}

#[inline(always)]
fn warp_dot_body(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; WARP];
    for (c, (&x, &y)) in a.iter().zip(b).enumerate() {
        lanes[c % WARP] = x.mul_add(y, lanes[c % WARP]);
    }
    reduce_warp(lanes)
}

/// The maximum of `term(0), ..., term(n - 1)` (`block_max`; NaN terms are skipped as fmaxf
/// skips them; -inf for an empty row). A maximum does not depend on the order.
#[inline]
pub fn block_max(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    (0..n).fold(f32::NEG_INFINITY, |m, j| m.max(term(j)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// An independent model of the device: lanes filled by `j % 256`, each warp's 32 lanes
    /// updated all at once by the xor butterfly (`v[i] + v[i ^ m]`, as `__shfl_xor_sync`
    /// delivers it), then the warp sums added in order.
    fn simulated(v: &[f32]) -> f32 {
        let mut lanes = vec![0.0f32; BLOCK_THREADS];
        for (j, &x) in v.iter().enumerate() {
            lanes[j % BLOCK_THREADS] += x;
        }
        let mut total = 0.0f32;
        for w in lanes.chunks(WARP) {
            let mut cur = w.to_vec();
            for m in [16, 8, 4, 2, 1] {
                cur = (0..WARP).map(|i| cur[i] + cur[i ^ m]).collect();
            }
            assert!(cur.iter().all(|x| x.to_bits() == cur[0].to_bits()));
            total += cur[0];
        }
        total
    }

    #[test]
    fn block_sum_is_the_device_order() {
        let mut rng = Rng::new(11);
        let mut differs = 0;
        for n in [1usize, 17, 127, 256, 300, 1000, 4099] {
            let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            let got = block_sum(n, |j| v[j]);
            assert_eq!(got.to_bits(), simulated(&v).to_bits(), "n = {n}");
            let ascending = v.iter().fold(0.0f32, |s, &x| s + x);
            differs += usize::from(got.to_bits() != ascending.to_bits());
        }
        // The order is not the ascending one (if it were, the CPU would not need this module).
        assert!(
            differs >= 3,
            "only {differs} of 7 rows differ from the ascending sum"
        );
        assert_eq!(block_sum(0, |_| 1.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(block_max(3, |j| [1.0, f32::NAN, 3.0][j]), 3.0);
        assert_eq!(block_max(0, |_| 1.0), f32::NEG_INFINITY);
    }

    #[test]
    fn warp_dot_is_the_lane_strided_fma_chains_then_the_butterfly() {
        let mut rng = Rng::new(12);
        let mut differs = 0;
        for n in [1usize, 17, 32, 127, 300, 1000, 2048, 4099] {
            let a: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            let mut lanes = vec![0.0f32; WARP];
            for j in 0..n {
                lanes[j % WARP] = a[j].mul_add(b[j], lanes[j % WARP]);
            }
            for m in [16, 8, 4, 2, 1] {
                lanes = (0..WARP).map(|i| lanes[i] + lanes[i ^ m]).collect();
            }
            let got = warp_dot_fma(&a, &b);
            assert_eq!(got.to_bits(), lanes[0].to_bits(), "n = {n}");
            let chain = a.iter().zip(&b).fold(0.0f32, |s, (&x, &y)| x.mul_add(y, s));
            differs += usize::from(got.to_bits() != chain.to_bits());
        }
        // The order is not one chain (if it were, the reference would not need the lanes).
        assert!(
            differs >= 4,
            "only {differs} of 8 dots differ from one chain"
        );
    }
}
