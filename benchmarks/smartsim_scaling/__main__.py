import sys

from benchmarks.smartsim_scaling.cli import main

sys.exit(main())
