"""Padding-free scoring (issue 42): rows packed into one sequence, a shared prompt held once, give the
log-probs and gradients of scoring each row padded, for full and LoRA training, with gradient checkpointing,
on Qwen2 and Llama; the segment attention against a float64 reference written from its definition."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from rlft import GRPOConfig, GRPOTrainer
from rlft.core.segments import Block, segment_attention
from rlft.errors import ConfigError
from rlft.model.packing import pack_rows
from rlft.model.scoring import install_scoring, score_rows
from rlft.rollout.base import Rollout
from rlft.tiny import build_causal_lm, build_tokenizer
from rlft.train.update.rollout_logprobs import packing_pays
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config


def reference_attention(q, k, v, blocks):
    """float64, one query at a time: query i of a block attends to the block's prefix and its own tokens up
    to i, softmax(q k^T / sqrt(d)) v, nothing else."""
    out = torch.zeros_like(q)
    for b in blocks:
        for i in range(b.length):
            seen = list(range(b.prefix_start, b.prefix_start + b.prefix_length))
            seen += list(range(b.start, b.start + i + 1))
            scores = torch.einsum("hd,hsd->hs", q[:, b.start + i], k[:, seen]) / q.shape[-1] ** 0.5
            out[:, b.start + i] = torch.einsum("hs,hsd->hd", torch.softmax(scores, dim=-1), v[:, seen])
    return out


def test_segment_attention_is_each_rows_own_attention_float64():
    g = torch.Generator().manual_seed(0)
    blocks = [Block(0, 5), Block(5, 4), Block(9, 3, 5, 4), Block(12, 2, 5, 4), Block(14, 6)]
    q = torch.randn(1, 4, 20, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64)  # grouped-query: 2 kv heads for 4
    v = torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64)
    out, _ = segment_attention(None, q, k, v, None, rlft_blocks=blocks)
    ref = reference_attention(q[0], k[0].repeat_interleave(2, 0), v[0].repeat_interleave(2, 0), blocks)
    assert out.shape == (1, 20, 4, 8)
    assert torch.allclose(out[0].transpose(0, 1), ref, atol=1e-12)


def rollout(vocab: int, prompts=((5, 3), (7, 2)), lengths=(6, 2, 0, 4, 5), width: int = 8, seed: int = 0):
    """Groups of completions behind left-padded prompts: (prompt length, completions per prompt)."""
    g = torch.Generator().manual_seed(seed)
    longest = max(p for p, _ in prompts)
    prompt_ids, prompt_mask = [], []
    for length, count in prompts:
        ids = torch.randint(3, vocab, (longest,), generator=g)
        mask = (torch.arange(longest) >= longest - length).long()
        prompt_ids += [ids * mask] * count
        prompt_mask += [mask] * count
    n = len(prompt_ids)
    completion_mask = (torch.arange(width)[None] < torch.tensor(lengths[:n])[:, None]).long()
    completion_ids = torch.randint(3, vocab, (n, width), generator=g) * completion_mask
    return Rollout(torch.stack(prompt_ids), torch.stack(prompt_mask), completion_ids, completion_mask,
                   torch.zeros(n, dtype=torch.bool))


def test_packed_layout_holds_a_shared_prompt_once_and_each_rows_real_tokens():
    r = rollout(100, prompts=((5, 3), (7, 1)), lengths=(6, 2, 0, 4))
    packed = pack_rows(r, [0, 1, 2, 3], share_prompts=True)
    assert packed.input_ids.shape[1] == 5 + 6 + 2 + 7 + 4  # the empty completion adds nothing
    assert packed.position_ids[0, :13].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 5, 6]
    assert packed.blocks[:3] == [Block(0, 5), Block(5, 6, 0, 5), Block(11, 2, 0, 5)]
    assert packed.predict[:3].tolist() == [4, 5, 6]  # the prompt's last token predicts each first token
    assert packed.predict[6].tolist() == 4
    whole = pack_rows(r, [0, 1, 2, 3], share_prompts=False)
    assert whole.input_ids.shape[1] == 3 * 5 + 6 + 2 + 7 + 4 - 5  # the empty row is left out whole
    assert torch.equal(whole.targets, packed.targets)


def tiny(arch: str, lora: bool, checkpointing: bool):
    torch.manual_seed(0)
    tokenizer = build_tokenizer(0, vocab_size=384)
    model = build_causal_lm(tokenizer, arch=arch, hidden_size=64)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    install_scoring(model)
    return model


def scores_and_grads(model, r, packing):
    model.zero_grad()
    scored = score_rows(model, r, torch.arange(r.completion_ids.shape[0]), 0.9, entropy=True, packing=packing)
    weights = torch.linspace(0.5, 1.5, scored.logps.numel()).view_as(scored.logps)
    ((scored.logps * weights).sum() + scored.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return scored.logps.detach(), scored.entropy.detach(), grads


@pytest.mark.parametrize("arch,lora,checkpointing", [("qwen2", False, False), ("llama", False, True),
                                                     ("qwen2", True, True), ("llama", True, False)])
def test_packed_scores_and_gradients_are_the_padded_ones(arch, lora, checkpointing):
    model = tiny(arch, lora, checkpointing)
    r = rollout(384)
    logps, entropy, grads = scores_and_grads(model, r, None)
    for packing in ("rows", "prompts"):
        packed_logps, packed_entropy, packed_grads = scores_and_grads(model, r, packing)
        mask = r.completion_mask[:, :logps.shape[1]].bool()
        assert torch.allclose(packed_logps[mask], logps[mask], atol=2e-5)
        assert (packed_logps[~mask] == 0).all()
        assert torch.allclose(packed_entropy[mask], entropy[mask], atol=2e-5)
        assert grads.keys() == packed_grads.keys() and grads
        for name, grad in grads.items():
            assert torch.allclose(packed_grads[name], grad, atol=2e-5, rtol=1e-4), name


def test_generation_and_the_saved_config_are_the_models_own_after_packed_scoring(tmp_path):
    model = tiny("qwen2", False, False)
    model.eval()
    prompt = torch.tensor([[5, 6, 7, 8]])
    before = model.generate(prompt, max_new_tokens=6, do_sample=False)
    score_rows(model, rollout(384), torch.arange(5), packing="prompts")
    assert model.config._attn_implementation == "rlft_segments:sdpa"
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), before)
    model.save_pretrained(tmp_path)
    assert "rlft" not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_eager_attention_is_refused_by_name():
    tokenizer = build_tokenizer(0, vocab_size=384)
    model = build_causal_lm(tokenizer, hidden_size=64)
    model.config._attn_implementation = "eager"
    install_scoring(model)
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        score_rows(model, rollout(384), torch.arange(5), packing="rows")


def test_auto_packing_needs_half_the_tokens_and_blocks_worth_a_call():
    """padding_free null: packed at most half the padded tokens and, where attention loops over the blocks
    (a CPU), 32 tokens a block on average (shorter ones cost more in calls than the padding they save)."""
    rows = torch.arange(4)
    r = rollout(384, prompts=((5, 4),), lengths=(8, 1, 1, 1))
    assert not packing_pays(r, rows, share_prompts=False, one_call=True)  # 31 of 52 tokens
    assert packing_pays(r, rows, share_prompts=True, one_call=True)  # 16 of 52 tokens, one varlen call
    assert not packing_pays(r, rows, share_prompts=True, one_call=False)  # 16 tokens in 5 blocks
    r = rollout(384, prompts=((40, 4),), lengths=(100, 20, 20, 20), width=100)
    assert packing_pays(r, rows, share_prompts=True, one_call=False)  # 200 of 560 tokens, 5 blocks


def one_step(kind: str, model_dir, out, **fields):
    from rlft import AsyncGRPOConfig, AsyncGRPOTrainer, RLOOConfig, RLOOTrainer

    trainer_class, config_class = {"grpo": (GRPOTrainer, GRPOConfig), "rloo": (RLOOTrainer, RLOOConfig),
                                   "async": (AsyncGRPOTrainer, AsyncGRPOConfig)}[kind]
    values = dict(output_dir=str(out), learning_rate=1e-3, max_steps=1, num_generations=4,
                  per_device_train_batch_size=8, max_completion_length=8, logging_steps=1, report_to="none",
                  disable_tqdm=True, seed=0, beta=0.05, temperature=0.9, gradient_checkpointing=False)
    config = config_class(**{**values, **fields})
    trainer = trainer_class(str(model_dir), [correct_answer], config, addition_rows(8))
    trainer.train()
    return trainer


@pytest.mark.parametrize("kind,fields", [("grpo", dict(num_iterations=2)),
                                         ("grpo", dict(gradient_checkpointing=True)),
                                         ("rloo", {}), ("async", {})])
def test_a_step_packed_is_the_padded_step(tmp_path, tiny_causal_dir, kind, fields):
    """Old-policy, reference and policy scoring packed (a group's prompt once) against padded: GRPO (with
    several optimiser steps per rollout, and with gradient checkpointing), RLOO (KL in the reward) and the
    async trainer."""
    runs = [one_step(kind, tiny_causal_dir, tmp_path / str(flag), padding_free=flag, **fields)
            for flag in (False, True)]
    logs = [trainer.state.log_history[0] for trainer in runs]
    assert (logs[0]["tokens/packed_fraction"], logs[1]["tokens/packed_fraction"]) == (0, 1)
    assert logs[1]["tokens/computed"] < logs[0]["tokens/computed"]
    assert logs[0]["loss"] == pytest.approx(logs[1]["loss"], abs=1e-5)
    assert logs[0]["kl"] == pytest.approx(logs[1]["kl"], abs=1e-6)
    padded = dict(runs[0].model.named_parameters())
    for name, weight in runs[1].model.named_parameters():
        assert torch.allclose(weight, padded[name], atol=1e-5), name


def test_padding_free_true_on_a_model_packing_cannot_serve_names_the_field(tmp_path, tiny_causal_dir):
    config = tiny_grpo_config(tmp_path, max_steps=1, padding_free=True,
                              model_init_kwargs={"attn_implementation": "eager"})
    trainer = GRPOTrainer(model=str(tiny_causal_dir), reward_funcs=correct_answer, args=config,
                          train_dataset=addition_rows(8))
    with pytest.raises(ConfigError, match="padding_free"):
        trainer.train()


def test_tool_rollouts_score_packed_like_padded():
    r = rollout(384)
    r.tool_mask = torch.ones_like(r.completion_mask)
    r.tool_mask[0, 2:4] = 0  # tool output the policy reads but is not trained on
    model = tiny("qwen2", False, False)
    padded = score_rows(model, r, torch.arange(5)).logps
    packed = score_rows(model, r, torch.arange(5), packing="prompts").logps
    assert torch.allclose(padded, packed, atol=2e-5)
    trained = r.loss_mask[:, :padded.shape[1]]
    assert torch.allclose((padded * trained).sum(), (packed * trained).sum(), atol=1e-4)


def test_a_moe_router_loss_packed_row_by_row_is_the_padded_one():
    torch.manual_seed(0)
    model = build_causal_lm(build_tokenizer(0, vocab_size=384), arch="qwen2_moe", hidden_size=64)
    install_scoring(model)
    r = rollout(384, lengths=(6, 2, 1, 4, 5))  # (a row with no completion is not packed: no tokens)
    padded = score_rows(model, r, torch.arange(5), router_loss=True)
    packed = score_rows(model, r, torch.arange(5), router_loss=True, packing="rows")
    torch.testing.assert_close(packed.aux_loss, padded.aux_loss)
    mask = r.completion_mask[:, :padded.logps.shape[1]].bool()
    assert torch.allclose(packed.logps[mask], padded.logps[mask], atol=2e-5)


def bottom_right_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, -1), enable_gqa=False,
                        scale=None):
    """A stand-in for torch's varlen flash attention, from its definition: sequence i's queries
    q[cu_q[i]:cu_q[i+1]] attend to its keys k[cu_k[i]:cu_k[i+1]], causally aligned to the bottom right."""
    assert window_size == (-1, 0) and enable_gqa and q.shape[1] == 2 * k.shape[1]
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        n, m = qs.stop - qs.start, ks.stop - ks.start
        seen = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)
        out[qs] = torch.nn.functional.scaled_dot_product_attention(
            q[qs].transpose(0, 1), k[ks].transpose(0, 1).repeat_interleave(2, 0),
            v[ks].transpose(0, 1).repeat_interleave(2, 0), attn_mask=seen).transpose(0, 1)
    return out


def test_the_varlen_layout_gives_each_block_its_prefix_and_its_own_past(monkeypatch):
    """The one-call GPU path (torch's varlen flash attention, CUDA only) lays the blocks out as the
    per-block path reads them: checked with a stand-in kernel written from varlen attention's definition."""
    import rlft.core.segments as segments

    monkeypatch.setattr(segments, "varlen_attn", bottom_right_varlen)
    monkeypatch.setattr(segments, "_VARLEN_ARGS", {"window_size", "enable_gqa", "scale"})
    g = torch.Generator().manual_seed(1)
    blocks = [Block(0, 5), Block(5, 4), Block(9, 3, 5, 4), Block(12, 2, 5, 4), Block(14, 6)]
    q = torch.randn(1, 4, 20, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64)
    out = segments._varlen(q, k, v, blocks, None)
    ref = reference_attention(q[0], k[0].repeat_interleave(2, 0), v[0].repeat_interleave(2, 0), blocks)
    assert torch.allclose(out[0].transpose(0, 1), ref, atol=1e-12)
    assert segments.kernel(q) == "sdpa per block"  # a CPU tensor: one SDPA call per block
