"""What the worker supervisor (:mod:`smartredis_io.worker.supervisor`), its worker processes
(:mod:`smartredis_io.worker.executor`) and the Redis module agree on: why a worker exited, the secret
the workers show the module (``SRIO.HELLO``) before they may take requests, where they find it,
which bytes it may hold (the module's C code, ``SRIO_SecretValid``, applies the same rule), and the
messages of the module's control socket (``spawn.c``)."""

from __future__ import annotations

__all__ = ["ENDING", "EXIT_DEADLINE", "EXIT_SERVER_GONE", "EXIT_STOPPED", "SECRET_ENV", "SECRET_MAX_BYTES",
           "SECRET_MIN_BYTES", "START_ERROR", "STOP", "secret_from_line"]

#: a worker's exit status when a run outlived its deadline (its watchdog ended the process)
EXIT_DEADLINE = 3
#: a worker's exit status after a second SIGTERM / SIGINT during a run
EXIT_STOPPED = 4
#: a worker's exit status when the server it served closed its connection (stopped, or gone)
EXIT_SERVER_GONE = 5
#: the environment variable holding the module's worker secret in a worker process (and, for an
#: external worker, in the environment it is started with)
SECRET_ENV = "SRIO_WORKER_SECRET"
#: a secret is this many bytes at least (128 bits) ...
SECRET_MIN_BYTES = 16
#: ... and at most this many, each printable ASCII other than the space (0x21 to 0x7e)
SECRET_MAX_BYTES = 256
#: what is stripped around the secret on its line (the module strips the same)
SECRET_STRIP = b" \t\v\f\r"
#: how a supervisor started by the module (``--secret-stdin``) tells it, on its standard input, why a
#: worker could not start: one message of these bytes followed by the reason
START_ERROR = b"error "
#: the module's message to its supervisor: stop the workers (as at the socket's end: the server is gone)
STOP = b"stop"
#: the supervisor's last message, once its workers and every process it started have ended; it exits
#: when the module closes the socket, and the module, where redis-server is PID 1 (the supervisor is
#: then its child), reaps it at once
ENDING = b"ending"


def secret_from_line(data: bytes, origin: str) -> str:
    """The worker secret on the first line of ``data``, stripped as the module strips it.

    Args:
        data: the bytes read (a file's, standard input's, an environment variable's).
        origin: where they come from, for the error.

    Raises:
        ValueError: the secret is shorter than ``SECRET_MIN_BYTES``, longer than ``SECRET_MAX_BYTES``,
            or holds a byte other than printable ASCII without the space (a non-UTF-8 one included).
    """
    secret = data.partition(b"\n")[0].strip(SECRET_STRIP)
    unprintable = any(b < 0x21 or b > 0x7E for b in secret)
    if unprintable or not SECRET_MIN_BYTES <= len(secret) <= SECRET_MAX_BYTES:
        raise ValueError(
            f"the worker secret ({origin}) must be {SECRET_MIN_BYTES} to {SECRET_MAX_BYTES} bytes of printable ASCII "
            f"without spaces, as the module reads it from its WORKER_SECRET_FILE; it is {len(secret)} bytes"
            + (", not all of them such" if unprintable else ""))
    return secret.decode("ascii")
