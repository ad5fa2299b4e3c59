//! `sluice determinism` from the outside (the built binary, with the test-only feature
//! `planted-faults` this package's tests turn on; its faults are inert unless SLUICE_PLANT
//! names one):
//!
//! - the CI gate: the committed goldens (tests/golden) pass on cpu (ci and full) and emu (ci);
//! - `run` catches the planted nondeterministic op and names it, with the first differing
//!   element under `--dump`; `check` fails, naming the op and how to bless, when an op's
//!   summation order changes; `--bless --reason` records the change;
//! - every probe passes on cpu (and the cheap ones on emu), and fails with its counterexample
//!   when its planted broken variant is in force;
//! - `diff` names what differs; bad input is exit 2 with one line naming it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-det-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `sluice determinism ARGS` with `env` (SLUICE_PLANT cleared unless given).
fn det(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(BIN);
    c.arg("determinism").args(args).current_dir(root());
    c.env_remove("SLUICE_PLANT");
    // Tests run checked (kernels/src/debug.rs); a test may pass SLUICE_DEBUG=0 in `env`.
    c.env("SLUICE_DEBUG", "1");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run sluice")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).to_string(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

fn expect(o: &Output, code: i32, what: &str) -> (String, String) {
    let (out, err) = text(o);
    assert_eq!(
        o.status.code(),
        Some(code),
        "{what}: exit {:?}, want {code}\nstdout:\n{out}\nstderr:\n{err}",
        o.status.code()
    );
    (out, err)
}

/// Bad input: exit 2 and exactly one line on stderr, containing `needle`.
fn bad_input(args: &[&str], env: &[(&str, &str)], needle: &str) {
    let (_, err) = expect(&det(args, env), 2, &format!("{args:?}"));
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: not one line: {err}");
    assert!(
        lines[0].contains(needle),
        "{args:?}: `{}` lacks `{needle}`",
        lines[0]
    );
}

/// The class key of this machine for `device` (from a record).
fn class_key(device: &str) -> String {
    let (out, _) = expect(
        &det(
            &[
                "record", "--device", device, "--preset", "ci", "--ops", "sq_norm",
            ],
            &[],
        ),
        0,
        "record",
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["class"]["key"].as_str().unwrap().to_string()
}

#[test]
fn committed_goldens_pass_on_cpu_and_emu() {
    let golden = root().join("tests/golden");
    // The emu goldens also with the debug switch off, as the main job runs: no poisoning and
    // recycled uninitialised buffers must not change a bit.
    for (device, preset, debug) in [
        ("cpu", "ci", "1"),
        ("cpu", "full", "1"),
        ("emu", "ci", "1"),
        ("emu", "ci", "0"),
    ] {
        let o = det(
            &[
                "check",
                "--golden",
                golden.to_str().unwrap(),
                "--device",
                device,
                "--preset",
                preset,
            ],
            &[("SLUICE_DEBUG", debug)],
        );
        let (out, _) = expect(&o, 0, &format!("check {device} {preset} debug {debug}"));
        let key = class_key(device);
        if golden.join(&key).join(format!("{preset}.json")).exists() {
            assert!(out.contains("ok: "), "{device} {preset}: {out}");
        } else {
            assert!(out.contains("no golden for numerics class"), "{out}");
        }
        println!("{out}");
    }
}

#[test]
fn run_catches_and_names_the_planted_nondeterministic_op() {
    let (out, _) = expect(
        &det(
            &[
                "run",
                "--device",
                "cpu",
                "--preset",
                "ci",
                "--ops",
                "gemm,sq_norm",
                "--runs",
                "3",
            ],
            &[],
        ),
        0,
        "run without plant",
    );
    assert!(out.contains("identical: 4 tensors of 2 workloads"), "{out}");
    let dump = scratch("dump");
    let o = det(
        &[
            "run",
            "--device",
            "cpu",
            "--preset",
            "ci",
            "--ops",
            "sq_norm,planted_hash_sum",
            "--runs",
            "3",
            "--dump",
            dump.to_str().unwrap(),
        ],
        &[("SLUICE_PLANT", "nondeterministic")],
    );
    let (out, err) = expect(&o, 1, "run with the nondeterministic op");
    assert!(
        out.contains("DIFFERS planted_hash_sum [f32 64 sums of 4096] sums [64] F32: run 2 has other bits than run 1"),
        "{out}"
    );
    assert!(out.contains("first difference at ["), "{out}");
    assert!(!out.contains("DIFFERS sq_norm"), "{out}");
    assert!(err.contains("not deterministic: planted_hash_sum"), "{err}");
    assert!(dump.join("run-1.safetensors").exists());
    std::fs::remove_dir_all(&dump).ok();
}

#[test]
fn check_fails_on_a_changed_summation_order_and_bless_records_it() {
    let dir = scratch("golden");
    let g = dir.to_str().unwrap();
    let ops = "gemm,softmax,topk";
    let check = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["check", "--golden", g, "--device", "cpu", "--preset", "ci"];
        args.extend_from_slice(extra);
        det(&args, env)
    };
    // No golden for the class yet: run-to-run identity only.
    let (out, _) = expect(&check(&["--ops", ops], &[]), 0, "no golden");
    assert!(out.contains("no golden for numerics class"), "{out}");
    let (out, _) = expect(
        &check(&["--ops", ops, "--bless", "--reason", "first golden"], &[]),
        0,
        "bless",
    );
    assert!(out.contains("blessed: wrote"), "{out}");
    let (out, _) = expect(&check(&["--ops", ops], &[]), 0, "check");
    assert!(out.contains("ok: 11 tensors match"), "{out}");
    // softmax's row sums taken in another order: new bits, named, with the bless command.
    let plant = [("SLUICE_PLANT", "softmax_order")];
    let (out, err) = expect(&check(&["--ops", ops], &plant), 1, "changed order");
    assert!(
        out.contains("DIFFERS softmax [f32 [24,100]] y [24, 100] F32"),
        "{out}"
    );
    assert!(
        !out.contains("DIFFERS gemm") && !out.contains("DIFFERS topk"),
        "{out}"
    );
    assert!(err.contains("the bits of softmax changed"), "{err}");
    assert!(
        err.contains("--ops gemm,softmax,topk --bless --reason \"why the bits changed\""),
        "{err}"
    );
    // An op of the run that the golden lacks fails too.
    let (_, err) = expect(&check(&["--ops", "gemm,sq_norm"], &[]), 1, "new op");
    assert!(err.contains("sq_norm not in the golden"), "{err}");
    // Blessing the new order records the reason and the op that changed.
    let (out, _) = expect(
        &check(
            &[
                "--ops",
                ops,
                "--bless",
                "--reason",
                "softmax sums its rows backwards",
            ],
            &plant,
        ),
        0,
        "bless the change",
    );
    assert!(out.contains("changed: softmax;"), "{out}");
    let golden_file = std::fs::read_dir(&dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
        .join("ci.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&golden_file).unwrap()).unwrap();
    let history = v["history"].as_array().unwrap();
    assert_eq!(history.len(), 2);
    assert_eq!(history[1]["reason"], "softmax sums its rows backwards");
    assert_eq!(history[1]["changed"], serde_json::json!(["softmax"]));
    expect(&check(&["--ops", ops], &plant), 0, "check after bless");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_input_is_exit_2_with_one_line() {
    let dir = scratch("bad");
    let cpu = ["--device", "cpu", "--preset", "ci"];
    bad_input(&["run", "--ops", "gemm,nope"], &[], "unknown op `nope`");
    bad_input(&["run", "--preset", "huge"], &[], "--preset \"huge\"");
    bad_input(&["run", "--device", "tpu"], &[], "unknown device `tpu`");
    bad_input(&["run", "--runs", "1"], &[], "at least 2 runs");
    bad_input(&["probe", "--probes", "nope"], &[], "unknown probe `nope`");
    bad_input(
        &["check", "--golden", dir.to_str().unwrap(), "--bless"],
        &[],
        "--bless needs --reason",
    );
    bad_input(
        &["run", "--ops", "gemm"],
        &[("SLUICE_PLANT", "nope")],
        "no planted fault",
    );
    // A golden of another format version.
    let key = class_key("cpu");
    std::fs::create_dir_all(dir.join(&key)).unwrap();
    std::fs::write(
        dir.join(&key).join("ci.json"),
        r#"{"format": "sluice-determinism", "kind": "golden", "version": 2, "digest_version": 1}"#,
    )
    .unwrap();
    let mut args = vec![
        "check",
        "--golden",
        dir.to_str().unwrap(),
        "--ops",
        "sq_norm",
    ];
    args.extend_from_slice(&cpu);
    bad_input(&args, &[], "format version 2; this sluice reads version 1");
    // Truncated JSON, a missing file, a golden where a record is expected.
    let rec = dir.join("a.json");
    let (_, _) = expect(
        &det(
            &[
                "run",
                "--ops",
                "sq_norm",
                "--json",
                rec.to_str().unwrap(),
                "--device",
                "cpu",
                "--preset",
                "ci",
            ],
            &[],
        ),
        0,
        "record for diff",
    );
    let full = std::fs::read_to_string(&rec).unwrap();
    let cut = dir.join("cut.json");
    std::fs::write(&cut, &full[..full.len() / 2]).unwrap();
    bad_input(
        &["diff", rec.to_str().unwrap(), cut.to_str().unwrap()],
        &[],
        "the file is truncated",
    );
    bad_input(
        &[
            "diff",
            rec.to_str().unwrap(),
            dir.join("missing.json").to_str().unwrap(),
        ],
        &[],
        "cannot read it",
    );
    let golden = dir.join(&key).join("ci.json");
    std::fs::write(
        &golden,
        full.replace("\"kind\": \"record\"", "\"kind\": \"golden\""),
    )
    .unwrap();
    bad_input(
        &["diff", rec.to_str().unwrap(), golden.to_str().unwrap()],
        &[],
        "a golden file, where a record file is expected",
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn diff_names_what_differs() {
    let dir = scratch("diff");
    let (a, b) = (dir.join("a.json"), dir.join("b.json"));
    for (path, threads) in [(&a, "1"), (&b, "2")] {
        expect(
            &det(
                &[
                    "run",
                    "--device",
                    "cpu",
                    "--preset",
                    "ci",
                    "--ops",
                    "gemm,sq_norm",
                    "--json",
                    path.to_str().unwrap(),
                ],
                &[("RAYON_NUM_THREADS", threads)],
            ),
            0,
            "run --json",
        );
    }
    let (out, _) = expect(
        &det(&["diff", a.to_str().unwrap(), b.to_str().unwrap()], &[]),
        0,
        "diff of equal digests",
    );
    assert!(out.contains("threads: 1 vs 2"), "{out}");
    assert!(
        out.contains("digests agree: 4 tensors of 2 workloads"),
        "{out}"
    );
    // Another digest for sq_norm in B.
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&b).unwrap()).unwrap();
    for e in v["entries"].as_array_mut().unwrap() {
        if e["op"] == "sq_norm" {
            e["digest"] = serde_json::json!("0".repeat(64));
        }
    }
    std::fs::write(&b, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let (out, err) = expect(
        &det(&["diff", a.to_str().unwrap(), b.to_str().unwrap()], &[]),
        1,
        "diff of other digests",
    );
    assert!(
        out.contains("  sq_norm [f32 N=20000] sq_norm [1] F32"),
        "{out}"
    );
    assert!(
        err.contains("1 of 4 tensors differ") && err.contains("ops: sq_norm"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Runs the probes `probes` on `device`; returns (stdout, stderr), asserting exit `code`.
fn probe(
    device: &str,
    probes: &str,
    ops: &str,
    plant: Option<&str>,
    code: i32,
) -> (String, String) {
    let env: Vec<(&str, &str)> = plant.map(|p| ("SLUICE_PLANT", p)).into_iter().collect();
    let mut args = vec!["probe", "--device", device, "--probes", probes];
    if !ops.is_empty() {
        args.extend_from_slice(&["--ops", ops]);
    }
    expect(
        &det(&args, &env),
        code,
        &format!("probe {probes} on {device} plant {plant:?}"),
    )
}

#[test]
fn every_probe_passes_on_cpu() {
    let (out, _) = probe(
        "cpu",
        "batch_invariance,chunked_prefill,decode_equals_training,prefix_shared,preempted_recompute,thread_count,schedule_seed",
        "gemm,sq_norm,moe_forward,train_step,engine",
        None,
        0,
    );
    assert_eq!(out.matches("\nPASS ").count(), 6, "{out}");
    assert!(out.contains("SKIP schedule_seed"), "{out}");
}

#[test]
fn the_cheaper_probes_pass_on_emu() {
    let (out, _) = probe(
        "emu",
        "chunked_prefill,decode_equals_training,thread_count,schedule_seed",
        "gemm,sq_norm,attention_backward",
        None,
        0,
    );
    assert_eq!(out.matches("\nPASS ").count(), 4, "{out}");
}

/// Each probe fails, with its counterexample, under a planted break of what it guards.
#[test]
fn every_probe_fails_on_its_broken_variant() {
    let cases: [(&str, &str, &str, &str, &[&str]); 7] = [
        (
            "cpu",
            "batch_invariance",
            "gemm_batch_variant",
            "",
            &[
                "gemm F32",
                "of a 129-row batch differs from the 1-row batch at",
            ],
        ),
        (
            "cpu",
            "chunked_prefill",
            "prefill_continuation_scale",
            "",
            &["one-shot", "chunked"],
        ),
        (
            "cpu",
            "decode_equals_training",
            "decode_scale",
            "",
            &["after layer 0 of 2", "training", "decode"],
        ),
        (
            "cpu",
            "prefix_shared",
            "sample_row_key",
            "",
            &["shared vs fresh"],
        ),
        (
            "cpu",
            "preempted_recompute",
            "decode_scale",
            "",
            &["preempted vs fresh"],
        ),
        (
            "cpu",
            "thread_count",
            "sq_norm_threads",
            "sq_norm,gemm",
            &["2 threads vs 1 thread: sq_norm [f32 N=20000] sq_norm [1] F32 has other bits"],
        ),
        (
            "emu",
            "schedule_seed",
            "racy_kernel",
            "planted_racy_sum",
            &["planted_racy_sum [f32 8 block sums of 4096] sums [8] F32 has other bits"],
        ),
    ];
    for (device, name, plant, ops, needles) in cases {
        let (out, err) = probe(device, name, ops, Some(plant), 1);
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("FAIL {name} ")))
            .unwrap_or_else(|| panic!("{name} with {plant}: no FAIL line:\n{out}"));
        for n in needles {
            assert!(
                line.contains(n),
                "{name} with {plant}: `{line}` lacks `{n}`"
            );
        }
        assert!(err.contains(&format!("probes failed: {name}")), "{err}");
    }
}
