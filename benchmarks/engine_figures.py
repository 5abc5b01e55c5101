"""The figures ``vllm_bench.py`` reads per engine and round, and the table it prints.

Wall-clock tokens/s on a shared two-core machine swings by an order of magnitude between
rounds, so next to it come figures noise touches less: the scheduler's own thread CPU
time per step (``time.thread_time`` around ``schedule()`` and ``update_from_output()``:
another process on the machine delays the thread but does not add to its CPU time), the
wall time it waited on kvsvc's replies, the CPU time of kvsvc's Step sender thread, and
CPU time per output token of the engine process (and of the kvsvc server process, which
stock vLLM does not have).

Every figure is kept per round; the table prints the median with the min-max over rounds,
and for each kvsvc engine the per-round ratio to stock's run in the same round (the
rounds rotate the engines, so the two ran a few seconds apart), median and min-max. A run
whose stock rounds' tokens/s differ by more than :data:`NOISY_SPREAD` is flagged NOISY:
its wall-clock figures say little, its CPU figures still do.

Nothing here imports vLLM: the arithmetic and the table are tested without it
(tests/test_engine_figures.py).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

# Stock's rounds may differ this much (max / min tokens/s) before a run is flagged NOISY.
NOISY_SPREAD = 2.0

# The table's width: it must read in a 100-column terminal.
WIDTH = 100


@dataclass
class SchedulerMeter:
    """One engine's scheduler: thread CPU and wall time of its steps, accumulated, and the
    thread CPU of named parts within them.

    :meth:`attach` replaces the scheduler instance's bound ``schedule`` and
    ``update_from_output`` (the engine core calls them through ``self.scheduler``), so
    stock vLLM and kvsvc's scheduler subclass are timed at the same place. :meth:`attach_part`
    does the same for methods called within a step (the KV cache manager's; kvsvc's Step
    sending and awaiting): a part's CPU counts in :attr:`parts` when no other part's
    method is running, so parts never overlap and their sum is within :attr:`cpu_s`.
    """

    steps: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    _in_part: bool = False

    def attach(self, scheduler: Any) -> None:
        """Time ``scheduler``'s two per-step methods from now on."""
        for name in ("schedule", "update_from_output"):
            setattr(scheduler, name, self._timed(getattr(scheduler, name), name == "schedule"))

    def attach_part(self, part: str, target: Any, methods: Sequence[str]) -> None:
        """Count the thread CPU of ``target``'s ``methods`` as ``part`` from now on."""
        self.parts.setdefault(part, 0.0)
        for name in methods:
            setattr(target, name, self._part(part, getattr(target, name)))

    def _timed(self, method: Callable[..., Any], counts_step: bool) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.cpu_s += time.thread_time() - cpu
                self.wall_s += time.perf_counter() - wall
                if counts_step:
                    self.steps += 1

        return timed

    def _part(self, part: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._in_part:  # called from within a part: the outer one counts it
                return method(*args, **kwargs)
            self._in_part = True
            cpu = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.parts[part] += time.thread_time() - cpu
                self._in_part = False

        return timed


def public_methods(target: Any) -> list[str]:
    """The names of the methods ``target``'s class defines or inherits, but ``_private``."""
    cls = type(target)
    return [
        name
        for name in dir(cls)
        if not name.startswith("_") and inspect.isfunction(getattr(cls, name, None))
    ]


@dataclass(frozen=True)
class Reading:
    """Cumulative counters of one engine at one moment (seconds; steps)."""

    steps: int
    scheduler_cpu_s: float
    scheduler_wall_s: float
    process_cpu_s: float
    manager_cpu_s: float = 0.0  # the scheduler thread's, in the KV cache manager's methods
    wait_s: float | None = None  # kvsvc engines only, from here on
    steps_cpu_s: float | None = None  # the scheduler thread's, sending and awaiting Steps
    sender_cpu_s: float | None = None
    server_cpu_s: float | None = None
    # Of process_cpu_s: the main thread's (vLLM's engine loop: scheduling and the forward
    # pass) and that of the threads Python did not start (torch's OpenMP pool above all).
    main_thread_cpu_s: float = 0.0
    native_threads_cpu_s: float = 0.0


@dataclass(frozen=True)
class RoundFigures:
    """One engine's round: rates per step and per output token (None: not on stock)."""

    tokens_per_s: float
    scheduler_cpu_us: float  # per step
    manager_cpu_us: float  # per step, within scheduler_cpu_us
    vllm_cpu_us: float  # per step: scheduler_cpu_us less the manager and the Steps
    scheduler_wall_us: float  # per step
    process_cpu_us: float  # per output token
    total_cpu_us: float  # per output token, the server's included
    steps_cpu_us: float | None = None  # per step, within scheduler_cpu_us
    wait_us: float | None = None  # per step
    sender_cpu_us: float | None = None  # per step
    server_cpu_us: float | None = None  # per output token
    main_thread_cpu_us: float = 0.0  # per output token, within process_cpu_us
    native_threads_cpu_us: float = 0.0  # per output token, within process_cpu_us


def round_figures(before: Reading, after: Reading, tokens: int, elapsed_s: float) -> RoundFigures:
    """The figures of the round between two readings that produced ``tokens`` tokens."""
    steps = max(after.steps - before.steps, 1)
    per_token = 1e6 / max(tokens, 1)

    def per_step_us(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else 1e6 * (b - a) / steps

    process = (after.process_cpu_s - before.process_cpu_s) * per_token
    server = (
        None
        if before.server_cpu_s is None or after.server_cpu_s is None
        else (after.server_cpu_s - before.server_cpu_s) * per_token
    )
    scheduler = 1e6 * (after.scheduler_cpu_s - before.scheduler_cpu_s) / steps
    manager = 1e6 * (after.manager_cpu_s - before.manager_cpu_s) / steps
    steps_cpu = per_step_us(before.steps_cpu_s, after.steps_cpu_s)
    return RoundFigures(
        tokens_per_s=tokens / elapsed_s,
        scheduler_cpu_us=scheduler,
        manager_cpu_us=manager,
        vllm_cpu_us=scheduler - manager - (steps_cpu or 0.0),
        steps_cpu_us=steps_cpu,
        scheduler_wall_us=1e6 * (after.scheduler_wall_s - before.scheduler_wall_s) / steps,
        process_cpu_us=process,
        total_cpu_us=process + (server or 0.0),
        wait_us=per_step_us(before.wait_s, after.wait_s),
        sender_cpu_us=per_step_us(before.sender_cpu_s, after.sender_cpu_s),
        server_cpu_us=server,
        main_thread_cpu_us=(after.main_thread_cpu_s - before.main_thread_cpu_s) * per_token,
        native_threads_cpu_us=(after.native_threads_cpu_s - before.native_threads_cpu_s)
        * per_token,
    )


@dataclass(frozen=True)
class Spread:
    """Median and range of a figure over rounds."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def format(self, fmt: str) -> str:
        return f"{self.median:{fmt}} [{self.low:{fmt}}-{self.high:{fmt}}]"


def per_round_ratios(
    engine: Sequence[RoundFigures], stock: Sequence[RoundFigures], key: str
) -> list[float]:
    """``key`` of each of an engine's rounds over stock's in the same round."""
    ratios = []
    for ours, theirs in zip(engine, stock, strict=True):
        value, base = getattr(ours, key), getattr(theirs, key)
        ratios.append(value / base if base else float("nan"))
    return ratios


def noisy(stock: Sequence[RoundFigures]) -> float | None:
    """Stock's max/min tokens/s over rounds when above :data:`NOISY_SPREAD`, else None."""
    rates = [r.tokens_per_s for r in stock]
    spread = max(rates) / min(rates)
    return spread if spread > NOISY_SPREAD else None


@dataclass(frozen=True)
class Figure:
    """A row group of the table: one figure, one line per engine that has it."""

    key: str  # a RoundFigures field
    label: str
    fmt: str
    # The goal on the median per-round ratio to stock, per engine label ("gRPC", "frames"):
    # (">=" or "<=", bound).
    goals: dict[str, tuple[str, float]]
    ratio: bool = True  # whether a ratio to stock is printed (stock has the figure)


FIGURES = (
    Figure(
        "tokens_per_s",
        "output tokens/s (wall clock)",
        ",.0f",
        {
            "gRPC": (">=", 0.90),
            "frames": (">=", 0.95),
            "gRPC, steps held": (">=", 0.90),
            "frames, steps held": (">=", 0.95),
        },
    ),
    Figure(
        "scheduler_cpu_us",
        "scheduler thread CPU per step, us",
        ",.0f",
        {
            "gRPC": ("<=", 1.0),
            "frames": ("<=", 1.0),
            "gRPC, steps held": ("<=", 1.0),
            "frames, steps held": ("<=", 1.0),
        },
    ),
    Figure("manager_cpu_us", "  of it in the KV cache manager, us", ",.0f", {}),
    Figure("steps_cpu_us", "  of it sending, awaiting Steps, us", ",.0f", {}, ratio=False),
    Figure("vllm_cpu_us", "  the rest: vLLM's scheduler, us", ",.0f", {}),
    Figure("scheduler_wall_us", "scheduler wall time per step, us", ",.0f", {}),
    Figure("wait_us", "  of it waiting on kvsvc, us", ",.0f", {}, ratio=False),
    Figure("sender_cpu_us", "kvsvc Step sender thread CPU/step, us", ",.0f", {}, ratio=False),
    Figure("process_cpu_us", "engine process CPU per output token, us", ",.0f", {}),
    Figure("main_thread_cpu_us", "  of it the main thread (forward pass too), us", ",.0f", {}),
    Figure("native_threads_cpu_us", "  of it threads not Python's (torch's), us", ",.0f", {}),
    Figure("server_cpu_us", "kvsvc server CPU per output token, us", ",.0f", {}, ratio=False),
    Figure("total_cpu_us", "engine + server CPU per output token, us", ",.0f", {}),
)

assert {f.key for f in FIGURES} == {f.name for f in fields(RoundFigures)}


def goal_met(ratio: float, goal: tuple[str, float]) -> bool:
    """Whether a median ratio meets ``(">=" or "<=", bound)``."""
    op, bound = goal
    return ratio >= bound if op == ">=" else ratio <= bound


def render(
    rounds: dict[str, list[RoundFigures]], labels: dict[str, str], stock: str = "stock"
) -> list[str]:
    """The table's lines: per figure, a line per engine with median [min-max] over rounds
    and, for an engine other than stock, its per-round ratio to stock (median [min-max])
    and the goal on it, if any (``ok`` or ``MISS``)."""
    lines = [
        "median [min-max] over rounds; vs stock: each round's ratio to stock's in that round",
        f"{'figure / engine':<30} {'median [min-max]':<24} {'vs stock [min-max]':<18} goal",
    ]
    for figure in FIGURES:
        lines.append(figure.label)
        for name, figures in rounds.items():
            values = [getattr(r, figure.key) for r in figures]
            if any(v is None for v in values):
                continue
            label = labels.get(name, name)
            line = f"  {label:<28} {Spread.of(values).format(figure.fmt):<24}"
            if name != stock and figure.ratio:
                ratios = Spread.of(per_round_ratios(figures, rounds[stock], figure.key))
                line += f" {ratios.format('.2f'):<18}"
                goal = figure.goals.get(label)
                if goal is not None:
                    mark = "ok" if goal_met(ratios.median, goal) else "MISS"
                    line += f" {goal[0]} {goal[1]:.2f} {mark}"
            lines.append(line.rstrip())
    spread = noisy(rounds[stock])
    if spread is not None:
        lines.append(
            f"NOISY: stock's rounds range {spread:.1f}x in tokens/s (> {NOISY_SPREAD:g}x): "
            "the machine is shared;"
        )
        lines.append("  read the CPU figures, not the wall-clock ones")
    return lines


def _thread_cpu_ns(pid: int) -> Iterator[tuple[int, int]]:
    """(thread id, CPU nanoseconds) of each thread of process ``pid``, from Linux
    ``schedstat`` (``/proc/PID/stat`` counts 10 ms ticks, too coarse for a round's share);
    a thread that ends meanwhile is left out."""
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError):
            yield int(stat.parent.name), int(stat.read_text().split()[0])


def thread_cpu_split() -> tuple[float, float]:
    """CPU seconds of this process's main thread, and of its threads that Python did not
    start (torch's OpenMP pool, gRPC's and gloo's pollers).

    On a machine whose cores all run the forward pass, a thread or process beside it
    (kvsvc's sender, its server) pre-empts one of torch's threads and the others wait for
    it at the next barrier, spinning: that shows in these two, not in the scheduler's.
    """
    python_threads = {thread.native_id for thread in threading.enumerate()}
    main = threading.main_thread().native_id
    main_ns = native_ns = 0
    for tid, ns in _thread_cpu_ns(os.getpid()):
        if tid == main:
            main_ns += ns
        elif tid not in python_threads:
            native_ns += ns
    return main_ns / 1e9, native_ns / 1e9


def process_cpu_s(pid: int) -> float:
    """CPU time of every thread of process ``pid``."""
    return sum(ns for _, ns in _thread_cpu_ns(pid)) / 1e9
