//! `sluice emu check` on a CUDA file that is not part of the project: a file written to a
//! temporary folder with one correct kernel and one planted bug per kernel. Each planted bug is
//! found, with its kind and the line it is on; the correct kernel is `ok`; bad usage is exit 2.
//!
//! The command line is parsed and run in-process (`parse_check_args` + `run_check`, what
//! `sluice emu check` itself calls). The emulator runtime is compiled once into a cache under
//! the cargo target folder (the first run of this file takes a while: g++ compiles the runtime).

use sluice_kernels::io::read_safetensors;
use sluice_kernels::Backend;
use sluice_trainer::emu_cmd::{parse_check_args, run_check, CheckReport};
use std::path::PathBuf;
use std::sync::OnceLock;

const SOURCE: &str = r#"// A user's CUDA file, checked by `sluice emu check`.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <sluice/hopper.cuh>

// Correct: y = a * x.
extern "C" __global__ void saxpy(const float* __restrict__ x, float* __restrict__ y, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];
}

extern "C" __global__ void tail_read(const float* __restrict__ x, float* __restrict__ y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + x[i + 1];  // BUG: tail_read
}

extern "C" __global__ void shared_overflow(float* __restrict__ out) {
    __shared__ float s[32];
    s[threadIdx.x] = 1.0f;
    if (threadIdx.x == 0) s[32] = 2.0f;  // BUG: shared_overflow
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x];
}

extern "C" __global__ void missing_sync(const float* __restrict__ x, float* __restrict__ out) {
    __shared__ float s[64];
    s[threadIdx.x] = x[threadIdx.x];  // BUG: missing_sync write
    out[threadIdx.x] = s[(threadIdx.x + 1) % 64];  // BUG: missing_sync read
}

extern "C" __global__ void lost_update(const int* __restrict__ x, int* __restrict__ total) {
    if (threadIdx.x == 0) total[0] += x[blockIdx.x];  // BUG: lost_update
}

extern "C" __global__ void divergent(float* __restrict__ out) {
    if (threadIdx.x < 16) __syncthreads();  // BUG: divergent
    out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void bad_mask(float* __restrict__ out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x % 32 < 16) v = __shfl_down_sync(0xffffffffu, v, 1);  // BUG: bad_mask
    out[threadIdx.x] = v;
}

// One warpgroup: D(64x128) = A * B^T with bf16 operands in shared memory (K-major, no swizzle).
extern "C" __global__ void wgmma_early(float* __restrict__ out) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* a = smem;
    unsigned char* b = smem + 2048;
    for (int e = threadIdx.x; e < 64 * 16; e += 128) {
        int row = e / 16, k = e % 16;
        *reinterpret_cast<__nv_bfloat16*>(a + (row / 8) * 128 + (row % 8) * 16 + (k / 8) * 1024 + (k % 8) * 2) = __float2bfloat16(1.0f);
    }
    for (int e = threadIdx.x; e < 128 * 16; e += 128) {
        int row = e / 16, k = e % 16;
        *reinterpret_cast<__nv_bfloat16*>(b + (row / 8) * 128 + (row % 8) * 16 + (k / 8) * 2048 + (k % 8) * 2) = __float2bfloat16(0.5f);
    }
    sluice::fence_proxy_async_shared();
    __syncthreads();
    float acc[64];
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    sluice::wgmma_fence();
    sluice::wgmma_m64n128k16_bf16(acc, sluice::wgmma_desc(0, 1024, 128), sluice::wgmma_desc(2048, 2048, 128), 1, smem);
    out[threadIdx.x] = acc[0];  // BUG: wgmma_early
    sluice::wgmma_commit();
    sluice::wgmma_wait<0>();
}

extern "C" __global__ void bulk_early(const float* __restrict__ src, float* __restrict__ out, int n) {
    extern __shared__ __align__(128) unsigned char smem[];
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    float* dst = reinterpret_cast<float*>(smem + 128);
    if (threadIdx.x == 0) sluice::mbarrier_init(bar, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        sluice::mbarrier_expect_tx(bar, n * 4);
        sluice::bulk_copy_g2s(dst, src, n * 4, bar);
        out[0] = dst[0];  // BUG: bulk_early
    }
    sluice::mbarrier_arrive(bar);
    sluice::mbarrier_wait(bar, 0);
}

// Race-free (atomics) but the float sum depends on the order of the additions.
extern "C" __global__ void float_atomic_sum(const float* __restrict__ x, float* __restrict__ total, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(total, x[i]);
}
"#;

/// The planted file, written once per test process to a temporary folder outside the project,
/// with the emulator cache pointed into the cargo target folder.
fn planted_file() -> &'static PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        // Set before any thread of this test binary compiles (the OnceLock orders them).
        std::env::set_var(
            "SLUICE_EMU_CACHE",
            PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("emu-cache"),
        );
        let dir = std::env::temp_dir().join(format!("sluice-emu-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("planted.cu");
        std::fs::write(&file, SOURCE).unwrap();
        // Compile once here, so parallel tests find it in the cache.
        if let Err(e) = sluice_kernels::emu::compile::compile(&file) {
            panic!("the planted file does not compile: {e}");
        }
        file
    })
}

fn line_of(marker: &str) -> usize {
    let hits: Vec<usize> = SOURCE
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains(marker))
        .map(|(i, _)| i + 1)
        .collect();
    assert_eq!(hits.len(), 1, "{marker}");
    hits[0]
}

fn check(argv: &[&str]) -> CheckReport {
    let file = planted_file().display().to_string();
    let mut full = vec![file.as_str()];
    full.extend_from_slice(argv);
    let args = parse_check_args(&full).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    run_check(&args)
}

/// The report failed with a finding of `kind` at the line of `marker` (its own line or, for a
/// race, the earlier access's); returns that line.
fn finding(r: &CheckReport, kind: &str, marker: &str) -> String {
    assert_eq!(r.status, 1, "{r:#?}");
    assert_eq!(r.lines.last().map(String::as_str), Some("failed"), "{r:#?}");
    let at = format!("planted.cu:{}", line_of(marker));
    r.lines
        .iter()
        .find(|l| l.starts_with(&format!("{kind}: ")) && l.contains(&at))
        .unwrap_or_else(|| panic!("no `{kind}` finding at {at}: {r:#?}"))
        .clone()
}

#[test]
fn a_correct_kernel_is_ok_and_its_buffers_are_written() {
    let out = planted_file().with_file_name("saxpy.safetensors");
    let r = check(&[
        "--kernel",
        "saxpy",
        "--grid",
        "2",
        "--block",
        "64",
        "--arg",
        "x=f32[127]:iota",
        "--arg",
        "y=f32[127]",
        "--arg",
        "a=f32:0.5",
        "--arg",
        "n=i32:127",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(r.status, 0, "{r:#?}");
    assert_eq!(r.lines, ["ok"]);
    let f = read_safetensors(&out, &Backend::Cpu).unwrap();
    let y = f.tensors["y"].to_vec::<f32>().unwrap();
    assert_eq!(y, (0..127).map(|i| 0.5 * i as f32).collect::<Vec<_>>());
    assert_eq!(f.tensors["x"].shape(), [127]);
}

#[test]
fn read_one_element_past_the_end_of_a_global_buffer() {
    let r = check(&[
        "--kernel",
        "tail_read",
        "--grid",
        "1",
        "--block",
        "32",
        "--arg",
        "x=f32[17]:random",
        "--arg",
        "y=f32[17]",
        "--arg",
        "n=i32:17",
    ]);
    let l = finding(&r, "out-of-bounds", "BUG: tail_read");
    assert!(
        l.contains("kernel tail_read block (0,0,0) thread (16,0,0): read of 4 bytes at byte offset 68 of global buffer `x` (argument 0, allocation #"),
        "{l}"
    );
    assert!(l.contains("of 68 bytes): past its end"), "{l}");
}

#[test]
fn static_shared_write_one_past_its_array() {
    let r = check(&[
        "--kernel",
        "shared_overflow",
        "--grid",
        "1",
        "--block",
        "32",
        "--arg",
        "out=f32[32]",
    ]);
    let l = finding(&r, "out-of-bounds", "BUG: shared_overflow");
    assert!(
        l.contains("thread (0,0,0): write of 4 bytes at byte offset 128 of static shared array `s` (128 bytes"),
        "{l}"
    );
}

#[test]
fn missing_syncthreads_between_a_shared_write_and_another_threads_read() {
    let r = check(&[
        "--kernel",
        "missing_sync",
        "--grid",
        "1",
        "--block",
        "64",
        "--arg",
        "x=f32[64]:random",
        "--arg",
        "out=f32[64]",
    ]);
    let l = finding(&r, "race", "BUG: missing_sync read");
    assert!(
        l.contains("kernel missing_sync block (0,0,0)") && l.contains("static shared array `s`"),
        "{l}"
    );
    assert!(
        l.contains(&format!(
            "planted.cu:{}",
            line_of("BUG: missing_sync write")
        )),
        "{l}"
    );
}

#[test]
fn lost_update_across_blocks_on_global_memory() {
    let r = check(&[
        "--kernel",
        "lost_update",
        "--grid",
        "5",
        "--block",
        "32",
        "--arg",
        "x=i32[5]:ones",
        "--arg",
        "total=i32[1]",
    ]);
    let l = finding(&r, "race", "BUG: lost_update");
    assert!(
        l.contains("global buffer `total` (argument 1")
            && l.contains("in the same launch (blocks are not ordered"),
        "{l}"
    );
}

#[test]
fn divergent_barrier() {
    let r = check(&[
        "--kernel",
        "divergent",
        "--grid",
        "1",
        "--block",
        "32",
        "--arg",
        "out=f32[32]",
    ]);
    let l = finding(&r, "divergent-barrier", "BUG: divergent");
    assert!(
        l.contains("kernel divergent block (0,0,0): divergent __syncthreads"),
        "{l}"
    );
}

#[test]
fn bad_shuffle_mask() {
    let r = check(&[
        "--kernel",
        "bad_mask",
        "--grid",
        "1",
        "--block",
        "32",
        "--arg",
        "out=f32[32]",
    ]);
    let l = finding(&r, "shuffle-mask", "BUG: bad_mask");
    assert!(l.contains("__shfl_down_sync(mask 0xffffffff)"), "{l}");
}

#[test]
fn wgmma_accumulator_read_before_its_wait() {
    let r = check(&[
        "--kernel",
        "wgmma_early",
        "--grid",
        "1",
        "--block",
        "128",
        "--smem",
        "6144",
        "--arg",
        "out=f32[128]",
    ]);
    let l = finding(&r, "async-read-before-wait", "BUG: wgmma_early");
    assert!(
        l.contains("read of the accumulator of the wgmma issued at"),
        "{l}"
    );
}

#[test]
fn bulk_copy_destination_read_before_its_barrier() {
    let r = check(&[
        "--kernel",
        "bulk_early",
        "--grid",
        "1",
        "--block",
        "32",
        "--smem",
        "256",
        "--arg",
        "src=f32[32]:random",
        "--arg",
        "out=f32[32]",
        "--arg",
        "n=i32:32",
    ]);
    let l = finding(&r, "async-read-before-wait", "BUG: bulk_early");
    assert!(
        l.contains("thread (0,0,0): read at byte offset 128 of dynamic shared memory (256 bytes requested at launch), the destination of a bulk copy"),
        "{l}"
    );
}

#[test]
fn outputs_that_change_with_the_seed_are_nondeterministic() {
    let r = check(&[
        "--kernel",
        "float_atomic_sum",
        "--grid",
        "8",
        "--block",
        "64",
        "--arg",
        "x=f32[500]:random",
        "--arg",
        "total=f32[1]",
        "--arg",
        "n=i32:500",
    ]);
    assert_eq!(r.status, 1, "{r:#?}");
    assert!(
        r.lines
            .iter()
            .any(|l| l
                .starts_with("nondeterministic: buffer `total` differs between seed 1 and seed")),
        "{r:#?}"
    );
    assert!(
        r.lines.iter().all(|l| !l.starts_with("race")),
        "atomics do not race: {r:#?}"
    );
}

#[test]
fn bad_usage_is_exit_2_with_a_reason() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["--kernel", "saxpy", "--grid", "1", "--block", "32", "--arg", "x=f32[4]"],
            "kernel saxpy takes 4 parameters (const float* x, float* y, float a, int n); 1 --arg given",
        ),
        (
            &["--kernel", "saxpy", "--grid", "1", "--block", "32", "--arg", "y=f32[4]", "--arg", "x=f32[4]", "--arg", "a=f32:1", "--arg", "n=i32:4"],
            "parameter 1 of saxpy is `x`",
        ),
        (
            &["--kernel", "saxpy", "--grid", "1", "--block", "32", "--arg", "x=f32[4]", "--arg", "y=f32[4]", "--arg", "a=i32:1", "--arg", "n=i32:4"],
            "parameter `a` of saxpy is `float`: give f32:V",
        ),
        (
            &["--kernel", "nope", "--grid", "1", "--block", "32"],
            "has no kernel `nope` (its kernels: saxpy, tail_read",
        ),
        (
            &["--kernel", "saxpy", "--grid", "0", "--block", "32", "--arg", "x=f32[4]", "--arg", "y=f32[4]", "--arg", "a=f32:1", "--arg", "n=i32:4"],
            "--grid 0: `0` is not a positive integer",
        ),
    ];
    for (argv, want) in cases {
        let r = check(argv);
        assert_eq!(r.status, 2, "{argv:?}: {r:#?}");
        let e = r.error.as_deref().unwrap_or("");
        assert!(e.contains(want), "{argv:?}: {e}");
        assert!(r.lines.is_empty());
    }
    assert!(
        parse_check_args(["x.cu", "--grid", "1"]).is_err(),
        "--kernel and --block are required"
    );
}

#[test]
fn a_file_that_does_not_compile_is_exit_2() {
    let dir = planted_file().parent().unwrap().join("broken");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("broken.cu");
    std::fs::write(
        &file,
        "extern \"C\" __global__ void k(float* out) { out[threadIdx.x] = undefined_name; }\n",
    )
    .unwrap();
    let args = parse_check_args([
        file.to_str().unwrap(),
        "--kernel",
        "k",
        "--grid",
        "1",
        "--block",
        "1",
        "--arg",
        "out=f32[1]",
    ])
    .unwrap();
    let r = run_check(&args);
    assert_eq!(r.status, 2, "{r:#?}");
    assert!(
        r.error
            .as_deref()
            .unwrap_or("")
            .contains("broken.cu does not compile for the emulator"),
        "{r:#?}"
    );
}
