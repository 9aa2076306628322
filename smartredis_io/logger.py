"""SmartRedis' logging API (``log_data``, ``log_warning``, ``log_error`` and the ``LL*`` levels) on
Python's :mod:`logging`.

SmartRedis writes its log lines itself (to ``SR_LOG_FILE`` or stdout) when the message's level is at
most ``SR_LOG_LEVEL``. Here the same gate decides whether a message is logged, and the record goes to
the ``smartredis_io.log`` logger, where the application's handlers decide where it ends up (a library
never prints). Records carry the SmartRedis context and level as ``sr_context`` and ``sr_level``.

=================  =====================================================
``SR_LOG_LEVEL``   messages logged (``quiet``, ``info`` (default), ``debug``, ``developer``)
``SR_LOG_FILE``    not read: attach a :class:`logging.FileHandler` to ``smartredis_io.log``
=================  =====================================================
"""

from __future__ import annotations

import enum
import logging
import os

from smartredis_io._client.helpers import typecheck
from smartredis_io.error import RedisRuntimeError

__all__ = [
    "LLDebug",
    "LLDeveloper",
    "LLInfo",
    "LLQuiet",
    "LOGGER_NAME",
    "SRLoggingLevel",
    "log_data",
    "log_error",
    "log_warning",
]

LOGGER_NAME = "smartredis_io.log"
LEVEL_ENV_VAR = "SR_LOG_LEVEL"
#: Python level of ``log_data`` at ``LLDeveloper`` (below ``logging.DEBUG``, as SmartRedis' is below debug)
DEVELOPER = 5

_log = logging.getLogger(LOGGER_NAME)


class SRLoggingLevel(enum.IntEnum):
    """SmartRedis' logging levels: a message is logged when its level is at most ``SR_LOG_LEVEL``."""

    LLQuiet = 1  # no logging at all (as SR_LOG_LEVEL); messages at this level are always logged
    LLInfo = 2  # informational logging only
    LLDebug = 3  # verbose logging for debugging purposes
    LLDeveloper = 4  # extra verbose logging for internal use


LLQuiet = SRLoggingLevel.LLQuiet
LLInfo = SRLoggingLevel.LLInfo
LLDebug = SRLoggingLevel.LLDebug
LLDeveloper = SRLoggingLevel.LLDeveloper

_CONFIGURED = {"quiet": LLQuiet, "info": LLInfo, "debug": LLDebug, "developer": LLDeveloper}
_DATA_LEVELS = {LLQuiet: logging.INFO, LLInfo: logging.INFO, LLDebug: logging.DEBUG, LLDeveloper: DEVELOPER}


def configured_level() -> SRLoggingLevel:
    """The level set by ``SR_LOG_LEVEL`` (``LLInfo`` when unset).

    :raises RedisRuntimeError: if the variable holds something else than quiet, info, debug or developer
    """
    value = os.environ.get(LEVEL_ENV_VAR, "")
    if not value:
        return LLInfo
    try:
        return _CONFIGURED[value.lower()]
    except KeyError:
        raise RedisRuntimeError(f"Unrecognized logging level: {value}") from None


def _emit(context: str, level: SRLoggingLevel, data: str, python_level: int) -> None:
    typecheck(context, "context", str)
    typecheck(level, "level", SRLoggingLevel)
    typecheck(data, "data", str)
    if level > configured_level():
        return
    if _log.isEnabledFor(python_level):
        _log.log(python_level, "%s: %s", context, data, extra={"sr_context": context, "sr_level": level.name},
                 stacklevel=3)


def log_data(context: str, level: SRLoggingLevel, data: str) -> None:
    """Log data to the SmartRedis log (the ``smartredis_io.log`` logger)

    :param context: Logging context (string to prefix the log entry with)
    :type context: str
    :param level: minimum logging level for data to be logged with
    :type level: SRLoggingLevel
    :param data: message data to log
    :type data: str
    :raises TypeError: if an argument has the wrong type
    :raises RedisRuntimeError: if ``SR_LOG_LEVEL`` holds an unknown level
    """
    _emit(context, level, data, _DATA_LEVELS.get(level, logging.INFO))


def log_warning(context: str, level: SRLoggingLevel, data: str) -> None:
    """Log a warning to the SmartRedis log (``logging.WARNING`` on ``smartredis_io.log``)

    :param context: Logging context (string to prefix the log entry with)
    :type context: str
    :param level: minimum logging level for data to be logged with
    :type level: SRLoggingLevel
    :param data: message data to log
    :type data: str
    :raises TypeError: if an argument has the wrong type
    :raises RedisRuntimeError: if ``SR_LOG_LEVEL`` holds an unknown level
    """
    _emit(context, level, data, logging.WARNING)


def log_error(context: str, level: SRLoggingLevel, data: str) -> None:
    """Log an error to the SmartRedis log (``logging.ERROR`` on ``smartredis_io.log``)

    :param context: Logging context (string to prefix the log entry with)
    :type context: str
    :param level: minimum logging level for data to be logged with
    :type level: SRLoggingLevel
    :param data: message data to log
    :type data: str
    :raises TypeError: if an argument has the wrong type
    :raises RedisRuntimeError: if ``SR_LOG_LEVEL`` holds an unknown level
    """
    _emit(context, level, data, logging.ERROR)
