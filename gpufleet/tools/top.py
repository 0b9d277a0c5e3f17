"""`gpufleet top`: a live, full-screen view of the fleet (nodes and their GPUs, queues, the jobs
that moved last), fed by the stream, like `nvtop` or `k9s`.

It starts from the dashboard's board at the head (`Fleet.board_at`: the admin from the nearest
view snapshot, a tenant from its own events) and folds every event after it as it comes (an
ordered consumer on `fleet.evt.>`, a tenant's push consumer on its own subjects), redrawing at
most `FPS` times a second on the terminal's alternate screen (rich `Live`: no flicker, the
terminal as it was afterwards). `q` (or Ctrl-C) quits. Not on a terminal, or with `--once`, it
prints one frame and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

FPS = 4
# a GPU cell: its state as the dashboard names it (gpufleet/tools/dashboard.py Board.state)
CELLS = {"free": ("·", "dim"), "shared": ("▒", "cyan"), "allocated": ("█", "green"),
         "quarantined": ("?", "yellow"), "unhealthy": ("✗", "bold red")}
PENDING = ("submitted", "admitted", "queued", "reserved")


def summary(state: dict[str, Any]) -> dict[str, int]:
    """Counts of the header line: nodes by status, GPUs by state, jobs running and pending."""
    out = {"nodes": len(state["nodes"]), "gpus": 0}
    for n in state["nodes"]:
        out[f"nodes_{n['status']}"] = out.get(f"nodes_{n['status']}", 0) + 1
        for c in n["gpus"]:
            out["gpus"] += 1
            out[f"gpus_{c['state']}"] = out.get(f"gpus_{c['state']}", 0) + 1
    jobs = state["jobs"]
    out["running"] = jobs.get("running", 0) + jobs.get("placed", 0)
    out["pending"] = sum(jobs.get(s, 0) for s in PENDING)
    return out


def frame(state: dict[str, Any], height: int = 50, source: str = "") -> Group:
    """One screen of `state` (Board.state), fitted to `height` lines: the busiest nodes first."""
    s = summary(state)
    head = Text.assemble(
        ("gpufleet top", "bold"), f"  seq {state['seq']}  {time.strftime('%H:%M:%S')}  {source}\n",
        f"nodes {s['nodes']} (", (f"{s.get('nodes_ready', 0)} ready", "green"), ", ",
        (f"{s.get('nodes_lost', 0)} lost", "red" if s.get("nodes_lost") else ""), ", ",
        f"{s.get('nodes_cordoned', 0)} cordoned)   GPUs {s['gpus']} (",
        (f"{s.get('gpus_allocated', 0) + s.get('gpus_shared', 0)} in use", "green"), ", ",
        (f"{s.get('gpus_unhealthy', 0)} unhealthy", "red" if s.get("gpus_unhealthy") else ""), ", ",
        f"{s.get('gpus_quarantined', 0)} quarantined)   jobs: {s['running']} running, {s['pending']} pending",
    )
    queues = Table(title="queues", title_justify="left", expand=False, pad_edge=False)
    for col in ("QUEUE", "GPUS USED", "RUNNING", "PENDING"):
        queues.add_column(col, justify="left" if col == "QUEUE" else "right")
    for q in state["queues"]:
        queues.add_row(q["queue"], str(q["gpus_used"]), str(q["running_or_placed"]), str(q["pending"]))
    room = max(3, height - 14 - len(state["queues"]))
    nodes = Table(title="nodes", title_justify="left", expand=False, pad_edge=False)
    for col in ("NODE", "STATUS", "MODEL", "GPUS", "JOBS"):
        nodes.add_column(col)
    busiest = sorted(state["nodes"], key=lambda n: (-sum(c["milli"] for c in n["gpus"]), n["node_id"]))
    shown = busiest[:max(1, room // 2)]
    for n in shown:
        cells = Text()
        for c in n["gpus"]:
            ch, style = CELLS.get(c["state"], ("?", ""))
            cells.append(ch, style=style)
        status = Text(n["status"], style="green" if n["status"] == "ready" else "red")
        nodes.add_row(n["node_id"], status, n["model"] or "-", cells, ", ".join(n["jobs"][:3])
                      + (f" +{len(n['jobs']) - 3}" if len(n["jobs"]) > 3 else ""))
    if len(busiest) > len(shown):
        nodes.caption = f"{len(busiest) - len(shown)} more nodes (the busiest shown)"
    jobs = Table(title="jobs, most recently active first", title_justify="left", expand=False, pad_edge=False)
    for col, least in (("JOB", 26), ("TENANT", 6), ("QUEUE", 7), ("NAME", 8), ("STATUS", 11), ("GPUS", 4),
                       ("NODES", 9), ("REASON", 6)):
        jobs.add_column(col, overflow="ellipsis", no_wrap=True, min_width=least,
                        justify="right" if col == "GPUS" else "left")
    for j in state["recent"][:max(1, room - len(shown))]:
        jobs.add_row(j["job_id"], j["tenant"], j["queue"], j["name"], j["status"], f"{j['gpus']:g}",
                     ",".join(j["nodes"][:2]), (j["reason"] or "")[:60])
    legend = Text.assemble(*(x for k, (ch, st) in CELLS.items() for x in ((ch, st), f" {k}  ")), "   q quits")
    return Group(head, queues, nodes, jobs, legend)


class _Keys:
    """`q` from the terminal, read in cbreak mode (no Enter needed; the mode is restored after)."""

    def __init__(self) -> None:
        self.quit = asyncio.Event()
        self._saved: Any = None

    def __enter__(self) -> _Keys:
        if not sys.stdin.isatty():
            return self
        import termios
        import tty

        fd = sys.stdin.fileno()
        self._saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
        asyncio.get_running_loop().add_reader(fd, self._read)
        return self

    def _read(self) -> None:
        data = os.read(sys.stdin.fileno(), 64)
        if not data or b"q" in data.lower() or b"\x03" in data:
            self.quit.set()

    def __exit__(self, *exc: object) -> None:
        if self._saved is None:
            return
        import termios

        fd = sys.stdin.fileno()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, self._saved)


async def run(fleet: Any, once: bool = False, console: Console | None = None) -> dict[str, Any]:
    """Show the fleet until `q`; returns the last state shown."""
    from nats.js.api import ConsumerConfig, DeliverPolicy
    from rich.live import Live

    from gpufleet.shared.runtime.log import tenant_subscribe
    from gpufleet.tools.viewsnap import fold_message

    console = console or Console()
    board, _ = await fleet.board_at(ended=False)
    tenant = fleet.tenant
    source = f"(tenant {tenant})" if tenant else ""
    if once or not console.is_terminal:
        state = board.state(tenant)
        console.print(frame(state, console.height, source))
        return state  # type: ignore[no-any-return]
    start = board.view.seq + 1
    if tenant is None:
        sub = await fleet.bus.js.subscribe("fleet.evt.>", ordered_consumer=True, config=ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start))
    else:
        sub = await tenant_subscribe(fleet.bus, f"fleet.evt.{tenant}.>", DeliverPolicy.BY_START_SEQUENCE, start)

    async def follow() -> None:
        async for msg in sub.messages:
            fold_message(board, msg)

    task = asyncio.create_task(follow())
    state = board.state(tenant)
    try:
        with _Keys() as keys, Live(frame(state, console.height, source), console=console, screen=True,
                                   auto_refresh=False, redirect_stderr=False) as live:
            while not keys.quit.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(keys.quit.wait(), 1 / FPS)
                state = board.state(tenant)
                live.update(frame(state, console.height, source), refresh=True)
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return state  # type: ignore[no-any-return]
