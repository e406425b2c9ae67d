"""A pytest plugin that measures how close every tolerance comparison in the suite comes to failing.

    RLFT_TOLERANCE_AUDIT=audit.json pytest -p tools.tolerance_audit [pytest args]

Each `torch.allclose`, `torch.testing.assert_close` and `pytest.approx` comparison made while a test runs is
recorded as its margin: max |actual - expected| / (atol + rtol |expected|) over the elements (1.0 is the
edge of failing; 0 is equal). The JSON written at the end holds, per comparing line of a test file, the
largest margin seen and the test that saw it. Run it under settings that move float32 rounding (another
kernel width: ATEN_CPU_CAPABILITY=avx2; another thread count: OMP_NUM_THREADS=1) and compare: a comparison
whose margin is near 1 anywhere is machine-dependent and must compare in float64 or state its bound
(tests/helpers.py: the float64 helpers).
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

_CURRENT: list[str] = [""]
_WORST: dict[str, dict] = {}


def _site() -> str:
    """file:line of the test code that made the comparison (the first frame under tests/)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if f"{os.sep}tests{os.sep}" in name and "tolerance_audit" not in name:
            return f"{os.path.relpath(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _record(margin: float) -> None:
    if not math.isfinite(margin) and margin == margin:
        margin = 1e30
    site = _site()
    seen = _WORST.get(site)
    if seen is None or margin > seen["margin"]:
        _WORST[site] = {"margin": margin, "test": _CURRENT[0]}


def _tensor_margin(actual, expected, rtol: float, atol: float) -> float:
    try:
        a = torch.as_tensor(actual).detach().to("cpu", torch.float64)
        b = torch.as_tensor(expected).detach().to("cpu", torch.float64)
        a, b = torch.broadcast_tensors(a, b)
    except (TypeError, RuntimeError, ValueError):
        return 0.0
    if a.numel() == 0:
        return 0.0
    both = torch.isfinite(a) & torch.isfinite(b)
    diff = (a - b).abs()[both]
    allowed = (atol + rtol * b.abs())[both]
    if diff.numel() == 0:
        return 0.0
    ratio = torch.where(allowed > 0, diff / allowed.clamp(min=1e-300), torch.where(diff > 0, math.inf, 0.0))
    return float(ratio.max())


def _install() -> None:
    allclose, assert_close = torch.allclose, torch.testing.assert_close

    def audited_allclose(input, other, rtol=1e-5, atol=1e-8, equal_nan=False):
        _record(_tensor_margin(input, other, rtol, atol))
        return allclose(input, other, rtol=rtol, atol=atol, equal_nan=equal_nan)

    def audited_assert_close(actual, expected, *args, rtol=None, atol=None, **kwargs):
        if rtol is not None and atol is not None:
            _record(_tensor_margin(actual, expected, rtol, atol))
        return assert_close(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)

    torch.allclose, torch.testing.assert_close = audited_allclose, audited_assert_close

    try:
        from _pytest.approx import ApproxScalar
    except ImportError:  # pytest < 9
        from _pytest.python_api import ApproxScalar

    equal = ApproxScalar.__eq__

    def audited_eq(self, actual):
        try:
            allowed, expected = float(self.tolerance), float(self.expected)
            diff = abs(float(actual) - expected)
            if math.isfinite(diff):
                _record(diff / allowed if allowed > 0 else (math.inf if diff > 0 else 0.0))
        except (TypeError, ValueError, OverflowError):
            pass
        return equal(self, actual)

    ApproxScalar.__eq__ = audited_eq


def pytest_configure(config):
    if os.environ.get("RLFT_TOLERANCE_AUDIT"):
        _install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _CURRENT[0] = item.nodeid
    yield


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("RLFT_TOLERANCE_AUDIT")
    if out:
        ordered = dict(sorted(_WORST.items(), key=lambda kv: -kv[1]["margin"]))
        with open(out, "w") as handle:
            json.dump(ordered, handle, indent=1)
