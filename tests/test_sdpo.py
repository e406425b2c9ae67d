"""SDPO (SDPOTrainer, TRL's experimental names): each completion's teacher prompt is built from its group's
successes (and feedback) by TRL's rule; a step's loss and gradient are the float64 definition of
(1 - w) x GRPO's policy loss + w x the self-distillation sequence mean over the reprompted rows; a step with
nothing reprompted trains without a gradient-flow error; resume is exact; bad settings are named."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from rlft.errors import ConfigError
from rlft.experimental.sdpo import SDPOConfig, SDPOTrainer
from rlft.train.sdpo import demonstrations
from tests.dist.grpo_step import FixedGenerator
from tests.helpers import addition_rows
from tests.test_grpo_resume import resumed_run_equals_straight


def even_length(completions, **kwargs):
    """1 for a completion of an even number of characters, else 0: successes in most groups."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t) % 2 == 0) for t in texts]


def config(tmp_path, name="run", **overrides) -> SDPOConfig:
    values = dict(output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=8, logging_steps=1, save_steps=1000, report_to="none", disable_tqdm=True,
                  seed=0, gradient_checkpointing=False, learning_rate=1e-3)
    values.update(overrides)
    return SDPOConfig(**values)


def test_trls_defaults_and_the_demonstration_rule(tmp_path):
    cfg = SDPOConfig(output_dir=str(tmp_path))
    assert (cfg.distillation_weight, cfg.distillation_alpha, cfg.distillation_mode, cfg.distillation_topk,
            cfg.teacher_model_kind, cfg.learning_rate, cfg.beta, cfg.loss_type, cfg.success_reward_threshold,
            cfg.max_reprompt_len) == (1.0, 1.0, "sampled_token", None, "ema", 5e-5, 0.0, "dapo", 1.0, 10240)
    totals = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 2.0])
    assert demonstrations(totals, 4, 1.0, True) == [1, 2, 1, 1, 7, 7, 7, None]
    assert demonstrations(totals, 4, 1.0, False) == [1, 1, 1, 1, 7, 7, 7, 7]


def test_each_rows_teacher_prompt_is_trls_reprompt(tmp_path, shipped_policy_dir):
    rows = [dict(r, privileged_context="too long") for r in addition_rows(16)]
    cfg = config(tmp_path, include_environment_feedback=True, environment_feedback_only_without_solution=True)
    trainer = SDPOTrainer(str(shipped_policy_dir), even_length, cfg, train_dataset=rows)
    trainer.generator = FixedGenerator(trainer.tokenizer)
    batch = trainer._make_rollout(0)
    rollout, tok = batch.rollout, trainer.tokenizer
    rewards = [s["reward"] for s in batch.samples]
    for row in range(8):
        teacher = tok.decode(rollout.teacher_prompt_ids[row][rollout.teacher_prompt_mask[row].bool()])
        group = range(row - row % 4, row - row % 4 + 4)
        sibling = next((j for j in group if j != row and rewards[j] >= 1.0), None)
        question = batch.samples[row]["prompt"][-1]["content"]
        if sibling is None:  # feedback alone, shown only where no sibling succeeded
            assert "feedback from your unsuccessful earlier attempt:\n\ntoo long" in teacher
            assert "Correct solution" not in teacher
        else:
            demo = tok.decode(rollout.completion_ids[sibling][rollout.completion_mask[sibling].bool()],
                              skip_special_tokens=True)
            assert f"{question}\nCorrect solution:\n\n{demo}\n\n\n\nCorrectly solve the original question.\n" in teacher
        assert rollout.teacher_rows[row] == 1.0
    assert batch.metrics["self_distillation/feedback_used_fraction"] < 1.0
    assert 0 < batch.metrics["self_distillation/success_sample_fraction"] < 1.0


@pytest.mark.parametrize("weight", [1.0, 0.4])
def test_one_step_is_the_definitions_loss_and_gradient(tmp_path, shipped_policy_dir, weight):
    """SGD at lr 1: the change is the gradient of (1 - w) x the dapo policy loss (ratio 1: -sum A_i over tokens /
    the step's tokens) + w x the mean over all rows of each reprompted row's token mean of the sampled-token
    loss, its teacher (the student as loaded here) reading the reprompt."""
    cfg = config(tmp_path, optim="sgd", learning_rate=1.0, max_grad_norm=1e9, distillation_weight=weight,
                 teacher_model_kind="base", temperature=0.9)
    trainer = SDPOTrainer(str(shipped_policy_dir), even_length, cfg, train_dataset=addition_rows(16))
    trainer.generator = FixedGenerator(trainer.tokenizer)
    batch = trainer._make_rollout(0)
    rollout = batch.rollout
    taught = rollout.teacher_rows.double()
    assert 0 < taught.sum() < len(taught)  # some rows reprompted, some not

    def logps(model, prompt_ids, prompt_mask):
        ids = torch.cat([prompt_ids, rollout.completion_ids], 1)
        mask = torch.cat([prompt_mask, rollout.completion_mask], 1)
        width = rollout.completion_ids.shape[1]
        z = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        return torch.log_softmax(z[:, -(width + 1):-1].double() / 0.9, -1).gather(
            -1, rollout.completion_ids[..., None]).squeeze(-1)

    student = trainer.model
    ls = logps(student, rollout.prompt_ids, rollout.prompt_mask)
    with torch.no_grad():
        lt = logps(trainer.teacher_model.module, rollout.teacher_prompt_ids, rollout.teacher_prompt_mask)
    mask = rollout.loss_mask.double()
    policy = -(batch.advantages.double()[:, None] * torch.exp(ls - ls.detach()) * mask).sum() / mask.sum()
    per_row = (((ls - lt).detach() * ls * mask).sum(-1) / mask.sum(-1).clamp(min=1)) * taught
    want = (1 - weight) * policy + weight * per_row.mean()
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    grads = torch.autograd.grad(want, list(student.parameters()))
    metrics = trainer.updater.step(batch)
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    assert metrics["distill_loss"] == pytest.approx(weight * per_row.mean().item(), rel=1e-5, abs=1e-7)
    for (name, p), g in zip(student.named_parameters(), grads):
        assert torch.allclose(before[name] - p.detach(), g.float(), atol=2e-6, rtol=1e-4), name


def test_a_rollout_with_no_success_trains_and_two_plus_two_steps_equal_four(tmp_path, shipped_policy_dir, caplog):
    """No completion reaches the threshold: nothing is reprompted, the w = 1 loss is 0, the gradient-flow check
    must not call that a fault, and TRL's diagnostics say so at the first such rollout; an ema teacher's run
    resumes exactly."""
    def trainer(name):
        cfg = config(tmp_path, name, max_steps=4, save_steps=2, teacher_update_rate=0.3)
        return SDPOTrainer(str(shipped_policy_dir), even_length, cfg, train_dataset=addition_rows(32))

    quiet = SDPOTrainer(str(shipped_policy_dir), even_length,
                        config(tmp_path, "quiet", success_reward_threshold=5.0), train_dataset=addition_rows(16))
    with caplog.at_level("WARNING", logger="rlft"):
        assert quiet.train().metrics["train_loss"] == 0.0
    assert "SDPO self-distillation is inactive because no reprompted samples were constructed" in caplog.text
    assert "SDPO did not find any successful rollouts" in caplog.text
    assert {"self_distillation/reward_std", "self_distillation/flat_group_fraction"} <= set(
        quiet.state.log_history[0])
    straight, resumed = resumed_run_equals_straight(trainer, 4, 2)
    for (name, p), (_, q) in zip(straight.teacher_model.module.named_parameters(),
                                 resumed.teacher_model.module.named_parameters()):
        assert torch.equal(p, q), name


def test_bad_settings_are_named(tmp_path, shipped_policy_dir):
    with pytest.raises(ConfigError, match="SDPOTrainer needs reward_funcs"):
        SDPOTrainer(str(shipped_policy_dir), None, config(tmp_path), train_dataset=addition_rows(8))
    for overrides, message in (({"distillation_mode": "full_logits", "distillation_alpha": 0.5,
                                 "entropy_coef": 0.01}, "an entropy bonus is not combined"),
                               ({"distillation_alpha": 0.5}, "estimates the reverse KL only"),
                               ({"distillation_mode": "topk_logits"}, "needs distillation_topk >= 1"),
                               ({"distillation_weight": 1.5}, r"distillation_weight=1.5 must be in \[0, 1\]"),
                               ({"reprompt_template": "{prompt}{answer}"}, r"may hold only \{feedback\}, \{prompt\}"),
                               ({"feedback_template": "{"}, "write a literal brace as")):
        with pytest.raises(ConfigError, match=message):
            config(tmp_path, **overrides)


def test_evaluation_reprompts_its_own_groups_and_reports_both_terms(tmp_path, shipped_policy_dir):
    """evaluate(): num_generations_eval completions per prompt, scored, then reprompted within their own groups
    (TRL's callback event reports the teacher prompts); eval_loss is the objective on them."""
    class Capture(TrainerCallback):
        texts: list = []

        def on_teacher_context_built(self, processing_class=None, teacher_input_ids=None, **kwargs):
            self.texts += [processing_class.decode(ids, skip_special_tokens=True) for ids in teacher_input_ids]

    def alpha_succeeds(prompts, **kwargs):
        return [float("Alpha" in p) for p in prompts]

    prompts = [{"prompt": f"{name} prompt: what is 2+2?"} for name in ("Alpha", "Beta", "Gamma")]
    cfg = config(tmp_path, num_generations_eval=2, success_reward_threshold=0.5, dont_reprompt_on_self_success=False)
    capture = Capture()
    trainer = SDPOTrainer(str(shipped_policy_dir), alpha_succeeds, cfg, train_dataset=addition_rows(8),
                          eval_dataset=prompts, callbacks=[capture])
    metrics = trainer.evaluate()
    alpha = [t for t in capture.texts if "Alpha" in t]
    assert len(alpha) == 2 and all("Correct solution:" in t for t in alpha)
    assert all("Correct solution:" not in t for t in capture.texts if "Alpha" not in t)
    assert metrics["eval_loss"] != 0.0 and metrics["eval_reward"] == pytest.approx(1 / 3)
