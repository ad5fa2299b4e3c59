#!/usr/bin/env python3
"""The XLA peer of sluice's CPU path (issue 16): the same MoE transformer in JAX, compiled by
XLA for the CPU, run on sluice's own weights, to time beside sluice's benches.

It reads a sluice model TOML (configs/model/*.toml) and a sluice checkpoint (safetensors, the
tensor names of model/src/layout.rs) and runs:

- `decode`: one decode step with a KV cache for B sequences (B = 1, 4, 16, 64 by default), in
  four MoE forms: `dense` (every expert on every token as einsums over the stored weights,
  gates zero outside the top-k: 4x the expert FLOPs of top-2 of 8), `dense_flat` (the same
  dense MoE as three plain matmuls on expert weights laid out once for it, the gates folded
  into the hidden activations), `topk` (each token's k experts' weights gathered: the same
  expert FLOPs as sluice) and `blocksparse` (below). Same shape as sluice's rollout bench:
  16-token prompts already in the cache, then steps decoding one token per sequence.
- `train`: one compiled training step of the supervised loss on 32 x 64 tokens: forward,
  backward (jax.grad) and the optimizer sluice uses (global-norm clipping, AdamW on the
  embedding, LM head, router and norm scales; Muon with Nesterov momentum on the matrices,
  each attention head's block and each expert's matrix orthogonalised on its own by 5
  Newton-Schulz steps, update scale 0.2 sqrt(max(rows, cols)), decoupled weight decay).
  MoE forms `dense` (as above), `ragged` (tokens sorted by expert, jax.lax.ragged_dot) and
  `blocksparse` (MegaBlocks' layout: token-slots sorted by expert, each expert's segment
  padded to whole blocks of `block_rows` rows, one batched matmul over the blocks with each
  block's expert weights, the rows scattered back; XLA runs it about 3x faster than the
  others here). `--forms dense_flat` also trains (its layouts made inside the step).
- `check`: the loss and gradient norm of a batch that sluice exported (see
  model/benches/train_step.rs, SLUICE_PEER_DIR) against sluice's own figures, so the timed
  programs are the same model, and every gradient tensor of the other forms against the
  dense form's; and the decode logits of every form against the full forward.

It makes its own virtual environment (.venv-xla/ at the repository root, jax[cpu] pinned
below) on first use and re-runs itself there. Nothing in sluice's tests needs it;
scripts/compare-xla.py drives it.

Usage:
  python3 scripts/peer-xla.py check  --model configs/model/small.toml --dir DIR
  python3 scripts/peer-xla.py decode --model configs/model/small.toml --checkpoint F [--batches 1,4,16,64]
  python3 scripts/peer-xla.py train  --model configs/model/small.toml --checkpoint F
  (decode and train: [--forms A,B] [--reps N] [--block ROWS])
Timings print as JSON lines: {"what": ..., "form": ..., "batch": ..., "ms": median, ...}.
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import time

JAX_PIN = "jax[cpu]==0.10.2"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv-xla")


def ensure_venv():
    """Re-runs this script inside .venv-xla (made, with JAX_PIN installed, when missing)."""
    py = os.path.join(VENV, "bin", "python")
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        return
    if not os.path.exists(py):
        print(f"peer-xla: creating {VENV} with {JAX_PIN}", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "venv", VENV])
        subprocess.check_call([py, "-m", "pip", "install", "-q", JAX_PIN])
    os.execv(py, [py, os.path.abspath(__file__)] + sys.argv[1:])


def die(msg):
    print(f"peer-xla: {msg}", file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------------------------------------
# sluice's files


def load_config(path):
    import tomllib

    with open(path, "rb") as f:
        c = tomllib.load(f)
    need = ["vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts",
            "top_k", "expert_ffn_dim"]
    for key in need:
        if key not in c:
            die(f"{path}: missing key `{key}`")
    c.setdefault("dense_first_layer", False)
    c.setdefault("shared_expert", False)
    c.setdefault("rope_theta", 10000.0)
    c.setdefault("norm_eps", 1e-5)
    c.setdefault("score_fn", "softmax")
    c.setdefault("renorm", True)
    if c["dense_first_layer"]:
        c.setdefault("dense_ffn_dim", c["top_k"] * c["expert_ffn_dim"])
    if c["shared_expert"]:
        c.setdefault("shared_expert_ffn_dim", c["expert_ffn_dim"])
    return c


def read_safetensors(path):
    """{name: numpy array} and the metadata of a safetensors file (F32 and I32 only)."""
    import numpy as np

    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        die(f"{path}: not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n:]
    out = {}
    kinds = {"F32": np.float32, "I32": np.int32}
    for name, spec in header.items():
        if spec["dtype"] not in kinds:
            die(f"{path}: tensor `{name}` is {spec['dtype']}; the peer reads F32 and I32")
        a, b = spec["data_offsets"]
        arr = np.frombuffer(body[a:b], dtype=kinds[spec["dtype"]]).reshape(spec["shape"])
        out[name] = arr.copy()
    return out, meta


def load_params(cfg, path):
    """The parameters as a dict of jax arrays, checked against the config's shapes."""
    import jax.numpy as jnp

    tensors, meta = read_safetensors(path)
    if meta.get("sluice.format") != "sluice-checkpoint":
        die(f"{path}: not a sluice checkpoint (metadata sluice.format)")
    d, e, f = cfg["d_model"], cfg["n_experts"], cfg["expert_ffn_dim"]
    qd, kvd = cfg["n_heads"] * cfg["head_dim"], cfg["n_kv_heads"] * cfg["head_dim"]
    want = {"embed.weight": (cfg["vocab"], d), "final_norm.scale": (d,),
            "lm_head.weight": (cfg["vocab"], d)}
    for l in range(cfg["n_layers"]):
        p = f"layers.{l}."
        want.update({p + "attn_norm.scale": (d,), p + "attn.wq": (qd, d), p + "attn.wk": (kvd, d),
                     p + "attn.wv": (kvd, d), p + "attn.wo": (d, qd), p + "ffn_norm.scale": (d,)})
        if cfg["dense_first_layer"] and l == 0:
            fd = cfg["dense_ffn_dim"]
            want.update({p + "ffn.w1": (fd, d), p + "ffn.w3": (fd, d), p + "ffn.w2": (d, fd)})
        else:
            want.update({p + "moe.router": (e, d), p + "moe.w1": (e, f, d),
                         p + "moe.w3": (e, f, d), p + "moe.w2": (e, d, f)})
            if cfg["shared_expert"]:
                fs = cfg["shared_expert_ffn_dim"]
                want.update({p + "moe.shared.w1": (fs, d), p + "moe.shared.w3": (fs, d),
                             p + "moe.shared.w2": (d, fs)})
    params = {}
    for name, shape in want.items():
        if name not in tensors:
            die(f"{path}: tensor `{name}` is missing")
        if tuple(tensors[name].shape) != shape:
            die(f"{path}: tensor `{name}` has shape {list(tensors[name].shape)}, expected {list(shape)}")
        params[name] = jnp.asarray(tensors[name])
    return params


# ---------------------------------------------------------------------------------------------
# The model (the same math as model/src/layers.rs and the kernels' CPU references)


# Rows per block of the block-sparse form: BLOCK_ROWS when set (--block), else the power of two
# at or below S / (2 E) for S token-slots and E experts, clamped to [8, 128]: about two blocks
# per expert's share, so the padding (under E blocks) stays a bounded part of the work at
# decode's small batches and train's large ones.
BLOCK_ROWS = 0


def block_rows(slots, experts):
    if BLOCK_ROWS:
        return BLOCK_ROWS
    target = max(1, slots // (2 * experts))
    return min(128, max(8, 1 << (target.bit_length() - 1)))


def make_model(cfg):
    import jax
    import jax.numpy as jnp
    import numpy as np

    d, H, Hkv, D = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    E, K = cfg["n_experts"], cfg["top_k"]
    eps = float(cfg["norm_eps"])
    scale = 1.0 / np.sqrt(D)
    # RoPE frequencies in f64, rounded to f32 (kernels/src/ops/rope.rs), half-split pairing.
    inv_freq = jnp.asarray((float(cfg["rope_theta"]) ** (-2.0 * np.arange(D // 2) / D)).astype(np.float32))

    def rmsnorm(x, w):
        r = 1.0 / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
        return x * r * w

    def rope(x, pos):  # x [..., heads, D], pos [...] int
        ang = pos.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
        c, s = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    def swiglu(h, w1, w3, w2):
        u, g = h @ w1.T, h @ w3.T
        return (jax.nn.silu(u) * g) @ w2.T

    def gates(p, l, h):  # h [N, d] -> (gate [N, K], idx [N, K])
        logits = h @ p[f"layers.{l}.moe.router"].T
        probs = jax.nn.softmax(logits, axis=-1) if cfg["score_fn"] == "softmax" else jax.nn.sigmoid(logits)
        kept, idx = jax.lax.top_k(probs, K)  # ties to the lower index, as sluice's topk
        if cfg["renorm"]:
            kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
        return kept, idx

    def moe_dense(p, l, h):
        gate, idx = gates(p, l, h)
        full = jnp.zeros((h.shape[0], E), h.dtype).at[jnp.arange(h.shape[0])[:, None], idx].set(gate)
        w1, w3, w2 = p[f"layers.{l}.moe.w1"], p[f"layers.{l}.moe.w3"], p[f"layers.{l}.moe.w2"]
        u = jnp.einsum("nd,efd->enf", h, w1)
        g = jnp.einsum("nd,efd->enf", h, w3)
        y = jnp.einsum("enf,edf->end", jax.nn.silu(u) * g, w2)
        return jnp.einsum("end,ne->nd", y, full)

    def moe_dense_flat(p, l, h):
        # The same dense MoE as three plain matmuls on weights laid out for it once, outside the
        # step (`inference_layout`): u = h W1cat [n, E*f], the gates folded into the hidden
        # before W2cat [E*f, d] (y = sum_e gate_e s_e W2_e^T = (gate * s) W2cat).
        # In a train step the layouts are made from the stored weights inside the step (three
        # transposes per layer, which the gradient flows back through).
        gate, idx = gates(p, l, h)
        n = h.shape[0]
        full = jnp.zeros((n, E), h.dtype).at[jnp.arange(n)[:, None], idx].set(gate)
        cat = p if f"layers.{l}.moe.w1cat" in p else flat_layout(p, l)
        u = h @ cat[f"layers.{l}.moe.w1cat"]
        g = h @ cat[f"layers.{l}.moe.w3cat"]
        s = (jax.nn.silu(u) * g).reshape(n, E, -1) * full[:, :, None]
        return s.reshape(n, -1) @ cat[f"layers.{l}.moe.w2cat"]

    def moe_topk_gather(p, l, h):
        gate, idx = gates(p, l, h)
        w1, w3, w2 = (p[f"layers.{l}.moe.{w}"][idx] for w in ("w1", "w3", "w2"))  # [N,K,...]
        u = jnp.einsum("nd,nkfd->nkf", h, w1)
        g = jnp.einsum("nd,nkfd->nkf", h, w3)
        y = jnp.einsum("nkf,nkdf->nkd", jax.nn.silu(u) * g, w2)
        return jnp.einsum("nkd,nk->nd", y, gate)

    def moe_topk_ragged(p, l, h):
        # Token-slots sorted by expert (stable), one grouped matmul per weight (ragged_dot).
        gate, idx = gates(p, l, h)
        n = h.shape[0]
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        xs = h[order // K]
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        w1, w3, w2 = p[f"layers.{l}.moe.w1"], p[f"layers.{l}.moe.w3"], p[f"layers.{l}.moe.w2"]
        u = jax.lax.ragged_dot(xs, jnp.swapaxes(w1, 1, 2), sizes)
        g = jax.lax.ragged_dot(xs, jnp.swapaxes(w3, 1, 2), sizes)
        ye = jax.lax.ragged_dot(jax.nn.silu(u) * g, jnp.swapaxes(w2, 1, 2), sizes)
        y_slots = jnp.zeros((n * K, d), h.dtype).at[order].set(ye).reshape(n, K, d)
        return jnp.einsum("nkd,nk->nd", y_slots, gate)

    def moe_blocksparse(p, l, h):
        # Block-sparse (the MegaBlocks layout): token-slots sorted by expert (stable), each
        # expert's segment padded to a multiple of `bk` rows, gathered into [blocks, bk, d]; one
        # batched matmul per weight with each block's expert matrix, then each slot's row
        # gathered back and combined with its gate in slot order. Shapes are static: at most
        # min(S/bk + E, S) blocks hold a slot (the sum over experts of ceil(size/bk), and no
        # block is empty); the zero rows of padded and unused blocks are the form's waste.
        gate, idx = gates(p, l, h)
        n = h.shape[0]
        S = n * K
        bk = block_rows(S, E)
        nb = min(S // bk + E, S)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # sorted rank -> slot
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        padded = (sizes + bk - 1) // bk * bk
        start = jnp.cumsum(sizes) - sizes
        pend = jnp.cumsum(padded)
        e_sorted = flat[order]
        dest = (pend - padded)[e_sorted] + jnp.arange(S, dtype=jnp.int32) - start[e_sorted]
        row_slot = jnp.full((nb * bk,), S, jnp.int32).at[dest].set(order.astype(jnp.int32))
        valid = row_slot < S
        xb = jnp.where(valid[:, None], h[jnp.where(valid, row_slot // K, 0)], 0.0)
        xb = xb.reshape(nb, bk, d)
        block_e = jnp.minimum(jnp.searchsorted(pend, jnp.arange(nb) * bk, side="right"), E - 1)
        w1, w3, w2 = (p[f"layers.{l}.moe.{w}"][block_e] for w in ("w1", "w3", "w2"))
        u = jnp.einsum("bnd,bfd->bnf", xb, w1)
        g = jnp.einsum("bnd,bfd->bnf", xb, w3)
        y = jnp.einsum("bnf,bdf->bnd", jax.nn.silu(u) * g, w2).reshape(nb * bk, d)
        slot_row = jnp.zeros((S,), jnp.int32).at[order].set(dest)
        return jnp.einsum("nkd,nk->nd", y[slot_row].reshape(n, K, d), gate)

    def ffn(p, l, h, form):
        if cfg["dense_first_layer"] and l == 0:
            return swiglu(h, p["layers.0.ffn.w1"], p["layers.0.ffn.w3"], p["layers.0.ffn.w2"])
        forms = {"dense": moe_dense, "dense_flat": moe_dense_flat, "topk": moe_topk_gather,
                 "ragged": moe_topk_ragged, "blocksparse": moe_blocksparse}
        y = forms[form](p, l, h)
        if cfg["shared_expert"]:
            pre = f"layers.{l}.moe.shared."
            y = y + swiglu(h, p[pre + "w1"], p[pre + "w3"], p[pre + "w2"])
        return y

    def qkv(p, l, x, pos):  # x [N, d], pos [N]
        pre = f"layers.{l}."
        h = rmsnorm(x, p[pre + "attn_norm.scale"])
        q = (h @ p[pre + "attn.wq"].T).reshape(-1, H, D)
        k = (h @ p[pre + "attn.wk"].T).reshape(-1, Hkv, D)
        v = (h @ p[pre + "attn.wv"].T).reshape(-1, Hkv, D)
        return rope(q, pos), rope(k, pos), v

    def attend(q, k, v, mask):  # q [B,S,H,D], k/v [B,L,Hkv,D], mask [B,S,L]
        k = jnp.repeat(k, H // Hkv, axis=2)
        v = jnp.repeat(v, H // Hkv, axis=2)
        s = jnp.einsum("bshd,blhd->bhsl", q, k) * scale
        s = jnp.where(mask[:, None], s, -jnp.inf)
        return jnp.einsum("bhsl,blhd->bshd", jax.nn.softmax(s, axis=-1), v)

    def logits_fn(p, tokens, form):  # tokens [B, S] -> logits [B, S, V] (causal per row)
        B, S = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(S), (B, S)).reshape(-1)
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((S, S), bool)), (B, S, S))
        x = p["embed.weight"][tokens.reshape(-1)]
        for l in range(cfg["n_layers"]):
            q, k, v = qkv(p, l, x, pos)
            o = attend(q.reshape(B, S, H, D), k.reshape(B, S, Hkv, D), v.reshape(B, S, Hkv, D), mask)
            x = x + o.reshape(B * S, H * D) @ p[f"layers.{l}.attn.wo"].T
            h = rmsnorm(x, p[f"layers.{l}.ffn_norm.scale"])
            x = x + ffn(p, l, h, form)
        return (rmsnorm(x, p["final_norm.scale"]) @ p["lm_head.weight"].T).reshape(B, S, -1)

    def loss_fn(p, tokens, targets, mask, form):
        lp = jax.nn.log_softmax(logits_fn(p, tokens, form), axis=-1)
        nll = -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    def decode_step(p, cache_k, cache_v, tokens, pos, form):
        # tokens [B], pos [B] (each sequence's position = its cached keys); caches
        # [L, B, MAXLEN, Hkv, D]. Writes the new K/V at pos, attends over keys 0..pos.
        B = tokens.shape[0]
        maxlen = cache_k.shape[2]
        rows = jnp.arange(B)
        mask = (jnp.arange(maxlen)[None, :] <= pos[:, None])[:, None, :]  # [B, 1, MAXLEN]
        x = p["embed.weight"][tokens]
        for l in range(cfg["n_layers"]):
            q, k, v = qkv(p, l, x, pos)
            cache_k = cache_k.at[l, rows, pos].set(k)
            cache_v = cache_v.at[l, rows, pos].set(v)
            o = attend(q[:, None], cache_k[l], cache_v[l], mask)
            x = x + o.reshape(B, H * D) @ p[f"layers.{l}.attn.wo"].T
            h = rmsnorm(x, p[f"layers.{l}.ffn_norm.scale"])
            x = x + ffn(p, l, h, form)
        logits = rmsnorm(x, p["final_norm.scale"]) @ p["lm_head.weight"].T
        return logits, cache_k, cache_v

    return logits_fn, loss_fn, decode_step


def flat_layout(params, l):
    """The dense-flat form's expert weights of MoE layer `l`: w1cat/w3cat [d, E*f] and w2cat
    [E*f, d]."""
    import jax.numpy as jnp

    pre = f"layers.{l}.moe."
    e, f, d = params[pre + "w1"].shape
    return {pre + "w1cat": jnp.transpose(params[pre + "w1"], (2, 0, 1)).reshape(d, e * f),
            pre + "w3cat": jnp.transpose(params[pre + "w3"], (2, 0, 1)).reshape(d, e * f),
            pre + "w2cat": jnp.transpose(params[pre + "w2"], (0, 2, 1)).reshape(e * f, d)}


def inference_layout(cfg, params):
    """The parameters plus the dense-flat form's expert weights, laid out once (decode only)."""
    p = dict(params)
    for l in range(cfg["n_layers"]):
        if f"layers.{l}.moe.w1" in p:
            p.update(flat_layout(params, l))
    return p


# ---------------------------------------------------------------------------------------------
# The optimizer (model/src/optim: clipping, AdamW, Muon with the per-head / per-expert split)

NS = (3.4445, -4.7750, 2.0315)


def muon_blocks(cfg, name, x):
    """The blocks Muon orthogonalises separately (a [n, r, c] stack) and the inverse map."""
    import jax.numpy as jnp

    D = cfg["head_dim"]
    if name.endswith(("attn.wq", "attn.wk", "attn.wv")):  # heads own rows
        h = x.shape[0] // D
        return x.reshape(h, D, x.shape[1]), lambda b: b.reshape(x.shape)
    if name.endswith("attn.wo"):  # heads own columns
        h = x.shape[1] // D
        blocks = jnp.transpose(x.reshape(x.shape[0], h, D), (1, 0, 2))
        return blocks, lambda b: jnp.transpose(b, (1, 0, 2)).reshape(x.shape)
    if x.ndim == 3:  # per expert
        return x, lambda b: b
    return x[None], lambda b: b[0]


def is_adamw(name):
    return name.endswith(("embed.weight", "lm_head.weight", "moe.router", ".scale"))


def newton_schulz(g, steps=5):
    import jax.numpy as jnp

    a, b, c = NS
    r, cols = g.shape[-2:]
    x = g / (jnp.sqrt(jnp.sum(g * g, axis=(-2, -1), keepdims=True)) + 1e-7)
    if r > cols:
        x = jnp.swapaxes(x, -1, -2)
    for _ in range(steps):
        A = x @ jnp.swapaxes(x, -1, -2)
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    if r > cols:
        x = jnp.swapaxes(x, -1, -2)
    return x


def make_train_step(cfg, loss_fn, form, lr=3e-3, mu=0.95, wd=0.1, beta1=0.9, beta2=0.95,
                    eps=1e-8, clip=1.0):
    import jax
    import jax.numpy as jnp

    def step(p, m, v, t, tokens, targets, mask):
        loss, g = jax.value_and_grad(loss_fn)(p, tokens, targets, mask, form)
        norm = jnp.sqrt(sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in g.values()))
        cs = jnp.where(norm > clip, clip / (norm + 1e-6), 1.0)
        new_p, new_m, new_v = {}, {}, {}
        bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
        for name, x in p.items():
            gi = cs * g[name]
            if is_adamw(name):
                mi = beta1 * m[name] + (1 - beta1) * gi
                vi = beta2 * v[name] + (1 - beta2) * gi * gi
                decay = wd if x.ndim >= 2 else 0.0
                upd = (mi / bc1) / (jnp.sqrt(vi / bc2) + eps)
                new_p[name] = x * (1 - lr * decay) - lr * upd
                new_m[name], new_v[name] = mi, vi
            else:
                mi = mu * m[name] + gi
                blocks, back = muon_blocks(cfg, name, gi + mu * mi)
                o = back(newton_schulz(blocks))
                r, c = blocks.shape[-2:]
                new_p[name] = x * (1 - lr * wd) - lr * (0.2 * max(r, c) ** 0.5) * o
                new_m[name], new_v[name] = mi, v[name]
        return new_p, new_m, new_v, loss, norm

    return jax.jit(step, donate_argnums=(0, 1, 2))


# ---------------------------------------------------------------------------------------------
# Commands


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2]


def cmd_decode(args, cfg, params):
    import jax
    import jax.numpy as jnp
    import numpy as np

    _, _, decode_step = make_model(cfg)
    params = inference_layout(cfg, params)
    prompt, steps = 16, 64
    maxlen = prompt + steps + 1
    L, Hkv, D = cfg["n_layers"], cfg["n_kv_heads"], cfg["head_dim"]
    for form in args.forms.split(","):
        fn = jax.jit(lambda p, ck, cv, t, pos, f=form: decode_step(p, ck, cv, t, pos, f),
                     donate_argnums=(1, 2))
        for B in [int(b) for b in args.batches.split(",")]:
            rng = np.random.default_rng(B)
            shape = (L, B, maxlen, Hkv, D)
            per_step = []
            for rep in range(args.reps):
                # A cache holding 16 prompt tokens' K/V per sequence (values of the right
                # scale; what is in the cache does not change the work), then `steps` steps.
                ck = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
                cv = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
                tok = jnp.asarray(rng.integers(0, cfg["vocab"], B).astype(np.int32))
                pos0 = prompt
                logits, ck, cv = fn(params, ck, cv, tok, jnp.full((B,), pos0, jnp.int32))
                logits.block_until_ready()
                t0 = time.perf_counter()
                for s in range(1, steps):
                    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                    logits, ck, cv = fn(params, ck, cv, tok, jnp.full((B,), pos0 + s, jnp.int32))
                logits.block_until_ready()
                per_step.append((time.perf_counter() - t0) / (steps - 1) * 1e3)
            print(json.dumps({"what": "decode", "form": form, "batch": B, "ms": median(per_step),
                              "runs_ms": per_step}), flush=True)


def train_batch(cfg, seqs=32, length=64, seed=1):
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg["vocab"], (seqs, length)).astype(np.int32)
    targets = rng.integers(0, cfg["vocab"], (seqs, length)).astype(np.int32)
    return tokens, targets, np.ones((seqs, length), np.float32)


def cmd_train(args, cfg, params):
    import jax
    import jax.numpy as jnp

    _, loss_fn, _ = make_model(cfg)
    tokens, targets, mask = (jnp.asarray(a) for a in train_batch(cfg))
    for form in args.forms.split(","):
        step = make_train_step(cfg, loss_fn, form)
        p = {k: jnp.array(v) for k, v in params.items()}
        m = {k: jnp.zeros_like(v) for k, v in params.items()}
        v = {k: jnp.zeros_like(x) for k, x in params.items()}
        p, m, v, loss, _ = step(p, m, v, 1.0, tokens, targets, mask)  # compile + warm up
        loss.block_until_ready()
        times = []
        for i in range(args.reps):
            t0 = time.perf_counter()
            p, m, v, loss, _ = step(p, m, v, float(i + 2), tokens, targets, mask)
            loss.block_until_ready()
            times.append((time.perf_counter() - t0) * 1e3)
        print(json.dumps({"what": "train", "form": form, "batch": "32x64", "ms": median(times),
                          "runs_ms": times}), flush=True)


def cmd_check(args, cfg):
    import jax
    import jax.numpy as jnp
    import numpy as np

    params = load_params(cfg, os.path.join(args.dir, "model.safetensors"))
    batch, meta = read_safetensors(os.path.join(args.dir, "batch.safetensors"))
    with open(os.path.join(args.dir, "sluice.json")) as f:
        ref = json.load(f)
    logits_fn, loss_fn, decode_step = make_model(cfg)
    tokens, targets, mask = (jnp.asarray(batch[n]) for n in ("tokens", "targets", "mask"))
    ok = True
    dense_grad = None
    for form in ("dense", "ragged", "blocksparse"):
        loss, g = jax.value_and_grad(loss_fn)(params, tokens, targets, mask, form)
        norm = float(jnp.sqrt(sum(jnp.sum(x * x) for x in g.values())))
        rl = abs(float(loss) - ref["loss"]) / abs(ref["loss"])
        rn = abs(norm - ref["grad_norm"]) / ref["grad_norm"]
        # Every gradient tensor against the dense form's: the largest |difference| over the
        # tensor's largest |value|, the worst tensor.
        dense_grad = dense_grad or g
        rg = max(float(jnp.max(jnp.abs(g[k] - dense_grad[k])) / jnp.max(jnp.abs(dense_grad[k])))
                 for k in g)
        # f32 forward and backward of the same math in another summation order: relative
        # differences of a few 1e-6 (1e-5 for a tensor's small entries) are rounding; 1e-4 and
        # 1e-3 leave a margin that a real difference in the model (a missing scale, a wrong
        # gate, a slot sent to the wrong expert) exceeds by orders.
        good = rl < 1e-4 and rn < 1e-4 and rg < 1e-3
        ok &= good
        print(json.dumps({"what": "check", "form": form, "loss": float(loss), "sluice_loss": ref["loss"],
                          "loss_rel_diff": rl, "grad_norm": norm, "sluice_grad_norm": ref["grad_norm"],
                          "grad_norm_rel_diff": rn, "grad_vs_dense_rel_max": rg, "ok": good}),
              flush=True)
    # Decode with the KV cache equals the full forward (both forms), on the first 2 sequences.
    full = logits_fn(params, tokens[:2, :8], "dense")
    params = inference_layout(cfg, params)
    L, Hkv, D = cfg["n_layers"], cfg["n_kv_heads"], cfg["head_dim"]
    for form in ("dense", "dense_flat", "topk", "blocksparse"):
        ck = jnp.zeros((L, 2, 8, Hkv, D), jnp.float32)
        cv = jnp.zeros_like(ck)
        worst = 0.0
        for s in range(8):
            lg, ck, cv = decode_step(params, ck, cv, tokens[:2, s], jnp.full((2,), s, jnp.int32), form)
            worst = max(worst, float(jnp.max(jnp.abs(lg - full[:, s]))) / float(jnp.max(jnp.abs(full))))
        good = worst < 1e-4
        ok &= good
        print(json.dumps({"what": "check", "form": form, "decode_vs_forward_rel_max": worst, "ok": good}),
              flush=True)
    if not ok:
        sys.exit(1)


def main():
    ensure_venv()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("check", "decode", "train"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True, help="a sluice model TOML")
        if name == "check":
            s.add_argument("--dir", required=True, help="what sluice's train_step bench exported")
        else:
            s.add_argument("--checkpoint", required=True, help="a sluice checkpoint (safetensors)")
            s.add_argument("--reps", type=int, default=5)
            default_forms = ("dense,dense_flat,topk,blocksparse" if name == "decode"
                             else "dense,ragged,blocksparse")
            s.add_argument("--forms", default=default_forms)
        if name == "decode":
            s.add_argument("--batches", default="1,4,16,64")
        if name != "check":
            s.add_argument("--block", type=int, default=0,
                           help="rows per block of the block-sparse form (0: block_rows' rule)")
    args = ap.parse_args()
    if not os.path.exists(args.model):
        die(f"--model {args.model}: no such file")
    cfg = load_config(args.model)
    if args.cmd == "check":
        cmd_check(args, cfg)
        return
    if not os.path.exists(args.checkpoint):
        die(f"--checkpoint {args.checkpoint}: no such file")
    global BLOCK_ROWS
    BLOCK_ROWS = args.block
    params = load_params(cfg, args.checkpoint)
    {"decode": cmd_decode, "train": cmd_train}[args.cmd](args, cfg, params)


if __name__ == "__main__":
    main()
