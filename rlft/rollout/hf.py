"""Generation with transformers' `generate`: the default engine, runs on any device.

The rollout protocol: prompt token ids and a group size in; completion ids, a completion
mask (every token up to and including the first EOS) and a truncation flag out. Multi-turn rollouts
(`rlft/rollout/multiturn.py`) add a tool mask and what reward functions see per row.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from rlft.data.prompts import left_pad
from rlft.errors import ConfigError
from rlft.rollout.base import Rollout

__all__ = ["HFGenerator", "LogpRecorder", "Rollout", "cache_keyword", "check_generation_kwargs",
           "completion_mask_from", "eos_token_ids", "shared_prompt_cache"]


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def completion_mask_from(completion_ids: torch.Tensor,
                         eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask every token up to and including the first EOS; flag rows that never emit one."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))  # [N, C]
    has_eos = is_eos.any(dim=1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), completion_ids.shape[1] - 1)  # [N]
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)[None, :]
    return (positions <= first_eos[:, None]).long(), ~has_eos


def cache_keyword(model) -> str:
    """The name of the KV-cache argument of the model's forward and generate: `cache` from transformers 5.24
    (which warns about the old name), `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def shared_prompt_cache(model, prompt_ids: list[list[int]], copies: int, pad_token_id: int, device):
    """The KV cache of every prompt but its last token, computed once per prompt and repeated `copies`
    times in place (row i*copies + j holds prompt i, as in the repeated batch). `generate` then runs only
    the last prompt token and the completion: the same tokens as a full prefill (tested), with 1/copies
    of the prefill work. None when a prompt has a single token (its row would be all padding), or when the
    model's cache cannot be repeated per row (hybrid / linear-attention layers, e.g. NemotronH): then
    generate prefills every row itself."""
    if min(len(ids) for ids in prompt_ids) < 2:
        return None
    cache = DynamicCache(config=model.config)
    if not all(hasattr(layer, "batch_repeat_interleave") for layer in getattr(cache, "layers", [])):
        return None
    ids, mask = (t.to(device) for t in left_pad(prompt_ids, pad_token_id))  # [P, L]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded prompts
    model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=position_ids[:, :-1],
          use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
    cache.batch_repeat_interleave(copies)
    return cache


GENERATE_ARGUMENTS = ("synced_gpus", "streamer", "logits_processor", "stopping_criteria",
                      "prefix_allowed_tokens_fn", "assistant_model", "negative_prompt_ids",
                      "negative_prompt_attention_mask", "custom_generate", "use_model_defaults", "tokenizer")
# GenerationConfig fields that change what generate returns or how many rows: rlft asks for its own.
RESHAPING = {"num_return_sequences": "num_generations sets the completions per prompt",
             "return_dict_in_generate": "rlft reads the generated token ids",
             "output_scores": "log-probs are recomputed by the trainer",
             "output_logits": "log-probs are recomputed by the trainer"}


def check_generation_kwargs(kwargs: dict | None) -> dict:
    """generation_kwargs for transformers' generate: every key a GenerationConfig field or a generate()
    argument, none that reshapes generate's output; an unknown one is an error naming it (generate would fail
    later)."""
    from transformers import GenerationConfig

    kwargs = dict(kwargs or {})
    unknown = sorted(set(kwargs) - set(GenerationConfig().to_dict()) - set(GENERATE_ARGUMENTS))
    if unknown:
        raise ConfigError(f"generation_kwargs {unknown} are neither GenerationConfig fields nor generate() "
                          "arguments; remove them (with use_vllm they would be vLLM SamplingParams fields)")
    for key, why in RESHAPING.items():
        if kwargs.get(key) not in (None, False, 1):
            raise ConfigError(f"generation_kwargs {key}={kwargs[key]!r} is not supported: {why}")
    return kwargs


class LogpRecorder:
    """A logits processor that keeps each sampled token's log-prob at the sampling temperature: at every step
    it reads the token the previous step sampled (the last of `input_ids`) and looks it up in that step's
    log-softmax; `finish` reads the last one. transformers runs it after its own processors (repetition
    penalty, bad words, ...) and before the temperature / top-k / top-p warpers, so with no such processor the
    log-probs are those of softmax(logits / temperature): what the trainer scores (rlft/scoring.py). Its
    user (rlft/rollout/producer_worker.py) asks for it only then."""

    def __init__(self, temperature: float):
        self.temperature, self.previous, self.logps = temperature or 1.0, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._read(input_ids[:, -1])
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _read(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.logps.append(self.previous.gather(1, tokens[:, None]).squeeze(1))

    def finish(self, completion_ids: torch.Tensor) -> torch.Tensor:
        """[N, C] log-probs of the generated tokens."""
        if completion_ids.shape[1]:
            self._read(completion_ids[:, -1])
        if not self.logps:
            return torch.zeros(completion_ids.shape)
        return torch.stack(self.logps, dim=1)[:, :completion_ids.shape[1]]


class HFGenerator:
    """Sampling with `model.generate`; one call per rollout for all prompts x num_generations.

    With the default dynamic cache each prompt is prefilled once per group, not num_generations times
    (`shared_prompt_prefill`); `cache_implementation` is passed to generate as in TRL. With `synced` (FSDP2,
    ZeRO-3) generate runs with synced_gpus, as every sharded forward needs every process."""

    def __init__(self, tokenizer, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int | None = None, repetition_penalty: float = 1.0,
                 cache_implementation: str | None = None, shared_prompt_prefill: bool = True,
                 min_p: float | None = None, generation_kwargs: dict | None = None, synced: bool = False):
        self.tokenizer = tokenizer
        self.sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k or 0, repetition_penalty=repetition_penalty)
        if min_p is not None:
            self.sampling["min_p"] = min_p
        if cache_implementation is not None:
            self.sampling["cache_implementation"] = cache_implementation
        if synced:  # sharded weights: a process that finished keeps running forward passes until all have
            self.sampling["synced_gpus"] = True
        # TRL's: passed to generate, win over the rest
        self.sampling.update(check_generation_kwargs(generation_kwargs))
        # Not with sharded weights (whether a process prefills is decided per process, and all must take
        # part), nor with beam search (generate expands each row into beams itself)
        self.shared_prompt_prefill = shared_prompt_prefill and cache_implementation in (None, "dynamic") and \
            not synced and self.sampling.get("num_beams", 1) == 1
        self.return_logps = False  # a rollout producer asks for the sampled tokens' log-probs

    holds_own_weights = False  # generate reads the live model: nothing to sync

    def on_weights_changed(self) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.no_grad()
    def __call__(self, model, prompt_ids: list[list[int]], num_generations: int, greedy: bool = False,
                 max_new_tokens: int | None = None) -> Rollout:
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        ids, mask = left_pad(repeated, self.tokenizer.pad_token_id)
        device = next(model.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        eos_ids = eos_token_ids(model, self.tokenizer)
        was_training = model.training
        model.eval()
        sampling = dict(self.sampling, do_sample=False, temperature=None, top_p=None, top_k=None,
                        min_p=None) if greedy else dict(self.sampling, do_sample=True)
        if max_new_tokens is not None:  # a later turn of a multi-turn rollout: what is left of the budget
            sampling["max_new_tokens"] = max_new_tokens
        cache = shared_prompt_cache(model, prompt_ids, num_generations, self.tokenizer.pad_token_id, device) \
            if self.shared_prompt_prefill and num_generations > 1 else None
        if cache is not None:
            sampling[cache_keyword(model)] = cache
        recorder = LogpRecorder(self.sampling["temperature"]) if self.return_logps and not greedy else None
        if recorder is not None:
            sampling["logits_processor"] = [*sampling.get("logits_processor", []), recorder]
        out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=self.tokenizer.pad_token_id,
                             eos_token_id=eos_ids, use_cache=True, **sampling)
        model.train(was_training)
        completion_ids = out[:, ids.shape[1]:]
        completion_mask, truncated = completion_mask_from(completion_ids, eos_ids)
        logps = None if recorder is None else recorder.finish(completion_ids).to(completion_ids.device)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, self.tokenizer.pad_token_id)
        return Rollout(ids, mask, completion_ids, completion_mask, truncated, logps)
