"""PhaseClock: laps charge the time since the previous lap; a phase block charges its own time only."""

from slime_spec.common import phase_clock
from slime_spec.common.phase_clock import PhaseClock


def test_laps_and_phase_blocks_charge_what_they_name(monkeypatch):
    now = iter([10.0, 11.0, 13.0, 20.0, 24.0, 30.0, 31.0])  # a stand-in for time.perf_counter, read in order
    monkeypatch.setattr(phase_clock.time, "perf_counter", lambda: next(now))
    clock = PhaseClock()                      # 10
    assert clock.lap("draft") == 1.0          # 11
    assert clock.lap("verify") == 2.0         # 13
    with clock.phase("train"):                # starts at 20: 13..20 is no phase's
        pass                                  # ends at 24
    with clock.phase("draft"):                # 30 .. 31
        pass
    assert dict(clock.seconds) == {"draft": 2.0, "verify": 2.0, "train": 4.0}
    assert clock.since_start() == 21.0
