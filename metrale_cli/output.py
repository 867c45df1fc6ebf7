"""All printing: rich on a terminal, plain text otherwise, JSON with --json.

Generated text goes to stdout; status lines, tables' captions and errors go to stderr, so
``metrale generate ... > answer.txt`` captures the answer alone.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


class Output:
    def __init__(self, json_mode: bool = False, quiet: bool = False):
        self.json_mode = json_mode
        self.quiet = quiet
        self.out = Console(highlight=False, soft_wrap=True)
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)

    # --- status -----------------------------------------------------------------------------
    def info(self, message: str) -> None:
        if not self.quiet:
            self.err.print(f"[dim]{message}[/dim]" if self.err.is_terminal else message, markup=self.err.is_terminal)

    def error(self, message: str, hint: str | None = None) -> None:
        """One ``error:`` line (and a ``hint:``) on stderr; with --json one JSON object there."""
        if self.json_mode:
            sys.stderr.write(json.dumps({"error": message, "hint": hint}) + "\n")
            return
        self.err.print(f"error: {message}", style="bold red", markup=False)
        if hint:
            self.err.print(f"hint: {hint}", style="yellow", markup=False)

    # --- results ----------------------------------------------------------------------------
    def stream(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def text(self, text: str) -> None:
        self.out.print(text, markup=False)

    def json(self, payload) -> None:
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")

    def json_line(self, payload) -> None:
        """One JSON object on one line (JSON Lines), flushed: a record of a stream of them."""
        sys.stdout.write(json.dumps(payload) + "\n")
        sys.stdout.flush()

    def table(self, title: str, columns: list[str], rows: list[list], caption: str | None = None) -> None:
        if not self.out.is_terminal:
            self._plain_table(title, columns, rows, caption)
            return
        table = Table(title=title, caption=caption)
        for c in columns:
            table.add_column(c)
        for r in rows:
            table.add_row(*[str(x) for x in r])
        self.out.print(table)

    def _plain_table(self, title, columns, rows, caption) -> None:
        cells = [columns] + [[str(x) for x in r] for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        print(title)
        for r in cells:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if caption:
            print(caption)

    # --- progress ---------------------------------------------------------------------------
    @contextmanager
    def progress(self, description: str, bytes_mode: bool = True):
        """Yields a ``callback(done, total)``; a rich bar on a terminal, silent otherwise. Its
        ``describe(text)`` says what is going on now: a status line, and the bar's label."""
        if self.quiet or not self.err.is_terminal:
            yield _Progress(self)
            return
        columns = [TextColumn("{task.description}"), BarColumn()]
        columns += [DownloadColumn()] if bytes_mode else [TextColumn("{task.completed}/{task.total}")]
        with Progress(*columns, TimeRemainingColumn(), console=self.err, transient=True) as bar:
            yield _Progress(self, bar, bar.add_task(description, total=None))


class _Progress:
    """Output.progress's callback."""

    def __init__(self, out: Output, bar: Progress | None = None, task=None):
        self.out, self.bar, self.task = out, bar, task

    def __call__(self, done: int, total: int | None) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)

    def describe(self, text: str) -> None:
        self.out.info(text)
        if self.bar is not None:
            self.bar.update(self.task, description=text)


class SilentOutput(Output):
    """What a tensor-parallel worker rank writes: nothing (rank 0 owns the output)."""

    def __init__(self):
        super().__init__(quiet=True)

    def info(self, message: str) -> None:
        pass

    def error(self, message: str, hint: str | None = None) -> None:
        pass

    def stream(self, text: str) -> None:
        pass

    def text(self, text: str) -> None:
        pass

    def json(self, payload) -> None:
        pass

    def json_line(self, payload) -> None:
        pass

    def table(self, title: str, columns: list[str], rows: list[list], caption: str | None = None) -> None:
        pass
