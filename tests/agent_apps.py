"""An agent app for tests/test_agents.py (imported by name, as a config's app_module): it never asks the
policy; it reports what its environment reset gave it, or, told to, one agent of a group fails while the
others hold their sessions, or every agent reports `reward`."""

import asyncio

fail_one = False  # set by a test: the first agent of a group raises, the others wait
started, cancelled = [], []
reward = None  # set by a test: what every agent reports instead


async def run_agent(ctx) -> float:
    observation = (await ctx.env.reset(seed=ctx.seed)).observation
    started.append(ctx.seed)
    if fail_one:
        if len(started) == 1:
            await asyncio.sleep(0.5)  # the others are in their sessions by now
            raise RuntimeError("this agent failed")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(ctx.seed)
            raise
    if reward is not None:
        return reward
    return float(observation["task_id"].split("/")[0].removeprefix("synth"))  # the synth family reset chose
