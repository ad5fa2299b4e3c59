//! Storage recycling for `sluice bench`: while a [`RecycleScope`] is alive on a thread, the
//! storage of every tensor dropped on that thread is kept, and a later allocation of the same
//! size on the same device takes it back instead of asking the allocator.
//!
//! Why: ops return fresh output tensors. Timed naively, every run would pay for cudaMalloc (or
//! the emulator's guarded allocation) and for the poison memset of its outputs. With the scope
//! open, the warm-up runs fill the pool with exactly the buffers one run needs, and every timed
//! run after them reuses those: the outputs are allocated once, before the timing, and reused,
//! the way a caching allocator serves a framework. The bench counts fresh allocations inside
//! its timed loop ([`crate::counters`]) and reports the count, which must be 0.
//!
//! What changes under the scope, and only there: a recycled buffer asked for as `poisoned` is
//! not re-poisoned (the poison catches unwritten outputs, which is the tests' business, not a
//! timing's); a recycled buffer asked for as `zeros` is zeroed as before (ops rely on it).

use super::{HostBuffer, Storage};
use crate::error::{Error, Result};
use std::cell::RefCell;
use std::marker::PhantomData;

thread_local! {
    static POOL: RefCell<Option<Vec<Storage>>> = const { RefCell::new(None) };
}

/// While alive, tensors dropped on this thread give their storage to the pool (see the module
/// documentation). Dropping the scope frees what the pool holds.
pub struct RecycleScope {
    // The pool is this thread's: the scope must be dropped on the thread that opened it.
    _not_send: PhantomData<*const ()>,
}

impl RecycleScope {
    /// Opens the scope on this thread; an error if one is already open here (nested scopes
    /// would hand one buffer to two owners' lifetimes).
    pub fn enter() -> Result<RecycleScope> {
        POOL.with(|p| {
            let mut p = p.borrow_mut();
            if p.is_some() {
                return Err(Error::Invalid(
                    "a tensor RecycleScope is already open on this thread".into(),
                ));
            }
            *p = Some(Vec::new());
            Ok(RecycleScope {
                _not_send: PhantomData,
            })
        })
    }

    /// Buffers the pool holds now.
    pub fn pooled(&self) -> usize {
        POOL.with(|p| p.borrow().as_ref().map_or(0, Vec::len))
    }
}

impl Drop for RecycleScope {
    fn drop(&mut self) {
        // Taken out first so the buffers are freed after the borrow ends.
        let held = POOL.with(|p| p.borrow_mut().take());
        drop(held);
    }
}

/// What kind of storage, and its size in bytes, as the pool matches it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Host,
    Emu,
    /// By the stream's address: two GPUs (or two contexts) never share a buffer.
    Cuda(usize),
}

fn key(s: &Storage) -> Option<(Kind, usize)> {
    match s {
        Storage::Host(HostBuffer::Words { bytes, .. }) => Some((Kind::Host, *bytes)),
        // An adopted vector is the CPU reference's own allocation; not worth keeping.
        Storage::Host(HostBuffer::F32(_)) => None,
        Storage::Emu(e) => Some((Kind::Emu, e.len_bytes())),
        Storage::Cuda(slice, stream) => Some((
            Kind::Cuda(std::sync::Arc::as_ptr(stream) as usize),
            slice.len(),
        )),
    }
}

/// A pooled buffer of this kind and size, where a scope is open and holds one.
pub(super) fn take(kind: Kind, bytes: usize) -> Option<Storage> {
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        let pool = p.as_mut()?;
        let i = pool.iter().position(|s| key(s) == Some((kind, bytes)))?;
        Some(pool.swap_remove(i))
    })
}

/// Keeps `storage` where a scope is open on this thread; else hands it back to be freed.
pub(super) fn give(storage: Storage) -> Option<Storage> {
    if key(&storage).is_none() {
        return Some(storage);
    }
    POOL.with(|p| match p.try_borrow_mut() {
        Ok(mut p) => match p.as_mut() {
            Some(pool) => {
                pool.push(storage);
                None
            }
            None => Some(storage),
        },
        // Only while the scope itself is being dropped: free normally.
        Err(_) => Some(storage),
    })
}

/// Whether a scope is open on this thread (so dropping a tensor should offer its storage).
pub(super) fn active() -> bool {
    POOL.with(|p| p.try_borrow().map(|p| p.is_some()).unwrap_or(false))
}
