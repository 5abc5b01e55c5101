"""Errors of the worker agent.

Bad local input (a flag, a layout name, a memory budget) raises
:class:`kvsvc.errors.InvalidArgument` naming the field, like the rest of kvsvc. The two
classes here cover what only a worker meets: a plan it cannot lay out in memory, and a
server that refuses it for good.
"""

from __future__ import annotations

from kvsvc.errors import KvsvcError


class AllocationError(KvsvcError, ValueError):
    """A plan this worker cannot turn into tensors (sizes or layouts that do not fit).

    A plan comes from the server; when its byte counts disagree with the worker's own page
    arithmetic, allocating anyway would hand the engine views that overlap or run past
    their tensor. The message names the layer, the tensor and the numbers that disagree.
    """


class WorkerAgentError(KvsvcError):
    """The agent stopped for good: its memory budget does not fit, the server rejected it,
    planning failed, or it timed out.

    Attributes:
        code: the gRPC status code name that ended the agent (``"INVALID_ARGUMENT"``,
            ``"NOT_FOUND"``, ...), or a local reason: ``"MEMORY"`` (the budget does not
            fit), ``"DEVICE"`` (CUDA asked for and missing), ``"PLAN_FAILED"``,
            ``"ALLOCATION"``, ``"TIMEOUT"``, ``"UNREACHABLE"``, ``"REPLANNED"``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
