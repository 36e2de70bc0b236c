"""Process-group plumbing for multi-process `boosttune train` (torchrun, SLURM, or our local launch).

The whole pipeline is SPMD: every rank runs the same command. Ranks split teacher shards and match
scoring; rank 0 writes shared files (prompt set, report); barriers order the phases. Lightning finds
the process group already initialised and reuses it for DDP / DeepSpeed.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

_LAUNCHED = "BOOSTTUNE_LAUNCHED"


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if os.environ.get(n):
            return int(os.environ[n])
    return default


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else _env_int("RANK", "SLURM_PROCID", default=0)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)


def local_rank() -> int:
    return _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)


def is_main() -> bool:
    return rank() == 0


def init() -> None:
    """Join the process group when this process is one of several ranks (no-op otherwise)."""
    if dist.is_initialized() or world_size() <= 1:
        return
    os.environ.setdefault("RANK", str(rank()))
    os.environ.setdefault("WORLD_SIZE", str(world_size()))
    os.environ.setdefault("LOCAL_RANK", str(local_rank()))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(hours=2))
    if not torch.cuda.is_available():  # share the CPU cores between the local ranks
        per_node = max(1, _env_int("LOCAL_WORLD_SIZE", default=world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def needs_local_launch(devices: int, num_nodes: int) -> bool:
    """True when a single-node multi-process run was asked for and we are not one of its ranks yet."""
    return devices > 1 and num_nodes == 1 and world_size() == 1 and not os.environ.get(_LAUNCHED)


def local_launch(devices: int, argv: Sequence[str]) -> int:
    """Run ``boosttune <argv>`` as ``devices`` ranks on this machine (torchrun, standalone rendezvous)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={devices}",
           "-m", "boosttune.cli", *argv]
    env = {**os.environ, _LAUNCHED: "1"}
    return subprocess.call(cmd, env=env)
