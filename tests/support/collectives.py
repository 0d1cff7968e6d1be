"""A model of which devices a process group's backend serves, checked on every collective a CPU run makes.

A gloo run cannot show NCCL's rule (an NCCL-only group refuses CPU tensors: "No backend type associated with
device type cpu"), so `devices_checked` wraps torch.distributed's collectives and fails any whose tensor is on a
device type that the backend spec a GPU host would use (`torch.distributed`'s own parser of "cpu:gloo,cuda:nccl")
does not serve; the collective itself then runs on the real (gloo) group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor")


def served_device_types(spec: str) -> set[str]:
    """Device types a backend spec serves; NCCL serves CUDA only (torch maps a bare "nccl" to {"cuda"})."""
    return set(BackendConfig(spec).get_device_backend_map())


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


@contextlib.contextmanager
def devices_checked(spec: str, device_type_of=lambda t: t.device.type) -> Iterator[list[str]]:
    """Every tensor collective inside checks its tensors against `spec`; yields the list of calls seen.

    `device_type_of` says where a tensor would live on the GPU host (default: where it is)."""
    served = served_device_types(spec)
    seen: list[str] = []
    originals = {name: getattr(dist, name) for name in TENSOR_COLLECTIVES}

    def checked(name: str):
        original = originals[name]

        def call(*args, **kwargs):
            types = {device_type_of(t) for t in _tensors(args) + _tensors(list(kwargs.values()))}
            seen.append(f"{name}{sorted(types)}")
            refused = types - served
            if refused:
                where = f"on a {spec!r} group, which serves {served}"
                raise RuntimeError(f"{name} of a tensor on {sorted(refused)} {where}")
            return original(*args, **kwargs)

        return call

    for name in TENSOR_COLLECTIVES:
        setattr(dist, name, checked(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
