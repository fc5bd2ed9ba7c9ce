"""`layerline plan`: which layout (or none) to run a model on, predicted and explained; `--calibrate`
measures this machine for it, `--check` sets its predictions beside local clusters measured."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from layerline.shared.settings import DTYPES

from .support import CommandError, HelpFormatter, Subcommands, reported_as_errors

EMITS = ("up", "compose", "k8s")


def _positive(kind: type[int] | type[float], flag: str) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{flag} {text} must be above 0")
        return value

    return parse


def _log(message: str) -> None:
    print(f"[plan] {message}", file=sys.stderr, flush=True)


def _profile_path(args: argparse.Namespace) -> Path:
    from layerline.plan.profile import default_profile_path

    return args.profile or default_profile_path()


def _run_calibrate(args: argparse.Namespace) -> int:
    from layerline.model_store import ModelStoreError, resolve_model
    from layerline.plan.calibrate import calibrate

    with reported_as_errors(ModelStoreError, RuntimeError, TimeoutError):
        profile = calibrate(resolve_model("smollm2-135m-instruct"), port=args.port, log=_log)
    path = _profile_path(args)
    profile.save(path)
    print(path, flush=True)
    return 0


def _run_check(args: argparse.Namespace) -> int:
    from layerline.model_store import ModelStoreError, resolve_model
    from layerline.plan.calibrate import calibrate
    from layerline.plan.check import check_table, run_check

    with reported_as_errors(ModelStoreError, RuntimeError, TimeoutError):
        checkpoint = resolve_model("smollm2-135m-instruct")
        _log("calibrating first: the predictions come from this run's profile ...")
        profile = calibrate(checkpoint, port=args.port + 10, log=_log)
        profile.save(_profile_path(args))
        rows = run_check(
            checkpoint,
            profile,
            dtype=args.dtype or "float32",
            new_tokens=args.new_tokens,
            concurrency=args.concurrency,
            rounds=args.rounds,
            port=args.port,
            log=_log,
        )
    print(f"CPU: {profile.cpu}, {profile.cores} cores; profile saved to {_profile_path(args)}")
    print(check_table(rows, concurrency=args.concurrency), end="")
    return 0 if all(r.within for r in rows) else 1


def _run_plan(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _run_calibrate(args)
    if args.check:
        return _run_check(args)
    from layerline.plan.emit import compose_text, k8s_text, up_text
    from layerline.plan.hardware import CPU, SpecError, parse_devices, parse_links
    from layerline.plan.predict import Machine, Workload
    from layerline.plan.profile import MachineProfile, ProfileError
    from layerline.plan.recommend import Target, make_plan, plan_json, plan_table
    from layerline.plan.shapes import load_model_config
    from layerline.shared.model_config import ConfigError

    with reported_as_errors(SpecError, ProfileError, ConfigError):
        name, config = load_model_config(args.model)
        nodes = parse_devices(args.devices)
        intra, inter = parse_links(args.links, nodes)
        cpu = nodes[0].device == CPU
        profile = MachineProfile.load(_profile_path(args)) if cpu else None
        dtype = args.dtype or ("float32" if cpu else "bfloat16")
        if profile is not None and dtype not in profile.matmul_flops:
            raise ProfileError(
                f"--dtype {dtype}: this machine's profile measured only {', '.join(profile.matmul_flops)}"
            )
        if args.context > config.max_position_embeddings:
            raise ConfigError(
                f"--context {args.context} is longer than the model's max_position_embeddings = "
                f"{config.max_position_embeddings}"
            )
        machine = Machine(nodes[0].device, len(nodes), nodes[0].count, intra, inter, profile)
        prompt = min(args.prompt_tokens, args.context)
        work = Workload(dtype, args.context, args.concurrency, prompt)
        plan = make_plan(name, config, machine, work, Target(args.target_latency, args.target_throughput))
    if args.emit:
        if plan.recommended is None:
            raise CommandError(f"nothing to emit: {plan.reason}")
        layout, model, kv = plan.recommended.layout, args.model, plan.recommended.kv_per_rank
        if args.emit == "up":
            if not cpu or len(nodes) > 1:
                raise CommandError(
                    "--emit up starts stages on this machine's CPU: for GPUs or several hosts use --emit compose or k8s"
                )
            text = up_text(model, layout, dtype=dtype, kv_bytes=kv)
        elif args.emit == "compose":
            text = compose_text(model, layout, dtype=dtype, gpu=not cpu, kv_bytes=kv)
        else:
            text = k8s_text(model, layout, dtype=dtype, gpu=not cpu, kv_bytes=kv)
        print(text, end="")
        return 0
    if args.json:
        print(json.dumps(plan_json(plan), indent=2))
    else:
        print(plan_table(plan), end="")
    return 0


def add_plan_commands(commands: Subcommands) -> None:
    """`layerline plan`."""
    from layerline.plan.hardware import CATALOG, LINKS
    from layerline.plan.shapes import known_configs

    devices = ", ".join(d.name for d in CATALOG.values())
    p = commands.add_parser(
        "plan",
        help="which layout (tp x pp x dp, or none) to run a model on, predicted and explained",
        description="Predict, for every layout the devices can hold (tensor parallel ranks x pipeline "
        "stages x replicas), the memory per device, decode tokens/s of one stream and of --concurrency "
        "streams, the first token of a prompt, the pipeline bubble and the bytes each link carries per "
        "token; recommend one, with its reason (possibly: do not distribute). GPUs come from a built-in "
        "catalog of datasheet figures; `cpu` is this machine as `--calibrate` measured it. `--check` "
        "measures local clusters beside the predictions.",
        epilog=f"devices: {devices}, cpu\nlinks: {', '.join(LINKS)}, or RATE:LATENCY (1gbit:5ms)\n"
        f"models by name: {', '.join(known_configs())}",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        metavar="M",
        help="a known name, a checkpoint directory or a bare config.json (no weights needed) "
        "(default: smollm2-135m-instruct)",
    )
    p.add_argument(
        "--devices",
        default="cpu",
        metavar="SPEC",
        help="COUNTxNAME per node, comma-separated: 2xH100 is one node of two, 4xL4,4xL4 two nodes; "
        "cpu is this machine, cpu,cpu two hosts like it (default: cpu)",
    )
    p.add_argument(
        "--links",
        metavar="SPEC",
        help="INTRA[,INTER]: the link between devices of a node and between nodes, each a name or "
        "RATE:LATENCY; one link alone with several nodes is the one between them "
        "(default: the device's own, eth100 between GPU nodes, eth10 between CPU hosts)",
    )
    p.add_argument(
        "--dtype", choices=DTYPES, help="weights and activations (default: float32 on cpu, bfloat16 on GPUs)"
    )
    p.add_argument(
        "--context",
        type=_positive(int, "--context"),
        default=2048,
        metavar="N",
        help="tokens each sequence's KV cache holds, prompt and answer (default: 2048)",
    )
    p.add_argument(
        "--concurrency",
        type=_positive(int, "--concurrency"),
        default=8,
        metavar="C",
        help="sequences at once, over all replicas (default: 8)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=_positive(int, "--prompt-tokens"),
        default=512,
        metavar="N",
        help="the prompt whose first-token time is predicted (default: 512, at most --context)",
    )
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--target-latency",
        type=_positive(float, "--target-latency"),
        metavar="MS",
        help="the most time between two tokens of one stream: the fewest devices that meet it win",
    )
    target.add_argument(
        "--target-throughput",
        type=_positive(float, "--target-throughput"),
        metavar="TOK_S",
        help="the least tokens/s of all --concurrency streams together: the fewest devices that meet it win",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON: layouts, recommended, reason")
    p.add_argument(
        "--emit",
        choices=EMITS,
        help="print what runs the recommended layout: a `layerline up` command (one machine), a compose "
        "file or Kubernetes manifests",
    )
    p.add_argument(
        "--profile", type=Path, metavar="FILE", help="this machine's profile (default: plan-profile.json in the cache)"
    )
    modes = p.add_argument_group("measuring")
    modes.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (memory bandwidth, matmul rates per dtype and row count, a layer's "
        "fixed time, all-reduce, layerline's step and hop on local clusters of the embedded model) and "
        "save the profile; takes a few minutes",
    )
    modes.add_argument(
        "--check",
        action="store_true",
        help="calibrate (and save the profile), then start local clusters of the embedded model (1, 2, 3 "
        "stages, 2 replicas, tp 3) and, as root, a 2-stage chain across 1 ms and 5 ms links between two test "
        "hosts (network namespaces), measure them in interleaved rounds and print each prediction beside its "
        "measurement; exit 1 unless all are within 25%%",
    )
    modes.add_argument(
        "--rounds",
        type=_positive(int, "--rounds"),
        default=3,
        metavar="N",
        help="--check: medians of N rounds (default: 3)",
    )
    modes.add_argument(
        "--new-tokens",
        type=_positive(int, "--new-tokens"),
        default=48,
        metavar="N",
        help="--check: tokens per stream (default: 48)",
    )
    modes.add_argument(
        "--port",
        type=int,
        default=7620,
        metavar="P",
        help="--check: the local clusters' coordinators use P to P+4, the calibration's P+11 and P+12 "
        "(--calibrate alone: P+1 and P+2) (default: 7620)",
    )
    p.set_defaults(handler=_run_plan)
