"""Where a run's numbers go: the metrics sink, progress and trackers (tracking.py), throughput and
MFU (perf.py), curves from metrics.jsonl (plots.py)."""
