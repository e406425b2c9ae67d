"""The shape of the package, checked: rlft's modules import each other without a cycle, `rlft/core/` (the pure
formulas) imports nothing else from rlft, the data layer nothing from rollout or training; every exception rlft
defines derives from `RlftError`; no file over 500 lines and no function over 60 (docs/concepts.md)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import rlft
from rlft.errors import RlftError

PACKAGE = Path(rlft.__file__).parent


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """rlft modules `name` imports anywhere in its file (top level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    resolved = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_cycle():
    edges = graph()
    assert len(edges) > 60 and "rlft.train.run.checkpoint" in edges["rlft.train.grpo"] | edges["rlft.train.reward"]
    assert cycles(edges) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_core_imports_nothing_else_from_rlft_and_data_nothing_from_above():
    edges = graph()
    for name, targets in edges.items():
        if name.startswith("rlft.core"):
            assert {t for t in targets if not t.startswith("rlft.core")} == set(), name
        if name.startswith("rlft.data"):
            above = {t for t in targets if t.startswith(("rlft.rollout", "rlft.train", "rlft.trainer"))}
            assert above == set(), name


def test_every_rlft_exception_derives_from_rlft_error():
    classes = {}
    for info in pkgutil.walk_packages(rlft.__path__, "rlft."):
        if info.name.startswith("rlft.assets"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (vLLM) is not installed here
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__.startswith("rlft."):
                classes[f"{cls.__module__}.{cls.__qualname__}"] = cls
    assert len(classes) >= 12
    assert [name for name, cls in classes.items() if not issubclass(cls, RlftError)] == []


def test_no_file_over_500_lines_and_no_function_over_60():
    long_files, long_functions = [], []
    for name, path in modules().items():
        text = path.read_text()
        if text.count("\n") > 500:
            long_files.append(name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long_files == [] and long_functions == []


def test_the_configs_are_literal_classes_and_validation_dispatches_by_class_not_hasattr():
    """`grep "class GRPOConfig"` finds the class; each config checks its own fields (`_check`, chained with
    super()), so validate asks no config which fields it happens to have."""
    source = "\n".join(path.read_text() for path in modules().values())
    for name in ("GRPOConfig", "RLOOConfig", "AsyncGRPOConfig", "RewardConfig", "SFTConfig"):
        assert f"\nclass {name}(" in source, name
    from rlft.config import validate

    checks = Path(inspect.getsourcefile(validate)).read_text()
    assert "def validate(" in checks and "hasattr(" not in checks


def test_the_grpo_trainers_are_compositions_not_overrides():
    """GRPOTrainer has at most two bases (the loop and TRL's surface); every other trainer kind of the GRPO
    family only chooses parts (in its constructor and class attributes): no method of its own but __init__,
    TRL's static helpers (functions of their arguments) and TRL's read-only attributes aside."""
    import rlft
    from rlft.kinds import KINDS, load

    assert len(rlft.GRPOTrainer.__bases__) <= 2
    for kind in KINDS.values():
        trainer = load(kind.trainer)
        if trainer is rlft.GRPOTrainer or not issubclass(trainer, rlft.GRPOTrainer):
            continue
        own = {name for name, value in vars(trainer).items() if inspect.isfunction(value)
               or isinstance(value, classmethod)}
        assert own <= {"__init__"}, (trainer.__name__, own)
        assert len(trainer.__bases__) == 1, trainer.__name__  # no mixin overriding the loop


def test_no_function_under_train_takes_the_trainer():
    """The parts get what they use, not the whole trainer: no parameter named trainer (or owner) under
    rlft/train/."""
    found = []
    for name, path in modules().items():
        if not name.startswith("rlft.train"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                names = [a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]]
                found += [f"{name}:{getattr(node, 'name', 'lambda')}" for a in names if a in ("trainer", "owner")]
    assert found == []


def test_the_rollout_carrier_loses_no_field_on_select_split_and_cat():
    """Every field of a Rollout survives select, split and cat; tensors() / from_tensors() round-trip the saved
    ones (the checkpoint format: prompt_ids, ..., truncated as uint8)."""
    import dataclasses

    import torch

    from rlft.rollout.base import Rollout

    rollout = Rollout(torch.tensor([[0, 5], [6, 7], [8, 9]]), torch.tensor([[0, 1], [1, 1], [1, 1]]),
                      torch.tensor([[1, 2], [3, 0], [4, 5]]), torch.tensor([[1, 1], [1, 0], [1, 1]]),
                      torch.tensor([True, False, True]), torch.rand(3, 2), torch.ones(3, 2, dtype=torch.long),
                      ["a", "b", "c"], {"answer": [1, 2, 3]}, {"tool_calls": torch.tensor([0.0, 1.0, 2.0])})
    parts = rollout.split(2)
    assert [p.row_count() for p in parts] == [2, 1]
    joined = Rollout.cat([parts[1], parts[0]], pad_token_id=0)
    picked = rollout.select([2, 0, 1])
    for field in dataclasses.fields(Rollout):
        a, b = getattr(joined, field.name), getattr(picked, field.name)
        if torch.is_tensor(a):
            assert torch.equal(a, b), field.name
        elif isinstance(a, dict):
            assert {k: v.tolist() if torch.is_tensor(v) else v for k, v in a.items()} == \
                {k: v.tolist() if torch.is_tensor(v) else v for k, v in b.items()}, field.name
        else:
            assert a == b, field.name
    saved = rollout.tensors()
    assert set(saved) == {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated",
                          "sampling_logps", "tool_mask"} and saved["truncated"].dtype == torch.uint8
    back = Rollout.from_tensors(saved)
    assert all(torch.equal(getattr(back, k), getattr(rollout, k)) for k in saved)


# Each layer and what of rlft it may import (besides itself): the arrows of docs/concepts.md's map.
LAYERS = {
    "rlft.config": ("rlft.core", "rlft.errors"),
    "rlft.train.run": ("rlft.config", "rlft.errors"),
    "rlft.model": ("rlft.core", "rlft.config", "rlft.errors", "rlft.quiet"),
    "rlft.rollout": ("rlft.core", "rlft.config", "rlft.data", "rlft.model", "rlft.errors", "rlft.quiet",
                     "rlft.import_utils"),
}


def test_each_layer_imports_only_the_layers_below_it_and_nothing_imports_the_command_line():
    found = []
    for name, targets in graph().items():
        for layer, allowed in LAYERS.items():
            if name == layer or name.startswith(layer + "."):
                found += [f"{name} -> {t}" for t in targets if not t.startswith((layer, *allowed))]
        if not name.startswith("rlft.cli"):
            found += [f"{name} -> {t}" for t in targets if t == "rlft.cli" or t.startswith("rlft.cli.")]
    assert found == []


def test_no_two_modules_share_a_stem_and_no_top_level_config_module():
    """A name says its layer: core/advantages and train/advantages, scoring and train/scorer were one name
    for two things."""
    stems: dict[str, list[str]] = {}
    for name in modules():
        stems.setdefault(name.rpartition(".")[2], []).append(name)
    assert {stem: names for stem, names in stems.items() if len(names) > 1} == {}
    assert [p.name for p in PACKAGE.glob("config_*.py")] == []
    memory = {name for name in modules() if name.startswith("rlft.train") and
              any(t in name for t in ("chunked_mlp", "offload", "host_memory", "selective_checkpoint"))}
    assert memory == set()  # memory techniques rewrite a module: rlft/model/memory/


def test_an_update_varies_by_its_objective_not_by_flags_or_subclasses():
    """The updater takes the objective as a value (rlft/train/update/objectives.py): no trainer carries flags
    saying which objective it runs, and nothing subclasses the updater to change its loss."""
    import inspect

    import rlft.train.update.updater as updater
    from rlft.train.distillation import DistillationTrainer
    from rlft.train.grpo import GRPOTrainer
    from rlft.train.update.distill_objective import DistillationObjective
    from rlft.train.update.objectives import PolicyObjective

    for flag in ("updater_class", "needs_rewards", "teacher_required", "progress_metric"):
        assert not hasattr(GRPOTrainer, flag), flag
    assert GRPOTrainer.objective is PolicyObjective and DistillationTrainer.objective is DistillationObjective
    names = {getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "module", None) or ""
             for node in ast.walk(ast.parse(inspect.getsource(updater)))}
    assert not [name for name in names if "distill" in name.lower()]  # the code, not its docstring
    sources = [p.read_text() for p in PACKAGE.rglob("*.py")]
    assert not any("(PolicyUpdater)" in text for text in sources)
