"""``python -m waterwave``: the command line (waterwave.tools.cli)."""
import sys

from .tools.cli import main

sys.exit(main())
