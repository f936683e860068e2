"""The criteria as a gate declares them: where each applies, and what it names that the gate
lacks, refused when the gate is declared (how each judges a bench: test_timing.py)."""

from __future__ import annotations

import dataclasses

import pytest

from suite.harness.criteria import BusyBound, CeilingFraction, EagerOverGraph, NotSlowerThan, SpeedupOver, Target


def test_unknown_criterion_name_is_refused_when_the_gate_is_declared():
    import toygate

    def declare(*criteria):
        return dataclasses.replace(toygate.BENCH_GATE, criteria=criteria)

    with pytest.raises(ValueError, match="nope"):
        declare(NotSlowerThan("nope"))
    with pytest.raises(ValueError, match="no preset 'huge'"):
        declare(SpeedupOver(2.0, presets=("huge",), cases=("sum",)))
    for peer in ("nobody", "arm"):  # an unknown contender, or the arm itself
        with pytest.raises(ValueError, match=f"{peer} \\(not a contender timed"):
            declare(SpeedupOver(1.0, peer, presets=("tiny",), cases=("sum",)))
        with pytest.raises(ValueError, match=f"{peer} \\(not a contender timed"):
            declare(Target(1.0, peer, presets=("tiny",), cases=("sum",)))
    with pytest.raises(ValueError, match="timed in mode 'grpah'"):
        declare(SpeedupOver(2.0, presets=("tiny",), cases=("sum",), modes=("grpah",)))
    for criterion in (BusyBound(1.1, presets=("tiny",), cases=("fwd",)),
                      EagerOverGraph(1.1, presets=("tiny",), cases=("fwd",))):
        with pytest.raises(ValueError, match="no bench case 'fwd'"):
            declare(criterion)
    # the toy's one case is timed with the host's clock: no graph replays to bound eager calls by
    with pytest.raises(ValueError, match="both the graph and the eager mode"):
        declare(EagerOverGraph(1.1, presets=("tiny",), cases=("sum",)))
    # a bound or a ceiling names the cases it holds for; everywhere would be a guess
    for criterion in (BusyBound(1.1), CeilingFraction(0.5), EagerOverGraph(1.1)):
        with pytest.raises(ValueError, match="name the cases"):
            declare(criterion)
    # two bars of one kind against one peer at one place: which holds would be a guess
    with pytest.raises(ValueError, match="both apply at one place"):
        declare(SpeedupOver(0.9, cases=("sum",)), SpeedupOver(0.8, presets=("tiny",), cases=("sum",)))
    declare(SpeedupOver(0.9, presets=("tiny",), cases=("sum",)), NotSlowerThan())  # the bar replaces it there


def test_a_criterion_applies_on_each_combination_of_what_it_names():
    criterion = SpeedupOver(0.9, "peer", presets=("a", "b"), cases=("fwd",), modes=("graph",))
    assert criterion.applies("a", "fwd", "graph") and criterion.applies("b", "fwd", "graph")
    assert not criterion.applies("c", "fwd", "graph") and not criterion.applies("a", "bwd", "graph")
    assert not criterion.applies("a", "fwd", "eager")
    assert NotSlowerThan().applies("any", "case", "wall")
    assert not EagerOverGraph(1.1, cases=("fwd",)).applies("a", "fwd", "graph")  # judged on the eager bench
