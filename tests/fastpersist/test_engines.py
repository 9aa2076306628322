"""Engine choice and fallback on this machine: unknown names, gds without CUDA, unlocked memory."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastpersist import FastPersistContext, fastpersist_load, fastpersist_save
from fastpersist.aio import aio_unavailable_reason
from fastpersist.memory import PAGE_BYTES, aligned_empty
from tests.support.fork import exit_code_in_fork


def test_unknown_engine_is_refused_by_name(ckpt_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown fastpersist engine 'nvme-magic'"):
        fastpersist_save({"w": torch.ones(1)}, ckpt_dir / "x.pt", engine="nvme-magic")
    with pytest.raises(ValueError, match="unknown fastpersist engine"):
        FastPersistContext(engine="fast")
    assert not list(ckpt_dir.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback on machines without CUDA")
def test_gds_without_cuda_falls_back_with_one_warning_naming_the_reason(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture, aio_engine: str
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="fastpersist"),
        FastPersistContext(io_buffer_mb=1, engine="gds") as context,
    ):
        stats = [
            fastpersist_save({"w": torch.randn(1000)}, ckpt_dir / f"{i}.pt", context=context)
            for i in range(2)
        ]
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("fastpersist")
    ]
    assert [s.engine for s in stats] == ["aio", "aio"]
    assert len(warnings) == 1 and "CUDA is not available" in warnings[0]


def test_unlocked_staging_memory_falls_back_to_the_python_engine(ckpt_dir: Path) -> None:
    if aio_unavailable_reason() is not None:
        pytest.skip(aio_unavailable_reason())
    buffer = aligned_empty(1 << 20)
    assert buffer.data_ptr() % PAGE_BYTES == 0
    with FastPersistContext(engine="aio", pinned_buffer=buffer) as context:
        stats = fastpersist_save({"w": torch.randn(300_000)}, ckpt_dir / "x.pt", context=context)
        loaded = fastpersist_load(ckpt_dir / "x.pt", context=context, engine="aio")
    assert stats.engine == "python" and loaded["w"].shape == (300_000,)


def test_a_context_pickles_its_settings_not_its_resources() -> None:
    import pickle

    from fastpersist import AioConfig

    with FastPersistContext(engine="python", io_buffer_mb=2, aio=AioConfig(queue_depth=4)) as context:
        context.staging_buffer("cpu", pinned=False)
        copy = pickle.loads(pickle.dumps(context))
    assert (copy.engine, copy.io_buffer_mb, copy.aio.queue_depth) == ("python", 2, 4)
    assert copy.staging_buffer("cpu", pinned=False).numel() == 2 * 1024**2


@pytest.mark.timeout(60)
@pytest.mark.skipif(aio_unavailable_reason() is not None, reason="DeepSpeed async_io op unavailable")
def test_aio_engine_reads_part_of_a_file_at_an_offset(ckpt_dir: Path) -> None:
    """A read of some blocks in the middle of a file returns exactly those bytes (and never hangs)."""
    from fastpersist.engines import Transfer, open_file

    data = torch.randint(0, 256, (3 * 2**20,), dtype=torch.uint8)
    path = ckpt_dir / "blocks.bin"
    path.write_bytes(data.numpy().tobytes())
    context = FastPersistContext(io_buffer_mb=2, engine="aio")
    buffer = context.staging_buffer().narrow(0, 0, 2**20)
    engine = context.io_engine("aio", str(ckpt_dir))
    file = open_file(str(path), write=False)
    try:
        engine.submit(Transfer(file, buffer, 2**20, write=False))
        engine.wait()
    finally:
        file.close()
    assert torch.equal(buffer, data[2**20 : 2 * 2**20])
    loaded = fastpersist_load(_saved(ckpt_dir), engine="aio", weights_only=True)
    assert torch.equal(loaded["b"], torch.arange(2**20, dtype=torch.float32))


def test_aio_saves_of_many_tensors_through_a_small_staging_buffer_complete(
    ckpt_dir: Path, aio_engine: str
) -> None:
    """Writes land in the middle of the preallocated file, many of them per save; none may hang."""
    path = ckpt_dir / "many.pt"
    script = (
        "import sys, torch\n"
        "from fastpersist import FastPersistContext, fastpersist_save\n"
        "with FastPersistContext(io_buffer_mb=2, engine='aio') as context:\n"
        "    for step in range(3):\n"
        "        state = {f'w{i}': torch.full((2**16,), float(step * 100 + i)) for i in range(16)}\n"
        "        stats = fastpersist_save(state, sys.argv[1], context=context)\n"
        "print(stats.engine)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "aio"
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded[f"w{i}"], torch.full((2**16,), float(200 + i))) for i in range(16))


def _saved(directory: Path) -> str:
    path = str(directory / "two.pt")
    fastpersist_save({"a": torch.ones(3 * 2**18), "b": torch.arange(2**20, dtype=torch.float32)}, path)
    return path


def test_deepspeeds_nvme_write_endurance_notice_is_kept_at_debug_level(
    ckpt_dir: Path, aio_engine: str
) -> None:
    # A fresh interpreter: DeepSpeed logs the notice once per process, on the first aio write.
    script = (
        "import logging, sys, torch\n"
        "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(name)s %(message)s')\n"
        "if sys.argv[2] == 'debug': logging.getLogger('fastpersist').setLevel(logging.DEBUG)\n"
        "from fastpersist import fastpersist_save\n"
        "for i in range(2): fastpersist_save({'w': torch.randn(5000)}, f'{sys.argv[1]}/{i}.pt', engine='aio')\n"
    )
    for level in ("warning", "debug"):
        done = subprocess.run(
            [sys.executable, "-c", script, str(ckpt_dir), level], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        output = done.stdout + done.stderr
        assert "Offloading to NVMe" not in output, output[-2000:]  # DeepSpeed's own wording, as a warning
        notices = [line for line in done.stderr.splitlines() if "write endurance (TBW)" in line]
        assert len(notices) == (1 if level == "debug" else 0), notices
        assert all(line.startswith("DEBUG fastpersist") for line in notices)


@pytest.mark.skipif(aio_unavailable_reason() is not None, reason="DeepSpeed async_io op unavailable")
def test_the_default_aio_handle_reaps_requests_in_batches_not_one_by_one() -> None:
    """Per-request reaping (``overlap_events``) costs the saving process CPU and gains no queue depth."""
    from fastpersist import AioConfig

    with FastPersistContext(engine="aio", io_buffer_mb=2) as context:
        assert context.aio_handle().get_overlap_events() is False
    assert AioConfig.from_ds_config({"queue_depth": 8}).overlap_events is False
    with FastPersistContext(engine="aio", io_buffer_mb=2, aio=AioConfig(overlap_events=True)) as context:
        assert context.aio_handle().get_overlap_events() is True


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_closing_a_context_lets_go_of_its_aio_handle_there_and_then(ckpt_dir: Path, aio_engine: str) -> None:
    """The aio handle goes in ``close()``, not at a later garbage collection: destroying its kernel
    AIO contexts waits a grace period each, holding the GIL, which must not land in a training step."""
    state = {"w": torch.randn(300_000), "b": torch.randn(10)}
    gc.collect()
    gc.disable()  # what a save leaves for the collector stays there
    try:
        before = _threads()
        context = FastPersistContext(engine=aio_engine, io_buffer_mb=1)
        fastpersist_save(state, ckpt_dir / "x.pt", context=context)
        assert _threads() > before  # the handle's worker thread
        context.close()
        assert _threads() == before
    finally:
        gc.enable()
    assert torch.equal(fastpersist_load(ckpt_dir / "x.pt")["w"], state["w"])


_ENGINES_HERE = ["python"] + (["aio"] if aio_unavailable_reason() is None else [])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("engine", _ENGINES_HERE)
def test_a_forked_child_saves_and_loads_through_its_parents_context(ckpt_dir: Path, engine: str) -> None:
    # ddp_fork and ddp_notebook fork processes that keep the plugin and its context: the parent's aio
    # handle and I/O threads did not survive the fork, so work handed to them would never finish.
    state = {f"t{index}": torch.randn(300_000) for index in range(4)}
    with FastPersistContext(engine=engine, io_buffer_mb=2) as context:
        fastpersist_save(state, ckpt_dir / "parent.pt", context=context)
        fastpersist_load(ckpt_dir / "parent.pt", context=context, weights_only=True)  # threads and handle exist

        def child() -> bool:
            fastpersist_save(state, ckpt_dir / "child.pt", context=context)
            loaded = fastpersist_load(ckpt_dir / "child.pt", context=context, weights_only=True)
            gc.collect()  # what the child dropped of the parent's is destroyed here, not at some later time
            return all(torch.equal(loaded[name], tensor) for name, tensor in state.items())

        assert exit_code_in_fork(child) == 0
    assert torch.equal(torch.load(ckpt_dir / "child.pt", weights_only=True)["t0"], state["t0"])
