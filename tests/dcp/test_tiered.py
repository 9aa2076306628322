"""Tiered sharded checkpoints across real processes (gloo, fake-gcs-server): two ranks save with
``local_dir`` (each rank's shard to the node's local tier, uploaded in the background), and the
checkpoint loads bit-exactly on one rank and on four (resharding), from the local tier and from GCS
(an empty ``local_dir``, a new node). ``.metadata`` appears in GCS only once every rank's shard is
there: a rank killed in the middle of its upload leaves GCS's previous checkpoint, and a restart on
the same node finishes the upload and publishes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.support.dcp_ranks import Ranks, run
from tests.support.dcp_tiered import load_seed, tier
from tests.support.gcs import FaultProxy


def _names(path: str) -> list[str]:
    from google.cloud import storage as gcs

    from dataflux_ckpt import parse_gcs_path

    bucket, key = parse_gcs_path(path)
    return sorted(blob.name[len(key) + 1 :] for blob in gcs.Client().list_blobs(bucket, prefix=key + "/"))


@pytest.mark.slow
def test_two_ranks_resume_on_one_and_on_four_from_the_local_tier_and_from_gcs(
        gs_root: str, local_root: Path, tmp_path: Path) -> None:
    path, node, new_node = f"{gs_root}/step-2", str(local_root / "node"), str(local_root / "new-node")
    reports = run([{"op": "tiered_save", "path": path, "local_dir": node, "seed": 2, "durable": True}], 2, tmp_path)
    assert [report["steps"][0]["durable"] for report in reports] == [True, True]
    # Published once both shards were there; the markers and the pending metadata are gone.
    names = _names(path)
    assert names[0] == ".metadata" and len(names) == 3 and all(name.endswith(".distcp") for name in names[1:])

    loads = [{"op": "tiered_load", "path": path, "local_dir": local_dir, "seed": 2} for local_dir in (node, new_node)]
    for world in (1, 4):
        reports = run(loads, world, tmp_path)
        for report in reports:
            from_local, from_gcs = report["steps"]
            assert from_local["mismatches"] == [] and from_gcs["mismatches"] == [], (world, report)
            assert (from_local["tier"], from_local["gcs"]) == ("local", 0), (world, report)
            assert from_local["local"] >= 1
            assert (from_gcs["tier"], from_gcs["local"]) == ("gcs", 0), (world, report)
            assert from_gcs["gcs"] >= 1
        # Resharded: the ranks together read both shards (locally from the node; from GCS on a new one).
        assert sum(report["steps"][0]["local"] for report in reports) >= 2
        assert sum(report["steps"][1]["gcs"] for report in reports) >= 2


def _rank_parts(request: object, rank: int) -> bool:
    """A part upload of rank ``rank``'s shard object, as the proxy sees it."""
    path = getattr(request, "path", "")
    return getattr(request, "method", "") == "POST" and f"__{rank}_0." in path and "uploadType=media" in path


@pytest.mark.slow
def test_metadata_waits_for_every_rank_and_a_restart_on_the_node_publishes(
        gs_root: str, local_root: Path, tmp_path: Path, gcs_proxy: FaultProxy) -> None:
    path, node = f"{gs_root}/last", str(local_root / "node")
    events = tmp_path / "events"
    events.mkdir()
    common = {"path": path, "local_dir": node, "endpoint": gcs_proxy.url}
    steps = [{"op": "tiered_save", "seed": 1, "durable": True, "touch": str(events), **common},
             {"op": "tiered_save", "seed": 2, "touch": str(events), **common},
             {"op": "tiered_hold", "events": str(events), **common}]
    killed = threading.Event()

    with Ranks(steps, 2, tmp_path, timeout_s=150) as ranks:
        def kill_rank_1_mid_upload(request: object, seen: int) -> str | None:
            # Rank 1's first part of save 2 (save 1 was durable before rank 1 said it saved it):
            # held until both ranks' dcp.save returned, then rank 1 dies with the part unsent.
            if killed.is_set() or not _rank_parts(request, 1) or not (events / "1-saved-1").exists():
                return None
            deadline = time.monotonic() + 60
            while not ((events / "0-saved-2").exists() and (events / "1-saved-2").exists()) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            killed.set()
            ranks.kill(1)
            return "reset"

        gcs_proxy.fault = kill_rank_1_mid_upload
        ranks.wait_for(events / "0-held")
        deadline = time.monotonic() + 60
        while not killed.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert killed.is_set(), "rank 1 never uploaded a part of its second save"
        # Rank 0's shard and the pending metadata of save 2 are in GCS; .metadata is still save 1's.
        deadline = time.monotonic() + 30
        while not any(name.endswith(".pending") for name in _names(path)) and time.monotonic() < deadline:
            time.sleep(0.1)
        names = _names(path)
        assert any(name.endswith(".pending") for name in names), names
        assert not any(name.startswith("__1_0.") and name.endswith(".distcp.uploaded") for name in names)
        seed, bad, _ = load_seed(path, None)
        assert (seed, bad) == (1, [])
    gcs_proxy.fault = None
    seed, bad, _ = load_seed(path, str(tmp_path / "new-node"))
    assert (seed, bad) == (1, [])  # a new node resumes from GCS's checkpoint, still save 1's
    seed, bad, source = load_seed(path, node)
    assert (seed, bad, source.chosen_tier) == (2, [], "local")  # the node has save 2, whole

    # A restart on the node takes over what the dead ranks left: rank 1's upload, and the publish.
    with tier(node) as restarted:
        assert restarted.finish_pending() >= 2
        assert restarted.wait(60)
    seed, bad, source = load_seed(path, str(tmp_path / "another-node"))
    assert (seed, bad, source.chosen_tier) == (2, [], "gcs")
    assert load_seed(path, None)[:2] == (2, [])
    assert not [name for name in _names(path) if name.endswith((".uploaded", ".pending"))]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_lightning_resumes_last_on_the_node_and_on_a_new_node(kind: str, gs_root: str, local_root: Path,
                                                             tmp_path: Path) -> None:
    import torch

    if kind == "model_parallel" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7):
        pytest.skip("FSDP2 (fully_shard) cannot train on CPU before torch 2.7 (CPU streams lack record_event)")
    root, node, new_node = f"{gs_root}/{kind}", str(local_root / "node"), str(local_root / "new-node")
    fit = {"op": "tiered_lightning", "kind": kind, "root": root}
    steps = [{**fit, "local_dir": node, "max_steps": 3}, {**fit, "local_dir": node, "max_steps": 5},
             {**fit, "local_dir": new_node, "max_steps": 6}]
    reports = run(steps, 2, tmp_path, timeout_s=600)
    first, second, third = reports[0]["steps"]
    assert (first["started"]["step"], first["ended"]["step"]) == (0, 3)
    # ckpt_path="last": the same node resumes the model and optimizer state the first fit ended with...
    assert second["started"] == first["ended"]
    # ... and a new node (an empty local_dir) the second's, from GCS: teardown waited for its uploads.
    assert third["started"] == second["ended"]
    # Each step saves twice (its own checkpoint and last.ckpt), a shard per rank each time.
    assert (third["ended"]["step"], [s["saves"] for s in (first, second, third)]) == (6, [6, 4, 2])
    assert [s["pending"] for s in (first, second, third)] == [0, 0, 0]
    assert reports[1]["steps"] == reports[0]["steps"]
    assert ".metadata" in _names(f"{root}/checkpoints/last.ckpt")


@pytest.mark.slow
def test_remote_every_publishes_every_nth_save_and_keeps_the_others_on_the_node(
        gs_root: str, local_root: Path, tmp_path: Path) -> None:
    from dataflux_ckpt.tiered_dcp import token_of

    path, node = f"{gs_root}/every-2", str(local_root / "node")
    saves = [{"op": "tiered_save", "path": path, "local_dir": node, "seed": seed, "durable": True, "remote_every": 2}
             for seed in (1, 2, 3)]
    reports = run(saves, 2, tmp_path)
    assert all(step["durable"] for report in reports for step in report["steps"])
    # Only the second save went to GCS: its metadata and its two shards, nothing of the others.
    names = _names(path)
    assert names[0] == ".metadata" and len(names) == 3, names
    assert len({token_of(name) for name in names[1:]}) == 1, names
    assert load_seed(path, str(tmp_path / "new-node"))[:2] == (2, [])  # a new node resumes from GCS
    seed, bad, source = load_seed(path, node)
    assert (seed, bad, source.chosen_tier) == (3, [], "local")  # the node from its newer save, never uploaded


@pytest.mark.slow
def test_lightning_sends_every_nth_step_to_gcs_with_remote_every(gs_root: str, local_root: Path,
                                                                 tmp_path: Path) -> None:
    root, node, new_node = f"{gs_root}/every-2", str(local_root / "node"), str(local_root / "new-node")
    fit = {"op": "tiered_lightning", "kind": "fsdp", "root": root, "remote_every": 2}
    first = run([{**fit, "local_dir": node, "max_steps": 3}], 2, tmp_path, timeout_s=600)[0]["steps"][0]
    assert (first["started"]["step"], first["ended"]["step"], first["saves"]) == (0, 3, 6)
    # Steps 1 and 3 stayed on the node, both of their saves (the step's checkpoint and last.ckpt):
    # GCS holds step 2's last.ckpt, and nothing of step 3's.
    names = _names(f"{root}/checkpoints")
    assert ".metadata" in _names(f"{root}/checkpoints/last.ckpt")
    assert not [name for name in names if "step=3" in name or "step=1" in name], names
    # The node resumes from its own newer step 3 (and keeps step 4 there: a new process counts its
    # rounds afresh); a new node from GCS's step 2.
    reports = run([{**fit, "local_dir": node, "max_steps": 4}, {**fit, "local_dir": new_node, "max_steps": 4}],
                  2, tmp_path, timeout_s=600)
    on_the_node, on_new_node = reports[0]["steps"]
    assert on_the_node["started"] == first["ended"]
    assert (on_new_node["started"] or {}).get("step") == 2, on_new_node
    assert reports[1]["steps"] == reports[0]["steps"]
