"""GRPOTrainer: rollout -> rewards -> advantages -> policy update -> log -> checkpoint, from parts
it owns:

    source      where rollouts come from: prompts in order, the engine / tool loop / environments /
                rollout_func, the reward functions (rlft/train/sources/rollout_source.py; `rollout_source`,
                dynamic sampling)
    advantages  the config's EstimatorSpec over every process's rewards
                (rlft/train/update/rollout_advantages.py)
    scorer      log-probs of a rollout under the policy and the reference
                (rlft/train/update/rollout_logprobs.py)
    updater     the policy's optimiser step on a batch: the loss, then the guarded step
                (rlft/train/update/updater.py)

One rollout (generation batch) holds per_device_train_batch_size x steps_per_generation completions
per process and feeds steps_per_generation / gradient_accumulation_steps optimiser steps, each on
its own slice, repeated num_iterations times (TRL's semantics). With more than one optimiser step
per rollout, the old policy's log-probs are computed once per rollout. The loop keeps a transformers
TrainerState and fires TrainerCallback events (rlft/train/flow.py, rlft/train/loop.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from rlft.config import GRPOConfig, validate
from rlft.config.compat import no_effect_notes
from rlft.config.rules import generation_batch, replay_plan, sampler_records
from rlft.data.prompts import PromptSet, load_eval_datasets, materialize
from rlft.errors import ConfigError
from rlft.model.loading import context_length, prepare_tokenizer, training_dtype
from rlft.model.policy import load_policy
from rlft.rewards.calling import RewardLog, RewardScorer, check_keywords, resolve_rewards
from rlft.rollout.base import engine_metrics, weights_changed
from rlft.telemetry.perf import Throughput
from rlft.telemetry.tracking import Messages
from rlft.train import state as run_state
from rlft.train.engines import make_engine
from rlft.train.flow import Flow
from rlft.train.grpo_surface import GRPOSurface
from rlft.train.loop import TrainLoop
from rlft.train.run import checkpoint as ckpt
from rlft.train.run import runs
from rlft.train.run.checkpoint import PartState
from rlft.train.sources.dynamic_sampling import DynamicSampling
from rlft.train.sources.generation import check_chat_prompts, environment_data, setup_tools
from rlft.train.sources.rollout_source import PromptSchedule, SourceParts, carry_row_columns, source_class
from rlft.train.update.distill_objective import load_teacher, prepare_teacher, teacher_source
from rlft.train.update.metrics import MetricWindow, rollout_metrics, tool_metrics
from rlft.train.update.objectives import PolicyObjective
from rlft.train.update.optimization import GuardedOptimizer
from rlft.train.update.rollout_advantages import Advantages, estimator_spec
from rlft.train.update.rollout_batch import RolloutBatch, ScoredRollout, row_view, timing_metrics
from rlft.train.update.rollout_logprobs import PolicyScorer
from rlft.train.update.self_teacher import SelfTeacher
from rlft.train.update.updater import PolicyUpdater

ZERO_LOSS_NOTE = (
    "loss is ~0 while grad_norm > 0: expected. With one update per rollout the ratio is exactly 1, "
    "so the surrogate's value is -mean(advantages), which is 0 per group; its gradient is not. "
    "Watch reward and grad_norm, not loss (docs/troubleshooting.md#loss-shows-0)."
)


def default_output_dir(model, suffix: str) -> str:
    """TRL's output_dir when no args are given: '<model name>-GRPO' / '<model name>-Reward'."""
    name = (model if isinstance(model, str | Path)
            else getattr(getattr(model, "config", None), "_name_or_path", ""))
    return f"{Path(str(name or 'model')).name}-{suffix}"


def _stop_message(args):
    return lambda in_a_row, reason: (f"{in_a_row} consecutive steps were non-finite "
                                     f"(max_nonfinite_steps={args.max_nonfinite_steps}); stopping. "
                                     f"{reason}")


class GRPOTrainer(TrainLoop, GRPOSurface):
    """TRL-compatible GRPO: `GRPOTrainer(model, reward_funcs, args, train_dataset, ...).train()`;
    `tools`, `environment_factory` and `rollout_func` as in TRL
    (rlft/train/sources/generation.py)."""

    _tag_names = ["trl", "grpo", "rlft"]
    _name = "GRPO"
    # The trainer's way where the config leaves it open (null): its rollout source and where beta's
    # KL goes.
    default_rollout_source = "generate"
    default_kl_in_reward = False
    # What the update optimises (rlft/train/update/objectives.py): its loss, whether it needs reward
    # functions or a teacher, what the progress shows.
    objective = PolicyObjective

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None,
                 rollout_func=None, environment_factory=None, teacher_model=None):
        self.args = args = validate(args or GRPOConfig(output_dir=default_output_dir(model, "GRPO")))
        objective = self.objective
        if args.min_generations < 2 and not (objective.needs_teacher or objective.teacher_is_student):
            raise ConfigError(f"{type(self).__name__} takes a GRPO-family config, not a "
                              f"{type(args).__name__} (its beta is a divergence's, not a KL "
                              "weight): use DistillationTrainer")
        # before LoRA init: adapter weights must not depend on earlier RNG use
        run_state.seed_everything(args.seed)
        self.accelerator = run_state.make_accelerator(args)
        self.engine, self.messages = make_engine(self.accelerator), Messages()
        self._source_class = source_class(args.rollout_source or self.default_rollout_source)
        self._source_class.check(args, self.accelerator.num_processes, tools, environment_factory,
                                 rollout_func)
        run_state.check_writable(args.output_dir)
        source = model if isinstance(model, str | Path) else getattr(model, "name_or_path", None)
        self.processing_class = self.tokenizer = prepare_tokenizer(processing_class, source, args, "left")
        setup = setup_tools(args, self.tokenizer, tools, environment_factory, rollout_func)
        self.rollout_func, self.tools, self.environments = rollout_func, setup.tools, setup.environments
        self._env_tools, self._template_kwargs = setup.env_tools, setup.template_kwargs
        self._setup_rewards(reward_funcs, reward_processing_classes, setup.rewards)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self._setup_prompts(train_dataset, model, setup)
        self._setup_notes = [] if rollout_func is not None else \
            check_keywords(self.reward_funcs, self.reward_names, self.train_prompts.extra_columns)
        self.eval_datasets = load_eval_datasets(eval_dataset)
        self._eval_prompts: dict[str, PromptSet] = {}
        if not self.objective.teacher_is_student:  # (else the trainer makes it from the policy)
            teacher_model = teacher_source(teacher_model, args, self.objective.needs_teacher)
        self._setup_policy(model, source, peft_config, optimizers, quantization_config, teacher_model)
        for note in self.objective.notes(args):  # at construction, as TRL warns
            logging.getLogger("rlft").warning(note)
        self._setup_notes += no_effect_notes(args) + [n for n in [replay_plan(args)[1]] if n]
        self.flow = Flow(args, callbacks, self.model, self.tokenizer, self.optimizer, self.scheduler,
                         self.total_steps, self.rollouts_per_epoch * self.steps_per_rollout, self.accelerator,
                         args.per_device_train_batch_size)
        self.state = self.flow.state
        self._compose(source, setup, rollout_func)
        self._zero_loss_noted, self._zero_signal_steps = False, 0
        self.flow.fire("on_init_end")

    # ---- set-up, all checks before the model is loaded -------------------------------------------
    def _setup_rewards(self, reward_funcs, processing_classes, own: list) -> None:
        """The reward functions, an environment's own reward last (weight 1, as TRL does)."""
        args = self.args
        reward_funcs = [*(reward_funcs if isinstance(reward_funcs, list | tuple) else
                          [] if reward_funcs is None else [reward_funcs]), *own]
        if reward_funcs and self._source_class.scores_itself:
            logging.getLogger("rlft").warning(
                "reward_funcs are not called: the rollout source scores its own rollouts and sends "
                "their advantages (a rollout_worker, as in TRL's AsyncGRPOTrainer)")
        # the objective's signal is elsewhere, or the source's rollouts come scored
        if self._source_class.scores_itself or (not reward_funcs and not self.objective.needs_rewards):
            self.reward_funcs, self.reward_names, self.reward_weights = [], [], torch.zeros(0)
            self.reward_processing_classes = []
            return
        weights = None if args.reward_weights is None else [*args.reward_weights, *[1.0] * len(own)]
        self.reward_funcs, self.reward_names, self.reward_weights = resolve_rewards(
            reward_funcs, weights, processing_classes, args.max_completion_length)
        # TRL's
        self.reward_processing_classes = [getattr(f, "tokenizer", None) for f in self.reward_funcs]

    def _setup_prompts(self, train_dataset, model, setup) -> None:
        """The generation batch (TRL's steps_per_generation / generation_batch_size), the prompts
        and the run's length."""
        args, processes = self.args, self.accelerator.num_processes
        batch = generation_batch(args, processes)
        self.rows_per_step, self.steps_per_rollout = batch.rows_per_step, batch.steps_per_rollout
        self.prompts_per_rollout = batch.prompts_per_process
        dataset = environment_data(args, train_dataset, setup.environments, batch.completions_total)
        needed = None
        if args.max_steps > 0:
            rollouts = -(-args.max_steps // self.steps_per_rollout)
            needed = rollouts * self.prompts_per_rollout * processes
        dataset, self.streaming = materialize(dataset, needed)
        self.context = context_length(model, args.trust_remote_code)
        self.train_prompts = PromptSet(dataset, self.tokenizer, args.max_prompt_length,
                                       args.max_completion_length, self.context, self._template_kwargs,
                                       filled_later=setup.environments is not None)
        check_chat_prompts(self.train_prompts, setup)
        self.rollouts_per_epoch = len(self.train_prompts) // (self.prompts_per_rollout * processes)
        if self.rollouts_per_epoch == 0:
            raise ConfigError(f"train_dataset has {len(self.train_prompts)} prompts, fewer than "
                              "one generation batch needs "
                              f"({self.prompts_per_rollout * processes})")
        self.total_steps = args.max_steps if args.max_steps > 0 else \
            int(args.num_train_epochs * self.rollouts_per_epoch) * self.steps_per_rollout

    def _setup_policy(self, model, source, peft_config, optimizers, quantization_config, teacher) -> None:
        args = self.args
        # routes a MoE policy's sampler chose (routing replay)
        records = sampler_records(self._source_class, self.rollout_func,
                                  bool(self.tools or self.environments))
        policy = load_policy(model, source, args, self.engine, self.accelerator.device, peft_config,
                             quantization_config, self._tag_names, routes_recorded=records)
        teacher = load_teacher(teacher, args, training_dtype(args, self.accelerator.device), policy.model,
                               self.tokenizer)
        rows = getattr(teacher, "rlft_vocab_rows", None)
        if rows is not None:
            self._setup_notes.append(f"the teacher's vocab_size is padded past the student's {rows} (the "
                                     f"same tokenizer): the divergence reads its first {rows} rows")
        # (None, local, served, or several)
        self.teacher_model = prepare_teacher(teacher, self.engine)
        self._setup_notes += policy.notes
        self.is_peft, self.param_summary = policy.is_peft, policy.param_summary
        self.router_aux_loss_coef = policy.router_aux_loss_coef
        optimizer, scheduler = optimizers
        optimizer = optimizer or run_state.build_optimizer(policy.model, args)
        self.scheduler = scheduler or run_state.build_scheduler(optimizer, args, self.total_steps)
        self.model, self.optimizer = self.engine.prepare(policy.model, optimizer, args.max_grad_norm)
        self.ref_model = None if policy.reference is None else self.engine.prepare_reference(policy.reference)
        if self.objective.teacher_is_student:  # self-distillation: the student as loaded, live or averaged
            given = peft_config is None and getattr(model, "peft_config", None) is not None
            self.teacher_model = SelfTeacher.build(args, self.model, self.accelerator.unwrap_model,
                                                   self.engine, self.is_peft, given_adapter=given)

    def _compose(self, source, setup, rollout_func) -> None:
        """The parts: the estimator, the scorer, the guarded optimiser and the policy updater, the
        source."""
        args, acc = self.args, self.accelerator
        kl_in_reward = self.default_kl_in_reward if args.kl_in_reward is None else args.kl_in_reward
        self.estimator = estimator_spec(args, kl_in_reward)
        unwrapped = acc.unwrap_model(self.model)
        self.throughput = Throughput(unwrapped.config, acc.device, next(unwrapped.parameters()).dtype)
        self.optim = GuardedOptimizer(
            self.model, self.optimizer, self.scheduler, self.engine, acc, self.flow, self.messages,
            max_grad_norm=args.max_grad_norm, max_nonfinite_steps=args.max_nonfinite_steps,
            counter="steps_skipped", stop_message=_stop_message(args),
            # an engine with its own weights syncs
            on_applied=lambda: weights_changed(self.generator))
        self.scorer = PolicyScorer(self.model, self.ref_model, acc, args, self.messages, self.teacher_model)
        objective = self.objective.build(args, self.estimator.kl_in_reward)
        self.updater = PolicyUpdater(self.scorer, self.optim, args, acc, objective, self.throughput,
                                     self.router_aux_loss_coef)
        self.advantages = Advantages(self.estimator, args, acc, self.scorer, self.reward_weights)
        self.schedule = PromptSchedule(self.train_prompts, self.prompts_per_rollout, self.rollouts_per_epoch,
                                       args.seed, args.shuffle_dataset and not self.streaming,
                                       acc.process_index, acc.num_processes)
        self.reward_scorer = RewardScorer(self.reward_funcs, self.reward_names, self.tokenizer, self.state,
                                          args.allow_nan_rewards, timeout=args.reward_timeout,
                                          report=self.messages.waiting)
        parts = SourceParts(args, self.schedule, self.reward_scorer, self.throughput, acc, self.state,
                            self.messages, unwrapped, self.tokenizer, self.engine, setup, source,
                            None if rollout_func is None else (lambda prompts: rollout_func(prompts, self)),
                            self.steps_per_rollout, self.total_steps, self.teacher_model,
                            getattr(self, "_worker", None), self.reward_weights, self.flow.dispatch)
        self.source = self._source_class(parts)
        if args.dynamic_sampling:  # rounds until the batch holds groups with a reward spread (DAPO)
            self.source = DynamicSampling(self.source, args, acc, self.reward_weights,
                                          self.tokenizer.pad_token_id, self.messages)

    # ---- the loop (rlft/train/loop.py runs the steps)
    # ------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        return self.rollouts_per_epoch * self.steps_per_rollout

    @property
    def _eval_sets(self) -> dict:
        return self.eval_datasets

    def _announce(self) -> None:
        self.run_log.info(f"{self._name}: {self.total_steps} steps, "
                      f"{self.param_summary['trainable']:,} trainable of "
                      f"{self.param_summary['total']:,} parameters "
                      f"({'LoRA' if self.is_peft else 'full'}), engine {self.engine.name} on "
                      f"{self.accelerator.num_processes} process(es)")
        for note in [*self._setup_notes, *filter(None, self._notes)]:
            self.run_log.warn(note)
        # a resume may have loaded other weights than the engine holds
        weights_changed(self.generator)
        self.source.open()

    def _end(self, stopping: bool = False) -> None:
        self.source.close()
        # the process exits: a colocated vLLM engine frees its memory and processes now
        if stopping:
            self.generator.close()

    def _step(self, step: int) -> dict[str, float]:
        """One GRPO step: a new rollout every steps_per_rollout steps (rollout -> rewards ->
        advantages), then one policy update on this step's part of it, then the reference sync
        (sync_ref_model)."""
        started, spr = time.perf_counter(), self.steps_per_rollout
        if self._batch is None or step % spr == 0:
            self._batch = self._make_rollout(step // spr)  # rollout -> rewards -> advantages
        batch, part = self._batch, (step % spr) % (spr // self.args.num_iterations)
        # update
        metrics = {**batch.metrics, **self.updater.step(batch.part(part, self.rows_per_step))}
        metrics.update(self.updater.sync_reference(step + 1))  # sync_ref_model (TR-DPO)
        metrics.update(self.source.step_metrics(step))
        # tokens the step's scoring forwards computed, packed or padded
        metrics.update(self.scorer.tally())
        seconds = time.perf_counter() - started
        metrics.update({"step_time": seconds, "time/step_seconds": seconds,
                        "num_tokens": self.state.num_input_tokens_seen,
                        "tokens_per_second": batch.rollout.completion_mask.sum().item() / seconds})
        return metrics

    def _make_rollout(self, rollout_index: int) -> RolloutBatch:
        """rollout -> rewards -> advantages: what the rollout's optimiser steps train on."""
        scored = self.source.rollout(rollout_index)  # rollout -> rewards
        # advantages (a rollout worker computed its own)
        if scored.advantages is None:
            advantages, total, stats, everyone = self.advantages(scored.rewards, scored.rollout)
        else:
            advantages, total, stats, everyone = self.advantages.given(scored.advantages, scored.totals,
                                                                       scored.rollout)
        batch = self._batch_of(scored, advantages, total, stats, everyone)
        if hasattr(self.source, "batch_made"):  # (TRL's self-distillation callback events)
            self.source.batch_made(batch)
        return batch

    def _batch_of(self, scored: ScoredRollout, advantages, total, stats, everyone) -> RolloutBatch:
        """The batch: masks, the old and reference log-probs the update needs, the rollout's metrics
        and samples."""
        args, acc, rollout = self.args, self.accelerator, scored.rollout
        timing, tokens = timing_metrics(scored.timing)
        if args.mask_truncated_completions:
            rollout.completion_mask[rollout.truncated] = 0
        old = self.scorer.policy_logps(rollout) \
            if self.steps_per_rollout > 1 and self.updater.objective.needs_old_logps(args, rollout) else None
        self.scorer.forget()  # the rollout's log-probs are in the batch now, or not needed
        # what its forwards read from the rows (several teachers: each row's)
        self.scorer.prepare(rollout)
        ref = self.scorer.reference_logps(rollout) if args.kl_coef > 0 and self.kl_in_loss else None
        metrics = rollout_metrics(*everyone, self.reward_weights, self.reward_names, stats)
        reward_log = RewardLog()
        reward_log.scalars = scored.scalars
        metrics.update(reward_log.metrics(acc))
        metrics.update(tool_metrics(rollout.stats, acc))
        metrics.update({**scored.metrics, **timing, **engine_metrics(self.generator)})
        self.state.num_input_tokens_seen += int(acc.reduce(torch.tensor(tokens, device=acc.device),
                                                           "sum").item())
        samples = [{"prompt": p, "completion": c, "reward": t, "advantage": a,
                    **dict(zip(self.reward_names, row)), **{k: v[i] for k, v in scored.logged.items()}}
                   for i, (p, c, t, a, row) in enumerate(zip(
                       scored.prompts, scored.completions, total.tolist(),
                       row_view(advantages, rollout.loss_mask).tolist(), scored.rewards.tolist()))]
        self._latest_samples = samples
        return RolloutBatch(rollout, advantages.to(acc.device), old, ref, samples, metrics)

    def _after_step(self, step: int, metrics: dict[str, float]) -> None:
        """log -> evaluate -> checkpoint (a checkpoint inside a rollout holds the rest of that
        rollout)."""
        control, window, batch = self.flow.control, self._window, self._batch
        window.add(metrics)
        if control.should_log and window.rows:
            self._log_row(self._flush(window, batch, step))
        if control.should_evaluate and self.eval_datasets:
            self.evaluate()
        key = self.objective.progress_metric
        self.run_log.advance(step, f"{key} {window.last.get(key, float('nan')):.3f}")
        if control.should_save:
            self._save_checkpoint(step)

    def _save_checkpoint(self, step: int) -> None:
        ckpt.save_checkpoint(self.accelerator, self.args.output_dir, step, self.optim, self.tokenizer,
                             self.flow, self._parts(step), self.args.save_total_limit)
        self.flow.fire("on_save")

    def _parts(self, step: int) -> PartState:
        """What a checkpoint holds besides the model files: the run's record, the policy update's
        counters and moved reference, the source's state, and the rest of a rollout in progress."""
        run = PartState(state={"num_processes": self.accelerator.num_processes, "config": self._record,
                               "config_hash": runs.config_hash(self._record), "loss_sum": self.flow.loss_sum,
                               "metric_window": self._window.rows})
        batch = self._batch
        rest = PartState() if step % self.steps_per_rollout == 0 else \
            PartState(extra={"metrics": batch.metrics, "samples": batch.samples}, tensors=batch.tensors())
        return PartState.merged([run, self.updater.state_dict(), rest, self.source.state_dict()])

    def _flush(self, window: MetricWindow, batch: RolloutBatch | None, step: int) -> dict:
        logged = window.flush()
        self._explain(logged)
        if self.args.log_completions and batch is not None:
            self.run_log.samples(batch.samples[: self.args.num_completions_to_log], step)
        return logged

    def _final_row(self) -> dict:
        """The summary row transformers logs at the end (train_runtime, train_loss, ...), holding
        the metrics of the steps since the last log, as TRL's does: no step's metrics are lost and
        log_history[-1] has them."""
        window, batch = self._window, self._batch
        summary = self.flow.summary(self.rows_per_step * self.accelerator.num_processes)
        if not window.rows:
            return self.flow.record(summary)
        return self._log_row({**self._flush(window, batch, self.flow.state.global_step), **summary})

    def _explain(self, logged: dict) -> None:
        """Say in the run itself what a zero loss or a zero-signal batch means."""
        if (self.objective.needs_rewards and not self._zero_loss_noted and abs(logged.get("loss", 1.0)) < 1e-6
                and logged.get("grad_norm", 0) > 0):
            self.run_log.info(ZERO_LOSS_NOTE)
            self._zero_loss_noted = True
        if logged.get("frac_reward_zero_std", 0.0) >= 1.0:
            self._zero_signal_steps += 1
            if self._zero_signal_steps == self.args.zero_signal_warning_steps:
                self.run_log.warn(
                    f"every group had zero reward spread for {self._zero_signal_steps} logged "
                    "steps: advantages and gradients are exactly 0, nothing is learned. Make the "
                    "task easier or the rewards graded, raise num_generations or temperature, or "
                    "start from a better model (docs/troubleshooting.md)")
        else:
            self._zero_signal_steps = 0

    # ---- evaluation, resume, save
    # ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Completions for every eval prompt (greedy; num_generations_eval sampled ones when set),
        scored by every reward function -> `<prefix>_reward`, `<prefix>_rewards/<name>/mean`, and
        the loss on them -> `<prefix>_loss` (0 for greedy completions without KL: one per prompt has
        no advantage). A dict of datasets is evaluated per name with prefix `<prefix>_<name>`."""
        datasets = self.eval_datasets if eval_dataset is None else load_eval_datasets(eval_dataset)
        if not datasets:
            raise ConfigError("evaluate() needs an eval_dataset (none was given to the trainer or "
                              "the call)")
        metrics = {}
        with self.source.session():
            for name, dataset in datasets.items():
                prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
                prompts = self._eval_set(name, dataset, eval_dataset is None)
                metrics.update(self._evaluate_one(prompts, prefix))
        self._log_row(metrics)
        self.flow.fire("on_evaluate", metrics=metrics)
        return metrics

    def _eval_set(self, name, dataset, cached: bool) -> PromptSet:
        if cached and name in self._eval_prompts:
            return self._eval_prompts[name]
        args = self.args
        prompts = PromptSet(materialize(dataset, None, whole=True)[0], self.tokenizer, args.max_prompt_length,
                            args.max_completion_length, self.context, self._template_kwargs,
                            filled_later=self.environments is not None)
        if cached:
            self._eval_prompts[name] = prompts
        return prompts

    def _evaluate_one(self, prompts: PromptSet, prefix: str) -> dict[str, float]:
        n = self.args.num_generations_eval or 1
        rows, chunk, all_rewards, loss = list(range(len(prompts))), max(256 // n, 1), [], 0.0
        for start in range(0, len(rows), chunk):
            batch = prompts.batch(rows[start:start + chunk])
            rollout = self.source.generate(batch, n, greedy=self.args.num_generations_eval is None)
            carry_row_columns(rollout, batch, n)
            all_rewards.append(self.reward_scorer(rollout, batch, n)[0])
            if hasattr(self.source, "eval_scored"):  # (SDPO reprompts them: rlft/train/sdpo.py)
                self.source.eval_scored(rollout, all_rewards[-1], n)
            loss += self._eval_loss(rollout, all_rewards[-1], n) * all_rewards[-1].shape[0]
        rewards = torch.cat(all_rewards)  # [E * n, F]
        metrics = {f"{prefix}_loss": loss / max(rewards.shape[0], 1)}
        if not self.reward_names:  # (an objective without rewards)
            return metrics
        metrics.update({f"{prefix}_rewards/{r}/mean": torch.nanmean(rewards[:, i]).item()
                        for i, r in enumerate(self.reward_names)})
        metrics[f"{prefix}_reward"] = torch.nanmean(torch.nansum(rewards * self.reward_weights, dim=1)).item()
        return metrics

    def _eval_loss(self, rollout, rewards: torch.Tensor, group: int) -> float:
        """The loss on evaluation completions (TRL's `eval_loss`): advantages within each prompt's
        `group` completions, the policy on-policy (ratio 1), plus the KL term when beta > 0."""
        advantages = self.advantages.local(rewards, rollout, group)
        return self.updater.eval_loss(rollout, advantages, self.kl_in_loss)

    def _resume(self, resume_from_checkpoint) -> int:
        """The first step to run; restores the parts' state, the rollout in flight and the logging
        window."""
        path = ckpt.resolve_resume(resume_from_checkpoint, self.args.output_dir)
        self._window, self._batch = MetricWindow(), None
        reward_models = {name: f.model for f, name in zip(self.reward_funcs, self.reward_names)
                         if isinstance(getattr(f, "model", None), torch.nn.Module)}
        self._record = runs.run_record(self.args, self.accelerator.unwrap_model(self.model),
                                       self.reward_names, self.teacher_model, reward_models)
        if path is None:
            self._notes = [runs.claim_output_dir(self.accelerator, self.args)]
            run_state.seed_everything(self.args.seed)
            self.source.load_state_dict(None)
            return 0
        self._notes = runs.check_resume(path, ckpt.read_state(path), self._record,
                                        runs.field_defaults(self.args))
        part = ckpt.load_checkpoint(self.accelerator, self.optim, path)
        rate = self.args.learning_rate
        if part.state.get("config", {}).get("learning_rate", rate) != rate:
            runs.apply_learning_rate(self.optimizer, self.scheduler, rate)
        self.flow.load(path, part.state.get("loss_sum", 0.0))
        self._window.rows = part.state.get("metric_window", [])
        self.updater.load_state_dict(part)
        self.source.load_state_dict(part)
        if "advantages" in part.tensors:  # a checkpoint inside a rollout: the rest of it
            self._batch = RolloutBatch.from_tensors(part.tensors, self.accelerator.device,
                                                    metrics=part.extra["metrics"],
                                                    samples=part.extra["samples"])
        return part.state["global_step"]

    def save_model(self, output_dir: str | Path | None = None) -> None:
        """A normal transformers folder (full fine-tuning) or peft adapter folder (LoRA), plus the
        tokenizer."""
        # every process: FSDP2 and ZeRO-3 gather the weights to save them
        self.accelerator.wait_for_everyone()
        self.engine.save_pretrained(self.model, Path(output_dir or self.args.output_dir), self.tokenizer)
