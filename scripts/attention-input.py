#!/usr/bin/env python3
"""Writes a safetensors input for `sluice kernel attention_forward` / `sluice emu profile
attention_forward --in` at any shape: B causal sequences of L tokens, H heads (Hkv = H), head
dim D, bf16 q = k = v filled from one block of 4096 normal draws repeated (the profiler's counts
do not depend on the values; the values are finite). Python standard library only.

    python3 scripts/attention-input.py OUT.safetensors B L H D
    python3 scripts/attention-input.py /tmp/attn_d64.safetensors 8 4096 32 64
"""
import json
import random
import struct
import sys


def usage(message):
    print(f"attention-input.py: {message}", file=sys.stderr)
    sys.exit(2)


def main():
    if len(sys.argv) != 6:
        usage("usage: attention-input.py OUT.safetensors B L H D")
    out = sys.argv[1]
    try:
        b, length, h, d = (int(a) for a in sys.argv[2:])
    except ValueError:
        usage(f"B L H D must be integers, got {sys.argv[2:]}")
    if min(b, length, h, d) < 1:
        usage("B, L, H and D must be at least 1")
    t = b * length
    rng = random.Random(1)
    block = b"".join(struct.pack("<f", rng.gauss(0.0, 1.0))[2:4] for _ in range(4096))
    n = t * h * d * 2
    data = (block * (n // len(block) + 1))[:n]
    cu = struct.pack(f"<{b + 1}i", *[length * i for i in range(b + 1)])
    tensors = [("q", data, [t, h, d], "BF16"), ("k", data, [t, h, d], "BF16"),
               ("v", data, [t, h, d], "BF16"), ("cu_seqlens", cu, [b + 1], "I32")]
    header, offset = {"__metadata__": {"causal": "true"}}, 0
    for name, payload, shape, dtype in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(payload)]}
        offset += len(payload)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, payload, _, _ in tensors:
            f.write(payload)
    print(f"{out}: q, k, v [{t}, {h}, {d}] bf16, cu_seqlens [{b + 1}] ({b} x {length} tokens)")


if __name__ == "__main__":
    main()
