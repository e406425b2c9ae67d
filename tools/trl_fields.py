"""Write rlft/trl_fields.json: every field name of TRL's GRPOConfig, RewardConfig and DistillationConfig
(which include transformers' TrainingArguments) with its default, so rlft accepts a TRL config's names.

    pip install -e ".[bench]" && python tools/trl_fields.py

Only names and defaults are recorded (no TRL code); rlft/config/compat.py reads the file.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path

import transformers
import trl

OUT = Path(__file__).resolve().parents[1] / "rlft" / "trl_fields.json"


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        value = None
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        json.dumps(value)
    except TypeError:
        value = repr(value)
    return value


def main() -> None:
    table = {"trl_version": trl.__version__, "transformers_version": transformers.__version__}
    for name in ("GRPOConfig", "RewardConfig", "DistillationConfig"):
        table[name] = {f.name: _default(f) for f in dataclasses.fields(getattr(trl, name)) if f.init}
    OUT.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{OUT}: " + ", ".join(f"{len(table[k])} {k}" for k in ("GRPOConfig", "RewardConfig",
                                                                     "DistillationConfig")) + " fields")


if __name__ == "__main__":
    main()
