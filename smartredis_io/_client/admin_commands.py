"""Key and client-configuration commands of the SmartRedis client: keys, polling, ensemble prefixes."""

from __future__ import annotations

from smartredis_io._client.client_base import ClientBase, command, poll
from smartredis_io._client.helpers import typecheck
from smartredis_io.error import RedisRuntimeError

__all__ = ["AdminCommands"]


class AdminCommands(ClientBase):
    """Commands on raw keys and on how this client prefixes the keys it reads and writes."""

    @command
    def key_exists(self, key: str) -> bool:
        """Check whether a key exists in the database (no prefix is applied)

        :param key: the database key
        :type key: str
        :return: whether the key exists
        :rtype: bool
        :raises RedisReplyError: if the check fails
        """
        typecheck(key, "key", str)
        return bool(self._db.redis.exists(key))

    def poll_key(self, key: str, poll_frequency_ms: int, num_tries: int) -> bool:
        """Wait for a key to exist in the database (no prefix is applied)

        :param key: the database key
        :type key: str
        :param poll_frequency_ms: milliseconds between checks
        :type poll_frequency_ms: int
        :param num_tries: how many times to check
        :type num_tries: int
        :return: whether the key was found
        :rtype: bool
        :raises RedisReplyError: if a check fails
        """
        return poll(lambda: self.key_exists(key), poll_frequency_ms, num_tries)

    @command
    def set_data_source(self, source_id: str) -> None:
        """Set the prefix used to read keys

        Reads use the first prefix of ``SSKEYIN`` until this selects another one of them.

        :param source_id: the prefix to read with; one of those in ``SSKEYIN``
        :type source_id: str
        :raises TypeError: if the argument is not a string
        :raises RedisRuntimeError: if ``source_id`` is not one of the prefixes in ``SSKEYIN``
        """
        typecheck(source_id, "source_id", str)
        if source_id not in self._get_prefixes:
            raise RedisRuntimeError(
                f"Client error: data source {source_id} could not be found during client initialization"
            )
        self._get_prefix = source_id

    def use_tensor_ensemble_prefix(self, use_prefix: bool) -> None:
        """Whether tensor keys get the ensemble prefix (``SSKEYOUT`` to write, ``SSKEYIN`` to read)

        On by default.

        :param use_prefix: apply the prefix to tensor keys
        :type use_prefix: bool
        :raises TypeError: if the argument is not a bool
        """
        typecheck(use_prefix, "use_prefix", bool)
        self._use["tensor"] = use_prefix

    def use_dataset_ensemble_prefix(self, use_prefix: bool) -> None:
        """Whether dataset keys get the ensemble prefix; on by default

        :param use_prefix: apply the prefix to dataset keys
        :type use_prefix: bool
        :raises TypeError: if the argument is not a bool
        """
        typecheck(use_prefix, "use_prefix", bool)
        self._use["dataset"] = use_prefix

    def use_list_ensemble_prefix(self, use_prefix: bool) -> None:
        """Whether aggregation-list keys get the ensemble prefix; on by default

        The datasets a list refers to keep the prefix they were put with.

        :param use_prefix: apply the prefix to list keys
        :type use_prefix: bool
        :raises TypeError: if the argument is not a bool
        """
        typecheck(use_prefix, "use_prefix", bool)
        self._use["list"] = use_prefix

    def use_model_ensemble_prefix(self, use_prefix: bool) -> None:
        """Whether model and script keys get the ensemble prefix; off by default

        :param use_prefix: apply the prefix to model and script keys
        :type use_prefix: bool
        :raises TypeError: if the argument is not a bool
        """
        typecheck(use_prefix, "use_prefix", bool)
        self._use["model"] = use_prefix
