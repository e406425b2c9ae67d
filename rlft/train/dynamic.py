"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, sec. 3.2; verl's `filter_groups`, OpenRLHF's
`dynamic_filtering`): a group whose completions all got the same reward has advantage 0 and teaches nothing,
so it is dropped and more prompts are sampled until the step's batch is full of groups with a learning signal.

Rounds after the first draw their prompts from a permutation seeded by (seed, rollout, round): no cursor to
save, so a resumed or repeated run samples the same prompts, and every process decides from the same counts
(each round, the fewest informative groups any process holds) so all run the same rounds. When
`max_num_gen_batches` rounds are not enough, the batch is filled with zero-spread groups from the rounds
(advantage 0: no policy signal) so its shape and every normaliser's meaning stay the same, and the run says
so.
"""

from __future__ import annotations

import torch

from rlft.data.prompts import epoch_order
from rlft.rewards.calling import RewardLog
from rlft.rollout.hf import Rollout

SPREAD_TOLERANCE = 1e-6


def informative_groups(rewards: torch.Tensor, weights: torch.Tensor, group: int) -> torch.Tensor:
    """[groups] bool: the group's weighted total rewards differ (max - min > 1e-6 over its scorable rows, at
    least two of them). rewards [N, F] with NaN = not applicable, weights [F]."""
    unscorable = torch.isnan(rewards).all(dim=1)
    total = torch.nansum(rewards * weights, dim=1).view(-1, group)  # [groups, G]
    valid = ~unscorable.view(-1, group)
    high = torch.where(valid, total, torch.full_like(total, -torch.inf)).max(dim=1).values
    low = torch.where(valid, total, torch.full_like(total, torch.inf)).min(dim=1).values
    return (valid.sum(dim=1) >= 2) & (high - low > SPREAD_TOLERANCE)


def round_prompt_indices(num_rows: int, seed: int, rollout_index: int, round_index: int, process_index: int,
                         per_process: int) -> list[int]:
    """This process's prompts for a later round: a permutation of all rows seeded by (seed, rollout,
    round)."""
    order = epoch_order(num_rows, seed + 1_000_003 * round_index, rollout_index)
    start = process_index * per_process
    return [order[(start + k) % num_rows] for k in range(per_process)]


def select_rows(rollout: Rollout, rows: list[int]) -> Rollout:
    """The rollout's rows `rows`, in that order (per-row lists and stats too)."""
    index = torch.tensor(rows, dtype=torch.long)  # moved to each tensor's device: stats may live on the CPU
    pick = lambda t: None if t is None else t[index.to(t.device)]  # noqa: E731
    return Rollout(pick(rollout.prompt_ids), pick(rollout.prompt_mask), pick(rollout.completion_ids),
                   pick(rollout.completion_mask), pick(rollout.truncated), pick(rollout.sampling_logps),
                   pick(rollout.tool_mask), None if rollout.completions is None else
                   [rollout.completions[i] for i in rows],
                   {k: [v[i] for i in rows] for k, v in rollout.extra.items()},
                   {k: pick(v) for k, v in rollout.stats.items()})


def _pad(tensors: list[torch.Tensor], value, left: bool = False) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        fill = t.new_full((t.shape[0], width - t.shape[1]), value)
        padded.append(torch.cat([fill, t] if left else [t, fill], dim=1))
    return torch.cat(padded)


def cat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Rows of several rollouts as one: prompts left-padded, completions right-padded to the widest."""
    if len(parts) == 1:
        return parts[0]
    optional = lambda name, value: None if getattr(parts[0], name) is None else \
        _pad([getattr(p, name) for p in parts], value)  # noqa: E731
    return Rollout(_pad([p.prompt_ids for p in parts], pad_token_id, left=True),
                   _pad([p.prompt_mask for p in parts], 0, left=True),
                   _pad([p.completion_ids for p in parts], pad_token_id),
                   _pad([p.completion_mask for p in parts], 0),
                   torch.cat([p.truncated for p in parts]), optional("sampling_logps", 0.0),
                   optional("tool_mask", 0),
                   None if parts[0].completions is None else [c for p in parts for c in p.completions],
                   {k: [v for p in parts for v in p.extra[k]] for k in parts[0].extra},
                   {k: torch.cat([p.stats[k] for p in parts]) for k in parts[0].stats})



def sample_informative(trainer, rollout_index: int, reward_log, timing: dict):
    """Rounds of generate + score until every process holds as many informative groups as a rollout has
    prompts (or `max_num_gen_batches` rounds ran). Returns (prompts batch, rollout, rewards, completions,
    metrics)."""
    args, acc = trainer.args, trainer.accelerator
    group, wanted = args.num_generations, trainer.prompts_per_rollout
    rounds, kept, spare, generated = 0, [], [], 0
    while True:
        indices = trainer._prompt_indices(rollout_index) if rounds == 0 else round_prompt_indices(
            len(trainer.train_prompts), args.seed, rollout_index, rounds, acc.process_index, wanted)
        prompts, round_log = trainer.train_prompts.batch(indices), RewardLog()
        rollout, rewards, completions = trainer._generate_and_score(prompts, round_log, timing)
        for name, values in round_log.scalars.items():  # log_metric values: every round's
            reward_log.scalars.setdefault(name, []).extend(values)
        columns = round_log.columns(len(completions))  # log_extra columns: the chosen rows' (below)
        signal = informative_groups(rewards, trainer.reward_weights, group).tolist()
        for g, useful in enumerate(signal):
            (kept if useful else spare).append((indices[g], rollout, rewards, completions, g, columns))
        rounds, generated = rounds + 1, generated + len(signal)
        fewest = torch.tensor(float(len(kept)), device=acc.device)
        fewest = -acc.reduce(-fewest, "max") if acc.num_processes > 1 else fewest  # accelerate has no "min"
        limit = args.max_num_gen_batches
        if fewest.item() >= wanted or (limit > 0 and rounds >= limit):
            break
    if fewest.item() < wanted:  # on any process (only the main process prints)
        trainer.log.warn(f"dynamic sampling: {int(fewest.item())} of {wanted} groups had a reward spread "
                         f"after {rounds} rounds (max_num_gen_batches={args.max_num_gen_batches}); the rest "
                         "of the batch are groups without one (advantage 0)")
    chosen = (kept + spare)[:wanted]
    stacked = torch.tensor([float(min(len(kept), wanted)), float(generated)], device=acc.device)
    stacked = acc.reduce(stacked, "sum") if acc.num_processes > 1 else stacked
    metrics = {"dynamic_sampling/kept_fraction": (stacked[0] / stacked[1]).item(),
               "dynamic_sampling/generation_rounds": float(rounds)}
    reward_log.extra = {name: [v for *_, g, cols in chosen for v in cols[name][g * group:(g + 1) * group]]
                        for name in set.intersection(*(set(cols) for *_, cols in chosen))}
    return _assemble(trainer, chosen, group) + (metrics,)


def _assemble(trainer, chosen: list, group: int):
    rows = lambda g: list(range(g * group, (g + 1) * group))  # noqa: E731
    parts = [select_rows(rollout, rows(g)) for _, rollout, _, _, g, _ in chosen]
    rewards = torch.cat([r[g * group:(g + 1) * group] for _, _, r, _, g, _ in chosen])
    completions = [c for _, _, _, comps, g, _ in chosen for c in comps[g * group:(g + 1) * group]]
    prompts = trainer.train_prompts.batch([index for index, *_ in chosen])
    return prompts, cat_rollouts(parts, trainer.tokenizer.pad_token_id), rewards, completions
