#!/usr/bin/env bash
# The GPU half of scripts/gpu-check (docs/gpu-check.md). scripts/gpu-check copies this file to
# .gpu/run.sh beside bundle.tar.xz (the stripped binaries) and MANIFEST; on the GPU machine, from
# the repository root:
#
#   bash .gpu/run.sh
#
# Needs only the NVIDIA driver (PTX is embedded in the binaries) and python3 or xz to unpack;
# uses compute-sanitizer and python3 + torch where present. In one run, within about 8 minutes:
#   0. stops at once, with a message saying why, where no NVIDIA driver works (nothing unpacked)
#   1. unpacks bundle.tar.xz into a temporary folder (its sha256 checked against MANIFEST)
#   2. environment: nvidia-smi, driver, `sluice devices`, torch
#   3. every bundled GPU test binary with SLUICE_REQUIRE_CUDA=1 (a missing GPU fails, never skips)
#   4. the gemm test binaries again with SLUICE_GEMM_PATH=wgmma (the Hopper path's opt-in)
#   5. compute-sanitizer memcheck and 6. racecheck over the small CUDA cases
#   7. `sluice bench --device cuda` (PyTorch peers are the bench's business), if the subcommand exists
# Logs go to $OUT (default .gpu/out; at most 7 files) and a summary table is printed last.
# The exit status is 0 only when every phase passed (a skipped bench is not a failure).
#
# Environment: SLUICE_GPU_FORCE=1 runs the GPU phases even when no driver is found (to try this
# script on a machine without a GPU); SLUICE_SANITIZE_FILTER overrides the sanitizer test filter;
# SLUICE_GPU_BUDGET_S (default 470) is the whole run's time budget in seconds.
set -uo pipefail

BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The working tree the bundle sits in (.gpu/ at its root): tests run in their package's folder
# with CARGO_MANIFEST_DIR set, as under cargo test, so they find their data files.
REPO="$(dirname "$BUNDLE")"
# Where bundle.tar.xz is unpacked (sluice, tests/<target>, tests.tsv): a temporary folder, removed
# at the end, so that .gpu/ stays small enough to be carried again.
BIN=""
trap '[[ -z "$BIN" ]] || rm -rf "$BIN"' EXIT
OUT="${OUT:-$BUNDLE/out}"
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET="${SLUICE_GPU_BUDGET_S:-470}"
DEADLINE=$((T0 + BUDGET))

ENV_LOG="$OUT/env.txt"
TESTS_LOG="$OUT/tests.log"
WGMMA_LOG="$OUT/tests-wgmma.log"
MEMCHECK_LOG="$OUT/memcheck.log"
RACECHECK_LOG="$OUT/racecheck.log"
BENCH_LOG="$OUT/bench.log"
SUMMARY="$OUT/summary.txt"
: >"$ENV_LOG"
# The phase logs are appended to as phases run; those left empty are removed at the end.
rm -f "$TESTS_LOG" "$WGMMA_LOG" "$MEMCHECK_LOG" "$RACECHECK_LOG" "$BENCH_LOG"

ROWS=()
FAILED=0
# row PHASE RESULT SECONDS DETAIL
row() {
    ROWS+=("$(printf '%-28s %-8s %6ss  %s' "$1" "$2" "$3" "$4")")
    [[ "$2" == FAIL || "$2" == TIMEOUT ]] && FAILED=1
    echo ">>> $1: $2 ($3 s) $4"
}

# Prints the summary table (also to summary.txt), drops empty logs and exits with the result.
finish() {
    local f
    for f in "$TESTS_LOG" "$WGMMA_LOG" "$MEMCHECK_LOG" "$RACECHECK_LOG" "$BENCH_LOG"; do
        [[ -s "$f" ]] || rm -f "$f"
    done
    {
        echo
        echo "==== sluice GPU check summary ($(($(date +%s) - T0)) s; logs in $OUT) ===="
        printf '%-28s %-8s %7s  %s\n' phase result time detail
        printf '%s\n' "${ROWS[@]}"
        if ((FAILED)); then
            echo "RESULT: FAIL"
        else
            echo "RESULT: PASS"
        fi
    } | tee "$SUMMARY"
    exit "$FAILED"
}

left() {
    echo $((DEADLINE - $(date +%s)))
}

# Seconds a step may take: its cap, or what is left of the run's budget if that is less.
cap() {
    local l
    l="$(left)"
    if ((l < $1)); then echo "$l"; else echo "$1"; fi
}

find_tool() {
    local name="$1" p
    if p="$(command -v "$name" 2>/dev/null)"; then
        echo "$p"
        return 0
    fi
    for p in /usr/local/cuda/bin/"$name" /usr/local/cuda-*/bin/"$name" /opt/nvidia/*/bin/"$name" \
        /usr/local/cuda/compute-sanitizer/"$name"; do
        if [[ -x "$p" ]]; then
            echo "$p"
            return 0
        fi
    done
    return 1
}

# Runs one test binary (argv after the log and the time cap), appending its output to the log.
# Prints "STATUS (counts)": STATUS is PASS, FAIL or TIMEOUT; counts from its libtest result line.
run_test_binary() {
    local log="$1" limit="$2" dir="$3"
    shift 3
    local start rc part counts status
    start=$(date +%s)
    part="$(mktemp)"
    (cd "$dir" && CARGO_MANIFEST_DIR="$dir" timeout -k 10 "$limit" "$@") >"$part" 2>&1
    rc=$?
    {
        echo "---- $(date -u +%H:%M:%S) in $dir: $* (limit ${limit}s)"
        cat "$part"
        echo "---- exit $rc after $(($(date +%s) - start))s"
    } >>"$log"
    counts="$(grep '^test result:' "$part" | tail -n 1 |
        sed -E 's/^test result: (ok|FAILED)\. //; s/; [0-9]+ measured//; s/; finished in.*//')"
    rm -f "$part"
    if ((rc == 124 || rc == 137)); then
        status=TIMEOUT
    elif ((rc == 0)); then
        status=PASS
    else
        status=FAIL
    fi
    echo "$status (${counts:-no test result line: exit $rc})"
}

# ---- 0. is there a working NVIDIA driver? Without one nothing else is done. ----
start=$(date +%s)
{
    echo "# sluice GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
    cat "$BUNDLE/MANIFEST" 2>/dev/null || echo "MANIFEST: missing (is this a bundle made by scripts/gpu-check?)"
    echo
    echo "# $(uname -srm); $(ldd --version 2>/dev/null | head -n 1); $(nproc) cores"
} >>"$ENV_LOG"
HAVE_GPU=0
if SMI="$(find_tool nvidia-smi)"; then
    if timeout 30 "$SMI" >>"$ENV_LOG" 2>&1; then
        HAVE_GPU=1
    else
        NO_GPU="nvidia-smi ($SMI) failed: the NVIDIA driver is not working on this machine"
    fi
else
    NO_GPU="nvidia-smi was not found: this machine has no NVIDIA driver"
fi
if ((!HAVE_GPU)); then
    echo "$NO_GPU" >>"$ENV_LOG"
    if [[ "${SLUICE_GPU_FORCE:-}" != 1 ]]; then
        echo "run.sh: $NO_GPU, so no CUDA test can run here; stopping without running anything."
        echo "run.sh: this script is for the GPU machine (docs/gpu-check.md); SLUICE_GPU_FORCE=1 runs its phases anyway."
        row environment FAIL $(($(date +%s) - start)) "no NVIDIA driver ($NO_GPU): nothing run"
        finish
    fi
    row "environment (forced)" FAIL $(($(date +%s) - start)) "$NO_GPU; SLUICE_GPU_FORCE=1: running the GPU phases anyway"
fi

# ---- 1. unpack bundle.tar.xz ----
# The sha256 in MANIFEST catches a bundle damaged or mixed up on its way here. python3's tarfile
# reads xz with the standard library alone; `tar -xJf` (which needs xz) is the fallback.
start=$(date +%s)
unpack() {
    local archive="$BUNDLE/bundle.tar.xz" want got
    [[ -f "$archive" ]] || {
        echo "no $archive: rebuild the bundle with scripts/gpu-check"
        return 1
    }
    want="$(sed -n 's/^archive: .* sha256 \([0-9a-f]*\)$/\1/p' "$BUNDLE/MANIFEST" 2>/dev/null)"
    got="$(sha256sum "$archive" 2>/dev/null | cut -d' ' -f1)"
    if [[ -n "$want" && -n "$got" && "$want" != "$got" ]]; then
        echo "bundle.tar.xz has sha256 $got, MANIFEST says $want: the bundle is damaged; rebuild it"
        return 1
    fi
    if command -v python3 >/dev/null 2>&1 && python3 - "$archive" "$BIN" <<'PY'; then
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as tar:
    if hasattr(tarfile, "data_filter"):
        tar.extractall(sys.argv[2], filter="data")
    else:
        tar.extractall(sys.argv[2])
PY
        return 0
    fi
    tar -xJf "$archive" -C "$BIN"
}
BIN="$(mktemp -d "${TMPDIR:-/tmp}/sluice-gpu-bundle.XXXXXX")"
if UNPACK_MSG="$(unpack 2>&1)" && [[ -x "$BIN/sluice" ]]; then
    row unpack PASS $(($(date +%s) - start)) "bundle.tar.xz: $(du -sh "$BIN" | cut -f1) in $BIN"
else
    echo "unpack: ${UNPACK_MSG:-bundle.tar.xz holds no sluice binary}" >>"$ENV_LOG"
    row unpack FAIL $(($(date +%s) - start)) "${UNPACK_MSG:-bundle.tar.xz holds no sluice binary}"
    finish
fi

mapfile -t TEST_BINS < <(cd "$BIN" && ls tests 2>/dev/null | LC_ALL=C sort)
declare -A PKG_DIR=()
if [[ -f "$BIN/tests.tsv" ]]; then
    while IFS=$'\t' read -r name pkg; do
        PKG_DIR["$name"]="$pkg"
    done <"$BIN/tests.tsv"
fi
# The folder test binary $1 runs in.
pkg_dir() {
    local d="$REPO/${PKG_DIR[$1]:-.}"
    [[ -d "$d" ]] || d="$REPO"
    (cd "$d" && pwd)
}

# ---- 2. environment ----
start=$(date +%s)
{
    if ((HAVE_GPU)); then
        timeout 20 "$SMI" --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm \
            --format=csv 2>&1
    fi
    echo
    echo "# sluice devices"
    timeout 60 "$BIN/sluice" devices 2>&1
    echo
    echo "# python3 / torch (the bench's peers)"
    timeout 60 python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>/dev/null ||
        echo "torch: not importable (bench runs without PyTorch peers)"
    SAN="$(find_tool compute-sanitizer)" && echo "compute-sanitizer: $SAN" || echo "compute-sanitizer: not found"
} >>"$ENV_LOG" 2>&1
cat "$ENV_LOG"
if ((HAVE_GPU)); then
    GPU_NAME="$("$SMI" --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
    row environment PASS $(($(date +%s) - start)) "$GPU_NAME; ${#TEST_BINS[@]} test binaries"
fi

# ---- 3. the GPU tests, SLUICE_REQUIRE_CUDA=1 ----
test_phase() {
    local phase="$1" log="$2" budget="$3"
    shift 3
    local bins=("$@")
    local start status detail="" worst=PASS b
    start=$(date +%s)
    if ((${#bins[@]} == 0)); then
        row "$phase" SKIP 0 "no test binaries in the bundle"
        return
    fi
    local phase_end=$(($(date +%s) + budget))
    for b in "${bins[@]}"; do
        local l=$((phase_end - $(date +%s)))
        ((l > $(left))) && l="$(left)"
        if ((l < 5)); then
            detail+="$b: not run (time budget); "
            worst=TIMEOUT
            continue
        fi
        status="$(run_test_binary "$log" "$l" "$(pkg_dir "$b")" "$BIN/tests/$b" --test-threads="$(nproc)")"
        detail+="$b: $status; "
        [[ "$status" != PASS* ]] && worst="${status%% *}"
    done
    row "$phase" "$worst" $(($(date +%s) - start)) "${detail%; }"
}

GEMM_BINS=()
for b in "${TEST_BINS[@]}"; do
    [[ "$b" == *gemm* ]] && GEMM_BINS+=("$b")
done

SLUICE_REQUIRE_CUDA=1 test_phase "tests (REQUIRE_CUDA)" "$TESTS_LOG" "$(cap 200)" "${TEST_BINS[@]}"
if ((${#GEMM_BINS[@]} > 0)); then
    SLUICE_REQUIRE_CUDA=1 SLUICE_GEMM_PATH=wgmma test_phase "gemm SLUICE_GEMM_PATH=wgmma" "$WGMMA_LOG" "$(cap 60)" "${GEMM_BINS[@]}"
else
    row "gemm SLUICE_GEMM_PATH=wgmma" SKIP 0 "no gemm test binary in the bundle"
fi

# ---- 5, 6. compute-sanitizer over the small CUDA cases ----
# Filter: the tests whose names contain "sanitize" where a binary has any, else those with "cuda".
sanitize_phase() {
    local tool="$1" log="$2" budget="$3"
    local start=$(date +%s) worst=PASS detail="" b
    if ! SAN="$(find_tool compute-sanitizer)"; then
        row "compute-sanitizer $tool" FAIL 0 "compute-sanitizer not found"
        return
    fi
    if ((${#TEST_BINS[@]} == 0)); then
        row "compute-sanitizer $tool" SKIP 0 "no test binaries in the bundle"
        return
    fi
    # Each binary gets an equal share (at least 15 s) of the phase's budget, which ends the
    # phase: binaries left when it is spent are reported as not run.
    local per=$((budget / ${#TEST_BINS[@]}))
    ((per < 15)) && per=15
    local phase_end=$(($(date +%s) + budget))
    for b in "${TEST_BINS[@]}"; do
        local filter="${SLUICE_SANITIZE_FILTER:-}"
        if [[ -z "$filter" ]]; then
            if "$BIN/tests/$b" --list 2>/dev/null | grep ': test$' | grep -q sanitize; then
                filter=sanitize
            else
                filter=cuda
            fi
        fi
        local l
        l="$(cap "$per")"
        ((l > phase_end - $(date +%s))) && l=$((phase_end - $(date +%s)))
        if ((l < 5)); then
            detail+="$b: not run (time budget); "
            worst=TIMEOUT
            continue
        fi
        local status
        status="$(SLUICE_REQUIRE_CUDA=1 run_test_binary "$log" "$l" "$(pkg_dir "$b")" "$SAN" --tool "$tool" --error-exitcode 99 \
            --print-limit 20 "$BIN/tests/$b" "$filter" --test-threads=1)"
        detail+="$b[$filter]: $status; "
        [[ "$status" != PASS* ]] && worst="${status%% *}"
    done
    grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$log" | sort | uniq -c | sed 's/^/  /' >>"$log"
    row "compute-sanitizer $tool" "$worst" $(($(date +%s) - start)) "${detail%; }"
}

sanitize_phase memcheck "$MEMCHECK_LOG" "$(cap 70)"
sanitize_phase racecheck "$RACECHECK_LOG" "$(cap 70)"

# ---- 7. sluice bench --device cuda ----
start=$(date +%s)
if "$BIN/sluice" --help 2>/dev/null | grep -qE '^ +bench( |$)'; then
    l="$(cap 120)"
    if ((l < 10)); then
        row "sluice bench" TIMEOUT 0 "not run: time budget spent"
    else
        timeout -k 10 "$l" "$BIN/sluice" bench --device cuda >>"$BENCH_LOG" 2>&1
        rc=$?
        if ((rc == 124 || rc == 137)); then
            row "sluice bench" TIMEOUT $(($(date +%s) - start)) "stopped after ${l}s; see bench.log"
        elif ((rc == 0)); then
            row "sluice bench" PASS $(($(date +%s) - start)) "report in bench.log"
        else
            row "sluice bench" FAIL $(($(date +%s) - start)) "exit $rc; see bench.log"
        fi
    fi
else
    echo "this sluice binary has no 'bench' subcommand yet" >>"$BENCH_LOG"
    row "sluice bench" SKIP 0 "no 'bench' subcommand in this build of sluice"
fi

finish
