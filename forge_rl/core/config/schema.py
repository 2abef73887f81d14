"""The config's schema: one dataclass per section, each with `check` stating which values are possible.

Defaults are neutral, tuned for no app or model, but for the keys a kind of config needs otherwise (a dataset task, a
pretrained model: RunConfig.FITTED_DEFAULTS); each config in configs/ states its tuned values, and its comments explain
each key to users. The learning rate's default is the tiny model's: with model.path set, the check
(recipes/grpo/check.py) refuses a config without one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional, Union

from forge_rl.core.config.checks import ConfigError, check_mapping, check_non_negative, check_positive
from forge_rl.core.config.grpo import GRPOConfig, ISCorrectionConfig, SelfImitationConfig  # noqa: F401 (re-exported)


@dataclass
class ModelConfig:
    path: Optional[str] = None  # HF id or directory, FILE.gguf or package:MODULE (forge_rl/models/); None: the tiny model
    tiny_seed: int = 0  # seed of the tiny model built when path is None
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Passed to the chat template at every turn the policy sees, e.g. {enable_thinking: false} for Qwen3
    chat_template_kwargs: dict = field(default_factory=dict)

    def check(self, key):
        check_mapping(self, key, "chat_template_kwargs")


@dataclass
class EnvConfig:
    url: Optional[str] = None  # a running OpenEnv server, e.g. http://blackjack:8000
    server: Optional[str] = None  # or "module:Class" to launch on loopback for local runs
    max_concurrent: int = 256  # sessions held at once, a launched server's MAX_CONCURRENT_ENVS; env.url's /health may lower it
    timeout_s: float = 30.0  # per call to the environment
    reset_args: dict = field(default_factory=dict)  # passed to every reset besides the seed, e.g. {task_set: synth}
    task_split: Optional[str] = None  # None: reset with seeds; a split: seeded task indices over its num_tasks
    queue_sessions: bool = True  # a server with fewer sessions than a group's games: queue them (false: stop)
    capacity_wait_s: float = 600.0  # a full server (CAPACITY_REACHED) is asked again for this long
    server_python: Optional[str] = None  # env.server's interpreter; None: .venv-env/bin/python beside the training venv
    dataset: Optional[str] = None  # a JSONL file or HF datasets directory of prompts, served by envs/dataset.py
    test_fraction: float = 0.0  # with env.dataset whose rows name no split: this share held out as split "test"
    reward_timeout_s: float = 10.0  # env.dataset: a reward function taking longer is its episode's error (< timeout_s)
    DATASET_SERVER: ClassVar[str] = "forge_rl.envs.dataset:DatasetEnvironment"  # what env.dataset launches

    def check(self, key):
        if self.dataset is not None and self.url is None and self.server is None:
            self.server = self.DATASET_SERVER  # launched on loopback like any env.server; check.py reads the dataset
        if (self.url is None) == (self.server is None):
            raise ConfigError(f"{key}: set exactly one of env.url or env.server")
        check_positive(self, key, "max_concurrent", "timeout_s", "capacity_wait_s", "reward_timeout_s")
        check_mapping(self, key, "reset_args")


@dataclass
class SamplingConfig:
    temperature: float = 1.0  # the trainer and reference score logits / temperature too
    top_p: float = 1.0  # only 1.0: the trainer cannot mirror top-p truncation
    max_tokens: int = 256  # per turn: room for a free-text answer; constrained one-token ACTIONS take one anyway
    constrained: bool = True  # sample exactly one of the app's answer tokens per turn (trainer mirrors it)
    # A turn's answer ends once its text contains one of these (kept in the text; every sampled id is trained):
    # e.g. "\n```\n" ends a code block (and a bare opening fence). Matched on the text, whatever the tokens
    stop: list[str] = field(default_factory=list)
    # "required": an MCP-tools app's every answer is a tool call, opened with its format's tag (rollout/tools.py) put
    # at the end of the prompt: a forced prefix, constrained decoding the trainer mirrors by construction (those ids
    # are never sampled nor trained). For a model that never samples the tag itself; OpenAI's tool_choice, in effect.
    tool_choice: Literal["auto", "required"] = "auto"

    def check(self, key):
        """The one rule that keeps behaviour and trained log-probs of the same distribution: the
        generator returns the log-probs of what it sampled from, and the trainer and reference
        reproduce that distribution (engines/titan/model.py `sampling_logits`) only for what it can mirror."""
        check_positive(self, key, "max_tokens", "temperature")
        if "" in self.stop:
            raise ConfigError(f"{key}.stop: an empty stop string would end every answer before its first token")
        if self.top_p != 1.0:
            raise ConfigError(
                f"{key}.top_p: expected 1.0, got {self.top_p} (the trainer scores the whole distribution, so "
                "truncated sampling would skew the PPO ratio; lower sampling.temperature instead)"
            )


@dataclass
class OptimizerConfig:
    # The tiny model's. A pretrained model's depends on its size and on LoRA (about 1e-6 to fully fine-tune 1-2B
    # models, as TorchForge's recipe; an order higher with LoRA, Schulman et al. 2025), so it must state its own
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    max_grad_norm: float = 1.0

    def check(self, key):
        check_positive(self, key, "lr", "max_grad_norm")
        check_non_negative(self, key, "weight_decay", "warmup_steps")


LORA_RANK = 16  # a pretrained model's LoRA unless its config says otherwise (RunConfig.FITTED_DEFAULTS)
LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # HF names


@dataclass
class LoraConfig:
    """LoRA (engines/titan/lora.py): only these low-rank adapters train; the generators serve base + adapters."""

    rank: int = 16
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LINEAR_LAYERS))  # HF names of the adapted layers

    def check(self, key):
        check_positive(self, key, "rank", "alpha")
        if self.dropout != 0:
            # Dropout would make the trainer's log-probs random (the ratio against the generator's would be noise),
            # and one mask would serve every episode a shared forward row scores.
            raise ConfigError(f"{key}.dropout: expected 0 (dropout makes the trainer's log-probs random), got {self.dropout}")
        unknown = [m for m in self.target_modules if m not in LINEAR_LAYERS]
        if unknown or not self.target_modules:
            raise ConfigError(f"{key}.target_modules: {unknown[0] if unknown else 'none'!r} is not a linear layer "
                              f"(known: {', '.join(LINEAR_LAYERS)})")


@dataclass
class TrainerConfig:
    procs: int = 1  # ranks per host; > 1 in all shards with FSDP2
    hosts: int = 1  # hosts the trainer mesh spans (cluster.workers or cluster.kubernetes)
    micro_batch_size: int = 8  # the ids of this many episodes per forward/backward on one rank (shared ids once): memory grows with it
    max_steps: int = 200
    checkpoint_every: int = 25  # steps; 0 disables (the last step is checkpointed too)
    timeout_s: float = 3600.0  # per call to the trainer (train step, weights push, checkpoint)
    restart_on_failure: bool = False  # the trainer's processes died: start again from the last checkpoint
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lora: Optional[LoraConfig] = None  # None: full fine-tuning

    def check(self, key):
        check_positive(self, key, "procs", "hosts", "micro_batch_size", "max_steps", "timeout_s")
        check_non_negative(self, key, "checkpoint_every")


@dataclass
class GeneratorConfig:
    num_replicas: int = 1
    procs: int = 1  # tensor-parallel ranks per replica (on one host)
    hosts: int = 1  # hosts the replicas are spread over: replica i runs on host i % hosts
    max_model_len: int = 512
    gpu_memory_utilization: float = 0.05  # on CPU: share of host memory for the KV cache
    weight_sync: Literal["auto", "shm", "broadcast", "store"] = "auto"  # how weights travel (forge_rl/weights/)
    partial_rollouts: bool = False  # True: a weight update pauses running requests, false: waits for them
    eager: bool | None = None  # None: eager on CPU, CUDA graphs on GPU; LoRA runs are eager (engines/vllm/lora_serving.py)
    # Per call to a replica: one call carries every request then in flight (an evaluation's hundreds at once), and a
    # replica silent for longer is restarted
    timeout_s: float = 300.0

    def check(self, key):
        check_positive(self, key, "num_replicas", "procs", "hosts", "max_model_len", "timeout_s")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"{key}.gpu_memory_utilization: expected in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class ReferenceConfig:
    num_replicas: int = 1
    hosts: int = 1  # hosts the replicas are spread over: replica i runs on host i % hosts

    def check(self, key):
        check_positive(self, key, "num_replicas", "hosts")


@dataclass
class RolloutConfig:
    num_workers: int = 64  # concurrent game-playing tasks on the controller
    max_turns: int = 8  # decisions per game before it is cut off
    invalid_action_penalty: float = 1.0  # a game ended by an unparseable answer scores -penalty
    # What a game still running after max_turns scores (its reward() is not asked). None: -invalid_action_penalty,
    # never better than losing, so that dragging a game out is no way to dodge a loss.
    cutoff_reward: Optional[float] = None

    def check(self, key):
        check_positive(self, key, "num_workers", "max_turns")
        check_non_negative(self, key, "invalid_action_penalty")

    @property
    def cutoff_score(self) -> float:
        return -self.invalid_action_penalty if self.cutoff_reward is None else self.cutoff_reward


@dataclass
class EvalConfig:
    interval: int = 25  # train steps between evaluations; 0 disables
    num_games: int = 10_000  # fixed seeded deals, greedy decoding
    seed: int = 1_000_000  # first seed of the evaluation deals (the check keeps them out of training's)
    reset_args: dict = field(default_factory=dict)  # over env.reset_args for evaluation, e.g. {split: eval}
    # None: the seeds above; a split: its tasks 0 .. num_games - 1 (at most all); a list of splits: each so, the
    # first's metrics eval/..., every other's eval/<split>/...
    task_split: Union[str, list[str], None] = None
    samples: int = 0  # besides the greedy game, this many games per evaluation game at sampling.temperature: pass@k
    pass_k: list[int] = field(default_factory=list)  # the k of eval/sampled_pass_at_<k>, each <= samples; []: [1, samples]
    pass_reward: float = 1.0  # a sampled game passes with at least this reward

    @property
    def splits(self) -> list[Optional[str]]:
        """task_split as a list: [None] without one."""
        return list(self.task_split) if isinstance(self.task_split, list) else [self.task_split]

    @property
    def ks(self) -> list[int]:
        """The k of pass@k logged (none without samples)."""
        return list(dict.fromkeys(self.pass_k or [1, self.samples])) if self.samples else []

    def check(self, key):
        check_non_negative(self, key, "interval", "samples")
        check_positive(self, key, "num_games")
        check_mapping(self, key, "reset_args")
        if isinstance(self.task_split, list) and (not self.task_split or len(set(self.task_split)) < len(self.task_split)):
            raise ConfigError(f"{key}.task_split: expected a split or a list of distinct splits, got {self.task_split!r}")
        if self.pass_k and not self.samples:
            raise ConfigError(f"{key}.pass_k: {self.pass_k} needs {key}.samples > 0 (the sampled games pass@k counts)")
        wrong = [k for k in self.pass_k if not 1 <= k <= self.samples]
        if wrong:
            raise ConfigError(f"{key}.pass_k: {wrong[0]} is not between 1 and {key}.samples ({self.samples})")


@dataclass
class KubernetesConfig:
    namespace: str = "forge-rl"  # where the worker pods of k8s/ run
    # The longest the controller waits for every role's worker pods to be Ready (GPU nodes scaled up from
    # zero by an autoscaler can take longer than the default), then stops with the roles it lacks.
    timeout_s: int = 600

    def check(self, key):
        check_positive(self, key, "timeout_s")


@dataclass
class ClusterConfig:
    """Where the trainer, generator and reference run (docs/multihost.md). Neither key set: this host only."""

    workers: list[str] = field(default_factory=list)  # tcp://host:port of `python -m forge_rl.worker` processes
    kubernetes: Optional[KubernetesConfig] = None  # or worker pods found by monarch.job.kubernetes.KubernetesJob
    # Monarch's TcpWithHostname / TcpWithLocalhost; auto: hostname, unless this host's name is loopback only
    transport: Literal["auto", "hostname", "localhost"] = "auto"

    @property
    def mode(self) -> str:
        return "workers" if self.workers else "kubernetes" if self.kubernetes else "local"

    def check(self, key):
        if self.workers and self.kubernetes:
            raise ConfigError(f"{key}: set cluster.workers or cluster.kubernetes, not both")
        for worker in self.workers:
            if not re.fullmatch(r"tcp://[^:/\s]+:\d+", worker):
                raise ConfigError(f"{key}.workers: {worker!r} is not of the form tcp://host:port")
        if len(set(self.workers)) != len(self.workers):
            raise ConfigError(f"{key}.workers: a worker is listed twice")


@dataclass
class ChatConfig:
    """The reverse chat server (forge_rl/rollout/chat_server.py) that chat-agent apps (`run_agent`) talk to."""

    model_name: str = "policy"  # the model name requests must ask for (GET /v1/models lists it)
    tool_parser: Optional[str] = None  # vLLM tool parser for the model's tool-call format (hermes, pythonic, ...)
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    agent_timeout_s: float = 300.0  # one agent run (run_agent) before it is cancelled

    def check(self, key):
        check_positive(self, key, "agent_timeout_s")
        check_non_negative(self, key, "port")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb_project: Optional[str] = None  # set to log to Weights & Biases
    samples_every: int = 10  # train steps between a few training games logged as text (samples.jsonl); 0: none

    def check(self, key):
        check_non_negative(self, key, "samples_every")


@dataclass
class RunConfig:
    env: EnvConfig
    # The module with the environment's three plain functions (render_prompt, parse_action, reward)
    # and, for constrained decoding, ACTIONS: the legal answers.
    app_module: str = "apps.blackjack.task"
    run_dir: str = "runs/default"
    seed: int = 0
    resume: bool = False
    synchronous: bool = True  # generate a batch with the current weights, then train on it (on-policy, no overlap)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    SEEDS_PER_RUN: ClassVar[int] = 1_000_000  # a run trains on seeds from seed * SEEDS_PER_RUN; evaluation's must lie outside
    # Set by load_config: the dotted keys the file and the overrides gave; every other key took its default, the
    # fitted ones (kind -> {key: value}) from FITTED_DEFAULTS
    keys_given: ClassVar[frozenset] = frozenset()
    defaults_fitted: ClassVar[dict] = {}
    # Defaults that fit what a config is, for the keys it leaves out; the check prints those a run takes. A dataset
    # task is one question and one answer, an answer without a parse as wrong as a wrong one. A pretrained model's
    # first run on 2 CPU cores: a short answer, a step of seconds for a 135M model (4 prompts x 8 answers, one
    # forward), LoRA at the rank the learning rate's error names (recipes/grpo/check.py), and no decay to 0 over a
    # first run, which is short and may be continued (resume with more steps).
    FITTED_DEFAULTS: ClassVar[dict] = {
        "a dataset task (env.dataset)": ("env.dataset", {"rollout.max_turns": 1, "rollout.invalid_action_penalty": 0.0}),
        "a pretrained model (model.path)": ("model.path", {
            "sampling.max_tokens": 16, "grpo.group_size": 8, "grpo.batch_size": 4, "trainer.micro_batch_size": 32,
            "trainer.lora": {"rank": LORA_RANK}, "trainer.optimizer.schedule": "constant"}),
    }

    def check(self, key):
        roles = {"trainer": self.trainer.hosts, "generator": self.generator.hosts, "reference": self.reference.hosts}
        for role, hosts in roles.items():
            if hosts > 1 and self.cluster.mode == "local":
                raise ConfigError(f"{role}.hosts: {hosts} hosts need cluster.workers or cluster.kubernetes")
            if self.cluster.workers and hosts > len(self.cluster.workers):
                raise ConfigError(f"{role}.hosts: {hosts}, but cluster.workers lists {len(self.cluster.workers)}")
        for role, section in (("generator", self.generator), ("reference", self.reference)):
            _replicas_fill_hosts(role, section.num_replicas, section.hosts)
        trained = range(self.seed * self.SEEDS_PER_RUN, (self.seed + 1) * self.SEEDS_PER_RUN)
        if self.eval.task_split is None and self.eval.seed < trained.stop and trained.start < self.eval.seed + self.eval.num_games:
            raise ConfigError(f"seed: {self.seed} trains on seeds {trained.start:,} on, where eval.seed {self.eval.seed:,} evaluates ({self.eval.num_games:,} games): set another seed")
        if self.grpo.overlong_buffer > self.sampling.max_tokens:
            raise ConfigError(f"grpo.overlong_buffer: {self.grpo.overlong_buffer} is longer than sampling.max_tokens ({self.sampling.max_tokens})")


def _replicas_fill_hosts(role: str, replicas: int, hosts: int) -> None:
    """Replica i runs on host i % hosts (runtime/provisioner.py), and every host of a role is sized alike (one
    StatefulSet per role in k8s/): more hosts than replicas leaves hosts idle, an uneven split leaves GPUs idle."""
    if hosts > replicas:
        raise ConfigError(f"{role}.hosts: {hosts} hosts for {replicas} replica(s) leaves {hosts - replicas} idle: set {role}.num_replicas >= {role}.hosts")
    if replicas % hosts:
        raise ConfigError(
            f"{role}.num_replicas: {replicas} replicas over {hosts} hosts is uneven (replica i runs on host i % hosts): make it a multiple of {role}.hosts"
        )
