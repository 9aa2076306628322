"""SmartRedis 0.6.1's Python API, whole: a SmartRedis program runs unchanged on smartredis_io.

``tests/support/smartredis_program.py`` imports ``smartredis`` and uses every public name of the
package, with normal and bad input; here the name ``smartredis`` (and its modules) is bound to
``smartredis_io`` and the program runs against a standalone database and a 3-shard cluster, each
with an execution worker. The signatures of SmartRedis 0.6.1 are recorded below from its source and
compared with smartredis_io's.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest

import smartredis_io
from smartredis_io import Orchestrator

PROGRAM = Path(__file__).parents[1] / "support" / "smartredis_program.py"
MODULES = ("client", "configoptions", "dataset", "dataset_utils", "error", "logcontext", "logger", "srobject", "util")

# SmartRedis 0.6.1 (src/python/module/smartredis): public callables and their parameters, as declared.
SMARTREDIS = {
    "Client": {
        "put_tensor": "name, data", "get_tensor": "name", "delete_tensor": "name",
        "copy_tensor": "src_name, dest_name", "rename_tensor": "old_name, new_name", "put_dataset": "dataset",
        "get_dataset": "name", "delete_dataset": "name", "copy_dataset": "src_name, dest_name",
        "rename_dataset": "old_name, new_name", "set_function": "name, function, device='CPU'",
        "set_function_multigpu": "name, function, first_gpu, num_gpus", "set_script": "name, script, device='CPU'",
        "set_script_multigpu": "name, script, first_gpu, num_gpus",
        "set_script_from_file": "name, file, device='CPU'",
        "set_script_from_file_multigpu": "name, file, first_gpu, num_gpus", "get_script": "name",
        "run_script": "name, fn_name, inputs, outputs",
        "run_script_multigpu": "name, fn_name, inputs, outputs, offset, first_gpu, num_gpus",
        "delete_script": "name", "delete_script_multigpu": "name, first_gpu, num_gpus", "get_model": "name",
        "set_model": "name, model, backend, device='CPU', batch_size=0, min_batch_size=0, min_batch_timeout=0, "
                     "tag='', inputs=None, outputs=None",
        "set_model_multigpu": "name, model, backend, first_gpu, num_gpus, batch_size=0, min_batch_size=0, "
                              "min_batch_timeout=0, tag='', inputs=None, outputs=None",
        "set_model_from_file": "name, model_file, backend, device='CPU', batch_size=0, min_batch_size=0, "
                               "min_batch_timeout=0, tag='', inputs=None, outputs=None",
        "set_model_from_file_multigpu": "name, model_file, backend, first_gpu, num_gpus, batch_size=0, "
                                        "min_batch_size=0, min_batch_timeout=0, tag='', inputs=None, outputs=None",
        "run_model": "name, inputs=None, outputs=None",
        "run_model_multigpu": "name, offset, first_gpu, num_gpus, inputs=None, outputs=None",
        "delete_model": "name", "delete_model_multigpu": "name, first_gpu, num_gpus", "tensor_exists": "name",
        "dataset_exists": "name", "model_exists": "name", "key_exists": "key",
        "poll_key": "key, poll_frequency_ms, num_tries", "poll_tensor": "name, poll_frequency_ms, num_tries",
        "poll_dataset": "name, poll_frequency_ms, num_tries", "poll_model": "name, poll_frequency_ms, num_tries",
        "set_data_source": "source_id", "use_model_ensemble_prefix": "use_prefix",
        "use_list_ensemble_prefix": "use_prefix", "use_tensor_ensemble_prefix": "use_prefix",
        "use_dataset_ensemble_prefix": "use_prefix", "get_db_node_info": "addresses",
        "get_db_cluster_info": "addresses", "get_ai_info": "address, key, reset_stat=False",
        "flush_db": "addresses", "config_get": "expression, address", "config_set": "config_param, value, address",
        "save": "addresses", "set_model_chunk_size": "chunk_size", "append_to_list": "list_name, dataset",
        "delete_list": "list_name", "copy_list": "src_name, dest_name", "rename_list": "src_name, dest_name",
        "get_list_length": "list_name", "poll_list_length": "name, list_length, poll_frequency_ms, num_tries",
        "poll_list_length_gte": "name, list_length, poll_frequency_ms, num_tries",
        "poll_list_length_lte": "name, list_length, poll_frequency_ms, num_tries",
        "get_datasets_from_list": "list_name", "get_dataset_list_range": "list_name, start_index, end_index",
        "log_data": "level, data", "log_warning": "level, data", "log_error": "level, data",
    },
    "Dataset": {
        "from_pybind": "dataset", "get_data": "", "set_data": "dataset", "add_tensor": "name, data",
        "get_tensor": "name", "get_name": "", "add_meta_scalar": "name, data", "add_meta_string": "name, data",
        "get_meta_scalars": "name", "get_meta_strings": "name", "get_metadata_field_names": "",
        "get_metadata_field_type": "name", "get_tensor_type": "name", "get_tensor_names": "",
        "get_tensor_dims": "name", "log_data": "level, data", "log_warning": "level, data",
        "log_error": "level, data",
    },
    "ConfigOptions": {
        "from_pybind": "configoptions", "get_data": "", "set_configoptions": "configoptions",
        "create_from_environment": "db_suffix", "get_integer_option": "option_name",
        "get_string_option": "option_name", "is_configured": "option_name",
        "override_integer_option": "option_name, value", "override_string_option": "option_name, value",
    },
    "LogContext": {"from_pybind": "logcontext", "get_context": "", "set_context": "logcontext",
                   "log_data": "level, data", "log_warning": "level, data", "log_error": "level, data"},
    "SRObject": {"log_data": "level, data", "log_warning": "level, data", "log_error": "level, data"},
    "util.Dtypes": {"tensor_from_numpy": "array", "metadata_from_numpy": "array", "from_string": "type_name"},
    "util": {"init_default": "default, init_value, expected_type=None", "exception_handler": "func",
             "typecheck": "arg, name, _type"},
    "logger": {"log_data": "context, level, data", "log_warning": "context, level, data",
               "log_error": "context, level, data"},
    "dataset_utils": {"get_data": "dataset, name, dtype", "typecheck_stringlist": "names, strings_name, string_name"},
    "dataset_utils.DatasetConverter": {
        "add_metadata_for_xarray": "dataset, data_names, dim_names, coord_names=None, attr_names=None",
        "transform_to_xarray": "dataset",
    },
    "configoptions": {"create_managed_instance": "base", "managed": "func"},
}
PACKAGE_NAMES = {"Client", "ConfigOptions", "Dataset", "SRObject", "LogContext", "DatasetConverter", "log_data",
                 "log_warning", "log_error", "LLQuiet", "LLInfo", "LLDebug", "LLDeveloper"}
ERRORS = {"RedisConnectionError", "RedisReplyError", "RedisRuntimeError", "RedisBadAllocError",
          "RedisDatabaseError", "RedisInternalError", "RedisTimeoutError", "RedisKeyError"}


def _resolve(path: str):
    target = smartredis_io
    for part in path.split("."):
        target = getattr(target, part) if hasattr(target, part) else importlib.import_module(
            f"smartredis_io.{part}")
    return target


def _parameters(function) -> list[tuple[str, object]]:
    parameters = [p for p in inspect.signature(function).parameters.values() if p.name not in ("self", "cls")]
    return [(p.name, p.default) for p in parameters]


def _declared(text: str) -> list[tuple[str, object]]:
    declared = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, default = item.partition("=")
        declared.append((name, eval(default) if default else inspect.Parameter.empty))  # noqa: S307 - literals above
    return declared


@pytest.mark.parametrize("owner", list(SMARTREDIS))
def test_every_smartredis_callable_is_there_with_its_parameters(owner: str) -> None:
    """Each parameter in SmartRedis' order with SmartRedis' default; a required one may gain a default
    (``backend="TORCH"``), and only optional parameters may follow."""
    namespace = _resolve(owner)
    for name, declared in SMARTREDIS[owner].items():
        ours = _parameters(getattr(namespace, name))
        theirs = _declared(declared)
        assert [n for n, _ in ours[:len(theirs)]] == [n for n, _ in theirs], f"{owner}.{name}: {ours}"
        for (n, our_default), (_, their_default) in zip(ours, theirs, strict=False):
            if their_default is not inspect.Parameter.empty:
                assert our_default == their_default, f"{owner}.{name}({n}=...)"
        assert all(d is not inspect.Parameter.empty for _, d in ours[len(theirs):]), f"{owner}.{name}: {ours}"


def test_every_public_name_of_the_package_and_its_modules() -> None:
    assert PACKAGE_NAMES <= set(smartredis_io.__all__)
    assert ERRORS == set(smartredis_io.error.__all__)
    for module in MODULES:
        importlib.import_module(f"smartredis_io.{module}")
    assert [level.value for level in (smartredis_io.LLQuiet, smartredis_io.LLInfo, smartredis_io.LLDebug,
                                      smartredis_io.LLDeveloper)] == [1, 2, 3, 4]
    assert issubclass(smartredis_io.Client, smartredis_io.SRObject)
    assert issubclass(smartredis_io.Dataset, smartredis_io.SRObject)
    assert issubclass(smartredis_io.LogContext, smartredis_io.SRObject)


def test_the_program_calls_every_callable() -> None:
    source = PROGRAM.read_text()
    called = set(re.findall(r"\.(\w+)\(", source)) | set(re.findall(r"\b(\w+)\(", source)) \
        | set(re.findall(r"(?:call|fn), .*?\bc\.(\w+)", source)) | set(re.findall(r"\bc\.(\w+)\b", source))
    missing = {f"{owner}.{name}" for owner, names in SMARTREDIS.items() for name in names if name not in called}
    assert not missing, f"the program does not call {sorted(missing)}"


@pytest.fixture(scope="module")
def standalone_database():
    with Orchestrator(shards=1, workers=1) as orchestrator:
        yield orchestrator


@pytest.fixture(scope="module")
def clustered_database():
    with Orchestrator(shards=3, workers=1) as orchestrator:
        yield orchestrator


@pytest.fixture
def as_smartredis(monkeypatch: pytest.MonkeyPatch):
    """``smartredis`` and its modules bound to smartredis_io's, and the program imported fresh."""
    monkeypatch.setitem(sys.modules, "smartredis", smartredis_io)
    for module in MODULES:
        monkeypatch.setitem(sys.modules, f"smartredis.{module}", importlib.import_module(f"smartredis_io.{module}"))
    monkeypatch.delitem(sys.modules, "tests.support.smartredis_program", raising=False)
    return importlib.import_module("tests.support.smartredis_program")


@pytest.mark.slow
@pytest.mark.parametrize("database", ["standalone", "cluster"])
def test_a_smartredis_program_runs_unchanged(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                                             as_smartredis, database: str, uid: str) -> None:
    orchestrator = request.getfixturevalue(f"{'clustered' if database == 'cluster' else 'standalone'}_database")
    for name, value in orchestrator.env.items():
        monkeypatch.setenv(name, value)
    as_smartredis.main(uid)
