//! The caching allocator: storage of dropped tensors kept for later allocations of the same
//! size on the same device, so a steady-state step asks the device allocator for nothing.
//!
//! One cache per thread, keyed by device (host, emu, or a CUDA stream) and size. A thread
//! gives and takes only while a [`PoolScope`] is open on it: the runtime opens one around the
//! learner's train step and around each rollout engine step, each on its own thread, so each
//! keeps its own working set without a lock and no thread takes another's buffers (which is
//! what makes the allocation counts of a step exact, [`crate::counters`]). The memory stays
//! cached when the scope closes, for the next step; [`release`] frees it, and so does the
//! thread's end.
//!
//! Sizes: CUDA allocations are rounded up to one of 8 sizes per power of two (at most 12.5%
//! above the request, 512 bytes at least), so tensors of nearby sizes share buffers; emu
//! buffers are kept at their exact size (the emulator's guard zone starts at the last byte of
//! the tensor, which is what catches a kernel writing one element past an output) and so are
//! host buffers.
//!
//! Bound: a buffer enters the cache only when its tensor is dropped, and an allocation takes a
//! cached buffer before it asks the allocator, so a thread's cache never holds more than the
//! peak of what its scoped steps had alive at once (plus the rounding); `SLUICE_POOL_MAX_BYTES`
//! caps it further (a buffer that would take the cache past the cap is freed instead). A CUDA
//! allocation that fails frees the cache and tries once more.
//!
//! Results do not depend on the cache: every op writes every element of its outputs, which
//! the debug switch ([`crate::debug`]) checks by poisoning recycled buffers exactly as fresh
//! ones; buffers asked for as zeros are zeroed again.
//!
//! [`RecycleScope`] is the bench's use of the same cache: a scope that frees the cache when it
//! closes.

use super::{HostBuffer, Storage};
use crate::error::{Error, Result};
use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::OnceLock;

#[derive(Default)]
struct Cache {
    free: HashMap<(Kind, usize), Vec<Storage>>,
    /// Bytes held in `free`.
    bytes: usize,
    /// Open [`PoolScope`]s on this thread.
    depth: u32,
    /// Whether a [`RecycleScope`] is open on this thread.
    recycling: bool,
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
}

/// The cap on one thread's cached bytes: `SLUICE_POOL_MAX_BYTES`, else none.
fn cap() -> usize {
    static CAP: OnceLock<usize> = OnceLock::new();
    *CAP.get_or_init(|| {
        std::env::var("SLUICE_POOL_MAX_BYTES")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(usize::MAX)
    })
}

/// While alive, this thread's dropped tensors give their storage to the cache and its
/// allocations take from it (see the module documentation). Scopes nest; the cache outlives
/// them.
pub struct PoolScope {
    // The cache is this thread's: the scope must be dropped on the thread that opened it.
    _not_send: PhantomData<*const ()>,
}

impl PoolScope {
    pub fn enter() -> PoolScope {
        CACHE.with(|c| c.borrow_mut().depth += 1);
        PoolScope {
            _not_send: PhantomData,
        }
    }
}

impl Drop for PoolScope {
    fn drop(&mut self) {
        let _ = CACHE.try_with(|c| {
            if let Ok(mut c) = c.try_borrow_mut() {
                c.depth = c.depth.saturating_sub(1);
            }
        });
    }
}

/// Frees every buffer this thread's cache holds; returns how many bytes that was.
pub fn release() -> usize {
    let taken = CACHE
        .try_with(|c| {
            let mut c = c.borrow_mut();
            let bytes = std::mem::take(&mut c.bytes);
            (std::mem::take(&mut c.free), bytes)
        })
        .ok();
    // Dropped after the borrow ends.
    taken.map_or(0, |(free, bytes)| {
        drop(free);
        bytes
    })
}

/// Bytes and buffers this thread's cache holds now.
pub fn cached() -> (usize, usize) {
    CACHE.with(|c| {
        let c = c.borrow();
        (c.bytes, c.free.values().map(Vec::len).sum())
    })
}

/// The bench's scope: [`PoolScope`] that frees the cache when it closes, so the warm-up runs
/// fill the cache with exactly the buffers one run needs and the timed runs reuse them (the
/// bench counts fresh allocations inside its timed loop, which must be 0).
pub struct RecycleScope {
    _scope: PoolScope,
}

impl RecycleScope {
    /// Opens the scope on this thread; an error if one is already open here (the inner one
    /// would free the outer one's buffers).
    pub fn enter() -> Result<RecycleScope> {
        let open = CACHE.with(|c| std::mem::replace(&mut c.borrow_mut().recycling, true));
        if open {
            return Err(Error::Invalid(
                "a tensor RecycleScope is already open on this thread".into(),
            ));
        }
        Ok(RecycleScope {
            _scope: PoolScope::enter(),
        })
    }

    /// Buffers the cache holds now.
    pub fn pooled(&self) -> usize {
        cached().1
    }
}

impl Drop for RecycleScope {
    fn drop(&mut self) {
        let _ = CACHE.try_with(|c| {
            if let Ok(mut c) = c.try_borrow_mut() {
                c.recycling = false;
            }
        });
        release();
    }
}

/// What kind of storage, as the cache matches it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) enum Kind {
    Host,
    Emu,
    /// By the stream's address: two GPUs (or two contexts) never share a buffer.
    Cuda(usize),
}

/// The size a request of `bytes` is served with: see the module documentation.
pub(super) fn bucket(kind: Kind, bytes: usize) -> usize {
    match kind {
        Kind::Host | Kind::Emu => bytes,
        Kind::Cuda(_) => {
            if bytes <= 512 {
                return 512;
            }
            // 8 sizes per power of two: steps of 2^(p-3) above 2^p.
            let p = usize::BITS - 1 - bytes.leading_zeros();
            let step = 1usize << (p - 3);
            bytes.div_ceil(step) * step
        }
    }
}

fn key(s: &Storage) -> Option<(Kind, usize)> {
    match s {
        Storage::Host(HostBuffer::Words { bytes, .. }) => Some((Kind::Host, *bytes)),
        // An adopted vector is the CPU reference's own allocation; not worth keeping.
        Storage::Host(HostBuffer::F32(_)) => None,
        Storage::Emu(e) => Some((Kind::Emu, e.len_bytes())),
        Storage::Cuda(slice, stream) => {
            let kind = Kind::Cuda(std::sync::Arc::as_ptr(stream) as usize);
            // Only bucket-sized allocations can serve a later request.
            (bucket(kind, slice.len()) == slice.len()).then_some((kind, slice.len()))
        }
    }
}

/// A cached buffer for a request of `bytes` on `kind` (its size is `bucket(kind, bytes)`),
/// where a scope is open on this thread and the cache holds one.
pub(super) fn take(kind: Kind, bytes: usize) -> Option<Storage> {
    CACHE
        .try_with(|c| {
            let mut c = c.try_borrow_mut().ok()?;
            if c.depth == 0 {
                return None;
            }
            let size = bucket(kind, bytes);
            let s = c.free.get_mut(&(kind, size))?.pop()?;
            c.bytes -= size;
            Some(s)
        })
        .ok()
        .flatten()
}

/// Keeps `storage` where a scope is open on this thread and the cap allows; else hands it back
/// to be freed.
pub(super) fn give(storage: Storage) -> Option<Storage> {
    let Some(k) = key(&storage) else {
        return Some(storage);
    };
    let kept = CACHE.try_with(|c| match c.try_borrow_mut() {
        Ok(mut c) if c.depth > 0 && c.bytes.saturating_add(k.1) <= cap() => {
            c.bytes += k.1;
            c.free.entry(k).or_default().push(storage);
            None
        }
        _ => Some(storage),
    });
    // Only while the thread's storage is being torn down: free normally.
    kept.unwrap_or(None)
}

/// Whether a scope is open on this thread (so dropping a tensor should offer its storage).
pub(super) fn active() -> bool {
    CACHE
        .try_with(|c| c.try_borrow().map(|c| c.depth > 0).unwrap_or(false))
        .unwrap_or(false)
}
