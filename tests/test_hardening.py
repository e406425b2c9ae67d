"""Faults and bad input: nothing in a checkpoint runs code, no non-finite value reaches the weights,
every bad input is named."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from rlft import GRPOTrainer
from rlft.cli.recipes import parse_run
from rlft.config import ConfigError, GRPOConfig
from rlft.errors import NonFiniteStepError
from rlft.model.loading import load_tokenizer
from rlft.model.scoring import Scored
from rlft.rewards import RewardFunctionError
from rlft.rollout.hf import shared_prompt_cache
from rlft.telemetry.tracking import read_metrics
from rlft.train.run.checkpoint import STATE_FILE, CheckpointError, latest_checkpoint, resolve_resume
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config, write_jsonl


class Planted:
    """Unpickling this writes a marker file: proof that code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def plant(folder, marker, keep_checksums_valid: bool) -> None:
    """Overwrite every file of a checkpoint with a code-executing pickle."""
    import hashlib

    files = [f for f in folder.rglob("*") if f.is_file()]
    for file in files:
        file.write_bytes(pickle.dumps(Planted(marker)))
    if keep_checksums_valid:  # an attacker who also rewrites the checksums
        state = {"global_step": 2, "num_processes": 1, "files": {
            str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files
            if f.name != STATE_FILE}}
        (folder / STATE_FILE).write_text(json.dumps(state))


def trained(tmp_path, shipped, **overrides):
    args = tiny_grpo_config(tmp_path, max_steps=2, save_steps=1, **overrides)
    trainer = GRPOTrainer(str(shipped), [correct_answer], args, addition_rows(16))
    trainer.train()
    return trainer


@pytest.mark.parametrize("keep_checksums_valid", [False, True])
def test_planted_pickle_checkpoint_is_refused_and_runs_nothing(tmp_path, shipped_policy_dir, keep_checksums_valid):
    trained(tmp_path, shipped_policy_dir)
    marker = tmp_path / "code-ran"
    checkpoint = tmp_path / "run" / "checkpoint-2"
    plant(checkpoint, marker, keep_checksums_valid)
    fresh = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=3),
                        addition_rows(16))
    with pytest.raises(CheckpointError, match=r"checkpoint-2/\S+ (cannot be read|is not|is corrupt)"):
        fresh.train(resume_from_checkpoint=str(checkpoint))
    assert not marker.exists()


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path, shipped_policy_dir, caplog):
    trained(tmp_path, shipped_policy_dir)
    newest = tmp_path / "run" / "checkpoint-2"
    optimizer = newest / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])  # truncated
    with caplog.at_level(logging.WARNING, logger="rlft"):
        assert resolve_resume(True, tmp_path / "run") == tmp_path / "run" / "checkpoint-1"
    assert "optimizer.pt is corrupt or truncated" in caplog.text and "falling back" in caplog.text
    with pytest.raises(CheckpointError, match="optimizer.pt is corrupt or truncated"):
        resolve_resume(str(newest), tmp_path / "run")


def test_resume_from_a_verified_checkpoint_has_the_same_state(tmp_path, shipped_policy_dir):
    first = trained(tmp_path, shipped_policy_dir)
    again = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=2),
                        addition_rows(16))
    again.train(resume_from_checkpoint=True)  # resumes at step 2 of 2: nothing left to train
    assert again.state.log_history[:2] == first.state.log_history[:2]
    for p, q in zip(first.model.parameters(), again.model.parameters()):
        assert torch.equal(p, q)


def test_non_finite_steps_are_skipped_then_stop_and_nothing_non_finite_is_saved(tmp_path, shipped_policy_dir):
    args = tiny_grpo_config(tmp_path, max_steps=6, save_steps=1, max_nonfinite_steps=2)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(16))
    model = trainer.accelerator.unwrap_model(trainer.model)
    calls = {"n": 0}

    def overflow_after_first_step(module, inputs, output):  # scores overflow from step 2 on
        if module.training and trainer.state.global_step >= 1 and isinstance(output, Scored):
            calls["n"] += 1
            output.logps = output.logps * float("inf")
        return output

    model.register_forward_hook(overflow_after_first_step)
    with pytest.raises(NonFiniteStepError, match="2 consecutive steps were non-finite"):
        trainer.train()
    assert calls["n"] > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # step 2 skipped and saved (weights of step 1), step 3 skipped: two in a row stop the run before its save
    assert latest_checkpoint(tmp_path / "run").name == "checkpoint-2"
    rows = read_metrics(tmp_path / "run")
    assert [r.get("steps_skipped") for r in rows] == [0, 1]


def test_every_completion_truncated_and_masked_skips_the_step(tmp_path, shipped_policy_dir, caplog):
    args = tiny_grpo_config(tmp_path, max_steps=2, max_completion_length=1, mask_truncated_completions=True)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(16))
    before = [p.clone() for p in trainer.model.parameters()]
    with caplog.at_level(logging.WARNING, logger="rlft"):
        trainer.train()  # no GradientFlowError blaming precision, no NaN
    assert "every completion was masked" in caplog.text
    assert all(torch.equal(p, q) for p, q in zip(before, trainer.model.parameters()))
    assert [r["steps_skipped"] for r in read_metrics(tmp_path / "run")] == [1, 2]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), 3e38])
def test_infinite_or_overflowing_rewards_are_named(tmp_path, shipped_policy_dir, bad):
    def explodes(completions, **kwargs):
        return [bad] + [0.0] * (len(completions) - 1)

    trainer = GRPOTrainer(str(shipped_policy_dir), [explodes], tiny_grpo_config(tmp_path), addition_rows(16))
    with pytest.raises(RewardFunctionError, match=r"reward function 'explodes' returned .* for completion 0 at step 0"):
        trainer.train()


def test_metrics_file_never_holds_non_json_tokens(tmp_path):
    from rlft.telemetry.tracking import _jsonable

    assert [_jsonable(v) for v in (float("nan"), float("inf"), -float("inf"), 1.5)] == [None, None, None, 1.5]


def test_local_dataset_file_makes_no_network_request(tmp_path, monkeypatch):
    import datasets.load

    from rlft.data.prompts import load_dataset_any

    def no_network(*args, **kwargs):
        raise AssertionError("a network session was opened for a local file")

    monkeypatch.setattr(datasets.load, "get_session", no_network)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    rows = load_dataset_any(str(write_jsonl(tmp_path / "d.jsonl", addition_rows(4))))
    assert len(rows) == 4


def test_dataset_folder_loads_through_the_named_dataset_path(tmp_path):
    import datasets

    from rlft.data.prompts import load_dataset_any

    datasets.DatasetDict({"train": datasets.Dataset.from_list(addition_rows(6))}).save_to_disk(str(tmp_path / "ds"))
    assert len(load_dataset_any(str(tmp_path / "ds"))) == 6


def test_shared_prefill_falls_back_on_caches_that_cannot_repeat(tmp_path, shipped_policy_dir):
    """NemotronH's linear-attention cache layers have no batch_repeat_interleave: generate prefills itself."""
    tokenizer = load_tokenizer(shipped_policy_dir)
    config = transformers.NemotronHConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert shared_prompt_cache(model, [[5, 6, 7], [8, 9, 10]], 4, tokenizer.pad_token_id, "cpu") is None
    trainer = GRPOTrainer(model, [correct_answer], tiny_grpo_config(tmp_path, max_steps=1, max_completion_length=4),
                          addition_rows(16), processing_class=tokenizer)
    trainer.train()
    assert trainer.state.global_step == 1


def test_bad_config_values_are_named(tmp_path):
    (tmp_path / "bad.yaml").write_text("learning_rate: 1e-5\nbeta: [0.1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+, column \d+: not valid YAML"):
        parse_run("grpo", [], str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match=r"report_to has unknown tracker"):
        GRPOConfig(report_to=["wandbb"])


def test_missing_model_path_and_model_folder_without_tokenizer(tmp_path, shipped_policy_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GRPOTrainer(str(tmp_path / "no" / "such" / "model"), [correct_answer], tiny_grpo_config(tmp_path),
                    addition_rows(16))
    bare = tmp_path / "bare"
    transformers.AutoModelForCausalLM.from_pretrained(shipped_policy_dir).save_pretrained(bare)
    with pytest.raises(FileNotFoundError, match="holds no tokenizer files"):
        GRPOTrainer(str(bare), [correct_answer], tiny_grpo_config(tmp_path), addition_rows(16))


def test_tokenizer_without_pad_token_gets_eos_as_pad(tmp_path, shipped_policy_dir):
    tokenizer = load_tokenizer(shipped_policy_dir)
    tokenizer.pad_token = None
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), addition_rows(16),
                          processing_class=tokenizer)
    assert trainer.tokenizer.pad_token == trainer.tokenizer.eos_token


def test_chat_message_with_unknown_role_or_no_content(tmp_path, shipped_policy_dir):
    from rlft.data.prompts import DatasetError

    rows = addition_rows(16)
    rows[3] = {"prompt": [{"role": "robot", "content": "hi"}], "answer": "1"}
    with pytest.raises(DatasetError, match="row 3: message 0 has role 'robot'"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), rows)
    rows[3] = {"prompt": [{"role": "user", "content": None}], "answer": "1"}
    with pytest.raises(DatasetError, match=r"row 3: message 0 \(user\) has no 'content'"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), rows)
    for empty in ([{"role": "user", "content": ""}], [{"role": "system", "content": " "}, {"role": "user", "content": ""}]):
        rows[3] = {"prompt": empty, "answer": "1"}  # as a plain "" is refused
        with pytest.raises(DatasetError, match=r"row 3: every message of the prompt is empty"):
            GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), rows)
    rows[3] = {"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "What is 1+1?"}], "answer": "2"}
    GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), rows)  # one says something


def test_float16_full_finetuning_is_refused_with_the_reason(tmp_path, shipped_policy_dir):
    with pytest.raises(ConfigError, match="float16 full fine-tuning is refused: AdamW would keep float16 state"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, model_init_kwargs={"dtype": "float16"}),
                    addition_rows(16))



@pytest.mark.parametrize("values,message", [
    ({"num_generations": 8.0}, r"num_generations=8.0 is a float; the field takes int"),
    ({"use_vllm": [False]}, r"use_vllm=\[False\] is a list; the field takes bool"),
    ({"reward_weights": "heavy"}, r"reward_weights='heavy' is a str; the field takes list\[float\]"),
])
def test_config_values_are_type_checked_against_their_fields(values, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**values)


def test_metrics_rewrite_at_resume_is_atomic_and_tolerates_a_partial_last_line(tmp_path, shipped_policy_dir):
    trained(tmp_path, shipped_policy_dir)  # 2 steps, checkpoints 1 and 2
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "loss": 0.1')  # killed mid-append
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2]
    resumed = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=3,
                                                                                       save_steps=1),
                          addition_rows(16))
    resumed.train(resume_from_checkpoint=True)
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3]
    assert not list((tmp_path / "run").glob(".*.tmp"))


def test_resume_with_another_process_count_is_refused_by_both_trainers(tmp_path, shipped_policy_dir, tiny_rm_dir):
    from rlft import RewardTrainer
    from tests.helpers import preference_rows, tiny_reward_config

    trained(tmp_path, shipped_policy_dir)
    reward = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_steps=1), train_dataset=preference_rows(32))
    reward.train()
    for folder in (tmp_path / "run" / "checkpoint-2", tmp_path / "rm" / "checkpoint-1"):
        state = json.loads((folder / STATE_FILE).read_text())
        (folder / STATE_FILE).write_text(json.dumps({**state, "num_processes": 2}))
    again = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=3),
                        addition_rows(16))
    with pytest.raises(ConfigError, match="written by 2 processes; resume with the same number"):
        again.train(resume_from_checkpoint=True)
    reward = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_steps=2), train_dataset=preference_rows(32))
    with pytest.raises(ConfigError, match="written by 2 processes; resume with the same number"):
        reward.train(resume_from_checkpoint=True)


def test_empty_and_malformed_jsonl_files_are_named_by_line(tmp_path):
    from rlft.data.prompts import DatasetError, load_dataset_any

    with pytest.raises(DatasetError, match="the dataset is an empty list"):
        load_dataset_any([])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match=r"empty.jsonl is empty"):
        load_dataset_any(str(empty))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(DatasetError, match=r"broken.jsonl: line 3 is not valid JSON"):
        load_dataset_any(str(broken))
    listed = tmp_path / "listed.jsonl"
    listed.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(DatasetError, match=r"listed.jsonl: line 2 is a JSON list, not an object"):
        load_dataset_any(str(listed))
    latin = tmp_path / "latin1.jsonl"  # pyarrow reads it and fails at the row's first access, naming nothing
    latin.write_bytes('{"prompt": "a"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1.jsonl: line 2 is not valid UTF-8 \(byte 0xe9 at column 16\)"):
        load_dataset_any(str(latin))


def reward_with_typo(completions, answr=None, **kwargs):
    return [0.0] * len(completions)


def reward_needing_a_missing_column(completions, solution, **kwargs):
    return [0.0] * len(completions)


def test_reward_keywords_that_match_nothing_warn_or_fail_up_front(tmp_path, shipped_policy_dir, caplog):
    trainer = GRPOTrainer(str(shipped_policy_dir), [reward_with_typo], tiny_grpo_config(tmp_path, max_steps=1),
                          addition_rows(16))
    with caplog.at_level(logging.WARNING, logger="rlft"):
        trainer.train()
    assert "reward function 'reward_with_typo': keyword 'answr' matches no dataset column" in caplog.text
    assert "Did you mean 'answer'?" in caplog.text
    caplog.clear()
    from rlft.rewards.builtins import format_reward  # its keyword `pattern` is a parameter, like no column

    quiet = GRPOTrainer(str(shipped_policy_dir), [format_reward], tiny_grpo_config(tmp_path / "q", max_steps=1),
                        addition_rows(16))
    with caplog.at_level(logging.WARNING, logger="rlft"):
        quiet.train()
    assert "matches no dataset column" not in caplog.text
    with pytest.raises(RewardFunctionError, match=r"'reward_needing_a_missing_column' requires keyword 'solution'"):
        GRPOTrainer(str(shipped_policy_dir), [reward_needing_a_missing_column], tiny_grpo_config(tmp_path),
                    addition_rows(16))


KILL_DURING_REWRITE = """
import os, sys
sys.path.insert(0, {root!r})
import rlft.telemetry.tracking
from rlft import GRPOTrainer
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config
from pathlib import Path

def killed(src, dst):  # the temporary file is written; the process dies before the rename
    os.kill(os.getpid(), 9)

rlft.telemetry.tracking.os.replace = killed
trainer = GRPOTrainer({model!r}, [correct_answer], tiny_grpo_config(Path({tmp!r}), max_steps=3, save_steps=1),
                      addition_rows(16))
trainer.train(resume_from_checkpoint={checkpoint!r})
"""


def test_a_kill_during_the_metrics_rewrite_loses_no_row(tmp_path, shipped_policy_dir):
    import subprocess
    import sys
    from pathlib import Path

    trained(tmp_path, shipped_policy_dir)  # 2 steps, checkpoints 1 and 2, metrics rows 1 and 2
    metrics = tmp_path / "run" / "metrics.jsonl"
    before = metrics.read_text()
    root = str(Path(__file__).resolve().parents[1])
    script = KILL_DURING_REWRITE.format(root=root, model=str(shipped_policy_dir), tmp=str(tmp_path),
                                        checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == -9, result.stderr[-2000:]
    assert metrics.read_text() == before  # the kill came between writing the new file and renaming it
    resumed = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=3,
                                                                                       save_steps=1),
                          addition_rows(16))
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3]


@pytest.mark.parametrize("damage", ["truncated", "garbage_header"])
def test_a_corrupt_base_model_file_is_named_with_the_fix(tmp_path, shipped_policy_dir, damage):
    import shutil

    from rlft.model.loading import ModelFileError

    folder = tmp_path / "model"
    shutil.copytree(shipped_policy_dir, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x10" + b"\x00" * 7 + b"not json" * 4)
    with pytest.raises(ModelFileError, match=rf"{weights}: .*truncated or corrupt .* download or copy it again"):
        GRPOTrainer(str(folder), [correct_answer], tiny_grpo_config(tmp_path), addition_rows(16))
    from rlft.cli import main

    data_file = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    assert main(["grpo", "--model_name_or_path", str(folder), "--train_dataset", str(data_file), "--reward_funcs",
                 "exact_match", "--output_dir", str(tmp_path / "o")]) == 2


def test_a_full_disk_while_optimizer_pt_is_written_names_the_file_the_reason_and_the_intact_checkpoint(
        tmp_path, shipped_policy_dir, monkeypatch):
    """ENOSPC part-way through optimizer.pt of checkpoint-2: the error says which file, why, the free space, that
    checkpoint-1 is intact and what to do; checkpoint-1 still verifies and the run resumes from it."""
    import rlft.train.engines.engine_base as engine_base
    from rlft.train.run.checkpoint import CheckpointWriteError, verify

    real_save, calls = torch.save, []

    def disk_fills_on_the_second_save(obj, handle):
        calls.append(1)
        if len(calls) == 2:
            handle.write(b"PK\x03\x04 partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, handle)

    monkeypatch.setattr(engine_base.torch, "save", disk_fills_on_the_second_save)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer],
                          tiny_grpo_config(tmp_path, save_steps=1, max_steps=3), addition_rows(16))
    with pytest.raises(CheckpointWriteError) as err:
        trainer.train()
    message = str(err.value)
    assert f"checkpoint-2 could not be written to {tmp_path / 'run'} (writing checkpoint-2/optimizer.pt failed: " \
           "ENOSPC: No space left on device)" in message
    assert "free on its filesystem now" in message and "Likely cause: the disk is full" in message
    assert "checkpoint-1, the last complete checkpoint, is intact: resume_from_checkpoint=True" in message
    assert err.value.reason == "ENOSPC: No space left on device"
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
    verify(tmp_path / "run" / "checkpoint-1")
    monkeypatch.setattr(engine_base.torch, "save", real_save)
    resumed = GRPOTrainer(str(shipped_policy_dir), [correct_answer],
                          tiny_grpo_config(tmp_path, save_steps=1, max_steps=3), addition_rows(16))
    resumed.train(resume_from_checkpoint=True)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


SIZE_LIMIT_AFTER_FIRST_CHECKPOINT = """
import resource, signal, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from transformers import TrainerCallback
from rlft import GRPOTrainer
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config

class LimitFileSize(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        first = Path(args.output_dir) / "checkpoint-1"
        limit = ((first / "model.safetensors").stat().st_size + (first / "optimizer.pt").stat().st_size) // 2
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

cfg = tiny_grpo_config(Path({folder!r}), save_steps=1, max_steps=3)
GRPOTrainer({model!r}, [correct_answer], cfg, addition_rows(16), callbacks=[LimitFileSize()]).train()
"""


def test_a_file_size_limit_hit_inside_torch_save_is_named_not_torchs_unexpected_pos(tmp_path, shipped_policy_dir):
    """A real failed write inside torch.save (a process file-size limit between the model file's size and
    optimizer.pt's): torch says only 'unexpected pos'; the run says which file and the OS's reason."""
    script = SIZE_LIMIT_AFTER_FIRST_CHECKPOINT.format(root=str(Path(__file__).resolve().parents[1]),
                                                      folder=str(tmp_path), model=str(shipped_policy_dir))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rlft.train.run.safe_files.CheckpointWriteError: checkpoint-2 could not be written")
    assert "(writing checkpoint-2/optimizer.pt failed: EFBIG: File too large)" in last
    assert "a file size limit (ulimit -f)" in last and "checkpoint-1, the last complete checkpoint, is intact" in last
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]


def test_reward_timeout_stops_a_run_whose_reward_never_returns(tmp_path, shipped_policy_dir):
    """reward_timeout reaches the trainer's reward calls: the run stops promptly, naming the function."""
    import threading
    import time

    release = threading.Event()

    def never_returns(completions, **kwargs):
        release.wait(30)
        return [0.0] * len(completions)

    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer, never_returns],
                          tiny_grpo_config(tmp_path, reward_timeout=1.0), addition_rows(16))
    started = time.monotonic()
    try:
        with pytest.raises(RewardFunctionError, match=r"reward function 'never_returns' did not return within "
                                                      r"reward_timeout=1 s at step 0"):
            trainer.train()
        assert time.monotonic() - started < 30
    finally:
        release.set()


@pytest.mark.parametrize("where", [0, "last", "middle"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_save_time_finite_check_finds_any_bad_value_and_holds_one_chunk_at_a_time(where, bad):
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlft.train.run.safe_files import FINITE_CHUNK, CheckpointError, check_finite, finite

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs:  # not a view
                Largest.largest = max(Largest.largest, out.numel())
            return out

    weight = torch.zeros(3 * FINITE_CHUNK // 1000 + 7, 1000)  # three chunks and a partial one
    assert finite(weight) and finite(weight.t()) and finite(weight.bfloat16())
    with Largest():
        assert finite(weight)
    assert Largest.largest <= FINITE_CHUNK < weight.numel()  # never a temporary of the weight's size
    index = {0: 0, "last": weight.numel() - 1, "middle": 2 * FINITE_CHUNK + 5}[where]
    weight.view(-1)[index] = bad
    assert not finite(weight) and not finite(weight.t())
    with pytest.raises(CheckpointError, match="refusing to save: 1 parameter tensors hold inf/NaN"):
        check_finite({"ok": torch.ones(3), "model.embed_tokens.weight": weight})
