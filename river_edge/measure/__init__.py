"""Measurement: how every benchmark alternates its configurations and summarises paired ratios (harness.py),
what they compare and how they measure memory and the host (files.py, probe.py, host.py), the runtime
benchmark (bench.py), decoding modes against the files a user has (modes.py), output quality (quality.py),
long generations and batches (longrun.py), task accuracy (evaluate.py over tasks.py), and the results pages and
their figures from the JSON (records.py, report.py, headline.py for the README's first screen, plots.py)."""
