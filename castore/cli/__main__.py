"""``python -m castore.cli``: the ``castore`` command, as the console script runs it."""

import sys

from castore.cli import main

sys.exit(main())
