"""The ``fedloom`` command (README.md, "Quick start"; docs/audit.md and docs/serving.md for
their subcommands). Exit status: 0 success, 2 bad config or input (one message, no traceback
unless --debug), 1 anything else."""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TextIO

import typer
from rich.console import Console
from rich.markup import escape

from fedloom.errors import FedloomInputError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Federated and personalized federated learning simulations.",
    pretty_exceptions_enable=False,
    # help is plain text: Rich markup would read "fedloom[flower]" as a tag and drop it
    rich_markup_mode=None,
)
err_console = Console(stderr=True)

# The options several commands share, spelled once.
ConfigArg = Annotated[
    Path | None, typer.Argument(help="YAML config; omit for the embedded default experiment")
]
SetOption = Annotated[
    list[str] | None, typer.Option("--set", help="override a key: --set train.rounds=5")
]
RunOutOption = Annotated[Path | None, typer.Option(help="run directory (must not exist)")]
DebugOption = Annotated[bool, typer.Option(help="show tracebacks")]


def _fail(err: BaseException, debug: bool) -> None:
    if debug:
        traceback.print_exception(err)
    if isinstance(err, FedloomInputError):
        # escaped: messages quote brackets (pip install 'fedloom[ray]') that are not markup
        err_console.print(
            f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(2)
    if isinstance(err, KeyboardInterrupt):
        err_console.print("interrupted; resume with `fedloom run --resume RUN_DIR`")
        raise typer.Exit(130)
    err_console.print(
        f"[bold red]fedloom failed:[/] {type(err).__name__}: {escape(str(err))} "
        "(rerun with --debug)"
    )
    raise typer.Exit(1)


def _echo_path(write: Callable[[], object], debug: bool) -> None:
    """Run a command's ``write`` and print the path it returns; a failure goes to ``_fail``."""
    try:
        path = write()
    except Exception as err:
        _fail(err, debug)
        return
    typer.echo(str(path))


def _raw_config(
    config: Path | None, set_: list[str] | None, resume: Path | None = None
) -> dict[str, Any]:
    """The YAML config (or, resuming, the run's config.yaml, else the embedded default
    experiment, config.default_experiment) with the ``--set`` overrides."""
    from fedloom.config import apply_overrides, default_experiment, load_yaml
    from fedloom.rl.config import RL_ENVS

    if config is None and resume is not None:  # --set against the run's own config
        from fedloom.engine.rundir import RunDir

        config = RunDir.open_existing(resume).config_path
    if config is not None:
        return apply_overrides(load_yaml(config), set_ or [], written_in=str(config))
    overrides = set_ or []
    names = [item.split("=", 1)[1].strip() for item in overrides if item.startswith("data.name=")]
    default = default_experiment(names[-1] if names else None, RL_ENVS)
    return apply_overrides(default, overrides, written_in=None)


@app.command()
def run(
    config: ConfigArg = None,
    set_: SetOption = None,
    out: RunOutOption = None,
    resume: Annotated[
        Path | None, typer.Option(help="continue RUN_DIR from its last checkpoint")
    ] = None,
    accept_config_change: Annotated[
        bool,
        typer.Option(
            help="with --resume: continue although RUN_DIR/config.yaml changed since the "
            "checkpoint (refused by default, naming the changed key)"
        ),
    ] = False,
    debug: DebugOption = False,
) -> None:
    """Run an experiment and write its run directory (metrics, summary, report, checkpoints)."""
    from fedloom.api import run as run_api

    try:
        cfg = _run_config(config, set_, resume)
        _check_run_options(out, resume, accept_config_change)
        result = run_api(cfg, out=out, resume=resume, accept_config_change=accept_config_change)
    except (Exception, KeyboardInterrupt) as err:
        _fail(err, debug)
        return
    where = f"run directory: {result.run_dir.path if result.run_dir else '-'}"
    typer.echo("\n".join([where, *_summary_lines(result.summary)]))


def _check_run_options(out: Path | None, resume: Path | None, accept_config_change: bool) -> None:
    """``fedloom run``'s options that exclude or need each other."""
    if resume is not None and out is not None:
        raise FedloomInputError(
            "--out and --resume exclude each other: a resumed run stays in RUN_DIR"
        )
    if accept_config_change and resume is None:
        raise FedloomInputError("--accept-config-change goes with --resume RUN_DIR")


def _run_config(config: Path | None, set_: list[str] | None, resume: Path | None) -> Any:
    """The config ``fedloom run`` was given (with ``--set``), parsed for a horizontal run, as
    read for the other families (``fedloom.run`` parses those); None without one."""
    from fedloom.api import run_kind
    from fedloom.config import from_default, parse_config
    from fedloom.errors import ConfigError

    if config is None and not set_:
        return None
    raw = _raw_config(config, set_, resume)
    try:
        return raw if run_kind(raw) != "horizontal" else parse_config(raw)
    except ConfigError as err:
        given = config is not None or resume is not None
        raise (err if given else from_default(err, set_ or [])) from None


def _summary_lines(s: dict[str, Any]) -> list[str]:
    """The final results of summary.json ``s`` in a few lines."""
    final = s["final"]
    glob, pers = final.get("global") or {}, final.get("personalized") or {}
    lines = []
    if glob.get("accuracy") is not None:
        lines.append(f"global accuracy {glob['accuracy']:.4f}, loss {glob['loss']:.4f}")
    elif glob.get("loss") is not None:
        lines.append(f"global loss {glob['loss']:.6g}")
    if pers.get("accuracy_mean") is not None:
        lines.append(
            "personalized accuracy mean {accuracy_mean:.4f}  P10 {accuracy_p10:.4f}  "
            "P50 {accuracy_p50:.4f}  P90 {accuracy_p90:.4f}  min {accuracy_min:.4f}".format(**pers)
        )
    elif pers.get("loss_mean") is not None:
        lines.append(f"personalized loss mean {pers['loss_mean']:.6g}")
    lines += _routing_or_returns(s.get("serving") or {}, final, pers)
    comm = s["communication"]
    lines.append(
        f"bytes up {comm['bytes_up']:,}  down {comm['bytes_down']:,}  "
        f"{s['seconds_per_round']:.3f} s/round, {s['wall_seconds']:.1f} s"
    )
    return lines


def _routing_or_returns(serving: dict[str, Any], final: dict[str, Any], pers: dict) -> list[str]:
    """The router's accuracy (docs/serving.md), or an RL run's greedy returns (docs/rl.md)."""
    routing = serving.get("routing")
    if routing:
        return [
            f"routed accuracy mean {routing['routed']['accuracy_mean']:.4f} (personal "
            f"{routing['personal']['accuracy_mean']:.4f}, global "
            f"{routing['global']['accuracy_mean']:.4f}, "
            f"{routing['personal_share']:.0%} to personal)"
        ]
    if pers.get("return_mean") is not None:
        unseen = final.get("return_unseen_mean")
        return [
            f"greedy return: training environments {pers['return_mean']:.1f}"
            + (f", unseen {unseen:.1f}" if unseen is not None else "")
        ]
    return []


@app.command()
def algorithms() -> None:
    """List the registered algorithms with their hyperparameters: the horizontal ones, then
    the federated RL and vertical ones with their family (``kind:``, docs/rl.md,
    docs/vertical.md)."""
    from fedloom.algorithms import ALGORITHMS, describe
    from fedloom.rl.config import RL_ALGORITHM_CONFIGS
    from fedloom.vertical.config import ALGORITHM_CONFIGS as VERTICAL_CONFIGS

    for name in ALGORITHMS:
        typer.echo(describe(ALGORITHMS.get(name)))
    for kind, configs in (("rl", RL_ALGORITHM_CONFIGS), ("vertical", VERTICAL_CONFIGS)):
        for name, model in configs.items():
            doc = (model.__doc__ or "").strip().splitlines()
            fields = ", ".join(f for f in model.model_fields if f != "name")
            typer.echo(f"{name} (kind: {kind}): {doc[0] if doc else ''}")
            typer.echo(f"    keys: {fields}")


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    debug: DebugOption = False,
) -> None:
    """(Re)build RUN_DIR/report.html."""
    from fedloom.report import write_report

    _echo_path(lambda: write_report(run_dir), debug)


@app.command()
def audit(
    run_dir: Annotated[Path, typer.Argument(help="a finished run directory")],
    attack: Annotated[
        str, typer.Option(help="loss | shadow (membership inference) | dlg (gradient inversion)")
    ] = "loss",
    out: Annotated[
        Path | None, typer.Option(help="the page to write (default RUN_DIR/audit.html)")
    ] = None,
    client: Annotated[
        int | None, typer.Option(help="dlg: the client attacked (default: first)")
    ] = None,
    members: Annotated[int, typer.Option(help="members (and non-members) per target")] = 500,
    defences: Annotated[
        bool,
        typer.Option(
            help="also measure the defences of docs/audit.md (or, for dlg, noise/pruning)"
        ),
    ] = False,
    debug: DebugOption = False,
) -> None:
    """Privacy audit of a finished run: membership inference on the global and each client's
    deployed model (RUN_DIR/audit.json, audit.html), or DLG against a client's gradient."""
    from fedloom.api import audit as audit_api

    try:
        doc = audit_api(run_dir, attack, out, client=client, members=members, defences=defences)
    except Exception as err:
        _fail(err, debug)
        return
    result = doc["attacks"][attack]
    if attack == "dlg":
        for r in result["reconstructions"]:
            psnr = "inf" if r["psnr"] is None else f"{r['psnr']:.1f}"
            typer.echo(f"{r['method']:>8} defence {r['defence']:<15} PSNR {psnr} dB")
    else:
        glob, mean = result.get("global"), result["client_mean"]
        if glob:
            typer.echo(
                f"global model AUC {glob['auc']:.4f}, TPR@1%FPR {glob['tpr_at_1pct_fpr']:.4f}"
            )
        typer.echo(
            f"deployed models AUC mean {mean['auc']:.4f}, TPR@1%FPR mean "
            f"{mean['tpr_at_1pct_fpr']:.4f} ({len(result['clients'])} clients)"
        )
    typer.echo(str(out or run_dir / "audit.html"))


@app.command()
def summary(run_dir: Annotated[Path, typer.Argument(help="a run directory")]) -> None:
    """Print RUN_DIR/summary.json."""
    from fedloom.core.run_files import Summary, read_typed
    from fedloom.core.runpaths import refuse_links, under
    from fedloom.errors import RunDirError

    try:
        if run_dir.is_dir():
            refuse_links(run_dir)
        path = under(run_dir, "summary.json")
        if not path.is_file():
            raise RunDirError(f"{path} not found")
        typer.echo(json.dumps(read_typed(path, Summary), indent=2))
    except RunDirError as err:
        _fail(err, False)


@app.command()
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="the run directories to overlay")],
    out: Annotated[
        Path, typer.Option(help="the page to write (a folder: FOLDER/compare.html)")
    ] = Path("compare.html"),
    debug: DebugOption = False,
) -> None:
    """Overlay runs on one offline page (accuracy, loss, bytes, time, cold start) with a
    table of their summaries."""
    from fedloom.report.compare import write_comparison

    _echo_path(lambda: write_comparison(run_dirs, out), debug)


@app.command()
def dashboard(
    runs_dir: Annotated[Path, typer.Argument(help="the folder that holds run directories")] = Path(
        "runs"
    ),
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port")] = 8765,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    allow_remote: Annotated[
        bool, typer.Option(help="allow a non-loopback --host (no login: anyone can read)")
    ] = False,
    debug: DebugOption = False,
) -> None:
    """Serve a local web app: the runs in RUNS_DIR, each run's report panels updating live
    while it trains, and a comparison of selected runs. Ctrl+C stops it."""
    from fedloom.dashboard import check_host, serve
    from fedloom.errors import RunDirError

    try:
        check_host(host, allow_remote)
        if (runs_dir / "config.yaml").is_file():
            parent = runs_dir.resolve().parent
            raise RunDirError(
                f"'{runs_dir}' is a run directory; give the folder that holds runs, "
                f"e.g. `fedloom dashboard {parent}`"
            )
        serve(
            runs_dir,
            host,
            port,
            allow_remote=allow_remote,
            announce=lambda url: err_console.print(
                f"fedloom dashboard of {runs_dir.resolve()} on {url} (Ctrl+C stops it)",
                highlight=False,
                soft_wrap=True,
            ),
        )
    except KeyboardInterrupt:
        return
    except Exception as err:
        _fail(err, debug)


@app.command()
def tune(
    config: Annotated[
        Path | None, typer.Argument(help="base YAML config; omit for the embedded default")
    ] = None,
    set_: SetOption = None,
    space: Annotated[
        Path | None, typer.Option(help="search space YAML: dotted keys -> distributions")
    ] = None,
    trials: Annotated[int, typer.Option(min=1, help="finished trials the search ends with")] = 20,
    out: Annotated[
        Path | None, typer.Option(help="search directory (the same one continues a search)")
    ] = None,
    pruner: Annotated[str, typer.Option(help="hyperband | sha | none")] = "hyperband",
    seed: Annotated[int | None, typer.Option(help="sampler seed (default: the config's)")] = None,
    metric: Annotated[
        str, typer.Option(help="dotted key of a metrics row, e.g. validation.global.accuracy")
    ] = "auto",
    debug: DebugOption = False,
) -> None:
    """Search hyperparameters (Optuna TPE with Hyperband or successive halving over rounds) on
    a validation split; writes tune.html, trials.json and the best config (docs/tune.md)."""
    from fedloom.errors import ConfigError

    try:
        if space is None:
            raise ConfigError("--space SPACE.yaml is required (docs/tune.md)")
        if pruner not in ("hyperband", "sha", "none"):
            raise ConfigError(f"--pruner {pruner!r}: expected hyperband, sha or none")
        from fedloom.tune import load_space
        from fedloom.tune import tune as tune_api

        result = tune_api(
            _raw_config(config, set_),
            load_space(space),
            trials,
            out=out,
            pruner=pruner,  # type: ignore[arg-type]
            seed=seed,
            metric=metric,
            log=lambda line: err_console.print(line, highlight=False, soft_wrap=True),
        )
    except (Exception, KeyboardInterrupt) as err:
        if isinstance(err, KeyboardInterrupt):
            err_console.print("interrupted; the same command continues the search")
            raise typer.Exit(130) from None
        _fail(err, debug)
        return
    s = result.summary
    lines = [f"search directory: {result.out}"]
    if s["best"] is not None:
        params = ", ".join(f"{k}={v}" for k, v in s["best"]["params"].items())
        best = f"best trial {s['best']['number']}: {s['metric']} {s['best']['value']:.6g}"
        lines.append(f"{best} ({params})")
        lines.append(f"best config: {result.out / s['best']['config']}")
    lines.append(
        f"rounds spent {s['rounds_spent']} of {s['rounds_without_pruning']} without pruning "
        f"({s['trials']['complete']} complete, {s['trials']['pruned']} pruned)"
    )
    lines.append(str(result.out / "tune.html"))
    typer.echo("\n".join(lines))


@app.command()
def sweep(
    spec: Annotated[Path, typer.Argument(help="sweep YAML: base, grid, seeds")],
    out: Annotated[Path, typer.Option(help="sweep directory (the same one continues the sweep)")],
    jobs: Annotated[
        int | None, typer.Option(min=1, help="runs at once on this machine (default: cores)")
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(min=1, help="torch threads per run (default: cores // jobs; 1 on Ray)"),
    ] = None,
    ray: Annotated[
        str | None, typer.Option(help="run on the Ray cluster at HOST:PORT, one task per run")
    ] = None,
    progress: Annotated[
        bool | None, typer.Option(help="the progress bar (default: when stderr is a terminal)")
    ] = None,
    compare: Annotated[bool, typer.Option(help="also write DIR/compare.html")] = True,
    debug: DebugOption = False,
) -> None:
    """Run every cell of a grid at every seed, each as its own run directory, in parallel;
    write results.csv, table.md, table.tex and compare.html (docs/benchmarks.md). Exit 1
    when a run failed (results.csv has its error)."""
    try:
        from fedloom.sweep import sweep as sweep_api

        result = sweep_api(
            spec, out, jobs=jobs, threads=threads, ray=ray, progress=progress, compare=compare
        )
    except (Exception, KeyboardInterrupt) as err:
        if isinstance(err, KeyboardInterrupt):
            err_console.print("interrupted; the same command continues the sweep")
            raise typer.Exit(130) from None
        _fail(err, debug)
        return
    failed = result.failed
    for row in failed:
        err_console.print(
            f"[bold red]failed:[/] {escape(str(row['run_dir']))}: {escape(str(row['error']))}",
            highlight=False,
            soft_wrap=True,
        )
    typer.echo(
        f"sweep directory: {result.out}\n{len(result.rows) - len(failed)} of "
        f"{len(result.rows)} runs finished; this call ran {result.ran}\n{result.out / 'table.md'}"
    )
    if failed:
        raise typer.Exit(1)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="a finished run directory (with serving)")],
    out: Annotated[
        Path | None, typer.Option(help="export directory (default RUN_DIR/export)")
    ] = None,
    debug: DebugOption = False,
) -> None:
    """Write the run's deployable models (global, EMA, best, each client's) as safetensors
    with a JSON card (docs/serving.md)."""

    def write() -> Path:
        from fedloom.serving import export_run

        return export_run(run_dir, out)

    _echo_path(write, debug)


@app.command()
def flower(
    config: ConfigArg = None,
    set_: SetOption = None,
    out: RunOutOption = None,
    num_cpus: Annotated[int | None, typer.Option(help="CPUs of Flower's Ray runtime")] = None,
    debug: DebugOption = False,
) -> None:
    """Run an experiment on Flower's simulation engine, one node per client, and write its run
    directory as `run` does (pip install 'fedloom[flower]'; docs/flower.md)."""
    try:
        from fedloom.flower import run_simulation

        result = run_simulation(_raw_config(config, set_), out=out, write=True, num_cpus=num_cpus)
    except (Exception, KeyboardInterrupt) as err:
        _fail(err, debug)
        return
    s, glob = result.summary, result.summary["final"].get("global") or {}
    typer.echo(
        f"run directory: {result.run_dir.path if result.run_dir else '-'}\n"
        + (f"global accuracy {glob['accuracy']:.4f}\n" if glob.get("accuracy") is not None else "")
        + f"{s['seconds_per_round']:.3f} s/round on Flower's simulation"
    )


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """fedloom's own warnings as one line on stderr (``warning: ...``); others as Python's."""
    if category.__module__.startswith("fedloom."):
        err_console.print(f"[bold yellow]warning:[/] {message}", highlight=False, soft_wrap=True)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


_python_show_warning = warnings.showwarning


def main() -> None:
    warnings.showwarning = _show_warning
    try:
        app()
    except SystemExit as exc:
        # Click reports usage errors with status 2 already; keep every other status as is.
        sys.exit(exc.code)
