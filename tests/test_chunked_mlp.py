"""`mlp_chunk_size` (rlft/model/memory/chunked_mlp.py): each decoder layer's MLP over a few positions at a time in
training forwards; log-probs and gradients are the unchunked ones (padded and packed, LoRA and full, with
and without gradient checkpointing), a GRPO step is the same step, a MoE block is refused by name."""

from __future__ import annotations

import pytest
import torch

from rlft.errors import ConfigError
from rlft.model.memory.chunked_mlp import chunk_mlps
from rlft.model.scoring import score_rows
from rlft.tiny import build_causal_lm, build_tokenizer
from tests.helpers import assert_same_step, one_step_each, tiny_grpo_config
from tests.test_packing import rollout, scores_and_grads, tiny


@pytest.mark.parametrize("arch,lora,checkpointing", [("qwen2", False, True), ("llama", True, False),
                                                     ("llama", False, True), ("qwen2", True, False)])
@pytest.mark.parametrize("packing", [None, "prompts"])
def test_chunked_scores_and_gradients_are_the_whole_ones(arch, lora, checkpointing, packing):
    model = tiny(arch, lora, checkpointing)
    r = rollout(384)
    logps, entropy, grads = scores_and_grads(model, r, packing)
    seen = []
    layer = model.get_base_model() if lora else model
    mlp = layer.model.layers[0].mlp
    hook = mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[-2]))
    assert chunk_mlps(model, 3) == len(layer.model.layers)
    chunked_logps, chunked_entropy, chunked_grads = scores_and_grads(model, r, packing)
    hook.remove()
    assert max(seen) == 3 and len(seen) > 2  # the MLP saw at most 3 positions at a time
    torch.testing.assert_close(chunked_logps, logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_entropy, entropy, atol=1e-5, rtol=1e-5)
    assert grads.keys() == chunked_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():  # a forward without gradient runs whole
        seen.clear()
        hook = mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[-2]))
        score_rows(model, r, torch.arange(5))
        hook.remove()
        assert max(seen) > 3


def test_a_grpo_step_with_chunked_mlps_is_the_same_step(tmp_path, tiny_causal_dir):
    assert_same_step(*one_step_each(tmp_path, tiny_causal_dir, "mlp_chunk_size", (None, 4)))


def test_a_deep_copy_such_as_a_reference_runs_its_own_weights():
    import copy

    model = build_causal_lm(build_tokenizer(0, vocab_size=384), arch="qwen2", hidden_size=64)
    chunk_mlps(model, 2)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied.model.layers[0].mlp.parameters():
            p.zero_()
    hidden = torch.randn(1, 5, 64, requires_grad=True)
    assert not torch.allclose(copied.model.layers[0].mlp(hidden), model.model.layers[0].mlp(hidden))
    assert torch.count_nonzero(copied.model.layers[0].mlp(hidden)) == 0


def test_a_moe_block_and_a_bad_size_are_refused_by_name(tmp_path):
    moe = build_causal_lm(build_tokenizer(0, vocab_size=384), arch="qwen2_moe", hidden_size=64)
    with pytest.raises(ConfigError, match="Mixture-of-Experts"):
        chunk_mlps(moe, 16)
    with pytest.raises(ConfigError, match="mlp_chunk_size=0"):
        tiny_grpo_config(tmp_path, mlp_chunk_size=0)


def _count_forwards(model):
    """{'gate': n, 'down': n} forward calls of every layer's MLP projections, and the dtypes gate returned."""
    calls, dtypes = {"gate": 0, "down": 0}, []
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in inner.model.layers:
        def gate(module, args, out):
            calls["gate"] += 1
            dtypes.append(out.dtype)

        layer.mlp.gate_proj.register_forward_hook(gate)
        layer.mlp.down_proj.register_forward_hook(lambda *a: calls.__setitem__("down", calls["down"] + 1))
    return calls, dtypes


@pytest.mark.parametrize("lora", [False, True])
def test_a_checkpointed_layers_recomputation_stops_before_the_chunked_mlp(lora):
    """The layer's recomputation ends at the MLP's input (nothing after the MLP saves a tensor), so each
    chunk's MLP runs twice in all: the forward and the chunk's own recomputation, as unchunked. A plain
    down projection (full fine-tuning) is not run again at all: its backward is written out."""
    model = tiny("qwen2", lora, True)
    r = rollout(384)
    chunk_mlps(model, 4)
    calls, _ = _count_forwards(model)
    scored = score_rows(model, r, torch.arange(5), packing="rows")
    tokens, layers = scored.tokens, len((model.get_base_model() if lora else model).model.layers)
    chunks = -(-tokens // 4)
    assert chunks > 2 and calls == {"gate": chunks * layers, "down": chunks * layers}
    scored.logps.sum().backward()
    assert calls == {"gate": 2 * chunks * layers, "down": (2 if lora else 1) * chunks * layers}


def test_a_down_projection_with_a_bias_gets_its_gradients_written_out():
    from transformers import AutoModelForCausalLM

    from rlft.model.scoring import install_scoring
    from rlft.tiny import _config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("llama", build_tokenizer(0, vocab_size=384), 64, 2,
                                                     mlp_bias=True))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    install_scoring(model)
    r = rollout(384)
    _, _, grads = scores_and_grads(model, r, "rows")
    chunk_mlps(model, 3)
    _, _, chunked_grads = scores_and_grads(model, r, "rows")
    assert "model.layers.0.mlp.down_proj.bias" in chunked_grads
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_layer_that_normalises_the_mlps_output_recomputes_it_and_is_exact():
    """Gemma 2's post-feed-forward norm saves the MLP's output, so the layer's recomputation runs the
    chunks too; values and gradients stay the unchunked ones."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from rlft.model.scoring import install_scoring

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=384, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=32, max_position_embeddings=64, attn_implementation="eager"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    install_scoring(model)
    r = rollout(384)
    logps, entropy, grads = scores_and_grads(model, r, None)
    chunk_mlps(model, 3)
    chunked_logps, chunked_entropy, chunked_grads = scores_and_grads(model, r, None)
    torch.testing.assert_close(chunked_logps, logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_entropy, entropy, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_an_mlp_whose_input_takes_no_gradient_still_trains_its_adapters():
    """LoRA on the MLP alone: the first layer's MLP input takes no gradient, its adapters do."""
    from peft import LoraConfig, get_peft_model

    from rlft.model.scoring import install_scoring

    model = build_causal_lm(build_tokenizer(0, vocab_size=384), arch="llama", hidden_size=64)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj",
                                                                                "down_proj"]))
    install_scoring(model)
    with torch.no_grad():  # B = 0 at initialisation: make the adapters do something
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    r = rollout(384)
    _, _, grads = scores_and_grads(model, r, None)
    chunk_mlps(model, 3)
    _, _, chunked_grads = scores_and_grads(model, r, None)
    assert grads.keys() == chunked_grads.keys() and any("layers.0.mlp" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_backward_recomputes_under_the_forwards_autocast():
    model = tiny("qwen2", False, True)
    r = rollout(384)
    chunk_mlps(model, 4)
    calls, dtypes = _count_forwards(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scored = score_rows(model, r, torch.arange(5), packing="rows")
    forward = len(dtypes)
    scored.logps.float().sum().backward()
    assert len(dtypes) == 2 * forward and set(dtypes) == {torch.bfloat16}


def test_an_mlp_with_dropout_is_refused():
    model = build_causal_lm(build_tokenizer(0, vocab_size=384), arch="llama", hidden_size=64)
    model.model.layers[1].mlp.dropout = torch.nn.Dropout(0.1)
    with pytest.raises(ConfigError, match="dropout"):
        chunk_mlps(model, 4)


def test_only_the_down_projections_training_still_get_their_gradients():
    """Full fine-tuning of the down projections alone: the chunk's recomputation stops at their input, which
    takes no gradient; their own gradients are written out."""
    model = tiny("llama", False, False)  # (checkpointing would make every layer's input take a gradient)
    for name, p in model.named_parameters():
        p.requires_grad_("down_proj" in name)
    r = rollout(384)
    _, _, grads = scores_and_grads(model, r, "rows")
    chunk_mlps(model, 3)
    _, _, chunked_grads = scores_and_grads(model, r, "rows")
    assert grads.keys() == chunked_grads.keys() and all("down_proj" in n for n in grads) and grads
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_gpt2_style_layers_under_h_are_chunked_and_exact():
    """GPT-2's layout (transformer.h[i].mlp, Conv1D projections): found and chunked, values and gradients the
    unchunked ones; its default MLP dropout is refused by name, not as a model without layers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=384, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    with pytest.raises(ConfigError, match="GPT2MLP has dropout"):
        chunk_mlps(GPT2LMHeadModel(config), 4)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).double()
    ids = torch.randint(0, 384, (2, 11))

    def run():
        model.zero_grad()
        logits = model(input_ids=ids).logits
        (logits.square().mean()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = run()
    assert chunk_mlps(model, 4) == 2
    got, grads = run()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=1e-12, msg=name)
