"""A SmartRedis program: every public name of SmartRedis 0.6.1's Python package, normal and bad input.

It imports ``smartredis`` as any SmartRedis program does; the test runs it with that name bound to
``smartredis_io`` (what ``import smartredis_io as smartredis`` does for the package, extended to its
modules), unchanged. The database comes from ``SSDB`` / ``SR_DB_TYPE`` (as SmartSim sets them), with
execution workers attached. ``main(tag)`` puts every key under ``tag`` and ends with ``flush_db``.
"""

from __future__ import annotations

import inspect
import io
import os
import tempfile
import warnings

import numpy as np
import smartredis
import torch
from smartredis import (
    Client,
    ConfigOptions,
    Dataset,
    DatasetConverter,
    LLDebug,
    LLDeveloper,
    LLInfo,
    LLQuiet,
    LogContext,
    SRObject,
    configoptions,
    dataset_utils,
    log_data,
    log_error,
    log_warning,
)
from smartredis.error import (
    RedisBadAllocError,
    RedisConnectionError,
    RedisDatabaseError,
    RedisInternalError,
    RedisKeyError,
    RedisReplyError,
    RedisRuntimeError,
    RedisTimeoutError,
)
from smartredis.util import Dtypes, exception_handler, init_default, typecheck

DTYPES = (np.float64, np.float32, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16)
SCRIPT = """
def one_to_one(data):
    return data.max(1)[0]

def two_to_one(data, data_2):
    merged = torch.cat((data, data_2))
    return merged.max(1)[0]
"""


def expect(error: type[BaseException], call, *args, **kwargs) -> BaseException:
    """Call and require ``error``: the bad-input half of each check."""
    try:
        call(*args, **kwargs)
    except error as exc:
        return exc
    raise AssertionError(f"{getattr(call, '__name__', call)}{args} did not raise {error.__name__}")


def one_to_one(data):
    return data.max(1)[0]


def bad_function(data):
    return False


def torch_cnn() -> bytes:
    """SmartRedis' test model: a conv net, TorchScript."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3), torch.nn.ReLU()).eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.trace(net, torch.rand(1, 1, 3, 3)), buffer)
    return buffer.getvalue()


def exported_linear() -> bytes:
    torch.manual_seed(1)
    program = torch.export.export(torch.nn.Linear(4, 2).eval(), (torch.zeros(2, 4),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def construction(tag: str) -> Client:
    address, cluster = os.environ["SSDB"], os.environ["SR_DB_TYPE"] == "Clustered"
    for args, kwargs in [((None,), {"logger_name": tag}), ((), {}), ((cluster, address), {}),
                         ((), {"cluster": cluster, "address": address, "logger_name": "x"}),
                         ((ConfigOptions.create_from_environment(""), "x"), {})]:
        client = Client(*args, **kwargs)
        assert str(client) != repr(client) and address.split(",")[0] in str(client) or cluster
    expect(TypeError, Client, 42)
    expect(TypeError, Client, False, address, bogus=1)
    opts = ConfigOptions.create_from_environment("")
    opts.override_string_option("SSDB", "127.0.0.1:1")
    opts.override_integer_option("SR_CONN_TIMEOUT", 1)
    expect(RedisConnectionError, Client, opts)
    return Client(None, logger_name=tag)


def tensors(c: Client, tag: str) -> None:
    for dtype in DTYPES:
        for shape in ((10,), (4, 5), (2, 3, 4)):
            data = (np.random.default_rng(1).random(shape) * 100).astype(dtype)
            c.put_tensor(f"{tag}.t", data)
            back = c.get_tensor(f"{tag}.t")
            assert back.dtype == data.dtype and np.array_equal(back, data)
    view = np.arange(20.0).reshape(4, 5)[:, ::2]
    c.put_tensor(f"{tag}.view", view)
    assert np.array_equal(c.get_tensor(f"{tag}.view"), view)
    out = np.empty_like(view)
    c.unpack_tensor(f"{tag}.view", np.ascontiguousarray(out))
    c.copy_tensor(f"{tag}.t", f"{tag}.copied")
    assert c.key_exists(f"{tag}.t") and c.key_exists(f"{tag}.copied")
    c.rename_tensor(f"{tag}.copied", f"{tag}.renamed")
    assert not c.tensor_exists(f"{tag}.copied") and c.tensor_exists(f"{tag}.renamed")
    assert c.poll_tensor(f"{tag}.renamed", 10, 2) and not c.poll_tensor(f"{tag}.none", 10, 2)
    assert c.poll_key(f"{tag}.renamed", 10, 2) and not c.poll_key(f"{tag}.none", 10, 2)
    c.delete_tensor(f"{tag}.renamed")
    assert not c.key_exists(f"{tag}.renamed")
    # bad input
    expect(TypeError, c.put_tensor, 42, np.zeros(2))
    expect(TypeError, c.put_tensor, f"{tag}.x", [1, 2, 3])
    expect(TypeError, c.put_tensor, f"{tag}.x", np.zeros(2, np.uint64))
    expect(RedisReplyError, c.get_tensor, f"{tag}.not-a-key")
    expect(RedisKeyError, c.get_tensor, f"{tag}.not-a-key")
    for call in (c.get_tensor, c.delete_tensor, c.tensor_exists, c.key_exists):
        expect(TypeError, call, 42)
    expect(TypeError, c.copy_tensor, 42, "x")
    expect(TypeError, c.rename_tensor, "x", 42)
    expect(RedisReplyError, c.rename_tensor, f"{tag}.not-a-key", f"{tag}.still-not")
    expect(RedisReplyError, c.copy_tensor, f"{tag}.not-a-key", f"{tag}.still-not")
    c.delete_tensor(f"{tag}.not-a-key")  # SmartRedis sends UNLINK: no tensor there, no error
    expect(TypeError, c.poll_tensor, f"{tag}.t", "bogus", 2)
    expect(TypeError, c.poll_key, f"{tag}.t", 10, "bogus")
    expect(RedisRuntimeError, c.unpack_tensor, f"{tag}.t", np.empty(3))


def make_dataset(name: str) -> Dataset:
    dataset = Dataset(name)
    dataset.add_tensor("test_array", np.array([1, 2, 3, 4]))
    dataset.add_meta_string("test_string", "test_meta_strings")
    dataset.add_meta_scalar("test_scalar", 7)
    return dataset


def datasets(c: Client, tag: str) -> None:
    d = Dataset(f"{tag}.ds")
    d.add_tensor("u8_tensor", np.uint8([[2, 4, 6, 8], [1, 3, 5, 7]]))
    d.add_tensor("i16_tensor", np.int16([1, 1, 2, 3, 5, 8]))
    d.add_meta_string("metastring", "metavalue")
    d.add_meta_scalar("u32_scalar", np.uint32(42))
    d.add_meta_scalar("double_scalar", np.double(3.1415926535))
    d.add_meta_scalar("double_scalar", 2.5)
    assert d.get_name() == f"{tag}.ds" and str(d) != repr(d) and "u8_tensor" in str(d)
    assert d.get_tensor_dims("u8_tensor") == [2, 4] and sorted(d.get_tensor_names()) == ["i16_tensor", "u8_tensor"]
    assert d.get_tensor_type("u8_tensor") == np.uint8 and d.get_tensor_type("i16_tensor") == np.int16
    assert sorted(d.get_metadata_field_names()) == ["double_scalar", "metastring", "u32_scalar"]
    assert d.get_metadata_field_type("double_scalar") == np.float64 and d.get_metadata_field_type("metastring") is str
    assert d.get_metadata_field_type("u32_scalar") == np.uint32
    assert list(d.get_meta_scalars("double_scalar")) == [3.1415926535, 2.5]
    assert d.get_meta_strings("metastring") == ["metavalue"]
    assert d.get_data() is d and Dataset.from_pybind(d).get_tensor_names() == d.get_tensor_names()
    other = Dataset("other")
    other.set_data(d)
    assert other.get_name() == d.get_name()
    c.put_dataset(d)
    assert c.dataset_exists(f"{tag}.ds") and c.poll_dataset(f"{tag}.ds", 10, 2)
    assert c.key_exists(f"{{{tag}.ds}}.meta")
    got = c.get_dataset(f"{tag}.ds")
    assert np.array_equal(got.get_tensor("u8_tensor"), d.get_tensor("u8_tensor"))
    assert got.get_meta_strings("metastring") == ["metavalue"]
    c.copy_dataset(f"{tag}.ds", f"{tag}.ds2")
    c.rename_dataset(f"{tag}.ds2", f"{tag}.ds3")
    assert not c.dataset_exists(f"{tag}.ds2") and not c.poll_dataset(f"{tag}.ds2", 10, 2)
    assert c.get_dataset(f"{tag}.ds3").get_meta_scalars("u32_scalar")[0] == 42
    c.delete_dataset(f"{tag}.ds3")
    assert not c.dataset_exists(f"{tag}.ds3")
    # bad input
    expect(TypeError, Dataset, 42)
    expect(TypeError, d.add_tensor, "x", [1, 2, 3])
    expect(TypeError, d.add_tensor, 42, np.zeros(2))
    expect(TypeError, d.add_meta_scalar, "x", np.array([1, 2, 3, 4]))
    expect(TypeError, d.add_meta_scalar, 42, 42)
    expect(TypeError, d.add_meta_string, "x", 42)
    expect(RedisKeyError, d.get_tensor, "none")
    expect(RedisKeyError, d.get_metadata_field_type, "none")
    expect(RedisRuntimeError, d.get_meta_scalars, "metastring")
    for call in (d.get_tensor, d.get_meta_scalars, d.get_meta_strings, d.get_tensor_type, d.get_metadata_field_type):
        expect(TypeError, call, 42)
    expect(TypeError, d.get_tensor_names, 42)
    expect(TypeError, Dataset.from_pybind, "not a dataset")
    expect(TypeError, c.put_dataset, np.array([1, 2]))
    expect(RedisKeyError, c.get_dataset, f"{tag}.not-a-key")
    expect(RedisReplyError, c.rename_dataset, f"{tag}.not-a-key", f"{tag}.x")
    expect(RedisReplyError, c.copy_dataset, f"{tag}.not-a-key", f"{tag}.x")
    expect(RedisRuntimeError, c.delete_dataset, f"{tag}.not-a-key")
    for call in (c.get_dataset, c.delete_dataset, c.dataset_exists):
        expect(TypeError, call, 42)
    expect(TypeError, c.copy_dataset, 42, "x")
    expect(TypeError, c.poll_dataset, "x", 10, "bogus")


def lists(c: Client, tag: str) -> None:
    name = f"{tag}.list"
    c.delete_list(name)
    originals = [make_dataset(f"{tag}.agg{i}") for i in range(4)]
    for dataset in originals:
        c.put_dataset(dataset)
        c.append_to_list(name, dataset)
    assert c.get_list_length(name) == 4
    assert c.poll_list_length(name, 4, 10, 2) and not c.poll_list_length(name, 5, 10, 2)
    assert c.poll_list_length_gte(name, 3, 10, 2) and not c.poll_list_length_gte(name, 5, 10, 2)
    assert c.poll_list_length_lte(name, 4, 10, 2) and not c.poll_list_length_lte(name, 3, 10, 2)
    assert [d.get_name() for d in c.get_datasets_from_list(name)] == [d.get_name() for d in originals]
    assert [d.get_name() for d in c.get_dataset_list_range(name, 0, 1)] == [f"{tag}.agg0", f"{tag}.agg1"]
    assert [d.get_name() for d in c.get_dataset_list_range(name, -1, -1)] == [f"{tag}.agg3"]
    c.rename_list(name, f"{tag}.new")
    assert c.get_list_length(name) == 0 and c.get_list_length(f"{tag}.new") == 4
    c.copy_list(f"{tag}.new", f"{tag}.copied")
    assert c.get_list_length(f"{tag}.copied") == 4
    assert c.get_datasets_from_list(f"{tag}.missing") == []
    # bad input
    expect(TypeError, c.append_to_list, 42, originals[0])
    expect(TypeError, c.append_to_list, name, 42)
    for call in (c.delete_list, c.get_list_length, c.get_datasets_from_list):
        expect(TypeError, call, 42)
    expect(TypeError, c.copy_list, 42, "dest")
    expect(TypeError, c.rename_list, "src", 42)
    expect(ValueError, c.copy_list, "", "dest")
    expect(RedisRuntimeError, c.copy_list, f"{tag}.missing", f"{tag}.dest")
    for call in (c.poll_list_length, c.poll_list_length_gte, c.poll_list_length_lte):
        expect(TypeError, call, name, "4", 10, 2)
        expect(ValueError, call, name, -1, 10, 2)
    expect(TypeError, c.get_dataset_list_range, name, "0", 1)


def models_and_scripts(c: Client, tag: str, workdir: str) -> None:
    model = torch_cnn()
    c.set_model(f"{tag}.cnn", model, "TORCH", "CPU")
    assert c.get_model(f"{tag}.cnn") == model and c.model_exists(f"{tag}.cnn") and c.poll_model(f"{tag}.cnn", 10, 2)
    data = torch.rand(1, 1, 3, 3).numpy()
    c.put_tensor(f"{tag}.in", data)
    c.run_model(f"{tag}.cnn", inputs=[f"{tag}.in"], outputs=[f"{tag}.out"])
    assert c.get_tensor(f"{tag}.out").shape == (1, 1, 1, 1)
    c.set_model(f"{tag}.linear", exported_linear(), "TORCH", "CPU")  # torch.export, beside TorchScript
    c.put_tensor(f"{tag}.x", np.ones((3, 4), np.float32))
    c.run_model(f"{tag}.linear", f"{tag}.x", f"{tag}.y")
    assert c.get_tensor(f"{tag}.y").shape == (3, 2)
    path = os.path.join(workdir, "torch_cnn.pt")
    with open(path, "wb") as f:
        f.write(model)
    c.set_model_chunk_size(1024)
    c.set_model_from_file(f"{tag}.file_cnn", path, "TORCH", "CPU")
    assert c.get_model(f"{tag}.file_cnn") == model
    c.delete_model(f"{tag}.file_cnn")
    assert not c.model_exists(f"{tag}.file_cnn")
    c.set_function(f"{tag}.fn", one_to_one)
    assert c.get_script(f"{tag}.fn") == inspect.getsource(one_to_one)
    c.put_tensor(f"{tag}.script-in", np.array([[1, 2, 3, 4, 5]]))
    c.run_script(f"{tag}.fn", "one_to_one", f"{tag}.script-in", f"{tag}.script-out")
    assert c.get_tensor(f"{tag}.script-out") == 5
    c.set_script(f"{tag}.script", SCRIPT)
    assert c.get_script(f"{tag}.script") == SCRIPT
    c.put_tensor(f"{tag}.d1", np.array([[1, 2, 3, 4]]))
    c.put_tensor(f"{tag}.d2", np.array([[5, 6, 7, 8]]))
    c.run_script(f"{tag}.script", "two_to_one", [f"{tag}.d1", f"{tag}.d2"], [f"{tag}.merged"])
    assert list(c.get_tensor(f"{tag}.merged")) == [4, 8]
    script_path = os.path.join(workdir, "script.txt")
    with open(script_path, "w") as f:
        f.write(SCRIPT)
    c.set_script_from_file(f"{tag}.script-file", script_path)
    assert c.model_exists(f"{tag}.script-file")
    c.delete_script(f"{tag}.script-file")
    assert not c.model_exists(f"{tag}.script-file")
    info = c.get_ai_info(os.environ["SSDB"].split(",")[:1], f"{tag}.cnn")[0]
    assert info["calls"] == "1" and info["backend"] == "TORCH" and info["type"] == "MODEL"
    assert c.get_ai_info(os.environ["SSDB"].split(",")[:1], f"{tag}.cnn", True) == [{}]
    # multi-GPU: on a machine without GPUs every copy runs on the CPU
    c.set_model_multigpu(f"{tag}.mg", model, "TORCH", 0, 2)
    c.run_model_multigpu(f"{tag}.mg", 3, 0, 2, [f"{tag}.in"], [f"{tag}.mg-out"])
    assert c.model_exists(f"{tag}.mg.GPU:1") and c.get_tensor(f"{tag}.mg-out").shape == (1, 1, 1, 1)
    c.delete_model_multigpu(f"{tag}.mg", 0, 2)
    c.set_model_from_file_multigpu(f"{tag}.mgf", path, "TORCH", 1, 1)
    c.delete_model_multigpu(f"{tag}.mgf", 1, 1)
    c.set_function_multigpu(f"{tag}.mgfn", one_to_one, 0, 2)
    c.run_script_multigpu(f"{tag}.mgfn", "one_to_one", f"{tag}.script-in", f"{tag}.mg-s", 1, 0, 2)
    assert c.get_tensor(f"{tag}.mg-s") == 5
    c.delete_script_multigpu(f"{tag}.mgfn", 0, 2)
    c.set_script_multigpu(f"{tag}.mgs", SCRIPT, 0, 1)
    c.set_script_from_file_multigpu(f"{tag}.mgsf", script_path, 0, 1)
    c.delete_script_multigpu(f"{tag}.mgs", 0, 1)
    # bad input
    expect(RedisReplyError, c.run_model, f"{tag}.wrong_cnn", [f"{tag}.in"], [f"{tag}.out"])
    expect(RedisReplyError, c.run_script, f"{tag}.fn", "not-a-function", [f"{tag}.in"], [f"{tag}.out"])
    c.set_function(f"{tag}.bad", bad_function)
    expect(RedisReplyError, c.run_script, f"{tag}.bad", "bad_function", f"{tag}.script-in", f"{tag}.o")
    expect(RedisReplyError, c.get_script, f"{tag}.not-a-script")
    expect(RedisReplyError, c.copy_tensor, f"{tag}.fn", f"{tag}.fork")
    expect(FileNotFoundError, c.set_script_from_file, "key", "not-a-file")
    expect(TypeError, c.set_script, "key", "some_script", device="not-a-gpu")
    expect(TypeError, c.set_model, 42, model, "TORCH", "CPU")
    expect(TypeError, c.set_model, "m", model, "UNSUPPORTED_ENGINE", "CPU")
    expect(TypeError, c.set_model, "m", model, "TORCH", "BAD_DEVICE")
    expect(TypeError, c.set_model, "m", model, "TORCH", "CPU", batch_size="not_an_integer")
    expect(TypeError, c.set_model, "m", model, "TORCH", "CPU", tag=42)
    expect(ValueError, c.set_model, "m", model, "TORCH", "CPU", inputs=["x"])
    expect(RedisRuntimeError, c.set_model, "m", model, "TORCH", "CPU", min_batch_timeout=1)
    expect(RedisRuntimeError, c.set_model_from_file, "m", path, "TORCH", "CPU", batch_size=1, min_batch_timeout=1)
    expect(TypeError, c.set_model_from_file, "m", "bad filename", "TORCH", "CPU", tag=42)
    expect(TypeError, c.set_model_from_file_multigpu, "m", "bad filename", "TORCH", 0, "1")
    expect(ValueError, c.set_model_multigpu, "m", model, "TORCH", -1, 1)
    expect(ValueError, c.run_model_multigpu, "m", 0, 0, 0)
    expect(ValueError, c.delete_model_multigpu, "m", 0, 0)
    expect(ValueError, c.set_script_multigpu, "key", "script", 0, 0)
    expect(ValueError, c.run_script_multigpu, "key", "fn", "in", "out", 0, -1, 1)
    expect(ValueError, c.delete_script_multigpu, "key", -1, 1)
    expect(ValueError, c.set_function_multigpu, "key", bad_function, 0, 0)
    expect(TypeError, c.set_function, "key", "not-a-function")
    expect(TypeError, c.run_model, 42)
    expect(TypeError, c.run_script, "key", "fn", 42, "out")
    for call in (c.get_model, c.get_script, c.delete_model, c.delete_script, c.model_exists):
        expect(TypeError, call, 42)
    expect(TypeError, c.set_model_chunk_size, "not an integer")
    expect(RedisRuntimeError, c.set_model_chunk_size, 0)
    expect(RedisRuntimeError, c.get_ai_info, ["no_host:6379"], f"{tag}.cnn")
    expect(RedisRuntimeError, c.get_ai_info, os.environ["SSDB"].split(",")[:1], f"{tag}.bad_key")
    expect(TypeError, c.get_ai_info, "not a list", f"{tag}.cnn")


def prefixes(tag: str) -> None:
    opts = ConfigOptions.create_from_environment("")
    opts.override_string_option("SSKEYOUT", f"{tag}.prefix_test")
    opts.override_string_option("SSKEYIN", f"{tag}.prefix_test,{tag}.prefix_ignore")
    c = Client(opts, logger_name=tag)
    c.use_dataset_ensemble_prefix(True)
    c.use_tensor_ensemble_prefix(True)
    c.set_data_source(f"{tag}.prefix_test")
    d = Dataset("test_dataset")
    d.add_tensor("dataset_tensor", np.uint16([1, 2, 3, 4]))
    c.put_dataset(d)
    c.put_tensor("test_tensor", np.uint16([1, 2, 3, 4]))
    assert c.dataset_exists("test_dataset") and c.key_exists(f"{tag}.prefix_test.{{test_dataset}}.meta")
    assert c.tensor_exists("test_tensor") and c.key_exists(f"{tag}.prefix_test.test_tensor")
    assert not c.key_exists("test_tensor")
    c.use_model_ensemble_prefix(True)
    c.set_model("simple_cnn", torch_cnn(), "TORCH", "CPU")
    assert c.model_exists("simple_cnn") and not c.key_exists("simple_cnn")
    c.use_list_ensemble_prefix(True)
    c.append_to_list("dataset_test_list", d)
    assert c.key_exists(f"{tag}.prefix_test.dataset_test_list") and not c.key_exists("dataset_test_list")
    c.use_tensor_ensemble_prefix(False)
    c.put_tensor(f"{tag}.bare", np.zeros(2))
    assert c.key_exists(f"{tag}.bare")
    expect(RedisRuntimeError, c.set_data_source, "not-a-source")
    expect(TypeError, c.set_data_source, 42)
    for call in (c.use_model_ensemble_prefix, c.use_list_ensemble_prefix, c.use_tensor_ensemble_prefix,
                 c.use_dataset_ensemble_prefix):
        expect(TypeError, call, "not a boolean")


def nodes(c: Client, tag: str) -> None:
    addresses = os.environ["SSDB"].split(",")
    cluster = os.environ["SR_DB_TYPE"] == "Clustered"
    info = c.get_db_node_info(addresses)
    assert len(info) == len(addresses) and "redis_version" in info[0]["Server"]
    if cluster:
        assert c.get_db_cluster_info(addresses)[0]["cluster_state"] == "ok"
    else:
        expect(RedisReplyError, c.get_db_cluster_info, addresses)
    c.config_set("lua-time-limit", "6000", addresses[0])
    assert c.config_get("lua-time-limit", addresses[0]) == {"lua-time-limit": "6000"}
    assert c.config_get("config_param_DNE", addresses[0]) == {}
    expect(RedisReplyError, c.config_set, "config_param_DNE", "10", addresses[0])
    for address in addresses:
        before = c.get_db_node_info([address])[0]["Persistence"]["rdb_last_save_time"]
        c.save([address])
        assert int(before) <= int(c.get_db_node_info([address])[0]["Persistence"]["rdb_last_save_time"])
    for call in (c.get_db_node_info, c.get_db_cluster_info, c.flush_db, c.save):
        expect(TypeError, call, "not a list")
    expect(TypeError, c.config_get, "timeout", 42)
    expect(TypeError, c.config_set, "timeout", 42, addresses[0])
    expect(RedisRuntimeError, c.get_db_node_info, ["no_host:6379"])


def logging_api(c: Client, tag: str) -> None:
    for level in (LLQuiet, LLInfo, LLDebug, LLDeveloper):
        log_data(tag, level, f"data ({level.name})")
        log_warning(tag, level, f"warning ({level.name})")
        log_error(tag, level, f"error ({level.name})")
        for obj in (c, Dataset(tag), LogContext(tag), SRObject(tag)):
            obj.log_data(level, "data")
            obj.log_warning(level, "warning")
            obj.log_error(level, "error")
    context = LogContext(tag)
    assert context.get_context() is context
    context.set_context(LogContext("other"))
    assert isinstance(LogContext.from_pybind(context), LogContext)
    for fn in (log_data, log_warning, log_error):
        expect(TypeError, fn, 42, LLInfo, "data")
        expect(TypeError, fn, tag, "Not a logging level", "data")
        expect(TypeError, fn, tag, LLInfo, 42)
    for obj in (c, Dataset(tag), LogContext(tag)):
        expect(TypeError, obj.log_data, "Not a logging level", "data")
        expect(TypeError, obj.log_error, LLInfo, 42)
    expect(TypeError, LogContext, 42)


def utilities() -> None:
    assert Dtypes.tensor_from_numpy(np.zeros(2, np.float32)) == "FLOAT"
    assert Dtypes.metadata_from_numpy(np.array(3, np.uint32)) == "UINT32"
    assert Dtypes.from_string("INT16") is np.int16 and Dtypes.from_string("STRING") is str
    expect(TypeError, Dtypes.from_string, "Incorrect input")
    expect(TypeError, Dtypes.metadata_from_numpy, np.array(["Incorrect Input"]))
    expect(TypeError, Dtypes.tensor_from_numpy, np.zeros(2, np.complex64))
    assert init_default([], None, list) == [] and init_default([], [1], list) == [1]
    expect(TypeError, init_default, [], "x", list)
    typecheck("x", "name", str)
    expect(TypeError, typecheck, 42, "name", str)
    assert exception_handler(lambda: 3)() == 3
    for error in (RedisBadAllocError, RedisDatabaseError, RedisInternalError, RedisKeyError, RedisRuntimeError,
                  RedisTimeoutError):
        assert issubclass(error, RedisReplyError)
    assert "m execution failed" in str(RedisReplyError("boom", "m"))


def config_options(tag: str) -> None:
    os.environ[f"{tag}_int_{tag}"] = "42"
    try:
        opts = ConfigOptions.create_from_environment(tag)
        assert opts.get_integer_option(f"{tag}_int") == 42 and opts.is_configured(f"{tag}_int")
        expect(RedisKeyError, opts.get_string_option, "not-set")
        opts.override_string_option("not-set", "meowth")
        assert opts.get_string_option("not-set") == "meowth"
        opts.override_integer_option("int-not-set", 7)
        assert opts.get_integer_option("int-not-set") == 7
        assert ConfigOptions.from_pybind(opts).get_string_option("not-set") == "meowth"
        assert opts.get_data() is opts
        copied = configoptions.create_managed_instance(ConfigOptions)
        copied.set_configoptions(opts)
        assert copied.get_integer_option("int-not-set") == 7
        assert configoptions.managed(ConfigOptions.get_string_option)(copied, "not-set") == "meowth"
    finally:
        del os.environ[f"{tag}_int_{tag}"]
    plain = ConfigOptions()
    for call, args in ((plain.get_integer_option, ("key",)), (plain.get_string_option, ("key",)),
                       (plain.is_configured, ("key",)), (plain.override_integer_option, ("key", 42)),
                       (plain.override_string_option, ("key", "value"))):
        expect(RedisRuntimeError, call, *args)
    expect(TypeError, ConfigOptions.create_from_environment, 42)
    opts = ConfigOptions.create_from_environment("")
    expect(TypeError, opts.get_integer_option, 42)
    expect(TypeError, opts.override_integer_option, "key", "stringval")
    expect(TypeError, opts.override_string_option, "key", 42)


def xarray_conversion(tag: str) -> None:
    ds = Dataset(f"{tag}.xr")
    ds.add_tensor("1ddata", np.random.default_rng(0).random(10))
    ds.add_tensor("x", np.linspace(0, 360, 10))
    for field, value in (("x_coord_units", "degrees E"), ("x_coord_longname", "Longitude"), ("units", "m/s"),
                         ("longname", "velocity"), ("convention", "CF1.5"), ("dim_data_x", "x")):
        ds.add_meta_string(field, value)
    DatasetConverter.add_metadata_for_xarray(ds, data_names=["1ddata"], dim_names=["dim_data_x"], coord_names=["x"],
                                             attr_names=["units", "longname", "convention"])
    DatasetConverter.add_metadata_for_xarray(ds, data_names="x", dim_names="dim_data_x",
                                             attr_names=["x_coord_units", "x_coord_longname"])
    assert dataset_utils.get_data(ds, "1ddata", "dim") == ["dim_data_x"]
    dataset_utils.typecheck_stringlist(["a", "b"], "names", "name")
    expect(TypeError, dataset_utils.typecheck_stringlist, ["a", 1], "names", "name")
    expect(TypeError, DatasetConverter.add_metadata_for_xarray, ds, data_names=1, dim_names=["dim_data_x"])
    expect(TypeError, DatasetConverter.add_metadata_for_xarray, ds, data_names=["1ddata"], dim_names=[1, 2])
    try:
        import xarray
    except ImportError:
        expect(RedisRuntimeError, DatasetConverter.transform_to_xarray, ds)
        return
    array = DatasetConverter.transform_to_xarray(ds)["1ddata"]
    assert isinstance(array, xarray.DataArray) and array.dims == ("x",) and array.attrs["units"] == "m/s"
    assert list(array.coords["x"].values) == list(np.linspace(0, 360, 10))


def main(tag: str) -> None:
    """Run the whole program under key prefix ``tag``; the database's nodes are flushed at the end."""
    assert smartredis.Client is Client
    client = construction(tag)
    with tempfile.TemporaryDirectory() as workdir:
        tensors(client, tag)
        datasets(client, tag)
        lists(client, tag)
        models_and_scripts(client, tag, workdir)
    prefixes(tag)
    nodes(client, tag)
    logging_api(client, tag)
    utilities()
    config_options(tag)
    xarray_conversion(tag)
    if os.environ["SR_DB_TYPE"] != "Clustered":
        client.put_tensor(f"{tag}.flushed", np.zeros(2))
        client.flush_db(os.environ["SSDB"].split(","))
        assert not client.tensor_exists(f"{tag}.flushed")
    else:
        client.flush_db(os.environ["SSDB"].split(","))
