"""Owners of temporaries: their tokens, and when a real process is certainly gone (and when it is not)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_storage_plugins.owners import Owner

HEX12 = st.text(alphabet="0123456789abcdef", min_size=12, max_size=12)
OWNERS = st.builds(
    Owner,
    pid=st.integers(0, 2**31 - 1),
    machine=st.none() | HEX12,
    started=st.none() | st.integers(0, 2**63 - 1),
    job=st.none() | HEX12,
    attempt=st.none() | st.integers(0, 10**9 - 1),
).filter(lambda owner: (owner.job is None) == (owner.attempt is None))


@given(OWNERS)
def test_a_token_names_its_owner_with_name_safe_characters(owner: Owner) -> None:
    token = owner.token()
    assert Owner.from_token(token) == owner
    assert set(token) <= set("abcdefghijklmnopqrstuvwxyz0123456789.")
    assert len(token) <= 80


@given(st.text(max_size=100))
def test_any_other_text_is_no_owner_or_reads_back_the_same(text: str) -> None:
    owner = Owner.from_token(text)
    assert owner is None or Owner.from_token(owner.token()) == owner


def test_this_process_is_its_own_live_owner() -> None:
    me = Owner.current({})
    assert me.pid == os.getpid()
    assert me.gone(me) is None
    assert me.job is None and me.attempt is None


def _child_owner() -> tuple[subprocess.Popen[str], Owner]:
    child = subprocess.Popen(
        [sys.executable, "-c", "from lightning_storage_plugins.owners import Owner; "
         "print(Owner.current().token(), flush=True); import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    owner = Owner.from_token(child.stdout.readline().strip())
    assert owner is not None and owner.pid == child.pid
    return child, owner


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process liveness is read from /proc")
def test_a_killed_process_on_this_machine_is_gone_once_killed_even_before_it_is_reaped() -> None:
    child, owner = _child_owner()
    try:
        assert owner.gone() is None, "a running process is not gone"
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has exited; a zombie until reaped
        assert owner.gone() == f"its process (pid {child.pid}) on this machine has exited"
    finally:
        child.kill()
        child.wait(30)
    assert owner.gone() == f"its process (pid {child.pid}) on this machine has exited"


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process liveness is read from /proc")
def test_a_pid_given_to_a_later_process_is_not_its_owner() -> None:
    me = Owner.current()
    assert me.started is not None
    earlier = Owner(me.pid, me.machine, me.started - 1)
    assert "now names another" in (earlier.gone() or "")


def test_a_dead_pid_of_another_machine_says_nothing() -> None:
    me = Owner.current()
    child, owner = _child_owner()
    child.kill()
    child.wait(30)
    elsewhere = Owner(owner.pid, "0" * 12 if me.machine != "0" * 12 else "1" * 12, owner.started)
    assert elsewhere.gone() is None
    assert Owner(owner.pid, None, owner.started).gone() is None, "no machine recorded: not known to be here"


SLURM = {"SLURM_JOB_ID": "81", "SLURM_CLUSTER_NAME": "c1"}


@pytest.mark.parametrize(("owner_env", "observer_env", "gone"), [
    ({**SLURM, "SLURM_RESTART_COUNT": "0"}, {**SLURM, "SLURM_RESTART_COUNT": "1"}, True),
    ({**SLURM}, {**SLURM, "SLURM_RESTART_COUNT": "2"}, True),  # before the first requeue: no count
    ({**SLURM, "SLURM_RESTART_COUNT": "1"}, {**SLURM, "SLURM_RESTART_COUNT": "1"}, False),  # another node, same attempt
    ({**SLURM, "SLURM_RESTART_COUNT": "2"}, {**SLURM, "SLURM_RESTART_COUNT": "1"}, False),  # a later attempt
    ({**SLURM, "SLURM_RESTART_COUNT": "0"}, {**SLURM, "SLURM_JOB_ID": "82", "SLURM_RESTART_COUNT": "1"}, False),
    ({**SLURM, "SLURM_RESTART_COUNT": "0"}, {**SLURM, "SLURM_CLUSTER_NAME": "c2", "SLURM_RESTART_COUNT": "1"}, False),
    ({**SLURM, "SLURM_RESTART_COUNT": "0"}, {"SLURM_RESTART_COUNT": "1"}, False),  # the observer is in no job
    # torchrun's agents count their restarts each for itself: no attempt order between nodes.
    ({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0"},
     {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "3"}, False),
])
def test_an_earlier_attempt_of_the_same_slurm_job_is_gone_on_any_machine(owner_env, observer_env, gone) -> None:
    owner = Owner(pid=1, machine="a" * 12)  # another machine's process: only the job can tell
    recorded = Owner.current(owner_env)
    owner = Owner(owner.pid, owner.machine, None, recorded.job, recorded.attempt)
    observer = Owner.current(observer_env)
    reason = owner.gone(observer)
    assert (reason is not None) is gone
    if gone:
        assert reason.startswith(f"it ran in attempt {owner.attempt} of this Slurm job")
