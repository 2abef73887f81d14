"""What a run checks before it starts anything, and all that `python -m forge_rl.config` checks: the names in
the config resolve, the tiny model knows the app's words, Weights & Biases can log, and this host has the GPUs
a local run places on it. Nothing is started, downloaded or converted; each failure is a one-line ConfigError.
These need the app, the environment's module or the model, hence here and not in core/config/.
"""

from __future__ import annotations

import ast
import importlib.util
import netrc
import os
import sys
from urllib.parse import urlsplit

from forge_rl.core.app import App, load_app
from forge_rl.core.config import LORA_RANK, ConfigError, RunConfig
from forge_rl.core.errors import first_line
from forge_rl.envs import local, rows
from forge_rl.models import model_kind
from forge_rl.rollout.play import answer_token_ids, unknown_words


def check_run(cfg: RunConfig, this_host: bool = True) -> App:
    """Every check, in the order a run would meet the problem; the checked app for the run to use.
    `this_host=False` leaves out what depends on the host it runs on (its GPUs, W&B's key)."""
    app = load_app(cfg.app_module, cfg.sampling.constrained, dataset=cfg.env.dataset is not None)
    if cfg.sampling.tool_choice == "required" and not (app.uses_tools and app.parse_action is None and not app.is_agent):
        raise ConfigError(f"sampling.tool_choice: 'required' opens answers with a tool call's tag, for an app with MCP_TOOLS "
                          f"whose calls forge_rl reads; {cfg.app_module} is not one: set it to 'auto'")
    check_env(cfg.env.server, cfg.env.url, cfg.env.server_python)
    check_dataset(cfg)
    check_model(cfg, app)
    if this_host:
        check_wandb(cfg.logging.wandb_project)
        check_gpus(cfg)
    for key, why in inert_keys(cfg):
        print(f"warning: {key}: {why}", file=sys.stderr)
    for kind, taken in cfg.defaults_fitted.items():
        values = ", ".join(f"{key} {value}".replace("'", "") for key, value in taken.items())
        print(f"defaults for {kind}: {values} (state a key to change it)", file=sys.stderr)
    return app


# Tokens a short answer takes beside the dataset's answer: a few words ("3 + 4 = ") and the end-of-turn token.
ROOM_BESIDE_THE_ANSWER = 8


def inert_keys(cfg: RunConfig) -> list[tuple[str, str]]:
    """Keys a run accepts but that do nothing with the others as set: said at the start, not refused."""
    inert = []
    if cfg.grpo.is_correction.level != "off":
        inert.append((
            "grpo.clip_low, grpo.clip_high",
            "no effect with grpo.is_correction on (the PPO ratio is taken against the trainer's own log-probs at the "
            "step, so it is 1); grpo.is_correction.threshold bounds the update instead",
        ))
    return inert


def check_env(server: str | None, url: str | None, server_python: str | None = None) -> None:
    """The module is read, not imported: it imports openenv, which lives in the server virtualenv only."""
    if server is not None:
        try:
            module, _, name = server.partition(":")
            spec = importlib.util.find_spec(module) if module else None
            if spec is None or not spec.origin:
                raise ValueError(f"no module named {module!r}")
            if name and name not in defined_names(spec.origin):
                raise ValueError(f"cannot load environment {server!r}: {spec.origin} defines no {name}")
        except (ValueError, ImportError) as e:
            raise ConfigError(f"env.server: {first_line(e)} (a module of your own must be on PYTHONPATH)") from None
        try:
            local.server_python(server_python)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
            raise ConfigError(f"env.url: {url!r} is not a URL such as http://blackjack:8000")


def check_dataset(cfg: RunConfig) -> None:
    """env.dataset read as its server will read it (envs/rows.py)."""
    env = cfg.env
    if env.dataset is None:
        if env.test_fraction:
            raise ConfigError("env.test_fraction: holds out rows of env.dataset, which is not set")
        return
    if env.server not in (None, env.DATASET_SERVER):
        raise ConfigError(f"env.server: env.dataset is served by {env.DATASET_SERVER}; leave env.server out")
    try:
        splits = rows.load_splits(env.dataset, env.test_fraction)
    except rows.DatasetError as e:
        key = "env.test_fraction" if "test_fraction" in str(e) else "env.dataset"
        raise ConfigError(f"{key}: {first_line(e)}") from None
    for key, split in [("env.task_split", env.task_split)] + [("eval.task_split", s) for s in cfg.eval.splits]:
        if split is not None and split not in splits:
            raise ConfigError(f"{key}: {split!r} is not a split of {env.dataset} (it has: {', '.join(splits)})")
    fitted = next((taken for taken in cfg.defaults_fitted.values() if "sampling.max_tokens" in taken), None)
    answers = [len(str(row["answer"])) for rows_of_split in splits.values() for row in rows_of_split if "answer" in row]
    if fitted is not None and answers:  # the rows say how long an answer is (characters: at least its tokens)
        cfg.sampling.max_tokens = fitted["sampling.max_tokens"] = max(answers) + ROOM_BESIDE_THE_ANSWER


def check_model(cfg: RunConfig, app: App) -> None:
    """A real model needs its own learning rate (the default is the tiny model's). With the tiny model, the app's
    answers and its SAMPLE_OBSERVATION's prompt must be words it knows: an unknown word reaches the policy as [UNK]."""
    try:
        kind = model_kind(cfg.model.path)
    except (ValueError, OSError, ImportError) as e:
        raise ConfigError(first_line(e)) from None
    if kind != "tiny":
        if "trainer.optimizer.lr" not in cfg.keys_given:
            raise ConfigError(
                f"trainer.optimizer.lr: not set, and its default {cfg.trainer.optimizer.lr:g} is the tiny model's: state the "
                f"learning rate for {cfg.model.path}: with LoRA (trainer.lora.rank {LORA_RANK}, a pretrained model's default) about "
                "3e-4 for a model of 100-500M parameters (configs/*_smollm2_cpu.yaml), 1e-5 to 1e-4 for 1-2B; fully fine-tuned "
                "(trainer.lora: null) about 1e-6 for 1-2B"
            )
        return
    from forge_rl.models.tiny import hf_tokenizer

    tokenizer = hf_tokenizer()
    if cfg.sampling.constrained:
        answer_token_ids(app, tokenizer)  # one known token each, as the run needs them
    if app.sample_observation is not None and not app.is_agent:
        prompt = app.render_prompt(app.sample_observation)
        unknown = unknown_words(tokenizer, prompt)
        if unknown:
            raise ConfigError(
                f"app_module {app.name!r}: the tiny model (model.path null) does not know {', '.join(map(repr, unknown))} "
                f"in its prompt {prompt[:200]!r} (rendered from SAMPLE_OBSERVATION): use words listed in "
                "forge_rl/models/tiny.py, or set model.path"
            )


def check_wandb(project: str | None) -> None:
    """Here, not after the actors have started: the package and an API key, unless WANDB_MODE keeps it local."""
    if not project:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb_project: set, but wandb is not installed: pip install '.[wandb]'")
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled"):
        return
    try:
        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    if not logged_in:
        raise ConfigError("logging.wandb_project: set, but no WANDB_API_KEY (export it, run `wandb login`, or WANDB_MODE=offline)")


def check_gpus(cfg: RunConfig) -> None:
    """A local run gives every trainer, generator and reference process a GPU of its own (runtime/provisioner.py)."""
    if cfg.cluster.mode != "local" or not os.path.exists("/dev/nvidiactl"):
        return
    import torch

    have = torch.cuda.device_count()
    need = {"trainer.procs": cfg.trainer.procs, "generator.num_replicas x procs": cfg.generator.num_replicas * cfg.generator.procs}
    if cfg.grpo.kl_coef > 0:
        need["reference.num_replicas"] = cfg.reference.num_replicas
    if have and sum(need.values()) > have:
        placed = ", ".join(f"{k} {v}" for k, v in need.items())
        raise ConfigError(f"{', '.join(need)}: this host has {have} GPU(s) and the config places {sum(need.values())} ({placed}): lower them, or run on cluster.workers")


def defined_names(path: str) -> set[str]:
    """The names a module's top level binds (classes, functions, assignments, imports), read from its source."""
    names = set()
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names.update(t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names
