"""Graph-based activation checkpointing: recompute only what is missing, once, and free it as soon as possible."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from lightning_sac import graph_ac
from lightning_sac.graph_ac import _graph, compose_policies, save_recompute_policy

P = CheckpointPolicy


class Spy:
    """Watch the graph's recomputes and the moments saved tensors are unpacked."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        g = _graph()
        self.computed: list[int] = []
        self.events: list[str] = []
        compute, unpack = g._compute, g.unpack

        def spy_compute(node):  # noqa: ANN001, ANN202
            self.computed.append(id(node))
            return compute(node)

        def spy_unpack(packed):  # noqa: ANN001, ANN202
            self.events.append("unpack")
            return unpack(packed)

        monkeypatch.setattr(g, "_compute", spy_compute)
        monkeypatch.setattr(g, "unpack", spy_unpack)


def _chain(g, x):  # noqa: ANN001, ANN202
    """A <- B <- C <- D, and E = f(B); autograd saves only D and E (tanh and sigmoid keep their outputs;
    scaling and shifting keep nothing).

    E is computed first, so autograd runs D's backward first (later ops first): D is unpacked before E.
    """
    with save_recompute_policy("recompute_all"):
        a = x * 2
        b = a + 1
        e = b.sigmoid()
        c = b * 3
        d = c.tanh()
        nodes = {k: g.refs[t].node for k, t in dict(a=a, b=b, c=c, d=d, e=e).items()}
    return (d * 2).sum() + (e * 3).sum(), nodes


def test_chain_recomputes_each_node_once_and_frees_everything(monkeypatch):
    spy = Spy(monkeypatch)
    g = _graph()
    x = torch.randn(1000, requires_grad=True)
    loss, nodes = _chain(g, x)
    # Use counts taken at pack time along the recursion: B feeds C (for D) and E.
    assert [nodes[k].uses for k in "abcde"] == [1, 2, 1, 1, 1]
    loss.backward()
    assert sorted(spy.computed) == sorted(id(nodes[k]) for k in "abcde")
    assert len(set(spy.computed)) == len(spy.computed) == 5  # each node recomputed exactly once
    assert spy.events == ["unpack", "unpack"]
    assert all(n.cache is None and n.uses == 0 for n in nodes.values())  # everything freed after backward
    ref = x.detach().requires_grad_()
    b = ref * 2 + 1
    (((b * 3).tanh() * 2).sum() + (b.sigmoid() * 3).sum()).backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_a_is_freed_before_e_is_unpacked(monkeypatch):
    g = _graph()
    x = torch.randn(100, requires_grad=True)
    loss, nodes = _chain(g, x)
    seen = []
    realize = g._realize

    def spy(ref):  # noqa: ANN001, ANN202
        if ref.node is nodes["e"]:
            seen.append((nodes["a"].cache is None, nodes["b"].cache is not None, nodes["d"].uses))
        return realize(ref)

    monkeypatch.setattr(g, "_realize", spy)
    loss.backward()
    # When E is realized, D is done, A is already gone and B is still cached for E.
    assert seen == [(True, True, 0)]


def test_nested_must_save_inside_recompute_all_saves_the_inner_ops():
    g = _graph()
    x = torch.randn(10, requires_grad=True)
    with save_recompute_policy("recompute_all"):
        outer = x.sin()
        with save_recompute_policy("must_save_all"):
            inner = outer.cos()
        after = inner.exp()
        nodes = [g.refs[t].node for t in (outer, inner, after)]
    assert [n.saved is not None for n in nodes] == [False, True, False]
    after.sum().backward()
    torch.testing.assert_close(x.grad, -(x.sin().cos().exp() * x.sin().sin() * x.cos()).detach())


def test_conflicting_must_policies_raise_and_bool_policies_work():
    x = torch.randn(4, requires_grad=True)
    outer = save_recompute_policy(lambda ctx, f, *a, **k: P.MUST_RECOMPUTE)
    inner = save_recompute_policy("must_save_all")
    with pytest.raises(RuntimeError, match="disagree: MUST_RECOMPUTE and MUST_SAVE"), outer, inner:
        x.sin()
    g = _graph()
    with save_recompute_policy(lambda ctx, f, *a, **k: ctx.op_index == 0):
        y = x.sin()  # op 0: True -> MUST_SAVE
        z = y.cos()  # op 1: False -> PREFER_RECOMPUTE
        assert g.refs[y].node.saved is not None and g.refs[z].node.saved is None
    assert not g.policies and g.mode is None  # the outermost region's exit uninstalls everything


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        ([], P.PREFER_SAVE),
        ([P.PREFER_RECOMPUTE], P.PREFER_RECOMPUTE),
        ([P.PREFER_RECOMPUTE, P.PREFER_SAVE], P.PREFER_SAVE),  # inner PREFER wins over outer PREFER
        ([P.MUST_SAVE, P.PREFER_RECOMPUTE], P.MUST_SAVE),  # MUST wins over PREFER
        ([P.PREFER_SAVE, P.MUST_RECOMPUTE], P.MUST_RECOMPUTE),
        ([P.MUST_SAVE, P.MUST_SAVE], P.MUST_SAVE),
        ([True], P.MUST_SAVE),
        ([False], P.PREFER_RECOMPUTE),
    ],
)
def test_compose_policies(answers, expected):
    assert compose_policies(answers) == expected


def test_random_ops_recompute_the_same_numbers_and_unknown_shortcuts_are_refused():
    x = torch.randn(1000, requires_grad=True)
    torch.manual_seed(0)
    with save_recompute_policy("recompute_all"):
        y = torch.nn.functional.dropout(x, 0.5).sin()
    y.sum().backward()
    torch.manual_seed(0)
    ref = x.detach().requires_grad_()
    torch.nn.functional.dropout(ref, 0.5).sin().sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)
    with pytest.raises(ValueError, match="Unknown policy shortcut 'save_some'"), save_recompute_policy("save_some"):
        pass
    assert graph_ac.recompute_count() > 0
