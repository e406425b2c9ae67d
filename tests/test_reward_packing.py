"""The reward trainer's pairs scored packed (rlft/train/update/pair_packing.py): the layout (a pair's shared
prefix once, each sequence pooled where the model's own forward pools), and one training step's loss,
metrics and parameter change equal to the padded step's for Qwen2 and Llama, full and LoRA, with gradient
checkpointing; a model whose attention cannot take the packed rows falls back (or is an error when asked)."""

from __future__ import annotations

import random

import pytest
import torch
from peft import LoraConfig

from rlft import RewardTrainer
from rlft.errors import ConfigError
from rlft.train.update.pair_packing import pack_pairs
from tests.helpers import tiny_reward_config

WORDS = ["good", "bad", "fine", "poor", "great", "awful", "clear", "vague", "kind", "rude"]


def long_pairs(count: int, seed: int = 0) -> list[dict]:
    """Pairs behind long prompts (15-30 words, 45-90 tokens) with answers of very different lengths (1-40
    words), each pair under max_length (256)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 30))) + " ? "
        answer = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) + "."  # noqa: E731
        rows.append({"prompt": prompt, "chosen": answer(), "rejected": answer()})
    return rows


def test_layout_shares_the_prefix_and_pools_the_last_token_that_is_not_padding():
    pad = 0
    chosen = [[5, 6, 7, 8, 9], [3, 4]]
    rejected = [[5, 6, 7, 2, pad], [3, 4, 1, 1]]  # the first rejected ends in the pad token (pooled before it)
    width = 5
    ids = torch.full((4, width), pad)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(chosen + rejected):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    packed = pack_pairs(ids, mask, pad)
    flat = packed.input_ids[0].tolist()
    # pair 0: [5 6 7] once, then [8 9] and [2 pad]; pair 1: [3] once (each keeps a token), then [4] and [4 1 1]
    assert flat == [5, 6, 7, 8, 9, 2, pad, 3, 4, 4, 1, 1]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 0, 1, 1, 2, 3]
    assert [flat[i] for i in packed.pooled.tolist()] == [9, 4, 2, 1]
    assert packed.pooled.tolist() == [4, 8, 5, 11]
    covered = sorted(i for b in packed.blocks for i in range(b.start, b.start + b.length))
    assert covered == list(range(len(flat)))
    whole = pack_pairs(ids, mask, pad, share=False)
    assert whole.input_ids.shape[1] == int(mask.sum()) and len(whole.blocks) == 4


def one_step(tmp_path, model_dir, name, padding_free, lora=False, **overrides):
    """Loss, metrics and parameter change of one SGD step (lr 1: the change is the gradient)."""
    cfg = tiny_reward_config(tmp_path / name, optim="sgd", learning_rate=1.0, max_grad_norm=1e9, max_steps=1,
                             per_device_train_batch_size=4, max_length=256, padding_free=padding_free,
                             logging_steps=1, **overrides)
    peft = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="SEQ_CLS") if lora else None
    trainer = RewardTrainer(str(model_dir), cfg, train_dataset=long_pairs(8), peft_config=peft)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = trainer._optimizer_step(0)
    change = {n: before[n] - p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return trainer, metrics, change


@pytest.fixture(scope="module")
def llama_rm_dir(tmp_path_factory):
    from rlft.tiny import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("llama-rm"), kind="seq_cls", arch="llama", seed=2)


@pytest.mark.parametrize("arch,lora,checkpointing", [("qwen2", False, False), ("qwen2", True, True),
                                                     ("llama", False, True), ("llama", True, False)])
def test_a_packed_step_is_the_padded_step(tmp_path, tiny_rm_dir, llama_rm_dir, arch, lora, checkpointing):
    model_dir = tiny_rm_dir if arch == "qwen2" else llama_rm_dir
    padded, want, want_change = one_step(tmp_path, model_dir, "padded", False, lora,
                                         gradient_checkpointing=checkpointing)
    packed, got, got_change = one_step(tmp_path, model_dir, "packed", True, lora,
                                       gradient_checkpointing=checkpointing)
    assert packed.packing.checked and padded.packing.checked is None
    batch = packed.train_pairs.batch(packed._indices(0, 0), packed.tokenizer.pad_token_id)
    layout = pack_pairs(batch["input_ids"], batch["attention_mask"], packed.tokenizer.pad_token_id)
    assert layout.tokens < 0.6 * layout.padded_tokens  # the prompts once and no padding
    for key in ("loss", "accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for name, change in want_change.items():
        assert torch.allclose(got_change[name], change, atol=1e-6, rtol=1e-4), name
    assert packed.evaluate(long_pairs(4, seed=1))["eval_loss"] == \
        pytest.approx(padded.evaluate(long_pairs(4, seed=1))["eval_loss"], rel=1e-5)


def test_packing_only_where_it_pays_and_a_model_it_cannot_take(tmp_path, tiny_rm_dir, caplog):
    short = [{"prompt": "good ? ", "chosen": "fine.", "rejected": "bad."}] * 8
    trainer = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path / "auto", max_steps=1,
                                                                per_device_train_batch_size=4),
                            train_dataset=short)
    trainer._optimizer_step(0)
    batch = trainer.train_pairs.batch([0, 1, 2, 3], trainer.tokenizer.pad_token_id)
    assert trainer.packing.checked  # checked at the first batch (on every process alike) ...
    assert trainer.packing.plan(trainer.model, batch) is None  # ... but short pairs are cheaper padded on a CPU
    eager = dict(model_init_kwargs={"attn_implementation": "eager"})
    trainer, _, _ = one_step(tmp_path, tiny_rm_dir, "eager", None, **eager)
    assert trainer.packing.checked is False and "packed pair scoring is off" in caplog.text
    with pytest.raises(ConfigError, match="padding_free=True"):
        one_step(tmp_path, tiny_rm_dir, "eager-asked", True, **eager)
