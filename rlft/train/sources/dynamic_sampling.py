"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, sec. 3.2; verl's `filter_groups`,
OpenRLHF's `dynamic_filtering`): a group whose completions all got the same reward has advantage 0
and teaches nothing, so it is dropped and more prompts are sampled until the step's batch is full of
groups with a learning signal.

`DynamicSampling` wraps any rollout source: round 0 is the source's own rollout (for the async
producer, the scheduled one), later rounds are `source.round(index, r)`, whose prompts come from a
permutation seeded by (seed, rollout, round): no cursor to save, so a resumed or repeated run
samples the same prompts. Process p samples positions [p*P, (p+1)*P) of each round's prompts (P per
process), so N processes sample exactly the prompts one process would.

The choice is global, as on one process: every process learns every group's informative flag, the
batch is the first N*P informative groups in (round, position) order, and process p trains on the
p-th P of them. A group chosen for another process than the one that sampled it is sent there (its
rows, rewards, completions and logged columns). So N processes train on the batch one process would,
and all run the same rounds. When `max_num_gen_batches` rounds are not enough, the batch is filled
with zero-spread groups from the rounds (advantage 0: no policy signal), in the same order, so its
shape and every normaliser's meaning stay the same, and the run says so. A search that goes on says
what it has found every `REPORT_ROUNDS` rounds; with no round limit (`max_num_gen_batches: 0`) one
that has found no group with a spread after `NO_SPREAD_EPOCHS` datasets' worth of prompts stops with
an error: about 95% of the prompts have been sampled by then (each round draws its prompts from a
fresh permutation, so a prompt is missed with probability about e^-3), and none had a spread: no
batch would ever fill.
"""

from __future__ import annotations

import dataclasses

import torch

from rlft.errors import RlftError
from rlft.rollout.base import Rollout
from rlft.train.sources.rollout_source import engine_of
from rlft.train.update.rollout_batch import ScoredRollout, add_timing

SPREAD_TOLERANCE = 1e-6
REPORT_ROUNDS = 10  # a search still going says what it has found every this many rounds
# with no round limit: datasets' worth of prompts sampled with no spread before it stops
NO_SPREAD_EPOCHS = 3


class NoRewardSpreadError(RlftError, RuntimeError):
    """Dynamic sampling with no round limit found no group with a reward spread in NO_SPREAD_EPOCHS
    datasets' worth of prompts; the message says what to change."""


def informative_groups(rewards: torch.Tensor, weights: torch.Tensor, group: int) -> torch.Tensor:
    """[groups] bool: the group's weighted total rewards differ (max - min > 1e-6 over its scorable
    rows, at least two of them). rewards [N, F] with NaN = not applicable, weights [F]."""
    unscorable = torch.isnan(rewards).all(dim=1)
    total = torch.nansum(rewards * weights, dim=1).view(-1, group)  # [groups, G]
    valid = ~unscorable.view(-1, group)
    high = torch.where(valid, total, torch.full_like(total, -torch.inf)).max(dim=1).values
    low = torch.where(valid, total, torch.full_like(total, torch.inf)).min(dim=1).values
    return (valid.sum(dim=1) >= 2) & (high - low > SPREAD_TOLERANCE)


def choose_groups(flags: list[list[bool]], wanted: int) -> list[tuple[int, int]]:
    """(round, position) of the groups the batch trains on, in batch order: the informative ones by
    round and position, then zero-spread ones the same way (only when too few had a spread), the
    first `wanted`. flags[r][k]: group k of round r (all processes' groups, in process order) has a
    reward spread."""
    keys = [(r, k) for r, row in enumerate(flags) for k in range(len(row))]
    useful = [key for key in keys if flags[key[0]][key[1]]]
    return (useful + [key for key in keys if not flags[key[0]][key[1]]])[:wanted]


class DynamicSampling:
    """A rollout source holding only groups with a reward spread, around `inner` (module
    docstring)."""

    def __init__(self, inner, args, accelerator, reward_weights: torch.Tensor, pad_token_id: int, messages):
        self.inner, self.args, self.accelerator = inner, args, accelerator
        self.reward_weights, self.pad_token_id, self.messages = reward_weights, pad_token_id, messages
        self.schedule = inner.schedule

    engine = engine_of("inner")

    def rollout(self, index: int) -> ScoredRollout:
        """Rounds of generate + score until all processes together hold as many informative groups
        as a rollout has prompts on all of them (or `max_num_gen_batches` rounds ran); this
        process's share of the global choice."""
        args, acc, group = self.args, self.accelerator, self.args.num_generations
        per = self.schedule.per_process
        wanted, flags, rounds = per * acc.num_processes, [], []
        while True:
            scored = self.inner.rollout(index) if not rounds else self.inner.round(index, len(rounds))
            rounds.append(scored)
            signal = informative_groups(scored.rewards, self.reward_weights, group)
            if acc.num_processes > 1:
                # every process's, in order
                signal = acc.gather(signal.to(acc.device, torch.uint8)).cpu()
            flags.append([bool(flag) for flag in signal.tolist()])
            found = sum(map(sum, flags))
            if found >= wanted or (args.max_num_gen_batches > 0 and len(flags) >= args.max_num_gen_batches):
                break
            self._searching(index, len(flags), found, wanted)
        if found < wanted:  # the same on every process (only the main process prints)
            self.messages.warn(f"dynamic sampling: {found} of {wanted} groups had a reward spread "
                               f"after {len(flags)} rounds "
                               f"(max_num_gen_batches={args.max_num_gen_batches}); the "
                               "rest of the batch are groups without one (advantage 0)")
        chosen = choose_groups(flags, wanted)
        held = {(r, acc.process_index * per + g): self._group(scored, g)
                for r, scored in enumerate(rounds) for g in range(per)}
        arrived = self._exchange(held, chosen) if acc.num_processes > 1 else {}
        mine = chosen[acc.process_index * per:(acc.process_index + 1) * per]
        batch = ScoredRollout.cat([held[key] if key in held else arrived[key] for key in mine],
                                  self.pad_token_id)
        timing, scalars = {}, {}
        for scored in rounds:  # every round's time, tokens and log_metric values count
            timing = add_timing(timing, scored.timing)
            for name, values in scored.scalars.items():
                scalars.setdefault(name, []).extend(values)
        metrics = {**batch.metrics,
                   "dynamic_sampling/kept_fraction": min(found, wanted) / sum(map(len, flags)),
                   "dynamic_sampling/generation_rounds": float(len(flags))}
        return dataclasses.replace(batch, timing=timing, scalars=scalars, metrics=metrics)

    def _searching(self, index: int, rounds: int, found: int, wanted: int) -> None:
        """Between rounds: a line every REPORT_ROUNDS rounds; with no round limit, stop a search
        that has sampled NO_SPREAD_EPOCHS datasets' worth of prompts and found no group with a
        spread (module docstring). Every process sees the same counts, so all stop together."""
        args = self.args
        sampled = rounds * self.schedule.per_process * self.accelerator.num_processes
        dataset = len(self.schedule.prompts)
        limit = args.max_num_gen_batches or "0 (no limit)"
        if rounds % REPORT_ROUNDS == 0:
            self.messages.info(f"dynamic sampling, rollout {index}: {rounds} rounds, {found} of "
                               f"{wanted} groups with a reward spread so far ({sampled} prompts "
                               f"sampled; max_num_gen_batches={limit})")
        if args.max_num_gen_batches == 0 and found == 0 and sampled >= NO_SPREAD_EPOCHS * dataset:
            raise NoRewardSpreadError(
                f"dynamic sampling found no group with a reward spread in {rounds} rounds of "
                f"rollout {index}: {sampled} prompts sampled ({sampled / dataset:.1f} times the "
                f"{dataset} prompts of the dataset) with {args.num_generations} completions each, "
                "and every prompt's completions got the same total reward, so the batch can never "
                "fill (max_num_gen_batches=0: no limit). Make the reward graded (partial credit) "
                "rather than pass/fail, raise num_generations or temperature so completions "
                "differ, start from a policy that sometimes succeeds, or set max_num_gen_batches "
                "to a number of rounds (the batch is then filled with zero-spread groups and the "
                "run goes on)")

    def _group(self, scored: ScoredRollout, g: int) -> ScoredRollout:
        group = self.args.num_generations
        return scored.select(slice(g * group, (g + 1) * group))

    def _exchange(self, held: dict, chosen: list) -> dict:
        """Send the groups this process sampled but another trains on; returns those the others
        sent. All processes call the collective or none (they all know `chosen`). Environments stay
        where they ran."""
        acc, per = self.accelerator, self.schedule.per_process
        # every group trains where sampled
        if all(key[1] // per == k // per for k, key in enumerate(chosen)):
            return {}
        from accelerate.utils import gather_object

        outgoing = {key: _portable(held[key]) for k, key in enumerate(chosen)
                    if key in held and k // per != acc.process_index}
        mine = set(chosen[acc.process_index * per:(acc.process_index + 1) * per])
        arrived = {key: value for part in gather_object([outgoing]) for key, value in part.items()
                   if key in mine}
        device = next(iter(held.values())).rollout.completion_ids.device
        return {key: value.to(device) for key, value in arrived.items()}

    # ---- the rest is the wrapped source's
    # --------------------------------------------------------------
    def round(self, index: int, round_index: int) -> ScoredRollout:
        return self.inner.round(index, round_index)

    def generate(self, prompts: dict, count: int, greedy: bool = False) -> Rollout:
        return self.inner.generate(prompts, count, greedy)

    def open(self) -> None:
        self.inner.open()

    def close(self) -> None:
        self.inner.close()

    def step_metrics(self, step: int) -> dict[str, float]:
        return self.inner.step_metrics(step)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)


def _portable(group: ScoredRollout) -> ScoredRollout:
    """One group as CPU tensors and plain values, ready to send; live environments stay in this
    process."""
    group = group.to("cpu")
    extra = dict(group.rollout.extra)
    if "environments" in extra:
        extra["environments"] = [None] * len(extra["environments"])
    return dataclasses.replace(group, rollout=dataclasses.replace(group.rollout, extra=extra))
