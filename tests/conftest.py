"""Shared fixtures: tiny real models saved to disk like hub folders."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_causal_dir(tmp_path_factory):
    from rlft.tiny import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), kind="causal", arch="qwen2")


@pytest.fixture(scope="session")
def tiny_rm_dir(tmp_path_factory):
    from rlft.tiny import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-rm"), kind="seq_cls", arch="qwen2")


@pytest.fixture(scope="session")
def shipped_policy_dir():
    from rlft.model.loading import shipped_policy_path

    return shipped_policy_path()


@pytest.fixture(scope="session")
def tiny_tool_dir(tmp_path_factory):
    """A random tiny Qwen2 with the tool-calling tokenizer and chat template."""
    from rlft.tiny import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-tools"), kind="causal", arch="qwen2", tools=True)
