"""vllm_bench.py's figures: per-round rates, same-round ratios, the NOISY flag, the table.

The benchmark itself needs vLLM and minutes; what it computes from its readings is
checked here on made-up readings, so a wrong ratio or a flag that never fires cannot
hide behind a noisy machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.tooling import script_module

MODULE = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_figures.py"


@pytest.fixture(scope="module")
def figures() -> Iterator[ModuleType]:
    with script_module("engine_figures", MODULE) as module:
        yield module


def a_round(figures: ModuleType, tokens_per_s: float, scheduler_cpu_us: float, **more: Any) -> Any:
    values = {
        "manager_cpu_us": 50.0,
        "vllm_cpu_us": 40.0,
        "scheduler_wall_us": 500.0,
        "process_cpu_us": 900.0,
        "total_cpu_us": 1000.0,
    }
    return figures.RoundFigures(
        tokens_per_s=tokens_per_s, scheduler_cpu_us=scheduler_cpu_us, **{**values, **more}
    )


def kvsvc_round(figures: ModuleType, tokens_per_s: float, scheduler_cpu_us: float) -> Any:
    return a_round(
        figures,
        tokens_per_s,
        scheduler_cpu_us,
        steps_cpu_us=10.0,
        wait_us=40.0,
        sender_cpu_us=30.0,
        server_cpu_us=100.0,
    )


def test_round_figures_divide_by_the_rounds_steps_and_tokens(figures: ModuleType) -> None:
    before = figures.Reading(
        steps=10,
        scheduler_cpu_s=1.0,
        scheduler_wall_s=2.0,
        process_cpu_s=5.0,
        manager_cpu_s=0.5,
        steps_cpu_s=0.1,
        wait_s=0.5,
        sender_cpu_s=0.25,
        server_cpu_s=3.0,
        main_thread_cpu_s=2.0,
        native_threads_cpu_s=2.5,
    )
    after = figures.Reading(
        steps=60,
        scheduler_cpu_s=1.05,
        scheduler_wall_s=2.1,
        process_cpu_s=7.0,
        manager_cpu_s=0.52,
        steps_cpu_s=0.105,
        wait_s=0.51,
        sender_cpu_s=0.26,
        server_cpu_s=3.5,
        main_thread_cpu_s=3.1,
        native_threads_cpu_s=3.2,
    )
    got = figures.round_figures(before, after, tokens=1000, elapsed_s=4.0)
    assert got.tokens_per_s == 250.0
    assert got.scheduler_cpu_us == pytest.approx(1000.0)  # 50 ms over 50 steps
    assert got.manager_cpu_us == pytest.approx(400.0)
    assert got.steps_cpu_us == pytest.approx(100.0)
    assert got.vllm_cpu_us == pytest.approx(500.0)  # the scheduler's CPU less both parts
    assert got.scheduler_wall_us == pytest.approx(2000.0)
    assert got.wait_us == pytest.approx(200.0)
    assert got.sender_cpu_us == pytest.approx(200.0)
    assert got.process_cpu_us == pytest.approx(2000.0)  # 2 s over 1,000 tokens
    assert got.server_cpu_us == pytest.approx(500.0)
    assert got.total_cpu_us == pytest.approx(2500.0)
    assert got.main_thread_cpu_us == pytest.approx(1100.0)  # 1.1 s over 1,000 tokens
    assert got.native_threads_cpu_us == pytest.approx(700.0)


def test_stock_has_no_kvsvc_figures(figures: ModuleType) -> None:
    before = figures.Reading(steps=0, scheduler_cpu_s=0, scheduler_wall_s=0, process_cpu_s=1.0)
    after = figures.Reading(steps=4, scheduler_cpu_s=0.004, scheduler_wall_s=0.008, process_cpu_s=2)
    got = figures.round_figures(before, after, tokens=100, elapsed_s=1.0)
    assert (got.wait_us, got.sender_cpu_us, got.server_cpu_us) == (None, None, None)
    assert got.steps_cpu_us is None
    assert got.vllm_cpu_us == pytest.approx(1000.0)  # no manager time in the readings
    assert got.total_cpu_us == got.process_cpu_us == pytest.approx(10_000.0)


def test_ratios_are_to_stocks_round_of_the_same_rotation(figures: ModuleType) -> None:
    stock = [a_round(figures, r, 100.0) for r in (100.0, 1000.0, 400.0)]
    engine = [kvsvc_round(figures, r, 90.0) for r in (95.0, 1100.0, 200.0)]
    ratios = figures.per_round_ratios(engine, stock, "tokens_per_s")
    assert ratios == pytest.approx([0.95, 1.1, 0.5])
    # Medians of rates would give 400 / 200: the same-round ratios are what is compared.
    assert figures.Spread.of(ratios) == figures.Spread(median=0.95, low=0.5, high=1.1)


def test_noisy_above_twice_the_spread_only(figures: ModuleType) -> None:
    def stock(*rates: float) -> list[Any]:
        return [a_round(figures, r, 100.0) for r in rates]

    assert figures.noisy(stock(300.0, 600.0, 450.0)) is None  # exactly 2x: not flagged
    assert figures.noisy(stock(278.0, 4838.0, 1000.0)) == pytest.approx(4838.0 / 278.0)


def render(figures: ModuleType, stock_rates: tuple[float, ...]) -> list[str]:
    rounds = {
        "stock": [a_round(figures, r, 100.0) for r in stock_rates],
        "kvsvc": [kvsvc_round(figures, 0.97 * r, 95.0) for r in stock_rates],
        "kvsvc_frames": [kvsvc_round(figures, 0.9 * r, 120.0) for r in stock_rates],
        "kvsvc_frames_pure": [kvsvc_round(figures, 0.5 * r, 300.0) for r in stock_rates],
    }
    labels = {
        "stock": "stock",
        "kvsvc": "gRPC",
        "kvsvc_frames": "frames",
        "kvsvc_frames_pure": "frames, pure-Python server",
    }
    lines: list[str] = figures.render(rounds, labels)
    return lines


def test_table_marks_the_goals_and_fits_100_columns(figures: ModuleType) -> None:
    lines = render(figures, (1000.0, 1200.0, 1100.0))
    assert max(len(line) for line in lines) <= figures.WIDTH
    tokens = lines.index("output tokens/s (wall clock)")
    cpu = lines.index("scheduler thread CPU per step, us")
    grpc_tokens, frames_tokens = lines[tokens + 2], lines[tokens + 3]
    assert grpc_tokens.split()[0] == "gRPC" and grpc_tokens.endswith(">= 0.90 ok")
    assert frames_tokens.split()[0] == "frames" and frames_tokens.endswith(">= 0.95 MISS")
    assert "0.97 [0.97-0.97]" in grpc_tokens
    assert lines[cpu + 2].endswith("<= 1.00 ok")  # gRPC: 95 vs 100 us
    assert lines[cpu + 3].endswith("<= 1.00 MISS")  # frames: 120 vs 100 us
    # No goal for the pure-Python server's engines; stock has no ratio.
    assert not lines[tokens + 4].endswith(("ok", "MISS"))
    assert lines[tokens + 1].split() == ["stock", "1,100", "[1,000-1,200]"]
    # The kvsvc-only figures have no stock line and no ratio.
    wait = lines.index("  of it waiting on kvsvc, us")
    assert [line.split()[0] for line in lines[wait + 1 : wait + 4]] == ["gRPC", "frames", "frames,"]
    assert lines[wait + 1].split()[1:] == ["40", "[40-40]"]
    assert not any(line.startswith("NOISY") for line in lines)


def test_table_flags_a_noisy_run(figures: ModuleType) -> None:
    lines = render(figures, (278.0, 4838.0, 1000.0))
    assert max(len(line) for line in lines) <= figures.WIDTH
    assert lines[-2].startswith("NOISY: stock's rounds range 17.4x in tokens/s")


def test_the_meter_times_both_methods_and_counts_schedule_calls(figures: ModuleType) -> None:
    calls: list[tuple[str, tuple[Any, ...]]] = []

    class Scheduler:
        def schedule(self, *args: Any) -> str:
            calls.append(("schedule", args))
            return "output"

        def update_from_output(self, *args: Any) -> str:
            calls.append(("update", args))
            return "outputs"

    scheduler = Scheduler()
    meter = figures.SchedulerMeter()
    meter.attach(scheduler)
    for step in range(3):
        assert scheduler.schedule(step) == "output"
        assert scheduler.update_from_output(step, "x") == "outputs"
    assert meter.steps == 3
    assert calls[-2:] == [("schedule", (2,)), ("update", (2, "x"))]
    assert meter.cpu_s >= 0.0
    assert meter.wall_s > 0.0  # six calls' perf_counter deltas, summed


def test_parts_count_only_outside_other_parts(figures: ModuleType) -> None:
    class Replica:
        def await_reply(self) -> None:
            pass

    class Manager:
        def __init__(self, replica: Replica) -> None:
            self.replica = replica

        def allocate_slots(self) -> int:
            self.replica.await_reply()  # a part called from within another part
            return 7

        def _private(self) -> None:
            pass

    replica = Replica()
    manager = Manager(replica)
    meter = figures.SchedulerMeter()
    assert figures.public_methods(manager) == ["allocate_slots"]
    meter.attach_part("manager", manager, figures.public_methods(manager))
    meter.attach_part("steps", replica, ["await_reply"])
    assert manager.allocate_slots() == 7
    assert meter.parts["steps"] == 0.0  # counted in "manager", not twice
    replica.await_reply()
    assert set(meter.parts) == {"manager", "steps"}
    assert not meter._in_part


def test_thread_cpu_split_tells_the_main_thread_from_python_threads(
    figures: ModuleType,
) -> None:
    """CPU spent by the main thread counts as the main thread's; CPU spent by a thread
    Python started counts as neither (it is the sender's kind, measured on its own)."""
    import threading
    import time

    def burn(seconds: float) -> None:
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass

    main_before, native_before = figures.thread_cpu_split()
    burn(0.2)
    main_after, _ = figures.thread_cpu_split()
    assert main_after - main_before >= 0.15
    burned, done = threading.Event(), threading.Event()

    def work() -> None:
        burn(0.3)
        burned.set()
        done.wait(30)  # alive while read: an ended thread is gone from /proc

    worker = threading.Thread(target=work)
    worker.start()
    try:
        assert burned.wait(30)
        main_last, native_last = figures.thread_cpu_split()
    finally:
        done.set()
        worker.join()
    assert main_last - main_after < 0.1  # it waited while the other thread burned
    assert native_last - native_before < 0.1
