"""Generation with transformers' `generate`: the default engine, runs on any device.

The rollout protocol: prompt token ids and a group size in; completion ids, a completion
mask (every token up to and including the first EOS) and a truncation flag out. Multi-turn rollouts
(`rlft/rollout/multiturn.py`) add a tool mask and what reward functions see per row.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch
from transformers import DynamicCache

from rlft.core.fused_head import vocabulary_rows
from rlft.core.logprobs import finite_ids
from rlft.core.sampling import inverse_cdf_sample
from rlft.data.prompts import left_pad
from rlft.errors import ConfigError
from rlft.model.routing import route_state
from rlft.rollout.base import Rollout

__all__ = ["HFGenerator", "Rollout", "SamplerRecorder", "TokenSampler", "WeightSwitch", "cache_keyword",
           "check_generation_kwargs", "completion_mask_from", "draws_itself", "effective_sampling",
           "eos_token_ids", "sampling_warpers", "shared_prompt_cache", "vocabulary_size"]


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def completion_mask_from(completion_ids: torch.Tensor,
                         eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask every token up to and including the first EOS; flag rows that never emit one."""
    # [N, C]
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    has_eos = is_eos.any(dim=1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), completion_ids.shape[1] - 1)  # [N]
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)[None, :]
    return (positions <= first_eos[:, None]).long(), ~has_eos


def cache_keyword(model) -> str:
    """The name of the KV-cache argument of the model's forward and generate: `cache` from
    transformers 5.24 (which warns about the old name), `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def shared_prompt_cache(model, prompt_ids: list[list[int]], copies: int, pad_token_id: int, device):
    """The KV cache of every prompt but its last token, computed once per prompt and repeated
    `copies` times in place (row i*copies + j holds prompt i, as in the repeated batch). `generate`
    then runs only the last prompt token and the completion: the same tokens as a full prefill
    (tested), with 1/copies of the prefill work. None when a prompt has a single token (its row
    would be all padding), or when the model's cache cannot be repeated per row (hybrid /
    linear-attention layers, e.g. NemotronH): then generate prefills every row itself."""
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
    """generation_kwargs for transformers' generate: every key a GenerationConfig field or a
    generate() argument, none that reshapes generate's output; an unknown one is an error naming it
    (generate would fail later)."""
    from transformers import GenerationConfig

    kwargs = dict(kwargs or {})
    unknown = sorted(set(kwargs) - set(GenerationConfig().to_dict()) - set(GENERATE_ARGUMENTS))
    if unknown:
        raise ConfigError(f"generation_kwargs {unknown} are neither GenerationConfig fields nor "
                          "generate() arguments; remove them (with use_vllm they would be vLLM "
                          "SamplingParams fields)")
    for key, why in RESHAPING.items():
        if kwargs.get(key) not in (None, False, 1):
            raise ConfigError(f"generation_kwargs {key}={kwargs[key]!r} is not supported: {why}")
    return kwargs


WARPER_FIELDS = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff",
                 "eta_cutoff")
# generate() arguments and GenerationConfig fields under which generate does more than draw one
# token per row from the processed scores: with any of them set it samples itself
OWN_SAMPLING = ("assistant_model", "prompt_lookup_num_tokens", "custom_generate", "penalty_alpha",
                "dola_layers", "assistant_early_exit", "watermarking_config")


def sampling_warpers(settings: dict, device="cpu") -> list:
    """transformers' own warpers for `settings` (generate's keywords over the model's generation
    config), in the order generate applies them, for a chain rlft places itself (so that a recorder
    can follow them, and a sampler after that)."""
    from transformers.generation import logits_process as lp

    get, warpers = settings.get, []
    if get("temperature") not in (None, 1.0):
        warpers.append(lp.TemperatureLogitsWarper(get("temperature")))
    if get("top_h") is not None:
        warpers.append(lp.TopHLogitsWarper(top_h=get("top_h")))
    if get("top_k"):
        warpers.append(lp.TopKLogitsWarper(top_k=get("top_k"), min_tokens_to_keep=1))
    if get("top_p") is not None and get("top_p") < 1.0:
        warpers.append(lp.TopPLogitsWarper(top_p=get("top_p"), min_tokens_to_keep=1))
    if get("min_p") is not None:
        warpers.append(lp.MinPLogitsWarper(min_p=get("min_p"), min_tokens_to_keep=1))
    if get("typical_p") is not None and get("typical_p") < 1.0:
        warpers.append(lp.TypicalLogitsWarper(mass=get("typical_p"), min_tokens_to_keep=1))
    if 0.0 < (get("epsilon_cutoff") or 0.0) < 1.0:
        warpers.append(lp.EpsilonLogitsWarper(epsilon=get("epsilon_cutoff"), min_tokens_to_keep=1))
    if 0.0 < (get("eta_cutoff") or 0.0) < 1.0:
        warpers.append(lp.EtaLogitsWarper(epsilon=get("eta_cutoff"), min_tokens_to_keep=1, device=device))
    return warpers


def effective_sampling(model, sampling: dict) -> dict:
    """The generation settings generate would use: `sampling` over the model's generation config."""
    config = getattr(model, "generation_config", None)
    return {**(config.to_dict() if config is not None else {}), **sampling}


def draws_itself(settings: dict) -> bool:
    """Whether rlft's TokenSampler can draw the tokens for these settings: one token per row from
    the processed scores (no beams, no assisted or contrastive decoding, no watermark, no custom
    decoding loop)."""
    return (settings.get("num_beams") or 1) == 1 and not any(settings.get(key) for key in OWN_SAMPLING)


# From this many vocabulary entries rlft draws sampled tokens itself: torch.multinomial's one
# exponential per entry then costs more than a millisecond a token for 16 rows on a CPU (54 ms at
# 151,936; benchmarks/sampling.py). Below, generate samples as in transformers and TRL (a seed gives
# their samples).
DRAW_FROM_VOCABULARY = 4096


def vocabulary_size(model) -> int:
    """The LM head's rows (also while ZeRO-3 partitions it), else the config's vocab_size."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return vocabulary_rows(weight) if weight is not None else int(getattr(model.config, "vocab_size", 0) or 0)


class TokenSampler:
    """The last logits processor of a sampled generate run that rlft makes with do_sample=False: it
    draws each row's next token from the processed scores by inversion (rlft/core/sampling.py: the
    distribution torch.multinomial draws from, without one exponential per vocabulary entry) and
    leaves that token the row's only finite score, so generate's argmax takes it."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # in place (generate reads only what the chain returns): no [rows, vocab] block allocated
        # per token
        probs = scores.float()
        # unnormalised: the sampler takes any scale
        probs = probs.sub_(probs.amax(-1, keepdim=True)).exp_()
        uniforms = torch.rand(scores.shape[0], dtype=torch.float64, device=scores.device)
        ids = inverse_cdf_sample(probs, uniforms)
        return probs.fill_(float("-inf")).scatter_(1, ids[:, None], 0.0)


class SamplerRecorder:
    """A logits processor placed after the sampling warpers, so it sees the scores generate samples
    from: at every step it keeps the ids the step kept (`kept`: the finite scores; top-k / top-p /
    min-p set the rest to -inf) and reads the token the previous step sampled (the last of
    `input_ids`) to keep its log-prob under that step's distribution; `finish` reads the last
    one."""

    def __init__(self, logps: bool = True, kept: bool = False):
        self.record_logps, self.record_kept = logps, kept
        self.previous, self.logps, self.kept = None, [], []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.record_logps:
            self._read(input_ids[:, -1])
            self.previous = torch.log_softmax(scores.float(), dim=-1)
        if self.record_kept:
            self.kept.append(finite_ids(scores))
        return scores

    def _read(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.logps.append(self.previous.gather(1, tokens[:, None]).squeeze(1))

    def finish(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor):
        """([N, C] log-probs of the generated tokens or None, [N, C, K] kept ids (-1 past each
        completion's end) or None)."""
        logps = kept = None
        if self.record_logps:
            if completion_ids.shape[1]:
                self._read(completion_ids[:, -1])
            logps = torch.stack(self.logps, dim=1)[:, :completion_ids.shape[1]] if self.logps else \
                torch.zeros(completion_ids.shape)
            # past a completion's end generate samples padding, which truncation may have removed
            # (-inf)
            logps = logps.masked_fill(completion_mask.to(logps.device) == 0, 0.0)
        if self.record_kept:
            width = max([k.shape[1] for k in self.kept] or [1])
            kept = torch.full((*completion_ids.shape, width), -1, dtype=torch.int32,
                              device=completion_ids.device)
            for step, ids in enumerate(self.kept[:completion_ids.shape[1]]):
                kept[:, step, :ids.shape[1]] = ids
            kept.masked_fill_(completion_mask[..., None] == 0, -1)
        return logps, kept


class WeightSwitch:
    """In-flight weight updates (a rollout producer's `inflight_weight_updates`): the last logits
    processor of a sampled run. At each decode step it notes the version of the weights that
    computed this step's logits (`versions`, one per generated token), then calls `pending()`,
    which may load newer weights in place: the next step's forward uses them, on the keys and
    values the earlier weights left in the cache, and the sampler's recorded log-prob of each token
    is that of the distribution it was drawn from. `pending(tokens)` gets the tokens sampled so
    far and returns the version it loaded, or None."""

    def __init__(self, version: int, pending: Callable[[int], int | None],
                 waiting: Callable[[], bool] | None = None):
        self.version, self.pending, self.versions, self.waiting = version, pending, [], waiting

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.step()
        return scores

    def step(self) -> None:
        """One decode step's tokens were drawn from `version`; newer weights may load now (a vLLM
        engine stepped by rlft/rollout/vllm_steps.py calls it between its steps)."""
        self.versions.append(self.version)
        self.load()

    def ready(self) -> bool:
        """Whether newer weights wait to be loaded (`waiting`; a vLLM server's requests are stopped
        for them first: rlft/rollout/vllm_requests.py)."""
        return self.waiting is not None and self.waiting()

    def load(self) -> bool:
        """Load newer weights if they wait (`pending`); whether it did."""
        loaded = self.pending(len(self.versions))  # tokens sampled so far
        if loaded is not None:
            self.version = loaded
        return loaded is not None


@contextlib.contextmanager
def sampling_forwards(model, routes):
    """The model in eval mode for generate's forwards (its training mode restored after), and
    `routes` (a MoE policy's RouteState, or None) recording them; freed when generate fails."""
    was_training = model.training
    model.eval()
    if routes is not None:
        routes.record()
    try:
        yield
    except BaseException:
        if routes is not None:
            routes.free()
        raise
    finally:
        model.train(was_training)


class HFGenerator:
    """Sampling with `model.generate`; one call per rollout for all prompts x num_generations.

    With the default dynamic cache each prompt is prefilled once per group, not num_generations
    times (`shared_prompt_prefill`); `cache_implementation` is passed to generate as in TRL. With
    `synced` (FSDP2, ZeRO-3) generate runs with synced_gpus, as every sharded forward needs every
    process. `replay_mask`: each completion token comes with the ids the sampler kept
    (rlft/rollout/truncation.py); `return_logps` (a rollout producer): with its log-prob under the
    distribution it was sampled from. Sampled tokens are drawn by rlft's TokenSampler where the
    vocabulary is large (`draw_tokens`: None decides by `DRAW_FROM_VOCABULARY`; True always; False
    never: generate's torch.multinomial, the same distribution)."""

    def __init__(self, tokenizer, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int | None = None, repetition_penalty: float = 1.0,
                 cache_implementation: str | None = None, shared_prompt_prefill: bool = True,
                 min_p: float | None = None, generation_kwargs: dict | None = None, synced: bool = False,
                 replay_mask: bool = False, draw_tokens: bool | None = None):
        from transformers import GenerationConfig

        self.tokenizer, self.draw_tokens = tokenizer, draw_tokens
        fields = GenerationConfig().to_dict()  # this transformers' fields: top_h is newer than some
        self.unset_warpers = {key: None for key in WARPER_FIELDS if key in fields}
        self.sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k or 0, repetition_penalty=repetition_penalty)
        if min_p is not None:
            self.sampling["min_p"] = min_p
        if cache_implementation is not None:
            self.sampling["cache_implementation"] = cache_implementation
        # sharded weights: a process that finished keeps running forward passes until all have
        if synced:
            self.sampling["synced_gpus"] = True
        # TRL's: passed to generate, win over the rest
        self.sampling.update(check_generation_kwargs(generation_kwargs))
        # Not with sharded weights (whether a process prefills is decided per process, and all must
        # take part), nor with beam search (generate expands each row into beams itself)
        self.shared_prompt_prefill = shared_prompt_prefill and cache_implementation in (None, "dynamic") and \
            not synced and self.sampling.get("num_beams", 1) == 1
        self.return_logps, self.replay_mask = False, replay_mask
        self.weight_switch: WeightSwitch | None = None  # a producer's in-flight weight updates

    holds_own_weights = False  # generate reads the live model: nothing to sync

    def on_weights_changed(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _settings(self, model, greedy: bool, device) -> tuple[dict, SamplerRecorder | None]:
        """generate's keywords. Sampled: rlft's own chain after the user's processors (the warpers
        generate would apply, a recorder when it records, and the TokenSampler that draws the token,
        generate then taking it with do_sample=False); where generate must sample itself (beams,
        assisted decoding, a watermark) and nothing records, generate's own sampling."""
        unset = self.unset_warpers
        if greedy:
            return dict(self.sampling, do_sample=False, **unset), None
        sampling = dict(self.sampling, do_sample=True)
        settings = effective_sampling(model, sampling)
        fast = draws_itself(settings) and (self.draw_tokens if self.draw_tokens is not None else
                                           vocabulary_size(model) >= DRAW_FROM_VOCABULARY)
        recorder = SamplerRecorder(logps=self.return_logps, kept=self.replay_mask) \
            if self.return_logps or self.replay_mask else None
        switch = [self.weight_switch] if self.weight_switch is not None else []
        if not fast and recorder is None and not switch:
            return sampling, None
        chain = [*sampling.get("logits_processor", []), *sampling_warpers(settings, device),
                 *([recorder] if recorder else []), *([TokenSampler()] if fast else []), *switch]
        sampling.update(unset, do_sample=not fast, logits_processor=chain)
        return sampling, recorder

    @torch.no_grad()
    def __call__(self, model, prompt_ids: list[list[int]], num_generations: int, greedy: bool = False,
                 max_new_tokens: int | None = None) -> Rollout:
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        ids, mask = left_pad(repeated, self.tokenizer.pad_token_id)
        device = next(model.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        eos_ids = eos_token_ids(model, self.tokenizer)
        sampling, recorder = self._settings(model, greedy, device)
        # a later turn of a multi-turn rollout: what is left of the budget
        if max_new_tokens is not None:
            sampling["max_new_tokens"] = max_new_tokens
        routes = route_state(model)
        if routes is not None and sampling.get("num_beams", 1) != 1:
            routes.free()  # beams reorder rows: nothing recorded, nothing replayed
            routes = None
        with sampling_forwards(model, routes):  # (a Mixture-of-Experts policy's routes recorded)
            cache = None
            if self.shared_prompt_prefill and num_generations > 1:
                cache = shared_prompt_cache(model, prompt_ids, num_generations, self.tokenizer.pad_token_id,
                                            device)
            if cache is not None:
                sampling[cache_keyword(model)] = cache
            out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=self.tokenizer.pad_token_id,
                                 eos_token_id=eos_ids, use_cache=True, **sampling)
        completion_ids = out[:, ids.shape[1]:]
        completion_mask, truncated = completion_mask_from(completion_ids, eos_ids)
        logps, kept = (None, None) if recorder is None else recorder.finish(completion_ids, completion_mask)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, self.tokenizer.pad_token_id)
        rollout = Rollout(ids, mask, completion_ids, completion_mask, truncated,
                          None if logps is None else logps.to(completion_ids.device), sampling_kept=kept)
        if routes is not None:
            prompt_routes, completion_routes = routes.assemble(len(repeated), ids.shape[1],
                                                               completion_ids.shape[1])
            rollout.prompt_routes = prompt_routes.to(completion_ids.device)
            rollout.completion_routes = completion_routes.to(completion_ids.device)
        return rollout
