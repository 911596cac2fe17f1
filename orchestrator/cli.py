"""`archipelago` command line: run, plan, config show/docs, serve, export, bench, data prepare.

What a command produces (the config YAML, the reference page, the final summary, the
progress line) goes to stdout; everything else is logged (`archipelago.orchestrator.logs`), to stderr,
at the level `-v`/`-q` choose.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from . import library
from .config_load import (
    ConfigError,
    check_extras,
    check_folders,
    check_task_spec,
    dump_config,
    load_config,
)
from .logs import LogFormat, configure, level_for
from .mode_settings import Mode

log = logging.getLogger(__name__)

# Subcommands other packages add (`bench`): an entry point of this group names a function
# that adds its parser and returns the handler. The command finds them, never imports them,
# so nothing in the product depends on the benchmarks (tests/test_architecture.py).
COMMANDS = "archipelago.commands"
Register = Callable[[Any, argparse.ArgumentParser], Callable[[argparse.Namespace], int]]
HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {}
# the subcommands of this project's other distributions: (the distribution, how to install it)
_BENCH = (
    "archipelago-diloco-bench",
    "`pip install -e orchestrator/bench` in a checkout of the repository, or `pip install 'archipelago-diloco[bench]'`",
)
ELSEWHERE = {"bench": _BENCH, "testbed": _BENCH, "simulate": _BENCH}


def _registered() -> dict[str, Register]:
    """The installed packages' subcommands, by name (an entry point that fails to load is
    logged and skipped: the rest of the command still works)."""
    found: dict[str, Register] = {}
    for point in entry_points(group=COMMANDS):
        try:
            found[point.name] = point.load()
        except Exception as err:  # a broken plugin must not take `archipelago run` down with it
            log.warning("the %s subcommand %r could not be loaded: %s", COMMANDS, point.name, err)
    return found


def config_args(p: argparse.ArgumentParser) -> None:
    """`--config FILE` and `--set KEY=VALUE`, as every command reading a run's config takes them."""
    p.add_argument("--config", help="YAML run config (see `archipelago config show`)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, e.g. --set outer.lr=0.5 (repeatable)",
    )


def _verbosity() -> argparse.ArgumentParser:
    """-v/-q, accepted before or after the subcommand (`archipelago -v run`, `archipelago run -q`)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more detail (repeatable; -v = debug)"
    )
    common.add_argument(
        "-q", "--quiet", action="count", default=argparse.SUPPRESS, help="warnings and errors only, no progress line"
    )
    common.add_argument(
        "--log-format",
        choices=[f.value for f in LogFormat],
        default=argparse.SUPPRESS,
        help="text (time, level, message; the default) or json (one object a line, for a log collector)",
    )
    return common


class _Version(argparse.Action):
    """`--version`: the version and the commit it was built from, asked only when shown
    (the commit may take a `git` call)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show the version and commit")

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        sys.stdout.write(f"archipelago {library.version()} (commit {library.commit()})\n")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The command line: the product's subcommands, then those other distributions register
    (`bench`, `simulate`), or a stub that says where they are."""
    common = _verbosity()
    parser = argparse.ArgumentParser(
        prog="archipelago", description="Low-communication training across islands on Ray.", parents=[common]
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_run_parser, _config_parser, _serve_parser, _export_parser, _data_parser, _plan_parser, _extensions):
        add(sub, common)
    return parser


def _run_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """`run`: train, or continue a run."""
    run_p = sub.add_parser(
        "run", parents=[common], help="train (default: sync DiLoCo, 4 CPU islands, small GPT on stdlib text)"
    )
    config_args(run_p)
    run_p.add_argument("--out", help="output folder (overrides out_dir)")
    run_p.add_argument(
        "--init-from", metavar="CHECKPOINT", help="start from a final.pt or a checkpoint folder (sets init_from)"
    )
    run_p.add_argument(
        "--resume",
        metavar="DIR[@N]",
        help="continue the run whose outputs are in DIR from its newest checkpoint (@N: from checkpoint N)",
    )
    run_p.add_argument(
        "--run-id",
        help="name the run; if checkpoint.path holds checkpoints of that id, continue it (a retried job resumes)",
    )


def _config_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """`config show` and `config docs`."""
    cfg_p = sub.add_parser("config", parents=[common], help="configuration helpers")
    cfg_sub = cfg_p.add_subparsers(dest="config_command", required=True)
    show = cfg_sub.add_parser("show", parents=[common], help="print the resolved config as YAML")
    config_args(show)
    show.add_argument(
        "--mode",
        choices=[m.value for m in Mode],
        help="the config of a run of this mode, with only the mode settings such a run reads",
    )
    docs = cfg_sub.add_parser(
        "docs", parents=[common], help="generate the configuration reference (docs/configuration.md) from the models"
    )
    docs.add_argument("--out", help="write it to this file (default: stdout)")


def _serve_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """`serve`: the control plane of a running job, from any machine that reaches its cluster."""
    serve = sub.add_parser("serve", parents=[common], help="serve the control plane (API + dashboard) of a running job")
    serve.add_argument("--run-id", help="the job's run id (default: the only running job)")
    serve.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS or auto)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8600)
    serve.add_argument("--public-reads", action="store_true", help="serve reads without the token (mutations need it)")
    serve.add_argument("--tls-cert", help="PEM certificate: serve HTTPS (with --tls-key)")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        help="an address or network whose X-Forwarded-For names the client (repeatable; default: none)",
    )


def _export_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """`export`: a finished run's model in its ecosystem's format."""
    export = sub.add_parser(
        "export", parents=[common], help="write a finished run's model in its ecosystem's format (Hugging Face)"
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run's output folder (config.yaml and final.pt)")
    export.add_argument("out_dir", metavar="OUT_DIR", help="where the exported model goes")
    export.add_argument("--format", choices=["hf"], default="hf", help="hf: save_pretrained with safetensors")
    export.add_argument(
        "--trust-config",
        action="store_true",
        help="import the task factory RUN_DIR/config.yaml names even if no checkpoint of the run records it",
    )


def _data_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """`data prepare`: token shards a run reads by position."""
    data = sub.add_parser("data", parents=[common], help="data helpers")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser(
        "prepare",
        parents=[common],
        help="tokenise a text source once into token shards a run reads by position (source: prepared)",
    )
    prep.add_argument(
        "source",
        metavar="SOURCE",
        help="stdlib; Parquet/JSON-lines files (a file, folder or glob); a save_to_disk folder; hf:NAME[:CONFIG]",
    )
    prep.add_argument(
        "out", metavar="OUT", help="folder for the shards and manifest.json (empty, or a prepare to resume)"
    )
    config_args(prep)
    prep.add_argument("--text-column", default="text", help="the column or field holding the documents")
    prep.add_argument("--shard-tokens", type=int, default=1 << 25, help="tokens per shard file")
    prep.add_argument("--eval-every", type=int, default=200, help="hold out one document in this many for evaluation")
    prep.add_argument("--workers", type=int, default=0, help="tokenising processes (default: one per core)")
    prep.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help="tokenise with Ray tasks on this cluster (default when RAY_ADDRESS is set, as in a Ray job)",
    )
    prep.add_argument("--split", default="train", help="split of an hf: source")
    prep.add_argument("--data-files", help="data_files of an hf: local builder (hf:json, hf:parquet)")


def _plan_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """`plan`: memory, bytes and time per process and per link, checked before launch."""
    plan = sub.add_parser(
        "plan",
        parents=[common],
        help="each process's peak memory and each link's bytes, checked against the cluster (exit 2: does not fit)",
    )
    plan.add_argument("config_file", nargs="?", help="YAML run config (or --config)")
    config_args(plan)
    plan.add_argument(
        "--cluster",
        help="KubeRay manifest (RayCluster or RayJob) to check against, or 'ray' for the running cluster "
        "($RAY_ADDRESS); default: this machine",
    )
    plan.add_argument(
        "--accelerator-memory",
        metavar="QUANTITY",
        help="memory of one GPU (e.g. 80Gi) where the manifest's worker group does not state it",
    )
    plan.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    plan.add_argument(
        "--link-gbps",
        type=_positive,
        help="Gbit/s between the islands and the head, for the head's share of a round (default: the head "
        "group's archipelago.io/link-gbps annotation, else 100)",
    )
    plan.add_argument(
        "--step-s",
        type=_positive,
        default=1.0,
        help="seconds an island's inner step takes, for the head's share of a round (default: 1)",
    )
    plan.add_argument(
        "--rehearse",
        action="store_true",
        help="also run each process once at the config's shapes on this machine's CPU and set its measured "
        "peak beside the plan's (exit 2 if one is more than 25%% away)",
    )
    plan.add_argument(
        "--rehearse-rows",
        type=_two_row_counts,
        default=None,
        metavar="R1,R2",
        help="with --rehearse: rehearse the island at micro-batches of R1 and R2 rows and read its peak at the "
        "config's own micro-batch off the line through them (a GPU config's micro-batch, too large for this CPU)",
    )


def _extensions(sub: Any, common: argparse.ArgumentParser) -> None:
    """The subcommands other distributions register, found by entry point; one named but
    not installed gets a stub saying what to install."""
    registered = _registered()
    for name, command in registered.items():
        HANDLERS[name] = command(sub, common)
    for name, (distribution, how) in ELSEWHERE.items():
        if name not in registered:  # named, so the command says where it is instead of "invalid choice"
            absent = sub.add_parser(name, parents=[common], help=f"not installed: {distribution}")
            absent.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            absent.set_defaults(absent=True)  # whatever follows, options too, is not read (`main`)
            HANDLERS[name] = _not_installed(name, distribution, how)


def _not_installed(name: str, distribution: str, how: str) -> Callable[[argparse.Namespace], int]:
    def handler(_: argparse.Namespace) -> int:
        log.error("archipelago %s is not installed: it is the distribution %s: %s", name, distribution, how)
        return 2

    return handler


def _two_row_counts(text: str) -> tuple[int, int]:
    """Two different positive row counts, "R1,R2" (a flag's value), or the flag's error (exit 2)."""
    try:
        rows = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not two whole numbers, R1,R2") from None
    if len(rows) != 2 or min(rows) < 1 or rows[0] == rows[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is not two different row counts above 0")
    return rows[0], rows[1]


def _positive(text: str) -> float:
    """A finite number above 0 (a flag's value), or the flag's error (exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0")
    return value


def _plan(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from archipelago.workers.tasks.hf_task import PlanInputError

    from .plan.cluster import ClusterError, from_manifest, from_ray, quantity

    if args.config_file and args.config:
        log.error("give the config once: as the argument or with --config")
        return 2
    try:
        cfg = library.config(args.config_file or args.config, *args.overrides)
    except ConfigError as err:
        log.error("invalid config: %s", err)
        return 2
    try:
        accel = quantity(args.accelerator_memory) if args.accelerator_memory else None
        cluster = None  # this machine (`library.plan`)
        if args.cluster == "ray":
            import ray

            ray.init(address=cfg.ray.address or "auto", log_to_driver=False)
            cluster = from_ray()
        elif args.cluster:
            cluster = from_manifest(args.cluster)
        if accel is not None and cluster is not None:
            cluster = dataclasses.replace(
                cluster,
                workers=tuple(
                    k if k.accelerator_memory else dataclasses.replace(k, accelerator_memory=accel)
                    for k in cluster.workers
                ),
            )
        plan = library.plan(cfg, cluster, accelerator_memory=accel, link_gbps=args.link_gbps, step_s=args.step_s)
    except (ClusterError, PlanInputError, OSError) as err:
        log.error("cannot plan: %s", err)
        return 2
    sys.stdout.write("\n".join(plan.lines()) + "\n")
    report = plan.as_dict()
    rehearsed_ok = True
    if args.rehearse_rows and not args.rehearse:
        log.error("--rehearse-rows scales a rehearsal: give --rehearse with it")
        return 2
    if args.rehearse:
        from .plan.rehearse import TOLERANCE, micro_batch_rows, rehearse

        if args.rehearse_rows:
            try:
                micro_batch_rows(cfg)
            except ValueError as err:
                log.error("--rehearse-rows: %s", err)
                return 2
        rehearsed = rehearse(plan.config(cfg), args.rehearse_rows)
        sys.stdout.write("rehearsal on this machine's CPU (no Ray):\n")
        sys.stdout.write("".join(f"  {r.line()}\n" for r in rehearsed))
        rehearsed_ok = all(abs(r.ratio - 1) <= TOLERANCE for r in rehearsed)
        report["rehearsal"] = [{**dataclasses.asdict(r), "ratio": r.ratio} for r in rehearsed]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if plan.fits and rehearsed_ok else 2


def _serve(args: argparse.Namespace) -> int:
    import ray
    import uvicorn

    from archipelago.api.app import create_app
    from archipelago.api.auth import (
        ExposureError,
        check_exposure,
        configured_read_source,
        configured_source,
        configured_token,
        is_loopback,
    )
    from archipelago.api.limits import rate_limit
    from archipelago.api.server import server_config

    from .config_operations import ApiConfig
    from .runtime.run_handle import RayRunHandle, find_run

    if (args.tls_cert is None) != (args.tls_key is None):
        log.error("--tls-cert and --tls-key go together")
        return 2
    try:
        token = configured_token()
        check_exposure(args.host, token)
        read_token = configured_read_source()
    except ExposureError as err:
        log.error("control plane refused: %s", err)
        return 2

    ray.init(address=args.address or "auto", log_to_driver=False)
    try:
        run_id = find_run(args.run_id)
    except LookupError as err:
        log.error("%s", err)
        return 2
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    log.info("control plane of run %s: %s://%s:%d/", run_id, "https" if tls else "http", args.host, args.port)
    app = create_app(
        RayRunHandle(run_id),
        configured_source(token),
        args.public_reads,
        loopback=is_loopback(args.host),
        read_token=read_token,
        rate=rate_limit(ApiConfig().rate_per_s, ApiConfig().rate_burst),
    )
    uvicorn.Server(server_config(app, args.host, args.port, tls, tuple(args.trusted_proxy))).run()
    return 0


def _config_docs(args: argparse.Namespace) -> int:
    from .config_docs import render

    page = render()
    if args.out:
        Path(args.out).write_text(page)
        log.info("wrote %s", args.out)
    else:
        sys.stdout.write(page)
    return 0


def _export(args: argparse.Namespace) -> int:
    import torch

    from archipelago.workers.tasks.task import TaskError, export_pretrained, load_task

    from .runtime.driver import ResumeRefused, resume_id

    run_dir = Path(args.run_dir)
    try:
        cfg = load_config(str(run_dir / "config.yaml"), [f"out_dir={run_dir}"], check_task=False)
        if not args.trust_config:  # config.yaml names code to import: only what the run's checkpoint recorded
            resume_id(cfg)
    except (ConfigError, ResumeRefused) as err:
        log.error("cannot export %s: %s (--trust-config imports what its config.yaml names)", run_dir, err)
        return 2
    try:
        state = torch.load(run_dir / "final.pt", map_location="cpu", weights_only=True)
        out = export_pretrained(load_task(cfg.task.factory, cfg.task.kwargs), state, Path(args.out_dir))
    except (ConfigError, OSError, TaskError, RuntimeError) as err:
        log.error("cannot export %s: %s", run_dir, err)
        return 2
    sys.stdout.write(f"{out}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "absent", False):
        parser.parse_args(argv)  # argparse's own error for what no command takes (exit 2)
    level = level_for(getattr(args, "verbose", 0), getattr(args, "quiet", 0))
    fmt = LogFormat(getattr(args, "log_format", LogFormat.TEXT.value))
    configure(level, fmt=fmt)
    if fmt == LogFormat.JSON:  # before Ray is imported: its de-duplicated and scheduler lines are text
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        os.environ.setdefault("RAY_SCHEDULER_EVENTS", "0")
    if args.command in HANDLERS:
        return HANDLERS[args.command](args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "export":
        return _export(args)
    if args.command == "config" and args.config_command == "docs":
        return _config_docs(args)
    if args.command == "data":
        from .data_cli import prepare_command

        return prepare_command(args)
    overrides = list(args.overrides)
    if getattr(args, "mode", None):  # `config show --mode M`: the file's and --set's mode overridden
        overrides.insert(0, f"mode={args.mode}")
    resume = getattr(args, "resume", None)
    if resume:  # the run's own resolved config, pointed at where it now lives
        folder, at, chosen = resume.rpartition("@")
        if at and chosen.isdigit():  # DIR@N: from checkpoint N
            resume = folder
            overrides.append(f"checkpoint.resume_from={chosen}")
        overrides.insert(0, f"out_dir={resume}")
    if getattr(args, "out", None):
        overrides.append(f"out_dir={args.out}")
    if getattr(args, "init_from", None):
        overrides.append(f"init_from={args.init_from}")
    config_file = str(Path(resume) / "config.yaml") if resume and not args.config else args.config
    try:
        # a resumed run's task factory is built only once its checkpoint vouches for it
        cfg = load_config(config_file, overrides, check_task=not resume)
        if args.command == "run":
            check_extras(cfg)
            check_folders(cfg)
    except ConfigError as err:
        log.error("invalid config: %s", err)
        return 2
    if args.command == "config":
        sys.stdout.write(dump_config(cfg, reads_only=bool(args.mode)))
        return 0
    from .runtime.driver import ResumeRefused, check_resumable, process_started_at, resume_id

    if resume and args.run_id:
        log.error("--resume continues the run its folder records: --run-id names another way, give one")
        return 2
    try:
        run_id = resume_id(cfg) if resume else args.run_id
        if run_id is not None:
            cfg = cfg.for_run(run_id)  # `--run-id`: its own folder, where its checkpoints are
        if resume or (run_id is not None and check_resumable(cfg, run_id)):
            log.info("continuing run %s from its checkpoint in %s", run_id, cfg.checkpoint_dir)
        if resume:
            check_task_spec(cfg)
    except ResumeRefused as err:
        log.error("cannot resume: %s", err)
        return 2
    except ConfigError as err:
        log.error("invalid config: %s", err)
        return 2
    return train(
        lambda: library.run(cfg, run_id=run_id, progress=level <= logging.INFO, started_at=process_started_at())
    )


def train(runs: Callable[[], dict[str, Any]]) -> int:
    """The exit status of a training command (`run`, `simulate`): 0 with its summary printed,
    2 refused before anything started (its data, its plan), 1 failed."""
    from archipelago.workers.data.manifest import DataError

    from .plan.preflight import PlanRefused
    from .runtime.driver import RunFailed, print_summary

    try:
        summary = runs()
    except DataError as err:  # refused before any training: nothing was lost
        log.error("data refused: %s", err)
        return 2
    except PlanRefused as err:  # refused before anything started
        log.error("the run does not fit (archipelago plan shows why; preflight: false skips the check): %s", err)
        return 2
    except RunFailed as err:
        log.error("run failed: %s", err)
        return 1
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
