"""Environments as OpenEnv servers, and the one way to start any of them.

An environment is an openenv 0.10 `Environment` subclass whose generic parameters name its
Action and Observation types (`Environment[MyAction, MyObservation, State]`). `serve` turns it
into an HTTP/WebSocket server (`create_app`) with a `/health` that also reports what the
environment wants known (`health_info()`, e.g. the sandbox mode). Start one with

    python -m forge_rl.envs apps.blackjack.env:BlackJackEnvironment --port 8001   # any module:Class
    python -m apps.blackjack.env --port 8001                                      # a module that calls serve()

Servers run in a virtualenv of their own (`.venv-env`, made by `make install`: openenv 0.10 cannot share one
with vLLM); `launch_local` (local.py) starts one with its python on 127.0.0.1 for a run whose config names
`env.server`. Kept free of openenv imports at module level: a run's controller imports this package too.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import typing

from forge_rl.compat.openenv import replace_route

DEFAULT_MAX_CONCURRENT_ENVS = 16
SHUTDOWN_GRACE_S = 5.0


def load_env_class(target: str) -> type:
    """'package.module:ClassName' -> the class; a one-line error naming what is wrong."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"environment must be 'module:Class', got {target!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load environment {target!r}: {e}") from e


def action_and_observation_types(env_cls: type) -> tuple[type, type]:
    """The Action and Observation classes from `Environment[ActT, ObsT, StateT]` in the bases."""
    from openenv.core.env_server.interfaces import Environment

    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if origin is not None and issubclass(origin, Environment) and typing.get_args(base):
                action_cls, observation_cls = typing.get_args(base)[:2]
                if isinstance(action_cls, type) and isinstance(observation_cls, type):
                    return action_cls, observation_cls
    raise TypeError(
        f"{env_cls.__name__} must subclass Environment[MyAction, MyObservation, MyState] "
        "so the server knows how to parse actions"
    )


def build_app(env_cls: type, max_concurrent_envs: int):
    """The FastAPI app for `env_cls`: OpenEnv's routes, with /health extended by health_info()."""
    from openenv.core.env_server.http_server import create_app

    action_cls, observation_cls = action_and_observation_types(env_cls)
    app = create_app(env_cls, action_cls, observation_cls, max_concurrent_envs=max_concurrent_envs)
    info_fn = getattr(env_cls, "health_info", None)
    extra = dict(info_fn()) if callable(info_fn) else {}
    extra.update(environment=env_cls.__name__, max_concurrent_envs=max_concurrent_envs, openenv=importlib.metadata.version("openenv"))
    # OpenEnv's /health only says "healthy"; replace it so probes also see e.g. the sandbox mode.
    replace_route(app, "/health", lambda: {"status": "healthy", **extra}, methods=["GET"])
    return app


def serve(env_cls: type | None = None, argv: list[str] | None = None) -> None:
    """Parse --host/--port/--max-concurrent-envs (default: $MAX_CONCURRENT_ENVS) and run uvicorn."""
    parser = argparse.ArgumentParser(description="Serve an OpenEnv environment.")
    if env_cls is None:
        parser.add_argument("target", help="the environment as module:Class")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-concurrent-envs",
        type=int,
        default=int(os.environ.get("MAX_CONCURRENT_ENVS", DEFAULT_MAX_CONCURRENT_ENVS)),
        help="WebSocket sessions served at once; one more gets a CAPACITY_REACHED error",
    )
    args = parser.parse_args(argv)
    if args.max_concurrent_envs < 1:
        parser.error(f"--max-concurrent-envs must be >= 1, got {args.max_concurrent_envs}")
    if env_cls is None:
        try:
            env_cls = load_env_class(args.target)
        except ValueError as e:
            parser.error(str(e))

    import uvicorn

    app = build_app(env_cls, args.max_concurrent_envs)
    # SIGTERM or Ctrl-C: open sessions are closed and steps in flight get this long, then are cancelled
    # (uvicorn's default waits for them forever).
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
