"""Test configuration: CPU runs execute every Triton kernel under the Triton interpreter.

``TRITON_INTERPRET=1`` is set before anything imports Triton when no GPU is present, so the
same tests exercise every generated variant on CPU tensors. Tests marked ``gpu`` skip without a
CUDA/ROCm device; ``multigpu`` ones need two. Tests marked ``slow`` are deselected by
``pyproject.toml``'s ``addopts``; ``SHARDMAX_SLOW_TESTS=1`` (or ``scripts/test.sh --slow``, or
any ``-m`` expression on the command line) brings them back.

``--part I/N`` runs the I-th of N consecutive slices of the selected tests
(``scripts/gpu_checks.sh`` runs the GPU set in three).

Warnings: ``pyproject.toml`` turns every RuntimeWarning and every warning from the project's own
modules into an error. Tests marked ``e2e`` run vLLM's own code and kernels in this process;
their warnings are vLLM's, so those tests keep pytest's default (warnings shown, not fatal).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_the_cores_between_xdist_workers() -> None:
    """Under pytest-xdist (``-n N``) every worker gets its share of the cores for torch's
    intra-op threads, and so do the processes it starts (gloo ranks, AOT compiles), through
    ``OMP_NUM_THREADS``: by default each worker would run as many OpenMP threads as the machine
    has cores, and N workers' spinning threads on the same cores burn CPU time without doing
    work (on 2 cores with ``-n 2``, the plain-torch reference tests took several times their
    CPU time). Only the thread count changes; an ``OMP_NUM_THREADS`` set by the caller wins."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // max(1, int(workers)))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores_between_xdist_workers()


def _same_examples_every_run() -> None:
    """Every Hypothesis test draws the same examples in every run (CI included): a property
    test that fails must fail on every run of the commit that broke it, never on a later
    unrelated one. ``SHARDMAX_FUZZ_RANDOM=1`` draws fresh examples (a soak run); no example
    database is written into the checkout and no deadline applies (the interpreter's times
    vary by orders of magnitude). Loaded before the test modules import, so their own
    ``@settings(...)`` inherit it."""
    try:
        from hypothesis import settings
    except ImportError:  # the Hypothesis tests importorskip it
        return
    settings.register_profile(
        "shardmax",
        derandomize=os.environ.get("SHARDMAX_FUZZ_RANDOM") != "1",
        database=None,
        deadline=None,
    )
    settings.load_profile("shardmax")


_same_examples_every_run()


def _interpreter_patches_the_language_once_per_launch() -> None:
    """Triton's interpreter (``TRITON_INTERPRET=1``) patches ``triton.language`` for the
    interpreter when a launch starts and restores it when the launch ends; it also patches it
    again on every call of a ``@triton.jit`` device function inside the launch (Triton 3.9:
    ``InterpretedFunction.__call__`` -> ``_patch_lang``, an ``inspect.getmembers`` walk over
    the language's modules). The kernels' device functions run in loops (the top-p replay calls
    them ~20 000 times in a small step), and those walks were a third of the interpreted suite's
    CPU time. A nested call finds the language already patched by its launch, for the same
    modules, so this skips it; a device function whose module sees a language module its
    kernel's does not (``tl.zeros``: ``triton.language.core``) still patches it, once per
    launch. Where the interpreter's structure differs (another Triton), nothing changes.
    Kernel semantics are untouched: every test still compares against its reference, and
    ``tests/test_interpreter_once.py`` checks the shim itself."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    real = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if real is None or scope_type is None or getattr(real, "_shardmax_once", False):
        return
    modules = (tl, tl.core)
    active: set[int] = set()  # the language modules the running launch patched (ids)

    def langs(fn: Any) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if any(v is m for m in modules)}

    def patch_lang(fn: Any) -> Any:
        mine = langs(fn)
        if active and mine <= active:  # a device function inside a launch: already patched
            return scope_type()
        outer = not active
        scope = real(fn)
        active.update(mine)
        if outer:  # the launch's own patch: its restore ends the launch
            restore = scope.restore

            def restore_and_end() -> None:
                try:
                    restore()
                finally:
                    active.clear()

            scope.restore = restore_and_end
        return scope

    patch_lang._shardmax_once = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang


_interpreter_patches_the_language_once_per_launch()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seeded_global_generator(request: pytest.FixtureRequest) -> None:
    """Every test starts torch's global generator from a seed of its own node id: a test that
    draws from it without a generator of its own sees the same numbers in every run, whichever
    tests ran before it in its xdist worker (torch seeds it differently in every process)."""
    torch.manual_seed(
        int.from_bytes(hashlib.sha256(request.node.nodeid.encode()).digest()[:8], "big")
    )


DEFAULT_MARKEXPR = "not e2e and not slow"

# Parametrizations marked ``slow`` here (their files belong to other work; the marker is the
# only change): the default run keeps a covering subset, so every class of behaviour still runs.
# test_every_local_variant_every_finish: 24 shard_keys variants (3 dtypes x 2 alignments x 4
# blocks), 13-26 CPU-s each; the default keeps every (alignment, block) pair once with the
# dtypes rotating (each dtype at least twice), the other 16 run with --slow.
# test_vocab_and_k: 4 vocabularies x K 1/3/5 (each over TP 1/2/3/4/8); the default keeps every
# vocabulary once and every K at least once.
_KEPT_BY_DEFAULT: dict[str, tuple[str, set[object]]] = {
    "tests/test_argmax.py::test_every_local_variant_every_finish": ("variant", {
        "shard_keys_bf16_va1_b1024", "shard_keys_fp16_va1_b2048", "shard_keys_fp32_va1_b4096",
        "shard_keys_bf16_va1_b8192", "shard_keys_fp16_va16_b1024", "shard_keys_fp32_va16_b2048",
        "shard_keys_bf16_va16_b4096", "shard_keys_fp16_va16_b8192",
    }),
    "tests/test_verify.py::test_vocab_and_k": ("vocab,k", {
        (1000, 3), (32001, 5), (50257, 1), (200064, 5),
    }),
}  # fmt: skip


def _slow_by_default(item: pytest.Item) -> bool:
    rule = _KEPT_BY_DEFAULT.get(item.nodeid.split("[", 1)[0])
    if rule is None:
        return False
    params = item.callspec.params  # type: ignore[attr-defined]
    names = rule[0].split(",")
    value = params[names[0]] if len(names) == 1 else tuple(params[n] for n in names)
    return value not in rule[1]


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--part") is not None:
        config.pluginmanager.register(_Part(*_part(config.getoption("--part"))), "shardmax-part")
    if os.environ.get("SHARDMAX_SLOW_TESTS") == "1" and config.option.markexpr == DEFAULT_MARKEXPR:
        config.option.markexpr = "not e2e"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--part",
        default=None,
        metavar="I/N",
        help="run only the I-th of N consecutive slices of the selected tests (after -m / -k; "
        "scripts/gpu_checks.sh: one machine call per slice)",
    )


def _part(spec: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)``; a clear error for anything else."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--part: expected I/N (e.g. 1/3), got {spec!r}") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--part: expected 1 <= I <= N, got {spec!r}")
    return i, n


def part_of(
    items: list[pytest.Item], i: int, n: int
) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """``items`` split into N consecutive slices of near-equal counts: the I-th (1-based) and
    the rest. Consecutive, so a file's tests stay together and their module fixtures are
    built once per part; every item falls in exactly one slice."""
    lo, hi = len(items) * (i - 1) // n, len(items) * i // n
    return items[lo:hi], items[:lo] + items[hi:]


class _Part:
    """The ``--part I/N`` plugin: keeps the I-th slice of what -m / -k selected, and says which
    slice of which selection it ran (:func:`selection_id`): the parts of one set run in
    separate processes, often on separate machines, so a part that collected a different set
    (a file skipped at import there, vLLM's kernels missing) would leave tests unrun between
    the slices -- equal selection ids across the parts show it did not."""

    def __init__(self, i: int, n: int) -> None:
        self.i, self.n = i, n
        self.line = ""

    @pytest.hookimpl(trylast=True)  # after the -m / -k selection (the mark plugin's hook)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        total, ident = len(items), selection_id(items)
        kept, dropped = part_of(items, self.i, self.n)
        first = total * (self.i - 1) // self.n
        self.line = (
            f"--part {self.i}/{self.n}: tests {first + 1}-{first + len(kept)} of {total} "
            f"selected, selection id {ident} (the same in every part of one set)"
        )
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.write_line(self.line)


def selection_id(items: list[pytest.Item]) -> str:
    """A short digest of the selected tests' ids, in order."""
    digest = hashlib.sha1("\n".join(item.nodeid for item in items).encode())
    return digest.hexdigest()[:12]


@pytest.hookimpl(tryfirst=True)  # before the -m selection (the mark plugin's hook) runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if _slow_by_default(item):
            item.add_marker(pytest.mark.slow)
        if "e2e" in item.keywords:
            item.add_marker(pytest.mark.filterwarnings("default"))
        if "gpu" in item.keywords and n == 0:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason="needs two GPUs"))


@pytest.fixture
def device() -> str:
    return DEVICE
