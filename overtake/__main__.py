"""``python -m overtake`` is the ``overtake`` command."""

import sys

from overtake.api.cli import main

sys.exit(main())
