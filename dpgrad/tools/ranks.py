"""Several processes of one machine as the ranks of a process group (gloo): what the
distributed tests and the FSDP memory benchmark run their scenarios on.

A scenario is a function ``(rank, world, **kwargs)`` in a module's ``SCENARIOS`` table; it
returns plain Python or numpy values (tensors sent through a queue would live in shared
memory that disappears with the process).
"""

from __future__ import annotations

import importlib
import os
import socket


# Imported once, by the server the ranks are forked from (with the first caller's scenarios).
PRELOAD = ["torch", "torch.distributed", "dpgrad"]


def run(rank: int, world: int, port: int, jobs: list, queue, scenarios: str, environ: dict) -> None:
    """Run each (name, kwargs) job of the module ``scenarios``'s SCENARIOS on this rank, in the
    caller's environment ``environ``; put (rank, [results]) or (rank, traceback)."""
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        table = importlib.import_module(scenarios).SCENARIOS
        out = [table[name](rank, world, **kwargs) for name, kwargs in jobs]
        queue.put((rank, out))
    except BaseException:
        import traceback

        queue.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, jobs: list, scenarios: str) -> list:
    """Each of ``world`` new ranks' results of ``jobs`` (SCENARIOS of the module ``scenarios``,
    importable from this process's path), [rank][job]. Raises with a rank's traceback if one
    failed. The ranks are forked from multiprocessing's server process (one per calling
    process, started at the first call, which has imported ``PRELOAD`` and that call's
    ``scenarios`` once, instead of each rank importing them), each in this process's
    environment as it is at the call; where there is no such server (Windows), spawned."""
    import torch.multiprocessing as mp

    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD + [scenarios])  # no effect once the server runs
    else:
        ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=run, args=(rank, world, port, jobs, queue, scenarios, environ))
             for rank in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, out in results.items():
        if isinstance(out, str):
            raise RuntimeError(f"rank {rank} failed:\n{out}")
    return [results[r] for r in range(world)]
