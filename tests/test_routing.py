"""Routing replay (rlft/model/routing.py): the trainer routes each token of a Mixture-of-Experts
policy to the experts the sampler chose."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeTopKRouter

from rlft.config import ConfigError
from rlft.model import routing
from rlft.model.scoring import install_scoring, score_rows
from rlft.rollout.base import Rollout
from rlft.rollout.hf import HFGenerator
from rlft.tiny import build_causal_lm, build_near_tie_moe, build_tokenizer
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config
from tests.route_helpers import log_ratios


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(0)


def strong_experts_moe(tokenizer, arch: str, layers: int = 4):
    """A tiny MoE whose experts dominate its MLP output (weights N(0, 0.1)) and whose router is
    near-uniform (N(0, 0.005)), so that near-ties between experts are common: the case replay is for."""
    model = build_near_tie_moe(tokenizer, arch, num_layers=layers)
    install_scoring(model)
    return model


def sample(sampler, tokenizer, prompts=("hello world 1 2 3", "4 + 5 =", "7 7 7 7 7 7 7 7"), group=8):
    engine = HFGenerator(tokenizer, max_new_tokens=32)
    engine.return_logps = True  # the sampler's own log-prob of each token, read while sampling
    torch.manual_seed(0)
    return engine(sampler, [tokenizer(p)["input_ids"] for p in prompts], group)


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_replaying_a_bf16_samplers_routes_removes_the_mismatch_routing_causes(tokenizer, arch):
    """Sampled in bfloat16, scored in float32. Measured here: mean |log ratio| 0.0085 -> 0.0020
    (Qwen3-MoE) and 0.0072 -> 0.0022 (OLMoE), max 0.34 -> 0.011 and 0.36 -> 0.012; 1-2% of the
    (token, layer) choices differ."""
    trainer = strong_experts_moe(tokenizer, arch)
    sampler = copy.deepcopy(trainer).to(torch.bfloat16)
    routing.install(sampler)
    rollout = sample(sampler, tokenizer)
    state = routing.install(trainer)
    free, replayed = log_ratios(trainer, rollout, False).abs(), log_ratios(trainer, rollout, True).abs()
    agreement = state.take_agreement()
    assert 0.95 < agreement < 1.0  # some choices flip between bf16 and fp32
    assert replayed.mean() < free.mean() / 2.5
    assert replayed.max() < free.max() / 10
    assert replayed.max() < 0.05  # what is left is bfloat16's rounding, not a different expert


def test_at_qwen3_30b_a3bs_routing_replay_cuts_a_bf16_samplers_mean_log_ratio_over_5x(tokenizer):
    """128 experts, 8 per token (Qwen3-30B-A3B's routing), 2 layers: about 7% of the choices flip between
    a bfloat16 sampler and a float32 trainer, and replaying them leaves bfloat16's rounding only.
    Measured here (372 tokens): mean |log ratio| 0.0107 -> 0.0014 (7.5x), max 0.010 replayed."""
    trainer = build_near_tie_moe(tokenizer, "qwen3_moe", num_layers=2, experts=(128, 8))
    install_scoring(trainer)
    sampler = copy.deepcopy(trainer).to(torch.bfloat16)
    routing.install(sampler)
    rollout = sample(sampler, tokenizer, group=4)
    state = routing.install(trainer)
    free, replayed = log_ratios(trainer, rollout, False).abs(), log_ratios(trainer, rollout, True).abs()
    assert 0.8 < state.take_agreement() < 0.97
    assert replayed.mean() < free.mean() / 5
    assert replayed.max() < 0.05


def test_a_float32_sampler_and_trainer_route_alike(tokenizer):
    """The same precision on both sides: every replayed choice is the one the trainer makes itself,
    and the importance ratio is 1 +- 0.005."""
    trainer = strong_experts_moe(tokenizer, "qwen3_moe", layers=2)
    sampler = copy.deepcopy(trainer)
    routing.install(sampler)
    rollout = sample(sampler, tokenizer)
    state = routing.install(trainer)
    ratio = log_ratios(trainer, rollout, True).exp()
    assert state.take_agreement() == 1.0
    assert ratio.sub(1).abs().max() < 0.005


def test_the_recorded_routes_lay_out_prompts_and_completions_per_row(tokenizer):
    model = strong_experts_moe(tokenizer, "qwen3_moe", layers=2)
    routing.install(model)
    rollout = sample(model, tokenizer, group=4)
    rows, prompt_width, completion_width = rollout.completion_ids.shape[0], rollout.prompt_ids.shape[1], \
        rollout.completion_ids.shape[1]
    assert rollout.prompt_routes.shape == (rows, prompt_width, 2, 2)
    assert rollout.completion_routes.shape == (rows, completion_width, 2, 2)
    assert rollout.prompt_routes.dtype == torch.int16
    # every prompt position and every completion token fed back is recorded; the last is never fed
    assert (rollout.prompt_routes >= 0).all()
    assert (rollout.completion_routes[:, :-1] >= 0).all() and (rollout.completion_routes[:, -1] == -1).all()
    # each prompt was prefilled once for its group: its routes are the same in every copy
    real = rollout.prompt_mask.bool()
    for first in range(0, rows, 4):
        for copy_row in range(first + 1, first + 4):
            assert torch.equal(rollout.prompt_routes[copy_row][real[copy_row]],
                               rollout.prompt_routes[first][real[first]])
    # two experts per token, distinct, in range
    chosen = rollout.completion_routes[:, :-1]
    assert (chosen[..., 0] != chosen[..., 1]).all() and int(chosen.max()) < 8


def test_replay_gives_the_same_log_probs_padded_and_packed(tokenizer):
    """The routes follow the tokens through score_rows' padded layout and both packed layouts."""
    trainer = strong_experts_moe(tokenizer, "olmoe", layers=2)
    sampler = copy.deepcopy(trainer).to(torch.bfloat16)
    routing.install(sampler)
    rollout = sample(sampler, tokenizer, group=4)
    state = routing.install(trainer)
    padded = log_ratios(trainer, rollout, True)
    for packing in ("rows", "prompts"):
        torch.testing.assert_close(log_ratios(trainer, rollout, True, packing), padded, atol=1e-5, rtol=0)
    assert state.take_agreement() < 1.0


def test_a_replayed_router_weights_the_recorded_experts_by_its_current_softmax():
    """Against the definition, in float64: the chosen experts are the recorded ones (-1: the
    router's own), their weights softmax(logits) gathered there and renormalised, and the gradient
    reaches the router's weight; the logits (the load-balancing loss's input) are unchanged."""
    config = Qwen3MoeConfig(hidden_size=8, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(config).double()
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    state = routing.RouteState([router])
    routing.attach(router, 0, state)
    hidden = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    free_logits, free_scores, free_chosen = router(hidden)
    recorded = torch.tensor([[[4, 1]], [[-1, -1]], [[0, 5]]], dtype=torch.int16)  # [tokens, L, k]
    state.mode, state.routes, state.valid = "replay", recorded, torch.ones(3, dtype=torch.bool)
    logits, scores, chosen = router(hidden)
    assert torch.equal(logits, free_logits)
    assert chosen.tolist()[0] == [4, 1] and chosen.tolist()[2] == [0, 5]
    assert torch.equal(chosen[1], free_chosen[1]) and torch.equal(scores[1], free_scores[1])
    probs = torch.softmax(hidden @ router.weight.T, dim=-1)
    for token, experts in ((0, [4, 1]), (2, [0, 5])):
        want = probs[token, experts] / probs[token, experts].sum()
        torch.testing.assert_close(scores[token], want, atol=1e-15, rtol=0)
    # over the recorded tokens (0 and 2): whether the router would have chosen the same pair itself
    assert state.take_agreement() == pytest.approx(sum(
        sorted(free_chosen[t].tolist()) == sorted(chosen[t].tolist()) for t in (0, 2)) / 2)
    (scores * torch.arange(2.0, dtype=torch.float64)).sum().backward()  # (their sum is 1: no gradient)
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


GEMMA4_EXPERT_SCALE = torch.linspace(0.5, 2.0, 8)


def family_router(name: str, experts: int = 8, k: int = 2, hidden: int = 8):
    """A router of class `name` (transformers 5.24) with the attributes its forward reads, its weight random."""
    import importlib

    from transformers import models

    found = [path for path in Path(models.__path__[0]).glob("*/modeling_*.py")
             if f"class {name}(" in path.read_text()]
    module = importlib.import_module(f"transformers.models.{found[0].parent.name}.{found[0].stem}")
    router = getattr(module, name).__new__(getattr(module, name))
    torch.nn.Module.__init__(router)
    generator = torch.Generator().manual_seed(0)
    router.weight = torch.nn.Parameter(torch.randn(experts, hidden, generator=generator))
    router.bias = torch.nn.Parameter(torch.randn(experts, generator=generator))  # (gpt-oss's)
    router.e_score_correction_bias = torch.randn(experts, generator=generator)  # (DeepSeek-V3's: the choice only)
    router.top_k, router.num_experts, router.hidden_dim, router.routed_scaling_factor = k, experts, hidden, 2.5
    router.num_group, router.topk_group, router.norm_topk_prob, router.topk_method = 2, 1, True, "greedy"
    router.router_scaling_factor, router.use_expert_bias, router.norm_min = 2.5, True, 1e-12  # (HY-V3, LFM2, Ernie)
    router.moe_statics = lambda weights: weights + router.e_score_correction_bias  # (Ernie 4.5's choice bias)
    # (Phi-3.5-MoE's sparsemixer: experts within 2 x 0.4 of the largest logit, relatively, stay in play; its
    # eval-mode forward, whose values replay gives: in training mode it samples and rescales at random)
    router.router_jitter_noise, router.input_jitter_noise = 0.4, 0.0
    # (AFMoE's and Longcat-Flash's logits come from a linear layer of theirs; DeepSeek-V4's score function, its
    # hash router's token -> experts table)
    router.gate = router.classifier = torch.nn.Linear(hidden, experts, bias=False)
    router.route_scale, router.n_routed_experts, router.score_fn = 2.5, experts, torch.sigmoid
    router.tid2eid = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(64)])
    # (Gemma 4's: a normed, scaled input to its projection; k from its config; a scale per expert)
    router.norm, router.proj, router.scale, router.scalar_root_size = torch.nn.Identity(), router.gate, 1.0, 1.0
    router.config, router.per_expert_scale = SimpleNamespace(top_k_experts=k), GEMMA4_EXPERT_SCALE
    router.eval()
    return router


def call(router, hidden):
    """The router's forward; MiniMax-M2's, HY-V3's, LFM2-MoE's and AFMoE's take their block's choice bias too,
    DeepSeek-V4's hash router the token ids."""
    import inspect

    params = list(inspect.signature(router.forward).parameters)
    if "input_ids" in params:
        return router(hidden, torch.arange(hidden.shape[0]) * 7)
    hidden = hidden[None] if type(router).__name__ == "AfmoeTokenChoiceRouter" else hidden  # ([b, t, H])
    return router(hidden, router.e_score_correction_bias) if len(params) > 1 else router(hidden)


def renormalised(p, eps=0.0):
    return p / (p.sum(-1, keepdim=True) + eps)


def sparsemixer(z, chosen, eps=0.4):
    """Phi-3.5-MoE's weights at `chosen` (transformers' `sparsemixer`, eval mode): for each chosen expert in
    turn, the softmax over the logits not chosen before it that lie within 2 eps of the largest of them,
    relative to the larger of |logit| and that largest."""
    weights, rest = [], z
    for j in range(chosen.shape[-1]):
        top = rest.max(-1, keepdim=True).values
        near = (top - z) / torch.maximum(z.abs(), top) <= 2 * eps
        weights.append(torch.where(near, rest, float("-inf")).softmax(-1).gather(-1, chosen[:, j:j + 1]))
        rest = rest.scatter(-1, chosen[:, j:j + 1], float("-inf"))
    return torch.cat(weights, -1)


@pytest.mark.parametrize("name, definition", [
    ("Qwen3MoeTopKRouter", lambda z, chosen: (lambda p: p / p.sum(-1, keepdim=True))(z.softmax(-1).gather(-1, chosen))),
    ("DeepseekV3TopkRouter", lambda z, chosen: 2.5 * (lambda p: p / p.sum(-1, keepdim=True))(z.sigmoid().gather(-1, chosen))),
    ("DeepseekV2TopkRouter", lambda z, chosen: 2.5 * z.softmax(-1).gather(-1, chosen)),
    ("GptOssTopKRouter", lambda z, chosen: z.gather(-1, chosen).softmax(-1)),
    ("GraniteMoeTopKRouter", lambda z, chosen: z.gather(-1, chosen).softmax(-1)),
    ("AriaTextTopKRouter", lambda z, chosen: z.gather(-1, chosen).softmax(-1)),
    ("JambaTopKRouter", lambda z, chosen: z.softmax(-1).gather(-1, chosen)),
    ("Ernie4_5_MoeTopKRouter", lambda z, chosen: renormalised(z.softmax(-1).gather(-1, chosen))),
    ("Mistral4TopkRouter", lambda z, chosen: 2.5 * renormalised(z.softmax(-1).gather(-1, chosen))),
    ("MiniMaxM2TopKRouter", lambda z, chosen: renormalised(z.sigmoid().gather(-1, chosen))),
    ("HYV3TopKRouter", lambda z, chosen: 2.5 * renormalised(z.sigmoid().gather(-1, chosen))),
    ("Lfm2MoeTopKRouter", lambda z, chosen: 2.5 * renormalised(z.sigmoid().gather(-1, chosen), 1e-6)),
    ("Cohere2MoeTopKRouter", lambda z, chosen: z.gather(-1, chosen).softmax(-1)),
    ("Cohere2MoeTopKRouter:sigmoid", lambda z, chosen: renormalised(z.gather(-1, chosen).sigmoid())),
    ("PhimoeTopKRouter", sparsemixer),
    ("Step3p7TopKRouter", lambda z, chosen: renormalised(z.sigmoid().gather(-1, chosen))),
    ("LongcatFlashTopkRouter", lambda z, chosen: 2.5 * z.softmax(-1).gather(-1, chosen)),
    ("AfmoeTokenChoiceRouter", lambda z, chosen: 2.5 * renormalised(z.sigmoid().gather(-1, chosen), 1e-20)),
    ("DeepseekV4TopKRouter", lambda z, chosen: 2.5 * renormalised(z.sigmoid().gather(-1, chosen), 1e-20)),
    ("DeepseekV4HashRouter", lambda z, chosen: 2.5 * renormalised(z.sigmoid().gather(-1, chosen), 1e-20)),
    # (its first output is the softmax's probabilities)
    ("Gemma4TextRouter", lambda p, chosen: renormalised(p.gather(-1, chosen)) * GEMMA4_EXPERT_SCALE[chosen])])
def test_each_router_family_replays_its_own_choice_exactly_and_weights_a_recorded_one_by_its_definition(
        name, definition):
    """Replaying the router's own choice returns exactly the weights its forward computed (so the family's
    formula is that router's); a recorded choice it would not make gets the family's definition at it, with the
    logits unchanged and a gradient reaching the router's weight."""
    name, _, selection = name.partition(":")  # (Cohere2-MoE's two `expert_selection_fn`s)
    router = family_router(name)
    router.expert_selection_fn = selection or "softmax"
    state = routing.RouteState([router])
    routing.attach(router, 0, state)
    hidden = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    free_logits, free_scores, free_chosen = call(router, hidden)
    state.mode, state.routes = "replay", free_chosen[:, None].to(torch.int16)
    _, scores, chosen = call(router, hidden)
    assert torch.equal(chosen, free_chosen)
    torch.testing.assert_close(scores, free_scores, atol=1e-6, rtol=1e-6)
    other = torch.tensor([[6, 1]] * 5)
    state.routes = other[:, None].to(torch.int16)
    logits, scores, chosen = call(router, hidden)
    assert torch.equal(logits, free_logits) and torch.equal(chosen, other)
    torch.testing.assert_close(scores, definition(free_logits.float(), other), atol=1e-6, rtol=1e-6)
    (scores * torch.tensor([1.0, 3.0])).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in router.parameters())


@pytest.mark.parametrize("arch, bias_of", [
    ("deepseek_v3", lambda router: router.e_score_correction_bias),
    ("ernie4_5_moe", lambda router: router.moe_statics.e_score_correction_bias)])
def test_a_trainer_replaying_a_samplers_routes_scores_exactly_what_a_biased_sampler_sampled(tokenizer, arch, bias_of):
    """DeepSeek-V3's router chooses by sigmoid + `e_score_correction_bias` (load balancing without a loss), Ernie
    4.5's by softmax + its `moe_statics` bias; both weight without the bias. A sampler whose biases differ (the
    same weights otherwise) routes some tokens elsewhere; the trainer replaying its routes gives the sampler's
    log-probs (float32 both sides, one precision), routing freely it does not."""
    trainer = strong_experts_moe(tokenizer, arch, layers=2)
    sampler = copy.deepcopy(trainer)
    generator = torch.Generator().manual_seed(5)
    for router in routing.moe_routers(sampler):
        bias = bias_of(router)
        bias.copy_(0.02 * torch.randn(bias.shape, generator=generator))
    routing.install(sampler)
    rollout = sample(sampler, tokenizer, group=4)
    state = routing.install(trainer)
    free, replayed = log_ratios(trainer, rollout, False).abs(), log_ratios(trainer, rollout, True).abs()
    assert state.take_agreement() < 0.95  # the biases moved choices
    assert replayed.max() < 1e-5 < free.max()


def test_phi_moe_training_mode_samples_its_routes_and_replay_scores_what_its_eval_mode_sampler_sampled(tokenizer):
    """Phi-3.5-MoE's sparsemixer samples its experts in training mode (and rescales a weight by 1/3 at random), so
    a trainer routing freely scores other log-probs than its eval-mode sampler sampled with the same weights;
    replaying the sampler's routes, the trainer scores them exactly (float32 both sides)."""
    trainer = strong_experts_moe(tokenizer, "phimoe", layers=2)
    sampler = copy.deepcopy(trainer).eval()
    routing.install(sampler)
    rollout = sample(sampler, tokenizer, group=4)
    state = routing.install(trainer)
    trainer.train()
    torch.manual_seed(1)
    free, replayed = log_ratios(trainer, rollout, False).abs(), log_ratios(trainer, rollout, True).abs()
    assert state.take_agreement() < 1.0  # its sampled choice differs somewhere
    assert replayed.max() < 1e-5 and free.max() > 1e-2


def assert_replaying_its_own_routes_changes_nothing(tokenizer, arch: str) -> None:
    """A whole tiny MoE of `arch` records routes while its generate samples; replaying them, its trainer agrees
    with every choice and scores what routing freely scores."""
    model = strong_experts_moe(tokenizer, arch, layers=2)
    state = routing.install(model)
    rollout = sample(model, tokenizer, group=2)
    assert bool((rollout.completion_routes[rollout.completion_mask.bool()][:-1] >= 0).any())
    free, replayed = log_ratios(model, rollout, False), log_ratios(model, rollout, True)
    assert state.take_agreement() == 1.0
    torch.testing.assert_close(replayed, free, atol=1e-5, rtol=0)


def test_llama4s_router_replays_a_recorded_choice_as_its_dense_sigmoid_scores():
    """Llama 4's router returns (scores [tokens, experts], logits): the sigmoid of its top-k logits, 0 elsewhere.
    Replaying its own choice returns exactly its scores; a recorded other expert gets the sigmoid of that
    expert's logit and 0 elsewhere, the gradient reaching the router; the logits are unchanged. On a whole tiny
    Llama 4, replaying the routes its own generate recorded agrees with every choice and scores the same."""
    from types import SimpleNamespace

    from transformers.models.llama4.modeling_llama4 import Llama4Router

    torch.manual_seed(0)
    router = Llama4Router(SimpleNamespace(hidden_size=8, num_local_experts=4, num_experts_per_tok=1))
    state = routing.RouteState([router])
    routing.attach(router, 0, state)
    hidden = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    free_scores, free_logits = router(hidden)
    own = free_logits.topk(1, dim=1).indices
    state.mode, state.routes = "replay", own[:, None].to(torch.int16)
    assert torch.equal(router(hidden)[0], free_scores)
    other = (own + 1) % 4
    state.routes = other[:, None].to(torch.int16)
    scores, logits = router(hidden)
    want = torch.zeros_like(free_logits).scatter(1, other, free_logits.gather(1, other).sigmoid())
    assert torch.equal(logits, free_logits)
    torch.testing.assert_close(scores, want, atol=1e-7, rtol=0)
    scores.sum().backward()
    assert router.weight.grad.abs().sum() > 0

    from rlft.tiny import build_tokenizer

    assert_replaying_its_own_routes_changes_nothing(build_tokenizer(0), "llama4")


def test_dbrxs_block_chooses_for_its_router_and_replays_a_recorded_choice_by_its_definition(tokenizer):
    """DBRX's router returns only its logits; its FFN block chooses (`route_tokens_to_experts`: softmax, top-k,
    the weights over their L1 norm), so the block is hooked as the router. Replaying its own choice returns
    exactly its weights; a recorded other choice gets softmax(logits) there over their L1 norm, the gradient
    reaching the router. A whole tiny DBRX replaying the routes its own generate recorded agrees with every
    choice and scores the same."""
    from transformers.models.dbrx.configuration_dbrx import DbrxFFNConfig
    from transformers.models.dbrx.modeling_dbrx import DbrxFFN

    torch.manual_seed(0)
    block = DbrxFFN(SimpleNamespace(ffn_config=DbrxFFNConfig(hidden_size=8, ffn_hidden_size=8, moe_num_experts=8,
                                                              moe_top_k=2)))
    state = routing.RouteState([block])
    routing.attach(block, 0, state)
    logits = block.router(torch.randn(5, 8, generator=torch.Generator().manual_seed(1)))
    free_weights, free_chosen = block.route_tokens_to_experts(logits)
    state.mode, state.routes = "replay", free_chosen[:, None].to(torch.int16)
    weights, chosen = block.route_tokens_to_experts(logits)
    assert torch.equal(chosen, free_chosen)
    torch.testing.assert_close(weights, free_weights, atol=1e-7, rtol=0)
    other = torch.tensor([[6, 1]] * 5)
    state.routes = other[:, None].to(torch.int16)
    weights, chosen = block.route_tokens_to_experts(logits)
    top = logits.softmax(-1).gather(-1, other)
    assert torch.equal(chosen, other)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True), atol=1e-7, rtol=0)
    (weights * torch.tensor([1.0, 3.0])).sum().backward()
    assert block.router.layer.weight.grad.abs().sum() > 0

    assert_replaying_its_own_routes_changes_nothing(tokenizer, "dbrx")


def test_every_replayed_router_class_has_its_familys_forward():
    """Each class `REPLAY_WEIGHTS` names has the same forward source as its family's tested representative
    (above), class names aside: a transformers release that changes one makes this fail instead of replaying it
    wrongly."""
    import re

    from transformers import models

    sources = {}
    for path in Path(models.__path__[0]).glob("*/modeling_*.py"):
        text = path.read_text()
        for match in re.finditer(r"^class (\w+Router)\(.*?(?=^class |\Z)", text, re.M | re.S):
            body = re.search(r"    def forward\(.*?(?=^    def |^\S|\Z)", match.group(0), re.M | re.S)
            sources[match.group(1)] = re.sub(r"\s+|#[^\n]*", " ", body.group(0)) if body else None
    representative = {routing.REPLAY_WEIGHTS[name]: name for name in (
        "Qwen3MoeTopKRouter", "DeepseekV3TopkRouter", "DeepseekV2TopkRouter", "GraniteMoeTopKRouter",
        "JambaTopKRouter", "Ernie4_5_MoeTopKRouter", "Mistral4TopkRouter", "MiniMaxM2TopKRouter", "HYV3TopKRouter",
        "Lfm2MoeTopKRouter", "Cohere2MoeTopKRouter", "PhimoeTopKRouter", "AfmoeTokenChoiceRouter",
        "DeepseekV4TopKRouter", "Gemma4TextRouter")}
    allowed = {"Qwen3MoeTopKRouter": {"Qwen3_5MoeTopKRouter", "Qwen3OmniMoeTextTopKRouter", "Qwen3VLMoeTextTopKRouter",
                                      "MixtralTopKRouter", "MiniMaxTopKRouter"},  # (always renormalise)
               "GraniteMoeTopKRouter": {"GptOssTopKRouter", "AriaTextTopKRouter"},  # (each tested above on its own)
               "MiniMaxM2TopKRouter": {"Step3p7TopKRouter"}, "DeepseekV2TopkRouter": {"LongcatFlashTopkRouter"},
               "DeepseekV4TopKRouter": {"DeepseekV4HashRouter"}}
    found = [name for name in routing.REPLAY_WEIGHTS if name in sources]  # (a newer transformers may drop some)
    assert len(found) >= 42 and all(sources[name] for name in representative.values())  # the scan read them
    for name, how in routing.REPLAY_WEIGHTS.items():
        if name not in sources:
            continue  # not in this transformers
        base = representative[how]
        assert sources[name] == sources[base] or name in allowed.get(base, ()), name


def test_routes_travel_with_their_rows_through_cat_select_and_checkpoint_tensors(tokenizer):
    model = strong_experts_moe(tokenizer, "qwen3_moe", layers=2)
    routing.install(model)
    short = sample(model, tokenizer, prompts=("4 + 5 =",), group=2)
    long = sample(model, tokenizer, prompts=("hello world 1 2 3 4 5 6",), group=2)
    both = Rollout.cat([short, long], pad_token_id=tokenizer.pad_token_id)
    assert both.prompt_routes.shape[1] == both.prompt_ids.shape[1]
    shift = both.prompt_ids.shape[1] - short.prompt_ids.shape[1]
    assert (both.prompt_routes[:2, :shift] == -1).all()  # left-padded like the prompts
    assert torch.equal(both.prompt_routes[:2, shift:], short.prompt_routes)
    assert torch.equal(both.select([3, 2]).completion_routes[1], long.completion_routes[0,
                                                                                      :both.completion_ids.shape[1]])
    saved = Rollout.from_tensors(both.tensors())
    assert torch.equal(saved.prompt_routes, both.prompt_routes)
    assert torch.equal(saved.completion_routes, both.completion_routes)


def test_a_dense_policy_records_nothing_and_refuses_an_explicit_replay(tmp_path, tokenizer):
    from rlft import GRPOTrainer

    dense = build_causal_lm(tokenizer, hidden_size=64)
    trainer = GRPOTrainer(dense, [correct_answer], tiny_grpo_config(tmp_path, max_steps=1), addition_rows(8),
                          processing_class=tokenizer)
    assert routing.route_state(trainer.model) is None
    with pytest.raises(ConfigError, match="routing_replay='rollout'.*no Mixture-of-Experts router"):
        GRPOTrainer(build_causal_lm(tokenizer, hidden_size=64), [correct_answer],
                    tiny_grpo_config(tmp_path, max_steps=1, routing_replay="rollout"), addition_rows(8),
                    processing_class=tokenizer)


def test_an_engine_that_records_no_routes_refuses_an_explicit_replay_and_auto_says_so():
    model = build_causal_lm(build_tokenizer(0), arch="qwen3_moe", hidden_size=64)
    with pytest.raises(ConfigError, match="needs routes recorded by the rollout engine"):
        routing.resolve("rollout", model, engine_records=False)
    replays, note = routing.resolve("auto", model, engine_records=False)
    assert not replays and "routing replay is off" in note
    assert routing.resolve("auto", model, engine_records=True) == (True, None)
    assert routing.resolve("none", model, engine_records=True) == (False, None)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rlft.tiny import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", hidden_size=64)


def test_grpo_on_a_moe_policy_replays_the_routes_of_its_own_rollouts(tmp_path, moe_dir):
    """routing_replay auto: the policy's routers are patched, every rollout carries its routes, and
    each step logs how many replayed choices the trainer's router agreed with (all: one precision)."""
    from rlft import GRPOTrainer

    trainer = GRPOTrainer(str(moe_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=2),
                          addition_rows(16))
    assert routing.route_state(trainer.model) is not None
    batch = trainer._make_rollout(0)
    assert batch.rollout.completion_routes is not None and batch.rollout.prompt_routes is not None
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["sampling/route_agreement"] for r in rows] == [1.0, 1.0]
    assert [r["sampling/routes_recorded"] for r in rows] == [1.0, 1.0]  # every fed token's route
    off = GRPOTrainer(str(moe_dir), [correct_answer],
                      tiny_grpo_config(tmp_path / "off", max_steps=1, routing_replay="none"), addition_rows(16))
    assert routing.route_state(off.model) is None and off._make_rollout(0).rollout.completion_routes is None


def test_a_resume_inside_a_generation_batch_replays_the_saved_routes(tmp_path, moe_dir):
    """Rollouts feed two steps each, so checkpoint-3 holds half a rollout: its routes are saved with
    it and replayed after the resume (the resumed run logs route agreement at step 4 as the straight
    run does, and every logged number and weight is the same). Full fine-tuning: the checkpoint holds
    the experts as save_pretrained writes them (one expert at a time) and the resume reads them back
    into the model's fused tensors."""
    from tests.test_grpo_resume import straight_and_resumed

    straight, _ = straight_and_resumed(tmp_path, moe_dir, full=True, steps_per_generation=2, num_iterations=1)
    assert all("sampling/route_agreement" in r for r in straight.state.log_history if "loss" in r)


def test_checkpointed_layers_recompute_with_the_replayed_routes(tmp_path, moe_dir):
    """Gradient checkpointing reruns each layer's forward in the backward pass: it must route as the
    forward did. One float64 SGD step on rollouts replaying random routes, in micro-batches of 2, with
    and without checkpointing: the same weights (tests/helpers.py: SAME_STEP)."""
    from rlft import GRPOConfig, GRPOTrainer
    from tests.dist.grpo_step import EAGER_EXPERTS, FixedGenerator, off_policy, token_sum_reward
    from tests.helpers import SAME_STEP, assert_params_close

    params = {}
    for checkpointing in (False, True):
        cfg = GRPOConfig(output_dir=str(tmp_path / str(checkpointing)), optim="sgd", learning_rate=1.0,
                         max_grad_norm=1e9, seed=0, num_generations=4, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, max_steps=1, max_completion_length=8, report_to=["none"],
                         disable_tqdm=True, router_aux_loss_coef=0.0, gradient_checkpointing=checkpointing,
                         model_init_kwargs={"dtype": "float64", **EAGER_EXPERTS}, padding_free=False)
        trainer = GRPOTrainer(str(moe_dir), [token_sum_reward], cfg, addition_rows(1))
        trainer.generator = FixedGenerator(trainer.tokenizer, routes=True)
        batch = trainer._make_rollout(0)
        off_policy(trainer, batch)
        metrics = trainer.updater.step(batch)
        assert metrics["sampling/route_agreement"] < 0.5  # the random routes, not the router's own
        params[checkpointing] = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    assert_params_close(params[True], params[False], SAME_STEP, "checkpointing")


@pytest.mark.parametrize("partial", [0, 1, "throughput"])
def test_the_async_producer_records_the_routes_it_samples_and_a_resume_replays_the_saved_ones(tmp_path, moe_dir,
                                                                                              partial):
    """AsyncGRPOTrainer: the producer process records its rollouts' routes and hands them over in a file; the
    trainer replays them, and a checkpoint holding rollouts requested ahead keeps their routes (the resumed run
    logs the same rows, route agreement included). With partial rollouts a completion carried across the
    producer's windows keeps each token's route from the window that first read it (the pool carries them, in
    checkpoints too), and the trainer agrees with them in one precision. In the throughput mode (in-flight updates)
    cut rows go on from their kept KV caches (rlft/rollout/kv_carry.py) and the agreement holds; its resume is
    not an uninterrupted run's (docs/async.md), so it is not compared."""
    from tests.helpers import has_answer_tags, stop_after
    from tests.test_async_grpo import async_config, rows_of, trained

    # (partial: the weights held still (a 1e-20 step changes no float32 weight), so a stale route cannot lower
    # the agreement; a misplaced one would)
    look = dict(partial_rollouts=1, max_staleness=2, max_completion_length=24, learning_rate=1e-20) if partial else {}
    if partial == "throughput":
        look["inflight_weight_updates"] = True
    straight = trained(tmp_path, "straight", model=moe_dir, max_steps=3, save_steps=2, **look)
    rows = [r for r in rows_of(tmp_path / "straight") if "loss" in r]
    assert len(rows) == 3 and all("sampling/route_agreement" in r for r in rows)
    assert routing.route_state(straight.model) is not None
    assert all(r["sampling/routes_recorded"] == 1.0 for r in rows)
    if partial:
        assert all(r["sampling/route_agreement"] >= 0.999 for r in rows), rows
        assert any(r["partial/carried_share"] > 0 for r in rows)  # completions did cross windows
    if partial == "throughput":  # (went on from kept caches: no carried token prefilled again)
        assert all(r["partial/reprefill_tokens"] == r["partial/advance_reprefill_tokens"] == 0 for r in rows)
        assert sum(r["partial/advance_steps"] for r in rows) > 0
        return
    from rlft import AsyncGRPOTrainer

    AsyncGRPOTrainer(str(moe_dir), [correct_answer, has_answer_tags],
                     async_config(tmp_path, "split", max_steps=3, save_steps=2, **look),
                     addition_rows(32), callbacks=[stop_after(2)]).train()
    trained(tmp_path, "split", model=moe_dir, max_steps=3, save_steps=2, resume=True, **look)
    assert rows_of(tmp_path / "straight") == rows_of(tmp_path / "split")


def test_a_deep_copy_of_a_replaying_model_routes_with_its_own_weights_and_its_own_state(tokenizer):
    """A frozen reference is a deep copy of the policy made after routing was installed: it must route by
    its own router weights (not the policy's, which train) and record / replay on a state of its own."""
    policy = strong_experts_moe(tokenizer, "qwen3_moe", layers=2)
    routing.install(policy)
    rollout = sample(policy, tokenizer, group=2)
    reference = copy.deepcopy(policy)
    assert routing.route_state(reference) is not routing.route_state(policy)
    free = copy.copy(rollout)
    free.prompt_routes = free.completion_routes = None
    with torch.no_grad():
        before = score_rows(reference, free, slice(None)).logps
        for router in routing.moe_routers(policy):  # the policy's routers move
            router.weight.add_(torch.randn_like(router.weight))
        torch.testing.assert_close(score_rows(reference, free, slice(None)).logps, before, atol=0, rtol=0)
        replayed = score_rows(reference, rollout, slice(None)).logps  # the recorded routes, on the copy
    assert routing.route_state(reference).mode == "replay" and routing.route_state(policy).mode != "replay"
    torch.testing.assert_close(replayed, before, atol=1e-5, rtol=0)  # its own routes: one precision


def test_a_forward_nobody_armed_routes_freely_after_a_replayed_one(tokenizer):
    """Replay stays set after a scoring forward (checkpointed layers recompute with it), but only the
    forward `replay` armed, of the shape it armed, replays: a later generate outside the rollout engine (a
    completions callback, beams) routes freely instead of reading another batch's routes."""
    model = strong_experts_moe(tokenizer, "qwen3_moe", layers=2)
    state = routing.install(model)
    rollout = sample(model, tokenizer, group=2)
    score_rows(model, rollout, slice(None))
    assert state.mode == "replay" and state.armed is None  # consumed by its forward
    prompt = torch.tensor([tokenizer("4 + 5 =")["input_ids"]])
    with torch.no_grad():
        model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)  # raised before: 30 vs 28 tokens
    assert state.mode == "free"
    HFGenerator(tokenizer, max_new_tokens=4, generation_kwargs={"num_beams": 2})(model, [prompt[0].tolist()], 2)
    assert state.mode == "free"


def calculator_moe(tmp_path):
    """The shipped calculator policy upcycled to a Mixture of Experts, saved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlft.model.loading import shipped_policy_path
    from rlft.tiny import save_tiny, upcycle_to_moe

    dense = shipped_policy_path("tiny-calculator")
    return save_tiny(upcycle_to_moe(AutoModelForCausalLM.from_pretrained(dense)),
                     AutoTokenizer.from_pretrained(dense), tmp_path / "calculator-moe")


@pytest.mark.parametrize("partial", [0, 1, "throughput"])
def test_async_tool_rollouts_carry_the_producers_routes_and_the_trainer_agrees_with_every_one(tmp_path, partial):
    """AsyncGRPOTrainer with tools: each turn is a request to the producer process, whose routes come back with
    it, and the tool loop keeps each token's route from the forward that first read it, as in the synchronous
    trainer. With the weights held still (a 1e-20 step) the trainer, in its own process, agrees with every
    replayed choice (one precision), which it would not if a turn's routes sat one position off. With partial
    rollouts the driver's pool does the same across windows (rows cut mid-turn, carried to the next rollout); in
    the throughput mode a turn cut by a window goes on from its kept KV cache."""
    from rlft import AsyncGRPOTrainer
    from rlft.data import calculator
    from rlft.data.addition import split_problems
    from tests.test_async_grpo import async_config, rows_of

    AsyncGRPOTrainer(str(calculator_moe(tmp_path)), [calculator.answer_reward],
                     async_config(tmp_path, "run", max_steps=2, max_completion_length=64, learning_rate=1e-20,
                                  producer_threads=1, partial_rollouts=int(bool(partial)),
                                  max_staleness=1 + int(bool(partial)),
                                  inflight_weight_updates=partial == "throughput"),
                     calculator.rows(split_problems()[0][:16]), tools=calculator.TOOLS).train()
    rows = [r for r in rows_of(tmp_path / "run") if "loss" in r]
    assert len(rows) == 2 and rows[0]["tools/producer_requests"] >= 2  # tool turns (windows)
    if partial:
        assert rows[1]["partial/carried_share"] > 0
    if partial == "throughput":  # (cut turns went on from their caches)
        assert sum(r["partial/continued_rows"] for r in rows) > 0
    assert [r["sampling/route_agreement"] for r in rows] == [1.0, 1.0]
    assert [r["sampling/routes_recorded"] for r in rows] == [1.0, 1.0]


def test_tool_rollouts_carry_each_tokens_route_and_the_trainer_replays_them(tmp_path):
    """Multi-turn rollouts (the tool loop): every token the sampler read has its route, from the forward that
    first read it (a turn's decoding, or the next turn's prompt for a turn's last token and the tool's
    output); only each row's final token, never read, routes freely. One precision on both sides: the trainer's
    router agrees with every replayed choice, which it would not if a route sat one position off."""

    from rlft import GRPOTrainer
    from rlft.data import calculator
    from rlft.data.addition import split_problems

    cfg = tiny_grpo_config(tmp_path, max_steps=1, max_completion_length=64, per_device_train_batch_size=8)
    trainer = GRPOTrainer(str(calculator_moe(tmp_path)), [calculator.answer_reward], cfg,
                          calculator.rows(split_problems()[0][:16]), tools=calculator.TOOLS)
    rollout = trainer._make_rollout(0).rollout
    assert rollout.stats["tool_calls"].sum() > 0 and (rollout.tool_mask == 0).logical_and(
        rollout.completion_mask.bool()).any()  # tool output inside the completions
    inside = rollout.completion_mask.bool()
    read = inside.clone()
    read[torch.arange(read.shape[0]), inside.sum(1) - 1] = False  # each row's final token may not be read
    recorded = (rollout.completion_routes >= 0).all(dim=(-1, -2))
    assert recorded[read].all() and not recorded[~inside].any()
    assert (rollout.completion_routes >= 0).all(dim=(-1, -2)).eq((rollout.completion_routes >= 0).any(
        dim=(-1, -2))).all()  # a token's route is whole or absent
    trainer.train()
    assert [r["sampling/route_agreement"] for r in trainer.state.log_history if "loss" in r] == [1.0]


def test_a_sampler_that_reports_too_few_routes_is_measured_and_warned_about_once(tokenizer, caplog):
    """sampling/routes_recorded: the share of completion tokens the sampler fed (all but each row's last)
    whose route it reported. A vLLM engine replaying CUDA graphs skips rlft's recorder; the run then says
    so once, naming the fix, instead of routing those tokens freely in silence."""
    from rlft.train.update.metrics import route_metrics

    model = build_near_tie_moe(tokenizer, "qwen3_moe", num_layers=2)
    routing.install(model)
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])  # 3 + 4 fed tokens
    routes = torch.zeros(2, 5, 2, 2, dtype=torch.int16)
    routes[:, -1] = -1  # (a last token: never fed, never counted)
    whole = SimpleNamespace(completion_mask=mask, completion_routes=routes)
    assert route_metrics(model, accelerator, whole) == {"sampling/routes_recorded": 1.0}
    routes = routes.clone()
    routes[1, 1:3] = -1  # decode steps the recorder never saw
    short = SimpleNamespace(completion_mask=mask, completion_routes=routes)
    with caplog.at_level("WARNING", logger="rlft"):
        assert route_metrics(model, accelerator, short) == {"sampling/routes_recorded": 5 / 7}
        route_metrics(model, accelerator, short)
    said = [r.getMessage() for r in caplog.records if "reported routes for" in r.getMessage()]
    assert len(said) == 1 and "71.4%" in said[0] and "vllm_enforce_eager" in said[0]
