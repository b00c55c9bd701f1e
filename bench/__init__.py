"""The repository's studies and the results pages it commits, run from the repository's root as `python -m bench.NAME`
(bench/README.md). Not part of the installed product: these modules import river_edge, and each other as bench.NAME;
river_edge imports nothing of them."""
