"""Tensor commands of the SmartRedis client: put, get, unpack, copy, rename, delete, exists, poll."""

from __future__ import annotations

import numpy as np

from smartredis_io._client import wire
from smartredis_io._client.client_base import ClientBase, command, poll
from smartredis_io._client.helpers import typecheck

__all__ = ["TensorCommands"]


class TensorCommands(ClientBase):
    """Tensors: n-dimensional arrays of any supported dtype, stored as one key each."""

    @command
    def put_tensor(self, name: str, data: np.ndarray) -> None:
        """Put a tensor to the database

        The key the tensor is stored at may be formed by applying a prefix to the supplied name;
        see ``use_tensor_ensemble_prefix()``. A tensor larger than Redis' largest value (512 MB)
        is stored as checksummed chunks; readers see the old tensor or the new one, never a mix.

        :param name: name for the tensor to be stored at
        :type name: str
        :param data: numpy array of tensor data (any shape; non-contiguous arrays are copied)
        :type data: np.ndarray
        :raises TypeError: if an argument has the wrong type or the dtype is not supported
        :raises RedisReplyError: if the put fails
        """
        typecheck(name, "name", str)
        typecheck(data, "data", np.ndarray)
        wire.put_array(self._db, self._put_key("tensor", name), data)

    @command
    def get_tensor(self, name: str) -> np.ndarray:
        """Get a tensor from the database

        The key the tensor is read from may be formed by applying a prefix to the supplied name;
        see ``set_data_source()`` and ``use_tensor_ensemble_prefix()``.

        :param name: name the tensor is stored at
        :type name: str
        :return: a new numpy array holding the tensor's data
        :rtype: np.ndarray
        :raises RedisKeyError: if there is no tensor at that name
        :raises RedisReplyError: if the get fails
        """
        typecheck(name, "name", str)
        return wire.get_array(self._db, self._get_key("tensor", name))

    @command
    def unpack_tensor(self, name: str, out_array: np.ndarray) -> None:
        """Read a tensor from the database into a caller-provided array

        The data are received straight into ``out_array`` (no intermediate copy), which must have
        the tensor's dtype and shape and be C-contiguous and writeable.

        :param name: name the tensor is stored at
        :type name: str
        :param out_array: the array to fill
        :type out_array: np.ndarray
        :raises TypeError: if an argument has the wrong type
        :raises RedisKeyError: if there is no tensor at that name
        :raises RedisRuntimeError: if the dtype or shape differ, or the array is not C-contiguous
            and writeable
        """
        typecheck(name, "name", str)
        typecheck(out_array, "out_array", np.ndarray)
        wire.get_array(self._db, self._get_key("tensor", name), out_array)

    @command
    def delete_tensor(self, name: str) -> None:
        """Delete a tensor from the database

        The key may be formed by applying a prefix to the supplied name; see
        ``set_data_source()`` and ``use_tensor_ensemble_prefix()``.

        Deleting a name that holds no tensor does nothing, as in SmartRedis (whose clients send
        ``UNLINK``).

        :param name: name the tensor is stored at
        :type name: str
        :raises RedisReplyError: if the deletion fails
        """
        typecheck(name, "name", str)
        wire.delete_value(self._db, self._get_key("tensor", name))

    @command
    def copy_tensor(self, src_name: str, dest_name: str) -> None:
        """Copy a tensor at one name to another name

        The source is read with the read prefix and the copy written with the write prefix; see
        ``set_data_source()`` and ``use_tensor_ensemble_prefix()``.

        :param src_name: name of the tensor to copy
        :type src_name: str
        :param dest_name: name to store the copy at
        :type dest_name: str
        :raises RedisKeyError: if there is no tensor at ``src_name``
        :raises RedisReplyError: if the copy fails
        """
        typecheck(src_name, "src_name", str)
        typecheck(dest_name, "dest_name", str)
        array = wire.get_array(self._db, self._get_key("tensor", src_name))
        wire.put_array(self._db, self._put_key("tensor", dest_name), array)

    @command
    def rename_tensor(self, old_name: str, new_name: str) -> None:
        """Rename a tensor in the database

        :param old_name: current name of the tensor
        :type old_name: str
        :param new_name: new name for the tensor
        :type new_name: str
        :raises RedisKeyError: if there is no tensor at ``old_name``
        :raises RedisReplyError: if the rename fails
        """
        self.copy_tensor(old_name, new_name)
        wire.delete_value(self._db, self._get_key("tensor", old_name))

    @command
    def tensor_exists(self, name: str) -> bool:
        """Check whether a tensor exists in the database

        The key may be formed by applying a prefix to the supplied name; see
        ``set_data_source()`` and ``use_tensor_ensemble_prefix()``.

        :param name: name the tensor would be stored at
        :type name: str
        :return: whether the tensor exists
        :rtype: bool
        :raises RedisReplyError: if the check fails
        """
        typecheck(name, "name", str)
        return bool(self._db.redis.exists(self._get_key("tensor", name)))

    def poll_tensor(self, name: str, poll_frequency_ms: int, num_tries: int) -> bool:
        """Wait for a tensor to exist in the database

        :param name: name the tensor would be stored at
        :type name: str
        :param poll_frequency_ms: milliseconds between checks
        :type poll_frequency_ms: int
        :param num_tries: how many times to check
        :type num_tries: int
        :return: whether the tensor was found
        :rtype: bool
        :raises RedisReplyError: if a check fails
        """
        return poll(lambda: self.tensor_exists(name), poll_frequency_ms, num_tries)
