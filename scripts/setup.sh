#!/usr/bin/env bash
# Set up fsdp_lab on a Debian/Ubuntu machine with Python >= 3.10, then run what you ask:
#   bash scripts/setup.sh tour   # install, then run every lab headless (fsdp-lab tour)
#   bash scripts/setup.sh test   # install with the test tools, then run the whole test suite
#   bash scripts/setup.sh e2e    # ... then the end-to-end runs the suite leaves out (CI runs both)
#   bash scripts/setup.sh        # install only
#
# torch: an installed torch is kept as it is (your CUDA build on a GPU machine stays). On a
# machine without one, a CPU machine gets the CPU build pinned as torch==2.13.0+cpu — the
# "+cpu" local version cannot match the multi-gigabyte CUDA wheel on PyPI, so that wheel is
# never pulled by accident; a machine with an NVIDIA driver gets the regular (CUDA) wheel.
# Python: the `python3` on PATH, or $PYTHON. Graphviz's `dot` and bubblewrap's `bwrap`: apt-get
# when root (or sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${FSDP_LAB_TORCH_VERSION:-2.13.0}
what=${1:-install}
case "$what" in install|tour|test|e2e|path) ;; *) echo "usage: bash scripts/setup.sh [install|tour|test|e2e]" >&2; exit 2;; esac
say() { echo "[setup] $*"; }

# The folder of $PYTHON first on PATH: a venv used without `activate` (PYTHON=venv/bin/python)
# keeps its tools there (nbgrader's alembic, jupyter, fsdp-lab), and they call each other by name.
PY_DIR=$(cd "$(dirname "$(command -v "$PY")")" && pwd)
case ":$PATH:" in *":$PY_DIR:"*) ;; *) export PATH="$PY_DIR:$PATH" ;; esac
if [ "$what" = path ]; then echo "$PATH"; exit 0; fi  # what the other steps run with

# 1. graphviz's `dot` for the wrap-boundary diagrams (the labs fall back to DOT source without it).
if ! command -v dot >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || command -v sudo >/dev/null 2>&1; }; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    say "installing graphviz (dot) with apt-get"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq graphviz >/dev/null \
      || say "could not install graphviz: diagrams will show their DOT source instead"
  else
    say "graphviz's dot not found and apt-get unavailable: diagrams will show their DOT source"
  fi
fi

# 1a. bubblewrap (`bwrap`) for `fsdp-lab grade`: each submission runs in its sandbox (without
#     it, grading says so and runs submissions unsandboxed, with your rights).
if ! command -v bwrap >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || command -v sudo >/dev/null 2>&1; }; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    say "installing bubblewrap (bwrap) with apt-get"
    $SUDO apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
      || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq bubblewrap >/dev/null; } \
      || say "could not install bubblewrap: fsdp-lab grade will run submissions unsandboxed"
  else
    say "bubblewrap (bwrap) not found and apt-get unavailable: fsdp-lab grade runs unsandboxed"
  fi
fi

# 1b. iproute2's `ip` and `tc` for the HSDP lab's emulated nodes (network namespaces, as root);
#     without them that one section says why it skips.
if { ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; } \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  say "installing iproute2 (ip, tc) with apt-get"
  apt-get install -y -qq iproute2 >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null; } \
    || say "could not install iproute2: the emulated-nodes section will skip"
fi

# 2. torch, chosen for this machine before anything else can ask pip for it.
if "$PY" -c "import torch" >/dev/null 2>&1; then
  say "keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "NVIDIA GPU found: installing torch==$TORCH_VERSION (CUDA build)"
  "$PY" -m pip install "torch==$TORCH_VERSION"
else
  say "no GPU: installing the CPU build torch==$TORCH_VERSION+cpu"
  "$PY" -m pip install "torch==$TORCH_VERSION+cpu" \
    || "$PY" -m pip install "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi

# 3. the package itself (editable, so notebooks see your edits) and its Python dependencies.
extra=$(case "$what" in test|e2e) echo "[dev]" ;; esac)
say "installing fsdp_lab$extra"
"$PY" -m pip install -q -e ".$extra"
"$PY" -c "import torch, fsdp_lab; print('[setup] fsdp_lab', fsdp_lab.__version__, 'with torch', torch.__version__)"

# 4. what was asked for.
case "$what" in
  tour) exec "$PY" -m fsdp_lab tour --out fsdp_lab_out ;;
  test) exec "$PY" -m pytest -q tests ;;
  e2e) exec "$PY" -m pytest -q -m e2e tests ;;  # the end-to-end runs the suite leaves out
esac
