//! Occupancy and a lower bound on H200 time from a profile: models, labelled as such wherever
//! they are shown (docs/emulator.md, "Profiling").
//!
//! Occupancy uses the kernel's registers and static shared memory from ptx/RESOURCES.txt
//! (ptxas -v, sm_90a) and the launch's block size and dynamic shared memory, against the sm_90
//! limits. The bound is the largest of four terms, each a count divided by a peak rate at one
//! stated clock; the term that binds is named.

use crate::emu::profile::{Counters, KernelProfile};

/// The stated SM clock of the bound (H200 SXM boost as DESIGN 9.1 states it).
pub const CLOCK_HZ: f64 = 1.83e9;
/// Streaming multiprocessors of an H200.
pub const SMS: f64 = 132.0;
/// Measured H200 copy bandwidth (DESIGN 9.1).
pub const DRAM_BYTES_PER_S: f64 = 4.3e12;
/// wgmma's dense bf16 peak: 132 SMs x 1.83 GHz x 4096 FLOP per clock per SM (DESIGN 9.1,
/// nominal; cuBLAS attains about 790 TFLOP/s).
pub const WGMMA_FLOPS: f64 = SMS * CLOCK_HZ * 4096.0;
/// mma.sync's attainable bf16 peak on Hopper: about two thirds of wgmma's (DESIGN 9.1; to be
/// measured by the GPU run).
pub const MMA_SYNC_FLOPS: f64 = WGMMA_FLOPS * 2.0 / 3.0;
/// Special-function results per clock per SM (4 per SM sub-partition).
pub const SFU_PER_CLOCK_PER_SM: f64 = 16.0;
/// L1 wavefronts per clock per SM.
pub const L1_WAVEFRONTS_PER_CLOCK_PER_SM: f64 = 1.0;

/// sm_90 per-SM limits.
const REGS_PER_SM: u64 = 65536;
const MAX_WARPS_PER_SM: u64 = 64;
const MAX_BLOCKS_PER_SM: u64 = 32;
const SHARED_PER_SM: u64 = 233_472; // 228 KiB
const SHARED_RESERVED_PER_BLOCK: u64 = 1024;

/// One kernel's line of ptx/RESOURCES.txt (sm_90a).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resources {
    pub regs: u64,
    pub static_shared: u64,
    pub spill_bytes: u64,
}

const RESOURCES_TXT: &str = include_str!("../../../ptx/RESOURCES.txt");

/// The sm_90a resources of `kernel`, if ptx/RESOURCES.txt lists it.
pub fn resources(kernel: &str) -> Option<Resources> {
    RESOURCES_TXT.lines().find_map(|line| {
        let cols: Vec<&str> = line.split_whitespace().collect();
        // family function kind arch regs smem stack cum_stack spill_st spill_ld barriers
        if cols.len() < 10 || cols[1] != kernel || cols[3] != "sm_90a" {
            return None;
        }
        Some(Resources {
            regs: cols[4].parse().ok()?,
            static_shared: cols[5].parse().ok()?,
            spill_bytes: cols[8].parse::<u64>().ok()? + cols[9].parse::<u64>().ok()?,
        })
    })
}

/// Blocks and warps per SM on sm_90a, and what limits them.
#[derive(Debug, Clone, PartialEq)]
pub struct Occupancy {
    pub blocks_per_sm: u64,
    pub warps_per_sm: u64,
    /// `registers`, `shared memory`, `threads` or `blocks`.
    pub limit: &'static str,
    pub regs: u64,
    pub shared_bytes_per_block: u64,
    /// Grid blocks over (132 x blocks per SM).
    pub waves: f64,
}

pub fn occupancy(k: &KernelProfile) -> Option<Occupancy> {
    let r = resources(&k.name)?;
    let threads = u64::from(k.block[0]) * u64::from(k.block[1]) * u64::from(k.block[2]);
    let warps = threads.div_ceil(32);
    // Registers are allocated per warp in units of 256 (8 per thread).
    let regs_per_warp = (r.regs.max(1) * 32).div_ceil(256) * 256;
    let by_regs = (REGS_PER_SM / regs_per_warp) / warps;
    let shared = r.static_shared + k.shared_bytes as u64 + SHARED_RESERVED_PER_BLOCK;
    let by_shared = SHARED_PER_SM / shared;
    let by_threads = MAX_WARPS_PER_SM / warps;
    let limits = [
        (by_regs, "registers"),
        (by_shared, "shared memory"),
        (by_threads, "threads"),
        (MAX_BLOCKS_PER_SM, "blocks"),
    ];
    let (blocks, limit) = limits.iter().copied().min_by_key(|(b, _)| *b)?;
    Some(Occupancy {
        blocks_per_sm: blocks,
        warps_per_sm: blocks * warps,
        limit,
        regs: r.regs,
        shared_bytes_per_block: shared - SHARED_RESERVED_PER_BLOCK,
        waves: if blocks == 0 {
            f64::INFINITY
        } else {
            k.blocks_total as f64 / (SMS * blocks as f64)
        },
    })
}

/// The terms of the bound, in seconds, and the one that binds.
#[derive(Debug, Clone, PartialEq)]
pub struct Bound {
    pub seconds: f64,
    pub binding: &'static str,
    pub dram_s: f64,
    /// What the DRAM term counts: `unique bytes` (every launch profiled in full) or
    /// `compulsory bytes` (some launch sampled: unique bytes unknown).
    pub dram_basis: &'static str,
    pub dram_bytes: f64,
    pub tensor_s: f64,
    pub sfu_s: f64,
    pub l1_s: f64,
}

/// Tensor FLOPs by instruction class: (mma.sync, wgmma).
pub fn tensor_flops_by_class(c: &Counters) -> (f64, f64) {
    let mut mma = 0.0;
    let mut wgmma = 0.0;
    for (shape, count) in &c.tensor_instructions {
        let flops = count * shape_flops(shape);
        if shape.starts_with("wgmma") {
            wgmma += flops;
        } else {
            mma += flops;
        }
    }
    (mma, wgmma)
}

/// FLOPs of one instruction of a shape name like `mma.m16n8k16.bf16` (2·m·n·k).
pub fn shape_flops(shape: &str) -> f64 {
    let dims = shape
        .split('.')
        .find(|p| p.starts_with('m') && p.contains('n') && p.contains('k'));
    let Some(d) = dims else { return 0.0 };
    let parse = |s: &str| s.parse::<f64>().unwrap_or(0.0);
    let (m, rest) = d[1..].split_once('n').unwrap_or(("0", "0k0"));
    let (n, k) = rest.split_once('k').unwrap_or(("0", "0"));
    2.0 * parse(m) * parse(n) * parse(k)
}

/// The bound of an op from its kernels' totals (summed) and its compulsory bytes.
pub fn bound(kernels: &[KernelProfile], compulsory_bytes: f64) -> Bound {
    let mut total = Counters::default();
    for k in kernels {
        total.add(&k.totals);
    }
    let all_full = kernels.iter().all(|k| k.is_full());
    let unique = total.get(crate::emu::profile::UNIQUE_READ)
        + total.get(crate::emu::profile::UNIQUE_WRITTEN);
    let (dram_basis, dram_bytes) = if all_full && unique.is_finite() {
        ("unique bytes", unique)
    } else {
        ("compulsory bytes", compulsory_bytes)
    };
    let (mma, wgmma) = tensor_flops_by_class(&total);
    let dram_s = dram_bytes / DRAM_BYTES_PER_S;
    let tensor_s = mma / MMA_SYNC_FLOPS + wgmma / WGMMA_FLOPS;
    let sfu_s = total.get("special_function_calls") / (SMS * SFU_PER_CLOCK_PER_SM * CLOCK_HZ);
    let l1_s = total.l1_wavefronts() / (SMS * L1_WAVEFRONTS_PER_CLOCK_PER_SM * CLOCK_HZ);
    let terms = [
        (dram_s, "dram"),
        (tensor_s, "tensor cores"),
        (sfu_s, "special functions"),
        (l1_s, "l1 wavefronts"),
    ];
    let (seconds, binding) =
        terms
            .iter()
            .copied()
            .fold((0.0, "none"), |best, t| if t.0 > best.0 { t } else { best });
    Bound {
        seconds,
        binding,
        dram_s,
        dram_basis,
        dram_bytes,
        tensor_s,
        sfu_s,
        l1_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_give_their_flops() {
        assert_eq!(shape_flops("mma.m16n8k16.bf16"), 4096.0);
        assert_eq!(shape_flops("wgmma.m64n128k16.bf16"), 262_144.0);
        assert_eq!(shape_flops("nonsense"), 0.0);
    }

    #[test]
    fn resources_come_from_the_checked_in_table() {
        let r = resources("attention_forward_bf16").expect("listed in ptx/RESOURCES.txt");
        assert!(r.regs > 0);
        assert!(resources("no_such_kernel").is_none());
    }

    #[test]
    fn peaks_are_the_stated_ones() {
        assert!((WGMMA_FLOPS / 1e12 - 989.4).abs() < 0.1, "{}", WGMMA_FLOPS);
        assert!((MMA_SYNC_FLOPS / WGMMA_FLOPS - 2.0 / 3.0).abs() < 1e-12);
    }
}
