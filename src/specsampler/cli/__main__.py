"""``python -m specsampler.cli``: the same as the ``specsampler`` command."""

import sys

from . import main

sys.exit(main())
