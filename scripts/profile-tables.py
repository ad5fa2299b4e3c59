#!/usr/bin/env python3
"""Writes the emulator's doc-shape profiles (docs/perf/profiles/<op>.json, made by
scripts/profile-doc) into each docs/perf/<family>.md, between the markers

    <!-- profile:begin -->
    <!-- profile:end -->

(appended at the end of the file the first time). Python standard library only.

    python3 scripts/profile-tables.py
"""
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROFILES = ROOT / "docs" / "perf" / "profiles"

FAMILIES = {
    "gemm": ["gemm"],
    "topk": ["topk"],
    "sample": ["sample"],
    "is_gate_loss": ["is_gate_loss"],
    "newton_schulz": ["newton_schulz"],
    "moe": ["moe_forward", "moe_backward"],
    "attention": ["attention_forward", "attention_backward"],
    "paged_attention": ["paged_attention", "kv_append", "paged_prefill"],
    "rmsnorm": ["rmsnorm", "rmsnorm_backward"],
    "rope": ["rope", "rope_backward"],
    "swiglu": ["swiglu", "swiglu_backward"],
    "embedding": ["embedding", "embedding_backward"],
    "elementwise": ["residual_add", "softmax", "softmax_backward", "transpose"],
    "muon": ["adamw", "sq_norm", "muon_gather", "muon_apply", "cast_bf16"],
}


def fmt(v):
    if v is None:
        return "-"
    a = abs(v)
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e4, "k")):
        if a >= scale:
            return f"{v / scale:.3g}{unit}" if unit != "k" else f"{v / 1e3:.1f}k"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"


def ratio(a, b):
    return f"{a / b:.2f}x" if b else "-"


def secs(s):
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


def table(op):
    path = PROFILES / f"{op}.json"
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    txt = (PROFILES / f"{op}.txt").read_text().splitlines()
    header = txt[0].lstrip("# ").strip() if txt else ""
    out = [f"### `{op}` at {rec['shape']}", "", f"`{header}`", ""]
    out.append(
        "| kernel | blocks profiled | global ld sectors (x ideal) | global st sectors (x ideal) "
        "| shared ld wavefronts (x ideal) | shared st wavefronts (x ideal) | tensor instructions "
        "| SFU calls | barriers | shuffles | occupancy (model) |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    # One row per kernel name (launches of one kernel summed).
    merged = {}
    for k in rec["kernels"]:
        m = merged.setdefault(k["name"], {"launches": 0, "profiled": 0, "total": 0, "t": {}, "tensor": {}, "occ": k.get("occupancy")})
        m["launches"] += 1
        m["profiled"] += k["blocks_profiled"]
        m["total"] += k["blocks_total"]
        for key, v in k["totals"].items():
            if key == "tensor_instructions":
                for shape, n in v.items():
                    m["tensor"][shape] = m["tensor"].get(shape, 0) + n
            elif isinstance(v, (int, float)):
                m["t"][key] = m["t"].get(key, 0) + v
    for name, m in merged.items():
        t = m["t"]
        g = lambda k: t.get(k, 0)
        tensor = ", ".join(f"{fmt(n)} {s}" for s, n in m["tensor"].items()) or "-"
        occ = m["occ"]
        occ_s = f"{occ['blocks_per_sm']} blocks/SM ({occ['limit']})" if occ else "-"
        launches = f" x{m['launches']}" if m["launches"] > 1 else ""
        out.append(
            f"| `{name}`{launches} | {fmt(m['profiled'])} of {fmt(m['total'])} "
            f"| {fmt(g('global_load_sectors'))} ({ratio(g('global_load_sectors'), g('global_load_ideal_sectors'))}) "
            f"| {fmt(g('global_store_sectors'))} ({ratio(g('global_store_sectors'), g('global_store_ideal_sectors'))}) "
            f"| {fmt(g('shared_load_wavefronts'))} ({ratio(g('shared_load_wavefronts'), g('shared_load_ideal_wavefronts'))}) "
            f"| {fmt(g('shared_store_wavefronts'))} ({ratio(g('shared_store_wavefronts'), g('shared_store_ideal_wavefronts'))}) "
            f"| {tensor} | {fmt(g('special_function_calls'))} | {fmt(g('barriers'))} | {fmt(g('shuffles'))} | {occ_s} |"
        )
    b = rec["bound"]
    terms = b["terms"]
    share = rec.get("tensor_share")
    share_s = "n/a" if share is None else f"{share * 100:.1f}%"
    out += [
        "",
        f"Useful FLOPs {fmt(rec['op_flops'])}; tensor-core FLOPs {fmt(rec['tensor_flops'])} "
        f"(share {share_s}, issued beyond the math {fmt(rec['wasted_tensor_flops'])}); "
        f"compulsory bytes {fmt(rec['compulsory_bytes'])}. "
        f"**H200 bound (a model): {secs(b['seconds'])}, bound by {b['binding']}** "
        f"(DRAM {secs(terms['dram_s'])} on {terms['dram_basis']}, tensor cores {secs(terms['tensor_s'])}, "
        f"special functions {secs(terms['special_functions_s'])}, L1 wavefronts {secs(terms['l1_wavefronts_s'])}).",
        "",
    ]
    return "\n".join(out)


def main():
    for family, ops in FAMILIES.items():
        doc = ROOT / "docs" / "perf" / f"{family}.md"
        parts = [t for t in (table(op) for op in ops) if t]
        if not parts or not doc.exists():
            continue
        block = "\n".join(
            [
                "<!-- profile:begin -->",
                "## Profile at the doc shape (emulator)",
                "",
                "Counted by `sluice emu profile OP --preset doc` (`bash scripts/profile-doc`; the JSON is in "
                "docs/perf/profiles/): counts are exact for the profiled blocks and scaled by the blocks each "
                "stands for; occupancy and the bound are models (docs/emulator.md, \"Profiling\"). The line "
                "under each title says when, at which commit and how long it took. Per-line counts are in "
                "the JSON and the .txt beside it.",
                "",
                *parts,
                "<!-- profile:end -->",
            ]
        )
        text = doc.read_text()
        pattern = re.compile(r"<!-- profile:begin -->.*?<!-- profile:end -->", re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _: block, text)
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
        doc.write_text(text)
        print(f"{doc.relative_to(ROOT)}: {len(parts)} op(s)")


if __name__ == "__main__":
    main()
