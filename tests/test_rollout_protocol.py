"""The rollout-engine protocol: every engine meets it, the trainer (not a callback) tells the engine when the
policy's weights changed -- after each applied optimiser step and after a resume -- and never after a skipped step."""

from __future__ import annotations

from rlft import GRPOTrainer
from rlft.rollout import ENGINES, HFGenerator, RolloutEngine
from rlft.rollout.multiturn import ToolLoop, Toolset
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config


class Recording:
    """Wraps the real engine; records the order of generate and weight-change calls."""

    holds_own_weights = True

    def __init__(self, inner):
        self.inner, self.events = inner, []

    def __call__(self, model, prompt_ids, num_generations, greedy=False, **kwargs):
        self.events.append("greedy" if greedy else "generate")
        return self.inner(model, prompt_ids, num_generations, greedy, **kwargs)

    def on_weights_changed(self):
        self.events.append("weights")

    def close(self):
        self.events.append("close")


def test_every_engine_meets_the_protocol(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), addition_rows(16))
    assert isinstance(trainer.generator, HFGenerator) and isinstance(trainer.generator, RolloutEngine)
    assert not trainer.generator.holds_own_weights
    loop = ToolLoop(Recording(trainer.generator), trainer.tokenizer, Toolset({}, []), 8)
    assert isinstance(loop, RolloutEngine) and loop.holds_own_weights  # the tool loop answers for its engine
    loop.on_weights_changed()
    assert loop.engine.events == ["weights"]
    assert set(ENGINES) == {(False, None), (True, "colocate"), (True, "server")}


def test_the_trainer_tells_the_engine_after_each_applied_step_and_a_resume(tmp_path, shipped_policy_dir):
    cfg = tiny_grpo_config(tmp_path, max_steps=3, save_steps=1, eval_strategy="steps", eval_steps=2)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], cfg, addition_rows(16),
                          eval_dataset=addition_rows(2, heldout=True))
    trainer.generator = engine = Recording(trainer.generator)
    trainer.train()
    assert engine.events == ["weights", "generate", "weights", "generate", "weights", "greedy",  # eval at 2
                             "generate", "weights", "greedy"]  # and at the end
    resumed = GRPOTrainer(str(shipped_policy_dir), [correct_answer], cfg, addition_rows(16))
    resumed.generator = engine = Recording(resumed.generator)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert engine.events == ["weights", "generate", "weights"]  # the resumed weights first, then step 3


def test_a_skipped_step_leaves_the_engine_alone(tmp_path, shipped_policy_dir):
    cfg = tiny_grpo_config(tmp_path, max_steps=1)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], cfg, addition_rows(16))
    trainer.generator = engine = Recording(trainer.generator)
    trainer.updater.step = lambda batch: trainer.optim.skip("test", nonfinite=False) or {}
    trainer.train()
    assert engine.events == ["weights", "generate"]
