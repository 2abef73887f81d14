"""The chat-agent form of an app: `async def run_agent(ctx)` instead of render_prompt / parse_action / reward.

    agent (app code, any SDK) --chat requests--> ChatServer (chat_server.py) --> policy service
              |  reset / step                          | exact ids of each rollout (segments)
              v                                        v
        environment session              Episodes (one per segment, the rollout's reward) --> replay buffer

Rollouts (rollouts.py) runs G agents per group as it runs G games: `play_agent` has play_game's arguments
and result. The agent returns its reward, or None to let the environment's last reward stand.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from forge_rl.core.rewards import checked_reward
from forge_rl.rollout.chat_server import ChatServer
from forge_rl.rollout.play import GameResult
from forge_rl.rollout.tools import call_tool_action, tool_result_text


class EnvRecorder:
    """The agent's environment session, remembering the last result; the agent's reset arguments go over `reset_args`."""

    def __init__(self, session, reset_args: dict | None = None):
        self.session, self.reset_args, self.last = session, dict(reset_args or {}), None

    async def reset(self, **kwargs: Any):
        self.last = await self.session.reset(**{**self.reset_args, **kwargs})
        return self.last

    async def step(self, action: Any):
        self.last = await self.session.step(action)
        return self.last

    async def call_tool(self, name: str, arguments: Any) -> str:
        """One step; arguments that are not a JSON object come back as the error text, the episode unchanged."""
        try:
            action = call_tool_action(name, arguments)
        except ValueError as e:
            return f"error: {e}"
        return tool_result_text((await self.step(action)).observation)

    @property
    def done(self) -> bool:
        """Whether the environment said the episode is over (its last reset or step)."""
        return bool(self.last is not None and self.last.done)


@dataclass
class AgentContext:
    """What an agent is given: where to send chat requests, its task's seed, its environment."""

    base_url: str  # OpenAI SDKs: AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
    anthropic_base_url: str  # Anthropic's SDK adds /v1 itself: AsyncAnthropic(base_url=ctx.anthropic_base_url, ...)
    api_key: str  # any string; the server does not check it
    model: str  # the model name to ask for
    seed: int  # the group's seed: the G agents of a group face the same task
    env: EnvRecorder | None  # an environment session (reset / step / call_tool) when the config names one
    # The run's HTTP pool for the SDKs' `http_client=`: a client of its own costs an agent an SSL context and a
    # new connection (docs/chat_agents.md). Owned by the run: an agent that shares it does not close it.
    http_client: Any = None
    # With MCP_TOOLS: the environment's tools as OpenAI function specs, the SDK's `tools=` (rollout/tools.py).
    tools: list[dict] = field(default_factory=list)
    # As the environment form scores an invalid answer and a cut-off game: the two forms of an app score alike.
    invalid_reward: float = 0.0
    cutoff_reward: float = 0.0


@dataclass
class ChatAgents:
    """What a run's agents share: the chat server and one connection pool to it."""

    server: ChatServer
    http_client: Any


async def chat_agents(rollouts) -> ChatAgents:
    """The run's chat server and connection pool, started by the first agent that needs them (later ones wait)."""
    if rollouts.agents is None:
        rollouts.agents = asyncio.ensure_future(_start(rollouts))  # set before any await: started once
    return await asyncio.shield(rollouts.agents)


async def _start(rollouts) -> ChatAgents:
    from openai import DefaultAioHttpClient

    async def generate(prompt_ids, params, session):
        return await rollouts.policy.route("generate", prompt_ids, params, session=session)

    logging.getLogger("httpx").setLevel(logging.WARNING)  # the agents' SDKs would log a line per request
    cfg = rollouts.cfg
    server = ChatServer(
        rollouts.tokenizer, generate, rollouts.sampling(), rollouts.sampling(greedy=True), cfg.chat, cfg.generator.max_model_len,
        cfg.model.chat_template_kwargs,
    )
    await server.start()
    # The SDK's own client on aiohttp costs less CPU per request than its default httpx transport, and the
    # agents run in this process. Its pool keeps 100 connections alive.
    return ChatAgents(server, DefaultAioHttpClient())


async def stop_chat_server(rollouts) -> None:
    task = rollouts.agents
    if task is not None and task.done() and not task.cancelled() and task.exception() is None:
        agents = task.result()
        await agents.http_client.aclose()
        await agents.server.stop()
    rollouts.agents = None


async def play_agent(rollouts, seed: int, group_id: str, asks, reset_args: dict | None = None) -> GameResult:
    """One agent run on its own rollout and environment session, with play.py `play_game`'s contract."""
    agents = await chat_agents(rollouts)
    server, cfg = agents.server, rollouts.cfg
    rollout = server.open_rollout(answer=asks.answer)
    base, reward = f"{server.url}/s/{rollout.rollout_id}", None
    try:
        async with rollouts.sessions.session() as session:
            env = EnvRecorder(session, reset_args or cfg.env.reset_args)
            ctx = AgentContext(f"{base}/v1", base, "forge-rl", cfg.chat.model_name, seed, env, agents.http_client,
                               [dict(spec) for spec in rollouts.app.tools], -cfg.rollout.invalid_action_penalty, cfg.rollout.cutoff_score)
            try:
                reward = await asyncio.wait_for(rollouts.app.run_agent(ctx), cfg.chat.agent_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"run_agent took longer than chat.agent_timeout_s={cfg.chat.agent_timeout_s} s") from None
            if reward is None:
                reward = (env.last.reward if env.last is not None else None) or 0.0
            reward = checked_reward(reward, f"{rollouts.app.name}.run_agent")
    finally:
        await server.end_rollout(rollout.rollout_id, reward)
    return GameResult(rollout.episodes(group_id), reward, False)
