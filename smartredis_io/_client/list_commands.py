"""Aggregation-list commands of the SmartRedis client: lists of references to stored datasets."""

from __future__ import annotations

from smartredis_io import dataset as ds_layout
from smartredis_io._client.client_base import ClientBase, command, poll
from smartredis_io._client.helpers import typecheck
from smartredis_io.dataset import Dataset
from smartredis_io.error import MissingKeyRuntimeError

__all__ = ["ListCommands"]


def _check_names(src_name: str, dest_name: str) -> None:
    if not src_name:
        raise ValueError("The src_name parameter cannot be an empty string.")
    if not dest_name:
        raise ValueError("The dest_name parameter cannot be an empty string.")


class ListCommands(ClientBase):
    """Aggregation lists: producers append datasets they have put, a consumer reads them all."""

    @command
    def append_to_list(self, list_name: str, dataset: Dataset) -> None:
        """Append a dataset to an aggregation list

        The list holds a reference to the dataset, which must have been put with
        ``put_dataset()``; a list is created when the first dataset is appended. The list's key may
        be formed by applying a prefix to ``list_name``; see ``use_list_ensemble_prefix()``.

        :param list_name: name of the aggregation list
        :type list_name: str
        :param dataset: the (already put) dataset to append
        :type dataset: Dataset
        :raises TypeError: if an argument has the wrong type
        :raises RedisReplyError: if the append fails
        """
        typecheck(list_name, "list_name", str)
        typecheck(dataset, "dataset", Dataset)
        self._db.redis.rpush(self._put_key("list", list_name), self._dataset_put_key(dataset.get_name()))

    @command
    def delete_list(self, list_name: str) -> None:
        """Delete an aggregation list (the datasets it refers to are kept)

        :param list_name: name of the aggregation list
        :type list_name: str
        :raises RedisReplyError: if the deletion fails
        """
        typecheck(list_name, "list_name", str)
        self._db.redis.delete(self._get_key("list", list_name))

    @command
    def copy_list(self, src_name: str, dest_name: str) -> None:
        """Copy an aggregation list (the references, not the datasets)

        :param src_name: name of the list to copy
        :type src_name: str
        :param dest_name: name of the copy (replaced if it exists)
        :type dest_name: str
        :raises ValueError: if a name is empty
        :raises RedisKeyError: if there is no list at ``src_name`` (a ``RedisRuntimeError`` too, as
            SmartRedis raises)
        :raises RedisReplyError: if the copy fails
        """
        typecheck(src_name, "src_name", str)
        typecheck(dest_name, "dest_name", str)
        _check_names(src_name, dest_name)
        src = self._get_key("list", src_name)
        if not self._db.redis.exists(src):
            raise MissingKeyRuntimeError(f"The list {src!r} does not exist")
        entries = self._db.redis.lrange(src, 0, -1)
        dest = self._put_key("list", dest_name)
        pipe = self._db.redis.pipeline(transaction=not self._db.cluster)
        pipe.delete(dest)
        pipe.rpush(dest, *entries)
        pipe.execute()

    @command
    def rename_list(self, src_name: str, dest_name: str) -> None:
        """Rename an aggregation list

        :param src_name: current name of the list
        :type src_name: str
        :param dest_name: new name of the list (replaced if it exists)
        :type dest_name: str
        :raises ValueError: if a name is empty
        :raises RedisKeyError: if there is no list at ``src_name`` (a ``RedisRuntimeError`` too, as
            SmartRedis raises)
        :raises RedisReplyError: if the rename fails
        """
        typecheck(src_name, "src_name", str)
        typecheck(dest_name, "dest_name", str)
        _check_names(src_name, dest_name)
        if src_name == dest_name:
            return
        self.copy_list(src_name, dest_name)
        if self._get_key("list", src_name) != self._put_key("list", dest_name):
            self._db.redis.delete(self._get_key("list", src_name))

    @command
    def get_list_length(self, list_name: str) -> int:
        """Number of datasets in an aggregation list

        :param list_name: name of the aggregation list
        :type list_name: str
        :return: the list's length (0 when there is no such list)
        :rtype: int
        :raises RedisReplyError: if the key holds something else than a list
        """
        typecheck(list_name, "list_name", str)
        return int(self._db.redis.llen(self._get_key("list", list_name)))

    def _poll_length(self, name: str, list_length: int, accept, poll_frequency_ms: int, num_tries: int) -> bool:
        typecheck(name, "name", str)
        typecheck(poll_frequency_ms, "poll_frequency_ms", int)
        typecheck(num_tries, "num_tries", int)
        if list_length < 0:
            raise ValueError("A positive value for list_length must be provided.")
        return poll(lambda: accept(self.get_list_length(name)), poll_frequency_ms, num_tries)

    def poll_list_length(self, name: str, list_length: int, poll_frequency_ms: int, num_tries: int) -> bool:
        """Wait for an aggregation list to reach exactly a given length

        :param name: name of the aggregation list
        :type name: str
        :param list_length: the length to wait for
        :type list_length: int
        :param poll_frequency_ms: milliseconds between checks
        :type poll_frequency_ms: int
        :param num_tries: how many times to check
        :type num_tries: int
        :return: whether the length was reached
        :rtype: bool
        :raises TypeError: if an argument has the wrong type
        :raises ValueError: if ``list_length`` is negative
        :raises RedisReplyError: if a check fails
        """
        typecheck(list_length, "list_length", int)
        return self._poll_length(name, list_length, lambda n: n == list_length, poll_frequency_ms, num_tries)

    def poll_list_length_gte(self, name: str, list_length: int, poll_frequency_ms: int, num_tries: int) -> bool:
        """Wait for an aggregation list to reach at least a given length

        :param name: name of the aggregation list
        :type name: str
        :param list_length: the smallest length accepted
        :type list_length: int
        :param poll_frequency_ms: milliseconds between checks
        :type poll_frequency_ms: int
        :param num_tries: how many times to check
        :type num_tries: int
        :return: whether the length was reached
        :rtype: bool
        :raises TypeError: if an argument has the wrong type
        :raises ValueError: if ``list_length`` is negative
        :raises RedisReplyError: if a check fails
        """
        typecheck(list_length, "list_length", int)
        return self._poll_length(name, list_length, lambda n: n >= list_length, poll_frequency_ms, num_tries)

    def poll_list_length_lte(self, name: str, list_length: int, poll_frequency_ms: int, num_tries: int) -> bool:
        """Wait for an aggregation list to be at most a given length

        :param name: name of the aggregation list
        :type name: str
        :param list_length: the largest length accepted
        :type list_length: int
        :param poll_frequency_ms: milliseconds between checks
        :type poll_frequency_ms: int
        :param num_tries: how many times to check
        :type num_tries: int
        :return: whether the length was reached
        :rtype: bool
        :raises TypeError: if an argument has the wrong type
        :raises ValueError: if ``list_length`` is negative
        :raises RedisReplyError: if a check fails
        """
        typecheck(list_length, "list_length", int)
        return self._poll_length(name, list_length, lambda n: n <= list_length, poll_frequency_ms, num_tries)

    @command
    def get_datasets_from_list(self, list_name: str) -> list[Dataset]:
        """All datasets of an aggregation list, in the order they were appended

        :param list_name: name of the aggregation list
        :type list_name: str
        :return: the datasets (an empty list when there is no such list)
        :rtype: list[Dataset]
        :raises RedisKeyError: if a listed dataset no longer exists
        :raises RedisReplyError: if the retrieval fails
        """
        typecheck(list_name, "list_name", str)
        return self._datasets(self._db.redis.lrange(self._get_key("list", list_name), 0, -1))

    @command
    def get_dataset_list_range(self, list_name: str, start_index: int, end_index: int) -> list[Dataset]:
        """A range of the datasets of an aggregation list

        Indices are inclusive and, as in Python, negative ones count from the end of the list.

        :param list_name: name of the aggregation list
        :type list_name: str
        :param start_index: index of the first dataset returned
        :type start_index: int
        :param end_index: index of the last dataset returned
        :type end_index: int
        :return: the datasets in that range
        :rtype: list[Dataset]
        :raises TypeError: if an argument has the wrong type
        :raises RedisKeyError: if a listed dataset no longer exists
        :raises RedisReplyError: if the retrieval fails
        """
        typecheck(list_name, "list_name", str)
        typecheck(start_index, "start_index", int)
        typecheck(end_index, "end_index", int)
        return self._datasets(self._db.redis.lrange(self._get_key("list", list_name), start_index, end_index))

    def _datasets(self, bases: list[bytes]) -> list[Dataset]:
        result = []
        for raw in bases:
            base = raw.decode()
            name = base[base.index("{") + 1:base.rindex("}")]
            result.append(ds_layout.get(self._db, base, name))
        return result
