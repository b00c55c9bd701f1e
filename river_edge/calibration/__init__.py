"""Calibration: record the exit signals and the damage of exiting, fit thresholds, report honestly.

On calibration prompts the backbone decodes greedily; for every decode token and every layer l we record
the paper's signal s_l = cos(h_l, h_l+1) (also without the few massive-activation dimensions), and what
exiting after l costs: the KL of the next-token distribution against the backbone and top-1 agreement,
with the river attending to the backbone's cache ("clean", cheap, all layers at once). Thresholds are fitted
on that, then checked "online": the rule decodes with its own mixed KV cache, so errors accumulate as at
run time, and the fit is tightened until it meets the target online. The report, on prompts the fit did not
see, sets the fitted rule beside random token selection at the same depth and beside all-river.

The pipeline, one module per stage:
  target.py   what the fit must meet (Target) and how it is measured (Settings)
  prompts.py  the calibration prompts (packaged set, or a user's file)
  record.py   greedy backbone decodes in the reference; per token and layer the exit signals and the
              clean damage of exiting
  rule.py     the paper's rule fitted on the records, checked online (the rule writing its own K/V),
              compared with random selection at the same depth; the verdict
  gate.py     the gated mode's entropy gate, fitted and reported the same way
  report.py   the whole calibration of a river GGUF into a new file, its summary table and figure
"""
