#!/usr/bin/env python3
"""sluice's CPU path against its XLA peer (issue 16), in alternating rounds; writes
docs/perf/cpu-vs-xla.md.

Steps:
1. builds sluice's two benches (runtime/benches/rollout.rs, model/benches/train_step.rs);
2. exports the small model's weights and one batch from sluice (SLUICE_PEER_DIR) and runs the
   peer's numerics check on them (scripts/peer-xla.py check: same loss and gradient norm of the
   same batch, decode logits equal to the full forward), so both sides time the same model;
3. ROUNDS rounds (default 3), each: sluice decode (B = 1, 4, 16, 64), peer decode (dense and
   top-k forms), sluice train step (forward, backward, optimizer), peer train step (dense and
   ragged top-k forms); the load average is read before each program;
4. the medians over rounds of each program's own median, and the ratios, into the report.

Only Python's standard library here; the peer makes its own venv (.venv-xla/).
Usage: python3 scripts/compare-xla.py [--rounds 3] [--out docs/perf/cpu-vs-xla.md]
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "configs/model/small.toml"
NO_CRITERION = "__timing_lines_only__"  # a filter no criterion bench matches


def run(cmd, env=None):
    """Runs `cmd` in the repository root; returns stdout (stderr passes through)."""
    e = dict(os.environ)
    e.update(env or {})
    r = subprocess.run(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        print(r.stdout, file=sys.stderr)
        sys.exit(f"compare-xla: `{' '.join(cmd)}` failed (exit {r.returncode})")
    return r.stdout


def json_lines(text):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"what"' in line:
            out.append(json.loads(line))
    return out


def load():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="docs/perf/cpu-vs-xla.md")
    args = ap.parse_args()

    rollout = ["cargo", "bench", "-q", "-p", "sluice-runtime", "--bench", "rollout", "--", NO_CRITERION]
    train = ["cargo", "bench", "-q", "-p", "sluice-model", "--bench", "train_step", "--", NO_CRITERION]
    peer = [sys.executable, "scripts/peer-xla.py"]
    print("building the benches ...", file=sys.stderr)
    run(["cargo", "bench", "-p", "sluice-runtime", "--bench", "rollout", "--no-run"])
    run(["cargo", "bench", "-p", "sluice-model", "--bench", "train_step", "--no-run"])

    tmp = tempfile.mkdtemp(prefix="sluice-peer-")
    run(train, env={"SLUICE_PEER_DIR": tmp})
    ckpt = os.path.join(tmp, "model.safetensors")
    check = json_lines(run(peer + ["check", "--model", MODEL, "--dir", tmp]))
    print(json.dumps(check), file=sys.stderr)

    rows = []  # (round, program, record)
    loads = []
    for r in range(args.rounds):
        steps = [
            ("sluice decode", rollout),
            ("peer decode", peer + ["decode", "--model", MODEL, "--checkpoint", ckpt]),
            ("sluice train", train),
            ("peer train", peer + ["train", "--model", MODEL, "--checkpoint", ckpt]),
        ]
        for name, cmd in steps:
            before = load()
            loads.append(before)
            print(f"round {r + 1}: {name} (load {before:.2f})", file=sys.stderr)
            for rec in json_lines(run(cmd)):
                rec["load"] = before
                rows.append((r, name, rec))

    # Median over rounds per (what, form, batch).
    series = {}
    for _, _, rec in rows:
        series.setdefault((rec["what"], rec["form"], str(rec["batch"])), []).append(rec["ms"])
    med = {key: median(v) for key, v in series.items()}

    commit = run(["git", "rev-parse", "--short", "HEAD"]).strip()
    dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).strip()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# sluice's CPU path against an XLA-compiled peer",
        "",
        "Written by `python3 scripts/compare-xla.py` (issue 16). The peer is",
        "`scripts/peer-xla.py`: the same model in JAX (pinned in the script), compiled by XLA for",
        "the CPU, running sluice's own weights (the small config, configs/model/small.toml,",
        "3.36 M parameters, exported from sluice's train_step bench).",
        "",
        f"- Date: {date}",
        f"- Machine: {cpu_model()}, {os.cpu_count()} cores ({platform.machine()}, {platform.system()})",
        f"- Commit: {commit}{' (with uncommitted changes)' if dirty else ''}",
        f"- Rounds: {args.rounds}, alternating sluice and peer programs; load average (1 min) before",
        f"  each program: min {min(loads):.2f}, median {median(loads):.2f}, max {max(loads):.2f}",
        f"  on {os.cpu_count()} cores. The 1-minute average still holds the previous program of this",
        "  comparison (about 1 to 2 on its own, since each uses every core); well above that,",
        "  other jobs shared the machine: treat the figures as noisy then.",
        "",
        "Each figure is the median over rounds of each program's own median (sluice: 5 fresh",
        "engines x 64 decode steps, 7 train steps; peer: 5 x 63 decode steps, 5 train steps, after",
        "compilation).",
        "",
        "## Numerics check (same model)",
        "",
        "| check | form | value | sluice | relative difference | ok |",
        "|---|---|---|---|---|---|",
    ]
    for c in check:
        if "loss" in c:
            lines.append(f"| loss of the exported batch | {c['form']} | {c['loss']:.7f} | {c['sluice_loss']:.7f} | "
                         f"{c['loss_rel_diff']:.1e} | {c['ok']} |")
            lines.append(f"| gradient global norm | {c['form']} | {c['grad_norm']:.7f} | {c['sluice_grad_norm']:.7f} | "
                         f"{c['grad_norm_rel_diff']:.1e} | {c['ok']} |")
        else:
            lines.append(f"| peer decode (KV cache) vs its full forward, max rel. logit diff | {c['form']} | "
                         f"{c['decode_vs_forward_rel_max']:.1e} | - | - | {c['ok']} |")
    lines += [
        "",
        "## Decode step (ms per step; B sequences, one token each, contexts 17..80)",
        "",
        "| B | sluice | peer dense (einsum) | peer dense (3 flat matmuls) | peer top-k (gathered experts) | peer fastest / sluice | sluice system CPU share |",
        "|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x: f"{x:.3f}" if x is not None else "-"
    for b in ("1", "4", "16", "64"):
        s = med.get(("decode", "sluice", b))
        peers = [med.get(("decode", f, b)) for f in ("dense", "dense_flat", "topk")]
        known = [x for x in peers if x is not None]
        fastest = min(known) if known else None
        ratio = f"{fastest / s:.2f}x" if s and fastest else "-"
        user = sum(r.get("user_s", 0.0) for _, _, r in rows if r["what"] == "decode" and r["form"] == "sluice" and str(r["batch"]) == b)
        sys_s = sum(r.get("sys_s", 0.0) for _, _, r in rows if r["what"] == "decode" and r["form"] == "sluice" and str(r["batch"]) == b)
        share = f"{100 * sys_s / (user + sys_s):.1f}% ({sys_s:.2f} of {user + sys_s:.2f} s)" if user + sys_s > 0 else "-"
        lines.append(f"| {b} | {fmt(s)} | {fmt(peers[0])} | {fmt(peers[1])} | {fmt(peers[2])} | {ratio} | {share} |")
    lines += [
        "",
        "A ratio above 1 means sluice is faster. The system CPU share is of the timed decode steps",
        "of every round together (user and system CPU seconds from /proc/self/stat).",
    ]
    s = med.get(("train", "sluice", "32x64"))
    sf = med.get(("train_fwd_bwd", "sluice", "32x64"))
    pd = med.get(("train", "dense", "32x64"))
    pr = med.get(("train", "ragged", "32x64"))
    fastest = min(x for x in (pd, pr) if x is not None)
    lines += [
        "",
        "## Train step (32 sequences x 64 tokens: forward, loss, backward, optimizer)",
        "",
        "| program | ms per step |",
        "|---|---|",
        f"| sluice (forward + backward only) | {sf:.1f} |",
        f"| sluice (with Muon + AdamW) | {s:.1f} |",
        f"| peer, dense MoE, one compiled step | {pd:.1f} |",
        f"| peer, top-k MoE (ragged_dot), one compiled step | {pr:.1f} |",
        f"| peer fastest / sluice | {fastest / s:.2f}x |",
        "",
        "A ratio above 1 means sluice is faster. What changed in sluice's CPU path to get here, and",
        "what each change kept, is docs/perf/cpu-path.md.",
        "",
        "## Every run",
        "",
        "| round | program | what | form | batch | ms | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, name, rec in rows:
        lines.append(f"| {r + 1} | {name} | {rec['what']} | {rec['form']} | {rec['batch']} | {rec['ms']:.3f} | {rec['load']:.2f} |")
    out = os.path.join(ROOT, args.out)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
