"""``python -m benchmarks.recovery``: goodput under kills and preemptions (:mod:`benchmarks.recovery.goodput`)."""

import sys

from benchmarks.recovery.goodput import main

sys.exit(main())
