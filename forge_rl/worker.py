"""A Monarch worker: what a bare machine or a worker pod runs so that a controller can place meshes on it.

    python -m forge_rl.worker --host 10.0.0.5 --port 26600

`--host` is the address the controller and the other hosts reach this one at; it becomes MASTER_ADDR
when this host is host 0 of a mesh. The worker serves until it is killed (Monarch's
run_worker_loop_forever); a controller that goes away leaves it ready for the next one.
"""

from __future__ import annotations

import argparse
import os

from forge_rl.runtime import cluster


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m forge_rl.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True, help="address peers reach this host at (IP or DNS name)")
    parser.add_argument("--port", type=int, default=26600, help="Monarch port (default 26600)")
    parser.add_argument("--bind", default=None, help="listen address if not --host, e.g. 0.0.0.0")
    parser.add_argument(
        "--transport", choices=["auto", "hostname", "localhost"], default="auto", help="as cluster.transport"
    )
    args = parser.parse_args(argv)
    address = f"tcp://{args.host}:{args.port}"
    # Inherited by every process the controller spawns here: how it names its host (forge_rl/runtime/cluster.py).
    os.environ[cluster.HOST_ENV], os.environ[cluster.WORKER_ENV] = args.host, address
    cluster.configure_transport(args.transport)
    from monarch.actor import run_worker_loop_forever

    listen = f"{address}@tcp://{args.bind}:{args.port}" if args.bind else address
    print(f"forge_rl worker: serving at {address}", flush=True)
    run_worker_loop_forever(address=listen, ca="trust_all_connections")


if __name__ == "__main__":
    main()
