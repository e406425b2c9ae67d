"""rlft/rollout/vllm_routes.py without vLLM: how the recorder files a step's expert choices per request and
position, what a server keeps and drops, and how requests' reads become a rollout's routes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from rlft.rollout import vllm_routes
from rlft.rollout.vllm_routes import RouteRecorder


class Runner:
    """What the recorder reads of vLLM's model runner after a step: each scheduled token's request index and
    position, and the batch's request ids."""

    def __init__(self):
        self.req_indices = SimpleNamespace(np=np.zeros(0, dtype=np.int64))
        self.positions = torch.zeros(0, dtype=torch.long)
        self.input_batch = SimpleNamespace(req_ids=[])

    def schedule(self, requests: list[str], tokens: list[tuple[int, int]]) -> None:
        """tokens: (request index, position) of each token in the step, in order."""
        self.input_batch.req_ids = requests
        self.req_indices.np = np.array([owner for owner, _ in tokens])
        self.positions = torch.tensor([position for _, position in tokens])


def step(recorder: RouteRecorder, runner: Runner, requests, tokens, layers: int = 2, finished=()) -> torch.Tensor:
    """One engine step: each MoE layer hands over its top-2 ids (distinct per token and layer), then the
    step is filed; returns them [T, L, 2]."""
    runner.schedule(requests, tokens)
    chosen = torch.arange(len(tokens) * layers * 2).reshape(len(tokens), layers, 2)
    for layer in range(layers):
        recorder.capture(layer, chosen[:, layer])
    recorder.step_done(SimpleNamespace(total_num_scheduled_tokens=len(tokens), finished_req_ids=set(finished)))
    return chosen


def test_a_step_is_filed_per_request_and_position_and_taken_by_vllms_inner_names():
    runner = Runner()
    recorder = RouteRecorder(runner)
    recorder.on = True
    prefill = step(recorder, runner, ["7-a1", "8-b2"], [(0, 0), (0, 1), (1, 0)])
    decode = step(recorder, runner, ["7-a1", "8-b2"], [(1, 1), (0, 2)])
    reads = recorder.take(["8", "7"])
    assert sorted(reads[0]) == [0, 1] and sorted(reads[1]) == [0, 1, 2]
    assert torch.equal(reads[0][1], decode[0].to(torch.int16)) and torch.equal(reads[1][1], prefill[1].to(torch.int16))
    assert recorder.reads == {}  # (a colocated engine: what nobody asked for is dropped with the take)
    # off (no rollout wants them), or a step some layer did not route whole: nothing filed
    recorder.on = False
    step(recorder, runner, ["9"], [(0, 0)])
    assert recorder.take(["9"]) == [{}]


def test_a_servers_recorder_keeps_marked_requests_until_taken_and_drops_orphans(monkeypatch):
    runner = Runner()
    recorder = RouteRecorder(runner, marked=True)
    mine, other = f"cmpl-{vllm_routes.MARK}x-0", "cmpl-someone-0"
    step(recorder, runner, [mine, other], [(0, 0), (1, 0)])
    assert list(recorder.reads) == [mine]  # (another client's requests are not recorded)
    now = [100.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    step(recorder, runner, [f"cmpl-{vllm_routes.MARK}y-0"], [(0, 0)], finished=[mine])
    now[0] += vllm_routes.ORPHANED - 1
    step(recorder, runner, [], [], finished=[])
    assert mine in recorder.reads  # finished, its client may still come for it
    assert recorder.take([f"{vllm_routes.MARK}y"], prefix="cmpl-")[0]  # taken: nothing else goes with it
    now[0] += 2
    step(recorder, runner, [], [])
    assert recorder.reads == {} and recorder.finished == {}  # nobody took it within ORPHANED seconds


def test_reads_become_left_padded_prefix_routes_and_new_tokens_routes():
    """Two requests of one prompt (the prefix cache served the second one's first two positions) and a
    third; each new token's route is the one read at its position, -1 where none was (a last token)."""
    route = lambda v: torch.full((2, 2), v, dtype=torch.int16)  # noqa: E731
    reads = [{0: route(0), 1: route(1), 2: route(2), 3: route(3)},  # prompt of 3, 2 tokens: the 1st read
             {2: route(12), 3: route(13), 4: route(14)},  # same prompt, 3 tokens
             {0: route(20), 1: route(21)}]  # a prompt of 2, 1 token (never read)
    prefix, new = vllm_routes.assemble(reads, [[5, 6, 7], [5, 6, 7], [8, 9]], [2, 3, 1])
    assert prefix.shape == (3, 3, 2, 2) and new.shape == (3, 3, 2, 2)
    assert prefix[:, :, 0, 0].tolist() == [[0, 1, 2], [0, 1, 12], [-1, 20, 21]]
    assert new[:, :, 0, 0].tolist() == [[3, -1, -1], [13, 14, -1], [-1, -1, -1]]
    assert vllm_routes.assemble([{}, {}], [[1], [2]], [1, 1]) is None


def test_a_rows_routes_keep_the_first_read_and_none_past_what_its_request_returned():
    into = [{}, {3: torch.zeros(2, 2, dtype=torch.int16)}]
    later = {3: torch.ones(2, 2, dtype=torch.int16), 4: torch.ones(2, 2, dtype=torch.int16),
             5: torch.ones(2, 2, dtype=torch.int16)}
    vllm_routes.merge(into, [1], [later], [5])  # (position 5: a step past the row's 5 tokens)
    assert sorted(into[1]) == [3, 4] and int(into[1][3].sum()) == 0


def test_routes_cross_the_wire_unchanged():
    reads = [{4: torch.tensor([[1, 2], [3, 4]], dtype=torch.int16), 2: torch.tensor([[5, 6], [7, 8]],
                                                                                       dtype=torch.int16)}, {}]
    back = vllm_routes.decode(vllm_routes.encode(reads))
    assert back[1] == {} and sorted(back[0]) == [2, 4]
    assert all(torch.equal(back[0][p], reads[0][p]) for p in (2, 4))
