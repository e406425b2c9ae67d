"""Scoring a policy's completion tokens without `[B, T, V]` logits: the model's forward, asked with
`rlft_score=`, runs the backbone and turns the hidden states of the completion positions into
per-token log-probs (and entropy) tile by tile through the LM head (rlft/core/fused_head.py).
Without `rlft_score` the forward is the original one, so generation and everything else is
unchanged.

The forward is patched on the transformers model itself (before or after peft wraps it), so every
wrapper calls it as usual: DDP (gradient sync), FSDP2 (unsharding hooks) and DeepSpeed go through
their own forward. The LM head is used as a plain weight when it is an `nn.Linear` (an FSDP2 DTensor
weight is made whole for the tile loop, with its gradient sharded back; a ZeRO-3 partitioned one is
gathered around the forward and the backward tile loops); a head that peft adapts is called as a
module, one checkpointed tile at a time, so its adapters apply.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from rlft.core.distill import Head, tiled_divergence
from rlft.core.fused_head import fused_kept_logprobs, kept_lse, tile_positions
from rlft.core.loss_grads import ClosedFormGrad
from rlft.core.self_distill import SelfDistillMode, topk_divergence
from rlft.core.sparse_distill import sparse_divergence
from rlft.core.uld import ULDPlan, spread, uld_distance
from rlft.model.packing import Packed, install, pack_rows, packed_forward
from rlft.model.routing import replay


@dataclass
class Score:
    """What `model(..., rlft_score=Score(...))` scores: `targets` [b, c] (the completion tokens, the
    last c positions of the input), `mask` [b, c] (which of them are real), at `temperature`."""

    targets: torch.Tensor
    mask: torch.Tensor
    temperature: float = 1.0
    entropy: bool = False  # also the entropy of each position's distribution
    router_loss: bool = False  # a Mixture-of-Experts policy's load-balancing loss
    tile: int | None = None  # positions per tile (None: sized to the vocabulary)
    # [b, c, K] the token ids a truncating sampler kept at each position (-1 padding): log-probs are
    # then renormalised over them (rlft/core/fused_head.py); None: the full vocabulary
    kept: torch.Tensor | None = None
    # the rows packed into one sequence (rlft/model/packing.py): the hidden states are read where it
    # says
    packed: Packed | None = None
    # distillation: the divergence to a teacher at the scored positions (and the log-probs unless
    # `logps` is False)
    teacher: TeacherStates | None = None
    logps: bool = True
    entropy_grad: bool = False  # the entropy's gradient will be asked for (an entropy bonus)
    # log-probs [b, c] -> the loss's dL/dlog p [b, c], for a loss whose gradient at a token reads
    # that token's log-prob alone: a trainable LM head then forms its gradients in the forward
    # (rlft/core/fused_head.py)
    loss_grad: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class TeacherStates:
    """A teacher's view of the scored positions, in the order the student's are read (the completion
    mask's), and the divergence's beta: a local teacher's last hidden states [n, H_t] (no gradient)
    and LM head (rlft/core/distill.py), or a served teacher's support ids and log-probs [n, K] (-1
    padding) and whether the rest of the vocabulary is one more bucket
    (rlft/core/sparse_distill.py)."""

    hidden: torch.Tensor | None
    head: Head | None
    beta: float
    ids: torch.Tensor | None = None
    logps: torch.Tensor | None = None
    tail: bool = True
    # self-distillation (rlft/core/self_distill.py): the objective taken against this teacher; None:
    # the generalized JSD over the vocabulary (or a served teacher's support)
    mode: SelfDistillMode | None = None
    # a teacher with another tokenizer (rlft/core/uld.py): `hidden` are at its own completion positions
    uld: ULDPlan | None = None


@dataclass
class Scored:
    logps: torch.Tensor  # [b, c], 0 at masked positions
    entropy: torch.Tensor | None  # [b, c]
    aux_loss: torch.Tensor | None
    # [b, c] log of the mass the sampler kept (with `kept`)
    kept_logmass: torch.Tensor | None = None
    tokens: int = 0  # tokens the backbone ran on: padding included, a packed shared prompt once
    divergence: torch.Tensor | None = None  # [b, c] with a teacher: each token's divergence to it
    # [b, c] with a teacher: its entropy at each position
    teacher_entropy: torch.Tensor | None = None
    # [b, c] a teacher's log-prob of each scored token (self-distillation's sampled_token mode)
    teacher_logps: torch.Tensor | None = None


def head_settings(config) -> tuple[float, float | None]:
    """(logit scale, final-logit softcap) as the model's own forward applies them before the
    softmax."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        scale = getattr(text, name, None) if scale is None else scale
    if scale is None and getattr(text, "logits_scaling", None):  # Granite divides by it
        scale = 1.0 / text.logits_scaling
    return (1.0 if scale is None else float(scale)), getattr(text, "final_logit_softcapping", None)


def install_scoring(model) -> None:
    """Give `model` (a transformers causal LM, or a peft model around one) the `rlft_score=`
    forward. Idempotent."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(model, "_rlft_scoring", False):
        return

    @functools.wraps(type(model).forward)  # generate() checks its kwargs against this signature
    def forward(self, *args, rlft_score: Score | None = None, **kwargs):
        # the class's forward: a deep copy of the model (a reference) calls its own
        if rlft_score is None:
            return type(self).forward(self, *args, **kwargs)
        return score_forward(self, rlft_score, *args, **kwargs)

    model.forward = types.MethodType(forward, model)
    model._rlft_scoring = True


def _backbone(model):
    """The causal LM's decoder stack (what its forward runs before the LM head). Llama 4's text-only
    model names `language_model` as its prefix (its multimodal parent's) but holds `model`."""
    found = getattr(model, model.base_model_prefix, None)
    return found if found is not None else model.model


def score_forward(model, score: Score, *args, **kwargs) -> Scored:
    kwargs.pop("logits_to_keep", None)
    kwargs["use_cache"] = False
    if score.router_loss:
        kwargs["output_router_logits"] = True
    backbone = _backbone(model)
    outputs = backbone(*args, **kwargs)
    mask, packed = score.mask.bool(), score.packed
    if packed is None:
        width = score.targets.shape[1]
        # [b, c, H]: position t predicts token t + 1
        hidden = outputs.last_hidden_state[:, -(width + 1):-1]
        hidden, targets = hidden[mask], score.targets[mask]  # [n, H], [n]
        kept = None if score.kept is None else score.kept[mask]  # [n, K]
    else:  # one packed sequence: the positions that predict each scored token
        hidden, targets, kept = outputs.last_hidden_state[0, packed.predict], packed.targets, packed.kept
    scale, softcap = head_settings(model.config)
    head = model.get_output_embeddings()
    def place(values):  # [n] -> [b, c], 0 elsewhere; an all-masked batch stays connected
        full = hidden.new_zeros(mask.shape, dtype=values.dtype)
        return full.masked_scatter(mask, values) if packed is None else \
            full.index_put((packed.rows, packed.cols), values)

    predict = None if score.loss_grad is None else _predictor(score.loss_grad, mask, packed, place)

    if score.teacher is not None and score.teacher.uld is not None:
        return _uld_scored(head, hidden, targets, score, scale, softcap, place)
    divergence = teacher_entropy = teacher_logps = None
    sampled = score.teacher is not None and score.teacher.mode is not None \
        and score.teacher.mode.name == "sampled_token"
    if sampled:
        teacher_logps = place(_teacher_token_logps(score.teacher, targets, score))
    elif score.teacher is not None:
        # [n] each
        divergence, entropy, teacher_entropy = _divergence(head, hidden, score, scale, softcap)
        divergence, teacher_entropy = place(divergence), place(teacher_entropy).detach()
        student_entropy = place(entropy).detach()
        if not score.logps:
            return Scored(torch.zeros_like(student_entropy), student_entropy, None, divergence=divergence,
                          teacher_entropy=teacher_entropy)
    logps, entropy, logmass = _head_scores(model, head, hidden, targets, kept, score, scale, softcap,
                                           predict)  # [n] each
    logps = place(logps)
    if entropy is not None:
        entropy = place(entropy)
    elif divergence is not None:  # the divergence's pass measured it
        entropy = student_entropy
    logmass = None if kept is None else place(logmass).detach()
    aux = _router_loss(model, outputs, kwargs.get("attention_mask")) if score.router_loss else None
    return Scored(logps, entropy, aux, logmass, divergence=divergence, teacher_entropy=teacher_entropy,
                  teacher_logps=teacher_logps)


def _predictor(loss_grad, mask: torch.Tensor, packed: Packed | None, place) -> Callable:
    """(log-probs [n] so far, a tile's rows) -> the loss's dL/dlog p [t] at those rows, in the order the
    head scores (Score.loss_grad). A closed form (rlft/core/loss_grads.py) reads its per-token constants
    at the scored positions once and evaluates the tile's rows alone (`closed_form`: no autograd, so a
    GPU uses it too); otherwise the loss's own code runs on every log-prob, read back where `place`
    put them."""
    def scored(grid: torch.Tensor) -> torch.Tensor:  # [b, c] -> [n]
        return grid[mask] if packed is None else grid[packed.rows, packed.cols]

    if isinstance(loss_grad, ClosedFormGrad):
        constants = loss_grad.build(mask.shape[1]).select(scored)

        def closed(values: torch.Tensor, rows: slice) -> torch.Tensor:
            return constants.select(lambda t: t[rows])(values[rows])
        closed.closed_form = True
        return closed
    return lambda values, rows: scored(loss_grad(place(values)))[rows]


def _uld_scored(head, hidden, targets, score: Score, scale: float, softcap: float | None, place) -> Scored:
    """Cross-tokenizer distillation's per-token loss [b, c]: each group's ULD distance (rlft/core/uld.py)
    shared among its student tokens, times the distillation weight, plus the cross-entropy weight
    times -log p of each token (at temperature 1); the student's entropy; no teacher entropy."""
    plain = _plain_weight(head, sharded=True)
    if plain is None:
        raise ValueError("distillation reads the student's LM head as a weight; an LM head adapted "
                         "by peft is not supported: leave lm_head out of the LoRA target_modules")
    weight, bias = plain
    teacher, plan = score.teacher, score.teacher.uld
    whole = _gathered(weight, bias)
    logps, entropy, _ = fused_kept_logprobs(hidden.to(weight.dtype), weight, targets, None, bias,
                                            plan.temperatures[0], scale, softcap, True, score.tile, whole)
    distance = uld_distance(hidden, Head(weight, bias, scale, softcap, whole), logps, teacher.hidden,
                            teacher.head, plan.teacher_token_logps, plan.pairs, plan.temperatures,
                            plan.hybrid)
    per_token = plan.weights[0] * spread(distance, plan.pairs)
    if plan.weights[1]:
        ce = logps if plan.temperatures[0] == 1 else fused_kept_logprobs(
            hidden.to(weight.dtype), weight, targets, None, bias, 1.0, scale, softcap, tile=score.tile,
            whole=whole)[0]
        per_token = per_token - plan.weights[1] * ce
    entropy = place(entropy).detach()
    return Scored(torch.zeros_like(entropy), entropy, None, divergence=place(per_token))


@torch.no_grad()
def _teacher_token_logps(teacher: TeacherStates, targets: torch.Tensor, score: Score) -> torch.Tensor:
    """The teacher's log-prob [n] of each scored token, at the student's temperature."""
    head = teacher.head
    return fused_kept_logprobs(teacher.hidden.to(head.weight.dtype), head.weight, targets, None, head.bias,
                               score.temperature, head.scale, head.softcap, tile=score.tile,
                               whole=head.whole)[0]


def _plain_weight(head, sharded: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The head's weight and bias when it can be used as a plain matrix (not peft-adapted); an FSDP2
    DTensor weight made whole (differentiably: its gradient is sharded back). `sharded`: FSDP2's own
    subclass of the linear layer too (a peft layer is no nn.Linear)."""
    if not (isinstance(head, torch.nn.Linear) if sharded else type(head) is torch.nn.Linear):
        return None
    weight, bias = head.weight, head.bias
    if hasattr(weight, "full_tensor"):  # torch.distributed.tensor.DTensor
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    return weight, bias


def _gathered(*params):
    """A ZeRO-3 partitioned weight made whole for the tile loops (forward and backward), unless
    DeepSpeed holds it whole already (a head tied to the embeddings, in use); a no-op without
    ZeRO-3."""
    params = [p for p in params if p is not None and hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext

    def whole():
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        missing = [p for p in params if p.ds_status != ZeroParamStatus.AVAILABLE]
        return (deepspeed.zero.GatheredParameters(missing, modifier_rank=None) if missing
                else contextlib.nullcontext())

    return whole


def _head_scores(model, head, hidden, targets, kept, score: Score, scale: float, softcap: float | None,
                 predict=None):
    """(log-probs [n], entropy [n] or None, log kept mass [n]). `predict`: ([n] log-probs, a tile's
    rows) -> the loss's dL/dlog p there (`_predictor`)."""
    # FSDP2's subclass of the head too, while its weight is the whole parameter FSDP unsharded for this
    # forward (its gradient is FSDP's to reduce); a weight still in shards takes the module path
    plain = None if hasattr(head.weight, "full_tensor") else _plain_weight(head, sharded=True)
    if plain is not None:
        weight, bias = plain
        return fused_kept_logprobs(hidden.to(weight.dtype), weight, targets, kept, bias, score.temperature,
                                   scale, softcap, score.entropy, score.tile, _gathered(weight, bias),
                                   score.entropy_grad, predict)
    return _module_scores(head, hidden, targets, kept, score, scale, softcap)


def _divergence(head, hidden, score: Score, scale: float, softcap: float | None):
    """(D [n], the student's entropy [n], the teacher's [n]) to the teacher's states, tile by tile
    (rlft/core/distill.py; a served teacher's: rlft/core/sparse_distill.py)."""
    plain = _plain_weight(head, sharded=True)
    if plain is None:
        raise ValueError("distillation reads the student's LM head as a weight; an LM head adapted "
                         "by peft is not supported: leave lm_head out of the LoRA target_modules")
    weight, bias = plain
    teacher = score.teacher
    student = Head(weight, bias, scale, softcap, _gathered(weight, bias))
    if teacher.mode is not None and teacher.mode.name == "topk_logits":  # on the student's top-k
        mode = teacher.mode
        return topk_divergence(hidden.to(weight.dtype), teacher.hidden, student, teacher.head, mode.topk,
                               teacher.beta, score.temperature, mode.tail, score.tile)
    if teacher.ids is not None:  # a served teacher: its top-k log-probs
        return sparse_divergence(hidden.to(weight.dtype), student, teacher.ids, teacher.logps, teacher.beta,
                                 score.temperature, teacher.tail, score.tile)
    return tiled_divergence(hidden.to(weight.dtype), teacher.hidden, student, teacher.head, teacher.beta,
                            score.temperature, score.tile)


@torch.no_grad()
def teacher_states(teacher, ids, mask, position_ids, completion_mask, beta: float) -> TeacherStates:
    """The teacher's hidden states at the positions that predict each real completion token of this
    padded batch (the last `c` columns; completion_mask [b, c]), and its LM head. Its backbone only:
    the teacher's [B, T, V] logits are never formed."""
    # a DeepSpeed inference engine (ZeRO-3) wraps the model
    inner = getattr(teacher, "module", teacher)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    backbone = _backbone(inner)
    # the student as its own teacher: its adapters off, or its EMA weights in
    # (rlft/train/update/self_teacher.py)
    with getattr(teacher, "scoring", contextlib.nullcontext)():
        outputs = backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    width = completion_mask.shape[1]
    hidden = outputs.last_hidden_state[:, -(width + 1):-1][completion_mask.bool()]  # [n, H_t]
    plain = _plain_weight(inner.get_output_embeddings(), sharded=True)
    if plain is None:
        raise ValueError("the teacher's LM head must be a plain linear layer (not adapted by peft)")
    weight, bias = plain
    scale, softcap = head_settings(inner.config)
    # the parameters themselves (read inside the divergence's autograd function: no graph), not
    # detached copies: a ZeRO-3 gather fills the parameter in place
    vocab = getattr(inner, "rlft_vocab_rows", None)  # a padded teacher's vocabulary (distill_objective.py)
    return TeacherStates(hidden, Head(weight, bias, scale, softcap, _gathered(weight, bias), vocab), beta)


def _module_scores(head, hidden, targets, kept, score: Score, scale: float, softcap: float | None):
    """The head called as a module, one checkpointed tile at a time (its [t, V] logits recomputed in
    backward)."""
    tile = score.tile or tile_positions(head.out_features if hasattr(head, "out_features")
                                        else head.weight.shape[0], device=hidden.device)
    parts = [checkpoint(_tile_scores, head, hidden[i:i + tile], targets[i:i + tile],
                        None if kept is None else kept[i:i + tile], score.temperature, scale, softcap,
                        score.entropy, use_reentrant=False) for i in range(0, hidden.shape[0], tile)]
    if not parts:
        empty = hidden.sum(-1).float()
        return empty, (empty if score.entropy else None), empty.detach()
    logps, logmass = torch.cat([p[0] for p in parts]), torch.cat([p[2] for p in parts])
    return logps, (torch.cat([p[1] for p in parts]) if score.entropy else None), logmass


def _tile_scores(head, hidden, targets, kept, temperature, scale, softcap, entropy):
    z = head(hidden)
    z = z.to(torch.promote_types(z.dtype, torch.float32)) * scale  # [t, V] float32 (float64 stays)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    used = lse if kept is None else kept_lse(z, kept, targets, lse)
    picked = z.gather(-1, targets[:, None]).squeeze(-1) - used
    log_probs = z - lse[:, None]
    return picked, (-(log_probs.exp() * log_probs).sum(-1) if entropy else picked), (used - lse).detach()


def _router_loss(model, outputs, attention_mask) -> torch.Tensor:
    """The load-balancing loss the model's own forward computes from its router logits (its module's
    function)."""
    module = sys.modules[type(model).__module__]
    balance = getattr(module, "load_balancing_loss_func", None)
    if balance is None:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as balance
    config = model.config.get_text_config()
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    return balance(outputs.router_logits, experts, config.num_experts_per_tok, attention_mask)


def score_rows(model, rollout, rows, temperature: float = 1.0, entropy: bool = False,
               router_loss: bool = False, tile: int | None = None, pad_to_multiple_of=None,
               packing: str | None = None, teacher=None, beta: float = 1.0,
               with_logps: bool = False, entropy_grad: bool = False,
               loss_grad: Callable[[torch.Tensor], torch.Tensor] | None = None,
               mode: SelfDistillMode | None = None) -> Scored:
    """Per-token log-probs [b, c] of a rollout's completion tokens for `rows` (a slice or an index
    tensor), from a model with `install_scoring`; renormalised over the sampler's kept tokens where
    the rollout carries them (`sampling_kept`). Padded, the batch is cut to its own longest
    completion (c <= C, rounded up to `pad_to_multiple_of` when it is an int) and its longest
    prompt: columns that are padding in every row cost a forward pass and change nothing. `packing`
    "rows" / "prompts": the rows packed into one sequence without padding, prompts shared by rows
    held once with "prompts" (rlft/model/packing.py). With a `teacher` model (same vocabulary) or
    served teacher (its `support`): `Scored.divergence` [b, c], each token's divergence from the
    teacher at `beta` (rlft/core/distill.py), and the student's entropy, instead of log-probs (as
    well, with `with_logps`); padded. `entropy_grad`: the entropy's gradient will be asked for (an
    entropy bonus; rlft/core/fused_head.py). `loss_grad`: the loss's dL/dlog p as a function of the
    log-probs [b, c], for a token-separable loss (Score.loss_grad). `mode`: a self-distillation
    objective against the teacher (rlft/core/self_distill.py; the teacher reads each row's
    `teacher_prompt_ids` where the rollout has them)."""
    completion_mask = rollout.completion_mask[rows]
    width = max(int(completion_mask.sum(dim=1).max()), 1)
    if packing is not None and teacher is None:
        listed = _row_list(rows, rollout.completion_ids.shape[0])
        packed = pack_rows(rollout, listed, packing == "prompts")
        # (no token to score: the padded forward keeps the graph connected)
        if packed.targets.numel():
            return _score_packed(model, rollout, listed, width, packed, temperature, entropy, router_loss,
                                 tile, entropy_grad, loss_grad)
    if isinstance(pad_to_multiple_of, int):
        width = min(-(-width // pad_to_multiple_of) * pad_to_multiple_of, completion_mask.shape[1])
    prompt_mask = rollout.prompt_mask[rows]
    first = int((prompt_mask.sum(dim=0) > 0).int().argmax())  # prompts are left-padded
    completion_ids = rollout.completion_ids[rows, :width]
    ids = torch.cat([rollout.prompt_ids[rows, first:], completion_ids], dim=1)
    mask = torch.cat([prompt_mask[:, first:], completion_mask[:, :width]], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded prompts
    kept = rollout.sampling_kept
    score = Score(completion_ids, completion_mask[:, :width], temperature, entropy, router_loss, tile,
                  None if kept is None else kept[rows, :width], entropy_grad=entropy_grad,
                  loss_grad=loss_grad)
    # rollout/teacher_server.py
    if teacher is not None and hasattr(teacher, "support"):
        score.teacher = TeacherStates(None, None, beta, *teacher.support(rollout, rows, width), teacher.tail)
    elif teacher is not None and hasattr(teacher, "uld_states"):  # its own tokens (rlft/core/uld.py)
        score.teacher = teacher.uld_states(rollout, rows, width, beta, tile)
    elif teacher is not None:
        inputs = _teacher_inputs(rollout, rows, ids, mask, position_ids, width)
        score.teacher = teacher_states(teacher, *inputs, completion_mask[:, :width], beta)
    if teacher is not None:
        score.logps, score.teacher.mode = with_logps, mode
    # routing replay; agreement counted over the completion tokens
    replay(model, _padded_routes(rollout, rows, first, width),
           torch.cat([torch.zeros_like(prompt_mask[:, first:]), completion_mask[:, :width]], dim=1))
    scored = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, rlft_score=score)
    scored.tokens = ids.numel()
    return scored


def _teacher_inputs(rollout, rows, ids, mask, position_ids, width: int):
    """What the teacher reads: the student's own (ids, mask, position_ids), or, where the rollout
    carries a teacher prompt per row (self-distillation), that prompt before the same completion."""
    if rollout.teacher_prompt_ids is None:
        return ids, mask, position_ids
    prompt_mask = rollout.teacher_prompt_mask[rows]
    first = int((prompt_mask.sum(dim=0) > 0).int().argmax())  # left-padded
    ids = torch.cat([rollout.teacher_prompt_ids[rows, first:], rollout.completion_ids[rows, :width]], dim=1)
    mask = torch.cat([prompt_mask[:, first:], rollout.completion_mask[rows, :width]], dim=1)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _padded_routes(rollout, rows, first: int, width: int) -> torch.Tensor | None:
    """The sampler's routes [b, t, L, k] in score_rows' padded layout (None: none recorded)."""
    if rollout.prompt_routes is None or rollout.completion_routes is None:
        return None
    return torch.cat([rollout.prompt_routes[rows, first:], rollout.completion_routes[rows, :width]], dim=1)


def _row_list(rows, total: int) -> list[int]:
    if isinstance(rows, slice):
        return list(range(*rows.indices(total)))
    return rows.tolist() if torch.is_tensor(rows) else list(rows)


def _score_packed(model, rollout, rows: list[int], width: int, packed: Packed, temperature: float,
                  entropy: bool, router_loss: bool, tile: int | None, entropy_grad: bool = False,
                  loss_grad=None) -> Scored:
    index = torch.tensor(rows, dtype=torch.long, device=rollout.completion_ids.device)
    score = Score(rollout.completion_ids[index, :width], rollout.completion_mask[index, :width], temperature,
                  entropy, router_loss, tile, packed=packed, entropy_grad=entropy_grad, loss_grad=loss_grad)
    install(_scoring_model(model))
    replay(model, None if packed.routes is None else packed.routes[None], packed.completion_positions)
    with packed_forward():
        scored = model(input_ids=packed.input_ids, position_ids=packed.position_ids, rlft_score=score,
                       rlft_blocks=packed.blocks)
    scored.tokens = packed.input_ids.numel()
    return scored


def _scoring_model(model):
    """The transformers model inside whatever wraps it (DDP, DeepSpeed, peft): the one
    `install_scoring` patched (its own attribute: wrappers forward attribute lookups to what they
    wrap)."""
    for module in model.modules():
        if vars(module).get("_rlft_scoring", False):
            return module
    raise ValueError("packed scoring needs a model prepared with install_scoring")
