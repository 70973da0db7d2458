"""``tessera`` command line: generate | serve | bench | router | kernels | worker (a rank process of a layout).

Each subcommand's module registers its own flags; this file only wires them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from tessera.engine.arg_utils import add_engine_args, engine_config_from_args


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", dest="sampling_seed", type=int, default=None)
    group.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")


def _generate(args: argparse.Namespace) -> int:
    from tessera.entrypoints.llm import LLM
    from tessera.sampling_params import SamplingParams

    config = engine_config_from_args(args, model=args.model)
    llm = LLM(**config.model_dump())
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": prompt}] for prompt in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for prompt, output in zip(args.prompt, outputs, strict=True):
        completion = output.outputs[0].text
        print(completion if args.chat else prompt + completion, flush=True)
    return 0


def _kernels(args: argparse.Namespace) -> int:
    from tessera.kernels import report  # imports torch: not for the other subcommands' start

    return report.run(json_output=args.json, forget=args.forget)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Run LLMs across many accelerators.")
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="generate text offline with the engine")
    generate.add_argument("model", help="alias (smollm2-135m-instruct), Hugging Face folder, or .gguf file")
    generate.add_argument("prompt", nargs="+", help="one or more prompts")
    add_engine_args(generate)
    _add_sampling_args(generate)
    generate.set_defaults(handler=_generate)

    kernels = sub.add_parser(
        "kernels", help="the CPU kernel build and the GEMM backend chosen per weight shape"
    )
    kernels.add_argument("--json", action="store_true", help="the report as JSON")
    kernels.add_argument(
        "--forget", action="store_true", help="delete the recorded GEMM verdicts (re-measured on load)"
    )
    kernels.set_defaults(handler=_kernels)

    for register in _optional_subcommands():
        register(sub)
    return parser


def _optional_subcommands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Subcommands that live beside their code (serving, benchmarks, workers)."""
    registrars = []
    for module_name in (
        "tessera.entrypoints.serve_command",
        "tessera.bench.cli",
        "tessera.router.cli",
        "tessera.entrypoints.drain",
        "tessera.worker.worker_proc",
        "tessera.models.shared_cache",
    ):
        try:
            module = __import__(module_name, fromlist=["register_cli"])
        except ImportError as exc:
            if exc.name and exc.name.startswith("tessera"):
                continue
            raise
        registrars.append(module.register_cli)
    return registrars


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
