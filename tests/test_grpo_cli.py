"""`rlft grpo --config run.yaml` with built-in and module:function rewards and a jsonl dataset."""

from __future__ import annotations

from rlft.cli import main
from rlft.tracking import read_metrics
from tests.helpers import addition_rows, write_jsonl


def test_cli_grpo_runs_from_yaml_with_overrides(tmp_path, shipped_policy_dir):
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model_name_or_path: {shipped_policy_dir}\n"
        f"train_dataset: {data}\n"
        f"output_dir: {tmp_path / 'out'}\n"
        "reward_funcs: [exact_match, 'tests.helpers:has_answer_tags']\n"
        "num_generations: 4\nper_device_train_batch_size: 8\nmax_completion_length: 8\n"
        "use_peft: true\nlora_r: 4\nlogging_steps: 1\nreport_to: [none]\ndisable_tqdm: true\n"
    )
    assert main(["grpo", "--config", str(config), "--max_steps", "2", "--learning_rate", "1e-4"]) == 0
    rows = read_metrics(tmp_path / "out")
    assert len(rows) == 2 and "rewards/exact_match_reward/mean" in rows[0] and "rewards/has_answer_tags/mean" in rows[0]
    assert (tmp_path / "out" / "checkpoint-2" / "adapter_model.safetensors").exists()
