"""What scripts call on a trainer around `train()`: transformers.Trainer's own `log_metrics`,
`save_metrics`, `save_state` and `metrics_format` (bound from transformers, not rewritten), the
callback-list methods, `is_world_process_zero`, `end`, `create_model_card` and `push_to_hub`.

Both trainers use this on top of their `flow` (rlft/train/flow.py) and `log` (once training runs).
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers.trainer_pt_utils import log_metrics, metrics_format, save_metrics, save_state

from rlft.errors import RlftError
from rlft.telemetry.tracking import end_trackers


class HubError(RlftError, RuntimeError):
    """Pushing to the Hugging Face Hub failed; the message says why (offline, no token, no repo
    id)."""


CARD = """---
{front_matter}---

# {model_name}

This model is a fine-tuned version of {base} trained with [rlft](https://pypi.org/project/rlft/)
({method}, TRL-compatible configuration).

## Training

- method: {method}
- steps: {steps}
- dataset: {dataset}
- final logged metrics: {metrics}
"""


class TrainerSurface:
    """transformers.Trainer's script-facing methods for rlft's own loops."""

    _tag_names: list[str] = ["trl", "rlft"]
    _name = "rlft"

    log_metrics = log_metrics
    metrics_format = metrics_format
    save_metrics = save_metrics
    save_state = save_state

    def _log_row(self, row: dict) -> dict:
        logs = self.flow.record(row)
        if getattr(self, "run_log", None) is not None:  # evaluate() may run before train()
            self.run_log.log(logs, self.flow.state.global_step)
        return logs

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """transformers.Trainer.log: `logs` at the current step into the log history, the callbacks'
        on_log and (during train()) the trackers and metrics.jsonl."""
        self._log_row(dict(logs))

    @property
    def model_wrapped(self):
        """The model as the training engine wraps it (DDP, FSDP2, DeepSpeed), as transformers'
        Trainer names it."""
        return self.model

    @property
    def max_prompt_length(self) -> int | None:
        return getattr(self.args, "max_prompt_length", None)

    # ---- transformers.Trainer's small methods
    # ----------------------------------------------------------
    @property
    def callback_handler(self):
        return self.flow.handler

    @property
    def control(self):
        return self.flow.control

    def add_callback(self, callback) -> None:
        self.flow.handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.flow.handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.flow.handler.remove_callback(callback)

    @property
    def hub_model_id(self) -> str | None:
        """The hub repository push_to_hub wrote to (or will: args.hub_model_id), as in
        transformers."""
        return getattr(self, "_hub_repo", None) or self.args.hub_model_id

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    def get_num_trainable_parameters(self) -> int:
        return self.param_summary["trainable"]

    def get_learning_rates(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def end(self) -> None:
        """Finish the trackers (transformers.Trainer.end); call once, after everything else."""
        end_trackers(self.accelerator)

    def _add_model_tags(self, model) -> None:
        """TRL's tags (so hub filters for TRL-trained models find these too) and rlft's."""
        unwrapped = self.accelerator.unwrap_model(model) if hasattr(self, "accelerator") else model
        add = getattr(unwrapped, "add_model_tags", None)
        if add is not None:
            add(list(self._tag_names))

    # ---- model card and hub
    # ----------------------------------------------------------------------------
    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        **kwargs,
    ) -> None:
        """README.md in output_dir: hub metadata (base model, tags, library) and what training
        ran."""
        if not self.is_world_process_zero():
            return
        model = self.accelerator.unwrap_model(self.model)
        base = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
        hub_base = base if base and not os.path.isdir(base) and base.count("/") == 1 else None
        tag_list = [tags] if isinstance(tags, str) else list(tags or [])
        tag_list += [
            t for t in [*self._tag_names, *(getattr(model, "model_tags", None) or [])] if t not in tag_list
        ]
        name = model_name or Path(self.args.output_dir).name
        lines = ([f"base_model: {hub_base}\n"] if hub_base else []) + [
            f"library_name: {'peft' if getattr(self, 'is_peft', False) else 'transformers'}\n",
            f"model_name: {name}\n",
            "tags:\n",
            *[f"- {t}\n" for t in tag_list],
        ]
        if dataset_name:
            lines.append(f"datasets: {dataset_name}\n")
        last = next((row for row in reversed(self.state.log_history) if "train_loss" not in row), {})
        shown = {
            k: round(v, 4) if isinstance(v, float) else v
            for k, v in last.items()
            if k in ("reward", "loss", "eval_reward", "accuracy", "eval_accuracy", "eval_loss")
        }
        text = CARD.format(
            front_matter="".join(lines),
            model_name=name,
            base=f"`{hub_base or base or 'a model'}`",
            method=self._name,
            steps=self.state.global_step,
            dataset=dataset_name or "(not named)",
            metrics=shown or "(none logged)",
        )
        Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.args.output_dir) / "README.md").write_text(text)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        **kwargs,
    ):
        """Save the model to output_dir, write its card, and upload the folder to `hub_model_id`
        (default: the output folder's name under your account). Needs the network and a token;
        offline it is a HubError."""
        from huggingface_hub import HfApi

        self.save_model(self.args.output_dir)
        if not self.is_world_process_zero():
            return None
        self.create_model_card(model_name=kwargs.pop("model_name", None), **kwargs)
        token = token if token is not None else self.args.hub_token
        api = HfApi(token=token)
        try:
            repo = self.args.hub_model_id or f"{api.whoami()['name']}/{Path(self.args.output_dir).name}"
            api.create_repo(repo, private=self.args.hub_private_repo, exist_ok=True)
            self._hub_repo = repo
            return api.upload_folder(
                repo_id=repo,
                folder_path=self.args.output_dir,
                commit_message=commit_message,
                revision=revision or self.args.hub_revision,
                run_as_future=not blocking,
                ignore_patterns=["_*", "checkpoint-*", ".tmp-checkpoint-*"],
            )
        # offline, no token, no permission: all end here, with the cause named
        except Exception as err:
            raise HubError(
                f"push_to_hub could not reach the Hugging Face Hub ({type(err).__name__}: {err}). "
                f"The model is saved in {self.args.output_dir}; push that folder later with "
                "`hf upload <repo> <folder>`, or set push_to_hub: false"
            ) from err
