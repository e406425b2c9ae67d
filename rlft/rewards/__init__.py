"""Reward functions: TRL's calling convention, built-ins, and reward models as rewards."""

from rlft.rewards.builtins import (
    accuracy_reward,
    exact_match_reward,
    format_reward,
    get_soft_overlong_punishment,
    math_verify_reward,
)
from rlft.rewards.calling import RewardFunctionError, RewardLog, compute_rewards, resolve_reward

__all__ = ["accuracy_reward", "exact_match_reward", "format_reward", "get_soft_overlong_punishment", "math_verify_reward",
           "RewardFunctionError", "RewardLog", "compute_rewards", "resolve_reward"]
