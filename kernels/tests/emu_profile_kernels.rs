//! The profiler on sluice's own kernels: the bf16 GEMM's tensor-core and ldmatrix counts, the
//! access widths the emulator sees against the checked-in PTX, and a sampled profile against a
//! full one (docs/emulator.md, "Profiling").

use sluice_kernels::emu::profile::{Counters, KernelProfile, Recording, Sampling, Strata};
use sluice_kernels::ops;
use sluice_kernels::profiler::{cases, profile_case, Preset};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Tensor};
use std::collections::{BTreeMap, BTreeSet};

fn random(backend: &Backend, shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut rng = Rng::new(seed);
    let data: Vec<f32> = (0..n).map(|_| (rng.uniform() * 2.0 - 1.0) as f32).collect();
    Tensor::from_f32_as(backend, shape, dtype, &data).unwrap()
}

fn total(kernels: &[KernelProfile]) -> Counters {
    let mut c = Counters::default();
    for k in kernels {
        c.add(&k.totals);
    }
    c
}

/// M = N = K = 128 in bf16: one 128 x 128 tile, (128/16) * (128/8) * (128/16) = 1024 mma.sync
/// m16n8k16 instructions, and ldmatrix reads from the padded tile at the ideal wavefronts.
#[test]
fn the_bf16_gemm_issues_mnk_over_2048_mmas_and_reads_shared_memory_at_ideal() {
    for seed in [0, 3] {
        let backend = Backend::emu_with_seed(seed);
        let a = random(&backend, &[128, 128], DType::BF16, 1);
        let b = random(&backend, &[128, 128], DType::BF16, 2);
        let rec = Recording::start(Sampling::full()).unwrap();
        ops::gemm::gemm(&backend, &a, &b).unwrap();
        let launches = rec.finish();
        let gemm: Vec<&KernelProfile> = launches
            .iter()
            .filter(|k| k.name == "gemm_bf16_mma")
            .collect();
        assert_eq!(
            gemm.len(),
            1,
            "one GEMM launch: {:?}",
            launches.iter().map(|k| &k.name).collect::<Vec<_>>()
        );
        let c = &gemm[0].totals;
        assert_eq!(
            c.tensor_instructions.get("mma.m16n8k16.bf16").copied(),
            Some(1024.0)
        );
        assert_eq!(c.get("tensor_flops"), 2.0 * 128.0 * 128.0 * 128.0);
        // 8 warps x 2 k16 steps per k-tile x 4 k-tiles x (4 A + 2 B) ldmatrix.x4.
        assert_eq!(c.get("ldmatrix_instructions"), 8.0 * 2.0 * 4.0 * 6.0);
        assert!(c.get("shared_load_wavefronts") > 0.0);
        assert_eq!(
            c.get("shared_load_wavefronts"),
            c.get("shared_load_ideal_wavefronts"),
            "ldmatrix from the padded tile is conflict-free"
        );
    }
}

/// Access widths (bytes per lane) of the global and shared loads and stores of one kernel in the
/// checked-in PTX (ptx/compute_90a): ld/st.{global,shared}[.nc][.vN].TYPE.
fn ptx_widths(family: &str, kernel: &str) -> BTreeMap<&'static str, BTreeSet<u32>> {
    let path = format!(
        "{}/../ptx/compute_90a/{family}.ptx",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let start = text
        .find(&format!(".entry {kernel}("))
        .unwrap_or_else(|| panic!("{kernel} not in {path}"));
    let body = &text[start..];
    let end = body[1..].find(".entry ").map_or(body.len(), |e| e + 1);
    let mut out: BTreeMap<&'static str, BTreeSet<u32>> = BTreeMap::new();
    for line in body[..end].lines() {
        let Some(op) = line.split_whitespace().next() else {
            continue;
        };
        let parts: Vec<&str> = op.trim_end_matches(';').split('.').collect();
        let kind = match (parts.first().copied(), parts.get(1).copied()) {
            (Some("ld"), Some("global")) => "global_load",
            (Some("st"), Some("global")) => "global_store",
            (Some("ld"), Some("shared")) => "shared_load",
            (Some("st"), Some("shared")) => "shared_store",
            _ => continue,
        };
        let lanes: u32 = parts
            .iter()
            .find_map(|p| p.strip_prefix('v').and_then(|n| n.parse().ok()))
            .unwrap_or(1);
        let ty = parts.last().unwrap();
        let bits: u32 = ty[1..]
            .parse()
            .unwrap_or_else(|_| panic!("type of `{line}`"));
        out.entry(kind).or_default().insert(lanes * bits / 8);
    }
    out
}

/// The host compiler must not merge, split or vectorise accesses (build flags of
/// kernels/src/emu/build_flags.rs): every width the profiler saw is one nvcc emitted.
#[test]
fn access_widths_match_the_checked_in_ptx() {
    let backend = Backend::emu_with_seed(0);
    // rmsnorm (f32 scalar loads, shared scratch), is_gate_loss (16-byte vector loads: rows of a
    // whole number of 2048-entry tiles take the vector path).
    for (op, family, kernel) in [
        ("rmsnorm", "rmsnorm", "rmsnorm_forward_f32"),
        ("is_gate_loss", "is_gate_loss", "is_gate_loss_f32"),
    ] {
        let mut case = cases::case(op, Preset::Small, &backend).unwrap();
        if op == "is_gate_loss" {
            let (n, v) = (4, 4096);
            case.tensors
                .insert("logits".into(), random(&backend, &[n, v], DType::F32, 11));
            let tokens: Vec<i32> = (0..n as i32).map(|i| i * 997).collect();
            case.tensors.insert(
                "tokens".into(),
                Tensor::from_slice(&backend, &[n], &tokens).unwrap(),
            );
            for name in ["behavior_logp", "advantages"] {
                case.tensors.insert(
                    name.into(),
                    Tensor::from_slice(&backend, &[n], &[-1.0f32, 0.5, 1.0, 1.0]).unwrap(),
                );
            }
            case.tensors.insert(
                "mask".into(),
                Tensor::from_slice(&backend, &[n], &[1.0f32, 1.0, 0.0, 1.0]).unwrap(),
            );
            case.tensors.remove("weight");
        }
        let p = profile_case(&backend, case, None).unwrap();
        let k = p
            .kernels
            .iter()
            .find(|k| k.name == kernel)
            .unwrap_or_else(|| {
                panic!(
                    "{op} launches {kernel}: {:?}",
                    p.kernels.iter().map(|k| &k.name).collect::<Vec<_>>()
                )
            });
        let ptx = ptx_widths(family, kernel);
        assert!(
            !k.totals.widths.is_empty(),
            "{kernel}: no memory access seen"
        );
        for (kind, seen) in &k.totals.widths {
            if *kind == "atomic" {
                continue;
            }
            let emitted = ptx.get(kind).cloned().unwrap_or_default();
            assert!(
                seen.is_subset(&emitted),
                "{kernel}: {kind} widths {seen:?} seen, PTX has {emitted:?}"
            );
        }
        // Where nvcc vectorised the loads, the emulator sees the same 16-byte accesses.
        if ptx.get("global_load").is_some_and(|w| w.contains(&16)) {
            assert!(
                k.totals.widths["global_load"].contains(&16),
                "{kernel}: {:?}",
                k.totals.widths
            );
        }
    }
}

/// Relative difference of every sizeable counter between a sampled and a full profile.
fn assert_close(full: &Counters, sampled: &Counters, what: &str) {
    let mut compared = 0;
    for (name, &f) in &full.values {
        if name.starts_with("unique_bytes") || f < 1000.0 {
            continue;
        }
        let s = sampled.get(name);
        let rel = (s - f).abs() / f;
        assert!(
            rel <= 0.02,
            "{what}: {name} sampled {s} against full {f} ({:.2}%)",
            rel * 100.0
        );
        compared += 1;
    }
    assert!(compared >= 5, "{what}: only {compared} counters compared");
}

fn profile_with(
    strata: fn(&str) -> Strata,
    blocks: Option<u64>,
    run: impl FnOnce(),
) -> Vec<KernelProfile> {
    let rec = Recording::start(Sampling {
        max_blocks: blocks,
        strata,
    })
    .unwrap();
    run();
    rec.finish()
}

/// Causal attention on the tile path, 8 sequences of 256 tokens, 4 heads: the per-block work
/// grows along the query axis (and the grid's tail blocks exit at once), which the op's strata
/// follow; 48 sampled blocks of 96 stay within 2%.
#[test]
fn a_sampled_causal_attention_profile_is_within_2_percent_of_the_full_one() {
    let backend = Backend::emu_with_seed(0);
    let strata = cases::case("attention_forward", Preset::Small, &backend)
        .unwrap()
        .strata;
    let (t, h, d) = (2048, 4, 16);
    let q = random(&backend, &[t, h, d], DType::BF16, 3);
    let k = random(&backend, &[t, 2, d], DType::BF16, 4);
    let v = random(&backend, &[t, 2, d], DType::BF16, 5);
    let cu_host: Vec<i32> = (0..=8).map(|i| i * 256).collect();
    let cu = Tensor::from_slice(&backend, &[9], &cu_host).unwrap();
    let run = || {
        ops::attention::attention_forward(&backend, &q, &k, &v, &cu, true, None).unwrap();
    };
    let full = profile_with(strata, None, run);
    assert_eq!(full.len(), 1, "one launch");
    assert_eq!(full[0].name, "attention_tc_forward_d16");
    let sampled = profile_with(strata, Some(48), run);
    assert!(
        sampled.iter().any(|k| !k.is_full()),
        "the sample ran fewer blocks"
    );
    assert_close(&total(&full), &total(&sampled), "attention_forward");
}

/// The MoE forward, T = 512, d = 128, E = 8, top-2, f = 64: routing runs in full, the grouped
/// GEMMs and the gather/combine are sampled.
#[test]
fn a_sampled_moe_forward_profile_is_within_2_percent_of_the_full_one() {
    let backend = Backend::emu_with_seed(0);
    let strata = cases::case("moe_forward", Preset::Small, &backend)
        .unwrap()
        .strata;
    let (t, dm, e, f) = (512, 128, 8, 64);
    let x = random(&backend, &[t, dm], DType::BF16, 6);
    let wr = random(&backend, &[e, dm], DType::BF16, 7);
    let w1 = random(&backend, &[e, f, dm], DType::BF16, 8);
    let w3 = random(&backend, &[e, f, dm], DType::BF16, 9);
    let w2 = random(&backend, &[e, dm, f], DType::BF16, 10);
    let run = || {
        ops::moe::moe_forward(
            &backend,
            &x,
            &wr,
            &w1,
            &w3,
            &w2,
            ops::moe::MoeConfig::new(2),
        )
        .unwrap();
    };
    let full = profile_with(strata, None, run);
    let sampled = profile_with(strata, Some(16), run);
    assert!(
        sampled.iter().any(|k| !k.is_full()),
        "the sample ran fewer blocks"
    );
    assert_close(&total(&full), &total(&sampled), "moe_forward");
}
