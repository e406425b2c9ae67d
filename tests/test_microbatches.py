"""Length-sorted, trimmed micro-batches: the same step as one big batch, with less padding."""

from __future__ import annotations

import pytest
import torch

from rlft import GRPOConfig, GRPOTrainer
from tests.dist.grpo_step import OPTIONS, FixedGenerator, off_policy, token_sum_reward
from tests.helpers import FLOAT64, SAME_STEP, SHARED_PROMPT, addition_rows, assert_params_close


def one_step(model_dir, tmp_path, per_device: int, accumulation: int, **overrides):
    """Parameters after one SGD step (lr 1: the change is the gradient) and the shapes fed to the model;
    micro-batches padded unless `overrides` say padding_free (these tests are about padded micro-batches). In
    float64, so that two splits agree to its rounding (tests/helpers.py: SAME_STEP)."""
    overrides = {"padding_free": False, "model_init_kwargs": FLOAT64, **overrides}
    cfg = GRPOConfig(output_dir=str(tmp_path / f"run{per_device}"), optim="sgd", learning_rate=1.0,
                     max_grad_norm=1e9, seed=0, num_generations=4, per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=accumulation, max_steps=1, max_completion_length=8,
                     report_to=["none"], disable_tqdm=True, **overrides)
    trainer = GRPOTrainer(str(model_dir), [token_sum_reward], cfg, addition_rows(16))
    trainer.generator = FixedGenerator(trainer.tokenizer, kept=overrides.get("top_p", 1.0) < 1.0)
    batch = trainer._make_rollout(0)
    off_policy(trainer, batch)
    trainer.last_entropy = 0.0  # adaptive entropy: as if the previous step was below the target
    shapes = []
    hook = trainer.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                   with_kwargs=True)
    metrics = trainer.updater.step(batch)
    hook.remove()
    params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
    return params, metrics, shapes, batch


@pytest.mark.parametrize("overrides", [dict(loss_type="grpo"), dict(loss_type="dapo", beta=0.04),
                                       dict(loss_type="dr_grpo", num_iterations=2),
                                       dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
                                       dict(loss_type="vespo", beta=0.04), *OPTIONS.values()])
def test_sorted_trimmed_micro_batches_give_the_one_batch_step(tmp_path, tiny_causal_dir, overrides):
    whole, whole_metrics, whole_shapes, batch = one_step(tiny_causal_dir, tmp_path, 16, 1, **overrides)
    split, split_metrics, split_shapes, _ = one_step(tiny_causal_dir, tmp_path, 2, 8, **overrides)
    # a group's prompt held once is split across micro-batches of 2
    bound = SHARED_PROMPT if overrides.get("padding_free") and overrides.get("shared_prefix_scoring", True) \
        else SAME_STEP
    assert_params_close(split, whole, bound)
    for key in ("loss", "kl", "entropy", "clip_ratio/region_mean", "entropy_loss", "entropy_mask/threshold",
                "off_policy/masked_fraction", "vespo/phi_seq_mean", "clip_ratio/delta_mean"):
        if key in whole_metrics:
            assert whole_metrics[key] == pytest.approx(split_metrics[key], abs=SAME_STEP), key
    if overrides.get("padding_free"):  # packed: one sequence per micro-batch, no padding to compare
        assert all(shape[0] == 1 for shape in split_shapes)
        return
    # The fixed completions have 3..7 tokens: the big batch pads every row to the longest, the
    # micro-batches (longest first) only to their own longest.
    lengths = sorted(batch.rollout.completion_mask.sum(dim=1).tolist(), reverse=True)
    prompt_width = batch.rollout.prompt_ids.shape[1]
    widths = [shape[1] - prompt_width for shape in split_shapes[-8:]]
    assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0]
    assert widths == [max(lengths[i:i + 2]) for i in range(0, 16, 2)]
    assert sum(s[0] * s[1] for s in split_shapes[-8:]) < whole_shapes[-1][0] * whole_shapes[-1][1]


def test_no_grad_log_probs_fill_every_row_in_its_place(tmp_path, tiny_causal_dir):
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), seed=0, num_generations=4, per_device_train_batch_size=2,
                     gradient_accumulation_steps=8, num_iterations=2, max_steps=1, max_completion_length=8,
                     report_to=["none"], disable_tqdm=True)
    trainer = GRPOTrainer(str(tiny_causal_dir), [token_sum_reward], cfg, addition_rows(16))
    trainer.generator = FixedGenerator(trainer.tokenizer)
    batch = trainer._make_rollout(0)  # old log-probs from 8 sorted, trimmed micro-batches
    mask = batch.rollout.completion_mask.bool()
    with torch.no_grad():
        whole = trainer.scorer.forward(trainer.model, batch.rollout, slice(0, None))[0]  # one batch, no sorting
    assert batch.old_logps.shape == mask.shape
    width = whole.shape[1]  # the longest completion; the rollout is padded wider
    assert width < mask.shape[1] and not mask[:, width:].any()
    assert torch.allclose(batch.old_logps[:, :width][mask[:, :width]], whole[mask[:, :width]], atol=1e-5, rtol=0)
    assert (batch.old_logps[:, width:] == 0).all()


@pytest.mark.parametrize("budget", [30, 60, 1000])
def test_token_budget_micro_batches_give_the_one_batch_step(tmp_path, tiny_causal_dir, budget):
    """Micro-batches filled by tokens (TRL's token_budget): long rows alone, short rows together, the same step."""
    whole, whole_metrics, _, batch = one_step(tiny_causal_dir, tmp_path, 16, 1, loss_type="dapo", beta=0.04)
    split, split_metrics, shapes, _ = one_step(tiny_causal_dir, tmp_path / "b", 16, 1, loss_type="dapo", beta=0.04,
                                               token_budget=budget)
    assert_params_close(split, whole, SAME_STEP)
    assert whole_metrics["loss"] == pytest.approx(split_metrics["loss"], abs=SAME_STEP)
    tokens = (batch.rollout.prompt_mask.sum(1) + batch.rollout.completion_mask.sum(1)).tolist()
    if budget < max(tokens) + min(tokens):  # nothing fits beside the longest row: it goes alone
        assert len(shapes) > 1 and min(s[0] for s in shapes) == 1
    if budget >= sum(tokens):
        assert [s[0] for s in shapes] == [16]  # everything in one micro-batch


def test_token_budget_bins_respect_the_budget_and_reach_a_requested_count():
    from rlft.core.batching import balanced_bins, budget_bins

    tokens = torch.tensor([50, 10, 40, 10, 30, 25, 5])
    bins = budget_bins(tokens, 50)
    assert sorted(r for b in bins for r in b) == list(range(7))
    assert all(sum(int(tokens[r]) for r in b) <= 50 for b in bins) and bins[0] == [0]  # the longest row alone
    more = balanced_bins(tokens, len(bins) + 2, 50)  # another process needs more micro-batches: as many here
    assert len(more) == len(bins) + 2 and sorted(int(r) for b in more for r in b) == list(range(7))
    assert budget_bins(torch.tensor([80, 5]), 50) == [[0], [1]]  # a row over the budget goes alone
