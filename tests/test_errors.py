"""What a user gets wrong gets a clear error: what, where in their code, and what to do."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fxshard

M2 = fxshard.MeshSpec((2,))
X = torch.randn(4, 8)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Masked(nn.Module):
    def forward(self, x):
        return x[x > 0].sum()


class Branch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class Item(nn.Module):
    def forward(self, x):
        return x * x.sum().item()


class Cond(nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t * 3, (x,))


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize(
    "model, words",
    [
        (Masked(), ["Masked", "depends on tensor values", "test_errors.py:", "x[x > 0]"]),
        (Branch(), ["Branch", "depends on tensor values", "test_errors.py:", "if x.sum() > 0"]),
        (Cond(), ["Cond", "torch.cond", "test_errors.py:", "torch.where"]),
        (Item(), ["Item", "tensor", "test_errors.py:", "x.sum().item()", "_local_scalar_dense"]),
    ],
    ids=["boolean_index", "python_if", "torch_cond", "item"],
)
def test_value_dependent_programs_name_the_line(model, words, training):
    x = X.clone().requires_grad_(training)
    with pytest.raises((RuntimeError, NotImplementedError)) as e:
        fxshard.shard(model, M2, {}, example_inputs=(x,), training=training)
    for w in words:
        if training and model.__class__ is Cond and w.startswith("test_errors"):
            continue  # AOT's joint graph keeps no source line for a torch.cond node
        assert w in str(e.value), str(e.value)


USER_FILE = """
import torch.nn as nn


class Masked(nn.Module):
    def forward(self, x):
        return x[x > 0].sum()


def fn(a):
    return a.no_such_attribute
"""


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("folder", ["fxshard", "torch", "fxshard/capture"])
def test_the_users_line_wherever_their_code_lives(tmp_path, folder, training):
    """A user's code under a folder named like a package (a clone of this project is named
    fxshard) is still the user's: errors name its file and line."""
    import importlib.util

    where = tmp_path / folder
    where.mkdir(parents=True)
    path = where / "user_model.py"
    path.write_text(USER_FILE)
    spec = importlib.util.spec_from_file_location("user_model_in_" + folder.replace("/", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = X.clone().requires_grad_(training)
    with pytest.raises(
        (RuntimeError, NotImplementedError), match=r"user_model\.py:7 \(`return x\[x > 0\]"
    ):
        fxshard.shard(module.Masked(), M2, {}, example_inputs=(x,), training=training)
    with pytest.raises(RuntimeError, match=r"fn at user_model\.py:11"):
        fxshard.shard(module.fn, M2, None, example_inputs=(X,))


def my_function(a):
    return a.no_such_attribute


def test_a_function_is_named_by_its_name():
    with pytest.raises(RuntimeError, match=r"my_function at test_errors\.py:\d+"):
        fxshard.shard(my_function, M2, None, example_inputs=(X,))


def test_arguments_of_the_wrong_kind():
    with pytest.raises(TypeError, match="plan must be a dict"):
        fxshard.shard(MLP(), M2, [ColwiseParallel()], example_inputs=(X,))
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['memory'\]"):
        fxshard.shard(MLP(), M2, "auto", example_inputs=(X,), auto_options={"memory": 1})
    with pytest.raises(TypeError, match="expected a mesh"):
        fxshard.shard(MLP(), "2", {}, example_inputs=(X,))
    with pytest.raises(TypeError, match="cost_model must be"):
        fxshard.plan_redistribute(M2, (Shard(0),), (Replicate(),), (4, 8), cost_model="fast")
    with pytest.raises(TypeError, match="cost model needs"):
        fxshard.shard(MLP(), M2, {}, example_inputs=(X,), cost_model="fast")


def test_friendlier_forms_are_accepted():
    # a mesh shape, a dict of AutoOptions fields, and "" for the model itself
    prog = fxshard.shard(
        MLP(), (2,), "auto", example_inputs=(X,), auto_options={"time_budget_s": 5}
    )
    assert prog.mesh.shape == (2,)
    lin = nn.Linear(8, 16)
    # one input given as the tensor itself, not a tuple of one
    prog = fxshard.shard(lin, M2, {"": ColwiseParallel()}, example_inputs=X)
    torch.testing.assert_close(prog.simulate(X), lin(X).detach())
    prog = fxshard.shard(lin, M2, {"": ColwiseParallel()}, example_inputs=(X,))
    torch.testing.assert_close(prog.simulate(X), lin(X).detach())
    weight = next(p for p in prog.placeholders if p.meta["fxshard"].fqn == "weight")
    assert weight.meta["fxshard"].spec.placements == (Shard(0),)


class GraphBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(h)


class Loss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).pow(2).sum()


def test_a_graph_without_parameters_under_a_module_plan():
    # the loss after the model's graph break is a graph of its own, with no parameter in it
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Loss(GraphBreak())
    plan = {"model.fc1": ColwiseParallel(), "model.fc2": RowwiseParallel()}
    f = torch.compile(
        model, backend="fxshard", options={"mesh": (2,), "plan": plan, "simulate": True}
    )
    loss = f(X)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = model(X)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)


def test_an_unknown_tp_plan_style_names_fxshard_and_the_remedies():
    with pytest.raises(
        ValueError,
        match="fxshard: plan entry 'fc1': unknown tp_plan style 'newest'.*ParallelStyle.*leave",
    ):
        fxshard.shard(MLP(), M2, {"fc1": "newest"}, example_inputs=(X,))
