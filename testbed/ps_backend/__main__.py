"""``python -m testbed.ps_backend``: the PS process (see testbed.ps_backend.main)."""

import sys

from testbed.ps_backend.main import main

if __name__ == "__main__":  # not again in a process it spawns (its planning processes)
    sys.exit(main())
