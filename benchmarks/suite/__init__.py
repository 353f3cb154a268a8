"""The benchmark suite behind ``benchmarks/run.py``: workloads, measurement, report."""
