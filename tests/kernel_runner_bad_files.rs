//! `sluice kernel` on input files that are not what they claim: truncated at every part of the
//! file, a corrupt header, tensors of dtypes sluice does not hold (F16, F64). Each is an error
//! that says what is wrong (and where), reported as bad input (exit code 2), never a panic; no
//! output file is written.

mod support;

use sluice_kernels::{Backend, DType, Device, Error, Tensor};
use sluice_trainer::kernel_cmd::run_kernel;
use std::path::Path;
use support::{scratch_dir, write_input};

/// A safetensors file from its parts: the 8-byte little-endian header length, the header, the
/// data section.
fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header.as_bytes());
    f.extend_from_slice(data);
    f
}

/// Runs `gemm` on the file `bytes`; it must fail as bad input, write no output, and its message
/// must contain every one of `needles`. Returns the message.
fn run_bad_file(dir: &Path, tag: &str, bytes: &[u8], needles: &[&str]) -> String {
    let input = dir.join(format!("{tag}.safetensors"));
    std::fs::write(&input, bytes).unwrap();
    let output = dir.join(format!("{tag}-out.safetensors"));
    let err = run_kernel("gemm", &input, &output, Device::Cpu)
        .err()
        .unwrap_or_else(|| panic!("{tag}: a bad file must be an error"));
    let msg = err.to_string();
    assert!(
        err.is_bad_input(),
        "{tag}: `{msg}` must be bad input (exit code 2)"
    );
    for n in needles {
        assert!(msg.contains(n), "{tag}: `{msg}` does not say `{n}`");
    }
    assert!(!output.exists(), "{tag}: an output was written");
    println!("{tag}: {msg}");
    msg
}

/// A valid gemm input (a[3,4], b[5,4] f32) as bytes, written by sluice itself.
fn valid_gemm_input(dir: &Path) -> Vec<u8> {
    let cpu = Backend::Cpu;
    let a = Tensor::from_f32_as(&cpu, &[3, 4], DType::F32, &[0.5; 12]).unwrap();
    let b = Tensor::from_f32_as(&cpu, &[5, 4], DType::F32, &[0.25; 20]).unwrap();
    let path = write_input(dir, &[("a", &a), ("b", &b)], &[]);
    let bytes = std::fs::read(&path).unwrap();
    // The file itself runs.
    run_kernel("gemm", &path, &dir.join("ok.safetensors"), Device::Cpu).unwrap();
    bytes
}

#[test]
fn kernel_runner_rejects_truncated_files_saying_where() {
    let dir = scratch_dir("bad-files-truncated");
    let good = valid_gemm_input(&dir);
    let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let data_start = 8 + n;
    assert_eq!(good.len(), data_start + (12 + 20) * 4);

    // Empty, and cut inside the 8-byte header length.
    run_bad_file(&dir, "empty", &[], &["0 bytes long", "truncated"]);
    run_bad_file(&dir, "len-cut", &good[..5], &["5 bytes long", "truncated"]);
    // Cut inside the JSON header.
    let msg = run_bad_file(&dir, "header-cut", &good[..8 + n / 2], &["truncated"]);
    assert!(msg.contains(&format!("{n}-byte JSON header")), "{msg}");
    // Cut inside the data of the last tensor (b: bytes 48..128 of the data section), and by a
    // single byte.
    for (tag, keep) in [("data-cut", data_start + 60), ("last-byte", good.len() - 1)] {
        let msg = run_bad_file(&dir, tag, &good[..keep], &["tensor `b`", "truncated"]);
        let have = keep - data_start;
        assert!(msg.contains(&format!("only {have} bytes")), "{tag}: {msg}");
    }
    // Cut inside the first tensor: the message names it.
    run_bad_file(
        &dir,
        "first-cut",
        &good[..data_start + 10],
        &["tensor `a`", "truncated"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kernel_runner_rejects_corrupt_headers() {
    let dir = scratch_dir("bad-files-header");
    let data = vec![0u8; (12 + 20) * 4];
    let good_header = r#"{"a":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},"b":{"dtype":"F32","shape":[5,4],"data_offsets":[48,128]}}"#;
    // The same header is accepted (and with an odd length, so the data starts unaligned).
    let ok = dir.join("ok-in.safetensors");
    std::fs::write(&ok, raw_file(&format!("{good_header} "), &data)).unwrap();
    run_kernel("gemm", &ok, &dir.join("ok-out.safetensors"), Device::Cpu).unwrap();

    // A header length far beyond the file.
    let mut huge = raw_file(good_header, &data);
    huge[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    run_bad_file(
        &dir,
        "huge-len",
        &huge,
        &["1099511627776-byte JSON header", "only"],
    );
    // Not JSON (garbage bytes, and invalid UTF-8).
    run_bad_file(
        &dir,
        "garbage",
        &raw_file("{\"a\": [1, 2", &data),
        &["not valid JSON", "corrupt"],
    );
    let mut bad_utf8 = raw_file("{\"a\":\"xx\"}", &data);
    bad_utf8[14] = 0xff; // the first x of the string
    assert!(std::str::from_utf8(&bad_utf8[8..18]).is_err());
    run_bad_file(&dir, "utf8", &bad_utf8, &["not valid JSON", "corrupt"]);
    // JSON, but not a safetensors header (an unknown dtype name, a missing field).
    let unknown = good_header.replace(
        r#""dtype":"F32","shape":[3,4]"#,
        r#""dtype":"F99","shape":[3,4]"#,
    );
    run_bad_file(
        &dir,
        "unknown-dtype",
        &raw_file(&unknown, &data),
        &["not a safetensors header", "F99"],
    );
    let missing = good_header.replace(r#""shape":[5,4],"#, "");
    run_bad_file(
        &dir,
        "no-shape",
        &raw_file(&missing, &data),
        &["not a safetensors header", "shape"],
    );
    // Offsets that disagree with the shape (a[3,4] f32 is 48 bytes, given 40) or overlap.
    let short = good_header
        .replace("[0,48]", "[0,40]")
        .replace("[48,128]", "[40,128]");
    run_bad_file(
        &dir,
        "short-extent",
        &raw_file(&short, &data),
        &["disagree", "corrupt"],
    );
    let overlap = good_header.replace("[48,128]", "[40,120]");
    run_bad_file(
        &dir,
        "overlap",
        &raw_file(&overlap, &data[..120]),
        &["disagree", "corrupt"],
    );
    // Bytes after the last tensor.
    let mut long = data.clone();
    long.extend_from_slice(&[1, 2, 3]);
    run_bad_file(
        &dir,
        "trailing",
        &raw_file(good_header, &long),
        &["131 bytes", "cover only 128"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kernel_runner_rejects_f16_and_f64_tensors_naming_them() {
    let dir = scratch_dir("bad-files-dtype");
    for (dtype, size) in [("F16", 2usize), ("F64", 8)] {
        let header = format!(
            r#"{{"a":{{"dtype":"{dtype}","shape":[3,4],"data_offsets":[0,{}]}},"b":{{"dtype":"F32","shape":[5,4],"data_offsets":[{},{}]}}}}"#,
            12 * size,
            12 * size,
            12 * size + 80
        );
        let data = vec![0u8; 12 * size + 80];
        run_bad_file(
            &dir,
            dtype,
            &raw_file(&header, &data),
            &[
                "tensor `a`",
                &format!("dtype {dtype}"),
                "F32, BF16",
                "convert",
            ],
        );
    }
    // The dtype error is the tensor's own kind of error, not a generic one.
    let cpu = Backend::Cpu;
    let path = dir.join("f64.safetensors");
    std::fs::write(
        &path,
        raw_file(
            r#"{"x":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}}"#,
            &[0u8; 16],
        ),
    )
    .unwrap();
    match sluice_kernels::io::read_safetensors(&path, &cpu) {
        Err(Error::DType { tensor, got, .. }) => {
            assert_eq!((tensor.as_str(), got.as_str()), ("x", "F64"))
        }
        Err(e) => panic!("expected a dtype error naming `x`, got {e}"),
        Ok(_) => panic!("an F64 tensor must be refused"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}
