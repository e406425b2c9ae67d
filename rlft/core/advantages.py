"""Advantage estimators over a step's sequence rewards, in a registry, with NaN-aware multi-reward
aggregation.

Rewards come as [N] with N = prompts x G (num_generations) and each prompt's completions contiguous.
NaN means "not applicable" and is left out of every statistic; a completion whose reward is NaN gets
advantage 0. Groups with zero spread (all rewards equal) give exactly 0 under every sequence-level
estimator (not under reinforce_pp, whose batch-wide whitening and per-token KL move them too).
`std` is the unbiased (Bessel-corrected) sample standard deviation, as in TRL.

ADVANTAGE_ESTIMATORS maps a name (the config's `advantage_estimator`) to an `EstimatorSpec`: the
function `fn(rewards [N], num_generations, *, scale_rewards, eps, lengths) -> advantages [N]` (a
spec is called like its function) and what it declares -- its level (sequence, or token: [N, C]),
the inputs it needs beyond the rewards (lengths, mask, token KL) and whether the KL penalty is in
its reward. `estimate(spec, inputs)` takes one `EstimatorInputs` built once per rollout;
`register_estimator` adds one:
    grpo                   DeepSeekMath (arXiv:2402.03300): (r_i - mean_g) / (std_g + eps);
                           `scale_rewards` batch / none divide by the batch's std or by nothing
                           (TRL's options)
    dr_grpo                Dr. GRPO (arXiv:2503.20783): r_i - mean_g, never divided by a std
    rloo                   RLOO (Ahmadian et al., arXiv:2402.14740):
                           r_i - (1/(G-1)) sum_{j != i} r_j
    reinforce_pp_baseline  REINFORCE++-baseline (arXiv:2501.03262): c_i = r_i - mean_g, then
                           normalised over the batch, (c_i - mean(c)) / (std(c) + eps)
    opo                    OPO (arXiv:2505.23585): r_i - b_g with the length-weighted baseline
                           b_g = sum_j |o_j| r_j / sum_j |o_j| (needs `lengths`)
    reinforce_pp           REINFORCE++ (arXiv:2501.03262), token level, the KL in its per-token
                           rewards
`kl_in_reward(spec)` is a sequence-level estimator with the KL penalty moved from the loss into the
reward (RLOO, Ahmadian et al. 2024, arXiv:2402.14740, as TRL's RLOOTrainer computes it): each total
reward clipped to `clip_range`, minus beta * sum_t (log pi_old - log pi_ref), then the estimator,
then (with `normalize`) whitened over the rows that have a baseline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch


def _group_mean_std(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """values [groups, size] with NaN -> (mean, unbiased std, valid count), each [groups, 1]."""
    valid = ~torch.isnan(values)
    count = valid.sum(-1, keepdim=True)
    filled = torch.where(valid, values, torch.zeros_like(values))
    mean = filled.sum(-1, keepdim=True) / count.clamp(min=1)
    sq = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values)).sum(-1, keepdim=True)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    std = torch.where(count > 1, std, torch.zeros_like(std))
    return mean, std, count


def _batch_std(values: torch.Tensor) -> torch.Tensor:
    valid = values[~torch.isnan(values)]
    return valid.std() if valid.numel() > 1 else values.new_zeros(())


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of "
                         f"{group_size}")
    return rewards.view(-1, group_size)  # [groups, G]


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale_rewards: str = "group",
                    eps: float = 1e-4, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO: centred by the group mean, divided by the group's std ("group"), the batch's ("batch")
    or not ("none")."""
    grouped = _grouped(rewards, group_size)
    mean, std, _ = _group_mean_std(grouped)
    centred = grouped - mean
    if scale_rewards == "group":
        scale = std
    elif scale_rewards == "batch":
        scale = _batch_std(rewards).expand_as(std)
    elif scale_rewards == "none":
        scale = None
    else:
        raise ValueError(f"scale_rewards={scale_rewards!r}: choose 'group', 'batch' or 'none'")
    advantages = centred if scale is None else centred / (scale + eps)
    return torch.nan_to_num(advantages, nan=0.0).view(-1)


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale_rewards: str = "group",
                       eps: float = 1e-4, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Dr. GRPO: the group mean subtracted, no division (whatever scale_rewards says)."""
    return grpo_advantages(rewards, group_size, scale_rewards="none")


def rloo_advantages(rewards: torch.Tensor, group_size: int, *, scale_rewards: str = "group",
                    eps: float = 1e-4, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO: each reward minus the mean of the OTHER valid rewards of its group, r_i - (S - r_i) /
    (n - 1) with S the group's sum over its n valid rewards; 0 where n < 2."""
    grouped = _grouped(rewards, group_size)
    valid = ~torch.isnan(grouped)
    count = valid.sum(-1, keepdim=True)
    filled = torch.where(valid, grouped, torch.zeros_like(grouped))
    others = (filled.sum(-1, keepdim=True) - filled) / (count - 1).clamp(min=1)
    advantages = torch.where(valid & (count > 1), filled - others, torch.zeros_like(filled))
    return advantages.view(-1)


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, group_size: int, *, scale_rewards: str = "group",
                                     eps: float = 1e-4, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++-baseline: the group mean subtracted, then the centred values whitened over the
    whole batch."""
    centred = grpo_advantages(rewards, group_size, scale_rewards="none")  # NaN rewards -> 0
    valid = ~torch.isnan(rewards)
    values = centred[valid]
    if values.numel() < 2:
        return centred
    whitened = (centred - values.mean()) / (values.std() + eps)
    return torch.where(valid, whitened, torch.zeros_like(whitened))


def opo_advantages(rewards: torch.Tensor, group_size: int, *, scale_rewards: str = "group", eps: float = 1e-4,
                   lengths: torch.Tensor | None = None) -> torch.Tensor:
    """OPO: each reward minus its group's length-weighted mean reward (the variance-optimal baseline
    for a sequence-sum loss); lengths [N] are the completions' token counts."""
    if lengths is None:
        raise ValueError("the opo estimator needs the completion lengths (lengths=[N])")
    grouped = _grouped(rewards, group_size)
    weight = torch.where(torch.isnan(grouped), torch.zeros_like(grouped),
                         lengths.to(grouped.dtype).view_as(grouped))
    filled = torch.nan_to_num(grouped, nan=0.0)
    baseline = (weight * filled).sum(-1, keepdim=True) / weight.sum(-1, keepdim=True).clamp(min=1e-12)
    return torch.where(torch.isnan(grouped), torch.zeros_like(grouped), filled - baseline).view(-1)


def reinforce_pp_advantages(rewards: torch.Tensor, group_size: int, *, scale_rewards: str = "group",
                            eps: float = 1e-4, lengths: torch.Tensor | None = None,
                            mask: torch.Tensor | None = None, token_kl: torch.Tensor | None = None,
                            beta: float = 0.0) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262), token level: each completion token's reward
    is -beta * KL_t (the first-order estimate log pi_old - log pi_ref), the outcome reward is added
    at the last completion token, the return is G_t = sum_{s >= t} r_s (gamma = 1), and the
    advantages are the returns whitened over every completion token of the batch, (G - mean) / (std
    + eps), with no per-group baseline. rewards [N], mask and token_kl [N, C] -> advantages [N, C]
    (0 off the mask and on NaN-reward rows)."""
    if mask is None:
        raise ValueError("reinforce_pp is a token-level estimator: it needs the completions' mask "
                         "[N, C]")
    mask = mask.to(rewards.dtype)
    scorable = ~torch.isnan(rewards)
    no_kl = token_kl is None or beta == 0
    token_rewards = torch.zeros_like(mask) if no_kl else -beta * token_kl.to(mask.dtype)
    token_rewards = token_rewards * mask
    # the last trained token: tool output leaves holes in the mask, so not its count minus one
    last = mask.shape[1] - 1 - torch.flip(mask, [1]).argmax(dim=1)
    rows = torch.arange(len(rewards), device=rewards.device)
    outcome = torch.where(scorable & (mask.sum(dim=1) > 0), rewards, torch.zeros_like(rewards))
    token_rewards = token_rewards.index_put((rows, last), token_rewards[rows, last] + outcome)
    returns = torch.flip(torch.cumsum(torch.flip(token_rewards, [1]), dim=1), [1])  # G_t
    valid = mask.bool() & scorable[:, None]
    values = returns[valid]
    if values.numel() < 2:
        return torch.zeros_like(returns)
    whitened = (returns - values.mean()) / (values.std() + eps)
    return torch.where(valid, whitened, torch.zeros_like(whitened))


@dataclass(frozen=True)
class EstimatorSpec:
    """An advantage estimator and what it declares; called like its function."""

    # (rewards [N], group_size, *, scale_rewards, eps, lengths, ...) -> [N]
    fn: Callable[..., torch.Tensor]
    level: str = "sequence"  # "token": advantages [N, C], one per completion token
    needs: frozenset[str] = frozenset()  # inputs beyond the rewards: "lengths", "mask", "token_kl"
    kl_in_reward: bool = False  # beta weighs a KL penalty in the reward, so the loss has no KL term
    # (total reward [N], sequence KL [N] or None, inputs) -> the reward the estimator sees, [N]
    shaping: Callable[..., torch.Tensor] | None = None
    # (advantages [N], shaped reward [N], inputs) -> advantages [N], after the estimator
    finish: Callable[..., torch.Tensor] | None = None

    def __post_init__(self):
        if self.level not in ("sequence", "token"):
            raise ValueError(f"estimator level {self.level!r}: choose 'sequence' or 'token'")
        unknown = set(self.needs) - {"lengths", "mask", "token_kl"}
        if unknown:
            raise ValueError(f"estimator needs {sorted(unknown)}: it may need lengths, mask, "
                             "token_kl")

    @property
    def token_level(self) -> bool:
        return self.level == "token"

    def __call__(self, rewards: torch.Tensor, group_size: int, **options) -> torch.Tensor:
        return self.fn(rewards, group_size, **options)


@dataclass
class EstimatorInputs:
    """One rollout's inputs to an estimator, built once: every process's rows, in process order."""

    rewards: torch.Tensor  # [N, F] per reward function, NaN = not applicable
    group_size: int
    weights: torch.Tensor | None = None  # [F]
    scale_rewards: str = "group"
    aggregation: str = "sum_then_normalize"
    eps: float = 1e-4
    lengths: torch.Tensor | None = None  # [N] trained tokens per completion
    mask: torch.Tensor | None = None  # [N, C] the tokens that carry a return / a KL estimate
    # [N, C] log pi_old - log pi_ref, 0 off the mask (None: beta 0)
    token_kl: torch.Tensor | None = None
    beta: float = 0.0
    # KL-in-reward: clip each total reward first
    clip_range: tuple[float, float] | list[float] | None = None
    normalize: bool = False  # KL-in-reward: whiten the advantages over the rows with a baseline


ADVANTAGE_ESTIMATORS: dict[str, EstimatorSpec] = {}


def register_estimator(name: str, fn: Callable[..., torch.Tensor] | EstimatorSpec, *, level: str = "sequence",
                       needs: tuple[str, ...] = ()) -> EstimatorSpec:
    """Add an estimator (a function, declared by `level` and `needs`, or a whole EstimatorSpec);
    `advantage_estimator: <name>` in a config then selects it (the config's allowed values are this
    registry's keys). A new one is its function, this call, and its float64 reference test."""
    if name in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r} is already registered")
    spec = fn if isinstance(fn, EstimatorSpec) else EstimatorSpec(fn, level, frozenset(needs))
    ADVANTAGE_ESTIMATORS[name] = spec
    return spec


for _name, _fn, _needs in [("grpo", grpo_advantages, ()), ("dr_grpo", dr_grpo_advantages, ()),
                           ("rloo", rloo_advantages, ()),
                           ("reinforce_pp_baseline", reinforce_pp_baseline_advantages, ()),
                           ("opo", opo_advantages, ("lengths",))]:
    register_estimator(_name, _fn, needs=_needs)
register_estimator("reinforce_pp", EstimatorSpec(reinforce_pp_advantages, "token",
                                                 frozenset({"mask", "token_kl"}), kl_in_reward=True))


def _spec(estimator: str | EstimatorSpec) -> EstimatorSpec:
    if isinstance(estimator, EstimatorSpec):
        return estimator
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage_estimator={estimator!r}: choose one of "
                         f"{sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[estimator]


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group", eps: float = 1e-4,
                     estimator: str | EstimatorSpec = "grpo", lengths: torch.Tensor | None = None,
                     mask: torch.Tensor | None = None, token_kl: torch.Tensor | None = None, beta: float = 0.0
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages for rewards [N] (groups contiguous) by the named estimator. Returns (advantages
    [N], or [N, C] for a token-level estimator, which alone receives mask, token_kl and beta;
    stats).

    stats: reward_std_within_group (mean of the groups' stds), frac_reward_zero_std (fraction of
    groups whose rewards are all equal, i.e. no learning signal), advantage_abs_mean (over
    completion tokens when token-level).
    """
    spec = _spec(estimator)
    _, std, count = _group_mean_std(_grouped(rewards, group_size))
    token_options = dict(mask=mask, token_kl=token_kl, beta=beta) if spec.token_level else {}
    advantages = spec(rewards, group_size, scale_rewards=scale_rewards, eps=eps, lengths=lengths,
                      **token_options)
    zero_spread = (std.squeeze(-1) == 0) | (count.squeeze(-1) < 2)
    magnitude = advantages.abs().mean() if advantages.ndim == 1 else \
        (advantages.abs() * mask).sum() / mask.sum().clamp(min=1)
    stats = {
        "reward_std_within_group": std.mean().item(),
        "frac_reward_zero_std": zero_spread.float().mean().item(),
        "advantage_abs_mean": magnitude.item(),
    }
    return advantages, stats


def multi_reward_advantages(rewards: torch.Tensor, weights: torch.Tensor | None, group_size: int,
                            scale_rewards: str = "group", aggregation: str = "sum_then_normalize",
                            eps: float = 1e-4, estimator: str | EstimatorSpec = "grpo",
                            lengths: torch.Tensor | None = None,
                            **token_options) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Advantages from per-function rewards [N, F] (NaN = not applicable) and weights [F].

    sum_then_normalize (GRPO/TRL): r_i = sum_f w_f r_if over the non-NaN entries (NaN if all are
        NaN), then the estimator's advantages of r (`group_advantages`).
    normalize_then_sum (GDPO, group reward-decoupled normalisation): A_i = sum_f w_f A_if with
        A_if the estimator's advantage of reward f alone, then normalised over the batch:
        (A - mean_batch(A)) / (std_batch(A) + eps).
    Returns (advantages [N], total reward [N] used for logging, stats). A row whose rewards are all
    NaN gets advantage 0 under both aggregations.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [N, F], got {tuple(rewards.shape)}")
    weights = (torch.ones(rewards.shape[1], dtype=rewards.dtype, device=rewards.device) if weights is None
               else weights)
    all_nan = torch.isnan(rewards).all(dim=1)  # [N]
    total = torch.nansum(rewards * weights, dim=1)  # [N]
    total = torch.where(all_nan, torch.full_like(total, float("nan")), total)
    if aggregation == "sum_then_normalize":
        advantages, stats = group_advantages(total, group_size, scale_rewards, eps, estimator, lengths,
                                             **token_options)
    elif aggregation == "normalize_then_sum":
        per_function = [group_advantages(rewards[:, f], group_size, scale_rewards, eps, estimator, lengths)[0]
                        for f in range(rewards.shape[1])]
        summed = (torch.stack(per_function, dim=1) * weights).sum(dim=1)  # [N]
        valid = summed[~all_nan]
        std = valid.std() if valid.numel() > 1 else summed.new_zeros(())
        mean = valid.mean() if valid.numel() else summed.new_zeros(())
        advantages = torch.where(all_nan, torch.zeros_like(summed), (summed - mean) / (std + eps))
        _, stats = group_advantages(total, group_size, scale_rewards, eps, estimator, lengths)
        stats["advantage_abs_mean"] = advantages.abs().mean().item()
    else:
        raise ValueError(f"aggregation={aggregation!r}: choose 'sum_then_normalize' or "
                         "'normalize_then_sum'")
    return advantages, total, stats


def kl_shaped_rewards(rewards: torch.Tensor, sequence_kl: torch.Tensor | None, beta: float,
                      clip_range: tuple[float, float] | list[float] | None = None) -> torch.Tensor:
    """RLOO's reward (Ahmadian et al. 2024, arXiv:2402.14740; TRL 1.16's RLOOTrainer): clipped to
    `clip_range` when given, minus beta times the sequence's KL estimate sum_t (log pi_old(o_t) -
    log pi_ref(o_t)) (the first-order estimate, which can be negative). NaN (unscorable) stays NaN.
    [N], [N] -> [N]."""
    if clip_range is not None:
        rewards = rewards.clamp(min=clip_range[0], max=clip_range[1])
    return rewards if sequence_kl is None or beta == 0 else rewards - beta * sequence_kl


def whiten(values: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(v - mean) / (std + eps) over the non-NaN entries (unbiased std); NaN entries become 0."""
    valid = values[~torch.isnan(values)]
    if valid.numel() < 2:
        return torch.nan_to_num(values - (valid.mean() if valid.numel() else 0.0), nan=0.0)
    return torch.nan_to_num((values - valid.mean()) / (valid.std() + eps), nan=0.0)


def _kl_penalised(total: torch.Tensor, sequence_kl: torch.Tensor | None,
                  inputs: EstimatorInputs) -> torch.Tensor:
    return kl_shaped_rewards(total, sequence_kl, inputs.beta, inputs.clip_range)


def _whiten_with_baseline(advantages: torch.Tensor, shaped: torch.Tensor,
                          inputs: EstimatorInputs) -> torch.Tensor:
    """Whitened over the rows that have a baseline (a scorable reward with another scorable one in
    its group: TRL's nanmean / nanstd), when `normalize` asks."""
    if not inputs.normalize:
        return advantages
    scorable = ~torch.isnan(shaped).view(-1, inputs.group_size)
    baseline = (scorable & (scorable.sum(dim=1, keepdim=True) > 1)).view(-1)
    return whiten(torch.where(baseline, advantages, float("nan")))


def kl_in_reward(spec: EstimatorSpec) -> EstimatorSpec:
    """The sequence-level estimator `spec` with beta's KL penalty in the reward instead of the loss
    (module docstring; RLOO as TRL computes it when `spec` is rloo)."""
    if spec.token_level or spec.kl_in_reward:
        raise ValueError("this estimator puts the KL in its per-token rewards itself; it cannot "
                         "take a sequence KL penalty in the reward too")
    return dataclasses.replace(spec, needs=spec.needs | {"mask", "token_kl"}, kl_in_reward=True,
                               shaping=_kl_penalised, finish=_whiten_with_baseline)


def estimate(spec: EstimatorSpec,
             inputs: EstimatorInputs) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Advantages of one rollout: (advantages [N] or [N, C], total reward [N] for logging, stats).
    Without shaping: `multi_reward_advantages`. With it (kl_in_reward): the weighted total (NaN
    where every reward is NaN), shaped, the estimator, finished; `kl` in stats is the mean per-token
    KL estimate over the mask."""
    token = dict(mask=inputs.mask, token_kl=inputs.token_kl, beta=inputs.beta) if spec.token_level else {}
    if spec.shaping is None:
        return multi_reward_advantages(inputs.rewards, inputs.weights, inputs.group_size,
                                       inputs.scale_rewards, inputs.aggregation, inputs.eps, spec,
                                       inputs.lengths, **token)
    weights = torch.ones(inputs.rewards.shape[1]) if inputs.weights is None else inputs.weights
    total = torch.nansum(inputs.rewards * weights, dim=1)
    total[torch.isnan(inputs.rewards).all(dim=1)] = float("nan")
    sequence_kl = None if inputs.token_kl is None else inputs.token_kl.sum(dim=1)
    shaped = spec.shaping(total, sequence_kl, inputs)
    advantages, stats = group_advantages(shaped, inputs.group_size, inputs.scale_rewards, inputs.eps,
                                         dataclasses.replace(spec, shaping=None, finish=None), inputs.lengths)
    if spec.finish is not None:
        advantages = spec.finish(advantages, shaped, inputs)
    if inputs.token_kl is not None and inputs.beta != 0:
        stats["kl"] = (inputs.token_kl.sum() / inputs.mask.sum().clamp(min=1)).item()
    return advantages, total, stats
