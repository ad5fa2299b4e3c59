#!/usr/bin/env python3
"""numpy peer of the CPU is_gate_loss bench (benches/policy.rs): the same shape (N=256,
V=32768, f32), the same work: log_softmax + gather + ratio + dis gate + mask + backward
(d loss / d logits). Prints ms per call and effective GB/s for 2 reads + 1 write of the logits.

Run in a throwaway venv:  python3 -m venv /tmp/np && /tmp/np/bin/pip install numpy
                          env -u OPENBLAS_CORETYPE /tmp/np/bin/python scripts/bench-numpy-policy.py
"""
import time

import numpy as np

N, V = 256, 32768
EPS_LOW, EPS_HIGH = 0.2, 0.28


def is_gate_loss_dis(logits, tokens, behavior_logp, advantages, mask):
    m = logits.max(axis=1, keepdims=True)
    shifted = logits - m
    lse = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    logp_all = shifted - lse  # log_softmax
    logp = logp_all[np.arange(N), tokens]  # gather
    ratio = np.exp(logp - behavior_logp)
    inside = (ratio > 1 - EPS_LOW) & (ratio < 1 + EPS_HIGH)
    w = np.where(inside, ratio, 0.0).astype(np.float32)
    d = max(mask.sum(), 1.0)
    loss = -(mask * w * advantages * logp).sum() / d
    # backward: d loss / d logits = coef * (onehot - softmax)
    coef = (-(mask * w * advantages) / d).astype(np.float32)
    grad = np.exp(logp_all)
    grad *= -coef[:, None]
    grad[np.arange(N), tokens] += coef
    return loss, grad, logp, ratio, inside & (mask != 0)


def main():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((N, V)) * 2).astype(np.float32)
    tokens = rng.integers(0, V, N)
    behavior = (-rng.random(N) * 12).astype(np.float32)
    adv = rng.standard_normal(N).astype(np.float32)
    mask = np.ones(N, dtype=np.float32)
    is_gate_loss_dis(logits, tokens, behavior, adv, mask)
    iters = 10
    t = time.perf_counter()
    for _ in range(iters):
        is_gate_loss_dis(logits, tokens, behavior, adv, mask)
    s = (time.perf_counter() - t) / iters
    gbytes = 3 * N * V * 4 / 1e9
    print(f"numpy is_gate_loss dis N={N} V={V} F32: {s * 1e3:.2f} ms, {gbytes / s:.1f} GB/s effective "
          f"(numpy {np.__version__})")


if __name__ == "__main__":
    main()
