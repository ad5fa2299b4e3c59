//! The Hopper pipeline's MN-major forms and its SwiGLU epilogue (kernels/cuda/gemm_hopper.cu)
//! on the emulator, against the CPU bit for bit:
//! - `gemm_bf16_wgmma_nn`: C = A · B with B stored [K,N], read MN-major where it lies (plain and
//!   grouped, ragged rows, a four-box B stage, a ring that wraps);
//! - `gemm_bf16_wgmma_segment_tn`: out[g] = P_g^T · Q_g with both operands MN-major and K = the
//!   segment's rows: empty, one-row, ragged and multi-step segments, whose last K step reads the
//!   next segment's rows and must zero them (the result would include them otherwise);
//! - `gemm_bf16_wgmma_swiglu`: h, gate and b rounded to bf16, the unfused bits.
//!
//! The emulator's race checker follows the ring and the tail's named barrier: a launch with a
//! finding fails the test. On a GPU the CUDA test below compares each form with the CPU by
//! relative norm (tensor cores sum a k16 step in their own order), and skips, saying so, where
//! no sm_90 GPU exists.

use half::bf16;
use sluice_kernels::emu::profile::{Recording, Sampling, Strata};
use sluice_kernels::ops::gemm::{
    gemm_grouped_nn_with_path, gemm_nn_with_path, gemm_segment_tn_with_path, GemmPath,
};
use sluice_kernels::ops::gemm_epilogue::gemm_grouped_swiglu_with_path;
use sluice_kernels::testing::{rel_norm, Rng, BF16_TOL};
use sluice_kernels::{Backend, DType, Tensor};

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn bits16(t: &Tensor) -> Vec<u16> {
    t.to_vec::<bf16>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Asserts equal bits, naming the first differing element and the count (not both vectors).
fn assert_same<T: PartialEq + std::fmt::Debug>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} of {} elements differ; first at {i}: {:?} against {:?}",
            bad.len(),
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// The kernels `f` launches (one block of each run: the names are what is asked for here).
fn kernels_of(f: impl FnOnce()) -> Vec<String> {
    kernels_sampled(
        Sampling {
            max_blocks: Some(1),
            strata: |_| Strata::Uniform,
        },
        f,
    )
}

fn kernels_sampled(sampling: Sampling, f: impl FnOnce()) -> Vec<String> {
    let rec = Recording::start(sampling).unwrap();
    f();
    rec.finish().into_iter().map(|p| p.name).collect()
}

fn bf16_tensor(backend: &Backend, shape: &[usize], rng: &mut Rng) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32_as(backend, shape, DType::BF16, &rng.normal_vec(n, 1.0)).unwrap()
}

fn on(emu: &Backend, t: &Tensor) -> Tensor {
    t.to_backend(emu).unwrap()
}

#[test]
fn nn_forms_read_b_where_it_lies_with_the_cpu_chain_bits() {
    let cpu = Backend::Cpu;
    let emu = Backend::emu_with_seed(7);
    let mut rng = Rng::new(41);
    let mut compared = 0;
    // N = 264: two column tiles, the second holding one 64-column box of 8 (the rest zero-filled);
    // K = 200: four K steps (the ring wraps once more on the next tile of the block).
    for &(m, n, k) in &[(17usize, 40usize, 24usize), (130, 264, 200), (1, 8, 8)] {
        let a = bf16_tensor(&cpu, &[m, k], &mut rng);
        let b = bf16_tensor(&cpu, &[k, n], &mut rng);
        let want = gemm_nn_with_path(&cpu, &a, &b, GemmPath::Mma).unwrap();
        let got = gemm_nn_with_path(&emu, &on(&emu, &a), &on(&emu, &b), GemmPath::Wgmma).unwrap();
        assert_same(&bits(&got), &bits(&want), &format!("{m}x{n}x{k}"));
        compared += m * n;
    }
    // Grouped: empty segments, a one-row segment, one longer than a 128-row tile.
    let offsets: [i32; 6] = [0, 0, 1, 150, 150, 170];
    let (rows, groups, n, k) = (170usize, 5usize, 72usize, 40usize);
    let a = bf16_tensor(&cpu, &[rows, k], &mut rng);
    let b = bf16_tensor(&cpu, &[groups, k, n], &mut rng);
    let o = Tensor::from_slice(&cpu, &[groups + 1], &offsets).unwrap();
    let want = gemm_grouped_nn_with_path(&cpu, &a, &b, &o, GemmPath::Mma).unwrap();
    let got = gemm_grouped_nn_with_path(
        &emu,
        &on(&emu, &a),
        &on(&emu, &b),
        &on(&emu, &o),
        GemmPath::Wgmma,
    )
    .unwrap();
    assert_same(&bits(&got), &bits(&want), "grouped");
    compared += rows * n;
    assert_eq!(compared, 17 * 40 + 130 * 264 + 8 + 170 * 72);
    // The Hopper kernel ran these (a fallback to mma.sync would give the same bits on emu), and
    // takes no N that is not a multiple of 8.
    let (ea, eb, eo) = (on(&emu, &a), on(&emu, &b), on(&emu, &o));
    let ran = kernels_of(|| {
        gemm_grouped_nn_with_path(&emu, &ea, &eb, &eo, GemmPath::Wgmma).unwrap();
    });
    assert_eq!(ran, ["gemm_bf16_wgmma_nn"]);
    let (a, b) = (
        bf16_tensor(&emu, &[3, 16], &mut rng),
        bf16_tensor(&emu, &[16, 17], &mut rng),
    );
    let ran = kernels_of(|| {
        gemm_nn_with_path(&emu, &a, &b, GemmPath::Wgmma).unwrap();
    });
    assert_eq!(ran, ["gemm_bf16_mma_nn"]);
}

#[test]
fn segment_tn_zeroes_each_ragged_tail_and_has_the_cpu_chain_bits() {
    let cpu = Backend::Cpu;
    let emu = Backend::emu_with_seed(8);
    let mut rng = Rng::new(42);
    let mut compared = 0;
    // Segments of 0, 1, 17, 127, 64 and 70 rows: tails of every length, two-step segments, one
    // exactly one K step; every tail but the last is followed by another segment's rows.
    let offsets: [i32; 7] = [0, 0, 1, 18, 145, 209, 279];
    let rows = 279usize;
    for &(pc, qc) in &[(72usize, 40usize), (136, 264)] {
        let groups = offsets.len() - 1;
        let p = bf16_tensor(&cpu, &[rows, pc], &mut rng);
        let q = bf16_tensor(&cpu, &[rows, qc], &mut rng);
        let o = Tensor::from_slice(&cpu, &[groups + 1], &offsets).unwrap();
        let want = gemm_segment_tn_with_path(&cpu, &p, &q, &o, GemmPath::Mma).unwrap();
        let got = gemm_segment_tn_with_path(
            &emu,
            &on(&emu, &p),
            &on(&emu, &q),
            &on(&emu, &o),
            GemmPath::Wgmma,
        )
        .unwrap();
        let (w, g) = (bits(&want), bits(&got));
        assert_eq!(g.len(), groups * pc * qc);
        // The empty segment's block is zeros, and the others are not.
        assert!(w[..pc * qc].iter().all(|&b| b == 0));
        assert!(w[pc * qc..].iter().any(|&b| b != 0));
        assert_same(&g, &w, &format!("P {pc}, Q {qc}"));
        compared += g.len();
    }
    assert_eq!(compared, 6 * (72 * 40 + 136 * 264));
}

#[test]
fn the_swiglu_epilogue_on_wgmma_has_the_unfused_bits() {
    let cpu = Backend::Cpu;
    let emu = Backend::emu_with_seed(9);
    let mut rng = Rng::new(43);
    let offsets: [i32; 4] = [0, 17, 17, 150];
    let (rows, groups, k) = (150usize, 3usize, 72usize);
    let mut compared = 0;
    // N = 40: a partial 64-column piece of the slab; 17: odd, rows start unaligned (the
    // element-by-element stores); 300: two column tiles.
    for n in [40usize, 17, 300] {
        let a = bf16_tensor(&cpu, &[rows, k], &mut rng);
        let b = bf16_tensor(&cpu, &[groups, n, k], &mut rng);
        let gate = Tensor::from_f32_vec(&cpu, &[rows, n], rng.normal_vec(rows * n, 2.0)).unwrap();
        let o = Tensor::from_slice(&cpu, &[groups + 1], &offsets).unwrap();
        let want = gemm_grouped_swiglu_with_path(&cpu, &a, &b, &o, &gate, GemmPath::Mma).unwrap();
        let (ea, eb, eo, eg) = (on(&emu, &a), on(&emu, &b), on(&emu, &o), on(&emu, &gate));
        let got = gemm_grouped_swiglu_with_path(&emu, &ea, &eb, &eo, &eg, GemmPath::Wgmma).unwrap();
        assert_same(&bits16(&got.h), &bits16(&want.h), &format!("h, N {n}"));
        assert_same(
            &bits16(&got.gate),
            &bits16(&want.gate),
            &format!("gate, N {n}"),
        );
        assert_same(&bits16(&got.b), &bits16(&want.b), &format!("b, N {n}"));
        compared += want.h.to_vec::<bf16>().unwrap().len();
        let ran = kernels_of(|| {
            gemm_grouped_swiglu_with_path(&emu, &ea, &eb, &eo, &eg, GemmPath::Wgmma).unwrap();
        });
        assert_eq!(ran, ["gemm_bf16_wgmma_swiglu"]);
    }
    assert_eq!(compared, rows * (40 + 17 + 300));
}

/// `GemmPath::scoped` overrides `SLUICE_GEMM_PATH` on its own thread until dropped, and puts a
/// composite op's GEMMs (the MoE layer's, here) on that path: what the bench's `wgmma` MoE rows
/// and `moe::cuda_wgmma_matches_reference` rely on.
#[test]
fn a_scoped_path_steers_this_thread_only() {
    let from_env = GemmPath::from_env().unwrap();
    {
        let _g = GemmPath::scoped(GemmPath::Wgmma);
        assert_eq!(GemmPath::from_env().unwrap(), GemmPath::Wgmma);
        let other = std::thread::spawn(|| GemmPath::from_env().unwrap())
            .join()
            .unwrap();
        assert_eq!(
            other, from_env,
            "another thread keeps the environment's path"
        );
        {
            let _inner = GemmPath::scoped(GemmPath::Mma);
            assert_eq!(GemmPath::from_env().unwrap(), GemmPath::Mma);
        }
        assert_eq!(
            GemmPath::from_env().unwrap(),
            GemmPath::Wgmma,
            "nested guard restored"
        );
    }
    assert_eq!(GemmPath::from_env().unwrap(), from_env);

    use sluice_kernels::ops::moe::{moe_forward, MoeConfig};
    let emu = Backend::emu_with_seed(10);
    let mut rng = Rng::new(45);
    let (t, d, e, f) = (24usize, 32usize, 4usize, 32usize);
    let x = bf16_tensor(&emu, &[t, d], &mut rng);
    let wr = bf16_tensor(&emu, &[e, d], &mut rng);
    let w1 = bf16_tensor(&emu, &[e, f, d], &mut rng);
    let w3 = bf16_tensor(&emu, &[e, f, d], &mut rng);
    let w2 = bf16_tensor(&emu, &[e, d, f], &mut rng);
    let ran = kernels_sampled(Sampling::full(), || {
        let _g = GemmPath::scoped(GemmPath::Wgmma);
        moe_forward(&emu, &x, &wr, &w1, &w3, &w2, MoeConfig::new(2)).unwrap();
    });
    let hopper: Vec<&str> = ran
        .iter()
        .map(String::as_str)
        .filter(|k| k.starts_with("gemm_bf16"))
        .collect();
    assert_eq!(
        hopper,
        [
            "gemm_bf16_wgmma",
            "gemm_bf16_wgmma_swiglu",
            "gemm_bf16_wgmma"
        ],
        "{ran:?}"
    );
}

/// Where a GPU exists: on sm_90 each form within the bf16 tolerance of the CPU (relative norm)
/// and two runs bit for bit; skips, saying so, elsewhere (the other forms' refusal off sm_90 is
/// `check_path`'s, tested in gemm_hopper.rs).
#[test]
fn cuda_hopper_forms_match_the_cpu() {
    let Some(gpu) = sluice_kernels::device::cuda_for_tests("gemm_hopper_forms cuda") else {
        return;
    };
    if !gpu
        .cuda()
        .is_some_and(|c| c.arch() == sluice_kernels::cuda::PtxArch::Sm90a)
    {
        println!("gemm_hopper_forms cuda: not an sm_90 GPU; skipped");
        return;
    }
    let cpu = Backend::Cpu;
    let mut rng = Rng::new(44);
    let f64s = |t: &Tensor| -> Vec<f64> {
        t.to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| *v as f64)
            .collect()
    };
    let (m, n, k) = (300usize, 520usize, 264usize);
    let a = bf16_tensor(&cpu, &[m, k], &mut rng);
    let b = bf16_tensor(&cpu, &[k, n], &mut rng);
    let want = f64s(&gemm_nn_with_path(&cpu, &a, &b, GemmPath::Mma).unwrap());
    let run = || gemm_nn_with_path(&gpu, &on(&gpu, &a), &on(&gpu, &b), GemmPath::Wgmma).unwrap();
    let (got, again) = (run(), run());
    let r = rel_norm(&got.to_vec::<f32>().unwrap(), &want);
    assert!(r < BF16_TOL, "nn: relative norm {r:e}");
    assert_same(&bits(&got), &bits(&again), "nn: two runs");

    let offsets: [i32; 5] = [0, 0, 1, 300, 517];
    let (rows, pc, qc) = (517usize, 136usize, 264usize);
    let p = bf16_tensor(&cpu, &[rows, pc], &mut rng);
    let q = bf16_tensor(&cpu, &[rows, qc], &mut rng);
    let o = Tensor::from_slice(&cpu, &[5], &offsets).unwrap();
    let want = f64s(&gemm_segment_tn_with_path(&cpu, &p, &q, &o, GemmPath::Mma).unwrap());
    let run = || {
        gemm_segment_tn_with_path(
            &gpu,
            &on(&gpu, &p),
            &on(&gpu, &q),
            &on(&gpu, &o),
            GemmPath::Wgmma,
        )
        .unwrap()
    };
    let (got, again) = (run(), run());
    let r = rel_norm(&got.to_vec::<f32>().unwrap(), &want);
    assert!(r < BF16_TOL, "segment_tn: relative norm {r:e}");
    assert_same(&bits(&got), &bits(&again), "segment_tn: two runs");
}
