"""Where a GRPO rollout comes from: the engine, the tool loop around it (`tools=`, `environment_factory=`) or
the user's `rollout_func` (TRL's names; docs/agents.md). Mixed into GRPOTrainer."""

from __future__ import annotations

import contextlib
import importlib

from rlft.data.prompts import DatasetError, load_dataset_any, render_prompt
from rlft.errors import ConfigError
from rlft.rollout import make_generator
from rlft.rollout.base import holds_own_weights
from rlft.rollout.environments import Environments, function_rollout
from rlft.rollout.hf import Rollout, eos_token_ids
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
    """A streamed (iterable) train set is read by every process, each keeping its own rows, in one thread: the
    settings say so, as TRL's do (`dispatch_batches=False`, no dataloader workers that would split the
    groups)."""
    if args.accelerator_config.dispatch_batches:
        raise ConfigError("Iterable datasets require `dispatch_batches=False`: every process reads the "
                          "stream and keeps its own rows (dispatching from the main process is not "
                          "supported); remove accelerator_config.dispatch_batches or set it to false")
    args.accelerator_config.dispatch_batches = False
    args.dataloader_num_workers = 0


class RolloutSource:
    """Uses the trainer's args, tokenizer, accelerator, engine and model."""

    def _setup_tools(self, tools, environment_factory, rollout_func) -> list:
        """Before the prompts are rendered: tools and environments decide how. Returns the environment's
        reward function when it owns one (added to reward_funcs with weight 1, as TRL does)."""
        args = self.args
        tools = import_tools(args.tools) + list(tools or [])
        if rollout_func is not None and (tools or environment_factory is not None):
            raise ConfigError("rollout_func replaces generation, tools and environments: "
                              "pass rollout_func alone")
        if rollout_func is not None and not callable(rollout_func):
            raise ConfigError(f"rollout_func must be callable, got {rollout_func!r}")
        self.rollout_func, self.tools = rollout_func, tools
        self.environments = None if environment_factory is None else Environments(environment_factory, tools)
        if self.environments is not None:  # TRL's: every environment's tools once, and each environment's own
            self._env_tools = dict(self.environments.tools_of)
            self.tools = list(tools)
            for methods in self._env_tools.values():
                self.tools += [m for m in methods if m.__name__ not in {t.__name__ for t in self.tools}]
        self._template_kwargs = dict(args.chat_template_kwargs or {})
        if not (tools or self.environments):
            return []
        check_template(self.tokenizer, args.chat_template_kwargs)
        schemas = self.environments.all_schemas if self.environments else tool_schemas(tools)
        self._template_kwargs["tools"] = schemas or None  # rendered into every prompt, as TRL does
        self._toolset = Toolset({t.__name__: t for t in tools}, schemas)
        return self.environments.reward_functions() if self.environments else []

    def _environment_data(self, train_dataset):
        """TRL's: with environments the data may be the environments' own. No train_dataset (one environment,
        max_steps set): one generation round of empty prompts, cycled; a row without `prompt` gets an empty
        user message that the environment's reset() fills."""
        import datasets

        args, empty = self.args, [{"role": "user", "content": ""}]
        if train_dataset is None and self.environments is not None:
            if self.environments.multi:
                raise ConfigError("a dict environment_factory (several environments) requires a "
                                  "`train_dataset` with an `environment` column routing each row; give one, "
                                  "or pass a single factory")
            if args.max_steps <= 0:
                raise ConfigError("without a train_dataset (the environment returns the prompt from "
                                  "reset()), set max_steps > 0: it sets the length of the run")
            spg = args.steps_per_generation or args.gradient_accumulation_steps
            rows = (args.generation_batch_size
                    or args.per_device_train_batch_size * spg * self.accelerator.num_processes)
            return load_dataset_any([{"prompt": empty} for _ in range(max(rows // args.num_generations, 1))])
        dataset = load_dataset_any(train_dataset)
        if isinstance(dataset, datasets.IterableDataset):
            streaming_settings(args)
        if self.environments is not None and "prompt" not in dataset.column_names:
            if isinstance(dataset, datasets.IterableDataset):
                return dataset.map(lambda row: {**row, "prompt": empty})
            return dataset.add_column("prompt", [empty] * len(dataset))
        return dataset

    def _check_chat_prompts(self, prompts) -> None:
        if (self.tools or self.environments) and isinstance(prompts.rows[0]["prompt"], str):
            raise DatasetError("tools and environments need chat prompts (a list of messages per row): "
                               "the tool schemas and tool messages are rendered by the chat template")

    def _wrap_generator(self, source):
        engine = make_generator(self.args, self.tokenizer, self.accelerator.unwrap_model(self.model), source,
                                synced=self.engine.sharded, full_weights=self.engine.full_weights)
        if not (self.tools or self.environments):
            return engine
        return ToolLoop(engine, self.tokenizer, self._toolset, self.args.max_completion_length,
                        self.args.max_tool_calling_iterations, self.args.tool_call_timeout,
                        self.args.chat_template_kwargs)

    def _generation_context(self):
        """FSDP2 gathers every layer for generate; a vLLM engine never runs the policy's forward (its weight
        sync makes the weights whole itself), so it is spared holding the whole policy for the rollout."""
        if self.rollout_func is None and holds_own_weights(self.generator):
            return contextlib.nullcontext()
        return self.engine.for_generation(self.model)

    def _generate(self, prompts: dict, count: int, greedy: bool = False) -> Rollout:
        """`count` completions per prompt of a PromptSet batch, rows in groups."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        with self._generation_context():
            if self.rollout_func is not None:
                return function_rollout(self.rollout_func, prompts["prompts"], self, count,
                                        eos_token_ids(unwrapped, self.tokenizer), self.tokenizer.pad_token_id,
                                        self.args.max_completion_length, self.accelerator.device)
            if self.environments is None:
                return self.generator(unwrapped, prompts["prompt_ids"], count, greedy)
            columns = [k for k in prompts if k not in ("prompts", "prompt_ids")]
            rows = [{"prompt": p, **{c: prompts[c][i] for c in columns}}
                    for i, p in enumerate(prompts["prompts"]) for _ in range(count)]
            names = self.environments.names(rows)
            envs = self.environments.take(names)
            texts = [render_prompt(p, self.tokenizer, i, {**self._template_kwargs,
                                                          "tools": self.environments.schemas[name] or None})
                     for i, (p, name) in enumerate(zip(self.environments.reset(envs, rows), names))]
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            rollout = self.generator(unwrapped, ids, 1, greedy,
                                     toolsets=[self.environments.toolset(e, n) for e, n in zip(envs, names)])
        rollout.extra["environments"] = envs
        return rollout
