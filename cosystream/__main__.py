"""``python -m cosystream``: the ``cosystream`` command."""

import sys

from cosystream.app.cli import main

sys.exit(main())
