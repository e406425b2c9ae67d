"""Truncated sampling and replaying it in the trainer (`replay_sampling_mask`, docs/vllm.md).

top-k / top-p / min-p sample each token from the policy's distribution renormalised over the tokens
they keep, so a trainer that scores the full vocabulary scores another distribution: at an on-policy
step the importance ratio pi_trainer / pi_sampler is the kept mass (0.7 at top_p 0.8, top_k 20 on
our tiny policy), not 1. With the replay on, every engine returns, with each sampled token, the ids
its sampler kept there, and the trainer renormalises over them (rlft/core/fused_head.py): the old,
current and reference log-probs, and so the importance ratio, the PPO ratio and the KL, are the
truncated distribution's.

The replay is exact where the sampler's only change to the logits is to remove tokens (the
truncations, and masks such as bad_words_ids or a minimum length, which the kept ids carry too).
Settings that change the values of the logits (a repetition penalty, a logit bias, ...) are not
replayed: with `replay_sampling_mask` left at null the replay is then off (and the run says why),
set to true it is an error. vLLM returns the kept ids through its processed log-probs, which need
top_k (the kept set of top-p or min-p alone is unbounded). Whether a config's sampling can be
replayed (`replay_plan`) is a rule on the config: rlft/config/rules.py.
"""

from __future__ import annotations

import math

import torch


def kept_of(entries: dict[int, float]) -> list[int] | None:
    """The ids a vLLM sampler kept at one position, from its processed top log-probs ({token id:
    log-prob}; the tokens truncation removed are -inf, -9999 over HTTP): None when they do not hold
    the whole kept mass (a kept set wider than the log-probs asked for: that position is scored over
    the full vocabulary)."""
    kept = [token for token, logprob in entries.items() if logprob > -9998.0]
    mass = sum(math.exp(entries[token]) for token in kept)
    return kept if abs(mass - 1.0) < 1e-3 else None


def kept_tensor(kept: list[list[list[int] | None]], width: int) -> torch.Tensor:
    """Per row, per completion token, the kept ids (or None) -> [N, width, K] int32, -1 padding."""
    most = max([len(ids) for row in kept for ids in row if ids] or [1])
    out = torch.full((len(kept), width, most), -1, dtype=torch.int32)
    for row, per_token in enumerate(kept):
        for position, ids in enumerate(per_token[:width]):
            if ids:
                out[row, position, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out
