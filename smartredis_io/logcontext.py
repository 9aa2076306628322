"""SmartRedis' ``LogContext``: a named context to log under, for code that is not a client or dataset."""

from __future__ import annotations

from smartredis_io._client.helpers import typecheck
from smartredis_io.srobject import SRObject

__all__ = ["LogContext"]


class LogContext(SRObject):
    """A log context: ``LogContext("solver").log_data(LLInfo, "step 3")``."""

    def __init__(self, context: str) -> None:
        """Initialize a LogContext object

        :param context: logging context
        :type context: str
        :raises TypeError: if ``context`` is not a string
        """
        super().__init__(context)

    @staticmethod
    def from_pybind(logcontext: LogContext) -> LogContext:
        """A new LogContext with the context of another

        SmartRedis takes its pybind object here; smartredis_io has none, so this takes what
        ``get_context()`` returns.

        :param logcontext: the log context to copy
        :type logcontext: LogContext
        :return: the new LogContext
        :rtype: LogContext
        :raises TypeError: if the argument is not a LogContext
        """
        typecheck(logcontext, "logcontext", LogContext)
        return LogContext(logcontext._lname)

    def get_context(self) -> LogContext:
        """The object holding this context's information (this LogContext itself)

        :return: the log context
        :rtype: LogContext
        """
        return self

    def set_context(self, logcontext: LogContext) -> None:
        """Take the context of another LogContext

        :param logcontext: the log context whose name to log under
        :type logcontext: LogContext
        :raises TypeError: if the argument is not a LogContext
        """
        typecheck(logcontext, "logcontext", LogContext)
        self._lname = logcontext._lname
