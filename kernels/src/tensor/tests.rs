//! The tensor's own tests: ranges, adopted vectors, large host copies, host fast paths.

use super::*;

fn ranges_on(backend: &Backend) {
    let data: Vec<f32> = (0..60).map(|i| i as f32 * 0.5 - 7.0).collect();
    let mut t = Tensor::from_slice(backend, &[6, 10], &data).unwrap();
    // A ragged window across rows, with its own shape.
    let w = t.copy_range(backend, 13, &[3, 7]).unwrap();
    assert_eq!(w.shape(), &[3, 7]);
    assert!(w.is_on(backend.device()));
    assert_eq!(w.to_vec::<f32>().unwrap(), data[13..34].to_vec());
    // Empty and whole ranges.
    assert_eq!(t.copy_range(backend, 60, &[0]).unwrap().numel(), 0);
    assert_eq!(
        t.copy_range(backend, 0, &[60])
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        data
    );
    // Write a window back elsewhere; the rest stays.
    let src = Tensor::from_slice(backend, &[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    t.write_range(56, &src).unwrap();
    let mut want = data.clone();
    want[56..60].copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
    assert_eq!(t.to_vec::<f32>().unwrap(), want);
    t.write_range(3, &Tensor::zeros(backend, &[0], DType::F32).unwrap())
        .unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), want);
    // bf16 keeps its bits.
    let h: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
    let hb = Tensor::from_slice(backend, &[60], &h).unwrap();
    let hw = hb.copy_range(backend, 1, &[5]).unwrap();
    assert_eq!(hw.dtype(), DType::BF16);
    assert_eq!(hw.to_vec::<bf16>().unwrap(), h[1..6].to_vec());

    // Bad input: errors that name the problem, never a panic.
    let err = t.copy_range(backend, 55, &[2, 3]).unwrap_err().to_string();
    assert!(err.contains("55..55+6") && err.contains("[6, 10]"), "{err}");
    let err = t
        .copy_range(backend, usize::MAX, &[2])
        .unwrap_err()
        .to_string();
    assert!(err.contains("out of bounds"), "{err}");
    let err = t.write_range(59, &src).unwrap_err().to_string();
    assert!(err.contains("59..59+4"), "{err}");
    let err = t.write_range(0, &hw).unwrap_err();
    assert!(
        matches!(&err, Error::DType { tensor, .. } if tensor == "src"),
        "{err}"
    );
}

#[test]
fn ranges_on_cpu() {
    ranges_on(&Backend::Cpu);
}

#[test]
fn ranges_on_emu() {
    ranges_on(&Backend::emu_with_seed(1));
}

#[test]
fn ranges_on_cuda() {
    if let Some(gpu) = crate::device::cuda_for_tests("tensor ranges") {
        ranges_on(&gpu);
    }
}

#[test]
fn ranges_across_devices_are_errors() {
    let emu = Backend::emu_with_seed(1);
    let mut cpu_t = Tensor::from_slice(&Backend::Cpu, &[4], &[1.0f32; 4]).unwrap();
    let emu_t = Tensor::from_slice(&emu, &[4], &[2.0f32; 4]).unwrap();
    let err = cpu_t.copy_range(&emu, 0, &[2]).unwrap_err().to_string();
    assert!(err.contains("lives on cpu, not on emu"), "{err}");
    let err = cpu_t.write_range(0, &emu_t).unwrap_err().to_string();
    assert!(err.contains("`src` lives on emu"), "{err}");
}

#[test]
fn adopted_f32_vectors_behave_like_any_tensor() {
    let v: Vec<f32> = (0..12).map(|i| i as f32 * 1.5).collect();
    for backend in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let mut t = Tensor::from_f32_vec(&backend, &[3, 4], v.clone()).unwrap();
        assert!(t.is_on(backend.device()));
        assert_eq!(t.to_vec::<f32>().unwrap(), v);
        assert_eq!(&*t.f32_data().unwrap(), v.as_slice());
        assert!(t.host_slice::<bf16>().is_err());
        t.host_slice_mut::<f32>().unwrap()[5] = -1.0;
        let w = t.copy_range(&backend, 4, &[2]).unwrap();
        assert_eq!(w.to_vec::<f32>().unwrap(), vec![6.0, -1.0]);
        t.write_range(0, &w).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap()[..2], [6.0, -1.0]);
        let r = t.reshape(&[12]).unwrap();
        assert_eq!(r.to_bytes().unwrap().len(), 48);
        assert!(Tensor::from_f32_vec(&backend, &[5], vec![0.0; 4]).is_err());
    }
    let b16 = Tensor::from_f32_as(&Backend::Cpu, &[2], DType::BF16, &[1.5, -2.0]).unwrap();
    assert_eq!(&*b16.f32_data().unwrap(), &[1.5, -2.0]);
}

#[test]
fn large_host_copies_split_over_threads_keep_every_byte() {
    // Above PAR_BYTES, with a ragged tail (not a multiple of the 256 KiB chunk or of 8).
    let n = (3 << 20) + 5;
    let bytes: Vec<u8> = (0..n).map(|i| (i * 7 + i / 4096) as u8).collect();
    for backend in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let mut t = Tensor::from_bytes(&backend, &[n], DType::U8, &bytes).unwrap();
        assert_eq!(t.to_bytes().unwrap(), bytes);
        assert_eq!(t.to_vec::<u8>().unwrap(), bytes);
        let w = t.copy_range(&backend, 3, &[n - 4]).unwrap();
        assert_eq!(w.to_vec::<u8>().unwrap(), bytes[3..n - 1].to_vec());
        t.write_range(1, &w).unwrap();
        let mut want = bytes.clone();
        want[1..n - 3].copy_from_slice(&bytes[3..n - 1]);
        assert_eq!(t.to_vec::<u8>().unwrap(), want);
        let p = Tensor::poisoned(&backend, &[n], DType::U8).unwrap();
        assert!(p.to_vec::<u8>().unwrap().iter().all(|&b| b == POISON_BYTE));
    }
    let f: Vec<f32> = (0..(1 << 19) + 3).map(|i| i as f32).collect();
    let t = Tensor::from_slice(&Backend::Cpu, &[f.len()], &f).unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), f);
}

#[test]
fn host_fast_paths_keep_values() {
    let v: Vec<f32> = (0..13).map(|i| i as f32 - 3.25).collect();
    for backend in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let t = Tensor::from_slice(&backend, &[13], &v).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), v);
        assert_eq!(t.to_bytes().unwrap(), bytemuck::cast_slice::<f32, u8>(&v));
        let odd = Tensor::from_bytes(&backend, &[3], DType::U8, &[1, 2, 3]).unwrap();
        assert_eq!(odd.to_vec::<u8>().unwrap(), vec![1, 2, 3]);
    }
}
