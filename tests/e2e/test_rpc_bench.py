"""The RPC benchmark runs end to end (short form) and its figures hold together.

Not "> 0": every p99 is at least its p50, the marginal cost and the ratios are the ones
the printed medians give, and the vLLM figure says where it comes from (this run where
vLLM is importable: tests/vllm/test_bench_vllm_columns.py; a labelled reference here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvsvc.native
from kvsvc.server.handler_stages import STAGES as HANDLER_STAGES

pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.torch]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "rpc_bench.py"
REFERENCE_VLLM_DECODE_US = 5.18
# Figure suffixes: gRPC over loopback TCP and the Unix socket, the framed transport over both.
TRANSPORTS = ("", "_unix", "_frames_tcp", "_frames")
# The pure-Python core's server (where the compiled core is built) -> the compiled
# server's transport it is compared with.
PURE_TRANSPORTS = {"_pure": "", "_frames_pure": "_frames"}
# The server with busy polling off -> the main (polling) server's transport.
NOPOLL_TRANSPORTS = {"_frames_nopoll": "_frames"}


def run_bench(*flags: str, python: str = sys.executable) -> dict[str, Any]:
    out = subprocess.run(
        [python, str(BENCH), "--quick", "--json", *flags],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    figures: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return figures


def check_relations(figures: dict[str, Any]) -> None:
    """What must hold between one report's figures, whoever ran it."""
    for call in ("echo", "allocate_new", "step256"):
        for transport in TRANSPORTS:
            name = f"{call}{transport}"
            assert 0 < figures[f"{name}_p50_us"] <= figures[f"{name}_p99_us"], name
        unix_vs_tcp = figures[f"{call}_unix_p50_us"] / figures[f"{call}_p50_us"]
        assert figures[f"{call}_unix_vs_tcp"] == pytest.approx(unix_vs_tcp, rel=1e-3, abs=1e-3)
    for transport in TRANSPORTS:
        # The server's own handler time is part of each call: above 0, below its p99.
        for call in ("allocate_new", "step256"):
            handler = figures[f"{call}{transport}_handler_us"]
            assert 0 < handler < figures[f"{call}{transport}_p99_us"], (call, transport)
        alloc = figures[f"allocate_new{transport}_p50_us"]
        beyond = (alloc - figures[f"allocate_new{transport}_handler_us"]) / figures[
            f"echo{transport}_p50_us"
        ]
        assert figures[f"allocate_new{transport}_beyond_handler_vs_echo"] == pytest.approx(
            beyond, rel=1e-2, abs=2e-3
        )
        # The server's own split of its handler: the pool's work and the events' drain
        # in every call, a reply sent from the handler only over frames, the parts
        # within the whole (each mean rounded to 0.1 us).
        for call in ("allocate_new", "step256"):
            stages = {s: figures[f"{call}{transport}_stage_{s}_us"] for s in HANDLER_STAGES}
            assert stages["decode"] > 0 and stages["apply"] > 0 and stages["events"] > 0
            assert (stages["reply"] > 0) == ("frames" in transport), (call, transport, stages)
            handler = figures[f"{call}{transport}_handler_us"]
            assert sum(stages.values()) <= handler + 0.5, (call, transport, stages)
    # The framed transport's calls against gRPC's echo and call on the same socket kind.
    for transport, grpc_transport in (("_frames_tcp", ""), ("_frames", "_unix")):
        for call in ("allocate_new", "step256"):
            mine = figures[f"{call}{transport}_p50_us"]
            vs_echo = mine / figures[f"echo{grpc_transport}_p50_us"]
            assert figures[f"{call}{transport}_vs_grpc_echo"] == pytest.approx(vs_echo, rel=1e-2)
            vs_grpc = mine / figures[f"{call}{grpc_transport}_p50_us"]
            assert figures[f"{call}{transport}_vs_grpc"] == pytest.approx(vs_grpc, rel=1e-2)
    # The pure-Python core's server, beside a compiled one: its calls against the same
    # calls of the compiled server (gRPC TCP, frames Unix socket).
    # And the server with busy polling off, against the polling one's same calls.
    compared = [(NOPOLL_TRANSPORTS, "polling")]
    if figures["pure_core"]:
        compared.append((PURE_TRANSPORTS, "compiled"))
    for transports, word in compared:
        for transport, main in transports.items():
            for call in ("allocate_new", "step256"):
                name = f"{call}{transport}"
                assert 0 < figures[f"{name}_p50_us"] <= figures[f"{name}_p99_us"], name
                assert 0 < figures[f"{name}_handler_us"] < figures[f"{name}_p99_us"], name
                ratio = figures[f"{name}_p50_us"] / figures[f"{call}{main}_p50_us"]
                assert figures[f"{name}_vs_{word}"] == pytest.approx(ratio, rel=1e-2)
    # The main server polled through the rounds' back-to-back calls, and says what for.
    assert figures["server_busy_poll_hits"] > 0
    assert figures["server_busy_poll_misses"] >= 0
    assert figures["server_busy_poll_s"] > 0
    assert 0 < figures["server_busy_poll_share"] < 1
    # The tails: p99 over p50 as printed, and the slow samples a client GC overlapped.
    for transport in TRANSPORTS:
        for call in ("allocate_new", "step256"):
            name = f"{call}{transport}"
            ratio = figures[f"{name}_p99_us"] / figures[f"{name}_p50_us"]
            assert figures[f"{name}_p99_vs_p50"] == pytest.approx(ratio, abs=0.01)
            assert 0 <= figures[f"{name}_slow_with_client_gc"] <= figures[f"{name}_slow_samples"]
    # The handlers' stages (in-process): each within the handler's whole work.
    for call, stages in (
        ("allocate_new", ("decode", "hash", "core", "reply")),
        ("step256", ("decode", "decode_pb", "core", "reply", "reply_pb")),
    ):
        whole = figures[f"{call}_split_handler_p50_us"]
        for stage in (*stages, "handler"):
            key = f"{call}_split_{stage}"
            assert 0 < figures[f"{key}_p50_us"] <= figures[f"{key}_p99_us"], key
        parts = sum(
            figures[f"{call}_split_{stage}_p50_us"] for stage in ("decode", "core", "reply")
        )
        assert parts == pytest.approx(whole, rel=0.5), call
        assert figures[f"{call}_split_gc_collections"] >= 0
        # The pool's work again after other memory traffic: measured, one run apiece.
        cold = f"{call}_split_core_cold"
        assert 0 < figures[f"{cold}_p50_us"] <= figures[f"{cold}_p99_us"], call
    # The server's CPU per framed call (Linux /proc), back to back and woken after a gap:
    # read from the right processes (a wrong or ended one reads 0).
    for name in ("echo", "step32", "step256"):
        assert figures[f"{name}_frames_server_cpu_us"] > 0, name
        assert figures[f"{name}_frames_server_cpu_woken_us"] > 0, name
    assert 0 < figures["step256_lockstep_p50_us"] <= figures["step256_lockstep_max_us"]
    assert figures["concurrent_ops_per_s"] > 0
    # Derived figures come from the printed medians (each rounded to 0.1 us).
    marginal = (figures["step256_p50_us"] - figures["echo_p50_us"]) / 256
    assert figures["step256_marginal_us"] == pytest.approx(marginal, abs=0.006)
    # The slope: the 256-request Step over the 32-request one, per added request.
    slope = (figures["step256_p50_us"] - figures["step32_p50_us"]) / 224
    assert figures["step256_slope_us"] == pytest.approx(slope, abs=0.006)
    assert figures["step32_p50_us"] > 0
    vs_echo = figures["allocate_new_p50_us"] / figures["echo_p50_us"]
    assert figures["allocate_new_vs_echo"] == pytest.approx(vs_echo, rel=1e-3, abs=1e-3)
    vs_vllm = figures["step256_marginal_us"] / figures["vllm_decode_us_p50"]
    assert figures["marginal_vs_vllm"] == pytest.approx(vs_vllm, rel=0.01, abs=0.002)
    if figures["vllm_source"] == "measured":
        assert figures["vllm_version"] and figures["vllm_decode_us_p50"] > 0
        # The same 256 decodes in-process: at least 256 single decodes' worth of medians.
        assert figures["vllm_step256_us_p50"] >= figures["vllm_decode_us_p50"] * 200
        for transport in TRANSPORTS:
            step = figures[f"step256{transport}_p50_us"] / figures["vllm_step256_us_p50"]
            assert figures[f"step256{transport}_vs_vllm"] == pytest.approx(step, rel=1e-2)
            admit = figures[f"allocate_new{transport}_p50_us"] / figures["vllm_admission_us_p50"]
            assert figures[f"allocate_new{transport}_vs_vllm"] == pytest.approx(admit, rel=1e-2)
    else:
        assert figures["vllm_source"] == "reference" and figures["vllm_version"] is None
        assert figures["vllm_decode_us_p50"] == REFERENCE_VLLM_DECODE_US
        assert "vllm_step256_us_p50" not in figures


def test_rpc_bench_quick_json() -> None:
    # --no-vllm: this test is about kvsvc's figures; the vLLM tests measure vLLM's.
    figures = run_bench("--no-vllm")
    check_relations(figures)
    assert figures["vllm_source"] == "reference"
    # Both builds side by side wherever the compiled one is there.
    assert figures["pure_core"] == (kvsvc.native.BUILD == "mypyc")
