"""The vLLM engines' own logic, with a stand-in for vLLM's LLM (no vLLM needed): sleep mode never lets a
generation run on a sleeping engine (a tool loop's later turns and the rollout after an evaluation have no sync
before them), each sync is timed and its bytes counted and logged, and the server's precision is said out loud
(`rlft vllm-serve` defaults to the model folder's dtype, not vLLM's auto)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from rlft import GRPOTrainer
from rlft.rollout.hf import eos_token_ids
from rlft.rollout.vllm import VLLMColocate, engine_weights, state_dtypes
from rlft.rollout.vllm_server import default_dtype, serve_command
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config


class FakeLLM:
    """Records what the engine asks of vLLM; answers every prompt with a one-token completion (EOS)."""

    def __init__(self, events: list, eos: int):
        self.events, self.eos, self.asleep = events, eos, False

    def wake_up(self):
        self.events.append("wake")
        self.asleep = False

    def sleep(self, level):
        self.events.append("sleep")
        self.asleep = True

    def collective_rpc(self, method, args=(), kwargs=None):
        assert not self.asleep, "weights pushed into a sleeping engine"
        if callable(method):  # a function run on the worker (rlft/rollout/vllm_moe.py: after_reload)
            return [0]
        list(kwargs["weights_iterator"])
        self.events.append("sync")

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        assert not self.asleep, "generation on a sleeping engine"
        self.events.append("generate")
        sample = SimpleNamespace(token_ids=[self.eos], logprobs=None)
        return [SimpleNamespace(outputs=[sample]) for _ in prompts]


class StubColocate(VLLMColocate):
    def __init__(self, args, tokenizer, model, events):  # what VLLMColocate.__init__ sets, without vLLM
        self.tokenizer, self.args, self.full_weights = tokenizer, args, None
        self.eos_ids, self.dtype = eos_token_ids(model, tokenizer), torch.float32
        self.llm = FakeLLM(events, self.eos_ids[0])
        self.lora_mode, self.lora_request, self.base_pushed = None, None, False

    def sampling_params(self, count, greedy, max_tokens=None):
        return [None] * count


def stub_trainer(tmp_path, shipped_policy_dir, **overrides):
    cfg = tiny_grpo_config(tmp_path, vllm_enable_sleep_mode=True, **overrides)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], cfg, addition_rows(16),
                          eval_dataset=addition_rows(2, heldout=True))
    events = []
    trainer.generator = StubColocate(cfg, trainer.tokenizer, trainer.model, events)
    return trainer, events


def test_sleep_mode_wakes_the_engine_for_every_generation_and_sync(tmp_path, shipped_policy_dir):
    trainer, events = stub_trainer(tmp_path, shipped_policy_dir, max_steps=3, eval_strategy="steps", eval_steps=1)
    trainer.train()
    engine = trainer.generator
    ids = trainer.train_prompts.batch([0])["prompt_ids"]
    engine(trainer.model, ids, 2)  # a later turn of a tool loop: no optimiser step, no sync before it
    assert events[-3:] == ["wake", "generate", "sleep"]
    assert events.count("sync") == 4  # the first rollout, then after each of the 3 applied steps (the evals)
    # every generation and sync finds the engine awake (FakeLLM asserts it), and it sleeps after each generation
    generations = [i for i, e in enumerate(events) if e == "generate"]
    assert all(events[i + 1] == "sleep" for i in generations)


def test_each_sync_is_timed_its_bytes_counted_and_logged(tmp_path, shipped_policy_dir):
    trainer, events = stub_trainer(tmp_path, shipped_policy_dir, max_steps=2)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "vllm/sync_bytes" in r]
    weights = sum(t.numel() * 4 for _, t in engine_weights(trainer.accelerator.unwrap_model(trainer.model)))
    assert [r["vllm/sync_bytes"] for r in rows] == [float(weights)] * 2 and all(r["vllm/sync_seconds"] > 0
                                                                               for r in rows)
    assert trainer.generator.metrics() == {}  # handed over once


def test_vllm_serve_defaults_to_the_trainers_dtype_and_mismatches_are_said(shipped_policy_dir, caplog):
    from rlft.model.loading import resolve_dtype

    assert default_dtype() == str(resolve_dtype("auto")).removeprefix("torch.") == "float32"  # a CPU here
    argv, _ = serve_command(str(shipped_policy_dir), "127.0.0.1", 8000, None, None, 1, 0.9, None, 0, [])
    assert argv[argv.index("--dtype") + 1] == "float32"
    argv, _ = serve_command(str(shipped_policy_dir), "127.0.0.1", 8000, "bfloat16", None, 1, 0.9, None, 0, [])
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    with caplog.at_level(logging.INFO, logger="rlft"):
        state_dtypes("bfloat16", torch.float32, "the vLLM server at http://x")
        state_dtypes(torch.float32, torch.float32, "the colocated vLLM engine")
    assert "samples in bfloat16 while the trainer trains in float32" in caplog.text
    assert "--dtype float32" in caplog.text and "samples in float32, the trainer's dtype" in caplog.text


def test_in_flight_updates_push_lora_merged_because_a_running_request_keeps_its_adapter(tmp_path, tiny_causal_dir):
    """A vLLM request keeps the adapter it was added with, so under inflight_weight_updates weights loaded between
    its steps must be the merged model: auto picks merged, and an explicit adapter push is refused saying why."""
    import pytest
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlft import AsyncGRPOConfig
    from rlft.errors import ConfigError
    from rlft.rollout.weight_sync import lora_sync_mode

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_causal_dir), LoraConfig(r=4))
    config = lambda **extra: AsyncGRPOConfig(output_dir=str(tmp_path), use_vllm=True, **extra)  # noqa: E731
    assert lora_sync_mode(config(), model) == "adapter"
    assert lora_sync_mode(config(inflight_weight_updates=True), model) == "merged"
    with pytest.raises(ConfigError, match="vllm_lora_sync='adapter' with inflight_weight_updates.*merged"):
        lora_sync_mode(config(inflight_weight_updates=True, vllm_lora_sync="adapter"), model)


def test_producers_of_several_processes_share_a_server_only_pushing_adapters():
    """AsyncGRPOTrainer on several processes starts a producer per process; on one vLLM server each pushes at
    its own time. Adapters are safe (each producer's requests name its own); whole or merged weights would reach
    another producer's running requests, so the producer refuses them, naming the fix."""
    from rlft.errors import ConfigError
    from rlft.rollout.vllm_server import VLLMServer

    server = VLLMServer.__new__(VLLMServer)
    server.client = SimpleNamespace(url="http://127.0.0.1:8000")
    for mode in (None, "merged"):
        server.lora_mode = mode
        server.check_shared(1)
        with pytest.raises(ConfigError, match="on 2 processes shares the vLLM server at http://127.0.0.1:8000.*"
                                              "vllm_lora_sync: auto or adapter.*--enable_lora"):
            server.check_shared(2)
    server.lora_mode = "adapter"
    server.check_shared(2)
