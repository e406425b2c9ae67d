"""What a token-level advantage estimator (REINFORCE++, `advantage_estimator: reinforce_pp`) needs from a
rollout: every process's completion masks and per-token KL estimates, padded to one width and gathered like
the rewards, so the batch-wide whitening sees the whole batch on every process.

The KL here is the first-order estimate log pi_old(o_t) - log pi_ref(o_t) at sampling time (the REINFORCE++
paper's per-token reward penalty); with beta = 0 there is none and no reference pass is made. The loss then
has no KL term of its own (beta is in the reward).
"""

from __future__ import annotations

import torch


def sampling_kl(trainer, rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token log pi_old - log pi_ref, the trained-token mask), both [N, C]: pi_old is the policy as it
    sampled; truncated completions are masked out with mask_truncated_completions (as TRL does before the KL).
    The KL penalty in RLOO's reward and in REINFORCE++'s per-token rewards."""
    mask = rollout.loss_mask.float()
    if trainer.args.mask_truncated_completions:
        mask = mask * (~rollout.truncated).float()[:, None]
    return (trainer._sampling_policy_logps(rollout) - trainer._reference_logps(rollout)) * mask, mask


def gathered_token_inputs(trainer, rollout) -> dict:
    """{"mask": [N_all, C], "token_kl": [N_all, C] or None, "beta": float}, C the widest completion of any
    process; this process's rows come first-to-last in process order, its width is its own completions'."""
    acc, args = trainer.accelerator, trainer.args
    if args.beta != 0:
        kl, mask = sampling_kl(trainer, rollout)
    else:  # no KL, no reference pass; truncated completions still carry no return when masked
        kl, mask = None, rollout.loss_mask.float()
        if args.mask_truncated_completions:
            mask = mask * (~rollout.truncated).float()[:, None]
    if acc.num_processes > 1:
        mask = acc.gather(acc.pad_across_processes(mask.to(acc.device), dim=1, pad_index=0.0))
        if kl is not None:
            kl = acc.gather(acc.pad_across_processes(kl.to(acc.device), dim=1, pad_index=0.0))
    return {"mask": mask.cpu(), "token_kl": None if kl is None else kl.cpu().float(), "beta": args.beta}


def row_view(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One number per completion for logs and samples: the mean advantage over its tokens ([N] stays [N])."""
    if advantages.ndim == 1:
        return advantages
    return (advantages * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
