"""``python -m qbits.cli``: the ``qbits`` command."""

import sys

from qbits.cli import main

sys.exit(main())
