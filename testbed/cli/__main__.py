"""``python -m testbed.cli``: the ``kvtb`` command."""

import sys

from testbed.cli.kvtb import main

sys.exit(main())
