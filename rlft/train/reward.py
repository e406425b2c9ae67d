"""RewardTrainer: Bradley-Terry reward models on chosen/rejected pairs, with or without LoRA.

pairs -> scores (float32) -> Bradley-Terry loss -> update -> log -> checkpoint. With LoRA the
task type is SEQ_CLS and the score head must be trainable (checked before the first step).
float16 weights train with float32 master copies of the trainable parameters under autocast;
a non-finite loss skips the step, and several in a row stop the run with the likely cause.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from rlft.config import ConfigError, RewardConfig, to_dict, validate
from rlft.core.preference import bradley_terry_loss
from rlft.data.preference import PreferencePairs
from rlft.data.prompts import epoch_order, load_dataset_any
from rlft.models import (
    apply_lora,
    enable_checkpointing,
    load_sequence_classifier,
    load_tokenizer,
    lora_config_from,
    parameter_summary,
    resolve_dtype,
)
from rlft.tracking import RunLog
from rlft.train import state as ckpt

HEAD_NAMES = ("score", "classifier")


class HeadFrozenError(RuntimeError):
    """The score/classifier head of a reward model would not be trained."""


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with an inf/NaN loss."""


def check_head_trainable(model) -> list[str]:
    """Names of trainable head parameters; raise if the head exists but is frozen."""
    head = [(n, p) for n, p in model.named_parameters() if any(f".{h}." in f".{n}" for h in HEAD_NAMES)]
    trainable = [n for n, p in head if p.requires_grad]
    if head and not trainable:
        raise HeadFrozenError(
            f"the reward head ({head[0][0]}, ...) is frozen, so it would stay at its random initialisation while "
            "the loss still falls. With LoRA use task_type='SEQ_CLS' (rlft sets it) and keep the head in "
            "modules_to_save; without LoRA do not freeze it")
    return trainable


class RewardTrainer:
    """`RewardTrainer(model, args, train_dataset, eval_dataset, processing_class, peft_config).train()`."""

    def __init__(self, model, args: RewardConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None):
        self.args = args = validate(args or RewardConfig())
        ckpt.seed_everything(args.seed)
        self.accelerator = ckpt.make_accelerator(args)
        ckpt.check_writable(args.output_dir)
        source = model if isinstance(model, str | Path) else model.name_or_path
        self.tokenizer = processing_class or load_tokenizer(source, padding_side="right")
        self.train_pairs = PreferencePairs(load_dataset_any(train_dataset), self.tokenizer, args.max_length,
                                           args.truncation)
        self.eval_pairs = None if eval_dataset is None else PreferencePairs(
            load_dataset_any(eval_dataset), self.tokenizer, args.max_length, args.truncation)
        pairs_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps \
            * self.accelerator.num_processes
        self.steps_per_epoch = len(self.train_pairs) // pairs_per_step
        if self.steps_per_epoch == 0:
            raise ConfigError(f"{len(self.train_pairs)} usable pairs are fewer than one step needs ({pairs_per_step})")
        self.total_steps = args.max_steps if args.max_steps > 0 else int(args.num_train_epochs * self.steps_per_epoch)
        self._setup_model(model, peft_config)

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> RewardTrainer:
        """Everything from one config (what `rlft reward --config` runs)."""
        if not cfg.model_name_or_path:
            raise ConfigError("model_name_or_path is not set: give a hub id or a local model folder")
        return cls(cfg.model_name_or_path, cfg, cfg.train_dataset, cfg.eval_dataset)

    def _setup_model(self, model, peft_config) -> None:
        args = self.args
        dtype = resolve_dtype(args.dtype, args.bf16, args.fp16, self.accelerator.device)
        model = load_sequence_classifier(model, dtype, self.tokenizer.pad_token_id)
        if args.disable_dropout:
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        if peft_config is None and args.use_peft:
            peft_config = lora_config_from(args, "SEQ_CLS")
        model = apply_lora(model, peft_config, "SEQ_CLS")
        self.head_parameters = check_head_trainable(model)
        self.autocast_dtype = None
        if dtype == torch.float16:  # float32 master weights for what trains; float16 only where frozen
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.float()
            self.autocast_dtype = torch.float16
        if args.gradient_checkpointing:
            enable_checkpointing(model, args.gradient_checkpointing_kwargs)
        self.param_summary = parameter_summary(model)
        optimizer = ckpt.build_optimizer(model, args)
        scheduler = ckpt.build_scheduler(optimizer, args, self.total_steps)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)

    # ---- the loop -------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None) -> list[dict]:
        args = self.args
        start_step = self._resume(resume_from_checkpoint)
        self.log = RunLog(self.accelerator, args.output_dir, args.report_to, to_dict(args), self.total_steps,
                          start_step, show_progress=not args.disable_tqdm, project="rlft-reward")
        for line in self.train_pairs.report.lines(args.max_length, args.truncation):
            self.log.warn(line)
        self.log.info(f"reward model: {len(self.train_pairs)} pairs, {self.total_steps} steps, "
                      f"{self.param_summary['trainable']:,} trainable parameters, head: {self.head_parameters[:2]}")
        history, self.nonfinite_skipped, consecutive = [], 0, 0
        try:
            for step in range(start_step, self.total_steps):
                metrics = self._optimizer_step(step)  # pairs -> scores -> loss -> update
                consecutive = consecutive + 1 if metrics is None else 0
                if metrics is None:
                    self._skip(step, consecutive)
                    continue
                history.append(self._after_step(step + 1, metrics))  # log -> checkpoint
        finally:
            self.log.close()
        return history

    def _skip(self, step: int, consecutive: int) -> None:
        self.nonfinite_skipped += 1
        self.log.warn(f"step {step + 1}: non-finite loss, step skipped ({self.nonfinite_skipped} so far)")
        if consecutive >= self.args.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"{consecutive} consecutive steps had an inf/NaN loss. Likely causes: float16 weights overflowing "
                "(use dtype bfloat16 or float32), or a learning rate too high (now "
                f"{self.args.learning_rate}); lower it or set max_grad_norm")

    def _indices(self, step: int, micro: int) -> list[int]:
        epoch, offset = divmod(step, self.steps_per_epoch)
        order = epoch_order(len(self.train_pairs), self.args.seed, epoch)
        size = self.args.per_device_train_batch_size
        block = ((offset * self.args.gradient_accumulation_steps + micro) * self.accelerator.num_processes
                 + self.accelerator.process_index) * size
        return order[block:block + size]

    def _scores(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        autocast = torch.autocast(self.accelerator.device.type, dtype=self.autocast_dtype) \
            if self.autocast_dtype is not None else contextlib.nullcontext()
        with autocast:
            scores = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        scores = scores.float().squeeze(-1)  # [2B], float32 whatever the model dtype
        half = scores.shape[0] // 2
        return scores[:half], scores[half:]

    def _pair_loss(self, batch):
        chosen, rejected = self._scores(batch)
        loss, metrics = bradley_terry_loss(chosen, rejected, batch.get("margin"), self.args.center_rewards_coefficient)
        return loss, metrics, chosen.detach(), rejected.detach()

    def _optimizer_step(self, step: int) -> dict[str, float] | None:
        args, acc = self.args, self.accelerator
        self.model.train()
        sums, rewards = {}, []
        for micro in range(args.gradient_accumulation_steps):
            batch = self.train_pairs.batch(self._indices(step, micro), self.tokenizer.pad_token_id)
            last = micro == args.gradient_accumulation_steps - 1
            with contextlib.nullcontext() if last else acc.no_sync(self.model):
                loss, metrics, chosen, rejected = self._pair_loss(batch)
                if not torch.isfinite(loss):
                    self.optimizer.zero_grad(set_to_none=True)
                    return None
                acc.backward(loss / args.gradient_accumulation_steps)
            for key, value in {"loss": loss.detach(), **metrics}.items():
                sums[key] = sums.get(key, 0.0) + value.item() / args.gradient_accumulation_steps
            rewards.append(torch.cat([chosen, rejected]))
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
        if not torch.isfinite(torch.as_tensor(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        learning_rate = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        all_rewards = torch.cat(rewards)
        if acc.num_processes > 1:  # every process's pairs, not rank 0's alone
            keys = sorted(sums)
            reduced = acc.reduce(torch.tensor([sums[k] for k in keys], device=acc.device), "mean").tolist()
            sums = dict(zip(keys, reduced))
            all_rewards = acc.gather(all_rewards)
        return {**sums, "reward_mean": all_rewards.mean().item(), "reward_std": all_rewards.std().item(),
                "grad_norm": float(grad_norm), "learning_rate": learning_rate,
                "nonfinite_skipped": self.nonfinite_skipped}

    def _after_step(self, step: int, metrics: dict[str, float]) -> dict:
        args = self.args
        if step % args.logging_steps == 0 or step in (1, self.total_steps):
            self.log.log(metrics, step)
        if self.eval_pairs is not None and args.eval_steps and (step % args.eval_steps == 0 or step == self.total_steps):
            eval_metrics = self.evaluate()
            self.log.log(eval_metrics, step)
            metrics = {**metrics, **eval_metrics}
        self.log.advance(step, f"loss {metrics['loss']:.3f} acc {metrics['accuracy']:.2f}")
        if step % args.save_steps == 0 or step == self.total_steps:
            ckpt.save_checkpoint(self.accelerator, self.model, self.tokenizer, self.optimizer, self.scheduler,
                                 args.output_dir, step, {"num_processes": self.accelerator.num_processes},
                                 None, args.save_total_limit)
        return {"step": step, **metrics}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss, accuracy and mean margin over the whole eval set -> eval/* metrics."""
        self.model.eval()
        size, chosen_all, rejected_all = self.args.per_device_eval_batch_size, [], []
        for start in range(0, len(self.eval_pairs), size):
            batch = self.eval_pairs.batch(list(range(start, min(start + size, len(self.eval_pairs)))),
                                          self.tokenizer.pad_token_id)
            chosen, rejected = self._scores(batch)
            chosen_all.append(chosen)
            rejected_all.append(rejected)
        loss, metrics = bradley_terry_loss(torch.cat(chosen_all), torch.cat(rejected_all))
        return {"eval/loss": loss.item(), **{f"eval/{k}": v.item() for k, v in metrics.items()}}

    def _resume(self, resume_from_checkpoint) -> int:
        path = ckpt.resolve_resume(resume_from_checkpoint, self.args.output_dir)
        if path is None:
            ckpt.seed_everything(self.args.seed)
            return 0
        trainer_state, _ = ckpt.load_checkpoint(self.accelerator, self.model, self.optimizer, self.scheduler, path)
        return trainer_state["global_step"]

    def save_model(self, output_dir: str | Path) -> None:
        """A plain sequence-classification folder (LoRA merged in), loadable by any Auto class and by GRPO."""
        self.accelerator.wait_for_everyone()
        if not self.accelerator.is_main_process:
            return
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "merge_and_unload"):
            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(output_dir)
        self.tokenizer.save_pretrained(output_dir)
