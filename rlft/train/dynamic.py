"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, sec. 3.2; verl's `filter_groups`, OpenRLHF's
`dynamic_filtering`): a group whose completions all got the same reward has advantage 0 and teaches nothing,
so it is dropped and more prompts are sampled until the step's batch is full of groups with a learning signal.

Rounds after the first draw their prompts from a permutation seeded by (seed, rollout, round): no cursor
to save, so a resumed or repeated run samples the same prompts. Process p samples positions [p*P, (p+1)*P)
of each round's prompts (P per process), so N processes sample exactly the prompts one process would.

The choice is global, as on one process: every process learns every group's informative flag, the batch is
the first N*P informative groups in (round, position) order, and process p trains on the p-th P of them. A
group chosen for another process than the one that sampled it is sent there (its rows, rewards, completions
and logged columns). So N processes train on the batch one process would, and all run the same rounds.
When `max_num_gen_batches` rounds are not enough, the batch is filled with zero-spread groups from the
rounds (advantage 0: no policy signal), in the same order, so its shape and every normaliser's meaning stay
the same, and the run says so.
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


def choose_groups(flags: list[list[bool]], wanted: int) -> list[tuple[int, int]]:
    """(round, position) of the groups the batch trains on, in batch order: the informative ones by round and
    position, then zero-spread ones the same way (only when too few had a spread), the first `wanted`.
    flags[r][k]: group k of round r (all processes' groups, in process order) has a reward spread."""
    keys = [(r, k) for r, row in enumerate(flags) for k in range(len(row))]
    useful = [key for key in keys if flags[key[0]][key[1]]]
    return (useful + [key for key in keys if not flags[key[0]][key[1]]])[:wanted]


def sample_informative(trainer, rollout_index: int, reward_log, timing: dict):
    """Rounds of generate + score until all processes together hold as many informative groups as a
    rollout has prompts on all of them (or `max_num_gen_batches` rounds ran); this process's share of the
    global choice. Returns (prompts batch, rollout, rewards, completions, metrics)."""
    args, acc = trainer.args, trainer.accelerator
    group, per, me = args.num_generations, trainer.prompts_per_rollout, acc.process_index
    wanted, flags, held = per * acc.num_processes, [], {}
    while True:
        rounds = len(flags)
        indices = trainer._prompt_indices(rollout_index) if rounds == 0 else round_prompt_indices(
            len(trainer.train_prompts), args.seed, rollout_index, rounds, me, per)
        prompts, round_log = trainer.train_prompts.batch(indices), RewardLog()
        rollout, rewards, completions = trainer._generate_and_score(prompts, round_log, timing)
        for name, values in round_log.scalars.items():  # log_metric values: every round's
            reward_log.scalars.setdefault(name, []).extend(values)
        columns = round_log.columns(len(completions))  # log_extra columns: the chosen rows' (below)
        signal = informative_groups(rewards, trainer.reward_weights, group)
        for g in range(per):
            held[(rounds, me * per + g)] = (indices[g], rollout, rewards, completions, g, columns)
        if acc.num_processes > 1:
            signal = acc.gather(signal.to(acc.device, torch.uint8)).cpu()  # every process's, in process order
        flags.append([bool(flag) for flag in signal.tolist()])
        found = sum(map(sum, flags))
        if found >= wanted or (args.max_num_gen_batches > 0 and len(flags) >= args.max_num_gen_batches):
            break
    if found < wanted:  # the same on every process (only the main process prints)
        trainer.log.warn(f"dynamic sampling: {found} of {wanted} groups had a reward spread after "
                         f"{len(flags)} rounds (max_num_gen_batches={args.max_num_gen_batches}); the rest "
                         "of the batch are groups without one (advantage 0)")
    chosen = choose_groups(flags, wanted)
    keys = chosen[me * per:(me + 1) * per]
    arrived = _exchange(held, chosen, per, group, acc, rollout, rewards) if acc.num_processes > 1 else {}
    mine = [held[key] if key in held else arrived[key] for key in keys]
    metrics = {"dynamic_sampling/kept_fraction": min(found, wanted) / sum(map(len, flags)),
               "dynamic_sampling/generation_rounds": float(len(flags))}
    reward_log.extra = {name: [v for *_, g, cols in mine for v in cols[name][g * group:(g + 1) * group]]
                        for name in set.intersection(*(set(cols) for *_, cols in mine))}
    return _assemble(trainer, mine, group) + (metrics,)


def _exchange(held: dict, chosen: list, per: int, group: int, acc, like: Rollout, like_rewards) -> dict:
    """Send the groups this process sampled but another trains on; returns those the others sent. All
    processes call the collective or none (they all know `chosen`). Environments stay where they ran."""
    if all(key[1] // per == k // per for k, key in enumerate(chosen)):  # every group trains where sampled
        return {}
    from accelerate.utils import gather_object

    outgoing = {key: _portable(held[key], group) for k, key in enumerate(chosen)
                if key in held and k // per != acc.process_index}
    mine = set(chosen[acc.process_index * per:(acc.process_index + 1) * per])
    arrived = {key: value for part in gather_object([outgoing]) for key, value in part.items() if key in mine}
    return {key: _placed(value, like, like_rewards) for key, value in arrived.items()}


def _portable(entry: tuple, group: int) -> tuple:
    """One group of a round's results as CPU tensors and plain lists, ready to send."""
    index, rollout, rewards, completions, g, columns = entry
    rows = list(range(g * group, (g + 1) * group))
    part = _moved(select_rows(rollout, rows), lambda name, t: t.cpu())
    if "environments" in part.extra:  # live objects in this process's pool: not sent
        part.extra["environments"] = [None] * group
    return (index, part, rewards[rows].cpu(), completions[g * group:(g + 1) * group], 0,
            {name: values[g * group:(g + 1) * group] for name, values in columns.items()})


def _placed(entry: tuple, like: Rollout, like_rewards: torch.Tensor) -> tuple:
    """A group another process sent, on this process's devices (those of its own `like` rollout)."""
    index, part, rewards, completions, g, columns = entry
    device_of = lambda name: (like.stats.get(name[6:]) if name.startswith("stats.")  # noqa: E731
                              else getattr(like, name))
    moved = _moved(part, lambda name, t: t.to(device_of(name).device))
    return index, moved, rewards.to(like_rewards.device), completions, g, columns


def _moved(rollout: Rollout, move) -> Rollout:
    """The rollout with move(field name, tensor) applied to every tensor (stats as 'stats.<name>')."""
    tensors = {name: None if getattr(rollout, name) is None else move(name, getattr(rollout, name))
               for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated",
                            "sampling_logps", "tool_mask")}
    return Rollout(**tensors, completions=rollout.completions, extra=dict(rollout.extra),
                   stats={k: move(f"stats.{k}", v) for k, v in rollout.stats.items()})


def _assemble(trainer, chosen: list, group: int):
    rows = lambda g: list(range(g * group, (g + 1) * group))  # noqa: E731
    parts = [select_rows(rollout, rows(g)) for _, rollout, _, _, g, _ in chosen]
    rewards = torch.cat([r[g * group:(g + 1) * group] for _, _, r, _, g, _ in chosen])
    completions = [c for _, _, _, comps, g, _ in chosen for c in comps[g * group:(g + 1) * group]]
    prompts = trainer.train_prompts.batch([index for index, *_ in chosen])
    return prompts, cat_rollouts(parts, trainer.tokenizer.pad_token_id), rewards, completions
