"""rlft/host_memory.py: on a CPU with glibc the trainers fix malloc's mmap threshold, so that a freed activation
goes back to the system even when a long-lived block sits above it; generate runs with the heap, and the
threshold is back after it. Each check runs in its own process (the setting is process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from rlft.host_memory import generation_heap, return_freed_host_memory

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def kept_after_free(mb=8):
        # a block of `mb` MiB freed below a small long-lived one: how much of it the process still holds
        block = torch.ones(mb * 2**18)
        pin = torch.ones(4096)
        before = rss_mb()
        del block
        return before - rss_mb(), pin

    raised = torch.ones(24 * 2**18); del raised  # glibc raises its threshold to 24 MiB on this free
    note = return_freed_host_memory(torch.device(sys.argv[1]))
    again = return_freed_host_memory(torch.device(sys.argv[1]))
    released, pin = kept_after_free()
    with generation_heap():
        released_in_generation, pin2 = kept_after_free()
    released_after, pin3 = kept_after_free()
    print(json.dumps(dict(note=note, again=again, released=released, in_generation=released_in_generation,
                          after=released_after)))
""")


def run(device: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, device], capture_output=True, text=True, check=True,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_on_a_cpu_a_freed_block_goes_back_to_the_system_except_while_generating():
    result = run("cpu")
    assert result["note"].startswith("training on a CPU: glibc's mmap threshold fixed at 64 KiB")
    assert result["again"] is None  # once per process
    assert result["released"] > 7.5 and result["after"] > 7.5  # the 8 MiB block given back at once
    assert result["in_generation"] < 0.5  # generate's blocks stay in the heap for the next token


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_users_own_setting_and_an_accelerator_are_left_alone():
    users, accelerator = run("cpu", MALLOC_MMAP_THRESHOLD_="1048576"), run("meta")
    for result in (users, accelerator):
        assert result["note"] is None and result["again"] is None
    assert accelerator["released"] < 0.5  # glibc's own raised threshold: the freed block stays in the heap
