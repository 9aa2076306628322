"""What the worker supervisor (:mod:`smartredis_io.worker.supervisor`) and its worker processes
(:mod:`smartredis_io.worker.executor`) agree on: why a worker exited, and where it finds the secret it
shows the Redis module (``SRIO.HELLO``) before it may take requests."""

from __future__ import annotations

__all__ = ["EXIT_DEADLINE", "EXIT_STOPPED", "SECRET_ENV"]

#: a worker's exit status when a run outlived its deadline (its watchdog ended the process)
EXIT_DEADLINE = 3
#: a worker's exit status after a second SIGTERM / SIGINT during a run
EXIT_STOPPED = 4
#: the environment variable holding the module's worker secret in a worker process (and, for an
#: external worker, in the environment it is started with)
SECRET_ENV = "SRIO_WORKER_SECRET"
