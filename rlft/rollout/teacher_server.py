"""A distillation teacher served by `rlft vllm-serve` (`teacher_model_server_url`): its top-k
log-probs at every completion position, read from vLLM's OpenAI server, instead of a second model in
the trainer.

Each completion is sent back as a prompt (its prompt's tokens then its own) to `POST
/v1/completions` with `prompt_logprobs=loss_top_k` and one token to generate: vLLM scores every
position of a prompt in one forward and answers, per position, the teacher's k most likely tokens
and the token that is there (the sampled one), with their log-probs. Those are raw log-probs
(temperature 1: vLLM applies no sampling setting to a prompt's tokens), so a served teacher needs
`temperature=1`. The divergence is then computed on that support plus one tail bucket
(rlft/core/sparse_distill.py: a lower bound of the exact one that tightens with k; measured in
docs/distillation.md).

The teacher's answers for a rollout are fetched on its first micro-batch (every row of this process,
requests in parallel, which the server batches); a row is asked once, however many micro-batches and
optimiser steps (`num_iterations`) use it. The teacher server is its
own vLLM server (another port than a student's `vllm_mode="server"`); it never receives weights.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from rlft.errors import ConfigError
from rlft.rollout.base import Rollout
from rlft.rollout.vllm_server import ServerClient, VLLMServerError

PROBE = "Distil 12 + 34 = 46, naïve café — 日本語 <tool_call>{\"x\": 1}</tool_call>\n"


class ServedTeacher:
    """The teacher behind `url`: `support(rollout, rows, width)` -> (ids, log-probs) [n, K] at the
    rows' real completion positions (-1 padding), in the order the student's scored positions are
    read."""

    def __init__(self, url: str, timeout: float, top_k: int, tail: bool, tokenizer):
        self.url, self.top_k, self.tail = url.rstrip("/"), int(top_k), bool(tail)
        self.client = ServerClient(self.url, timeout)
        try:
            self.client.wait_healthy()
        except VLLMServerError as err:
            raise VLLMServerError(f"no teacher server answered at {self.url} within {timeout} s "
                                  "(vllm_server_timeout): start it with `rlft vllm-serve --model "
                                  "TEACHER --port PORT` or fix teacher_model_server_url") from err
        self.served = self.client.request("/v1/models")["data"][0]["id"]
        self._check_limits()
        self._check_tokenizer(tokenizer)
        self._held: tuple[Rollout, torch.Tensor, torch.Tensor] | None = None
        self.route_index: int | None = None  # one of several teachers: its rows' teacher_index
        # each sequence's answers [its completion tokens, K] (ids, log-probs), by (sequence,
        # completion length): the trainer hands each optimiser step a new selection of the same rows
        self._rows: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(self) -> dict:
        """What a resume must find the same (the run record's `_teacher`): the served model and the
        support, not where it is served (a teacher moved to another host resumes)."""
        return {"class": "ServedTeacher", "model": self.served, "loss_top_k": self.top_k,
                "loss_add_tail": self.tail}

    def _check_limits(self) -> None:
        try:
            info = self.client.request("/server_info?config_format=json", timeout=30) or {}
        except VLLMServerError:
            return  # (no vLLM development routes: the request itself will say)
        limit = ((info.get("vllm_config") or {}).get("model_config") or {}).get("max_logprobs")
        if isinstance(limit, int) and 0 <= limit < self.top_k:
            raise ConfigError(f"loss_top_k={self.top_k} but the teacher server at {self.url} "
                              f"returns at most {limit} log-probs per position: lower loss_top_k "
                              "or restart it with `rlft vllm-serve ... --max-logprobs "
                              f"{self.top_k}`")

    def _check_tokenizer(self, tokenizer) -> None:
        """The served teacher's tokenizer must be the student's: distillation compares next-token
        distributions token id by token id."""
        try:
            served = self.client.request("/tokenize", {"model": self.served, "prompt": PROBE,
                                                       "add_special_tokens": False}, timeout=30)["tokens"]
        except (VLLMServerError, KeyError, TypeError):
            # (no /tokenize route: its answers' ids are still checked against the vocabulary)
            return
        own = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        if list(served) != list(own):
            raise ConfigError(f"the teacher served at {self.url} ({self.served}) tokenizes text "
                              "differently from the student: distillation compares their "
                              "next-token distributions token by token, so both must use the same "
                              "tokenizer")

    # ---- a rollout's answers
    # -------------------------------------------------------------------------
    def support(self, rollout: Rollout, rows, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [n, K] long, the teacher's log-probs there [n, K] float32) at the real completion
        positions of `rows` within the first `width` columns (completion_mask order)."""
        if self._held is None or self._held[0] is not rollout:
            self._held = (rollout, *self._fetch(rollout))
        _, ids, logps = self._held
        mask = rollout.completion_mask[rows, :width].bool()
        return ids[rows, :width][mask], logps[rows, :width][mask]

    def _fetch(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, C, K] ids and log-probs for every row (K = loss_top_k + 1: the sampled token may be
        outside the top k); rows already answered (the same tokens in another selection of a
        rollout) are not asked again. One of several teachers (`route_index` set) asks only for the
        rows routed to it."""
        rows, width = rollout.completion_ids.shape
        mine = range(rows) if self.route_index is None or rollout.teacher_index is None else \
            (rollout.teacher_index == self.route_index).nonzero().flatten().tolist()
        sequences = [self._sequence(rollout, b) if b in mine else ([], []) for b in range(rows)]
        keys = [(tuple(sequence), len(columns)) for sequence, columns in sequences]
        if len(self._rows) > 4 * rows:  # answers of earlier rollouts: not asked for again
            self._rows = {key: self._rows[key] for key in keys if key in self._rows}
        for key in keys:
            if key[1] == 0:  # no completion token: nothing to ask
                self._rows[key] = self._parse([], 0, 0)
        missing = list(dict.fromkeys(key for key in keys if key not in self._rows))
        with ThreadPoolExecutor(max_workers=16) as pool:
            answers = list(pool.map(self._ask, [list(sequence) for sequence, _ in missing]))
        for (sequence, count), answer in zip(missing, answers):
            self._rows[(sequence, count)] = self._parse(answer, len(sequence) - count, count)
        ids = torch.full((rows, width, self.top_k + 1), -1, dtype=torch.long)
        logps = torch.zeros(ids.shape, dtype=torch.float32)
        for b, (key, (_, columns)) in enumerate(zip(keys, sequences)):
            ids[b, columns], logps[b, columns] = self._rows[key]
        device = rollout.completion_ids.device
        return ids.to(device), logps.to(device)

    def _parse(self, answer: list, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[count, K] ids (-1 padding) and log-probs at the `count` places from `start` of an
        answer."""
        ids = torch.full((count, self.top_k + 1), -1, dtype=torch.long)
        logps = torch.zeros(ids.shape, dtype=torch.float32)
        for place in range(count):
            entries = _entries(answer, start + place, self.url, self.top_k + 1)
            ids[place, :len(entries)] = torch.tensor([token for token, _ in entries])
            logps[place, :len(entries)] = torch.tensor([value for _, value in entries])
        return ids, logps

    @staticmethod
    def _sequence(rollout: Rollout, b: int) -> tuple[list[int], list[int]]:
        """Row b as the student scores it: its real prompt tokens then its real completion tokens,
        and the completion columns those are."""
        prompt = rollout.prompt_ids[b][rollout.prompt_mask[b].bool()].tolist()
        columns = rollout.completion_mask[b].nonzero().flatten().tolist()
        return prompt + rollout.completion_ids[b, columns].tolist(), columns

    def _ask(self, sequence: list[int]) -> list:
        body = {"model": self.served, "prompt": sequence, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": self.top_k}
        return self.client.request("/v1/completions", body)["choices"][0].get("prompt_logprobs") or []


def _entries(answer: list, place: int, url: str, limit: int) -> list[tuple[int, float]]:
    """[(token id, log-prob)] at one place of a prompt_logprobs answer, most likely first (at most
    `limit`)."""
    found = answer[place] if place < len(answer) else None
    if not found:
        raise VLLMServerError(f"the teacher server at {url} answered no prompt log-probs at "
                              f"position {place}: is it a vLLM server started by `rlft "
                              "vllm-serve`?")
    ranked = sorted(found.items(), key=lambda item: item[1].get("rank") or 0)
    return [(int(token), float(entry["logprob"])) for token, entry in ranked][:limit]
