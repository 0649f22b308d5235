"""``python -m example_services.demo``: see :mod:`example_services.demo`."""

import sys

from example_services.demo import main

sys.exit(main())
