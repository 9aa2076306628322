"""The smartredis_io Redis module on a real redis-server: its build and locator, the launchers loading
it, and RedisAI's data commands (arguments, replies and RedisAI's error wording) over smartredis_io's
storage, spoken with plain redis-py as redisai-py and the SmartRedis clients speak them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster as PlainCluster

from smartredis_io import Client, RedisServer
from smartredis_io._client import protocol, wire
from smartredis_io.launchers import redis_module as locator
from tests.support.srio_models import linear, torchscript_bytes

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "smartredis_io" / "redisai"


def _plain(server: RedisServer, **kwargs) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, password=server.settings().password, **kwargs)


@pytest.fixture
def db(redis_server) -> redis.Redis:
    with _plain(redis_server) as client:
        yield client


@pytest.fixture(scope="module")
def chunking_server():
    """A server whose module chunks every value above 4 KiB (as the client does with SRIO_BULK_LIMIT_BYTES)."""
    with RedisServer(module_args=("BULK_LIMIT_BYTES", "4096")) as server:
        yield server


# ---- build, locator, launchers -----------------------------------------------------------------

def test_the_locator_prints_the_module_path() -> None:
    result = subprocess.run([sys.executable, "-m", "smartredis_io.redis_module"], capture_output=True, text=True,
                            check=True)
    path = Path(result.stdout.strip())
    assert path == Path(locator.module_path()) and path.name == locator.MODULE_FILE and path.is_file()


def test_the_locator_prints_only_the_path() -> None:
    """Nothing on stderr (no runpy warning about the module being imported with the package), so the
    output can go straight into ``--loadmodule``."""
    result = subprocess.run([sys.executable, "-W", "always", "-m", "smartredis_io.redis_module"],
                            capture_output=True, text=True, check=True)
    assert result.stderr == ""
    assert result.stdout == locator.module_path() + "\n"


def test_the_locator_prints_what_a_command_line_or_redis_conf_needs_for_this_interpreter(
        tmp_path, monkeypatch, capsys) -> None:
    """``--args`` follows the path on a command line; ``--conf`` is a whole redis.conf line, any path quoted."""
    result = subprocess.run([sys.executable, "-m", "smartredis_io.redis_module", "--args"], capture_output=True,
                            text=True, check=True)
    assert result.stdout == f"WORKER_PYTHON {sys.executable}\n" and result.stderr == ""
    spaced = '/opt/a "quoted" dir\\with/python3'
    monkeypatch.setattr(sys, "executable", spaced)
    assert locator.main(["--args"]) == 1, "a command line would split the path"
    assert "--conf" in capsys.readouterr().err
    assert locator.main(["--conf"]) == 0
    conf = capsys.readouterr().out
    (tmp_path / "redis.conf").write_text(conf.rstrip("\n") + ' "WORKERS" "0"\n')  # no worker for this check
    with RedisServer(module=False, extra_args=("--include", str(tmp_path / "redis.conf"))) as server, \
            _plain(server) as plain:
        (module,) = plain.execute_command("MODULE", "LIST")
    assert module[b"path"].decode() == locator.module_path()
    assert module[b"args"] == [b"WORKER_PYTHON", spaced.encode(), b"WORKERS", b"0"]


def test_a_missing_module_is_a_clear_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(locator.MODULE_ENV, str(tmp_path / "nowhere.so"))
    result = subprocess.run([sys.executable, "-m", "smartredis_io.redis_module"], capture_output=True, text=True)
    assert result.returncode == 1 and "make setup" in result.stderr and "nowhere.so" in result.stderr
    with pytest.raises(locator.RedisModuleNotFoundError, match=r"nowhere\.so.*make setup"):
        RedisServer()


def test_redis_server_loadmodule_with_the_printed_path(tmp_path) -> None:
    """What a user running their own redis-server does."""
    path = subprocess.run([sys.executable, "-m", "smartredis_io.redis_module"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with RedisServer(module=False, extra_args=("--loadmodule", path)) as server, _plain(server) as plain:
        assert plain.execute_command("AI.TENSORSET", "x", "INT8", 2, "VALUES", 1, 2) == b"OK"
        assert [m[b"name"] for m in plain.module_list()] == [b"srio"]


def test_a_plain_redis_has_no_ai_commands_and_smartredis_io_still_works(uid: str) -> None:
    with RedisServer(module=False) as server, _plain(server) as plain, Client(False, server.address) as client:
        with pytest.raises(redis.ResponseError, match="unknown command 'AI.TENSORSET'"):
            plain.execute_command("AI.TENSORSET", "x", "INT8", 1, "VALUES", 1)
        client.put_tensor(uid, np.arange(3, dtype=np.int16))
        np.testing.assert_array_equal(client.get_tensor(uid), np.arange(3, dtype=np.int16))


def test_the_module_uses_only_apis_of_the_redis_server_it_runs_on() -> None:
    """Every RedisModule_* function the sources call is one this redis-server exports (CI: Debian's 7.0.15):
    a missing one would be a NULL pointer at the first call, not an error at load."""
    binary = Path(shutil.which("redis-server") or "")
    exported = set(re.findall(rb"RedisModule_[A-Za-z0-9_]+", binary.read_bytes()))
    used = {name.encode() for source in SOURCES.glob("*.c")
            for name in re.findall(r"RedisModule_[A-Za-z0-9_]+", source.read_text())}
    missing = sorted(used - exported - {b"RedisModule_Init", b"RedisModule_OnLoad"})
    assert not missing, f"{binary} does not export {missing}"


def _build_script():
    spec = importlib.util.spec_from_file_location("srio_build", SOURCES / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare --net (root)")
def test_the_module_builds_without_network_and_warnings(tmp_path, monkeypatch) -> None:
    """The pinned header is in the repository; the build (-Wall -Wextra -Werror) runs where no network is."""
    build = _build_script()
    assert build.check_header() == SOURCES / "redismodule.h"
    assert {"-Wall", "-Wextra", "-Werror"} <= set(build.CFLAGS)
    out = tmp_path / "srio.so"
    subprocess.run(["unshare", "--net", sys.executable, str(SOURCES / "build.py"), "--out", str(out)], check=True,
                   capture_output=True)
    assert out.is_file() and build.build(out) == out and build._up_to_date(out, build.command(out))
    binary = out.read_bytes()  # what a wheel ships: no path of the machine it was built on
    for where in (build.ROOT, tmp_path, Path.cwd()):
        assert str(where).encode() not in binary, where
    # another compiler command builds again
    monkeypatch.setenv("CFLAGS", "-DSRIO_OTHER_FLAGS")
    assert not build._up_to_date(out, build.command(out))
    monkeypatch.delenv("CFLAGS")
    monkeypatch.setenv("CC", "cc -DSRIO_OTHER_COMPILER")
    assert not build._up_to_date(out, build.command(out))


def test_a_changed_header_is_refused(tmp_path, monkeypatch) -> None:
    build = _build_script()
    header = tmp_path / "redismodule.h"
    header.write_bytes((SOURCES / "redismodule.h").read_bytes() + b"\n")
    monkeypatch.setattr(build, "HEADER", header)
    with pytest.raises(SystemExit, match="SHA-256"):
        build.check_header()


# ---- tensors -------------------------------------------------------------------------------------

DTYPES = {"DOUBLE": "<f8", "FLOAT": "<f4", "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
          "UINT8": "u1", "UINT16": "<u2", "BOOL": "?", "FLOAT16": "<f2"}


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_tensorset_blob_is_read_by_smartredis_io_and_back(db, redis_server, uid: str, name: str) -> None:
    array = (np.arange(6) % 2 if name == "BOOL" else np.arange(6) - 2).astype(DTYPES[name]).reshape(2, 3)
    assert db.execute_command("AI.TENSORSET", uid, name, 2, 3, "BLOB", array.tobytes()) == b"OK"
    with Client(False, redis_server.address) as client:
        np.testing.assert_array_equal(client.get_tensor(uid), array)
        client.put_tensor(uid + "b", array[::-1])
    reply = db.execute_command("AI.TENSORGET", uid + "b", "META", "BLOB")
    assert reply[:4] == [b"dtype", name.encode(), b"shape", [2, 3]] and reply[4] == b"blob"
    np.testing.assert_array_equal(np.frombuffer(reply[5], DTYPES[name]).reshape(2, 3), array[::-1])


def _floats(values: list) -> list[float]:
    """Doubles as RESP2 (bulk strings) or RESP3 (doubles) gives them."""
    return [float(v) for v in values]


def test_tensorset_values_and_tensorget_values(db, uid: str) -> None:
    db.execute_command("AI.TENSORSET", uid, "FLOAT", 2, "VALUES", 1.5, -2)
    assert _floats(db.execute_command("AI.TENSORGET", uid, "VALUES")) == [1.5, -2]
    assert db.execute_command("AI.TENSORGET", uid, "META") == [b"dtype", b"FLOAT", b"shape", [2]]
    db.execute_command("AI.TENSORSET", uid, "INT16", 3, "VALUES", -32768, 0, 32767)
    assert db.execute_command("AI.TENSORGET", uid, "META", "VALUES") == [b"dtype", b"INT16", b"shape", [3],
                                                                          b"values", [-32768, 0, 32767]]
    db.execute_command("AI.TENSORSET", uid, "BFLOAT16", 2, "VALUES", 1.0, 3.140625)
    assert _floats(db.execute_command("AI.TENSORGET", uid, "VALUES")) == [1, 3.140625]
    db.execute_command("AI.TENSORSET", uid, "FLOAT16", 2, "VALUES", 65504, 1e-7)
    assert _floats(db.execute_command("AI.TENSORGET", uid, "VALUES")) == [65504, float(np.float16(1e-7))]
    db.execute_command("AI.TENSORSET", uid, "INT32", 2, 2)  # no data: zeros
    assert db.execute_command("AI.TENSORGET", uid, "VALUES") == [0, 0, 0, 0]


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,) * 32])
def test_zero_dimensional_and_empty_tensors(db, redis_server, uid: str, shape) -> None:
    array = np.full(shape, 7, dtype=np.int64)
    bigger = np.asarray(array + 1)
    db.execute_command("AI.TENSORSET", uid, "INT64", *shape, "BLOB", array.tobytes())
    with Client(False, redis_server.address) as client:
        got = client.get_tensor(uid)
        assert got.shape == shape
        np.testing.assert_array_equal(got, array)
        client.put_tensor(uid, bigger)
    assert db.execute_command("AI.TENSORGET", uid, "META", "BLOB") == [
        b"dtype", b"INT64", b"shape", list(shape), b"blob", bigger.tobytes()]


@pytest.mark.parametrize("command, error", [
    (("AI.TENSORSET", "{k}", "FLOAT"), "wrong number of arguments for 'ai.tensorset' command"),
    (("AI.TENSORSET", "{k}", "COMPLEX", 1, "VALUES", 1), "invalid data type"),
    (("AI.TENSORSET", "{k}", "STRING", 1, "VALUES", "a"), "invalid data type: STRING tensors are not supported"),
    (("AI.TENSORSET", "{k}", "FLOAT", -1, "VALUES", 1), "invalid or negative value found in tensor shape"),
    (("AI.TENSORSET", "{k}", "FLOAT", "two", "VALUES", 1), "invalid or negative value found in tensor shape"),
    (("AI.TENSORSET", "{k}", "FLOAT", 2, "BLOB", b"\0" * 7), "data length does not match tensor shape and type"),
    (("AI.TENSORSET", "{k}", "FLOAT", 2, "BLOB", b"", b""), "a single binary string should come after the BLOB"),
    (("AI.TENSORSET", "{k}", "FLOAT", 2, "VALUES", 1), "wrong number of values was given in 'AI.TENSORSET'"),
    (("AI.TENSORSET", "{k}", "INT8", 1, "VALUES", 128), "invalid value"),
    (("AI.TENSORSET", "{k}", "FLOAT", 1, "VALUES", "x"), "invalid value"),
    (("AI.TENSORSET", "{k}", "BOOL", 2, "BLOB", b"\0\2"), "BOOL tensor elements must be 0 or 1"),
    (("AI.TENSORSET", "{k}", "FLOAT", *[1] * 33, "VALUES", 1), "more than 32 dimensions"),
    (("AI.TENSORGET", "{k}missing"), "tensor key is empty or in a different shard"),
    (("AI.TENSORGET", "{k}list"), "WRONGTYPE"),
    (("AI.TENSORGET", "{k}string"), "WRONGTYPE"),
    (("AI.TENSORSET", "{k}string", "FLOAT", 1, "VALUES", 1), "WRONGTYPE"),
    (("AI.TENSORGET", "{k}t", "PICKLE"), "unsupported data format"),
    (("AI.TENSORGET", "{k}t", "BLOB", "VALUES"), "both BLOB and VALUES specified"),
    (("AI.TENSORGET", "{k}t", "META", "BLOB", "VALUES", "META"), "wrong number of arguments"),
])
def test_tensor_errors_are_redisais(db, uid: str, command, error: str) -> None:
    db.rpush(f"{{k}}list{uid}", "x")
    db.set(f"{{k}}string{uid}", "not a tensor")
    db.execute_command("AI.TENSORSET", f"{{k}}t{uid}", "FLOAT", 1, "VALUES", 1)
    with pytest.raises(redis.ResponseError, match=re.escape(error)):
        db.execute_command(command[0], command[1] + uid if command[0].startswith("AI.") else command[1], *command[2:])


def test_chunked_values_both_ways(chunking_server, uid: str, monkeypatch) -> None:
    big = np.arange(5000, dtype=np.float64)  # 40 KB: 10 chunks of 4 KiB
    with _plain(chunking_server) as plain, Client(False, chunking_server.address) as client:
        plain.execute_command("AI.TENSORSET", uid, "DOUBLE", big.size, "BLOB", big.tobytes())
        header = wire.decode_header(plain.getrange(uid, 0, wire.HEADER_MAX_BYTES - 1), uid)
        assert header.chunks == 10 and header.crc == zlib.crc32(big.tobytes())
        assert len(plain.keys(f"{{{uid}}}.chunk.*")) == 10
        np.testing.assert_array_equal(client.get_tensor(uid), big)

        plain.execute_command("AI.TENSORSET", uid, "DOUBLE", 2, "VALUES", 1, 2)  # replaced: its chunks go
        assert plain.keys(f"{{{uid}}}.chunk.*") == []

        monkeypatch.setenv(wire.BULK_LIMIT_ENV, "1000")
        client.put_tensor(uid + "p", big)  # chunked by the client
        assert wire.read_header(client._db, uid + "p").chunks == 40
        reply = plain.execute_command("AI.TENSORGET", uid + "p", "BLOB")
        np.testing.assert_array_equal(np.frombuffer(reply, np.float64), big)

        chunk = wire.read_header(client._db, uid + "p").chunk_keys(uid + "p")[3]
        plain.setrange(chunk, 0, b"\xff")  # a flipped byte
        with pytest.raises(redis.ResponseError, match="corrupt: its chunks do not match their checksum"):
            plain.execute_command("AI.TENSORGET", uid + "p", "BLOB")
        plain.delete(chunk)
        with pytest.raises(redis.ResponseError, match="chunk 3 does not exist"):
            plain.execute_command("AI.TENSORGET", uid + "p", "BLOB")


def test_a_forged_header_costs_what_is_stored(db, uid: str) -> None:
    forged = wire.encode_header(1, (1 << 40,), chunks=1 << 19, crc=0, payload=8 << 40, version="00" * 16)
    db.set(uid, forged)
    with pytest.raises(redis.ResponseError, match="does not exist"):
        db.execute_command("AI.TENSORGET", uid, "BLOB")
    db.set(uid, wire.encode_header(1, (1 << 40,)) + b"\0" * 8)
    with pytest.raises(redis.ResponseError, match="header claims 8796093022208 bytes of data but 8 are stored"):
        db.execute_command("AI.TENSORGET", uid, "BLOB")


def test_tensorset_clears_an_expiry_as_set_does(db, uid: str) -> None:
    db.set(uid, wire.encode_header(7, (1,)) + b"\1", px=60_000)
    db.execute_command("AI.TENSORSET", uid, "UINT8", 1, "VALUES", 2)
    assert db.pttl(uid) == -1


# ---- models and scripts --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    import torch

    return torchscript_bytes(linear(1), torch.ones(2, 4))


def test_modelstore_is_smartredis_ios_model(db, redis_server, uid: str, model_bytes: bytes) -> None:
    half = len(model_bytes) // 2
    assert db.execute_command("AI.MODELSTORE", uid, "TORCH", "gpu:1", "TAG", "v1", "BATCHSIZE", 8, "MINBATCHSIZE",
                              2, "MINBATCHTIMEOUT", 5, "BLOB", model_bytes[:half], model_bytes[half:]) == b"OK"
    manifest = protocol.parse(db.get(uid))
    assert (manifest.kind, manifest.backend, manifest.device, manifest.tag, manifest.batch_size,
            manifest.min_batch_size, manifest.min_batch_timeout) == ("model", "TORCH", "GPU:1", "v1", 8, 2, 5)
    assert db.get(uid).startswith(protocol.MANIFEST_PREFIX) and len(manifest.version) == 32
    with Client(False, redis_server.address) as client:
        assert client.get_model(uid) == model_bytes
        client.set_model(uid + "s", model_bytes, "TORCH", "CPU", tag="mine")
    assert db.execute_command("AI.MODELGET", uid + "s", "META") == [
        b"backend", b"TORCH", b"device", b"CPU", b"tag", b"mine", b"batchsize", 0, b"minbatchsize", 0,
        b"inputs", [], b"outputs", [], b"minbatchtimeout", 0]
    assert db.execute_command("AI.MODELGET", uid + "s", "BLOB") == model_bytes
    assert db.execute_command("AI.MODELGET", uid + "s")[-2:] == [b"blob", model_bytes]


def test_a_model_stored_again_replaces_its_blob(db, uid: str, model_bytes: bytes) -> None:
    db.execute_command("AI.MODELSTORE", uid, "TORCH", "CPU", "BLOB", model_bytes)
    first = protocol.blob_key(uid, protocol.parse(db.get(uid)).version)
    db.execute_command("AI.MODELSTORE", uid, "TORCH", "CPU", "TAG", "2", "BLOB", model_bytes)
    assert not db.exists(first) and db.exists(protocol.blob_key(uid, protocol.parse(db.get(uid)).version))
    assert db.execute_command("AI.MODELDEL", uid) == b"OK"
    assert db.keys(f"*{uid}*") == []


def test_modelget_in_chunks_of_model_chunk_size(db, uid: str, model_bytes: bytes) -> None:
    db.execute_command("AI.MODELSTORE", uid, "TORCH", "CPU", "BLOB", model_bytes)
    try:
        assert db.execute_command("AI.CONFIG", "MODEL_CHUNK_SIZE", 100) == b"OK"
        assert db.execute_command("AI.CONFIG", "GET", "MODEL_CHUNK_SIZE") == 100
        chunks = db.execute_command("AI.MODELGET", uid, "BLOB")
        assert len(chunks) == -(-len(model_bytes) // 100) and b"".join(chunks) == model_bytes
    finally:
        db.execute_command("AI.CONFIG", "MODEL_CHUNK_SIZE", 511 * 1024 * 1024)


@pytest.mark.parametrize("command, error", [
    (("AI.MODELSTORE", "{k}m", "ONNX", "CPU", "BLOB", b"x"), "backend ONNX is not served"),
    (("AI.MODELSTORE", "{k}m", "TF", "CPU", "INPUTS", 1, "a", "OUTPUTS", 1, "b", "BLOB", b"x"),
     "backend TF is not served"),
    (("AI.MODELSTORE", "{k}m", "TFLITE", "CPU", "BLOB", b"x"), "backend TFLITE is not served"),
    (("AI.MODELSTORE", "{k}m", "PYTORCH", "CPU", "BLOB", b"x"), "unsupported backend"),
    (("AI.MODELSTORE", "{k}m", "TORCH", "TPU", "BLOB", b"x"), "Invalid DEVICE"),
    (("AI.MODELSTORE", "{k}m", "TORCH", "GPU:x", "BLOB", b"x"), "Invalid DEVICE"),
    (("AI.MODELSTORE", "{k}m", "TORCH", "CPU", "BATCHSIZE", -1, "BLOB", b"x"), "Invalid argument for BATCHSIZE"),
    (("AI.MODELSTORE", "{k}m", "TORCH", "CPU", "MINBATCHSIZE", 2, "BLOB", b"x"),
     "MINBATCHSIZE specified without BATCHSIZE"),
    (("AI.MODELSTORE", "{k}m", "TORCH", "CPU", "BATCHSIZE", 2, "MINBATCHTIMEOUT", 2, "BLOB", b"x"),
     "MINBATCHTIMEOUT specified without MINBATCHSIZE"),
    (("AI.MODELSTORE", "{k}m", "TORCH", "CPU", "INPUTS", 1, "a", "BLOB", b"x"),
     "INPUTS argument should not be specified for this backend"),
    (("AI.MODELSTORE", "{k}m", "TORCH", "CPU", "TAG", "t"), "Insufficient arguments, missing model BLOB"),
    (("AI.MODELSTORE", "{k}m", "TORCH", "CPU", "SOURCE", b"x"), "Invalid argument, expected BLOB"),
    (("AI.MODELSTORE", "{k}m", "TORCH", "CPU", "BLOB", b"not a zip"), "neither a TorchScript archive"),
    (("AI.MODELSTORE", "{k}t", "TORCH", "CPU", "BLOB", b"PK\x03\x04"), "WRONGTYPE"),
    (("AI.MODELGET", "{k}missing"), "model key is empty"),
    (("AI.MODELGET", "{k}t"), "WRONGTYPE"),
    (("AI.MODELGET", "{k}s"), "WRONGTYPE"),
    (("AI.MODELDEL", "{k}missing"), "model key is empty"),
    (("AI.SCRIPTGET", "{k}m2"), "WRONGTYPE"),
    (("AI.SCRIPTDEL", "{k}missing"), "script key is empty"),
    (("AI.SCRIPTSET", "{k}s", "CPU", "TAG", "t"), "Insufficient arguments, missing script SOURCE"),
    (("AI.SCRIPTSET", "{k}s", "CPU", "SOURCE"), "wrong number of arguments"),
    (("AI.SCRIPTSET", "{k}s", "CPU", "SOURCES", "x", "y", "z"), "missing script SOURCE"),
    (("AI.SCRIPTSTORE", "{k}s", "CPU", "ENTRY_POINTS", "x", "f", "SOURCE", "def f(x):\n  return x"),
     "Non numeric entry points number"),
    (("AI.SCRIPTSTORE", "{k}s", "CPU", "ENTRY_POINTS", 1, "g", "SOURCE", "def f(x):\n  return x"),
     "entry point 'g' is not a function the script defines"),
    (("AI.SCRIPTSTORE", "{k}s", "CPU", "TAG", "t", "SOURCE", "def f(x):\n  return x", "x"),
     "missing script entry points"),
    (("AI.INFO", "{k}missing"), "cannot find run info for key"),
    (("AI.CONFIG", "LOADBACKEND", "ONNX", "/x/backends/redisai_onnxruntime.so"), "backend ONNX is not served"),
    (("AI.CONFIG", "MODEL_CHUNK_SIZE", 0), "MODEL_CHUNK_SIZE: invalid chunk size"),
    (("AI.CONFIG", "SHOUT"), "unsupported subcommand"),
])
def test_model_and_script_errors_are_redisais(db, uid: str, model_bytes: bytes, command, error: str) -> None:
    db.execute_command("AI.TENSORSET", f"{{k}}t{uid}", "FLOAT", 1, "VALUES", 1)
    db.execute_command("AI.SCRIPTSET", f"{{k}}s{uid}", "CPU", "SOURCE", "def f(x):\n    return x\n")
    db.execute_command("AI.MODELSTORE", f"{{k}}m2{uid}", "TORCH", "CPU", "BLOB", model_bytes)
    args = [command[1] + uid if command[1].startswith("{k}") else command[1], *command[2:]]
    with pytest.raises(redis.ResponseError, match=re.escape(error)):
        db.execute_command(command[0], *args)
    assert not db.exists(f"{{k}}m{uid}")


def test_scripts_set_and_stored_are_smartredis_ios(db, redis_server, uid: str) -> None:
    source = "def double(x):\n    return x * 2\n\ndef add(a, b):\n    return a + b\n"
    db.execute_command("AI.SCRIPTSTORE", uid, "cpu", "TAG", "t", "ENTRY_POINTS", 2, "double", "add", "SOURCE", source)
    with Client(False, redis_server.address) as client:
        assert client.get_script(uid) == source
        client.set_script(uid + "p", source)
    assert db.execute_command("AI.SCRIPTGET", uid + "p", "SOURCE") == source.encode()
    assert db.execute_command("AI.SCRIPTGET", uid, "META") == [b"device", b"CPU", b"tag", b"t", b"Entry Points",
                                                               [b"double", b"add"]]
    assert db.execute_command("AI.SCRIPTGET", uid)[-2:] == [b"source", source.encode()]
    assert protocol.parse(db.get(uid)).kind == "script"
    assert db.execute_command("AI.SCRIPTDEL", uid) == b"OK" and db.keys(f"*{{{uid}}}*") == []


def test_ai_info_and_config(db, uid: str, model_bytes: bytes) -> None:
    db.execute_command("AI.MODELSTORE", uid, "TORCH", "CPU", "TAG", "v2", "BLOB", model_bytes)
    info = db.execute_command("AI.INFO", uid)
    assert dict(zip(info[0::2], info[1::2], strict=True)) == {
        b"key": uid.encode(), b"type": b"MODEL", b"backend": b"TORCH", b"device": b"CPU", b"tag": b"v2",
        b"duration": 0, b"samples": 0, b"calls": 0, b"errors": 0}
    assert db.execute_command("AI.INFO", uid, "RESETSTAT") == b"OK"
    db.execute_command("AI.SCRIPTSET", uid + "s", "CPU", "SOURCE", "def f(x):\n    return x\n")
    assert db.execute_command("AI.INFO", uid + "s")[13] == -1  # samples: none for a script, as RedisAI
    assert db.execute_command("AI.CONFIG", "LOADBACKEND", "TORCH", "redisai_torch/redisai_torch.so") == b"OK"
    assert db.execute_command("AI.CONFIG", "BACKENDSPATH", "/usr/lib/redis/modules/backends") == b"OK"
    assert db.execute_command("AI.CONFIG", "GET", "BACKENDSPATH") == b"/usr/lib/redis/modules/backends"
    assert db.execute_command("AI.CONFIG", "GET", "THREADS_PER_QUEUE") is None


def test_a_manifest_written_by_smartredis_io_with_unicode_is_read(db, redis_server, uid: str,
                                                                   model_bytes: bytes) -> None:
    with Client(False, redis_server.address) as client:
        client.set_model(uid, model_bytes, "TORCH", "CPU", tag='ünï "côde" 🚀\n')
    assert db.execute_command("AI.MODELGET", uid, "META")[5] == 'ünï "côde" 🚀\n'.encode()
    db.execute_command("AI.MODELSTORE", uid, "TORCH", "CPU", "TAG", 'ünï "côde" 🚀\n', "BLOB", model_bytes)
    assert json.loads(db.get(uid))["tag"] == 'ünï "côde" 🚀\n'
    with pytest.raises(redis.ResponseError, match="must be UTF-8 text"):
        db.execute_command("AI.MODELSTORE", uid, "TORCH", "CPU", "TAG", b"\xff", "BLOB", model_bytes)


def test_an_alias_is_read_only_with_read_access_to_its_target(redis_server, uid: str, model_bytes: bytes) -> None:
    """A manifest forged to name another key as its blob does not read that key for a user who may not."""
    with _plain(redis_server) as admin:
        admin.execute_command("AI.MODELSTORE", f"secret{uid}", "TORCH", "CPU", "BLOB", model_bytes)
        secret_blob = protocol.blob_key(f"secret{uid}", protocol.parse(admin.get(f"secret{uid}")).version)
        forged = protocol.Manifest("model", protocol.new_version(), blob=secret_blob)
        admin.set(f"mine{uid}", json.dumps(forged.__dict__))
        admin.acl_setuser(f"u{uid}", enabled=True, passwords=[f"+pw{uid}"], keys=[f"mine{uid}*"],
                          commands=["+ai.modelget"])
        assert admin.execute_command("AI.MODELGET", f"mine{uid}", "BLOB") == model_bytes  # a user who may read it
    with redis.Redis(host="127.0.0.1", port=redis_server.port, username=f"u{uid}", password=f"pw{uid}") as user:
        with pytest.raises(redis.exceptions.NoPermissionError, match="alias points to"):
            user.execute_command("AI.MODELGET", f"mine{uid}", "BLOB")
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.execute_command("AI.MODELGET", f"secret{uid}", "BLOB")


# ---- ACL and cluster routing ---------------------------------------------------------------------

def test_key_specs_give_acl_the_keys(redis_server, uid: str) -> None:
    with _plain(redis_server) as admin:
        admin.acl_setuser(f"r{uid}", enabled=True, passwords=[f"+pw{uid}"], keys=[f"%R~{uid}*", f"%W~{uid}w*"],
                          commands=["+ai.tensorset", "+ai.tensorget", "+ai.modelstore", "+ai.modeldel"])
        admin.execute_command("AI.TENSORSET", uid, "INT8", 1, "VALUES", 1)
    with redis.Redis(host="127.0.0.1", port=redis_server.port, username=f"r{uid}", password=f"pw{uid}") as user:
        assert user.execute_command("AI.TENSORGET", uid, "VALUES") == [1]
        assert user.execute_command("AI.TENSORSET", uid + "w", "INT8", 1, "VALUES", 2) == b"OK"  # write only
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.execute_command("AI.TENSORSET", uid, "INT8", 1, "VALUES", 2)
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.execute_command("AI.TENSORGET", "elsewhere")
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.execute_command("AI.MODELDEL", uid)


def test_cluster_routes_the_ai_commands(redis_cluster, uid: str) -> None:
    nodes = [redis.Redis(host="127.0.0.1", port=port, password=redis_cluster.settings().password)
             for port in redis_cluster.ports]
    with PlainCluster(host="127.0.0.1", port=redis_cluster.ports[0], password=redis_cluster.settings().password) as cl:
        slot = cl.keyslot(uid)
        assert cl.execute_command("AI.TENSORSET", uid, "INT8", 1, "VALUES", 3) == b"OK"
        node = cl.get_node_from_key(uid)
        others = [n for n, port in zip(nodes, redis_cluster.ports, strict=True) if port != node.port]
        with pytest.raises(redis.exceptions.ResponseError) as moved:
            others[0].execute_command("AI.TENSORGET", uid, "VALUES")
        assert f"{slot} 127.0.0.1:{node.port}" in str(moved.value)
    for n in nodes:
        n.close()
