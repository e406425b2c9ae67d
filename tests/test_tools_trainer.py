"""GRPOTrainer with tools, environment_factory and rollout_func (TRL's names), driven by a scripted policy."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from rlft import GRPOTrainer
from rlft.config import ConfigError
from rlft.data.prompts import DatasetError
from tests.helpers import addition_rows, tiny_grpo_config
from tests.tools_helpers import Scripted, add, call


def numbers(context):
    import re

    a, b = re.search(r"What is (\d+)\+(\d+)\?", context).groups()
    return int(a), int(b)


def calculator_script(context, turn):
    """Even sums: call the tool then answer with its result; odd sums: answer at once, wrongly."""
    a, b = numbers(context)
    if (a + b) % 2:
        return f"<answer>{a + b + 1}</answer>"
    return call("add", a=a, b=b) if turn == 0 else f"<answer>{a + b}</answer>"


def right(completions, answer, **kwargs):
    return [float(c[-1]["content"] == f"<answer>{a}</answer>") for c, a in zip(completions, answer)]


def alternating(completions, **kwargs):
    """Different rewards within each group of identical scripted completions: non-zero advantages."""
    return [float(i % 2) + 0.5 * float("tool_calls" in c[0]) for i, c in enumerate(completions)]


def scripted(trainer, script=calculator_script):
    trainer.generator.engine = Scripted(trainer.processing_class, script)
    return trainer


def test_tools_run_and_tool_output_is_not_trained(tmp_path, tiny_tool_dir):
    """One SGD step at lr 1 moves the weights by exactly minus the DAPO gradient over the policy's own tokens."""
    model = AutoModelForCausalLM.from_pretrained(tiny_tool_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = tiny_grpo_config(tmp_path, max_completion_length=96, max_grad_norm=1e9, num_generations=2,
                           per_device_train_batch_size=8)
    first_turns = iter(range(10**6))

    def mixed(context, turn):  # within a group, one completion calls the tool and one answers at once
        a, b = numbers(context)
        if turn == 0:
            return call("add", a=a, b=b) if next(first_turns) % 2 else f"<answer>{a + b + 1}</answer>"
        return f"<answer>{a + b}</answer>"

    trainer = scripted(GRPOTrainer(model, [alternating], cfg, train_dataset=addition_rows(16), tools=[add],
                                   optimizers=(optimizer, None)), mixed)
    batch = trainer._make_rollout(0)
    rollout = batch.rollout
    assert batch.metrics["tools/call_frequency"] == pytest.approx(float(rollout.stats["tool_calls"].mean()))
    assert 0 < batch.metrics["tools/call_frequency"] < 1 and batch.metrics["tools/failure_frequency"] == 0.0
    assert (rollout.tool_mask * rollout.completion_mask).sum() < rollout.completion_mask.sum()  # tool tokens exist
    assert batch.metrics["completions/mean_length"] == pytest.approx(rollout.loss_mask.sum(1).float().mean().item())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    expected = {}
    for right_mask, mask in ((True, rollout.loss_mask), (False, rollout.completion_mask)):  # and one training tool output
        model.zero_grad()
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
        attention = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
        logits = model(input_ids=ids, attention_mask=attention,
                       position_ids=(attention.cumsum(-1) - 1).clamp(min=0)).logits
        width = rollout.completion_ids.shape[1]
        logps = torch.log_softmax(logits[:, -width - 1:-1].float(), -1).gather(2, rollout.completion_ids[..., None])[..., 0]
        loss = -(batch.advantages[:, None] * torch.exp(logps - logps.detach()) * mask).sum() / mask.sum()
        loss.backward()
        expected[right_mask] = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    trainer.updater.step(batch)
    for name, param in model.named_parameters():
        torch.testing.assert_close(before[name] - param.detach(), expected[True][name], atol=2e-6, rtol=1e-4)
    gap = max((expected[True][n] - expected[False][n]).abs().max().item() for n in expected[True])
    assert gap > 1e-4, gap  # the test can tell them apart
    assert batch.advantages.abs().min() > 0


def test_environment_factory_resets_per_row_and_owns_a_reward(tmp_path, tiny_tool_dir):
    made, seen = [], {}

    class Counter:
        def __init__(self):
            made.append(self)
            self.total = None

        def reset(self, prompt, answer, **row):
            self.total, self.answer = 0, int(answer)
            return " Count with increment."

        def increment(self, by: int) -> int:
            """Add to the counter.

            Args:
                by: How much to add.
            """
            self.total += by
            return self.total

        def get_reward(self) -> float:
            return float(self.total == self.answer)

    def script(context, turn):
        assert "Count with increment." in context and "increment(by)" in context
        a, b = numbers(context)
        return call("increment", by=a + b if a % 2 else a) if turn == 0 else "<answer>done</answer>"

    def sees_environments(completions, environments, **kwargs):
        seen["environments"] = environments
        return [0.0] * len(completions)

    cfg = tiny_grpo_config(tmp_path, max_completion_length=96, num_generations=2, per_device_train_batch_size=8,
                           max_steps=1)
    trainer = scripted(GRPOTrainer(tiny_tool_dir, [sees_environments], cfg, train_dataset=addition_rows(16),
                                   environment_factory=Counter), script)
    assert trainer.reward_names == ["sees_environments", "Counter"] and trainer.reward_weights.tolist() == [1.0, 1.0]
    batch = trainer._make_rollout(0)
    assert len(made) == 8 and seen["environments"] == made  # one environment per completion, each its own state
    odd = [int(s["prompt"][0]["content"].split()[2].split("+")[0]) % 2 for s in batch.samples]
    assert [s["Counter"] for s in batch.samples] == [float(o) for o in odd]
    assert batch.metrics["rewards/Counter/mean"] == pytest.approx(sum(odd) / len(odd))
    trainer.train()  # the pool is reused: no new instances
    assert len(made) == 8


def test_rollout_func_replaces_generation(tmp_path, tiny_tool_dir):
    def rollout_func(prompts, trainer):
        tok = trainer.processing_class
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "tag": []}
        for prompt in prompts:
            ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
            for g in range(trainer.args.num_generations):
                completion = tok(f"<answer>{g}</answer> ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                out["prompt_ids"].append(ids)
                out["completion_ids"].append(completion)
                out["logprobs"].append([-1.0] * len(completion))
                out["env_mask"].append([1] * (len(completion) - 2) + [0, 0])
                out["tag"].append(g)
        return out

    def by_tag(completions, tag, **kwargs):
        return [float(t) for t in tag]

    cfg = tiny_grpo_config(tmp_path, max_steps=1, num_generations=4)
    trainer = GRPOTrainer(tiny_tool_dir, [by_tag], cfg, train_dataset=addition_rows(16), rollout_func=rollout_func)
    batch = trainer._make_rollout(0)
    assert batch.metrics["reward"] == pytest.approx(1.5)
    rollout = batch.rollout
    assert rollout.loss_mask.sum(1).tolist() == (rollout.completion_mask.sum(1) - 2).tolist()
    assert rollout.sampling_logps[rollout.completion_mask.bool()].eq(-1.0).all()
    assert [s["completion"][0]["content"] for s in batch.samples[:2]] == ["<answer>0</answer> ok",
                                                                          "<answer>1</answer> ok"]
    trainer.train()
    step = trainer.state.log_history[0]
    assert step["grad_norm"] > 0 and step["reward"] == pytest.approx(1.5)


@pytest.mark.parametrize("change, message", [
    (lambda o: o.pop("logprobs"), r"lacks \['logprobs'\]"),
    (lambda o: o["completion_ids"].pop(), "'completion_ids' must be a list of 8 rows"),
    (lambda o: o["logprobs"][3].append(0.0), "'logprobs' row 3 has"),
    (lambda o: (o["completion_ids"].__setitem__(0, list(range(30))), o.__setitem__("logprobs", None)),
     "completion row 0 has 30 tokens"),
])
def test_rollout_func_output_is_checked(tmp_path, tiny_tool_dir, change, message):
    def rollout_func(prompts, trainer):
        out = {"prompt_ids": [[1, 2]] * 8, "completion_ids": [[3, 4]] * 8, "logprobs": [[0.0, 0.0]] * 8}
        out = {k: [list(r) for r in v] for k, v in out.items()}
        change(out)
        return out

    trainer = GRPOTrainer(tiny_tool_dir, [lambda completions, **k: [0.0] * len(completions)],
                          tiny_grpo_config(tmp_path), train_dataset=addition_rows(16), rollout_func=rollout_func)
    with pytest.raises(ConfigError, match=message):
        trainer._make_rollout(0)


def test_setup_errors_name_the_fix(tmp_path, tiny_tool_dir, tiny_causal_dir):
    rows, cfg = addition_rows(16), tiny_grpo_config(tmp_path)
    with pytest.raises(ConfigError, match="chat template that renders the assistant's tool_calls"):
        GRPOTrainer(tiny_causal_dir, [right], cfg, train_dataset=rows, tools=[add])
    with pytest.raises(DatasetError, match="need chat prompts"):
        GRPOTrainer(tiny_tool_dir, [right], cfg, train_dataset=[{"prompt": "1+1?", "answer": "2"}] * 16, tools=[add])
    with pytest.raises(ConfigError, match="pass rollout_func alone"):
        GRPOTrainer(tiny_tool_dir, [right], cfg, train_dataset=rows, tools=[add], rollout_func=lambda p, t: {})
    with pytest.raises(ConfigError, match="has no reset"):
        GRPOTrainer(tiny_tool_dir, [right], cfg, train_dataset=rows, environment_factory=object)
    with pytest.raises(ConfigError, match="tools entry 'nowhere:add' could not be imported"):
        GRPOTrainer(tiny_tool_dir, [right], tiny_grpo_config(tmp_path, tools=["nowhere:add"]), train_dataset=rows)


def test_config_names_tools_by_import_path(tmp_path, tiny_tool_dir):
    cfg = tiny_grpo_config(tmp_path, tools=["rlft.data.calculator:add"], max_completion_length=96,
                           max_tool_calling_iterations=1, num_generations=2, max_steps=1)
    trainer = scripted(GRPOTrainer(tiny_tool_dir, [right], cfg, train_dataset=addition_rows(16)))
    assert trainer.generator.max_iterations == 1 and list(trainer.generator.toolset.functions) == ["add"]
    trainer.train()
    assert trainer.state.log_history[0]["tools/call_frequency"] > 0


def test_short_real_run_with_tools_lora_and_two_rewards_checkpoints_and_resumes(tmp_path):
    """The shipped tiny-calculator generating for real (transformers generate, per turn), LoRA, two rewards,
    a checkpoint taken mid-rollout (the tool mask is saved with the rollout) and a resume that ends where an
    uninterrupted run ends."""
    from rlft.data.calculator import TOOLS, answer_reward, tool_use_reward
    from rlft.model.loading import shipped_policy_path

    def run(out, steps, resume=None):
        cfg = tiny_grpo_config(out, max_steps=steps, num_generations=4,
                               per_device_train_batch_size=8, steps_per_generation=2, max_completion_length=64,
                               temperature=0.7, reward_weights=[1.0, 0.2], save_steps=1, learning_rate=5e-4)
        trainer = GRPOTrainer(str(shipped_policy_path("tiny-calculator")), [answer_reward, tool_use_reward], cfg,
                              train_dataset=addition_rows(32), tools=TOOLS,
                              peft_config=LoraConfig(r=4, lora_dropout=0.0, target_modules="all-linear"))
        trainer.train(resume_from_checkpoint=resume)
        return trainer, trainer.state.log_history

    trainer, history = run(tmp_path / "a", 3)
    assert history[0]["tools/call_frequency"] > 0.5 and history[0]["tools/turns_mean"] > 1.5
    assert max(h.get("grad_norm", 0) for h in history) > 0 and "rewards/tool_use_reward/mean" in history[0]
    assert trainer._make_rollout(0).samples[0]["completion"][1]["role"] == "tool"
    run(tmp_path / "b", 3)  # the same run again, then resumed from its step-1 checkpoint (mid-rollout)
    _, history_b = run(tmp_path / "b", 3, resume=str(tmp_path / "b" / "run" / "checkpoint-1"))
    last = lambda h: [r for r in h if "loss" in r][-1]  # noqa: E731
    assert last(history_b)["loss"] == pytest.approx(last(history)["loss"], abs=1e-6)


class Lamp:
    def reset(self, **row):
        self.on = False
        return " Use the lamp."

    def switch(self, on: bool) -> str:
        """Switch the lamp.

        Args:
            on: Whether the lamp should be on.
        """
        self.on = on
        return "ok"

    def get_reward(self) -> float:
        return float(self.on)


class Door:
    def reset(self, **row):
        assert "environment" not in row  # it routes the row; reset gets the dataset's columns (TRL's rule)
        return None

    def knock(self, times: int) -> str:
        """Knock on the door.

        Args:
            times: How many times.
        """
        return "who is there?"


def test_a_dict_of_environments_routes_each_row_by_its_environment_column(tmp_path, tiny_tool_dir):
    """TRL's multi-environment form: each row's `environment` picks its environment; its prompt lists only that
    environment's tools; an environment that owns a reward scores its own rows (None for the others)."""
    def script(context, turn):
        if "Use the lamp." in context:
            assert "switch" in context and "knock" not in context
            return call("switch", on=True) if turn == 0 else "<answer>1</answer>"
        assert "knock" in context and "switch" not in context
        return "<answer>2</answer>"

    rows = [{**row, "environment": "lamp" if i % 2 else "door"} for i, row in enumerate(addition_rows(16))]
    cfg = tiny_grpo_config(tmp_path, max_completion_length=96, num_generations=2, per_device_train_batch_size=8,
                           max_steps=1)
    trainer = scripted(GRPOTrainer(tiny_tool_dir, [lambda completions, **k: [0.0] * len(completions)], cfg,
                                   train_dataset=rows, environment_factory={"lamp": Lamp, "door": Door}), script)
    assert trainer.reward_names[-1] == "Lamp"
    # TRL's attributes: every environment's tools once (get_reward and reset are not tools), and each one's own
    assert sorted(t.__name__ for t in trainer.tools) == ["knock", "switch"]
    assert {k: [t.__name__ for t in v] for k, v in trainer._env_tools.items()} == {"lamp": ["switch"],
                                                                                   "door": ["knock"]}
    batch = trainer._make_rollout(0)
    lamp_rewards = [s["Lamp"] for s in batch.samples]
    kinds = [type(env).__name__ for env in batch.rollout.extra["environments"]]
    assert sorted(set(kinds)) == ["Door", "Lamp"]
    assert all((r == 1.0) if k == "Lamp" else math.isnan(r) for r, k in zip(lamp_rewards, kinds))
    with pytest.raises(ConfigError, match=r"row \d+ has environment='attic', which is not among"):
        trainer.source.generate({**trainer.train_prompts.batch([0]), "environment": ["attic"]}, 2)


def test_a_single_environment_without_a_dataset_supplies_the_prompts(tmp_path, tiny_tool_dir):
    class Puzzle:
        def reset(self, **row):
            return "What is 2+2?"

        def get_reward(self) -> float:
            return 1.0

    cfg = tiny_grpo_config(tmp_path, max_completion_length=96, num_generations=2, per_device_train_batch_size=4,
                           max_steps=2)
    trainer = scripted(GRPOTrainer(tiny_tool_dir, None, cfg, environment_factory=Puzzle),
                       lambda context, turn: "<answer>4</answer>" if "What is 2+2?" in context else "?")
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.state.log_history[0]["rewards/Puzzle/mean"] == 1.0
    with pytest.raises(ConfigError, match="set max_steps > 0"):
        GRPOTrainer(tiny_tool_dir, None, tiny_grpo_config(tmp_path, max_steps=-1), environment_factory=Puzzle)
    with pytest.raises(ConfigError, match="requires a `train_dataset` with an `environment` column"):
        GRPOTrainer(tiny_tool_dir, None, cfg, environment_factory={"p": Puzzle})


async def async_add(a: int, b: int) -> int:
    """Add two integers, asynchronously.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def test_an_async_tool_runs_like_a_plain_one(tmp_path, tiny_tool_dir):
    def script(context, turn):
        a, b = numbers(context)
        return call("async_add", a=a, b=b) if turn == 0 else f"<answer>{a + b}</answer>"

    cfg = tiny_grpo_config(tmp_path, max_completion_length=96, num_generations=2, per_device_train_batch_size=8)
    trainer = scripted(GRPOTrainer(tiny_tool_dir, [right], cfg, train_dataset=addition_rows(16), tools=[async_add]),
                       script)
    batch = trainer._make_rollout(0)
    tool_messages = [m for s in batch.samples for m in s["completion"] if m["role"] == "tool"]
    a, b = numbers(str(batch.samples[0]["prompt"]))
    assert tool_messages[0]["content"] == str(a + b) and batch.metrics["rewards/right/mean"] == 1.0


def test_trls_views_of_the_environments_after_a_rollout(tmp_path, tiny_tool_dir):
    """trainer.environments[i] is the instance that served row i of the latest rollout; _environment_pool holds
    each environment's reusable instances, seeded by the probe."""
    rows = [{**row, "environment": "lamp" if i % 2 else "door"} for i, row in enumerate(addition_rows(16))]
    cfg = tiny_grpo_config(tmp_path, max_completion_length=96, num_generations=2, per_device_train_batch_size=8,
                           max_steps=1)
    trainer = scripted(GRPOTrainer(tiny_tool_dir, [lambda completions, **k: [0.0] * len(completions)], cfg,
                                   train_dataset=rows, environment_factory={"lamp": Lamp, "door": Door}),
                       lambda context, turn: "<answer>1</answer>")
    assert trainer.environments and len(trainer.environments) == 0
    assert {k: len(v) for k, v in trainer._environment_pool.items()} == {"lamp": 1, "door": 1}
    batch = trainer._make_rollout(0)
    assert [trainer.environments[i] for i in range(8)] == batch.rollout.extra["environments"]
