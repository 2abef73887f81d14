# The image that k8s/ runs (docs/kubernetes.md): forge_rl installed with `make install` as in the
# README, GPU path. torch 2.13 wheels bring their own CUDA 13 libraries; the CUDA devel base adds
# what they do not: gcc and nvcc for the kernels Triton and vLLM compile at run time, and the
# NVIDIA_* variables that make the container runtime mount the host's driver, which must be
# CUDA 13.0's: NVIDIA driver 580 or newer on the GPU nodes. Python is Ubuntu 24.04's, 3.12.
FROM nvidia/cuda:13.0.0-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential make ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/forge_rl
COPY . .
# No GPU is visible while an image builds, so the GPU path is named rather than detected
# (scripts/install.sh otherwise picks it when nvidia-smi finds a GPU); Weights & Biases is included.
RUN MACHINE=gpu EXTRAS=wandb make install
ENV PATH=/opt/forge_rl/.venv/bin:$PATH

# The trainer and the BlackJack server run as this user (runAsUser in k8s/); the code interpreter
# runs as nobody (65534). Nothing in the image is writable by either.
RUN useradd --uid 10001 --create-home forge
USER 10001
