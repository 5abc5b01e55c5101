"""``kvsvc worker``: flag errors exit 2 naming the flag; a run holds the tensors until a
signal and exits 0; a rejected rank exits 1."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvsvc.cli import main
from kvsvc.models import dump_spec_file
from kvsvc.specs import FullAttentionSpec, MLAAttentionSpec

from .fake_server import FakeServer, FakeWorkerService

pytestmark = pytest.mark.torch

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")


@pytest.fixture
def spec_file(tmp_path: Path) -> str:
    path = tmp_path / "specs.json"
    specs = {f"model.layers.{i}.self_attn.attn": SPEC for i in range(4)}
    specs["model.layers.4.self_attn.attn"] = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=32, dtype="float16"
    )
    dump_spec_file(specs, path)
    return str(path)


def base(server: str = "127.0.0.1:1", world_size: int = 1, rank: int = 0) -> list[str]:
    return [
        "worker",
        "--server",
        server,
        "--pool",
        "p",
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
    ]


def wait_for(predicate: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--device", "tpu"], r"device: expected cpu, cuda or cuda:N, got 'tpu'"),
        (["--device", "cpu"], r"kv_cache_memory: required on cpu"),
        (
            ["--device", "cpu", "--kv-cache-memory", "100000TiB"],
            r"kv_cache_memory: .* exceeds the host's available memory",
        ),
        (["--device", "cpu", "--tp", "3"], r"world_size: --tp 3 x --pp 1 = 3 ranks"),
        (["--device", "cpu", "--attn-layout", "paged"], r"unknown layout 'paged'; valid"),
        (["--device", "cpu", "--attn-layout", "nope=flash"], r"attn_layout\[nope\]: no layer"),
        (
            ["--device", "cpu", "--attn-layout", "model.layers.4.self_attn.attn=flash"],
            r"MLA layers use the 'mla' layout",
        ),
        (["--device", "cpu", "--metrics-listen", "9400"], r"metrics_listen: expected HOST:PORT"),
        (
            ["--device", "cpu", "--shared-layer", "x=nope"],
            r"shared_layers\[x\]: target 'nope' is not a layer",
        ),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    spec_file: str, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*base(), "--spec-file", spec_file, *extra]) == 2
    assert re.search(r"kvsvc worker: error: .*" + message, capsys.readouterr().err)


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="this host has CUDA: no error to see"
)
def test_cuda_without_cuda_names_the_flags_to_use_instead(
    spec_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CPU torch's `--device cuda`: what to do in kvsvc worker's own terms (flags), not
    the Python API's (device='cpu', memory_baseline=None)."""
    assert main([*base(), "--spec-file", spec_file, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"kvsvc worker: error: --device: device 'cuda' needs CUDA", err), err
    assert "run the agent with --device cpu --kv-cache-memory 4GiB" in err
    assert "device='cpu'" not in err and "memory_baseline" not in err
    import torch

    if torch.version.cuda is None:  # a CPU-only build: how to get the CUDA one
        assert "TORCH_INDEX_URL=" in err


def test_a_rank_outside_the_world_and_unknown_models_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [*base(world_size=2, rank=2), "--device", "cpu", "--model-config", "llama-3.2-1b"]
    assert main(args) == 2
    assert "rank: must be in [0, 2)" in capsys.readouterr().err
    assert main([*base(), "--device", "cpu", "--model-config", "no-such-model"]) == 2
    assert "no bundled config named 'no-such-model'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--device", "cpu"], "one of the arguments --model-config --spec-file is required"),
        (
            ["--device", "cpu", "--spec-file", "a", "--model-config", "b"],
            "not allowed with argument",
        ),
        (["--device", "cpu", "--spec-file", "a", "--kv-cache-memory", "lots"], "invalid byte"),
        (["--spec-file", "a"], "the following arguments are required: --device"),
    ],
)
def test_parser_errors_exit_2(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*base(), *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _interrupt_when(predicate: Callable[[], object]) -> None:
    def run() -> None:
        wait_for(predicate)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=run, daemon=True).start()


def test_a_bundled_model_runs_until_sigint_and_exits_0() -> None:
    service = FakeWorkerService()
    with FakeServer(service) as server:
        _interrupt_when(lambda: 0 in service.reports)
        code = main(
            [
                *base(server.address),
                "--device",
                "cpu",
                "--model-config",
                "llama-3.2-1b",
                "--max-model-len",
                "1024",
                "--kv-cache-memory",
                "64MiB",
                "--heartbeat-interval",
                "0.05",
            ]
        )
    assert code == 0
    registration = service.registrations[0]
    assert registration.model == "llama-3.2-1b"
    assert registration.max_model_len == 1024
    assert registration.tensor_parallel_size == 1 and len(registration.layers) == 16
    # 16 layers x 16 tokens x 8 KV heads x 128 (K+V) x 2 bytes = 512 KiB per block.
    assert service.reports[0].num_blocks == 128


def test_a_rejected_rank_exits_1(spec_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer(FakeWorkerService(pool="other")) as server:
        args = [*base(server.address), "--device", "cpu", "--spec-file", spec_file]
        assert main([*args, "--kv-cache-memory", "4MiB"]) == 1
    assert 'kvsvc worker: error: Register: unknown pool "p"' in capsys.readouterr().err


def test_the_process_serves_metrics_and_exits_0_on_sigterm(spec_file: str) -> None:
    service = FakeWorkerService()
    with FakeServer(service) as server:
        command = [
            sys.executable,
            "-m",
            "kvsvc",
            *base(server.address),
            "--device",
            "cpu",
            "--spec-file",
            spec_file,
            "--kv-cache-memory",
            "4MiB",
            "--max-model-len",
            "256",
            "--heartbeat-interval",
            "0.1",
            "--attn-layout",
            "kv_first",
            "--metrics-listen",
            "127.0.0.1:0",
        ]
        process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue[str] = queue.Queue()
        log: list[str] = []

        def pump() -> None:
            assert process.stderr is not None
            for line in process.stderr:
                lines.put(line)

        pumper = threading.Thread(target=pump, daemon=True)
        pumper.start()
        try:
            port = None
            while port is None:
                line = lines.get(timeout=30)
                log.append(line)
                match = re.search(r"metrics on http://127.0.0.1:(\d+)/metrics", line)
                port = int(match.group(1)) if match else None
            wait_for(lambda: 0 in service.reports)

            def scrape() -> str:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return str(r.read().decode())

            # The agent marks itself ready once the server has answered its report, a
            # moment after the server received it (reading at once raced that answer).
            ready = 'kvsvc_agent_ready{pool="p",rank="0"} 1.0'
            wait_for(lambda: ready in scrape())
            body = scrape()
            assert ready in body
            assert 'kvsvc_agent_info{device="cpu",pool="p",rank="0"} 1.0' in body
            views = {v.layer_name: list(v.shape) for v in service.reports[0].views}
            assert views["model.layers.0.self_attn.attn"][:2] == [2, service.reports[0].num_blocks]
            assert views["model.layers.4.self_attn.attn"][1:] == [16, 32]  # MLA stays MLA
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        pumper.join(timeout=5)
        while not lines.empty():
            log.append(lines.get())
        text = "".join(log)
        assert "holding" in text and "SIGTERM: stopping" in text
