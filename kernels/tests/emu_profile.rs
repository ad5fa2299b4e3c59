//! Tests of the emulator's profiler (docs/emulator.md, "Profiling"): the kernels of
//! kernels/emu/tests/profile.cu, whose memory-pipeline counts are known by construction, and two
//! real kernels. Every count is exact and is asserted under several schedule seeds.

use sluice_kernels::emu::profile::{Counters, KernelProfile, Recording, Sampling};
use sluice_kernels::emu::{emu_launch, EmuBuffer};
use std::ffi::c_void;

/// Schedule seeds every count must agree under.
const SEEDS: [u64; 4] = [0, 1, 7, 12345];

fn upload<T: Copy>(v: &[T]) -> EmuBuffer {
    let bytes = std::mem::size_of_val(v);
    let mut b = EmuBuffer::alloc(bytes).expect("emu alloc");
    // SAFETY: T is a plain Copy value type (f32/u32/u16 here); viewing it as bytes is sound.
    let src = unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), bytes) };
    b.as_bytes_mut().copy_from_slice(src);
    b
}

enum Arg<'a> {
    Buf(&'a EmuBuffer),
    I32(i32),
}

/// Runs `kernel` once per seed under a recording; asserts the profiles agree across seeds and
/// returns the first.
fn profile(kernel: &str, grid: u32, block: u32, args: &[Arg<'_>]) -> KernelProfile {
    let mut first: Option<KernelProfile> = None;
    for seed in SEEDS {
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match a {
                Arg::Buf(b) => b.as_ptr() as u64,
                Arg::I32(v) => *v as u32 as u64,
            })
            .collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        let rec = Recording::start(Sampling::full()).unwrap();
        emu_launch(kernel, [grid, 1, 1], [block, 1, 1], 0, &mut params, seed).unwrap();
        let mut launches = rec.finish();
        assert_eq!(launches.len(), 1, "{kernel}: one launch recorded");
        let p = launches.remove(0);
        assert_eq!(
            p.blocks_profiled, p.blocks_total,
            "{kernel}: every block ran"
        );
        match &first {
            None => first = Some(p),
            Some(f) => {
                assert_eq!(
                    f.totals, p.totals,
                    "{kernel}: totals differ under seed {seed}"
                );
                assert_eq!(
                    f.lines, p.lines,
                    "{kernel}: per-line counts differ under seed {seed}"
                );
            }
        }
    }
    first.unwrap()
}

fn assert_counts(c: &Counters, what: &str, expected: &[(&str, f64)]) {
    for (name, v) in expected {
        assert_eq!(
            c.get(name),
            *v,
            "{what}: {name} (all counters: {:?})",
            c.values
        );
    }
}

fn floats(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i as f32) * 0.25 - 3.0).collect()
}

#[test]
fn coalesced_strided_and_misaligned_loads_count_their_sectors() {
    let x = upload(&floats(32 * 32 + 8));
    let y = upload(&vec![0.0f32; 64]);
    // (stride, offset) -> (requests, sectors, lines, ideal sectors) for two warps of 32 lanes.
    let cases = [
        (1, 0, 2.0, 8.0, 2.0, 8.0),
        (2, 0, 2.0, 16.0, 4.0, 8.0),
        (32, 0, 2.0, 64.0, 64.0, 8.0),
        (1, 1, 2.0, 10.0, 4.0, 8.0),
    ];
    for (stride, offset, req, sectors, lines, ideal) in cases {
        let block = if stride == 32 { 32 } else { 64 };
        let scale = if stride == 32 { 0.5 } else { 1.0 };
        let p = profile(
            "emutest_prof_strided",
            1,
            block,
            &[
                Arg::Buf(&x),
                Arg::Buf(&y),
                Arg::I32(stride),
                Arg::I32(offset),
            ],
        );
        let what = format!("stride {stride} offset {offset}");
        assert_counts(
            &p.totals,
            &what,
            &[
                ("global_load_requests", req * scale),
                ("global_load_bytes", 4.0 * f64::from(block)),
                ("global_load_sectors", sectors * scale),
                ("global_load_lines", lines * scale),
                ("global_load_ideal_sectors", ideal * scale),
                ("global_store_requests", req * scale),
                ("global_store_sectors", 8.0 * scale),
                ("global_store_ideal_sectors", 8.0 * scale),
            ],
        );
        // Unique bytes: the loads read block lanes' 4 bytes each.
        assert_eq!(
            p.totals.get("unique_bytes_read"),
            4.0 * f64::from(block),
            "{what}"
        );
        assert_eq!(
            p.totals.get("unique_bytes_written"),
            4.0 * f64::from(block),
            "{what}"
        );
    }
}

#[test]
fn a_broadcast_is_one_sector() {
    let x = upload(&floats(8));
    let y = upload(&[0.0f32; 32]);
    let p = profile(
        "emutest_prof_broadcast",
        1,
        32,
        &[Arg::Buf(&x), Arg::Buf(&y)],
    );
    assert_counts(
        &p.totals,
        "broadcast",
        &[
            ("global_load_requests", 1.0),
            ("global_load_bytes", 128.0),
            ("global_load_sectors", 1.0),
            ("global_load_lines", 1.0),
            ("global_load_ideal_sectors", 1.0),
            ("unique_bytes_read", 4.0),
        ],
    );
}

#[test]
fn a_float4_load_is_sixteen_sectors_in_four_lines() {
    let x = upload(&floats(128));
    let y = upload(&vec![0.0f32; 128]);
    let p = profile("emutest_prof_float4", 1, 32, &[Arg::Buf(&x), Arg::Buf(&y)]);
    assert_counts(
        &p.totals,
        "float4",
        &[
            ("global_load_requests", 1.0),
            ("global_load_bytes", 512.0),
            ("global_load_sectors", 16.0),
            ("global_load_lines", 4.0),
            ("global_load_ideal_sectors", 16.0),
            ("global_store_requests", 1.0),
            ("global_store_sectors", 16.0),
        ],
    );
    assert_eq!(
        p.totals
            .widths
            .get("global_load")
            .map(|w| w.iter().copied().collect::<Vec<_>>()),
        Some(vec![16])
    );
}

#[test]
fn a_shared_transpose_conflicts_unless_padded() {
    let x = upload(&floats(1024));
    let y = upload(&vec![0.0f32; 1024]);
    for (kernel, per_column) in [
        ("emutest_prof_transpose", 32.0),
        ("emutest_prof_transpose_padded", 1.0),
    ] {
        let p = profile(kernel, 1, 1024, &[Arg::Buf(&x), Arg::Buf(&y)]);
        assert_counts(
            &p.totals,
            kernel,
            &[
                ("shared_store_requests", 32.0),
                ("shared_store_wavefronts", 32.0),
                ("shared_store_ideal_wavefronts", 32.0),
                ("shared_load_requests", 32.0),
                ("shared_load_wavefronts", 32.0 * per_column),
                ("shared_load_ideal_wavefronts", 32.0),
                ("barriers", 32.0),
            ],
        );
    }
}

#[test]
fn wide_shared_accesses_go_in_half_and_quarter_warp_phases() {
    let x = upload(&floats(32));
    let y = upload(&[0.0f32; 32]);
    let p = profile(
        "emutest_prof_wide_shared",
        1,
        32,
        &[Arg::Buf(&x), Arg::Buf(&y)],
    );
    // One 8-byte and one 16-byte request each way: 2 + 4 wavefronts, at ideal.
    assert_counts(
        &p.totals,
        "wide shared",
        &[
            ("shared_store_requests", 2.0),
            ("shared_store_wavefronts", 6.0),
            ("shared_store_ideal_wavefronts", 6.0),
            ("shared_load_requests", 2.0),
            ("shared_load_wavefronts", 6.0),
            ("shared_load_ideal_wavefronts", 6.0),
        ],
    );
    let widths: Vec<u32> = p.totals.widths["shared_load"].iter().copied().collect();
    assert_eq!(widths, vec![8, 16]);
}

#[test]
fn ldmatrix_counts_its_eight_row_phases_and_a_swizzle_removes_the_conflicts() {
    let x = upload(&vec![0x3f80u16; 32 * 64]);
    let y = upload(&vec![0u32; 128]);
    for (kernel, waves) in [
        ("emutest_prof_ldmatrix", 32.0),
        ("emutest_prof_ldmatrix_swizzled", 4.0),
    ] {
        let p = profile(kernel, 1, 32, &[Arg::Buf(&x), Arg::Buf(&y)]);
        assert_counts(
            &p.totals,
            kernel,
            &[
                ("ldmatrix_instructions", 1.0),
                ("shared_load_requests", 1.0),
                ("shared_load_wavefronts", waves),
                ("shared_load_ideal_wavefronts", 4.0),
                // The emulation's own reads of the tile are not the kernel's.
                ("global_load_requests", 64.0),
            ],
        );
    }
}

#[test]
fn an_mma_loop_counts_n_cubed_over_2048_instructions() {
    let frag = upload(&vec![0x3f80_3f80u32; 256]);
    let out = upload(&vec![0.0f32; 128]);
    for n in [16, 32, 48] {
        let p = profile(
            "emutest_prof_mma",
            1,
            32,
            &[Arg::Buf(&frag), Arg::Buf(&out), Arg::I32(n)],
        );
        let instructions = (n * n * n) as f64 / 2048.0;
        assert_eq!(
            p.totals
                .tensor_instructions
                .get("mma.m16n8k16.bf16")
                .copied(),
            Some(instructions),
            "n = {n}"
        );
        assert_eq!(
            p.totals.get("tensor_flops"),
            instructions * 4096.0,
            "n = {n}"
        );
        // The warp-gathers of the emulation are not shuffles.
        assert_eq!(p.totals.get("shuffles"), 0.0);
    }
}

#[test]
fn a_48_thread_block_has_a_partial_second_warp() {
    let x = upload(&floats(64));
    let y = upload(&[0.0f32; 48]);
    let p = profile(
        "emutest_prof_strided",
        1,
        48,
        &[Arg::Buf(&x), Arg::Buf(&y), Arg::I32(1), Arg::I32(0)],
    );
    assert_counts(
        &p.totals,
        "48 threads",
        &[
            ("global_load_requests", 2.0),
            ("global_load_bytes", 192.0),
            ("global_load_sectors", 6.0),
            ("global_load_lines", 2.0),
            ("global_load_ideal_sectors", 6.0),
        ],
    );
}

#[test]
fn divergent_branches_and_loops_make_requests_of_the_lanes_that_run_them() {
    let x = upload(&floats(512));
    let y = upload(&[0.0f32; 32]);
    let p = profile(
        "emutest_prof_divergent",
        1,
        32,
        &[Arg::Buf(&x), Arg::Buf(&y)],
    );
    // Branch: 2 requests of 16 lanes (2 sectors each). Loop: 4 requests of 32, 24, 16, 8 lanes,
    // each touching all 4 sectors of its 32 consecutive floats (every 8-lane sector has lanes
    // with L % 4 >= k), so only the ideal shrinks: 4, 3, 2, 1.
    assert_counts(
        &p.totals,
        "divergent",
        &[
            ("global_load_requests", 6.0),
            ("global_load_bytes", 4.0 * (32.0 + 32.0 + 24.0 + 16.0 + 8.0)),
            ("global_load_sectors", 2.0 + 2.0 + 4.0 * 4.0),
            (
                "global_load_ideal_sectors",
                2.0 + 2.0 + 4.0 + 3.0 + 2.0 + 1.0,
            ),
        ],
    );
    // Three load lines (two branch sites, the loop); the loop's line holds 4 requests.
    let loads: Vec<f64> = p
        .lines
        .values()
        .map(|c| c.get("global_load_requests"))
        .filter(|&r| r > 0.0)
        .collect();
    let mut sorted = loads.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(
        sorted,
        vec![1.0, 1.0, 4.0],
        "lines: {:?}",
        p.lines.keys().collect::<Vec<_>>()
    );
}

#[test]
fn special_functions_barriers_shuffles_and_atomics_are_counted() {
    let x = upload(&floats(32));
    let y = upload(&[0.0f32; 32]);
    let count = upload(&[0i32]);
    let p = profile(
        "emutest_prof_misc",
        1,
        32,
        &[Arg::Buf(&x), Arg::Buf(&y), Arg::Buf(&count)],
    );
    assert_counts(
        &p.totals,
        "misc",
        &[
            ("special_function_calls", 64.0),
            ("barriers", 1.0),
            ("shuffles", 5.0),
            ("atomics", 1.0),
            ("global_load_requests", 1.0),
        ],
    );
    // Sites carry the kernel's source lines.
    assert!(
        p.lines.keys().all(|s| s.contains("profile.cu")),
        "every site is a line of profile.cu: {:?}",
        p.lines.keys().collect::<Vec<_>>()
    );
}

#[test]
fn a_winner_per_round_of_a_warp_synchronous_loop_is_one_request_per_round() {
    let x = upload(&floats(32));
    let y = upload(&[0.0f32; 4]);
    let p = profile(
        "emutest_prof_round_winners",
        1,
        32,
        &[Arg::Buf(&x), Arg::Buf(&y)],
    );
    assert_counts(
        &p.totals,
        "round winners",
        &[
            ("global_load_requests", 4.0),
            ("global_load_sectors", 4.0),
            ("global_store_requests", 4.0),
            ("warp_votes", 4.0),
        ],
    );
}
