"""Datasets named by TRL's script arguments (dataset_name, dataset_config, dataset_*_split, dataset_streaming).

A local folder laid out like a hub dataset repository goes through the same `datasets.load_dataset(name,
config)` call a hub id takes; only the network is off for it.
"""

from __future__ import annotations

import pytest

from rlft import GRPOTrainer, RewardTrainer
from rlft.cli import main
from rlft.cli.recipes import parse_run, recipe_datasets
from rlft.config import ConfigError
from rlft.data.prompts import DatasetError, load_named_dataset
from rlft.telemetry.tracking import read_metrics
from tests.helpers import (
    addition_rows,
    correct_answer,
    preference_rows,
    tiny_grpo_config,
    tiny_reward_config,
    write_jsonl,
)

README_WITH_CONFIGS = """---
configs:
- config_name: small
  data_files:
  - split: train
    path: small/train.jsonl
  - split: test
    path: small/test.jsonl
- config_name: large
  data_files:
  - split: train
    path: large/train.jsonl
---
"""


@pytest.fixture
def hub_folder(tmp_path):
    """A dataset repository as on the hub: data/<split>.jsonl, split names from the file names."""
    folder = tmp_path / "addition-dataset"
    (folder / "data").mkdir(parents=True)
    write_jsonl(folder / "data" / "train.jsonl", addition_rows(24))
    write_jsonl(folder / "data" / "test.jsonl", addition_rows(6, heldout=True))
    return folder


def datasets_of(kind: str = "grpo", **values):
    """(train, eval) as `rlft grpo` / `rlft reward` would pick them from these fields."""
    script, cfg, _, mixture, _ = parse_run(kind, [], None, values)
    return recipe_datasets(script, cfg, mixture)


def test_a_hub_style_folder_loads_every_split_without_the_network(hub_folder, monkeypatch):
    import datasets.load

    def no_network(*args, **kwargs):
        raise AssertionError("a network session was opened for a local folder")

    monkeypatch.setattr(datasets.load, "get_session", no_network)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    loaded = load_named_dataset(str(hub_folder))
    assert {name: len(split) for name, split in loaded.items()} == {"train": 24, "test": 6}
    assert loaded["train"][0] == addition_rows(1)[0]


def test_dataset_config_picks_the_subset_the_readme_declares(tmp_path):
    folder = tmp_path / "two-configs"
    for config, count in (("small", 3), ("large", 9)):
        (folder / config).mkdir(parents=True)
        write_jsonl(folder / config / "train.jsonl", addition_rows(count))
    write_jsonl(folder / "small" / "test.jsonl", addition_rows(2, heldout=True))
    (folder / "README.md").write_text(README_WITH_CONFIGS)
    train, evaluation = datasets_of(dataset_name=str(folder), dataset_config="large")
    assert len(train) == 9 and evaluation is None  # eval_strategy "no": the test split is not read
    train, evaluation = datasets_of(dataset_name=str(folder), dataset_config="small", eval_strategy="steps",
                                    eval_steps=1)
    assert (len(train), len(evaluation)) == (3, 2)
    with pytest.raises(DatasetError, match=r"dataset_config 'medium'.*could not be loaded as a local folder"):
        datasets_of(dataset_name=str(folder), dataset_config="medium")


def test_a_missing_split_names_the_splits_there_are_and_the_field(hub_folder, tmp_path):
    with pytest.raises(DatasetError, match=r"splits \['train', 'test'\] and no 'training': set dataset_train_split"):
        datasets_of(dataset_name=str(hub_folder), dataset_train_split="training")
    with pytest.raises(DatasetError, match=r"no 'validation': set dataset_test_split .*\(or eval_strategy: no\)"):
        datasets_of(dataset_name=str(hub_folder), dataset_test_split="validation", eval_strategy="steps",
                    eval_steps=1)


def test_dataset_name_and_train_dataset_together_are_refused(hub_folder):
    with pytest.raises(ConfigError, match=r"train_dataset and dataset_name/datasets are both set: give one"):
        datasets_of(dataset_name=str(hub_folder), train_dataset="rows.jsonl")


def test_a_dataset_mixture_concatenates_its_datasets_in_their_shares(hub_folder, tmp_path):
    other = write_jsonl(tmp_path / "other.jsonl", addition_rows(12, heldout=True))
    mixture = [{"path": str(hub_folder), "split": "train"}, {"path": "json", "data_files": str(other)}]
    train, _ = datasets_of(datasets=mixture)
    assert len(train) == 24 + 12
    halves = [{**mixture[0], "fraction": 0.5}, {**mixture[1], "fraction": 0.5}]
    train, evaluation = datasets_of(datasets=halves, test_split_size=4, eval_strategy="steps", eval_steps=1)
    assert len(train) + len(evaluation) == 24 and len(evaluation) == 4  # 12 + 12: no row repeated


def test_a_hub_id_that_cannot_be_reached_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetError, match=r"dataset_name 'nobody/no-such-dataset' could not be loaded as a hub "
                                           r"dataset"):
        load_named_dataset("nobody/no-such-dataset")  # HF_HUB_OFFLINE=1 in the test session (conftest)


def test_grpo_from_the_command_line_trains_on_the_train_split_and_evaluates_on_the_test_split(
        hub_folder, tmp_path, shipped_policy_dir):
    out = tmp_path / "run"
    assert main(["grpo", "--model_name_or_path", str(shipped_policy_dir), "--dataset_name", str(hub_folder),
                 "--reward_funcs", "exact_match", "--output_dir", str(out), "--max_steps", "2",
                 "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "8",
                 "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "2",
                 "--gradient_checkpointing", "false", "--disable_tqdm", "true"]) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]
    evals = [r for r in rows if "eval_reward" in r]
    assert len(evals) == 1 and round(evals[0]["eval_reward"] * 6, 6).is_integer()  # greedy, 6 test prompts


def test_streaming_reads_only_what_max_steps_needs(hub_folder, tmp_path, shipped_policy_dir):
    train, _ = datasets_of(dataset_name=str(hub_folder), dataset_streaming=True)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), train_dataset=train)
    assert len(trainer.train_prompts) == 4  # 2 steps x 8 completions / 4 per prompt, not the 24 rows
    trainer.train()
    assert trainer.state.global_step == 2


def test_reward_trainer_reads_dataset_name_too(tmp_path, tiny_rm_dir):
    folder = tmp_path / "prefs"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", preference_rows(32))
    write_jsonl(folder / "test.jsonl", preference_rows(8, heldout=True))
    train, evaluation = datasets_of("reward", dataset_name=str(folder), eval_strategy="steps", eval_steps=2)
    trainer = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_steps=2, eval_strategy="steps",
                                                                 eval_steps=2), train_dataset=train,
                            eval_dataset=evaluation)
    assert len(trainer.train_pairs) == 32
    trainer.train()
    assert "eval_accuracy" in trainer.evaluate()
