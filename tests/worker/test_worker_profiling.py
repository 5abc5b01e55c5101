"""The KV cache budget arithmetic (CUDA fed with numbers, CPU against MemAvailable)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")  # kvsvc.worker (the package) imports torch


from kvsvc.errors import InvalidArgument
from kvsvc.worker.profiling import (
    FLAG_NAMES,
    CudaMemorySnapshot,
    MemoryProfile,
    cpu_kv_cache_budget,
    cuda_kv_cache_budget,
    profile_memory,
    read_meminfo,
    take_cuda_snapshot,
)

pytestmark = pytest.mark.torch

GiB = 1 << 30


def test_cuda_budget_is_utilisation_minus_what_the_engine_added() -> None:
    # 80 GiB device; 1 GiB used by another process and the context at the baseline.
    baseline = CudaMemorySnapshot(total_bytes=80 * GiB, free_bytes=79 * GiB)
    # Weights + activation peak: 20 GiB through torch (reserved 22); NCCL/graphs: 2 GiB.
    current = CudaMemorySnapshot(
        total_bytes=80 * GiB,
        free_bytes=55 * GiB,
        torch_peak_bytes=20 * GiB,
        torch_reserved_bytes=22 * GiB,
    )
    profile = cuda_kv_cache_budget(current, baseline=baseline, gpu_memory_utilization=0.9)
    # non-torch: (80-55) - 22 = 3 GiB now vs 1 GiB at the baseline -> +2 GiB.
    assert profile.non_kv_bytes == 22 * GiB
    assert profile.kv_cache_bytes == int(80 * GiB * 0.9) - 22 * GiB
    assert (profile.total_bytes, profile.free_bytes) == (80 * GiB, 55 * GiB)


def test_cuda_budget_without_a_baseline_offers_the_whole_utilisation() -> None:
    snap = CudaMemorySnapshot(total_bytes=16 * GiB, free_bytes=15 * GiB)
    profile = cuda_kv_cache_budget(snap, gpu_memory_utilization=0.5)
    assert profile == MemoryProfile(16 * GiB, 15 * GiB, 0, 8 * GiB)


def test_cuda_budget_refuses_more_than_was_free_at_startup() -> None:
    baseline = CudaMemorySnapshot(total_bytes=80 * GiB, free_bytes=40 * GiB)
    with pytest.raises(
        InvalidArgument, match=r"gpu_memory_utilization: free memory .*\(40.00/80.00 GiB\)"
    ):
        cuda_kv_cache_budget(baseline, baseline=baseline, gpu_memory_utilization=0.9)


def test_cuda_budget_says_what_to_change_when_nothing_is_left() -> None:
    baseline = CudaMemorySnapshot(total_bytes=24 * GiB, free_bytes=24 * GiB)
    current = CudaMemorySnapshot(24 * GiB, 2 * GiB, torch_peak_bytes=22 * GiB)
    with pytest.raises(
        InvalidArgument,
        match=r"no memory left.*raise gpu_memory_utilization \(WorkerAgentConfig\) or set "
        r"kv_cache_memory \(WorkerAgentConfig\)$",
    ):
        cuda_kv_cache_budget(current, baseline=baseline, gpu_memory_utilization=0.9)
    # kvsvc worker's spelling: its flags.
    with pytest.raises(
        InvalidArgument, match=r"raise --gpu-memory-utilization or set --kv-cache-memory$"
    ):
        cuda_kv_cache_budget(
            current, baseline=baseline, gpu_memory_utilization=0.9, names=FLAG_NAMES
        )


def test_cuda_fixed_budget_must_fit_in_free_memory() -> None:
    snap = CudaMemorySnapshot(total_bytes=24 * GiB, free_bytes=10 * GiB)
    assert cuda_kv_cache_budget(snap, kv_cache_memory=4 * GiB).kv_cache_bytes == 4 * GiB
    with pytest.raises(InvalidArgument, match=r"kv_cache_memory: 12.00 GiB exceeds the free"):
        cuda_kv_cache_budget(snap, kv_cache_memory=12 * GiB)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5])
def test_cuda_utilisation_outside_zero_one_is_refused(utilization: float) -> None:
    snap = CudaMemorySnapshot(total_bytes=GiB, free_bytes=GiB)
    with pytest.raises(InvalidArgument, match=r"gpu_memory_utilization: must be in"):
        cuda_kv_cache_budget(snap, gpu_memory_utilization=utilization)


def test_cpu_budget_must_be_given_and_fit_in_available_memory() -> None:
    profile = cpu_kv_cache_budget(
        mem_total=32 * GiB, mem_available=20 * GiB, process_rss=GiB, kv_cache_memory=8 * GiB
    )
    assert profile == MemoryProfile(32 * GiB, 20 * GiB, GiB, 8 * GiB)
    with pytest.raises(InvalidArgument, match=r"kv_cache_memory: required on cpu"):
        cpu_kv_cache_budget(
            mem_total=32 * GiB, mem_available=20 * GiB, process_rss=0, kv_cache_memory=None
        )
    with pytest.raises(
        InvalidArgument, match=r"24.00 GiB exceeds the host's available memory 20.00 GiB"
    ):
        cpu_kv_cache_budget(
            mem_total=32 * GiB, mem_available=20 * GiB, process_rss=0, kv_cache_memory=24 * GiB
        )


def test_read_meminfo_converts_kilobytes(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       16384 kB\nMemFree:  1024 kB\nMemAvailable:   8192 kB\n")
    assert read_meminfo(path) == {
        "MemTotal": 16384 * 1024,
        "MemFree": 1024 * 1024,
        "MemAvailable": 8192 * 1024,
    }


def test_profile_memory_on_this_host_reads_real_figures() -> None:
    info = read_meminfo()
    profile = profile_memory("cpu", kv_cache_memory=1 << 20)
    assert profile.kv_cache_bytes == 1 << 20
    assert 0 < profile.free_bytes <= profile.total_bytes
    assert profile.total_bytes == info["MemTotal"]
    assert profile.non_kv_bytes > 0  # this process's resident memory
    with pytest.raises(InvalidArgument, match=r"exceeds the host's available memory"):
        profile_memory("cpu", kv_cache_memory=info["MemTotal"] * 4)


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="this host has CUDA: no error to see"
)
def test_cuda_snapshot_and_profile_without_cuda_raise_a_kvsvc_error() -> None:
    # Not torch's bare "AssertionError: Torch not compiled with CUDA enabled": a kvsvc
    # error naming the device and what to do on a CPU-only machine.
    import torch

    build = "is a CPU-only build" if torch.version.cuda is None else "sees no CUDA device"
    with pytest.raises(InvalidArgument) as raised:
        take_cuda_snapshot()
    message = str(raised.value)
    assert message.startswith(
        f"device: take_cuda_snapshot() needs CUDA, and this torch ({torch.__version__}) {build}"
    )
    assert "device='cpu' and a fixed kv_cache_memory" in message
    assert "memory_baseline=None" in message
    with pytest.raises(InvalidArgument, match=r"^device: device 'cuda:0' needs CUDA"):
        profile_memory("cuda:0", kv_cache_memory=1 << 20)


def test_importing_the_worker_warns_about_nothing() -> None:
    # torch warns "Failed to initialize NumPy" at import when NumPy is missing: the worker
    # extra installs it, so an engine importing the agent sees no warning.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import kvsvc.worker"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
