//! `sluice emu profile` and `sluice emu check --profile` as a user runs them: every op of the
//! kernel runner profiles at the small preset, the JSON has the documented keys, and bad usage
//! is exit 2 with a line naming the problem and no JSON file.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-emu-profile-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn sluice(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("SLUICE_DEBUG", "1")
        .env(
            "SLUICE_EMU_CACHE",
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("emu-cache"),
        )
        .output()
        .unwrap()
}

const LINE_KEYS: &[&str] = &[
    "global_load_requests",
    "global_load_bytes",
    "global_load_sectors",
    "global_load_lines",
    "global_load_ideal_sectors",
    "global_store_requests",
    "global_store_bytes",
    "global_store_sectors",
    "global_store_lines",
    "global_store_ideal_sectors",
    "shared_load_requests",
    "shared_load_wavefronts",
    "shared_load_ideal_wavefronts",
    "shared_store_requests",
    "shared_store_wavefronts",
    "shared_store_ideal_wavefronts",
    "tensor_instructions",
    "tensor_flops",
    "special_function_calls",
    "async_copy_bytes",
    "barriers",
    "shuffles",
    "atomics",
    "unique_bytes_read",
    "unique_bytes_written",
];

fn check_record(v: &Value, op: &str) {
    assert_eq!(v["op"], op);
    let kernels = v["kernels"]
        .as_array()
        .unwrap_or_else(|| panic!("{op}: kernels"));
    assert!(!kernels.is_empty(), "{op}: at least one launch");
    for k in kernels {
        for key in [
            "name",
            "grid",
            "block",
            "blocks_profiled",
            "totals",
            "lines",
        ] {
            assert!(!k[key].is_null(), "{op}: kernel key {key}");
        }
        for key in LINE_KEYS {
            assert!(k["totals"].get(*key).is_some(), "{op}: totals.{key}");
        }
        let lines = k["lines"].as_array().unwrap();
        for l in lines {
            assert!(
                l["site"].as_str().is_some_and(|s| s.contains(':')),
                "{op}: site FILE:LINE"
            );
            for key in LINE_KEYS {
                assert!(l.get(*key).is_some(), "{op}: line.{key}");
            }
        }
    }
    for key in ["op_flops", "tensor_flops", "tensor_share"] {
        assert!(v.get(key).is_some(), "{op}: {key}");
    }
    assert!(
        v["bound"]["seconds"].as_f64().is_some_and(|s| s > 0.0),
        "{op}: bound.seconds"
    );
    assert!(
        v["bound"]["binding"].as_str().is_some(),
        "{op}: bound.binding"
    );
}

/// Every op of `sluice kernel --list` profiles at the small preset (the CI run of the issue).
#[test]
fn every_op_profiles_at_the_small_preset() {
    let list = sluice(&["kernel", "--list"]);
    assert!(list.status.success());
    let ops: Vec<String> = String::from_utf8_lossy(&list.stdout)
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.is_empty())
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect();
    assert_eq!(ops.len(), 29, "{ops:?}");
    let dir = scratch("all");
    for op in &ops {
        let json = dir.join(format!("{op}.json"));
        let out = sluice(&[
            "emu",
            "profile",
            op,
            "--preset",
            "small",
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{op}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("H200 bound (a model)"), "{op}: {text}");
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        check_record(&v, op);
    }
}

/// A sampled profile says so and reports no unique bytes (they need every block).
#[test]
fn a_sampled_profile_scales_and_says_so() {
    let dir = scratch("sampled");
    let json = dir.join("attention.json");
    let out = sluice(&[
        "emu",
        "profile",
        "attention_forward",
        "--blocks",
        "4",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("blocks sampled, counts scaled"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let k = &v["kernels"][0];
    assert_eq!(k["blocks_profiled"], 4);
    assert!(k["blocks_total"].as_u64().unwrap() > 4);
    assert!(k["totals"]["unique_bytes_read"].is_null());
    assert_eq!(v["bound"]["terms"]["dram_basis"], "compulsory bytes");
}

fn assert_usage_error(args: &[&str], json: &Path, says: &str) {
    let out = sluice(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains(says), "{args:?}: `{err}` should say `{says}`");
    assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
    assert!(!json.exists(), "{args:?}: no JSON on failure");
    assert!(
        !json.with_extension("json.partial").exists(),
        "{args:?}: no partial JSON"
    );
}

#[test]
fn bad_usage_is_exit_2_with_one_line_and_no_json() {
    let dir = scratch("bad");
    let json = dir.join("out.json");
    let j = json.to_str().unwrap();
    assert_usage_error(
        &["emu", "profile", "no_such_op", "--json", j],
        &json,
        "unknown op `no_such_op`",
    );
    assert_usage_error(
        &["emu", "profile", "gemm", "--preset", "huge", "--json", j],
        &json,
        "unknown preset `huge`",
    );
    assert_usage_error(
        &["emu", "profile", "gemm", "--blocks", "0", "--json", j],
        &json,
        "--blocks must be at least 1",
    );
    let missing = dir.join("missing.safetensors");
    assert_usage_error(
        &[
            "emu",
            "profile",
            "gemm",
            "--in",
            missing.to_str().unwrap(),
            "--json",
            j,
        ],
        &json,
        "missing.safetensors",
    );
    // A CUDA file that does not compile, under `emu check --profile`.
    let cu = dir.join("broken.cu");
    std::fs::write(
        &cu,
        "extern \"C\" __global__ void k(float* out) { out[threadIdx.x] = undefined_name; }\n",
    )
    .unwrap();
    let out = sluice(&[
        "emu",
        "check",
        cu.to_str().unwrap(),
        "--kernel",
        "k",
        "--grid",
        "1",
        "--block",
        "1",
        "--arg",
        "out=f32[1]",
        "--profile",
        "--json",
        j,
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not compile for the emulator"));
    assert!(!json.exists());
}

/// `sluice emu check --profile` on any CUDA file: the profile follows the check's verdict.
#[test]
fn emu_check_profiles_any_kernel() {
    let dir = scratch("check");
    let cu = dir.join("copy.cu");
    std::fs::write(
        &cu,
        "extern \"C\" __global__ void copy_strided(const float* x, float* y, int stride) {\n\
         \x20   y[threadIdx.x] = x[threadIdx.x * stride];\n}\n",
    )
    .unwrap();
    let json = dir.join("copy.json");
    let out = sluice(&[
        "emu",
        "check",
        cu.to_str().unwrap(),
        "--kernel",
        "copy_strided",
        "--grid",
        "1",
        "--block",
        "32",
        "--arg",
        "x=f32[64]:random",
        "--arg",
        "y=f32[32]",
        "--arg",
        "stride=i32:2",
        "--seeds",
        "2",
        "--profile",
        "--json",
        json.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("ok"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let t = &v["kernels"][0]["totals"];
    // Stride 2: 32 lanes x 4 bytes over 256 bytes, 8 sectors in 2 lines, ideal 4.
    assert_eq!(t["global_load_requests"], 1);
    assert_eq!(t["global_load_sectors"], 8);
    assert_eq!(t["global_load_lines"], 2);
    assert_eq!(t["global_load_ideal_sectors"], 4);
    let sites: Vec<&str> = v["kernels"][0]["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["site"].as_str().unwrap())
        .collect();
    assert!(sites.iter().any(|s| s.ends_with("copy.cu:2")), "{sites:?}");
}

/// A profile of inputs from a file samples each launch as the op's own case does (attention:
/// by query tile along grid x). Two 128-token sequences, 2 heads: grid (2 tiles + 2 spare
/// blocks, 2 heads); a uniform sample of 2 would take x = 2 twice, two spare blocks that exit at
/// once, and count no FLOPs. By query tile, one stratum's block is sequence 1's whole tile: the
/// scaled count is the exact one, 2 heads x 2 sequences x 10 warp-tiles (4 warps of 32 rows see
/// 1..4 key tiles of 32) x 32 x 32 pairs x 16 dims x 4 FLOPs.
#[test]
fn a_file_profile_samples_as_the_op_s_case() {
    use sluice_kernels::{io::write_safetensors, Backend, DType, Tensor};
    let dir = scratch("file-strata");
    let (t, h, d) = (256usize, 2usize, 16usize);
    let cpu = Backend::Cpu;
    let vals: Vec<f32> = (0..t * h * d)
        .map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5)
        .collect();
    let x = Tensor::from_f32_as(&cpu, &[t, h, d], DType::BF16, &vals).unwrap();
    let cu = Tensor::from_slice(&cpu, &[3], &[0i32, 128, 256]).unwrap();
    let input = dir.join("attention.safetensors");
    let named = [("q", &x), ("k", &x), ("v", &x), ("cu_seqlens", &cu)];
    write_safetensors(&input, &named, &Default::default()).unwrap();
    let json = dir.join("attention.json");
    let out = sluice(&[
        "emu",
        "profile",
        "attention_forward",
        "--in",
        input.to_str().unwrap(),
        "--blocks",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["kernels"][0]["name"], "attention_tc_forward_d16");
    assert_eq!(v["kernels"][0]["blocks_profiled"], 2);
    let exact = (2 * 2 * 10 * 32 * 32 * 16 * 4) as f64;
    let got = v["tensor_flops"].as_f64().unwrap();
    assert!((got - exact).abs() <= 0.01 * exact, "{got} vs {exact}");
}
