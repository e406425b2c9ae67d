"""Per-token log-probs of a rollout's completion tokens under the policy or the reference policy, a
micro-batch at a time, through the fused LM head (rlft/scoring.py: never a [B, T, V] tensor).

Micro-batches hold the longest completions first, so each pads only to its own longest row (a step's loss is
a sum over rows with global normalisers: row order changes nothing); with `token_budget` they are filled by
tokens instead of rows (rlft/core/batching.py). The policy's log-probs of a rollout as it was sampled are
computed once per rollout and shared by whatever needs them (the KL in RLOO's and REINFORCE++'s reward, the
old log-probs of several optimiser steps per rollout).
"""

from __future__ import annotations

import torch

from rlft.core.batching import balanced_bins, budget_count
from rlft.rollout.base import Rollout
from rlft.scoring import score_rows


class PolicyScorer:
    """Log-probs (and entropies) of rollouts under `model` (the policy, as the training engine wraps it) or
    its reference (`ref_model`; with LoRA and no copy, the policy with its adapters off)."""

    def __init__(self, model, ref_model, accelerator, args):
        self.model, self.ref_model, self.accelerator, self.args = model, ref_model, accelerator, args
        self._policy_logps_of: tuple[Rollout, torch.Tensor] | None = None

    def forward(self, model, rollout: Rollout, rows, entropy: bool = False, entropy_grad: bool = False,
                router_loss: bool = False):
        """Per-token log-probs [b, c] of the completion tokens (and their entropy [b, c]; a MoE policy's
        router load-balancing loss, the model's own `aux_loss`; the log of the mass the sampler kept [b, c]
        where the rollout carries its kept ids) for `rows` (a slice or an index tensor), cut to the rows'
        longest completion and prompt (rlft/scoring.py: score_rows). With kept ids the log-probs are
        renormalised over them: the distribution the sampler drew from (rlft/rollout/truncation.py)."""
        scored = score_rows(model, rollout, rows, self.args.temperature, entropy, router_loss,
                            self.args.logprob_chunk_size, self.args.pad_to_multiple_of)
        ent = None if scored.entropy is None else scored.entropy if entropy_grad else scored.entropy.detach()
        return scored.logps, ent, scored.aux_loss, scored.kept_logmass

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
        out = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)  # [N, C]
        for rows in self.micro_batches(rollout):
            logps = self.forward(model, rollout, rows)[0]
            out[rows, :logps.shape[1]] = logps.float()
        return out

    @torch.no_grad()
    def entropies(self, rollout: Rollout) -> torch.Tensor:
        """[N, C] the policy's entropy at every completion position, no gradient."""
        entropies = torch.zeros(rollout.completion_mask.shape, device=rollout.completion_mask.device)
        for rows in self.micro_batches(rollout):
            ent = self.forward(self.model, rollout, rows, entropy=True)[1]
            entropies[rows, :ent.shape[1]] = ent.float()
        return entropies

    def policy_logps(self, rollout: Rollout) -> torch.Tensor:
        """The policy's log-probs of the rollout's tokens as it sampled them: computed once per rollout."""
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
        """(per-token log pi_old - log pi_ref, the trained-token mask), both [N, C]: pi_old is the policy as
        it sampled; truncated completions are masked out with mask_truncated_completions (as TRL does before
        the KL). The KL penalty in RLOO's reward and in REINFORCE++'s per-token rewards."""
        mask = self.trained_mask(rollout)
        return (self.policy_logps(rollout) - self.reference_logps(rollout)) * mask, mask

    def trained_mask(self, rollout: Rollout) -> torch.Tensor:
        """[N, C] float: the tokens that carry a return (truncated completions left out when masked)."""
        mask = rollout.loss_mask.float()
        if self.args.mask_truncated_completions:
            mask = mask * (~rollout.truncated).float()[:, None]
        return mask
