"""Checkpoints are atomic and resume continues exactly."""

from __future__ import annotations

import shutil

import pytest
import torch

from rlft import GRPOTrainer
from rlft.telemetry.tracking import read_metrics
from rlft.train.run.checkpoint import latest_checkpoint
from tests.helpers import addition_rows, correct_answer, has_answer_tags, stop_after, tiny_grpo_config
from tests.test_grpo_trainer import lora

TIMING = ("time/", "tokens_per_second", "step_time", "perf/")  # wall-clock measurements


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def assert_same_rows(straight, split, steps: int) -> None:
    """Every logged row of the resumed run (steps 1..`steps`) equals the straight run's, timings aside."""
    a, b = comparable(read_metrics(straight)), comparable(read_metrics(split))
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    for row_a, row_b in zip(a, b):
        assert row_a.keys() == row_b.keys()
        for key in row_a:
            assert row_a[key] == pytest.approx(row_b[key], abs=1e-6), key


def resumed_run_equals_straight(make, steps: int, stop: int, rows: bool = True):
    """`make(name)` builds a trainer writing to a folder named `name`: the straight run, and one stopped
    after `stop` steps (its checkpoint) then resumed to `steps`; their trained weights are equal bitwise and,
    with `rows`, every logged row. Returns (straight, resumed)."""
    straight = make("straight")
    straight.train()
    split = make("split")
    split.total_steps = stop
    split.train()
    resumed = make("split")
    resumed.train(resume_from_checkpoint=True)
    if rows:
        assert_same_rows(straight.args.output_dir, resumed.args.output_dir, steps)
    for (name, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name
    return straight, resumed


def run(tmp_path, name, shipped, steps, resume=None, full=False, **overrides):
    args = tiny_grpo_config(tmp_path, output_dir=str(tmp_path / name), max_steps=6, save_steps=3, **overrides)
    trainer = GRPOTrainer(str(shipped), [correct_answer, has_answer_tags], args, addition_rows(32),
                          peft_config=None if full else lora())
    if steps < 6:
        trainer.total_steps = steps  # stop early, as a killed job would, right after the checkpoint
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def straight_and_resumed(tmp_path, shipped, **overrides):  # full=True: no LoRA
    """6 steps straight, and 3 steps + a resume to 6: every logged row equal; returns both trainers."""
    straight = run(tmp_path, "straight", shipped, 6, **overrides)
    run(tmp_path, "split", shipped, 3, **overrides)
    assert latest_checkpoint(tmp_path / "split").name == "checkpoint-3"
    resumed = run(tmp_path, "split", shipped, 6, resume=True, **overrides)
    assert_same_rows(tmp_path / "straight", tmp_path / "split", 6)
    for (name, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name
    return straight, resumed


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_three_plus_three_equals_six(tmp_path, shipped_policy_dir, num_iterations):
    straight_and_resumed(tmp_path, shipped_policy_dir, num_iterations=num_iterations, beta=0.04)


def test_full_finetuning_resume_restores_weights(tmp_path, shipped_policy_dir):
    straight = run(tmp_path, "straight", shipped_policy_dir, 6, full=True)
    run(tmp_path, "split", shipped_policy_dir, 3, full=True)
    resumed = run(tmp_path, "split", shipped_policy_dir, 6, resume=True, full=True)
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_half_written_checkpoints_are_ignored(tmp_path, shipped_policy_dir):
    run(tmp_path, "run", shipped_policy_dir, 3)
    good = tmp_path / "run" / "checkpoint-3"
    shutil.copytree(good, tmp_path / "run" / ".tmp-checkpoint-6")  # killed before the rename
    partial = tmp_path / "run" / "checkpoint-9"
    shutil.copytree(good, partial)
    (partial / "rlft_state.json").unlink()  # killed mid-write (cannot happen with rename, but be safe)
    assert latest_checkpoint(tmp_path / "run") == good


def test_resume_with_nothing_to_resume_is_a_clear_error(tmp_path, shipped_policy_dir):
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        run(tmp_path, "empty", shipped_policy_dir, 6, resume=True)


def untimed(history):
    return [{k: v for k, v in row.items() if not k.startswith(TIMING) and not k.startswith("train_")}
            for row in history]


def test_trainer_state_and_a_logging_window_spanning_the_checkpoint_resume_exactly(tmp_path, shipped_policy_dir):
    """logging_steps=2, save_steps=3: the window holding step 3 is in the checkpoint, so rows match."""
    def make(name, callbacks=()):
        args = tiny_grpo_config(tmp_path, output_dir=str(tmp_path / name), max_steps=6, save_steps=3, logging_steps=2)
        return GRPOTrainer(str(shipped_policy_dir), [correct_answer, has_answer_tags], args, addition_rows(32),
                           peft_config=lora(), callbacks=list(callbacks))

    straight = make("straight")
    straight.train()
    make("split", [stop_after(3)]).train()
    resumed = make("split")
    resumed.train(resume_from_checkpoint=True)
    a, b = comparable(read_metrics(tmp_path / "straight")), comparable(read_metrics(tmp_path / "split"))
    assert [r["step"] for r in b] == [2, 4, 6]
    for row_a, row_b in zip(a, b):
        assert row_a == pytest.approx(row_b, abs=1e-6)
    history_a, history_b = untimed(straight.state.log_history)[:-1], untimed(resumed.state.log_history)[:-1]
    assert len(history_a) == len(history_b) == 3
    for row_a, row_b in zip(history_a, history_b):
        assert row_a == pytest.approx(row_b, abs=1e-6)
    assert resumed.state.log_history[-1]["train_loss"] == pytest.approx(straight.state.log_history[-1]["train_loss"])
    assert resumed.state.num_input_tokens_seen == straight.state.num_input_tokens_seen


def test_carried_tensors_are_each_process_own_and_a_moved_reference_is_written_once(tmp_path, caplog):
    import logging
    from types import SimpleNamespace

    from rlft.train.run.checkpoint import _read_carried, _write_carried

    ranks = [SimpleNamespace(num_processes=2, process_index=r, is_main_process=r == 0) for r in (0, 1)]
    for acc in ranks:
        _write_carried(acc, tmp_path, {"ref_model.w": torch.ones(2), "completion_ids": torch.full((2,), acc.process_index)},
                       {"samples": [acc.process_index]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extra.safetensors", "extra_0.json", "extra_0.safetensors",
                                                          "extra_1.json", "extra_1.safetensors"]
    for acc in ranks:
        tensors, extra = _read_carried(acc, tmp_path)
        assert sorted(tensors) == ["completion_ids", "ref_model.w"] and extra == {"samples": [acc.process_index]}
        assert tensors["completion_ids"].tolist() == [acc.process_index] * 2
    old = tmp_path / "old"  # written inside a rollout by an rlft that kept only rank 0's rows
    old.mkdir()
    _write_carried(SimpleNamespace(num_processes=1, process_index=0, is_main_process=True), old,
                   {"completion_ids": torch.zeros(2)}, {"samples": [0]})
    with caplog.at_level(logging.WARNING, logger="rlft"):
        _read_carried(ranks[1], old)
    assert "kept only process 0's rows; process 1 continues that rollout from them" in caplog.text


def test_a_reward_model_replaced_in_place_is_refused_on_resume(tmp_path, shipped_policy_dir, tiny_rm_dir):
    import shutil

    from transformers import AutoModelForSequenceClassification

    from rlft.errors import ConfigError

    judge = tmp_path / "judge"
    shutil.copytree(tiny_rm_dir, judge)
    cfg = lambda: tiny_grpo_config(tmp_path, max_steps=2, save_steps=1)  # noqa: E731
    first = GRPOTrainer(str(shipped_policy_dir), [str(judge)], cfg(), addition_rows(16))
    first.total_steps = 1
    first.train()
    model = AutoModelForSequenceClassification.from_pretrained(judge)
    with torch.no_grad():
        model.score.weight.mul_(1.5)
    model.save_pretrained(judge)  # the same folder, shapes and class
    again = GRPOTrainer(str(shipped_policy_dir), [str(judge)], cfg(), addition_rows(16))
    with pytest.raises(ConfigError, match=r"different config[\s\S]*_reward_models:"):
        again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
