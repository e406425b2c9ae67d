"""The policy update: the scoring forwards of a rollout (rollout_logprobs.py), advantages
(rollout_advantages.py), the guarded optimiser step and the updater (optimization.py, updater.py),
the objectives it optimises (objectives.py, distill_objective.py), the step's metrics, the row
carriers (rollout_batch.py), several teachers (teachers.py), the reward model's packed pairs."""
