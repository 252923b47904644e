"""The ``servekit`` command line: each command parses its flags, builds a config and makes one call."""

from __future__ import annotations

import signal

import typer

from .batch import batch
from .bench import bench, compare
from .infer import demo, infer
from .models import models_app, repo_app
from .precision import accuracy, optimize
from .serve import serve, triton
from .traces import traces
from .tune import tune

__all__ = ["app", "main"]

app = typer.Typer(
    help="servekit: serve deep-learning models in-process, on Triton and on Ray.",
    context_settings={"max_content_width": 120},
    # Plain help: Rich's boxed tables cut the text into narrow columns whenever the
    # terminal is narrow or unknown (a pipe, CI logs); click's layout reads at any width.
    rich_markup_mode=None,
)
app.add_typer(models_app, name="models")
app.add_typer(repo_app, name="repo")
for command in (infer, serve, bench, compare, tune, optimize, accuracy, batch, demo, traces):
    app.command()(command)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(triton)


def main() -> None:
    # A SIGTERM before a command installs its own handlers (the Supervisor's) ends the
    # process at once with 0: nothing has started yet that must be stopped.
    signal.signal(signal.SIGTERM, _stop_before_start)
    app()


def _stop_before_start(signum: int, frame: object) -> None:
    raise SystemExit(0)
