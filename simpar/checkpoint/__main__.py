"""``python -m simpar.checkpoint``: see :mod:`simpar.checkpoint.cli`."""

import sys

from simpar.checkpoint.cli import main

sys.exit(main())
