"""rlft's exceptions share one base, so a caller can catch every error rlft raises about its input or run."""


class RlftError(Exception):
    """Base of every rlft error; the message says what was wrong, where, and what to do."""


class ConfigError(RlftError, ValueError):
    """A configuration value that cannot work; the message says which field and what to do."""
