"""`FIELD_HELP`: the one-line help of every field rlft declares, read back from the dataclasses (a
read-only view; the text itself sits beside each field's default, in `field(metadata={"help":
...})`).

The classes read are those the command line parses and their siblings: every kind's config
(rlft/kinds.py; rlft/config/common.py, rlft/config/grpo_fields.py), `ModelConfig` and the scripts'
arguments. Fields of transformers' TrainingArguments that rlft does not declare keep transformers'
help and are not listed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from transformers import TrainingArguments

from rlft.cli.recipes import GRPOScriptArguments, RewardScriptArguments
from rlft.config.model_config import ModelConfig
from rlft.kinds import KINDS, load

HELP_CLASSES = (*dict.fromkeys(load(kind.config) for kind in KINDS.values()), ModelConfig,
                GRPOScriptArguments, RewardScriptArguments)


def declared_help(*classes: type) -> dict[str, str]:
    """name -> help (as argparse prints it: "%%" read as "%") for each field of `classes` that rlft
    declares; where two classes declare a name, the first one's."""
    transformers_own = TrainingArguments.__dataclass_fields__
    found: dict[str, str] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            text = f.metadata.get("help")
            if text and f is not transformers_own.get(f.name):
                found.setdefault(f.name, text.replace("%%", "%"))
    return found


FIELD_HELP: Mapping[str, str] = MappingProxyType(declared_help(*HELP_CLASSES))
