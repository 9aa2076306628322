"""Benchmark runners: ``python -m benchmarks.<name> --help``."""
