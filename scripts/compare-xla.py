#!/usr/bin/env python3
"""sluice's CPU path against its XLA peer (issue 16), in alternating rounds; writes
docs/perf/cpu-vs-xla.md.

Steps:
1. builds sluice's two benches (runtime/benches/rollout.rs, model/benches/train_step.rs);
2. exports the small model's weights and one batch from sluice (SLUICE_PEER_DIR) and runs the
   peer's numerics check on them (scripts/peer-xla.py check: same loss and gradient norm of the
   same batch, decode logits equal to the full forward), so both sides time the same model;
3. ROUNDS rounds (default 3), each: sluice decode (B = 1, 4, 16, 64) and peer decode (every MoE
   form), then sluice train step (forward, backward, optimizer) and peer train step (every MoE
   form), each pair in alternating order (sluice first in odd rounds, the peer first in even
   ones); the load average is read before each program;
4. the medians over rounds of each program's own median; for each measurement the peer's
   fastest form (by that median), named, its ratio to sluice, and the ratio of each round's
   pair, into the report.

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
        decode = [("sluice decode", rollout),
                  ("peer decode", peer + ["decode", "--model", MODEL, "--checkpoint", ckpt])]
        training = [("sluice train", train),
                    ("peer train", peer + ["train", "--model", MODEL, "--checkpoint", ckpt])]
        if r % 2:
            decode.reverse()
            training.reverse()
        for name, cmd in decode + training:
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
    per_round = {}
    for r, _, rec in rows:
        per_round[(r, rec["what"], rec["form"], str(rec["batch"]))] = rec["ms"]

    def fastest(what, batch, forms):
        # The peer's fastest form of one measurement, by its median over rounds.
        known = [(med[(what, f, batch)], f) for f in forms if (what, f, batch) in med]
        return min(known) if known else (None, None)

    def paired(what, batch, form):
        # Each round's peer / sluice of the same measurement (the two ran back to back).
        return [per_round[(r, what, form, batch)] / per_round[(r, what, "sluice", batch)]
                for r in range(args.rounds)
                if (r, what, form, batch) in per_round and (r, what, "sluice", batch) in per_round]

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
        "compilation). Both sides run f32 on every core of the machine; each number is the wall",
        "time of one step.",
        "",
        "The peer runs each measurement in every MoE form it has and the fastest one (by its",
        "median over rounds) is set against sluice: `dense` (every expert on every token, gates 0",
        "outside the top-k: 4x the expert FLOPs of top-2 of 8, in einsums), `dense_flat` (decode:",
        "the same as three plain matmuls on weights laid out once), `topk` (decode: each token's",
        "k experts' weights gathered), `ragged` (train: tokens sorted by expert, one",
        "`jax.lax.ragged_dot` per weight) and `blocksparse` (token-slots sorted by expert, each",
        "expert's segment padded to whole blocks, one batched matmul over the blocks with each",
        "block's expert weights gathered, rows scattered back: MegaBlocks' layout, 128-row blocks",
        "at the train step's 4096 token-slots, where 32, 64 and 256 rows ran slower; sluice's own",
        "MoE is a grouped GEMM over exact per-expert segments). Every form is checked below",
        "against sluice's loss and gradient norm, its gradients against the dense form's, and its",
        "decode against its full forward.",
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
            lines.append(f"| every gradient tensor vs the dense form's, max abs diff / max abs | {c['form']} | "
                         f"{c['grad_vs_dense_rel_max']:.1e} | - | - | {c['ok']} |")
        else:
            lines.append(f"| peer decode (KV cache) vs its full forward, max rel. logit diff | {c['form']} | "
                         f"{c['decode_vs_forward_rel_max']:.1e} | - | - | {c['ok']} |")
    lines += [
        "",
        "## Decode step (ms per step; B sequences, one token each, contexts 17..80)",
        "",
        "| B | sluice | peer dense (einsum) | peer dense (3 flat matmuls) | peer top-k (gathered experts) | peer block-sparse | peer fastest / sluice (form; each round's pair) | sluice system CPU share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x: f"{x:.3f}" if x is not None else "-"
    fmt1 = lambda x: f"{x:.1f}" if x is not None else "-"
    decode_forms = ("dense", "dense_flat", "topk", "blocksparse")

    def ratio_cell(what, b, s, forms):
        best, form = fastest(what, b, forms)
        if not (s and best):
            return "-"
        pairs = paired(what, b, form)
        spread = f"{min(pairs):.2f}-{max(pairs):.2f}" if pairs else "-"
        return f"{best / s:.2f}x ({form}; {spread})"

    for b in ("1", "4", "16", "64"):
        s = med.get(("decode", "sluice", b))
        peers = [med.get(("decode", f, b)) for f in decode_forms]
        user = sum(r.get("user_s", 0.0) for _, _, r in rows if r["what"] == "decode" and r["form"] == "sluice" and str(r["batch"]) == b)
        sys_s = sum(r.get("sys_s", 0.0) for _, _, r in rows if r["what"] == "decode" and r["form"] == "sluice" and str(r["batch"]) == b)
        share = f"{100 * sys_s / (user + sys_s):.1f}% ({sys_s:.2f} of {user + sys_s:.2f} s)" if user + sys_s > 0 else "-"
        lines.append(f"| {b} | {fmt(s)} | {' | '.join(fmt(x) for x in peers)} | {ratio_cell('decode', b, s, decode_forms)} | {share} |")
    lines += [
        "",
        "A ratio above 1 means sluice is faster. The system CPU share is of the timed decode steps",
        "of every round together (user and system CPU seconds from /proc/self/stat).",
    ]
    forms = ("dense", "ragged", "blocksparse")
    s = med.get(("train", "sluice", "32x64"))
    sf = med.get(("train_fwd_bwd", "sluice", "32x64"))
    names = {"dense": "dense MoE (einsum)", "ragged": "top-k MoE (ragged_dot)",
             "blocksparse": "top-k MoE (block-sparse)"}
    lines += [
        "",
        "## Train step (32 sequences x 64 tokens: forward, loss, backward, optimizer)",
        "",
        "| program | ms per step |",
        "|---|---|",
        f"| sluice (forward + backward only) | {fmt1(sf)} |",
        f"| sluice (with Muon + AdamW) | {fmt1(s)} |",
    ]
    for f in forms:
        lines.append(f"| peer, {names[f]}, one compiled step | {fmt1(med.get(('train', f, '32x64')))} |")
    # How much slower the two forms the peer used to train in are than the block-sparse one.
    train_ms = {f: med.get(("train", f, "32x64")) for f in forms}
    if all(train_ms.values()):
        slower = sorted(train_ms[f] / train_ms["blocksparse"] for f in ("dense", "ragged"))
        slower_text = f"{slower[0]:.1f}x and {slower[1]:.1f}x slower than the block-sparse one in this run"
    else:
        slower_text = "slower than the block-sparse one (not every form ran here)"
    lines += [
        f"| peer fastest / sluice (form; each round's pair) | {ratio_cell('train', '32x64', s, forms)} |",
        "",
        "A ratio above 1 means sluice is faster; each round's pair is that round's peer step over",
        "its sluice step, the two run back to back. Until 2026-12-06 the peer trained in the dense",
        f"and ragged forms only, which XLA runs {slower_text}",
        "(2.5-3x under the load of the first such run): the report of 2026-12-01 (commit 3af1b5b)",
        "put sluice 2.27x ahead on the train step, a lead over a slow peer rather than over XLA.",
        "What changed in sluice's CPU path, and what each change kept, is docs/perf/cpu-path.md.",
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
