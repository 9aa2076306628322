"""The published Dataflux package (gcs-torch-dataflux) as a peer row of ``benchmarks.lightning_ckpt``.

gcs-torch-dataflux 1.4.0 is written against google-cloud-storage 2.x (it imports
``google.resumable_media`` and helpers that google-cloud-storage 3 removed), while this project's plugin
needs google-cloud-storage 3. The two cannot share one environment, so the peer runs in a worker process
whose ``PYTHONPATH`` puts a directory with the peer and its GCS client first::

    pip install --no-deps --target DIR gcs-torch-dataflux==1.4.0 absl-py==2.5.1 \\
        google-cloud-storage==2.19.0 google-resumable-media==2.7.2

(torch, Lightning, google-auth and google-api-core come from the benchmark's own environment.) The
worker builds the same model, data and Trainer (:mod:`benchmarks.lightning_model`), talks to the same
GCS endpoint, and times each save and load itself; the runner drives it one operation at a time, so its
rows interleave with the others. Its protocol is one JSON object per line on stdin and stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataflux_ckpt.emulator import EMULATOR_PROJECT
from lightning_storage_plugins.services import die_with_parent

PEER_PACKAGE = "gcs-torch-dataflux"
PEER_VERSION = "1.4.0"
PEER_PATH_ENV = "DATAFLUX_PEER_PATH"
PEER_PINS = ("gcs-torch-dataflux==1.4.0", "absl-py==2.5.1", "google-cloud-storage==2.19.0",
             "google-resumable-media==2.7.2")
PEER_INSTALL_HINT = (f"install it in its own directory, `pip install --no-deps --target DIR {' '.join(PEER_PINS)}`, "
                f"and pass --peer-path DIR (or set ${PEER_PATH_ENV}); `make setup` installs it into "
                f".tools/gcs-torch-dataflux")
START_TIMEOUT_S = 600.0  # imports, model build and one training step (LAYERS=1000 takes minutes)
OP_TIMEOUT_S = 1800.0
STOP_TIMEOUT_S = 30.0
CHECKOUT = Path(__file__).resolve().parents[1]
# Where the checkout's set-up (`make setup`) installs the peer.
CHECKOUT_PEER_PATH = CHECKOUT / ".tools" / "gcs-torch-dataflux"


def default_peer_path() -> str | None:
    """The peer's directory: ``$DATAFLUX_PEER_PATH``, else the checkout's set-up's, else none (this environment)."""
    if os.environ.get(PEER_PATH_ENV):
        return os.environ[PEER_PATH_ENV]
    return str(CHECKOUT_PEER_PATH) if (CHECKOUT_PEER_PATH / "dataflux_pytorch").is_dir() else None


@dataclass(frozen=True)
class PeerVariant:
    """One way to run the peer: its CheckpointIO class and options."""

    key: str
    name: str
    asynchronous: bool = False
    multipart: bool = True


PEER_VARIANTS: dict[str, PeerVariant] = {
    v.key: v
    for v in [
        PeerVariant("peer", f"Dataflux ({PEER_PACKAGE} {PEER_VERSION})"),
        PeerVariant("peer-async", f"Dataflux async ({PEER_PACKAGE} {PEER_VERSION})", asynchronous=True),
        PeerVariant("peer-no-mpu", f"Dataflux, multipart off ({PEER_PACKAGE} {PEER_VERSION})", multipart=False),
    ]
}


class PeerError(RuntimeError):
    """The peer worker failed or did not answer in time; the message has its log tail."""


class PeerUnavailableError(PeerError):
    """The peer package cannot be imported where the worker runs; the message says how to install it."""


class PeerProcess:
    """The parent's handle on a running peer worker (a context manager).

    Args:
        endpoint: the GCS endpoint the worker's client talks to (None: real GCS, from the environment).
        layers: the model's layer count.
        peer_path: directory that holds the peer and its google-cloud-storage 2.x (first on PYTHONPATH);
            None runs the worker in this environment.
        project: GCP project of the peer's client.
        wikitext2_dir: train on WikiText2 from here instead of synthetic tokens.
    """

    def __init__(self, *, endpoint: str | None, layers: int, peer_path: str | None = None,
                 project: str | None = None, wikitext2_dir: str | None = None) -> None:
        argv = [sys.executable, "-m", "benchmarks.lightning_peer", "--layers", str(layers)]
        if endpoint:
            argv += ["--endpoint", endpoint]
        if project:
            argv += ["--project", project]
        if wikitext2_dir:
            argv += ["--wikitext2-dir", wikitext2_dir]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [peer_path, str(CHECKOUT), env.get("PYTHONPATH")]))
        self._log = tempfile.NamedTemporaryFile(prefix="peer-worker-", suffix=".log", delete=False)
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      env=env, cwd=str(CHECKOUT), preexec_fn=die_with_parent, text=True)
        self.info: dict[str, Any] = {}
        try:
            self.info = self._reply(START_TIMEOUT_S, "start-up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> PeerProcess:
        return self

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self._proc.pid

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, max_bytes: int = 4000) -> str:
        with open(self._log.name, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode(errors="replace")

    def _reply(self, timeout_s: float, what: str) -> dict[str, Any]:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            state = "exited" if self._proc.poll() is not None else f"did not answer within {timeout_s:.0f} s"
            raise PeerError(f"peer worker {state} during {what}; log tail:\n{self.log_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            error = PeerUnavailableError if reply.get("unavailable") else PeerError
            raise error(f"peer worker: {what} failed: {reply.get('error')}")
        return reply

    def call(self, op: str, variant: str, path: str) -> dict[str, Any]:
        """Run ``op`` ("save", "load" or "remove") of ``variant`` on ``path``; the worker's measurement.

        Raises:
            PeerError: the operation failed, or the worker died or did not answer in time.
        """
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps({"op": op, "variant": variant, "path": path}) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError as err:
            raise PeerError(f"peer worker exited; log tail:\n{self.log_tail()}") from err
        return self._reply(OP_TIMEOUT_S, f"{op} {path}")

    def close(self) -> None:
        """Ask the worker to stop (its plugins tear down), then kill it if it does not. Idempotent."""
        proc = self._proc
        if proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                proc.stdin.close()
                proc.wait(STOP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except OSError:
                    pass
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


# The worker ------------------------------------------------------------------------------------------
def _client(endpoint: str | None, project: str | None) -> Any:
    from google.cloud import storage

    if endpoint is None:
        return None  # the peer makes its own client from the environment
    from google.auth.credentials import AnonymousCredentials

    return storage.Client(project=project or EMULATOR_PROJECT, credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": endpoint})


def _plugins(endpoint: str | None, project: str | None) -> dict[str, Any]:
    from dataflux_pytorch.lightning import DatafluxLightningAsyncCheckpoint, DatafluxLightningCheckpoint

    client = _client(endpoint, project)
    plugins = {}
    for variant in PEER_VARIANTS.values():
        cls = DatafluxLightningAsyncCheckpoint if variant.asynchronous else DatafluxLightningCheckpoint
        plugins[variant.key] = cls(project or EMULATOR_PROJECT, storage_client=client,
                                   disable_multipart=not variant.multipart)
    return plugins


def _serve(args: argparse.Namespace, out: Any) -> None:
    from benchmarks.lightning_model import fitted_trainer, save
    from benchmarks.report import PeakRSS

    def send(reply: dict[str, Any]) -> None:
        out.write(json.dumps(reply) + "\n")
        out.flush()

    try:
        from importlib.metadata import version

        plugins = _plugins(args.endpoint, args.project)
        versions = {"peer": version(PEER_PACKAGE), "google-cloud-storage": version("google-cloud-storage")}
    except ImportError as err:
        send({"ok": False, "unavailable": True, "error": f"{type(err).__name__}: {err}"})
        return
    with tempfile.TemporaryDirectory(prefix="peer-worker-") as root:
        trainer = fitted_trainer(args.layers, args.wikitext2_dir, root)
        send({"ok": True, "versions": versions, "pid": os.getpid()})
        for line in sys.stdin:
            request = json.loads(line)
            op = request["op"]
            if op == "quit":
                break
            variant, path = PEER_VARIANTS[request["variant"]], request["path"]
            plugin = plugins[variant.key]
            try:
                reply: dict[str, Any] = {"ok": True}
                loaded = None
                with PeakRSS() as rss:
                    start = time.perf_counter()
                    if op == "save":
                        save(trainer, plugin, path)
                        reply["blocked_s"] = time.perf_counter() - start
                        if variant.asynchronous:
                            plugin.teardown()  # waits until the checkpoint is stored
                    elif op == "load":
                        loaded = plugin.load_checkpoint(path)
                    elif op == "remove":
                        plugin.remove_checkpoint(path)
                    else:
                        raise ValueError(f"unknown operation {op!r}")
                    reply["seconds"] = time.perf_counter() - start
                    del loaded  # a load's result is freed after the clock stops, as in the main rows
                reply["extra_rss_mb"] = rss.peak_mb - rss.start_mb
            except Exception as err:
                reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            send(reply)
        for plugin in plugins.values():
            plugin.teardown()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lightning_peer",
                                     description="gcs-torch-dataflux worker of benchmarks.lightning_ckpt "
                                                 "(started by it; JSON lines on stdin and stdout)")
    parser.add_argument("--endpoint", help="GCS endpoint URL (default: real GCS, from the environment)")
    parser.add_argument("--project", help="GCP project of the client")
    parser.add_argument("--layers", type=int, required=True, help="the model's encoder and decoder layers")
    parser.add_argument("--wikitext2-dir", help="train on WikiText2 from this directory")
    args = parser.parse_args(argv)
    # The protocol gets the real stdout; anything else that writes to stdout lands in the log.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _serve(args, out)


if __name__ == "__main__":
    main()
