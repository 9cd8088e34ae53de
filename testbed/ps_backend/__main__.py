"""``python -m testbed.ps_backend``: the PS process (see testbed.ps_backend.main)."""

import sys

from testbed.ps_backend.main import main

sys.exit(main())
