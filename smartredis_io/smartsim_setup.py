"""``python -m smartredis_io.smartsim_setup DIR``: lay out SmartSim's dependencies with the smartredis_io module.

The command's documented name; the code is :mod:`smartredis_io.launchers.smartsim_setup`.
"""

import sys

from smartredis_io.launchers.smartsim_setup import main

if __name__ == "__main__":
    sys.exit(main())
