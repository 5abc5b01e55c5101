"""Loading every pool's saved state when the server starts (``--state-dir``, ``--restore``).

For each configured pool: with a state in the state directory, load its snapshot, replay
its journal and go on persisting there; with a ``--restore FILE`` for it, load that
snapshot and (with a state directory) make it the pool's new state there; else start
empty. Every pool's state is loaded and checked before the server serves anything: one
that cannot be used stops the start (:class:`StateError`, ``kvsvc serve`` exits 1).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsvc.server.config import ServerConfig
from kvsvc.server.persistence.dirlock import StateDirLock
from kvsvc.server.persistence.durability import AckedMarker
from kvsvc.server.persistence.journal_store import PoolStore
from kvsvc.server.persistence.records import Snapshot, StateError, new_store_id
from kvsvc.server.persistence.snapshot_file import (
    read_snapshot,
    read_snapshot_identity,
    snapshot_name,
)
from kvsvc.server.persistence.writer import StateSettings
from kvsvc.server.pool import Pool
from kvsvc.server.pool_identity import check_made_for, pool_settings

log = logging.getLogger("kvsvc.server")


def prepare_state_dir(path: Path) -> None:
    """Create the directory (mode 0700) or check an existing one is a writable directory.

    Raises:
        StateError: it cannot be used.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        raise StateError(f"state_dir {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise StateError(f"state_dir {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise StateError(f"state_dir {path} is not writable by this user")
    if info.st_mode & 0o077:
        log.warning(
            "state_dir %s is readable by others (mode %o): it holds the pools' hash seeds; "
            "chmod 700 it",
            path,
            stat.S_IMODE(info.st_mode),
        )


def _remove_leftovers(directory: Path, store: PoolStore) -> None:
    """Snapshots of other generations and half-written files a crash left behind."""
    current = snapshot_name(store.pool, store.snapshot_generation)
    for path in directory.glob(f"{store.pool}.snapshot-*.db*"):
        if path.name != current:
            path.unlink(missing_ok=True)
    for path in directory.glob(f"{store.pool}.db.tmp*"):
        path.unlink(missing_ok=True)


def lock_state_dir(config: ServerConfig) -> StateDirLock | None:
    """Prepare the state directory and lock it for this server (None: no state_dir).

    Raises:
        StateError: it cannot be used, or another server holds it.
    """
    if not config.state_dir:
        return None
    directory = Path(config.state_dir)
    prepare_state_dir(directory)
    try:
        return StateDirLock.acquire(directory, config.listen)
    except OSError as exc:
        raise StateError(f"state_dir {directory}: cannot lock it: {exc.strerror}") from None


def _behind_acknowledged(directory: Path, snapshot: Snapshot) -> bool:
    """Whether ``directory`` remembers its lineage acknowledging more than ``snapshot``."""
    pool, store_id = snapshot.identity.get("pool"), snapshot.identity.get("store_id")
    if not isinstance(pool, str) or not isinstance(store_id, str):
        return False
    acknowledged = AckedMarker(PoolStore.path_for(directory, pool), store_id).read()
    return acknowledged is not None and acknowledged > snapshot.journal_seq


def _refuse_orphan_snapshots(directory: Path | None, pool: str) -> None:
    """A pool without a journal but with snapshots: the journal was lost (deleted, or the
    directory copied in part). Starting empty would drop the state without a word.

    Raises:
        StateError: naming the files and the ways on.
    """
    if directory is None:
        return
    snapshots = sorted(p.name for p in directory.glob(f"{pool}.snapshot-*.db"))
    if snapshots:
        raise StateError(
            f"state_dir {directory}: pool {pool!r} has no journal ({pool}.db) but its "
            f"snapshot {', '.join(snapshots)} remains: the journal was removed, and with it "
            "the calls acknowledged after that snapshot. Put the journal back; or, to start "
            f"from the snapshot, move it out of the state directory and start with --restore "
            "FILE (the calls after it are lost: a new event epoch, and engines must free "
            f"and readmit their requests); or move {pool}.snapshot-*.db away to start the "
            "pool empty"
        )


def restore_settings(restore: Sequence[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Per pool, the ``--restore`` file that holds it and the pool settings it was made
    with: ``kvsvc serve --restore FILE`` configures a pool the flags and config file do not
    from these, and takes those a configured pool leaves unset from them.

    Raises:
        StateError: a file that cannot be read, or two files of one pool.
    """
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for name in restore:
        try:
            identity = read_snapshot_identity(Path(name))
        except StateError as exc:
            raise StateError(f"--restore {name}: {exc}") from None
        pool = identity.get("pool")
        if not isinstance(pool, str):
            raise StateError(f"--restore {name}: the file names no pool; it is damaged")
        if pool in found:
            raise StateError(f"--restore {name} and {found[pool][0]} are both pool {pool!r}")
        found[pool] = (name, pool_settings(identity))
    return found


# What a refusal of a restore file's settings tells the user (the file is the state; there
# is nothing in a state directory to move away).
RESTORE_SETTINGS_REMEDY = (
    "leave these settings out (kvsvc serve --restore takes the pool's settings from the "
    "snapshot) or give the snapshot's values"
)


def state_dir_remedy(directory: Path, pool: str) -> str:
    """What a refusal of a state directory's settings tells the user: the files to move."""
    return (
        f"give the pool the settings it was planned with, or move "
        f"{PoolStore.path_for(directory, pool)} (and {pool}.snapshot-*.db beside it) out of "
        "the state directory to plan it afresh (its live requests and cached blocks are lost)"
    )


def load_states(
    pools: dict[str, Pool], config: ServerConfig, restore: Sequence[str] = ()
) -> list[str]:
    """Configure every pool's persistence and load its saved state (see the module); the
    directory is prepared and locked already (:func:`lock_state_dir`).

    Returns:
        One line per pool that was restored, for the log.

    Raises:
        StateError: a state or a restore file that cannot be used.
    """
    directory = Path(config.state_dir) if config.state_dir else None
    files: dict[str, tuple[str, Snapshot]] = {}
    for name in restore:
        snapshot = read_snapshot(Path(name))
        pool = snapshot.identity.get("pool")
        if pool not in pools:
            raise StateError(
                f"--restore {name}: the file holds pool {pool!r}, which is not configured "
                f"(pools: {', '.join(sorted(pools))})"
            )
        if pool in files:
            raise StateError(f"--restore {name} and {files[pool][0]} are both pool {pool!r}")
        files[pool] = (name, snapshot)
    lines = []
    for name, pool in pools.items():
        if directory is not None:
            pool.configure_state(
                StateSettings(
                    directory,
                    synchronous=config.state_synchronous,
                    snapshot_every=config.state_snapshot_every,
                    snapshot_min_interval_s=config.state_snapshot_min_interval_s,
                    checkpoint_interval_s=config.state_checkpoint_interval_s,
                )
            )
        started = time.perf_counter()
        store = (
            PoolStore.open(directory, name, synchronous=config.state_synchronous)
            if directory is not None
            else None
        )
        if name in files:
            source, snapshot = files[name]
            check_made_for(
                snapshot.identity,
                pool.config,
                f"--restore {source} (pool {name!r})",
                RESTORE_SETTINGS_REMEDY,
            )
            if store is not None:
                store.close()
                raise StateError(
                    f"--restore {source}: {store.path} holds a state "
                    f"of pool {name!r} already; move it away to restore over it"
                )
            # Same epoch (the state goes on), a new store: its journal starts afresh. But a
            # snapshot older than what its own lineage acknowledged here (its journal lost,
            # the snapshot restored by hand) gets a new epoch: its sequence numbers from
            # there on were handed out already.
            epoch = snapshot.identity.get("epoch")
            if directory is not None and _behind_acknowledged(directory, snapshot):
                log.warning(
                    "pool %s: --restore %s is older than the state last acknowledged in %s: "
                    "a new event epoch",
                    name,
                    source,
                    directory,
                )
                epoch = uuid.uuid4().hex
            identity = {**snapshot.identity, "store_id": new_store_id(), "epoch": epoch}
            snapshot = dataclasses.replace(snapshot, identity=identity, generation=1)
            replayed = pool.restore(snapshot)
            if directory is not None:
                try:
                    store = PoolStore.create(
                        directory, identity, snapshot, synchronous=config.state_synchronous
                    )
                except OSError as exc:
                    raise StateError(f"state_dir {directory}: {exc}") from None
                pool.attach_store(store)
            how = f"from {source}"
        elif store is not None:
            try:
                assert directory is not None
                check_made_for(
                    store.identity,
                    pool.config,
                    f"the saved state of pool {name!r} in {directory}",
                    state_dir_remedy(directory, name),
                )
                snapshot = store.load_snapshot()
                earlier = store.check_acknowledged()
                if earlier is not None:
                    log.warning(
                        "pool %s: its state in %s may be earlier than the one acknowledged: "
                        "%s. Serving it under a new event epoch, so subscribers and indexers "
                        "resynchronise instead of reading sequence numbers again; engines may "
                        "hold blocks it forgot",
                        name,
                        directory,
                        earlier,
                    )
                    store.renew_epoch(uuid.uuid4().hex)
                # The journal's epoch: a renewed one is newer than the snapshot's.
                snapshot = dataclasses.replace(
                    snapshot, identity={**snapshot.identity, "epoch": store.identity["epoch"]}
                )
                replayed = pool.restore(
                    snapshot, store.journal(snapshot.journal_seq), store.ranks(), store
                )
            except BaseException:
                store.close()
                raise
            _remove_leftovers(store.directory, store)
            how = f"from {directory}"
        else:
            _refuse_orphan_snapshots(directory, name)
            continue
        assert pool.cache is not None
        usage = pool.cache.usage()
        lines.append(
            f"pool {name}: state restored {how} in {time.perf_counter() - started:.2f} s "
            f"({usage.num_requests} live requests, {usage.num_cached_blocks} cached blocks, "
            f"{replayed} journal rows replayed, event sequence {pool.events.last_sequence}); "
            "waiting for its ranks"
        )
    if directory is not None:
        for path in sorted(directory.glob("*.db")):
            if ".snapshot-" not in path.name and path.stem not in pools:
                log.warning(
                    "state_dir %s holds %s, the state of a pool that is not configured: "
                    "left as it is",
                    directory,
                    path.name,
                )
    return lines
