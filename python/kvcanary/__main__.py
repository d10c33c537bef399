"""python -m kvcanary: the command-line front door (see kvcanary.cli)."""

import sys

from kvcanary.cli import main

sys.exit(main())
