"""A run on disk: checkpoints (checkpoint.py) and their atomic, checksummed files (safe_files.py),
the output folder and the resume comparison (runs.py), stopping on a signal with a checkpoint
(preemption.py)."""
