"""Generalized knowledge distillation under TRL 1.16's experimental names (`GKDTrainer`,
`GKDConfig`; Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", arXiv:2306.13649).

Each rollout is, with probability `lmbda`, the student's own completions of its prompts (on-policy,
from the current weights: GRPO's rollout engines, vLLM included); otherwise the teacher's
completions (`seq_kd`: sequence-level KD) or the dataset's (supervised KD). Whatever the
completions, the loss is distillation's (rlft/train/update/distill_objective.py): the generalized
Jensen-Shannon divergence at `beta` of every completion token, at temperature 1, a token mean over
the optimiser step. The draw is seeded by the run's seed and the rollout's index, so every process,
a resumed run and a rerun take the same one (TRL draws with Python's global `random` once per
micro-batch on each process).

Datasets: TRL's `messages` column (a conversation; its last message, the assistant's, is the
completion) or `prompt` + `completion` columns (conversational or plain text). A dataset completion
is the tokens the chat template gives the last turn after the prompt's generation prompt, cut at
`max_new_tokens`.
"""

from __future__ import annotations

import random
import time

import torch
from transformers import GenerationConfig

from rlft.config import GKDConfig, GOLDConfig
from rlft.data.prompts import DatasetError, is_conversational, left_pad, load_dataset_any
from rlft.errors import ConfigError
from rlft.rollout.base import Rollout
from rlft.rollout.hf import HFGenerator, completion_mask_from, eos_token_ids
from rlft.train.distillation import DistillationTrainer
from rlft.train.grpo import default_output_dir
from rlft.train.sources.rollout_source import (
    EngineSource,
    GeneratedSource,
    SourceParts,
    score_rollout,
)
from rlft.train.update.rollout_batch import ScoredRollout

KINDS_OF_COMPLETION = ("student", "teacher", "dataset")


def gkd_rows(dataset):
    """A GKD dataset as prompt + completion rows: `messages` split before its last message (which
    must be the assistant's); `prompt` + `completion` kept as they are."""
    if dataset is None:
        return None
    if isinstance(dataset, dict):  # named evaluation sets (a DatasetDict too)
        return {name: gkd_rows(value) for name, value in dataset.items()}
    loaded = load_dataset_any(dataset)
    columns = loaded.column_names
    if "messages" in columns:
        return loaded.map(_split_messages, remove_columns=["messages"], with_indices=True)
    if "prompt" in columns and "completion" in columns:
        return loaded
    raise DatasetError(f"a GKD dataset needs a 'messages' column (TRL's format) or 'prompt' and "
                       f"'completion' columns; it has {columns}")


def _split_messages(row: dict, index: int) -> dict:
    messages = row["messages"]
    if not isinstance(messages, list) or len(messages) < 2 or messages[-1].get("role") != "assistant":
        raise DatasetError(f"row {index}: 'messages' must be a conversation of at least two "
                           "messages that ends with the assistant's (the completion distilled on)")
    return {"prompt": messages[:-1], "completion": messages[-1:]}


class GKDSource(EngineSource):
    """The rollouts of a GKD run (module docstring): the student's, the teacher's or the dataset's
    completions, one draw per rollout."""

    trainer, agents_hint = "GKDTrainer", " (use DistillationTrainer, which takes them)"

    def __init__(self, parts: SourceParts):
        self.args, self.schedule, self.rewards = parts.args, parts.schedule, parts.rewards
        self.throughput, self.tokenizer = parts.throughput, parts.tokenizer
        self.device = parts.accelerator.device
        self.generated = GeneratedSource(parts)  # the student's completions (the config's engine)
        self.teacher, self.eos_ids = parts.teacher, eos_token_ids(parts.model, parts.tokenizer)
        padded = getattr(getattr(self.teacher, "module", self.teacher), "rlft_vocab_rows", None)
        if self.args.seq_kd and padded:
            raise ConfigError("seq_kd=True samples from the teacher, whose vocab_size is padded past the "
                              "student's: it could sample a padding id the student has no row for; "
                              "set seq_kd: false, or use a teacher of the student's vocab_size")
        args = self.args
        self.teacher_engine = HFGenerator(parts.tokenizer, args.max_completion_length, args.temperature,
                                          args.top_p, args.top_k, args.repetition_penalty,
                                          min_p=args.min_p) if args.seq_kd else None

    def kind(self, index: int) -> str:
        """Whose completions rollout `index` trains on."""
        draw = random.Random(f"gkd:{self.args.seed}:{index}").random()
        if draw < self.args.lmbda:
            return "student"
        return "teacher" if self.args.seq_kd else "dataset"

    def rollout(self, index: int) -> ScoredRollout:
        return self.round(index, 0)

    def round(self, index: int, round_index: int) -> ScoredRollout:
        which = self.kind(index)
        if which == "student":
            scored = self.generated.round(index, round_index)
        else:
            prompts, started = self.schedule.batch(index, round_index), time.perf_counter()
            rollout = self._teacher(prompts) if which == "teacher" else self._dataset(prompts)
            seconds = time.perf_counter() - started
            scored = score_rollout(self.rewards, self.throughput, prompts, rollout, 1, seconds, seconds)
        for name in KINDS_OF_COMPLETION:  # what share of the steps trained on whose completions
            scored.scalars[f"gkd/{name}_completions"] = [float(name == which)]
        return scored

    def generate(self, prompts: dict, count: int, greedy: bool = False) -> Rollout:
        return self.generated.generate(prompts, count, greedy)

    @torch.no_grad()
    def _teacher(self, prompts: dict) -> Rollout:
        return self.teacher_engine(self.teacher, prompts["prompt_ids"], 1)

    def _dataset(self, prompts: dict) -> Rollout:
        """The dataset's completions of these prompts, as a rollout: each one's tokens after its
        prompt."""
        width, rows = self.args.max_completion_length, []
        for prompt, completion, ids in zip(prompts["prompts"], prompts["completion"], prompts["prompt_ids"]):
            tokens = self._completion_tokens(prompt, completion, ids)
            rows.append(tokens[:width])
        prompt_ids, prompt_mask = left_pad(prompts["prompt_ids"], self.tokenizer.pad_token_id)
        longest = max(1, max(len(r) for r in rows))
        completion_ids = torch.full((len(rows), longest), self.tokenizer.pad_token_id, dtype=torch.long)
        for row, tokens in enumerate(rows):
            completion_ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        completion_mask, truncated = completion_mask_from(completion_ids, self.eos_ids)
        lengths = torch.tensor([len(r) for r in rows])
        completion_mask = completion_mask * (torch.arange(longest)[None, :] < lengths[:, None])
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated).to(self.device)

    def _completion_tokens(self, prompt, completion, prompt_ids: list[int]) -> list[int]:
        """A plain completion's tokens and EOS; a conversational one's, the chat template's
        rendering of the last turn after the prompt's generation prompt."""
        tokenizer = self.tokenizer
        if not is_conversational(completion):
            text = tokenizer(str(completion), add_special_tokens=False)["input_ids"]
            return text + [tokenizer.eos_token_id]
        kwargs = self.args.chat_template_kwargs or {}
        whole = tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False, **kwargs)
        ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
        if ids[:len(prompt_ids)] != list(prompt_ids):
            raise DatasetError("a completion's chat rendering does not begin with its prompt's: "
                               "this chat template renders the last assistant turn differently "
                               "from a generation prompt; give 'prompt' and 'completion' as plain "
                               "text")
        return ids[len(prompt_ids):]



@torch.no_grad()
def generate_on_policy_outputs(model, inputs: dict, generation_config: GenerationConfig):
    """TRL's `GKDTrainer.generate_on_policy_outputs`: `model.generate` from `inputs["prompts"]` and
    `inputs["prompt_attention_mask"]` (left-padded); returns (sequences, attention mask, labels), the
    completion kept through its first end-of-sequence id (whole without one), labels -100 on the
    prompt and on what is not kept."""
    prompts, prompt_mask = inputs["prompts"], inputs["prompt_attention_mask"]
    sequences = model.generate(input_ids=prompts, attention_mask=prompt_mask,
                               generation_config=generation_config, return_dict_in_generate=True).sequences
    completion = sequences[:, prompts.shape[1]:]
    stops = generation_config.eos_token_id
    if stops is None:
        kept = torch.ones_like(completion)
    else:
        kept = completion_mask_from(completion, [stops] if isinstance(stops, int) else list(stops))[0]
    mask = torch.cat([prompt_mask.to(kept.dtype), kept], dim=1)
    labels = sequences.masked_fill(mask == 0, -100)
    labels[:, :prompts.shape[1]] = -100
    return sequences, mask, labels


class GKDTrainer(DistillationTrainer):
    """TRL-compatible GKD: `GKDTrainer(model, teacher_model, args, train_dataset=...).train()`; the
    teacher defaults to the config's teacher_model_name_or_path, else the student's own checkpoint
    (TRL's)."""

    _tag_names = ["trl", "gkd", "rlft"]
    _name = "GKD"
    default_rollout_source = "gkd"
    config_class = GKDConfig
    generate_on_policy_outputs = staticmethod(generate_on_policy_outputs)  # TRL's public static method

    def __init__(self, model=None, teacher_model=None, args: GKDConfig | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, compute_metrics=None,
                 callbacks=None, optimizers=(None, None), preprocess_logits_for_metrics=None,
                 peft_config=None, formatting_func=None):
        kind = self.config_class.__name__
        args = args or self.config_class(output_dir=default_output_dir(model, self._name))
        if not isinstance(args, self.config_class):
            raise ConfigError(f"{type(self).__name__} takes a {kind}, got {type(args).__name__}")
        unused = {"data_collator": data_collator, "compute_metrics": compute_metrics,
                  "preprocess_logits_for_metrics": preprocess_logits_for_metrics,
                  "formatting_func": formatting_func}
        given = sorted(name for name, value in unused.items() if value is not None)
        if given:
            raise ConfigError(f"{type(self).__name__}: {', '.join(given)} are SFTTrainer's hooks, which "
                              "rlft's loop does not call (it tokenizes prompts and completions "
                              "itself); leave them out")
        if teacher_model is None and args.teacher_model_name_or_path is None \
                and not args.teacher_model_server_url:
            teacher_model = model if isinstance(model, str) else getattr(model, "name_or_path", None)
        super().__init__(model, teacher_model, args, gkd_rows(train_dataset), gkd_rows(eval_dataset),
                         processing_class, callbacks, optimizers, None, peft_config)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset  # the caller's, as TRL keeps them

    @property
    def generation_config(self) -> GenerationConfig:
        """The student's sampling settings (TRL's attribute): what the rollout engine samples with."""
        args, model = self.args, self.accelerator.unwrap_model(self.model)
        return GenerationConfig(max_new_tokens=args.max_completion_length, temperature=args.temperature,
                                do_sample=True, top_k=args.top_k, top_p=args.top_p,
                                pad_token_id=self.tokenizer.pad_token_id,
                                eos_token_id=model.generation_config.eos_token_id)


class GOLDTrainer(GKDTrainer):
    """TRL's experimental GOLDTrainer for a teacher with the student's tokenizer: GKD's rollouts (the
    student's with probability lmbda, else the dataset's or, with seq_kd, the teacher's) and the
    generalized JSD at `beta`, at the sampling temperature (GOLDConfig); TRL's signature."""

    _tag_names = ["trl", "gold", "rlft"]
    _name = "GOLD"
    config_class = GOLDConfig
