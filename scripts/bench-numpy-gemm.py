#!/usr/bin/env python3
"""numpy/OpenBLAS f32 GEMM GFLOP/s at 512^3 and 1024^3: the CPU peer of `cargo bench --bench gemm`.

Computes C = A @ B.T with A [s,s], B [s,s] float32 (the same linear-layer form as sluice's
gemm), best of several runs after a warm-up, and prints which BLAS and kernel numpy runs.

Needs numpy (and optionally threadpoolctl) in any Python; nothing in sluice depends on it:
    python3 -m venv /tmp/npvenv && /tmp/npvenv/bin/pip install numpy threadpoolctl
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /tmp/npvenv/bin/python scripts/bench-numpy-gemm.py
(On machines that set OPENBLAS_CORETYPE for old OpenBLAS builds, unset it for this command only,
or numpy runs a slower generic kernel; see the header it prints.)
"""
import os
import time

import numpy as np


def describe_blas() -> str:
    try:
        from threadpoolctl import threadpool_info

        infos = [
            f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture')}, "
            f"{i.get('num_threads')} threads)"
            for i in threadpool_info()
            if i.get("user_api") == "blas"
        ]
        return "; ".join(infos) or "unknown BLAS"
    except ImportError:
        return "threadpoolctl not installed"


def bench(s: int, reps: int) -> float:
    rng = np.random.default_rng(s)
    a = rng.standard_normal((s, s), dtype=np.float32)
    b = rng.standard_normal((s, s), dtype=np.float32)
    c = a @ b.T  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        c = a @ b.T
        best = min(best, time.perf_counter() - t)
    assert c.dtype == np.float32
    return best


def main() -> None:
    print(f"numpy {np.__version__}; BLAS: {describe_blas()}")
    print(
        "OPENBLAS_CORETYPE="
        + os.environ.get("OPENBLAS_CORETYPE", "(unset)")
        + " OPENBLAS_L2_SIZE="
        + os.environ.get("OPENBLAS_L2_SIZE", "(unset)")
    )
    for s, reps in ((512, 30), (1024, 10)):
        t = bench(s, reps)
        print(f"gemm numpy f32 {s}^3: best {t * 1e3:.2f} ms = {2 * s**3 / t / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
