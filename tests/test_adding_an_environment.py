"""docs/adding_an_environment.md, followed literally: its files written out of the page into a folder outside
the repository, its commands run as it gives them (the config check, the server alone, a few training steps
on the tiny model), its word check, and its Kubernetes overlay rendered over k8s/base and validated offline.

The training run also checks what the page promises about it: a game cut off at rollout.max_turns scores
rollout.cutoff_reward, eval_metrics receives the reference policies' mean rewards, and with Weights & Biases
(offline here) the resolved config is logged with the run.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from forge_rl.core.config import parse_cli
from forge_rl.envs.local import launch_local
from forge_rl.recipes.metrics import read_metrics
from forge_rl.rollout.env_client import EnvSession
from tests.test_k8s import KUBERNETES_VERSIONS, find, kubectl, pod_spec

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "docs" / "adding_an_environment.md").read_text()
ENV_CLASS = "guess_number.env:GuessNumberEnvironment"


def guide_files() -> dict[str, str]:
    """The page's code blocks whose first line names a file (`# guess_number/env.py`): path -> text."""
    files = {}
    for block in re.findall(r"^```\w*\n(.*?)^```", GUIDE, re.S | re.M):
        name = re.fullmatch(r"# (\S+)", block.splitlines()[0])
        if name:
            files[name.group(1)] = block
    return files


def guide_commands(tool: str) -> list[list[str]]:
    """The page's `... -m <tool> ...` command lines, as argument lists from `-m` on."""
    shell = "\n".join(re.findall(r"^```sh\n(.*?)^```", GUIDE, re.S | re.M))
    lines = [line for line in shell.splitlines() if re.search(rf"-m {re.escape(tool)}(\s|$)", line)]
    return [shlex.split(line[line.index("-m ") :].split("  #")[0]) for line in lines]


@pytest.fixture(scope="module")
def my_envs(tmp_path_factory) -> Path:
    """~/my_envs as the page leaves it: the package, its empty __init__.py, the config."""
    folder = tmp_path_factory.mktemp("my_envs")
    for package in ("guess_number", "sums"):
        (folder / package).mkdir()
        (folder / package / "__init__.py").touch()
    for name, text in guide_files().items():
        if not name.startswith("my_overlay/") and name != "Dockerfile":
            (folder / name).write_text(text)
    return folder


def environment(my_envs: Path, **extra: str) -> dict:
    """`export PYTHONPATH=$PWD` in ~/my_envs (and this checkout, which the shared venv does not install)."""
    return {**os.environ, "PYTHONPATH": f"{my_envs}{os.pathsep}{ROOT}", **extra}


def test_the_page_writes_every_file_it_uses():
    assert set(guide_files()) == {
        "guess_number/env.py", "guess_number/tasks.py", "guess_number/task.py", "guess_number.yaml", "Dockerfile",
        "guess_number/tools.py", "guess_number/tools_task.py",
        "my_overlay/guess-number.yaml", "my_overlay/kustomization.yaml",
        "sums/make_data.py", "sums/task.py", "sums.yaml",
    }
    assert ENV_CLASS in GUIDE and "touch guess_number/__init__.py" in GUIDE and "touch sums/__init__.py" in GUIDE


def test_the_word_check_prints_what_the_page_shows(my_envs):
    (line,) = [x for x in GUIDE.splitlines() if "-c \"from forge_rl.models.tiny" in x]
    shown = GUIDE.splitlines()[GUIDE.splitlines().index(line) + 1]
    out = subprocess.run([sys.executable, *shlex.split(line)[1:]], env=environment(my_envs), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == shown, out.stderr[-2000:]


def test_the_server_serves_reset_args_and_reproducible_games(my_envs):
    """`python -m forge_rl.envs guess_number.env:GuessNumberEnvironment` (what launch_local runs): reset_args
    arrive as reset's keyword arguments, and one seed is one number."""
    (command,) = guide_commands("forge_rl.envs")
    assert command[2] == ENV_CLASS

    async def play(url: str, seed: int, high: int) -> tuple[int, int]:
        async with EnvSession(url, timeout_s=30) as session:
            obs = (await session.reset(seed=seed, high=high)).observation
            while not obs["done"]:
                obs = (await session.step({"guess": (obs["low"] + obs["high"]) // 2})).observation
            return obs["last_guess"], obs["guesses"]

    with launch_local(ENV_CLASS, env={"PYTHONPATH": environment(my_envs)["PYTHONPATH"]}) as server:
        small = [asyncio.run(play(server.url, seed, 3)) for seed in range(8)]
        twice = [asyncio.run(play(server.url, 5, 15)) for _ in range(2)]
    assert all(0 <= number <= 3 for number, _ in small) and len({n for n, _ in small}) > 1
    assert twice[0] == twice[1]


def test_the_pages_task_splits_are_served_sized_and_played(my_envs):
    """"Task splits": the server publishes the page's splits through OpenEnv's Task API; the run sizes
    env.task_split and eval.task_split from it (a split it lacks stops with one line naming the key); a group
    resets on a seeded index of the training split, evaluation game i on task i; reset(split, index) plays
    that task."""
    from types import SimpleNamespace

    from forge_rl.core.config import ConfigError, load_config
    from forge_rl.rollout.evaluation import Evaluation
    from forge_rl.rollout.rollouts import Rollouts
    from forge_rl.rollout.sessions import task_split_sizes

    target = "guess_number.tasks:GuessNumberTasks"
    assert "guess_number/tasks.py" in guide_files()
    config = my_envs / "guess_number.yaml"

    def cfg(*overrides):
        return load_config(config, ["env.server=null", "env.url=http://127.0.0.1:1", *overrides])

    async def found(url: str, split: str, index: int) -> int:
        async with EnvSession(url, timeout_s=30) as session:
            obs = (await session.reset(seed=0, split=split, index=index)).observation
            while not obs["done"]:
                obs = (await session.step({"guess": (obs["low"] + obs["high"]) // 2})).observation
            return obs["last_guess"]

    with launch_local(target, env={"PYTHONPATH": environment(my_envs)["PYTHONPATH"]}) as server:
        sizes = task_split_sizes(server.url, cfg("env.task_split=train", "eval.task_split=eval"))
        with pytest.raises(ConfigError, match=r"^eval\.task_split: 'test' is not a split of the server at .* \(it has: train, eval\)$"):
            task_split_sizes(server.url, cfg("eval.task_split=test"))
        played = [asyncio.run(found(server.url, "eval", i)) for i in range(4)]
    assert sizes == {"train": 4, "eval": 4}
    assert played == [0, 5, 9, 15]  # the page's SPLITS["eval"], in order

    run = cfg("env.task_split=train", "eval.task_split=eval", "eval.num_games=10", "env.reset_args={high: 15}")
    rollouts = SimpleNamespace(cfg=run, num_tasks=sizes)
    draws = [Rollouts.task_reset_args(rollouts, seed) for seed in range(40)]
    assert all(d["split"] == "train" and d["high"] == 15 for d in draws)
    assert {d["index"] for d in draws} == {0, 1, 2, 3} and draws == [Rollouts.task_reset_args(rollouts, s) for s in range(40)]
    games = Evaluation(rollouts).games()  # 10 games asked, the split has 4 tasks
    assert [args["index"] for _, args in games] == [0, 1, 2, 3] and all(args["split"] == "eval" for _, args in games)
    assert Rollouts.task_reset_args(SimpleNamespace(cfg=cfg(), num_tasks={}), 7) is None  # no split: seeds alone


CONFIGS = ["guess_number.yaml", "sums.yaml"]  # the page's, in its order


def test_the_pages_check_commands_pass(my_envs):
    """The page's check commands (the tiny model's; SmolLM2's on the dataset, once make_data wrote it): the
    config, the app module and the environment class or the dataset are checked."""
    check, train = guide_commands("forge_rl.config"), guide_commands("forge_rl.grpo")
    assert check == [["-m", "forge_rl.config", "--config", c] for c in CONFIGS] and train == [["-m", "forge_rl.grpo", "--config", c] for c in CONFIGS]
    (make_data,) = guide_commands("sums.make_data")
    subprocess.run([sys.executable, *make_data], cwd=my_envs, env=environment(my_envs), check=True, timeout=60)
    for command, module in zip(check, ("guess_number.task", "sums.task")):
        out = subprocess.run([sys.executable, *command], cwd=my_envs, env=environment(my_envs), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and module in out.stdout, out.stderr[-2000:]
        assert "warning" not in out.stderr, out.stderr  # every model-dependent key stated


@pytest.mark.slow  # a whole run (1.5 minutes here, more in CI; the suite keeps under 20): make test-slow runs it
def test_the_pages_run_trains_a_few_steps_on_the_tiny_model(my_envs, tmp_path):
    """The page's second command, the run shortened to 3 steps with an evaluation at its end, 2 guesses a game
    and cut-off games scored -3 (the page's -1 would equal a loss and prove nothing), W&B logging offline."""
    train = guide_commands("forge_rl.grpo")[0]
    run_dir = tmp_path / "run"
    short = [f"run_dir={run_dir}", "trainer.max_steps=3", "grpo.batch_size=4", "eval.interval=3", "eval.num_games=32",
             "rollout.max_turns=2", "rollout.cutoff_reward=-3", "logging.wandb_project=guide"]
    env = environment(my_envs, WANDB_MODE="offline", WANDB_SILENT="true")
    out = subprocess.run([sys.executable, *train, *short], cwd=my_envs, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    untrained, last = [r for r in rows if "eval/found" in r]  # the run opens with the untrained policy's
    assert untrained["step"] == 0 and last["step"] == 3
    found = last["eval/found"]
    # Every game either found the number (1) or was cut off after 2 guesses (-3): constrained answers are never invalid.
    assert last["eval/reward"] == pytest.approx(found - 3 * (1 - found)) and found < 1
    assert last["eval/bisect"] == 1.0, "eval_metrics receives the reference policies' mean rewards (bisect always finds it)"
    (record,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    logged = record.read_bytes()
    # keys of the config that neither the command line nor the file names: only the resolved config holds them
    assert b"invalid_action_penalty" in logged and b"micro_batch_size" in logged, "the resolved config is logged with the run"


@pytest.mark.slow  # SmolLM2 on CPU: about 5 minutes here
def test_the_pages_smollm2_run_on_the_dataset_trains_a_few_steps_in_free_text(my_envs, tmp_path):
    """Section 5's run, shortened to 2 steps: the dataset server launched by the run, free-text answers whose
    action is the last number they name, the held-out accuracy at step 0 and at the end."""
    (make_data,) = guide_commands("sums.make_data")
    subprocess.run([sys.executable, *make_data], cwd=my_envs, env=environment(my_envs), check=True, timeout=60)
    train = guide_commands("forge_rl.grpo")[1]
    run_dir = tmp_path / "run"
    short = [f"run_dir={run_dir}", "trainer.max_steps=2", "eval.interval=2", "eval.num_games=8", "logging.samples_every=1"]
    out = subprocess.run([sys.executable, *train, *short], cwd=my_envs, env=environment(my_envs), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    assert [r["step"] for r in rows if "eval/reward" in r] == [0, 2]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    turns = [t for s in samples for t in s["turns"]]
    assert {s["step"] for s in samples} >= {0, 1, 2} and all(len(s["turns"]) == 1 for s in samples)
    assert all(t["action"] is None or t["action"]["answer"] == re.findall(r"-?\d+", t["answer"])[-1] for t in turns)


def test_the_pages_dataset_is_served_with_its_reward_and_its_config_is_the_shipped_ones(my_envs):
    """Section 6: the dataset server launched as a run launches it serves the page's sums.jsonl (written by
    its make_data) with its `split` field, the observation is the prompt alone, a step is scored by the page's
    reward; the page's sums.yaml sets nothing that configs/sums_smollm2_cpu.yaml (the measured run) sets otherwise."""
    from forge_rl.core.config import load_config
    from forge_rl.envs.rows import server_variables
    from forge_rl.rollout.sessions import task_split_sizes

    (make_data,) = guide_commands("sums.make_data")
    subprocess.run([sys.executable, *make_data], cwd=my_envs, env=environment(my_envs), check=True, timeout=60)
    page = load_config(my_envs / "sums.yaml", [])
    variables = server_variables(str(my_envs / page.env.dataset), page.app_module, page.env.test_fraction, page.env.reward_timeout_s)

    async def play(url: str, answer: str) -> tuple[dict, dict]:
        async with EnvSession(url, timeout_s=30) as session:
            first = (await session.reset(seed=0, split="test", index=0)).observation
            return first, (await session.step({"answer": answer})).observation

    with launch_local(page.env.server, env={**variables, "PYTHONPATH": environment(my_envs)["PYTHONPATH"]}) as server:
        assert task_split_sizes(server.url, page) == {"train": 70, "test": 30}
        first, _ = asyncio.run(play(server.url, "0"))
        a, b = map(int, re.findall(r"\d+", first["prompt"]))
        _, right = asyncio.run(play(server.url, str(a + b)))
        _, wrong = asyncio.run(play(server.url, str(a + b + 1)))
    assert set(first) == {"prompt", "done", "reward", "metadata"} and not first["done"]
    assert (right["reward"], wrong["reward"], right["done"]) == (1.0, 0.0, True)

    given = yaml.safe_load((my_envs / "sums.yaml").read_text())
    shipped = load_config(ROOT / "configs" / "sums_smollm2_cpu.yaml", [])

    def leaves(tree, prefix=""):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]

    for key, value in leaves(given):
        if key not in ("run_dir", "app_module", "env.dataset"):
            section, *rest = key.split(".")
            assert functools.reduce(getattr, rest, getattr(shipped, section)) == value, key


def test_the_overlay_renders_over_the_base_and_validates(tmp_path):
    """my_overlay beside a checkout of forge_rl, as the page puts it: rendered with kubectl kustomize and
    validated offline; the Job runs the page's config against the page's Service, which runs the page's class."""
    files = guide_files()
    overlay = tmp_path / "my_overlay"
    overlay.mkdir()
    (overlay / "guess-number.yaml").write_text(files["my_overlay/guess-number.yaml"])
    base = os.path.relpath(ROOT / "k8s" / "base", overlay)
    (overlay / "kustomization.yaml").write_text(files["my_overlay/kustomization.yaml"].replace("../forge_rl/k8s/base", base))
    out = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    objects = [o for o in yaml.safe_load_all(out.stdout) if o]
    for o in objects:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(o, version, strict=True)

    (server,) = pod_spec(find(objects, "Deployment", "guess-number"))["containers"]
    assert server["command"][:4] == ["python", "-m", "forge_rl.envs", ENV_CLASS]
    assert server["image"] == "registry.example.com/you/forge-rl-env-guess-number:0.1.0"
    (controller,) = pod_spec(find(objects, "Job", "blackjack-grpo"))["containers"]
    args = controller["command"][3:]
    assert args[args.index("--config") + 1] == "/opt/my_envs/guess_number.yaml"
    assert "COPY guess_number.yaml /opt/my_envs/" in files["Dockerfile"] and "ENV PYTHONPATH=/opt/my_envs" in files["Dockerfile"]
    config = tmp_path / "guess_number.yaml"
    config.write_text(files["guess_number.yaml"])
    args[args.index("--config") + 1] = str(config)
    cfg = parse_cli(args)
    assert cfg.env.url == "http://guess-number:8000" and cfg.env.server is None
    service = find(objects, "Service", "guess-number")
    labels = find(objects, "Deployment", "guess-number")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["port"] == 8000 and service["spec"]["selector"].items() <= labels.items()


def test_the_tools_section_trains_a_tool_call_into_the_environments_reward(my_envs, tmp_path, monkeypatch):
    """The page's MCPEnvironment, served from ~/my_envs, with its app: a game whose answers are guess calls
    (bisecting on the tool's higher/lower) is found and scored by the environment's reward."""
    from tests.chat_helpers import CONFIG, build_scripted_model
    from tests.test_tools import Scripted, call, tool_rollouts

    monkeypatch.syspath_prepend(str(my_envs))
    monkeypatch.setenv("PYTHONPATH", f"{my_envs}{os.pathsep}{ROOT}")
    with launch_local("guess_number.tools:GuessTools", max_concurrent_envs=4, timeout_s=180) as server:
        r = tool_rollouts(tmp_path, build_scripted_model(tmp_path / "m"), server.url, "app_module=guess_number.tools_task")
        answers = Scripted(r.tokenizer, [call("guess", n=8), call("guess", n=4), call("guess", n=6), call("guess", n=5)])

        async def main():
            try:
                from forge_rl.rollout.play import play_game
                return await play_game(r, 5, "g", answers)  # reset(seed=5): the number is 5
            finally:
                await r.close()

        result = asyncio.run(main())
    assert [t[2]["arguments"]["n"] for t in result.turns] == [8, 4, 6, 5] and result.reward == 1.0
    assert [t["function"]["name"] for t in r.app.tools] == ["guess"] and CONFIG.exists()
