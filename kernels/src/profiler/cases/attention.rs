//! The attention family's profile plans: training attention (forward and backward over packed
//! causal sequences) and the paged-KV trio (decode attention, K/V append, prefill), with the
//! block tables and sequence layouts they are built from.

use super::*;

/// `8x4096` when every length is the same, else `17+33`.
pub(super) fn lens_words(lens: &[usize]) -> String {
    if !lens.is_empty() && lens.iter().all(|&l| l == lens[0]) {
        format!("{}x{}", lens.len(), lens[0])
    } else {
        lens.iter()
            .map(|l| l.to_string())
            .collect::<Vec<_>>()
            .join("+")
    }
}

pub(super) fn cu_seqlens(lens: &[usize]) -> Vec<i32> {
    std::iter::once(0)
        .chain(lens.iter().scan(0, |acc, &l| {
            *acc += l as i32;
            Some(*acc)
        }))
        .collect()
}

/// Causal varlen attention (bf16, GQA): 4·D FLOPs per visible (query, key) pair and query head
/// forward; the backward 2.5x that (its recomputation of the forward is not counted).
pub(super) fn attention(lens: Vec<usize>, h: usize, hkv: usize, d: usize, backward: bool) -> Plan {
    let dtype = DType::BF16;
    let t: usize = lens.iter().sum();
    let pairs: f64 = lens.iter().map(|&l| (l * (l + 1) / 2) as f64).sum();
    let forward = 4.0 * d as f64 * h as f64 * pairs;
    Plan {
        shape: format!(
            "{} tokens (T={t}) H={h} Hkv={hkv} D={d} causal bf16",
            lens_words(&lens)
        ),
        flops: if backward { 2.5 * forward } else { forward },
        strata: attention_strata,
        build: Box::new(move |b| {
            b.values("q", &[t, h, d], dtype)?;
            b.values("k", &[t, hkv, d], dtype)?;
            b.values("v", &[t, hkv, d], dtype)?;
            b.i32s("cu_seqlens", &[lens.len() + 1], &cu_seqlens(&lens))?;
            if backward {
                b.values("dout", &[t, h, d], dtype)?;
                b.output(&[t, h, d], DType::F32);
                b.output(&[t, hkv, d], DType::F32);
                b.output(&[t, hkv, d], DType::F32);
            } else {
                b.output(&[t, h, d], DType::F32);
            }
            Ok(())
        }),
    }
}

/// Cache blocks of 16 slots (the default).
const BS: usize = 16;

/// The paged layout of sequences of `ctx` tokens: every sequence's blocks drawn from a shuffled
/// cache of their total plus `spare` free blocks. Returns (NB, MB, block table [B,MB], -1 past
/// a sequence's blocks).
pub(super) fn block_table(ctx: &[usize], spare: usize, seed: u64) -> (usize, usize, Vec<i32>) {
    let need: Vec<usize> = ctx.iter().map(|c| c.div_ceil(BS)).collect();
    let mb = need.iter().copied().max().unwrap_or(0).max(1);
    let nb = need.iter().sum::<usize>() + spare;
    let ids = shuffled(nb, seed);
    let mut table = vec![-1i32; ctx.len() * mb];
    let mut next = 0;
    for (s, &n) in need.iter().enumerate() {
        table[s * mb..s * mb + n].copy_from_slice(&ids[next..next + n]);
        next += n;
    }
    (nb.max(1), mb, table)
}

/// Decode (bf16): one query per sequence over its paged context; 4·D FLOPs per (query head,
/// key). Compulsory: the K/V rows of the contexts (not the whole cache), q, the tables, out.
pub(super) fn paged_attention(
    ctx: Vec<usize>,
    h: usize,
    hkv: usize,
    d: usize,
    spare: usize,
) -> Plan {
    let dtype = DType::BF16;
    let batch = ctx.len();
    let keys: usize = ctx.iter().sum();
    let ctx_words = if ctx.iter().all(|&c| c == ctx[0]) {
        format!("{}-token contexts", ctx[0])
    } else {
        format!("contexts {}", lens_words(&ctx))
    };
    Plan {
        shape: format!("B={batch} H={h} Hkv={hkv} D={d} {ctx_words}, block size {BS}, bf16"),
        flops: 4.0 * d as f64 * h as f64 * keys as f64,
        strata: paged_strata,
        build: Box::new(move |b| {
            let seed = b.next_seed();
            let (nb, mb, table) = block_table(&ctx, spare, seed);
            b.values("q", &[batch, h, d], dtype)?;
            let cache = [nb, BS, hkv, d];
            b.values_by("k_cache", &cache, dtype, false, unit)?;
            b.values_by("v_cache", &cache, dtype, false, unit)?;
            b.bytes += 2.0 * bytes_of(&[keys, hkv, d], dtype);
            b.i32s("block_table", &[batch, mb], &table)?;
            let lens: Vec<i32> = ctx.iter().map(|&c| c as i32).collect();
            b.i32s("context_lens", &[batch], &lens)?;
            b.output(&[batch, h, d], DType::F32);
            Ok(())
        }),
    }
}

/// Appending new K/V rows (bf16) to paged caches: sequence s holds `cached` tokens and appends
/// `new`, at the slots of its shuffled blocks; `pad` padding rows (slot -1) follow. Pure data
/// movement; compulsory: the new rows and slots read, the non-padding rows written (the caches
/// are updated in place, not read).
pub(super) fn kv_append(
    seqs: Vec<(usize, usize)>,
    pad: usize,
    hkv: usize,
    d: usize,
    nb: usize,
) -> Plan {
    let dtype = DType::BF16;
    let rows: usize = seqs.iter().map(|s| s.1).sum();
    let t = rows + pad;
    let seq_words = if seqs.iter().all(|&s| s == seqs[0]) {
        format!("{}x{} after {} cached", seqs.len(), seqs[0].1, seqs[0].0)
    } else {
        seqs.iter()
            .map(|(c, n)| format!("{n} after {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Plan {
        shape: format!(
            "T={t} new rows ({seq_words}{}) into NB={nb} blocks x {BS}, Hkv={hkv} D={d} bf16",
            if pad > 0 {
                format!(", {pad} padding")
            } else {
                String::new()
            }
        ),
        flops: 0.0,
        strata: paged_strata,
        build: Box::new(move |b| {
            let ctx: Vec<usize> = seqs.iter().map(|(c, n)| c + n).collect();
            let used: usize = ctx.iter().map(|c| c.div_ceil(BS)).sum();
            let seed = b.next_seed();
            let (_, mb, table) = block_table(&ctx, nb - used, seed);
            let mut slots = Vec::with_capacity(t);
            for (s, &(cached, new)) in seqs.iter().enumerate() {
                for p in cached..cached + new {
                    slots.push(table[s * mb + p / BS] * BS as i32 + (p % BS) as i32);
                }
            }
            slots.extend(std::iter::repeat_n(-1, pad));
            b.values("k_new", &[t, hkv, d], dtype)?;
            b.values("v_new", &[t, hkv, d], dtype)?;
            b.i32s("slot_mapping", &[t], &slots)?;
            let cache = [nb, BS, hkv, d];
            b.values_by("k_cache", &cache, dtype, false, unit)?;
            b.values_by("v_cache", &cache, dtype, false, unit)?;
            b.bytes += 2.0 * bytes_of(&[rows, hkv, d], dtype);
            Ok(())
        }),
    }
}

/// Chunked prefill (bf16): sequence s has `ctx` keys cached, its `new` tokens last, queried
/// causally; 4·D FLOPs per visible (query, key) pair and query head. Compulsory: q, the K/V rows
/// of the contexts, the tables, out.
pub(super) fn paged_prefill(
    seqs: Vec<(usize, usize)>,
    h: usize,
    hkv: usize,
    d: usize,
    spare: usize,
) -> Plan {
    let dtype = DType::BF16;
    let batch = seqs.len();
    let t: usize = seqs.iter().map(|s| s.1).sum();
    let keys: usize = seqs.iter().map(|s| s.0).sum();
    // New token i (0-based) of a sequence sees ctx - new + i + 1 keys.
    let pairs: f64 = seqs
        .iter()
        .map(|&(c, n)| (n * (c - n) + n * (n + 1) / 2) as f64)
        .sum();
    let seq_words = if seqs.iter().all(|&s| s == seqs[0]) {
        format!(
            "{}x{} new tokens over {}-token contexts",
            batch, seqs[0].1, seqs[0].0
        )
    } else {
        seqs.iter()
            .map(|(c, n)| format!("{n} new of {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Plan {
        shape: format!("{seq_words} (T={t}) H={h} Hkv={hkv} D={d}, block size {BS}, causal bf16"),
        flops: 4.0 * d as f64 * h as f64 * pairs,
        strata: paged_strata,
        build: Box::new(move |b| {
            let ctx: Vec<usize> = seqs.iter().map(|s| s.0).collect();
            let new: Vec<usize> = seqs.iter().map(|s| s.1).collect();
            let seed = b.next_seed();
            let (nb, mb, table) = block_table(&ctx, spare, seed);
            b.values("q", &[t, h, d], dtype)?;
            let cache = [nb, BS, hkv, d];
            b.values_by("k_cache", &cache, dtype, false, unit)?;
            b.values_by("v_cache", &cache, dtype, false, unit)?;
            b.bytes += 2.0 * bytes_of(&[keys, hkv, d], dtype);
            b.i32s("block_table", &[batch, mb], &table)?;
            b.i32s("cu_seqlens", &[batch + 1], &cu_seqlens(&new))?;
            let lens: Vec<i32> = ctx.iter().map(|&c| c as i32).collect();
            b.i32s("context_lens", &[batch], &lens)?;
            b.output(&[t, h, d], DType::F32);
            Ok(())
        }),
    }
}
