"""Dataset commands of the SmartRedis client: put, get, copy, rename, delete, exists, poll."""

from __future__ import annotations

from smartredis_io import dataset as ds_layout
from smartredis_io._client.client_base import ClientBase, command, poll
from smartredis_io._client.helpers import typecheck
from smartredis_io.dataset import Dataset
from smartredis_io.error import MissingKeyRuntimeError

__all__ = ["DatasetCommands"]


class DatasetCommands(ClientBase):
    """Datasets: named groups of tensors and metadata, stored and read as one unit."""

    @command
    def put_dataset(self, dataset: Dataset) -> None:
        """Put a Dataset instance into the database

        Every tensor and metadata field of the dataset is stored; the dataset's manifest, written
        last, publishes them, so readers see the whole old dataset or the whole new one. The key
        may be formed by applying a prefix to the dataset's name; see
        ``use_dataset_ensemble_prefix()``.

        :param dataset: the dataset to store
        :type dataset: Dataset
        :raises TypeError: if the argument is not a Dataset
        :raises RedisReplyError: if the put fails
        """
        typecheck(dataset, "dataset", Dataset)
        ds_layout.put(self._db, self._dataset_put_key(dataset.get_name()), dataset)

    @command
    def get_dataset(self, name: str) -> Dataset:
        """Get a dataset from the database

        :param name: name the dataset is stored at
        :type name: str
        :return: the dataset, with all its tensors and metadata
        :rtype: Dataset
        :raises RedisKeyError: if there is no dataset at that name
        :raises RedisReplyError: if the get fails
        """
        typecheck(name, "name", str)
        return ds_layout.get(self._db, self._dataset_get_key(name), name)

    @command
    def delete_dataset(self, name: str) -> None:
        """Delete a dataset, with all its tensors and metadata, from the database

        :param name: name the dataset is stored at
        :type name: str
        :raises RedisKeyError: if there is no dataset at that name (a ``RedisRuntimeError`` too, as
            SmartRedis raises)
        :raises RedisReplyError: if the deletion fails
        """
        typecheck(name, "name", str)
        if not ds_layout.delete(self._db, self._dataset_get_key(name)):
            raise MissingKeyRuntimeError(f"The dataset {name!r} does not exist")

    @command
    def copy_dataset(self, src_name: str, dest_name: str) -> None:
        """Copy a dataset to another name

        The source is read with the read prefix and the copy written with the write prefix; see
        ``set_data_source()`` and ``use_dataset_ensemble_prefix()``.

        :param src_name: name of the dataset to copy
        :type src_name: str
        :param dest_name: name to store the copy at
        :type dest_name: str
        :raises RedisKeyError: if there is no dataset at ``src_name``
        :raises RedisReplyError: if the copy fails
        """
        typecheck(src_name, "src_name", str)
        typecheck(dest_name, "dest_name", str)
        source = ds_layout.get(self._db, self._dataset_get_key(src_name), src_name)
        ds_layout.put(self._db, self._dataset_put_key(dest_name), ds_layout.renamed(source, dest_name))

    @command
    def rename_dataset(self, old_name: str, new_name: str) -> None:
        """Rename a dataset in the database

        :param old_name: current name of the dataset
        :type old_name: str
        :param new_name: new name for the dataset
        :type new_name: str
        :raises RedisKeyError: if there is no dataset at ``old_name``
        :raises RedisReplyError: if the rename fails
        """
        self.copy_dataset(old_name, new_name)
        ds_layout.delete(self._db, self._dataset_get_key(old_name))

    @command
    def dataset_exists(self, name: str) -> bool:
        """Check whether a dataset exists in the database

        :param name: name the dataset would be stored at
        :type name: str
        :return: whether the dataset exists
        :rtype: bool
        :raises RedisReplyError: if the check fails
        """
        typecheck(name, "name", str)
        return ds_layout.exists(self._db, self._dataset_get_key(name))

    def poll_dataset(self, name: str, poll_frequency_ms: int, num_tries: int) -> bool:
        """Wait for a dataset to exist in the database

        :param name: name the dataset would be stored at
        :type name: str
        :param poll_frequency_ms: milliseconds between checks
        :type poll_frequency_ms: int
        :param num_tries: how many times to check
        :type num_tries: int
        :return: whether the dataset was found
        :rtype: bool
        :raises RedisReplyError: if a check fails
        """
        return poll(lambda: self.dataset_exists(name), poll_frequency_ms, num_tries)
