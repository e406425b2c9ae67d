"""The benchmark workloads: the same model, tokenizer, prompts and rewards for both libraries.

a: the shipped 0.54M demo policy on its addition task (8 prompts x 8 completions, 8 tokens)
b: a ~25M-parameter Qwen2 (random weights), 1 prompt x 8 completions of 128 tokens, LoRA
c: a ~100M-parameter Qwen2 with a 32k vocabulary, same batch: log-prob memory starts to matter
d: Qwen's vocabulary (151,936): a Qwen2 of hidden 512 x 4 layers (~84M parameters, 78M of them the tied
   embedding), 1 prompt x 16 completions of 512 tokens, LoRA, gradient checkpointing on (both libraries'
   default): the LM head dominates generation and scoring
s: skewed completion lengths, as reasoning RL has: a Qwen2 of hidden 256 x 4 layers (random weights)
   whose EOS embedding is scaled x8, so that completions end after ~20 tokens (median, mean ~60) while
   about one in eight runs to the 256-token limit; 2 prompts x 8 completions, LoRA. On this CPU its
   decode step costs in proportion to the rows (7.5 ms at 16 rows, 20 ms at 64: compute-bound)
t: the same shape of lengths (median ~65, mean ~90, one in ten at 256) from a Qwen2 of hidden 64 x 2
   layers (EOS x12), whose decode step costs nearly the same for 16 rows as for 64 (2.9 ms, 4.3 ms:
   overhead-bound, as decoding is on a GPU)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlft.data.addition import rows, split_problems
from rlft.model.loading import shipped_policy_path
from rlft.rewards.builtins import exact_match_reward, format_reward
from rlft.tiny import build_tokenizer


def distinct_token_ratio(completion_ids, **kwargs) -> list[float]:
    """A cheap deterministic reward with spread, for random-weight models."""
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


@dataclass
class Spec:
    name: str
    hidden: int = 0
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    intermediate: int = 0
    vocab: int | None = None
    prompts_per_step: int = 1
    num_generations: int = 8
    max_completion_length: int = 128
    temperature: float = 1.0
    learning_rate: float = 1e-4
    gradient_checkpointing: bool = False
    eos_scale: float = 1.0  # the EOS row of the (tied) embedding scaled: how soon completions end
    lora: dict = field(default_factory=lambda: dict(r=16, lora_alpha=32, lora_dropout=0.0,
                                                    target_modules="all-linear", task_type="CAUSAL_LM"))

    def common(self) -> dict:
        """Config fields both libraries name the same way."""
        return dict(num_generations=self.num_generations,
                    per_device_train_batch_size=self.num_generations * self.prompts_per_step,
                    gradient_accumulation_steps=1, max_completion_length=self.max_completion_length,
                    temperature=self.temperature, top_p=1.0, learning_rate=self.learning_rate, epsilon=0.2,
                    scale_rewards="group", num_iterations=1, max_grad_norm=1.0,
                    gradient_checkpointing=self.gradient_checkpointing)


WORKLOADS = {
    "a": Spec("demo policy 0.54M, 8x8, 8 tokens", prompts_per_step=8, max_completion_length=8, temperature=0.7,
              learning_rate=5e-4),
    "b": Spec("Qwen2 25M, 1x8, 128 tokens", hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536),
    "c": Spec("Qwen2 100M, vocab 32k, 1x8, 128 tokens", hidden=768, layers=10, heads=12, kv_heads=4,
              intermediate=2048, vocab=32000),
    "d": Spec("Qwen2 84M, vocab 151,936, 1x16, 512 tokens", hidden=512, layers=4, heads=8, kv_heads=2,
              intermediate=1536, vocab=151936, num_generations=16, max_completion_length=512,
              gradient_checkpointing=True),
    "s": Spec("Qwen2 hidden 256 x 4 layers, 2x8, 256 tokens, skewed lengths", hidden=256, layers=4, heads=4,
              kv_heads=2, intermediate=768, prompts_per_step=2, max_completion_length=256, eos_scale=8.0),
    "t": Spec("Qwen2 hidden 64 x 2 layers, 2x8, 256 tokens, skewed lengths", hidden=64, layers=2, heads=4,
              kv_heads=2, intermediate=192, prompts_per_step=2, max_completion_length=256, eos_scale=12.0),
}


@dataclass
class Work:
    model: torch.nn.Module
    tokenizer: object
    rows: list
    reward_funcs: list


def build(spec: Spec) -> Work:
    train, _ = split_problems()
    if spec.hidden == 0:
        path = shipped_policy_path()
        from transformers import AutoTokenizer

        return Work(AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), rows(train),
                    [exact_match_reward, format_reward])
    tokenizer = build_tokenizer(seed=0)
    if spec.vocab:  # pad the vocabulary with real (added) tokens so every sampled id decodes
        tokenizer.add_tokens([f"<tok{i}>" for i in range(spec.vocab - len(tokenizer))])
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                         num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                         intermediate_size=spec.intermediate,
                         max_position_embeddings=max(512, spec.max_completion_length + 128), tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer.eos_token_id] *= spec.eos_scale
    return Work(model, tokenizer, rows(train[:512]), [distinct_token_ratio])
