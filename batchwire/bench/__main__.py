"""``python -m batchwire.bench``: the same as ``batchwire bench``."""

import sys

from batchwire.bench.cli import main

sys.exit(main())
