"""kvtier.session without a daemon: which ranks a client says share its kvtierd (``node_ranks``)."""

from __future__ import annotations

import pytest

from kvtier.session import NODE_RANKS_ENV, _node_ranks


def test_every_rank_by_default(monkeypatch):
    monkeypatch.delenv(NODE_RANKS_ENV, raising=False)
    assert _node_ranks(None, 3, 4) == (0, 1, 2, 3)
    assert _node_ranks(None, None, 2) == (0, 1)


def test_given_ranks_win_over_the_environment(monkeypatch):
    monkeypatch.setenv(NODE_RANKS_ENV, "0-7")
    assert _node_ranks(range(15, 7, -1), 8, 16) == tuple(range(8, 16))
    assert _node_ranks(None, 3, 16) == tuple(range(8))
    assert _node_ranks(None, None, 16) == tuple(range(8))          # a coordinator on that node


@pytest.mark.parametrize("given,env,rank,words", [
    (range(8), None, 8, ("node_ranks", "rank 8")),
    (None, "0-7", 8, (NODE_RANKS_ENV, "0-7", "rank 8")),
    ([0, 16], None, 0, ("node_ranks", "world of 16")),
    ([1, 1], None, 1, ("distinct",)),
    ([], None, None, ("at least one",)),
])
def test_wrong_ranks_name_where_they_came_from(monkeypatch, given, env, rank, words):
    if env is None:
        monkeypatch.delenv(NODE_RANKS_ENV, raising=False)
    else:
        monkeypatch.setenv(NODE_RANKS_ENV, env)
    with pytest.raises(ValueError) as info:
        _node_ranks(given, rank, 16)
    for word in words:
        assert word in str(info.value)


def test_an_unreadable_environment_is_an_error(monkeypatch):
    monkeypatch.setenv(NODE_RANKS_ENV, "eight to fifteen")
    with pytest.raises(ValueError, match="8-15"):
        _node_ranks(None, 8, 16)
