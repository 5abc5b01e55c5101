"""Pool state on disk: a journal of the calls that changed a pool, and snapshots of it.

Layout of a state directory (``kvsvc serve --state-dir DIR``, ``state_dir`` in the config)::

    DIR/<pool>.db                   the pool's journal database (SQLite, WAL mode)
    DIR/<pool>.db-wal, -shm         SQLite's write-ahead log and its index
    DIR/<pool>.snapshot-<N>.db      the pool's current snapshot (SQLite), generation N

Every file is created with mode 0600 (the hash seed of an ``xxh3_128`` pool is a secret)
and the directory with 0700.

The journal database holds the pool's identity (what the state was made for: the pool's
planning settings, each rank's registration, the hash algorithm and seed, the event
epoch), the ranks' tensor identities, and one row per call that changed the pool, in the
order they were applied: the request as it came over the wire (so replay runs the very
code that served it), the engine whose namespace it ran in, the number and time of the
event batch it produced and a digest of its reply. A snapshot database holds the whole
core state at one journal position (:meth:`kvsvc.core.PoolKVCache.to_state`, encoded by
:mod:`kvsvc.core.state`), with a checksum, plus the server's own per-pool state (the
replies of recent calls, kept so a retried call answers what the lost reply said).

Durability: a change is committed to the journal before its reply leaves the server.
Calls that arrive together share one transaction (group commit). With the default
``state_synchronous = "normal"`` a commit writes the WAL without waiting for the disk, so a
killed or crashed process loses nothing it acknowledged; a power loss or kernel crash can
lose the acknowledged changes since the last checkpoint, which a background thread runs
every ``checkpoint_interval_s`` (1 s) and which syncs the WAL to disk. ``"full"`` syncs
every commit (in a thread, grouping the calls that arrive meanwhile): nothing
acknowledged is lost even on power loss, at the price of one disk sync per group.

Restart: the snapshot is loaded, the journal rows after it are replayed through the same
code that first applied them, and each replayed reply must equal the one acknowledged
(its digest): a replay that diverges refuses to start rather than serve another state.
Snapshots are written in a thread from a copy taken between calls; a new one replaces the
old (written and synced first, then pointed to, then the old one deleted) and the journal
rows it covers are dropped.

The schema of both kinds of file, its versions and migrations: :mod:`.schema`.

Modules, from the bottom::

    records        the plain records (journal rows, ranks, snapshots) and StateError
    durability     a full disk told apart from a damaged file; the acknowledged position
    wal            a damaged write-ahead log told apart from one that simply ends
    schema         the SQLite format both files share: tables, versions, migrations
    snapshot_file  writing and reading a snapshot file
    journal_store  PoolStore: one pool's journal database
    writer         PoolPersistence: group commit, checkpoints and snapshots of one pool
    dirlock        one server per state directory

Above this package, beside the pool they serve (they need its calls, registrations and
planning, which in turn journal through this package): :mod:`kvsvc.server.pool_identity`
(what a saved state was made for) and :mod:`kvsvc.server.pool_replay` (a saved state
loaded and its journal replayed, for a pool to take over).
"""
