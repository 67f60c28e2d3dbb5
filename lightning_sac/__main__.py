"""``python -m lightning_sac``: the same command line as ``lightning-sac``."""

import sys

from lightning_sac.cli import main

sys.exit(main())
