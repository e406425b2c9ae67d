"""A reward model's pairs scored packed: the chosen and rejected sequences of a micro-batch in one
sequence with no padding, and (`shared_prefix_scoring`) the tokens a pair's two sequences begin with
-- the prompt, most often the whole conversation but its last turn -- held once, both continuations
attending to them with positions continuing from the prefix's end. rlft's segment attention
(rlft/model/packing.py, rlft/core/segments.py)
keeps every sequence from seeing another.

Each sequence's score is the score head at the hidden state of the token the model's own forward
pools: the last token that is not the pad token (transformers' sequence classifiers), the same token
here. So the scores and their gradients are those of the padded batch, to float rounding; the first
packed batch of a run is checked against the padded one (eval mode, random state untouched; on every
process, which share the verdict) and padding stays, said once, where they differ (an error with
`padding_free: true`).

Pairs of one short prompt and two answers of different lengths pad to the longest of the
micro-batch; a long shared prompt is computed twice per pair padded, once packed.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch

from rlft.core import segments
from rlft.core.segments import Block
from rlft.errors import ConfigError
from rlft.model.packing import install, packed_forward
from rlft.train.update.rollout_logprobs import (
    MIN_BLOCK_TOKENS,  # GRPO's rule: shorter blocks cost more in calls than padding
)


@dataclass
class PackedPairs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    blocks: list[Block]  # tile [0, T)
    # [2B] where in [0, T) each sequence's pooled token is (chosen rows, then rejected)
    pooled: torch.Tensor
    padded_tokens: int  # what the padded batch computes

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]


def _shared(a: list[int], b: list[int]) -> int:
    """Tokens the two sequences begin with, leaving each at least one of its own."""
    limit = min(len(a), len(b)) - 1
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _pooled_index(row: list[int], pad_id: int | None) -> int:
    """The token a sequence classifier pools: the last that is not the pad token (0 if every one
    is)."""
    for j in range(len(row) - 1, -1, -1):
        if row[j] != pad_id:
            return j
    return 0


def pack_pairs(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int | None,
               share: bool = True) -> PackedPairs:
    """A preference batch (chosen rows then rejected rows, [2B, L]) packed (module docstring)."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
    half = len(rows) // 2
    ids: list[int] = []
    positions: list[int] = []
    blocks: list[Block] = []
    pooled = [0] * len(rows)
    for i in range(half):
        pair = (i, half + i)
        n = _shared(rows[i], rows[half + i]) if share else 0
        prefix_start = len(ids)
        if n:
            blocks.append(Block(prefix_start, n))
            ids += rows[i][:n]
            positions += range(n)
        for r in pair:
            own = rows[r][n:]
            start = len(ids)
            blocks.append(Block(start, len(own), prefix_start, n) if n else Block(start, len(own)))
            ids += own
            positions += range(n, n + len(own))
            j = _pooled_index(rows[r], pad_id)
            pooled[r] = prefix_start + j if j < n else start + j - n
    tensor = functools.partial(torch.tensor, dtype=torch.long, device=input_ids.device)
    return PackedPairs(tensor(ids)[None], tensor(positions)[None], blocks, tensor(pooled),
                       input_ids.numel())


def packing_pays(packed: PackedPairs, one_call: bool) -> bool:
    """At most half the padded batch's tokens, and (attention looping over blocks) blocks of
    MIN_BLOCK_TOKENS tokens on average."""
    return 2 * packed.tokens <= packed.padded_tokens and (
        one_call or packed.tokens >= MIN_BLOCK_TOKENS * len(packed.blocks))


def install_pair_scoring(model) -> None:
    """Give the sequence classifier inside `model` (wrapped by peft, DDP, FSDP2 or DeepSpeed, or
    not) the `rlft_pairs=` forward: the backbone over a packed sequence, the score head at each
    sequence's pooled token. Idempotent."""
    from transformers import PreTrainedModel

    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)
    if getattr(inner, "_rlft_pairs", False):
        return
    if not isinstance(getattr(inner, "score", None), torch.nn.Module):
        raise ValueError(f"{type(inner).__name__} has no `score` head to apply to packed hidden "
                         "states")

    @functools.wraps(type(inner).forward)
    def forward(self, *args, rlft_pairs: PackedPairs | None = None, **kwargs):
        if rlft_pairs is None:
            return type(self).forward(self, *args, **kwargs)
        backbone = getattr(self, self.base_model_prefix)
        hidden = backbone(input_ids=rlft_pairs.input_ids, position_ids=rlft_pairs.position_ids,
                          rlft_blocks=rlft_pairs.blocks, use_cache=False).last_hidden_state
        # [2B, labels]
        return types.SimpleNamespace(logits=self.score(hidden[0, rlft_pairs.pooled]))

    inner.forward = types.MethodType(forward, inner)
    inner._rlft_pairs = True
    install(inner)


class PairPacking:
    """Whether and how the reward trainer packs a batch: `padding_free` None (where it pays), True
    (always), False (never); checked exact for the model at the first batch, on every process alike
    (a sharded engine's forwards gather on all of them), the verdict the same everywhere."""

    def __init__(self, args, pad_id: int | None, messages=None, accelerator=None):
        self.args, self.pad_id, self.messages, self.accelerator = args, pad_id, messages, accelerator
        self.checked: bool | None = None  # packed == padded for this model (None: not checked yet)
        self.gap = 0.0

    def plan(self, model, batch: dict, dtype: torch.dtype | None = None) -> PackedPairs | None:
        """The packed batch, or None to pad; `dtype`: what the forward computes in (autocast's, else
        the weights')."""
        if self.args.padding_free is False or self.checked is False:
            return None
        packed = pack_pairs(batch["input_ids"], batch["attention_mask"], self.pad_id,
                            self.args.shared_prefix_scoring)
        weight = next(model.parameters())
        dtype = dtype or weight.dtype
        if self.checked is None:
            self.checked = self._settle(self._check(model, batch, packed, dtype))
            if not self.checked:
                return None
        if self.args.padding_free is None:
            if not packing_pays(packed, segments.one_call(weight.device, dtype)):
                return None
        return packed

    def _agreed(self, ok: bool) -> bool:
        acc = self.accelerator
        if acc is None or acc.num_processes == 1:
            return ok
        return bool(acc.reduce(torch.tensor(float(ok), device=acc.device), "min").item())

    @torch.no_grad()
    def _check(self, model, batch: dict, packed: PackedPairs, dtype: torch.dtype) -> str | None:
        """None when the packed scores of this batch are the padded ones (to the dtype's rounding),
        else why not."""
        error, training, device = None, model.training, batch["input_ids"].device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model.eval()
            try:
                install_pair_scoring(model)
                padded = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                packed_scores = run_packed(model, packed)
                gap = (padded.float() - packed_scores.float()).abs().max().item()
                scale = max(1.0, padded.float().abs().max().item())
            except (ValueError, RuntimeError, TypeError, AttributeError) as err:
                gap, scale, error = float("inf"), 1.0, err
            finally:
                model.train(training)
        if gap <= (0.05 if dtype in (torch.float16, torch.bfloat16) else 1e-4) * scale:
            self.gap = gap
            return None
        return f"packing failed: {error}" if error is not None else \
            f"packed and padded scores differ by {gap:.3g}"

    def _settle(self, why: str | None) -> bool:
        """The verdict every process shares, said once (an error when padding_free is true)."""
        ok = self._agreed(why is None)
        if ok:
            if self.messages is not None:
                self.messages.info(f"packed pair scoring checked (scores within {self.gap:.2g} of "
                                   f"padded); attention kernel: {segments.LAST_KERNEL}")
            return True
        why = why or "another process's check failed"
        if self.args.padding_free:
            raise ConfigError(f"padding_free=True: {why} for this model; set padding_free: false")
        if self.messages is not None:
            self.messages.warn(f"packed pair scoring is off for this model: {why}; batches are "
                               "padded")
        return False


def run_packed(model, packed: PackedPairs) -> torch.Tensor:
    """Scores [2B, labels] of a packed batch through `model` as wrapped (DDP, FSDP2, DeepSpeed)."""
    with packed_forward():
        return model(input_ids=packed.input_ids, position_ids=packed.position_ids, rlft_pairs=packed).logits

