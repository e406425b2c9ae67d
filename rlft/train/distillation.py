"""On-policy distillation under TRL 1.16's names (`DistillationTrainer`, `DistillationConfig`;
Agarwal et al. 2024, arXiv:2306.13649): the student samples a completion per prompt from its current
weights (transformers' generate, vLLM colocated or served, tools: GRPO's rollout sources), the
teacher scores every completion token, and the loss is the token-mean generalized Jensen-Shannon
divergence at `beta` between their next-token distributions (0 forward KL, 1 reverse KL), computed
tile by tile over the vocabulary from the two models' hidden states (rlft/core/distill.py,
rlft/train/update/distill_objective.py). No reward function, no advantage, no reference model;
generation, LoRA, sharded engines, exact resume and logging are GRPO's.
"""

from __future__ import annotations

import torch

from rlft.config import AsyncDistillationConfig, DistillationConfig, ServerDistillationConfig
from rlft.core.distill import divergence_terms
from rlft.errors import ConfigError
from rlft.train.grpo import GRPOTrainer, default_output_dir
from rlft.train.update.distill_objective import DistillationObjective


def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta: float = 0.5,
                         temperature: float = 1.0, reduction: str = "batchmean", num_items_in_batch=None):
    """TRL's `GKDTrainer.generalized_jsd_loss` for logits a caller holds ([B, T, V] each): the
    generalized JSD at `beta` (rlft/core/distill.py: divergence_terms) at `temperature`, the positions
    whose `labels` are -100 left out; "batchmean" sums and divides by the kept positions (by B without
    labels), "sum", "mean" (over every term), else the terms; `num_items_in_batch` divides the sum."""
    log_ps = torch.log_softmax(student_logits / temperature, dim=-1)
    log_pt = torch.log_softmax(teacher_logits / temperature, dim=-1)
    terms = divergence_terms(log_ps, log_pt, beta)
    if labels is not None:
        terms = terms[labels != -100]
    if num_items_in_batch is not None:
        return terms.sum() / num_items_in_batch
    if reduction == "batchmean":
        kept = int((labels != -100).sum()) if labels is not None else terms.shape[0]
        return terms.sum() / max(kept, 1)
    if reduction == "sum":
        return terms.sum()
    return terms.mean() if reduction == "mean" else terms


class DistillationTrainer(GRPOTrainer):
    """TRL-compatible on-policy distillation: `DistillationTrainer(model, teacher_model, args,
    train_dataset,
    ...).train()`; `teacher_model` a hub id, a folder or a loaded model (else the config's
    teacher_model_name_or_path)."""

    _tag_names = ["trl", "distillation", "rlft"]
    _name = "Distillation"
    objective = DistillationObjective
    generalized_jsd_loss = staticmethod(generalized_jsd_loss)  # TRL's public static method (GKD's too)

    def __init__(self, model, teacher_model=None, args: DistillationConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None):
        args = args or DistillationConfig(output_dir=default_output_dir(model, "Distillation"))
        if not isinstance(args, DistillationConfig):
            raise ConfigError("DistillationTrainer takes a DistillationConfig, got "
                              f"{type(args).__name__}: "
                              "its beta is the divergence's (GRPOConfig's is a KL weight)")
        super().__init__(model, None, args, train_dataset, eval_dataset, processing_class, None, callbacks,
                         optimizers, quantization_config, peft_config, tools, teacher_model=teacher_model)


class ServerDistillationTrainer(DistillationTrainer):
    """TRL's experimental ServerDistillationTrainer: DistillationTrainer whose teacher is always
    served (`teacher_model_server_url`), with TRL's signature (no teacher_model) and
    ServerDistillationConfig's defaults (loss_top_k 1)."""

    _tag_names = ["trl", "server-distillation", "rlft"]
    _name = "ServerDistillation"

    def __init__(self, model, args: ServerDistillationConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None):
        if not isinstance(args, ServerDistillationConfig):
            raise ConfigError(f"ServerDistillationTrainer takes a ServerDistillationConfig with "
                              f"teacher_model_server_url set, got {type(args).__name__}")
        super().__init__(model, None, args, train_dataset, eval_dataset, processing_class, callbacks,
                         optimizers, quantization_config, peft_config)


class AsyncDistillationTrainer(DistillationTrainer):
    """TRL's experimental AsyncDistillationTrainer: distillation whose completions come from async
    GRPO's producer (a process sampling later steps' completions while the trainer trains,
    rlft/train/sources/async_source.py: reproducible, exactly resumable), scored by the teachers of
    `teacher_server_urls` (one per `teacher_id`: MOPD) or local ones; TRL's signature."""

    _tag_names = ["trl", "async-distillation", "rlft"]
    _name = "AsyncDistillation"
    default_rollout_source = "producer"

    def __init__(self, model, args: AsyncDistillationConfig | None = None, train_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None,
                 rollout_worker=None, weight_transfer=None, teacher_model=None, eval_dataset=None):
        if not isinstance(args, AsyncDistillationConfig):
            raise ConfigError("AsyncDistillationTrainer takes an AsyncDistillationConfig (its teachers "
                              f"in teacher_server_urls), got {type(args).__name__}")
        if rollout_worker is not None or weight_transfer is not None:
            raise ConfigError("AsyncDistillationTrainer: rollout_worker= / weight_transfer= are not "
                              "taken; rlft's producer samples the student's completions (docs/async.md)")
        super().__init__(model, teacher_model, args, train_dataset, eval_dataset, processing_class, callbacks,
                         optimizers, None, peft_config)
