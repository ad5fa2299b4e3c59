//! The emulator's register-source wgmma (`wgmma_bf16_rs` in kernels/cuda/common/hopper.cuh; test
//! kernels in kernels/emu/tests/wgmma_rs.cu): the fragment of A in registers as the PTX ISA draws
//! it, element by element; products against an f32 fmaf chain, B K-major and MN-major; and the
//! planted bug of the new hazard class, an A register written before the wgmma's wait.
//!
//! The fragment table below is written the way the ISA states it ("Register Fragments", matrix
//! A of wgmma .m64nNk16; CUTLASS encodes the same map as its `ALayout_64x16`), independently of
//! the emulator's decoding in hopper.cuh (a list of which quad lane holds which rows and
//! columns). A misreading shared by both would pass; a GPU run of the attention kernels that use
//! this form (kernels/tests/attention_wgmma.rs, CUDA test) settles it.

use half::bf16;
use sluice_kernels::emu::{EmuBuffer, EmuFinding};
use std::ffi::c_void;

mod support;
use support::{checked_launch, marker_line};

/// (row, column) of element `e` (a0..a7) of warpgroup thread `i`'s A fragment: warp w = i / 32
/// holds rows 16w..16w+15; groupID = lane >> 2, threadID_in_group = lane % 4;
/// row = 16w + groupID for a0, a1, a4, a5 and + 8 for a2, a3, a6, a7;
/// col = 2 threadID_in_group + (e & 1) for a0..a3 and + 8 for a4..a7.
fn isa_a_element(i: usize, e: usize) -> (usize, usize) {
    let (warp, lane) = (i / 32, i % 32);
    let (group, tig) = (lane >> 2, lane % 4);
    let row = 16 * warp + group + if matches!(e, 2 | 3 | 6 | 7) { 8 } else { 0 };
    let col = 2 * tig + (e & 1) + if e >= 4 { 8 } else { 0 };
    (row, col)
}

/// Every thread's four registers for A [64][16]: register r holds elements 2r (low half) and
/// 2r + 1 (high half), as the ISA's "elements (low to high)" lists them.
fn fragments(a: &[bf16]) -> Vec<u32> {
    let mut regs = vec![0u32; 128 * 4];
    for i in 0..128 {
        for r in 0..4 {
            let (r0, c0) = isa_a_element(i, 2 * r);
            let (r1, c1) = isa_a_element(i, 2 * r + 1);
            let lo = a[r0 * 16 + c0].to_bits() as u32;
            let hi = a[r1 * 16 + c1].to_bits() as u32;
            regs[4 * i + r] = lo | (hi << 16);
        }
    }
    regs
}

fn buffer_of<T: Copy>(data: &[T]) -> EmuBuffer {
    let bytes = std::mem::size_of_val(data);
    let mut b = EmuBuffer::alloc(bytes).expect("emu alloc");
    // SAFETY: `data` is `bytes` long and T is plain data (u32, bf16).
    let src = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), bytes) };
    b.as_bytes_mut().copy_from_slice(src);
    b
}

/// One run of `emutest_wgmma_rs`: C (64 x n) and the thread's A[0] parity row; its findings.
fn run(
    a: &[bf16],
    b: &[bf16],
    n: usize,
    mn_major: bool,
    early: bool,
    seed: u64,
) -> (Vec<f32>, Vec<EmuFinding>) {
    let frag = buffer_of(&fragments(a));
    let bb = buffer_of(b);
    let mut out = EmuBuffer::alloc((64 * n + 128) * 4).expect("emu alloc");
    out.as_bytes_mut().fill(0xff); // poison: every word must be written
    let mut slots: Vec<u64> = vec![
        frag.as_ptr() as u64,
        bb.as_ptr() as u64,
        out.as_ptr() as u64,
        n as u64,
        mn_major as u64,
        early as u64,
    ];
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|s| s as *mut u64 as *mut c_void)
        .collect();
    let found = checked_launch("emutest_wgmma_rs", 1, 128, n * 16 * 2, &mut params, seed);
    let c = out
        .as_bytes()
        .chunks_exact(4)
        .take(64 * n)
        .map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect();
    (c, found)
}

/// Distinct normal bf16 values (bit patterns 0x3c00 + i: 2^-7 to just under 2).
fn distinct(n: usize) -> Vec<bf16> {
    (0..n).map(|i| bf16::from_bits(0x3c00 + i as u16)).collect()
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

#[test]
fn register_a_follows_the_ptx_isa_fragment_element_by_element() {
    // B one-hot: B[col][k] = 1 where k = col % 16, so C[row][col] = A[row][col % 16] exactly
    // (the other 15 products are +0): every element of A shows up where the emulator read it from.
    let a = distinct(64 * 16);
    let mut checked = 0;
    for n in [64usize, 128] {
        for mn_major in [false, true] {
            let b: Vec<bf16> = (0..n * 16)
                .map(|e| bf16::from_f32(if e % 16 == (e / 16) % 16 { 1.0 } else { 0.0 }))
                .collect();
            let (c, found) = run(&a, &b, n, mn_major, false, 1);
            assert!(found.is_empty(), "N {n}, MN-major {mn_major}: {found:#?}");
            for row in 0..64 {
                for col in 0..n {
                    let want = a[row * 16 + col % 16].to_f32();
                    assert_eq!(
                        c[row * n + col].to_bits(),
                        want.to_bits(),
                        "N {n}, MN-major {mn_major}: C[{row}][{col}] = {} is not A[{row}][{}] = {want}",
                        c[row * n + col],
                        col % 16
                    );
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 2 * 64 * (64 + 128));
}

#[test]
fn register_a_products_equal_an_fmaf_chain_in_ascending_k_under_two_seeds() {
    let mut compared = 0;
    for n in [64usize, 128] {
        for mn_major in [false, true] {
            let a = random_bf16(64 * 16, 3 + n as u64);
            let b = random_bf16(n * 16, 5 + n as u64);
            let (c1, found) = run(&a, &b, n, mn_major, false, 1);
            assert!(found.is_empty(), "{found:#?}");
            let (c2, _) = run(&a, &b, n, mn_major, false, 2);
            for row in 0..64 {
                for col in 0..n {
                    let mut acc = 0f32;
                    for k in 0..16 {
                        acc = a[row * 16 + k]
                            .to_f32()
                            .mul_add(b[col * 16 + k].to_f32(), acc);
                    }
                    let (x, y) = (c1[row * n + col], c2[row * n + col]);
                    assert_eq!(
                        x.to_bits(),
                        acc.to_bits(),
                        "N {n} MN {mn_major}: C[{row}][{col}]"
                    );
                    assert_eq!(x.to_bits(), y.to_bits(), "seeds differ at C[{row}][{col}]");
                    assert!(
                        acc != 0.0 || a[row * 16..row * 16 + 16].iter().all(|v| v.to_f32() == 0.0)
                    );
                    compared += 1;
                }
            }
        }
    }
    assert_eq!(compared, 2 * 64 * (64 + 128));
}

#[test]
fn planted_a_register_written_before_the_wait() {
    let line = marker_line(
        include_str!("../emu/tests/wgmma_rs.cu"),
        "PLANTED BUG: an A register overwritten",
    );
    let a = random_bf16(64 * 16, 9);
    let b = random_bf16(64 * 16, 10);
    let (_, found) = run(&a, &b, 64, false, true, 1);
    let hits: Vec<&EmuFinding> = found
        .iter()
        .filter(|f| f.kind == "async-operand-before-wait")
        .collect();
    assert!(
        !hits.is_empty(),
        "no async-operand-before-wait finding: {found:#?}"
    );
    assert!(
        hits.iter().all(|f| f
            .location
            .as_ref()
            .is_some_and(|l| l.file.ends_with("wgmma_rs.cu") && l.line == line)),
        "the findings do not name wgmma_rs.cu:{line}: {hits:#?}"
    );
    assert!(
        hits[0].message.contains("A registers") && hits[0].message.contains("wgmma_rs.cu"),
        "{}",
        hits[0].message
    );
}
