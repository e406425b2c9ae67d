"""Packed, padding-free scoring inputs: the rows of a micro-batch as one sequence with no padding,
each row's positions starting at 0, and (`share_prompts`) the prompt of rows that share it held
once, each completion attending to it and to its own past with positions continuing from the
prompt's end. The attention is rlft's segment attention (rlft/core/segments.py), which a model
scored packed takes as "rlft_segments:<its own>": the segments in a packed scoring forward, its own
attention everywhere else (generation, padded forwards).

The log-probs and gradients are those of scoring each (prompt, completion) on its own, to float
rounding (tests/test_packing.py), with tokens nobody needs never computed: a micro-batch of one
2,048-token completion and fifteen of 96 behind 64-token prompts is 4.5k tokens packed instead of
34k padded, and 8 completions of 64 behind one 3,072-token prompt are 3.6k tokens with the prompt
shared instead of 25k.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from rlft.core.segments import Block, segment_attention

IMPLEMENTATION = "rlft_segments"


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    blocks: list[Block]  # tile [0, T) in order
    predict: torch.Tensor  # [n] where, in [0, T), the hidden state predicting each scored token is
    targets: torch.Tensor  # [n] the scored tokens
    rows: torch.Tensor  # [n] each scored token's row in the micro-batch
    cols: torch.Tensor  # [n] and its column in the completion
    kept: torch.Tensor | None = None  # [n, K] the sampler's kept ids (truncated sampling)
    routes: torch.Tensor | None = None  # [T, L, k] the sampler's experts per packed token (routing)
    completion_positions: torch.Tensor | None = None  # [T] bool: a completion token (with routes)


def _real(rollout, rows: list[int]) -> list[tuple[list[int], list[int]]]:
    """Each row's (prompt tokens, completion tokens): the completion up to and including its end
    (EOS)."""
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.prompt_ids[rows].cpu(),
                                                             rollout.prompt_mask[rows].cpu())]
    lengths = rollout.completion_mask[rows].sum(dim=1).tolist()
    completions = [ids[:int(n)].tolist() for ids, n in zip(rollout.completion_ids[rows].cpu(), lengths)]
    return list(zip(prompts, completions))


def _groups(pairs, share_prompts: bool, routes: list[bytes] | None = None) -> list[list[int]]:
    """Indices of `pairs` in packing order: rows with the same prompt together when prompts are
    shared (and, under routing replay, the same recorded routes for it: `routes`, per row)."""
    if not share_prompts:
        return [[i] for i in range(len(pairs))]
    groups: dict[tuple, list[int]] = {}
    for i, (prompt, _) in enumerate(pairs):
        groups.setdefault((tuple(prompt), None if routes is None else routes[i]), []).append(i)
    return list(groups.values())


def _prompt_routes(rollout, rows: list[int]) -> list[torch.Tensor] | None:
    """Each row's recorded routes of its prompt tokens (None: no routes recorded)."""
    if rollout.prompt_routes is None or rollout.completion_routes is None:
        return None
    return [rollout.prompt_routes[row][rollout.prompt_mask[row].bool()] for row in rows]


def pack_rows(rollout, rows, share_prompts: bool = True) -> Packed:
    """The rows `rows` (an index tensor or a list) of a rollout packed for scoring (module
    docstring)."""
    rows = rows.tolist() if torch.is_tensor(rows) else list(rows)
    pairs = _real(rollout, rows)
    prompt_routes = _prompt_routes(rollout, rows)
    groups = _groups(pairs, share_prompts, None if prompt_routes is None else
                     [r.cpu().numpy().tobytes() for r in prompt_routes])
    ids, positions, blocks, predict, targets, at_row, at_col = [], [], [], [], [], [], []
    for group in groups:
        prompt = pairs[group[0]][0]
        shared = share_prompts
        if shared:  # the prompt once, then each completion after it
            prompt_start = len(ids)
            blocks.append(Block(prompt_start, len(prompt)))
            ids += prompt
            positions += range(len(prompt))
        for i in group:
            completion = pairs[i][1]
            if not completion:
                continue
            start = len(ids)
            if not shared:
                blocks.append(Block(start, len(prompt) + len(completion)))
                ids += prompt
                positions += range(len(prompt))
                # the hidden state predicting the completion's first token
                first = start + len(prompt) - 1
            else:
                blocks.append(Block(start, len(completion), prompt_start, len(prompt)))
                first = prompt_start + len(prompt) - 1
            completion_start = len(ids)
            ids += completion
            positions += range(len(prompt), len(prompt) + len(completion))
            predict += [first] + list(range(completion_start, completion_start + len(completion) - 1))
            targets += completion
            at_row += [i] * len(completion)
            at_col += range(len(completion))
    device = rollout.completion_ids.device
    tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    rows_t, cols_t = tensor(at_row), tensor(at_col)
    kept = None
    if rollout.sampling_kept is not None:
        kept = rollout.sampling_kept[tensor(rows)][rows_t, cols_t]
    return Packed(tensor(ids)[None], tensor(positions)[None], blocks, tensor(predict), tensor(targets),
                  rows_t, cols_t, kept,
                  *_packed_routes(rollout, rows, pairs, groups, prompt_routes, share_prompts))


def _packed_routes(rollout, rows: list[int], pairs, groups, prompt_routes, share_prompts: bool):
    """The sampler's routes [T, L, k] of each packed token, in pack_rows' order, and [T] which of
    them are completion tokens ((None, None): none recorded)."""
    if prompt_routes is None:
        return None, None
    parts = []
    for group in groups:
        if share_prompts:
            parts.append((prompt_routes[group[0]], False))
        for i in group:
            length = len(pairs[i][1])
            if not length:
                continue
            if not share_prompts:
                parts.append((prompt_routes[i], False))
            parts.append((rollout.completion_routes[rows[i], :length], True))
    flags = [torch.full((len(routes),), completion, dtype=torch.bool) for routes, completion in parts]
    return torch.cat([routes for routes, _ in parts]), torch.cat(flags).to(rollout.completion_ids.device)


_STATE = threading.local()  # .packed: this thread is running a packed scoring forward


def _delegating(original: str):
    """An attention function and a mask function named "rlft_segments:<original>": rlft's segment
    attention for a packed scoring forward (`rlft_blocks` passed), the original everywhere else
    (generation, a padded forward, whatever else the model is used for)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, attention_mask, rlft_blocks=None, **kwargs):
        if rlft_blocks is not None:
            return segment_attention(module, query, key, value, attention_mask, rlft_blocks=rlft_blocks,
                                     **kwargs)
        if getattr(_STATE, "packed", False):
            raise ValueError("the model's layers do not pass attention keyword arguments through, "
                             "so its attention cannot be told the packed sequence's rows")
        return ALL_ATTENTION_FUNCTIONS[original](module, query, key, value, attention_mask, **kwargs)

    def mask(*args, **kwargs):  # a packed forward needs no mask: the blocks say who sees whom
        if getattr(_STATE, "packed", False):
            return None
        return ALL_MASK_ATTENTION_FUNCTIONS[original](*args, **kwargs)

    return attention, mask


def install(model) -> None:
    """Make the attention of `model` (the transformers model `install_scoring` patched)
    "rlft_segments:<its own>" for good, not just for a forward: a gradient-checkpointed layer
    recomputes its forward during the backward, outside any block of code a forward ran in. The
    implementation name is not saved with the model (config.json keeps none). Raises ValueError for
    an attention implementation it cannot wrap (eager, whose function each model file defines for
    itself: load the model with sdpa)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for config in _configs(model):
        current = config._attn_implementation
        if current is None or current.startswith(IMPLEMENTATION):
            continue
        if current not in ALL_ATTENTION_FUNCTIONS or current not in ALL_MASK_ATTENTION_FUNCTIONS:
            raise ValueError(f"packed scoring wraps a registered attention implementation (sdpa, "
                             f"flash_attention_2, flex_attention), not {current!r}: load the model "
                             "with attn_implementation='sdpa'")
        name = f"{IMPLEMENTATION}:{current}"
        attention, mask = _delegating(current)
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, mask)
        config._attn_implementation = name


@contextlib.contextmanager
def packed_forward():
    """For the block (this thread): the forward is a packed one, so masks are not built."""
    before = getattr(_STATE, "packed", False)
    _STATE.packed = True
    try:
        yield
    finally:
        _STATE.packed = before


def _configs(model) -> list:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]
