"""Reward functions: TRL's calling convention, built-ins (TRL's and rlft's), and reward models as
rewards."""

from rlft.rewards.builtins import (
    accuracy_reward,
    exact_match_reward,
    format_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    math_verify_reward,
    reasoning_accuracy_reward,
    think_format_reward,
)
from rlft.rewards.calling import RewardFunctionError, RewardLog, compute_rewards, resolve_reward

__all__ = ["accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
           "get_soft_overlong_punishment", "get_cosine_scaled_reward", "get_repetition_penalty_reward",
           "exact_match_reward", "format_reward", "math_verify_reward", "RewardFunctionError", "RewardLog",
           "compute_rewards", "resolve_reward"]
