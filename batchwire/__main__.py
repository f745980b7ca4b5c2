"""``python -m batchwire``: the ``batchwire`` command, where the environment's scripts folder is not on PATH."""

import sys

from batchwire.cli import main

sys.exit(main())
