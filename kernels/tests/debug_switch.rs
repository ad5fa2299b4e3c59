//! The debug switch (kernels/src/debug.rs) and the caching allocator (kernels/src/tensor/pool.rs)
//! together: with the switch on, op outputs are poisoned, fresh or recycled, so an element a
//! kernel leaves unwritten is NaN; with it off, nothing is filled and recycled storage is
//! served with no fresh allocation.
//!
//! Its own test binary: the switch is process-wide and the test turns it off.

use sluice_kernels::counters;
use sluice_kernels::launch::Launch;
use sluice_kernels::tensor::{pool_release, PoolScope, POISON_BYTE};
use sluice_kernels::{debug, Backend, DType, Tensor};

/// `moe_widen_bf16` writes out[i] = src[i] widened for i < m: a real kernel that writes only part
/// of an output (the first `m` of `n` elements), as a buggy op would.
fn partial_write(b: &Backend, out: &Tensor, m: usize) {
    let src = Tensor::from_slice(b, &[m], &vec![half::bf16::from_f32(2.5); m]).unwrap();
    b.launch(
        &Launch::new("moe_widen_bf16", [1, 1, 1], [256, 1, 1])
            .arg_tensor(&src)
            .arg_tensor(out)
            .arg_i64(m as i64),
    )
    .unwrap();
}

#[test]
fn poisoning_follows_the_switch_and_recycled_outputs_are_poisoned_again() {
    let b = Backend::emu_with_seed(1);
    let (n, m) = (40, 29);
    assert!(debug::enabled(), "tests run checked by default");
    let _scope = PoolScope::enter();

    // On: the unwritten tail of a partly written output is NaN (caught by any comparison).
    let out = Tensor::poisoned(&b, &[n], DType::F32).unwrap();
    partial_write(&b, &out, m);
    let v = out.to_vec::<f32>().unwrap();
    assert!(v[..m].iter().all(|&x| x == 2.5), "{v:?}");
    assert!(v[m..].iter().all(|x| x.is_nan()), "{v:?}");
    // The same storage, recycled (no fresh allocation), is poisoned again: the old values are
    // not left where the next op might fail to write.
    drop(out);
    let before = counters::snapshot();
    let again = Tensor::poisoned(&b, &[n], DType::F32).unwrap();
    assert_eq!(counters::snapshot().since(before).storage_allocs, 0);
    assert!(again.to_bytes().unwrap().iter().all(|&x| x == POISON_BYTE));
    drop(again);

    // Off: no fill at all, recycled buffers served without an allocation; zeros are still
    // zeros.
    debug::set(false);
    let before = counters::snapshot();
    let mut z = Tensor::poisoned(&b, &[n], DType::F32).unwrap();
    assert_eq!(counters::snapshot().since(before).storage_allocs, 0);
    z.fill_byte(7).unwrap();
    drop(z);
    let zeros = Tensor::zeros(&b, &[n], DType::F32).unwrap();
    assert!(zeros.to_vec::<f32>().unwrap().iter().all(|&x| x == 0.0));
    drop(zeros);
    // A size the cache does not hold: a fresh allocation, left as the allocator gives it.
    let before = counters::snapshot();
    let fresh = Tensor::poisoned(&b, &[n + 1], DType::F32).unwrap();
    assert_eq!(counters::snapshot().since(before).storage_allocs, 1);
    drop(fresh);
    assert!(pool_release() > 0);
    debug::set(true);
}
