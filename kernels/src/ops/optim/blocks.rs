//! Strided 2-D blocks of the arena (Muon's matrices): their validation, the block table
//! uploaded once per optimizer, and the plain gather into a dense batch.

use super::{check_arena, THREADS};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::tensor::Tensor;
use rayon::prelude::*;

/// Most grid-stride blocks per matrix in the gather and apply launches.
const MAX_BLOCKS_PER_MATRIX: usize = 1024;
/// Most blocks in one gather/apply launch (CUDA's grid.y limit).
pub const MAX_BLOCKS: usize = 65535;

/// One strided 2-D block of the arena: element (r, c) at `offset + r * row_stride + c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedBlock {
    pub offset: usize,
    pub row_stride: usize,
}

/// Checks blocks of `rows` x `cols` against an arena of `len` elements: each in bounds and its
/// rows non-overlapping (`cols <= row_stride` when rows > 1). Disjointness between blocks is
/// checked once by [`BlockTable::new`] ([`check_disjoint`]).
pub fn check_blocks(blocks: &[StridedBlock], rows: usize, cols: usize, len: usize) -> Result<()> {
    if blocks.len() > MAX_BLOCKS {
        return Err(Error::param(
            "blocks",
            format!("{} blocks in one batch; at most {MAX_BLOCKS}", blocks.len()),
        ));
    }
    if rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Err(Error::param(
            "blocks",
            format!("block shape [{rows},{cols}] exceeds 32-bit indices"),
        ));
    }
    for (k, b) in blocks.iter().enumerate() {
        if rows > 1 && cols > b.row_stride {
            return Err(Error::param(
                "blocks",
                format!(
                    "block {k}: {cols} columns but row stride {}: its rows would overlap",
                    b.row_stride
                ),
            ));
        }
        let end = if rows == 0 || cols == 0 {
            Some(b.offset)
        } else {
            (rows - 1)
                .checked_mul(b.row_stride)
                .and_then(|x| x.checked_add(b.offset))
                .and_then(|x| x.checked_add(cols))
        };
        if end.is_none_or(|e| e > len) {
            return Err(Error::param(
                "blocks",
                format!(
                    "block {k} (offset {}, [{rows},{cols}], row stride {}) runs past the arena's {len} elements",
                    b.offset, b.row_stride
                ),
            ));
        }
    }
    Ok(())
}

/// Checks that no two blocks share an element (every element then has one writer per launch):
/// the blocks' row windows sorted by start must not overlap. O(R log R) in the number of rows R.
pub fn check_disjoint(blocks: &[StridedBlock], rows: usize, cols: usize) -> Result<()> {
    if cols == 0 {
        return Ok(());
    }
    let mut rows_of: Vec<(usize, usize)> = blocks
        .iter()
        .enumerate()
        .flat_map(|(k, b)| (0..rows).map(move |r| (b.offset + r * b.row_stride, k)))
        .collect();
    rows_of.sort_unstable();
    for w in rows_of.windows(2) {
        if w[1].0 < w[0].0 + cols {
            return Err(Error::param(
                "blocks",
                format!(
                    "blocks {} and {} overlap (rows at arena offsets {} and {}, {cols} columns); \
                     blocks must be disjoint",
                    w[0].1, w[1].1, w[0].0, w[1].0
                ),
            ));
        }
    }
    Ok(())
}

/// Copies the blocks of `src` into a dense `[n, rows, cols]` batch.
pub fn gather_blocks_reference(
    src: &[f32],
    blocks: &[StridedBlock],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>> {
    check_blocks(blocks, rows, cols, src.len())?;
    let size = rows * cols;
    let mut out = vec![0.0f32; blocks.len() * size];
    if size == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(size).zip(blocks).for_each(|(o, b)| {
        for (r, orow) in o.chunks_mut(cols).enumerate() {
            let s = b.offset + r * b.row_stride;
            orow.copy_from_slice(&src[s..s + cols]);
        }
    });
    Ok(out)
}

/// A batch of same-shape blocks on a device: offsets and row strides (U64).
pub struct BlockTable {
    pub(super) blocks: Vec<StridedBlock>,
    pub(super) rows: usize,
    pub(super) cols: usize,
    device: Option<(Tensor, Tensor)>,
}

impl BlockTable {
    /// Validates the blocks against an arena of `len` elements and uploads them to `backend`.
    pub fn new(
        backend: &Backend,
        blocks: Vec<StridedBlock>,
        rows: usize,
        cols: usize,
        len: usize,
    ) -> Result<BlockTable> {
        check_blocks(&blocks, rows, cols, len)?;
        check_disjoint(&blocks, rows, cols)?;
        let device = if matches!(backend, Backend::Cpu) || blocks.is_empty() {
            None
        } else {
            let offs: Vec<u64> = blocks.iter().map(|b| b.offset as u64).collect();
            let strides: Vec<u64> = blocks.iter().map(|b| b.row_stride as u64).collect();
            Some((
                Tensor::from_slice(backend, &[offs.len()], &offs)?,
                Tensor::from_slice(backend, &[strides.len()], &strides)?,
            ))
        };
        Ok(BlockTable {
            blocks,
            rows,
            cols,
            device,
        })
    }

    pub fn blocks(&self) -> &[StridedBlock] {
        &self.blocks
    }

    /// The block shape `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    pub(super) fn grid(&self) -> [u32; 3] {
        let size = self.rows * self.cols;
        [
            blocks_for(
                size.min(MAX_BLOCKS_PER_MATRIX * THREADS as usize),
                THREADS as usize,
            ),
            self.blocks.len() as u32,
            1,
        ]
    }

    pub(super) fn device_tables(&self, kernel: &str) -> Result<&(Tensor, Tensor)> {
        self.device.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "{kernel}: the block table was built for the cpu device; build it on the launch's device"
            ))
        })
    }
}

/// The table's blocks of `src` (1-D F32) as a dense `[n, rows, cols]` F32 tensor.
pub fn gather_blocks(backend: &Backend, src: &Tensor, table: &BlockTable) -> Result<Tensor> {
    src.expect_rank("src", 1, "[n] (an arena)")?;
    check_arena("src", src, src.numel())?;
    check_blocks(table.blocks(), table.rows, table.cols, src.numel())?;
    let shape = [table.blocks.len(), table.rows, table.cols];
    if let Backend::Cpu = backend {
        let out =
            gather_blocks_reference(src.host_slice()?, table.blocks(), table.rows, table.cols)?;
        return Tensor::from_slice(backend, &shape, &out);
    }
    let out = Tensor::poisoned(backend, &shape, DType::F32)?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let (offs, strides) = table.device_tables("optim_gather_blocks_f32")?;
    // Block (x, y): matrix y, grid-stride over its elements; writes out[y] only.
    backend.launch(
        &Launch::new("optim_gather_blocks_f32", table.grid(), [THREADS, 1, 1])
            .arg_tensor(src)
            .arg_tensor(&out)
            .arg_tensor(offs)
            .arg_tensor(strides)
            .arg_i32(table.rows as i32)
            .arg_i32(table.cols as i32),
    )?;
    Ok(out)
}
