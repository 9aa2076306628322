"""``python -m smartredis_io.worker``: the execution workers' supervisor (:mod:`smartredis_io.worker.supervisor`)."""

from smartredis_io.worker.supervisor import _exit, main

if __name__ == "__main__":
    _exit(main())
