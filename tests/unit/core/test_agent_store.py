"""Agent-store keys: the same on every rank of a launch, whatever each node's own restart count."""

from hftk.core import agent_store


def test_run_key_is_the_same_across_nodes_with_different_restart_counts(monkeypatch):
    """After node 1's workers die, node 1 restarts with TORCHELASTIC_RESTART_COUNT=1 while node 0 re-forms the
    group as a membership change with 0: the ranks' failure-watch keys must still meet (the issue-50 hang)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    survivor = agent_store.run_key("failed/3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert agent_store.run_key("failed/3") == survivor


def test_run_key_names_the_launch(monkeypatch):
    """Two launches sharing a store (one agent host, two jobs) never read each other's keys."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    first = agent_store.run_key("failed/0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    assert agent_store.run_key("failed/0") != first
