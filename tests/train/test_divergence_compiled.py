"""The compiled chunk chain, and the eager one in cache-sized row blocks, compute what the eager chain
over whole chunks does; a compiler failure costs nothing; the settings that choose the chain and the
chunk."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from mopd.train.kernel import chunk_chain
from mopd.train.kernel.chunk_chain import chunk_size_for, should_compile
from mopd.train.kernel.divergence import KINDS, linear_divergence
from mopd.train.kernel.labels import linear_cross_entropy
from tests.tolerance import LAMBDA, U, assert_close
from tests.train.divergence_cases import make_case
from tests.train.test_divergence import run_fused

# 50 tokens in chunks of 16: three full chunks and a short last one, which the compiled chain runs at
# full width.
N, VOCAB, CHUNK = 50, 97, 16


@pytest.mark.parametrize("kind", ["reverse_kl", "jsd"])
def test_the_compiled_chain_matches_the_eager_one(kind: str) -> None:
    chunk_chain.COMPILED.clear()
    case = make_case(num_tokens=N, vocab=VOCAB, teachers=3, softcap=True, seed=2)
    eager = run_fused(case, kind=kind, chunk=CHUNK, temperature=0.8)
    compiled = run_fused(case, kind=kind, chunk=CHUNK, temperature=0.8, compiled=True)
    assert [k for k, chain in chunk_chain.COMPILED.items() if chain is not None]  # it did compile
    # The same operations, their reductions over the V columns possibly fused and reordered: each side
    # carries its own order's rounding, λ·√V·U per sum (relative to the sum of magnitudes).
    rtol = 2 * LAMBDA * math.sqrt(VOCAB) * U
    for name, c, e in zip(("loss", "per_token", "grad_hidden", "grad_head"), compiled, eager, strict=True):
        assert_close(c, e, rtol=rtol, norm=True, what=name)


def test_a_chain_that_does_not_compile_runs_eagerly_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    chunk_chain.COMPILED.clear()

    def broken(*_args: object, **_kwargs: object) -> object:
        def chain(*_a: object, **_k: object) -> object:
            raise RuntimeError("no compiler here")

        return chain

    monkeypatch.setattr(torch, "compile", broken)
    case = make_case(num_tokens=N, vocab=VOCAB, teachers=3, seed=4)
    with caplog.at_level(logging.WARNING, logger="mopd.divergence"):
        fallen = run_fused(case, kind="reverse_kl", chunk=CHUNK, compiled=True)
        again = run_fused(case, kind="reverse_kl", chunk=CHUNK, compiled=True)
    eager = run_fused(case, kind="reverse_kl", chunk=CHUNK)
    lines = [r.getMessage() for r in caplog.records if r.name == "mopd.divergence"]
    assert len(lines) == 1 and "no compiler here" in lines[0] and "eagerly" in lines[0]
    for got in (fallen, again):
        for g, e in zip(got, eager, strict=True):
            assert torch.equal(g, e)  # the eager chain itself, bit for bit


def test_compile_setting() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [should_compile(s, cpu) for s in ("auto", "on", "off")] == [False, True, False]
    assert [should_compile(s, cuda) for s in ("auto", "on", "off")] == [True, True, False]
    with pytest.raises(ValueError, match="auto, on or off"):
        should_compile("yes", cpu)


def test_the_compiled_hard_label_chain_matches_the_eager_one() -> None:
    chunk_chain.COMPILED.clear()
    case = make_case(num_tokens=N, vocab=VOCAB, seed=6)
    labels = torch.randint(0, VOCAB - 5, (N,), generator=torch.Generator().manual_seed(2))
    labels[7] = -100

    def run(compiled: bool) -> list[torch.Tensor]:
        hs = case.student_hidden.detach().clone().requires_grad_()
        ws = case.student_head.detach().clone().requires_grad_()
        out = linear_cross_entropy(
            hs, ws, labels, weights=case.weights, chunk_size=CHUNK, vocab_size=VOCAB - 5, compiled=compiled
        )
        out.loss.backward()
        assert hs.grad is not None and ws.grad is not None
        return [out.loss.detach(), out.per_token, hs.grad, ws.grad]

    eager, compiled = run(False), run(True)
    assert [k for k, chain in chunk_chain.COMPILED.items() if chain is not None]
    rtol = 2 * LAMBDA * math.sqrt(VOCAB) * U  # as above: one reduction over V, in two orders
    for name, c, e in zip(("loss", "per_token", "grad_hidden", "grad_head"), compiled, eager, strict=True):
        assert_close(c, e, rtol=rtol, norm=True, what=name)


def test_chunk_size_setting() -> None:
    from mopd.config.train import DivergenceConfig
    from mopd.train.kernel.chunk_chain import AUTO_CHUNK

    assert DivergenceConfig().chunk_size == "auto"
    assert chunk_size_for("auto", torch.device("cpu")) == AUTO_CHUNK["cpu"]
    assert chunk_size_for("auto", torch.device("cuda")) == AUTO_CHUNK["cuda"]
    assert chunk_size_for(96, torch.device("cuda")) == 96
    for bad in (0, -4, "big"):
        with pytest.raises(ValueError):
            DivergenceConfig(chunk_size=bad)  # type: ignore[arg-type]


def test_the_api_and_the_trainer_share_one_chunk_rule() -> None:
    """`linear_divergence` and `linear_cross_entropy` default to the trainer's `auto`, resolved by the
    same rule (`chunk_size_for`), and refuse a chunk the config would refuse."""
    import inspect

    from mopd.config.train import DivergenceConfig

    for api in (linear_divergence, linear_cross_entropy):
        assert inspect.signature(api).parameters["chunk_size"].default == DivergenceConfig().chunk_size
    case = make_case(num_tokens=N, vocab=VOCAB, seed=7)
    auto = run_fused(case, kind="reverse_kl", chunk="auto")
    chosen = run_fused(case, kind="reverse_kl", chunk=chunk_size_for("auto", torch.device("cpu")))
    for a, c in zip(auto, chosen, strict=True):
        assert torch.equal(a, c)  # the same chunks, so the same sums in the same order
    with pytest.raises(ValueError, match="chunk_size must be a positive number or auto"):
        run_fused(case, kind="reverse_kl", chunk=0)


@pytest.mark.parametrize("kind", KINDS)
def test_the_chain_in_row_blocks_matches_it_whole(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's eager chain runs a chunk a few rows at a time (`chunk_chain.CACHE_BYTES`); here one row
    at a time, against whole chunks, with padded vocabulary columns."""
    case = make_case(num_tokens=N, vocab=VOCAB, teachers=3, softcap=True, seed=5)

    def run(cache_bytes: int) -> list[torch.Tensor]:
        monkeypatch.setattr(chunk_chain, "CACHE_BYTES", cache_bytes)
        hs = case.student_hidden.detach().clone().requires_grad_()
        ws = case.student_head.detach().clone().requires_grad_()
        out = linear_divergence(
            hs,
            ws,
            case.teacher_hidden,
            case.teacher_heads,
            case.teacher_index,
            kind=kind,
            temperature=0.8,
            weights=case.weights,
            chunk_size=CHUNK,
            vocab_size=VOCAB - 5,
            teacher_transforms=case.transforms,
        )
        out.loss.backward()
        assert hs.grad is not None and ws.grad is not None
        return [out.loss.detach(), out.per_token, hs.grad, ws.grad]

    by_row, whole = run(1), run(1 << 40)
    # The same operations on each row; a row's reductions over V may be split another way when a block
    # is one row (λ·√V·U per sum on each side, relative to the sum of magnitudes).
    rtol = 2 * LAMBDA * math.sqrt(VOCAB) * U
    for name, b, w in zip(("loss", "per_token", "grad_hidden", "grad_head"), by_row, whole, strict=True):
        assert_close(b, w, rtol=rtol, norm=True, what=name)
