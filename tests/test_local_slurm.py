"""The local Slurm cluster the recovery and SmartSim tests run on: what they rely on, on real daemons.

Each test checks one behaviour users' jobs meet on a real cluster (accounting, one task per node,
Lightning's requeue signal, requeue with its restart count, two steps in one allocation), and that the
cluster leaves nothing behind.
"""

from __future__ import annotations

import os
import tempfile
import time

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_storage_plugins.services import ServiceStartError
from tests.support.processes import alive
from tests.support.slurm import LocalSlurm, SlurmJobError, parse_scontrol, slurm_unavailable_reason

WAIT_S = 120.0  # a job's start and end on a busy 2-core machine, with room to spare


def test_a_batch_job_completes_and_its_record_reaches_accounting(slurm_cluster: LocalSlurm) -> None:
    job = slurm_cluster.sbatch("--job-name=hello", script="#!/bin/bash\necho hello from $SLURMD_NODENAME\n")

    info = slurm_cluster.wait_for(job, "COMPLETED", WAIT_S)
    assert info["ExitCode"] == "0:0"
    assert "hello from n" in slurm_cluster.output(job)
    record = slurm_cluster.wait_for(job, "COMPLETED", WAIT_S, source="sacct")
    assert record["ExitCode"] == "0:0"
    # slurmdbd may take the job's end before its start, and names it "allocation" until the start is in
    deadline = time.monotonic() + WAIT_S
    while {row["JobID"]: row["JobName"] for row in slurm_cluster.sacct(job)} != {str(job): "hello",
                                                                                 f"{job}.batch": "batch"}:
        assert time.monotonic() < deadline, slurm_cluster.sacct(job)
        time.sleep(0.25)


def test_a_failed_job_is_reported_with_its_state_exit_code_and_output(slurm_cluster: LocalSlurm) -> None:
    job = slurm_cluster.sbatch("--wrap=echo the reason it failed; exit 3")

    with pytest.raises(SlurmJobError, match=r"(?s)ended FAILED.*ExitCode=3:0.*the reason it failed"):
        slurm_cluster.wait_for(job, "COMPLETED", WAIT_S)
    assert slurm_cluster.wait_for(job, "FAILED", WAIT_S, source="sacct")["ExitCode"] == "3:0"


def test_srun_on_three_nodes_runs_one_task_on_each(slurm_cluster: LocalSlurm) -> None:
    result = slurm_cluster.run(["srun", "-N3", "-n3", "bash", "-c", "echo $SLURM_PROCID $SLURMD_NODENAME"],
                               timeout=WAIT_S)

    tasks = dict(line.split() for line in result.stdout.splitlines())
    assert sorted(tasks) == ["0", "1", "2"]
    assert sorted(tasks.values()) == ["n1", "n2", "n3"]


def test_a_step_sees_no_database_address_of_this_process(slurm_cluster: LocalSlurm,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # An earlier test's SmartRedis database is none of a job's: a step given its SSDB would connect there
    # instead of to the database its SmartSim experiment launched.
    for name in ("SSDB", "SR_DB_TYPE", "SSKEYIN", "SSKEYOUT"):
        monkeypatch.setenv(name, "from-this-process")
    result = slurm_cluster.run(["srun", "-N1", "bash", "-c", "env | grep -E '^(SSDB|SR_DB_TYPE|SSKEY)' || true"],
                               timeout=WAIT_S)
    assert result.stdout == ""
    given_one = slurm_cluster.run(["srun", "-N1", "printenv", "SSDB"], env={"SSDB": "10.0.0.1:6780"}, timeout=WAIT_S)
    assert given_one.stdout == "10.0.0.1:6780\n"  # what the caller passes still reaches the step


TRAP_SCRIPT = """#!/bin/bash
trap 'echo "USR1 reached the trap"; exit 0' USR1
echo trap set
# a shell takes a trapped signal only between commands: wait, not a foreground sleep
sleep 600 & wait
echo "no USR1 came"; exit 1
"""


def test_usr1_reaches_the_batch_scripts_trap_from_scancel(slurm_cluster: LocalSlurm) -> None:
    # Lightning's requeue set-up: --requeue, and USR1 ahead of the time limit (none here)
    job = slurm_cluster.sbatch("--requeue", "--signal=B:USR1@90", script=TRAP_SCRIPT)
    slurm_cluster.wait_for_output(job, "trap set", WAIT_S)

    slurm_cluster.signal(job, "USR1", batch=True)

    assert slurm_cluster.wait_for(job, "COMPLETED", WAIT_S)["ExitCode"] == "0:0"
    assert "USR1 reached the trap" in slurm_cluster.output(job)


@pytest.mark.slow
def test_usr1_reaches_the_batch_scripts_trap_before_the_time_limit(slurm_cluster: LocalSlurm) -> None:
    # due 5 s into a 1-minute limit; slurmctld checks time limits every 30 s, so it comes within 35 s
    job = slurm_cluster.sbatch("--requeue", "--time=1", "--signal=B:USR1@55", script=TRAP_SCRIPT)

    assert slurm_cluster.wait_for(job, "COMPLETED", WAIT_S)["ExitCode"] == "0:0"
    assert "USR1 reached the trap" in slurm_cluster.output(job)


def test_a_requeued_job_runs_again_with_its_restart_count(slurm_cluster: LocalSlurm) -> None:
    job = slurm_cluster.sbatch("--requeue", script="""#!/bin/bash
echo "run ${SLURM_RESTART_COUNT:-0}"
[ "${SLURM_RESTART_COUNT:-0}" -ge 1 ] && exit 0
sleep 600 & wait
""")
    slurm_cluster.wait_for_output(job, "run 0", WAIT_S)

    slurm_cluster.run(["scontrol", "requeue", str(job)])
    slurm_cluster.requeue_now(job, WAIT_S)

    info = slurm_cluster.wait_for(job, "COMPLETED", WAIT_S, restarts=1)
    assert (info["Restarts"], info["ExitCode"]) == ("1", "0:0")
    assert "run 1" in slurm_cluster.output(job)
    slurm_cluster.wait_for(job, "COMPLETED", WAIT_S, restarts=1, source="sacct")
    runs = [row["State"] for row in slurm_cluster.sacct(job, duplicates=True) if row["JobID"] == str(job)]
    assert runs == ["REQUEUED", "COMPLETED"]


# Step A holds the allocation's only CPU until it sees step B's file, or until told to stop.
TWO_STEPS = """
srun bash -c 'touch a.started; until [ -e b.ran ] || [ -e a.stop ]; do sleep 0.1; done; [ -e b.ran ] && echo "A saw B"' &
until [ -e a.started ]; do sleep 0.05; done
{b_srun} bash -c 'touch b.ran; echo "B ran"'
touch a.stop
wait $!
"""


@pytest.mark.parametrize("overlap", [True, False], ids=["SLURM_OVERLAP=1", "no-overlap"])
def test_a_second_step_runs_beside_the_first_only_with_slurm_overlap(slurm_cluster: LocalSlurm, tmp_path,
                                                                    overlap: bool) -> None:
    # without the overlap, step B would wait for step A, which waits for B: it gives up after 2 s
    script = TWO_STEPS.format(b_srun="SLURM_OVERLAP=1 srun" if overlap else "srun --immediate=2")

    result = slurm_cluster.run(["salloc", "-N1", "-n1", "bash", "-c", script], cwd=tmp_path, check=False,
                               timeout=WAIT_S)

    if overlap:
        assert (result.returncode, sorted(result.stdout.splitlines())) == (0, ["A saw B", "B ran"]), result.stderr
    else:
        # Slurm gives a step every CPU of the allocation on its node: a second one waits for them
        assert "B ran" not in result.stdout and "A saw B" not in result.stdout, result.stdout
        assert "Requested nodes are busy" in result.stderr


@pytest.mark.slow
def test_teardown_kills_jobs_steps_and_daemons_and_leaves_the_other_cluster_running(
        slurm_cluster: LocalSlurm) -> None:
    with LocalSlurm(nodes=1, accounting=True) as other:
        # a batch shell that ignores SIGTERM, a step, and a process that left the job's process tree
        # (a double fork: its parent is init); each writes its pid, the first two also their parent's
        # (the slurmstepd of the batch step and of step 0)
        job = other.sbatch(script="""#!/bin/bash
trap '' TERM
echo $$ $PPID > batch.pids
srun bash -c 'echo $$ $PPID > step.pids; exec sleep 600' &
(setsid bash -c 'echo $$ > escaped.pid; exec sleep 600' &)
sleep 600
""")
        other.wait_for(job, "RUNNING", WAIT_S)
        files = [other.jobs_dir / name for name in ("batch.pids", "step.pids", "escaped.pid")]
        deadline = time.monotonic() + WAIT_S
        while not all(f.is_file() and f.read_text().strip() for f in files):
            assert time.monotonic() < deadline, f"the job did not start its processes: {other.output(job)}"
            time.sleep(0.1)
        pids = {int(pid) for f in files for pid in f.read_text().split()} | set(other.pids.values())
        assert {"munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd:n1"} <= set(other.pids)
        path = other.path
        assert all(alive(pid) for pid in pids)

    assert not [pid for pid in pids if alive(pid)]
    assert not path.exists()
    assert not [p.info for p in psutil.process_iter(["pid", "cmdline"])
                if any(str(path) in arg for arg in p.info["cmdline"] or ())]
    # the session's cluster, beside it on its own ports, munge and database, still serves
    assert set(slurm_cluster.node_states()) == set(slurm_cluster.nodes)
    assert slurm_cluster.run(["srun", "-N1", "echo", "still here"], timeout=WAIT_S).stdout == "still here\n"


def test_a_cluster_whose_nodes_do_not_come_up_fails_naming_them_and_cleans_up() -> None:
    reason = slurm_unavailable_reason(accounting=False)
    if reason:
        pytest.skip(reason)
    with tempfile.TemporaryDirectory(prefix="local-slurm-test-") as base:
        os.chmod(base, 0o711)  # munged's rule: everyone may traverse its socket's directories
        # a node declaring more CPUs than the machine has is refused by slurmctld (state INVAL)
        cluster = LocalSlurm(nodes=1, accounting=False, cpus_per_node=4096, base_dir=base)

        with pytest.raises(ServiceStartError, match=r"(?s)nodes of the local Slurm cluster were refused \['n1'\]"
                                                    r".*reasons: n1: Low socket\*core\*thread count, Low CPUs"
                                                    r".*--- slurmctld:.*--- slurmd:n1:"):
            cluster.start()
        assert cluster.pids == {}
        assert os.listdir(base) == []
        assert not [p.info for p in psutil.process_iter(["pid", "cmdline"])
                    if any(base in arg for arg in p.info["cmdline"] or ())]


KEYS = st.from_regex(r"[A-Z][A-Za-z0-9_:/]{0,12}", fullmatch=True)
# a value's first word may hold "=" (TRES=cpu=1,node=1); a space followed by Key= starts the next field
VALUES = st.builds(lambda first, rest: " ".join([first, *rest]),
                   st.from_regex(r"[^\s=][^\s]{0,12}", fullmatch=True),
                   st.lists(st.from_regex(r"[^\s=]{1,8}", fullmatch=True), max_size=3))


@given(st.dictionaries(KEYS, VALUES, min_size=1, max_size=12))
def test_parse_scontrol_reads_back_every_field(fields: dict[str, str]) -> None:
    line = " ".join(f"{key}={value}" for key, value in fields.items())

    assert parse_scontrol(line) == fields
