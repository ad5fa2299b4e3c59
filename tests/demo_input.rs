//! The README's kernel-runner demo input (configs/demo/gemm_in.safetensors, written by
//! scripts/make-demo-inputs.py) is a valid safetensors file holding what the demo says it holds.

use sluice_kernels::io::read_safetensors;
use sluice_kernels::{Backend, DType};
use std::path::Path;

#[test]
fn demo_gemm_input_holds_a_and_b() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/demo/gemm_in.safetensors");
    let file = read_safetensors(&path, &Backend::Cpu).expect("the demo input reads back");
    let names: Vec<&str> = file.tensors.keys().map(String::as_str).collect();
    assert_eq!(names, ["a", "b"]);
    for (name, shape) in [("a", [17, 64]), ("b", [33, 64])] {
        let t = &file.tensors[name];
        assert_eq!(t.shape(), shape, "{name}");
        assert_eq!(t.dtype(), DType::F32, "{name}");
        let v = t.to_f32_vec().expect("f32 values");
        // The generator draws uniform values in [-1, 1): finite, in range, not all zero.
        assert!(
            v.iter().all(|x| x.is_finite() && (-1.0..1.0).contains(x)),
            "{name}"
        );
        assert!(v.iter().any(|&x| x != 0.0), "{name}");
    }
}
