"""Self-distillation fine-tuning under TRL 1.16's experimental names (`SDFTTrainer`, `SDFTConfig`;
Shenfeld, Damani, Hubotter, Agrawal 2026, "Self-Distillation Enables Continual Learning",
arXiv:2601.19897).

Each dataset row has a `prompt` and a `privileged_context` (a demonstration, the answer, feedback).
The student samples `num_generations` completions of the prompt alone (or, with
`generate_from_teacher`, of the teacher's prompt); the teacher, the student itself
(`teacher_model_kind`: base, live or ema; rlft/train/update/self_teacher.py), reads the same
completions after the teacher's prompt, `teacher_prompt_template` filled with the prompt and the
context, and the loss makes the student without the context predict what the teacher predicts with
it (rlft/core/self_distill.py, rlft/train/update/self_distill_objective.py).

The teacher's prompt, as TRL builds it: a plain prompt is the template filled in; a chat prompt keeps
its earlier messages and has its last message, which must be the user's, replaced by one user message
whose text is the template filled with that message's text. A context given as chat messages is
their texts joined by newlines. The teacher's prompts of the training set are built and measured
before the first step, so a row too long for `max_prompt_length` is named then (rlft refuses what TRL
cuts from the left, as it does for student prompts).

Generation, LoRA, exact resume, evaluation (`eval_loss` is the objective on the evaluation
completions) and logging are GRPO's; no reward function is called.
"""

from __future__ import annotations

import time

import torch

from rlft.config import SDFTConfig
from rlft.data.prompts import DatasetError, is_conversational, left_pad, render_prompt
from rlft.errors import ConfigError
from rlft.rollout.base import Rollout
from rlft.train.distillation import DistillationTrainer
from rlft.train.grpo import default_output_dir
from rlft.train.sources.rollout_source import EngineSource, GeneratedSource, SourceParts, score_rollout
from rlft.train.update.rollout_batch import ScoredRollout
from rlft.train.update.self_distill_objective import SelfDistillationObjective

CONTEXT = "privileged_context"  # TRL's column


def _text(content) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(part.get("text", "") for part in content if part.get("type") == "text")
    return str(content)


def context_text(context, row) -> str:
    """A row's privileged context as text (chat messages: their texts, a line each)."""
    if context is None:
        raise DatasetError(f"row {row}: `{CONTEXT}` must not be None: SDFT's teacher reads it (give "
                           "an empty string for a row without one)")
    if isinstance(context, list) and context and isinstance(context[0], dict):
        return "\n".join(text for text in (_text(m.get("content", "")) for m in context) if text)
    return context if isinstance(context, str) else str(context)


def rewritten(prompt, row, write):
    """A teacher's prompt from a student's: a plain prompt is `write(prompt)`; a chat prompt keeps its
    earlier messages, and its last, the user's, becomes one user message `write(its text)` (TRL's
    rule)."""
    if not is_conversational(prompt):
        return write(prompt)
    if not prompt or prompt[-1].get("role") != "user":
        role = prompt[-1].get("role") if prompt else None
        raise DatasetError(f"row {row}: the prompt ends with a {role!r} message; the teacher's prompt "
                           "rewrites the last user message, so a prompt must end with the user's")
    return list(prompt[:-1]) + [{"role": "user", "content": write(_text(prompt[-1].get("content", "")))}]


def teacher_prompt(prompt, context, template: str, row):
    """SDFT's teacher prompt (module docstring) for one row."""
    text = context_text(context, row)
    return rewritten(prompt, row, lambda said: template.format(prompt=said, privileged_context=text))


def teacher_inputs(rollout) -> tuple:
    """(ids, attention mask) [N, P' + C] the teacher reads: its prompts, then the completions."""
    return (torch.cat([rollout.teacher_prompt_ids, rollout.completion_ids], dim=1),
            torch.cat([rollout.teacher_prompt_mask, rollout.completion_mask], dim=1))


class SelfTeacherSource(EngineSource):
    """What a self-distilling source shares: GRPO's generation, and the self-teacher's state in
    checkpoints (rlft/train/update/self_teacher.py)."""

    def __init__(self, parts: SourceParts):
        self.args, self.schedule, self.rewards = parts.args, parts.schedule, parts.rewards
        self.throughput, self.tokenizer, self.teacher = parts.throughput, parts.tokenizer, parts.teacher
        self.device, self.group = parts.accelerator.device, parts.args.num_generations
        self.generated = GeneratedSource(parts)
        self.generation_prompts: list = []  # per row, the prompt the last rollout was sampled after
        self.events, self.steps_per_rollout = parts.events, parts.steps_per_rollout

    def tokenized(self, prompts: list, limit: int | None, keep_end: bool = False) -> list[list[int]]:
        """Teacher prompts' token ids, each rendered as a student prompt is; over `limit` tokens an
        error naming the row, or (keep_end) its last `limit` tokens."""
        out = []
        for row, prompt in enumerate(prompts):
            text = render_prompt(prompt, self.tokenizer, row, self.args.chat_template_kwargs)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if limit is not None and len(ids) > limit and not keep_end:
                raise DatasetError(f"row {row}: the teacher's prompt (the prompt with its "
                                   f"{CONTEXT}) has {len(ids)} tokens, over max_prompt_length={limit}; "
                                   "raise max_prompt_length or shorten the context")
            out.append(ids[-limit:] if limit is not None else ids)
        return out

    def state_dict(self):
        return self.teacher.state_dict()

    def load_state_dict(self, state) -> None:
        if state is not None:
            self.teacher.load_state_dict(state)

    def batch_made(self, batch) -> None:
        """After the trainer made the batch of a rollout: TRL's self-distillation callback events
        about it (callbacks that define them get TRL's arguments)."""
        rollout, fire = batch.rollout, self.events
        teacher_ids, teacher_mask = teacher_inputs(rollout)
        fire("on_generation_prompts_selected", generation_prompts=self.generation_prompts,
             generation_prompt_text=None)
        if rollout.teacher_rows is not None:
            fire("on_teacher_context_built", teacher_input_ids=teacher_ids,
                 teacher_attention_mask=teacher_mask, completion_mask=rollout.completion_mask,
                 self_distillation_mask=rollout.teacher_rows)
        fire("on_self_distillation_batch_prepared", old_per_token_logps=batch.old_logps,
             prompt_ids=rollout.prompt_ids, completion_ids=rollout.completion_ids,
             teacher_input_ids=teacher_ids, teacher_attention_mask=teacher_mask,
             self_distillation_mask=rollout.teacher_rows)
        fire("on_generation_batch_built", generate_every=self.steps_per_rollout,
             steps_per_generation=self.args.steps_per_generation)


class SDFTSource(SelfTeacherSource):
    """The student's completions of each prompt, with the teacher's prompt for every row
    (`Rollout.teacher_prompt_ids`)."""

    trainer = "SDFTTrainer"

    def open(self) -> None:
        """Before the first step: every training row's teacher prompt built and measured."""
        rows = getattr(self.schedule.prompts, "rows", None)
        if rows is not None:
            whole = {"prompts": [r["prompt"] for r in rows]}
            if rows and CONTEXT in rows[0]:
                whole[CONTEXT] = [r[CONTEXT] for r in rows]
            self.teacher_prompts(whole)

    def teacher_prompts(self, prompts: dict) -> tuple[list, list[list[int]]]:
        """The teacher's prompt for each prompt of a batch, and its tokens."""
        if CONTEXT not in prompts:
            raise DatasetError(f"the dataset has no '{CONTEXT}' column: SDFT's teacher reads each row's "
                               "prompt with its privileged context (a demonstration, the answer)")
        template = self.args.teacher_prompt_template
        written = [teacher_prompt(prompt, context, template, row)
                   for row, (prompt, context) in enumerate(zip(prompts["prompts"], prompts[CONTEXT]))]
        return written, self.tokenized(written, self.args.max_prompt_length)

    def rollout(self, index: int) -> ScoredRollout:
        return self.round(index, 0)

    def round(self, index: int, round_index: int) -> ScoredRollout:
        prompts, started = self.schedule.batch(index, round_index), time.perf_counter()
        rollout = self.generate(prompts, self.group, from_teacher=self.args.generate_from_teacher)
        seconds = time.perf_counter() - started
        return score_rollout(self.rewards, self.throughput, prompts, rollout, self.group, seconds, seconds)

    def generate(self, prompts: dict, count: int, greedy: bool = False,
                 from_teacher: bool = False) -> Rollout:
        """`count` completions per prompt, with the teacher's prompts; `from_teacher`: sampled after
        the teacher's prompt, then trained after the student's."""
        written, teacher = self.teacher_prompts(prompts)
        sampled_after = written if from_teacher else prompts["prompts"]
        self.generation_prompts = [p for p in sampled_after for _ in range(count)]
        if not from_teacher:
            rollout = self.generated.generate(prompts, count, greedy)
        else:
            rollout = self.generated.generate({**prompts, "prompt_ids": teacher}, count, greedy)
            student, student_mask = left_pad([ids for ids in prompts["prompt_ids"] for _ in range(count)],
                                             self.tokenizer.pad_token_id)
            rollout.prompt_ids, rollout.prompt_mask = student.to(self.device), student_mask.to(self.device)
            rollout.prompt_routes = rollout.completion_routes = None  # routed after another prompt
        ids, mask = left_pad([ids for ids in teacher for _ in range(count)], self.tokenizer.pad_token_id)
        rollout.teacher_prompt_ids, rollout.teacher_prompt_mask = ids.to(self.device), mask.to(self.device)
        return rollout

class SDFTTrainer(DistillationTrainer):
    """TRL-compatible SDFT: `SDFTTrainer(model, args, train_dataset=...).train()` on `prompt` +
    `privileged_context` rows."""

    _tag_names = ["trl", "sdft", "rlft"]
    _name = "SDFT"
    default_rollout_source = "sdft"
    objective = SelfDistillationObjective

    def __init__(self, model, args: SDFTConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None,
                 quantization_config=None):
        args = args or SDFTConfig(output_dir=default_output_dir(model, "SDFT"))
        if not isinstance(args, SDFTConfig):
            raise ConfigError(f"SDFTTrainer takes an SDFTConfig, got {type(args).__name__}")
        if train_dataset is None:
            raise ConfigError("SDFTTrainer needs a train_dataset with 'prompt' and "
                              f"'{CONTEXT}' columns")
        super().__init__(model, None, args, train_dataset, eval_dataset, processing_class, callbacks,
                         optimizers, quantization_config, peft_config)
