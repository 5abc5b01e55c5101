"""How many bytes a worker can offer the KV cache.

CUDA follows vLLM's worker: the KV cache gets ``gpu_memory_utilization`` of the device
minus what the rest of the engine needs, where that need is measured against a *baseline*
snapshot taken before the engine loaded anything::

    requested = total * gpu_memory_utilization            (must be free at the baseline)
    non_kv    = torch peak increase                       (weights + activation peak)
              + non-torch increase                        (CUDA graphs, NCCL, cuBLAS, ...)
    kv_cache  = requested - non_kv

where ``non-torch = (total - free) - torch reserved``. Memory other processes hold is in the
baseline, so it does not count against this engine; it only has to leave ``requested``
free. A fixed ``kv_cache_memory`` skips the arithmetic (it must fit in what is free now).

CPU has no profiler: the KV cache gets a fixed ``kv_cache_memory`` budget, which must fit in
the host's available memory (``MemAvailable`` of ``/proc/meminfo``).

The arithmetic is pure (:func:`cuda_kv_cache_budget`, :func:`cpu_kv_cache_budget`) so tests
can feed it numbers; :func:`profile_memory` reads the real figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsvc.errors import InvalidArgument
from kvsvc.units import format_gib


@dataclass(frozen=True, slots=True)
class SettingNames:
    """How a memory message names the settings to change: the caller's own spelling.

    The same budget errors reach a Python caller (``WorkerAgentConfig`` fields) and a
    ``kvsvc worker`` user (flags); telling either to use the other's knob is no help.
    """

    kv_cache_memory: str
    gpu_memory_utilization: str
    example_budget: str
    device: str
    # How to run on a CPU-only machine instead, in the caller's terms.
    on_cpu: str


# A Python caller's spelling (the default): the fields of WorkerAgentConfig.
PYTHON_NAMES = SettingNames(
    kv_cache_memory="kv_cache_memory (WorkerAgentConfig)",
    gpu_memory_utilization="gpu_memory_utilization (WorkerAgentConfig)",
    example_budget="4 << 30 for 4 GiB",
    device="device",
    on_cpu="device='cpu' and a fixed kv_cache_memory, and no CUDA snapshot (memory_baseline=None)",
)
# ``kvsvc worker``'s spelling: its flags.
FLAG_NAMES = SettingNames(
    kv_cache_memory="--kv-cache-memory",
    gpu_memory_utilization="--gpu-memory-utilization",
    example_budget="4GiB",
    device="--device",
    on_cpu="--device cpu --kv-cache-memory 4GiB (a fixed budget: on the CPU there is "
    "nothing to profile)",
)


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What a worker reports at registration (bytes).

    Attributes:
        total_bytes: device (or host) memory in total.
        free_bytes: free at profiling time (host: ``MemAvailable``).
        non_kv_bytes: what the rest of the engine uses (weights, activation peak,
            non-torch allocations; host: this process's resident memory).
        kv_cache_bytes: what the worker offers the KV cache.
    """

    total_bytes: int
    free_bytes: int
    non_kv_bytes: int
    kv_cache_bytes: int


@dataclass(frozen=True, slots=True)
class CudaMemorySnapshot:
    """Device memory figures at one moment.

    Attributes:
        total_bytes / free_bytes: ``torch.cuda.mem_get_info``.
        torch_peak_bytes: ``torch.cuda.max_memory_allocated`` (since the last reset).
        torch_reserved_bytes: ``torch.cuda.memory_reserved`` (held by torch's allocator).
    """

    total_bytes: int
    free_bytes: int
    torch_peak_bytes: int = 0
    torch_reserved_bytes: int = 0

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes

    @property
    def non_torch_bytes(self) -> int:
        """Device memory in use outside torch's allocator (contexts, NCCL, other processes)."""
        return max(self.used_bytes - self.torch_reserved_bytes, 0)


def _check_utilization(gpu_memory_utilization: float) -> None:
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise InvalidArgument(
            "gpu_memory_utilization", f"must be in (0, 1], got {gpu_memory_utilization}"
        )


def cuda_kv_cache_budget(
    current: CudaMemorySnapshot,
    *,
    baseline: CudaMemorySnapshot | None = None,
    gpu_memory_utilization: float = 0.9,
    kv_cache_memory: int | None = None,
    names: SettingNames = PYTHON_NAMES,
) -> MemoryProfile:
    """The KV cache budget of a CUDA device, vLLM's way (see the module docstring).

    Args:
        current: the snapshot after the engine loaded weights and ran its profile pass.
        baseline: the snapshot before it loaded anything (default: ``current``, i.e. a
            standalone agent with nothing else on the device).
        gpu_memory_utilization: fraction of the device this engine may use, in (0, 1].
        kv_cache_memory: a fixed budget instead of the utilisation arithmetic.
        names: how messages name the settings (fields, or ``kvsvc worker``'s flags).

    Raises:
        InvalidArgument: naming the setting to change when nothing is left for the KV cache,
            the device had less free than requested at the baseline, or a fixed budget
            exceeds the free memory.
    """
    _check_utilization(gpu_memory_utilization)
    baseline = baseline or current
    torch_increase = max(current.torch_peak_bytes - baseline.torch_peak_bytes, 0)
    non_torch_increase = max(current.non_torch_bytes - baseline.non_torch_bytes, 0)
    non_kv = torch_increase + non_torch_increase
    if kv_cache_memory is not None:
        if kv_cache_memory <= 0:
            raise InvalidArgument("kv_cache_memory", f"must be positive, got {kv_cache_memory}")
        if kv_cache_memory > current.free_bytes:
            raise InvalidArgument(
                "kv_cache_memory",
                f"{format_gib(kv_cache_memory)} GiB exceeds the free device memory "
                f"{format_gib(current.free_bytes)} GiB; lower {names.kv_cache_memory}",
            )
        kv = kv_cache_memory
    else:
        requested = int(current.total_bytes * gpu_memory_utilization)
        if baseline.free_bytes < requested:
            raise InvalidArgument(
                "gpu_memory_utilization",
                f"free memory on the device at startup ({format_gib(baseline.free_bytes)}/"
                f"{format_gib(baseline.total_bytes)} GiB) is less than the desired "
                f"utilisation ({gpu_memory_utilization}, {format_gib(requested)} GiB); lower "
                f"{names.gpu_memory_utilization} or free memory used by other processes",
            )
        kv = requested - non_kv
        if kv <= 0:
            raise InvalidArgument(
                "gpu_memory_utilization",
                f"no memory left for the KV cache: {gpu_memory_utilization} of the device is "
                f"{format_gib(requested)} GiB but the engine already needs "
                f"{format_gib(non_kv)} GiB; raise {names.gpu_memory_utilization} or set "
                f"{names.kv_cache_memory}",
            )
    return MemoryProfile(
        total_bytes=current.total_bytes,
        free_bytes=current.free_bytes,
        non_kv_bytes=non_kv,
        kv_cache_bytes=kv,
    )


def cpu_kv_cache_budget(
    *,
    mem_total: int,
    mem_available: int,
    process_rss: int,
    kv_cache_memory: int | None,
    names: SettingNames = PYTHON_NAMES,
) -> MemoryProfile:
    """The KV cache budget of a host: a fixed budget that must fit in available memory.

    Raises:
        InvalidArgument: naming ``kv_cache_memory`` when it is missing, not positive, or
            larger than ``mem_available``.
    """
    if kv_cache_memory is None:
        raise InvalidArgument(
            "kv_cache_memory",
            f"required on cpu (there is no profiler): give {names.kv_cache_memory}, e.g. "
            f"{names.example_budget}",
        )
    if kv_cache_memory <= 0:
        raise InvalidArgument("kv_cache_memory", f"must be positive, got {kv_cache_memory}")
    if kv_cache_memory > mem_available:
        raise InvalidArgument(
            "kv_cache_memory",
            f"{format_gib(kv_cache_memory)} GiB exceeds the host's available memory "
            f"{format_gib(mem_available)} GiB (MemAvailable in /proc/meminfo); lower "
            f"{names.kv_cache_memory}",
        )
    return MemoryProfile(
        total_bytes=mem_total,
        free_bytes=mem_available,
        non_kv_bytes=process_rss,
        kv_cache_bytes=kv_cache_memory,
    )


# --------------------------------------------------------------------------- readers


def read_meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``{"MemTotal": ..., "MemAvailable": ...}``).

    Falls back to ``sysconf`` page counts where there is no ``/proc`` (macOS).
    """
    out: dict[str, int] = {}
    try:
        text = Path(path).read_text()
    except OSError:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * page
        except (ValueError, OSError):
            available = total
        return {"MemTotal": total, "MemAvailable": available}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if not fields or not fields[0].isdigit():
            continue
        scale = 1024 if len(fields) > 1 and fields[1].lower() == "kb" else 1
        out[key.strip()] = int(fields[0]) * scale
    if "MemAvailable" not in out and "MemFree" in out:
        out["MemAvailable"] = out["MemFree"]  # kernels before 3.14
    return out


def process_rss_bytes() -> int:
    """Resident memory of this process (0 where it cannot be read)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def host_available_bytes() -> int:
    return read_meminfo().get("MemAvailable", 0)


def _torch() -> Any:
    import torch  # the worker is the one place kvsvc imports torch

    return torch


def _require_cuda(torch: Any, what: str, names: SettingNames = PYTHON_NAMES) -> None:
    """Raise a kvsvc error instead of torch's bare ``AssertionError: Torch not compiled
    with CUDA enabled`` (or a driver error) when CUDA cannot be used, saying what to do
    in the caller's terms (``names``: Python arguments, or ``kvsvc worker``'s flags)."""
    if torch.cuda.is_available():
        return
    cpu_build = torch.version.cuda is None
    why = (
        f"this torch ({torch.__version__}) is a CPU-only build"
        if cpu_build
        else f"this torch ({torch.__version__}) sees no CUDA device"
    )
    gpu = (
        "; on a GPU machine, install torch's CUDA build (make venv "
        "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128, the CUDA your driver runs)"
        if cpu_build
        else ""
    )
    raise InvalidArgument(
        names.device,
        f"{what} needs CUDA, and {why}. On a CPU-only machine run the agent with "
        f"{names.on_cpu}{gpu}.",
    )


def take_cuda_snapshot(device: Any = None) -> CudaMemorySnapshot:
    """The current figures of a CUDA device (``None``: the current device).

    Take one before the engine loads weights and pass it as ``baseline`` to
    :func:`profile_memory`; reset the peak (``torch.cuda.reset_peak_memory_stats``) first
    so the peak increase is this engine's.

    Raises:
        InvalidArgument: naming ``device`` when CUDA cannot be used (a CPU-only torch, or
            no device): the message says what to do on a CPU-only machine.
    """
    torch = _torch()
    _require_cuda(torch, "take_cuda_snapshot()")
    free, total = torch.cuda.mem_get_info(device)
    return CudaMemorySnapshot(
        total_bytes=int(total),
        free_bytes=int(free),
        torch_peak_bytes=int(torch.cuda.max_memory_allocated(device)),
        torch_reserved_bytes=int(torch.cuda.memory_reserved(device)),
    )


def device_free_bytes(device: str) -> int:
    """Free memory of ``device`` now (host: ``MemAvailable``)."""
    if device.startswith("cuda"):
        torch = _torch()
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return host_available_bytes()


def profile_memory(
    device: str,
    *,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
    baseline: CudaMemorySnapshot | None = None,
    names: SettingNames = PYTHON_NAMES,
) -> MemoryProfile:
    """Measure ``device`` and decide the KV cache budget.

    Args:
        device: ``"cpu"`` or ``"cuda[:N]"``.
        kv_cache_memory: fixed budget in bytes (required on CPU).
        gpu_memory_utilization: CUDA only; see :func:`cuda_kv_cache_budget`.
        baseline: CUDA only; the snapshot taken before the engine loaded anything.
        names: how messages name the settings (fields, or ``kvsvc worker``'s flags).

    Raises:
        InvalidArgument: when the budget does not fit, or CUDA is asked for and missing.
    """
    if device.startswith("cuda"):
        torch = _torch()
        _require_cuda(torch, f"device {device!r}", names)
        dev = torch.device(device)
        torch.cuda.synchronize(dev)
        current = take_cuda_snapshot(dev)
        return cuda_kv_cache_budget(
            current,
            baseline=baseline,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory=kv_cache_memory,
            names=names,
        )
    info = read_meminfo()
    return cpu_kv_cache_budget(
        mem_total=info.get("MemTotal", 0),
        mem_available=info.get("MemAvailable", 0),
        process_rss=process_rss_bytes(),
        kv_cache_memory=kv_cache_memory,
        names=names,
    )
