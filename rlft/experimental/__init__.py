"""TRL's experimental module paths (`trl.experimental.*`: async_grpo, the deprecated distillation
alias, ...), made from the kind rows (rlft/kinds.py) by rlft/paths.py."""
