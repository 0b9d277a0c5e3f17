"""`schema export`: the message contract as files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpufleet.cli.common import (
    app,
)

schema_app = typer.Typer(no_args_is_help=True, help="The message contract (JSON Schema, AsyncAPI).")
app.add_typer(schema_app, name="schema")


@schema_app.command("export")
def schema_export(out_dir: Annotated[Path, typer.Argument(help="where to write the schemas")]) -> None:
    """Write a JSON Schema per message type and one AsyncAPI document."""
    from gpufleet.shared.contract.schema import export

    files = export(out_dir)
    typer.echo(f"wrote {len(files)} files to {out_dir}")


