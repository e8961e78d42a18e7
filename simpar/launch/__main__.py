"""``python -m simpar.launch``: simrun, and on every rank its wrapper (see :mod:`simpar.launch`)."""

import sys

from simpar.launch.cli import main

sys.exit(main())
