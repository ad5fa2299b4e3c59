#!/usr/bin/env python3
"""PyTorch peers for `sluice bench`, on the bench's own case table (docs/gpu-check.md).

    run.py --cases CASES.json --out PEERS.jsonl   time a peer for every case (needs torch + CUDA)
    run.py --cases CASES.json --check-only        parse every case's shape and name its peer
                                                  (no torch needed; the dry run runs this)
    run.py --merge ROWS.jsonl PEERS.jsonl         a markdown table: our median beside the peer's

CASES.json is `sluice bench --list-json --preset P`: the shapes come from the bench itself, so
a peer cannot time a different problem than the row it is set beside. Each peer row is
appended to PEERS.jsonl and flushed as it finishes (a cut keeps what was done).

Timing: CUDA events around the peer's calls only, inputs made before; 3 warm-up calls, then
the median, min and max of 10 samples; short calls batched per event pair the way the bench
does (a sample of at least 50 us). Where a peer has several implementations (the attention
backends of scaled_dot_product_attention), each is timed and the fastest reported, with all
of them listed (the math backend is left out: it materialises the scores).

Exit status: 0 when every case was handled (a case with no peer is listed as such); 2 for bad
input (an unreadable file, a shape this script cannot parse).
"""

import argparse
import json
import re
import sys
import time


def die(msg):
    print(f"run.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def dims(shape):
    """The KEY=VALUE integers of a bench shape string, plus its dtype and any BxL token
    count or [r,c] matrix."""
    d = {k: int(v) for k, v in re.findall(r"\b([A-Za-z]+)=(\d+)\b", shape)}
    m = re.search(r"\b(\d+)x(\d+) tokens\b", shape)
    if m:
        d["B"], d["L"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"\[(\d+),(\d+)\]", shape)
    if m:
        d["r"], d["c"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"(\d+) MiB", shape)
    if m:
        d["MiB"] = int(m.group(1))
    d["dtype"] = "bf16" if re.search(r"\bbf16\b", shape) else "f32"
    return d


# What each op's peer is, and the keys its shape must hold.
PEERS = {
    "gemm": ("torch.matmul(a, b.T)", ["M", "N", "K"]),
    "cublas_gemm_bf16": ("torch.matmul(a, b.T) (bf16)", ["M", "N", "K"]),
    "d2d_copy": ("Tensor.copy_", ["MiB"]),
    "attention_forward": ("scaled_dot_product_attention, every backend", ["B", "L", "H", "Hkv", "D"]),
    "attention_backward": ("scaled_dot_product_attention backward, every backend", ["B", "L", "H", "Hkv", "D"]),
    "paged_attention": ("decode SDPA over a CONTIGUOUS KV cache (not a paged peer)", ["B", "ctx", "H", "Hkv", "D"]),
    "moe_forward": ("torch._grouped_mm expert FFN (w1, w3, SwiGLU, w2; no router, no permutation)", ["T", "d", "E", "k", "f"]),
    "moe_backward": ("torch._grouped_mm expert FFN forward + backward (autograd)", ["T", "d", "E", "k", "f"]),
    "is_gate_loss": ("log_softmax + gather + IS gate, forward and backward (autograd); and F.cross_entropy", ["N", "V"]),
    "sample": ("softmax + torch.multinomial", ["B", "V"]),
    "topk": ("torch.topk", ["T", "E", "k"]),
    "newton_schulz": ("bf16 Newton-Schulz, 5 quintic steps, batched matmuls", ["n", "r", "c"]),
    "rmsnorm": ("F.rms_norm", ["T", "d"]),
    "softmax": ("torch.softmax", ["T", "n"]),
    "transpose": ("x.t().contiguous()", ["R", "C"]),
    "adamw": ("torch.optim.AdamW(fused=True).step", ["N"]),
    "rmsnorm_backward": ("F.rms_norm backward (autograd; forward included)", ["T", "d"]),
    "swiglu": ("F.silu(a) * b", ["T", "f"]),
    "swiglu_backward": ("F.silu(a) * b backward (autograd; forward included)", ["T", "f"]),
    "rope": ("RoPE rotating interleaved pairs, cos/sin tables made beforehand", ["T", "H", "D"]),
    "embedding": ("F.embedding", ["T", "V", "d"]),
    "embedding_backward": ("index_add_ into a zeroed table", ["T", "V", "d"]),
    "softmax_backward": ("torch._softmax_backward_data", ["T", "n"]),
}


def load_cases(path):
    try:
        with open(path) as f:
            cases = json.load(f)
    except (OSError, ValueError) as e:
        die(f"cannot read the case table {path}: {e}")
    if not isinstance(cases, list):
        die(f"{path}: not a JSON array of cases (make it with `sluice bench --list-json`)")
    for c in cases:
        op = c.get("op")
        if op in PEERS:
            missing = [k for k in PEERS[op][1] if k not in dims(c.get("shape", ""))]
            if missing:
                die(f"{op} `{c.get('shape')}`: no {', '.join(missing)} in the shape")
    return cases


def check_only(cases):
    with_peer = 0
    for c in cases:
        peer = PEERS.get(c["op"])
        if peer:
            with_peer += 1
        print(f"{c['op']} {c['pass']} {c['shape']}: {peer[0] if peer else 'no peer'}")
    print(f"{len(cases)} cases, {with_peer} with a peer")


def timed(torch, fn, samples=10, warmup=3, min_sample_s=50e-6):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one = start.elapsed_time(end) * 1e-3
    batch = 1 if one >= min_sample_s or one <= 0 else min(1000, int(min_sample_s / one) + 1)
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / batch)
    times.sort()
    n = len(times)
    median = times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])
    return {"median_s": median, "min_s": times[0], "max_s": times[-1], "samples": n, "batch": batch}


def peers_of(torch, c):
    """[(label, callable)] for one case; the inputs are made here, before any timing."""
    F = torch.nn.functional
    op, d = c["op"], dims(c["shape"])
    dt = torch.bfloat16 if d["dtype"] == "bf16" else torch.float32
    dev = "cuda"
    rnd = lambda *s, dtype=dt: torch.randn(*s, device=dev, dtype=dtype)  # noqa: E731
    if op in ("gemm", "cublas_gemm_bf16"):
        a, b = rnd(d["M"], d["K"]), rnd(d["N"], d["K"])
        return [("matmul", lambda: a @ b.T)]
    if op == "d2d_copy":
        n = d["MiB"] << 18
        src, dst = rnd(n, dtype=torch.float32), rnd(n, dtype=torch.float32)
        return [("copy_", lambda: dst.copy_(src))]
    if op in ("attention_forward", "attention_backward", "paged_attention"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        B, H, Hkv, D = d["B"], d["H"], d["Hkv"], d["D"]
        decode = op == "paged_attention"
        Lq, Lk = (1, d["ctx"]) if decode else (d["L"], d["L"])
        grad = op == "attention_backward"
        q = rnd(B, H, Lq, D).requires_grad_(grad)
        k = rnd(B, Hkv, Lk, D).requires_grad_(grad)
        v = rnd(B, Hkv, Lk, D).requires_grad_(grad)
        gqa = H != Hkv
        out = []
        # MATH is left out: it materialises the scores and is never the fastest.
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION):
            def fwd(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=not decode, enable_gqa=gqa)
            try:
                o = fwd()
            except RuntimeError:
                continue  # this backend does not take these shapes
            if grad:
                g = torch.randn_like(o)
                # The backward alone: a fresh forward graph per call, its time subtracted.
                def bwd(fwd=fwd, g=g):
                    fwd().backward(g)
                out.append((f"{backend.name} fwd+bwd", bwd))
                out.append((f"{backend.name} fwd", lambda fwd=fwd: fwd()))
            else:
                out.append((backend.name, fwd))
        return out
    if op in ("moe_forward", "moe_backward"):
        if not hasattr(torch, "_grouped_mm"):
            return []
        T, dm, E, k, f = d["T"], d["d"], d["E"], d["k"], d["f"]
        rows = T * k
        # Balanced segments, offsets a multiple of 16 rows as _grouped_mm wants.
        per = max(16, (rows // E + 15) // 16 * 16)
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * per
        grad = op == "moe_backward"
        x = rnd(per * E, dm, dtype=torch.bfloat16).requires_grad_(grad)
        w1 = rnd(E, dm, f, dtype=torch.bfloat16).requires_grad_(grad)
        w3 = rnd(E, dm, f, dtype=torch.bfloat16).requires_grad_(grad)
        w2 = rnd(E, f, dm, dtype=torch.bfloat16).requires_grad_(grad)

        def ffn():
            h = F.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
            return torch._grouped_mm(h, w2, offs=offs)
        if grad:
            g = torch.randn(per * E, dm, device=dev, dtype=torch.bfloat16)
            return [("grouped_mm fwd+bwd", lambda: ffn().backward(g))]
        return [("grouped_mm", ffn)]
    if op == "is_gate_loss":
        N, V = d["N"], d["V"]
        logits = rnd(N, V).requires_grad_(True)
        tokens = torch.randint(0, V, (N,), device=dev)
        behavior = torch.full((N,), -12.0, device=dev)
        adv = torch.ones(N, device=dev)

        def gate():
            logp = torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]
            rho = torch.exp(logp - behavior)
            w = torch.where((rho > 0.8) & (rho < 1.28), rho, torch.zeros_like(rho)).detach()
            (-(w * adv * logp).mean()).backward()

        def ce():
            F.cross_entropy(logits.float(), tokens).backward()
        return [("log_softmax+gather+gate fwd+bwd", gate), ("cross_entropy fwd+bwd", ce)]
    if op == "sample":
        logits = rnd(d["B"], d["V"])
        return [("softmax+multinomial", lambda: torch.multinomial(torch.softmax(logits.float(), -1), 1))]
    if op == "topk":
        s = rnd(d["T"], d["E"])
        return [("topk", lambda: torch.topk(s, d["k"], dim=-1))]
    if op == "newton_schulz":
        r, cc = min(d["r"], d["c"]), max(d["r"], d["c"])
        g = rnd(d["n"], r, cc, dtype=torch.bfloat16)
        a, b, c3 = 3.4445, -4.7750, 2.0315

        def ns():
            x = g / (g.norm(dim=(-2, -1), keepdim=True) + 1e-7)
            for _ in range(5):
                A = x @ x.mT
                x = a * x + (b * A + c3 * A @ A) @ x
            return x
        return [("bf16 NS", ns)]
    if op == "rmsnorm":
        x, w = rnd(d["T"], d["d"]), rnd(d["d"])
        if hasattr(F, "rms_norm"):
            return [("rms_norm", lambda: F.rms_norm(x, (d["d"],), w, 1e-6))]
        return [("manual rms_norm", lambda: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w)]
    if op == "softmax":
        x = rnd(d["T"], d["n"])
        return [("softmax", lambda: torch.softmax(x.float(), -1))]
    if op == "transpose":
        x = rnd(d["R"], d["C"])
        return [("t().contiguous()", lambda: x.t().contiguous())]
    if op == "rmsnorm_backward":
        x, w = rnd(d["T"], d["d"]).requires_grad_(True), rnd(d["d"]).requires_grad_(True)
        g = rnd(d["T"], d["d"])
        return [("rms_norm fwd+bwd", lambda: F.rms_norm(x, (d["d"],), w, 1e-6).backward(g))]
    if op in ("swiglu", "swiglu_backward"):
        grad = op == "swiglu_backward"
        a, b = rnd(d["T"], d["f"]).requires_grad_(grad), rnd(d["T"], d["f"]).requires_grad_(grad)
        if grad:
            g = rnd(d["T"], d["f"])
            return [("silu*mul fwd+bwd", lambda: (F.silu(a) * b).backward(g))]
        return [("silu*mul", lambda: F.silu(a) * b)]
    if op == "rope":
        T, H, D = d["T"], d["H"], d["D"]
        x = rnd(T, H, D)
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
        ang = torch.arange(T, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

        def rope():
            x1, x2 = x[..., ::2].float(), x[..., 1::2].float()
            return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)
        return [("rotate pairs", rope)]
    if op == "embedding":
        table = rnd(d["V"], d["d"])
        ids = torch.randint(0, d["V"], (d["T"],), device=dev)
        return [("F.embedding", lambda: F.embedding(ids, table))]
    if op == "embedding_backward":
        dout = rnd(d["T"], d["d"])
        ids = torch.randint(0, d["V"], (d["T"],), device=dev)
        return [("index_add_", lambda: torch.zeros(d["V"], d["d"], device=dev).index_add_(0, ids, dout.float()))]
    if op == "softmax_backward":
        y, dy = torch.softmax(rnd(d["T"], d["n"]).float(), -1), rnd(d["T"], d["n"]).float()
        return [("_softmax_backward_data", lambda: torch._softmax_backward_data(dy, y, -1, torch.float32))]
    if op == "adamw":
        p = torch.nn.Parameter(rnd(d["N"], dtype=torch.float32))
        p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW([p], lr=3e-3, weight_decay=0.1, fused=True)
        return [("AdamW fused step", opt.step)]
    return []


def run(cases, out_path):
    import torch
    if not torch.cuda.is_available():
        print("run.py: torch has no CUDA device here; no peers", file=sys.stderr)
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # f32 rows are true f32 (DESIGN 2)
    torch.backends.cudnn.allow_tf32 = False
    with open(out_path, "w") as out:
        for c in cases:
            t0 = time.time()
            base = {"op": c["op"], "pass": c["pass"], "path": c["path"], "shape": c["shape"],
                    "peer": PEERS.get(c["op"], ("none", []))[0], "torch": torch.__version__}
            try:
                impls = peers_of(torch, c)
                results = []
                for label, fn in impls:
                    try:
                        results.append(dict(timed(torch, fn), impl=label))
                    except RuntimeError as e:
                        results.append({"impl": label, "error": str(e).splitlines()[0]})
                    torch.cuda.empty_cache()
                ok = [r for r in results if "median_s" in r]
                if c["op"] == "attention_backward":
                    # The backward alone: each backend's fwd+bwd minus its fwd.
                    fwd = {r["impl"][:-4]: r["median_s"] for r in ok if r["impl"].endswith(" fwd")}
                    ok = [dict(r, median_s=r["median_s"] - fwd[r["impl"][:-8]], impl=r["impl"][:-8] + " bwd")
                          for r in ok if r["impl"].endswith(" fwd+bwd") and r["impl"][:-8] in fwd]
                best = min(ok, key=lambda r: r["median_s"]) if ok else None
                row = dict(base, best=best, all=results)
                if not impls:
                    row["none"] = "no peer for this op in this torch"
            except Exception as e:  # a peer that cannot run must not cost the others
                row = dict(base, error=f"{type(e).__name__}: {e}")
            row["wall_s"] = round(time.time() - t0, 3)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"peer {c['op']} {c['shape']}: "
                  f"{row.get('best', {}) and row['best']['impl']} {row.get('best', {}) and row['best']['median_s']}",
                  file=sys.stderr)
    return 0


def read_jsonl(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n") and line.strip():
                    rows.append(json.loads(line))
    except (OSError, ValueError) as e:
        die(f"cannot read {path}: {e}")
    return rows


def merge(rows_path, peers_path):
    ours = {(r["op"], r["pass"], r["path"], r["shape"]): r for r in read_jsonl(rows_path)}
    print("\n## Peers (PyTorch, same shapes, CUDA events)\n")
    print("| op | pass | path | shape | ours | peer | peer median | ours / peer |")
    print("|---|---|---|---|---|---|---|---|")
    for p in read_jsonl(peers_path):
        r = ours.get((p["op"], p["pass"], p["path"], p["shape"]))
        best = p.get("best")
        mine = r.get("median_s") if r else None
        ratio = f"{mine / best['median_s']:.2f}x" if mine and best and best["median_s"] > 0 else "-"
        peer = f"{best['impl']} ({p['peer']})" if best else p.get("error") or p.get("none") or "no timing"
        pm = f"{best['median_s'] * 1e6:.1f} us" if best else "-"
        om = f"{mine * 1e6:.1f} us" if mine else "-"
        print(f"| {p['op']} | {p['pass']} | {p['path']} | {p['shape']} | {om} | {peer} | {pm} | {ratio} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases")
    ap.add_argument("--out")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--merge", nargs=2, metavar=("ROWS", "PEERS"))
    a = ap.parse_args()
    if a.merge:
        merge(*a.merge)
        return 0
    if not a.cases:
        die("--cases CASES.json is required (make it with `sluice bench --list-json --preset P`)")
    cases = load_cases(a.cases)
    if a.check_only:
        check_only(cases)
        return 0
    if not a.out:
        die("--out PEERS.jsonl is required to time the peers")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("run.py: no torch in this python3; no peers (the run goes on)", file=sys.stderr)
        return 0
    return run(cases, a.out)


if __name__ == "__main__":
    sys.exit(main())
