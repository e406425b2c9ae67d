"""`trim_host_memory` (rlft/model/memory/host_memory.py): on a CPU with glibc, freed heap memory goes back to the
system between decoder layers of a training forward and backward. It is given back (the resident set
shrinks), the trimmer runs once before each layer's forward and once before its backward (not in forwards
without gradient), trims only above its threshold, and changes no value a step computes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from rlft.model.memory import host_memory
from rlft.model.memory.host_memory import HostMemoryTrimmer, decoder_layers, trim_between_layers
from rlft.model.scoring import score_rows
from tests.helpers import assert_same_step, one_step_each
from tests.test_packing import rollout, scores_and_grads, tiny

needs_glibc = pytest.mark.skipif(host_memory.held_free() is None, reason="needs glibc's malloc_trim / mallinfo2")


@needs_glibc
def test_freed_heap_memory_held_by_glibc_goes_back_to_the_system():
    # 100 KB blocks come from glibc's heap (below its 128 KiB mmap threshold); keeping every 8th one pins the
    # heap, so the other 7/8 are freed but stay resident until they are trimmed
    script = textwrap.dedent("""
        import json, os, torch
        from rlft.model.memory.host_memory import HostMemoryTrimmer, held_free

        def resident_mb():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

        high, low = HostMemoryTrimmer(threshold=1 << 40), HostMemoryTrimmer(threshold=256 << 20)
        baseline = low.give_back(), high.give_back()  # the resident set they measure growth from
        blocks = [torch.ones(25_000) for _ in range(4_000)]
        kept = blocks[::8]
        del blocks
        before, free = resident_mb(), held_free()
        print(json.dumps({"free": free, "untouched": high.give_back(), "trimmed": low.give_back(),
                          "baseline": baseline, "before": before, "after": resident_mb(),
                          "again": low.give_back(), "kept": len(kept)}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert run["free"] > 300 << 20
    assert run["baseline"] == [False, False]  # no growth yet
    assert run["untouched"] is False  # below its threshold a trimmer does nothing
    assert run["trimmed"] is True
    assert run["before"] - run["after"] > 250, run  # MB: the freed 7/8 of 400 MB left the resident set
    assert run["again"] is False  # glibc still holds them free, but the resident set has not grown since


@needs_glibc
@pytest.mark.parametrize("lora", [False, True])
def test_the_trimmer_runs_before_each_layers_forward_and_backward_and_changes_no_value(lora):
    model = tiny("qwen2", lora, checkpointing=True)
    r = rollout(384)
    logps, entropy, grads = scores_and_grads(model, r, None)
    layers = decoder_layers(model)
    assert trim_between_layers(model, "cuda", threshold=0) is None  # training elsewhere: no hook at all
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for layer in layers)
    trimmer = trim_between_layers(model, "cpu", threshold=0)  # trims at every call
    assert len(layers) == 2 and all(layer._rlft_trimmer is trimmer for layer in layers)
    assert trim_between_layers(model, "cpu") is None  # installed once
    trimmed_logps, trimmed_entropy, trimmed_grads = scores_and_grads(model, r, None)
    assert trimmer.checks == trimmer.trims == 2 * len(layers)  # before each layer's forward and backward
    assert torch.equal(trimmed_logps, logps) and torch.equal(trimmed_entropy, entropy)
    assert grads.keys() == trimmed_grads.keys() and grads
    assert all(torch.equal(trimmed_grads[name], grad) for name, grad in grads.items())
    with torch.no_grad():  # generation, old-policy and reference scoring: no call
        score_rows(model, r, torch.arange(5))
    assert trimmer.checks == 2 * len(layers)


@needs_glibc
def test_below_the_threshold_the_trimmer_only_checks():
    model = tiny("llama", False, checkpointing=False)
    trimmer = trim_between_layers(model, "cpu", threshold=1 << 60)
    scores_and_grads(model, rollout(384), "prompts")
    assert trimmer.checks == 2 * len(decoder_layers(model)) and trimmer.trims == 0
    assert HostMemoryTrimmer().threshold == host_memory.THRESHOLD


def test_a_grpo_step_installs_the_trimmer_by_default_and_is_the_same_step(tmp_path, tiny_causal_dir):
    off, on = one_step_each(tmp_path, tiny_causal_dir, "trim_host_memory", (False, True))
    assert_same_step(off, on)
    assert not any(hasattr(layer, "_rlft_trimmer") for layer in decoder_layers(off.model))
    trimmers = {getattr(layer, "_rlft_trimmer", None) for layer in decoder_layers(on.model)}
    if host_memory.held_free() is not None:
        (trimmer,) = trimmers
        assert trimmer.checks > 0 and trimmer.trims == 0  # a tiny model's heap never holds 256 MiB free
