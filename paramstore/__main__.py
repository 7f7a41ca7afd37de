"""``python -m paramstore ...``: the ``paramstore`` command line (see paramstore.cli)."""

import sys

from .cli import main

sys.exit(main())
