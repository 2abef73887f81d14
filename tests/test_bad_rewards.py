"""A reward is a finite number or an error (issue #53): every path that brings one refuses NaN, +-inf and
non-numbers as an error of that episode; a hung reward function holds neither its session nor the run; a step
that timed out is never sent again; an errored episode costs its group, counted by reason, never the run.
Against the real dataset server (tests/hostile_app.py's reward) and a real run; the other paths are tested beside
their code (test_env_client.py, test_agents.py, test_tools.py, test_chat_server.py)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from forge_rl.core.app import load_app
from forge_rl.core.config import EnvConfig, load_config
from forge_rl.core.rewards import RewardError, checked_reward
from forge_rl.envs.local import launch_local
from forge_rl.envs.rows import server_variables
from forge_rl.recipes.metrics import read_metrics
from forge_rl.rollout.evaluation import Evaluation
from forge_rl.rollout.rollouts import Rollouts
from forge_rl.rollout.env_client import EnvSession, EnvTimeout

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parent.parent
KINDS = {"nan": "reward_not_finite", "inf": "reward_not_finite", "-inf": "reward_not_finite", "str": "reward_not_a_number",
         "bool": "reward_not_a_number", "raise": "reward_raised", "hang": "reward_timeout"}  # fmt: skip


def rows(path: Path) -> Path:
    """Row 0 answers right; row i + 1 is bad the i-th way of KINDS."""
    good = [{"prompt": "Is one one? Answer yes or no.", "answer": "yes"}]
    bad = [{"prompt": f"Is {kind} one? Answer yes or no.", "answer": "no", "bad": kind} for kind in KINDS]
    path.write_text("".join(json.dumps(row) + "\n" for row in good + bad))
    return path


def hostile_server(tmp_path: Path, reward_timeout_s: float, sessions: int):
    variables = server_variables(str(rows(tmp_path / "rows.jsonl")), "tests.hostile_app", 0.0, reward_timeout_s)
    variables["HOSTILE_CALLS"] = str(tmp_path / "calls")
    return launch_local(EnvConfig.DATASET_SERVER, env=variables, max_concurrent_envs=sessions)


async def step_on(url: str, index: int, answer: str = "no", **session):
    async with EnvSession(url, **session) as env:
        await env.reset(split="train", index=index)
        return await env.step({"answer": answer})


def test_a_reward_is_a_finite_number_or_an_error():
    assert [checked_reward(v, "r") for v in (1, -0.5, np.float32(0.25), Fraction(1, 2))] == [1.0, -0.5, 0.25, 0.5]
    for value, reason in [(math.nan, "reward_not_finite"), (math.inf, "reward_not_finite"), (-math.inf, "reward_not_finite"),
                          ("0.7", "reward_not_a_number"), (True, "reward_not_a_number"), (None, "reward_not_a_number")]:
        with pytest.raises(RewardError, match=f"^{reason}: r gave ") as e:
            checked_reward(value, "r")
        assert e.value.reason == reason and "\n" not in str(e.value)


def test_the_dataset_server_refuses_every_bad_reward_and_a_hung_one_frees_its_session(tmp_path):
    """Each bad reward is the step's error, its reason named; with env.reward_timeout_s=1 a hung reward function
    is one within about a second, and three of them in a row leave a 2-session server answering."""
    with hostile_server(tmp_path, reward_timeout_s=1.0, sessions=2) as server:
        assert asyncio.run(step_on(server.url, 0, "yes", timeout_s=30)).reward == 1.0
        for i, (kind, reason) in enumerate(KINDS.items(), 1):
            start = time.monotonic()
            with pytest.raises(RewardError, match=f"^{reason}: tests.hostile_app.reward ") as e:
                asyncio.run(step_on(server.url, i, timeout_s=30))
            assert e.value.reason == reason, kind
        assert time.monotonic() - start < 5, "the hung reward function is cut off at env.reward_timeout_s"
        for _ in range(2):
            with pytest.raises(RewardError, match="^reward_timeout: "):
                asyncio.run(step_on(server.url, len(KINDS), timeout_s=30))
        assert asyncio.run(step_on(server.url, 0, "yes", timeout_s=30, capacity_wait_s=0)).reward == 1.0


def test_a_step_that_timed_out_is_never_sent_again(tmp_path):
    """The client gives up on a step before the server does (timeout_s 1 s, env.reward_timeout_s 60 s): the episode
    ends at once, and the step reached the server once, not once per restored session (max_restores + 1)."""
    with hostile_server(tmp_path, reward_timeout_s=60.0, sessions=8) as server:
        start = time.monotonic()
        with pytest.raises(EnvTimeout, match="no answer to a step within timeout_s=1 s"):
            asyncio.run(step_on(server.url, len(KINDS), timeout_s=1, max_restores=3, restore="replay"))
        assert time.monotonic() - start < 5
        time.sleep(2)  # time for any step sent again to arrive
    assert (tmp_path / "calls").read_text().split() == ["hang"]


def test_reference_policies_leave_a_lost_game_out(tmp_path):
    """The reference policies' games (played when a run starts, and again when it restarts) meet the same bad
    rewards: each such game is left out of their figure instead of stopping the run at start."""
    cfg = load_config(ROOT / "configs" / "blackjack_tiny_cpu.yaml", ["app_module=tests.hostile_app", "env.server=null",
                      f"env.dataset={rows(tmp_path / 'rows.jsonl')}", "eval.task_split=train", "eval.num_games=8"])  # fmt: skip
    app = load_app(cfg.app_module, cfg.sampling.constrained, dataset=True)
    with hostile_server(tmp_path, reward_timeout_s=1.0, sessions=8) as server:
        rollouts = Rollouts(cfg, app, None, None, server.url, None)  # no policy: references need none
        rollouts.num_tasks = {"train": 1 + len(KINDS)}

        async def play():
            try:
                return await Evaluation(rollouts).play_references()
            finally:
                await rollouts.close()

        assert asyncio.run(play()) == {"eval/reference/always_yes": 1.0}  # row 0's; the 7 bad rows' games left out
    assert rollouts.reasons_said == set(KINDS.values())


@pytest.mark.slow  # two minutes of a real run (vLLM engine, trainer, reference): make test-slow runs it
def test_a_run_whose_reward_function_misbehaves_trains_to_the_end(tmp_path):
    """`python -m forge_rl.grpo`, synchronous (the default), the tiny model on a dataset whose reward function
    misbehaves on 7 of 15 rows in each of KINDS' ways: the run ends its steps (one game that raised stopped the
    synchronous loop before), each lost group counted by reason and each reason said once in run.log, the
    evaluation's lost games left out, every weight finite."""
    good = [{"prompt": f"Is {word} one? Answer yes or no.", "answer": answer} for word, answer in
            [("one", "yes"), ("two", "no"), ("1", "yes"), ("three", "no"), ("uno", "yes"), ("four", "no"), ("I", "yes"), ("five", "no")]]
    bad = [{"prompt": f"Is {kind} one? Answer yes or no.", "answer": "no", "bad": kind} for kind in KINDS]
    data, run_dir = tmp_path / "rows.jsonl", tmp_path / "run"
    data.write_text("".join(json.dumps(row) + "\n" for row in good + bad))
    args = [sys.executable, "-m", "forge_rl.grpo", "--config", str(ROOT / "configs" / "blackjack_tiny_cpu.yaml"), f"run_dir={run_dir}",
            "app_module=tests.hostile_app", "env.server=null", f"env.dataset={data}", "env.reward_timeout_s=2", "env.timeout_s=10",
            "env.max_concurrent=32", "grpo.batch_size=2", "grpo.group_size=4", "rollout.num_workers=4", "trainer.max_steps=3",
            "eval.interval=3", "eval.num_games=8", "trainer.checkpoint_every=0"]  # fmt: skip
    out = subprocess.run(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = read_metrics(run_dir)[-1]
    lost = {key.removeprefix("rollout/lost_groups/"): n for key, n in last.items() if key.startswith("rollout/lost_groups/")}
    assert last["step"] == 3 and len(lost) >= 2 and set(lost) <= set(KINDS.values()), lost
    log = (run_dir / "run.log").read_text() + out.stdout + out.stderr  # the controller's warnings: run.log as a rule
    assert all(log.count(f"a game was lost to {reason} ") == 1 for reason in lost), out.stderr[-3000:]
    assert 0 < last["eval/games"] < 8, "the evaluation's games on bad rows are left out"
    assert all(torch.isfinite(w).all() for w in load_file(run_dir / "final" / "hf" / "model.safetensors").values())
