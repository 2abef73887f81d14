"""The app contract: what the config's `app_module` provides, checked once when a run starts.

An app is plain code: it turns an environment's observation into a prompt, the policy's answer into an
action, and the end of an episode into a reward. It takes one of three forms:

    TaskApp   render_prompt(observation) -> str
              parse_action(text, observation) -> action dict | None (None: invalid answer, the episode ends)
              reward(observation, invalid, invalid_penalty) -> float, called once, on the last observation;
              with env.dataset, reward(prompt_row, answer) -> float, called by the dataset server on the row
              and the action's answer (envs/dataset.py), the episode's one turn
              ACTIONS (one token each) or ANSWER_VOCABULARY (answers of several tokens): the words
              constrained decoding may sample (sampling.constrained)
    AgentApp  async run_agent(ctx) -> float | None: an agent written against a chat API (rollout/agents.py);
              with MCP_TOOLS = True it gets the MCPEnvironment's tools as ctx.tools and calls ctx.env.call_tool
    ToolApp   MCP_TOOLS = True and render_prompt(reset observation) -> str: the environment is an OpenEnv
              MCPEnvironment, the policy acts by calling its tools (rollout/tools.py); parse_action defaults to
              the tool-call parser and reward to the environment's (terminal_reward)

Either may add `eval_metrics(results, references) -> dict` (its headline first; `references`: each reference
policy's mean reward) and `REFERENCE_POLICIES` ({name: observation -> answer text or None}). A TaskApp may set
`SYSTEM_PROMPT` (else the template's default) and `SAMPLE_OBSERVATION`, whose prompt the config check renders
to find words the tiny model does not know.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from forge_rl.core.config import ConfigError


class TaskApp(Protocol):
    def render_prompt(self, observation: Mapping) -> str: ...
    def parse_action(self, text: str, observation: Mapping | None = None) -> dict | None: ...
    def reward(self, observation: Mapping, invalid: bool, invalid_penalty: float) -> float: ...


class AgentApp(Protocol):
    async def run_agent(self, ctx: Any) -> float | None: ...


def mean_reward(results: list, references: dict) -> dict[str, float]:
    """The evaluation an app without eval_metrics reports."""
    return {"eval/reward": sum(r.reward for r in results) / max(len(results), 1), "eval/games": len(results)}


@dataclass(frozen=True)
class App:
    """An app module, checked: what the framework calls, and the defaults of what the app left out."""

    name: str
    render_prompt: Callable | None = None
    parse_action: Callable | None = None
    reward: Callable | None = None
    run_agent: Callable | None = None
    answers: tuple[str, ...] = ()  # ACTIONS or ANSWER_VOCABULARY: what constrained decoding samples
    multi_token_answers: bool = False  # ANSWER_VOCABULARY: an answer is up to sampling.max_tokens of them
    eval_metrics: Callable = mean_reward
    reference_policies: dict = field(default_factory=dict)
    system_prompt: str | None = None  # SYSTEM_PROMPT: the first turn's system message (None: the template's own)
    sample_observation: Mapping | None = None  # SAMPLE_OBSERVATION: a prompt to check words against
    uses_tools: bool = False  # MCP_TOOLS: the policy acts by the environment's tools (rollout/tools.py)
    tools: tuple = ()  # their function specs, listed by the server when the run starts

    @property
    def is_agent(self) -> bool:
        return self.run_agent is not None


def load_app(name: str, constrained: bool = False, dataset: bool = False) -> App:
    """Import app_module and check it has what the run will call. With `dataset`, reward(prompt_row, answer) is
    the dataset server's to call (envs/dataset.py)."""
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"app_module {name!r} cannot be imported: {e}") from None
    agent, tools = hasattr(module, "run_agent"), bool(getattr(module, "MCP_TOOLS", False))
    needed = ["run_agent"] if agent else ["render_prompt"] if tools else ["render_prompt", "parse_action", "reward"]
    missing = [n for n in needed if not callable(getattr(module, n, None))]
    vocabulary = getattr(module, "ANSWER_VOCABULARY", None)
    answers = tuple(vocabulary or getattr(module, "ACTIONS", None) or ())
    if constrained and not answers:
        missing.append("ACTIONS or ANSWER_VOCABULARY (sampling.constrained)")
    if missing:
        raise ConfigError(f"app_module {name!r} lacks {', '.join(missing)}")
    if dataset and not agent and not _takes_two(module.reward):
        raise ConfigError(f"app_module {name!r}: with env.dataset, reward(prompt_row, answer) scores an answer; its reward "
                          f"takes {inspect.signature(module.reward)}")
    policies = getattr(module, "REFERENCE_POLICIES", {})
    if policies and not (callable(getattr(module, "parse_action", None)) and callable(getattr(module, "reward", None))):
        raise ConfigError(f"app_module {name!r}: REFERENCE_POLICIES are played with its parse_action and reward, which it lacks")
    return App(
        name=name,
        render_prompt=getattr(module, "render_prompt", None),
        parse_action=getattr(module, "parse_action", None),
        reward=terminal_reward if not agent and (dataset or tools and not hasattr(module, "reward")) else getattr(module, "reward", None),
        run_agent=getattr(module, "run_agent", None),
        answers=answers,
        multi_token_answers=bool(vocabulary),
        eval_metrics=getattr(module, "eval_metrics", mean_reward),
        reference_policies=dict(policies),
        system_prompt=getattr(module, "SYSTEM_PROMPT", None),
        sample_observation=getattr(module, "SAMPLE_OBSERVATION", None),
        uses_tools=tools,
    )


def _takes_two(function: Callable) -> bool:
    try:
        inspect.signature(function).bind(None, None)
        return True
    except (TypeError, ValueError):
        return False


# Helpers apps share (plain functions; an app may use them or not).


def observation_fields(observation: Any) -> Mapping[str, Any]:
    """An observation as a mapping: the client's dict as it is, a server's pydantic Observation dumped."""
    return observation.model_dump() if hasattr(observation, "model_dump") else observation


def terminal_reward(observation: Any, invalid: bool, invalid_penalty: float) -> float:
    """-invalid_penalty (a magnitude) for a refused answer: scoring it below the worst outcome teaches the
    format first. A game cut off is not scored here (play.py)."""
    if invalid_penalty < 0:
        raise ValueError(f"invalid_penalty is a magnitude and must be >= 0, got {invalid_penalty}")
    if invalid:
        return 0.0 - float(invalid_penalty)
    obs = observation_fields(observation)
    return float(obs.get("reward") or 0.0) if obs.get("done") else 0.0
