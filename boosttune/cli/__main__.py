"""``python -m boosttune.cli``: the same as the `boosttune` command."""

import sys

from boosttune.cli import main

sys.exit(main())
