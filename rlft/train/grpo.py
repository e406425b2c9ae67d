"""GRPOTrainer: rollout -> rewards -> advantages -> policy updates -> log -> checkpoint.

One optimiser step takes a rollout (prompts x num_generations completions), or reuses the
current one when num_iterations > 1, and runs gradient_accumulation_steps micro-batches whose
losses are shares of one step loss: the normalisers (completion count, token count) are
counted over the whole step and all processes before the first micro-batch.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoConfig

from rlft.config import ConfigError, GRPOConfig, to_dict, validate
from rlft.core.advantages import multi_reward_advantages
from rlft.core.logprobs import entropy_from_logits, selective_log_softmax
from rlft.core.losses import policy_loss
from rlft.data.prompts import PromptSet, epoch_order, is_conversational, load_dataset_any
from rlft.models import (
    GradientFlowError,
    apply_lora,
    check_gradient_flow,
    enable_checkpointing,
    load_causal_lm,
    load_tokenizer,
    lora_config_from,
    parameter_summary,
    resolve_dtype,
)
from rlft.rewards.calling import compute_rewards, resolve_reward, reward_name
from rlft.rollout.hf import HFGenerator, Rollout
from rlft.tracking import RunLog
from rlft.train import state as ckpt
from rlft.train.metrics import MetricWindow, StepSums, rollout_metrics

ZERO_LOSS_NOTE = (
    "loss is ~0 while grad_norm > 0: expected. With one update per rollout the ratio is exactly 1, so the "
    "surrogate's value is -mean(advantages), which is 0 per group; its gradient is not. Watch reward and "
    "grad_norm, not loss (docs/troubleshooting.md#loss-shows-0)."
)


@dataclass
class RolloutBatch:
    rollout: Rollout
    advantages: torch.Tensor  # [N]
    old_logps: torch.Tensor | None = None  # [N, C], only when num_iterations > 1
    ref_logps: torch.Tensor | None = None  # [N, C], only when beta > 0
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)


def _listify(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


class GRPOTrainer:
    """TRL-compatible GRPO: `GRPOTrainer(model, reward_funcs, args, train_dataset, ...).train()`."""

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None):
        self.args = args = validate(args or GRPOConfig())
        ckpt.seed_everything(args.seed)  # before LoRA init: adapter weights must not depend on earlier RNG use
        self.accelerator = ckpt.make_accelerator(args)
        ckpt.check_writable(args.output_dir)
        self._setup_rewards(reward_funcs)
        self.tokenizer = processing_class or load_tokenizer(model if isinstance(model, str | Path)
                                                            else model.name_or_path)
        self.tokenizer.padding_side = "left"
        context = self._context_length(model)
        self.train_prompts = PromptSet(load_dataset_any(train_dataset), self.tokenizer, args.max_prompt_length,
                                       args.max_completion_length, context)
        self.eval_prompts = None if eval_dataset is None else PromptSet(
            load_dataset_any(eval_dataset), self.tokenizer, args.max_prompt_length, args.max_completion_length, context)
        self.prompts_per_rollout = args.per_device_train_batch_size * args.gradient_accumulation_steps \
            // args.num_generations
        self.rollouts_per_epoch = len(self.train_prompts) // (self.prompts_per_rollout * self.accelerator.num_processes)
        if self.rollouts_per_epoch == 0:
            raise ConfigError(f"train_dataset has {len(self.train_prompts)} prompts, fewer than one rollout needs "
                              f"({self.prompts_per_rollout * self.accelerator.num_processes})")
        self.total_steps = args.max_steps if args.max_steps > 0 else \
            int(args.num_train_epochs * self.rollouts_per_epoch) * args.num_iterations
        self._setup_model(model, peft_config)
        self._flow_checked, self._zero_loss_noted, self._zero_signal_steps = False, False, 0
        self.generator = HFGenerator(self.tokenizer, args.max_completion_length, args.temperature, args.top_p,
                                     args.top_k, args.repetition_penalty, args.cache_implementation,
                                     args.shared_prompt_prefill)

    @classmethod
    def from_config(cls, cfg: GRPOConfig) -> GRPOTrainer:
        """Everything from one config (what `rlft grpo --config` runs)."""
        if not cfg.model_name_or_path:
            raise ConfigError("model_name_or_path is not set: give a hub id or a local model folder")
        return cls(cfg.model_name_or_path, cfg.reward_funcs, cfg, cfg.train_dataset, cfg.eval_dataset)

    # ---- set-up, all checks before the model is loaded -------------------------------------------
    def _setup_rewards(self, reward_funcs) -> None:
        specs = _listify(reward_funcs)
        if not specs:
            raise ConfigError("reward_funcs is empty: give at least one reward function")
        weights = self.args.reward_weights
        if weights is not None and len(weights) != len(specs):
            raise ConfigError(f"reward_weights has {len(weights)} values but reward_funcs has {len(specs)}: "
                              "give one weight per reward function")
        self.reward_funcs = [resolve_reward(s, self.args.max_completion_length) for s in specs]
        names = [reward_name(f) for f in self.reward_funcs]
        self.reward_names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        self.reward_weights = torch.tensor(weights if weights is not None else [1.0] * len(specs))

    def _context_length(self, model) -> int | None:
        config = model.config if hasattr(model, "config") else AutoConfig.from_pretrained(str(model))
        return getattr(config, "max_position_embeddings", None)

    def _setup_model(self, model, peft_config) -> None:
        args = self.args
        dtype = resolve_dtype(args.dtype, args.bf16, args.fp16, self.accelerator.device)
        model = load_causal_lm(model, dtype)
        if peft_config is None and args.use_peft:
            peft_config = lora_config_from(args, "CAUSAL_LM")
        model = apply_lora(model, peft_config, "CAUSAL_LM")
        self.is_peft = isinstance(model, PeftModel)
        if args.gradient_checkpointing:
            enable_checkpointing(model, args.gradient_checkpointing_kwargs)
        self.param_summary = parameter_summary(model)
        if self.param_summary["trainable"] == 0:
            raise GradientFlowError("the model has no trainable parameters (all requires_grad=False); unfreeze "
                                    "them or pass a peft_config whose target_modules match the model")
        # Reference policy: none at beta 0; LoRA's base with adapters off; else a frozen copy.
        self.ref_model = None
        if args.beta > 0 and not self.is_peft:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        optimizer = ckpt.build_optimizer(model, args)
        scheduler = ckpt.build_scheduler(optimizer, args, self.total_steps)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        if self.ref_model is not None:
            self.ref_model = self.ref_model.to(self.accelerator.device)

    # ---- the loop -------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None) -> list[dict]:
        args = self.args
        start_step, batch = self._resume(resume_from_checkpoint)
        self.log = RunLog(self.accelerator, args.output_dir, args.report_to, to_dict(args), self.total_steps,
                          start_step, show_progress=not args.disable_tqdm)
        self.log.info(f"GRPO: {self.total_steps} steps, {self.param_summary['trainable']:,} trainable of "
                      f"{self.param_summary['total']:,} parameters ({'LoRA' if self.is_peft else 'full'})")
        window, history = MetricWindow(), []
        if args.eval_on_start and start_step == 0 and self.eval_prompts is not None:
            history.append({**self.evaluate(), "step": 0})
            self.log.log(history[-1], 0)
        try:
            for step in range(start_step, self.total_steps):
                started = time.perf_counter()
                if batch is None or step % args.num_iterations == 0:
                    batch = self._make_rollout(step)  # rollout -> rewards -> advantages
                metrics = {**batch.metrics, **self._optimizer_step(batch)}  # policy updates
                metrics["time/step_seconds"] = time.perf_counter() - started
                metrics["tokens_per_second"] = batch.rollout.completion_mask.sum().item() / metrics["time/step_seconds"]
                window.add(metrics)
                logged = self._after_step(step + 1, window, batch)  # log -> checkpoint
                if logged:
                    history.append({"step": step + 1, **logged})
        finally:
            self.log.close()
        return history

    def _after_step(self, step: int, window: MetricWindow, batch: RolloutBatch) -> dict:
        args, logged = self.args, {}
        if step % args.logging_steps == 0 or step == self.total_steps or step == 1:
            logged = window.flush()
            logged["epoch"] = (step - 1) // args.num_iterations / self.rollouts_per_epoch
            self._explain(logged)
            if args.log_completions:
                self.log.samples(batch.samples[: args.num_completions_to_log], step)
            self.log.log(logged, step)
        if self.eval_prompts is not None and args.eval_steps and (step % args.eval_steps == 0 or step == self.total_steps):
            eval_metrics = self.evaluate()
            self.log.log(eval_metrics, step)
            logged.update(eval_metrics)
        status = f"reward {window.last.get('reward', float('nan')):.3f}"
        self.log.advance(step, status)
        if step % args.save_steps == 0 or step == self.total_steps:
            mid_rollout = step % args.num_iterations != 0
            extra = {"rollout_batch": batch} if mid_rollout else None
            ckpt.save_checkpoint(self.accelerator, self.model, self.tokenizer, self.optimizer, self.scheduler,
                                 args.output_dir, step, {"num_processes": self.accelerator.num_processes},
                                 extra, args.save_total_limit)
        return logged

    def _explain(self, logged: dict) -> None:
        """Say in the run itself what a zero loss or a zero-signal batch means."""
        if not self._zero_loss_noted and abs(logged.get("loss", 1.0)) < 1e-6 and logged.get("grad_norm", 0) > 0:
            self.log.info(ZERO_LOSS_NOTE)
            self._zero_loss_noted = True
        if logged.get("frac_reward_zero_std", 0.0) >= 1.0:
            self._zero_signal_steps += 1
            if self._zero_signal_steps == self.args.zero_signal_warning_steps:
                self.log.warn(
                    f"every group had zero reward spread for {self._zero_signal_steps} logged steps: advantages and "
                    "gradients are exactly 0, nothing is learned. Make the task easier or the rewards graded, raise "
                    "num_generations or temperature, or start from a better model (docs/troubleshooting.md)")
        else:
            self._zero_signal_steps = 0

    # ---- rollout -> rewards -> advantages ------------------------------------------------------------
    def _prompt_indices(self, rollout_index: int) -> list[int]:
        epoch, offset = divmod(rollout_index, self.rollouts_per_epoch)
        order = epoch_order(len(self.train_prompts), self.args.seed, epoch)
        per_process = self.prompts_per_rollout
        start = (offset * self.accelerator.num_processes + self.accelerator.process_index) * per_process
        return order[start:start + per_process]

    def _make_rollout(self, step: int) -> RolloutBatch:
        args, started = self.args, time.perf_counter()
        prompts = self.train_prompts.batch(self._prompt_indices(step // args.num_iterations))
        unwrapped = self.accelerator.unwrap_model(self.model)
        rollout = self.generator(unwrapped, prompts["prompt_ids"], args.num_generations)
        generated = time.perf_counter()
        rewards, completions = self._score(rollout, prompts, args.num_generations, step)
        scored = time.perf_counter()
        advantages, total, stats, everyone = self._advantages(rewards, rollout)
        if args.mask_truncated_completions:
            rollout.completion_mask[rollout.truncated] = 0
        batch = RolloutBatch(rollout, advantages.to(self.accelerator.device))
        if args.num_iterations > 1:
            batch.old_logps = self._logps_no_grad(self.model, rollout)
        if args.beta > 0:
            batch.ref_logps = self._reference_logps(rollout)
        batch.metrics = rollout_metrics(*everyone, self.reward_weights, self.reward_names, stats)
        batch.metrics.update({"time/generation_seconds": generated - started, "time/reward_seconds": scored - generated})
        batch.samples = [{"prompt": p, "completion": c, "reward": t, "advantage": a,
                          **{n: r for n, r in zip(self.reward_names, row)}}
                         for p, c, t, a, row in zip(self._repeat(prompts["prompts"], args.num_generations),
                                                    completions, total.tolist(), advantages.tolist(), rewards.tolist())]
        return batch

    def _advantages(self, rewards: torch.Tensor, rollout: Rollout):
        """Advantages from the rewards of ALL processes (groups never span two; batch-level statistics
        such as scale_rewards='batch' need everyone's rewards), sliced back to this process's rows."""
        acc, args = self.accelerator, self.args
        lengths = rollout.completion_mask.sum(dim=1).float()
        gathered = [acc.gather(t.to(acc.device)).cpu() if acc.num_processes > 1 else t.cpu()
                    for t in (rewards, lengths, rollout.truncated.float())]
        advantages, total, stats = multi_reward_advantages(
            gathered[0], self.reward_weights, args.num_generations, args.scale_rewards, args.multi_objective_aggregation)
        rows = slice(acc.process_index * rewards.shape[0], (acc.process_index + 1) * rewards.shape[0])
        everyone = (gathered[0], total, gathered[1], gathered[2].bool())
        return advantages[rows], total[rows], stats, everyone

    @staticmethod
    def _repeat(values: list, times: int) -> list:
        return [v for v in values for _ in range(times)]

    def _score(self, rollout: Rollout, prompts: dict, group: int, step: int) -> tuple[torch.Tensor, list]:
        mask = rollout.completion_mask.bool()
        ids = [row[m].tolist() for row, m in zip(rollout.completion_ids.cpu(), mask.cpu())]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        repeated_prompts = self._repeat(prompts["prompts"], group)
        completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                       for p, t in zip(repeated_prompts, texts)]
        columns = {k: self._repeat(v, group) for k, v in prompts.items() if k not in ("prompts", "prompt_ids")}
        rewards = compute_rewards(self.reward_funcs, self.reward_names, prompts=repeated_prompts,
                                  completions=completions, completion_ids=ids, columns=columns, step=step,
                                  allow_nan=self.args.allow_nan_rewards)
        return rewards, completions

    # ---- log-probs ----------------------------------------------------------------------------------------
    def _forward(self, model, rollout: Rollout, rows, entropy: bool = False):
        """Per-token log-probs [b, c] of the completion tokens (and their entropy [b, c]) for `rows` (a slice
        or an index tensor). The batch is cut to its own longest completion (c <= C) and its longest prompt:
        columns that are padding in every row cost a forward pass and change nothing."""
        completion_mask = rollout.completion_mask[rows]
        width = max(int(completion_mask.sum(dim=1).max()), 1)
        prompt_mask = rollout.prompt_mask[rows]
        first = int((prompt_mask.sum(dim=0) > 0).int().argmax())  # prompts are left-padded
        completion_ids = rollout.completion_ids[rows, :width]
        ids = torch.cat([rollout.prompt_ids[rows, first:], completion_ids], dim=1)
        mask = torch.cat([prompt_mask[:, first:], completion_mask[:, :width]], dim=1)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded prompts
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
                       logits_to_keep=width + 1).logits[:, :-1]  # [b, c, V]: position t predicts token t
        logps = selective_log_softmax(logits, completion_ids, self.args.temperature, self.args.logprob_chunk_size)
        ent = entropy_from_logits(logits.detach(), self.args.temperature, self.args.logprob_chunk_size) if entropy \
            else None
        return logps, ent

    def _micro_batches(self, rollout: Rollout) -> list[torch.Tensor]:
        """Row indices of each micro-batch, longest completions first, so a micro-batch pads only to its own
        longest row (the step's loss is a sum over rows with global normalisers: row order changes nothing)."""
        lengths = rollout.completion_mask.sum(dim=1)
        order = torch.argsort(lengths, descending=True, stable=True)
        return list(order.split(self.args.per_device_train_batch_size))

    @torch.no_grad()
    def _logps_no_grad(self, model, rollout: Rollout) -> torch.Tensor:
        out = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)  # [N, C]
        for rows in self._micro_batches(rollout):
            logps = self._forward(model, rollout, rows)[0]
            out[rows, :logps.shape[1]] = logps.float()
        return out

    def _reference_logps(self, rollout: Rollout) -> torch.Tensor:
        if self.ref_model is not None:
            return self._logps_no_grad(self.ref_model, rollout)
        with self.accelerator.unwrap_model(self.model).disable_adapter():  # LoRA: the base model is the reference
            return self._logps_no_grad(self.model, rollout)

    # ---- policy update ---------------------------------------------------------------------------------
    def _optimizer_step(self, batch: RolloutBatch) -> dict[str, float]:
        args, acc = self.args, self.accelerator
        started = time.perf_counter()
        rollout = batch.rollout
        # Global normalisers: the whole step, every micro-batch, every process.
        num_items = acc.reduce(rollout.completion_mask.sum().float(), "sum")
        num_sequences = rollout.completion_ids.shape[0] * acc.num_processes
        sums = StepSums()
        batches = self._micro_batches(rollout)
        self.model.train()
        for k, rows in enumerate(batches):
            sync = contextlib.nullcontext() if k == len(batches) - 1 else acc.no_sync(self.model)
            with sync:
                logps, entropy = self._forward(self.model, rollout, rows, entropy=True)
                width = logps.shape[1]
                mask = rollout.completion_mask[rows, :width]
                old = batch.old_logps[rows, :width] if batch.old_logps is not None else logps.detach()
                loss, metrics = policy_loss(
                    logps, old, batch.advantages[rows], mask, loss_type=args.loss_type,
                    epsilon_low=args.epsilon, epsilon_high=args.epsilon_high,
                    ref_logps=None if batch.ref_logps is None else batch.ref_logps[rows, :width], beta=args.beta,
                    kl_estimator=args.kl_estimator, importance_sampling_level=args.importance_sampling_level,
                    max_completion_length=args.max_completion_length, num_items=num_items,
                    num_sequences=num_sequences, sapo_temperature_pos=args.sapo_temperature_pos,
                    sapo_temperature_neg=args.sapo_temperature_neg)
                if not loss.requires_grad:
                    raise GradientFlowError("the loss does not require grad: no trainable parameter is connected to "
                                            "it (all parameters frozen, or adapters disabled)")
                # DDP averages gradients over processes; the normalisers are global sums, so undo the mean.
                acc.backward(loss * acc.num_processes)
            sums.add(loss, metrics, entropy, mask)
        return self._finish_step(batch, sums, started)

    def _finish_step(self, batch: RolloutBatch, sums: StepSums, started: float) -> dict[str, float]:
        # Checked at the first step with a learning signal: with all advantages 0 (and LoRA's B = 0 making
        # policy == reference) a zero gradient is correct, not a wiring fault.
        if not self._flow_checked and batch.advantages.abs().sum() > 0:
            check_gradient_flow(self.accelerator.unwrap_model(self.model))
            self._flow_checked = True
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        learning_rate = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = sums.reduce(self.accelerator)
        metrics.update({"grad_norm": float(grad_norm), "learning_rate": learning_rate,
                        "time/train_seconds": time.perf_counter() - started})
        return metrics

    # ---- evaluation, resume, save ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy completion per eval prompt, scored by every reward function -> eval/* metrics."""
        assert self.eval_prompts is not None
        unwrapped = self.accelerator.unwrap_model(self.model)
        rows, chunk = list(range(len(self.eval_prompts))), 256
        all_rewards = []
        for start in range(0, len(rows), chunk):
            prompts = self.eval_prompts.batch(rows[start:start + chunk])
            rollout = self.generator(unwrapped, prompts["prompt_ids"], 1, greedy=True)
            all_rewards.append(self._score(rollout, prompts, 1, step=-1)[0])
        rewards = torch.cat(all_rewards)  # [E, F]
        metrics = {f"eval/rewards/{n}/mean": torch.nanmean(rewards[:, i]).item() for i, n in enumerate(self.reward_names)}
        metrics["eval/reward"] = torch.nanmean(torch.nansum(rewards * self.reward_weights, dim=1)).item()
        return metrics

    def _resume(self, resume_from_checkpoint) -> tuple[int, RolloutBatch | None]:
        path = ckpt.resolve_resume(resume_from_checkpoint, self.args.output_dir)
        if path is None:
            ckpt.seed_everything(self.args.seed)
            return 0, None
        trainer_state, extra = ckpt.load_checkpoint(self.accelerator, self.model, self.optimizer, self.scheduler, path)
        if trainer_state.get("num_processes", 1) != self.accelerator.num_processes:
            raise ConfigError(f"{path} was written by {trainer_state['num_processes']} processes; resume with the same "
                              f"number (now {self.accelerator.num_processes})")
        return trainer_state["global_step"], extra.get("rollout_batch")

    def save_model(self, output_dir: str | Path) -> None:
        """A normal transformers folder (full fine-tuning) or peft adapter folder (LoRA), plus the tokenizer."""
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            self.accelerator.unwrap_model(self.model).save_pretrained(output_dir)
            self.tokenizer.save_pretrained(output_dir)
