import sys


def _run() -> int:
    try:
        from kvsvc.cli import main

        return main()
    except KeyboardInterrupt:
        # Ctrl-C before the command handles it (while importing, say torch): one line.
        print("kvsvc: interrupted", file=sys.stderr)
        return 130


sys.exit(_run())
