//! Per-thread counts of what an op costs besides its kernels: fresh tensor storage allocations,
//! kernel launches and host synchronisations (downloads and explicit waits).
//!
//! `sluice bench` reads them around one run of an op (launches and host syncs per run) and
//! around its timed loop (storage allocations there must be 0: outputs come from the bench's
//! storage pool, [`crate::tensor::RecycleScope`]). The counts are per thread because the tests
//! of one binary run in parallel threads and each must see only its own op's work; ops
//! allocate, launch and download on the thread that calls them.

use std::cell::Cell;

thread_local! {
    static COUNTS: Cell<Counts> = const { Cell::new(Counts::ZERO) };
}

/// The counts of one thread, or the difference of two snapshots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Tensor storage taken from the allocator (not from the bench's pool), on any device.
    pub storage_allocs: u64,
    /// Kernel launches (emu and cuda).
    pub launches: u64,
    /// Waits of the host for the device: `Backend::synchronize` on cuda and every download
    /// of device memory to the host (on emu the download is a host copy, counted the same
    /// way so the dry run sees what a GPU run would).
    pub host_syncs: u64,
    /// The downloads among `host_syncs` issued from inside an op (a call site in
    /// kernels/src/ops/): the copies to the host an op makes on its own, which the hot path
    /// must not have (0 unless the debug switch is on, [`crate::debug`]). The rest are the
    /// caller's: the runtime reading a step's results.
    pub op_downloads: u64,
}

impl Counts {
    const ZERO: Counts = Counts {
        storage_allocs: 0,
        launches: 0,
        host_syncs: 0,
        op_downloads: 0,
    };

    /// The counts since `earlier` (a snapshot of the same thread).
    pub fn since(self, earlier: Counts) -> Counts {
        Counts {
            storage_allocs: self.storage_allocs - earlier.storage_allocs,
            launches: self.launches - earlier.launches,
            host_syncs: self.host_syncs - earlier.host_syncs,
            op_downloads: self.op_downloads - earlier.op_downloads,
        }
    }
}

/// This thread's counts so far.
pub fn snapshot() -> Counts {
    COUNTS.with(Cell::get)
}

fn bump(f: impl FnOnce(&mut Counts)) {
    COUNTS.with(|c| {
        let mut v = c.get();
        f(&mut v);
        c.set(v);
    });
}

pub(crate) fn storage_alloc() {
    bump(|c| c.storage_allocs += 1);
}

pub(crate) fn launch() {
    bump(|c| c.launches += 1);
}

pub(crate) fn host_sync() {
    bump(|c| c.host_syncs += 1);
}

/// A download of device memory: a host sync, and an op's own when `caller` (the call site,
/// carried through `#[track_caller]` from the download methods of [`crate::Tensor`]) is in
/// kernels/src/ops/.
pub(crate) fn download(caller: &std::panic::Location<'_>) {
    let inside_op = is_op_site(caller.file());
    bump(|c| {
        c.host_syncs += 1;
        c.op_downloads += u64::from(inside_op);
    });
}

fn is_op_site(file: &str) -> bool {
    file.replace('\\', "/").contains("kernels/src/ops/")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Backend, DType, Tensor};

    /// A fresh tensor counts one allocation; a download on emu counts one host sync; another
    /// thread's work does not show in this thread's counts.
    #[test]
    fn counts_are_per_thread_and_per_event() {
        let b = Backend::emu_with_seed(0);
        let before = snapshot();
        let t = Tensor::zeros(&b, &[4], DType::F32).unwrap();
        let _ = t.to_bytes().unwrap();
        let d = snapshot().since(before);
        assert_eq!(d.storage_allocs, 1, "{d:?}");
        assert_eq!(d.host_syncs, 1, "{d:?}");
        // Not from kernels/src/ops/: the caller's download, not an op's.
        assert_eq!(d.op_downloads, 0, "{d:?}");
        let before = snapshot();
        std::thread::spawn(|| Tensor::zeros(&Backend::Cpu, &[4], DType::F32).map(|_| ()))
            .join()
            .unwrap()
            .unwrap();
        assert_eq!(snapshot().since(before).storage_allocs, 0);
    }

    /// A download whose call site is in kernels/src/ops/ counts as an op's own; one from
    /// anywhere else does not; `download_many` is one sync for any number of tensors.
    #[test]
    fn op_downloads_are_told_by_their_call_site() {
        assert!(is_op_site("kernels/src/ops/gemm/mod.rs"));
        assert!(is_op_site("/abs/path/kernels/src/ops/moe/device.rs"));
        assert!(!is_op_site("kernels/src/tensor.rs"));
        assert!(!is_op_site("model/src/forward.rs"));
        let b = Backend::emu_with_seed(0);
        let x = Tensor::from_slice(&b, &[3], &[1i32, 2, 3]).unwrap();
        let y = Tensor::from_slice(&b, &[2], &[4.0f32, 5.0]).unwrap();
        let before = snapshot();
        let got = Tensor::download_many(&[&x, &y]).unwrap();
        let d = snapshot().since(before);
        assert_eq!(d.host_syncs, 1, "{d:?}");
        assert_eq!(d.op_downloads, 0, "{d:?}");
        assert_eq!(got[0], bytemuck::cast_slice::<i32, u8>(&[1, 2, 3]));
        assert_eq!(got[1], bytemuck::cast_slice::<f32, u8>(&[4.0, 5.0]));
    }
}
