"""``python -m graphspec`` is the ``graphspec`` command."""

import sys

from graphspec.cli import main

sys.exit(main())
