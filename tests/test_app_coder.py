"""The code app with real Monarch actors, vLLM, TorchStore and a code-task server on loopback.

1. `python -m forge_rl.grpo --config configs/coder_tiny_cpu.yaml` for two steps: rewards flow from the
   server's grading into training, the evaluation reports pass_at_1 / pass_rate, the synthesizer beside it.
2. configs/coder_qwen3_1_7b.yaml (HumanEval, 3 turns) with the tiny model in this process: its random
   answers are run, then submitted, so episodes have several turns; each episode's ids are exactly what
   the policy sampled plus each observation tokenized alone, and two train steps run on them.
"""

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forge_rl.core.config import load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # 80 s on 2 cores; make test keeps under 20 minutes with its install (make test-slow runs it)
def test_tiny_config_trains_on_graded_submissions(tmp_path):
    run_dir = tmp_path / "run"
    small = ["trainer.max_steps=2", "grpo.batch_size=2", "grpo.group_size=4", "rollout.num_workers=2",
             "eval.interval=2", "eval.num_games=8", "logging.tensorboard=false", "trainer.checkpoint_every=0",
             "grpo.kl_coef=0.01"]  # fmt: skip  (a reference model too: its arguments are the trainer's)
    proc = subprocess.run(
        [sys.executable, "-m", "forge_rl.grpo", "--config", str(ROOT / "configs/coder_tiny_cpu.yaml"), f"run_dir={run_dir}", *small],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    references = rows.pop(0)
    assert references["eval/reference/synthesizer"] == 1.0, "three examples determine a family-1 program"
    assert [r["step"] for r in rows] == [1, 2]
    last = rows[-1]
    assert 0 <= last["eval/pass_at_1"] <= last["eval/pass_rate"] <= 1 and last["eval/tasks"] == 8
    assert last["train/invalid_rate"] == 0 and math.isfinite(last["train/loss"]) and math.isfinite(last["train/kl"])
    assert "train/imitation_pool" in last  # the committed config replays its passes (grpo.self_imitation)
    assert "step 2 pass_at_1=" in out and "synthesizer=1.000" in out, out[-3000:]
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    # vLLM's and Monarch's lines go to the run's log, not the console
    log = (run_dir / "run.log").read_text()
    assert "Resolved architecture" in log and "Resolved architecture" not in out and " INFO " not in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three actor meshes start, one a vLLM engine: minutes on a busy 2-core machine
def test_humaneval_config_multi_turn_episodes_on_the_tiny_model(tmp_path):
    overrides = [
        f"run_dir={tmp_path}", "model.path=null", "model.dtype=float32", "sampling.max_tokens=12",
        "generator.max_model_len=2048", "generator.gpu_memory_utilization=0.02", "grpo.group_size=3",
        "grpo.batch_size=1", "rollout.num_workers=1", "trainer.micro_batch_size=4", "env.max_concurrent=8",
    ]  # fmt: skip
    cfg = load_config(ROOT / "configs/coder_qwen3_1_7b.yaml", overrides)
    assert cfg.env.reset_args["max_turns"] == 3 and cfg.grpo.filter_zero_spread and cfg.env.task_split == "humaneval_train" and cfg.eval.task_split == "humaneval_eval"
    asyncio.run(_multi_turn(cfg))


async def _multi_turn(cfg):
    from forge_rl.rollout.env_client import EnvSession
    from forge_rl.envs.local import env_url
    from forge_rl.core.app import load_app
    from forge_rl.recipes.grpo.main import shutdown, start
    from forge_rl.rollout.play import prompt_ids

    game = load_app(cfg.app_module, cfg.sampling.constrained)
    url, server = env_url(cfg.env.url, cfg.env.server, cfg.env.max_concurrent)
    job = None
    try:
        job = await start(cfg, game, url)
        rollouts, sampled = job.rollouts, []
        generate = rollouts.generate

        async def recording(prompt, params):  # the completions exactly as the generator returned them
            completions = await generate(prompt, params)
            sampled.extend(completions)
            return completions

        rollouts.generate = recording
        group = await rollouts.group(seed=5)
        assert group and len(group) == 3
        tok, eos = rollouts.tokenizer, rollouts.tokenizer.eos_token_id
        for episode in group:
            # Rebuild the episode from the environment (deterministic in seed and actions) and the samples.
            async with EnvSession(url, timeout_s=60) as session:
                observation = (await session.reset(seed=5, **cfg.env.reset_args)).observation
                expected, mask, turns = prompt_ids(game, tok, observation, True), [], 0
                mask = [False] * len(expected)
                while True:
                    completion = next(
                        c for c in sampled
                        if c.prompt_ids == expected and episode.tokens[len(expected) : len(expected) + len(c.token_ids)].tolist() == c.token_ids
                    )  # fmt: skip
                    at = len(expected)
                    assert episode.behaviour_logprobs[at : at + len(completion.token_ids)].tolist() == pytest.approx(completion.logprobs)
                    expected, mask, turns = expected + completion.token_ids, mask + [True] * len(completion.token_ids), turns + 1
                    action = game.parse_action(completion.text, observation)
                    assert action is not None
                    observation = (await session.step(action)).observation
                    if observation["done"]:
                        break
                    turn = prompt_ids(game, tok, observation, False, expected[-1] != eos)  # tokenized alone
                    expected, mask = expected + turn, mask + [False] * len(turn)
            assert episode.tokens.tolist() == expected and episode.loss_mask.tolist() == mask
            assert turns == 3, "random answers have no ```python block: run twice, submitted on the last turn"
        for version in (1, 2):
            metrics = await job.learner.step(group, version)
            assert math.isfinite(metrics["train/loss"])
    finally:
        await shutdown(job)
        if server is not None:
            server.stop()


@pytest.mark.slow  # about 2 minutes on 2 cores
def test_smollm2_code_config_runs_its_evaluation_on_both_splits_with_pass_at_k(tmp_path):
    """configs/coder_smollm2_cpu.yaml with the tiny model in SmolLM2's place (the same server, splits, stop at the
    block's end, evaluation): it trains from the functions train split and reports greedy pass@1, sampled pass@k
    and the invalid rate on the eval split and on HumanEval's 40, and how long games waited on the server."""
    run_dir = tmp_path / "run"
    small = ["model.path=null", "trainer.max_steps=1", "grpo.batch_size=1", "grpo.group_size=2", "rollout.num_workers=1",
             "eval.num_games=2", "eval.samples=2", "eval.pass_k=[1,2]", "sampling.max_tokens=8", "logging.tensorboard=false"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "forge_rl.grpo", "--config", str(ROOT / "configs/coder_smollm2_cpu.yaml"), f"run_dir={run_dir}", *small],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    for split in ("eval/", "eval/humaneval_eval/"):
        assert {f"{split}{k}" for k in ("pass_at_1", "sampled_pass_at_1", "sampled_pass_at_2", "invalid_rate")} <= set(last)
        assert last[f"{split}tasks"] == 2
    assert last["rollout/env_s"] > 0 and last["rollout/policy_s"] > 0 and last["train/sampled_tokens"] > 0
