//! The emulator's findings: every planted bug (out-of-bounds accesses, a missing barrier, a
//! lost update, async results read before their wait, divergent barriers, bad masks, asserts)
//! is reported with its kernel, block, line and what went wrong.

use super::*;

#[test]
fn missing_syncthreads_is_caught_by_seed_comparison_and_by_race_detection() {
    let n: i32 = 256 * 3;
    let x: Vec<f32> = (0..n).map(|i| (i % 13) as f32).collect();
    let xb = upload(&x);
    let want: f32 = x.iter().sum::<f32>();
    // Without race detection, the seed-shuffled thread order alone shows the bug.
    let no_race = LaunchOptions {
        checks: Checks::Full,
        race: Some(false),
        param_names: None,
    };
    let mut results = Vec::new();
    for seed in 1..=6u64 {
        let out = EmuBuffer::alloc(4).unwrap();
        let mut slots = params_of(&[Arg::Buf(&xb), Arg::Buf(&out), Arg::I32(n)]);
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        let found = emu_launch_checked(
            "emutest_block_sum_racy",
            [1, 1, 1],
            [256, 1, 1],
            0,
            &mut params,
            seed,
            &no_race,
        )
        .unwrap();
        assert!(found.is_empty(), "{found:#?}");
        results.push(download_f32(&out)[0]);
    }
    let distinct = {
        let mut r = results.clone();
        r.sort_by(f32::total_cmp);
        r.dedup();
        r.len()
    };
    assert!(
        distinct >= 2,
        "racy reduction gave the same result {results:?} under 6 seeds"
    );
    assert!(
        results.iter().any(|&r| r != want),
        "racy reduction was always right: {results:?}"
    );
    // Race detection names it under any seed.
    let out = EmuBuffer::alloc(4).unwrap();
    let found = checked(
        "emutest_block_sum_racy",
        1,
        256,
        0,
        &[Arg::Buf(&xb), Arg::Buf(&out), Arg::I32(n)],
        1,
    );
    assert!(!found.is_empty());
    assert!(
        found
            .iter()
            .all(|f| f.kind == "race" && f.message.contains("static shared array `partial`")),
        "{found:#?}"
    );
}

#[test]
fn out_of_bounds_write_is_reported_with_offset() {
    let out = EmuBuffer::alloc(100 * 4).unwrap();
    let err = launch(
        "emutest_oob_write",
        4,
        32,
        0,
        &[Arg::Buf(&out), Arg::I32(100)],
        1,
    )
    .unwrap_err();
    assert!(
        err.starts_with("out-of-bounds: kernel emutest_oob_write block (3,0,0) thread (4,0,0)"),
        "{err}"
    );
    assert!(
        err.contains("write of 4 bytes at byte offset 400 of global buffer of argument 0")
            && err.contains("of 400 bytes)")
            && err.contains("past its end (valid offsets 0..399)"),
        "{err}"
    );
    // The allocation stays usable.
    launch(
        "emutest_oob_write",
        3,
        32,
        0,
        &[Arg::Buf(&out), Arg::I32(95)],
        1,
    )
    .unwrap();
}

#[test]
fn out_of_bounds_read_far_past_the_end_is_reported() {
    let x = upload(&random_f32(1000, 1));
    let out = EmuBuffer::alloc(64 * 4).unwrap();
    let err = launch(
        "emutest_oob_read",
        2,
        32,
        0,
        &[Arg::Buf(&x), Arg::Buf(&out), Arg::I32(64)],
        1,
    )
    .unwrap_err();
    assert!(
        err.starts_with("out-of-bounds: kernel emutest_oob_read"),
        "{err}"
    );
    assert!(
        err.contains("read of 4 bytes at byte offset 16") && err.contains("of 4000 bytes)"),
        "{err}"
    );
    // The emulator keeps working after a caught fault.
    launch(
        "emutest_oob_read",
        1,
        32,
        0,
        &[Arg::Buf(&x), Arg::Buf(&out), Arg::I32(0)],
        1,
    )
    .unwrap();
}

#[test]
fn planted_read_one_element_past_a_global_buffer() {
    let line = planted_line("PLANTED BUG: tail read");
    for n in [1usize, 17, 127] {
        let x = upload(&random_f32(n, 3));
        let out = EmuBuffer::alloc(n * 4).unwrap();
        let found = checked(
            "emutest_tail_read",
            n.div_ceil(32) as u32,
            32,
            0,
            &[Arg::Buf(&x), Arg::Buf(&out), Arg::I32(n as i32)],
            1,
        );
        let f = only_finding(&found, "out-of-bounds", line);
        let last = n - 1;
        let want = format!(
            "kernel emutest_tail_read block ({},0,0) thread ({},0,0): read of 4 bytes at byte offset {} of global buffer of argument 0 (allocation #",
            last / 32,
            last % 32,
            4 * n
        );
        assert!(f.message.contains(&want), "n={n}: {f}");
        assert!(
            f.message
                .contains(&format!("of {} bytes): past its end", 4 * n)),
            "n={n}: {f}"
        );
        assert_eq!(f.count, 1, "only thread n-1 reads past the end: {f}");
    }
}

#[test]
fn planted_static_shared_write_one_past_its_array() {
    let line = planted_line("PLANTED BUG: one past the array");
    let out = EmuBuffer::alloc(2 * 32 * 4).unwrap();
    let found = checked(
        "emutest_static_shared_overflow",
        2,
        32,
        0,
        &[Arg::Buf(&out)],
        1,
    );
    let f = only_finding(&found, "out-of-bounds", line);
    assert!(
        f.message.contains("thread (0,0,0): write of 4 bytes at byte offset 128 of static shared array `s` (128 bytes, declared at ")
            && f.message.contains("planted.cu:"),
        "{f}"
    );
    // Both blocks do it; the finding counts them.
    assert_eq!(f.count, 2, "{f}");
    // The neighbouring array was not hit (a redzone lies between them).
    assert_eq!(
        download_f32(&out),
        (0..64).map(|i| (i % 32) as f32).collect::<Vec<_>>()
    );
}

#[test]
fn planted_dynamic_shared_read_one_past_the_requested_bytes() {
    let line = planted_line("PLANTED BUG: n floats were requested");
    let out = EmuBuffer::alloc(4).unwrap();
    let found = checked(
        "emutest_dyn_shared_overflow",
        1,
        64,
        64 * 4,
        &[Arg::Buf(&out), Arg::I32(64)],
        1,
    );
    let f = only_finding(&found, "out-of-bounds", line);
    assert!(
        f.message.contains("read of 4 bytes at byte offset 256 of dynamic shared memory (256 bytes requested at launch)"),
        "{f}"
    );
}

#[test]
fn planted_missing_syncthreads_between_a_shared_write_and_another_threads_read() {
    let line = planted_line("PLANTED BUG: read of a neighbour's write");
    let x = upload(&random_f32(64, 5));
    let out = EmuBuffer::alloc(64 * 4).unwrap();
    for seed in [1u64, 2, 3] {
        let found = checked(
            "emutest_missing_barrier",
            1,
            64,
            0,
            &[Arg::Buf(&x), Arg::Buf(&out), Arg::I32(0)],
            seed,
        );
        assert!(
            !found.is_empty(),
            "seed {seed}: the missing barrier went unnoticed"
        );
        for f in &found {
            assert_eq!(f.kind, "race", "{f}");
            assert!(
                f.message.contains("static shared array `s`")
                    && (f
                        .message
                        .contains("of the same block with no __syncthreads, named barrier or mbarrier between them")
                        || f.message.contains(
                            "of the same warp with no __syncthreads, __syncwarp or mbarrier between them"
                        )),
                "{f}"
            );
        }
        assert!(
            found.iter().any(|f| [&f.location, &f.other]
                .iter()
                .any(|l| l.as_ref().is_some_and(|l| l.line == line))),
            "no finding names planted.cu:{line}: {found:#?}"
        );
        let clean = checked(
            "emutest_missing_barrier",
            1,
            64,
            0,
            &[Arg::Buf(&x), Arg::Buf(&out), Arg::I32(1)],
            seed,
        );
        assert!(clean.is_empty(), "with the barrier: {clean:#?}");
    }
}

#[test]
fn planted_lost_update_across_blocks() {
    let line = planted_line("PLANTED BUG: non-atomic update shared by all blocks");
    let x: Vec<i32> = (1..=7).collect();
    let xb = upload(&x);
    let total = upload(&[0i32]);
    let found = checked(
        "emutest_lost_update",
        7,
        32,
        0,
        &[Arg::Buf(&xb), Arg::Buf(&total), Arg::I32(0)],
        1,
    );
    assert!(!found.is_empty(), "the lost update went unnoticed");
    for f in &found {
        assert_eq!(f.kind, "race", "{f}");
        assert!(
            f.message.contains("global buffer of argument 1")
                && f.message
                    .contains("in the same launch (blocks are not ordered"),
            "{f}"
        );
        assert!(f.location.as_ref().is_some_and(|l| l.line == line), "{f}");
    }
    // With an atomic: clean, and nothing is lost.
    let total = upload(&[0i32]);
    let clean = checked(
        "emutest_lost_update",
        7,
        32,
        0,
        &[Arg::Buf(&xb), Arg::Buf(&total), Arg::I32(1)],
        1,
    );
    assert!(clean.is_empty(), "{clean:#?}");
    assert_eq!(download_i32(&total), [28]);
}

#[test]
fn warp_exchange_through_shared_memory_needs_syncwarp() {
    let out = EmuBuffer::alloc(32 * 4).unwrap();
    let found = checked(
        "emutest_warp_exchange",
        1,
        32,
        0,
        &[Arg::Buf(&out), Arg::I32(0)],
        1,
    );
    assert!(!found.is_empty());
    assert!(
        found.iter().all(|f| f.kind == "race"
            && f.message.contains(
                "of the same warp with no __syncthreads, __syncwarp or mbarrier between them"
            )),
        "{found:#?}"
    );
    let clean = checked(
        "emutest_warp_exchange",
        1,
        32,
        0,
        &[Arg::Buf(&out), Arg::I32(1)],
        1,
    );
    assert!(clean.is_empty(), "{clean:#?}");
    assert_eq!(
        download_f32(&out),
        (0..32).map(|l| ((31 - l) * 3) as f32).collect::<Vec<_>>()
    );
}

#[test]
fn planted_wgmma_accumulator_read_before_its_wait() {
    let line = planted_line("PLANTED BUG: accumulator read before wgmma_wait");
    let smem = 64 * 16 * 2 + 128 * 16 * 2;
    let out = EmuBuffer::alloc(128 * 4).unwrap();
    let found = checked(
        "emutest_wgmma",
        1,
        128,
        smem,
        &[Arg::Buf(&out), Arg::I32(1)],
        1,
    );
    let f = only_finding(&found, "async-read-before-wait", line);
    assert!(
        f.message
            .contains("read of the accumulator of the wgmma issued at")
            && f.message.contains("before the wgmma_wait"),
        "{f}"
    );
    assert_eq!(f.count, 128, "every thread reads early: {f}");
    // The early value is the poison, not the result.
    assert!(download_f32(&out).iter().all(|v| v.is_nan()));
    // Read after the wait: clean, and D[m][n] = 16 n (thread t's acc[0] is column 2 (t % 4)).
    let clean = checked(
        "emutest_wgmma",
        1,
        128,
        smem,
        &[Arg::Buf(&out), Arg::I32(0)],
        1,
    );
    assert!(clean.is_empty(), "{clean:#?}");
    let got = download_f32(&out);
    for (t, v) in got.iter().enumerate() {
        assert_eq!(*v, 32.0 * (t % 4) as f32, "thread {t}");
    }
}

#[test]
fn planted_bulk_copy_destination_read_before_its_barrier() {
    let line = planted_line("PLANTED BUG: bulk-copy destination read before its barrier");
    let n = 36usize;
    let src_v = random_f32(n, 11);
    let src = upload(&src_v);
    let out = EmuBuffer::alloc((n + 1) * 4).unwrap();
    let found = checked(
        "emutest_bulk_copy",
        1,
        64,
        128 + n * 4,
        &[
            Arg::Buf(&src),
            Arg::Buf(&out),
            Arg::I32(n as i32),
            Arg::I32(1),
        ],
        1,
    );
    let f = only_finding(&found, "async-read-before-wait", line);
    assert!(
        f.message
            .contains("thread (0,0,0): read at byte offset 128 of dynamic shared memory")
            && f.message
                .contains("the destination of a bulk copy issued by thread (0,0,0)")
            && f.message.contains("before its mbarrier phase completes"),
        "{f}"
    );
    assert!(
        download_f32(&out)[n].is_nan(),
        "the early read saw the copy's data"
    );
    let clean = checked(
        "emutest_bulk_copy",
        1,
        64,
        128 + n * 4,
        &[
            Arg::Buf(&src),
            Arg::Buf(&out),
            Arg::I32(n as i32),
            Arg::I32(0),
        ],
        1,
    );
    assert!(clean.is_empty(), "{clean:#?}");
    let got = download_f32(&out);
    for (i, (g, s)) in got.iter().zip(&src_v).enumerate() {
        assert_eq!(*g, s * 2.0, "element {i}");
    }
}

#[test]
fn cp_async_destination_read_before_its_wait() {
    let line = planted_line("PLANTED BUG: cp.async destination read before its wait");
    let src_v = random_f32(64 * 4, 13);
    let src = upload(&src_v);
    let out = EmuBuffer::alloc(64 * 4).unwrap();
    let found = checked(
        "emutest_cp_async",
        1,
        64,
        0,
        &[Arg::Buf(&src), Arg::Buf(&out), Arg::I32(1)],
        1,
    );
    let f = only_finding(&found, "async-read-before-wait", line);
    assert!(f.message.contains("the destination of a cp.async"), "{f}");
    assert_eq!(f.count, 64, "{f}");
    let clean = checked(
        "emutest_cp_async",
        1,
        64,
        0,
        &[Arg::Buf(&src), Arg::Buf(&out), Arg::I32(0)],
        1,
    );
    assert!(clean.is_empty(), "{clean:#?}");
    for (t, got) in download_f32(&out).into_iter().enumerate() {
        let j = (t + 1) % 64;
        let want: f32 = src_v[4 * j..4 * j + 4].iter().sum();
        assert_eq!(got, want, "thread {t}");
    }
}

#[test]
fn divergent_barrier_is_reported() {
    let line = planted_line("PLANTED BUG: half the block waits here");
    let out = EmuBuffer::alloc(32 * 4).unwrap();
    let found = checked("emutest_divergent_barrier", 1, 32, 0, &[Arg::Buf(&out)], 1);
    let f = only_finding(&found, "divergent-barrier", line);
    assert!(
        f.message.starts_with("kernel emutest_divergent_barrier block (0,0,0): divergent __syncthreads: 16 threads wait at the barrier at ")
            && f.message.contains("but 16 threads of the block exited without reaching it"),
        "{f}"
    );
    let err = launch("emutest_early_exit_barrier", 1, 32, 0, &[Arg::Buf(&out)], 1).unwrap_err();
    assert!(
        err.contains("emutest_early_exit_barrier block (0,0,0)"),
        "{err}"
    );
    assert!(err.contains("thread (3,0,0)"), "{err}");
}

#[test]
fn bad_shuffle_mask_is_reported() {
    let line = planted_line("PLANTED BUG: full mask, half the lanes");
    let out = EmuBuffer::alloc(64 * 4).unwrap();
    let found = checked("emutest_bad_shuffle_mask", 1, 64, 0, &[Arg::Buf(&out)], 1);
    let f = only_finding(&found, "shuffle-mask", line);
    assert!(
        f.message
            .starts_with("kernel emutest_bad_shuffle_mask block (0,0,0) warp")
            && f.message.contains("__shfl_down_sync(mask 0xffffffff)"),
        "{f}"
    );
    let err = launch("emutest_bad_shuffle_mask", 1, 64, 0, &[Arg::Buf(&out)], 1).unwrap_err();
    assert!(err.starts_with("shuffle-mask: "), "{err}");
    let err = launch("emutest_mask_without_self", 1, 32, 0, &[Arg::Buf(&out)], 1).unwrap_err();
    assert!(err.contains("does not include its own lane"), "{err}");
}

#[test]
fn assert_and_trap_are_reported() {
    let mut v: Vec<i32> = (0..64).collect();
    v[40] = -1;
    let xb = upload(&v);
    let err = launch(
        "emutest_assert",
        2,
        32,
        0,
        &[Arg::Buf(&xb), Arg::I32(64)],
        1,
    )
    .unwrap_err();
    assert!(
        err.contains("emutest_assert block (1,0,0) thread (8,0,0)") && err.contains("x[i] >= 0"),
        "{err}"
    );
    launch(
        "emutest_assert",
        2,
        32,
        0,
        &[Arg::Buf(&xb), Arg::I32(40)],
        1,
    )
    .unwrap();
    let err = launch("emutest_trap", 1, 32, 0, &[Arg::I32(1)], 1).unwrap_err();
    assert!(
        err.contains("__trap()") && err.contains("thread (5,0,0)"),
        "{err}"
    );
}
