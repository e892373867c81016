"""``python -m pydflash.server``: the same as ``pydflash serve``."""

import sys

from .app import main

sys.exit(main())
