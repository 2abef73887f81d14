"""The package's shape, kept: imports go one way (.importlinter's contracts), no module grows past what one read
takes in, and the README names every module a newcomer meets."""

import ast
import builtins
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "forge_rl"
MAX_MODULE_LINES = 400


def test_imports_go_one_way():
    """lint-imports checks .importlinter: each layer imports only the layers below it, and forge_rl never imports
    an app. A module importing upward (a runtime module reaching for the recipe, say) fails here with the import."""
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The contract can fail: a copy of the package where core imports the recipe is refused."""
    import shutil

    copy = tmp_path / "repo"
    shutil.copytree(PACKAGE, copy / "forge_rl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "apps", copy / "apps", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", copy / ".importlinter")
    types = copy / "forge_rl" / "core" / "types.py"
    types.write_text(types.read_text() + "\nfrom forge_rl.recipes.grpo import loop  # noqa\n")
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--config", ".importlinter"], cwd=copy, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"})
    assert result.returncode != 0 and "forge_rl.core.types -> forge_rl.recipes.grpo.loop" in result.stdout, result.stdout[-2000:]


def test_no_module_is_longer_than_one_read():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_the_readme_names_every_module():
    """The README's architecture table names each module of the package as `folder/module.py` (a package's
    __init__.py with code in it as `folder/`)."""
    named = set(re.findall(r"`([a-z_/]+(?:\.py|/))`", (ROOT / "README.md").read_text()))
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE))
        if path.name == "__main__.py":  # the package's command, named with the package
            continue
        if path.name == "__init__.py":
            if path.parent != PACKAGE and len(path.read_text().splitlines()) > 5 and module.removesuffix("__init__.py") not in named:
                missing.append(module.removesuffix("__init__.py"))
        elif module not in named:
            missing.append(module)
    assert not missing, f"README.md does not name {missing}"


def names_annotations_use_unbound(source: str) -> set[str]:
    """Names in the function and variable annotations of a module that nothing in it binds."""
    tree, bound, used = ast.parse(source), set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    for node in ast.walk(tree):
        annotations = [node.annotation] if isinstance(node, (ast.AnnAssign, ast.arg)) and node.annotation else []
        annotations += [node.returns] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns else []
        used.update(n.id for a in annotations for n in ast.walk(a) if isinstance(n, ast.Name))
    return used - bound


def test_annotations_name_what_their_module_has():
    """Under `from __future__ import annotations` nothing evaluates an annotation, so a function that names a
    type its module never imports runs as if it did: the mark of dead or copied code nobody calls."""
    unbound = {str(p.relative_to(ROOT)): names for p in PACKAGE.rglob("*.py") if (names := names_annotations_use_unbound(p.read_text()))}
    assert not unbound, f"annotations naming what their module does not import or define: {unbound}"


def test_no_modules_import_each_other():
    """An import circle shows where layering broke: a lower module reaching back for the one that uses it
    (for a type hint, say). Only a package's __init__ may import its own modules (weights/: one per transport)."""
    import grimp

    graph = grimp.build_graph("forge_rl", include_external_packages=False)
    packages = {m for m in graph.modules if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").is_file()}
    circles = sorted(
        (m, n) for m in graph.modules - packages for n in graph.find_modules_directly_imported_by(m) - packages
        if graph.chain_exists(importer=n, imported=m)
    )
    assert not circles, f"modules that import each other, directly or through others: {circles}"
