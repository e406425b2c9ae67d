"""Partial rollouts with tools (rlft/train/sources/agent_pool.py), without a model: a scripted producer answers
each window, so which rows a window holds, where it ends, and what a cut turn becomes are checked exactly."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoTokenizer

from rlft.rollout.multiturn import Toolset
from rlft.rollout.producer import ProcessProducer, Produced
from rlft.rollout.tools import tool_schemas
from rlft.train.sources.agent_pool import AgentPool
from tests.tools_helpers import add, call

ROWS = 2  # completions per rollout (one prompt x 2)


@pytest.fixture(scope="module")
def tok(tiny_tool_dir):
    return AutoTokenizer.from_pretrained(tiny_tool_dir)


def first_turn(rollout: int, row: int) -> str:
    """Row 0 thinks before its call, longer in each later rollout (the long tail); row 1 calls at once."""
    return ("hmm " * 10 * (rollout + 1) if row == 0 else "") + call("add", a=rollout, b=row)


class ScriptedProducer:
    """The producer's end of `submit_rows` / `take`, stateless as generate is: each row's turn (turn 0:
    `first_turn`, then an answer) goes on from the part of it its prefix already ends with, one token per decode
    step, a row finishing at its EOS or budget, the window at its `must` rows' end. Window w of rollout r writes
    log-prob -(10 r + w + 1) and version 10 r + w, so tests can read where each token came from."""

    to_rollout = ProcessProducer.to_rollout

    def __init__(self, tok):
        self.tokenizer, self.eos_ids = tok, [tok.eos_token_id]
        self.windows: list[dict] = []
        self.answers: dict[str, Produced] = {}

    def _rest(self, prefix: list[int], name: list[int]) -> list[int]:
        rollout, row, turn = name
        text = first_turn(rollout, row) if turn == 0 else f"<answer>{rollout + row}</answer>"
        full = self.tokenizer(text, add_special_tokens=False)["input_ids"] + self.eos_ids
        done = max(k for k in range(len(full)) if k == 0 or prefix[-k:] == full[:k])
        return full[done:]

    def submit_rows(self, key: str, rows: dict, seed: int) -> int:
        self.windows.append(rows)
        rollout, window = (int(part.lstrip("w")) for part in key.split("-")[1:])
        stamp = 10 * rollout + window
        queues = [self._rest(prefix, name) for prefix, name in zip(rows["prefixes"], rows["names"])]
        tokens, finished = [[] for _ in queues], [False] * len(queues)
        while not all(done or not must for done, must in zip(finished, rows["must"])):
            for i, queue in enumerate(queues):
                if not finished[i]:
                    tokens[i].append(queue.pop(0))
                    finished[i] = not queue or len(tokens[i]) == rows["budgets"][i]
        self.answers[key] = Produced(key, 0, tokens, [[-(stamp + 1.0)] * len(t) for t in tokens],
                                     row_versions=[[stamp] * len(t) for t in tokens], finished=finished,
                                     timings={"partial/window_steps": float(max(map(len, tokens)))})
        return 0

    def take(self, key: str) -> Produced:
        return self.answers.pop(key)


def pool_of(tok, rollouts: int, ahead: int, max_length: int = 128, iterations=None):
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Add {r}."}], tools=tool_schemas([add]),
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for r in range(rollouts)]
    args = types.SimpleNamespace(max_completion_length=max_length, max_tool_calling_iterations=iterations,
                                 tool_call_timeout=5.0, chat_template_kwargs=None, num_generations=ROWS,
                                 inflight_weight_updates=False)
    source = types.SimpleNamespace(
        args=args, tokenizer=tok, engine=ScriptedProducer(tok), turn_seed=lambda r, w: 0,
        setup=types.SimpleNamespace(toolset=Toolset({"add": add}, tool_schemas([add])), environments=None),
        schedule=types.SimpleNamespace(batch=lambda r: {"prompt_ids": [prompts[r]], "prompts": [None]}),
        accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    return AgentPool(source, ahead), source.engine


def test_a_window_ends_with_rollout_ks_turns_and_the_next_rollouts_rows_go_on_from_where_it_cut_them(tok):
    """Rollout 0's rows call their tool in window 0 and answer in window 1; the next rollout's rows ride along.
    Rollout 1's long row, cut by both windows, went on in its own (not restarted), and its call, split across
    three windows, was parsed whole."""
    pool, producer = pool_of(tok, rollouts=3, ahead=1)
    first = pool.drive(0, last=2, version=0)
    assert [w["must"] for w in producer.windows[:1]] == [[True, True, False, False]]
    assert first.stats["tool_calls"].tolist() == [1.0, 1.0] and first.stats["turns"].tolist() == [2.0, 2.0]
    answers = [m[-1]["content"] for m in first.completions]
    assert answers == ["<answer>0</answer>", "<answer>1</answer>"]
    assert [m[1] for m in first.completions] == [{"role": "tool", "name": "add", "content": "0"},
                                                 {"role": "tool", "name": "add", "content": "1"}]
    # tool output is read, not trained; every sampled token keeps the window (version) that drew it
    sampled = first.tool_mask.bool() & first.completion_mask.bool()
    assert (first.token_versions[sampled] >= 0).all() and (first.tool_mask == 0).logical_and(
        first.completion_mask.bool()).any()
    assert torch.equal(first.sampling_logps[sampled], -(first.token_versions[sampled].float() + 1))
    carried = pool.cohorts[1].rows
    assert all(row.ids for row in carried) and pool.stats["partial/carried_share"] == 0.0
    second = pool.drive(1, last=2, version=0)
    assert pool.stats["partial/carried_share"] > 0.5  # most of rollout 1 was drawn in rollout 0's windows
    assert [m[0]["tool_calls"][0]["function"] for m in second.completions] == [
        {"name": "add", "arguments": {"a": 1, "b": 0}}, {"name": "add", "arguments": {"a": 1, "b": 1}}]
    long_row = second.completion_ids[0][second.tool_mask[0].bool()].tolist()
    assert tok.decode(long_row).startswith("hmm hmm")  # the cut turn went on from its tokens, not restarted
    assert len(set(second.token_versions[0][second.tool_mask[0].bool()].tolist())) > 1  # over several windows


def test_tool_rounds_and_the_budget_end_rows_as_the_synchronous_loop_does(tok):
    """max_tool_calling_iterations=0: a row's calls are never run (counted as hitting the limit); a budget that
    cuts the long row's first turn ends it truncated, with no call run."""
    pool, _ = pool_of(tok, rollouts=1, ahead=0, iterations=0)
    out = pool.drive(0, last=0, version=0)
    assert out.stats["hit_limit"].tolist() == [1.0, 1.0] and out.stats["tool_calls"].tolist() == [0.0, 0.0]
    pool, _ = pool_of(tok, rollouts=1, ahead=0, max_length=12)
    out = pool.drive(0, last=0, version=0)
    assert out.truncated.tolist() == [True, True] and out.completion_mask.sum(1).tolist() == [12, 12]
    assert out.stats["tool_calls"].tolist() == [0.0, 0.0]


def test_the_pool_through_a_checkpoint_continues_as_it_would_have(tok):
    """state() / load(): a pool saved between rollouts, restored into a new pool, drives the next rollout to the
    same tokens, masks and messages as the pool that was never saved."""
    straight, _ = pool_of(tok, rollouts=3, ahead=1)
    straight.drive(0, last=2, version=0)
    saved = straight.state()
    expected = straight.drive(1, last=2, version=0)
    resumed, _ = pool_of(tok, rollouts=3, ahead=1)
    resumed.load(*saved)
    got = resumed.drive(1, last=2, version=0)
    for name in ("completion_ids", "completion_mask", "tool_mask", "sampling_logps", "token_versions"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert got.completions == expected.completions
