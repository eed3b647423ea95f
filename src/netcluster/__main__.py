"""``python -m netcluster run ... -- script.py args`` / ``python -m netcluster cleanup``."""

import sys

from .cluster import main

sys.exit(main())
