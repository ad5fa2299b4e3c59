#!/usr/bin/env python3
"""Writes configs/demo/gemm_in.safetensors, the input of the README's kernel-runner demo.

Standard library only (no numpy): the safetensors format is an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the raw
little-endian data.

    a[17, 64] f32, b[33, 64] f32, uniform in [-1, 1) from a fixed-seed generator
    (17 and 33 are ragged on purpose: neither is a multiple of a tile size).

    python3 scripts/make-demo-inputs.py [OUT_DIR]     # default: configs/demo
"""

import json
import os
import random
import struct
import sys


def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, shape, list of floats), written as F32 in that order."""
    header = {}
    blobs = []
    offset = 0
    for name, shape, values in tensors:
        count = 1
        for d in shape:
            count *= d
        if len(values) != count:
            raise ValueError(f"{name}: {len(values)} values for shape {shape}")
        blob = struct.pack(f"<{count}f", *values)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)  # align the data to 8 bytes, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def uniform(rng, n):
    # Rounded to f32 by struct.pack; drawn as multiples of 2^-20 so the values are exact in f32.
    return [rng.randrange(-(1 << 20), 1 << 20) / float(1 << 20) for _ in range(n)]


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join("configs", "demo")
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(20260601)
    m, n, k = 17, 33, 64
    path = os.path.join(out_dir, "gemm_in.safetensors")
    write_safetensors(path, [("a", (m, k), uniform(rng, m * k)), ("b", (n, k), uniform(rng, n * k))])
    print(f"wrote {path}: a[{m},{k}] f32, b[{n},{k}] f32")


if __name__ == "__main__":
    main()
