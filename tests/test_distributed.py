"""Real collectives across processes: gloo on CPU (CI), NCCL on 2 GPUs (marked multigpu).

Each rank holds only its vLLM-layout shard of the same full logits; the sharded ops must return
exactly the plain path's answer (the reference on the full logits) on every rank, for both
transports, eagerly and (NCCL) under CUDA-graph replay with changing inputs. Mismatched shard
geometry raises on every rank instead of hanging.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import shardmax
from shardmax import reference
from shardmax.runtime import dispatch
from shardmax.testing import adversarial_logits, random_verify_batch, shard_like_vllm
from tests._dist import RankPools, run_ranks


@pytest.fixture(scope="module")
def gloo():
    """The gloo tests' ranks: one group per world size, started once for the module's tests and
    reused (:class:`tests._dist.RankPool`; a body that fails kills its pool, the next starts a
    fresh one)."""
    pools = RankPools("gloo")
    yield pools
    pools.close()


def _same_on_all_ranks(t: torch.Tensor, world: int) -> None:
    gathered = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(gathered, t.contiguous())
    for g in gathered:
        assert torch.equal(g, t), "ranks disagree"


DTYPES = (torch.bfloat16, torch.float32)


def _verify_batch(step: int, vocab: int, dtype: torch.dtype, device: str):
    """10 requests on GPUs, 5 on the CPU (each gloo rank runs its kernels in the interpreter)."""
    reqs = 10 if device == "cuda" else 5
    return random_verify_batch(reqs, 3, vocab, seed=step, dtype=dtype, synthetic=(step == 1))


def _expected_verify(vocab: int, device: str) -> list[tuple[torch.Tensor, ...]]:
    """Reference outputs per dtype step, computed once in the test process (CPU tensors).

    On a GPU machine the reference runs on cuda:0 (its synthetic draws are Triton's tl.rand,
    which needs a device or the interpreter)."""
    out = []
    for step, dtype in enumerate(DTYPES):
        batch = _verify_batch(step, vocab, dtype, device)
        if device == "cuda":
            batch = dataclasses.replace(
                batch,
                **{
                    f.name: getattr(batch, f.name).to("cuda:0")
                    for f in dataclasses.fields(batch)
                    if isinstance(getattr(batch, f.name), torch.Tensor)
                },
            )
        out.append(tuple(t.cpu() for t in batch.reference()))
    return out


def _parity_body(
    rank: int,
    world: int,
    device: str,
    vocab: int,
    graphed: bool,
    expected: list[tuple[torch.Tensor, ...]],
) -> None:
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    group = dist.group.WORLD
    for transport in ("allgather", "allreduce", "plain"):
        force = {"variant": "plain"} if transport == "plain" else {"transport": transport}
        for step, dtype in enumerate(DTYPES):
            full = adversarial_logits(20, vocab, dtype=dtype, seed=step, tp_size=world, block=1024)
            shard = shard_like_vllm(full, world)[rank]
            local = shard.local_logits.to(dev)
            with dispatch.override(**force):
                ids = shardmax.vocab_parallel_argmax(
                    local, vocab_start=shard.vocab_start, num_valid=shard.num_valid, group=group
                )
            assert torch.equal(ids.cpu(), reference.argmax(full)), (transport, dtype)
            _same_on_all_ranks(ids, world)

            batch = _verify_batch(step, vocab, dtype, device)
            vshard = shard_like_vllm(batch.logits, world)[rank]
            args = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in batch.args()]
            kwargs = {
                k: (v.to(dev) if isinstance(v, torch.Tensor) else v)
                for k, v in batch.kwargs().items()
            }
            with dispatch.override(**force):
                got = shardmax.sharded_greedy_verify(
                    vshard.local_logits.to(dev),
                    *args,
                    vocab_start=vshard.vocab_start,
                    num_valid=vshard.num_valid,
                    group=group,
                    **kwargs,
                )
            for g, w in zip(got, expected[step], strict=True):
                assert torch.equal(g.cpu(), w.cpu()), (transport, dtype)
                _same_on_all_ranks(g, world)

    if graphed:
        _graph_replay(rank, world, dev, vocab)


def _graph_replay(rank: int, world: int, dev: torch.device, vocab: int) -> None:
    """Capture local kernel + NCCL collective + finish once, replay with new logits."""
    group = dist.group.WORLD
    for transport in ("allgather", "allreduce"):
        full = torch.randn(96, vocab, dtype=torch.bfloat16)
        shard = shard_like_vllm(full, world)[rank]
        static = shard.local_logits.to(dev).clone()
        with dispatch.override(transport=transport):
            shardmax.vocab_parallel_argmax(
                static, vocab_start=shard.vocab_start, num_valid=shard.num_valid, group=group
            )  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: NCCL's watchdog thread queries events while this thread captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = shardmax.vocab_parallel_argmax(
                    static, vocab_start=shard.vocab_start, num_valid=shard.num_valid, group=group
                )
        for seed in range(3):
            g = torch.Generator().manual_seed(100 + seed)
            full = torch.randn(96, vocab, generator=g).to(torch.bfloat16)
            full[seed, 5] = 100.0  # plant a winner
            static.copy_(shard_like_vllm(full, world)[rank].local_logits.to(dev))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), reference.argmax(full)), (transport, seed)


def _mismatch_body(rank: int, world: int, device: str) -> None:
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    local = torch.randn(4, 128, device=dev)
    # rank 1 claims a vocab range that overlaps rank 0's: must raise on every rank
    start = 0 if rank == 0 else 100
    with pytest.raises(ValueError, match="shard geometry mismatch"):
        shardmax.vocab_parallel_argmax(local, vocab_start=start, group=dist.group.WORLD)
    width = 128 if rank == 0 else 192
    with pytest.raises(ValueError, match="local widths differ"):
        shardmax.vocab_parallel_argmax(
            torch.randn(4, width, device=dev),
            vocab_start=rank * 128,
            num_valid=128,
            group=dist.group.WORLD,
        )


def test_gloo_two_ranks_parity(gloo: RankPools) -> None:
    gloo.run(_parity_body, 2, "cpu", 5003, False, _expected_verify(5003, "cpu"))


def test_gloo_geometry_mismatch_raises_on_every_rank(gloo: RankPools) -> None:
    gloo.run(_mismatch_body, 2, "cpu")


@pytest.mark.multigpu
@pytest.mark.parametrize("vocab", [32001, 200064])
def test_nccl_two_gpus_parity_eager_and_graphed(vocab: int) -> None:
    run_ranks(_parity_body, 2, "nccl", "cuda", vocab, True, _expected_verify(vocab, "cuda"))


@pytest.mark.multigpu
def test_nccl_geometry_mismatch_raises_on_every_rank() -> None:
    run_ranks(_mismatch_body, 2, "nccl", "cuda")


# ---------------------------------------------------- geometry changed on one rank, later
GEOMETRY_FIELDS = ("num_valid", "vocab_start", "width", "dtype", "rows")


def _later_change_body(rank: int, world: int, field: str) -> None:
    """Every rank makes a good call, then one rank alone changes one geometry field: every rank
    must raise the same ValueError (never a hang, never a garbage id), and a good call after it
    works again on every rank."""
    group = dist.group.WORLD
    width, rows = 128, 4

    def call(changed: bool) -> torch.Tensor:
        w, r, dtype = width, rows, torch.float32
        start, num_valid = rank * width, width
        if changed and rank == world - 1:
            if field == "num_valid":
                num_valid = width - 3
            elif field == "vocab_start":
                start -= 7  # overlaps the previous rank's range
            elif field == "width":
                w = width + 16
            elif field == "dtype":
                dtype = torch.bfloat16
            elif field == "rows":
                r = rows + 1
        x = torch.randn(r, w, generator=torch.Generator().manual_seed(rank)).to(dtype)
        return shardmax.vocab_parallel_argmax(
            x, vocab_start=start, num_valid=num_valid, group=group
        )

    call(False)
    if field == "num_valid":  # a legal geometry (a shorter last shard): every rank agrees
        ids = call(True)
        _same_on_all_ranks(ids, world)
        parts = [torch.randn(rows, width, generator=torch.Generator().manual_seed(r))
                 for r in range(world)]  # fmt: skip
        parts[-1] = parts[-1][:, : width - 3]
        assert torch.equal(ids, torch.cat(parts, dim=1).argmax(dim=-1))
        return
    with pytest.raises(ValueError, match="shard geometry mismatch") as info:
        call(True)
    messages = [None] * world
    dist.all_gather_object(messages, str(info.value))
    assert len(set(messages)) == 1, messages  # the same error on every rank
    call(False)


def _peer_refusal_body(rank: int, world: int) -> None:
    """One rank's own inputs are refused (a wrong dtype, a wrong draft shape): that rank raises
    its own error, every other rank raises too instead of waiting in the step's collective."""
    group = dist.group.WORLD
    b = random_verify_batch(3, 2, 256 * world, seed=1, prefill_prob=0.0)
    shard = shard_like_vllm(b.logits, world)[rank]
    args = list(b.args())
    if rank == 1:
        args[0] = args[0][:-1]  # draft_sampled one row short
    if rank == 1:
        with pytest.raises(ValueError, match="draft_sampled"):
            shardmax.sharded_greedy_verify(
                shard.local_logits, *args, vocab_start=shard.vocab_start,
                num_valid=shard.num_valid, group=group, **b.kwargs(),
            )  # fmt: skip
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] refused their inputs"):
            shardmax.sharded_greedy_verify(
                shard.local_logits, *args, vocab_start=shard.vocab_start,
                num_valid=shard.num_valid, group=group, **b.kwargs(),
            )  # fmt: skip
    x = torch.zeros(2, 64, dtype=torch.float64 if rank == 0 else torch.float32)
    with pytest.raises((TypeError, ValueError)):
        shardmax.vocab_parallel_argmax(x, vocab_start=64 * rank, group=group)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("field", GEOMETRY_FIELDS)
def test_gloo_geometry_changed_on_one_rank_at_a_later_call(
    gloo: RankPools, world: int, field: str
) -> None:
    gloo.run(_later_change_body, world, field, timeout=240)


def test_gloo_a_rank_refusing_its_inputs_stops_every_rank(gloo: RankPools) -> None:
    gloo.run(_peer_refusal_body, 2, timeout=240)


# ------------------------------------------------ gathering into a given buffer (graph replay)
def _gather_into_body(rank: int, world: int) -> None:
    """``TorchDistributed.all_gather_dim0_into`` writes exactly ``all_gather_dim0``'s bytes into
    the given buffer (what a step replayed from split graphs gathers into), for int64 records and
    a 2-D send; the buffer's other storage is untouched."""
    from shardmax.runtime.collectives import TorchDistributed, gather_into

    coll = TorchDistributed(dist.group.WORLD)
    for shape in ((5,), (3, 4), (3, 2)):
        t = torch.arange(rank * 100, rank * 100 + torch.Size(shape).numel(), dtype=torch.int64)
        t = t.reshape(shape)
        if shape == (3, 2):  # a strided send
            t = torch.stack([t, t], dim=2).reshape(3, 4)[:, ::2]
        want = coll.all_gather_dim0(t)
        backing = torch.full((world * shape[0] + 1, *shape[1:]), -7, dtype=torch.int64)
        out = backing[: world * shape[0]]
        gather_into(coll, t, out)
        assert torch.equal(out, want), shape
        assert torch.equal(backing[-1], torch.full(shape[1:], -7, dtype=torch.int64))
        assert torch.equal(want, torch.cat([t + 100 * (r - rank) for r in range(world)]))


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_gather_into_a_given_buffer(gloo: RankPools, world: int) -> None:
    gloo.run(_gather_into_body, world, timeout=240)


def _split_replay_body(rank: int, world: int) -> None:
    """Sampled steps (two-phase, T = 1, realistic traffic) on each rank's vLLM-layout shard over
    NCCL, two batches of one shape taking turns: replayed from graphs split at their all_gathers
    (gathering straight into the next graph's buffers) every step returns its own eager launches'
    outputs bit for bit, identical on every rank."""
    from shardmax.plan import VocabShard
    from shardmax.runtime.validation import check_step_batch
    from shardmax.testing.traffic import realistic_batch

    dev = torch.device(f"cuda:{rank}")
    steps = []
    for seed in (5, 6):
        t = realistic_batch(24, 3, 151936, seed=seed, mix="temperature", device="cpu")
        shard = shard_like_vllm(t.logits, world)[rank]
        local = shard.local_logits.to(dev)
        batch = check_step_batch(
            local.shape[0], dev, t.draft_sampled.to(dev), t.cu_num_logits.to(dev), t.pos.to(dev),
            t.idx_mapping.to(dev), t.expanded_local_pos.to(dev), t.seed.to(dev),
            t.num_speculative_steps, temperature=t.temperature.to(dev),
        )  # fmt: skip
        steps.append((local, batch, shard))
    local0, _, shard0 = steps[0]
    vshard = VocabShard(
        vocab_start=shard0.vocab_start, num_valid=shard0.num_valid, width=local0.shape[1],
        dtype=local0.dtype, device=dev, group=dist.group.WORLD,
    )  # fmt: skip
    plan = vshard.verify(local0.shape[0])
    refs = [[x.clone() for x in plan.run(local, batch)] for local, batch, _ in steps]
    assert not all(torch.equal(a, b) for a, b in zip(refs[0], refs[1], strict=True))
    graphed = vshard.graphed(plan)
    held = []  # outputs kept alive, as vLLM keeps a step's: later steps take other slots
    for i in range(6):  # eager, captured, then replayed, the batches taking turns
        local, batch, _ = steps[i % 2]
        got = graphed.run(local, batch)
        for g, w in zip(got, refs[i % 2], strict=True):
            assert torch.equal(g, w), f"step {i}"
            _same_on_all_ranks(g, world)
        held.append(got)
    assert graphed.num_graphs == 1


@pytest.mark.multigpu
def test_nccl_split_graph_replay_equals_the_launches() -> None:
    run_ranks(_split_replay_body, 2, "nccl")


class _FakePyNccl:
    """vLLM's PyNcclCommunicator as the coordinator route sees it: ``all_gather(out, in)``."""

    def __init__(self, disabled: bool = False) -> None:
        self.disabled, self.calls = disabled, 0

    def all_gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> None:
        self.calls += 1
        torch.cat([input_tensor, input_tensor + 100], out=output_tensor)


def _fake_coordinator(comm: object) -> object:
    import types

    def all_gather(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        fake.own_gathers += 1
        return torch.cat([t, t + 100], dim=dim)

    fake = types.SimpleNamespace(
        world_size=2, rank_in_group=0, device_group=object(), cpu_group=object(),
        device_communicator=types.SimpleNamespace(pynccl_comm=comm), all_gather=all_gather,
        own_gathers=0,
    )  # fmt: skip
    return fake


def test_vllm_coordinator_gather_route_follows_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The route of ``VllmCoordinator.all_gather_dim0_into`` is the one vLLM's CUDA all_gather
    takes: PyNccl when present and enabled, the device group without it (or disabled, or on
    ROCm), vLLM's own gather (then a copy) with symmetric memory on (its buffer registration is
    collective), gloo for CPU tensors."""
    import types

    from shardmax.runtime.collectives import VllmCoordinator

    cuda = types.SimpleNamespace(is_cuda=True)
    monkeypatch.delenv("VLLM_USE_NCCL_SYMM_MEM", raising=False)
    assert VllmCoordinator(_fake_coordinator(_FakePyNccl())).gather_route(cuda) == "pynccl"
    assert VllmCoordinator(_fake_coordinator(None)).gather_route(cuda) == "device_group"
    disabled = VllmCoordinator(_fake_coordinator(_FakePyNccl(disabled=True)))
    assert disabled.gather_route(cuda) == "device_group"
    assert disabled.gather_route(torch.zeros(1)) == "cpu"
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert VllmCoordinator(_fake_coordinator(_FakePyNccl())).gather_route(cuda) == "device_group"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setenv("VLLM_USE_NCCL_SYMM_MEM", "1")
    assert VllmCoordinator(_fake_coordinator(_FakePyNccl())).gather_route(cuda) == "vllm"
    monkeypatch.setenv("VLLM_USE_NCCL_SYMM_MEM", "0")
    assert VllmCoordinator(_fake_coordinator(_FakePyNccl())).gather_route(cuda) == "pynccl"


@pytest.mark.parametrize("route", ["pynccl", "vllm"])
def test_vllm_coordinator_gathers_into_the_buffer(
    monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """Each CUDA route writes the gathered bytes into the given buffer: PyNccl with (output,
    input) in that order and a contiguous send, vLLM's own gather copied in (routes forced on
    CPU tensors)."""
    from shardmax.runtime.collectives import VllmCoordinator, gather_into

    comm = _FakePyNccl()
    fake = _fake_coordinator(comm)
    coll = VllmCoordinator(fake)
    monkeypatch.setattr(coll, "gather_route", lambda t: route)
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)[:, ::2]  # a strided send
    out = torch.full((6, 2), -1, dtype=torch.int64)
    gather_into(coll, t, out)
    assert torch.equal(out, torch.cat([t, t + 100]))
    assert (comm.calls, fake.own_gathers) == ((1, 0) if route == "pynccl" else (0, 1))
