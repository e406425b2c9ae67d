"""The model-level fused scoring (rlft/model/scoring.py): the same log-probs, entropies and gradients as the model's own
logits, for every kind of LM head, and no [B, T, V] tensor in a GRPO scoring step or an evaluation."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from rlft import GRPOTrainer
from rlft.core.logprobs import entropy_from_logits, selective_log_softmax
from rlft.model.loading import cast_lm_head_to_fp32
from rlft.model.scoring import Score, install_scoring
from rlft.tiny import build_causal_lm, build_tokenizer
from tests.helpers import SAME_STEP, addition_rows, correct_answer, tiny_grpo_config
from tests.test_core_fused_head import LargestTensor


def batch(vocab: int, rows: int = 4, prompt: int = 5, width: int = 6):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, prompt + width), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    completion_mask = torch.ones(rows, width, dtype=torch.long)
    completion_mask[1, 3:] = 0  # a short completion
    completion_mask[2, :] = 0  # an empty one
    mask[:, prompt:] = completion_mask
    return ids, mask, ids[:, prompt:], completion_mask


def unfused(model, ids, mask, targets, temperature):
    width = targets.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=width + 1).logits[:, :-1]
    return selective_log_softmax(logits, targets, temperature), entropy_from_logits(logits, temperature)


def fused(model, ids, mask, targets, completion_mask, temperature, tile=3):
    out = model(input_ids=ids, attention_mask=mask, rlft_score=Score(targets, completion_mask, temperature, True,
                                                                     tile=tile))
    return out.logps, out.entropy


def tiny(arch: str = "qwen2", tied: bool = True):
    tokenizer = build_tokenizer(0, vocab_size=384)
    model = build_causal_lm(tokenizer, arch=arch, hidden_size=64)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model


@pytest.mark.parametrize("arch,tied,lora_head,fp32_head", [("qwen2", True, False, False), ("llama", False, False, False),
                                                           ("qwen2", False, True, False), ("llama", False, False, True)])
def test_fused_scores_and_gradients_equal_the_models_own_logits(arch, tied, lora_head, fp32_head):
    model = tiny(arch, tied)
    if fp32_head:
        model = model.to(torch.bfloat16)
        cast_lm_head_to_fp32(model)
    else:  # two orders of one sum: compared in float64, to its rounding (tests/helpers.py: SAME_STEP)
        model = model.double()
    install_scoring(model)
    if lora_head:  # the head adapted by peft: scored as a module, one checkpointed tile at a time
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    reference = copy.deepcopy(model)
    ids, mask, targets, completion_mask = batch(model.config.vocab_size)
    want_logps, want_entropy = unfused(reference, ids, mask, targets, 0.7)
    logps, entropy = fused(model, ids, mask, targets, completion_mask, 0.7)
    keep = completion_mask.bool()
    # bf16 backbone: the same hidden states, then float32 either way (the model's own logits are bf16)
    tolerance = 2e-2 if fp32_head else SAME_STEP
    want_logps, want_entropy = (want_logps.float(), want_entropy.float()) if fp32_head else (want_logps,
                                                                                            want_entropy)
    torch.testing.assert_close(logps[keep], want_logps[keep], rtol=0, atol=tolerance)
    torch.testing.assert_close(entropy[keep], want_entropy[keep], rtol=0, atol=tolerance)
    assert (logps[~keep] == 0).all()
    ((logps * keep).sum() + (entropy * keep).sum()).backward()
    ((want_logps * keep).sum() + (want_entropy * keep).sum()).backward()
    trained = [(n, p, q) for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())
               if p.requires_grad]
    assert trained
    for name, p, q in trained:
        torch.testing.assert_close(p.grad.float() if fp32_head else p.grad, q.grad.float() if fp32_head else q.grad,
                                   rtol=1e-3 if fp32_head else 0, atol=1e-2 if fp32_head else SAME_STEP, msg=name)


def test_a_moe_policys_router_loss_is_the_models_own():
    model = tiny("qwen2_moe")
    install_scoring(model)
    ids, mask, targets, completion_mask = batch(model.config.vocab_size)
    own = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    scored = model(input_ids=ids, attention_mask=mask, rlft_score=Score(targets, completion_mask, router_loss=True))
    torch.testing.assert_close(scored.aux_loss, own)


def test_generation_is_untouched_by_the_scoring_forward():
    model = tiny()
    before = model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)
    install_scoring(model)
    assert torch.equal(model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False), before)


def test_a_grpo_step_and_an_evaluation_never_build_positions_times_vocabulary(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer],
                          tiny_grpo_config(tmp_path, per_device_train_batch_size=64, num_generations=4,
                                           max_completion_length=8, logprob_chunk_size=4, max_steps=1),
                          addition_rows(64), eval_dataset=addition_rows(32, heldout=True))
    config = trainer.accelerator.unwrap_model(trainer.model).config
    vocab, weight = config.vocab_size, config.vocab_size * config.hidden_size  # the head's weight and its gradient
    batch_ = trainer._make_rollout(0)
    positions = int(batch_.rollout.completion_mask.sum())
    with LargestTensor(vocab) as watch:
        trainer.updater.step(batch_)
    assert watch.largest <= max(4 * vocab, weight) < positions * vocab  # one tile of logits, never the step's
    with LargestTensor(vocab) as watch:
        trainer.evaluate()
    assert watch.largest <= max(32 * vocab, weight) < 32 * 8 * vocab  # generate: one position's logits per token
