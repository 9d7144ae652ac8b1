"""A stream's audio against the wall clock (frontend/lateness.py): how far behind real time a frontend reads it."""

from __future__ import annotations

import pytest

from cosystream.frontend.lateness import FORGET_PER_S, AudioClock, median_late_s


def fed(chunks: list[tuple[float, float]]) -> AudioClock:
    """A clock that read each (received at, seconds of audio)."""
    clock = AudioClock()
    for received_s, audio_s in chunks:
        clock.read(received_s, audio_s)
    return clock


def test_a_stream_read_as_it_is_spoken_is_not_late_whatever_its_chunks():
    assert AudioClock().late_s(5.0) is None  # (no audio yet: not counted)
    for chunk_s in (0.01, 0.1, 0.25):
        chunks = [(100 + (i + 1) * chunk_s, chunk_s) for i in range(int(10 / chunk_s))]
        clock = fed(chunks)
        last = chunks[-1][0]
        assert clock.late_s(last) == pytest.approx(0, abs=1e-9)
        assert clock.late_s(last + chunk_s) == pytest.approx(0, abs=1e-9)  # (its next chunk is due, not late)
        assert clock.late_s(last + chunk_s + 0.5) == pytest.approx(0.5 - FORGET_PER_S * (chunk_s + 0.5))


def test_a_stream_read_slower_than_real_time_falls_behind_by_what_is_left_unread():
    # Two seconds at real time, then read at 80% of real time for five: a second behind.
    chunks = [(100 + (i + 1) * 0.1, 0.1) for i in range(20)]
    chunks += [(102 + (i + 1) * 0.125, 0.1) for i in range(40)]
    clock = fed(chunks)
    assert clock.late_s(107.0 + 0.1) == pytest.approx(1.0 - FORGET_PER_S * 5.1, abs=0.01)


def test_a_client_that_starts_ahead_or_behind_is_measured_from_where_it_settles():
    ahead = fed([(100.0, 2.0)] + [(100 + (i + 1) * 0.1, 0.1) for i in range(50)])  # a 2 s burst, then real time
    assert ahead.late_s(105.0) == pytest.approx(0, abs=1e-9)
    behind = fed([(100 + 0.5 + (i + 1) * 0.1, 0.1) for i in range(50)])  # the first chunk half a second late
    assert behind.late_s(105.5) == pytest.approx(0, abs=1e-9)


def test_a_pause_in_sending_is_late_until_it_is_forgotten():
    # Discontinuous transmission: 3 s of silence not sent, then real time again.
    clock = fed([(100 + (i + 1) * 0.1, 0.1) for i in range(20)])
    assert clock.late_s(105.0) == pytest.approx(2.9 - FORGET_PER_S * 3)  # (in the pause: behind by it)
    for i in range(300):
        clock.read(105 + (i + 1) * 0.1, 0.1)
    assert clock.late_s(135.1) == pytest.approx(3.0 - FORGET_PER_S * 33.1)
    for i in range(1200):
        clock.read(135 + (i + 1) * 0.1, 0.1)
    assert clock.late_s(255.0) == pytest.approx(0, abs=1e-6)


def test_the_frontends_lateness_is_the_median_of_its_streams():
    on_time = [fed([(100 + (i + 1) * 0.1, 0.1) for i in range(20)]) for _ in range(3)]
    late = [fed([(100 + (i + 1) * 0.1, 0.1) for i in range(10)]) for _ in range(2)]  # nothing read for 1 s
    assert median_late_s([], 102.0) == 0
    assert median_late_s([*on_time, AudioClock()], 102.0) == pytest.approx(0)  # (no audio yet: not counted)
    assert median_late_s([*on_time, *late], 102.0) == pytest.approx(0)
    assert median_late_s([*late, on_time[0]], 102.1) == pytest.approx(1.0 - FORGET_PER_S * 1.1)
