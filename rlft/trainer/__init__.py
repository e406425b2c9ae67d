"""TRL's module paths (`trl.trainer.*`), so `from trl.trainer.reward_trainer import ...` carries over with
the import changed. rlft's trainers live in rlft/train/; these modules only re-export them."""
