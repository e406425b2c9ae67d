"""Per-token log-probs of a rollout's completion tokens under the policy or the reference policy, a
micro-batch at a time, through the fused LM head (rlft/model/scoring.py: never a [B, T, V] tensor).

Micro-batches hold the longest completions first, so each pads only to its own longest row (a step's
loss is a sum over rows with global normalisers: row order changes nothing); with `token_budget`
they are filled by tokens instead of rows (rlft/core/batching.py). With `padding_free` a micro-batch
is scored packed into one sequence with no padding, a shared prompt once (`shared_prefix_scoring`;
rlft/model/packing.py), once a check on the model's first scored rows shows packed and padded agree;
left at null, where packing computes at most half the tokens padding would. The policy's log-probs
of a rollout as it was sampled are computed once per rollout and shared by whatever needs them (the
KL in RLOO's and REINFORCE++'s reward, the old log-probs of several optimiser steps per rollout).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlft.core import segments
from rlft.core.batching import balanced_bins, budget_count
from rlft.core.self_distill import SelfDistillMode, sampled_token_loss
from rlft.errors import ConfigError
from rlft.model.scoring import score_rows
from rlft.rollout.base import Rollout


class Forward(NamedTuple):
    """One scoring forward's per-token values [b, c] (None where not asked)."""
    logps: torch.Tensor
    entropy: torch.Tensor | None
    aux_loss: torch.Tensor | None  # a MoE policy's router load-balancing loss (a scalar)
    kept_logmass: torch.Tensor | None  # log of the mass the sampler kept (rollouts with kept ids)
    # reverse KL(policy || teacher) per token (`teacher=True`)
    divergence: torch.Tensor | None = None


class PolicyScorer:
    """Log-probs (and entropies) of rollouts under `model` (the policy, as the training engine wraps
    it) or its reference (`ref_model`; with LoRA and no copy, the policy with its adapters off)."""

    def __init__(self, model, ref_model, accelerator, args, messages=None, teacher=None):
        self.model, self.ref_model, self.accelerator, self.args = model, ref_model, accelerator, args
        # teacher: distillation's (rlft/train/update/distill_objective.py)
        self.messages, self.teacher = messages, teacher
        self._policy_logps_of: tuple[Rollout, torch.Tensor] | None = None
        # packed scoring checked exact for this model (None: not yet)
        self.packable: bool | None = None
        self._tally = dict.fromkeys(("computed", "real", "packed", "forwards"), 0)

    def forward(self, model, rollout: Rollout, rows, entropy: bool = False, entropy_grad: bool = False,
                router_loss: bool = False, teacher: bool = False, loss_grad=None) -> Forward:
        """Per-token log-probs [b, c] of the completion tokens (and their entropy [b, c]; a MoE
        policy's router load-balancing loss, the model's own `aux_loss`; the log of the mass the
        sampler kept [b, c] where the rollout carries its kept ids; with `teacher`, each token's
        reverse KL to the teacher, from the same forward) for `rows` (a slice or an index tensor),
        cut to the rows' longest completion and prompt (rlft/model/scoring.py: score_rows). With
        kept ids the log-probs are renormalised over them: the distribution the sampler drew from
        (rlft/rollout/truncation.py). `loss_grad`: the loss's dL/dlog p as a function of the
        log-probs [b, c], for a token-separable loss (rlft/model/scoring.py: Score.loss_grad)."""
        packing = None if teacher else self.packing(model, rollout, rows, router_loss)
        scored = score_rows(model, rollout, rows, self.args.temperature, entropy, router_loss,
                            self.args.logprob_chunk_size, self.args.pad_to_multiple_of, packing,
                            teacher=self.teacher if teacher else None, beta=1.0, with_logps=True,
                            entropy_grad=entropy and entropy_grad, loss_grad=loss_grad)
        real = int(rollout.prompt_mask[rows].sum()) + int(rollout.completion_mask[rows].sum())
        for key, value in (("computed", scored.tokens), ("real", real), ("packed", packing is not None),
                           ("forwards", 1)):
            self._tally[key] += value
        ent = None if scored.entropy is None else scored.entropy if entropy_grad else scored.entropy.detach()
        return Forward(scored.logps, ent, scored.aux_loss, scored.kept_logmass, scored.divergence)

    def prepare(self, rollout: Rollout) -> None:
        """Before a rollout's forwards: what they read from its rows (several teachers: which is
        each row's, rlft/train/update/teachers.py)."""
        if hasattr(self.teacher, "route"):
            self.teacher.route(rollout)

    def divergence(self, rollout: Rollout, rows, beta: float):
        """Distillation: each completion token's divergence at `beta` from the teacher [b, c]
        (differentiable in the policy), and the policy's and the teacher's entropies there [b, c];
        padded forwards. Several teachers: one forward per teacher over the rows it teaches."""
        if not hasattr(self.teacher, "route"):
            return self._divergence(rollout, rows, beta, self.teacher)
        self.teacher.route(rollout)
        rows = torch.arange(rollout.completion_ids.shape[0], device=rollout.completion_ids.device)[rows]
        index = rollout.teacher_index[rows]  # [b]
        parts = []
        for k, (_, teacher) in enumerate(self.teacher.items()):
            mine = (index == k).nonzero().squeeze(-1)
            if len(mine):
                part = self._divergence(rollout, rows[mine], beta, teacher)
                width = part[0].shape[1]
                self.teacher.observe(k, part[0], part[2], rollout.loss_mask[rows[mine], :width])
                parts.append((mine, part))
        width = max(part[0].shape[1] for _, part in parts)
        out = [parts[0][1][0].new_zeros(len(rows), width) for _ in range(3)]  # D, entropies [b, c]
        for mine, part in parts:
            for whole, piece in zip(out, part):
                whole[mine, :piece.shape[1]] = piece
        return tuple(out)

    def self_divergence(self, rollout: Rollout, rows, beta: float, mode: SelfDistillMode, with_logps: bool):
        """Self-distillation (rlft/core/self_distill.py), per token [b, c]: the objective's value
        (D_alpha, or the sampled-token loss; differentiable in the policy), the policy's log-probs
        (with `with_logps` or the sampled-token mode, else None), its entropy and the teacher's (None
        in the sampled-token mode); padded forwards, the teacher reading the rollout's teacher
        prompts."""
        args, sampled = self.args, mode.name == "sampled_token"
        scored = score_rows(self.model, rollout, rows, args.temperature, entropy=sampled,
                            tile=args.logprob_chunk_size, pad_to_multiple_of=args.pad_to_multiple_of,
                            teacher=self.teacher, beta=beta, with_logps=with_logps or sampled, mode=mode)
        real = int(rollout.prompt_mask[rows].sum()) + int(rollout.completion_mask[rows].sum())
        for key, value in (("computed", scored.tokens), ("real", real), ("forwards", 1)):
            self._tally[key] += value
        logps = scored.logps if with_logps or sampled else None
        if sampled:
            value = sampled_token_loss(scored.logps, scored.teacher_logps)
            return value, logps, scored.entropy.detach(), None
        return scored.divergence, logps, scored.entropy, scored.teacher_entropy

    def _divergence(self, rollout: Rollout, rows, beta: float, teacher):
        args = self.args
        temperature = getattr(args, "divergence_temperature", args.temperature)
        scored = score_rows(self.model, rollout, rows, temperature, tile=args.logprob_chunk_size,
                            pad_to_multiple_of=args.pad_to_multiple_of, teacher=teacher, beta=beta)
        real = int(rollout.prompt_mask[rows].sum()) + int(rollout.completion_mask[rows].sum())
        for key, value in (("computed", scored.tokens), ("real", real), ("forwards", 1)):
            self._tally[key] += value
        return scored.divergence, scored.entropy, scored.teacher_entropy

    def tally(self) -> dict[str, float]:
        """What the scoring forwards since the last call computed: `tokens/computed` (through the
        backbone: padding included, a packed shared prompt once), `tokens/real` (each row's prompt
        and completion, no padding) and `tokens/packed_fraction` (of the forwards); summed over all
        processes (each calls it)."""
        tally, self._tally = self._tally, dict.fromkeys(self._tally, 0)
        values = torch.tensor([int(v) for v in tally.values()], dtype=torch.long,
                              device=self.accelerator.device)
        computed, real, packed, forwards = self.accelerator.reduce(values, "sum").tolist()
        if not forwards:
            return {}
        return {"tokens/computed": float(computed), "tokens/real": float(real),
                "tokens/packed_fraction": packed / forwards}

    def packing(self, model, rollout: Rollout, rows, router_loss: bool = False) -> str | None:
        """How these rows are scored: "prompts" (packed, shared prompts once), "rows" (packed) or
        None (padded). A MoE router's balancing loss is over the tokens of each row: rows whole."""
        asked = self.args.padding_free
        if asked is False:
            return None
        mode = "prompts" if self.args.shared_prefix_scoring and not router_loss else "rows"
        # at the first forward on every process alike (sharded forwards gather)
        if self.packable is None:
            self.packable = self._check_packing(model, rollout, mode)
        if not self.packable:
            return None
        if asked is None:
            weight = next(model.parameters())
            one_call = segments.one_call(weight.device, weight.dtype)
            if not packing_pays(rollout, rows, mode == "prompts", one_call):
                return None
        return mode

    @torch.no_grad()
    def _check_packing(self, model, rollout: Rollout, mode: str) -> bool:
        """Packed and padded scoring of a rollout's first rows agree (to the dtype's rounding): the
        model's attention takes rlft's segment attention and no row sees another. Else padding
        stays, said once (an error when padding_free is true)."""
        rows = torch.arange(min(4, rollout.completion_ids.shape[0]), device=rollout.completion_ids.device)
        args = (self.args.temperature, False, False, self.args.logprob_chunk_size)
        error, training, device = None, model.training, rollout.completion_ids.device
        # without dropout (it would make any two forwards differ), and drawing no random number: the
        # run's random stream is the same wherever the check falls (a resumed run checks at its
        # first step)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model.eval()
            try:
                padded = score_rows(model, rollout, rows, *args).logps
                packed = score_rows(model, rollout, rows, *args, packing=mode).logps
                gap = (padded - packed).abs().max().item()
            except (ValueError, RuntimeError, TypeError, AttributeError) as err:
                gap, error = float("inf"), err
            finally:
                model.train(training)
        half = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
        if gap <= (0.1 if half else 1e-3):
            if self.messages is not None:
                self.messages.info(f"packed scoring checked (log-probs within {gap:.2g} of "
                                   f"padded); attention kernel: {segments.LAST_KERNEL}")
            return True
        why = f"packing failed: {error}" if error is not None else \
            f"packed and padded log-probs differ by {gap:.3g}"
        if self.args.padding_free:
            raise ConfigError(f"padding_free=True: {why} for this model ({type(model).__name__}): "
                              "its attention does not take rlft's packed segments exactly; set "
                              "padding_free: false")
        if self.messages is not None:
            self.messages.warn(f"packed scoring is off for this model: {why}; micro-batches are "
                               "padded")
        return False

    def micro_batches(self, rollout: Rollout) -> list[torch.Tensor]:
        """Row indices of each micro-batch (module docstring)."""
        lengths = rollout.completion_mask.sum(dim=1)
        if self.args.token_budget is None:
            order = torch.argsort(lengths, descending=True, stable=True)
            return list(order.split(self.args.per_device_train_batch_size))
        tokens = (rollout.prompt_mask.sum(dim=1) + lengths).cpu()
        count = torch.tensor(budget_count(tokens, self.args.token_budget), device=self.accelerator.device)
        # every process runs as many forwards (sharded engines need it)
        if self.accelerator.num_processes > 1:
            count = self.accelerator.reduce(count, "max")
        return [rows.to(lengths.device) for rows in balanced_bins(tokens, int(count), self.args.token_budget)]

    @torch.no_grad()
    def logps(self, model, rollout: Rollout) -> torch.Tensor:
        """[N, C] log-probs of every completion token under `model`, no gradient."""
        shape, out = rollout.completion_ids.shape, None  # out: float32, float64 for a float64 model
        for rows in self.micro_batches(rollout):
            logps = self.forward(model, rollout, rows)[0]
            if out is None:
                out = rollout.completion_ids.new_zeros(shape, dtype=_at_least_32(logps))  # [N, C]
            out[rows, :logps.shape[1]] = logps
        return out if out is not None else rollout.completion_ids.new_zeros(shape, dtype=torch.float32)

    @torch.no_grad()
    def entropies(self, rollout: Rollout) -> torch.Tensor:
        """[N, C] the policy's entropy at every completion position, no gradient."""
        entropies = None  # [N, C] in the entropies' dtype (as logps)
        for rows in self.micro_batches(rollout):
            ent = self.forward(self.model, rollout, rows, entropy=True)[1]
            if entropies is None:
                entropies = rollout.completion_mask.new_zeros(rollout.completion_mask.shape,
                                                              dtype=_at_least_32(ent))
            entropies[rows, :ent.shape[1]] = ent
        return entropies if entropies is not None else rollout.completion_mask.new_zeros(
            rollout.completion_mask.shape, dtype=torch.float32)

    def policy_logps(self, rollout: Rollout) -> torch.Tensor:
        """The policy's log-probs of the rollout's tokens as it sampled them: computed once per
        rollout."""
        cached = self._policy_logps_of
        if cached is not None and cached[0] is rollout:
            return cached[1]
        logps = self.logps(self.model, rollout)
        self._policy_logps_of = (rollout, logps)
        return logps

    def forget(self) -> None:
        """The rollout's log-probs are in its batch now, or not needed: drop the cached ones."""
        self._policy_logps_of = None

    def reference_logps(self, rollout: Rollout) -> torch.Tensor:
        if self.ref_model is not None:
            return self.logps(self.ref_model, rollout)
        # LoRA: the base model is the reference
        with self.accelerator.unwrap_model(self.model).disable_adapter():
            return self.logps(self.model, rollout)

    def sampling_kl(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-token log pi_old - log pi_ref, the trained-token mask), both [N, C]: pi_old is the
        policy as it sampled; truncated completions are masked out with mask_truncated_completions
        (as TRL does before the KL). The KL penalty in RLOO's reward and in REINFORCE++'s per-token
        rewards."""
        mask = self.trained_mask(rollout)
        return (self.policy_logps(rollout) - self.reference_logps(rollout)) * mask, mask

    def trained_mask(self, rollout: Rollout) -> torch.Tensor:
        """[N, C] float: the tokens that carry a return (truncated completions left out when
        masked)."""
        mask = rollout.loss_mask.float()
        if self.args.mask_truncated_completions:
            mask = mask * (~rollout.truncated).float()[:, None]
        return mask


def _at_least_32(values: torch.Tensor) -> torch.dtype:
    """float32 for half-precision values, their own dtype otherwise (a float64 model keeps
    float64)."""
    return torch.promote_types(values.dtype, torch.float32)


# Below this many tokens per block on average, the loop over blocks (one SDPA call per block and
# layer) costs more than the padding it saves. A one-off timing of score_rows' forward + backward on
# 2 CPU cores (2026-11-26): the demo's 8 x 8 rows of ~18 tokens took 1.6x the padded time packed, at
# 0.42x the tokens; 50 tokens a block (a 200-token prompt, 8 x 8 rows of 32) took 0.61x the padded
# time.
MIN_BLOCK_TOKENS = 32


def packing_pays(rollout: Rollout, rows, share_prompts: bool, one_call: bool) -> bool:
    """Packing these rows computes at most half the tokens a padded forward of them would, and
    (where the attention loops over the blocks: `one_call` False) its blocks hold MIN_BLOCK_TOKENS
    tokens on average."""
    prompt = rollout.prompt_mask[rows].sum(dim=1)  # [b]
    completion = rollout.completion_mask[rows].sum(dim=1)
    padded = prompt.numel() * (int(prompt.max()) + int(completion.max())) if prompt.numel() else 0
    distinct = _distinct_prompts(rollout, rows) if share_prompts else None
    packed = int(completion.sum()) + (int(prompt.sum()) if distinct is None else sum(distinct.values()))
    blocks = int((completion > 0).sum()) + (0 if distinct is None else len(distinct))
    return 2 * packed <= padded and (one_call or packed >= MIN_BLOCK_TOKENS * max(blocks, 1))


def _distinct_prompts(rollout: Rollout, rows) -> dict[tuple, int]:
    """Each distinct prompt among the rows, with its length."""
    seen = {}
    for ids, mask in zip(rollout.prompt_ids[rows].tolist(), rollout.prompt_mask[rows].tolist()):
        prompt = tuple(i for i, m in zip(ids, mask) if m)
        seen[prompt] = len(prompt)
    return seen
