"""``python -m wspool``: the same as the ``wspool`` command."""

import sys

from wspool.cli import main

sys.exit(main())
