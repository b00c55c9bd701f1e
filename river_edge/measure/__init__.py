"""Measurement: how every benchmark alternates its configurations and summarises paired ratios (harness.py), what
they compare and how they measure memory and the host (files.py, probe.py, host.py), the runtime benchmark
(bench.py), decoding modes against the files a user has (modes.py), task accuracy (evaluate.py over tasks.py), and
`river bench`'s JSON and figures (records.py, plots.py). The studies and the results pages the repository commits
are bench/'s (a package of the repository, not of the product)."""
