"""What every command group of the CLI shares: the app, its options, running a client command (errors as one line, not a traceback), the mesh's config."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from gpufleet.shared.contract.config import data_dir as resolve_data_dir
from gpufleet.shared.contract.errors import GpufleetError, SpecError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="gpufleet: a control plane for GPU clusters, on one event log.")


@app.callback()
def _identity(creds: Annotated[str | None, typer.Option(
        "--creds", envvar="GPUFLEET_CREDS",
        help="credentials file: who you are to NATS (default: the data dir's admin credentials)")] = None) -> None:
    """Every client command connects as --creds (or $GPUFLEET_CREDS), else as the data dir's admin."""
    if creds:
        from gpufleet.shared.trust.authz import CredsError, load_creds

        try:
            load_creds(creds)
        except CredsError as exc:
            typer.echo(f"error: --creds: {exc}", err=True)
            raise typer.Exit(2) from None
        os.environ["GPUFLEET_CREDS"] = str(Path(creds).resolve())

T = TypeVar("T")
DataDir = Annotated[str | None, typer.Option("--data-dir", envvar="GPUFLEET_DATA_DIR", help="the mesh's data dir")]
JsonOut = Annotated[bool, typer.Option("--json", help="machine-readable output")]
ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", help="cluster config with prices and budgets (default: GPUFLEET_CONFIG, else the mesh's copy)")]


def _run(coro: Coroutine[Any, Any, T]) -> T:
    import nats.errors
    import nats.js.errors

    try:
        return asyncio.run(coro)
    except GpufleetError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
        # connected, but JetStream does not answer: a cluster electing its leader, a server restarting
        typer.echo(f"error: JetStream does not answer ({type(exc).__name__}): the stream may have no leader "
                   "yet or its server is restarting; try again in a few seconds (`gpufleet status`)", err=True)
        raise typer.Exit(1) from None


STATUS_STYLES = {"running": "green", "placed": "green", "succeeded": "green", "ready": "green",
                 "failed": "red", "lost": "red", "rejected": "red", "unschedulable": "yellow",
                 "cancelled": "dim", "preempted": "yellow", "cordoned": "yellow"}


def _rich_out() -> bool:
    """Tables in colour for a person (stdout a terminal, or GPUFLEET_COLOR=always); plain text to
    a pipe or a file (GPUFLEET_COLOR=never forces it), the same columns either way; --json never."""
    mode = os.environ.get("GPUFLEET_COLOR", "auto").lower()
    return mode == "always" or (mode != "never" and sys.stdout.isatty())


def _rich_table(columns: list[tuple[str, str]], rows: list[list[str]], status_col: str | None = None) -> None:
    """`columns`: (header, justify); a cell of `status_col` coloured by its status."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, header_style="bold")
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name not in ("REASON",))  # type: ignore[arg-type]
    at = [c for c, _ in columns].index(status_col) if status_col else -1
    for row in rows:
        cells: list[Any] = list(row)
        if at >= 0:
            cells[at] = Text(row[at], style=STATUS_STYLES.get(row[at], ""))
        table.add_row(*cells)
    Console(force_terminal=True if os.environ.get("GPUFLEET_COLOR", "").lower() == "always" else None).print(table)


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=None, default=str))


async def _with_fleet(data_dir: str | None, fn: Callable[[Any], Awaitable[T]]) -> T:
    from gpufleet.sdk import Fleet
    from gpufleet.shared.runtime.archive import ARCHIVE_DIR_ENV

    archive = resolve_data_dir(data_dir) / "archive"
    if ARCHIVE_DIR_ENV not in os.environ and archive.is_dir():
        os.environ[ARCHIVE_DIR_ENV] = str(archive)  # what left the stream is read back from its archive
    fleet = await Fleet.connect(data_dir=data_dir)
    try:
        with _read_bar():
            return await fn(fleet)
    finally:
        await fleet.close()


@contextlib.contextmanager
def _read_bar(after_s: float = 2.0) -> Iterator[None]:
    """A progress bar on stderr (a terminal only) for a read of the log that takes longer than
    `after_s` (replay, audit, explain of a long log); gone when it is done."""
    from gpufleet.shared.runtime.log import read_progress

    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    t0 = time.monotonic()
    bar: dict[str, Any] = {}

    def report(seq: int, pending: int) -> None:
        if "p" not in bar:
            if time.monotonic() - t0 < after_s or not pending:
                return
            bar["p"] = Progress(TextColumn("reading the log"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            bar["p"].start()
            bar["t"] = bar["p"].add_task("read", total=seq + pending)
        bar["p"].update(bar["t"], completed=seq, total=max(seq + pending, 1))
        if not pending:  # this read is done: the bar goes (a full-screen command may follow)
            bar.pop("p").stop()

    try:
        with read_progress(report):
            yield
    finally:
        if "p" in bar:
            bar["p"].stop()


@contextlib.contextmanager
def _steps_bar(label: str, after_s: float = 1.0) -> Iterator[Callable[[int, int, str], None]]:
    """A progress bar on stderr for long work (bench placement seeds, a what-if, a simulation):
    `update(done, total, note)`. On a terminal the bar shows once the work has taken `after_s`,
    with each note printed above it; elsewhere the notes alone go to stderr, a line each (a log
    or CI keeps them), and the bar never draws."""
    if not sys.stderr.isatty():
        def plain(_done: int, _total: int, note: str = "") -> None:
            if note:
                typer.echo(note, err=True)
        yield plain
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.monotonic()
    bar: dict[str, Any] = {}
    console = Console(stderr=True)

    def update(done: int, total: int, note: str = "") -> None:
        if "p" not in bar and time.monotonic() - t0 >= after_s:
            bar["p"] = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=console, transient=True)
            bar["p"].start()
            bar["t"] = bar["p"].add_task(label, total=max(total, 1))
        if note:
            console.print(note, highlight=False)
        if "p" in bar:
            bar["p"].update(bar["t"], completed=done, total=max(total, 1))

    try:
        yield update
    finally:
        if "p" in bar:
            bar["p"].stop()


async def _reading(data_dir: str | None, fn: Callable[[Any], Awaitable[T]], within_s: float = 10.0) -> T:
    """`_with_fleet` for a command that only reads: again while JetStream does not answer (a
    cluster electing a leader, a server restarting), for up to `within_s`."""
    from gpufleet.shared.runtime.bus import while_unanswered

    return await while_unanswered(lambda: _with_fleet(data_dir, fn), within_s)



def _parse_time(text: str) -> float:
    """'10m' / '2h' / '30s' ago, or an ISO 8601 time (UTC when it names no zone) -> unix seconds."""
    from datetime import UTC, datetime

    from gpufleet.shared.contract.spec import parse_duration_s

    try:
        return time.time() - parse_duration_s(text)
    except (ValueError, TypeError):
        pass
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        typer.echo(f"error: {text!r} is neither a duration (10m) nor an ISO time (2026-11-30T05:00:00)", err=True)
        raise typer.Exit(2) from None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()



def _mesh_config(data_dir: str | None) -> Any:
    from gpufleet.shared.contract.clusterconfig import load_config

    path = resolve_data_dir(data_dir) / "cluster.yaml"
    return load_config(path if path.exists() else os.environ.get("GPUFLEET_CONFIG"))



def _cluster_config(data_dir: str | None, path: Path | None) -> Any:
    """--config, else GPUFLEET_CONFIG, else the copy `gpufleet up --config` keeps in the data dir."""
    from gpufleet.shared.contract.clusterconfig import ClusterConfig, load_config

    candidates = [path, Path(os.environ["GPUFLEET_CONFIG"]) if os.environ.get("GPUFLEET_CONFIG") else None,
                  resolve_data_dir(data_dir) / "cluster.yaml"]
    for c in candidates:
        if c is not None and (c is path or c.exists()):
            try:
                return load_config(c)
            except (SpecError, OSError) as exc:
                typer.echo(f"error: cluster config {c}: {exc}", err=True)
                raise typer.Exit(2) from None
    return ClusterConfig()

