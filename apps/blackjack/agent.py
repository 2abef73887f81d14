"""BlackJack played by a plain OpenAI-SDK agent: the chat-agent form of task.py.

The agent knows nothing of RL. It deals its hand from its environment session, sends each observation
as a user message, reads HIT or STAND from the reply and plays it, until the hand is over. The same
prompt and parsing as the environment form, so the two forms train on the same ids (configs/
blackjack_agent_tiny_cpu.yaml against configs/blackjack_tiny_cpu.yaml). The reference policies and
exact EVs are task.py's: evaluation reads the agent's EV against them on the same deals.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from apps.blackjack.task import ACTIONS, REFERENCE_EV, REFERENCE_POLICIES, eval_metrics, parse_action, render_prompt, reward

__all__ = ["run_agent", "ACTIONS", "REFERENCE_EV", "REFERENCE_POLICIES", "eval_metrics", "parse_action", "reward"]

INVALID_ANSWER_PENALTY = 1.0  # a reply that is neither HIT nor STAND ends the hand with this loss


async def run_agent(ctx) -> float | None:
    """One hand; returns None so that the environment's reward (the hand's return) stands.
    The client shares the run's connection pool (ctx.http_client): a hand is two requests or so, less
    than what a client of its own costs to make. The pool is the run's to close, not the hand's."""
    client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client, timeout=120)
    observation = (await ctx.env.reset(seed=ctx.seed)).observation
    messages = []
    while not observation["done"]:
        messages.append({"role": "user", "content": render_prompt(observation)})
        response = await client.chat.completions.create(model=ctx.model, messages=messages)
        answer = response.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        action = parse_action(answer)
        if action is None:
            return reward(observation, True, INVALID_ANSWER_PENALTY)
        observation = (await ctx.env.step(action)).observation
    return None
