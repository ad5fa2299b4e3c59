// Token embedding: out[t,:] = table[tokens[t],:] for table[V,d], tokens[T] (I32).
// Backward: dtable[v,:] = sum over the positions t with tokens[t] == v, in ascending t, of
// dout[t,:]; rows of tokens that never occur are 0.
//
// Determinism without atomics: the host validates the tokens (0 <= token < V, an error naming
// `tokens` otherwise) and builds a stable counting sort of the positions by token id: order[T]
// (positions grouped by token, ascending inside each group) and offsets[V+1] (group bounds).
// Then one thread owns one (v, column) of dtable and adds its group's rows in ascending
// position order, so every element has one fixed summation order and one writer.
//
// Kernels
//   embedding_forward_{f32,bf16}   grid-stride, one thread per output element
//   embedding_backward_{f32,bf16}  grid (V, ceil(d / 128)), block 128: column j of row v

#include <cuda_bf16.h>
#include "common/block_reduce.cuh"
#include <stdint.h>

namespace embedding_impl {

constexpr int BACKWARD_THREADS = 128;

using sluice::load;

template <typename T>
__device__ __forceinline__ void forward(const T* __restrict__ table, const int* __restrict__ tokens,
                                        float* __restrict__ out, int rows, int vocab, int d) {
    const long long n = (long long)rows * d;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long t = i / d;
        const int j = (int)(i % d);
        const int token = tokens[t];
        // The host rejected out-of-range tokens before the launch; the guard only keeps a
        // caller that skipped validation from reading outside the table (it writes NaN).
        out[i] = (token >= 0 && token < vocab) ? load(table, (long long)token * d + j) : __int_as_float(0x7fffffff);
    }
}

template <typename T>
__device__ __forceinline__ void backward(const T* __restrict__ dout, const int* __restrict__ order,
                                         const int* __restrict__ offsets,
                                         float* __restrict__ dtable, int d) {
    const long long v = blockIdx.x;
    const int j = blockIdx.y * BACKWARD_THREADS + threadIdx.x;
    if (j >= d) return;
    const int k0 = offsets[v];
    const int k1 = offsets[v + 1];
    float acc = 0.0f;
    for (int k = k0; k < k1; ++k) acc += load(dout, (long long)order[k] * d + j);
    dtable[v * d + j] = acc;
}

}  // namespace embedding_impl

extern "C" __global__ void __launch_bounds__(256) embedding_forward_f32(const float* __restrict__ table, const int* __restrict__ tokens, float* __restrict__ out, int rows, int vocab, int d) {
    embedding_impl::forward(table, tokens, out, rows, vocab, d);
}

extern "C" __global__ void __launch_bounds__(256) embedding_forward_bf16(const __nv_bfloat16* __restrict__ table, const int* __restrict__ tokens, float* __restrict__ out, int rows, int vocab, int d) {
    embedding_impl::forward(table, tokens, out, rows, vocab, d);
}

extern "C" __global__ void __launch_bounds__(128) embedding_backward_f32(const float* __restrict__ dout, const int* __restrict__ order, const int* __restrict__ offsets, float* __restrict__ dtable, int d) {
    embedding_impl::backward(dout, order, offsets, dtable, d);
}

extern "C" __global__ void __launch_bounds__(128) embedding_backward_bf16(const __nv_bfloat16* __restrict__ dout, const int* __restrict__ order, const int* __restrict__ offsets, float* __restrict__ dtable, int d) {
    embedding_impl::backward(dout, order, offsets, dtable, d);
}
