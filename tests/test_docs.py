"""The README and docs/ stay true and small: every training or config-check command they give passes the
config check (as `python -m forge_rl.config` runs it, in this process), every repository path, module and
link they name exists, docs/index.md lists every page, and they stay reference, not a diary; the code's
comments say why, and leave what one run measured to docs/results.md.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
import shlex
from pathlib import Path

import pytest

from forge_rl.core.config import load_config
from forge_rl.recipes.grpo.check import check_run

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GUIDE = ROOT / "docs" / "adding_an_environment.md"  # its commands run in tests/test_adding_an_environment.py
README_MAX_CHARS = 15_000
DOCS_MAX_BYTES = 119_300  # README + docs/*.md: about half of the 178 KB they were while they held measurement history (+5 KB: estimators.md; +2 KB: datasets, task splits; +0.9 KB: reasoning-gym tasks; +2.4 KB: code on SmolLM2, pass@k, MCP tools; +1 KB: tools for agents, multi-turn code, the code bench; +0.5 KB: PPO's minibatches, BlackJack learnt from the outcome; +0.5 KB: LoRA's fused layer and its cost; +2.1 KB: red team; +2.1 KB: bad rewards and bad input; +5.1 KB: each estimator's own loss, the KL estimators' gradients, the exact-gradient harness; +5.2 KB: Qwen2.5-Coder and its tool calls, defaults that fit a config; +1.5 KB: the shortest config, timed; +1.3 KB: Qwen2.5 trained to call tools, and the README's row; +0.5 KB: every CPU config rerun on the packed trainer, the tiny code run's spread under rounding)
TOP_LEVEL = ("forge_rl", "apps", "configs", "docs", "tests", "bench", "scripts", "k8s")
DEFAULT_CONFIG = "configs/blackjack_tiny_cpu.yaml"  # the Makefile's CONFIG


def code_spans(text: str) -> list[str]:
    """Fenced blocks (backslash-continued lines joined) and inline code spans, each as one string."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    spans = [line for block in fenced for line in block.replace("\\\n", " ").splitlines()]
    return spans + [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", rest)]


def commands(page: Path) -> list[tuple[str, list[str]]]:
    """(config file, overrides) of each `-m forge_rl.grpo|forge_rl.config` and `make train` command."""
    found = []
    for span in code_spans(page.read_text()):
        for match in re.finditer(r"-m (forge_rl\.grpo|forge_rl\.config)\b(.*)|\bmake train\b(.*)", span):
            if match.group(1):
                args = shlex.split(match.group(2), comments=True)
                if "--config" not in args:
                    continue
                config = args[args.index("--config") + 1]
            else:
                args = shlex.split(match.group(3), comments=True)
                config = next((a.split("=", 1)[1] for a in args if a.startswith("CONFIG=")), DEFAULT_CONFIG)
                args = [o for a in args if a.startswith("ARGS=") for o in shlex.split(a.split("=", 1)[1])]
            found.append((config, [a for a in args if "=" in a and not a.startswith(("-", "CONFIG="))]))
    return found


def every_command():
    return [pytest.param(config, overrides, id=f"{page.name}:{config}:{' '.join(overrides)}"[:120])
            for page in PAGES for config, overrides in commands(page)]


def test_the_pages_give_commands():
    readme = commands(ROOT / "README.md")
    assert (DEFAULT_CONFIG, []) in readme and len(readme) >= 3, readme


@pytest.mark.parametrize("config, overrides", every_command())
def test_every_command_passes_the_config_check(config, overrides):
    """What `python -m forge_rl.config` checks (host-independent part), for each command as written."""
    config = config.replace("/etc/forge_rl/configs/", "configs/")  # where the Kubernetes Job mounts configs/
    if not (ROOT / config).is_file():
        assert f"--config {config}" in GUIDE.read_text(), f"{config}: not in the repository, and not the guide's own file"
        return
    check_run(load_config(ROOT / config, overrides), this_host=False)


def named_paths(text: str) -> set[str]:
    pattern = rf"(?<![\w/.~$-])(?<!apiVersion: )((?:{'|'.join(TOP_LEVEL)})/[\w./-]*[\w/])"
    return {p.split("::")[0] for p in re.findall(pattern, text)}


def test_every_repository_path_module_and_link_exists():
    missing = []
    for page in PAGES:
        text = page.read_text()
        missing += [f"{page.name}: {p}" for p in named_paths(text) if not (ROOT / p).exists()]
        for span in code_spans(text):
            for module in re.findall(r"-m ((?:forge_rl|apps)[\w.]*)", span):
                if importlib.util.find_spec(module) is None:
                    missing.append(f"{page.name}: python -m {module}")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                missing.append(f"{page.name}: link {target}")
            elif anchor and anchor not in anchors(path):
                missing.append(f"{page.name}: link {target} (no such heading)")
    assert not missing, missing


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_code_and_configs_name_only_pages_that_exist():
    files = [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts and ".venv" not in p.parts and ".venv-env" not in p.parts
             and (p.suffix in (".py", ".yaml", ".sh", ".toml") or p.name in ("Dockerfile", "Makefile", "Kustomization"))]
    named = {(f.relative_to(ROOT), d) for f in files for d in re.findall(r"docs/[\w/.-]*\.md", f.read_text(errors="replace"))}
    assert named and all((ROOT / d).is_file() for _, d in named), sorted(str(x) for x in named if not (ROOT / x[1]).is_file())


def test_sizes():
    assert len((ROOT / "README.md").read_text()) <= README_MAX_CHARS
    total = sum(len(p.read_bytes()) for p in PAGES)
    assert total <= DOCS_MAX_BYTES, f"README + docs/ hold {total} bytes; move history out (git keeps it)"


def test_the_readme_has_the_front_doors_sections():
    headings = re.findall(r"^## (.*)$", (ROOT / "README.md").read_text(), re.M)
    for wanted in ("The two commands", "What you will see", "One episode", "Configuration", "Adding an environment",
                   "Deploying", "Results"):
        assert any(h.startswith(wanted) for h in headings), (wanted, headings)


def test_the_index_lists_every_page_once():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in PAGES[1:]:
        if page.name != "index.md":
            assert index.count(f"]({page.name})") == 1, page.name


def test_reference_not_a_diary():
    """No section named after a day or a time of day, no commit hashes, no branch names in prose."""
    when = r"\b(january|february|march|april|may|june|july|august|september|october|november|december|morning|afternoon|evening|night|today|yesterday)\b"
    problems = []
    for page in PAGES:
        text = page.read_text()
        problems += [f"{page.name}: heading {h!r}" for h in re.findall(r"^#+ (.*)$", text, re.M) if re.search(when, h, re.I)]
        problems += [f"{page.name}: {h}" for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", h) and re.search(r"[a-f]", h)]
        problems += [f"{page.name}: {b!r}" for b in re.findall(r"\bbranch(?:es)? `?[\w/-]+`?", text, re.I)]
    assert not problems, problems


# A figure one run measured: a time or a size, or a ratio ("~20x slower", "0.85x as long").
MEASURED = re.compile(r"\d(?:[\d,.]*\d)?(?:-\d[\d.]*)?\s?(?:ms|GB|MB|KB)\b|\b\d+(?:\.\d+)?x\b")


def comments(path: Path) -> list[str]:
    """A module's comments and docstrings, or a YAML file's comments."""
    text = path.read_text()
    if path.suffix != ".py":
        return [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]
    found = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return found + [doc for node in ast.walk(ast.parse(text)) if isinstance(node, documented) and (doc := ast.get_docstring(node))]


def test_code_comments_say_why_not_what_one_run_measured():
    """A run's timing or size in a comment goes stale with the next change, and no one reruns it; what is worth
    keeping goes to docs/results.md with its date and command."""
    files = [*(ROOT / "forge_rl").rglob("*.py"), *(ROOT / "apps").rglob("*.py"), *(ROOT / "configs").glob("*.yaml")]
    found = [f"{f.relative_to(ROOT)}: {m.group()!r} in {c.strip()[:80]!r}" for f in files for c in comments(f) for m in MEASURED.finditer(c)]
    assert not found, found


def test_the_guide_names_everything_the_app_loader_reads():
    """The guide's contract table lists each name `load_app` reads from an app module (SYSTEM_PROMPT too, without
    which SmolLM2's template names itself); `run_agent` is chat_agents.md's."""
    source = (ROOT / "forge_rl" / "core" / "app.py").read_text()
    loader = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "load_app")
    read = {c.args[1].value for c in ast.walk(loader) if isinstance(c, ast.Call) and getattr(c.func, "id", "") in ("getattr", "hasattr")
            and isinstance(c.args[1], ast.Constant) and isinstance(c.args[1].value, str)} - {"run_agent"}
    table = set(re.findall(r"^\| `(\w+)", GUIDE.read_text(), re.M)) | set(re.findall(r"^\| `\w+` or `(\w+)`", GUIDE.read_text(), re.M))
    assert "SYSTEM_PROMPT" in read and read <= table, f"not in the contract table of {GUIDE.name}: {sorted(read - table)}"
