"""The SmartSim scaling tests (throughput, inference, data aggregation) for ``smartredis_io``.

``python -m benchmarks.smartsim_scaling {throughput,inference,aggregation,process_results} --help``.
"""
