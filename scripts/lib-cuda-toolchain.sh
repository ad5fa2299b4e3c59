# Shared shell helpers for sluice's scripts: the pinned CUDA compiler and small utilities.
# Source it (bash only):  . "$(dirname "$0")/lib-cuda-toolchain.sh"
#
# The CUDA compiler comes from pinned PyPI wheels installed into the ignored virtualenv
# .venv-cuda/ at the repository root. All five wheels are pinned: unpinned, pip mixes 13.x parts
# into the 13.0 nvcc. nvcc 13.0 emits PTX ISA 9.0, which every CUDA 13.0+ driver (580+) loads; a
# newer nvcc (13.5 emits ISA 9.5) would produce PTX that a 580 driver rejects, so any other
# version is refused.

SLUICE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SLUICE_CUDA_VENV="${SLUICE_CUDA_VENV:-$SLUICE_ROOT/.venv-cuda}"
SLUICE_CUDA_PINS=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
)
# What `nvcc --version` must say.
SLUICE_NVCC_RELEASE="release 13.0, V13.0.88"

sluice_die() {
    echo "error: $*" >&2
    exit 1
}

sluice_note() {
    echo "[$(basename "$0")] $*" >&2
}

# Seconds since the epoch with a fraction (for step timings).
sluice_now() {
    date +%s.%N
}

# Elapsed time since $1 (from sluice_now) as "12.3s" or "4m05s".
sluice_elapsed() {
    awk -v a="$1" -v b="$(sluice_now)" 'BEGIN {
        d = b - a; if (d < 0) d = 0
        if (d < 60) printf "%.1fs", d; else printf "%dm%02ds", int(d / 60), int(d) % 60 }'
}

sluice_jobs() {
    local n="${SLUICE_JOBS:-}"
    if [[ -z "$n" ]]; then
        n="$(nproc 2>/dev/null || echo 2)"
    fi
    echo "$n"
}

# A python interpreter to build the virtualenv with: 3.11 where present (what the wheels were
# checked with), else any python3 >= 3.9.
_sluice_python() {
    local p
    for p in python3.11 python3; do
        if command -v "$p" >/dev/null 2>&1 &&
            "$p" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 9) else 1)' 2>/dev/null; then
            command -v "$p"
            return 0
        fi
    done
    return 1
}

# The site-packages directory of the virtualenv (the python version may differ between machines).
_sluice_venv_purelib() {
    "$SLUICE_CUDA_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

# True when every pinned wheel is installed in the virtualenv at exactly its pinned version.
_sluice_pins_installed() {
    "$SLUICE_CUDA_VENV/bin/python" - "${SLUICE_CUDA_PINS[@]}" <<'PY'
import sys
from importlib import metadata
bad = []
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if have != want:
        bad.append(f"{name}: want {want}, have {have}")
if bad:
    print("pinned CUDA wheels differ: " + "; ".join(bad), file=sys.stderr)
    sys.exit(1)
PY
}

# Checks the compiler found in the virtualenv; sets SLUICE_CUDA_BIN, NVCC, PTXAS. Returns 1 (with
# a reason on stderr) when it is missing or is not the pinned release.
_sluice_cuda_found() {
    [[ -x "$SLUICE_CUDA_VENV/bin/python" ]] || return 1
    local purelib
    purelib="$(_sluice_venv_purelib)" || return 1
    SLUICE_CUDA_BIN="$purelib/nvidia/cu13/bin"
    NVCC="$SLUICE_CUDA_BIN/nvcc"
    PTXAS="$SLUICE_CUDA_BIN/ptxas"
    [[ -x "$NVCC" && -x "$PTXAS" ]] || return 1
    _sluice_pins_installed || return 1
    local v
    v="$("$NVCC" --version 2>&1)" || return 1
    if [[ "$v" != *"$SLUICE_NVCC_RELEASE"* ]]; then
        echo "error: $NVCC is not the pinned nvcc ($SLUICE_NVCC_RELEASE); it says:" >&2
        echo "$v" >&2
        return 1
    fi
    return 0
}

# Makes sure the pinned CUDA compiler is installed (installing it into .venv-cuda/ if needed) and
# sets SLUICE_CUDA_BIN, NVCC and PTXAS.
sluice_cuda_toolchain() {
    if _sluice_cuda_found 2>/dev/null; then
        return 0
    fi
    command -v gcc >/dev/null 2>&1 && command -v g++ >/dev/null 2>&1 ||
        sluice_die "nvcc needs the host C/C++ compiler (gcc, g++) even for -ptx; install them (Debian: apt-get install build-essential)"
    local py
    py="$(_sluice_python)" || sluice_die "python3 (>= 3.9) is needed to install the pinned CUDA compiler wheels"
    if [[ ! -x "$SLUICE_CUDA_VENV/bin/python" ]]; then
        sluice_note "creating $SLUICE_CUDA_VENV with $py"
        if ! "$py" -m venv "$SLUICE_CUDA_VENV" >/dev/null 2>&1; then
            # Debian's python3 without python3-venv lacks ensurepip: make the venv bare and use
            # the system pip to install into it.
            rm -rf "$SLUICE_CUDA_VENV"
            "$py" -m venv --without-pip "$SLUICE_CUDA_VENV" ||
                sluice_die "cannot create a virtualenv with $py (Debian: apt-get install python3-venv)"
        fi
    fi
    local pip=("$SLUICE_CUDA_VENV/bin/python" -m pip)
    if ! "${pip[@]}" --version >/dev/null 2>&1; then
        "$py" -m pip --version >/dev/null 2>&1 ||
            sluice_die "no pip for $py and none in $SLUICE_CUDA_VENV (Debian: apt-get install python3-venv python3-pip)"
        pip=("$py" -m pip --python "$SLUICE_CUDA_VENV/bin/python")
    fi
    sluice_note "installing the pinned CUDA compiler wheels: ${SLUICE_CUDA_PINS[*]}"
    "${pip[@]}" install --disable-pip-version-check --no-input --only-binary=:all: --quiet \
        "${SLUICE_CUDA_PINS[@]}" ||
        sluice_die "pip could not install the pinned CUDA compiler wheels into $SLUICE_CUDA_VENV"
    _sluice_cuda_found || sluice_die "the CUDA wheels installed, but no usable pinned nvcc/ptxas under $SLUICE_CUDA_VENV"
    sluice_note "nvcc: $NVCC ($SLUICE_NVCC_RELEASE)"
}
