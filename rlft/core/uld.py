"""Cross-tokenizer distillation: the Universal Logit Distillation loss (Boizard et al. 2024, "Towards
Cross-Tokenizer Distillation: the Universal Logit Distillation Loss for LLMs", arXiv:2402.12030),
with the byte alignment and token merging of TRL's GOLD (General On-policy Logit Distillation).

Two tokenizers cut one completion text differently, and their vocabularies share no index, so the
divergence of rlft/core/distill.py (token by token, one vocabulary) does not apply. ULD compares what
survives a relabelling: the sorted probability vectors. For distributions p (student, V_s entries)
and q (teacher, V_t entries), each sorted in decreasing order and padded with zeros to
V = max(V_s, V_t),

    ULD(p, q) = sum_{i=1..V} | p_(i) - q_(i) |

(the paper's closed form of the Wasserstein-1 distance under a uniform cost).

Alignment (GOLD's "extended" ULD). Each completion token covers a span of the completion text's UTF-8
bytes; walking both token lists, a group closes where both tokenizers end a token at the same byte.
Groups pair a run of student tokens with a run of teacher tokens covering the same bytes. A group of
k tokens t_1..t_k is one distribution over the vocabulary, by the chain rule with the other tokens
fixed at what was generated:

    "observed":  P(v) = p_1(v) * prod_{j=2..k} p_j(t_j)     (the first token varies)
    "bayesian":  P(v) = p_k(v) * prod_{j=1..k-1} p_j(t_j)   (the last token varies)

where p_j is the distribution that predicted t_j (each scalar clamped at 1e-8, as TRL). Positional
ULD (`use_extended_uld=False`, the paper's) pairs the i-th student token with the i-th teacher token.

Hybrid (GOLD's `uld_use_hybrid_loss`): tokens whose strings exist in both vocabularies are compared
entry by entry with the generalized JSD at `beta` (rlft/core/distill.py's, on the unnormalised merged
probabilities clamped at 1e-8), the rest by ULD on their sorted values; the two are weighted by fixed
weights or by the matched share of the teacher's vocabulary.

Each group's distance is differentiable in the student's hidden states and head; the teacher has no
gradient. Groups are processed a tile at a time under activation checkpointing, so [G, V] is never
held for all groups at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from rlft.core.distill import Head, divergence_terms

EPS = 1e-8
STRATEGIES = ("observed", "bayesian")


def align_by_byte_ends(s_ends: list[int], t_ends: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Pair runs of student and teacher tokens covering the same bytes: `s_ends` / `t_ends` are each
    token's end offset in the shared text (non-decreasing). Returns the groups' token indices, one list
    per side (a trailing unmatched run on either side is a last group, possibly empty on the other)."""
    s_groups: list[list[int]] = []
    t_groups: list[list[int]] = []
    s = t = s_start = t_start = 0
    while s < len(s_ends) and t < len(t_ends):
        if s_ends[s] < t_ends[t]:
            s += 1
        elif s_ends[s] > t_ends[t]:
            t += 1
        else:
            s, t = s + 1, t + 1
            s_groups.append(list(range(s_start, s)))
            t_groups.append(list(range(t_start, t)))
            s_start, t_start = s, t
    if s < len(s_ends) or t < len(t_ends):
        s_groups.append(list(range(s_start, len(s_ends))))
        t_groups.append(list(range(t_start, len(t_ends))))
    return s_groups, t_groups


def positional_groups(n_s: int, n_t: int) -> tuple[list[list[int]], list[list[int]]]:
    """The paper's pairing: the i-th token of each side, for the shorter side's length."""
    return [[i] for i in range(min(n_s, n_t))], [[i] for i in range(min(n_s, n_t))]


@dataclass
class Pairs:
    """G aligned groups over flattened student positions (n_s) and teacher positions (n_t): for each
    side the position whose whole distribution is kept (`*_base` [G]) and the positions whose sampled
    token's probability multiplies it (`*_scalar` [M]) with their group (`*_scalar_group` [M]);
    `s_size` [G]: student tokens per group; `s_group` [n_s]: each student position's group (-1:
    none)."""
    s_base: torch.Tensor
    t_base: torch.Tensor
    s_scalar: torch.Tensor
    s_scalar_group: torch.Tensor
    t_scalar: torch.Tensor
    t_scalar_group: torch.Tensor
    s_size: torch.Tensor
    s_group: torch.Tensor

    def __len__(self) -> int:
        return int(self.s_base.shape[0])


def build_pairs(rows: list[tuple[list[list[int]], list[list[int]]]], s_starts: list[int], t_starts: list[int],
                n_s: int, strategy: str) -> Pairs:
    """Pairs from each row's (student groups, teacher groups) of row-local token indices; `s_starts` /
    `t_starts`: each row's first position in the flattened positions. Groups empty on either side are
    left out (nothing to compare: GOLD drops them too)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"uld_token_merge_strategy must be one of {STRATEGIES}, got {strategy!r}")
    cols: dict[str, list[int]] = {k: [] for k in ("sb", "tb", "ss", "ssg", "ts", "tsg", "size")}
    s_group = [-1] * n_s
    for (s_groups, t_groups), s0, t0 in zip(rows, s_starts, t_starts, strict=True):
        for sg, tg in zip(s_groups, t_groups, strict=True):
            if not sg or not tg:
                continue
            g = len(cols["sb"])
            for side, group, start in (("s", sg, s0), ("t", tg, t0)):
                base = group[0] if strategy == "observed" else group[-1]
                cols[f"{side}b"].append(start + base)
                others = [start + i for i in group if i != base]
                cols[f"{side}s"] += others
                cols[f"{side}sg"] += [g] * len(others)
            cols["size"].append(len(sg))
            for i in sg:
                s_group[s0 + i] = g
    t = {k: torch.tensor(v, dtype=torch.long) for k, v in cols.items()}
    return Pairs(t["sb"], t["tb"], t["ss"], t["ssg"], t["ts"], t["tsg"], t["size"],
                 torch.tensor(s_group, dtype=torch.long))


def head_logprobs(hidden: torch.Tensor, head: Head, temperature: float) -> torch.Tensor:
    """log softmax of a head's logits [t, V] in float32 (float64 stays), differentiably: logit scale,
    softcapping, temperature, and only the vocabulary's rows of a padded head."""
    weight = head.weight if head.vocab is None else head.weight[:head.vocab]
    bias = head.bias if head.bias is None or head.vocab is None else head.bias[:head.vocab]
    z = hidden.to(weight.dtype) @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.to(torch.promote_types(z.dtype, torch.float32)) * head.scale
    if head.softcap:
        z = head.softcap * torch.tanh(z / head.softcap)
    return torch.log_softmax(z / temperature, dim=-1)


def sorted_l1(p_s: torch.Tensor, p_t: torch.Tensor) -> torch.Tensor:
    """ULD [g] of probability rows p_s [g, V_s] and p_t [g, V_t] (module docstring): sorted in decreasing
    order, the shorter padded with zeros."""
    a = p_s.sort(dim=-1, descending=True).values
    b = p_t.sort(dim=-1, descending=True).values
    m = min(a.shape[-1], b.shape[-1])
    out = (a[:, :m] - b[:, :m]).abs().sum(-1)
    return out + a[:, m:].sum(-1) + b[:, m:].sum(-1)


@dataclass(frozen=True)
class Hybrid:
    """GOLD's hybrid loss: `student_ids` [K] / `teacher_ids` [K] the vocabulary entries with one string
    on both sides (matched pairwise), weights of the matched JSD and of the unmatched ULD, `beta` of
    the JSD."""
    student_ids: torch.Tensor
    teacher_ids: torch.Tensor
    matched_weight: float
    unmatched_weight: float
    beta: float


def matched_vocabulary(student_vocab: dict[str, int], teacher_vocab: dict[str, int]) -> tuple[list, list]:
    """(student ids, teacher ids) of the token strings both vocabularies hold, in teacher-id order."""
    pairs = sorted((t, student_vocab[s]) for s, t in teacher_vocab.items() if s in student_vocab)
    return [s for _, s in pairs], [t for t, _ in pairs]


def hybrid_distance(p_s: torch.Tensor, p_t: torch.Tensor, hybrid: Hybrid) -> torch.Tensor:
    """[g]: matched_weight x JSD over the matched entries + unmatched_weight x ULD over the rest."""
    s_ids, t_ids = hybrid.student_ids.to(p_s.device), hybrid.teacher_ids.to(p_s.device)
    matched = divergence_terms(p_s[:, s_ids].clamp_min(EPS).log(), p_t[:, t_ids].clamp_min(EPS).log(),
                               hybrid.beta).sum(-1)
    s_rest = torch.ones(p_s.shape[-1], dtype=torch.bool, device=p_s.device)
    t_rest = torch.ones(p_t.shape[-1], dtype=torch.bool, device=p_s.device)
    s_rest[s_ids], t_rest[t_ids] = False, False
    unmatched = sorted_l1(p_s[:, s_rest], p_t[:, t_rest]) if s_rest.any() and t_rest.any() \
        else torch.zeros_like(matched)
    return hybrid.matched_weight * matched + hybrid.unmatched_weight * unmatched


def _merged(logp_base: torch.Tensor, scalar_logp: torch.Tensor) -> torch.Tensor:
    """Merged group probabilities [g, V] from the base rows' log-probs and each group's summed log
    scalars [g]."""
    return (logp_base + scalar_logp[:, None]).exp()


def _tile_distance(hidden_s, weight, bias, scalar_s, hidden_t, scalar_t, student: Head, teacher: Head,
                   temperatures: tuple[float, float], hybrid: Hybrid | None) -> torch.Tensor:
    head_s = Head(weight, bias, student.scale, student.softcap, vocab=student.vocab)
    p_s = _merged(head_logprobs(hidden_s, head_s, temperatures[0]), scalar_s)
    with torch.no_grad():
        p_t = _merged(head_logprobs(hidden_t, teacher, temperatures[1]), scalar_t)
    return sorted_l1(p_s, p_t) if hybrid is None else hybrid_distance(p_s, p_t, hybrid)


def _group_scalars(token_logps: torch.Tensor, positions: torch.Tensor, groups: torch.Tensor,
                   count: int) -> torch.Tensor:
    """Each group's sum of log max(p_j(t_j), 1e-8) over its scalar positions [count]."""
    out = token_logps.new_zeros(count)
    if positions.numel():
        clamped = token_logps[positions].clamp_min(math.log(EPS))
        out = out.index_add(0, groups.to(out.device), clamped)
    return out


def uld_distance(hidden_s: torch.Tensor, student: Head, token_logps_s: torch.Tensor, hidden_t: torch.Tensor,
                 teacher: Head, token_logps_t: torch.Tensor, pairs: Pairs,
                 temperatures: tuple[float, float] = (1.0, 1.0), hybrid: Hybrid | None = None,
                 tile: int = 64) -> torch.Tensor:
    """Each group's distance [G] (ULD, or the hybrid), from the student's hidden states [n_s, H_s] and
    head (differentiable, as are `token_logps_s` [n_s]: each position's log-prob of its sampled token
    at the student's temperature) and the teacher's [n_t, H_t], [n_t] (no gradient); `temperatures`:
    (student's, teacher's)."""
    device = hidden_s.device
    count = len(pairs)
    if count == 0:
        return hidden_s.sum() * 0.0 + hidden_s.new_zeros(0, dtype=torch.float32)
    scalar_s = _group_scalars(token_logps_s, pairs.s_scalar.to(device), pairs.s_scalar_group, count)
    scalar_t = _group_scalars(token_logps_t.detach(), pairs.t_scalar.to(device), pairs.t_scalar_group, count)
    s_base, t_base = pairs.s_base.to(device), pairs.t_base.to(device)
    parts = []
    for i in range(0, count, tile):
        sl = slice(i, i + tile)
        parts.append(checkpoint(_tile_distance, hidden_s[s_base[sl]], student.weight, student.bias,
                                scalar_s[sl], hidden_t[t_base[sl]].detach(), scalar_t[sl], student, teacher,
                                temperatures, hybrid, use_reentrant=False))
    return torch.cat(parts)


@dataclass
class ULDPlan:
    """What the student's scoring forward needs besides the teacher's hidden states and head
    (rlft/model/scoring.py): the groups, the teacher's log-prob of each of its tokens [n_t],
    (student's, teacher's) temperatures, (distillation, cross-entropy) weights, and the hybrid's
    vocabulary match (None: plain ULD)."""
    pairs: Pairs
    teacher_token_logps: torch.Tensor
    temperatures: tuple[float, float]
    weights: tuple[float, float]
    hybrid: Hybrid | None = None


def spread(distance: torch.Tensor, pairs: Pairs) -> torch.Tensor:
    """Each student position's share [n_s] of its group's distance (distance / the group's student
    tokens; 0 at positions in no group): summed over positions, the groups' total."""
    group = pairs.s_group.to(distance.device)
    inside = group >= 0
    out = distance.new_zeros(group.shape[0])
    if inside.any():
        share = distance / pairs.s_size.to(distance.device, distance.dtype)
        out = out.masked_scatter(inside, share[group[inside]])
    return out
