"""TRL's `LogCompletionsCallback`: every `freq` optimiser steps (default: eval_steps), the policy
completes the first `num_prompts` prompts of the evaluation set, and the table of every (step,
prompt, completion) so far goes to the run's `completions.jsonl` and to the trackers the run reports
to (wandb and trackio as a table, tensorboard as text).

`LogCompletionsCallback(trainer, generation_config=None, num_prompts=None, freq=None)`, added with
`trainer.add_callback(...)`, as in TRL's distillation and GKD scripts. The prompts are rendered as
the trainer renders its own (a chat template for message lists) and split over the processes;
generation runs on the policy as it trains (every process takes part: sharded engines gather the
weights for it), greedy unless `generation_config` says otherwise.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers import GenerationConfig, TrainerCallback

from rlft.data.prompts import load_eval_datasets, render_prompt
from rlft.errors import ConfigError


class LogCompletionsCallback(TrainerCallback):
    def __init__(self, trainer, generation_config: GenerationConfig | None = None,
                 num_prompts: int | None = None, freq: int | None = None):
        sets = load_eval_datasets(getattr(trainer, "eval_dataset", None))
        if not sets:
            raise ConfigError("Trainer must have an evaluation dataset to use the "
                              "LogCompletionsCallback (eval_dataset= with a 'prompt' column)")
        dataset = next(iter(sets.values()))
        if "prompt" not in dataset.column_names:
            raise ConfigError("LogCompletionsCallback reads the evaluation set's 'prompt' column; "
                              f"it has {dataset.column_names}")
        if num_prompts is not None:
            dataset = dataset.select(range(min(num_prompts, len(dataset))))
        self.trainer, self.freq, self.generation_config = trainer, freq, generation_config
        template_kwargs = getattr(trainer.args, "chat_template_kwargs", None)
        self.prompts = [render_prompt(prompt, trainer.processing_class, row, template_kwargs)
                        for row, prompt in enumerate(dataset["prompt"])]
        self.table: list[dict] = []
        self._last_logged_step = -1

    def on_step_end(self, args, state, control, **kwargs):
        every, step = self.freq or state.eval_steps, state.global_step
        if step == self._last_logged_step or not every or step % every:
            return
        self._last_logged_step = step
        from accelerate.utils import gather_object

        accelerator = self.trainer.accelerator
        with accelerator.split_between_processes(self.prompts) as mine:
            completions = self._complete(list(mine))
        rows = gather_object([{"step": step, "prompt": prompt, "completion": completion}
                              for prompt, completion in zip(mine, completions)])
        if not accelerator.is_main_process:
            return
        self.table.extend(rows)
        log = getattr(self.trainer, "run_log", None)
        if log is not None:
            log.samples([{"prompt": r["prompt"], "completion": r["completion"],
                          "source": "LogCompletionsCallback"} for r in rows], step)
        self._to_trackers(args, step)

    def _config(self, tokenizer) -> GenerationConfig:
        if self.generation_config is not None:
            config = copy.deepcopy(self.generation_config)
        else:  # greedy, as long as the trainer's completions
            length = getattr(self.trainer.args, "max_completion_length", None) or 128
            config = GenerationConfig(max_new_tokens=length, do_sample=False)
        if config.pad_token_id is None:
            config.pad_token_id = tokenizer.pad_token_id
        return config

    @torch.no_grad()
    def _complete(self, prompts: list[str]) -> list[str]:
        """This process's completions, in batches of per_device_eval_batch_size; a process with no
        prompt still generates once (sharded engines gather weights with every process)."""
        trainer = self.trainer
        tokenizer, model = trainer.processing_class, trainer.accelerator.unwrap_model(trainer.model)
        engine, config = getattr(trainer, "engine", None), self._config(tokenizer)
        size = max(1, trainer.args.per_device_eval_batch_size)
        side, tokenizer.padding_side, was_training = tokenizer.padding_side, "left", model.training
        out = []
        model.eval()
        try:
            for start in range(0, max(len(prompts), 1), size):
                batch = prompts[start:start + size]
                encoded = tokenizer(batch or [tokenizer.eos_token], return_tensors="pt", padding=True,
                                    add_special_tokens=False).to(trainer.accelerator.device)
                gathered = engine.for_generation(trainer.model) if engine else contextlib.nullcontext()
                with gathered:
                    ids = model.generate(**encoded, generation_config=config,
                                         synced_gpus=getattr(engine, "name", "") == "zero3")
                new = ids[:, encoded["input_ids"].shape[1]:]
                out += tokenizer.batch_decode(new, skip_special_tokens=True)[:len(batch)]
        finally:
            tokenizer.padding_side = side
            model.train(was_training)
        return out

    def _to_trackers(self, args, step: int) -> None:
        accelerator, columns = self.trainer.accelerator, ["step", "prompt", "completion"]
        data = [[str(r["step"]), r["prompt"], r["completion"]] for r in self.table]
        for name in [r for r in (args.report_to or []) if r != "none"]:
            try:
                tracker = accelerator.get_tracker(name, unwrap=True)
            except (ValueError, KeyError):
                continue
            if name == "wandb":
                import wandb

                tracker.log({"completions": wandb.Table(columns=columns, data=data)}, step=step)
            elif name == "trackio":
                import trackio

                trackio.log({"completions": trackio.Table(columns=columns, data=data)}, step=step)
            elif name == "tensorboard":
                lines = ["| step | prompt | completion |", "|---|---|---|"]
                lines += [f"| {s} | {p!r} | {c!r} |" for s, p, c in data]
                tracker.add_text("completions", "\n".join(lines), global_step=step)
