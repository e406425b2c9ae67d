"""`rlft grpo --config run.yaml` with built-in and module:function rewards and a jsonl dataset."""

from __future__ import annotations

from rlft.cli import main
from rlft.telemetry.tracking import read_metrics
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


def test_the_final_model_lands_in_output_dir_beside_checkpoints_that_still_resume(tmp_path, shipped_policy_dir,
                                                                                    capsys):
    """As `trl grpo`: the model at output_dir's top level (what a pipeline loads with --output_dir X); the
    checkpoints beside it are untouched, and a resume from that folder finds them."""
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    common = ["grpo", "--model_name_or_path", str(shipped_policy_dir), "--train_dataset", str(data),
              "--reward_funcs", "exact_match", "--output_dir", str(tmp_path / "out"), "--use_peft", "true",
              "--lora_r", "4", "--per_device_train_batch_size", "8", "--num_generations", "4",
              "--max_completion_length", "8", "--logging_steps", "1", "--save_steps", "2", "--report_to", "none",
              "--disable_tqdm", "true"]
    assert main([*common, "--max_steps", "2"]) == 0
    out = tmp_path / "out"
    assert f"rlft grpo: model saved to {out}\n" in capsys.readouterr().out
    assert (out / "adapter_model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "checkpoint-2" / "rlft_state.json").is_file() and not (out / "final").exists()
    assert main([*common, "--max_steps", "4", "--resume_from_checkpoint", "true"]) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
