"""``python -m testbed``: the ``testbed`` command, for an environment whose scripts are not on
PATH."""

import sys

from testbed.cli import main

sys.exit(main())
