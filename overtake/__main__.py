"""``python -m overtake`` is the ``overtake`` command."""

import sys

from overtake.api.cli import program

sys.exit(program())
