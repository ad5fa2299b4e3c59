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
}

impl Counts {
    const ZERO: Counts = Counts {
        storage_allocs: 0,
        launches: 0,
        host_syncs: 0,
    };

    /// The counts since `earlier` (a snapshot of the same thread).
    pub fn since(self, earlier: Counts) -> Counts {
        Counts {
            storage_allocs: self.storage_allocs - earlier.storage_allocs,
            launches: self.launches - earlier.launches,
            host_syncs: self.host_syncs - earlier.host_syncs,
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
        let before = snapshot();
        std::thread::spawn(|| Tensor::zeros(&Backend::Cpu, &[4], DType::F32).map(|_| ()))
            .join()
            .unwrap()
            .unwrap();
        assert_eq!(snapshot().since(before).storage_allocs, 0);
    }
}
