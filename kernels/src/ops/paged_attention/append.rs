//! kv_append: new K/V rows into their cache slots (the layout in mod.rs).

use super::check_cache;
use crate::device::Backend;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::tensor::Tensor;
use half::bf16;

/// Checks slot_mapping: each slot is < 0 (padding: skipped) or a slot of the cache (< n_slots),
/// and no slot appears twice (two writers of one row would make the result depend on timing).
pub fn check_slots(slot_mapping: &[i32], n_slots: usize) -> Result<()> {
    let mut seen: Vec<i32> = slot_mapping.iter().copied().filter(|&s| s >= 0).collect();
    if let Some((t, &s)) = slot_mapping
        .iter()
        .enumerate()
        .find(|(_, &s)| s >= 0 && s as usize >= n_slots)
    {
        return Err(Error::Invalid(format!(
            "`slot_mapping`[{t}] = {s} is past the cache's {n_slots} slots (NB * BS)"
        )));
    }
    seen.sort_unstable();
    if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::Invalid(format!(
            "`slot_mapping` names slot {} twice",
            w[0]
        )));
    }
    Ok(())
}

/// CPU reference of kv_append: copies row t of k_new/v_new [T,Hkv,D] into slot slot_mapping[t]
/// of the caches [NB,BS,Hkv,D] (rows of width Hkv*D); negative slots are skipped.
pub fn kv_append_reference<E: Copy>(
    k_new: &[E],
    v_new: &[E],
    slot_mapping: &[i32],
    row: usize,
    k_cache: &mut [E],
    v_cache: &mut [E],
) -> Result<()> {
    if row == 0
        || k_new.len() != slot_mapping.len() * row
        || v_new.len() != k_new.len()
        || k_cache.len() != v_cache.len()
        || !k_cache.len().is_multiple_of(row)
    {
        return Err(Error::Invalid(format!(
            "kv_append buffers: k_new {}, v_new {}, {} slots of {row} values, caches {} and {}",
            k_new.len(),
            v_new.len(),
            slot_mapping.len(),
            k_cache.len(),
            v_cache.len()
        )));
    }
    check_slots(slot_mapping, k_cache.len() / row)?;
    for (t, &s) in slot_mapping.iter().enumerate() {
        if s >= 0 {
            let dst = s as usize * row;
            k_cache[dst..dst + row].copy_from_slice(&k_new[t * row..(t + 1) * row]);
            v_cache[dst..dst + row].copy_from_slice(&v_new[t * row..(t + 1) * row]);
        }
    }
    Ok(())
}

fn cpu_append<E: Element>(
    k_new: &Tensor,
    v_new: &Tensor,
    slots: &[i32],
    row: usize,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
) -> Result<()> {
    // In place: the reference checks every length and slot before it writes anything, so an
    // error leaves the caches untouched.
    kv_append_reference(
        k_new.host_slice::<E>()?,
        v_new.host_slice::<E>()?,
        slots,
        row,
        k_cache.host_slice_mut::<E>()?,
        v_cache.host_slice_mut::<E>()?,
    )
}

/// Writes k_new/v_new [T,Hkv,D] into the caches [NB,BS,Hkv,D] at slot_mapping[T] (I32, slot =
/// block * BS + offset; negative = padding, skipped). The new rows have the caches' dtype.
/// The slots are checked (in range, distinct) on the host; on cuda that downloads T ints.
pub fn kv_append(
    backend: &Backend,
    k_new: &Tensor,
    v_new: &Tensor,
    slot_mapping: &Tensor,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
) -> Result<()> {
    let [nb, bs, hkv, d] = check_cache("k_cache", k_cache)?;
    if v_cache.shape() != k_cache.shape() {
        return Err(Error::shape(
            "v_cache",
            format!(
                "[NB,BS,Hkv,D] = {:?} (the shape of k_cache)",
                k_cache.shape()
            ),
            v_cache.shape(),
        ));
    }
    v_cache.expect_dtype("v_cache", k_cache.dtype())?;
    k_new.expect_rank("k_new", 3, "[T,Hkv,D]")?;
    let t = k_new.shape()[0];
    if k_new.shape()[1..] != [hkv, d] {
        return Err(Error::shape(
            "k_new",
            format!("[T,Hkv,D] = [T,{hkv},{d}] (Hkv, D of the cache)"),
            k_new.shape(),
        ));
    }
    if v_new.shape() != k_new.shape() {
        return Err(Error::shape(
            "v_new",
            format!("[T,Hkv,D] = {:?} (the shape of k_new)", k_new.shape()),
            v_new.shape(),
        ));
    }
    k_new.expect_dtype("k_new", k_cache.dtype())?;
    v_new.expect_dtype("v_new", k_cache.dtype())?;
    if slot_mapping.shape() != [t] {
        return Err(Error::shape(
            "slot_mapping",
            format!("[T] = [{t}]"),
            slot_mapping.shape(),
        ));
    }
    slot_mapping.expect_dtype("slot_mapping", DType::I32)?;
    let n_slots = nb * bs;
    // On a device only in debug mode (a copy and a sync): the block manager hands out distinct
    // slots inside the cache (runtime kv_blocks.rs checks its tables where it builds them).
    let slots = if crate::debug::reads_back(slot_mapping) {
        let slots = slot_mapping.to_vec::<i32>()?;
        check_slots(&slots, n_slots)?;
        slots
    } else {
        Vec::new()
    };
    if t == 0 {
        return Ok(());
    }
    let bf = k_cache.dtype() == DType::BF16;
    match backend {
        Backend::Cpu => {
            if bf {
                cpu_append::<bf16>(k_new, v_new, &slots, hkv * d, k_cache, v_cache)
            } else {
                cpu_append::<f32>(k_new, v_new, &slots, hkv * d, k_cache, v_cache)
            }
        }
        _ => {
            // Each (token, kv head) row is written by one warp, slots checked distinct and in
            // range above, so no two warps write the same bytes.
            backend.launch(
                &Launch::new(
                    if bf {
                        "paged_attention_kv_append_bf16"
                    } else {
                        "paged_attention_kv_append_f32"
                    },
                    [blocks_for(t, 4), hkv as u32, 1],
                    [128, 1, 1],
                )
                .arg_tensor(k_new)
                .arg_tensor(v_new)
                .arg_tensor(slot_mapping)
                .arg_i32(t as i32)
                .arg_i32(hkv as i32)
                .arg_i32(d as i32)
                .arg_i64(n_slots as i64)
                .arg_tensor(k_cache)
                .arg_tensor(v_cache),
            )
        }
    }
}
