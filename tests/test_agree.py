"""Ranks that disagree (another batch, other weights, other random seeds, another program) and a
rank that fails alone: on real gloo ranks, every rank must raise a clear error, or be made to
agree, and never wait in a collective for a rank that will not come."""

import e2e_workers  # noqa: I001 (tests/ is on sys.path)
import pytest

from fxshard.runtime.launch import spawn


@pytest.mark.slow
def test_ranks_that_disagree_raise_together_or_take_rank_zeros_values():
    for rank, out in enumerate(spawn(2, e2e_workers.ranks_disagree, timeout=200)):
        kind, msg = out["inputs"]
        assert kind == "RanksDisagree" and "input 0 (x)" in msg, (rank, out["inputs"])
        rel_out, rel_weight = out["weights"]
        assert rel_out < 1e-6 and rel_weight == 0.0, (rank, out["weights"])
        kind, msg = out["random"]
        assert kind == "RanksDisagree" and "random generator state" in msg, (rank, msg)
        assert "torch.manual_seed" in msg
        assert out["random_alike"] < 1e-6, (rank, out["random_alike"])
        assert out["backend_weights"] < 1e-6, (rank, out["backend_weights"])
        assert out["backend_random"] < 1e-6, (rank, out["backend_random"])
        assert out["backend_update"] < 1e-6, (rank, out["backend_update"])
        kind, msg = out["backend_recompile"]
        assert kind == "RanksDisagree" and "program" in msg, (rank, out["backend_recompile"])


@pytest.mark.slow
def test_ranks_that_disagree_on_an_uneven_program():
    for rank, out in enumerate(spawn(2, e2e_workers.uneven_ranks_disagree, timeout=200)):
        assert out["uneven"], rank
        kind, msg = out["inputs"]
        assert kind == "RanksDisagree" and "input 0 (x)" in msg, (rank, out["inputs"])
        assert out["weights"] < 1e-6, (rank, out["weights"])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bad_input", "absent", "hung"])
def test_a_rank_that_fails_alone_fails_the_others_fast(case):
    # the process group's own timeout is 120 s: the other rank must raise far sooner (a failing
    # rank aborts the groups; a rank that hangs meets AgreementOptions.collective_timeout_s)
    outs = spawn(2, e2e_workers.rank_fails_alone, case, timeout=200, collective_timeout=120)
    for rank, (kind, msg, seconds) in enumerate(outs):
        assert kind != "ok", (rank, kind, msg)
        assert kind == "hung" or seconds < 40, (rank, kind, msg, seconds)
    if case == "hung":
        assert outs[0][0] == "RuntimeError" and outs[0][2] < 15, outs[0]
    elif case == "bad_input":
        assert outs[1][0] == "ValueError" and "shape (5, 16)" in outs[1][1]
    else:
        assert outs[0][0] == "RanksDisagree" and "did not come" in outs[0][1]


@pytest.mark.slow
def test_a_rank_that_dies_without_a_word_is_named():
    with pytest.raises(RuntimeError) as e:
        spawn(2, e2e_workers.one_rank_dies, timeout=60)
    assert "rank 0's own error" in str(e.value)
    assert "rank 1 died (exit code 3) without reporting" in str(e.value)
