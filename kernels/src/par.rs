//! Threads for the CPU references: one pool (rayon's global pool), used only when an op has
//! enough work to pay for it.
//!
//! Every CPU reference that works row by row cuts its rows into a few contiguous pieces, one
//! task each, and only when the op's total work is at least [`MIN_PAR_WORK`]; below that it
//! runs on the calling thread and never touches the pool. A row's arithmetic never depends on
//! which piece holds it, so the cut changes no bits (batch invariance and determinism hold
//! whatever the thread count).
//!
//! Why: a parallel iterator started from a thread outside the pool hands the job to a worker
//! and puts the caller to sleep, and rayon splits an iterator down to single items that the
//! idle worker steals. For the rollout engine's decode ops (one row of 128 floats at batch 1)
//! that hand-off costs far more than the op: at batch 64 a third of the decode's CPU time was
//! system time, with about 350 k involuntary context switches in 4 s (issue 16).

/// The smallest total work (multiply-adds, or element operations of similar cost) worth
/// splitting over threads: about 20-40 us of one core's time, several times the cost of
/// waking a worker and joining it.
pub const MIN_PAR_WORK: usize = 1 << 21;

/// The pool's thread count.
pub fn threads() -> usize {
    rayon::current_num_threads().max(1)
}

/// How many contiguous pieces `rows` rows of `work_per_row` units each are cut into: 1 (run on
/// the calling thread) below [`MIN_PAR_WORK`] in total, else up to four per thread, none with
/// less than `MIN_PAR_WORK / 2` units.
pub fn pieces(rows: usize, work_per_row: usize) -> usize {
    let work = rows.saturating_mul(work_per_row.max(1));
    let t = threads();
    if work < MIN_PAR_WORK || rows < 2 || t == 1 {
        return 1;
    }
    (work / (MIN_PAR_WORK / 2)).clamp(1, 4 * t).min(rows)
}

/// Calls `f(first_row, chunk)` on `out` (rows of `row_len` elements) cut into contiguous
/// chunks of whole rows: one chunk on the calling thread when the work is small (see
/// [`pieces`]), else the chunks as tasks of the pool.
pub fn chunks_mut<T: Send>(
    out: &mut [T],
    row_len: usize,
    work_per_row: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    if row_len == 0 || out.is_empty() {
        return;
    }
    // A short last row (a caller cutting into blocks of rows) counts as a row.
    let rows = out.len().div_ceil(row_len);
    let p = pieces(rows, work_per_row);
    if p == 1 {
        f(0, out);
        return;
    }
    use rayon::prelude::*;
    let per = rows.div_ceil(p);
    out.par_chunks_mut(per * row_len)
        .with_max_len(1)
        .enumerate()
        .for_each(|(i, c)| f(i * per, c));
}

/// Calls `f(row, row_slice)` for every row of `out` (rows of `row_len` elements), threaded as
/// [`chunks_mut`].
pub fn rows_mut<T: Send>(
    out: &mut [T],
    row_len: usize,
    work_per_row: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    chunks_mut(out, row_len, work_per_row, |r0, chunk| {
        for (i, row) in chunk.chunks_mut(row_len).enumerate() {
            f(r0 + i, row);
        }
    });
}

/// [`chunks_mut`] over two outputs with the same number of rows (`a` rows of `a_len`, `b`
/// rows of `b_len`): `f(first_row, a_chunk, b_chunk)`.
pub fn chunks2_mut<A: Send, B: Send>(
    a: &mut [A],
    a_len: usize,
    b: &mut [B],
    b_len: usize,
    work_per_row: usize,
    f: impl Fn(usize, &mut [A], &mut [B]) + Sync + Send,
) {
    if a_len == 0 || b_len == 0 || a.is_empty() {
        return;
    }
    let rows = a.len() / a_len;
    debug_assert_eq!(b.len() / b_len, rows, "chunks2_mut: row counts differ");
    let p = pieces(rows, work_per_row);
    if p == 1 {
        f(0, a, b);
        return;
    }
    use rayon::prelude::*;
    let per = rows.div_ceil(p);
    a.par_chunks_mut(per * a_len)
        .zip(b.par_chunks_mut(per * b_len))
        .with_max_len(1)
        .enumerate()
        .for_each(|(i, (ca, cb))| f(i * per, ca, cb));
}

/// [`rows_mut`] over two outputs with the same number of rows (`a` rows of `a_len`, `b` rows
/// of `b_len`): `f(row, a_row, b_row)`.
pub fn rows2_mut<A: Send, B: Send>(
    a: &mut [A],
    a_len: usize,
    b: &mut [B],
    b_len: usize,
    work_per_row: usize,
    f: impl Fn(usize, &mut [A], &mut [B]) + Sync + Send,
) {
    chunks2_mut(a, a_len, b, b_len, work_per_row, |r0, ca, cb| {
        for (i, (ra, rb)) in ca.chunks_mut(a_len).zip(cb.chunks_mut(b_len)).enumerate() {
            f(r0 + i, ra, rb);
        }
    });
}

/// Calls `f(first, a_chunk, b_chunk, c_chunk)` over three slices of the same length cut at the
/// same places (elementwise updates of three arrays, e.g. AdamW's p, m, v), threaded as
/// [`chunks_mut`] with `work_per_item` units per element.
pub fn chunks3_mut<A: Send, B: Send, C: Send>(
    a: &mut [A],
    b: &mut [B],
    c: &mut [C],
    work_per_item: usize,
    f: impl Fn(usize, &mut [A], &mut [B], &mut [C]) + Sync + Send,
) {
    let n = a.len();
    debug_assert!(b.len() == n && c.len() == n, "chunks3_mut: lengths differ");
    let p = pieces(n, work_per_item);
    if p == 1 {
        f(0, a, b, c);
        return;
    }
    use rayon::prelude::*;
    let per = n.div_ceil(p);
    a.par_chunks_mut(per)
        .zip(b.par_chunks_mut(per))
        .zip(c.par_chunks_mut(per))
        .with_max_len(1)
        .enumerate()
        .for_each(|(i, ((ca, cb), cc))| f(i * per, ca, cb, cc));
}

/// Calls `f(segment, first_row, chunk)` for each segment `bounds[g]..bounds[g+1]` (row
/// indices, non-decreasing, starting at 0) of `out` (rows of `row_len`), the segments as tasks
/// of the pool when the total work (`work_per_row` per row) reaches [`MIN_PAR_WORK`] and there
/// are at least two of them; empty segments are skipped. (The MoE layer's per-expert products.)
pub fn segments_mut<T: Send>(
    out: &mut [T],
    row_len: usize,
    bounds: &[usize],
    work_per_row: usize,
    f: impl Fn(usize, usize, &mut [T]) + Sync + Send,
) {
    let mut tasks = Vec::with_capacity(bounds.len().saturating_sub(1));
    let mut rest = out;
    for (g, w) in bounds.windows(2).enumerate() {
        let (chunk, tail) = std::mem::take(&mut rest).split_at_mut((w[1] - w[0]) * row_len);
        rest = tail;
        if w[1] > w[0] {
            tasks.push((g, w[0], chunk));
        }
    }
    let rows = bounds.last().copied().unwrap_or(0);
    if tasks.len() < 2 || pieces(rows, work_per_row) == 1 {
        for (g, r0, chunk) in tasks {
            f(g, r0, chunk);
        }
        return;
    }
    use rayon::prelude::*;
    tasks
        .into_par_iter()
        .with_max_len(1)
        .for_each(|(g, r0, chunk)| f(g, r0, chunk));
}

/// A vector of `n` values, `f(i)` each, built as [`rows_mut`] with rows of one element.
pub fn map_collect<T: Send + Copy + Default>(
    n: usize,
    work_per_item: usize,
    f: impl Fn(usize) -> T + Sync + Send,
) -> Vec<T> {
    let mut out = vec![T::default(); n];
    chunks_mut(&mut out, 1, work_per_item, |i0, c| {
        for (i, o) in c.iter_mut().enumerate() {
            *o = f(i0 + i);
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_work_is_one_piece_and_large_work_is_split() {
        assert_eq!(pieces(1, 128), 1);
        assert_eq!(pieces(64, 128), 1);
        assert_eq!(pieces(0, 1 << 20), 1);
        if threads() > 1 {
            assert!(pieces(4096, 4096) > 1);
            assert!(pieces(4096, 4096) <= 4 * threads());
        }
    }

    #[test]
    fn every_row_is_visited_once_with_its_index() {
        for (rows, len, work) in [(1, 3, 1), (17, 5, 1), (127, 2, 1 << 14), (1000, 1, 1 << 12)] {
            let mut out = vec![usize::MAX; rows * len];
            rows_mut(&mut out, len, work, |r, row| row.fill(r));
            let want: Vec<usize> = (0..rows)
                .flat_map(|r| std::iter::repeat_n(r, len))
                .collect();
            assert_eq!(out, want, "rows {rows} len {len} work {work}");
            let mut a = vec![0usize; rows * len];
            let mut b = vec![0usize; rows];
            rows2_mut(&mut a, len, &mut b, 1, work, |r, ra, rb| {
                ra.fill(r + 1);
                rb[0] = 2 * r;
            });
            assert!(a
                .chunks(len)
                .enumerate()
                .all(|(r, x)| x.iter().all(|&v| v == r + 1)));
            assert!(b.iter().enumerate().all(|(r, &v)| v == 2 * r));
            let m = map_collect(rows, work, |i| i * 3);
            assert!(m.iter().enumerate().all(|(i, &v)| v == i * 3));
        }
    }
}
