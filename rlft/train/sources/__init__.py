"""What feeds a step: the rollout-source protocol, its registry and prompt schedule
(rollout_source.py), the engine, tool loop, environments and rollout_func behind it (generation.py),
the async producer's schedule (async_source.py) and DAPO's dynamic sampling
(dynamic_sampling.py)."""
