"""``python -m smartredis_io.redis_module``: print the path of the smartredis_io Redis module.

The command's documented name; the locator is :mod:`smartredis_io.launchers.redis_module`.
"""

import sys

from smartredis_io.launchers.redis_module import main

if __name__ == "__main__":
    sys.exit(main())
