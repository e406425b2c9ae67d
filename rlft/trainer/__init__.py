"""TRL's module paths (`trl.trainer.*`), so `from trl.trainer.reward_trainer import ...` carries
over with the import changed. The modules are made from the kind rows (rlft/kinds.py) by
rlft/paths.py."""
