"""A server whose state directory's disk fills up, run inside a mount namespace with a small
tmpfs as that disk (``test_state_store.py`` starts it with ``unshare``; the namespace and
its tmpfs go when this process ends).

Usage: ``python -m tests.server.disk_full_scenario MOUNTPOINT``. Prints one JSON object:
what a change answered once the disk was full (``running``), and what the first change
after a restart on the full disk answered (``restart``: a start that was refused says
why instead).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvsvc_client import KVCacheClient, KVCacheError

from kvsvc.server.persistence.records import StateError
from tests.server.harness import bring_up
from tests.server.test_restart import MEMORY, QUICK, crash, rejoin, server_on


def fill(path: Path) -> None:
    """Write zeros to ``path`` until the disk says no."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    finally:
        os.close(fd)


def main(mountpoint: Path) -> dict[str, str]:
    state_dir = mountpoint / "state"
    outcome = {"running": "", "restart": ""}
    with server_on(state_dir) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            assert kv.allocate("kept", [1] * 30, 30, start=True).ok
            fill(mountpoint / "filler")
            try:
                for i in range(200):  # the WAL's last page may still have room for a few
                    kv.allocate(f"r{i}", [2 + i] * 100, 100, start=True)
            except KVCacheError as exc:
                outcome["running"] = str(exc)
        for rank in ranks:
            rank.close()
        crash(srv)
    try:
        with server_on(state_dir) as srv:
            rejoin(srv, "A-0")  # the same tensors: the state is served on
            with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
                kv.allocate("after", [3] * 30, 30, start=True)
                outcome["restart"] = "served"
    except (StateError, KVCacheError) as exc:
        outcome["restart"] = str(exc)
    return outcome


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))), flush=True)
