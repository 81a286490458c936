"""The version gate (docs/design.md, invariant 2): each iteration opens it with a newer version, once."""

from __future__ import annotations

import pytest

from lit_parl import OffPolicyError
from lit_parl.data.version_gate import VersionGate


def test_a_version_opens_the_gate_at_most_once():
    gate = VersionGate(timeout_s=1.0)
    gate.open(3, confirmed=3)
    assert gate.wait() == 3
    gate.close()
    with pytest.raises(OffPolicyError, match=r"policy version 3 is not newer than the last iteration's \(3\)"):
        gate.open(3, confirmed=3)  # the same weights again would train a second iteration on θ_3's rollouts
    with pytest.raises(OffPolicyError, match="not newer"):
        gate.open(2, confirmed=2)
    assert not gate._event.is_set(), "a refused version left the gate open"
    gate.open(4, confirmed=4)
    assert gate.wait() == 4


def test_a_version_the_pool_did_not_confirm_does_not_open_the_gate():
    gate = VersionGate(timeout_s=0.05)
    with pytest.raises(OffPolicyError, match="asked to open version 1 but the pool confirmed version 0"):
        gate.open(1, confirmed=0)
    with pytest.raises(TimeoutError, match="nothing opened the version gate"):
        gate.wait()
