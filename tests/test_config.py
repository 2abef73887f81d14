"""Config loading: overrides, interpolation, and one-line errors with exit status 2 for every kind of bad input."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from forge_rl.core.config import ConfigError, RunConfig, load_config, parse_cli

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "blackjack_tiny_cpu.yaml"


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert isinstance(cfg, RunConfig), path


def test_overrides_and_interpolation():
    cfg = load_config(TINY, ["trainer.optimizer.lr=2e-6", "grpo.group_size=16", "seed=7"])
    assert cfg.trainer.optimizer.lr == 2e-6 and isinstance(cfg.trainer.optimizer.lr, float)
    assert cfg.grpo.group_size == 16
    assert cfg.model.tiny_seed == 7, "model.tiny_seed: ${seed} must follow the overridden seed"
    assert cfg.grpo.clip_high == 0.28  # untouched keys keep the file's value


def test_a_seed_whose_training_seeds_are_the_evaluations_is_refused():
    """Training takes seeds from seed x 1,000,000 on: with seed 1 it would play eval.seed's deals (1,000,000 on)."""
    with pytest.raises(ConfigError, match=r"^seed: 1 trains on seeds 1,000,000 on, where eval.seed 1,000,000 evaluates"):
        load_config(TINY, ["seed=1"])
    assert load_config(TINY, ["seed=2"]).seed == 2
    assert load_config(TINY, ["seed=1", "eval.seed=5000000"]).seed == 1
    assert load_config(TINY, ["seed=1", "eval.task_split=test"]).seed == 1  # a split's tasks, not seeds


def test_env_url_on_the_command_line_wins_over_the_files_env_server():
    cfg = load_config(TINY, ["env.url=http://blackjack:8000"])
    assert cfg.env.url == "http://blackjack:8000" and cfg.env.server is None
    assert load_config(TINY).env.server is not None


def test_defaults_are_neutral_and_the_tiny_config_states_its_tuned_values(tmp_path):
    """A minimal YAML (only the environment) takes the framework's neutral defaults, not the values tuned for
    the tiny model's two-answer BlackJack (issue #44): no entropy bonus, room for a free-text answer, a small
    micro-batch, full fine-tuning. configs/blackjack_tiny_cpu.yaml states its own; load_config records
    which keys a config gave, for the check to name the others."""
    minimal = load_config(write(tmp_path, "env:\n  server: apps.blackjack.env:BlackJackEnvironment\n"))
    neutral = minimal.grpo.entropy_coef, minimal.sampling.max_tokens, minimal.trainer.micro_batch_size, minimal.trainer.lora
    assert neutral == (0.0, 256, 8, None)
    tiny = load_config(TINY)
    assert (tiny.grpo.entropy_coef, tiny.sampling.max_tokens, tiny.trainer.micro_batch_size) == (0.3, 4, 256)
    assert minimal.keys_given == {"env", "env.server"}
    given = load_config(TINY, ["trainer.lora=null"]).keys_given
    assert {"trainer.lora", "trainer.optimizer.lr", "grpo.is_correction.threshold"} <= given and "trainer.hosts" in given
    assert "keys_given" not in dataclasses.asdict(tiny)  # not a key: the resolved config saved with a run lacks it


def test_int_is_accepted_where_a_float_is_expected():
    assert load_config(TINY, ["trainer.optimizer.lr=1"]).trainer.optimizer.lr == 1.0


def write(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.group_sise=4"], r"grpo\.group_sise: unknown key"),
        (["grpo.group_size=1"], r"grpo\.group_size: expected >= 2"),
        (["trainer.optimizer.lr=0"], r"trainer\.optimizer\.lr: expected > 0"),
        (["trainer.optimizer.lr=-1e-5"], r"trainer\.optimizer\.lr: expected > 0"),
        (["grpo.max_policy_age=-1"], r"grpo\.max_policy_age: expected >= 0"),
        (["grpo.group_size=eight"], r"grpo\.group_size: expected int, got 'eight'"),
        (["grpo.kl_estimator=k4"], r"grpo\.kl_estimator: expected one of 'k1', 'k2', 'k3'"),
        (["grpo=3"], r"grpo: expected a section"),
        (["env.url=http://x:1", "env.server=a.b:C"], r"env: set exactly one of env\.url or env\.server"),
        (["seed=${nope}"], r"seed: .*nope"),
        (["grpo.clip_low=1.5"], r"grpo\.clip_low: expected < 1"),
        (["grpo.loss_agg=sum"], r"grpo\.loss_agg: expected one of 'token_mean', 'seq_mean', 'seq_sum', 'token_sum'"),
        (["sampling.top_p=0.9"], r"sampling\.top_p: expected 1\.0, got 0\.9 \(the trainer scores the whole distribution"),
        (["sampling.temperature=0"], r"sampling\.temperature: expected > 0"),
        (["grpo.is_correction.level=geo", "grpo.is_correction.mode=clip"], r"grpo\.is_correction: level geo with mode clip"),
        (["grpo.is_correction.level=seq", "grpo.is_correction.mode=trunc"], r"grpo\.is_correction: level seq with mode trunc"),
        (["grpo.is_correction.threshold=[1.2,2]"], r"grpo\.is_correction\.threshold: expected 0 <= low <= 1 <= high"),
        (["grpo.is_correction.level=half"], r"grpo\.is_correction\.level: expected one of 'off'"),
        (["grpo.entropy_floor=0"], r"grpo\.entropy_floor: expected > 0 nats"),
        (["grpo.estimator=rloo", "grpo.normalize_mean=true"], r"grpo\.normalize_mean: a scale of dr_grpo's advantages, but estimator is rloo"),
        (["grpo.estimator=ppo2"], r"grpo\.estimator: expected one of 'grpo', 'dr_grpo', 'rloo', 'reinforce_pp', 'ppo', 'gspo', 'cispo', 'sapo', got 'ppo2'"),
        (["grpo.gamma=1.5"], r"grpo\.gamma: expected 0 <= gamma <= 1, got 1\.5"),
        (["grpo.estimator=ppo", "grpo.gae_lambda=-0.1"], r"grpo\.gae_lambda: expected 0 <= gae_lambda <= 1"),
        (["grpo.estimator=ppo", "grpo.value_coef=0"], r"grpo\.value_coef: expected > 0 with estimator ppo"),
        (["grpo.value_coef=-1"], r"grpo\.value_coef: expected >= 0"),
        (["grpo.minibatches=0"], r"grpo\.minibatches: expected > 0"),
        (["grpo.batch_size=4", "grpo.minibatches=5"], r"grpo\.minibatches: each holds whole groups, so at most batch_size \(4\)"),
        (["grpo.estimator=ppo", "grpo.turn_credit=1"], r"grpo\.turn_credit: compares a group's rewards; ppo's baseline is the value head's"),
        (["grpo.estimator=ppo", "grpo.group_size=0"], r"grpo\.group_size: expected > 0"),
        (["grpo.estimator=ppo", "grpo.group_size=1", "grpo.turn_credit=0", "grpo.filter_zero_spread=true"],
         r"grpo\.filter_zero_spread: refuses groups whose rewards are all equal, as a group of one always is"),
        (["grpo.normalize_std=true"], r"grpo\.normalize_std: replaced by grpo\.estimator: grpo divides by the group's std, dr_grpo does not"),
        (["grpo.overlong_buffer=5"], r"grpo\.overlong_buffer: 5 is longer than sampling\.max_tokens \(4\)"),
        (["grpo.ratio_level=word"], r"grpo\.ratio_level: expected one of 'token', 'sequence'"),
        (["grpo.estimator=dr_grpo", "grpo.loss_agg=seq_mean"], r"grpo\.loss_agg: seq_mean divides each answer by its length, the 1/\|o\| bias Dr\.GRPO removes"),
        (["grpo.estimator=gspo", "grpo.loss_agg=token_mean", "grpo.ratio_level=sequence"], r"grpo\.loss_agg: token_mean with ratio_level sequence weighs a sequence by its length"),
        (["grpo.estimator=sapo", "grpo.loss_agg=seq_mean", "grpo.ratio_level=sequence"], r"grpo\.ratio_level: sequence is GSPO's clipped sequence ratio; policy_loss sapo"),
        (["grpo.dual_clip=0.5"], r"grpo\.dual_clip: bounds PPO's clipped loss for negative advantages, so > 1"),
        (["grpo.estimator=cispo", "grpo.dual_clip=3"], r"grpo\.dual_clip: .* with policy_loss cispo"),
        (["grpo.kl_coef=0.1", "grpo.kl_estimator=k1"], r"grpo\.kl_estimator: k1 as a loss term has zero expected gradient"),
        (["grpo.kl_in_reward=true"], r"grpo\.kl_in_reward: true puts kl_coef x the KL in the return, but kl_coef is 0\.0"),
        (["grpo.sapo_tau_neg=0"], r"grpo\.sapo_tau_neg: expected > 0"),
        (["trainer.lora={rank: 8, dropout: 0.1}"], r"trainer\.lora\.dropout: expected 0 \(dropout makes the trainer's log-probs random\), got 0\.1"),
        (["grpo.self_imitation.episodes=-1"], r"grpo\.self_imitation\.episodes: expected >= 0"),
        (["grpo.self_imitation.capacity=0"], r"grpo\.self_imitation\.capacity: expected > 0"),
        (["grpo.entropy_floor=1.0", "grpo.entropy_coef=0"], r"grpo\.entropy_floor: 1\.0 holds the entropy up with the bonus, but entropy_coef is 0"),
        (["eval.samples=4", "eval.pass_k=[1,8]"], r"eval\.pass_k: 8 is not between 1 and eval\.samples \(4\)"),
        (["eval.samples=4", "eval.pass_k=[0]"], r"eval\.pass_k: 0 is not between 1 and eval\.samples \(4\)"),
        (["eval.pass_k=[1]"], r"eval\.pass_k: \[1\] needs eval\.samples > 0"),
        (["eval.samples=-1"], r"eval\.samples: expected >= 0"),
        (["eval.task_split=[eval,eval]"], r"eval\.task_split: expected a split or a list of distinct splits"),
        (["eval.task_split=[]"], r"eval\.task_split: expected a split or a list of distinct splits"),
        (["eval.task_split=[eval,3]"], r"eval\.task_split\[1\]: expected str, got 3"),
        (["eval.task_split=3"], r"eval\.task_split: expected str, got 3"),
        (["sampling.stop=['']"], r"sampling\.stop: an empty stop string would end every answer"),
    ],
)
def test_bad_values_name_the_key_and_the_file(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(TINY, overrides)
    assert str(TINY) in str(info.value)
    assert "\n" not in str(info.value)


def test_eval_task_split_is_a_split_or_a_list_and_pass_k_defaults_to_1_and_samples(tmp_path):
    one, two = load_config(TINY, ["eval.task_split=eval"]).eval, load_config(TINY, ["eval.task_split=[eval,humaneval_eval]"]).eval
    assert (one.task_split, one.splits, two.task_split, two.splits) == ("eval", ["eval"], ["eval", "humaneval_eval"], ["eval", "humaneval_eval"])
    assert load_config(TINY).eval.splits == [None] and load_config(TINY).eval.ks == []
    assert load_config(TINY, ["eval.samples=8"]).eval.ks == [1, 8] and load_config(TINY, ["eval.samples=1"]).eval.ks == [1]
    assert load_config(TINY, ["eval.samples=8", "eval.pass_k=[1,4,8]"]).eval.ks == [1, 4, 8]
    stops = write(tmp_path, 'env: {server: "apps.blackjack.env:BlackJackEnvironment"}\nsampling: {stop: ["\\n```\\n"]}\n')
    assert load_config(stops).sampling.stop == ["\n```\n"] and load_config(TINY).sampling.stop == []


def test_ppo_needs_no_group():
    cfg = load_config(TINY, ["grpo.estimator=ppo", "grpo.group_size=1", "grpo.turn_credit=0"])
    assert (cfg.grpo.group_size, cfg.grpo.gamma, cfg.grpo.gae_lambda, cfg.grpo.value_coef) == (1, 1.0, 1.0, 0.1)


def test_is_correction_and_partial_rollouts_load():
    cfg = load_config(TINY, ["generator.partial_rollouts=true", "grpo.is_correction.level=geo", "grpo.max_token_age=1"])
    assert cfg.generator.partial_rollouts and cfg.grpo.max_token_age == 1
    assert (cfg.grpo.is_correction.level, cfg.grpo.is_correction.mode) == ("geo", "mask")
    assert load_config(TINY, ["grpo.is_correction.level=off"]).grpo.is_correction.level == "off"  # YAML's false
    # off (the default) does not care about the sampling temperature
    assert load_config(TINY, ["sampling.temperature=0.7"]).grpo.is_correction.level == "off"


def test_missing_required_key(tmp_path):
    path = write(tmp_path, "seed: 1\n")
    with pytest.raises(ConfigError, match=rf"env: missing required key in {path}"):
        load_config(path)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nowhere.yaml"):
        load_config(tmp_path / "nowhere.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "env: [unclosed\n"))


def test_cli_exits_2_with_one_line_before_launching_anything(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "forge_rl.config", "--config", str(TINY), "grpo.group_size=1"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "grpo.group_size" in lines[0] and str(TINY) in lines[0], bad.stderr
    assert bad.stdout == ""

    good = subprocess.run(
        [sys.executable, "-m", "forge_rl.config", "--config", str(TINY), "grpo.group_size=12"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert good.returncode == 0, good.stderr
    assert "group_size: 12" in good.stdout  # the resolved config is printed for reproduction
    assert "${" not in good.stdout


def test_parse_cli_rejects_malformed_arguments(capsys):
    for argv in ([], ["--config"], ["--config", str(TINY), "lr"], ["--config", str(TINY), "--lr=3"]):
        with pytest.raises(SystemExit) as info:
            parse_cli(argv)
        assert info.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_generator_timeout_reaches_the_policy_service():
    """generator.timeout_s bounds each call to a replica (an evaluation's requests travel in one call)."""
    from forge_rl.engines.vllm.generator import Generator

    cfg = load_config(ROOT / "configs/coder_smollm2_cpu.yaml")
    assert Generator.replicas(cfg.generator).service_options["call_timeout_s"] == cfg.generator.timeout_s == 1200
    with pytest.raises(ConfigError, match="generator.timeout_s"):
        load_config(ROOT / "configs/coder_smollm2_cpu.yaml", ["generator.timeout_s=0"])
