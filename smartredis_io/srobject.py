"""SmartRedis' ``SRObject``: the base of ``Client``, ``Dataset`` and ``LogContext``, with a log context."""

from __future__ import annotations

from smartredis_io import logger
from smartredis_io._client.helpers import typecheck
from smartredis_io.logger import SRLoggingLevel

__all__ = ["SRObject"]


class SRObject:
    """An object that logs under a context name (``logger_name`` of a client, a dataset's name)."""

    _lname: str

    def __init__(self, context: str) -> None:
        """Initialize a SRObject object

        :param context: logging context
        :type context: str
        :raises TypeError: if ``context`` is not a string
        """
        typecheck(context, "context", str)
        self._lname = context

    def log_data(self, level: SRLoggingLevel, data: str) -> None:
        """Conditionally log data if the logging level is high enough

        :param level: Minimum logging level for data to be logged
        :type level: SRLoggingLevel
        :param data: Text of data to be logged
        :type data: str
        :raises TypeError: if an argument has the wrong type
        :raises RedisRuntimeError: if ``SR_LOG_LEVEL`` holds an unknown level
        """
        logger.log_data(self._lname, level, data)

    def log_warning(self, level: SRLoggingLevel, data: str) -> None:
        """Conditionally log warning data if the logging level is high enough

        :param level: Minimum logging level for data to be logged
        :type level: SRLoggingLevel
        :param data: Text of data to be logged
        :type data: str
        :raises TypeError: if an argument has the wrong type
        :raises RedisRuntimeError: if ``SR_LOG_LEVEL`` holds an unknown level
        """
        logger.log_warning(self._lname, level, data)

    def log_error(self, level: SRLoggingLevel, data: str) -> None:
        """Conditionally log error data if the logging level is high enough

        :param level: Minimum logging level for data to be logged
        :type level: SRLoggingLevel
        :param data: Text of data to be logged
        :type data: str
        :raises TypeError: if an argument has the wrong type
        :raises RedisRuntimeError: if ``SR_LOG_LEVEL`` holds an unknown level
        """
        logger.log_error(self._lname, level, data)
