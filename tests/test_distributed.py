"""Two CPU processes (torchrun, gloo) are exactly one process split in two."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlft.core.losses import LOSS_TYPES
from rlft.telemetry.tracking import read_metrics
from tests.dist.grpo_step import OPTIONS
from tests.helpers import (
    SAME_STEP,
    SHARED_PROMPT,
    addition_rows,
    assert_params_close,
    preference_rows,
    write_jsonl,
)

ROOT = Path(__file__).resolve().parents[1]


def launch(args: list[str], processes: int, timeout: int = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--standalone",
               *args] if processes > 1 else [sys.executable, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_one_step_on_two_processes_equals_one_process_for_every_loss_type_and_option(tmp_path, tiny_causal_dir):
    """SGD with lr 1 makes the parameter change equal to the gradient, so this compares gradients; in float64,
    to its rounding (tests/helpers.py: SAME_STEP)."""
    for processes in (1, 2):
        result = launch(["tests/dist/grpo_step.py", str(tiny_causal_dir), str(tmp_path / f"{processes}.pt"), "4"],
                        processes)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert sorted(one) == sorted([*LOSS_TYPES, *OPTIONS])
    assert one["off_policy_mask"]["metrics"]["off_policy/masked_fraction"] > 0  # the options did act
    assert 0 < one["top_entropy_quantile"]["metrics"]["entropy_mask/kept_fraction"] < 1
    assert one["delta"]["metrics"]["clip_ratio/delta_mean"] > 0
    for packed in ("packed_prompts", "packed_rows"):
        assert one[packed]["tokens"]["tokens/packed_fraction"] == two[packed]["tokens"]["tokens/packed_fraction"] == 1
    assert one["padded"]["tokens"]["tokens/packed_fraction"] == 0
    # packed (a group's prompt once / every row whole) = padded
    assert_params_close(one["packed_rows"]["params"], one["padded"]["params"], SAME_STEP, "packed_rows")
    assert_params_close(one["packed_prompts"]["params"], one["padded"]["params"], SHARED_PROMPT, "packed_prompts")
    for packed in ("packed_prompts", "packed_rows"):
        assert one[packed]["metrics"]["loss"] == pytest.approx(one["padded"]["metrics"]["loss"], abs=SAME_STEP)
    assert one["packed_prompts"]["tokens"]["tokens/computed"] < one["packed_rows"]["tokens"]["tokens/computed"] \
        < one["padded"]["tokens"]["tokens/computed"]
    for loss_type in one:  # a group's prompt held once falls into other micro-batches on 2 processes
        bound = SHARED_PROMPT if loss_type == "packed_prompts" else SAME_STEP
        assert_params_close(two[loss_type]["params"], one[loss_type]["params"], bound, loss_type)
        for key, value in one[loss_type]["metrics"].items():
            assert value == pytest.approx(two[loss_type]["metrics"][key], abs=bound), (loss_type, key)


def test_routing_replay_on_two_processes_equals_one_process(tmp_path):
    """A Mixture-of-Experts policy replaying routes its rollouts carry (fixed at random, so replay
    differs from routing freely): each process replays its own rows' routes, padded and packed."""
    from rlft.tiny import make_tiny_model_dir

    moe = make_tiny_model_dir(tmp_path / "moe", arch="qwen3_moe", hidden_size=64)
    for processes in (1, 2):
        result = launch(["tests/dist/grpo_step.py", str(moe), str(tmp_path / f"{processes}.pt"), "4", "routes"],
                        processes)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert sorted(one) == ["packed_prompts", "packed_rows", "padded"]
    assert one["padded"]["metrics"]["sampling/route_agreement"] < 0.9  # the random routes were replayed
    assert_params_close(one["packed_rows"]["params"], one["padded"]["params"], SAME_STEP, "packed_rows")
    assert_params_close(one["packed_prompts"]["params"], one["padded"]["params"], SHARED_PROMPT, "packed_prompts")
    assert one["packed_prompts"]["tokens"]["tokens/computed"] < one["packed_rows"]["tokens"]["tokens/computed"]
    for name in one:
        bound = SHARED_PROMPT if name == "packed_prompts" else SAME_STEP
        assert_params_close(two[name]["params"], one[name]["params"], bound, name)
        for key, value in one[name]["metrics"].items():
            assert value == pytest.approx(two[name]["metrics"][key], abs=bound), (name, key)


def lora_run_yaml(tmp_path, model_dir, extra: str = "") -> tuple[Path, Path]:
    """A small GRPO LoRA run's YAML (2 prompts x 4 completions per process and step; `extra` lines win, as later
    YAML keys do): (config, output_dir)."""
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(32))
    out, config = tmp_path / "run", tmp_path / "run.yaml"
    config.write_text(f"model_name_or_path: {model_dir}\ntrain_dataset: {data}\noutput_dir: {out}\n"
                      "reward_funcs: [exact_match, format]\nnum_generations: 4\nper_device_train_batch_size: 8\n"
                      "max_completion_length: 8\nuse_peft: true\nlora_r: 4\nlogging_steps: 1\nsave_steps: 2\n"
                      "learning_rate: 1e-3\nreport_to: none\ndisable_tqdm: true\n" + extra)
    return config, out


def cli_on_two_processes(*args: str) -> None:
    result = launch(["-m", "rlft.cli", *args], 2)
    assert result.returncode == 0, result.stderr[-3000:]


def test_two_process_grpo_lora_run_logs_once_checkpoints_once_and_resumes(tmp_path, shipped_policy_dir):
    config, out = lora_run_yaml(tmp_path, shipped_policy_dir)
    cli_on_two_processes("grpo", "--config", str(config), "--max_steps", "2")
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]  # one writer, not one per rank
    # the linear schedule advances once per optimiser step, not once per process (1e-3 over 2 steps)
    assert [r["learning_rate"] for r in rows] == pytest.approx([1e-3, 5e-4])
    assert all(r["completions/count"] == 16 for r in rows)  # 8 completions on each of 2 ranks
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert sorted(p.name for p in (out / "checkpoint-2").glob("rng_state_*.json")) == ["rng_state_0.json",
                                                                                    "rng_state_1.json"]
    cli_on_two_processes("grpo", "--config", str(config), "--max_steps", "4", "--resume_from_checkpoint", "true")
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


def test_two_processes_resume_inside_a_rollout_each_from_its_own_rows(tmp_path, shipped_policy_dir):
    """Two optimiser steps per rollout, a checkpoint after the first: each process's rest of the rollout is in
    the checkpoint (extra_<rank>.safetensors), so the resumed run equals the straight one."""
    from safetensors.torch import load_file

    config, out = lora_run_yaml(tmp_path, shipped_policy_dir, "steps_per_generation: 2\nsave_steps: 1\n")
    cli_on_two_processes("grpo", "--config", str(config), "--max_steps", "3")
    split = tmp_path / "split"
    cli_on_two_processes("grpo", "--config", str(config), "--max_steps", "3", "--output_dir", str(split),
                         "--resume_from_checkpoint", str(out / "checkpoint-1"))
    assert sorted(p.name for p in (out / "checkpoint-1").glob("extra*")) == [
        "extra_0.json", "extra_0.safetensors", "extra_1.json", "extra_1.safetensors"]
    rows = lambda folder: [(r["step"], r["loss"], r["reward"]) for r in read_metrics(folder)]  # noqa: E731
    assert rows(split) == rows(out)[1:]
    straight, resumed = (load_file(folder / "adapter_model.safetensors") for folder in (out, split))
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


def test_dynamic_sampling_on_two_processes_agrees_on_its_rounds(tmp_path, shipped_policy_dir):
    """Each process samples its own prompts; all run the same rounds (a disagreement would hang a collective)
    and every group in the batch has a reward spread unless the round limit was hit."""
    config, out = lora_run_yaml(tmp_path, shipped_policy_dir, "dynamic_sampling: true\nmax_num_gen_batches: 4\n"
                                "temperature: 1.2\n")
    cli_on_two_processes("grpo", "--config", str(config), "--max_steps", "2")
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(r["completions/count"] == 16 for r in rows)
    for row in rows:
        assert 1 <= row["dynamic_sampling/generation_rounds"] <= 4 and 0 <= row["dynamic_sampling/kept_fraction"] <= 1
        assert row["frac_reward_zero_std"] == 0.0 or row["dynamic_sampling/generation_rounds"] == 4


def test_dynamic_sampling_on_two_processes_trains_on_the_groups_one_process_would(tmp_path, tiny_causal_dir):
    """The kept groups are chosen globally: groups one process sampled are sent to the other when the batch
    order puts them there, and two steps on 2 processes equal them on 1 (SGD, lr 1: gradients compared)."""
    for processes in (1, 2):
        result = launch(["tests/dist/dynamic_step.py", str(tiny_causal_dir), str(tmp_path / f"{processes}.pt")],
                        processes)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert one["received"] == [0] and min(two["received"]) > 0  # groups did move between the processes
    assert [m["dynamic_sampling/generation_rounds"] for m in one["metrics"]] == [3.0, 4.0]
    assert one["rows"] == two["rows"]  # the same prompts, completions and rewards in the same batch order
    for step_one, step_two in zip(one["metrics"], two["metrics"], strict=True):
        assert step_one["frac_reward_zero_std"] == 0.0 and step_one["dynamic_sampling/kept_fraction"] < 1
        assert step_one.keys() == step_two.keys()
        for key, value in step_one.items():
            assert value == pytest.approx(step_two[key], abs=SAME_STEP), key
    assert_params_close(two["params"], one["params"], SAME_STEP)


@pytest.mark.slow  # (CI time, 38 s each: the tool-loop test below runs the same producers per process, with tools)
@pytest.mark.parametrize("mode", ["plain", "partial"])
def test_async_grpo_on_two_processes_each_with_its_producer_resumes_exactly(tmp_path, mode):
    """Each process's producer samples its slice of the prompts; a checkpoint holds each process's requested
    rollouts (extra_<rank>), and with partial rollouts each process's pool of carried completions
    (extra_<rank>.json), so a 2-process async run resumed from step 2 equals the straight one."""
    import json

    from safetensors.torch import load_file

    from rlft.model.loading import shipped_policy_path

    model = str(shipped_policy_path())
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ["--partial"] if mode == "partial" else []
    for args in ([model, str(straight)], [model, str(resumed), "--resume", str(straight / "checkpoint-2")]):
        result = launch(["tests/dist/async_run.py", *args, *flags], 2)
        assert result.returncode == 0, result.stderr[-3000:]
    carried = [load_file(straight / "checkpoint-2" / f"extra_{rank}.safetensors") for rank in (0, 1)]
    assert all(any(k.startswith("async.") for k in part) for part in carried)  # the rollouts requested ahead
    assert not torch.equal(carried[0]["async.2.tokens"], carried[1]["async.2.tokens"])  # each rank its own
    if mode == "partial":  # each rank's pool, its own
        pools = [json.loads((straight / "checkpoint-2" / f"extra_{rank}.json").read_text()) for rank in (0, 1)]
        assert pools[0] != pools[1] and all("async" in pool for pool in pools)
    kept = ("step", "loss", "reward", "sample/version", "sample/staleness_max", "completions/mean_length")
    rows = lambda folder: [{k: r[k] for k in kept} for r in read_metrics(folder)]  # noqa: E731
    if mode == "plain":
        assert [r["sample/staleness_max"] for r in rows(straight)] == [0.0, 1.0, 1.0, 1.0]
    assert rows(resumed) == rows(straight)[2:]
    a, b = (load_file(folder / "final" / "adapter_model.safetensors") for folder in (straight, resumed))
    assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("mode", ["plain", pytest.param("partial", marks=pytest.mark.slow)])  # (CI time: 40 s)
def test_async_tool_loops_on_two_processes_resume_exactly(tmp_path, mode):
    """Tools under AsyncGRPOTrainer on 2 processes: each process's driver thread runs its slice's tool loops on
    its own producer while DDP trains; a run resumed from its step-2 checkpoint (each rank's scored rollouts
    requested ahead in extra_<rank>, each rank's its own; with partial rollouts each rank's pool of tool-loop
    rows too) logs the same steps, one step stale after the first, and ends on the same weights as the
    straight run."""
    import json

    from safetensors.torch import load_file

    from rlft.model.loading import shipped_policy_path

    model = str(shipped_policy_path("tiny-calculator"))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ["--tools", "--partial"] if mode == "partial" else ["--tools"]
    for args in ([model, str(straight)], [model, str(resumed), "--resume", str(straight / "checkpoint-2")]):
        result = launch(["tests/dist/async_run.py", *args, *flags], 2)
        assert result.returncode == 0, result.stderr[-3000:]
    carried = [load_file(straight / "checkpoint-2" / f"extra_{rank}.safetensors") for rank in (0, 1)]
    assert all(any(k.startswith("async.") for k in part) for part in carried)  # the rollouts requested ahead
    assert not torch.equal(carried[0]["async.2.prompt_ids"], carried[1]["async.2.prompt_ids"])  # each rank its own
    if mode == "partial":  # each rank's pool of tool-loop rows (rollout 3's, moved on in rollout 2's windows)
        pools = [json.loads((straight / "checkpoint-2" / f"extra_{rank}.json").read_text())["async"]["agent_pool"]
                 for rank in (0, 1)]
        assert [[e["rollout"] for e in pool] for pool in pools] == [[3], [3]] and pools[0] != pools[1]
    kept = ("step", "loss", "reward", "sample/version", "sample/staleness_max", "tools/call_frequency",
            "completions/mean_length")
    rows = lambda folder: [{k: r[k] for k in kept} for r in read_metrics(folder)]  # noqa: E731
    assert all(r["tools/call_frequency"] > 0.5 for r in rows(straight))
    if mode == "plain":
        assert [r["sample/staleness_max"] for r in rows(straight)] == [0.0, 1.0, 1.0, 1.0]
    assert rows(resumed) == rows(straight)[2:]
    a, b = (load_file(folder / "final" / "adapter_model.safetensors") for folder in (straight, resumed))
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_two_process_reward_model_run(tmp_path, tiny_rm_dir):
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(128))
    out = tmp_path / "rm"
    config = tmp_path / "rm.yaml"
    config.write_text(f"model_name_or_path: {tiny_rm_dir}\ntrain_dataset: {data}\noutput_dir: {out}\n"
                      "per_device_train_batch_size: 8\nmax_length: 64\nlogging_steps: 1\nsave_steps: 3\n"
                      "learning_rate: 3e-3\nreport_to: [none]\ndisable_tqdm: true\npadding_free: true\n")
    cli_on_two_processes("reward", "--config", str(config), "--max_steps", "3")  # pairs packed under DDP
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert [r["learning_rate"] for r in read_metrics(out)] == pytest.approx([3e-3, 2e-3, 1e-3])  # as on 1 process
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    cli_on_two_processes("reward", "--config", str(config), "--max_steps", "5", "--resume_from_checkpoint", "true")
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]


def test_mislaunch_fails_before_any_model_is_loaded(tmp_path):
    """Groups never span processes, so each process's rollout must hold whole groups."""
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name_or_path: {tmp_path / 'no-such-model'}\ntrain_dataset: {data}\n"
                      f"output_dir: {tmp_path / 'out'}\nreward_funcs: [exact_match]\nnum_generations: 4\n"
                      "per_device_train_batch_size: 6\n")
    result = launch(["-m", "rlft.cli", "grpo", "--config", str(config)], 2)
    assert result.returncode != 0
    assert "not divisible by num_generations=4; use a multiple such as [4, 8, 12, 16]" in result.stderr
    assert "no-such-model" not in result.stderr  # failed before trying to load it


def test_a_rank_that_stops_answering_is_named_within_ddp_timeout(tmp_path, shipped_policy_dir):
    started = time.monotonic()
    result = launch(["tests/dist/stuck_rank.py", str(shipped_policy_dir), str(tmp_path / "run")], 2, timeout=200)
    assert result.returncode != 0
    assert "rank 0: rank(s) [1] did not answer a collective within ddp_timeout=5 s" in result.stderr, \
        result.stderr[-3000:]
    assert time.monotonic() - started < 150  # not the 300 s rank 1 sleeps, nor 30 minutes


def test_two_nodes_of_one_process_each_on_loopback(tmp_path, shipped_policy_dir):
    """torchrun --nnodes 2 (static rendezvous), both "nodes" on this machine: ranks come from the launcher, not
    from a single node's local ranks. On real nodes output_dir must be a shared filesystem (docs/distributed.md)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config, out = lora_run_yaml(tmp_path, shipped_policy_dir, "max_steps: 2\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
                               "-m", "rlft.cli", "grpo", "--config", str(config)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in results]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(r["completions/count"] == 16 for r in rows)
    assert sorted(p.name for p in (out / "checkpoint-2").glob("rng_state_*.json")) == ["rng_state_0.json",
                                                                                    "rng_state_1.json"]
