"""SmartRedis' ``Client`` on a stock Redis or Redis Cluster; models and scripts run by our workers."""

from __future__ import annotations

import logging
from typing import Any

from smartredis_io._client.admin_commands import AdminCommands
from smartredis_io._client.connection import ConnectionSettings, Database
from smartredis_io._client.dataset_commands import DatasetCommands
from smartredis_io._client.helpers import typecheck
from smartredis_io._client.list_commands import ListCommands
from smartredis_io._client.model_commands import ModelCommands
from smartredis_io._client.multigpu_commands import MultiGPUCommands
from smartredis_io._client.node_commands import NodeCommands
from smartredis_io._client.tensor_commands import TensorCommands
from smartredis_io.configoptions import ConfigOptions
from smartredis_io.error import RedisConnectionError
from smartredis_io.srobject import SRObject

__all__ = ["Client"]

log = logging.getLogger(__name__)

DEFAULT_MODEL_TIMEOUT_MS = 60_000  # SR_MODEL_TIMEOUT (milliseconds, as SmartRedis): deadline of run_model


class Client(SRObject, TensorCommands, DatasetCommands, MultiGPUCommands, ModelCommands, ListCommands, AdminCommands,
             NodeCommands):
    """A SmartRedis client: tensors, datasets, aggregation lists, models and scripts in Redis."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        """Initialize a client and connect it to the database

        The client can be made with either of SmartRedis' two signatures:

            Client(config_options: ConfigOptions = None, logger_name: str = "Default")
            Client(cluster: bool, address: str | None = None, logger_name: str = "Default")

        With the first, the address comes from ``SSDB`` (or ``SSDB_<suffix>`` for options made
        with a suffix) and the database type from ``SR_DB_TYPE`` (``Clustered`` or
        ``Standalone``). With the second, ``address`` (default ``SSDB``) names the database and
        ``cluster`` whether it is a Redis Cluster; the address given is not written to the
        environment.

        Credentials come from ``SR_USERNAME`` / ``SR_PASSWORD`` or a
        ``redis://user:password@host:port`` address; TLS from a ``rediss://`` address or ``SR_TLS``
        (with ``SR_TLS_CA_CERT``, ``SR_TLS_CERT``, ``SR_TLS_KEY``). Deadlines are SmartRedis':
        ``SR_CONN_TIMEOUT`` (seconds, default 100) to connect, retried every ``SR_CONN_INTERVAL``
        ms; ``SR_CMD_TIMEOUT`` (seconds, default 100) for each command and each method call;
        ``SR_MODEL_TIMEOUT`` (milliseconds, default 60000) for ``run_model`` / ``run_script``.
        Every option can also be set on a ``ConfigOptions`` with its ``override_*_option`` methods.

        :param a: the positional arguments of either signature
        :type a: tuple[any]
        :param kw: the keyword arguments of either signature
        :type kw: dict[str, any]
        :raises TypeError: if an argument has the wrong type or is unknown
        :raises RedisConnectionError: if no address is configured or no database answers at it
            within ``SR_CONN_TIMEOUT``
        """
        if (a and isinstance(a[0], bool)) or (not a and ("address" in kw or "cluster" in kw)):
            for arg in kw:
                if arg not in ("cluster", "address", "logger_name"):
                    raise TypeError(f"__init__() got an unexpected keyword argument '{arg}'")
            self._address_construction(*a, **kw)
        elif not a or isinstance(a[0], ConfigOptions) or a[0] is None:
            self._standard_construction(*a, **kw)
        else:
            raise TypeError(f"Invalid type for argument 0: {type(a[0])}")

    def _address_construction(self, cluster: bool, address: str | None = None, logger_name: str = "Default") -> None:
        typecheck(cluster, "cluster", bool)
        options = ConfigOptions.create_from_environment("")
        if address:
            typecheck(address, "address", str)
            options.override_string_option("SSDB", address)
        if not options.is_configured("SSDB"):
            raise RedisConnectionError("Could not connect to database. $SSDB not set")
        self._setup(options, cluster, logger_name)

    def _standard_construction(self, config_options: ConfigOptions | None = None, logger_name: str = "Default") -> None:
        options = config_options or ConfigOptions.create_from_environment("")
        typecheck(options, "config_options", ConfigOptions)
        if not options.is_configured("SSDB"):
            raise RedisConnectionError("Could not connect to database. $SSDB not set")
        self._setup(options, None, logger_name)

    def _setup(self, options: ConfigOptions, cluster: bool | None, logger_name: str) -> None:
        SRObject.__init__(self, logger_name)
        self._options = options
        self._logger_name = logger_name
        self._log = logging.getLogger(f"{__name__}.{logger_name}")
        settings = ConnectionSettings.from_options(options, cluster=cluster)
        self._model_timeout_s = options.integer_or("SR_MODEL_TIMEOUT", DEFAULT_MODEL_TIMEOUT_MS) / 1000
        self._db = Database(settings)
        self._init_prefixes(options.string_or("SSKEYIN", ""), options.string_or("SSKEYOUT", ""))
        self._log.debug("connected to %s (%s)", settings.address, "cluster" if settings.cluster else "standalone")

    def __str__(self) -> str:
        """A description of the client and its connection, laid out as SmartRedis' ``to_string()``

        :return: the description
        :rtype: str
        """
        kind = "Clustered" if self._db.cluster else "Non-clustered"
        if self._db.cluster:
            shards = sorted(node.name for node in self._db.redis.get_primaries())
        else:
            shards = self._db.address.replace(";", ",").split(",")
        protocol = "Unix Domain Socket" if self._db.address.startswith("unix://") else "TCP"
        db_type = "Clustered" if self._db.cluster else "Standalone"
        lines = [f"Client ({self._logger_name}):", f"{kind} Redis connection:", f"  Database type: {db_type}",
                 "  Redis shards at:", *(f"    {shard.strip()}" for shard in shards if shard.strip()),
                 f"  Protocol: {protocol}",
                 f"  Model and script timeout (ms): {self._model_timeout_s * 1000:.0f}"]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        """Close the client's connections (SmartRedis closes them when the client is destroyed)"""
        self._db.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
