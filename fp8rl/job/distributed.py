"""torch.distributed from the launcher's environment: Slurm (one task per GPU or CPU rank) or torchrun.

A multi-node Slurm job started with ``--ntasks-per-node=<GPUs>`` runs one process per GPU; each reads
its rank from ``SLURM_PROCID``, the world size from ``SLURM_NTASKS``, its GPU from ``SLURM_LOCALID``
and the rendezvous host from the first node of ``SLURM_JOB_NODELIST``. The parsing is pure (a mapping
in, a `DistEnv` out) so it is unit-tested on CPU; `init_distributed` is the only part that touches torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

DEFAULT_PORT_BASE = 29500  # MASTER_PORT = base + job_id % PORT_SPAN, so jobs sharing a node do not collide
PORT_SPAN = 10000


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a (possibly multi-node) job."""

    rank: int  # global rank, 0 .. world_size - 1
    world_size: int  # processes in the job
    local_rank: int  # rank on this node = the GPU index it drives
    local_world_size: int  # processes on this node
    node_rank: int  # index of this node, 0 .. num_nodes - 1
    num_nodes: int
    master_addr: str  # host of rank 0 (the TCP rendezvous)
    master_port: int
    source: str  # "slurm", "torchrun" or "single"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def torch_env(self) -> dict[str, str]:
        """The variables torch.distributed's ``env://`` rendezvous reads."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


SINGLE_PROCESS = DistEnv(0, 1, 0, 1, 0, 1, "127.0.0.1", DEFAULT_PORT_BASE, "single")


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order.

    ``"gpu[001-003,007],login-a1,n[1-2]-ib"`` -> ``["gpu001", "gpu002", "gpu003", "gpu007", "login-a1",
    "n1-ib", "n2-ib"]``; zero padding is kept. Several bracket groups in one name expand as a product.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_host(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, current = [], 0, []
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if current:
        items.append("".join(current))
    return [item for item in items if item]


def _expand_host(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]+)\]", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [head + part + rest for part in _expand_ranges(match.group(1)) for rest in _expand_host(tail)]


def _expand_ranges(spec: str) -> list[str]:
    """``"001-003,7"`` -> ``["001", "002", "003", "7"]``."""
    out = []
    for part in spec.split(","):
        if "-" in part:
            low, high = part.split("-", 1)
            width = len(low)
            out.extend(str(i).zfill(width) for i in range(int(low), int(high) + 1))
        else:
            out.append(part)
    return out


def parse_tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``"8(x2),4"``) -> tasks on each node (``[8, 8, 4]``)."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"cannot parse SLURM_TASKS_PER_NODE={spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def slurm_dist_env(environ: Mapping[str, str], port_base: int = DEFAULT_PORT_BASE) -> DistEnv:
    """The DistEnv of a Slurm task (``srun`` sets the variables for every task it starts)."""
    rank = int(environ["SLURM_PROCID"])
    world_size = int(environ.get("SLURM_NTASKS", environ.get("SLURM_NPROCS", "1")))
    node_rank = int(environ.get("SLURM_NODEID", "0"))
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURMD_NODENAME")
    hosts = expand_hostlist(nodelist) if nodelist else ["127.0.0.1"]
    per_node = parse_tasks_per_node(environ["SLURM_TASKS_PER_NODE"]) if "SLURM_TASKS_PER_NODE" in environ else []
    local_world = per_node[node_rank] if node_rank < len(per_node) else world_size // max(len(hosts), 1)
    job_id = int(re.sub(r"\D", "", environ.get("SLURM_JOB_ID", "0")) or 0)
    port = int(environ["MASTER_PORT"]) if "MASTER_PORT" in environ else port_base + job_id % PORT_SPAN
    if not 0 <= rank < world_size:
        raise ValueError(f"SLURM_PROCID={rank} is outside SLURM_NTASKS={world_size}")
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=int(environ.get("SLURM_LOCALID", "0")),
        local_world_size=max(local_world, 1),
        node_rank=node_rank,
        num_nodes=int(environ.get("SLURM_JOB_NUM_NODES", environ.get("SLURM_NNODES", str(len(hosts))))),
        master_addr=environ.get("MASTER_ADDR", hosts[0]),
        master_port=port,
        source="slurm",
    )


def torchrun_dist_env(environ: Mapping[str, str]) -> DistEnv:
    """The DistEnv torchrun (or any ``env://`` launcher) describes."""
    world_size = int(environ["WORLD_SIZE"])
    local_world = int(environ.get("LOCAL_WORLD_SIZE", world_size))
    return DistEnv(
        rank=int(environ["RANK"]),
        world_size=world_size,
        local_rank=int(environ.get("LOCAL_RANK", "0")),
        local_world_size=local_world,
        node_rank=int(environ.get("GROUP_RANK", environ.get("NODE_RANK", "0"))),
        num_nodes=max(world_size // max(local_world, 1), 1),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(environ.get("MASTER_PORT", DEFAULT_PORT_BASE)),
        source="torchrun",
    )


def dist_env_from_environ(environ: Mapping[str, str] | None = None) -> DistEnv:
    """torchrun's variables win (a torchrun inside an allocation), then a Slurm task's, else one process.

    ``SLURM_PROCID`` alone is not enough: ``sbatch`` scripts run outside ``srun`` also carry Slurm
    variables; a task started by ``srun`` has ``SLURM_STEP_ID`` as well.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return torchrun_dist_env(environ)
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        return slurm_dist_env(environ)
    return SINGLE_PROCESS


def cuda_device_index(env: DistEnv, device_count: int) -> int:
    """The GPU this process drives: its local rank when it sees the whole node, else its only device."""
    if device_count <= 0:
        raise RuntimeError("no CUDA device visible to this task")
    if device_count == 1:
        return 0  # --gpus-per-task=1 or CUDA_VISIBLE_DEVICES narrowed to one GPU
    if env.local_rank >= device_count:
        raise RuntimeError(f"local rank {env.local_rank} but only {device_count} CUDA devices are visible")
    return env.local_rank


def init_distributed(env: DistEnv, backend: str | None = None, timeout_s: float = 1800.0) -> bool:
    """Initialize the default process group from `env` (gloo on CPU; NCCL for CUDA tensors and gloo for CPU
    ones on GPU: `process_group_backend`); no-op for a single
    process or when a group exists. Returns whether this call created it (then it should destroy it)."""
    if not env.is_distributed:
        return False
    import torch
    import torch.distributed as dist

    from fp8rl.models.runtime import process_group_backend

    if dist.is_initialized():
        return False
    os.environ.update(env.torch_env())
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(cuda_device_index(env, torch.cuda.device_count()))
    dist.init_process_group(
        backend=backend or process_group_backend(use_cuda),
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return True


def shutdown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
