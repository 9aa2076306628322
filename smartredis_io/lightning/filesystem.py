"""``redis://`` as an fsspec filesystem, so that Lightning's ``ModelCheckpoint`` can list, check and remove
checkpoints kept by :class:`smartredis_io.SmartRedisCheckpointIO`.

``redis://run1/epoch=3.ckpt`` is the value at key ``run1/epoch=3.ckpt``; a "directory" is a key
prefix ending in ``/``. The filesystem connects the way a SmartRedis client does (``SSDB``,
``SR_DB_TYPE``, ``SR_USERNAME``, ``SR_PASSWORD``, ``SR_TLS``...), or to ``address`` when fsspec is
given one (``fsspec.filesystem("redis", address=...)`` or ``FSSPEC_REDIS_ADDRESS``).

Importing this module registers the protocol (the ``fsspec.specs`` entry point of the distribution
does it without an import).
"""

from __future__ import annotations

import datetime
import io
import os
import re
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem
from redis.cluster import RedisCluster

from smartredis_io._client import wire
from smartredis_io._client.connection import ConnectionSettings, Database, detect_cluster
from smartredis_io.configoptions import ConfigOptions
from smartredis_io.error import RedisKeyError

__all__ = ["PROTOCOL", "RedisFileSystem", "url_key"]

PROTOCOL = "redis"
_PREFIXES = (f"{PROTOCOL}://", f"{PROTOCOL}:/")  # the second: a URL after os.path.normpath
SCAN_COUNT = 1000


def url_key(url: str) -> str:
    """The key of a ``redis://name/...`` URL (``ValueError`` when it has none)."""
    for prefix in _PREFIXES:
        if url.startswith(prefix):
            key = url[len(prefix):].lstrip("/")
            if not key:
                raise ValueError(f"{url!r} names no key")
            return key
    raise ValueError(f"{url!r} is not a {PROTOCOL}:// URL")


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def keys_under(db: Database, prefix: str) -> list[str]:
    """Every key that starts with ``prefix``, sorted (on every primary of a cluster)."""
    return keys_matching(db, _glob_escape(prefix) + "*")


def keys_matching(db: Database, match: str) -> list[str]:
    """Every key that the glob-style pattern ``match`` matches, sorted (on every primary of a cluster)."""
    client = db.redis
    if isinstance(client, RedisCluster):
        found = client.scan_iter(match=match, count=SCAN_COUNT, target_nodes=RedisCluster.PRIMARIES)
    else:
        found = client.scan_iter(match=match, count=SCAN_COUNT)
    return sorted({k.decode() if isinstance(k, bytes) else k for k in found})


class RedisFileSystem(AbstractFileSystem):
    """Keys of a Redis database (standalone or cluster) seen as files.

    Args:
        address: the database (default ``SSDB``); may carry credentials (``redis://user:pw@host:port``).
        cluster: whether it is a Redis Cluster (default: asked from the server).
        config_options: where credentials, TLS and deadlines come from (default: the environment).
    """

    protocol = (PROTOCOL,)
    root_marker = ""
    cachable = False  # an instance made without arguments follows SSDB as it is when it is made

    def __init__(self, address: str | None = None, cluster: bool | None = None,
                 config_options: ConfigOptions | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.address = address
        self.cluster = cluster
        self.config_options = config_options
        self._db: Database | None = None
        self._pid = 0

    @property
    def db(self) -> Database:
        """One connection per process (re-made after a fork)."""
        if self._db is None or self._pid != os.getpid():
            settings = ConnectionSettings.from_options(self.config_options, address=self.address,
                                                       cluster=bool(self.cluster))
            if self.cluster is None:
                settings = settings.with_(cluster=detect_cluster(settings))
            self._db = Database(settings)
            self._pid = os.getpid()
        return self._db

    @classmethod
    def _strip_protocol(cls, path: str | list[str]) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        for prefix in _PREFIXES:
            if path.startswith(prefix):
                path = path[len(prefix):]
                break
        return path.strip("/")

    def unstrip_protocol(self, name: str) -> str:
        """``redis://<name>`` for a path with or without the protocol."""
        return f"{PROTOCOL}://{self._strip_protocol(name)}"

    def _keys_under(self, prefix: str) -> list[str]:
        return keys_under(self.db, prefix)

    def _file_info(self, key: str, header: wire.Header | None = None) -> dict[str, Any] | None:
        header = header or wire.read_header(self.db, key)
        if header is None:
            return None
        return {"name": key, "type": "file", "size": header.payload_bytes if header.chunks else header.nbytes,
                "mtime": header.written_at}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        """The files (values) and directories (key prefixes) directly under ``path``."""
        path = self._strip_protocol(path)
        single = self._file_info(path) if path else None
        if single is not None:
            return [single] if detail else [path]
        prefix = f"{path}/" if path else ""
        entries: dict[str, dict[str, Any]] = {}
        for key in self._keys_under(prefix):
            child, sep, _ = key[len(prefix):].partition("/")
            name = prefix + child
            if sep:
                entries.setdefault(name, {"name": name, "type": "directory", "size": 0})
            elif name not in entries:
                info = self._file_info(name)
                if info is not None:
                    entries[name] = info
        if not entries:
            raise FileNotFoundError(f"{PROTOCOL}://{path}")
        listing = [entries[name] for name in sorted(entries)]
        return listing if detail else [entry["name"] for entry in listing]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """``name``, ``type`` (file or directory), ``size`` and, for a file, ``mtime``; ``FileNotFoundError`` when nothing is there."""
        path = self._strip_protocol(path)
        if path:
            found = self._file_info(path)
            if found is not None:
                return found
        if not path or self._keys_under(f"{path}/"):
            return {"name": path, "type": "directory", "size": 0}
        raise FileNotFoundError(f"{PROTOCOL}://{path}")

    def modified(self, path: str) -> datetime.datetime:
        """When the value at ``path`` was written."""
        info = self.info(path)
        if info["type"] != "file" or info.get("mtime") is None:
            raise IsADirectoryError(f"{PROTOCOL}://{self._strip_protocol(path)} has no modification time")
        return datetime.datetime.fromtimestamp(info["mtime"], tz=datetime.timezone.utc)

    def rm_file(self, path: str) -> None:
        """Remove the value at ``path`` and its chunks; ``FileNotFoundError`` when there is none."""
        key = self._strip_protocol(path)
        if not wire.delete_value(self.db, key):
            raise FileNotFoundError(f"{PROTOCOL}://{key}")

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """Nothing to do: a directory exists while a key is under it."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Nothing to do: a directory exists while a key is under it."""

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        """The bytes of the value at ``path`` (a slice of them with ``start`` / ``end``)."""
        key = self._strip_protocol(path)
        try:
            data = wire.get_array(self.db, key).tobytes()
        except RedisKeyError:
            raise FileNotFoundError(f"{PROTOCOL}://{key}") from None
        return data[start:end]

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        """Store ``value`` at ``path`` (published whole, as a checkpoint is)."""
        key = self._strip_protocol(path)
        with wire.ChunkedWriter(self.db, key, wire.bulk_limit() - wire.HEADER_MAX_BYTES) as writer:
            writer.write(value)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        if "r" in mode:
            return io.BytesIO(self.cat_file(path))
        return _WriteOnClose(self, path, autocommit)


class _WriteOnClose(io.BytesIO):
    """A file written to the database, in one piece, when closed; inside an fsspec transaction (as
    Lightning's ``TorchCheckpointIO`` saves), when the transaction commits, and never if it is
    discarded."""

    def __init__(self, fs: RedisFileSystem, path: str, autocommit: bool = True) -> None:
        super().__init__()
        self._fs, self._path, self._autocommit = fs, path, autocommit
        self._pending: bytes | None = None

    def close(self) -> None:
        if not self.closed:
            if self._autocommit:
                self._fs.pipe_file(self._path, self.getvalue())
            else:
                self._pending = self.getvalue()
        super().close()

    def commit(self) -> None:
        """Store what was written (fsspec calls it when the transaction the file was opened in commits)."""
        if self._pending is not None:
            data, self._pending = self._pending, None
            self._fs.pipe_file(self._path, data)

    def discard(self) -> None:
        """Drop what was written (the transaction was abandoned)."""
        self._pending = None


fsspec.register_implementation(PROTOCOL, RedisFileSystem, clobber=True)
