"""AsyncGRPOTrainer with the user's rollout worker and weight transfer (TRL 1.16's rollout_worker= /
weight_transfer=): the samples' split and masks, the advantages used as given, the protocol's calls in
TRL's order, stale samples dropped and counted, a resume telling the worker its version, refusals."""

from __future__ import annotations

import queue

import pytest
import torch

from rlft import AsyncGRPOTrainer
from rlft.errors import ConfigError
from rlft.model.loading import shipped_policy_path
from rlft.telemetry.tracking import read_metrics
from rlft.train.sources.worker_source import RolloutSample, _drain_metrics, rows_to_rollout, sample_row
from tests.helpers import addition_rows, correct_answer, stop_after
from tests.test_async_grpo import async_config


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shipped_policy_path())


class Worker:
    """A worker that, at start and at each new version, queues `per_version` samples of the addition
    prompts tagged with the version it last heard; `old` samples of version -10 go first."""

    def __init__(self, tokenizer, per_version: int = 8, advantage: float = 1.0, old: int = 0):
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()
        self.tokenizer, self.per_version, self.advantage = tokenizer, per_version, advantage
        self.calls, self.version, self.made = [], 0, 0
        for _ in range(old):
            self.rollout_buffer.put(self._sample(-10))

    def _sample(self, version: int) -> RolloutSample:
        row = addition_rows(64)[self.made % 64]
        prompt = list(self.tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                         tokenize=True, return_dict=False))
        completion = self.tokenizer(f" <answer>{row['answer']}</answer>")["input_ids"] + [
            self.tokenizer.eos_token_id]
        sign = 1 if self.made % 2 == 0 else -1
        self.made += 1
        return RolloutSample(row["prompt"], "c", prompt + completion, [0] * len(prompt) + [1] * len(completion),
                             [0.0] * len(prompt) + [-1.0] * len(completion), sign * self.advantage, version,
                             self.made // 4, {"reward": float(sign > 0), "tools/calls": 2.0})

    def _fill(self):
        for _ in range(self.per_version):
            self.rollout_buffer.put(self._sample(self.version))

    def start(self):
        self.calls.append(("start",))
        self._fill()

    def update_model_version(self, version):
        self.calls.append(("version", version))
        self.version = version
        self._fill()
        self.metrics_queue.put({"worker/rate": (1.0, 4.0), "worker/gauge": 3.0})

    def stop(self):
        self.calls.append(("stop",))

    def check_health(self, stale_after_s):
        pass


class Transfer:
    def __init__(self):
        self.calls, self.sent = [], []

    def init_weight_transfer(self):
        self.calls.append("init")

    def pause(self):
        self.calls.append("pause")

    def send_weights(self, iterator):
        self.calls.append("send")
        self.sent.append({name: tensor.clone() for name, tensor in iterator})

    def resume(self):
        self.calls.append("resume")

    def destroy(self):
        self.calls.append("destroy")


def test_a_sample_splits_at_its_first_trained_token_and_keeps_tool_output_untrained(tokenizer):
    sample = RolloutSample("p", "c", [5, 6, 7, 8, 9, 10, 11, tokenizer.eos_token_id], [0, 0, 1, 1, 0, 0, 1, 1],
                           [0, 0, -0.5, -0.25, 0, 0, -1.5, -2.0], 0.75, 3, 0, {"reward": 1.0})
    short = RolloutSample("p", "c", [5, 6, 9], [0, 1, 1], [0, -1.0, -3.0], -0.5, 3, 0, {})
    rows = [sample_row(sample, 0), sample_row(short, 1)]
    assert rows[0]["prompt_ids"] == [5, 6] and rows[0]["completion_ids"] == [7, 8, 9, 10, 11, tokenizer.eos_token_id]
    rollout = rows_to_rollout(rows, tokenizer.pad_token_id, {tokenizer.eos_token_id}, "cpu")
    assert rollout.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert rollout.loss_mask.tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert rollout.completion_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert rollout.sampling_logps[0].tolist() == [-0.5, -0.25, 0, 0, -1.5, -2.0]
    assert rollout.truncated.tolist() == [False, True]  # the second holds no EOS
    # a chat template's turn may end with a newline after its EOS: not truncated
    templated = RolloutSample("p", "c", [5, tokenizer.eos_token_id, 7], [0, 1, 1], [0, -1.0, -1.0], 1.0, 3, 0, {})
    assert not rows_to_rollout([sample_row(templated, 0)], tokenizer.pad_token_id, {tokenizer.eos_token_id},
                               "cpu").truncated.item()
    for bad, words in ((dict(completion_mask=[0, 0, 0]), "completion_mask has no 1"),
                       (dict(old_log_probs=[0.0]), "one value per token"),
                       (dict(advantage=float("nan")), "not a finite number")):
        fields = {**vars(short), **bad}
        with pytest.raises(ConfigError, match=f"sample 4 \\(group_id 0\\).*{words}"):
            sample_row(RolloutSample(**fields), 4)


def test_the_workers_metrics_queue_combines_gauges_and_rates():
    items: queue.Queue = queue.Queue()
    for item in ({"a": 1.0, "r": (1.0, 4.0)}, {"a": 3.0, "r": (2.0, 4.0)}):
        items.put(item)
    assert _drain_metrics(items) == {"a": 2.0, "r": 0.375}


def worker_run(tmp_path, name, tokenizer, worker=None, transfer=None, callbacks=None, resume=None,
               **overrides):
    worker = worker or Worker(tokenizer)
    transfer = transfer or Transfer()
    settings = dict(max_steps=3, per_device_train_batch_size=8, num_generations=4, learning_rate=1e-2)
    trainer = AsyncGRPOTrainer(str(shipped_policy_path()), correct_answer,
                               async_config(tmp_path, name, **{**settings, **overrides}), addition_rows(32),
                               callbacks=callbacks, rollout_worker=worker, weight_transfer=transfer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train(resume_from_checkpoint=resume)
    return trainer, worker, transfer, before


def test_a_rollout_worker_feeds_training_in_trls_order_and_its_advantages_are_the_ones_used(tmp_path, tokenizer):
    """Three steps: synced at the start and before steps 1 and 2 (init, then pause/send/resume each time, destroy
    at the end), the worker told versions 1..3 and started once, after the first sync; four stale samples
    dropped and counted; the worker's metrics logged; every parameter trained. The same run with advantages 0
    leaves the weights as they were: the update reads the worker's advantages, not a reward function's."""
    trainer, worker, transfer, before = worker_run(tmp_path, "run", tokenizer, Worker(tokenizer, old=4))
    assert transfer.calls == ["init", *["pause", "send", "resume"] * 3, "destroy"]
    assert worker.calls == [("version", 1), ("start",), ("version", 2), ("version", 3), ("stop",)]
    first, second = transfer.sent[0], transfer.sent[1]
    assert torch.equal(first["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert not torch.equal(second["model.embed_tokens.weight"], first["model.embed_tokens.weight"])
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before)
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 3 and all(r["sample/dropped_stale_total"] == 4 for r in rows)
    assert all(r["reward"] == 0.5 and r["tools/calls"] == 2.0 and r["worker/rate"] == 0.25 for r in rows[1:])
    assert [r["sample/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]

    still, _, _, before = worker_run(tmp_path, "zero", tokenizer, Worker(tokenizer, advantage=0.0))
    assert all(torch.equal(before[n], p) for n, p in still.model.named_parameters())


def test_a_resumed_worker_run_tells_the_worker_its_version_before_the_next_sync(tmp_path, tokenizer):
    """Stopped after step 2 with a checkpoint (two syncs: version 2), resumed: the new worker hears version 2,
    then 3 from the resume's first sync, then starts; the run finishes its 4 steps."""
    worker_run(tmp_path, "run", tokenizer, max_steps=4, save_steps=2, callbacks=[stop_after(2)])
    _, worker, _, _ = worker_run(tmp_path, "run", tokenizer, max_steps=4, save_steps=2, resume=True)
    assert worker.calls[:3] == [("version", 2), ("version", 3), ("start",)]
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert steps == [1, 2, 3, 4]


def test_what_a_rollout_worker_cannot_be_given_is_refused_by_name(tmp_path, tokenizer, caplog):
    path, rows = str(shipped_policy_path()), addition_rows(32)
    with caplog.at_level("WARNING", logger="rlft"):
        trainer = AsyncGRPOTrainer(path, correct_answer, async_config(tmp_path, "warned"), rows,
                                   rollout_worker=Worker(tokenizer))
    assert trainer.reward_funcs == [] and "reward_funcs are not called" in caplog.text
    with pytest.raises(ConfigError, match="weight_transfer without a rollout_worker"):
        AsyncGRPOTrainer(path, correct_answer, async_config(tmp_path), rows, weight_transfer=Transfer())
    with pytest.raises(ConfigError, match="rollout_worker=object has no rollout_buffer, start"):
        AsyncGRPOTrainer(path, correct_answer, async_config(tmp_path), rows, rollout_worker=object())
    with pytest.raises(ConfigError, match="eval_dataset with a rollout_worker"):
        AsyncGRPOTrainer(path, correct_answer, async_config(tmp_path), rows, eval_dataset=rows,
                         rollout_worker=Worker(tokenizer))
    with pytest.raises(ConfigError, match="tools with a rollout_worker"):
        AsyncGRPOTrainer(path, correct_answer, async_config(tmp_path), rows, tools=[len],
                         rollout_worker=Worker(tokenizer))


def test_a_worker_run_on_two_processes_equals_one_process(tmp_path):
    """The main process takes both processes' rows from its worker and hands each its slice: two processes
    of 8 rows train as one of 16 (float64, to SAME_STEP)."""
    from safetensors.torch import load_file

    from tests.helpers import SAME_STEP, assert_params_close
    from tests.test_distributed import launch

    for processes in (1, 2):
        result = launch(["tests/dist/worker_run.py", str(shipped_policy_path()), str(tmp_path / f"{processes}.pt")],
                        processes)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert_params_close(two, one, SAME_STEP, "worker")
    start = load_file(shipped_policy_path() / "model.safetensors")
    assert (one["model.norm.weight"] - start["model.norm.weight"].double()).abs().max() > 1e-4  # it trained
