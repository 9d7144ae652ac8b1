"""Audio seconds per token (``max_audio_s_per_min=``, ``max_audio_s_per_day=`` in the tokens file): the
shared table across frontend processes, and real servers refusing, cutting and pacing streams with
RESOURCE_EXHAUSTED and a ``google.rpc.RetryInfo``."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_status import rpc_status

from cosystream.frontend import usage
from cosystream.frontend.quota import TokenSessions
from cosystream.frontend.usage import DAY_S, UsageExceeded, UsageLimits
from cosystream.server.auth import TokenFileError, parse_tokens
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import retry_after_s
from tests.servers import Served, local_server_with
from tests.speech import encode, needs_espeak, silence, speech
from tests.test_http import SENTENCE, heard

METER = "meter-00112233445566778899aabb"
DAILY = "daily-00112233445566778899aabb"
FREE = "free-ffeeddccbbaa998877665544"
NOON = 20_000 * DAY_S + DAY_S / 2  # a Unix time at 12:00 UTC


# --- the table ------------------------------------------------------------------------------------------


def _spend_in_other_frontend(sessions: TokenSessions, done: mp.Event) -> None:
    lease = sessions.audio_lease("meter", UsageLimits(per_min_s=5.0))
    for _ in range(3):
        lease.ensure()
        lease.spend(1.0)
    lease.close()
    done.set()


def test_audio_is_counted_across_frontend_processes():
    sessions = TokenSessions(frontends=2)
    context = mp.get_context("spawn")
    done = context.Event()
    child = context.Process(target=_spend_in_other_frontend, args=(sessions.for_frontend(1), done))
    child.start()
    try:
        assert done.wait(60), "the other frontend spent its audio"
        mine = sessions.for_frontend(0)
        minute_s, day_s = mine.audio_used("meter", time.time())
        assert minute_s == pytest.approx(3.0) and day_s == pytest.approx(3.0)
        lease = mine.audio_lease("meter", UsageLimits(per_min_s=5.0))
        lease.ensure()
        lease.spend(1.0)
        lease.ensure()  # 2 s were left: a lease of 1 s, then the last one
        lease.spend(1.0)
        with pytest.raises(UsageExceeded, match=r"max_audio_s_per_min=5 seconds of audio in any 60 s") as caught:
            lease.ensure()
        assert caught.value.per == "min" and 0 < caught.value.retry_after_s <= 60
        assert mine.audio_used("other", time.time()) == (0.0, 0.0), "another name's audio is its own"
    finally:
        child.join(30)


def test_the_minute_slides_and_the_day_starts_at_midnight_utc():
    table = usage.UsageTable(mp.get_context("spawn"), slots=4)
    per_min = UsageLimits(per_min_s=10.0)
    assert table.reserve("a", per_min, 6.0, 0.0, NOON) == 6.0
    assert table.reserve("a", per_min, 6.0, 0.0, NOON + 30) == 4.0, "what is left of the window"
    with pytest.raises(UsageExceeded) as caught:
        table.reserve("a", per_min, 1.0, 0.0, NOON + 31)
    assert caught.value.retry_after_s == pytest.approx(29.0), "the first 6 s leave the window at NOON + 60"
    assert table.reserve("a", per_min, 6.0, 0.0, NOON + 60) == 6.0
    table.give_back("a", 2.5, NOON + 60, NOON + 61)  # a stream ended with 2.5 s of its lease unspent
    assert table.used("a", NOON + 61) == (pytest.approx(7.5), pytest.approx(13.5))

    per_day = UsageLimits(per_day_s=20.0)
    assert table.reserve("b", per_day, 15.0, 0.0, NOON) == 15.0
    assert table.reserve("b", per_day, 15.0, 0.0, NOON + 3600) == 5.0
    with pytest.raises(UsageExceeded, match="max_audio_s_per_day=20 seconds of audio today") as caught:
        table.reserve("b", per_day, 1.0, 0.5, NOON + 7200)
    assert caught.value.per == "day" and caught.value.retry_after_s == pytest.approx(DAY_S / 2 - 7200)
    assert table.used("b", NOON + 7200)[1] == pytest.approx(20.5), "audio spent past the lease is charged"
    assert table.reserve("b", per_day, 15.0, 0.0, NOON + DAY_S / 2) == 15.0, "a new UTC day"


def test_a_full_table_refuses_new_names_until_a_row_is_idle():
    table = usage.UsageTable(mp.get_context("spawn"), slots=2)
    limits = UsageLimits(per_min_s=100.0)
    table.reserve("a", limits, 1.0, 0.0, NOON)
    table.reserve("b", limits, 1.0, 0.0, NOON)
    with pytest.raises(UsageExceeded, match="more than 2 tokens"):
        table.reserve("c", limits, 1.0, 0.0, NOON)
    assert table.reserve("c", limits, 1.0, 0.0, NOON + DAY_S) == 1.0, "yesterday's rows are free"


def test_tokens_file_audio_limits():
    meter, free = parse_tokens(f"meter {METER} max_audio_s_per_min=30 max_audio_s_per_day=3600.5\nfree {FREE}\n")
    assert meter.usage == UsageLimits(30.0, 3600.5) and meter.usage.limited
    assert not free.usage.limited
    for bad in (
        "max_audio_s_per_min=0",
        "max_audio_s_per_day=-1",
        "max_audio_s_per_min=lots",
        "max_audio_s_per_min=inf",
    ):
        with pytest.raises(TokenFileError, match=re.escape(f"{bad}: give a number of seconds > 0")):
            parse_tokens(f"meter {METER} {bad}\n")


# --- through real servers ---------------------------------------------------------------------------------


def _requests(audio: bytes, priority=pb.REALTIME, chunk_bytes: int = 3200):
    yield pb.StreamingRecognizeRequest(
        config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, priority=priority)
    )
    for offset in range(0, len(audio), chunk_bytes):
        yield pb.StreamingRecognizeRequest(audio=audio[offset : offset + chunk_bytes])


def _sentence(seconds_after: float = 0.6) -> bytes:
    return encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(seconds_after)]), "LINEAR16")


def _stream(address: str, token: str, audio: bytes, priority=pb.REALTIME):
    """(responses, the call's code, its details, RetryInfo's delay in seconds or None)."""
    responses = []
    with grpc.insecure_channel(address) as channel:
        call = pb_grpc.CosyStreamStub(channel).StreamingRecognize(
            _requests(audio, priority), metadata=(("authorization", f"Bearer {token}"),), timeout=60
        )
        with contextlib.suppress(grpc.RpcError):
            responses.extend(call)
        status = rpc_status.from_call(call)
        delay = retry_after_s(call.trailing_metadata())
        return responses, call.code(), call.details(), delay, status


def _finals(responses) -> list[str]:
    return [r.transcript for response in responses for r in response.results if r.is_final]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("usage") / "tokens"
    path.write_text(f"meter {METER} max_audio_s_per_min=5\ndaily {DAILY} max_audio_s_per_day=2\nfree {FREE}\n")
    with Served("--frontends", "2", "--auth-tokens", str(path)) as server:
        server.tokens_path = path
        server.wait(lambda: server.health() == 1, 60, "SERVING: both frontends listen")
        yield server


@needs_espeak
def test_a_token_past_its_minute_is_cut_then_refused_with_retry_info_on_every_frontend(served):
    audio = _sentence()
    assert 2.6 < len(audio) / 32000 < 4, "one sentence fits the minute, two do not"
    responses, code, details, delay, _ = _stream(served.address, METER, audio)
    assert code == grpc.StatusCode.OK, details
    assert heard(" ".join(_finals(responses)))

    # The second sentence runs out of the minute part-way: what was heard gets its final, then the status.
    responses, code, details, delay, status = _stream(served.address, METER, audio)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "max_audio_s_per_min=5 seconds of audio in any 60 s" in details
    assert 30 < delay <= 60, delay
    assert status is not None and status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    last = responses[-1]
    assert last.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and last.error.retry_delay_ms > 30_000
    assert any(r.results and r.results[0].is_final for r in responses[:-1]), "the final of what was heard"

    mark = len(served.log)
    for _ in range(10):  # fresh connections, spread over both frontends by SO_REUSEPORT
        _, code, details, delay, _ = _stream(served.address, METER, audio)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_audio_s_per_min=5" in details, details
        assert 0 < delay <= 60
    _, code, details, _, _ = _stream(served.address, FREE, audio[: 32000 // 2])
    assert code == grpc.StatusCode.OK, "a token without limits is not counted"
    time.sleep(0.3)  # (the log reader)
    closing = [line for line in served.log[mark:] if "closed: RESOURCE_EXHAUSTED" in line]
    assert all(any(f"frontend-{index} " in line for line in closing) for index in (0, 1)), (
        "both frontends refused some: the count is shared"
    )
    metrics = urllib.request.urlopen(served.metrics_url, timeout=10).read().decode()
    assert re.search(
        r'^cosystream_token_refused_sessions_total\{reason="usage_quota",token="meter"\} 11\.0$', metrics, re.M
    )
    counted = re.search(r'^cosystream_token_audio_seconds_total\{token="meter"\} ([\d.]+)$', metrics, re.M)
    assert counted and 4.9 < float(counted.group(1)) < 5.6, "the audio heard, at most a slice beyond the limit"

    # A reload (new limits, the same names) keeps what each name has used.
    mark = len(served.log)
    served.tokens_path.write_text(
        f"meter {METER} max_audio_s_per_min=6\ndaily {DAILY} max_audio_s_per_day=2\nfree {FREE}\n"
    )
    os.kill(served.process.pid, signal.SIGHUP)
    served.wait(lambda: sum("tokens reloaded" in line for line in served.log[mark:]) >= 2, 15, "both reloaded")
    responses, code, details, _, _ = _stream(served.address, METER, audio)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_audio_s_per_min=6" in details, (
        "about 5 s were used this minute: 1 s is left of the new 6, less than the sentence"
    )


@needs_espeak
def test_a_token_past_its_day_is_refused_until_midnight_utc(served):
    audio = _sentence()
    responses, code, details, _, _ = _stream(served.address, DAILY, audio, pb.BATCH)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_audio_s_per_day=2" in details, details
    assert _finals(responses), "the final of the 2 s heard"
    _, code, details, delay, _ = _stream(served.address, DAILY, audio, pb.BATCH)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    now = time.time()
    assert delay == pytest.approx((now // DAY_S + 1) * DAY_S - now, abs=5), "until midnight UTC"


@needs_espeak
def test_http_transcriptions_past_the_quota_are_429_with_retry_after(served):
    import io
    import wave

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1), wav.setsampwidth(2), wav.setframerate(16000)
        wav.writeframes(_sentence())
    body, boundary = _multipart(buffer.getvalue())
    request = urllib.request.Request(
        f"{served.http_url}/v1/audio/transcriptions",
        data=body,
        headers={"Authorization": f"Bearer {DAILY}", "Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 429
    assert 0 < int(caught.value.headers["Retry-After"]) <= DAY_S
    assert int(caught.value.headers["retry-after-ms"]) > 0
    assert "max_audio_s_per_day=2" in caught.value.read().decode()


def _multipart(wav: bytes) -> tuple[bytes, str]:
    boundary = "cosystreamtestboundary"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'.encode(),
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n".encode()
        + wav
        + b"\r\n",
        f"--{boundary}--\r\n".encode(),
    ]
    return b"".join(parts), boundary


@needs_espeak
def test_a_batch_stream_past_its_minute_waits_for_it_and_loses_nothing(tmp_path, monkeypatch):
    """BATCH audio is slowed, not refused: the stream stops being read until the minute frees room."""
    offset_s = [0.0]
    monkeypatch.setattr(usage, "unix_time", lambda: time.time() + offset_s[0])
    tokens = tmp_path / "tokens"
    tokens.write_text(f"meter {METER} max_audio_s_per_min=2\n")
    audio = _sentence()
    with local_server_with(max_sessions=4, idle_timeout_s=10.0, auth_tokens=str(tokens)) as server:
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(_stream(server.address, METER, audio, pb.BATCH)))
        thread.start()
        thread.join(4)
        assert thread.is_alive(), "the stream waits once its 2 s of the minute are spent"
        offset_s[0] = 61.0  # a minute later
        thread.join(30)
        responses, code, details, _, _ = outcome[0]
        assert code == grpc.StatusCode.OK, details
        assert heard(" ".join(_finals(responses))), "every byte was transcribed"
