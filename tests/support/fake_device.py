"""A fake accelerator for device-placement tests without a GPU: the "fakegpu" device (no storage, no compute).

A tensor left on CPU that meets a "fakegpu" tensor raises ``FakeTensorDeviceMismatchError`` exactly where a GPU
run would fail with "Expected all tensors to be on the same device". Built on torch's FakeTensorMode and the
privateuse1 backend (private torch 2.13 API); the rename is once per process, so tests run it in a subprocess.
Limits: torch has no autocast kernels for a python backend (BF16 autocast cannot run here: FP32 and the FP8
emulator only), and data-dependent reads (``float(t)``) are stood in for when ``host_syncs`` is a list.
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

FAKE = "fakegpu"


# ---------------------------------------------------------------------------------------------- the helper
def ensure_fake_backend(name: str = FAKE) -> None:
    """Register the privateuse1 backend as a python "device" called `name` (once per process)."""
    if torch._C._get_privateuse1_backend_name() == name:
        return
    from torch.utils.backend_registration import _DummyBackendModule, _setup_privateuseone_for_python_backend

    class BackendModule(_DummyBackendModule):
        def get_amp_supported_dtype(self):  # lets torch.autocast(device_type=name) be entered (fp8rl.quant does)
            return [torch.float16, torch.bfloat16]

    # private, experimental torch API (2.13)
    _setup_privateuseone_for_python_backend(rename=name, backend_module=BackendModule())


class FakeDeviceMode(FakeTensorMode):
    """FakeTensorMode that never initializes a device (the registered backend would otherwise count as one).

    With ``host_syncs`` set to a list, data-dependent reads of a fake tensor (``bool(t)``, ``t.item()``,
    ``float(t)``, ``torch.equal``) do not raise: they return a stand-in (True / 1 / False for equal) and append
    the innermost fp8rl/megatron frame to the list - each one is a device-to-host sync on a real GPU.
    """

    host_syncs: list | None = None

    @property
    def avoid_device_init(self) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.host_syncs is not None and func in (
            torch.ops.aten._local_scalar_dense.default,
            torch.ops.aten.equal.default,
        ):
            frames = [f for f in traceback.extract_stack() if "/fp8rl/" in f.filename or "/megatron/" in f.filename]
            where = frames[-1] if frames else traceback.extract_stack()[-3]
            self.host_syncs.append(
                f"{where.filename.split('site-packages/')[-1]}:{where.lineno} {where.line.strip()[:60]}"
            )
            if func is torch.ops.aten.equal.default:
                return False
            dtype = args[0].dtype
            return True if dtype == torch.bool else (1 if not dtype.is_floating_point else 1.0)
        return super().__torch_dispatch__(func, types, args, kwargs or {})


def _clear_rope_cache() -> None:
    # megatron's RotaryEmbedding.forward is an lru_cache (rotary_pos_embedding.py:177): it would hand a cached
    # real CPU embedding to the fake run, or keep a fake one for later real runs.
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding.forward.cache_clear()


_MODE: list[FakeDeviceMode] = []


def _fake_mode() -> FakeDeviceMode:
    """One mode per process: fake tensors cached across blocks (by megatron or fp8rl) must share their mode."""
    if not _MODE:
        _MODE.append(FakeDeviceMode(allow_non_fake_inputs=False))
    return _MODE[0]


def _drop_fake_buffers(device: str) -> None:
    """Forget scratch tensors megatron's global memory buffer allocated on the fake device."""
    from megatron.core import parallel_state

    buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    if buffer is not None:
        buffer.buffer = {k: v for k, v in buffer.buffer.items() if v.device.type != device}


@contextlib.contextmanager
def fake_device_model(model: torch.nn.Module, device: str = FAKE):
    """Inside the block `model`'s parameters, buffers and plain tensor attributes (RoPE's inv_freq) are fake
    tensors on `device`; yields the FakeTensorMode. Create inputs inside the block (``torch.ones(..., device=
    device)``); real tensors passed in raise. Everything is restored on exit (the real weights are untouched).
    """
    ensure_fake_backend(device)
    mode = _fake_mode()
    saved: list[tuple[dict, str, object]] = []
    fakes: dict[int, torch.Tensor] = {}  # shared (tied) tensors stay shared

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            f = torch.empty(t.shape, dtype=t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                f = torch.nn.Parameter(f, requires_grad=t.requires_grad)
                for key, value in vars(t).items():  # megatron's tensor_model_parallel, partition_dim, ...
                    setattr(f, key, value)
            fakes[id(t)] = f
        return fakes[id(t)]

    _clear_rope_cache()
    with mode:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is not None:
                        saved.append((table, name, t))
                        table[name] = fake_of(t)
            for name, t in list(vars(module).items()):
                if isinstance(t, torch.Tensor):
                    saved.append((module.__dict__, name, t))
                    module.__dict__[name] = fake_of(t)
        try:
            yield mode
        finally:
            for table, name, t in reversed(saved):
                table[name] = t
            _clear_rope_cache()
            _drop_fake_buffers(device)
