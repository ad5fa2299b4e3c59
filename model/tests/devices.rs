//! The arena (views as tensors included) and checkpoints on the other devices: emu (host memory
//! from the emulator's allocator) and cuda (device memory; skipped with a printed line where no
//! GPU exists). The cpu device has its own tests in arena.rs and checkpoint.rs; the views as
//! tensors run there too (below).

use sluice_model::config::ModelConfig;
use sluice_model::kernels::device::cuda_for_tests;
use sluice_model::kernels::{Backend, DType, Tensor};
use sluice_model::{init, Model};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn dir(tag: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("sluice-model-dev-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&p).unwrap();
    p
}

/// Init, views, zeroing, bf16 copy and a checkpoint round trip across devices on `backend`.
fn exercise(backend: &Backend, tag: &str) {
    let cfg = ModelConfig::tiny();
    let mut m = Model::new(cfg.clone(), backend).unwrap();
    let want = init::initial_values(m.layout(), cfg.seed, cfg.init_std);
    assert_eq!(
        bits(&m.params.to_vec().unwrap()),
        bits(&want),
        "{tag}: init"
    );
    assert_eq!(
        bits(&m.params.view_to_vec("layers.1.moe.w3").unwrap()),
        bits(&want[m.layout().view("layers.1.moe.w3").unwrap().range()])
    );
    assert!(m.grads.to_vec().unwrap().iter().all(|&x| x == 0.0));
    views_as_tensors(backend, &mut m, &want, tag);
    let half = m.params.cast_copy(backend, DType::BF16).unwrap();
    assert_eq!(half.dtype(), DType::BF16);
    assert_eq!(half.to_vec().unwrap().len(), m.layout().len());

    // Save from this device, load on cpu, and back.
    let d = dir(tag);
    let p = d.join("m.safetensors");
    m.save(&p).unwrap();
    let cpu = Model::from_checkpoint(&p, &Backend::Cpu).unwrap();
    assert_eq!(bits(cpu.params.as_slice().unwrap()), bits(&want));
    let mut other = cfg.clone();
    other.seed = 77;
    let mut n = Model::new(other, backend).unwrap();
    n.load(&p, backend).unwrap();
    assert_eq!(bits(&n.params.to_vec().unwrap()), bits(&want));
    // A failed load leaves the device arena as it was.
    std::fs::write(&p, b"garbage").unwrap();
    assert!(m.load(&p, backend).is_err());
    assert_eq!(bits(&m.params.to_vec().unwrap()), bits(&want));
    m.grads.fill_zero(backend).unwrap();
    std::fs::remove_dir_all(&d).ok();
}

/// Arena::view_tensor copies a view out with its shape; Arena::write_view copies a tensor into a
/// view and leaves the rest (padding included) alone; bad input is an error naming the view.
fn views_as_tensors(backend: &Backend, m: &mut Model, want: &[f32], tag: &str) {
    let layout = m.layout().clone();
    let i = layout.index_of("layers.1.moe.w3").unwrap();
    let spec = &layout.views()[i];
    let t = m.params.view_tensor(backend, i).unwrap();
    assert_eq!(t.shape(), spec.shape.as_slice(), "{tag}");
    assert!(t.is_on(backend.device()));
    assert_eq!(bits(&t.to_vec::<f32>().unwrap()), bits(&want[spec.range()]));
    // Write it into the (zero) gradient arena, reshaped: only that view changes.
    let flat = t.reshape(&[spec.numel()]).unwrap();
    m.grads.write_view(i, &flat).unwrap();
    let g = m.grads.to_vec().unwrap();
    for (j, &x) in g.iter().enumerate() {
        let expect = if spec.range().contains(&j) {
            want[j]
        } else {
            0.0
        };
        assert_eq!(x.to_bits(), expect.to_bits(), "{tag}: element {j}");
    }
    let short = Tensor::zeros(backend, &[spec.numel() - 1], DType::F32).unwrap();
    let err = m.grads.write_view(i, &short).unwrap_err().to_string();
    assert!(err.contains("layers.1.moe.w3"), "{err}");
    let wrong = Tensor::zeros(backend, &spec.shape, DType::BF16).unwrap();
    let err = m.grads.write_view(i, &wrong).unwrap_err().to_string();
    assert!(
        err.contains("layers.1.moe.w3") && err.contains("BF16"),
        "{err}"
    );
    assert!(m.params.view_tensor(backend, layout.views().len()).is_err());
    m.grads.fill_zero(backend).unwrap();
}

#[test]
fn arena_and_checkpoints_on_emu() {
    let emu = Backend::emu_with_seed(1);
    exercise(&emu, "emu");
    // emu storage is host memory: views are slices.
    let m = Model::new(ModelConfig::tiny(), &emu).unwrap();
    assert_eq!(m.params.view("final_norm.scale").unwrap(), &[1.0; 8]);
}

#[test]
fn arena_and_checkpoints_on_cuda() {
    if let Some(gpu) = cuda_for_tests("arena_and_checkpoints_on_cuda") {
        exercise(&gpu, "cuda");
        // Device memory has no host slices: an error, never a panic.
        let m = Model::new(ModelConfig::tiny(), &gpu).unwrap();
        assert!(m.params.view("final_norm.scale").is_err());
    }
}

#[test]
fn views_as_tensors_on_cpu() {
    let cfg = ModelConfig::tiny();
    let mut m = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    let want = init::initial_values(m.layout(), cfg.seed, cfg.init_std);
    views_as_tensors(&Backend::Cpu, &mut m, &want, "cpu");
}
