"""FSDP2 and DeepSpeed ZeRO-2/3 on 2 CPU processes (gloo) are one process split in two: the same update for every
loss type, the same learning rates, checkpoints that resume exactly, and saved folders that load.

Launched like a user launches them: `accelerate launch --config_file tests/dist/engines/<engine>.yaml`
(ZeRO-3 with stage3_param_persistence_threshold 0, or a tiny model is never actually sharded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlft.config import ConfigError
from rlft.telemetry.tracking import read_metrics
from tests.helpers import SAME_STEP, SHARED_PROMPT, assert_params_close, float32_step_bound
from tests.test_distributed import ROOT, launch

ENGINES = ["fsdp2", "zero2", "zero3"]
SLOW = pytest.mark.slow  # (CI time: each engine keeps a variant of each test in the default suite)


def some_slow(cases: list, slow: set) -> list:
    """`cases` for parametrize with those in `slow` marked slow (run them with -m slow)."""
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=SLOW) if c in slow else c for c in cases]


def needs(engine: str) -> None:
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")


def accelerate_launch(config: str | Path, args: list[str], timeout: int = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), *args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    return result


def engine_launch(engine: str, args: list[str]) -> subprocess.CompletedProcess:
    return accelerate_launch(f"tests/dist/engines/{engine}.yaml", args)


@pytest.fixture(scope="module")
def one_process_step(tmp_path_factory, tiny_causal_dir):
    out = tmp_path_factory.mktemp("one") / "1.pt"
    result = launch(["tests/dist/grpo_step.py", str(tiny_causal_dir), str(out), "4"], 1)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


# (ZeRO-2 and ZeRO-3 steps: the resume tests below; CI time, 2026-11-28: ZeRO-3 here took 36-73 s)
@pytest.mark.parametrize("engine", some_slow(ENGINES, {"zero2", "zero3"}))
def test_one_step_equals_one_process_for_every_loss_type(engine, tmp_path, tiny_causal_dir, one_process_step):
    """SGD at learning rate 1: the parameter change is the gradient. Full fine-tuning, beta > 0 (under ZeRO-3 the
    reference is its own sharded engine), 4 micro-batches on 1 process vs 2 x 2: one optimiser step either way.
    FSDP2 trains float64 like the one process and equals it to rounding; DeepSpeed trains float32 only, so its
    step is held to float32's bound from the float64 one (tests/helpers.py)."""
    needs(engine)
    dtype = "float32" if engine.startswith("zero") else "float64"
    engine_launch(engine, ["tests/dist/grpo_step.py", str(tiny_causal_dir), str(tmp_path / "2.pt"), "4", dtype])
    one, two = one_process_step, torch.load(tmp_path / "2.pt")
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(tiny_causal_dir).state_dict()  # (a tied head included)
    assert sorted(one) == sorted(two)
    for run in one:
        assert two[run]["engine"] == engine
        # every engine scores the LM head fused (FSDP2's subclass of nn.Linear too), as one process does
        assert one[run]["module_tiles"] == two[run]["module_tiles"] == 0, run
        want, got = one[run]["params"], two[run]["params"]
        assert {str(p.dtype) for p in got.values()} == {f"torch.{dtype}"}

        def bound(name, want=want, run=run):
            if dtype == "float64":
                return SHARED_PROMPT if run == "packed_prompts" else SAME_STEP
            change = (want[name] - before[name].double()).abs().max().item()
            return float32_step_bound(change, want[name].abs().max().item())

        assert_params_close(got, want, bound, run)
        for key, value in one[run]["metrics"].items():  # float32 metrics: a few roundings of values ~1
            assert value == pytest.approx(two[run]["metrics"][key], rel=1e-5, abs=1e-6), (run, key)


def test_an_untied_lm_head_under_fsdp2_is_scored_fused_and_its_step_equals_one_process(tmp_path, tiny_causal_dir):
    """A policy with its own LM head (not the embedding): FSDP2 shards it as a unit of its own, and the fused head
    reads the whole parameter FSDP unsharded for the forward, so FSDP reduce-scatters its gradient. One step on 2
    processes equals one process's to float64 rounding, the head's rows included, with no module-path forward."""
    needs("fsdp2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_causal_dir)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone() * 1.5)
    untied = tmp_path / "untied"
    model.save_pretrained(untied)
    AutoTokenizer.from_pretrained(tiny_causal_dir).save_pretrained(untied)
    runs = ["tests/dist/grpo_step.py", str(untied), None, "4", "float64", "grpo,dapo,sapo"]
    result = launch([*runs[:2], str(tmp_path / "1.pt"), *runs[3:]], 1)
    assert result.returncode == 0, result.stderr[-3000:]
    engine_launch("fsdp2", [*runs[:2], str(tmp_path / "2.pt"), *runs[3:]])
    one, two = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert sorted(one) == sorted(two) == ["dapo", "grpo", "sapo"]
    for run in one:
        assert two[run]["engine"] == "fsdp2" and one[run]["module_tiles"] == two[run]["module_tiles"] == 0
        assert "lm_head.weight" in two[run]["params"]
        assert_params_close(two[run]["params"], one[run]["params"], lambda name: SAME_STEP, run)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory, tiny_causal_dir, tiny_rm_dir):
    cache = {}

    def run(mode: str, dtype: str = "float64") -> Path:
        if (mode, dtype) not in cache:
            out = tmp_path_factory.mktemp(f"one-{mode}-{dtype}")
            model = tiny_rm_dir if mode.startswith("reward") else tiny_causal_dir
            result = launch(["tests/dist/sharded_run.py", str(model), str(out), mode, dtype], 1)
            assert result.returncode == 0, result.stderr[-3000:]
            cache[mode, dtype] = out
        return cache[mode, dtype]

    run.model = tiny_causal_dir
    return run


def dtype_of(engine: str) -> str:
    """The runs compared with one process's train float64 (tests/helpers.py: SAME_STEP), except under
    DeepSpeed, which trains float32 only: those are compared with one process's float32 run, to TOLERANCE."""
    return "float32" if engine.startswith("zero") else "float64"


# Adam turns a gradient difference at float32 rounding into an update difference of up to ~lr where a gradient is
# near 0 (its step is lr m / (sqrt(v) + eps), most sensitive to g where |g| ~ eps: up to lr / eps per unit of g);
# 4 steps at lr 1e-2: full fine-tuning is compared to 1e-4, LoRA (few, larger gradients) to 1e-5. Seen on two
# CPUs (AVX-512 and AVX2 kernels, 2 and 1 threads): at most 0.49 of these. Against a float64 run instead the
# float32 run's own rounding stands alone and ZeRO-3's full fine-tuning came to 0.90 of its bound, so
# DeepSpeed's float32 runs are compared with one process's float32 run.
TOLERANCE = {"lora": 1e-5, "full": 1e-4, "reward-lora": 1e-5, "reward-full": 1e-4}
# The same 4 Adam steps in float64 on both sides. The reward model's and distillation's forwards round nothing in
# float32: their steps agree to float64's rounding (seen: 0 and < 1e-10). GRPO's packed forwards hold a group's
# prompt once, and transformers' RMSNorm rounds its summed gradient to float32 where one process's split rounds
# each row's (tests/helpers.py: SHARED_PROMPT); Adam carries that (a few 1e-8 relative) into updates of up to
# ~lr where a gradient is near 0: 1e-6 (seen: 1.1e-7 LoRA, 3.4e-8 full, on 2026-11-28).
FLOAT64_BOUND = {"lora": 1e-6, "full": 1e-6, "reward-lora": 1e-10, "reward-full": 1e-10, "distill": 1e-10}


def tolerance(engine: str, mode: str) -> float:
    """FLOAT64_BOUND or TOLERANCE. (FSDP2's LoRA runs were held to full fine-tuning's bound while FSDP's subclass
    of the LM head took the checkpointed module tiles; since 2026-11-29 it takes the fused head, as one process
    does.)"""
    if dtype_of(engine) == "float64":
        return FLOAT64_BOUND[mode]
    return TOLERANCE[mode]


@pytest.mark.parametrize("engine, mode", some_slow(
    [(e, m) for e in ["ddp", *ENGINES] for m in TOLERANCE],
    {("ddp", "full"), ("ddp", "reward-full"), ("zero2", "full"), ("zero2", "reward-full"), ("zero3", "reward-full"),
     ("fsdp2", "reward-lora"),
     # (CI time, 2026-11-28: the default suite keeps each engine's LoRA run and one reward run, fsdp2's)
     ("ddp", "reward-lora"), ("zero2", "reward-lora"), ("zero3", "reward-lora"), ("fsdp2", "full"),
     ("zero3", "full"),
     # (CI time, 2026-11-28: ZeRO-2 still runs in the default suite through its shipped accelerate config)
     ("zero2", "lora"),
     # (CI time, 2026-11-29, 75 s: ZeRO-3 LoRA still trains, checkpoints and resumes in the default suite in
     # test_async_grpo_under_a_sharded_engine_equals_ddp, and its shipped config runs)
     ("zero3", "lora")}))
def test_train_checkpoint_resume_save_equals_one_process(engine, mode, tmp_path, tiny_causal_dir, tiny_rm_dir,
                                                         one_process_runs):
    """DDP (accelerate's MULTI_GPU config, gloo on CPUs) and the sharded engines: 4 AdamW steps on a linear
    schedule, checkpoint at 2; a second trainer resumes from checkpoint-2. The resumed
    save_model folder equals the straight one bitwise, both equal 1 process's, the learning rates are 1 process's
    ([0.01, 0.0075, 0.005, 0.0025]), and the folder loads with from_pretrained."""
    needs(engine)
    model = tiny_rm_dir if mode.startswith("reward") else tiny_causal_dir
    engine_launch(engine, ["tests/dist/sharded_run.py", str(model), str(tmp_path), mode, dtype_of(engine)])
    reference = one_process_runs(mode, dtype_of(engine))
    rates = json.loads((tmp_path / "rates.json").read_text())
    assert rates == {"rates": json.loads((reference / "rates.json").read_text())["rates"], "engine": engine}
    assert rates["rates"] == pytest.approx([0.01, 0.0075, 0.005, 0.0025])
    straight, resumed, one = (weights(folder) for folder in (tmp_path / "straight", tmp_path / "resumed",
                                                             reference / "straight"))
    assert sorted(straight) == sorted(one) and straight
    for name, value in one.items():
        assert torch.equal(straight[name], resumed[name]), name
        assert torch.allclose(straight[name].double(), value.double(), atol=tolerance(engine, mode), rtol=0), \
            (name, mode)
    checkpoint = tmp_path / "run" / "checkpoint-4"
    if engine == "ddp":  # the whole optimizer state on every process: one file, read back with weights_only
        assert [p.name for p in checkpoint.rglob("*.pt")] == ["optimizer.pt"]
    else:
        assert not list(checkpoint.rglob("*.pt")), "nothing pickled in a sharded checkpoint"
        assert (checkpoint / "engine" / "optimizer.safetensors").is_file()
    _loads(tmp_path / "resumed", mode)


@pytest.mark.parametrize("engine, mode", some_slow([("fsdp2", "distill-lora"), ("zero3", "distill-full")],
                                                   {("zero3", "distill-full")}))  # (CI time, 33 s)
def test_distillation_under_a_sharded_engine_equals_one_process(engine, mode, tmp_path, one_process_runs):
    """DistillationTrainer's 4 steps with a resume at 2: under FSDP2 (LoRA student) and ZeRO-3 (full student,
    the teacher its own ZeRO-3 engine, LM heads gathered for the tile loops) the saved weights equal one
    process's, and the resumed run the straight one bitwise."""
    needs(engine)
    engine_launch(engine, ["tests/dist/sharded_run.py", str(one_process_runs.model), str(tmp_path), mode,
                           dtype_of(engine)])
    straight, resumed, one = (weights(folder) for folder in (tmp_path / "straight", tmp_path / "resumed",
                                                             one_process_runs(mode, dtype_of(engine)) / "straight"))
    assert sorted(straight) == sorted(one) and straight
    for name, value in one.items():
        assert torch.equal(straight[name], resumed[name]), name
        bound = FLOAT64_BOUND["distill"] if dtype_of(engine) == "float64" else TOLERANCE[mode.removeprefix("distill-")]
        assert torch.allclose(straight[name].double(), value.double(), atol=bound, rtol=0), name


@pytest.mark.parametrize("engine", some_slow(ENGINES, {"zero2", "fsdp2"}))  # (CI time: ZeRO-3's in the default)
def test_a_bfloat16_run_trains_saves_and_resumes_in_bfloat16(engine, tmp_path, tiny_causal_dir):
    """dtype bfloat16, full fine-tuning: the saved weights are bfloat16 (ZeRO-3 once built the model inside zero.Init
    at the config's float32 and trained and saved float32 without a word), they moved, and the run resumed from
    checkpoint-2 equals the straight one bitwise (DeepSpeed resumes from its fp32 master copy)."""
    needs(engine)
    engine_launch(engine, ["tests/dist/sharded_run.py", str(tiny_causal_dir), str(tmp_path), "full", "bfloat16"])
    straight, resumed = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    start = weights(Path(tiny_causal_dir))
    assert {v.dtype for v in straight.values()} == {torch.bfloat16}
    assert max((straight[k].float() - start[k].float()).abs().max().item() for k in start) > 1e-2
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name


def _loads(folder: Path, mode: str) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if mode == "lora":
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(folder)
    elif mode == "full":
        model = AutoModelForCausalLM.from_pretrained(folder)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert all(p.numel() > 0 for p in model.parameters())  # ZeRO-3 once saved shape-(0,) tensors


@pytest.mark.parametrize("config", ["ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"])
def test_shipped_accelerate_configs_run_their_engine(config, tmp_path, shipped_policy_dir):
    """The configs users copy, launched as shipped but on 2 processes: a LoRA GRPO run with checkpoints."""
    needs("zero" if "deepspeed" in config else config)
    from tests.test_distributed import lora_run_yaml

    run_config, out = lora_run_yaml(tmp_path, shipped_policy_dir, "max_steps: 2\n")
    result = accelerate_launch(f"examples/accelerate/{config}.yaml",
                               ["--num_processes", "2", "-m", "rlft.cli", "grpo", "--config", str(run_config)])
    engine = {"ddp": "ddp", "fsdp2": "fsdp2", "deepspeed_zero2": "zero2", "deepspeed_zero3": "zero3"}[config]
    assert f"engine {engine} on 2 process(es)" in result.stdout + result.stderr
    assert (out / "checkpoint-2" / "engine" / "weights.safetensors").is_file() == (engine != "ddp")
    assert (out / "checkpoint-2" / "adapter_model.safetensors").is_file()


def test_sharding_asked_on_one_cpu_process_is_an_error(monkeypatch, tmp_path):
    from rlft import GRPOConfig
    from rlft.train.state import make_accelerator

    if torch.cuda.is_available():
        pytest.skip("on a GPU one process may run DeepSpeed/FSDP")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="asks for fsdp on one process"):
        make_accelerator(GRPOConfig(output_dir=str(tmp_path), report_to=["none"]))


def test_an_engine_that_would_not_run_is_named(monkeypatch):
    """What accelerate would run differs from what the launch asked for: an error naming both."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from rlft.train.engines import asked_engine, check_engine

    with pytest.raises(ConfigError, match="asks for FSDP2 but accelerate would run DDP"):
        check_engine(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU), "fsdp")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="both FSDP and DeepSpeed"):
        asked_engine()


@pytest.fixture(scope="module")
def one_process_sync(tmp_path_factory, tiny_causal_dir):
    cache = {}

    def run(mode: str, dtype: str = "float64") -> dict[str, torch.Tensor]:
        if (mode, dtype) not in cache:
            out = tmp_path_factory.mktemp(f"sync-one-{mode}-{dtype}")
            result = launch(["tests/dist/sync_weights.py", str(tiny_causal_dir), str(out), mode, dtype], 1)
            assert result.returncode == 0, result.stderr[-3000:]
            cache[mode, dtype] = load_file(str(out / "rank0.safetensors"))
        return cache[mode, dtype]

    return run


@pytest.mark.parametrize("engine, mode", some_slow(
    [(e, m) for e in ["fsdp2", "zero3"] for m in ["lora", "full", "buckets", "adapter"]],
    {("fsdp2", "lora"), ("fsdp2", "full"), ("zero3", "buckets"), ("zero3", "adapter"), ("zero3", "lora"),
     # (CI time, 2026-11-28: zero3-full keeps a sharded full-weights push in the default suite)
     ("fsdp2", "buckets")}))
def test_a_vllm_weight_sync_reads_whole_merged_weights_on_every_process(engine, mode, tmp_path, tiny_causal_dir,
                                                                         one_process_sync):
    """What a vLLM engine is pushed after 3 sharded steps (each process: its own colocated engine; rank 0: the
    server's) is the whole model, LoRA merged, in vLLM's names, and equals 1 process's. With syncs before every
    step in between: a sync leaves the shards as they were (FSDP2: peft merging DTensors in place was 0.17 off
    and changed the shards). Buckets (full) and adapter (LoRA, the base weights unmerged then the adapter):
    gathered one bucket at a time -- never more parameters whole at once than one bucket holds."""
    needs(engine)
    engine_launch(engine, ["tests/dist/sync_weights.py", str(tiny_causal_dir), str(tmp_path), mode, dtype_of(engine)])
    one = one_process_sync(mode, dtype_of(engine))
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1)]
    assert sorted(ranks[0]) == sorted(one) and "lm_head.weight" in one
    assert any("lora" in k for k in one) == (mode == "adapter")
    if mode in ("buckets", "adapter"):
        for rank in (0, 1):
            whole = json.loads((tmp_path / f"rank{rank}.json").read_text())
            assert whole["before"] == 0 and whole["buckets"] > 5, whole
            assert 0 < whole["inside"] <= whole["largest_bucket"] < whole["params"], whole
    for name, value in one.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert ranks[0][name].shape == value.shape, name
        bound = tolerance(engine, {"buckets": "full", "adapter": "lora"}.get(mode, mode))
        if dtype_of(engine) == "float64":  # pushed as float32: each side's float64 weights rounded once
            bound += 2.0 ** -23 * value.abs().max().item()
        assert torch.allclose(ranks[0][name], value, atol=bound, rtol=0), name


@pytest.fixture(scope="module")
def async_on_ddp(tmp_path_factory, shipped_policy_dir):
    """DDP's async runs, per mode, made when first asked for."""
    runs = {}

    def run(mode: str) -> Path:
        if mode not in runs:
            runs[mode] = tmp_path_factory.mktemp("async") / mode
            engine_launch("ddp", ["tests/dist/async_run.py", str(shipped_policy_dir), str(runs[mode]),
                                  *(["--full"] if mode == "full" else [])])
        return runs[mode]
    return run


@pytest.mark.parametrize("engine, mode", some_slow([("fsdp2", "lora"), ("zero3", "lora"), ("zero3", "full")],
                                                   {("zero3", "full"), ("fsdp2", "lora")}))
def test_async_grpo_under_a_sharded_engine_equals_ddp(engine, mode, tmp_path, shipped_policy_dir, async_on_ddp):
    """Each process's producer starts from the gathered base weights and takes gathered pushes (the adapters, or
    every weight): the run samples and trains as under DDP (to 1e-5 after 4 steps) and resumes from its step-2
    checkpoint."""
    needs(engine)
    out, resumed, ddp_out = tmp_path / engine, tmp_path / "resumed", async_on_ddp(mode)
    full = ["--full"] if mode == "full" else []
    engine_launch(engine, ["tests/dist/async_run.py", str(shipped_policy_dir), str(out), *full])
    engine_launch(engine, ["tests/dist/async_run.py", str(shipped_policy_dir), str(resumed), *full,
                           "--resume", str(out / "checkpoint-2")])
    rows = lambda folder: [(r["step"], r["reward"], r["completions/mean_length"])  # noqa: E731
                           for r in read_metrics(folder)]
    assert rows(out) == rows(ddp_out) and rows(resumed) == rows(out)[2:]
    weights = "model.safetensors" if mode == "full" else "adapter_model.safetensors"
    ddp = load_file(ddp_out / "final" / weights)
    for folder in (out, resumed):
        sharded = load_file(folder / "final" / weights)
        assert sorted(sharded) == sorted(ddp)
        worst = max((sharded[name] - value).abs().max().item() for name, value in ddp.items())
        assert worst <= 1e-5, (engine, mode, worst)
