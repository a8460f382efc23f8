"""The paths users run, run the way they run them: real gloo ranks, the Inductor-compiled per-rank
program, the losses people train with, several optimizer steps."""

from __future__ import annotations

import e2e_workers
import pytest

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
    ]
    for rank_results in spawn(
        2, e2e_workers.train_losses, cases, timeout=600, collective_timeout=60
    ):
        assert len(rank_results) == len(cases)
        for loss, where, optimizer, rel in rank_results:
            assert rel < 1e-4, (loss, where, optimizer, rel)


@pytest.mark.slow
def test_transformers_training_with_labels_on_gloo_ranks():
    """model(x, labels=...).loss.backward() (transformers' cross-entropy in the graph) with AdamW,
    a default no_grad call between steps, on 2 gloo ranks with Inductor."""
    names = ["llama", "qwen3", "mixtral"]
    for rank_results in spawn(2, e2e_workers.hf_train, names, timeout=600, collective_timeout=60):
        assert [r[0] for r in rank_results] == names
        for name, rel in rank_results:
            assert rel < 1e-4, (name, rel)
