//! `sluice delta diff | apply | inspect`: diff then apply reproduces NEW byte for byte (sluice
//! checkpoints with different metadata, and files of mixed dtypes); tensor tables that differ,
//! a corrupt or misdirected delta, a missing or non-safetensors file are bad input (exit code
//! 2 in `sluice`) with a message naming the problem, and leave no output file.

use clap::Parser;
use half::bf16;
use sluice_kernels::io::write_safetensors;
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, Error, Tensor};
use sluice_model::checkpoint;
use sluice_model::{Model, ModelConfig};
use sluice_trainer::delta_cmd::{run, DeltaCommand};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The `delta` part of the `sluice` command line, parsed as `sluice delta ...` is.
#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: DeltaCommand,
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-delta-cmd-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `sluice delta ARGS...`; returns its report or error.
fn delta(args: &[&str]) -> Result<String, Error> {
    let cli = Cli::try_parse_from(std::iter::once("delta").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    let mut out = Vec::new();
    run(&cli.command, &mut out).map(|()| String::from_utf8(out).unwrap())
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// `args` must fail as bad input with a message containing each of `needles`, and leave no
/// file at `out`.
fn assert_bad_input(args: &[&str], needles: &[&str], out: &Path) {
    let err = delta(args).expect_err("must fail");
    assert!(
        err.is_bad_input(),
        "{args:?}: not bad input (exit 2): {err}"
    );
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "{args:?}: `{msg}` does not mention `{n}`");
    }
    assert!(!out.exists(), "{args:?}: {out:?} was written");
    assert!(
        !checkpoint::temp_path(out).exists(),
        "{args:?}: a temp file was left"
    );
}

/// A sluice checkpoint (BASE) and the same model after an update of a few views, saved with
/// other metadata (NEW).
fn checkpoint_pair(dir: &Path) -> (PathBuf, PathBuf) {
    let mut cfg = ModelConfig::small();
    cfg.n_layers = 1;
    cfg.d_model = 32;
    cfg.head_dim = 8;
    let mut m = Model::new(cfg, &Backend::Cpu).unwrap();
    let base = dir.join("base.safetensors");
    checkpoint::save_with_meta(&base, &m.config, &m.params, &[], &[("step", "1".into())]).unwrap();
    let mut rng = Rng::new(3);
    for name in ["embed.weight", "layers.0.attn.wq", "layers.0.moe.w1"] {
        for v in m.params.view_mut(name).unwrap() {
            *v *= 1.0 + 1e-3 * rng.normal() as f32;
        }
    }
    let new = dir.join("new.safetensors");
    checkpoint::save_with_meta(&new, &m.config, &m.params, &[], &[("step", "1000".into())])
        .unwrap();
    (base, new)
}

#[test]
fn diff_then_apply_reproduces_new_byte_for_byte() {
    let dir = scratch("roundtrip");
    let (base, new) = checkpoint_pair(&dir);
    let d = dir.join("d.sldelta");
    let out = dir.join("new2.safetensors");
    for chunk in ["64", "4096", "262144"] {
        let report = delta(&[
            "diff",
            p(&base),
            p(&new),
            "--out",
            p(&d),
            "--chunk-size",
            chunk,
        ])
        .unwrap();
        assert!(report.contains("wrote"), "{report}");
        let report = delta(&["apply", p(&base), p(&d), "--out", p(&out)]).unwrap();
        assert!(report.contains("(verified)"), "{report}");
        assert!(
            std::fs::read(&out).unwrap() == std::fs::read(&new).unwrap(),
            "chunk {chunk}: NEW2 differs from NEW"
        );
        std::fs::remove_file(&out).unwrap();
        // Only three of the views changed: the delta is well under the file's size.
        let (dl, nl) = (
            std::fs::metadata(&d).unwrap().len(),
            std::fs::metadata(&new).unwrap().len(),
        );
        assert!(dl < nl / 2, "chunk {chunk}: delta {dl} bytes for {nl}");
    }

    // inspect: one line per chunk, the encodings, and the total against the full size.
    delta(&[
        "diff",
        p(&base),
        p(&new),
        "--out",
        p(&d),
        "--chunk-size",
        "4096",
    ])
    .unwrap();
    let report = delta(&["inspect", p(&d)]).unwrap();
    let data_len = std::fs::metadata(&new).unwrap().len() as usize;
    let chunk_lines = report
        .lines()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() == 5 && f[0].parse::<usize>().is_ok() && f[1].parse::<usize>().is_ok()
        })
        .count();
    // The data section is the file less its header; 4096-byte chunks.
    assert!(chunk_lines >= (data_len - 20_000) / 4096, "{report}");
    assert!(chunk_lines <= data_len.div_ceil(4096), "{report}");
    for needle in ["same", "zstd_xor", "total:", "% of NEW's", "as f32"] {
        assert!(report.contains(needle), "`{needle}` missing:\n{report}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn mixed_dtype_files_round_trip() {
    let dir = scratch("mixed");
    let mut rng = Rng::new(8);
    let write = |path: &Path, scale: f32, rng: &mut Rng| {
        let w: Vec<bf16> = (0..1000)
            .map(|i| bf16::from_f32((i as f32 * 0.37).sin() * scale))
            .collect();
        let ids: Vec<i32> = (0..17).map(|i| i * 3).collect();
        let b: Vec<f32> = (0..127).map(|_| rng.normal() as f32).collect();
        let tensors = [
            (
                "w",
                Tensor::from_slice(&Backend::Cpu, &[40, 25], &w).unwrap(),
            ),
            (
                "ids",
                Tensor::from_slice(&Backend::Cpu, &[17], &ids).unwrap(),
            ),
            ("b", Tensor::from_slice(&Backend::Cpu, &[127], &b).unwrap()),
        ];
        let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
        write_safetensors(path, &named, &BTreeMap::new()).unwrap();
    };
    let (base, new) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    write(&base, 1.0, &mut rng);
    write(&new, 1.01, &mut rng);
    let d = dir.join("d");
    let out = dir.join("c.safetensors");
    delta(&[
        "diff",
        p(&base),
        p(&new),
        "--out",
        p(&d),
        "--chunk-size",
        "128",
    ])
    .unwrap();
    delta(&["apply", p(&base), p(&d), "--out", p(&out)]).unwrap();
    assert!(std::fs::read(&out).unwrap() == std::fs::read(&new).unwrap());
    let report = delta(&["inspect", p(&d)]).unwrap();
    assert!(
        report.contains("as u8"),
        "mixed dtypes use no shuffle:\n{report}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn differing_tensor_tables_are_refused_naming_the_first_difference() {
    let dir = scratch("tables");
    let write = |name: &str, tensors: &[(&str, Vec<usize>, bool)]| {
        let path = dir.join(name);
        let owned: Vec<(String, Tensor)> = tensors
            .iter()
            .map(|(n, shape, is_bf16)| {
                let numel: usize = shape.iter().product();
                let t = if *is_bf16 {
                    let v: Vec<bf16> = (0..numel).map(|i| bf16::from_f32(i as f32)).collect();
                    Tensor::from_slice(&Backend::Cpu, shape, &v).unwrap()
                } else {
                    let v: Vec<f32> = (0..numel).map(|i| i as f32 + 0.5).collect();
                    Tensor::from_slice(&Backend::Cpu, shape, &v).unwrap()
                };
                (n.to_string(), t)
            })
            .collect();
        let named: Vec<(&str, &Tensor)> = owned.iter().map(|(n, t)| (n.as_str(), t)).collect();
        write_safetensors(&path, &named, &BTreeMap::new()).unwrap();
        path
    };
    let base = write("base", &[("a", vec![4, 6], false), ("b", vec![5], false)]);
    let out = dir.join("d");
    let cases = [
        (
            write("shape", &[("a", vec![6, 4], false), ("b", vec![5], false)]),
            vec!["`a`", "[4, 6]", "[6, 4]"],
        ),
        (
            write("dtype", &[("a", vec![4, 6], false), ("b", vec![5], true)]),
            vec!["`b`", "F32", "BF16"],
        ),
        (
            write("name", &[("a", vec![4, 6], false), ("c", vec![5], false)]),
            vec!["`b`", "`c`"],
        ),
        (
            write(
                "extra",
                &[
                    ("a", vec![4, 6], false),
                    ("b", vec![5], false),
                    ("z", vec![1], false),
                ],
            ),
            vec!["`z` is only in NEW"],
        ),
    ];
    for (new, needles) in &cases {
        let mut all = vec!["identical tensor tables"];
        all.extend(needles.iter().copied());
        assert_bad_input(&["diff", p(&base), p(new), "--out", p(&out)], &all, &out);
    }
    // apply refuses a BASE whose table is not the delta's.
    let same_table = write("same", &[("a", vec![4, 6], false), ("b", vec![5], false)]);
    delta(&["diff", p(&base), p(&same_table), "--out", p(&out)]).unwrap();
    let new2 = dir.join("new2");
    assert_bad_input(
        &["apply", p(&cases[0].0), p(&out), "--out", p(&new2)],
        &["does not have the delta's tensor table", "`a`"],
        &new2,
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn corrupt_or_misdirected_deltas_and_missing_files_write_nothing() {
    let dir = scratch("corrupt");
    let (base, new) = checkpoint_pair(&dir);
    let d = dir.join("d.sldelta");
    delta(&[
        "diff",
        p(&base),
        p(&new),
        "--out",
        p(&d),
        "--chunk-size",
        "1024",
    ])
    .unwrap();
    let good = std::fs::read(&d).unwrap();
    let out = dir.join("out.safetensors");
    let bad = dir.join("bad.sldelta");
    let apply_bad = |bytes: &[u8], needles: &[&str]| {
        std::fs::write(&bad, bytes).unwrap();
        assert_bad_input(
            &["apply", p(&base), p(&bad), "--out", p(&out)],
            needles,
            &out,
        );
    };
    // One flipped byte in each part: the file prefix's NEW hash, NEW's header, the codec's
    // header, a payload, the checksum; and a random sample of others.
    let header_len = u64::from_le_bytes(good[16..24].try_into().unwrap()) as usize;
    let mut rng = Rng::new(1);
    let mut flips = vec![
        12,
        18,
        30,
        60,
        88 + 40,
        88 + header_len + 20,
        good.len() - 100,
        good.len() - 1,
    ];
    flips.extend((0..12).map(|_| 8 + rng.below(good.len() - 8)));
    for at in flips {
        let mut b = good.clone();
        b[at] ^= 0x20;
        apply_bad(&b, &["bad.sldelta"]);
    }
    // Truncations.
    for keep in [
        good.len() - 1,
        good.len() / 2,
        88 + header_len + 3,
        88 + 9,
        40,
        0,
    ] {
        apply_bad(&good[..keep], &["bad.sldelta"]);
    }
    // Not a delta at all.
    apply_bad(b"hello, not a delta", &["not a sluice delta file"]);
    // A delta made from another BASE (same tensor table, other values): NEW is BASE's
    // neighbour, so apply it to NEW instead of BASE.
    assert_bad_input(
        &["apply", p(&new), p(&d), "--out", p(&out)],
        &["not the file this delta was made from"],
        &out,
    );
    // An existing --out is left as it was by a failed apply.
    std::fs::write(&out, b"previous").unwrap();
    std::fs::write(&bad, &good[..good.len() - 5]).unwrap();
    let err = delta(&["apply", p(&base), p(&bad), "--out", p(&out)]).unwrap_err();
    assert!(err.is_bad_input(), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), b"previous");
    std::fs::remove_file(&out).unwrap();

    // Missing and non-safetensors files, for every subcommand.
    let missing = dir.join("missing.safetensors");
    let junk = dir.join("junk.safetensors");
    std::fs::write(&junk, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}").unwrap();
    assert_bad_input(
        &["diff", p(&missing), p(&new), "--out", p(&out)],
        &["BASE", "missing.safetensors", "cannot read"],
        &out,
    );
    assert_bad_input(
        &["diff", p(&base), p(&missing), "--out", p(&out)],
        &["NEW", "missing.safetensors"],
        &out,
    );
    assert_bad_input(
        &["diff", p(&base), p(&junk), "--out", p(&out)],
        &["NEW", "junk.safetensors", "not a valid safetensors file"],
        &out,
    );
    assert_bad_input(
        &["apply", p(&missing), p(&d), "--out", p(&out)],
        &["BASE", "missing.safetensors"],
        &out,
    );
    assert_bad_input(
        &["apply", p(&base), p(&missing), "--out", p(&out)],
        &["delta", "missing.safetensors"],
        &out,
    );
    let err = delta(&["inspect", p(&missing)]).unwrap_err();
    assert!(
        err.is_bad_input() && err.to_string().contains("missing.safetensors"),
        "{err}"
    );
    let err = delta(&["inspect", p(&junk)]).unwrap_err();
    assert!(
        err.is_bad_input() && err.to_string().contains("not a sluice delta"),
        "{err}"
    );
    // Bad options are bad input too.
    assert_bad_input(
        &[
            "diff",
            p(&base),
            p(&new),
            "--out",
            p(&out),
            "--chunk-size",
            "100",
        ],
        &["chunk size 100"],
        &out,
    );
    std::fs::remove_dir_all(&dir).ok();
}
