"""AsyncGRPOTrainer: generation overlapped with training, on a reproducible schedule (docs/async.md).

A producer process (rlft/rollout/producer.py) holds its own copy of the policy and generates the rollouts of
later steps while the trainer trains. The schedule is fixed by the trainer alone:

    rollout r is sampled from the weights of optimiser step  v(r) = s - s mod weight_sync_steps,
    s = max(0, (r - rollout_lag) x steps_per_rollout)

so step t trains on completions sampled rollout_lag rollouts earlier (one-step-off-policy at rollout_lag = 1;
rollout_lag = 0 is the synchronous loop run on the producer). Rollout r is requested as soon as the weights of
v(r) exist, with a seed that is a function of (seed, r) only; the producer serves requests in order. Two runs
with the same seed therefore see the same rollouts, and a checkpoint holds the rollouts already requested
(waited for, saved as tensors), so a resumed run equals the uninterrupted one. With several training
processes (DDP) each has its own producer, which samples that process's slice of the prompts with its own
seed (a function of (seed, r, process)); each process's checkpoint files hold its own requested rollouts.

Each completion carries the sampler's per-token log-probs. The loss is GRPO's with the trainer's current
policy as pi_old (ratio 1 at the first update, as in synchronous GRPO) and each token weighted by
pi_old / pi_sampler, truncated (`vllm_importance_sampling_*`, rlft/core/importance.py; decoupled PPO,
Hilton et al. 2021, as AReaL uses it): the staleness is corrected, not ignored.
"""

from __future__ import annotations

import logging
import time

import torch

from rlft.config import AsyncGRPOConfig
from rlft.errors import ConfigError
from rlft.rollout.producer import ProcessProducer, Produced, ProducerError
from rlft.train import checkpoint as ckpt
from rlft.train.grpo import GRPOTrainer, default_output_dir

REFUSED = {"tools": "tool calling", "environment_factory": "environments", "rollout_func": "rollout_func",
           "rollout_worker": "a custom rollout worker", "weight_transfer": "a custom weight transfer"}


def sampling_version(rollout: int, lag: int, steps_per_rollout: int, sync_steps: int) -> int:
    """The optimiser step whose weights sample rollout `rollout` (the schedule above)."""
    step = max(0, (rollout - lag) * steps_per_rollout)
    return step - step % sync_steps


def rollout_seed(seed: int, key: int) -> int:
    """The producer's sampling seed for one request: a function of the run's seed and the request alone."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + key)
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


class AsyncGRPOTrainer(GRPOTrainer):
    """TRL 1.16's `trl.experimental.async_grpo.AsyncGRPOTrainer` names: `AsyncGRPOTrainer(model, reward_funcs,
    args=AsyncGRPOConfig(...), train_dataset=...).train()`; everything GRPOTrainer takes except tools,
    environments and rollout_func."""

    _tag_names = ["trl", "async-grpo", "rlft"]
    _name = "AsyncGRPO"

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None, train_dataset=None,
                 **kwargs):
        args = args or AsyncGRPOConfig(output_dir=default_output_dir(model, "AsyncGRPO"))
        if not hasattr(args, "rollout_lag"):
            raise ConfigError(f"AsyncGRPOTrainer takes an AsyncGRPOConfig, got {type(args).__name__}")
        for name, what in REFUSED.items():
            if kwargs.get(name) is not None or (name == "tools" and args.tools):
                raise ConfigError(f"{what} with AsyncGRPOTrainer is not built yet (the producer process "
                                  "would have to run it); use GRPOTrainer")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("rollout_worker", "weight_transfer")}
        super().__init__(model, reward_funcs, args, train_dataset, **kwargs)
        worst = args.rollout_lag * self.steps_per_rollout + args.weight_sync_steps - 1
        if worst > args.max_staleness:
            raise ConfigError(f"with {self.steps_per_rollout} optimiser steps per rollout, rollout_lag="
                              f"{args.rollout_lag} and weight_sync_steps={args.weight_sync_steps} train on "
                              f"weights up to {worst} steps old, above max_staleness={args.max_staleness}: "
                              "raise max_staleness or lower rollout_lag / weight_sync_steps")
        if args.weight_sync_steps % self.steps_per_rollout:
            raise ConfigError(f"weight_sync_steps={args.weight_sync_steps} must be a multiple of the "
                              f"optimiser steps per rollout ({self.steps_per_rollout}): weights are pushed "
                              "between rollouts")
        self._ready: dict[int, Produced] = {}
        self._next_submit, self._taking, self._async_metrics, self._round = 0, 0, {}, 0
        # requested from the current producer and not yet received; rollouts sampled again after a restart
        self._outstanding, self._resampled, self._restarts = set(), {}, 0

    def _wrap_generator(self, source):
        gather = self.engine.full_weights if self.engine.sharded else None
        return ProcessProducer(self.args, self.tokenizer, self.accelerator.unwrap_model(self.model), gather,
                               self.accelerator.device)

    @property
    def _rollouts_total(self) -> int:
        return -(-self.total_steps // self.steps_per_rollout)

    def _seed_key(self, key: int) -> int:
        """Each process's producer samples its own slice of the prompts with its own seed."""
        return key * self.accelerator.num_processes + self.accelerator.process_index

    def _version(self, rollout: int) -> int:
        return sampling_version(rollout, self.args.rollout_lag, self.steps_per_rollout,
                                self.args.weight_sync_steps)

    # ---- the loop: start and stop the producer around the steps -------------------------------------------
    def train(self, resume_from_checkpoint=None):
        try:
            return super().train(resume_from_checkpoint)
        except ProducerError as err:  # however it surfaced (a take, a push, a request): where to resume
            last = ckpt.latest_checkpoint(self.args.output_dir)
            raise ProducerError(
                f"{err}\nTraining stopped at step {self.flow.state.global_step}; the last good checkpoint is "
                f"{last if last else 'none (none was saved yet)'}. Resume from it "
                "(resume_from_checkpoint=True): a new producer starts from its weights.") from err
        finally:
            self.generator.close()

    def _announce(self) -> None:
        super()._announce()
        self._start_producer()
        self.log.info(f"{self.generator.name}: rollouts sampled {self.args.rollout_lag} rollout(s) behind, "
                      f"weights pushed every {self.args.weight_sync_steps} step(s)")
        if self.accelerator.device.type == "cpu" and self.args.producer_cpus is None:
            self.log.warn(f"the trainer ({torch.get_num_threads()} threads) and the producer share this "
                          "machine's CPU cores: each slows the other down. Give the producer its own "
                          "cores (producer_cpus, producer_threads) and the trainer the rest (taskset, "
                          "torch.set_num_threads); docs/async.md")

    def _start_producer(self) -> None:
        if self.generator.proc is None:
            self.generator.start(self.accelerator.unwrap_model(self.model), self.flow.state.global_step)

    # ---- a producer that fails: stop with the last checkpoint, or restart it (producer_restarts) ---------
    def _producer(self, action):
        """`action()`, which talks to the producer; when the producer fails, it is restarted from the
        trainer's current weights (at most producer_restarts times in a run) and `action` runs again."""
        while True:
            try:
                return action()
            except ProducerError as err:
                self._restart(err)

    def _restart(self, err: ProducerError) -> None:
        """A new producer from the current weights; what the failed one finished is kept, what it had not
        is requested again (same seeds, the current weights: the run differs from an uninterrupted one from
        here). Under FSDP2 / ZeRO-3 a restart would need every process to gather: not done, the error
        stands."""
        if self._restarts >= self.args.producer_restarts or self.engine.sharded:
            raise err
        self._restarts, step = self._restarts + 1, self.flow.state.global_step
        for rollout in sorted(self._outstanding):
            if f"rollout-{rollout}" in self.generator.results:
                self._ready[rollout] = self.generator.results.pop(f"rollout-{rollout}")
                self._outstanding.discard(rollout)
        self.generator.close()
        self._start_producer()
        lost, self._outstanding = sorted(self._outstanding), set()
        for rollout in lost:
            self._resampled[rollout] = step
            self._request(rollout)
        message = (f"{err}\nRestarted the producer from the weights of step {step} (restart "
                   f"{self._restarts} of producer_restarts={self.args.producer_restarts}); rollouts {lost} "
                   "are sampled again from them, so this run differs from an uninterrupted one from here")
        if self.accelerator.is_main_process:
            self.log.warn(message)
        else:
            logging.getLogger("rlft").warning(f"process {self.accelerator.process_index}: {message}")

    def _resume(self, resume_from_checkpoint) -> int:
        self._ready, self._next_submit, self._async_metrics = {}, 0, {}
        self._outstanding, self._resampled = set(), {}
        start = super()._resume(resume_from_checkpoint)
        self._next_submit = max(self._next_submit, -(-start // self.steps_per_rollout))
        self._taking = -(-start // self.steps_per_rollout) - 1  # the last rollout taken from the producer
        return start

    # ---- rollout: requested ahead, taken when its step comes --------------------------------------------
    def _make_rollout(self, rollout_index: int):
        self._producer(lambda: self._submit_ahead(rollout_index + self.args.rollout_lag))
        self._taking, self._round = rollout_index, 0
        try:
            return super()._make_rollout(rollout_index)
        finally:
            self._round = 0  # what _generate serves next is an evaluation's

    def _submit_ahead(self, last: int) -> None:
        """Request every rollout up to `last` whose weights exist (pushing the current ones when a rollout
        needs them)."""
        step, unwrapped = self.flow.state.global_step, self.accelerator.unwrap_model(self.model)
        while self._next_submit <= min(last, self._rollouts_total - 1):
            version = self._version(self._next_submit)
            if version != self.generator.label:
                if version != step:
                    raise ConfigError(
                        f"async schedule: rollout {self._next_submit} is to be sampled from the weights of "
                        f"step {version}, which this run no longer has (it is at step {step}): an async run "
                        "resumed with a larger max_steps than the checkpoint's run had cannot keep its "
                        "schedule; resume with that max_steps")
                self.generator.push(unwrapped, version)
            self._submit(self._next_submit)

    def _submit(self, rollout: int) -> None:
        self._next_submit = rollout + 1
        self._request(rollout)

    def _request(self, rollout: int) -> None:
        prompts = self.train_prompts.batch(self._prompt_indices(rollout))
        self._outstanding.add(rollout)
        self.generator.submit(f"rollout-{rollout}", prompts["prompt_ids"], self.args.num_generations,
                              rollout_seed(self.args.seed, self._seed_key(rollout)))

    def _submit_older(self) -> None:
        """Before the producer is given weights out of schedule (evaluation) or replaced (a checkpoint):
        request the rollouts still due from the weights it holds."""
        label = self.generator.label
        while (label is not None and label < self.flow.state.global_step
               and self._next_submit < self._rollouts_total and self._version(self._next_submit) == label):
            self._submit(self._next_submit)

    def _take(self, rollout: int) -> Produced:
        if rollout in self._ready:
            return self._ready.pop(rollout)
        produced = self.generator.take(f"rollout-{rollout}")
        self._outstanding.discard(rollout)
        expected = self._resampled.pop(rollout, self._version(rollout))
        if produced.version != expected:
            raise RuntimeError(f"async schedule: rollout {rollout} was sampled from the weights of step "
                               f"{produced.version}, not {expected} (an rlft bug)")
        return produced

    def _generate_and_score(self, prompts: dict, reward_log, timing: dict):
        """The scheduled rollout from the producer (waited for if it is not ready), then its rewards. Dynamic
        sampling's later rounds are requested when they are needed, from the current weights (their own
        seed; each completion's sampler log-probs correct them like any other)."""
        self._round += 1
        if self._round > 1:
            return super()._generate_and_score(prompts, reward_log, timing)
        args, rollout_index, started = self.args, self._taking, time.perf_counter()
        produced = self._producer(lambda: self._take(rollout_index))
        waited = time.perf_counter()
        rollout = self.generator.to_rollout(produced, prompts["prompt_ids"], args.num_generations,
                                            self.accelerator.device)
        timing["tokens"] += (rollout.prompt_mask.sum() + rollout.completion_mask.sum()).float()
        for key, value in self.throughput.generation(rollout, max(produced.seconds, 1e-9),
                                                     args.num_generations).items():
            timing[key] = timing.get(key, 0.0) + value * (waited - started)
        rewards, completions = self._score(rollout, prompts, args.num_generations, reward_log)
        timing["time/generation_seconds"] += waited - started
        timing["time/reward_seconds"] += time.perf_counter() - waited
        queued = self.generator.waiting_rows() + sum(len(p.tokens) for p in self._ready.values())
        self._async_metrics = {
            "sample/version": float(produced.version), "perf/rollout_wait_s": waited - started,
            # how long the rollout waited for the trainer (0 when the trainer waited for it)
            "sample/time_in_queue_s": max(0.0, started - produced.arrived),
            "sample/rollout_queue_size": float(queued), "rollout/duration_s": produced.seconds,
            "rollout/score_s": produced.timings.get("score_seconds", 0.0),
            "rollout/weight_wait_s": produced.timings.get("idle_seconds", 0.0),
            "rollout/weight_load_s": produced.timings.get("load_seconds", 0.0),
            "rollout/producer_restarts": float(self._restarts),
            **{k: v for k, v in produced.timings.items() if k.startswith("vllm/")}}
        return rollout, rewards, completions

    def _step(self, step: int) -> dict[str, float]:
        metrics = super()._step(step)
        sampled = self._async_metrics.get("sample/version", self._version(step // self.steps_per_rollout))
        staleness = float(step - sampled)  # the schedule's, or a restarted producer's resampled rollout's
        metrics.update({**self._async_metrics, "sample/staleness_mean": staleness,
                        "sample/staleness_max": staleness, "sample/dropped_stale_total": 0.0})
        return metrics

    # ---- evaluation: the current weights, on the producer -------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """GRPOTrainer's evaluation; called outside train(), it starts a producer for itself and stops it
        after (no process is left running)."""
        own = self.generator.proc is None
        try:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            if own:
                self.generator.close()

    def _generate(self, prompts: dict, count: int, greedy: bool = False):
        self._start_producer()
        return self._producer(lambda: self._generate_now(prompts, count, greedy))

    def _generate_now(self, prompts: dict, count: int, greedy: bool):
        self._submit_older()
        step = self.flow.state.global_step
        seed = rollout_seed(self.args.seed + 1, self._seed_key(step)) if self._round == 0 else \
            rollout_seed(self.args.seed + 2, self._seed_key(self._taking * 1_000_003 + self._round))
        return self.generator(self.accelerator.unwrap_model(self.model), prompts["prompt_ids"], count, greedy,
                              seed=seed, version=step)

    # ---- checkpoints carry the requested rollouts ---------------------------------------------------------
    def _carried(self, step: int, batch) -> tuple[dict, dict | None]:
        tensors, extra = super()._carried(step, batch)
        self._producer(self._receive_requested)
        pending = []
        for rollout, produced in sorted(self._ready.items()):
            lengths = torch.tensor([len(t) for t in produced.tokens], dtype=torch.long)
            tensors[f"async.{rollout}.tokens"] = torch.tensor([i for t in produced.tokens for i in t],
                                                              dtype=torch.long)
            tensors[f"async.{rollout}.lengths"] = lengths
            tensors[f"async.{rollout}.logprobs"] = torch.tensor(
                [v for row in produced.logprobs for v in row], dtype=torch.float32)
            pending.append({"rollout": rollout, "version": produced.version, "seconds": produced.seconds})
        carried = {"next_submit": self._next_submit, "pending": pending, "metrics": self._async_metrics,
                   "restarts": self._restarts}
        return tensors, {**(extra or {}), "async": carried}

    def _receive_requested(self) -> None:
        """Every rollout requested ahead, received (a checkpoint holds them)."""
        self._submit_older()
        for rollout in range(self._taking + 1, self._next_submit):
            if rollout not in self._ready:
                self._ready[rollout] = self._take(rollout)

    def _restore_carried(self, tensors: dict, extra: dict | None) -> dict:
        saved = (extra or {}).get("async", {})
        self._next_submit = saved.get("next_submit", 0)
        self._async_metrics = saved.get("metrics", {})  # the rollout in progress's (a mid-rollout resume)
        self._restarts = saved.get("restarts", 0)
        for entry in saved.get("pending", []):
            r = entry["rollout"]
            lengths = tensors.pop(f"async.{r}.lengths").tolist()
            tokens = tensors.pop(f"async.{r}.tokens").split(lengths)
            logprobs = tensors.pop(f"async.{r}.logprobs").split(lengths)
            self._ready[r] = Produced(f"rollout-{r}", entry["version"], [t.tolist() for t in tokens],
                                      [v.tolist() for v in logprobs], entry["seconds"])
        return super()._restore_carried(tensors, extra)
