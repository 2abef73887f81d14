"""`python -m forge_rl.chat_server --config FILE --port P [key=value ...]`: the reverse chat server alone.

The config's policy is served by generators launched as a run would; agents (any OpenAI or Anthropic SDK)
open rollouts with `POST /rollouts` and end them with `POST /s/<id>/end` (rollout/chat_server.py). It
serves until Ctrl-C or SIGTERM, then stops within STOP_BOUND_S, engines included, whatever it was doing
(requests in flight are cancelled after 2 s; past the bound the process ends itself, and its actor and
engine processes end with it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

STOP_BOUND_S = 60.0  # from the stop (Ctrl-C, SIGTERM) to the end of the process


async def serve(cfg) -> None:
    """Serve the config's policy (generators launched as a run would) until cancelled."""
    import torch
    from transformers import AutoTokenizer

    from forge_rl.core.app import load_app
    from forge_rl.engines.vllm.generator import Generator
    from forge_rl.models import resolve_model
    from forge_rl.rollout.chat_server import ChatServer
    from forge_rl.rollout.play import answer_token_ids, sampling_params

    model_path = resolve_model(cfg.model.path, cfg.model.dtype, Path(cfg.run_dir) / "tiny_model", cfg.model.tiny_seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    allowed = answer_token_ids(load_app(cfg.app_module, True), tokenizer) if cfg.sampling.constrained else None
    policy = await Generator.replicas(cfg.generator, torch.cuda.is_available()).as_service(
        model_path, cfg.model.dtype, cfg.generator, cfg.seed
    )

    async def generate(prompt_ids, sampling, session):
        return await policy.route("generate", prompt_ids, sampling, session=session)

    server = ChatServer(
        tokenizer, generate, sampling_params(cfg.sampling, allowed), sampling_params(cfg.sampling, allowed, greedy=True),
        cfg.chat, cfg.generator.max_model_len, cfg.model.chat_template_kwargs,
    )
    try:
        url = await server.start()
        print(f"chat server: {url} (POST {url}/rollouts to open a rollout)", flush=True)
        await asyncio.Event().wait()
    finally:
        from forge_rl.recipes.grpo.main import exit_within

        exit_within(STOP_BOUND_S, 130)  # whatever holds up the stop below
        await server.stop()
        await policy.stop()


def main() -> None:
    from forge_rl.core.config import parse_cli

    argv = sys.argv[1:]
    if "--port" in argv:
        i = argv.index("--port")
        argv[i : i + 2] = [f"chat.port={argv[i + 1] if i + 1 < len(argv) else ''}"]
    cfg = parse_cli(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # SIGTERM stops it as Ctrl-C does, as grpo's; SIGINT restored first: a script's background job inherits it
    # ignored (and SIGTERM, turned into it, did nothing either).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        print("chat server stopped", file=sys.stderr)


if __name__ == "__main__":
    main()
