//! Tests of the CUDA-on-CPU emulator itself: the kernels of kernels/emu/tests/planted.cu, run
//! through the raw emu API (EmuBuffer + hand-built params), so they do not depend on the Tensor or
//! Launch layers. Planted bugs must be reported with the kernel, block and what went wrong; the
//! correct kernels must give the reference result, bit-identical under different schedule seeds.
//! This file: the harness and the correct kernels; emu_planted/findings.rs: the planted bugs.

use sluice_kernels::emu::{
    emu_kernel_names, emu_kernel_signature, emu_launch, emu_launch_checked, Checks, EmuBuffer,
    EmuFinding, LaunchOptions,
};
use std::ffi::c_void;

mod support;
use support::{checked_launch, planted_line};

/// Deterministic pseudo-random floats in [-1, 1) (xorshift; no extra dev-dependency).
fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn upload<T: Copy>(v: &[T]) -> EmuBuffer {
    let bytes = std::mem::size_of_val(v);
    let mut b = EmuBuffer::alloc(bytes).expect("emu alloc");
    // SAFETY: T is a plain Copy value type (f32/i32/u32 here); viewing it as bytes is sound.
    let src = unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), bytes) };
    b.as_bytes_mut().copy_from_slice(src);
    b
}

fn download_f32(b: &EmuBuffer) -> Vec<f32> {
    b.as_bytes()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
fn download_i32(b: &EmuBuffer) -> Vec<i32> {
    b.as_bytes()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
fn download_u16(b: &EmuBuffer) -> Vec<u16> {
    b.as_bytes()
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// One kernel argument, stored in an 8-byte slot as the cuLaunchKernel convention expects.
enum Arg<'a> {
    Buf(&'a EmuBuffer),
    I32(i32),
}

fn params_of(args: &[Arg<'_>]) -> Vec<u64> {
    args.iter()
        .map(|a| match a {
            Arg::Buf(b) => b.as_ptr() as u64,
            Arg::I32(v) => *v as u32 as u64,
        })
        .collect()
}

fn launch(
    kernel: &str,
    grid: u32,
    block: u32,
    shared: usize,
    args: &[Arg<'_>],
    seed: u64,
) -> Result<(), String> {
    let mut slots = params_of(args);
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|s| s as *mut u64 as *mut c_void)
        .collect();
    emu_launch(
        kernel,
        [grid, 1, 1],
        [block, 1, 1],
        shared,
        &mut params,
        seed,
    )
}

/// A launch with every check, race detection included whatever SLUICE_EMU_RACE says; returns
/// its findings (empty: clean).
fn checked(
    kernel: &str,
    grid: u32,
    block: u32,
    shared: usize,
    args: &[Arg<'_>],
    seed: u64,
) -> Vec<EmuFinding> {
    let mut slots = params_of(args);
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|s| s as *mut u64 as *mut c_void)
        .collect();
    checked_launch(kernel, grid, block, shared, &mut params, seed)
}

/// The single finding of `found`, of kind `kind`, located at planted.cu line `line` (its own
/// access or, for a race, either of the two).
fn only_finding<'a>(found: &'a [EmuFinding], kind: &str, line: u32) -> &'a EmuFinding {
    assert_eq!(found.len(), 1, "expected one finding, got: {found:#?}");
    let f = &found[0];
    assert_eq!(f.kind, kind, "{f}");
    let at = |l: &Option<sluice_kernels::emu::CodeLocation>| {
        l.as_ref()
            .is_some_and(|l| l.file.ends_with("kernels/emu/tests/planted.cu") && l.line == line)
    };
    assert!(
        at(&f.location) || at(&f.other),
        "finding not at planted.cu:{line}: {f}"
    );
    f
}

fn rel_err(got: f64, want: f64) -> f64 {
    (got - want).abs() / want.abs().max(1e-30)
}

#[test]
fn kernel_table_lists_the_test_kernels() {
    let names = emu_kernel_names();
    for k in ["emutest_block_sum", "emutest_oob_write", "emutest_warp_ops"] {
        assert!(names.iter().any(|n| n == k), "{k} missing from {names:?}");
    }
    assert_eq!(
        emu_kernel_signature("emutest_block_sum").as_deref(),
        Some("ppi")
    );
    assert_eq!(emu_kernel_signature("no_such_kernel"), None);
}

#[test]
fn block_sum_matches_reference_and_is_seed_invariant() {
    for n in [1usize, 17, 127, 1000, 4099] {
        let x = random_f32(n, n as u64);
        let xb = upload(&x);
        let grid = 3u32;
        let out_a = EmuBuffer::alloc(grid as usize * 4).unwrap();
        let out_b = EmuBuffer::alloc(grid as usize * 4).unwrap();
        for (out, seed) in [(&out_a, 1u64), (&out_b, 0xdead_beef)] {
            launch(
                "emutest_block_sum",
                grid,
                256,
                0,
                &[Arg::Buf(&xb), Arg::Buf(out), Arg::I32(n as i32)],
                seed,
            )
            .unwrap();
        }
        assert_eq!(
            out_a.as_bytes(),
            out_b.as_bytes(),
            "n={n}: results differ between seeds"
        );
        let total: f64 = download_f32(&out_a).iter().map(|&v| v as f64).sum();
        let want: f64 = x.iter().map(|&v| v as f64).sum();
        // f32 tree sum of <= 4099 values of magnitude <= 1: error well below 1e-5 relative to the
        // sum of magnitudes; compare against that scale.
        let scale: f64 = x.iter().map(|&v| (v as f64).abs()).sum();
        assert!(
            (total - want).abs() / scale <= 1e-5,
            "n={n}: {total} vs {want}"
        );
    }
}

#[test]
fn warp_sum_with_dynamic_shared_memory() {
    for n in [1usize, 33, 500] {
        let x = random_f32(n, 7 + n as u64);
        let xb = upload(&x);
        let block = 128u32;
        let grid = n.div_ceil(block as usize) as u32;
        let out = EmuBuffer::alloc(grid as usize * 4).unwrap();
        launch(
            "emutest_warp_sum",
            grid,
            block,
            (block / 32) as usize * 4,
            &[Arg::Buf(&xb), Arg::Buf(&out), Arg::I32(n as i32)],
            3,
        )
        .unwrap();
        let got = download_f32(&out);
        for (b, &g) in got.iter().enumerate() {
            let lo = b * block as usize;
            let hi = (lo + block as usize).min(n);
            let want: f64 = x[lo..hi].iter().map(|&v| v as f64).sum();
            assert!(
                rel_err(g as f64, want) < 1e-4 || (g as f64 - want).abs() < 1e-5,
                "block {b}: {g} vs {want}"
            );
        }
    }
}

#[test]
fn warp_primitives_follow_ptx_semantics() {
    let out = EmuBuffer::alloc(64 * 16 * 4).unwrap();
    launch("emutest_warp_ops", 1, 64, 0, &[Arg::Buf(&out)], 11).unwrap();
    let o = download_i32(&out);
    for t in 0..64usize {
        let lane = (t % 32) as i32;
        let v = |l: i32| l * 10;
        let r = &o[t * 16..t * 16 + 16];
        let seg = |w: i32| lane & !(w - 1);
        let want = [
            v(3),
            v(seg(8) + ((lane + 1) & 7)),
            if lane >= 2 { v(lane - 2) } else { v(lane) },
            if (lane & 15) >= 3 {
                v(lane - 3)
            } else {
                v(lane)
            },
            if lane + 5 <= 31 { v(lane + 5) } else { v(lane) },
            if (lane & 3) < 3 { v(lane + 1) } else { v(lane) },
            v(lane ^ 9),
            0x4924_9249u32 as i32,
            1,
            0,
            v(seg(16)),
            (0..32).map(|k: i32| k * k * (k + 1)).sum(),
            -1,
            8 * 100 + 31 + 4 * 1000,
            (0..32).sum(),
            (0xfu32 << ((lane / 4) * 4)) as i32,
        ];
        assert_eq!(r, &want, "thread {t}");
    }
}

#[test]
fn warpgroup_gather_sees_all_128_values() {
    let out = EmuBuffer::alloc(2 * 256 * 4).unwrap();
    launch("emutest_warpgroup_gather", 2, 256, 0, &[Arg::Buf(&out)], 5).unwrap();
    let o = download_i32(&out);
    let want: i64 = (0..128i64).map(|k| (k * 3 + 1) * (k % 7)).sum();
    let want_hi: i64 = (128..256i64).map(|t| (t * 3 + 1) * ((t - 128) % 7)).sum();
    for (t, &g) in o.iter().enumerate() {
        let w = if t % 256 < 128 { want } else { want_hi };
        assert_eq!(g as i64, w, "thread {t}");
    }
}

#[test]
fn bf16_and_half_conversions_round_to_nearest_even() {
    // Random bit patterns (every class: normal, subnormal, inf, NaN) plus the tie cases.
    let mut x: Vec<f32> = random_f32(20_000, 99)
        .iter()
        .enumerate()
        .map(|(i, &r)| {
            f32::from_bits(
                (r.to_bits())
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(i as u32),
            )
        })
        .collect();
    x.extend([
        0.0,
        -0.0,
        1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x3f80_8000), // bf16 tie, even below
        f32::from_bits(0x3f81_8000), // bf16 tie, odd below
        65504.0,
        65519.0,
        65520.0,
        5.960_464_5e-8,
        2.980_232_2e-8,
        1e-10,
    ]);
    let n = x.len();
    let xb = upload(&x);
    let bits = EmuBuffer::alloc(n * 2).unwrap();
    let back = EmuBuffer::alloc(n * 4).unwrap();
    let hbits = EmuBuffer::alloc(n * 2).unwrap();
    launch(
        "emutest_bf16",
        n.div_ceil(256) as u32,
        256,
        0,
        &[
            Arg::Buf(&xb),
            Arg::Buf(&bits),
            Arg::Buf(&back),
            Arg::Buf(&hbits),
            Arg::I32(n as i32),
        ],
        1,
    )
    .unwrap();
    let bits = download_u16(&bits);
    let back = download_f32(&back);
    let hbits = download_u16(&hbits);
    for i in 0..n {
        if x[i].is_nan() {
            assert_eq!(bits[i], 0x7fff, "bf16 of NaN {:#x}", x[i].to_bits());
            assert_eq!(hbits[i], 0x7fff, "half of NaN {:#x}", x[i].to_bits());
            continue;
        }
        let want = half::bf16::from_f32(x[i]).to_bits();
        assert_eq!(bits[i], want, "bf16 of {:e} ({:#x})", x[i], x[i].to_bits());
        assert_eq!(
            back[i].to_bits(),
            (want as u32) << 16,
            "bf16 round trip of {:e}",
            x[i]
        );
        let hwant = half::f16::from_f32(x[i]).to_bits();
        assert_eq!(
            hbits[i],
            hwant,
            "half of {:e} ({:#x})",
            x[i],
            x[i].to_bits()
        );
    }
}

#[test]
fn dynamic_shared_memory_is_poisoned_with_nan() {
    let out = EmuBuffer::alloc(3 * 2 * 4).unwrap();
    launch("emutest_dyn_shared_poison", 3, 32, 64, &[Arg::Buf(&out)], 2).unwrap();
    let o = download_f32(&out);
    for b in 0..3 {
        assert!(
            o[2 * b].is_nan(),
            "block {b}: unwritten shared memory read {}",
            o[2 * b]
        );
        assert_eq!(o[2 * b + 1], 2.0);
    }
}

#[test]
fn static_shared_memory_is_poisoned_per_block() {
    // More blocks than host threads (at most 8), so host threads run several blocks in turn.
    let blocks = 19;
    let out = EmuBuffer::alloc(blocks * 2 * 4).unwrap();
    launch(
        "emutest_static_shared_poison",
        blocks as u32,
        32,
        0,
        &[Arg::Buf(&out)],
        4,
    )
    .unwrap();
    let o = download_f32(&out);
    for b in 0..blocks {
        assert!(
            o[2 * b].is_nan(),
            "block {b}: unwritten static shared memory read {}",
            o[2 * b]
        );
        assert_eq!(o[2 * b + 1], 3.0);
    }
}

#[test]
fn spin_waits_yield_and_hung_spins_are_reported() {
    let out = EmuBuffer::alloc(64 * 4).unwrap();
    launch(
        "emutest_spin_wait",
        1,
        64,
        0,
        &[Arg::Buf(&out), Arg::I32(0)],
        8,
    )
    .unwrap();
    assert!(download_i32(&out).iter().all(|&v| v == 42));
    let err = launch(
        "emutest_spin_wait",
        1,
        64,
        0,
        &[Arg::Buf(&out), Arg::I32(1)],
        8,
    )
    .unwrap_err();
    assert!(
        err.contains("emutest_spin_wait block (0,0,0)") && err.contains("spin-wait"),
        "{err}"
    );
}

#[test]
fn block_order_is_shuffled_by_the_seed() {
    let blocks = 23usize;
    let mut orders = Vec::new();
    for seed in [1u64, 2] {
        let order = EmuBuffer::alloc(blocks * 4).unwrap();
        let ticket = upload(&[0i32]);
        // Race detection runs a launch's blocks on one host thread in the launch order, so the
        // tickets show that order exactly.
        let found = checked(
            "emutest_block_order",
            blocks as u32,
            32,
            0,
            &[Arg::Buf(&order), Arg::Buf(&ticket)],
            seed,
        );
        assert!(found.is_empty(), "{found:#?}");
        let got = download_i32(&order);
        let mut sorted = got.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..blocks as i32).collect::<Vec<_>>(),
            "seed {seed}: not a permutation"
        );
        orders.push(got);
    }
    assert_ne!(
        orders[0], orders[1],
        "seeds 1 and 2 ran the blocks in the same order"
    );
}

#[test]
fn launch_errors_are_reported() {
    let out = EmuBuffer::alloc(16).unwrap();
    let err = launch("no_such_kernel", 1, 32, 0, &[], 1).unwrap_err();
    assert!(err.contains("no_such_kernel"), "{err}");
    let err = launch("emutest_trap", 1, 32, 0, &[], 1).unwrap_err();
    assert!(err.contains("takes 1 parameters"), "{err}");
    let err = launch(
        "emutest_divergent_barrier",
        1,
        2048,
        0,
        &[Arg::Buf(&out)],
        1,
    )
    .unwrap_err();
    assert!(err.contains("invalid block"), "{err}");
    // A pointer that did not come from the emu allocator is a launch bug.
    let host = [0f32; 4];
    let mut slot = host.as_ptr() as u64;
    let mut params = [&mut slot as *mut u64 as *mut c_void];
    let err = emu_launch(
        "emutest_divergent_barrier",
        [1, 1, 1],
        [32, 1, 1],
        0,
        &mut params,
        1,
    )
    .unwrap_err();
    assert!(
        err.contains("does not point into memory from sluice_emu_alloc"),
        "{err}"
    );
}

#[test]
fn fresh_buffers_are_nan_poisoned_and_aligned() {
    for bytes in [0usize, 1, 4, 255, 256, 4097] {
        let b = EmuBuffer::alloc(bytes).unwrap();
        assert_eq!(b.as_ptr() as usize % 4096, 0, "{bytes} bytes");
        assert_eq!(b.len_bytes(), bytes);
        assert!(b.as_bytes().iter().all(|&v| v == 0xff));
    }
}

#[test]
fn million_element_reduction_over_4096_blocks() {
    // A launch of many blocks across the host thread pool (its speed is measured in
    // docs/emulator.md, not here: timings belong in benches).
    let n = 1 << 20;
    let x = upload(&vec![1.0f32; n]);
    let out = EmuBuffer::alloc(4096 * 4).unwrap();
    launch(
        "emutest_reduce_speed",
        4096,
        256,
        0,
        &[Arg::Buf(&x), Arg::Buf(&out), Arg::I32(n as i32)],
        1,
    )
    .unwrap();
    assert!(download_f32(&out).iter().all(|&v| v == 256.0));
}

#[path = "emu_planted/findings.rs"]
mod findings;
