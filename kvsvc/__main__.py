import sys

from kvsvc.cli import main

sys.exit(main())
