"""Agents under AsyncGRPOTrainer (`tools=`, `environment_factory=`; docs/async.md, "Tools and
environments"): the tool loop runs in the trainer's process, in a driver thread, and each of its
turns is one request to the producer process.

Rollout r is driven when the schedule requests it: its first turn is requested with the seed a
plain async rollout has, each later turn with its own (a function of the run's seed, r, the turn and
the process), the tools and environments run here between turns (their output tokens masked from
the loss, as in the synchronous trainer), and the rollout is scored as soon as it is done (an
environment that owns its reward is read before the next rollout resets it). The trainer trains
while the driver works. Rollouts are driven one at a time, in order, so an environment instance is
never shared by two rollouts in flight.

Which weights sample a turn is the trainer's decision alone: before the trainer pushes newer
weights it waits until the driver has finished every rollout requested before (`drain`); a turn
therefore never meets weights its rollout was not scheduled for, and the same seed gives the same run
(with tools and environments that answer the same). With `rollout_lag: 1` that wait costs nothing
(the trainer needs that rollout next anyway); with a larger lag the later rollouts wait for it.
With `inflight_weight_updates` the trainer does not wait: weights pushed while a loop runs reach its
next turns (or the rest of the turn being sampled), each token records the version that sampled it
(`Rollout.token_versions`, tool output the version of the token before it), and timing decides which;
a resume continues from what the checkpoint saved.

A checkpoint waits for the rollouts requested ahead and saves them scored (`save_scored`), so a
resumed run equals the uninterrupted one.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from rlft.rollout.multiturn import ToolLoop
from rlft.train.sources.generation import Generation
from rlft.train.update.rollout_batch import ScoredRollout

TURN_SEED = 7_919  # later turns' seeds: (seed + TURN_SEED * turn, the rollout's key)


class ProducerTurns:
    """The RolloutEngine protocol for one rollout's tool loop: each call is one request to the
    producer, keyed `<key>-t<turn>` and seeded by `seed_of(turn)`; every turn must come from the
    weights `version` (None: whatever the producer holds, evaluation)."""

    holds_own_weights = True  # the producer's copy: no gather of a sharded policy here

    def __init__(self, source, key: str, seed_of, version: int | None):
        self.source, self.key, self.seed_of, self.version = source, key, seed_of, version
        self.turns, self.seconds = 0, 0.0

    def __call__(self, model, prompt_ids: list[list[int]], num_generations: int, greedy: bool = False,
                 max_new_tokens: int | None = None):
        engine, key = self.source.engine, f"{self.key}-t{self.turns}"
        engine.submit(key, prompt_ids, num_generations, self.seed_of(self.turns), greedy,
                      max_new_tokens=max_new_tokens)
        produced = engine.take(key)
        # in-flight weight updates: weights may be pushed while the loop runs, so a turn may start from
        # newer ones (never older); without them every turn comes from the rollout's scheduled weights
        newer_allowed = getattr(self.source.args, "inflight_weight_updates", False)
        if self.version is not None and (produced.version < self.version if newer_allowed
                                         else produced.version != self.version):
            raise RuntimeError(f"{key} was sampled from the weights of step {produced.version}, not "
                               f"{self.version} (an rlft bug: weights were pushed while a rollout's "
                               "tool loop was running)")
        self.turns += 1
        self.seconds += produced.seconds
        rollout = engine.to_rollout(produced, prompt_ids, num_generations, self.source.accelerator.device,
                                    greedy)
        if newer_allowed and rollout.token_versions is None:  # (a greedy turn: no switch inside it)
            versions = torch.full_like(rollout.completion_ids, produced.version, dtype=torch.int32)
            rollout.token_versions = versions.masked_fill(rollout.completion_mask == 0, -1)
        return rollout


class AgentDriver:
    """The driver thread: `submit(r, version)` queues rollout r, `take(r)` waits for it scored,
    `drain()` waits until every submitted rollout is done; an error in the thread is raised by the
    next of these calls."""

    def __init__(self, source):
        self.source = source
        self.jobs: queue.Queue = queue.Queue()
        self.done: dict[int, ScoredRollout] = {}
        self.busy: set[int] = set()
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, daemon=True, name="rlft-agent-driver")
            self.thread.start()

    def stop(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join(timeout=60)
        self.thread = None

    def submit(self, rollout: int, version: int) -> None:
        with self.cond:
            self.busy.add(rollout)
        self.start()
        self.jobs.put((rollout, version))

    def take(self, rollout: int) -> ScoredRollout:
        with self.cond:
            while rollout not in self.done:
                self._raise()
                if rollout not in self.busy:
                    raise KeyError(f"rollout {rollout} was not requested from the agent driver")
                self.cond.wait(0.2)
            return self.done.pop(rollout)

    def drain(self) -> None:
        with self.cond:
            while self.busy:
                self._raise()
                self.cond.wait(0.2)

    def _raise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            self.busy.clear()
            raise error

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            rollout, version = job
            try:
                scored = drive(self.source, rollout, version)
            except BaseException as err:  # raised in the trainer's thread by take / drain
                with self.cond:
                    self.error = err
                    self.cond.notify_all()
                continue
            with self.cond:
                self.done[rollout] = scored
                self.busy.discard(rollout)
                self.cond.notify_all()


def agent_generation(source, key: str, seed_of, version: int | None) -> Generation:
    """The synchronous trainer's Generation (tool loop, environments) over the producer's turns."""
    args, setup = source.args, source.setup
    loop = ToolLoop(ProducerTurns(source, key, seed_of, version), source.tokenizer, setup.toolset,
                    args.max_completion_length, args.max_tool_calling_iterations, args.tool_call_timeout,
                    args.chat_template_kwargs)
    return Generation(loop, source.model, source.tokenizer, args, source.accelerator.device,
                      source.training_engine, setup)


def drive(source, rollout: int, version: int) -> ScoredRollout:
    """The driver thread's work for rollout `rollout` of the async source (async_source.py): its tool
    loop on the producer (each turn seeded by `source.turn_seed`), then its rewards."""
    from rlft.train.sources.rollout_source import score_rollout

    args = source.args
    prompts, started = source.schedule.batch(rollout), time.perf_counter()
    if source.agent_pool is not None:  # partial rollouts: windows over the pool (agent_pool.py)
        pool = source.agent_pool
        result = pool.drive(rollout, source.rollouts - 1, version)
        generating, stats = pool.stats.pop("seconds"), pool.stats
        requests = stats["partial/windows"]
    else:
        generation = agent_generation(source, f"rollout-{rollout}",
                                      lambda turn: source.turn_seed(rollout, turn), version)
        result = generation(prompts, args.num_generations)
        turns, stats = generation.engine.engine, {}
        generating, requests = turns.seconds, turns.turns
    seconds = time.perf_counter() - started
    scored = score_rollout(source.rewards, source.throughput, prompts, result, args.num_generations, seconds,
                           max(generating, 1e-9))
    scored.rollout.extra.pop("environments", None)  # read by the rewards; the next rollout resets them
    scored.metrics = {"sample/version": float(version), "rollout/duration_s": seconds,
                      "tools/producer_requests": float(requests), **stats}
    return scored


# ---- a scored rollout in a checkpoint -----------------------------------------------------------------
def save_scored(scored: ScoredRollout, prefix: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, JSON) of a scored agent rollout: the rollout's saved fields and per-row stats, the
    rewards, and the lists reward functions and logs read (environments are not kept: they were read
    when it was scored)."""
    rollout = scored.rollout
    tensors = {f"{prefix}.{name}": value for name, value in rollout.tensors().items()}
    tensors[f"{prefix}.rewards"] = scored.rewards
    tensors.update({f"{prefix}.stats.{name}": value for name, value in rollout.stats.items()})
    extra = {name: v for name, v in rollout.extra.items() if name != "environments"}
    return tensors, {"completions": scored.completions, "prompts": scored.prompts, "logged": scored.logged,
                     "scalars": scored.scalars, "timing": scored.timing, "metrics": scored.metrics,
                     "rollout_completions": rollout.completions, "rollout_extra": extra}


def load_scored(tensors: dict[str, torch.Tensor], saved: dict, prefix: str, device) -> ScoredRollout:
    from rlft.rollout.base import Rollout

    mine = {name[len(prefix) + 1:]: value for name, value in tensors.items() if name.startswith(prefix + ".")}
    stats = {name[6:]: value.to(device) for name, value in mine.items() if name.startswith("stats.")}
    rollout = Rollout.from_tensors({k: v for k, v in mine.items() if not k.startswith("stats.")}, device,
                                   completions=saved["rollout_completions"], extra=saved["rollout_extra"],
                                   stats=stats)
    return ScoredRollout(rollout, mine["rewards"], saved["completions"], saved["prompts"], saved["logged"],
                         saved["scalars"], saved["timing"], saved["metrics"])

