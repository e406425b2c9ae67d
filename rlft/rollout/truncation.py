"""Truncated sampling and replaying it in the trainer (`replay_sampling_mask`, docs/vllm.md).

top-k / top-p / min-p sample each token from the policy's distribution renormalised over the tokens they
keep, so a trainer that scores the full vocabulary scores another distribution: at an on-policy step the
importance ratio pi_trainer / pi_sampler is the kept mass (0.7 at top_p 0.8, top_k 20 on our tiny policy),
not 1. With the replay on, every engine returns, with each sampled token, the ids its sampler kept there,
and the trainer renormalises over them (rlft/core/fused_head.py): the old, current and reference log-probs,
and so the importance ratio, the PPO ratio and the KL, are the truncated distribution's.

The replay is exact where the sampler's only change to the logits is to remove tokens (the truncations, and
masks such as bad_words_ids or a minimum length, which the kept ids carry too). Settings that change the
values of the logits (a repetition penalty, a logit bias, ...) are not replayed: with `replay_sampling_mask`
left at null the replay is then off (and the run says why), set to true it is an error. vLLM returns the kept
ids through its processed log-probs, which need top_k (the kept set of top-p or min-p alone is unbounded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlft.errors import ConfigError

# generate / vLLM settings that change the values of the logits before sampling (not only remove tokens)
VALUE_CHANGING = ("repetition_penalty", "encoder_repetition_penalty", "sequence_bias", "presence_penalty",
                  "frequency_penalty", "logit_bias", "exponential_decay_length_penalty", "guidance_scale",
                  "watermarking_config")
# truncations generate applies after rlft's recorder (not replayed)
OTHER_WARPERS = ("typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
NEUTRAL = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "guidance_scale": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
           "eta_cutoff": 0.0}


@dataclass(frozen=True)
class Truncation:
    """The effective truncation of a config's sampling (generation_kwargs win, as the engines apply them)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def truncation(args) -> Truncation:
    extra = args.generation_kwargs or {}
    top_k = extra.get("top_k", args.top_k)
    top_p = extra.get("top_p", args.top_p)
    min_p = extra.get("min_p", args.min_p)
    return Truncation(max(int(top_k or 0), 0), 1.0 if top_p is None else float(top_p), float(min_p or 0.0))


def unreplayable(args) -> list[str]:
    """The settings that keep the sampler's distribution from being replayed exactly."""
    given = {"repetition_penalty": args.repetition_penalty, **(args.generation_kwargs or {})}
    found = [f"{k}={v!r}" for k, v in given.items()
             if (k in VALUE_CHANGING or k in OTHER_WARPERS) and v not in (None, NEUTRAL.get(k), {}, [])]
    if (args.generation_kwargs or {}).get("num_beams", 1) not in (None, 1):
        found.append(f"num_beams={args.generation_kwargs['num_beams']!r}")
    if args.use_vllm and truncation(args).truncates and truncation(args).top_k == 0:
        found.append("top_k=0 with vLLM (vLLM returns kept ids only with top_k set, e.g. 512)")
    return found


def replay_plan(args) -> tuple[bool, str | None]:
    """(replay the sampler's kept ids?, a line for the run when the replay is off though sampling truncates).
    `replay_sampling_mask`: null = on whenever sampling truncates and the replay can be exact."""
    asked, cut = args.replay_sampling_mask, truncation(args)
    if asked is False or not cut.truncates:
        return False, None
    blockers = unreplayable(args)
    if blockers and asked:
        raise ConfigError(f"replay_sampling_mask=True cannot replay the sampler's distribution exactly with "
                          f"{', '.join(blockers)}: the trainer renormalises the policy over the kept tokens, "
                          "but these change the logits' values too. Remove them, or set "
                          "replay_sampling_mask: false (the trainer then scores the full vocabulary)")
    if blockers:
        return False, (f"sampling truncates (top_k={cut.top_k}, top_p={cut.top_p}, min_p={cut.min_p}) but "
                       f"{', '.join(blockers)} keeps the trainer from replaying what the sampler drew from: "
                       "log-probs are the full vocabulary's, so importance ratios carry the kept mass "
                       "(docs/vllm.md#truncated-sampling)")
    return True, None


def kept_of(entries: dict[int, float]) -> list[int] | None:
    """The ids a vLLM sampler kept at one position, from its processed top log-probs ({token id: log-prob};
    the tokens truncation removed are -inf, -9999 over HTTP): None when they do not hold the whole kept mass
    (a kept set wider than the log-probs asked for: that position is scored over the full vocabulary)."""
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
