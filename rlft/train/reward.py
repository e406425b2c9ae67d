"""RewardTrainer: Bradley-Terry reward models on chosen/rejected pairs, with or without LoRA.

pairs -> scores (float32) -> Bradley-Terry loss -> update -> log -> checkpoint. With LoRA the
task type is SEQ_CLS and the score head must be trainable (checked before the first step).
float16 weights train with float32 master copies of the trainable parameters under autocast;
a non-finite loss skips the step, and several in a row stop the run with the likely cause.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from rlft.config import RewardConfig, validate
from rlft.config.compat import no_effect_notes
from rlft.core.preference import bradley_terry_loss
from rlft.data.preference_pairs import PreferencePairs
from rlft.data.prompts import epoch_order, load_dataset_any, load_eval_datasets, materialize
from rlft.errors import ConfigError, RlftError
from rlft.model.loading import (
    apply_lora,
    disable_dropout,
    load_sequence_classifier,
    parameter_summary,
    prepare_tokenizer,
    training_dtype,
)
from rlft.model.memory import apply_memory
from rlft.telemetry.tracking import Messages
from rlft.train import state as run_state
from rlft.train.engines import lora_merge as engine_io
from rlft.train.engines import make_engine
from rlft.train.flow import Flow
from rlft.train.loop import TrainLoop
from rlft.train.run import checkpoint as ckpt
from rlft.train.run import runs
from rlft.train.run.checkpoint import PartState
from rlft.train.run.safe_files import check_finite
from rlft.train.surface import TrainerSurface
from rlft.train.update.metrics import MetricWindow
from rlft.train.update.optimization import GuardedOptimizer
from rlft.train.update.pair_packing import PairPacking, run_packed

HEAD_NAMES = ("score", "classifier")


class HeadFrozenError(RlftError, RuntimeError):
    """The score/classifier head of a reward model would not be trained."""


def check_head_trainable(model) -> list[str]:
    """Names of trainable head parameters; raise if the head exists but is frozen."""
    head = [(n, p) for n, p in model.named_parameters() if any(f".{h}." in f".{n}" for h in HEAD_NAMES)]
    trainable = [n for n, p in head if p.requires_grad]
    if head and not trainable:
        raise HeadFrozenError(
            f"the reward head ({head[0][0]}, ...) is frozen, so it would stay at its random "
            "initialisation while the loss still falls. With LoRA use task_type='SEQ_CLS' (rlft "
            "sets it) and keep the head in modules_to_save; without LoRA do not freeze it")
    return trainable


class RewardTrainer(TrainLoop, TrainerSurface):
    """`RewardTrainer(model, args, train_dataset, eval_dataset, processing_class,
    peft_config).train()`."""

    _tag_names = ["trl", "reward-trainer", "rlft"]
    _name = "Reward"

    def __init__(self, model, args: RewardConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None):
        from rlft.train.grpo import default_output_dir

        self.args = args = validate(args or RewardConfig(output_dir=default_output_dir(model, "Reward")))
        if isinstance(data_collator, list) or hasattr(data_collator, "column_names"):
            raise ConfigError("the third positional argument of RewardTrainer is data_collator "
                              "(TRL's order); pass the dataset as train_dataset=")
        if data_collator is not None and not callable(data_collator):
            raise ConfigError("data_collator must be callable (like DataCollatorForPreference), "
                              f"got {data_collator!r}")
        self.data_collator, self.compute_metrics = data_collator, compute_metrics
        run_state.seed_everything(args.seed)
        self.accelerator = run_state.make_accelerator(args)
        self.engine, self.messages = make_engine(self.accelerator), Messages()
        run_state.check_writable(args.output_dir)
        source = model if isinstance(model, str | Path) else getattr(model, "name_or_path", None)
        self.processing_class = self.tokenizer = prepare_tokenizer(processing_class, source, args, "right")
        pairs_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps \
            * self.accelerator.num_processes
        dataset, _ = materialize(load_dataset_any(train_dataset), args.max_steps * pairs_per_step
                                 if args.max_steps > 0 else None)
        self.train_pairs = PreferencePairs(dataset, self.tokenizer, args.max_length, args.truncation)
        self.eval_sets = self._eval_pairs(eval_dataset)
        # TRL's attributes after tokenization: the processed rows (chosen_ids, rejected_ids[,
        # margin])
        self.train_dataset = self.train_pairs.as_dataset()
        named = {name: pairs.as_dataset() for name, pairs in self.eval_sets.items()}
        self.eval_dataset = None if not named else named.get(None, named) if None in named else named
        # Every pair once per epoch, as TRL's data loader: the last step's batch is filled with the
        # epoch's first pairs (accelerate's even_batches), so every step and process has the same
        # shape
        self.steps_per_epoch = -(-len(self.train_pairs) // pairs_per_step)
        self.total_steps = (args.max_steps if args.max_steps > 0
                            else int(args.num_train_epochs * self.steps_per_epoch))
        self._setup_model(model, peft_config, optimizers, quantization_config)
        self.flow = Flow(args, callbacks, self.model, self.tokenizer, self.optimizer, self.scheduler,
                         self.total_steps, self.steps_per_epoch, self.accelerator,
                         args.per_device_train_batch_size)
        self.state = self.flow.state
        self.optim = GuardedOptimizer(
            self.model, self.optimizer, self.scheduler, self.engine, self.accelerator, self.flow,
            self.messages, max_grad_norm=args.max_grad_norm, max_nonfinite_steps=args.max_nonfinite_steps,
            counter="nonfinite_skipped", stop_message=self._stop_message)
        self.packing = PairPacking(args, self.tokenizer.pad_token_id, self.messages, self.accelerator)
        self.flow.fire("on_init_end")

    def _setup_model(self, model, peft_config, optimizers, quantization_config=None) -> None:
        args = self.args
        dtype = training_dtype(args, self.accelerator.device)
        self.engine.before_loading(dtype)
        init_kwargs = {**(args.model_init_kwargs or {}),
                       **({"quantization_config": quantization_config}
                          if quantization_config is not None else {})}
        try:
            model = load_sequence_classifier(model, dtype, self.tokenizer.pad_token_id, init_kwargs,
                                             args.trust_remote_code)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        model = apply_lora(model, peft_config, "SEQ_CLS")
        self._add_model_tags(model)
        if args.disable_dropout:  # after LoRA: its adapters' dropout too
            disable_dropout(model)
        self.head_parameters = check_head_trainable(model)
        self.autocast_dtype = None
        # float32 master weights for what trains; float16 only where frozen
        if dtype == torch.float16:
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.float()
            self.autocast_dtype = torch.float16
        # as the policy's (rlft/model/memory)
        for note in apply_memory(model, args, self.accelerator.device):
            self.messages.warn(note)
        self.param_summary = parameter_summary(model)
        optimizer, scheduler = optimizers
        optimizer = optimizer or run_state.build_optimizer(model, args)
        self.scheduler = scheduler or run_state.build_scheduler(optimizer, args, self.total_steps)
        # not the scheduler
        self.model, self.optimizer = self.engine.prepare(model, optimizer, args.max_grad_norm)

    # ---- the loop (rlft/train/loop.py runs the steps)
    # ------------------------------------------------
    @property
    def _eval_sets(self) -> dict:
        return self.eval_sets

    def _announce(self) -> None:
        args = self.args
        for line in [*self.train_pairs.report.lines(args.max_length, args.truncation),
                     *filter(None, self._notes), *no_effect_notes(args)]:
            self.run_log.warn(line)
        self.run_log.info(f"reward model: {len(self.train_pairs)} pairs, {self.total_steps} steps, "
                      f"{self.param_summary['trainable']:,} trainable parameters, "
                      f"head: {self.head_parameters[:2]}, "
                      f"engine {self.engine.name} on {self.accelerator.num_processes} process(es)")

    def _step(self, step: int) -> dict[str, float]:
        """pairs -> scores -> Bradley-Terry loss -> update; a non-finite step is skipped and
        counted."""
        return self._optimizer_step(step)

    def _end(self, stopping: bool = False) -> None:
        pass

    def _final_row(self) -> dict:
        """transformers' summary row, holding the steps since the last log (as in TRL): none is
        lost."""
        args, flow = self.args, self.flow
        summary = flow.summary(args.per_device_train_batch_size * args.gradient_accumulation_steps
                               * self.accelerator.num_processes)
        return self._log_row({**self.window.flush(), **summary}) if self.window.rows else flow.record(summary)

    def _stop_message(self, consecutive: int, reason: str) -> str:
        """Why max_nonfinite_steps steps in a row were not finite, and what to do."""
        dtype = self.accelerator.unwrap_model(self.model).dtype
        half = self.autocast_dtype == torch.float16 or dtype == torch.float16
        return (f"{consecutive} consecutive steps had an inf/NaN loss or gradient norm "
                f"(max_nonfinite_steps={self.args.max_nonfinite_steps}). Likely cause: a learning "
                f"rate too high (now {self.args.learning_rate}; lower it or set max_grad_norm)"
                + (", or float16 activations overflowing (use dtype bfloat16 or float32)" if half else
                   f"; the model runs in {dtype}, so not a float16 overflow"))

    def _indices(self, step: int, micro: int) -> list[int]:
        epoch, offset = divmod(step, self.steps_per_epoch)
        order = epoch_order(len(self.train_pairs), self.args.seed, epoch)
        size = self.args.per_device_train_batch_size
        block = ((offset * self.args.gradient_accumulation_steps + micro) * self.accelerator.num_processes
                 + self.accelerator.process_index) * size
        return [order[(block + k) % len(order)] for k in range(size)]

    def _scores(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        autocast = torch.autocast(self.accelerator.device.type, dtype=self.autocast_dtype) \
            if self.autocast_dtype is not None else contextlib.nullcontext()
        with autocast:
            packed = self.packing.plan(self.model, batch, self.autocast_dtype)
            scores = run_packed(self.model, packed) if packed is not None else \
                self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # [2B], float32 whatever the model's half dtype (a float64 model keeps float64)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).squeeze(-1)
        half = scores.shape[0] // 2
        return scores[:half], scores[half:]

    def _pair_loss(self, batch):
        chosen, rejected = self._scores(batch)
        loss, metrics = bradley_terry_loss(chosen, rejected, batch.get("margin"),
                                           self.args.center_rewards_coefficient)
        return loss, metrics, chosen.detach(), rejected.detach()

    def _optimizer_step(self, step: int) -> dict[str, float]:
        args, acc = self.args, self.accelerator
        self.model.train()
        sums, rewards, finite = {}, [], True
        for micro in range(args.gradient_accumulation_steps):
            batch = self.train_pairs.batch(self._indices(step, micro), self.tokenizer.pad_token_id,
                                           self.pad_multiple, self.data_collator)
            last = micro == args.gradient_accumulation_steps - 1
            with self.engine.micro_batch(self.model, last):
                loss, metrics, chosen, rejected = self._pair_loss(batch)
                finite = finite and bool(torch.isfinite(loss))
                # every process runs backward, finite or not: DDP syncs there
                if loss.requires_grad:
                    self.engine.backward(self.model,
                                         torch.nan_to_num(loss) / args.gradient_accumulation_steps)
            for key, value in {"loss": loss.detach(), **metrics}.items():
                sums[key] = sums.get(key, 0.0) + value.item() / args.gradient_accumulation_steps
            rewards.append(torch.cat([chosen, rejected]))
        outcome = self.optim.apply(finite, lambda norm: "the loss or gradient norm is not finite")
        if not outcome.applied:
            return {"nonfinite_skipped": self.optim.skipped}
        all_rewards = torch.cat(rewards)
        if acc.num_processes > 1:  # every process's pairs, not rank 0's alone
            keys = sorted(sums)
            reduced = acc.reduce(torch.tensor([sums[k] for k in keys], device=acc.device), "mean").tolist()
            sums = dict(zip(keys, reduced))
            all_rewards = acc.gather(all_rewards)
        return {**sums, "min_reward": all_rewards.min().item(), "mean_reward": all_rewards.mean().item(),
                "max_reward": all_rewards.max().item(), "reward_std": all_rewards.std().item(),
                "grad_norm": float(outcome.grad_norm), "learning_rate": outcome.learning_rate,
                "nonfinite_skipped": self.optim.skipped}

    def _after_step(self, step: int, metrics: dict[str, float]) -> None:
        control = self.flow.control
        self.window.add(metrics)
        if control.should_log:  # averaged over the steps since the last log, as TRL does
            self._log_row(self.window.flush())
        if control.should_evaluate and self.eval_sets:
            self.evaluate()
        self.run_log.advance(step, f"loss {metrics.get('loss', float('nan')):.3f} "
                               f"acc {metrics.get('accuracy', 0):.2f}")
        if control.should_save:
            self._save_checkpoint(step)

    def _save_checkpoint(self, step: int) -> None:
        run = PartState(state={"num_processes": self.accelerator.num_processes, "config": self._record,
                               "config_hash": runs.config_hash(self._record), "loss_sum": self.flow.loss_sum,
                               "metric_window": self.window.rows, **self.optim.state_dict()})
        ckpt.save_checkpoint(self.accelerator, self.args.output_dir, step, self.optim, self.tokenizer,
                             self.flow, run, self.args.save_total_limit)
        self.flow.fire("on_save")

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss, accuracy and mean margin over a whole eval set -> `eval_loss`, `eval_accuracy`,
        ...; a dict of eval datasets gives `eval_<name>_*` per name."""
        sets = self.eval_sets if eval_dataset is None else self._eval_pairs(eval_dataset)
        if not sets:
            raise ConfigError("evaluate() needs an eval_dataset (none was given to the trainer or "
                              "the call)")
        metrics = {}
        for name, pairs in sets.items():
            prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
            metrics.update({f"{prefix}_{k}": v for k, v in self._evaluate_pairs(pairs).items()})
        self._log_row(metrics)
        self.flow.fire("on_evaluate", metrics=metrics)
        return metrics

    def _eval_pairs(self, eval_dataset) -> dict[str | None, PreferencePairs]:
        return {name: PreferencePairs(materialize(d, None, whole=True)[0], self.tokenizer,
                                      self.args.max_length, self.args.truncation)
                for name, d in load_eval_datasets(eval_dataset).items()}

    def _evaluate_pairs(self, pairs: PreferencePairs) -> dict[str, float]:
        self.model.eval()
        size, chosen_all, rejected_all = self.args.per_device_eval_batch_size, [], []
        for start in range(0, len(pairs), size):
            batch = pairs.batch(list(range(start, min(start + size, len(pairs)))),
                                self.tokenizer.pad_token_id, self.pad_multiple, self.data_collator)
            chosen, rejected = self._scores(batch)
            chosen_all.append(chosen)
            rejected_all.append(rejected)
        chosen, rejected = torch.cat(chosen_all), torch.cat(rejected_all)
        loss, metrics = bradley_terry_loss(chosen, rejected)
        both = torch.cat([chosen, rejected])
        out = {"loss": loss.item(), **{k: v.item() for k, v in metrics.items()},
               "min_reward": both.min().item(), "mean_reward": both.mean().item(),
               "max_reward": both.max().item()}
        # scores [N, 2] (chosen, rejected); label 0: the chosen one wins
        if self.compute_metrics is not None:
            from transformers.trainer_utils import EvalPrediction

            scores = torch.stack([chosen, rejected], dim=1).cpu().numpy()
            out.update(self.compute_metrics(EvalPrediction(predictions=scores, label_ids=scores[:, 0] * 0)))
        return out

    def _resume(self, resume_from_checkpoint) -> int:
        self.window = MetricWindow()
        path = ckpt.resolve_resume(resume_from_checkpoint, self.args.output_dir)
        self._record = runs.run_record(self.args, self.accelerator.unwrap_model(self.model))
        if path is None:
            self._notes = [runs.claim_output_dir(self.accelerator, self.args)]
            run_state.seed_everything(self.args.seed)
            self.optim.load_state_dict({})
            return 0
        self._notes = runs.check_resume(path, ckpt.read_state(path), self._record,
                                        runs.field_defaults(self.args))
        part = ckpt.load_checkpoint(self.accelerator, self.optim, path)
        rate = self.args.learning_rate
        if part.state.get("config", {}).get("learning_rate", rate) != rate:
            runs.apply_learning_rate(self.optimizer, self.scheduler, rate)
        self.flow.load(path, part.state.get("loss_sum", 0.0))
        self.optim.load_state_dict(part.state)
        self.window.rows = part.state.get("metric_window", [])
        return part.state["global_step"]

    def save_model(self, output_dir: str | Path | None = None) -> None:
        """A plain sequence-classification folder (LoRA merged in), loadable by any Auto class and
        by GRPO."""
        output_dir = Path(output_dir or self.args.output_dir)
        self.accelerator.wait_for_everyone()
        model = self.accelerator.unwrap_model(self.model)
        if not hasattr(model, "merge_and_unload"):
            self.engine.save_pretrained(self.model, output_dir, self.tokenizer)
            return
        # every process
        state_dict = self.accelerator.get_state_dict(self.model) if self.engine.sharded else None
        if self.accelerator.is_main_process:
            with self.engine.unpartitioned():
                merged = engine_io.merged_copy(model, state_dict)
            check_finite(merged)
            merged.save_pretrained(output_dir)
            self.tokenizer.save_pretrained(output_dir)
        self.accelerator.wait_for_everyone()

    @property
    def pad_multiple(self) -> int | None:
        multiple = self.args.pad_to_multiple_of
        return multiple if isinstance(multiple, int) else None
