"""Build the tiny, real models and tokenizers that rlft's demos and tests use.

Everything here is a genuine Hugging Face artefact: a BPE tokenizer trained with the
`tokenizers` library (Qwen2's pre-tokenizer pipeline, so it survives a save/load round trip
through `AutoTokenizer`), and Qwen2 / Llama models built from a config. They are saved with
`save_pretrained` and loaded with the Auto classes, exactly like a model from the hub.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

# Qwen2's split regex: every digit is its own pre-token, so numbers tokenize digit by digit.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
ANSWER_TOKENS = ["<answer>", "</answer>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] "
    "}}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML with tools (Hermes / Qwen2.5 tool-call format): the tools listed in a system turn by name
# and arguments, each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, results in
# 'tool' turns.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}"
    "({{ tool.function.parameters.properties | join(', ') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}"
    "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "the a an is of to and in that it for you what answer question assistant user system helpful "
    "good bad better worse correct wrong number sum plus minus think step reward model policy "
    "response chosen rejected please write short long sentence summary kind polite rude yes no"
).split()


def _tokenizer_corpus(seed: int, lines: int = 2000, tools: bool = False) -> list[str]:
    rng = random.Random(seed)
    corpus = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        corpus.append(f"What is {a}+{b}? {words.capitalize()}. The answer is {a + b}!")
        if tools:
            corpus.append(f'Tools: add(a, b)\n{{"name": "add", "arguments": {{"a": {a}, "b": '
                          f'{b}}}}}\ntool\n{a + b}')
    return corpus


def build_tokenizer(seed: int = 0, vocab_size: int = 384, tools: bool = False,
                    tag_tokens: bool = True) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with Qwen2's normalizer and pre-tokenizer.

    Special tokens: `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos); `<answer>` and
    `</answer>` are single added tokens. The chat template is ChatML, like Qwen2's. With `tools`
    the corpus also holds tool calls, `<tool_call>` / `</tool_call>` are added tokens and the chat
    template renders tools, tool calls and tool messages (Hermes format).
    Padding is on the left, as generation wants it. `tag_tokens` False: `<answer>` / `</answer>` are
    left to BPE (several tokens each): another family's cut of the same completions (a teacher for
    cross-tokenizer distillation, rlft/core/uld.py).
    """
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(seed, tools=tools), trainer)
    tok.add_tokens((ANSWER_TOKENS if tag_tokens else []) + (TOOL_TOKENS if tools else []))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        chat_template=TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE,
        model_max_length=512,
    )


def _config(arch: str, tokenizer, hidden_size: int, num_layers: int, **extra):
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=max(hidden_size // 32, 1),
        num_key_value_heads=max(hidden_size // 64, 1),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        **extra,
    )
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    return _moe_config(arch, common, hidden_size)


def _moe_config(arch: str, common: dict, hidden_size: int):
    """The Mixture-of-Experts architectures of `_config`."""
    # a Mixture-of-Experts policy: 4 experts, 2 per token, a router load-balancing loss
    if arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=hidden_size, shared_expert_intermediate_size=hidden_size,
                              router_aux_loss_coef=0.01)
    # Mixture-of-Experts policies with 8 experts, 2 per token (routing replay's tests)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=hidden_size, norm_topk_prob=True,
                              head_dim=hidden_size // common["num_attention_heads"],
                              router_aux_loss_coef=0.01)
    if arch == "olmoe":
        from transformers import OlmoeConfig

        return OlmoeConfig(**common, num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.01)
    # DeepSeek-V3's sigmoid router: bias-corrected choice within the best group of two, weights scaled
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config

        heads = common["num_attention_heads"]
        return DeepseekV3Config(**{**common, "num_key_value_heads": heads}, n_routed_experts=8,
                                num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                moe_intermediate_size=hidden_size, first_k_dense_replace=0, q_lora_rank=None,
                                kv_lora_rank=hidden_size // 2, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                v_head_dim=32, routed_scaling_factor=2.5, norm_topk_prob=True)
    return _other_moe_config(arch, common, hidden_size)


def _other_moe_config(arch: str, common: dict, hidden_size: int):
    """The Mixture-of-Experts architectures of `_config` whose routers differ in kind (routing replay's
    tests of each)."""
    # Llama 4's router: the sigmoid of its top-1 logit, a dense [tokens, experts] score matrix
    if arch == "llama4":
        from transformers import Llama4TextConfig

        heads = common["num_attention_heads"]
        return Llama4TextConfig(**{**common, "num_key_value_heads": 1}, intermediate_size_mlp=2 * hidden_size,
                                head_dim=hidden_size // heads, num_local_experts=4, num_experts_per_tok=1,
                                interleave_moe_layer_step=1, no_rope_layers=[1] * common["num_hidden_layers"],
                                attention_chunk_size=common["max_position_embeddings"])
    # Ernie 4.5's router: softmax weights, the choice biased by its `moe_statics`
    if arch == "ernie4_5_moe":
        from transformers import Ernie4_5_MoeConfig

        return Ernie4_5_MoeConfig(**common, moe_num_experts=8, moe_k=2, moe_intermediate_size=hidden_size,
                                  moe_num_shared_experts=0, moe_layer_start_index=0, moe_layer_interval=1,
                                  router_aux_loss_coef=0.01)
    # Phi-3.5-MoE's sparsemixer: in training mode it samples its choice and rescales weights at random
    if arch == "phimoe":
        from transformers import PhimoeConfig

        return PhimoeConfig(**common, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.01,
                            input_jitter_noise=0.0, router_aux_loss_coef=0.01)
    # DBRX: its router returns logits, its FFN block chooses (softmax, top-k, weights over their L1 norm)
    if arch == "dbrx":
        from transformers import DbrxConfig

        return DbrxConfig(d_model=hidden_size, n_heads=common["num_attention_heads"],
                          n_layers=common["num_hidden_layers"], max_seq_len=common["max_position_embeddings"],
                          vocab_size=common["vocab_size"], pad_token_id=common["pad_token_id"],
                          eos_token_id=common["eos_token_id"], bos_token_id=common["bos_token_id"],
                          tie_word_embeddings=False,
                          attn_config={"kv_n_heads": common["num_key_value_heads"], "rope_theta": 1e4,
                                       "clip_qkv": 8.0},
                          ffn_config={"ffn_hidden_size": hidden_size, "moe_num_experts": 8, "moe_top_k": 2})
    raise ValueError(f"arch={arch!r}: choose 'qwen2', 'llama', 'qwen2_moe', 'qwen3_moe', 'olmoe', "
                     "'deepseek_v3', 'llama4', 'ernie4_5_moe', 'phimoe' or 'dbrx'")


def build_causal_lm(tokenizer, arch: str = "qwen2", hidden_size: int = 128, num_layers: int = 2,
                    seed: int = 0, **config_fields) -> PreTrainedModel:
    """A randomly initialised Qwen2, Llama or MoE (Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, Llama 4,
    Ernie 4.5) causal LM sized for CPU tests; `config_fields` replace the config's own."""
    config = _config(arch, tokenizer, hidden_size, num_layers)
    for name, value in config_fields.items():
        if not hasattr(config, name):
            raise ValueError(f"{type(config).__name__} has no field {name!r}")
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_sequence_classifier(tokenizer, arch: str = "qwen2", hidden_size: int = 64, num_layers: int = 2,
                              seed: int = 0) -> PreTrainedModel:
    """The same backbones with a one-output score head (a reward model)."""
    torch.manual_seed(seed)
    config = _config(arch, tokenizer, hidden_size, num_layers, num_labels=1)
    return AutoModelForSequenceClassification.from_config(config)


def build_near_tie_moe(tokenizer, arch: str = "qwen3_moe", num_layers: int = 4, seed: int = 1,
                       experts: tuple[int, int] | None = None) -> PreTrainedModel:
    """A tiny MoE (hidden 64) whose experts dominate its MLP output (weights N(0, 0.1)) and whose
    router is near-uniform (N(0, 0.005)), so near-ties between experts are common: the case routing
    replay is for (its tests and benchmarks/routing_replay.py). `experts`: (experts, experts per
    token) of a Qwen3-MoE or OLMoE, e.g. (128, 8), Qwen3-30B-A3B's routing; default (8, 2)."""
    from rlft.model.routing import CHOOSING_BLOCKS, moe_routers

    fields = {}
    if experts is not None:
        if arch not in ("qwen3_moe", "olmoe"):
            raise ValueError(f"experts= takes a qwen3_moe or olmoe policy, not {arch!r}")
        fields = {"num_experts": experts[0], "num_experts_per_tok": experts[1]}
    model = build_causal_lm(tokenizer, arch=arch, hidden_size=64, num_layers=num_layers, **fields)
    generator = torch.Generator().manual_seed(seed)
    for router in moe_routers(model):  # (a choosing block's router: its linear layer)
        linear = router.router.layer if type(router).__name__ in CHOOSING_BLOCKS else router
        linear.weight.data = torch.randn(linear.weight.shape, generator=generator) * 0.005
    for name, param in model.named_parameters():
        if ".experts." in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.1
    return model


def upcycle_to_moe(dense: PreTrainedModel, num_experts: int = 4, top_k: int = 2, noise: float = 0.05,
                   seed: int = 0) -> PreTrainedModel:
    """A Qwen2-MoE model "sparsely upcycled" from a dense Qwen2 (A. Komatsuzaki et al., "Sparse
    Upcycling: Training Mixture-of-Experts from Dense Checkpoints", 2023; Qwen1.5-MoE was made
    so): attention, norms and embeddings copied, each expert a copy of the dense MLP with its
    weights scaled by 1 + `noise` x N(0, 1) (so the experts differ and routing matters), a random
    router, the shared expert off (its output projection 0). What the dense model learnt, the MoE
    starts from: the demo's policy as a Mixture-of-Experts (routing replay's tests)."""
    from transformers import Qwen2MoeConfig

    config = dense.config
    if config.model_type != "qwen2":
        raise ValueError(f"upcycle_to_moe takes a Qwen2 model, not {config.model_type!r}")
    fields = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "model_type")}
    moe_config = Qwen2MoeConfig(**{**fields, "num_experts": num_experts, "num_experts_per_tok": top_k,
                                   "moe_intermediate_size": config.intermediate_size,
                                   "shared_expert_intermediate_size": config.intermediate_size,
                                   "norm_topk_prob": True, "qkv_bias": True, "router_aux_loss_coef": 0.01})
    generator = torch.Generator().manual_seed(seed)
    moe = AutoModelForCausalLM.from_config(moe_config)
    state, out = dense.state_dict(), {}
    for name, tensor in moe.state_dict().items():
        if name in state:
            out[name] = state[name]
            continue
        layer = name.split(".mlp.")[0] + ".mlp."
        noisy = lambda t: t * (1 + noise * torch.randn(t.shape, generator=generator))  # noqa: E731
        if name.endswith("experts.gate_up_proj"):
            gate_up = torch.cat([state[layer + "gate_proj.weight"], state[layer + "up_proj.weight"]])
            out[name] = torch.stack([noisy(gate_up) for _ in range(num_experts)])
        elif name.endswith("experts.down_proj"):
            out[name] = torch.stack([noisy(state[layer + "down_proj.weight"]) for _ in range(num_experts)])
        elif name.endswith("gate.weight"):  # the router
            out[name] = 0.02 * torch.randn(tensor.shape, generator=generator)
        elif ".shared_expert." in name:
            out[name] = state[layer + name.split(".shared_expert.")[1]] if "down_proj" not in name \
                else torch.zeros_like(tensor)
        else:  # the shared expert's gate
            out[name] = torch.zeros_like(tensor)
    moe.load_state_dict(out)
    moe.generation_config = dense.generation_config
    return moe


def save_tiny(model: PreTrainedModel, tokenizer, path: str | Path) -> Path:
    """Save model and tokenizer side by side, as a hub folder would hold them."""
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_model_dir(path: str | Path, kind: str = "causal", arch: str = "qwen2", seed: int = 0,
                        hidden_size: int = 64, num_layers: int = 2, tools: bool = False) -> Path:
    """Build tokenizer + model (`kind` 'causal' or 'seq_cls') and save them to `path` (`tools`: the
    tool-calling tokenizer and chat template)."""
    tokenizer = build_tokenizer(seed, vocab_size=448 if tools else 384, tools=tools)
    builder = build_causal_lm if kind == "causal" else build_sequence_classifier
    model = builder(tokenizer, arch=arch, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    return save_tiny(model, tokenizer, path)
