"""Execution: the workers that run the models and scripts clients ask for with run_model / run_script.

``python -m smartredis_io.worker`` starts a supervisor (:mod:`~smartredis_io.worker.supervisor`) and
its worker processes (:mod:`~smartredis_io.worker.executor`), which load models and scripts under the
policies of :mod:`smartredis_io._client.torchscript_policy` and
:mod:`smartredis_io._client.export_policy` (``_torchscript``, ``_torch_export``) on the device
``devices`` picks. ``worker_protocol`` is what the supervisor, its workers and the launchers agree
on. Importing this package imports no torch: the worker processes do.
"""
