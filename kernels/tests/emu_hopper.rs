//! The emulator's Hopper pipeline pieces (kernels/emu/tests/planted.cu, kernels/emu/async.cpp):
//! tensor-map copies and their swizzled layouts (checked against the PTX ISA's tables, written
//! here per row as the ISA draws them), wgmma m64nNk16 reading those layouts, mbarrier rings
//! ordered without a block barrier, and the planted bugs the checks must name: a ring without its
//! empty barrier, a missing proxy fence, a wrong swizzle.
//!
//! What these tests cannot show: the emulator and kernels/cuda/common/hopper.cuh encode one
//! reading of the PTX ISA. A misreading shared by both passes here; only a GPU run settles it.
//! These test kernels are emulator-only (kernels/emu/tests); on a GPU, scripts/gpu-check runs the
//! Hopper GEMM built from the same helpers (the CUDA tests of kernels/tests/gemm.rs and
//! gemm_hopper.rs), whose results against the CPU say whether the layouts were read right.

use half::bf16;
use sluice_kernels::device::Backend;
use sluice_kernels::emu::{EmuBuffer, EmuFinding};
use sluice_kernels::launch::Launch;
use sluice_kernels::tensor::Tensor;
use sluice_kernels::tensor_map::{Swizzle, TensorMap, TiledMap};
use std::ffi::c_void;

mod support;
use support::{checked_launch, planted_line};

fn emu() -> Backend {
    Backend::emu_with_seed(1)
}

/// One raw kernel parameter: an 8-byte slot, or a tensor map (passed by address).
enum P<'a> {
    Slot(u64),
    Map(&'a TensorMap<'a>),
}

/// A launch with every check and race detection on; its findings (empty: clean).
fn checked(kernel: &str, block: u32, shared: usize, args: &[P<'_>], seed: u64) -> Vec<EmuFinding> {
    let mut slots: Vec<u64> = args
        .iter()
        .map(|a| match a {
            P::Slot(v) => *v,
            P::Map(_) => 0,
        })
        .collect();
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .zip(args)
        .map(|(s, a)| match a {
            P::Slot(_) => s as *mut u64 as *mut c_void,
            P::Map(m) => m.as_param().cast_mut(),
        })
        .collect();
    checked_launch(kernel, 1, block, shared, &mut params, seed)
}

fn buf(bytes: usize) -> EmuBuffer {
    let mut b = EmuBuffer::alloc(bytes).expect("emu alloc");
    b.as_bytes_mut().fill(0xff); // poison: every output word must be written
    b
}
fn ptr(b: &EmuBuffer) -> P<'static> {
    P::Slot(b.as_ptr() as u64)
}
fn words_f32(b: &EmuBuffer) -> Vec<f32> {
    b.as_bytes()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn names_line(f: &EmuFinding, line: u32) -> bool {
    [&f.location, &f.other].iter().any(|l| {
        l.as_ref().is_some_and(|l| {
            (l.file.ends_with("planted.cu") && l.line == line)
                || l.called_from
                    .as_ref()
                    .is_some_and(|(file, ln)| file.ends_with("planted.cu") && *ln == line)
        })
    })
}

/// Deterministic bf16 values in [-2, 2), never all zero.
fn random_bf16(n: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
        })
        .collect()
}

/// Where the PTX ISA's swizzle tables put the 16-byte chunk `c` of box row `r` whose rows are
/// `row_bytes` long: as the ISA draws them, row by row (the emulator computes it from address
/// bits instead, so the two agree only if both readings are right).
/// - 128B: rows of 128 bytes; row r permutes its 8 chunks by XOR with r mod 8.
/// - 64B: rows of 64 bytes, two to a 128-byte line; row r permutes its 4 chunks by XOR with
///   (r / 2) mod 4.
/// - 32B: rows of 32 bytes, four to a line; row r permutes its 2 chunks by XOR with (r / 4) mod 2.
fn ptx_table_chunk(swizzle: Swizzle, r: usize, c: usize) -> usize {
    match swizzle {
        Swizzle::None => c,
        Swizzle::B128 => c ^ (r % 8),
        Swizzle::B64 => c ^ ((r / 2) % 4),
        Swizzle::B32 => c ^ ((r / 4) % 2),
    }
}

#[test]
fn tensor_copies_land_in_the_ptx_isa_swizzle_layouts_and_zero_fill_outside_the_tensor() {
    let backend = emu();
    let mut checked_rows = 0;
    for swizzle in [Swizzle::None, Swizzle::B32, Swizzle::B64, Swizzle::B128] {
        // A ragged tensor: cols not a multiple of the box, rows 37. Element (r, c) holds the bits
        // r * cols + c + 1 (a bf16 bit pattern, never NaN here), so each landed word names its
        // source.
        let box0 = if swizzle == Swizzle::None {
            24
        } else {
            swizzle.span() / 2
        };
        let (rows, cols) = (37usize, 3 * box0 + 8);
        let data: Vec<bf16> = (0..rows * cols)
            .map(|i| bf16::from_bits(i as u16 + 1))
            .collect();
        let t = Tensor::from_slice(&backend, &[rows, cols], &data).unwrap();
        let box1 = 16usize;
        let map = TensorMap::tiled(
            &backend,
            &t,
            "x",
            &TiledMap {
                dims: &[cols as u64, rows as u64],
                strides: &[(cols * 2) as u64],
                boxes: &[box0 as u32, box1 as u32],
                swizzle,
            },
        )
        .unwrap();
        let row_bytes = box0 * 2;
        let words = box1 * box0;
        // Inside, and overlapping the tensor's far corner (columns and rows past the end).
        for (c0, c1) in [(box0 as i32, 8i32), ((cols - 3) as i32, (rows - 5) as i32)] {
            let out =
                Tensor::poisoned(&backend, &[words], sluice_kernels::dtype::DType::BF16).unwrap();
            backend
                .launch(
                    &Launch::new("emutest_tma_box", [1, 1, 1], [32, 1, 1])
                        .shared_bytes((1024 + words * 2) as u32)
                        .arg_tensor_map(&map)
                        .arg_tensor(&out)
                        .arg_i32(c0)
                        .arg_i32(c1)
                        .arg_i32(words as i32),
                )
                .unwrap();
            let got: Vec<u16> = out
                .to_vec::<bf16>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            for r in 0..box1 {
                for c in 0..box0 {
                    let (gr, gc) = (c1 as usize + r, c0 as usize + c);
                    let want = if gr < rows && gc < cols {
                        (gr * cols + gc + 1) as u16
                    } else {
                        0
                    };
                    let chunk = ptx_table_chunk(swizzle, r, c * 2 / 16);
                    let at = (r * row_bytes + chunk * 16 + (c * 2) % 16) / 2;
                    assert_eq!(
                        got[at], want,
                        "{swizzle:?} box at ({c0}, {c1}): element ({r}, {c}) should land at word {at}"
                    );
                }
                checked_rows += 1;
            }
        }
    }
    assert_eq!(checked_rows, 4 * 2 * 16);
}

/// C = A B^T in f32 with the products added in ascending k by fmaf, as the emulator's wgmma does.
fn reference(a: &[bf16], b: &[bf16], n: usize, k: usize) -> Vec<f32> {
    let mut c = vec![0f32; 64 * n];
    for i in 0..64 {
        for j in 0..n {
            let mut acc = 0f32;
            for kk in 0..k {
                acc = a[i * k + kk].to_f32().mul_add(b[j * k + kk].to_f32(), acc);
            }
            c[i * n + j] = acc;
        }
    }
    c
}

fn wgmma_run(
    span: usize,
    n: usize,
    desc_mode: i32,
    seed: u64,
) -> (Vec<f32>, Vec<f32>, Vec<EmuFinding>) {
    let backend = emu();
    let k = span / 2;
    let swizzle = match span {
        32 => Swizzle::B32,
        64 => Swizzle::B64,
        _ => Swizzle::B128,
    };
    let a = random_bf16(64 * k, seed);
    let b = random_bf16(n * k, seed + 1);
    let ta = Tensor::from_slice(&backend, &[64, k], &a).unwrap();
    let tb = Tensor::from_slice(&backend, &[n, k], &b).unwrap();
    let map = |t, rows: usize| {
        TensorMap::tiled(
            &backend,
            t,
            "operand",
            &TiledMap {
                dims: &[k as u64, rows as u64],
                strides: &[(k * 2) as u64],
                boxes: &[k as u32, rows.min(256) as u32],
                swizzle,
            },
        )
        .unwrap()
    };
    let (ma, mb) = (map(&ta, 64), map(&tb, n));
    let out = buf(64 * n * 4);
    let found = checked(
        "emutest_wgmma_tma",
        128,
        1024 + (64 + n) * span,
        &[
            P::Map(&ma),
            P::Map(&mb),
            ptr(&out),
            P::Slot(n as u64),
            P::Slot(span as u64),
            P::Slot(desc_mode as u64),
        ],
        seed,
    );
    (words_f32(&out), reference(&a, &b, n, k), found)
}

#[test]
fn wgmma_reads_tensor_copies_in_every_swizzle_mode_and_width() {
    let mut runs = 0;
    for (span, desc_mode) in [(32usize, 3i32), (64, 2), (128, 1)] {
        for n in [64usize, 128, 256] {
            let (got, want, found) = wgmma_run(span, n, desc_mode, 7 + n as u64);
            assert!(found.is_empty(), "span {span}, N {n}: {found:#?}");
            let same = got
                .iter()
                .zip(&want)
                .filter(|(g, w)| g.to_bits() == w.to_bits())
                .count();
            assert_eq!(
                same,
                64 * n,
                "span {span}, N {n}: bits differ from the fmaf reference"
            );
            runs += 1;
        }
    }
    assert_eq!(runs, 9);
}

#[test]
fn planted_wgmma_reading_a_128_byte_swizzle_as_64() {
    let line = planted_line("PLANTED BUG site when desc_mode mismatches");
    let (got, want, found) = wgmma_run(128, 64, 2, 3);
    assert!(!found.is_empty(), "the wrong swizzle went unnoticed");
    assert!(
        found.iter().all(|f| f.kind == "swizzle-mismatch"
            && f.message.contains(
                "with 64-byte swizzle, but a tensor copy landed it with 128-byte swizzle"
            )),
        "{found:#?}"
    );
    assert!(
        found.iter().any(|f| names_line(f, line)),
        "no finding names planted.cu:{line}: {found:#?}"
    );
    assert_ne!(
        got, want,
        "a wrong layout cannot give the right product here"
    );
}

/// C = A B^T for MN-major operands: A stored [K][64], B stored [K][N].
fn reference_mn(a: &[bf16], b: &[bf16], n: usize, k: usize) -> Vec<f32> {
    let mut c = vec![0f32; 64 * n];
    for i in 0..64 {
        for j in 0..n {
            let mut acc = 0f32;
            for kk in 0..k {
                acc = a[kk * 64 + i].to_f32().mul_add(b[kk * n + j].to_f32(), acc);
            }
            c[i * n + j] = acc;
        }
    }
    c
}

/// One MN-major wgmma run (planted.cu `emutest_wgmma_mn_tma`): boxes of 32 K rows x `row_bytes`.
fn wgmma_mn_run(
    row_bytes: usize,
    n: usize,
    desc_mode: i32,
    seed: u64,
) -> (Vec<f32>, Vec<f32>, Vec<EmuFinding>) {
    let backend = emu();
    let k = 32;
    let swizzle = match row_bytes {
        16 => Swizzle::None,
        32 => Swizzle::B32,
        64 => Swizzle::B64,
        _ => Swizzle::B128,
    };
    let a = random_bf16(k * 64, seed);
    let b = random_bf16(k * n, seed + 1);
    let ta = Tensor::from_slice(&backend, &[k, 64], &a).unwrap();
    let tb = Tensor::from_slice(&backend, &[k, n], &b).unwrap();
    let map = |t, cols: usize| {
        TensorMap::tiled(
            &backend,
            t,
            "operand",
            &TiledMap {
                dims: &[cols as u64, k as u64],
                strides: &[(cols * 2) as u64],
                boxes: &[(row_bytes / 2) as u32, k as u32],
                swizzle,
            },
        )
        .unwrap()
    };
    let (ma, mb) = (map(&ta, 64), map(&tb, n));
    let out = buf(64 * n * 4);
    let found = checked(
        "emutest_wgmma_mn_tma",
        128,
        1024 + (64 + n) * k * 2,
        &[
            P::Map(&ma),
            P::Map(&mb),
            ptr(&out),
            P::Slot(n as u64),
            P::Slot(row_bytes as u64),
            P::Slot(desc_mode as u64),
        ],
        seed,
    );
    (words_f32(&out), reference_mn(&a, &b, n, k), found)
}

#[test]
fn wgmma_reads_mn_major_tensor_copies_in_every_mode_and_width() {
    let mut runs = 0;
    for (row_bytes, desc_mode) in [(16usize, 0i32), (32, 3), (64, 2), (128, 1)] {
        for n in [64usize, 128, 256] {
            let (got, want, found) = wgmma_mn_run(row_bytes, n, desc_mode, 11 + n as u64);
            assert!(found.is_empty(), "rows of {row_bytes} B, N {n}: {found:#?}");
            let same = got
                .iter()
                .zip(&want)
                .filter(|(g, w)| g.to_bits() == w.to_bits())
                .count();
            assert_eq!(
                same,
                64 * n,
                "rows of {row_bytes} B, N {n}: bits differ from the fmaf reference"
            );
            runs += 1;
        }
    }
    assert_eq!(runs, 12);
}

/// The PTX ISA's MN-major bf16 layouts ("Canonical Layouts", Figures 168-170: no swizzle, 32B and
/// 64B; 128B from the canonical form with LBO = 2 KiB, SBO = 1 KiB) as CuTe layouts
/// ((8,c,m),(8,k)):((1,8,s2),(t0,t1)) in elements, the byte address then swizzled by
/// Swizzle<log2 c,4,3>; against the offsets the emulated wgmma reads element (mn, k) from.
#[test]
fn mn_major_descriptors_read_the_ptx_isa_layouts() {
    struct Case {
        mode: u64,
        swizzle_bits: u32,
        chunks: usize,
        mn_groups: usize,
        strides: [usize; 4], // s2 (per m), t0 (per K row), t1 (per 8 K rows), in elements; [3] unused
        lbo_bytes: u64,
        sbo_bytes: u64,
    }
    let cases = [
        // Figure 168: Swizzle<0,4,3> o ((8,1,2),(8,2)):((1,8,64),(8,128)), LBO 128 el, SBO 64 el.
        Case {
            mode: 0,
            swizzle_bits: 0,
            chunks: 1,
            mn_groups: 2,
            strides: [64, 8, 128, 0],
            lbo_bytes: 256,
            sbo_bytes: 128,
        },
        // Figure 169: Swizzle<1,4,3> o ((8,2,2),(8,2)):((1,8,128),(16,256)), LBO 128 el, SBO 256 el.
        Case {
            mode: 3,
            swizzle_bits: 1,
            chunks: 2,
            mn_groups: 2,
            strides: [128, 16, 256, 0],
            lbo_bytes: 256,
            sbo_bytes: 512,
        },
        // Figure 170: Swizzle<2,4,3> o ((8,4,2),(8,2)):((1,8,256),(32,512)), LBO 256 el, SBO 512 el.
        Case {
            mode: 2,
            swizzle_bits: 2,
            chunks: 4,
            mn_groups: 2,
            strides: [256, 32, 512, 0],
            lbo_bytes: 512,
            sbo_bytes: 1024,
        },
        // 128B: Swizzle<3,4,3> o ((8,8,2),(8,2)):((1,8,1024),(64,512)), LBO 1024 el, SBO 512 el.
        Case {
            mode: 1,
            swizzle_bits: 3,
            chunks: 8,
            mn_groups: 2,
            strides: [1024, 64, 512, 0],
            lbo_bytes: 2048,
            sbo_bytes: 1024,
        },
    ];
    let mut checked_elements = 0;
    for c in &cases {
        let rows = 8 * c.chunks * c.mn_groups;
        let desc: u64 = ((c.lbo_bytes >> 4) << 16) | ((c.sbo_bytes >> 4) << 32) | (c.mode << 62);
        let out = buf(rows * 16 * 4);
        let found = checked(
            "emutest_wgmma_offsets",
            32,
            0,
            &[P::Slot(desc), P::Slot(1), P::Slot(rows as u64), ptr(&out)],
            3,
        );
        assert!(found.is_empty(), "{found:#?}");
        let got: Vec<u32> = out
            .as_bytes()
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        for mn in 0..rows {
            for k in 0..16 {
                let (i0, i1, i2) = (mn % 8, (mn / 8) % c.chunks, mn / (8 * c.chunks));
                let el = i0
                    + 8 * i1
                    + c.strides[0] * i2
                    + c.strides[1] * (k % 8)
                    + c.strides[2] * (k / 8);
                let bytes = (2 * el) as u32;
                let mask = (1u32 << c.swizzle_bits) - 1;
                let want = bytes ^ (((bytes >> 7) & mask) << 4);
                assert_eq!(
                    got[mn * 16 + k],
                    want,
                    "mode {}: element (mn {mn}, k {k})",
                    c.mode
                );
                checked_elements += 1;
            }
        }
    }
    assert_eq!(checked_elements, 16 * (16 + 32 + 64 + 128));
}

fn ring(steps: usize, skip_empty: bool, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<EmuFinding>) {
    let x: Vec<f32> = (0..steps * 128)
        .map(|i| ((i * 37 % 101) as f32) * 0.25 - 3.0)
        .collect();
    let mut xb = EmuBuffer::alloc(x.len() * 4).unwrap();
    xb.as_bytes_mut().copy_from_slice(bytemuck::cast_slice(&x));
    let out = buf(steps * 128 * 4);
    let found = checked(
        "emutest_mbarrier_ring",
        160,
        128 + 2 * 128 * 4,
        &[
            ptr(&xb),
            ptr(&out),
            P::Slot(steps as u64),
            P::Slot(skip_empty as u64),
        ],
        seed,
    );
    let want = (0..steps * 128)
        .map(|i| 2.0 * x[i] + (i / 128) as f32)
        .collect();
    (words_f32(&out), want, found)
}

#[test]
fn an_mbarrier_ring_orders_its_stages_without_a_block_barrier() {
    for seed in [1u64, 2, 3, 4] {
        let (got, want, found) = ring(6, false, seed);
        assert!(
            found.is_empty(),
            "seed {seed}: a correct ring was reported: {found:#?}"
        );
        assert_eq!(got, want, "seed {seed}");
    }
}

#[test]
fn planted_ring_without_its_empty_barrier() {
    let line = planted_line("PLANTED BUG site: without the empty wait");
    for seed in [1u64, 2, 3] {
        let (_, _, found) = ring(6, true, seed);
        let races: Vec<&EmuFinding> = found.iter().filter(|f| f.kind == "race").collect();
        assert!(
            !races.is_empty(),
            "seed {seed}: the missing empty barrier went unnoticed: {found:#?}"
        );
        assert!(
            races.iter().any(|f| names_line(f, line)
                || f.message.contains("the bulk copies completing on mbarrier")),
            "seed {seed}: no race names the overwrite (planted.cu:{line}) or the landed data: {found:#?}"
        );
    }
}

#[test]
fn planted_missing_proxy_fence() {
    let line = planted_line("PLANTED BUG site: without the fence");
    let out = buf(128 * 4);
    let found = checked(
        "emutest_proxy_fence",
        128,
        4096,
        &[ptr(&out), P::Slot(0)],
        1,
    );
    assert!(!found.is_empty(), "the missing fence went unnoticed");
    for f in &found {
        assert_eq!(f.kind, "missing-proxy-fence", "{f}");
        assert!(f.message.contains("with no fence.proxy.async"), "{f}");
    }
    // The finding is at the wgmma (the read), a few lines below the planted site.
    assert!(
        found.iter().any(|f| f
            .location
            .as_ref()
            .is_some_and(|l| l.line > line && l.line < line + 10)),
        "{found:#?}"
    );
    let out = buf(128 * 4);
    let clean = checked(
        "emutest_proxy_fence",
        128,
        4096,
        &[ptr(&out), P::Slot(1)],
        1,
    );
    assert!(clean.is_empty(), "with the fence: {clean:#?}");
    // D[m][n] = 16 n; thread t's first value is column 2 (t % 4).
    let got = words_f32(&out);
    for (t, v) in got.iter().enumerate() {
        assert_eq!(*v, 16.0 * (2 * (t % 4)) as f32, "thread {t}");
    }
}

#[test]
fn tensor_maps_refuse_what_the_copy_engine_cannot_do() {
    let backend = emu();
    let t = Tensor::from_slice(&backend, &[8, 64], &random_bf16(512, 1)).unwrap();
    let map = |dims: &[u64], strides: &[u64], boxes: &[u32], swizzle| {
        TensorMap::tiled(
            &backend,
            &t,
            "w",
            &TiledMap {
                dims,
                strides,
                boxes,
                swizzle,
            },
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    };
    assert!(map(&[64, 8], &[128], &[64, 8], Swizzle::B128).is_ok());
    let cases: [(Result<(), String>, &str); 5] = [
        (
            map(&[64, 8], &[100], &[64, 8], Swizzle::None),
            "stride of dimension 1 is 100 bytes",
        ),
        (
            map(&[64, 8], &[128], &[32, 8], Swizzle::B128),
            "box row of 64 bytes with the 128-byte swizzle",
        ),
        (
            map(&[64, 9], &[128], &[64, 8], Swizzle::None),
            "reaches byte 1152 of a tensor of 1024 bytes",
        ),
        (
            map(&[64, 8], &[128], &[64, 300], Swizzle::None),
            "the box has 300 elements in dimension 1",
        ),
        (
            map(&[64, 8], &[128, 256], &[64, 8], Swizzle::None),
            "rank 2 with 2 box sizes and 2 strides",
        ),
    ];
    for (got, want) in cases {
        let e = got.expect_err(want);
        assert!(e.contains("tensor map over `w`") && e.contains(want), "{e}");
    }
    let cpu = Tensor::from_slice(&Backend::Cpu, &[8, 64], &random_bf16(512, 1)).unwrap();
    let e = TensorMap::tiled(
        &Backend::Cpu,
        &cpu,
        "w",
        &TiledMap {
            dims: &[64, 8],
            strides: &[128],
            boxes: &[64, 8],
            swizzle: Swizzle::None,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("cpu"), "{e}");
}

#[test]
fn named_barriers_order_the_warps_that_meet_at_them() {
    let line = planted_line("PLANTED BUG site: read without the pair's barrier");
    for seed in [1u64, 2, 3] {
        let out = buf(64 * 4);
        let clean = checked(
            "emutest_named_barrier",
            128,
            0,
            &[ptr(&out), P::Slot(1)],
            seed,
        );
        assert!(clean.is_empty(), "seed {seed}: {clean:#?}");
        let got = words_f32(&out);
        for (i, v) in got.iter().enumerate() {
            let (pair, lane) = (i / 32, i % 32);
            assert_eq!(
                *v,
                (pair * 64 + (lane + 1) % 32 + 1) as f32,
                "seed {seed}, word {i}"
            );
        }
        let out = buf(64 * 4);
        let found = checked(
            "emutest_named_barrier",
            128,
            0,
            &[ptr(&out), P::Slot(0)],
            seed,
        );
        assert!(
            !found.is_empty(),
            "seed {seed}: the missing named barrier went unnoticed"
        );
        assert!(
            found.iter().all(|f| f.kind == "race"
                && f.message.contains("of the same block with no __syncthreads, named barrier or mbarrier between them")),
            "{found:#?}"
        );
        assert!(found.iter().any(|f| names_line(f, line)), "{found:#?}");
    }
}

#[test]
fn a_chain_of_syncwarps_orders_transitively() {
    let out = buf(4);
    let found = checked("emutest_syncwarp_chain", 32, 0, &[ptr(&out)], 1);
    assert!(found.is_empty(), "{found:#?}");
    assert_eq!(words_f32(&out), [7.0]);
}
