"""Subcommands of the ``kvsvc`` CLI, one module each.

Every module defines ``add_parser(subparsers)`` which registers its arguments and sets
``func`` to a ``run(args) -> int``. Modules keep heavy imports (grpc, torch) inside ``run``
so that ``kvsvc --help`` and ``kvsvc plan`` start fast.
"""
