"""Console helpers shared by shardmax's command-line tools (generator, tuner, benchmarks).

* :func:`prog_name`: the program name as the user invoked it (``shardmax-tune`` from the
  console script, ``python -m tuner`` from a checkout, ``python -m shardmax.tuner`` installed),
  so ``--help`` and error messages print a command that works.
* :func:`progress`: progress of a long loop with an ETA. On a terminal a tqdm bar; otherwise
  (a log file, CI, ``2>&1 | tee``) a plain line every ``every`` items or ``min_interval``
  seconds, whichever comes first, and one when the loop ends -- never silent for long, never
  a wall of carriage returns.
* :func:`format_us`: a duration in microseconds in a readable unit (``415.7 ms``).

Standard library and tqdm only (a dependency of the package); importing this module never
imports torch or Triton.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO


def prog_name(package: str | None, script: str) -> str:
    """How the running tool was invoked.

    ``package``: the ``__package__`` of the tool's ``__main__`` (``"tuner"`` or
    ``"shardmax.tuner"``); ``script``: its console-script name (``"shardmax-tune"``). Returns
    the console-script name when ``sys.argv[0]`` is that script, else ``python -m <package>``.
    """
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if argv0.startswith(script):  # shardmax-tune, shardmax-tune.exe
        return script
    return f"python -m {package or script}"


def format_us(us: float | None) -> str:
    """``12.3 us`` / ``415.7 ms`` / ``2.41 s`` for a duration in microseconds (``n/a`` if None
    or not finite)."""
    if us is None or us != us or us in (float("inf"), float("-inf")):
        return "n/a"
    a = abs(us)
    if a < 1e3:
        return f"{us:.1f} us" if a >= 10 else f"{us:.2f} us"
    if a < 1e6:
        return f"{us / 1e3:.1f} ms"
    return f"{us / 1e6:.2f} s"


def format_seconds(s: float) -> str:
    """``42 s`` / ``3 min 05 s`` / ``1 h 02 min``."""
    s = max(0.0, float(s))
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


class LineProgress:
    """Plain-line progress for a stream that is not a terminal (see the module docstring)."""

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        every: int,
        min_interval: float,
        stream: TextIO,
        clock: Any = time.monotonic,
    ) -> None:
        self.total = max(0, int(total))
        self.desc = desc
        self.every = max(1, int(every))
        self.min_interval = float(min_interval)
        self.stream = stream
        self.clock = clock
        self.n = 0
        self.postfix = ""
        self.t0 = clock()
        self._last_n = 0
        self._last_t = self.t0
        self._closed = False
        self._emit("started")

    def line(self) -> str:
        """The current progress line (also what is printed)."""
        elapsed = self.clock() - self.t0
        parts = [f"{self.desc}: {self.n}/{self.total}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"elapsed {format_seconds(elapsed)}")
        if 0 < self.n < self.total:
            parts.append(f"ETA {format_seconds(elapsed / self.n * (self.total - self.n))}")
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    def _emit(self, note: str = "") -> None:
        text = self.line() + (f" ({note})" if note else "")
        print(text, file=self.stream, flush=True)
        self._last_n, self._last_t = self.n, self.clock()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if self.n >= self.total and self.total:
            return  # close() prints the final line
        if self.n - self._last_n >= self.every or now - self._last_t >= self.min_interval:
            self._emit()

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        self.postfix = s

    def write(self, s: str) -> None:
        print(s, file=self.stream, flush=True)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._emit("done" if self.n >= self.total else "stopped")

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoProgress:
    """What :func:`progress` returns when disabled: every call does nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def write(self, s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress(
    total: int,
    desc: str,
    *,
    enabled: bool = True,
    every: int | None = None,
    min_interval: float = 30.0,
    stream: TextIO | None = None,
    leave: bool = False,
) -> Any:
    """A progress reporter for ``total`` items (``update``, ``set_postfix_str``, ``close``,
    usable as a context manager).

    On a terminal (``stream.isatty()``) a tqdm bar with rate and ETA; otherwise a
    :class:`LineProgress` that prints a line every ``every`` items (default: a tenth of
    ``total``) or ``min_interval`` seconds, and a last one on ``close``. ``enabled=False``
    returns a :class:`NoProgress`. ``stream`` defaults to ``sys.stderr``.
    """
    out = stream if stream is not None else sys.stderr
    if not enabled:
        return NoProgress()
    isatty = getattr(out, "isatty", None)
    if callable(isatty) and isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, leave=leave, dynamic_ncols=True, file=out)
    step = every if every is not None else max(1, total // 10)
    return LineProgress(total, desc, every=step, min_interval=min_interval, stream=out)


def rerun_with_interpreter(module: str, argv: list[str] | None) -> int | None:
    """On a machine without a GPU, make sure the Triton interpreter was on before Triton loaded.

    Returns ``None`` when nothing is needed (a GPU is present, or ``TRITON_INTERPRET=1`` is
    already in the environment); otherwise runs ``python -m <module> <argv>`` again in a child
    with ``TRITON_INTERPRET=1`` (a console script imports the ``shardmax`` package, and with it
    Triton, before its ``main`` runs, so setting the variable in-process is too late) and
    returns the child's exit code.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    args = sys.argv[1:] if argv is None else list(argv)
    return subprocess.call([sys.executable, "-m", module, *args], env=env)
