"""Self-distillation fine-tuning (SDFTTrainer, TRL's experimental names): the tiled top-k divergence, the
sampled-token loss and the clipped weight are their float64 definitions; a step is the definition's loss and
gradient with the teacher reading the prompt with its privileged context; the base, live and ema teachers are
what they say (LoRA and full); a student equal to its teacher trains at loss 0 without error; resume is exact;
bad input is named."""

from __future__ import annotations

import json
import math

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

from rlft.core.distill import Head
from rlft.core.self_distill import clipped_ratio, sampled_token_loss, sequence_means, topk_divergence
from rlft.errors import ConfigError
from rlft.experimental.sdft import SDFTConfig, SDFTTrainer
from rlft.train.run.checkpoint import latest_checkpoint
from tests.dist.grpo_step import FixedGenerator
from tests.helpers import addition_rows, run_trl_script
from tests.test_core_distill import reference_from_logprobs
from tests.test_grpo_resume import resumed_run_equals_straight


def sdft_rows(count: int = 16, chat: bool = True) -> list[dict]:
    rows = [dict(r, privileged_context=f"The answer is {r['answer']}.") for r in addition_rows(count)]
    if not chat:
        rows = [dict(r, prompt=r["prompt"][-1]["content"]) for r in rows]
    return rows


def config(tmp_path, name="run", **overrides) -> SDFTConfig:
    values = dict(output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=8, logging_steps=1, save_steps=1000, report_to="none", disable_tqdm=True,
                  seed=0, gradient_checkpointing=False, learning_rate=1e-3, distillation_topk=5)
    values.update(overrides)
    return SDFTConfig(**values)


# ---- the core functions against their definitions --------------------------------------------------------
def topk_definition(z_s, z_t, k: int, alpha: float, tail: bool) -> torch.Tensor:
    """SDFT's top-k objective from full logits [N, V]: the student's k most likely tokens, both distributions
    restricted to them and renormalised, or with one more bucket for the rest."""
    ls, lt = torch.log_softmax(z_s, -1), torch.log_softmax(z_t, -1)
    top = ls.detach().topk(k, dim=-1).indices
    a, q = ls.gather(-1, top), lt.gather(-1, top)
    if tail:
        a = torch.cat([a, torch.log1p(-a.exp().sum(-1, keepdim=True))], -1)
        q = torch.cat([q, torch.log1p(-q.exp().sum(-1, keepdim=True))], -1)
    else:
        a, q = a - a.logsumexp(-1, keepdim=True), q - q.logsumexp(-1, keepdim=True)
    return reference_from_logprobs(a, q, alpha)


@pytest.mark.parametrize(("alpha", "tail"), [(0.0, False), (0.5, False), (1.0, True), (0.3, True)])
def test_the_tiled_topk_divergence_is_the_definition_in_float64(alpha, tail):
    g = torch.Generator().manual_seed(0)
    n, h, v, k, temperature, scale = 11, 6, 37, 7, 0.8, 1.3
    hidden_s = torch.randn(n, h, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, generator=g, requires_grad=True)
    hidden_t, weight_t = torch.randn(n, 5, dtype=torch.float64, generator=g), torch.randn(v, 5, dtype=torch.float64,
                                                                                             generator=g)
    got = topk_divergence(hidden_s, hidden_t, Head(weight, bias, scale), Head(weight_t), k, alpha, temperature,
                          tail, tile=4)
    z_s = scale * (hidden_s @ weight.T + bias) / temperature
    want = topk_definition(z_s, hidden_t @ weight_t.T / temperature, k, alpha, tail)
    assert torch.allclose(got.value, want, atol=1e-12, rtol=0)
    ls = torch.log_softmax(z_s, -1)
    assert torch.allclose(got.entropy, -(ls.exp() * ls).sum(-1), atol=1e-12)
    w = torch.randn(n, dtype=torch.float64, generator=g)
    for mine, theirs in zip(torch.autograd.grad((got.value * w).sum(), [hidden_s, weight, bias]),
                            torch.autograd.grad((want * w).sum(), [hidden_s, weight, bias])):
        assert torch.allclose(mine, theirs, atol=1e-12, rtol=0)
    # k = V: the support is the vocabulary, so the top-k objective is the full divergence
    whole = topk_divergence(hidden_s, hidden_t, Head(weight, bias, scale), Head(weight_t), v, alpha, temperature,
                            False, tile=4)
    full = reference_from_logprobs(ls, torch.log_softmax(hidden_t @ weight_t.T / temperature, -1), alpha)
    assert torch.allclose(whole.value, full, atol=1e-12)


def test_the_sampled_token_loss_the_clip_and_the_sequence_mean():
    logps = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[-1.5, -2.0, -0.1]], dtype=torch.float64)
    loss = sampled_token_loss(logps, teacher)
    assert torch.allclose(loss, torch.tensor([[0.5 * -1.0, 0.0, -0.4 * -0.5]], dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss.sum(), logps)  # the reverse KL's score-function gradient
    assert torch.allclose(grad, (logps - teacher).detach())
    old = torch.tensor([[-1.0, -3.0, -0.5 - 30.0]], dtype=torch.float64)
    ratio = clipped_ratio(logps, old, 2.0)
    assert torch.allclose(ratio, torch.tensor([[1.0, min(math.e, 2.0), 2.0]], dtype=torch.float64))
    assert not ratio.requires_grad
    assert clipped_ratio(logps, old, 10.0)[0, 1].item() == pytest.approx(math.e)  # exp(1) under the cap
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert sequence_means(values, mask).tolist() == [1.5, 0.0]


# ---- the trainer -------------------------------------------------------------------------------------------
def reference_loss(trainer, rollout, mode: str, alpha: float, skip: int, k: int) -> torch.Tensor:
    """The definition from [B, T, V] logits (float64 softmaxes): the student reads its prompt, the teacher the
    teacher's prompt, both before the same completion; per row the token mean over the trained tokens after the
    first `skip`, then the mean over rows."""
    def logits(model, prompt_ids, prompt_mask):
        ids = torch.cat([prompt_ids, rollout.completion_ids], 1)
        mask = torch.cat([prompt_mask, rollout.completion_mask], 1)
        width = rollout.completion_ids.shape[1]
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        return out.logits[:, -(width + 1):-1].double() / trainer.args.temperature

    z_s = logits(trainer.model, rollout.prompt_ids, rollout.prompt_mask)
    teacher = trainer.teacher_model
    with torch.no_grad(), teacher.scoring():
        z_t = logits(teacher.module, rollout.teacher_prompt_ids, rollout.teacher_prompt_mask)
    if mode == "sampled_token":
        ls = torch.log_softmax(z_s, -1).gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
        lt = torch.log_softmax(z_t, -1).gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
        per_token = (ls - lt).detach() * ls
    elif mode == "full_logits":
        per_token = reference_from_logprobs(torch.log_softmax(z_s, -1), torch.log_softmax(z_t, -1), alpha)
    else:
        per_token = topk_definition(z_s, z_t, k, alpha, False)
    mask = rollout.loss_mask.double().clone()
    mask[:, :skip] = 0
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


@pytest.mark.parametrize(("mode", "alpha"), [("topk_logits", 0.5), ("sampled_token", 1.0), ("full_logits", 0.0)])
def test_one_step_is_the_definitions_loss_and_gradient(tmp_path, shipped_policy_dir, mode, alpha):
    """SGD at lr 1: the parameter change is the gradient of the definition's loss (reference_loss), the teacher
    (the student as loaded) reading each row's prompt with its privileged context."""
    cfg = config(tmp_path, optim="sgd", learning_rate=1.0, max_grad_norm=1e9, distillation_mode=mode,
                 distillation_alpha=alpha, temperature=0.9, num_loss_tokens_to_skip=1, logprob_chunk_size=5)
    trainer = SDFTTrainer(str(shipped_policy_dir), cfg, train_dataset=sdft_rows(16, chat=mode != "full_logits"))
    trainer.generator = FixedGenerator(trainer.tokenizer)
    batch = trainer._make_rollout(0)
    rollout, tok = batch.rollout, trainer.tokenizer
    for row in (0, 5):  # the teacher's prompt is the template filled in (a chat prompt's last user message)
        text = tok.decode(rollout.teacher_prompt_ids[row][rollout.teacher_prompt_mask[row].bool()])
        assert batch.samples[row]["prompt"] is not None and "\n\nThe answer is " in text
    assert batch.old_logps is None  # one step per rollout: nothing to weight
    student = trainer.model
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    want = reference_loss(trainer, rollout, mode, alpha, 1, 5)
    grads = torch.autograd.grad(want, list(student.parameters()))
    metrics = trainer.updater.step(batch)
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    assert metrics["sdft/distillation_loss"] == metrics["self_distillation/distillation_loss"]
    for (name, p), g in zip(student.named_parameters(), grads):
        assert torch.allclose(before[name] - p.detach(), g.float(), atol=2e-6, rtol=1e-4), name


def test_a_student_equal_to_its_teacher_trains_at_loss_0_without_error(tmp_path, shipped_policy_dir):
    """The live teacher with an empty context reads exactly the student's prompt: the loss is at its minimum (0),
    and the gradient-flow check must not take a zero gradient for a wiring fault."""
    rows = [dict(r, privileged_context="") for r in sdft_rows(16, chat=False)]
    cfg = config(tmp_path, teacher_model_kind="live", teacher_prompt_template="{prompt}{privileged_context}")
    trainer = SDFTTrainer(str(shipped_policy_dir), cfg, train_dataset=rows)
    output = trainer.train()
    # (0 up to rounding: the student's forward runs with autograd on, the teacher's without)
    assert output.global_step == 2 and abs(output.metrics["train_loss"]) < 1e-7


def test_the_base_and_ema_teachers_with_lora_and_full_fine_tuning(tmp_path, shipped_policy_dir):
    """base + LoRA: the model under the adapters (off); ema: the average starts at the student and moves by
    teacher_update_rate at each sync, LoRA's adapter tensors or a full copy's parameters."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    base = SDFTTrainer(str(shipped_policy_dir), config(tmp_path, "base", max_steps=1), train_dataset=sdft_rows(),
                       peft_config=lora)
    base.train()
    peft_model = base.accelerator.unwrap_model(base.model)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), base.teacher_model.scoring():
        teacher_out = base.teacher_model.module(input_ids=ids).logits
    with torch.no_grad(), peft_model.disable_adapter():
        assert torch.equal(teacher_out, peft_model(input_ids=ids).logits)
    assert not torch.equal(teacher_out, peft_model(input_ids=ids).logits)  # the student has moved
    for peft in (lora, None):
        cfg = config(tmp_path, f"ema-{peft is None}", max_steps=2, teacher_model_kind="ema", teacher_update_rate=0.25)
        trainer = SDFTTrainer(str(shipped_policy_dir), cfg, train_dataset=sdft_rows(), peft_config=peft)
        teacher, unwrap = trainer.teacher_model, trainer.accelerator.unwrap_model
        start = {n: p.detach().clone() for n, p in unwrap(trainer.model).named_parameters() if p.requires_grad}
        trainer.total_steps = 1
        trainer.train()
        now = {n: p.detach().clone() for n, p in unwrap(trainer.model).named_parameters() if p.requires_grad}
        average = teacher.average if peft is not None else dict(teacher.module.named_parameters())
        for name, value in start.items():
            assert torch.allclose(average[name], 0.75 * value + 0.25 * now[name], atol=1e-7), name
        assert teacher.syncs == 1 and (peft is None) == (teacher.average is None)


def test_two_plus_two_steps_equal_four_with_an_ema_teacher(tmp_path, shipped_policy_dir):
    def trainer(name):
        cfg = config(tmp_path, name, max_steps=4, save_steps=2, teacher_model_kind="ema", teacher_update_rate=0.3,
                     steps_per_generation=2, gradient_accumulation_steps=1, per_device_train_batch_size=4)
        return SDFTTrainer(str(shipped_policy_dir), cfg, train_dataset=sdft_rows(32))

    straight, resumed = resumed_run_equals_straight(trainer, 4, 2)
    for (name, p), (_, q) in zip(straight.teacher_model.module.named_parameters(),
                                 resumed.teacher_model.module.named_parameters()):
        assert torch.equal(p, q), name
    assert latest_checkpoint(tmp_path / "split").name == "checkpoint-4"


def test_a_reused_rollout_is_weighted_and_one_sampled_from_the_teachers_prompt_is_not(tmp_path,
                                                                                      shipped_policy_dir):
    """steps_per_generation 2: the rollout's second step weights each token by its clipped ratio to the sampling
    policy (old log-probs kept); generate_from_teacher samples after the teacher's prompt and keeps none (TRL).
    TRL's self-distillation callback events report both, once per rollout."""
    seen = []

    class Capture(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_generation_prompts_selected(self, generation_prompts=None, **kwargs):
            self.events.append(("prompts", generation_prompts[0]))

        def on_self_distillation_batch_prepared(self, old_per_token_logps=None, teacher_input_ids=None, **kwargs):
            self.events.append(("prepared", old_per_token_logps is not None, teacher_input_ids.shape[0]))

        def on_generation_batch_built(self, steps_per_generation=None, **kwargs):
            self.events.append(("built", steps_per_generation))

    class Recording(FixedGenerator):
        def __call__(self, model, prompt_ids, num_generations, greedy=False):
            seen.append(prompt_ids)
            return super().__call__(model, prompt_ids, num_generations, greedy)

    for from_teacher in (False, True):
        cfg = config(tmp_path, f"t{from_teacher}", steps_per_generation=2, per_device_train_batch_size=4,
                     generate_from_teacher=from_teacher)
        capture = Capture()
        trainer = SDFTTrainer(str(shipped_policy_dir), cfg, train_dataset=sdft_rows(), callbacks=[capture])
        trainer.generator = Recording(trainer.tokenizer)
        batch = trainer._make_rollout(0)
        assert (batch.old_logps is None) == from_teacher
        prompt = capture.events[0][1][-1]["content"]
        assert capture.events[1:] == [("prepared", not from_teacher, 8), ("built", 2)]
        assert ("The answer is" in prompt) == from_teacher
        prompt = trainer.tokenizer.decode(seen[-1][0])
        assert ("The answer is" in prompt) == from_teacher
        student = trainer.tokenizer.decode(batch.rollout.prompt_ids[0][batch.rollout.prompt_mask[0].bool()])
        assert "The answer is" not in student
    capture.events.clear()
    assert trainer.train().global_step == 2
    assert [e[0] for e in capture.events] == ["prompts", "prepared", "built"]  # one rollout for the 2 steps


def test_bad_datasets_and_settings_are_named(tmp_path, shipped_policy_dir):
    """Every training row's teacher prompt is built and measured when train() starts, before any step."""
    rows = sdft_rows(8)
    with pytest.raises(ValueError, match="no 'privileged_context' column"):
        SDFTTrainer(str(shipped_policy_dir), config(tmp_path), train_dataset=addition_rows(8)).train()
    rows[3] = dict(rows[3], privileged_context=None)
    with pytest.raises(ValueError, match="row 3: `privileged_context` must not be None"):
        SDFTTrainer(str(shipped_policy_dir), config(tmp_path), train_dataset=rows).train()
    rows = sdft_rows(8)
    rows[2] = dict(rows[2], prompt=rows[2]["prompt"] + [{"role": "assistant", "content": "Sure"}])
    with pytest.raises(ValueError, match="row 2: the prompt ends with a 'assistant' message"):
        SDFTTrainer(str(shipped_policy_dir), config(tmp_path), train_dataset=rows).train()
    rows = sdft_rows(8)
    rows[5] = dict(rows[5], privileged_context="word " * 600)
    with pytest.raises(ValueError, match="row 5: the teacher's prompt .* over max_prompt_length=512"):
        SDFTTrainer(str(shipped_policy_dir), config(tmp_path), train_dataset=rows).train()
    for overrides, message in (
            ({"distillation_mode": "sampled_token"}, "estimates the reverse KL only"),
            ({"teacher_prompt_template": "{prompt} {answer}"}, "must hold {privileged_context}"),
            ({"teacher_prompt_template": "{prompt} { {privileged_context}"}, "write a literal brace as"),
            ({"teacher_model_name_or_path": "x"}, "SDFT's teacher is the student itself"),
            ({"use_teacher_server": True}, "use_teacher_server=True is not supported"),
            ({"beta": 0.5}, "the divergence's mix is distillation_alpha"),
            ({"teacher_model_kind": "frozen"}, "teacher_model_kind='frozen'")):
        with pytest.raises(ConfigError, match=message):
            config(tmp_path, **overrides)


SCRIPT = '''
"""A TRL SDFT script's shape (examples/scripts/sdft.py: its imports, parser, data preparation, the
trainer's attributes it reads, an evaluation of its own around train()) with the imports changed."""
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlft import (LogCompletionsCallback, ModelConfig, ScriptArguments, TrlParser, get_peft_config,
                  get_quantization_config)
from rlft.data_utils import maybe_apply_chat_template
from rlft.experimental.sdft import SDFTConfig, SDFTTrainer
from rlft.models import unwrap_model_for_generation

parser = TrlParser((ScriptArguments, SDFTConfig, ModelConfig))
script_args, training_args, model_args = parser.parse_args_and_config()
assert get_quantization_config(model_args) is None
tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
dataset = load_dataset(script_args.dataset_name)
split = lambda name: dataset[name].map(  # noqa: E731
    lambda row: {"prompt": row["prompt"], "privileged_context": "Example response: " + row["golden_response"]},
    remove_columns=dataset[name].column_names)
train, test = split(script_args.dataset_train_split), split(script_args.dataset_test_split)
model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
trainer = SDFTTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=test,
                      processing_class=tokenizer, peft_config=get_peft_config(model_args))
trainer.add_callback(LogCompletionsCallback(trainer, GenerationConfig(max_new_tokens=4), num_prompts=2))

def own_eval(prefix):
    texts = [maybe_apply_chat_template({"prompt": p}, trainer.processing_class)["prompt"] for p in test["prompt"]]
    batch = trainer.processing_class(text=texts, return_tensors="pt", padding=True, truncation=True,
                                     max_length=trainer.max_prompt_length, add_special_tokens=False)
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped, torch.no_grad():
        out = unwrapped.generate(**batch, max_new_tokens=4, do_sample=False,
                                 pad_token_id=trainer.processing_class.pad_token_id)
    metrics = {f"{prefix}/length": float(out.shape[1] - batch["input_ids"].shape[1])}
    trainer.log(metrics)
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)

own_eval("tool_eval_before")
trainer.train()
trainer.save_model(training_args.output_dir)
metrics = trainer.evaluate()
trainer.log_metrics("eval", metrics)
own_eval("tool_eval_after")
print("EVAL", sorted(metrics))
'''


def test_a_trl_style_sdft_script_trains_evaluates_and_saves(tmp_path, shipped_policy_dir):
    rows = [{"prompt": r["prompt"], "golden_response": f"<answer>{r['answer']}</answer>"} for r in addition_rows(20)]
    recipe = (f"model_name_or_path: {shipped_policy_dir}\nmax_steps: 2\n"
              "per_device_train_batch_size: 4\nnum_generations: 4\nmax_completion_length: 8\n"
              "teacher_model_kind: ema\nteacher_update_rate: 0.01\nuse_peft: true\nlora_r: 4\n"
              "report_to: none\ndisable_tqdm: true\nlogging_steps: 1\neval_strategy: steps\neval_steps: 2\n"
              "gradient_checkpointing: false\n")
    result = run_trl_script(tmp_path, SCRIPT, recipe, rows[:16], rows[16:])
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
    assert "'eval_loss'" in result.stdout
    history = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert "tool_eval_after/length" in history


def test_a_student_given_with_its_own_adapter_is_warned_about(tmp_path, shipped_policy_dir, caplog):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(shipped_policy_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    with caplog.at_level("WARNING", logger="rlft"):
        trainer = SDFTTrainer(model, config(tmp_path), train_dataset=sdft_rows(8))
    assert "already contains a PEFT adapter: `teacher_model_kind='base'` may refer to the underlying base" in \
        caplog.text and trainer.teacher_model.kind == "base"


def test_trls_loss_utils_on_whole_logits_are_the_definitions():
    """rlft.experimental.sdft.loss_utils (TRL's names, for [B, T, V] logits a caller holds)."""
    from rlft.experimental.sdft.loss_utils import (
        add_tail_bucket,
        apply_importance_sampling_clipping,
        compute_full_logit_self_distillation_loss,
        compute_sampled_token_self_distillation_loss,
        compute_topk_self_distillation_loss,
    )

    g = torch.Generator().manual_seed(3)
    z_s, z_t = torch.randn(2, 3, 9, generator=g, dtype=torch.float64), torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    got = compute_topk_self_distillation_loss(z_s, z_t, distillation_topk=4, distillation_alpha=0.5,
                                              distillation_add_tail=True)
    assert torch.allclose(got, topk_definition(z_s.reshape(6, 9), z_t.reshape(6, 9), 4, 0.5, True).reshape(2, 3))
    full = compute_full_logit_self_distillation_loss(z_s, z_t, distillation_alpha=0.0)
    assert torch.allclose(full, reference_from_logprobs(torch.log_softmax(z_s, -1), torch.log_softmax(z_t, -1), 0.0))
    ids = torch.randint(0, 9, (2, 3), generator=g)
    sampled = compute_sampled_token_self_distillation_loss(z_s, z_t, ids, distillation_alpha=1.0)
    ls = torch.log_softmax(z_s, -1).gather(-1, ids[..., None]).squeeze(-1)
    lt = torch.log_softmax(z_t, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(sampled, (ls - lt) * ls)
    with pytest.raises(ValueError, match="reverse KL only"):
        compute_sampled_token_self_distillation_loss(z_s, z_t, ids, distillation_alpha=0.5)
    top = torch.log_softmax(z_s, -1).topk(4, -1).values
    assert torch.allclose(add_tail_bucket(top).exp().sum(-1), torch.ones(2, 3, dtype=torch.float64))
    assert torch.allclose(apply_importance_sampling_clipping(sampled, ls, ls - 1.0, 2.0), sampled * 2.0)
