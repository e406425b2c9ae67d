"""activation_offloading (rlft/model/memory/offload.py): which saved tensors move (activations, not weights; with
gradient checkpointing each layer's input), the offloaded forward computes the same log-probs and gradients,
and a run on a CPU is told the option moves nothing there. The copies themselves need a CUDA device: the
tests marked for one run where torch sees one (none in CI; benchmarks/gpu/README.md says where they ran)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from rlft import RewardTrainer
from rlft.model.memory.offload import offload_activations, selected
from rlft.model.scoring import score_rows
from rlft.tiny import build_causal_lm, build_tokenizer
from tests.helpers import one_step_each, preference_rows, tiny_reward_config
from tests.test_packing import rollout, scores_and_grads, tiny

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the copies to host memory need a CUDA device")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a trainer on a CUDA machine runs on CUDA")


def test_selected_takes_activations_not_weights_expanded_views_or_small_tensors():
    big = torch.nn.Parameter(torch.zeros(1024, 512))  # 2 MiB
    assert not selected(big) and not selected(big.t()) and not selected(big[:600])
    assert not selected(big.to(torch.bfloat16))  # autocast's copy of a trained weight
    x = torch.zeros(1024, 512, requires_grad=True)
    assert selected(x) and selected(x.t()) and selected(x * 2) and selected(big * 2)
    assert not selected(torch.zeros(1024, 512))  # off the gradient's path (a mask, an index)
    assert not selected(torch.zeros(16, 16, requires_grad=True))  # under MIN_BYTES
    assert not selected(torch.zeros(1, 1, 512, requires_grad=True).expand(4, 1024, 512))  # one row, repeated
    assert not selected(torch.zeros(1024, 512).to_sparse().requires_grad_())


def test_with_checkpointing_the_backbone_saves_little_more_than_each_layers_input():
    torch.manual_seed(0)
    model = build_causal_lm(build_tokenizer(0, vocab_size=384), hidden_size=128, num_layers=3).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs, moved = [], {}
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a, k: inputs.append(k.get("hidden_states", a and a[0])),
                                        with_kwargs=True)

    def pack(tensor):
        if selected(tensor):
            moved[id(tensor)] = tensor
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=torch.randint(3, 384, (2, 2048)))  # [2, 2048, 128] float32: 2 MiB each
    assert len(inputs) == 3 and all(id(x) in moved for x in inputs)
    assert len(moved) <= len(inputs) + 2  # + the last layer's output and the final norm's, saved outside
    assert all(t.shape == (2, 2048, 128) for t in moved.values())


@pytest.mark.parametrize("lora,checkpointing", [(False, True), (True, False)])
def test_the_offloaded_backbone_scores_and_differentiates_as_before(lora, checkpointing):
    model = tiny("qwen2", lora, checkpointing)
    r = rollout(384)
    before = scores_and_grads(model, r, "prompts")
    assert offload_activations(model) == 1 and offload_activations(model) == 1  # the backbone, once
    after = scores_and_grads(model, r, "prompts")
    torch.testing.assert_close(after[0], before[0], atol=0, rtol=0)
    for name, grad in before[2].items():
        torch.testing.assert_close(after[2][name], grad, atol=0, rtol=0, msg=name)
    reference = copy.deepcopy(model)  # a copy runs its own weights through the patched forward
    for p in reference.parameters():
        p.data.zero_()
    with torch.no_grad():
        assert not torch.equal(score_rows(reference, r, torch.arange(5)).logps,
                               score_rows(model, r, torch.arange(5)).logps)


@cpu_only
def test_a_grpo_run_on_a_cpu_is_told_offloading_moves_nothing_and_takes_the_same_step(tmp_path, tiny_causal_dir):
    trainers = one_step_each(tmp_path, tiny_causal_dir, "activation_offloading", (False, True))
    assert any("activation_offloading: no effect on cpu" in n for n in trainers[1]._setup_notes)
    assert not any("activation_offloading" in n for n in trainers[0]._setup_notes)
    plain, offloaded = (t.state.log_history[0] for t in trainers)
    assert offloaded["loss"] == plain["loss"]
    reference = dict(trainers[0].model.named_parameters())
    for name, weight in trainers[1].model.named_parameters():
        assert torch.equal(weight, reference[name]), name


@cpu_only
def test_a_reward_run_on_a_cpu_is_told_offloading_moves_nothing(tmp_path, tiny_rm_dir, caplog):
    cfg = tiny_reward_config(tmp_path, activation_offloading=True, max_steps=1)
    with caplog.at_level(logging.WARNING, logger="rlft"):
        RewardTrainer(str(tiny_rm_dir), cfg, train_dataset=preference_rows(4))
    assert "activation_offloading: no effect on cpu" in caplog.text


# ---- on a CUDA device ---------------------------------------------------------------------------------------
def _long_model(lora: bool, checkpointing: bool):
    torch.manual_seed(0)
    model = build_causal_lm(build_tokenizer(0, vocab_size=384), hidden_size=256, num_layers=4).cuda().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    from rlft.model.scoring import install_scoring

    install_scoring(model)
    return model


def _long_step(model, r):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    scored = score_rows(model, r, torch.arange(r.completion_ids.shape[0]), packing="rows")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # a block freed while its copy to the host ran is released now
    held = torch.cuda.memory_allocated() - base  # what the forward keeps for the backward
    weights = torch.linspace(0.5, 1.5, scored.logps.numel(), device="cuda").view_as(scored.logps)
    (scored.logps * weights).sum().backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return scored.logps.detach(), grads, held


@cuda
@pytest.mark.parametrize("lora,checkpointing", [(False, True), (True, True), (False, False)])
def test_on_cuda_offloading_keeps_the_values_and_frees_the_layer_activations(lora, checkpointing):
    model = _long_model(lora, checkpointing)
    r = rollout(384, prompts=((64, 2),), lengths=(2048, 1500), width=2048)
    r = r.to("cuda")
    logps, grads, held = _long_step(model, r)
    offload_activations(model)
    off_logps, off_grads, off_held = _long_step(model, r)
    backbone = (model.get_base_model() if lora else model).model
    assert backbone._rlft_offloaded_bytes > 0
    torch.testing.assert_close(off_logps, logps, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(off_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    layer_input = (64 + 2048 + 1500) * 256 * 4  # one layer's input, float32 bytes
    assert held - off_held >= 3 * layer_input, (held, off_held)


@cuda
def test_on_cuda_a_step_with_offloading_is_the_same_step(tmp_path, tiny_causal_dir):
    plain, offloaded = one_step_each(tmp_path, tiny_causal_dir, "activation_offloading", (False, True))
    assert offloaded.accelerator.device.type == "cuda"
    assert not any("activation_offloading" in n for n in offloaded._setup_notes)
    assert offloaded.state.log_history[0]["loss"] == pytest.approx(plain.state.log_history[0]["loss"], abs=1e-6)
