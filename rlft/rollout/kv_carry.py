"""Partial rollouts' carried rows keep their KV cache between windows with transformers' generate, in the
throughput mode (in-flight weight updates whenever weights arrive; docs/async.md, "Partial rollouts").

Without it every window prefills each carried row again (its prompt and tokens so far), under the weights
the producer holds then. In the throughput mode a row already goes on, inside a window, on keys and values
older weights computed (in-flight semantics, each token recording the version that drew it), so between
windows it may as well: a row cut by a window keeps its slice of the window's cache, and the next window
naming the row with a prefix one token longer than what was cached (the token the window sampled last,
never fed) starts from it. Rows without a kept cache (new rows, or rows whose prefix changed: a tool's
output appended) are prefilled together in one forward; the caches are then left-padded to one length,
and generate feeds each row's last token as its first decode step. The same scheme as a colocated vLLM
engine's kept requests (rlft/rollout/vllm_steps.py), which carry their KV cache in the engine.

Only where every layer's cache is transformers' plain DynamicLayer (no sliding-window or linear-attention
layers); elsewhere the rows are prefilled again. A Mixture-of-Experts policy's routes (routing replay) are
laid out from the window's forwards by `carried_routes`: the prefill of the rows without a kept cache, then
generate's steps, the first reading each prefix's last token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rlft.data.prompts import left_pad


class KVCarry:
    """Row name -> (tokens cached, per layer (keys, values) [heads, tokens, dim]) of rows cut by a window."""

    def __init__(self):
        self.rows: dict = {}

    def cache_for(self, model, prefixes: list[list[int]], names: list, pad_id: int, keyword: str, device):
        """(a DynamicCache of every prefix but its last token, each row right-aligned, or None; per row
        whether it went on from its kept cache). Rows without one are prefilled here."""
        hits = [name in self.rows and self.rows[name][0] == len(prefix) - 1
                for name, prefix in zip(names, prefixes)]
        kept = {name: self.rows[name][1] for name, hit in zip(names, hits) if hit}
        self.rows = {}
        if not kept or min(len(p) for p in prefixes) < 2:
            return None, [False] * len(prefixes)
        per_row = [kept[name] if hit else None for name, hit in zip(names, hits)]
        missing = [i for i, hit in enumerate(hits) if not hit]
        if missing:
            prefilled = _prefill(model, [prefixes[i][:-1] for i in missing], pad_id, keyword, device)
            if prefilled is None:
                return None, [False] * len(prefixes)
            for i, layers in zip(missing, prefilled):
                per_row[i] = layers
        width = max(len(p) for p in prefixes) - 1
        cache = DynamicCache(config=model.config)
        for index in range(len(per_row[0])):  # each layer: every row's keys and values, left-padded
            keys, values = (torch.stack([F.pad(row[index][part], (0, 0, width - row[index][part].shape[1], 0))
                                         for row in per_row]) for part in (0, 1))
            cache.update(keys, values, index)
        return cache, hits

    def keep(self, cache, names: list, prefixes: list[list[int]], counts: list[int],
             finished: list[bool]) -> None:
        """After a window: each row it cut keeps the cache of its prefix and its new tokens but the last."""
        if not plain(cache):
            return
        for r, (name, prefix, count, done) in enumerate(zip(names, prefixes, counts, finished)):
            if done:
                continue
            tokens = len(prefix) + count - 1
            self.rows[name] = (tokens, [(layer.keys[r, :, -tokens:].clone(),
                                         layer.values[r, :, -tokens:].clone()) for layer in cache.layers])


def plain(cache) -> bool:
    return cache is not None and bool(getattr(cache, "layers", None)) and all(
        type(layer) is DynamicLayer for layer in cache.layers)


@torch.no_grad()
def _prefill(model, prefixes: list[list[int]], pad_id: int, keyword: str, device) -> list | None:
    """Each prefix's per-layer (keys, values) from one forward (None: a cache other than DynamicLayers)."""
    cache = DynamicCache(config=model.config)
    if not plain(cache):
        return None
    ids, mask = (t.to(device) for t in left_pad(prefixes, pad_id))
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded prompts
    model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, logits_to_keep=1,
          **{keyword: cache})
    return [[(layer.keys[r, :, -len(p):], layer.values[r, :, -len(p):]) for layer in cache.layers]
            for r, p in enumerate(prefixes)]


def carried_routes(calls: list[torch.Tensor], prefixes: list[list[int]], hits: list[bool], steps: int):
    """A window that went on from kept caches (`KVCarry.cache_for` gave a cache; `hits` its second answer):
    its recorded forwards `calls` (routing.RouteState.take_calls: the prefill of the rows without a kept
    cache if any, then one per decode step) as (read [N, P, L, k] over the left-padded prefixes, decoded
    [N, steps, L, k]): -1 where this window read nothing (a kept row's cached tokens, the last new token)."""
    rows, width = len(prefixes), max(len(p) for p in prefixes)
    shape = calls[-1].shape[2:]
    read = torch.full((rows, width, *shape), -1, dtype=torch.int16)
    decoded = torch.full((rows, steps, *shape), -1, dtype=torch.int16)
    missing = [i for i, hit in enumerate(hits) if not hit]
    if missing:  # (their prefixes but the last token, left-padded)
        prefill, calls = calls[0], calls[1:]
        for m, i in enumerate(missing):
            tokens = len(prefixes[i]) - 1
            read[i, width - 1 - tokens:width - 1] = prefill[m, prefill.shape[1] - tokens:]
    read[:, width - 1] = calls[0][:, 0]  # the first step feeds each prefix's last token
    for j in range(1, min(steps, len(calls))):
        decoded[:, j - 1] = calls[j][:, 0]  # step j feeds new token j - 1
    return read, decoded
