"""Measurement: what the benchmarks compare and how they time it (files.py, probe.py, host.py), the runtime
benchmark (bench.py), decoding modes against the files a user has (modes.py), output quality (quality.py),
long generations and batches (longrun.py), task accuracy (evaluate.py over tasks.py), and the results pages and
their figures (report.py, plots.py)."""
