#!/usr/bin/env bash
# The GPU half of scripts/gpu-check (docs/gpu-check.md). scripts/gpu-check copies this file to
# .gpu/run.sh beside bundle.tar.xz (the stripped binaries) and MANIFEST. On the GPU machine,
# from the repository root:
#
#   bash .gpu/run.sh              the GPU run (device tool: carry [".gpu"], timeout_s 540)
#   bash .gpu/run.sh --dry-run    the same phases on this machine's CPU: --device emu, tiny
#                                 shapes; what needs a GPU is SKIPPED with its reason
#                                 (scripts/gpu-check --dry-run runs this in scripts/test)
#
# Phases, in the order of their value, each with its own budget (seconds, capped by what is
# left of SLUICE_GPU_BUDGET_S, default 470):
#   environment 20   nvidia-smi, MANIFEST, `sluice devices`, the tools found
#   tests 120        the CUDA tests only (libtest filter `cuda`) of every bundled test binary,
#                    SLUICE_REQUIRE_CUDA=1; the zero-mismatch test (cuda, f32 and bf16) is one
#   bench 150        `sluice bench --device cuda --preset doc`, rows streamed to rows.jsonl
#   peers 50         scripts/peers/run.py (python3 + torch) on the bench's own case table
#   counters 40      ncu's metrics on three real kernels beside the emulator's counts
#   sanitizer 40     compute-sanitizer memcheck and racecheck over the ops of `--preset tiny`
#   determinism 50   `sluice determinism check --device cuda --bless` into golden.tar.gz
# An absent tool is SKIPPED with the reason, never a failure. Everything is written as it
# happens into at most 8 files in $OUT (default .gpu/out), so a run cut short keeps all it did:
#   summary.txt  the phase table, rewritten after every phase
#   log.txt      every phase's output, appended
#   tests.txt    `ok|FAILED BINARY::TEST@default` per CUDA test run (what verifies a bench row)
#   rows.jsonl   the bench's rows, one per finished case
#   report.md    the report built from rows.jsonl, tests.txt and peers.jsonl
#   peers.jsonl  the peers' rows;  counters.txt  ncu beside the emulator;
#   golden.tar.gz  the cuda determinism goldens
# Exit status 0 only when no phase failed (SKIPPED is not a failure).
#
# Environment: SLUICE_GPU_BIN=DIR uses binaries already unpacked there (the dry run's);
# SLUICE_GPU_FORCE=1 runs the GPU phases even where no driver is found.
set -uo pipefail

DRY=0
case "${1:-}" in
    "") ;;
    --dry-run) DRY=1 ;;
    -h | --help)
        sed -n '2,36p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "run.sh: unknown option '$1'; usage: bash .gpu/run.sh [--dry-run]" >&2
        exit 2
        ;;
esac

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The working tree the bundle sits in (.gpu/ at its root, or scripts/ for the dry run).
REPO="$(dirname "$HERE")"
OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
T0=$(date +%s)
BUDGET="${SLUICE_GPU_BUDGET_S:-470}"
DEADLINE=$((T0 + BUDGET))
WORK="$(mktemp -d "${TMPDIR:-/tmp}/sluice-gpu-run.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

LOG="$OUT/log.txt"
SUMMARY="$OUT/summary.txt"
TESTS="$OUT/tests.txt"
ROWS="$OUT/rows.jsonl"
REPORT="$OUT/report.md"
PEERS="$OUT/peers.jsonl"
COUNTERS="$OUT/counters.txt"
GOLDEN="$OUT/golden.tar.gz"
rm -f "$LOG" "$SUMMARY" "$TESTS" "$ROWS" "$REPORT" "$PEERS" "$COUNTERS" "$GOLDEN"
: >"$LOG"

if ((DRY)); then
    DEVICE=emu
    PRESET=tiny
    MODE="dry run (--device emu, tiny shapes, no GPU)"
else
    DEVICE=cuda
    PRESET=doc
    MODE="GPU run"
fi

PHASE_ROWS=()
FAILED=0
# The phase table, rewritten whole after every phase so a cut keeps it.
write_summary() {
    local result="$1"
    {
        echo "==== sluice GPU check summary: $MODE, $(($(date +%s) - T0)) s of ${BUDGET} s; files in $OUT ===="
        printf '%-13s %-8s %6s  %s\n' phase result time detail
        printf '%s\n' "${PHASE_ROWS[@]}"
        echo "RESULT: $result"
    } >"$SUMMARY"
}
# phase_row PHASE RESULT SECONDS DETAIL (RESULT: PASS, FAIL, TIMEOUT or SKIPPED)
phase_row() {
    PHASE_ROWS+=("$(printf '%-13s %-8s %5ss  %s' "$1" "$2" "$3" "$4")")
    [[ "$2" == FAIL || "$2" == TIMEOUT ]] && FAILED=1
    echo ">>> $1: $2 ($3 s) $4" | tee -a "$LOG"
    write_summary "(running)"
}
finish() {
    local result=PASS
    ((FAILED)) && result=FAIL
    write_summary "$result"
    echo
    cat "$SUMMARY"
    local n
    n="$(find "$OUT" -maxdepth 1 -type f | wc -l)"
    echo "files in $OUT: $n (at most 8 come back)"
    exit "$FAILED"
}
trap 'write_summary "CUT (interrupted)"; exit 130' INT TERM

left() { echo $((DEADLINE - $(date +%s))); }
# Seconds a phase may take: its budget, or what is left of the run's if less.
cap() {
    local l
    l="$(left)"
    if ((l < $1)); then echo "$l"; else echo "$1"; fi
}
section() { echo "---- [$(date -u +%H:%M:%S)] $*" >>"$LOG"; }

find_tool() {
    local name="$1" p
    if p="$(command -v "$name" 2>/dev/null)"; then
        echo "$p"
        return 0
    fi
    for p in /usr/local/cuda/bin/"$name" /usr/local/cuda-*/bin/"$name" /opt/nvidia/*/bin/"$name"; do
        if [[ -x "$p" ]]; then
            echo "$p"
            return 0
        fi
    done
    return 1
}

# run_capped SECONDS CMD...: runs CMD with its output appended to the log; prints its status
# word (PASS, FAIL or TIMEOUT).
run_capped() {
    local limit="$1" rc
    shift
    timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    if ((rc == 124 || rc == 137)); then
        echo TIMEOUT
    elif ((rc == 0)); then
        echo PASS
    else
        echo "FAIL"
    fi
}

# ---- environment (and the driver check: without one, a GPU run stops here) ----
start=$(date +%s)
section environment
HAVE_GPU=0
NO_GPU=""
if SMI="$(find_tool nvidia-smi)"; then
    if timeout 20 "$SMI" >>"$LOG" 2>&1; then
        HAVE_GPU=1
        timeout 10 "$SMI" --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm,clocks.max.mem \
            --format=csv >>"$LOG" 2>&1
    else
        NO_GPU="nvidia-smi ($SMI) failed: the NVIDIA driver is not working"
    fi
else
    NO_GPU="nvidia-smi not found: no NVIDIA driver on this machine"
fi
{
    echo "# $(uname -srm); $(nproc) cores; mode: $MODE"
    cat "$HERE/MANIFEST" 2>/dev/null || echo "MANIFEST: none (a dry run stages the binaries without one)"
} >>"$LOG"
if ((!HAVE_GPU && !DRY)) && [[ "${SLUICE_GPU_FORCE:-}" != 1 ]]; then
    phase_row environment FAIL $(($(date +%s) - start)) "$NO_GPU: nothing run (SLUICE_GPU_FORCE=1 runs the phases anyway)"
    finish
fi

# The binaries: unpacked from bundle.tar.xz (sha256 checked against MANIFEST), or given.
BIN="${SLUICE_GPU_BIN:-}"
if [[ -z "$BIN" ]]; then
    BIN="$WORK/bin"
    mkdir -p "$BIN"
    archive="$HERE/bundle.tar.xz"
    want="$(sed -n 's/^archive: .* sha256 \([0-9a-f]*\)$/\1/p' "$HERE/MANIFEST" 2>/dev/null)"
    got="$(sha256sum "$archive" 2>/dev/null | cut -d' ' -f1)"
    if [[ ! -f "$archive" ]]; then
        phase_row environment FAIL $(($(date +%s) - start)) "no $archive: rebuild the bundle with scripts/gpu-check"
        finish
    elif [[ -n "$want" && "$want" != "$got" ]]; then
        phase_row environment FAIL $(($(date +%s) - start)) "bundle.tar.xz has sha256 $got, MANIFEST says $want: damaged; rebuild it"
        finish
    fi
    # python3's tarfile reads xz with the standard library; `tar -xJf` is the fallback.
    if ! python3 - "$archive" "$BIN" >>"$LOG" 2>&1 <<'PY'; then
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as tar:
    if hasattr(tarfile, "data_filter"):
        tar.extractall(sys.argv[2], filter="data")
    else:
        tar.extractall(sys.argv[2])
PY
        tar -xJf "$archive" -C "$BIN" >>"$LOG" 2>&1
    fi
fi
SLUICE="$BIN/sluice"
if [[ ! -x "$SLUICE" ]]; then
    phase_row environment FAIL $(($(date +%s) - start)) "no sluice binary in $BIN"
    finish
fi
mapfile -t TEST_BINS < <(cd "$BIN/tests" 2>/dev/null && ls | LC_ALL=C sort)
declare -A PKG_DIR=()
if [[ -f "$BIN/tests.tsv" ]]; then
    while IFS=$'\t' read -r name pkg; do PKG_DIR["$name"]="$pkg"; done <"$BIN/tests.tsv"
fi
pkg_dir() {
    local d="$REPO/${PKG_DIR[$1]:-.}"
    [[ -d "$d" ]] || d="$REPO"
    (cd "$d" && pwd)
}
{
    echo "# sluice devices"
    timeout 30 "$SLUICE" devices 2>&1
    echo "# tools"
    for t in nvidia-smi ncu compute-sanitizer nvcc; do
        p="$(find_tool "$t")" && echo "$t: $p" || echo "$t: not found"
    done
    timeout 30 python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 ||
        echo "torch: not importable"
} >>"$LOG" 2>&1
if ((HAVE_GPU)); then
    phase_row environment PASS $(($(date +%s) - start)) "$("$SMI" --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1); ${#TEST_BINS[@]} test binaries"
elif ((DRY)); then
    phase_row environment SKIPPED $(($(date +%s) - start)) "$NO_GPU (dry run); ${#TEST_BINS[@]} test binaries"
else
    phase_row environment FAIL $(($(date +%s) - start)) "$NO_GPU; SLUICE_GPU_FORCE=1: running the phases anyway"
fi

# ---- tests: the CUDA tests only ----
# The libtest filter `cuda` picks the CUDA tests (named cuda_* or *_on_cuda) and leaves the CPU
# and emulator tests these binaries also hold, which ran in CI already. Each result line
# becomes `ok|FAILED BINARY::TEST@default` in tests.txt; a GPU run sets SLUICE_REQUIRE_CUDA=1,
# so a test cannot pass by skipping. A dry run has no GPU: its tests skip, so it writes no
# results (no bench row may count as verified by a skipped test).
start=$(date +%s)
section "tests (CUDA only)"
: >"$TESTS"
phase_end=$(($(date +%s) + $(cap 120)))
worst=PASS
ran=0
notrun=()
for b in "${TEST_BINS[@]}"; do
    l=$((phase_end - $(date +%s)))
    if ((l < 5)); then
        notrun+=("$b")
        worst=TIMEOUT
        continue
    fi
    part="$WORK/test-$b.out"
    dir="$(pkg_dir "$b")"
    if ((DRY)); then
        (cd "$dir" && CARGO_MANIFEST_DIR="$dir" timeout -k 5 "$l" "$BIN/tests/$b" cuda --test-threads=2) >"$part" 2>&1
    else
        (cd "$dir" && CARGO_MANIFEST_DIR="$dir" SLUICE_REQUIRE_CUDA=1 timeout -k 5 "$l" "$BIN/tests/$b" cuda \
            --test-threads="$(nproc)") >"$part" 2>&1
    fi
    rc=$?
    { echo "# $b (exit $rc)"; cat "$part"; } >>"$LOG"
    if ((!DRY)); then
        sed -nE "s/^test ([^ ]+) \.\.\. (ok|FAILED)$/\2 $b::\1@default/p" "$part" >>"$TESTS"
    fi
    ran=$((ran + $(grep -cE '^test [^ ]+ \.\.\. (ok|FAILED)$' "$part")))
    if ((rc == 124 || rc == 137)); then
        worst=TIMEOUT
    elif ((rc != 0)); then
        [[ "$worst" == TIMEOUT ]] || worst=FAIL
    fi
done
detail="$ran CUDA tests in ${#TEST_BINS[@]} binaries; $(grep -c '^ok' "$TESTS") ok, $(grep -c '^FAILED' "$TESTS") failed"
((${#notrun[@]})) && detail+="; not reached: ${notrun[*]}"
if ((DRY)) && [[ "$worst" == PASS ]]; then
    phase_row tests SKIPPED $(($(date +%s) - start)) "no GPU: $ran CUDA tests selected and run, each skipped; no row can be verified"
elif ((DRY)); then
    phase_row tests "$worst" $(($(date +%s) - start)) "$ran CUDA tests selected; a test binary failed without a GPU (log.txt)"
else
    phase_row tests "$worst" $(($(date +%s) - start)) "$detail"
    zm="$(grep 'zero_mismatch::' "$TESTS" | head -n 3 | tr '\n' ' ')"
    phase_row zero-mismatch "$([[ "$zm" == ok* && "$zm" != *FAILED* ]] && echo PASS || echo FAIL)" 0 \
        "${zm:-the zero-mismatch test (cuda f32 and bf16) did not run}"
fi

# ---- bench: rows stream to rows.jsonl; the report is built from it ----
start=$(date +%s)
section "bench --device $DEVICE --preset $PRESET"
l="$(cap 150)"
if ((l < 10)); then
    phase_row bench TIMEOUT 0 "not run: the time budget is spent"
else
    st="$(run_capped "$l" "$SLUICE" bench --device "$DEVICE" --preset "$PRESET" --jsonl "$ROWS" --verified "$TESTS")"
    n="$( [[ -f "$ROWS" ]] && wc -l <"$ROWS" | tr -d ' ' || echo 0)"
    phase_row bench "$st" $(($(date +%s) - start)) "$n rows in rows.jsonl"
fi

# ---- peers: PyTorch on the same shapes ----
start=$(date +%s)
section peers
"$SLUICE" bench --list-json --preset "$PRESET" >"$WORK/cases.json" 2>>"$LOG"
if ((DRY)); then
    phase_row peers SKIPPED 0 "dry run: the peers time CUDA kernels (scripts/peers/run.py --check-only ran: $(python3 "$REPO/scripts/peers/run.py" --cases "$WORK/cases.json" --check-only 2>>"$LOG" | tail -n 1))"
elif ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    phase_row peers SKIPPED 0 "python3 with a CUDA-enabled torch is not available here"
else
    l="$(cap 50)"
    st="$(run_capped "$l" python3 "$REPO/scripts/peers/run.py" --cases "$WORK/cases.json" --out "$PEERS")"
    n="$( [[ -f "$PEERS" ]] && wc -l <"$PEERS" | tr -d ' ' || echo 0)"
    phase_row peers "$st" $(($(date +%s) - start)) "$n peer rows in peers.jsonl"
fi

# ---- counters: ncu beside the emulator's counts ----
# Three real kernels (GEMM, attention forward, is_gate_loss) at the bench's tiny shapes: ncu
# measures their launches under `sluice bench --device cuda`; `sluice bench --device emu
# --profile` counts the same launches (same shapes, same inputs) in the emulator. The
# emulator's counts are exact by construction; this is the check that they match hardware.
start=$(date +%s)
section counters
NCU_METRICS="dram__bytes_read.sum,dram__bytes_write.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed_pipe_tensor.sum"
# emu_counts OP SECONDS: the emulator's counts of OP's tiny launches, appended to counters.txt.
emu_counts() {
    echo "## $1: emulator (sluice bench --device emu --op $1 --preset tiny --profile)" >>"$COUNTERS"
    timeout -k 5 "$2" "$SLUICE" bench --device emu --op "$1" --preset tiny --samples 1 --warmup 1 \
        --profile --jsonl "$WORK/emu-$1.jsonl" --json "$WORK/emu-$1.json" >>"$LOG" 2>&1 &&
        python3 -c 'import json,sys
for r in json.load(open(sys.argv[1])):
    for k in r.get("profile", {}).get("kernels", []):
        print(r["shape"], k.get("kernel"), json.dumps(k.get("totals", {}), sort_keys=True))' \
            "$WORK/emu-$1.json" >>"$COUNTERS" 2>>"$LOG"
}
COUNTER_OPS=(gemm attention_forward is_gate_loss)
NCU=""
((DRY)) || NCU="$(find_tool ncu)"
if [[ -z "$NCU" ]]; then
    # The emulator's half runs anyway (it needs no GPU), so its commands are tried everywhere.
    l="$(cap 40)"
    echo "# ncu: $( ((DRY)) && echo 'dry run, no GPU' || echo 'not found'); the emulator's counts alone" >"$COUNTERS"
    for op in "${COUNTER_OPS[@]}"; do emu_counts "$op" $((l / 3)); done
    phase_row counters SKIPPED $(($(date +%s) - start)) "$( ((DRY)) && echo 'dry run: ncu needs a GPU' || echo 'ncu not found'); the emulator's half ran: $(grep -c '^[^#]' "$COUNTERS") kernel lines in counters.txt"
else
    l="$(cap 40)"
    per=$((l / 6))
    worst=PASS
    echo "# ncu --metrics $NCU_METRICS, beside the emulator's counts of the same launches" >"$COUNTERS"
    for op in "${COUNTER_OPS[@]}"; do
        if ((per < 4)); then
            worst=TIMEOUT
            continue
        fi
        emu_counts "$op" "$per"
        echo "## $op: ncu (sluice bench --device cuda --op $op --preset tiny)" >>"$COUNTERS"
        timeout -k 5 "$per" "$NCU" --clock-control none --metrics "$NCU_METRICS" --csv \
            "$SLUICE" bench --device cuda --op "$op" --preset tiny --samples 1 --warmup 1 \
            --jsonl "$WORK/ncu-$op.jsonl" >"$WORK/ncu-$op.csv" 2>&1
        rc=$?
        grep -E '^"' "$WORK/ncu-$op.csv" >>"$COUNTERS"
        tail -n 5 "$WORK/ncu-$op.csv" >>"$LOG"
        if ((rc == 124 || rc == 137)); then
            worst=TIMEOUT
        elif ((rc != 0)); then
            worst=FAIL
        fi
    done
    phase_row counters "$worst" $(($(date +%s) - start)) "counters.txt: ncu and the emulator, same launches"
fi

# ---- sanitizer: memcheck and racecheck over the ops at tiny shapes ----
# The named ops of the tiny preset (not the model steps: hundreds of launches each), one
# timed run each: every kernel at small shapes, so the tools' 10-1000x slowdown fits.
SANITIZE_OPS="gemm,topk,is_gate_loss,sample,newton_schulz,moe,attention,rmsnorm,softmax,transpose,adamw,swiglu,rope,embedding"
start=$(date +%s)
section sanitizer
SAN=""
((DRY)) || SAN="$(find_tool compute-sanitizer)"
if [[ -z "$SAN" ]]; then
    # The command the tools would wrap, run bare on this device, so it is tried everywhere.
    st="$(run_capped "$(cap 40)" "$SLUICE" bench --device "$DEVICE" --preset tiny --op "$SANITIZE_OPS" \
        --samples 1 --warmup 1 --jsonl "$WORK/san-rows.jsonl")"
    why="$( ((DRY)) && echo 'dry run: compute-sanitizer needs a GPU' || echo 'compute-sanitizer not found')"
    if [[ "$st" == PASS ]]; then
        phase_row sanitizer SKIPPED $(($(date +%s) - start)) "$why; its command ran without it: $(wc -l <"$WORK/san-rows.jsonl" | tr -d ' ') rows"
    else
        phase_row sanitizer "$st" $(($(date +%s) - start)) "$why; its command failed without it (log.txt)"
    fi
else
    l="$(cap 40)"
    worst=PASS
    detail=""
    for tool in memcheck racecheck; do
        st="$(run_capped $((l / 2)) "$SAN" --tool "$tool" --error-exitcode 99 --print-limit 20 \
            "$SLUICE" bench --device cuda --preset tiny --op "$SANITIZE_OPS" --samples 1 --warmup 1 \
            --jsonl "$WORK/san-rows.jsonl")"
        detail+="$tool $st; "
        [[ "$st" == PASS ]] || worst="$st"
    done
    phase_row sanitizer "$worst" $(($(date +%s) - start)) "${detail%; } (sluice bench --preset tiny --op $SANITIZE_OPS)"
fi

# ---- determinism: this device's goldens ----
start=$(date +%s)
section "determinism check --device $DEVICE --bless"
l="$(cap 50)"
if ((l < 10)); then
    phase_row determinism TIMEOUT 0 "not run: the time budget is spent"
else
    if ((DRY)); then
        sel=(--device emu --preset ci --ops gemm)
    else
        sel=(--device cuda)
    fi
    st="$(run_capped "$l" "$SLUICE" determinism check "${sel[@]}" --golden "$WORK/golden" --bless \
        --reason "$MODE by .gpu/run.sh")"
    if [[ -d "$WORK/golden" ]]; then
        tar -czf "$GOLDEN" -C "$WORK" golden 2>>"$LOG"
    fi
    phase_row determinism "$st" $(($(date +%s) - start)) "goldens in golden.tar.gz ($(find "$WORK/golden" -name '*.json' 2>/dev/null | wc -l) files)"
fi

# ---- the report: rows + tests + peers ----
start=$(date +%s)
section report
if [[ -s "$ROWS" ]]; then
    if "$SLUICE" bench --report-from "$ROWS" --verified "$TESTS" >"$REPORT" 2>>"$LOG"; then
        if [[ -s "$PEERS" ]]; then
            python3 "$REPO/scripts/peers/run.py" --merge "$ROWS" "$PEERS" >>"$REPORT" 2>>"$LOG"
        else
            echo -e "\nPeers: none in this run (see summary.txt)." >>"$REPORT"
        fi
        phase_row report PASS $(($(date +%s) - start)) "report.md from $(wc -l <"$ROWS" | tr -d ' ') rows"
    else
        phase_row report FAIL $(($(date +%s) - start)) "sluice bench --report-from failed (log.txt)"
    fi
else
    phase_row report SKIPPED 0 "no rows to report"
fi
finish
