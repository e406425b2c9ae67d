"""Where a batch of prompts gets its completions: the rollout engine, the tool loop around it
(`tools=`), environments (`environment_factory=`) or the user's `rollout_func` (TRL's names;
docs/agents.md).

`setup_tools` decides, before any prompt is rendered, what the prompts carry (tool schemas) and
which reward functions environments add; `Generation` is the one call a rollout source makes:
`generation(prompts, count, greedy) -> Rollout`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from rlft.data.prompts import DatasetError, load_dataset_any, render_prompt
from rlft.errors import ConfigError
from rlft.rollout import make_generator
from rlft.rollout.base import Rollout, holds_own_weights
from rlft.rollout.environments import Environments, function_rollout
from rlft.rollout.hf import eos_token_ids
from rlft.rollout.multiturn import ToolLoop, Toolset
from rlft.rollout.tools import check_template, tool_schemas


def import_tools(names: list[str] | str) -> list:
    """Config `tools`: "module:function" names -> the functions."""
    tools = []
    for name in [names] if isinstance(names, str) else names:
        module, _, attr = str(name).partition(":")
        try:
            tools.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError, ValueError) as err:
            raise ConfigError(f"tools entry {name!r} could not be imported ({err}); "
                              "write 'module.path:function'") from err
    return tools


def streaming_settings(args) -> None:
    """A streamed (iterable) train set is read by every process, each keeping its own rows, in one
    thread: the settings say so, as TRL's do (`dispatch_batches=False`, no dataloader workers that
    would split the groups)."""
    if args.accelerator_config.dispatch_batches:
        raise ConfigError("Iterable datasets require `dispatch_batches=False`: every process reads "
                          "the stream and keeps its own rows (dispatching from the main process is "
                          "not supported); remove accelerator_config.dispatch_batches or set it to "
                          "false")
    args.accelerator_config.dispatch_batches = False
    args.dataloader_num_workers = 0


@dataclass
class ToolSetup:
    """What tools and environments decide before the prompts are rendered."""

    # every tool the policy may call (environments' methods too)
    tools: list = field(default_factory=list)
    environments: Environments | None = None
    env_tools: dict = field(default_factory=dict)  # TRL's `_env_tools`: each environment's tools
    template_kwargs: dict = field(default_factory=dict)  # rendered into every prompt (tool schemas)
    toolset: Toolset | None = None
    # environments that own their reward, as reward functions
    rewards: list = field(default_factory=list)


def setup_tools(args, tokenizer, tools, environment_factory, rollout_func) -> ToolSetup:
    """`tools=` (and the config's `tools`), `environment_factory=` or `rollout_func=` (alone)."""
    tools = import_tools(args.tools) + list(tools or [])
    if rollout_func is not None and (tools or environment_factory is not None):
        raise ConfigError("rollout_func replaces generation, tools and environments: pass "
                          "rollout_func alone")
    if rollout_func is not None and not callable(rollout_func):
        raise ConfigError(f"rollout_func must be callable, got {rollout_func!r}")
    setup = ToolSetup(tools=list(tools), template_kwargs=dict(args.chat_template_kwargs or {}))
    # TRL's: every environment's tools once, and each environment's own
    if environment_factory is not None:
        setup.environments = Environments(environment_factory, tools)
        setup.env_tools = dict(setup.environments.tools_of)
        for methods in setup.env_tools.values():
            setup.tools += [m for m in methods if m.__name__ not in {t.__name__ for t in setup.tools}]
    if not (tools or setup.environments):
        return setup
    check_template(tokenizer, args.chat_template_kwargs)
    schemas = setup.environments.all_schemas if setup.environments else tool_schemas(tools)
    setup.template_kwargs["tools"] = schemas or None  # rendered into every prompt, as TRL does
    setup.toolset = Toolset({t.__name__: t for t in tools}, schemas)
    setup.rewards = setup.environments.reward_functions() if setup.environments else []
    return setup


def environment_data(args, train_dataset, environments: Environments | None, completions_total: int):
    """TRL's: with environments the data may be the environments' own. No train_dataset (one
    environment, max_steps set): one generation round of empty prompts, cycled; a row without
    `prompt` gets an empty user message that the environment's reset() fills."""
    import datasets

    empty = [{"role": "user", "content": ""}]
    if train_dataset is None and environments is not None:
        if environments.multi:
            raise ConfigError("a dict environment_factory (several environments) requires a "
                              "`train_dataset` with an `environment` column routing each row; give "
                              "one, or pass a single factory")
        if args.max_steps <= 0:
            raise ConfigError("without a train_dataset (the environment returns the prompt from "
                              "reset()), set max_steps > 0: it sets the length of the run")
        rows = max(completions_total // args.num_generations, 1)
        return load_dataset_any([{"prompt": empty} for _ in range(rows)])
    dataset = load_dataset_any(train_dataset)
    if isinstance(dataset, datasets.IterableDataset):
        streaming_settings(args)
    if environments is not None and "prompt" not in dataset.column_names:
        if isinstance(dataset, datasets.IterableDataset):
            return dataset.map(lambda row: {**row, "prompt": empty})
        return dataset.add_column("prompt", [empty] * len(dataset))
    return dataset


def check_chat_prompts(prompts, setup: ToolSetup) -> None:
    if (setup.tools or setup.environments) and isinstance(prompts.rows[0]["prompt"], str):
        raise DatasetError("tools and environments need chat prompts (a list of messages per row): "
                           "the tool schemas and tool messages are rendered by the chat template")


def rollout_engine(args, tokenizer, model, source, training_engine, setup: ToolSetup):
    """The engine the config asks for (generate, vLLM colocated or a server), in a tool loop when
    the policy calls tools."""
    engine = make_generator(args, tokenizer, model, source, synced=training_engine.sharded,
                            full_weights=training_engine.full_weights)
    if not (setup.tools or setup.environments):
        return engine
    return ToolLoop(engine, tokenizer, setup.toolset, args.max_completion_length,
                    args.max_tool_calling_iterations, args.tool_call_timeout, args.chat_template_kwargs)


class Generation:
    """`count` completions per prompt of a PromptSet batch, rows in groups: from
    `rollout_func(prompts)` when given, else from `engine` (settable: `trainer.generator`), each row
    with its own environment when there are environments."""

    def __init__(self, engine, model, tokenizer, args, device, training_engine, setup: ToolSetup,
                 rollout_func: Callable[[list], dict] | None = None):
        self.engine, self.model, self.tokenizer, self.args = engine, model, tokenizer, args
        self.device, self.training_engine, self.setup = device, training_engine, setup
        self.rollout_func = rollout_func

    def context(self):
        """FSDP2 gathers every layer for generate; a vLLM engine never runs the policy's forward
        (its weight sync makes the weights whole itself), so it is spared holding the whole policy
        for the rollout."""
        if self.rollout_func is None and holds_own_weights(self.engine):
            return contextlib.nullcontext()
        return self.training_engine.for_generation(self.model)

    def __call__(self, prompts: dict, count: int, greedy: bool = False) -> Rollout:
        with self.context():
            if self.rollout_func is not None:
                eos_ids = eos_token_ids(self.model, self.tokenizer)
                return function_rollout(self.rollout_func, prompts["prompts"], count, eos_ids,
                                        self.tokenizer.pad_token_id, self.args.max_completion_length,
                                        self.device)
            if self.setup.environments is None:
                return self.engine(self.model, prompts["prompt_ids"], count, greedy)
            return self._with_environments(prompts, count, greedy)

    def _with_environments(self, prompts: dict, count: int, greedy: bool) -> Rollout:
        ids, envs, toolsets = environment_rows(self.setup, self.tokenizer, prompts, count)
        rollout = self.engine(self.model, ids, 1, greedy, toolsets=toolsets)
        rollout.extra["environments"] = envs
        return rollout


def environment_rows(setup: ToolSetup, tokenizer, prompts: dict, count: int, lane: int = 0):
    """Each completion row's environment (from `lane`, Environments.take), reset with its dataset row:
    (the rows' prompt ids, each rendered with its environment's tools and what reset returned; the
    instances; their toolsets)."""
    environments = setup.environments
    columns = [k for k in prompts if k not in ("prompts", "prompt_ids")]
    rows = [{"prompt": p, **{c: prompts[c][i] for c in columns}}
            for i, p in enumerate(prompts["prompts"]) for _ in range(count)]
    names = environments.names(rows)
    envs = environments.take(names, lane)
    texts = [render_prompt(p, tokenizer, i, {**setup.template_kwargs,
                                             "tools": environments.schemas[name] or None})
             for i, (p, name) in enumerate(zip(environments.reset(envs, rows), names))]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return ids, envs, [environments.toolset(e, n) for e, n in zip(envs, names)]
