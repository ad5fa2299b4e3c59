//! The bench harness's timed loop performs no heap allocation: a counting global allocator
//! (this test binary's only) counts every allocation made between the first and the last timed
//! run of a case whose run itself allocates nothing. With the cold-L2 flush on, so the flush
//! between samples is inside the counted span too. (That the ops' outputs are not allocated in
//! the loop either is checked by the storage counter: tests/bench_cmd.rs.)

use sluice_kernels::bench::{time_run, BenchRun, TimingConfig};
use sluice_kernels::Backend;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    // Per thread, so the tests of this binary (run in parallel threads) do not see each
    // other's allocations. A const Cell with no destructor: using it cannot allocate.
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    ALLOCS.with(|c| c.set(c.get() + 1));
}

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract is passed on to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const SAMPLES: usize = 8;

fn allocations_in_timed_loop(backend: &Backend, cold_l2: bool) -> u64 {
    // Allocation counts seen at each run, in a buffer allocated before anything is timed.
    let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::with_capacity(64)));
    let log = seen.clone();
    let mut run: BenchRun = Box::new(move |_| {
        let mut l = log.borrow_mut();
        if l.len() < l.capacity() {
            l.push(allocs());
        }
        Ok(())
    });
    let cfg = TimingConfig {
        warmup: 2,
        samples: SAMPLES,
        // One run per sample, so the last SAMPLES runs are the timed ones.
        min_sample_s: 0.0,
        cold_l2_bytes: cold_l2.then_some(1 << 20),
        ..TimingConfig::default()
    };
    let t = time_run(backend, &mut run, &cfg).unwrap();
    assert_eq!((t.samples, t.batch), (SAMPLES, 1));
    let seen = seen.borrow();
    // warm-up 2, the counted run 1, then the timed runs.
    assert_eq!(seen.len(), 3 + SAMPLES);
    let timed = &seen[3..];
    timed[SAMPLES - 1] - timed[0]
}

#[test]
fn the_timed_loop_allocates_nothing() {
    // Counted on this thread: the harness spawns no thread on cpu or emu.
    assert_eq!(allocations_in_timed_loop(&Backend::Cpu, false), 0);
    assert_eq!(
        allocations_in_timed_loop(&Backend::emu_with_seed(0), true),
        0
    );
}

/// The counter is not blind: a run that allocates shows up.
#[test]
fn an_allocating_run_is_counted() {
    let before = allocs();
    let v: Vec<u64> = std::hint::black_box(Vec::with_capacity(16));
    assert!(allocs() > before);
    drop(v);
}
