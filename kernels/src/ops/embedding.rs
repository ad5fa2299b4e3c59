//! Token embedding lookup and its deterministic backward (kernels in kernels/cuda/embedding.cu).
//!
//! Forward: out[t,:] = table[tokens[t],:] for table[V,d] (F32 or BF16), tokens[T] I32; out F32.
//! Backward: dtable[v,:] = sum over positions t with tokens[t] == v, in ascending t, of
//! dout[t,:]; rows of unused ids are 0. dtable is F32.
//!
//! Tokens are validated on the host (0 <= token < V; otherwise an error naming `tokens`, the
//! position and the value) where they live there, and on a device in debug mode
//! ([`crate::debug`]: one small device-to-host copy of T int32 values); otherwise the caller
//! checked them where it built them. The backward needs the tokens on the host for its sort:
//! [`embedding_backward_host`] takes the caller's host copy, [`embedding_backward`] downloads
//! them.
//!
//! No atomics: [`counting_sort`] (host, O(T + V)) groups the positions by token id, stable
//! (ascending positions inside each group); then one GPU thread owns one (v, column) element of
//! dtable and adds its group's rows in that order. The CPU reference does the same additions in
//! the same order, so cpu and emu/cuda agree bit for bit on f32 inputs.

use super::elementwise::{
    as_i32, by_dtype, ew_blocks, float_dtype, host_tensor, rows_cols, EW_THREADS, FLOAT,
};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;

/// Threads per block of embedding_backward_* (its grid is (V, ceil(d / 128))).
const BACKWARD_THREADS: usize = 128;

/// Checks every token is in [0, vocab).
pub fn validate_tokens(tokens: &[i32], vocab: usize) -> Result<()> {
    if let Some((t, &tok)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &tok)| tok < 0 || tok as i64 >= vocab as i64)
    {
        return Err(Error::Invalid(format!(
            "`tokens`[{t}] = {tok} is outside the vocabulary [0, {vocab})"
        )));
    }
    Ok(())
}

/// Stable counting sort of positions by token id: `(order, offsets)` where the positions of
/// token v are `order[offsets[v]..offsets[v+1]]`, ascending. Tokens must be valid.
pub fn counting_sort(tokens: &[i32], vocab: usize) -> Result<(Vec<i32>, Vec<i32>)> {
    validate_tokens(tokens, vocab)?;
    if i32::try_from(tokens.len()).is_err() {
        return Err(Error::Invalid(format!(
            "`tokens` has {} entries; the embedding kernels index positions with 32-bit ints",
            tokens.len()
        )));
    }
    let mut offsets = vec![0i32; vocab + 1];
    for &tok in tokens {
        offsets[tok as usize + 1] += 1;
    }
    for v in 0..vocab {
        offsets[v + 1] += offsets[v];
    }
    let mut next: Vec<i32> = offsets[..vocab].to_vec();
    let mut order = vec![0i32; tokens.len()];
    for (t, &tok) in tokens.iter().enumerate() {
        let slot = &mut next[tok as usize];
        order[*slot as usize] = t as i32;
        *slot += 1;
    }
    Ok((order, offsets))
}

/// out[t,:] = table[tokens[t],:] for table[vocab, d].
pub fn embedding_reference(
    table: &[f32],
    tokens: &[i32],
    vocab: usize,
    d: usize,
) -> Result<Vec<f32>> {
    if table.len() != vocab * d {
        return Err(Error::Invalid(format!(
            "`table` has {} elements; expected {} ([V,d] = [{vocab},{d}])",
            table.len(),
            vocab * d
        )));
    }
    validate_tokens(tokens, vocab)?;
    let mut out = vec![0.0f32; tokens.len() * d];
    if d > 0 {
        par::rows_mut(&mut out, d, d, |row, o| {
            let v = tokens[row] as usize;
            o.copy_from_slice(&table[v * d..(v + 1) * d]);
        });
    }
    Ok(out)
}

/// dtable[vocab, d] from dout[T, d]: each id's rows added in ascending position order.
pub fn embedding_backward_reference(
    dout: &[f32],
    tokens: &[i32],
    vocab: usize,
    d: usize,
) -> Result<Vec<f32>> {
    if dout.len() != tokens.len() * d {
        return Err(Error::Invalid(format!(
            "`dout` has {} elements; expected {} ([T,d] = [{},{d}])",
            dout.len(),
            tokens.len() * d,
            tokens.len()
        )));
    }
    let (order, offsets) = counting_sort(tokens, vocab)?;
    let mut dtable = vec![0.0f32; vocab * d];
    if d > 0 {
        let per_row = (tokens.len() * d).div_ceil(vocab.max(1));
        par::rows_mut(&mut dtable, d, per_row, |v, row| {
            for &t in &order[offsets[v] as usize..offsets[v + 1] as usize] {
                let src = &dout[t as usize * d..(t as usize + 1) * d];
                for (o, s) in row.iter_mut().zip(src) {
                    *o += s;
                }
            }
        });
    }
    Ok(dtable)
}

fn check_tokens(tokens: &Tensor) -> Result<Vec<i32>> {
    check_token_tensor(tokens)?;
    tokens.to_vec::<i32>()
}

fn check_token_tensor(tokens: &Tensor) -> Result<()> {
    tokens.expect_dtype("tokens", DType::I32)?;
    tokens.expect_rank("tokens", 1, "[T]")
}

/// Embedding lookup on any device: table[V,d] (F32 or BF16), tokens[T] I32 -> out[T,d] F32.
pub fn embedding(backend: &Backend, table: &Tensor, tokens: &Tensor) -> Result<Tensor> {
    let dtype = float_dtype(&[("table", table)])?;
    let (vocab, d) = rows_cols("table", table, "[V,d]")?;
    check_token_tensor(tokens)?;
    let t = tokens.numel();
    // The ids are checked on the host where they live there, and on a device in debug mode
    // (a copy and a sync); otherwise whoever built them checked them (the model's batches, the
    // engine's sampled rows).
    let host_tokens = if crate::debug::reads_back(tokens) {
        let host = tokens.to_vec::<i32>()?;
        validate_tokens(&host, vocab)?;
        host
    } else {
        Vec::new()
    };
    if let Backend::Cpu = backend {
        let out = embedding_reference(&table.f32_data()?, &host_tokens, vocab, d)?;
        return host_tensor(backend, &[t, d], out);
    }
    let out = Tensor::poisoned(backend, &[t, d], DType::F32)?;
    let n = t * d;
    if n > 0 {
        // Grid-stride over T*d outputs; reads table rows of validated ids only.
        backend.launch(
            &Launch::new(
                by_dtype(dtype, "embedding_forward_f32", "embedding_forward_bf16"),
                [ew_blocks(n), 1, 1],
                [EW_THREADS, 1, 1],
            )
            .arg_tensor(table)
            .arg_tensor(tokens)
            .arg_tensor(&out)
            .arg_i32(as_i32("tokens", "T", t)?)
            .arg_i32(as_i32("table", "V", vocab)?)
            .arg_i32(as_i32("table", "d", d)?),
        )?;
    }
    Ok(out)
}

/// Embedding backward on any device: dout[T,d] (F32 or BF16), tokens[T] I32 -> dtable[vocab,d] F32.
pub fn embedding_backward(
    backend: &Backend,
    dout: &Tensor,
    tokens: &Tensor,
    vocab: usize,
) -> Result<Tensor> {
    let host_tokens = check_tokens(tokens)?;
    embedding_backward_host(backend, dout, &host_tokens, vocab)
}

/// [`embedding_backward`] from the token ids in host memory (the caller's copy of what it
/// uploaded), so nothing is read back from the device: the ids are sorted by value on the host
/// for the kernel's one-writer-per-row schedule.
pub fn embedding_backward_host(
    backend: &Backend,
    dout: &Tensor,
    host_tokens: &[i32],
    vocab: usize,
) -> Result<Tensor> {
    let dtype = float_dtype(&[("dout", dout)])?;
    let t = host_tokens.len();
    dout.expect_rank("dout", 2, "[T,d]")?;
    if dout.shape()[0] != t {
        return Err(Error::shape(
            "dout",
            format!("[{t},d] (T = the length of tokens)"),
            dout.shape(),
        ));
    }
    let d = dout.shape()[1];
    if let Backend::Cpu = backend {
        let dtable = embedding_backward_reference(&dout.f32_data()?, host_tokens, vocab, d)?;
        return host_tensor(backend, &[vocab, d], dtable);
    }
    let (order, offsets) = counting_sort(host_tokens, vocab)?;
    let dtable = Tensor::poisoned(backend, &[vocab, d], DType::F32)?;
    if vocab == 0 || d == 0 {
        return Ok(dtable);
    }
    let col_blocks = blocks_for(d, BACKWARD_THREADS);
    if col_blocks > 65535 || vocab > i32::MAX as usize {
        return Err(Error::param(
            "vocab",
            format!("V = {vocab}, d = {d} exceed the kernel's grid (V < 2^31, d <= 8388480)"),
        ));
    }
    let order = Tensor::from_slice(backend, &[t.max(1)], &if t == 0 { vec![0] } else { order })?;
    let offsets = Tensor::from_slice(backend, &[vocab + 1], &offsets)?;
    // Block (v, column block): one writer per dtable element; reads the rows of v's positions.
    backend.launch(
        &Launch::new(
            by_dtype(dtype, "embedding_backward_f32", "embedding_backward_bf16"),
            [vocab as u32, col_blocks, 1],
            [BACKWARD_THREADS as u32, 1, 1],
        )
        .arg_tensor(dout)
        .arg_tensor(&order)
        .arg_tensor(&offsets)
        .arg_tensor(&dtable)
        .arg_i32(as_i32("dout", "d", d)?),
    )?;
    Ok(dtable)
}

fn run_forward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    Ok(vec![(
        "out",
        embedding(backend, call.tensor("table")?, call.tensor("tokens")?)?,
    )])
}

fn run_backward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let vocab = call.param_usize("vocab")?;
    Ok(vec![(
        "dtable",
        embedding_backward(backend, call.tensor("dout")?, call.tensor("tokens")?, vocab)?,
    )])
}

/// `sluice kernel embedding`.
pub static SPEC: OpSpec = OpSpec {
    name: "embedding",
    summary: "out[t] = table[tokens[t]] (tokens checked to lie in [0, V))",
    inputs: &[
        TensorSpec {
            name: "table",
            shape: "[V,d]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "tokens",
            shape: "[T]",
            dtypes: "I32",
        },
    ],
    params: &[],
    outputs: &[TensorSpec {
        name: "out",
        shape: "[T,d]",
        dtypes: "F32",
    }],
    run: run_forward,
};

/// `sluice kernel embedding_backward`.
pub static BACKWARD_SPEC: OpSpec = OpSpec {
    name: "embedding_backward",
    summary: "dtable[v] = sum of dout[t] over tokens[t] == v, ascending t (sorted, no atomics)",
    inputs: &[
        TensorSpec {
            name: "dout",
            shape: "[T,d]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "tokens",
            shape: "[T]",
            dtypes: "I32",
        },
    ],
    params: &[ParamSpec {
        name: "vocab",
        default: None,
        help: "V, the number of rows of dtable",
    }],
    outputs: &[TensorSpec {
        name: "dtable",
        shape: "[V,d]",
        dtypes: "F32",
    }],
    run: run_backward,
};
