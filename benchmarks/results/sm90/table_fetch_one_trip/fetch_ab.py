"""``table_fetch`` A/B under CUDA-graph replay: GPU us per fetch of two variants of the kernel
(their generated modules, by path) at table sizes around the one-trip kernel's BLOCK (256).

Each variant's fetch is checked first (the entries copied, nothing past them written, the
request number acknowledged), then captured 50 times in a row into one graph, replayed 20 times
between CUDA events; PDL off; three interleaved rounds, the minimum kept. Needs a GPU. Run from
the repository root::

    git show 2c14e7f:generated/table_fetch.py > /tmp/old_table_fetch.py
    python benchmarks/results/sm90/table_fetch_one_trip/fetch_ab.py \\
        /tmp/old_table_fetch.py generated/table_fetch.py > fetch_ab.csv

(the run of this folder made the same measurement from an uncommitted copy of this script
with the two paths written in).
"""

import importlib.util
import sys
from types import ModuleType

import torch

SIZES = (24, 100, 255, 256, 300)  # entries: a greedy / top-p step's table, BLOCK - 1 .. past it
REPEAT, REPLAYS, ROUNDS = 50, 20, 3


def load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def per_fetch_us(mod: ModuleType, n: int) -> float:
    src = torch.arange(1000, 1000 + n + 2, dtype=torch.int64).pin_memory()
    src[n], src[n + 1] = 77 + n, -1  # the request number, the acknowledgement not yet written
    dst = torch.full((n + 8,), -7, dtype=torch.int64, device="cuda")

    def launch() -> None:
        mod.kernel[(1,)](dst, src, n, BLOCK=mod.BLOCK, PDL=False, num_warps=1)

    launch()
    torch.cuda.synchronize()
    ok = torch.equal(dst[:n].cpu(), src[:n]) and bool((dst[n:] == -7).all())
    if not ok or int(src[n + 1]) != 77 + n:
        raise SystemExit(f"{mod.__name__}: wrong fetch at n={n}")
    with torch.cuda.stream(torch.cuda.Stream()):
        launch()  # warm the side stream the capture uses
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            launch()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * REPEAT)


def main() -> None:
    variants = {"old": load(sys.argv[1], "tf_old"), "new": load(sys.argv[2], "tf_new")}
    times: dict[tuple[int, str], list[float]] = {}
    for n in SIZES:
        for _ in range(ROUNDS):
            for tag, mod in variants.items():
                times.setdefault((n, tag), []).append(per_fetch_us(mod, n))
    print("n,variant,us_per_fetch(min of 3 rounds),rounds")
    for (n, tag), us in times.items():
        print(f"{n},{tag},{min(us):.2f},{' '.join(f'{x:.2f}' for x in us)}")


if __name__ == "__main__":
    main()
