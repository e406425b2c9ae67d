"""GRPOTrainer: rollout -> rewards -> advantages -> policy updates -> log -> checkpoint.

One rollout (generation batch) holds per_device_train_batch_size x steps_per_generation
completions per process and feeds steps_per_generation / gradient_accumulation_steps optimiser
steps, each on its own slice, repeated num_iterations times (TRL's semantics). With more than one
optimiser step per rollout, the old policy's log-probs are computed once per rollout.
The loop keeps a transformers TrainerState and fires TrainerCallback events (rlft/train/flow.py).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import torch
from peft import PeftModel

from rlft.compat import no_effect_notes
from rlft.config import GRPOConfig, validate
from rlft.core.advantages import multi_reward_advantages
from rlft.data.prompts import PromptSet, epoch_order, load_eval_datasets, materialize
from rlft.errors import ConfigError
from rlft.models import (
    GradientFlowError,
    apply_lora,
    cast_lm_head_to_fp32,
    context_length,
    disable_dropout,
    enable_checkpointing,
    load_causal_lm,
    parameter_summary,
    prepare_tokenizer,
    router_loss_coef,
    training_dtype,
)
from rlft.rewards.calling import RewardLog, check_keywords, compute_rewards, resolve_rewards
from rlft.rollout.base import engine_metrics, weights_changed
from rlft.scoring import install_scoring
from rlft.train import checkpoint as ckpt
from rlft.train import engine_io, runs
from rlft.train import state as run_state
from rlft.train.agent import RolloutSource
from rlft.train.dynamic import sample_informative
from rlft.train.engines import make_engine
from rlft.train.flow import Flow
from rlft.train.grpo_helpers import GRPOHelpers
from rlft.train.grpo_update import PolicyUpdate, RolloutBatch, UpdateCounters, option_notes
from rlft.train.loop import TrainLoop
from rlft.train.metrics import MetricWindow, rollout_metrics, tool_metrics
from rlft.train.surface import TrainerSurface
from rlft.train.token_advantages import gathered_token_inputs, row_view

ZERO_LOSS_NOTE = (
    "loss is ~0 while grad_norm > 0: expected. With one update per rollout the ratio is exactly 1, so the "
    "surrogate's value is -mean(advantages), which is 0 per group; its gradient is not. Watch reward and "
    "grad_norm, not loss (docs/troubleshooting.md#loss-shows-0)."
)


def _repeat(values: list, times: int) -> list:
    return [v for v in values for _ in range(times)]


def default_output_dir(model, suffix: str) -> str:
    """TRL's output_dir when no args are given: '<model name>-GRPO' / '<model name>-Reward'."""
    name = (model if isinstance(model, str | Path)
            else getattr(getattr(model, "config", None), "_name_or_path", ""))
    return f"{Path(str(name or 'model')).name}-{suffix}"


class GRPOTrainer(TrainLoop, PolicyUpdate, RolloutSource, GRPOHelpers, TrainerSurface):
    """TRL-compatible GRPO: `GRPOTrainer(model, reward_funcs, args, train_dataset, ...).train()`; `tools`,
    `environment_factory` and `rollout_func` as in TRL (rlft/train/agent.py)."""

    _tag_names = ["trl", "grpo", "rlft"]
    _name = "GRPO"

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None,
                 rollout_func=None, environment_factory=None):
        self.args = args = validate(args or GRPOConfig(output_dir=default_output_dir(model, "GRPO")))
        # before LoRA init: adapter weights must not depend on earlier RNG use
        run_state.seed_everything(args.seed)
        self.accelerator = run_state.make_accelerator(args)
        self.engine = make_engine(self.accelerator)
        run_state.check_writable(args.output_dir)
        source = model if isinstance(model, str | Path) else getattr(model, "name_or_path", None)
        self.processing_class = self.tokenizer = prepare_tokenizer(processing_class, source, args, "left")
        own_reward = self._setup_tools(tools, environment_factory, rollout_func)
        reward_funcs = [*(reward_funcs if isinstance(reward_funcs, list | tuple) else
                          [] if reward_funcs is None else [reward_funcs]), *own_reward]
        weights = None if args.reward_weights is None else [*args.reward_weights, *[1.0] * len(own_reward)]
        self.reward_funcs, self.reward_names, self.reward_weights = resolve_rewards(
            reward_funcs, weights, reward_processing_classes, args.max_completion_length)
        # TRL's list
        self.reward_processing_classes = [getattr(f, "tokenizer", None) for f in self.reward_funcs]
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self._setup_batches(self._environment_data(train_dataset), model)
        self._check_chat_prompts(self.train_prompts)
        self._setup_notes = [] if rollout_func is not None else \
            check_keywords(self.reward_funcs, self.reward_names, self.train_prompts.extra_columns)
        self.eval_datasets = load_eval_datasets(eval_dataset)
        self._eval_prompts: dict[str, PromptSet] = {}
        self._setup_model(model, source, peft_config, optimizers, quantization_config)
        self._zero_loss_noted, self._zero_signal_steps = False, 0
        self.counters = UpdateCounters(entropy_coef=args.entropy_coef)  # in checkpoints
        for note in option_notes(args):  # at construction, as TRL warns
            logging.getLogger("rlft").warning(note)
        self._setup_notes += no_effect_notes(args)
        self.generator = self._wrap_generator(source)
        self.flow = Flow(args, callbacks, self.model, self.tokenizer, self.optimizer, self.scheduler,
                         self.total_steps, self.rollouts_per_epoch * self.steps_per_rollout, self.accelerator,
                         args.per_device_train_batch_size)
        self.state = self.flow.state
        self.flow.fire("on_init_end")

    # ---- set-up, all checks before the model is loaded -------------------------------------------
    def _setup_batches(self, dataset, model) -> None:
        """Generation batch (TRL's steps_per_generation / generation_batch_size) and the run's length."""
        args, processes = self.args, self.accelerator.num_processes
        spg = args.steps_per_generation or args.gradient_accumulation_steps
        if args.generation_batch_size is not None:
            per_step = args.per_device_train_batch_size * processes
            if args.generation_batch_size % per_step:
                raise ConfigError(f"generation_batch_size={args.generation_batch_size} is not a multiple of "
                                  f"per_device_train_batch_size x processes = {per_step}")
            spg = args.generation_batch_size // per_step
        rollout = args.per_device_train_batch_size * spg  # completions per process per generation
        if spg % args.gradient_accumulation_steps or rollout % args.num_generations:
            raise ConfigError(f"a generation batch of {rollout} completions per process ({spg} steps) must "
                              f"hold whole groups of num_generations={args.num_generations} and whole "
                              "optimiser steps of "
                              f"gradient_accumulation_steps={args.gradient_accumulation_steps}")
        self.rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.steps_per_rollout = spg // args.gradient_accumulation_steps * args.num_iterations
        self.prompts_per_rollout = rollout // args.num_generations
        needed = None
        if args.max_steps > 0:
            rollouts = -(-args.max_steps // self.steps_per_rollout)
            needed = rollouts * self.prompts_per_rollout * processes
        dataset, self.streaming = materialize(dataset, needed)
        context = context_length(model, args.trust_remote_code)
        self.train_prompts = PromptSet(dataset, self.tokenizer, args.max_prompt_length,
                                       args.max_completion_length, context, self._template_kwargs)
        self.rollouts_per_epoch = len(self.train_prompts) // (self.prompts_per_rollout * processes)
        if self.rollouts_per_epoch == 0:
            raise ConfigError(f"train_dataset has {len(self.train_prompts)} prompts, fewer than one "
                              f"generation batch needs ({self.prompts_per_rollout * processes})")
        self.total_steps = args.max_steps if args.max_steps > 0 else \
            int(args.num_train_epochs * self.rollouts_per_epoch) * self.steps_per_rollout
        self.context = context

    def _setup_model(self, model, source, peft_config, optimizers, quantization_config=None) -> None:
        args = self.args
        dtype = training_dtype(args, self.accelerator.device)
        self.engine.before_loading(dtype)
        init_kwargs = {**(args.model_init_kwargs or {}),
                       **({"quantization_config": quantization_config}
                          if quantization_config is not None else {})}
        model = load_causal_lm(model, dtype, init_kwargs, args.trust_remote_code)
        install_scoring(model)  # log-probs from hidden states through the LM head in tiles (rlft/scoring.py)
        if args.cast_lm_head_to_fp32:
            cast_lm_head_to_fp32(model)
        model = apply_lora(model, peft_config, "CAUSAL_LM")
        self._add_model_tags(model)
        self.router_aux_loss_coef = router_loss_coef(model, args.router_aux_loss_coef)
        if args.disable_dropout:  # after LoRA: its adapters' dropout too
            disable_dropout(model)
        elif args.use_vllm and args.vllm_importance_sampling_correction and any(
                isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
            self._setup_notes.append(
                "dropout is on (lora_dropout or the model's own) while vLLM samples without it: the sampling "
                "correction then also weighs dropout noise, and the sampling/ mismatch metrics show it "
                "although the weights match. Set disable_dropout: true for vLLM runs")
        self.is_peft = isinstance(model, PeftModel)
        if args.sync_ref_model and self.is_peft:
            raise ConfigError("sync_ref_model=True with a LoRA model: the reference is the base model under "
                              "the adapters, not a copy that can move; use full fine-tuning or "
                              "sync_ref_model: false")
        if next(model.parameters()).dtype == torch.float16 and not self.is_peft:
            raise ConfigError("float16 full fine-tuning is refused: AdamW would keep float16 state and "
                              "overflow within a step (inf/NaN weights). Use bf16 / dtype: bfloat16, "
                              "float32, or LoRA")
        if args.gradient_checkpointing:
            enable_checkpointing(model, args.gradient_checkpointing_kwargs)
        self.param_summary = parameter_summary(model)
        if self.param_summary["trainable"] == 0:
            raise GradientFlowError("the model has no trainable parameters (all requires_grad=False); "
                                    "unfreeze them or pass a peft_config whose target_modules match the "
                                    "model")
        reference = self._reference_copy(model, source, dtype)
        optimizer, scheduler = optimizers
        optimizer = optimizer or run_state.build_optimizer(model, args)
        self.scheduler = scheduler or run_state.build_scheduler(optimizer, args, self.total_steps)
        self.model, self.optimizer = self.engine.prepare(model, optimizer, args.max_grad_norm)
        self.ref_model = None if reference is None else self.engine.prepare_reference(reference)

    def _reference_copy(self, model, source, dtype):
        """Reference policy: none at beta 0; LoRA's base with adapters off; else a frozen copy. Under ZeRO-3
        the loaded weights are already in pieces, so the reference is loaded again (sharded the same way)."""
        if self.args.beta == 0 or self.is_peft:
            return None
        if self.args.sync_ref_model and self.engine.sharded:
            raise ConfigError(f"sync_ref_model under {self.engine.name}: moving a reference whose weights "
                              "are in pieces is not built; use DDP, or sync_ref_model: false")
        if not self.engine.partitions_on_load:
            return copy.deepcopy(model).eval().requires_grad_(False)
        if source is None or isinstance(source, torch.nn.Module):
            raise ConfigError("ZeRO-3 full fine-tuning with beta > 0 loads the reference model a second "
                              "time: pass the model as a hub id or folder, not a loaded model object")
        reference = load_causal_lm(source, dtype, self.args.model_init_kwargs, self.args.trust_remote_code)
        install_scoring(reference)
        return reference.eval().requires_grad_(False)

    # ---- the loop (rlft/train/loop.py runs the steps) ------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        return self.rollouts_per_epoch * self.steps_per_rollout

    @property
    def _eval_sets(self) -> dict:
        return self.eval_datasets

    def _announce(self) -> None:
        self.log.info(f"{self._name}: {self.total_steps} steps, {self.param_summary['trainable']:,} "
                      f"trainable of {self.param_summary['total']:,} parameters "
                      f"({'LoRA' if self.is_peft else 'full'}), engine {self.engine.name} on "
                      f"{self.accelerator.num_processes} process(es)")
        for note in [*self._setup_notes, *filter(None, self._notes)]:
            self.log.warn(note)
        weights_changed(self.generator)  # a resume may have loaded other weights than the engine holds

    def _step(self, step: int) -> dict[str, float]:
        """One GRPO step: a new rollout every steps_per_rollout steps (rollout -> rewards -> advantages), then
        one policy update on this step's part of it, then the reference sync (sync_ref_model)."""
        started = time.perf_counter()
        if self._batch is None or step % self.steps_per_rollout == 0:
            # rollout -> rewards -> advantages
            self._batch = self._make_rollout(step // self.steps_per_rollout)
        batch, state = self._batch, self.flow.state
        part = (step % self.steps_per_rollout) % (self.steps_per_rollout // self.args.num_iterations)
        metrics = {**batch.metrics, **self._optimizer_step(batch.part(part, self.rows_per_step))}  # update
        metrics.update(self._sync_reference(step + 1))  # sync_ref_model (TR-DPO)
        seconds = time.perf_counter() - started
        metrics.update({"step_time": seconds, "time/step_seconds": seconds,
                        "num_tokens": state.num_input_tokens_seen,
                        "tokens_per_second": batch.rollout.completion_mask.sum().item() / seconds})
        return metrics

    def _after_step(self, step: int, metrics: dict[str, float]) -> None:
        """log -> evaluate -> checkpoint (a checkpoint inside a rollout holds the rest of that rollout)."""
        control, window, batch = self.flow.control, self._window, self._batch
        window.add(metrics)
        if control.should_log and window.rows:
            self._log_row(self._flush(window, batch, step))
        if control.should_evaluate and self.eval_datasets:
            self.evaluate()
        self.log.advance(step, f"reward {window.last.get('reward', float('nan')):.3f}")
        if control.should_save:
            tensors, extra = self._carried(step, batch)
            ckpt.save_checkpoint(
                self.accelerator, self.model, self.tokenizer, self.optimizer, self.scheduler,
                self.args.output_dir, step, self._rlft_state(window), tensors or None, extra, self.flow,
                self.args.save_total_limit, self.engine)
            self.flow.fire("on_save")

    def _carried(self, step: int, batch: RolloutBatch) -> tuple[dict, dict | None]:
        """What a checkpoint carries besides weights and optimiser: the rest of a rollout in progress, a moved
        reference (tensors), and the rollout's metrics and samples (JSON)."""
        mid_rollout = step % self.steps_per_rollout != 0
        tensors = {**(batch.tensors() if mid_rollout else {}), **self._reference_tensors()}
        return tensors, {"metrics": batch.metrics, "samples": batch.samples} if mid_rollout else None

    def _restore_carried(self, tensors: dict, extra: dict | None) -> dict:
        """The tensors of the rollout in progress, from what `_carried` saved."""
        return self._load_reference_tensors(tensors)

    def _flush(self, window: MetricWindow, batch: RolloutBatch | None, step: int) -> dict:
        logged = window.flush()
        self._explain(logged)
        if self.args.log_completions and batch is not None:
            self.log.samples(batch.samples[: self.args.num_completions_to_log], step)
        return logged

    def _final_row(self) -> dict:
        """The summary row transformers logs at the end (train_runtime, train_loss, ...), holding the metrics
        of the steps since the last log, as TRL's does: no step's metrics are lost and log_history[-1] has
        them."""
        window, batch = self._window, self._batch
        summary = self.flow.summary(self.rows_per_step * self.accelerator.num_processes)
        if not window.rows:
            return self.flow.record(summary)
        return self._log_row({**self._flush(window, batch, self.flow.state.global_step), **summary})

    def _rlft_state(self, window: MetricWindow) -> dict:
        return {"num_processes": self.accelerator.num_processes, "config": self._record,
                "config_hash": runs.config_hash(self._record), "loss_sum": self.flow.loss_sum,
                "metric_window": window.rows, **self.counters.state_dict()}

    def _explain(self, logged: dict) -> None:
        """Say in the run itself what a zero loss or a zero-signal batch means."""
        if (not self._zero_loss_noted and abs(logged.get("loss", 1.0)) < 1e-6
                and logged.get("grad_norm", 0) > 0):
            self.log.info(ZERO_LOSS_NOTE)
            self._zero_loss_noted = True
        if logged.get("frac_reward_zero_std", 0.0) >= 1.0:
            self._zero_signal_steps += 1
            if self._zero_signal_steps == self.args.zero_signal_warning_steps:
                self.log.warn(
                    f"every group had zero reward spread for {self._zero_signal_steps} logged steps: "
                    "advantages and gradients are exactly 0, nothing is learned. Make the task easier or the "
                    "rewards graded, raise num_generations or temperature, or start from a better model "
                    "(docs/troubleshooting.md)")
        else:
            self._zero_signal_steps = 0

    # ---- rollout -> rewards -> advantages ------------------------------------------------------------
    def _prompt_indices(self, rollout_index: int) -> list[int]:
        epoch, offset = divmod(rollout_index, self.rollouts_per_epoch)
        shuffle = self.args.shuffle_dataset and not self.streaming
        order = epoch_order(len(self.train_prompts), self.args.seed, epoch) if shuffle \
            else list(range(len(self.train_prompts)))
        per_process = self.prompts_per_rollout
        start = (offset * self.accelerator.num_processes + self.accelerator.process_index) * per_process
        return order[start:start + per_process]

    def _generate_and_score(self, prompts: dict, reward_log: RewardLog, timing: dict):
        """num_generations completions per prompt (the engine, the tool loop or rollout_func) and their
        rewards; adds to the step's timings, token count and generation utilisation."""
        args, started = self.args, time.perf_counter()
        rollout = self._generate(prompts, args.num_generations)
        generated = time.perf_counter()
        # before masking
        timing["tokens"] += (rollout.prompt_mask.sum() + rollout.completion_mask.sum()).float()
        for key, value in self.throughput.generation(rollout, generated - started,
                                                     args.num_generations).items():
            timing[key] = timing.get(key, 0.0) + value * (generated - started)  # time-weighted over rounds
        rewards, completions = self._score(rollout, prompts, args.num_generations, reward_log)
        timing["time/generation_seconds"] += generated - started
        timing["time/reward_seconds"] += time.perf_counter() - generated
        return rollout, rewards, completions

    def _make_rollout(self, rollout_index: int) -> RolloutBatch:
        args, reward_log = self.args, RewardLog()
        timing = {"time/generation_seconds": 0.0, "time/reward_seconds": 0.0, "tokens": torch.zeros(())}
        if args.dynamic_sampling:  # rounds until the batch holds groups with a reward spread (DAPO)
            prompts, rollout, rewards, completions, sampling = sample_informative(
                self, rollout_index, reward_log, timing)
        else:
            prompts = self.train_prompts.batch(self._prompt_indices(rollout_index))
            (rollout, rewards, completions), sampling = self._generate_and_score(
                prompts, reward_log, timing), {}
        tokens, seconds = timing.pop("tokens"), max(timing["time/generation_seconds"], 1e-12)
        sampling.update({k: timing.pop(k) / seconds for k in [k for k in timing if k.startswith("perf/")]})
        sampling.update({**timing, **engine_metrics(self.generator)})  # vLLM: weight-sync seconds and bytes
        advantages, total, stats, everyone = self._advantages(rewards, rollout)
        if args.mask_truncated_completions:
            rollout.completion_mask[rollout.truncated] = 0
        batch = RolloutBatch(rollout, advantages.to(self.accelerator.device))
        if self.steps_per_rollout > 1:
            batch.old_logps = self._sampling_policy_logps(rollout)
        self._policy_logps_of = None  # the rollout's log-probs are in the batch now, or not needed
        if args.beta > 0 and self.kl_in_loss:
            batch.ref_logps = self._reference_logps(rollout)
        batch.metrics = rollout_metrics(*everyone, self.reward_weights, self.reward_names, stats)
        batch.metrics.update(reward_log.metrics(self.accelerator))
        batch.metrics.update(tool_metrics(rollout.stats, self.accelerator))
        batch.metrics.update(sampling)
        self.flow.state.num_input_tokens_seen += int(
            self.accelerator.reduce(tokens.to(self.accelerator.device), "sum").item())
        columns = reward_log.columns(len(completions))
        batch.samples = [{"prompt": p, "completion": c, "reward": t, "advantage": a,
                          **{n: r for n, r in zip(self.reward_names, row)},
                          **{k: v[i] for k, v in columns.items()}}
                         for i, (p, c, t, a, row) in enumerate(zip(
                             _repeat(prompts["prompts"], args.num_generations), completions, total.tolist(),
                             row_view(advantages, rollout.loss_mask).tolist(), rewards.tolist()))]
        self._latest_samples = batch.samples
        return batch

    def _advantages(self, rewards: torch.Tensor, rollout):
        """Advantages from the rewards of ALL processes (groups never span two; batch-level statistics
        such as scale_rewards='batch' need everyone's rewards), sliced back to this process's rows."""
        acc, args = self.accelerator, self.args
        lengths = rollout.loss_mask.sum(dim=1).float()  # TRL's: tokens the policy generated (not tool output)
        gathered = [acc.gather(t.to(acc.device)).cpu() if acc.num_processes > 1 else t.cpu()
                    for t in (rewards, lengths, rollout.truncated.float())]
        token = gathered_token_inputs(self, rollout) if self.token_level_advantages else {}  # REINFORCE++
        advantages, total, stats = multi_reward_advantages(
            gathered[0], self.reward_weights, args.num_generations, args.scale_rewards,
            args.multi_objective_aggregation, estimator=args.advantage_estimator, lengths=gathered[1],
            **token)
        rows = slice(acc.process_index * rewards.shape[0], (acc.process_index + 1) * rewards.shape[0])
        everyone = (gathered[0], total, gathered[1], gathered[2].bool())
        width = rollout.completion_ids.shape[1]  # token-level advantages: this process's columns
        local = advantages[rows] if advantages.ndim == 1 else advantages[rows, :width]
        return local, total[rows], stats, everyone

    def _score(self, rollout, prompts: dict, group: int, reward_log: RewardLog | None = None):
        mask = rollout.completion_mask.bool()
        ids = [row[m].tolist() for row, m in zip(rollout.completion_ids.cpu(), mask.cpu())]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        repeated_prompts = _repeat(prompts["prompts"], group)
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                       for p, t in zip(repeated_prompts, texts)]
        if rollout.completions is not None:  # multi-turn: the assistant and tool messages
            completions = rollout.completions
        columns = {k: _repeat(v, group) for k, v in prompts.items() if k not in ("prompts", "prompt_ids")}
        columns.update({"environments": None, **rollout.extra})  # TRL passes environments=None without them
        rewards = compute_rewards(self.reward_funcs, self.reward_names, prompts=repeated_prompts,
                                  completions=completions, completion_ids=ids, columns=columns,
                                  trainer_state=self.flow.state, reward_log=reward_log or RewardLog(),
                                  allow_nan=self.args.allow_nan_rewards)
        return rewards, completions

    # ---- evaluation, resume, save ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Completions for every eval prompt (greedy; num_generations_eval sampled ones when set), scored by
        every reward function -> `<prefix>_reward`, `<prefix>_rewards/<name>/mean`, and the loss on them ->
        `<prefix>_loss` (0 for greedy completions without KL: one per prompt has no advantage). A dict of
        datasets is evaluated per name with prefix `<prefix>_<name>`."""
        datasets = self.eval_datasets if eval_dataset is None else load_eval_datasets(eval_dataset)
        if not datasets:
            raise ConfigError("evaluate() needs an eval_dataset (none was given to the trainer or the call)")
        metrics = {}
        for name, dataset in datasets.items():
            prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
            metrics.update(self._evaluate_one(self._eval_set(name, dataset, eval_dataset is None), prefix))
        self._log_row(metrics)
        self.flow.fire("on_evaluate", metrics=metrics)
        return metrics

    def _eval_set(self, name, dataset, cached: bool) -> PromptSet:
        if cached and name in self._eval_prompts:
            return self._eval_prompts[name]
        args = self.args
        prompts = PromptSet(materialize(dataset, None, whole=True)[0], self.tokenizer, args.max_prompt_length,
                            args.max_completion_length, self.context, self._template_kwargs)
        if cached:
            self._eval_prompts[name] = prompts
        return prompts

    def _evaluate_one(self, prompts: PromptSet, prefix: str) -> dict[str, float]:
        n = self.args.num_generations_eval or 1
        rows, chunk, all_rewards, loss = list(range(len(prompts))), max(256 // n, 1), [], 0.0
        for start in range(0, len(rows), chunk):
            batch = prompts.batch(rows[start:start + chunk])
            rollout = self._generate(batch, n, greedy=self.args.num_generations_eval is None)
            all_rewards.append(self._score(rollout, batch, n)[0])
            loss += self._eval_loss(rollout, all_rewards[-1], n) * all_rewards[-1].shape[0]
        rewards = torch.cat(all_rewards)  # [E * n, F]
        metrics = {f"{prefix}_loss": loss / max(rewards.shape[0], 1)}
        metrics.update({f"{prefix}_rewards/{r}/mean": torch.nanmean(rewards[:, i]).item()
                        for i, r in enumerate(self.reward_names)})
        metrics[f"{prefix}_reward"] = torch.nanmean(torch.nansum(rewards * self.reward_weights, dim=1)).item()
        return metrics

    def _resume(self, resume_from_checkpoint) -> int:
        """The first step to run; restores the rollout in flight and the logging window with it."""
        path = ckpt.resolve_resume(resume_from_checkpoint, self.args.output_dir)
        window = MetricWindow()
        self._record = runs.run_record(self.args, self.accelerator.unwrap_model(self.model),
                                       self.reward_names)
        if path is None:
            self._notes = [runs.claim_output_dir(self.accelerator, self.args)]
            run_state.seed_everything(self.args.seed)
            self._batch, self._window = None, window
            return 0
        self._notes = runs.check_resume(path, ckpt.read_state(path), self._record,
                                        runs.field_defaults(self.args))
        state, tensors, extra = ckpt.load_checkpoint(self.accelerator, self.model, self.optimizer,
                                                     self.scheduler, path, self.engine)
        if state.get("config", {}).get("learning_rate", self.args.learning_rate) != self.args.learning_rate:
            runs.apply_learning_rate(self.optimizer, self.scheduler, self.args.learning_rate)
        self.flow.load(path, state.get("loss_sum", 0.0))
        window.rows = state.get("metric_window", [])
        self.counters.load_state_dict(state)
        tensors = self._restore_carried(tensors, extra)
        batch = RolloutBatch.from_saved(tensors, extra, self.accelerator.device) if tensors else None
        self._batch, self._window = batch, window
        return state["global_step"]

    def save_model(self, output_dir: str | Path | None = None) -> None:
        """A normal transformers folder (full fine-tuning) or peft adapter folder (LoRA), plus the
        tokenizer."""
        # every process: FSDP2 and ZeRO-3 gather the weights to save them
        self.accelerator.wait_for_everyone()
        engine_io.save_pretrained(self.accelerator, self.engine, self.model,
                                  Path(output_dir or self.args.output_dir), self.tokenizer)
