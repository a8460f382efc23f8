"""The paths users run, run the way they run them: real gloo ranks, the Inductor-compiled per-rank
program, the losses people train with, several optimizer steps."""

from __future__ import annotations

import e2e_workers
import pytest
import test_hf

from fxshard.runtime.launch import spawn


@pytest.mark.slow
def test_training_with_the_losses_people_use_on_gloo_ranks():
    """Cross-entropy (ignore_index, label smoothing) in the compiled graph and in eager code after
    it, MSE; SGD and AdamW; eval()/no_grad forwards between the steps: single device's numbers."""
    cases = [
        ("ce", "inside", "sgd"),
        ("ce", "inside", "adamw"),
        ("ce", "outside", "adamw"),
        ("mse", "inside", "sgd"),
        ("ce", "inside", "adamw", "vocab"),  # vocab-sharded logits: loss parallel
    ]
    for rank_results in spawn(
        2, e2e_workers.train_losses, cases, timeout=600, collective_timeout=60
    ):
        assert len(rank_results) == len(cases)
        for loss, where, optimizer, rel, _moved in rank_results:
            assert rel < 1e-4, (loss, where, optimizer, rel)
        # loss parallel: the forward moves nothing larger than the hidden states' all-reduces
        # (4 x 8 x 64 floats); the logits (4 x 8 x 8192 floats, half on each rank) stay
        assert rank_results[-1][-1] <= 4 * 8 * 64 * 4, rank_results[-1]


@pytest.mark.slow
def test_transformers_training_with_labels_on_gloo_ranks():
    """model(x, labels=...).loss.backward() (transformers' cross-entropy in the graph) with AdamW,
    a default no_grad call between steps, then greedy generate(), on 2 gloo ranks with Inductor."""
    # every architecture of tests/test_hf.py (a masked LM and an image classifier train and answer
    # the default call; the causal LMs generate too)
    # (not Qwen2 / Mistral: Llama's code with a q/k/v bias / a sliding window longer than these
    # inputs, trained on simulated ranks in tests/test_hf.py; CI time)
    names = [n for n in test_hf.ARCHS if n not in ("qwen2", "mistral")]
    for rank_results in spawn(2, e2e_workers.hf_train, names, timeout=1200, collective_timeout=60):
        assert [r[0] for r in rank_results] == names
        for name, rel, same_tokens in rank_results:
            text = test_hf.ARCHS[name][2] == "text"
            assert rel < 1e-4 and same_tokens is (True if text else None), (name, rel, same_tokens)


@pytest.mark.slow
def test_transformers_training_with_sharded_parameters_on_gloo_ranks():
    """fxshard.parallelize(model, mesh, tp_plan) called as users call a transformers model
    (``pm(input_ids=x, labels=y).loss``, ``attention_mask=`` in eval), AdamW on the DTensor
    parameters, on 2 gloo ranks with Inductor: single device's losses, logits and weights, and a
    training step with no more collectives than transformers' own TP (the parameters' gradients
    stay sharded: no gather).  The default call returns a DynamicCache: its tensors come back as
    KeptTensors (heads-sharded, not gathered; a parallelize program failed on it before), equal to
    single device's, and a loss that reads it trains exactly.  Gemma-2 makes a constant tensor as
    it runs (its embedding scale); (Phi-3, GPT-2's user plan, Mixtral, OLMo-2, Qwen3-MoE measured
    alike: docs/benchmarks.md)."""
    names = ["llama", "gemma2"]
    for r in spawn(2, e2e_workers.hf_parallelize_train, names, timeout=600, collective_timeout=60):
        assert list(r) == names
        for name, got in r.items():
            assert got["err"] < 1e-4 and got["programs"] == 2, (name, got)
            assert got["cache"] == ["KeptTensor"], (name, got)
            if test_hf.ARCHS[name][1] is None:  # the model's own tp_plan: HF's TP applies
                assert got["ours"] <= got["torch"], (name, got)


@pytest.mark.slow
def test_parallelize_returns_global_outputs_with_and_without_autograd():
    """A vocab-parallel head under no_grad, with frozen parameters and between training steps
    returned one rank's half of the logits (silently)."""
    for rank_results in spawn(2, e2e_workers.parallelize_calls, timeout=300, collective_timeout=60):
        same_keys, optimizer_keys = rank_results.pop("state_dict_keys")
        assert same_keys  # get_state_dict(pm, opt): the model's own FQNs
        assert optimizer_keys == ["body.bias", "body.weight", "head.bias", "head.weight"]
        assert set(rank_results) == {
            "no_grad",
            "torch.compile of it",
            "eval after step 0",
            "eval after step 1",
            "after set_state_dict",
            "frozen",
        }
        for name, (shape, err) in rank_results.items():
            assert shape == (4, 8, 100) and err is not None and err < 1e-5, (name, shape, err)


@pytest.mark.slow
def test_a_compiled_call_returns_what_eager_returns():
    """DTensor in: a DTensor out, placed as eager DTensor places it; a style with
    use_local_output=False: a DTensor out; plain inputs with a plan: a plain global tensor."""
    for r in spawn(2, e2e_workers.dtensor_returns, timeout=300, collective_timeout=60):
        assert r["eager torch"][0], r  # what the compiled call is held to
        for name in ("dtensor in", "use_local_output=False", "plain"):
            assert r[name][2] is not None and r[name][2] < 1e-5, (name, r[name])
        assert r["dtensor in"][:2] == (True, ("S(0)",)), r["dtensor in"]
        assert r["use_local_output=False"][0], r["use_local_output=False"]
        assert r["use_local_output=False"][1] == r["eager torch"][1], r
        assert r["plain"][:2] == (False, None), r["plain"]
        # DTensor arguments DTensor's eager rules refuse while dynamo traces: the backend runs them
        for name in (
            "plain params",
            "uneven batch",
            "dynamic seq 16",
            "dynamic seq 24",
            "batch ids",
        ):
            assert r[name][0] and r[name][2] is not None and r[name][2] < 1e-5, (name, r[name])


@pytest.mark.slow
def test_a_read_one_rank_makes_alone_fails_clearly_instead_of_hanging():
    """Rank 0 reads a sharded KeptTensor eagerly (a print), the other rank decodes on: it hung
    (a gather on the mesh's group, paired with the other's program collectives)."""
    results = spawn(2, e2e_workers.lone_read, 10.0, timeout=240, collective_timeout=120)
    for rank, r in enumerate(results):
        assert r["kept"] == "KeptTensor" and r["joint read"] < 1e-4, r
        assert r["error"] is not None and r["seconds"] < 60, (rank, r)
    assert "read" in results[0]["error"] and "t.local" in results[0]["error"], results[0]


@pytest.mark.slow
def test_the_default_call_returns_its_cache_sharded_and_costs_torch_tps_collectives():
    """``model(input_ids)`` creates a DynamicCache and returns it: its keys and values come back as
    each rank's heads (KeptTensors, single device's values when read), not gathered at the end of
    every call, so the prefill and the decode step that takes the cache back run no more
    collectives than transformers' own TP (they gathered 2 per layer)."""
    names = ["llama", "gemma2", "phi3", "mixtral"]
    # phi3's plan gathers its packed qkv_proj (colwise_gather_output): a replicated, plain cache
    kept = {"llama": ["KeptTensor"], "gemma2": ["KeptTensor"], "phi3": ["Tensor"],
            "mixtral": ["KeptTensor"]}  # fmt: skip
    for r in spawn(2, e2e_workers.hf_default_call, names, timeout=600, collective_timeout=60):
        assert list(r) == names
        for name, got in r.items():
            assert got["err"] < 1e-4 and got["kinds"] == kept[name], (name, got)
            assert len(got["ours"]) == 2, (name, got)  # prefill, decode
            assert all(o <= t for o, t in zip(got["ours"], got["torch"])), (name, got)


@pytest.mark.slow
def test_a_training_call_returns_its_cache_sharded_with_its_gradient():
    """``model(x, labels=y)`` in train mode makes and returns a DynamicCache: its keys and values
    were gathered at the end of every training forward (2 all-gathers per layer more than
    transformers' own TP); they come back as each rank's heads (KeptTensors) that keep their
    autograd history: a loss that reads them, and a second call that takes the cache back, give
    single device's gradients.  A whole training step runs no more collectives than torch's TP."""
    names = ["llama", "gemma2"]
    for r in spawn(2, e2e_workers.hf_train_cache, names, timeout=600, collective_timeout=60):
        assert list(r) == names
        for name, got in r.items():
            assert got["err"] < 1e-4 and got["kinds"] == ["KeptTensor"], (name, got)
            assert got["ours"] <= got["torch"], (name, got)
            # the whole step too: the gradients' gathers are one bucket (they were one each:
            # Llama 28 against torch's 16)
            assert got["ours_step"] <= got["torch_step"], (name, got)
