"""Weight sync to vLLM without vLLM: buckets of bounded size that cover the state dict, LoRA pushed as an adapter
(PEFT's saved tensors) or merged with the reason said, the server-side receiver, and the server engine's whole
sync over HTTP against a stand-in server whose staging folder is not the trainer's (rlft/rollout/weight_sync.py,
vllm_receiver.py, vllm_server.py). The same paths against real vLLM: tests/test_vllm.py (`-m vllm`)."""

from __future__ import annotations

import base64
import json
import logging
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save
from transformers import AutoModelForCausalLM

from rlft import GRPOTrainer
from rlft.errors import ConfigError
from rlft.rollout.vllm import engine_weights, module_tensors
from rlft.rollout.vllm_receiver import WeightReceiver
from rlft.rollout.vllm_server import VLLMServerError
from rlft.rollout.weight_sync import (
    adapter_entries,
    adapter_files,
    lora_rank_limit,
    lora_sync_mode,
    weight_buckets,
)
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config


def policy(shipped_policy_dir, **lora):
    model = AutoModelForCausalLM.from_pretrained(shipped_policy_dir)
    return get_peft_model(model, LoraConfig(**{"r": 4, "target_modules": "all-linear", **lora})) if lora else model


def test_buckets_are_bounded_in_order_cover_the_state_dict_and_count_a_tied_weight_once(shipped_policy_dir):
    model = policy(shipped_policy_dir)
    limit = 64 * 1024
    buckets = list(weight_buckets(model, module_tensors, None, torch.float32, limit))
    everything = module_tensors(model)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in everything]  # all, once, in order
    for (name, sent), (_, mine) in zip([e for b in buckets for e in b], everything):
        assert torch.equal(sent, mine), name
    for bucket in buckets:
        distinct = {id(t): t for _, t in bucket}  # lm_head.weight is embed_tokens.weight: counted once
        assert len(distinct) == 1 or sum(t.numel() * 4 for t in distinct.values()) <= limit
    assert len(buckets) > 10
    whole = list(weight_buckets(model, module_tensors, None, torch.bfloat16, 1 << 40))
    assert len(whole) == 1 and all(t.dtype == torch.bfloat16 for _, t in whole[0])  # cast to the engine's dtype
    model.to(torch.bfloat16).model.norm.to(torch.float32)  # mixed dtypes: None keeps each tensor's own
    kept = [e for b in weight_buckets(model, module_tensors, None, None, limit) for e in b]
    assert {n: t.dtype for n, t in kept} == {n: t.dtype for n, t in module_tensors(model)}
    assert {t.dtype for _, t in kept} == {torch.bfloat16, torch.float32}


def test_an_adapter_is_pushed_as_the_tensors_and_config_peft_saves(shipped_policy_dir, tmp_path):
    model = policy(shipped_policy_dir, lora_alpha=16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    mine = dict(adapter_entries(model))
    peft_saved = get_peft_model_state_dict(model)
    assert sorted(mine) == sorted(peft_saved)
    assert all(torch.equal(mine[k], peft_saved[k]) for k in mine)
    files = adapter_files(model, list(mine.items()))
    (tmp_path / "adapter_model.safetensors").write_bytes(files["adapter_model.safetensors"])
    assert set(load_file(str(tmp_path / "adapter_model.safetensors"))) == set(peft_saved)
    config = json.loads(files["adapter_config.json"])
    assert config["r"] == 4 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
    assert not any("lora" in name for name, _ in engine_weights(model))  # the base weights, vLLM's names


def test_lora_sync_mode_picks_the_adapter_when_vllm_can_serve_it_and_says_why_when_not(shipped_policy_dir, caplog,
                                                                                      tmp_path):
    args = lambda mode: tiny_grpo_config(tmp_path, vllm_lora_sync=mode)  # noqa: E731
    assert lora_sync_mode(args("auto"), policy(shipped_policy_dir)) is None  # no LoRA
    assert lora_sync_mode(args("auto"), policy(shipped_policy_dir, r=4)) == "adapter"
    assert lora_sync_mode(args("merged"), policy(shipped_policy_dir, r=4)) == "merged"
    dora = policy(shipped_policy_dir, use_dora=True)
    with caplog.at_level(logging.WARNING, logger="rlft"):
        assert lora_sync_mode(args("auto"), dora) == "merged"
    assert "DoRA (use_dora=True)" in caplog.text and "pushes the whole model with LoRA merged" in caplog.text
    with pytest.raises(ConfigError, match=r"vllm_lora_sync='adapter': vLLM cannot serve this adapter \(DoRA"):
        lora_sync_mode(args("adapter"), dora)
    saved = policy(shipped_policy_dir, modules_to_save=["lm_head"])
    assert lora_sync_mode(args("auto"), saved) == "merged" and "modules_to_save=['lm_head']" in caplog.text
    assert [lora_rank_limit(policy(shipped_policy_dir, r=r)) for r in (1, 4, 16, 20)] == [1, 8, 16, 32]
    with pytest.raises(ConfigError, match="vllm_lora_sync='both' is not allowed; choose one of 'auto', 'adapter', 'merged'"):
        tiny_grpo_config(tmp_path, vllm_lora_sync="both")


class RecordingReceiver(WeightReceiver):
    rank = 0
    model_runner = types.SimpleNamespace(model=torch.nn.Linear(2, 2))  # (a worker's, without MoE layers)

    def __init__(self):
        self.loaded = []

    def reload_weights(self, weights_iterator):
        self.loaded.append([(name, tensor.clone()) for name, tensor in weights_iterator])


def test_the_receiver_stages_files_loads_buckets_in_order_and_refuses_bad_names(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFT_RECEIVE_DIR", str(tmp_path))
    receiver = RecordingReceiver()
    first, second = {"a": torch.ones(2)}, {"b": torch.zeros(3), "c": torch.arange(4.0)}
    receiver.rlft_receive("s1", "bucket-00001.safetensors", base64.b64encode(save(second)).decode())
    folder = receiver.rlft_receive("s1", "bucket-00000.safetensors", base64.b64encode(save(first)).decode())
    assert folder == str(tmp_path / "s1" / "worker0")  # buckets: a folder per worker
    assert receiver.rlft_load_received("s1") == 2
    assert [n for n, _ in receiver.loaded[0]] == ["a", "b", "c"]
    assert torch.equal(receiver.loaded[0][2][1], torch.arange(4.0))
    assert not (tmp_path / "s1").exists()  # deleted once loaded
    for session, name in (("../up", "bucket-0.safetensors"), ("s2", "../../etc"), ("s2", "a/b")):
        with pytest.raises(ValueError, match="bad"):
            receiver.rlft_receive(session, name, "")
    with pytest.raises(FileNotFoundError, match="nothing received for session 's3'"):
        receiver.rlft_load_received("s3")


class FakeServer(BaseHTTPRequestHandler):
    """vLLM's routes as rlft uses them, with rlft's receiver behind /collective_rpc; every completion is EOS."""

    state: dict = {}

    def log_message(self, *args):
        pass

    def _answer(self, code: int, body) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._answer(200, "")
        if self.path == "/v1/models":
            return self._answer(200, {"data": [{"id": "tiny"}]})
        lora = self.state["lora"]
        config = {"model_config": {"dtype": "torch.float32"}, "lora_config": lora}
        return self._answer(200, {"vllm_config": config})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        log, receiver = self.state["log"], self.state["receiver"]
        if self.path == "/collective_rpc":
            if receiver is None:
                return self._answer(500, "AttributeError: 'CPUWorker' has no attribute 'rlft_receiver_protocol'")
            log.append((body["method"], *(a if len(a) < 64 else "<payload>" for a in body.get("args", []))))
            return self._answer(200, {"results": [getattr(receiver, body["method"])(*body.get("args", []))]})
        log.append((self.path, body.get("lora_name") or body.get("model")))
        if self.path == "/v1/completions":
            choice = {"token_ids": [self.state["eos"]], "logprobs": {"token_logprobs": [-0.5]}}
            return self._answer(200, {"choices": [choice]})
        return self._answer(200, "Success")


@pytest.fixture()
def fake_server(tmp_path, monkeypatch, shipped_policy_dir):
    server_dir = tmp_path / "server-host"
    monkeypatch.setenv("RLFT_RECEIVE_DIR", str(server_dir))  # the receiver's folder; the trainer writes none
    FakeServer.state = {"log": [], "receiver": RecordingReceiver(), "lora": {"max_lora_rank": 8}, "eos": 2}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield FakeServer.state, httpd.server_address[1], server_dir
    httpd.shutdown()


def server_trainer(tmp_path, shipped_policy_dir, port, peft=True, **overrides):
    cfg = tiny_grpo_config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_port=port,
                           vllm_server_timeout=10, **overrides)
    return GRPOTrainer(str(shipped_policy_dir), [correct_answer], cfg, addition_rows(16),
                       peft_config=LoraConfig(r=4, target_modules="all-linear") if peft else None)


def test_a_server_receives_the_base_once_then_only_adapters_over_http(tmp_path, shipped_policy_dir, fake_server):
    state, port, server_dir = fake_server
    trainer = server_trainer(tmp_path, shipped_policy_dir, port, vllm_sync_bucket_mb=0.5)
    trainer.train()  # 2 steps: a sync before each rollout
    log, loaded = state["log"], state["receiver"].loaded
    buckets = [entry for entry in log if entry[0] == "rlft_receive" and entry[2].startswith("bucket-")]
    assert len(buckets) == 5 and len(loaded) == 1  # the base weights once, in 0.5 MiB buckets
    names = [name for name, _ in loaded[0]]
    assert sorted(names) == sorted(name for name, _ in engine_weights(trainer.model)) and "lm_head.weight" in names
    adapters = [entry[1] for entry in log if entry[0] == "/v1/load_lora_adapter"]
    assert len(adapters) == 2 and adapters[0] != adapters[1]  # a new name per sync
    assert ("/v1/unload_lora_adapter", adapters[0]) in log and ("rlft_drop_received", adapters[0]) in log
    asked = {entry[1] for entry in log if entry[0] == "/v1/completions"}
    assert asked == set(adapters)  # completions come from the adapter pushed before them
    staged = list(server_dir.iterdir())
    assert [p.name for p in staged] == [adapters[1]]  # the adapter in use, on the server's side only
    assert sorted(p.name for p in staged[0].iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    rows = [r["vllm/sync_bytes"] for r in trainer.state.log_history if "vllm/sync_bytes" in r]
    adapter = sum(t.numel() * 4 for _, t in adapter_entries(trainer.model))
    assert rows == [sum(t.numel() * 4 for _, t in engine_weights(trainer.model)) + adapter, adapter]
    trainer.generator.close()
    assert not list(server_dir.iterdir()) and log[-2][0] == "/v1/unload_lora_adapter"


def test_full_weights_go_in_buckets_and_a_lora_off_server_gets_merged_weights(tmp_path, shipped_policy_dir,
                                                                               fake_server, caplog):
    state, port, _ = fake_server
    trainer = server_trainer(tmp_path / "full", shipped_policy_dir, port, peft=False, vllm_sync_bucket_mb=0.5)
    trainer.train()
    assert len(state["receiver"].loaded) == 2  # one load per sync, each from 5 buckets
    assert sum(1 for e in state["log"] if e[0] == "rlft_receive") == 10
    assert sorted(n for n, _ in state["receiver"].loaded[1]) == sorted(n for n, _ in module_tensors(trainer.model))
    state["lora"] = None
    with caplog.at_level(logging.WARNING, logger="rlft"):
        trainer = server_trainer(tmp_path / "merged", shipped_policy_dir, port)
    assert trainer.generator.lora_mode == "merged"
    assert "has LoRA off" in caplog.text and "rlft vllm-serve --enable_lora --max_lora_rank 8" in caplog.text
    with pytest.raises(ConfigError, match="vllm_lora_sync='adapter': the vLLM server at .* has LoRA off"):
        server_trainer(tmp_path / "adapter", shipped_policy_dir, port, vllm_lora_sync="adapter")


def test_a_server_without_the_receiver_is_a_clear_error(tmp_path, shipped_policy_dir, fake_server):
    state, port, _ = fake_server
    state["receiver"] = None
    with pytest.raises(VLLMServerError, match=r"cannot receive weights over HTTP: start it with `rlft vllm-serve "
                                              r"--model \.\.\.`, or add `--worker-extension-cls rlft"):
        server_trainer(tmp_path, shipped_policy_dir, port)
