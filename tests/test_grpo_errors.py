"""Bad input fails before any model is loaded, with a message naming the field or row."""

from __future__ import annotations

import os

import pytest

import rlft.model.policy as policy_module
from rlft import GRPOTrainer
from rlft.config import ConfigError, GRPOConfig
from rlft.data.prompts import DatasetError
from rlft.model.loading import load_tokenizer
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(policy_module, "load_causal_lm", refuse)


def make(tmp_path, shipped, rows=None, funcs=(correct_answer,), **overrides):
    return GRPOTrainer(str(shipped), list(funcs), tiny_grpo_config(tmp_path, **overrides),
                       addition_rows(16) if rows is None else rows)


def test_batch_not_divisible_by_num_generations():
    with pytest.raises(ConfigError, match="not divisible by num_generations=3"):
        GRPOConfig(num_generations=3, per_device_train_batch_size=8)


def test_num_generations_below_two():
    with pytest.raises(ConfigError, match="num_generations=1 must be >= 2"):
        GRPOConfig(num_generations=1)


def test_unknown_loss_type():
    with pytest.raises(ConfigError, match="loss_type='ppo' is not allowed"):
        GRPOConfig(loss_type="ppo")


def test_bad_reward_weights_length(tmp_path, shipped_policy_dir, no_model_loading):
    with pytest.raises(ConfigError, match="reward_weights has 3 values but reward_funcs has 1"):
        make(tmp_path, shipped_policy_dir, reward_weights=[1.0, 2.0, 3.0])


def test_missing_prompt_column_names_the_columns_found(tmp_path, shipped_policy_dir, no_model_loading):
    rows = [{"question": "What is 1+1?", "answer": "2"}] * 8
    with pytest.raises(DatasetError, match=r"no 'prompt' column; columns found: \['question', 'answer'\]"):
        make(tmp_path, shipped_policy_dir, rows=rows)


def test_prompt_longer_than_context(tmp_path, shipped_policy_dir, no_model_loading):
    long_prompt = [{"role": "user", "content": "What is " + "1+" * 300 + "1?"}]
    rows = addition_rows(8) + [{"prompt": long_prompt, "answer": "301"}]
    with pytest.raises(DatasetError, match=r"row 8: prompt of \d+ tokens \+ max_completion_length=8 exceeds the "
                                           r"model's context of 512 tokens"):
        make(tmp_path, shipped_policy_dir, rows=rows, max_prompt_length=None)


def test_prompt_longer_than_max_prompt_length(tmp_path, shipped_policy_dir, no_model_loading):
    with pytest.raises(DatasetError, match=r"exceed max_prompt_length=5 tokens \(row \d+ has \d+\)"):
        make(tmp_path, shipped_policy_dir, max_prompt_length=5)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_output_dir(tmp_path, shipped_policy_dir, no_model_loading):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="is not writable"):
        make(tmp_path, shipped_policy_dir, output_dir=str(locked / "run"))


def test_output_dir_that_is_a_file(tmp_path, shipped_policy_dir, no_model_loading):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"output_dir='.*file/run' is not writable"):
        make(tmp_path, shipped_policy_dir, output_dir=str(tmp_path / "file" / "run"))


def test_chat_prompts_without_chat_template(tmp_path, shipped_policy_dir, no_model_loading):
    tokenizer = load_tokenizer(shipped_policy_dir)
    tokenizer.chat_template = None
    with pytest.raises(DatasetError, match="row 0: the prompt is a list of chat messages but the tokenizer has no "
                                           "chat template"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), addition_rows(8),
                    processing_class=tokenizer)


def test_unknown_reward_name(tmp_path, shipped_policy_dir, no_model_loading):
    with pytest.raises(Exception, match="'acuracy' is not a built-in"):
        make(tmp_path, shipped_policy_dir, funcs=["acuracy"])


def test_empty_reward_funcs(tmp_path, shipped_policy_dir, no_model_loading):
    with pytest.raises(ConfigError, match="No reward source provided: pass reward_funcs"):
        make(tmp_path, shipped_policy_dir, funcs=())


def test_a_dead_vllm_server_is_a_clear_error_within_the_timeout(tmp_path, shipped_policy_dir):
    import socket
    import time

    from rlft.rollout.vllm_server import VLLMServerError

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(VLLMServerError, match=rf"no vLLM server answered at http://127.0.0.1:{port}/health within "
                                              r"vllm_server_timeout=3 s; start one with `rlft vllm-serve --model"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer],
                    tiny_grpo_config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_port=port,
                                     vllm_server_timeout=3), addition_rows(16))
    assert time.monotonic() - started < 30


def test_a_vllm_server_that_dies_mid_run_is_named_as_gone_not_as_slow_or_a_different_model():
    """A server that closes the connection (it stopped or crashed) is named as gone, with the reason, before
    anything else; a weight push to it is not blamed on the model."""
    import socket
    import threading

    from rlft.rollout.vllm_server import ServerClient, VLLMServer, VLLMServerError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def reset_every_connection():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()  # RST: "Connection reset by peer"

    threading.Thread(target=reset_every_connection, daemon=True).start()
    client = ServerClient(f"http://127.0.0.1:{listener.getsockname()[1]}", 30)
    with pytest.raises(VLLMServerError, match=r"^the vLLM server at http://127\.0\.0\.1:\d+ is gone: the connection "
                                              r"was refused or closed during /collective_rpc") as caught:
        server = VLLMServer.__new__(VLLMServer)
        server.client, server.base_name = client, "tiny-adder"
        server._rpc("rlft_load_received", "session")
    assert caught.value.kind == "gone" and "different model" not in str(caught.value)
    listener.close()


@pytest.mark.parametrize("field", ["pad_token", "eos_token"])
def test_a_pad_or_eos_token_the_vocabulary_lacks_is_named(tmp_path, shipped_policy_dir, field):
    """transformers would set it with no id, and the first padded batch would fail far from the cause."""
    with pytest.raises(ConfigError, match=f"{field}='<NOT_A_TOKEN>' is not a token of the tokenizer"):
        make(tmp_path, shipped_policy_dir, **{field: "<NOT_A_TOKEN>"})
