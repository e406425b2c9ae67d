"""GOLD (GOLDTrainer, TRL's experimental names): TRL's GOLDConfig defaults, GKD's rollouts with the divergence at
the sampling temperature (a step equals the float64 definition), cross-tokenizer distillation by ULD (a step
equals the definition written from the paper and the chain rule, with the alignment found independently), and
TRL's GOLD script's shape with the imports changed."""

from __future__ import annotations

import json

import pytest
import torch

from rlft.errors import ConfigError
from rlft.experimental.gold import GOLDConfig, GOLDTrainer
from tests.helpers import run_trl_script
from tests.test_distillation import perturbed, reference_loss
from tests.test_gkd import messages_rows
from tests.test_grpo_resume import resumed_run_equals_straight


def gold_config(tmp_path, **overrides) -> GOLDConfig:
    values = dict(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                  max_completion_length=8, logging_steps=1, save_steps=1000, report_to="none", disable_tqdm=True,
                  seed=0, gradient_checkpointing=False)
    return GOLDConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def teacher(shipped_policy_dir):
    return perturbed(shipped_policy_dir, 0.05).eval()


def test_trls_defaults_and_the_uld_settings_checked(tmp_path):
    cfg = GOLDConfig(output_dir=str(tmp_path))
    assert (cfg.learning_rate, cfg.temperature, cfg.top_p, cfg.lmbda, cfg.beta, cfg.max_completion_length,
            cfg.seq_kd, cfg.num_generations, cfg.divergence_temperature) == (1e-7, 0.9, 0.95, 0.5, 0.5, 128, False,
                                                                            1, 0.9)
    assert (cfg.use_uld_loss, cfg.use_extended_uld, cfg.uld_token_merge_strategy, cfg.uld_skip_student_eos,
            cfg.uld_crossentropy_weight, cfg.uld_distillation_weight) == (False, True, "observed", True, 0.0, 1.0)
    for bad, match in ((dict(seq_kd=True), "seq_kd is set with use_uld_loss"),
                       (dict(teacher_model_server_url="http://h:1"), "teacher_model_server_url is set with"),
                       (dict(uld_hybrid_matched_weight=0.5), "set together"),
                       (dict(uld_token_merge_strategy="mean"), "uld_token_merge_strategy"),
                       (dict(uld_teacher_temperature=0.0), "uld_teacher_temperature")):
        with pytest.raises(ConfigError, match=match):
            GOLDConfig(output_dir=str(tmp_path), use_uld_loss=True, **bad)
    with pytest.raises(ConfigError, match="vllm_sync_frequency=2 is not supported"):
        GOLDConfig(output_dir=str(tmp_path), vllm_sync_frequency=2)


def test_a_dataset_step_is_the_definition_at_the_sampling_temperature(tmp_path, shipped_policy_dir, teacher):
    cfg = gold_config(tmp_path, lmbda=0.0, optim="sgd", learning_rate=1.0, max_grad_norm=1e9, beta=0.3,
                      temperature=0.7, per_device_train_batch_size=8, logprob_chunk_size=5)
    trainer = GOLDTrainer(str(shipped_policy_dir), teacher, cfg, train_dataset=messages_rows(16))
    batch = trainer._make_rollout(0)
    student = trainer.model
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    want = reference_loss(student, teacher, batch.rollout, 0.3, 0.7)  # GKD's would be at 1.0
    grads = torch.autograd.grad(want, list(student.parameters()))
    metrics = trainer.updater.step(batch)
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    assert batch.metrics["gkd/dataset_completions"] == 1.0 and "gold" in student.model_tags
    for (name, p), g in zip(student.named_parameters(), grads):
        assert torch.allclose(before[name] - p.detach(), g.float(), atol=2e-6, rtol=1e-4), name


@pytest.fixture(scope="module")
def other_tokenizer_teacher(tmp_path_factory):
    """A teacher with its own ByteLevel BPE tokenizer (another corpus, another vocabulary size)."""
    from rlft.tiny import build_causal_lm, build_tokenizer, save_tiny

    tokenizer = build_tokenizer(seed=3, vocab_size=300)
    return save_tiny(build_causal_lm(tokenizer, hidden_size=48, num_layers=2, seed=3), tokenizer,
                     tmp_path_factory.mktemp("uld") / "teacher")


def wordy_rows(count: int) -> list[dict]:
    """Completions with words the two tokenizers cut differently (and the answer tags both hold)."""
    tails = ["please think", "the sum is good", "a short answer", "correct, yes"]
    return [{"messages": m["messages"][:-1] + [{"role": "assistant", "content":
                                                 f"{tails[i % 4]} {m['messages'][-1]['content']}"}]}
            for i, m in enumerate(messages_rows(count))]


def chain_rule_merge(logp, tokens, group, strategy):
    varying = group[0] if strategy == "observed" else group[-1]
    factor = torch.ones((), dtype=logp.dtype)
    for j in group:
        if j != varying:
            factor = factor * logp[j, tokens[j]].exp().clamp_min(1e-8)
    return logp[varying].exp() * factor


def boundary_groups(s_text_ends, t_text_ends):
    """Runs of tokens between the byte offsets where both tokenizations end a token."""
    common = sorted(set(s_text_ends) & set(t_text_ends))
    groups = []
    for low, high in zip([0] + common, common):
        groups.append(([i for i, e in enumerate(s_text_ends) if low < e <= high],
                       [i for i, e in enumerate(t_text_ends) if low < e <= high]))
    return groups


def uld_reference(student, teacher, st, tt, rollout, strategy: str, temps):
    """The step's loss from the definitions: per row, the text of the completion, the teacher's tokens of
    it, the groups between shared byte boundaries (the EOS left out on both sides), each group's merged
    distributions, their sorted L1 distance; summed and divided by the step's trained student tokens."""
    total = 0.0
    for r in range(rollout.completion_ids.shape[0]):
        prompt = rollout.prompt_ids[r][rollout.prompt_mask[r].bool()].tolist()
        completion = rollout.completion_ids[r][rollout.completion_mask[r].bool()].tolist()
        body = completion[:-1] if completion[-1] == st.eos_token_id else completion
        text = st.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        t_body = tt(text, add_special_tokens=False)["input_ids"]
        t_prompt = tt(st.decode(prompt, skip_special_tokens=False), add_special_tokens=True)["input_ids"]
        s_ends = [len(st.decode(body[:i + 1], skip_special_tokens=False)) for i in range(len(body))]
        t_ends = [len(tt.decode(t_body[:i + 1], skip_special_tokens=False)) for i in range(len(t_body))]
        assert s_ends[-1] == t_ends[-1] == len(text.encode())  # (ASCII: characters are bytes)
        ids = torch.tensor([prompt + completion])
        lp_s = torch.log_softmax(student(ids).logits[0, len(prompt) - 1:-1].double() / temps[0], -1)
        t_ids = torch.tensor([t_prompt + t_body + [tt.eos_token_id]])
        with torch.no_grad():
            lp_t = torch.log_softmax(teacher(t_ids).logits[0, len(t_prompt) - 1:-1].double() / temps[1], -1)
        for s_group, t_group in boundary_groups(s_ends, t_ends):
            p = chain_rule_merge(lp_s, completion, s_group, strategy)
            q = chain_rule_merge(lp_t, t_body, t_group, strategy)
            a, b = p.sort(descending=True).values, q.sort(descending=True).values
            m = min(len(a), len(b))
            total = total + (a[:m] - b[:m]).abs().sum() + a[m:].sum() + b[m:].sum()
    return total / rollout.loss_mask.sum()


@pytest.mark.parametrize("strategy", ["observed", "bayesian"])
def test_a_cross_tokenizer_uld_step_is_the_definition(tmp_path, shipped_policy_dir, other_tokenizer_teacher,
                                                     strategy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    temps = (1.0, 1.5) if strategy == "observed" else (0.7, 1.0)
    cfg = gold_config(tmp_path, lmbda=0.0, optim="sgd", learning_rate=1.0, max_grad_norm=1e9, max_completion_length=24,
                      per_device_train_batch_size=8, use_uld_loss=True, uld_token_merge_strategy=strategy,
                      uld_student_temperature=temps[0], uld_teacher_temperature=temps[1], logprob_chunk_size=5)
    trainer = GOLDTrainer(str(shipped_policy_dir), str(other_tokenizer_teacher), cfg, train_dataset=wordy_rows(16))
    batch = trainer._make_rollout(0)
    student = trainer.model
    teacher = AutoModelForCausalLM.from_pretrained(other_tokenizer_teacher).eval()
    st, tt = trainer.tokenizer, AutoTokenizer.from_pretrained(other_tokenizer_teacher)
    assert st.tokenize("please think") != tt.tokenize("please think")  # the tokenizers differ here
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    want = uld_reference(student, teacher, st, tt, batch.rollout, strategy, temps)
    grads = torch.autograd.grad(want, list(student.parameters()))
    metrics = trainer.updater.step(batch)
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5) and want.item() > 0.1
    assert "distill/teacher_entropy" not in metrics
    for (name, p), g in zip(student.named_parameters(), grads):
        assert torch.allclose(before[name] - p.detach(), g.float(), atol=2e-6, rtol=1e-4), name


def test_byte_spans_are_exact_for_characters_a_byte_level_tokenizer_splits(tmp_path, shipped_policy_dir,
                                                                           other_tokenizer_teacher):
    from transformers import AutoTokenizer

    from rlft.train.update.cross_tokenizer import CrossTokenizerTeacher

    st, tt = (AutoTokenizer.from_pretrained(p) for p in (shipped_policy_dir, other_tokenizer_teacher))
    text = "café 日本 <answer>12</answer> ok"
    completion = st(text, add_special_tokens=False)["input_ids"] + [st.eos_token_id]
    assert len(st.convert_ids_to_tokens(completion)) > len(text.split())  # multi-byte characters split
    teacher = CrossTokenizerTeacher(None, tt, st, GOLDConfig(output_dir=str(tmp_path), use_uld_loss=True,
                                                             uld_skip_teacher_eos=False), [st.eos_token_id])
    prompt, teacher_ids, s_groups, t_groups = teacher._row(st("2+2=")["input_ids"], completion)
    assert b"".join(teacher.student_bytes(i) for i in completion) == text.encode()
    assert teacher_ids[-1] == tt.eos_token_id and tt.decode(teacher_ids[:-1]) == text
    s_ends = teacher.student_bytes.ends(completion[:-1])  # the student's EOS left out, the teacher's kept
    t_ends = teacher.teacher_bytes.ends(teacher_ids)
    assert [i for g in s_groups for i in g] == list(range(len(completion) - 1))
    assert [i for g in t_groups for i in g] == list(range(len(teacher_ids)))
    for sg, tg in zip(s_groups[:-1], t_groups[:-1]):  # every group but the EOS's ends on one byte
        assert s_ends[sg[-1]] == t_ends[tg[-1]]
    assert s_groups[-1] == [] and t_groups[-1] == [len(teacher_ids) - 1]  # the unpaired EOS: left out
    # the student's text spelling the teacher's special token: the teacher reads it as that token, as wide as
    # its text, and the groups close on each side of it
    pieces = ["o", "k", "Ġ", *"<|im_end|>", "x"]  # (one byte each: every one is in the vocabulary)
    completion = st.convert_tokens_to_ids(pieces) + [st.eos_token_id]
    assert st.unk_token_id not in completion and 0 not in completion
    _, teacher_ids, s_groups, t_groups = teacher._row(st("2+2=")["input_ids"], completion)
    assert tt.eos_token_id in teacher_ids[:-1]  # "<|im_end|>" read as one teacher token, before its own EOS
    at = teacher_ids.index(tt.eos_token_id)
    assert [list(range(3, 13))] == [g for g, h in zip(s_groups, t_groups) if h == [at]]


def test_uld_runs_resume_exactly_and_what_cannot_be_aligned_is_refused(
        tmp_path, shipped_policy_dir, other_tokenizer_teacher):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlft.tiny import build_causal_lm, save_tiny

    def make(name):  # the student's own completions and the dataset's, mixed; 2 + 2 steps resumed equal 4
        cfg = gold_config(tmp_path, output_dir=str(tmp_path / name), max_steps=4, save_steps=2, lmbda=0.5,
                          use_uld_loss=True, uld_use_hybrid_loss=True, uld_crossentropy_weight=0.1)
        return GOLDTrainer(str(shipped_policy_dir), str(other_tokenizer_teacher), cfg, train_dataset=wordy_rows(16))

    resumed_run_equals_straight(make, 4, 2)
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in rows)
    assert {r["gkd/student_completions"] for r in rows} == {0.0, 1.0}
    # a word-level tokenizer has no byte pieces: byte alignment is refused by name, positional ULD runs
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "<pad>": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    plain = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>", pad_token="<pad>")
    folder = save_tiny(build_causal_lm(plain, hidden_size=32, num_layers=1), plain, tmp_path / "words")
    plain.save_pretrained(tmp_path / "words-tokenizer")  # (alone: the model's folder names Qwen2's class)
    named = dict(teacher_tokenizer_name_or_path=str(tmp_path / "words-tokenizer"))
    with pytest.raises(ConfigError, match="not ByteLevel BPE: byte alignment \\(use_extended_uld\\)"):
        GOLDTrainer(str(shipped_policy_dir), str(folder), gold_config(tmp_path, use_uld_loss=True, **named),
                    train_dataset=wordy_rows(8))
    trainer = GOLDTrainer(str(shipped_policy_dir), str(folder),
                          gold_config(tmp_path, output_dir=str(tmp_path / "positional"), use_uld_loss=True, **named, use_extended_uld=False, max_steps=1,
                                      lmbda=0.0), train_dataset=wordy_rows(8))
    assert trainer.updater.step(trainer._make_rollout(0))["loss"] > 0


SCRIPT = '''
"""A TRL GOLD script's shape (examples/scripts/gold.py) with the imports changed."""
from datasets import load_dataset
from transformers import AutoTokenizer, GenerationConfig
from rlft import LogCompletionsCallback, ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config
from rlft.experimental.gold.gold_config import GOLDConfig
from rlft.experimental.gold.gold_trainer import GOLDTrainer

parser = TrlParser((ScriptArguments, GOLDConfig, ModelConfig))
script_args, training_args, model_args = parser.parse_args_and_config()
training_args.model_init_kwargs = dict(revision=model_args.model_revision, attn_implementation=None,
                                       dtype=model_args.dtype, use_cache=False,
                                       quantization_config=get_quantization_config(model_args))
training_args.teacher_model_init_kwargs = dict(revision=training_args.teacher_model_revision,
                                               attn_implementation=None, dtype=model_args.dtype, use_cache=True)
tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
trainer = GOLDTrainer(model=model_args.model_name_or_path, teacher_model=training_args.teacher_model_name_or_path,
                      args=training_args, train_dataset=dataset[script_args.dataset_train_split],
                      eval_dataset=dataset[script_args.dataset_test_split], processing_class=tokenizer,
                      peft_config=get_peft_config(model_args))
trainer.add_callback(LogCompletionsCallback(trainer, GenerationConfig(
    max_new_tokens=training_args.max_completion_length, do_sample=True, temperature=training_args.temperature),
    num_prompts=8))
trainer.train()
trainer.save_model(training_args.output_dir)
'''


def test_a_trl_style_gold_script_trains_and_saves(tmp_path, shipped_policy_dir, other_tokenizer_teacher):
    """TRL's GOLD script with a teacher of another tokenizer (use_uld_loss, hybrid, from the recipe)."""
    rows = [{"prompt": m["messages"][:-1], "completion": m["messages"][-1:]} for m in messages_rows(20)]
    recipe = (f"model_name_or_path: {shipped_policy_dir}\nteacher_model_name_or_path: {other_tokenizer_teacher}\n"
              "use_uld_loss: true\nuld_use_hybrid_loss: true\n"
              "max_steps: 2\nper_device_train_batch_size: 4\nmax_completion_length: 8\n"
              "learning_rate: 2e-4\nuse_peft: true\nlora_r: 4\nlora_alpha: 16\nreport_to: none\n"
              "disable_tqdm: true\nlogging_steps: 1\neval_strategy: steps\neval_steps: 2\n"
              "gradient_checkpointing: false\n")
    run_trl_script(tmp_path, SCRIPT, recipe, rows[:16], rows[16:])
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in logged if "loss" in r]
    assert len(trained) == 2 and all(r["loss"] > 0 and "distill/teacher_entropy" not in r for r in trained)
