"""rlft's exceptions share one base, so a caller can catch every error rlft raises about its input
or run.

Each specific class also keeps the built-in base it had (ValueError, RuntimeError), so code written
against those still catches them. Modules raise the classes defined here; a few keep a local name
for an old import path.
"""


class RlftError(Exception):
    """Base of every rlft error; the message says what was wrong, where, and what to do."""


class ConfigError(RlftError, ValueError):
    """A configuration value that cannot work; the message says which field and what to do."""


class OutputDirBusyError(RlftError, RuntimeError):
    """Another training run holds the output_dir (its lock, rlft/train/run/runs.py); the message
    names its process and what to do."""


class NonFiniteError(RlftError, RuntimeError):
    """Too many consecutive optimiser steps with an inf/NaN loss or gradient norm (GRPO and reward
    training alike: each such step is skipped, and `max_nonfinite_steps` in a row stop the run)."""


# The names each trainer raised before there was one class; `except NonFiniteLossError` keeps
# working.
NonFiniteStepError = NonFiniteLossError = NonFiniteError
