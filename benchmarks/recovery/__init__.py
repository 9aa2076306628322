"""A job that dies comes back: the recovery job, the events that stop it, and the log both leave.

* :mod:`benchmarks.recovery.job`: a Lightning training run (``python -m benchmarks.recovery.job``) that
  checkpoints through one storage plugin every N steps, resumes from its newest checkpoint when it
  starts again, and writes what happens to an event log (JSON lines);
* :mod:`benchmarks.recovery.events`: ways to start the job (a fresh process, or a fork of a process
  that has imported torch and Lightning already), the events users meet (SIGKILL at a chosen point,
  SIGTERM with a grace period, Slurm's requeue signal, a torchrun rank killed), and the reader of the
  event log, from which tests check each resume and a goodput runner times each part of a run.
"""
