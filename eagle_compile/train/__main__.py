"""``python -m eagle_compile.train``: the ``eagle31 train`` command on its own."""

import sys

from eagle_compile.train.cli import main

sys.exit(main())
