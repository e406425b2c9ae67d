"""Third-party noise that rlft itself triggers, silenced unless asked for (`--verbose` or
RLFT_VERBOSE=1).

- Progress bars of transformers (loading and writing weights), datasets (preparing splits) and
  huggingface_hub: off for the `rlft` command, which prints its own progress; a Python caller's
  settings are left alone.
- Deprecation warnings raised inside a library by a call rlft makes, that the user cannot act on
  (peft's `get_peft_model` reads transformers' deprecated `is_gradient_checkpointing`): filtered
  around that one call, by message, everywhere.
- vLLM's INFO logging (dozens of lines per engine start): WARNING and above, for the `rlft` command.
"""

from __future__ import annotations

import contextlib
import os
import warnings

VERBOSE_ENV = "RLFT_VERBOSE"
# (category, message regex) of warnings a library raises from inside a call rlft makes
KNOWN_NOISE = ((FutureWarning, r"`is_gradient_checkpointing` is deprecated"),)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


@contextlib.contextmanager
def known_noise():
    """Around a third-party call: its KNOWN_NOISE warnings are not shown (unless verbose)."""
    if verbose():
        yield
        return
    with warnings.catch_warnings():
        for category, message in KNOWN_NOISE:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def quiet_command_line(verbose_flag: bool) -> None:
    """For the `rlft` command: progress bars and vLLM's INFO lines off, unless --verbose /
    RLFT_VERBOSE."""
    if verbose_flag:
        os.environ[VERBOSE_ENV] = "1"
    if verbose():
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        # what DeepSpeed would detect, said up front: it warns "Setting accelerator to CPU" when it
        # has to guess
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import datasets
    import huggingface_hub.utils
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
