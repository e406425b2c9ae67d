"""On-policy distillation's parts (DistillationTrainer: rlft/train/distillation.py): the teacher as
it is loaded, and the objective whose loss is each completion token's divergence from the teacher.

The loss of one optimiser step (TRL 1.16's DistillationTrainer's): the sum over every trained
completion token of the step, on every process, of D (the generalized Jensen-Shannon divergence at
`beta`, rlft/core/distill.py) divided by the number of those tokens: a token-level mean, counted
before the first micro-batch, so neither the micro-batch split nor the process count changes it.
Trained tokens are the policy's own completion tokens up to and including the first EOS; tool
results and padding are left out (the rollout's loss mask).

The teacher is frozen and scored under no_grad, only its backbone (its [B, T, V] logits never
exist): it is prepared like a reference model (whole on every process; a ZeRO-3 inference engine
under ZeRO-3). Or it is served (`teacher_model_server_url`: `rlft vllm-serve`), and the divergence
is taken on its top-k log-probs (rlft/rollout/teacher_server.py, rlft/core/sparse_distill.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rlft.core.fused_head import vocabulary_rows
from rlft.errors import ConfigError
from rlft.model.loading import load_causal_lm
from rlft.model.scoring import install_scoring
from rlft.train.update.objectives import Objective
from rlft.train.update.rollout_batch import RolloutBatch
from rlft.train.update.teachers import TeacherSet, is_url, teacher_dict


def _vocabulary(model) -> int:
    return vocabulary_rows(model.get_output_embeddings().weight)


@dataclass(frozen=True)
class TeacherServer:
    """A teacher behind `rlft vllm-serve` at `url` (the config's teacher_model_server_url)."""
    url: str


def teacher_source(teacher_model, args, required: bool):
    """What the teacher is loaded from (the trainer's teacher_model, else the config's
    teacher_model_name_or_path, or a TeacherServer for teacher_model_server_url), or None for a run
    without one. `required`: distillation's; otherwise GRPO's teacher term, there exactly when
    teacher_coef > 0."""
    several = teacher_dict(teacher_model, args)
    if several is not None:  # id -> a source each (a URL: served)
        return {k: _served_source(None, args, v) if is_url(v) else v for k, v in several.items()}
    teacher = args.teacher_model_name_or_path if teacher_model is None else teacher_model
    if args.teacher_model_server_url:
        teacher = _served_source(teacher, args)
    if required:
        if teacher is None:
            raise ConfigError("DistillationTrainer needs a teacher: pass teacher_model= (a hub id, "
                              "a folder or a loaded model), or set teacher_model_name_or_path (or "
                              "teacher_model_server_url) in the config")
        return teacher
    if args.teacher_coef == 0:
        if teacher is not None:
            raise ConfigError("a teacher is given (teacher_model / teacher_model_name_or_path / "
                              "teacher_model_server_url) but "
                              "teacher_coef is 0, so it would be loaded and never used: set "
                              "teacher_coef > 0 to add its reverse KL to the loss, or leave the "
                              "teacher out")
        return None
    if teacher is None:
        raise ConfigError(f"teacher_coef={args.teacher_coef} needs a teacher: pass teacher_model= "
                          "to the trainer or set teacher_model_name_or_path (or "
                          "teacher_model_server_url)")
    return teacher


def _served_source(local, args, url: str | None = None) -> TeacherServer:
    if local is not None:
        raise ConfigError("both a local teacher (teacher_model / teacher_model_name_or_path) and "
                          f"teacher_model_server_url={args.teacher_model_server_url!r} are given: "
                          "keep one")
    temperature = getattr(args, "divergence_temperature", args.temperature)
    if temperature != 1.0:
        raise ConfigError("a served teacher answers its log-probs at temperature 1 (vLLM applies "
                          "no sampling setting to prompt log-probs), but "
                          f"temperature={temperature}: the "
                          "divergence would compare the student at that temperature with the "
                          "teacher at 1. Set temperature: 1.0, or load the teacher locally "
                          "(teacher_model_name_or_path)")
    return TeacherServer(url or args.teacher_model_server_url)


def load_teacher(teacher, args, dtype: torch.dtype, student, tokenizer=None):
    """The teacher from a hub id or folder (with teacher_model_init_kwargs and
    teacher_model_revision) or a loaded model, frozen, in eval mode, checked against the student
    (`student`: the policy as loaded); for a TeacherServer, the ServedTeacher client (checked
    against the student's `tokenizer`)."""
    if teacher is None:
        return None
    if isinstance(teacher, dict):  # several teachers, each loaded and checked as one is
        return TeacherSet({k: load_teacher(t, args, dtype, student, tokenizer) for k, t in teacher.items()})
    _plain_student_head(student)
    if isinstance(teacher, TeacherServer):
        from rlft.rollout.teacher_server import ServedTeacher

        if args.teacher_model_init_kwargs or args.teacher_model_revision:
            raise ConfigError("teacher_model_init_kwargs / teacher_model_revision load a local "
                              "teacher; the served teacher (teacher_model_server_url) is loaded by "
                              "its server: leave them unset")
        return ServedTeacher(teacher.url, args.vllm_server_timeout, args.loss_top_k, args.loss_add_tail,
                             tokenizer)
    model = _load_local(teacher, args, dtype)
    if getattr(args, "use_uld_loss", False):  # its own tokenizer: no vocabulary to share
        return _cross_tokenizer(model, teacher, args, student, tokenizer)
    inner = student.get_base_model() if hasattr(student, "get_base_model") else student
    student_vocab, teacher_vocab = _vocabulary(inner), _vocabulary(model)
    if student_vocab != teacher_vocab:
        if not _padded_past(model, teacher, student_vocab, teacher_vocab, tokenizer):
            name = teacher if isinstance(teacher, str | Path) else type(teacher).__name__
            raise ConfigError(f"the student model has vocab_size {student_vocab} but the teacher model "
                              f"({name}) has vocab_size {teacher_vocab}: distillation compares the "
                              "student's and the teacher's next-token distributions token by token, so "
                              "both must share one vocabulary (use a teacher with the student's "
                              "tokenizer; a larger vocab_size is taken when the tokenizers are the same "
                              "and the extra rows are padding; GOLDTrainer with use_uld_loss distils "
                              "across tokenizers)")
        model.rlft_vocab_rows = student_vocab  # its first rows are the vocabulary (rlft/core/distill.py)
    return model


def _load_local(teacher, args, dtype: torch.dtype):
    """A local teacher loaded (with teacher_model_init_kwargs and teacher_model_revision), frozen, in
    eval mode, with the scoring forward."""
    kwargs = dict(args.teacher_model_init_kwargs or {})
    if isinstance(teacher, torch.nn.Module):
        if kwargs:
            raise ConfigError("teacher_model_init_kwargs only applies when the teacher is given as "
                              "a name or path; the teacher_model passed in is already loaded")
    elif args.teacher_model_revision is not None:
        kwargs.setdefault("revision", args.teacher_model_revision)
    model = load_causal_lm(teacher if isinstance(teacher, torch.nn.Module) else str(teacher), dtype, kwargs,
                           args.trust_remote_code)
    install_scoring(model)
    return model.eval().requires_grad_(False)


def _cross_tokenizer(model, teacher, args, student, tokenizer):
    """GOLD's ULD teacher: the model with its tokenizer (teacher_tokenizer_name_or_path, else the
    teacher's own folder; rlft/train/update/cross_tokenizer.py)."""
    from rlft.model.loading import load_tokenizer
    from rlft.rollout.hf import eos_token_ids
    from rlft.train.update.cross_tokenizer import CrossTokenizerTeacher

    source = args.teacher_tokenizer_name_or_path or (
        teacher if isinstance(teacher, str | Path) else getattr(model, "name_or_path", None))
    if not source:
        raise ConfigError("use_uld_loss needs the teacher's tokenizer: set teacher_tokenizer_name_or_path "
                          "(the teacher_model passed in names no folder)")
    try:  # (with a pad token: its eos where it has none)
        teacher_tokenizer = load_tokenizer(source, "left", args.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ConfigError(f"teacher_tokenizer_name_or_path: no tokenizer could be loaded from {source!r} "
                          f"({err}); name the teacher's tokenizer folder or hub id") from err
    return CrossTokenizerTeacher(model, teacher_tokenizer, tokenizer, args, eos_token_ids(student, tokenizer))


def _padded_past(model, teacher, student_vocab: int, teacher_vocab: int, tokenizer) -> bool:
    """The teacher's embedding matrix is the student's vocabulary padded with rows no token reaches
    (Qwen2.5-7B's 152,064 against Qwen2.5-0.5B's 151,936): it is larger, its tokenizer (from its
    folder) is the student's, and every token id of that tokenizer is below the student's size."""
    source = teacher if isinstance(teacher, str | Path) else getattr(model, "name_or_path", None)
    if teacher_vocab < student_vocab or tokenizer is None or not source:
        return False
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError):
        return False
    mine = tokenizer.get_vocab()
    return theirs.get_vocab() == mine and max(mine.values()) < student_vocab


def prepare_teacher(teacher, engine):
    """The loaded teacher as the training engine holds a frozen model (a ZeRO-3 inference engine, a
    device): a local one, or each local one of several; a served one as it is."""
    if isinstance(teacher, TeacherSet):
        if len(teacher) > 1 and engine.sharded:
            raise ConfigError(f"several teachers under a sharded engine ({engine.name}): each "
                              "process would run a forward per teacher its own rows name, and "
                              "sharded forwards must run on every process together; train under "
                              "DDP, or one teacher")
        return teacher.prepared(engine.prepare_reference)
    if hasattr(teacher, "uld_states"):  # a teacher with its own tokenizer: the model inside
        if engine.sharded and engine.name.startswith("zero"):
            raise ConfigError(f"use_uld_loss under {engine.name}: the ULD loss reads the LM heads as whole "
                              "weights; train under DDP or FSDP2")
        teacher.model = engine.prepare_reference(teacher.model)
        return teacher
    return engine.prepare_reference(teacher) if isinstance(teacher, torch.nn.Module) else teacher


def _plain_student_head(student) -> None:
    inner = student.get_base_model() if hasattr(student, "get_base_model") else student
    if type(inner.get_output_embeddings()) is not torch.nn.Linear:
        raise ConfigError("distillation reads the student's LM head as a weight, but peft adapts "
                          "it: leave lm_head out of the LoRA target_modules (and modules_to_save)")


class DistillationObjective(Objective):
    """Distillation's loss (module docstring): no rewards, a teacher, no ratio to the sampling
    policy; the scorer holds the teacher."""

    needs_rewards = False  # the teacher is the signal
    needs_teacher = True
    progress_metric = "loss"
    uses_old_logps = False  # the divergence needs no ratio to the sampling policy

    def __init__(self, beta: float):
        self.beta = beta  # the generalized JSD's mix (0 forward KL, 1 reverse KL)
        # some trained token of this step has a nonzero divergence (on this process)
        self._apart = False

    @classmethod
    def build(cls, args, kl_in_reward: bool) -> DistillationObjective:
        return cls(args.beta)

    def begin_step(self, u, batch: RolloutBatch) -> None:
        self._apart = False
        if isinstance(u.scorer.teacher, TeacherSet):
            u.scorer.teacher.reset()

    def has_signal(self, u, batch: RolloutBatch) -> bool:
        return True  # known after the backward: weighted

    def weighted(self, u, kept: bool) -> bool:
        """Some trained token on some process has a nonzero divergence. A student equal to its
        teacher (self-distillation, at the first step) has none: the loss is at its minimum and a
        zero gradient is right, not a wiring fault; the gradient-flow check waits for a step where
        they differ."""
        apart = torch.tensor(float(self._apart), device=u.accelerator.device)
        if u.accelerator.num_processes > 1:
            apart = u.accelerator.reduce(apart, "max")
        return bool(apart.item() > 0) and kept

    def end_step(self, u, metrics: dict[str, float]) -> dict[str, float]:
        # each teacher's share (rlft/train/update/teachers.py)
        if isinstance(u.scorer.teacher, TeacherSet):
            metrics.update(u.scorer.teacher.metrics(u.accelerator))
        metrics.pop("policy_loss", None)
        if "loss" in metrics:
            metrics["distill/loss"] = metrics["loss"]
        return metrics

    def micro_loss(self, u, batch: RolloutBatch, rows, num_items, num_sequences, corrections: list,
                   keep=None):
        """One micro-batch's share: sum of D over its trained tokens / the step's trained tokens."""
        rollout = batch.rollout
        divergence, entropy, teacher_entropy = u.scorer.divergence(rollout, rows, self.beta)
        width = divergence.shape[1]
        mask = (rollout.loss_mask if keep is None else keep)[rows, :width].to(divergence.dtype)
        loss = (divergence * mask).sum() / num_items
        self._apart = self._apart or bool((divergence.detach() * mask).ne(0).any())
        metrics = {} if teacher_entropy is None else {  # (None: a teacher of another tokenizer)
            "distill/teacher_entropy": (teacher_entropy * mask).sum() / mask.sum().clamp(min=1)}
        return loss, metrics, entropy, mask

    @torch.no_grad()
    def eval_loss(self, u, rollout, advantages: torch.Tensor, kl_in_loss: bool) -> float:
        """The mean divergence per completion token of the evaluation completions (TRL's
        `eval_loss`)."""
        total, count = 0.0, 0
        for rows in u.scorer.micro_batches(rollout):
            divergence = u.scorer.divergence(rollout, rows, self.beta)[0]
            mask = rollout.loss_mask[rows, :divergence.shape[1]]
            total += float((divergence * mask).sum())
            count += int(mask.sum())
        return total / max(count, 1)
