"""Commands of the SmartRedis client addressed to database nodes: info, configuration, flush, save.

Each takes node addresses (``host:port``, or ``unix:///path``) as SmartRedis does and runs on the
node at each: on a standalone database that is its one address, on a cluster any node of its slot
map. An address that names no node of the database is a ``RedisRuntimeError``, as is an error the
node answers. ``get_ai_info`` reports the statistics the execution workers keep for each model and
script (RedisAI's ``AI.INFO`` fields).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from smartredis_io._client import _redispy, placement
from smartredis_io._client.client_base import ClientBase, command
from smartredis_io._client.connection import parse_address
from smartredis_io._client.helpers import typecheck, typecheck_list
from smartredis_io.error import MissingKeyRuntimeError, RedisConnectionError, RedisRuntimeError

__all__ = ["NodeCommands"]

MODEL_CHUNK_MAX_BYTES = 512 * 1024 * 1024  # Redis' largest value


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def parse_info(info: str) -> dict[str, dict[str, str]]:
    """``INFO`` text as SmartRedis parses it: section -> field -> value, all strings."""
    sections: dict[str, dict[str, str]] = {}
    current = ""
    for line in info.split("\r\n"):
        if not line:
            continue
        if line.startswith("#"):
            current = line[2:]
            sections.setdefault(current, {})
            continue
        field, _, value = line.partition(":")
        sections.setdefault(current, {})[field] = value
    return sections


def parse_fields(info: str) -> dict[str, str]:
    """``CLUSTER INFO`` text as SmartRedis parses it: field -> value, all strings."""
    fields: dict[str, str] = {}
    for line in info.split("\r\n"):
        if line:
            field, _, value = line.partition(":")
            fields[field] = value
    return fields


#: AI.INFO's fields that count (summed over a cluster's copies of a model)
_COUNTED = ("duration", "samples", "calls", "errors")


class NodeCommands(ClientBase):
    """Commands run on given database nodes, and the model chunk size."""

    #: the chunk size models are stored with (``set_model_chunk_size``); None: the bulk limit
    _model_chunk_bytes: int | None = None
    _sharded: Callable[[], bool]  # ModelCommands': models are on every shard

    def _node_pool(self, address: str) -> redis.ConnectionPool:
        typecheck(address, "address", str)
        try:
            endpoints = parse_address(address)
        except RedisConnectionError:
            raise RedisRuntimeError(f"{address} is not a valid database node address.") from None
        pool = _redispy.pool_at(self._db.redis, endpoints[0]) if len(endpoints) == 1 else None
        if pool is None:
            raise RedisRuntimeError(f"{address} is not the address of a node of the database at {self._db.address}")
        return pool

    def _run_at(self, address: str, *args: Any) -> Any:
        """Run one command on the node at ``address``; its raw reply (``RedisRuntimeError`` for an error)."""
        pool = self._node_pool(address)
        self._db.check_deadline()
        with _redispy.pooled_connection(pool) as conn:  # its socket waits end at SR_CMD_TIMEOUT
            _redispy.send_commands(conn, [args])
            reply = _redispy.read_reply(conn)
        if isinstance(reply, Exception):
            raise RedisRuntimeError(f"{' '.join(map(str, args[:2]))} command failed on {address}: {reply}")
        return reply

    @staticmethod
    def _addresses(addresses: list[str], name: str = "addresses") -> list[str]:
        return typecheck_list(addresses, name)

    @command
    def get_db_node_info(self, addresses: list[str]) -> list[dict]:
        """Returns information about given database nodes (their ``INFO EVERYTHING``)

        :param addresses: The addresses of the database nodes
        :type addresses: list[str]
        :returns: A list of dictionaries with each entry in the list corresponding to an address
            reply: section name -> field -> value (strings, as the server wrote them)
        :rtype: list[dict]
        :raises TypeError: if ``addresses`` is not a list of strings
        :raises RedisRuntimeError: if an address is not a node of the database or the command fails
        """
        return [parse_info(_text(self._run_at(a, "INFO", "EVERYTHING"))) for a in self._addresses(addresses)]

    @command
    def get_db_cluster_info(self, addresses: list[str]) -> list[dict]:
        """Returns cluster information (``CLUSTER INFO``) from the given database nodes

        :param addresses: The addresses of the database nodes
        :type addresses: list[str]
        :returns: A list of dictionaries with each entry in the list corresponding to an address
            reply: field -> value (strings)
        :rtype: list[dict]
        :raises TypeError: if ``addresses`` is not a list of strings
        :raises RedisRuntimeError: if the database is not a cluster, an address is not one of its
            nodes, or the command fails
        """
        self._addresses(addresses)
        if not self._db.cluster:
            raise RedisRuntimeError("Cannot run on non-cluster environment", "get_db_cluster_info")
        return [parse_fields(_text(self._run_at(a, "CLUSTER", "INFO"))) for a in addresses]

    @command
    def get_ai_info(self, address: list[str], key: str, reset_stat: bool = False) -> list[dict]:
        """Returns ``AI.INFO``-style statistics of the script or model at a key, per address

        The smartredis_io Redis module counts, per model and script, the calls, errors, samples
        (rows of the first input) and the microseconds the workers spent running it (``AI.INFO``,
        asked of the server that holds the key); every address reports those statistics. The key
        is taken as given (no prefix is applied).

        :param address: The addresses of the database nodes
        :type address: list[str]
        :param key: The key associated with the model or script
        :type key: str
        :param reset_stat: Boolean indicating if the statistics for the model or script should be
            reset (the reply is then an empty dictionary per address)
        :type reset_stat: bool
        :returns: A list of dictionaries with each entry in the list corresponding to an address
            reply: ``key``, ``type``, ``backend``, ``device``, ``tag``, ``duration``, ``samples``,
            ``calls``, ``errors`` (strings)
        :rtype: list[dict]
        :raises TypeError: if an argument has the wrong type
        :raises RedisRuntimeError: if an address is not a node of the database or there is no
            model or script at ``key``
        """
        self._addresses(address, "address")
        typecheck(key, "key", str)
        typecheck(reset_stat, "reset_stat", bool)
        for node in address:
            self._node_pool(node)
        # In a cluster with the module the model has a copy on every shard (smartredis_io._client.placement),
        # each with its own statistics: their sums are the database's.
        copies = placement.shard_keys(self._db, key) if self._sharded() else [key]
        replies = [self._db.exchange([("AI.INFO", copy, *(["RESETSTAT"] if reset_stat else []))],
                                     raise_on_error=False)[0] for copy in copies]
        failed = next((r for r in replies if isinstance(r, redis.exceptions.ResponseError)), None)
        if failed is not None:
            if "is empty" in str(failed) or "WRONGTYPE" in str(failed):
                raise MissingKeyRuntimeError(f"AI.INFO command failed on server: no model or script at key {key!r}")
            raise RedisRuntimeError(f"AI.INFO command failed on server: {failed}")
        if reset_stat:
            return [{} for _ in address]
        fields = [{_text(k): _text(v) if isinstance(v, bytes) else str(v)
                   for k, v in zip(reply[0::2], reply[1::2], strict=False)} for reply in replies]
        info = {**fields[0], "key": key}
        for name in _COUNTED:
            info[name] = str(sum(int(f.get(name, 0)) for f in fields))
        return [dict(info) for _ in address]

    @command
    def flush_db(self, addresses: list[str]) -> None:
        """Removes all keys from the given database nodes (``FLUSHDB``)

        :param addresses: The addresses of the database nodes
        :type addresses: list[str]
        :raises TypeError: if ``addresses`` is not a list of strings
        :raises RedisRuntimeError: if an address is not a node of the database or the command fails
        """
        for address in self._addresses(addresses):
            self._run_at(address, "FLUSHDB")

    @command
    def config_get(self, expression: str, address: str) -> dict:
        """Read the configuration parameters of a running server (``CONFIG GET``)

        :param expression: Parameter used in the configuration or a glob pattern (``*`` for all)
        :type expression: str
        :param address: The address of the database node
        :type address: str
        :returns: configuration parameter -> value; an empty dictionary when nothing matches
        :rtype: dict
        :raises TypeError: if an argument is not a string
        :raises RedisRuntimeError: if the address is not a node of the database or the command fails
        """
        typecheck(expression, "expression", str)
        typecheck(address, "address", str)
        reply = self._run_at(address, "CONFIG", "GET", expression)
        if isinstance(reply, dict):  # RESP3
            return {_text(k): _text(v) for k, v in reply.items()}
        return {_text(k): _text(v) for k, v in zip(reply[::2], reply[1::2], strict=True)}

    @command
    def config_set(self, config_param: str, value: str, address: str) -> None:
        """Reconfigure the server (``CONFIG SET``); the change applies from the next command

        :param config_param: A configuration parameter to set
        :type config_param: str
        :param value: The value to assign to the configuration parameter
        :type value: str
        :param address: The address of the database node
        :type address: str
        :raises TypeError: if an argument is not a string
        :raises RedisRuntimeError: if the address is not a node of the database, or the server
            refuses the parameter or value
        """
        typecheck(config_param, "config_param", str)
        typecheck(value, "value", str)
        typecheck(address, "address", str)
        self._run_at(address, "CONFIG", "SET", config_param, value)

    @command
    def save(self, addresses: list[str]) -> None:
        """Performs a synchronous save of the given database nodes (``SAVE``: an RDB snapshot)

        :param addresses: The addresses of the database nodes
        :type addresses: list[str]
        :raises TypeError: if ``addresses`` is not a list of strings
        :raises RedisRuntimeError: if an address is not a node of the database or the save fails
        """
        for address in self._addresses(addresses):
            self._run_at(address, "SAVE")

    def set_model_chunk_size(self, chunk_size: int) -> None:
        """Set the size of the chunks this client stores models in

        Models larger than this are stored as checksummed chunks of at most ``chunk_size`` bytes
        (RedisAI's ``MODEL_CHUNK_SIZE``); the default is Redis' largest value, 512 MB. The setting
        belongs to this client; it changes nothing on the server.

        :param chunk_size: The new chunk size in bytes
        :type chunk_size: int
        :raises TypeError: if ``chunk_size`` is not an integer
        :raises RedisRuntimeError: if ``chunk_size`` is not between 1 byte and 512 MB
        """
        typecheck(chunk_size, "chunk_size", int)
        if not 0 < chunk_size <= MODEL_CHUNK_MAX_BYTES:
            raise RedisRuntimeError(
                f"AI.CONFIG MODEL_CHUNK_SIZE command failed: chunk size {chunk_size} is not between 1 and "
                f"{MODEL_CHUNK_MAX_BYTES} bytes", "set_model_chunk_size",
            )
        self._model_chunk_bytes = chunk_size
