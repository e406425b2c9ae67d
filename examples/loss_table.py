"""Print the tables in docs/losses.md: one fixed batch, every loss_type with and without KL, then each
algorithm option switched on alone (on dapo unless named).

    python examples/loss_table.py
"""

from __future__ import annotations

import torch

from rlft.core.advantages import group_advantages
from rlft.core.losses import LOSS_TYPES, off_policy_sequence_mask, policy_loss
from rlft.core.regularizers import entropy_bonus, entropy_threshold, high_entropy_mask


def fixed_batch():
    """Two prompts x 4 completions, lengths 2..8 tokens, one rollout old (ratios != 1)."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    advantages, _ = group_advantages(rewards, group_size=4)
    lengths = torch.tensor([2, 8, 5, 3, 8, 4, 6, 2])
    mask = (torch.arange(8)[None, :] < lengths[:, None]).float()
    logps = -torch.rand(8, 8, generator=g) * 2
    old = logps + torch.randn(8, 8, generator=g) * 0.2
    ref = logps + torch.randn(8, 8, generator=g) * 0.1
    return logps, old, ref, advantages, mask


def main() -> None:
    logps, old, ref, adv, mask = fixed_batch()
    print("| loss_type | loss, beta=0 | loss, beta=0.04 | loss on-policy (old = current), beta=0 | grad norm on-policy |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for loss_type in LOSS_TYPES:
        kw = dict(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, max_completion_length=8)
        off = policy_loss(logps, old, adv, mask, **kw)[0].item()
        kl = policy_loss(logps, old, adv, mask, ref_logps=ref, beta=0.04, **kw)[0].item()
        current = logps.clone().requires_grad_()
        on, _ = policy_loss(current, current.detach(), adv, mask, **kw)
        on.backward()
        print(f"| {loss_type} | {off:+.4f} | {kl:+.4f} | {on.item():+.4f} | {current.grad.norm().item():.4f} |")



def options() -> None:
    """Each option on the off-policy batch: loss and gradient norm with respect to the log-probs."""
    logps, old, ref, adv, mask = fixed_batch()
    entropy = torch.rand(8, 8, generator=torch.Generator().manual_seed(1)) * 3  # stand-in token entropies
    keep = high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask.bool()], 0.2))
    base = dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, max_completion_length=8)
    rows = [
        ("dapo (no option)", {}, mask, None),
        ("delta: 1.1", {"delta": 1.1}, mask, None),
        ("off_policy_mask_threshold: 0.02", {"keep": off_policy_sequence_mask(adv, logps, old, mask, 0.02)}, mask,
         None),
        ("top_entropy_quantile: 0.2", {"num_items": keep.sum()}, keep, None),
        ("entropy_coef: 0.01", {}, mask, 0.01),
        ("loss_type: luspo (sequence level)", {"loss_type": "luspo", "importance_sampling_level": "sequence"}, mask,
         None),
        ("loss_type: vespo", {"loss_type": "vespo"}, mask, None),
    ]
    print("| option | loss, beta=0 | grad norm |")
    print("| --- | ---: | ---: |")
    for name, extra, trained, coef in rows:
        current = logps.clone().requires_grad_()
        loss, _ = policy_loss(current, old, adv, trained, **{**base, **extra})
        if coef is not None:  # the bonus's gradient reaches the logits, not the log-probs: only its value here
            loss = loss + entropy_bonus(entropy, trained, coef)
        loss.backward()
        print(f"| {name} | {loss.item():+.4f} | {current.grad.norm().item():.4f} |")


if __name__ == "__main__":
    main()
    print()
    options()
