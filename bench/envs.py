"""Environment throughput, each figure against a baseline measured in the same run.

    python bench/envs.py [--seconds 3]

BlackJack: environment calls (reset or step) per second through the WebSocket client, one
session and 16 concurrent ones, against calling BlackJackEnvironment in-process.
Code interpreter: executions per second of a trivial program through the client, against the
same Sandbox called in-process and against the floor of any sandbox: starting a bare interpreter.
Code tasks: graded submissions (reset, then a synth answer graded on its hidden tests out of the
program's process) per second, one session and eight, against the code interpreter's one session.
Servers run on 127.0.0.1 in subprocesses, as in training. Numbers depend on the host; compare
ratios, not absolute rates, across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.modules.setdefault("gradio", None)  # as in the servers: a lean process forks as fast as they do

from apps.blackjack.env import BlackJackAction, BlackJackEnvironment  # noqa: E402
from forge_rl.rollout.env_client import EnvSession  # noqa: E402
from forge_rl.envs.local import launch_local  # noqa: E402
from apps.coder.task import synthesize  # noqa: E402
from apps.coder.sandbox import Sandbox  # noqa: E402

TRIVIAL = "print(sum(range(10)))"


def rate(fn, seconds: float) -> float:
    """Calls of fn (which returns how many units it did) per second over about `seconds`."""
    fn()  # warm-up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += fn()
    return done / (time.perf_counter() - start)


def blackjack_in_process(seconds: float) -> float:
    env, stand, seed = BlackJackEnvironment(), BlackJackAction(action="STAND"), [0]

    def hand() -> int:
        seed[0] += 1
        env.reset(seed=seed[0])
        env.step(stand)
        return 2

    return rate(hand, seconds)


async def blackjack_client(url: str, sessions: int, seconds: float) -> float:
    async def worker(i: int, deadline: float) -> int:
        calls = 0
        async with EnvSession(url) as session:
            while time.perf_counter() < deadline:
                await session.reset(seed=i * 1_000_000 + calls)
                await session.step({"action": "STAND"})
                calls += 2
        return calls

    await worker(0, time.perf_counter() + 0.2)  # warm-up
    start = time.perf_counter()
    counts = await asyncio.gather(*(worker(i, start + seconds) for i in range(sessions)))
    return sum(counts) / (time.perf_counter() - start)


async def code_client(url: str, sessions: int, seconds: float) -> float:
    async def worker(deadline: float) -> int:
        runs = 0
        async with EnvSession(url, restore="reset") as session:
            await session.reset()
            while time.perf_counter() < deadline:
                obs = (await session.step({"code": TRIVIAL})).observation
                assert obs["stdout"] == "45\n", obs
                runs += 1
        return runs

    start = time.perf_counter()
    counts = await asyncio.gather(*(worker(start + seconds) for _ in range(sessions)))
    return sum(counts) / (time.perf_counter() - start)


async def code_task_client(url: str, sessions: int, seconds: float, program: bool = False) -> float:
    """Graded submissions/s of the synthesizer's answers: as the expression ("x+7", computed by the server
    without a run) or, `program`, as a conditional expression, which the sandbox grades."""

    async def worker(i: int, deadline: float) -> int:
        runs = 0
        async with EnvSession(url, restore="reset") as session:
            while time.perf_counter() < deadline:
                examples = (await session.reset(seed=i * 1_000_000 + runs)).observation["examples"]
                answer = synthesize(examples)
                answer = f"{answer} if True else 0" if program else answer
                obs = (await session.step({"code": answer, "submit": True})).observation
                assert obs["reward"] == 1.0, obs
                runs += 1
        return runs

    start = time.perf_counter()
    counts = await asyncio.gather(*(worker(i, start + seconds) for i in range(sessions)))
    return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    args = parser.parse_args()
    rows = []

    base = blackjack_in_process(args.seconds)
    rows.append(("blackjack in-process", base, "calls/s", None, ""))
    with launch_local("apps.blackjack.env:BlackJackEnvironment", max_concurrent_envs=16) as srv:
        for n in (1, 16):
            r = asyncio.run(blackjack_client(srv.url, n, args.seconds))
            rows.append((f"blackjack websocket, {n} session(s)", r, "calls/s", r / base, "in-process"))

    sandbox = Sandbox()
    floor = rate(lambda: subprocess.run([sandbox.python, "-c", "pass"], check=True) and 1, args.seconds)
    rows.append(("bare interpreter start", floor, "runs/s", None, ""))
    direct = rate(lambda: sandbox.run(TRIVIAL).exit_code == 0 and 1, args.seconds)
    rows.append((f"sandbox in-process [{sandbox.isolation}]", direct, "runs/s", direct / floor, "bare start"))
    with launch_local("apps.coder.interpreter:CodeInterpreterEnvironment", max_concurrent_envs=4) as srv:
        for n in (1, 4):
            r = asyncio.run(code_client(srv.url, n, args.seconds))
            rows.append((f"code interpreter websocket, {n} session(s)", r, "runs/s", r / direct, "sandbox in-process"))
            one_session = r if n == 1 else one_session
    with launch_local("apps.coder.env:CodeTaskEnvironment", max_concurrent_envs=8) as srv:
        for program in (True, False):
            for n in (1, 8):
                r = asyncio.run(code_task_client(srv.url, n, args.seconds, program))
                what = "program graded in the sandbox" if program else "arithmetic answer computed"
                rows.append((f"code task {what}, {n} session(s)", r, "runs/s", r / one_session, "interpreter, 1 session"))

    print(f"{'measurement':44s} {'rate':>10s}          ratio")
    for name, value, unit, ratio, versus in rows:
        against = f"{ratio:6.2f}x {versus}" if ratio is not None else "(baseline)"
        print(f"{name:44s} {value:10.1f} {unit:7s}  {against}")
    print(f"host: {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
