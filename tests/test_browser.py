"""The captioning page (``GET /``) in a real headless Chromium, driven by selenium: the microphone is
Chromium's fake capture device playing speech synthesized by espeak-ng, through the page's AudioWorklet,
over the Realtime WebSocket of a real server on loopback; the test reads the captions, the latency
readout and the WebVTT download from the DOM. Also: a connection cut mid-sentence by a TCP proxy (the page
resumes its session), tokens and client secrets, a refused microphone, a server that goes away, and the
worklet's resampler measured on tones.

Needs Debian's ``chromium`` and ``chromium-driver`` (``make system-deps``); skipped without them. Nothing
is downloaded: selenium is given the driver's path and runs offline.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
import time
import wave
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from cosystream.app.local import LocalServer
from cosystream.engine.config import EngineConfig
from cosystream.frontend.host import StreamOptions
from cosystream.server.frontend import FrontendConfig
from cosystream.server.http import HttpConfig
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from tests.servers import CuttingProxy
from tests.speech import encode, needs_espeak, silence, speech

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or (
    "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None
)

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs chromium and chromedriver (apt-get install chromium chromium-driver)",
)

SENTENCE = "the quick brown fox jumps over the lazy dog"
OTHER = "please call me back tomorrow morning"
TOKEN = "carol-0123456789abcdef0123"
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1200,900",
]
WAIT_CAPTIONS_S = 40.0


def heard(transcript: str, sentence: str = SENTENCE) -> bool:
    """Most of the sentence's words are in the transcript (the model is small; espeak is not a person)."""
    words = set(sentence.split())
    return len(words & set(transcript.lower().split())) >= len(words) - 2


# --- servers and browsers ----------------------------------------------------------------------------


@contextmanager
def http_server(tokens: Path | None = None, resume_window_s: float = 30.0) -> Iterator[LocalServer]:
    config = FrontendConfig(
        host="127.0.0.1",
        port=0,
        stream=StreamOptions(idle_timeout_s=5.0, resume_window_s=resume_window_s),
        auth_tokens=None if tokens is None else str(tokens),
        http=HttpConfig(host="127.0.0.1", port=0),
    )
    with LocalServer(frontend_config=config, engine=EngineConfig(max_sessions=4, max_batch=4)) as server:
        server.http_url = f"http://127.0.0.1:{server.frontend.http_port}/"
        yield server


def active_sessions(server: LocalServer, token: str | None = None) -> int:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(server.address) as channel:
        info = pb_grpc.CosyStreamStub(channel).GetServerInfo(
            pb.GetServerInfoRequest(), timeout=5, metadata=metadata
        )
        return info.active_sessions


@pytest.fixture(scope="module")
def speech_wav(tmp_path_factory) -> Path:
    """Two sentences, 48 kHz mono 16-bit: Chromium's fake microphone plays them from the start for each
    capture, then silence (``%noloop``), resampled to the rate it captures at."""
    rate_hz = 48000
    audio = np.concatenate(
        [
            silence(0.5, rate_hz),
            speech(SENTENCE, rate_hz=rate_hz),
            silence(1.0, rate_hz),
            speech(OTHER, rate_hz=rate_hz),
            silence(1.0, rate_hz),
        ]
    )
    path = tmp_path_factory.mktemp("browser") / "speech.wav"
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate_hz)
        wav.writeframes(encode(audio, "LINEAR16"))
    return path


@contextmanager
def chromium(*flags: str) -> Iterator[webdriver.Chrome]:
    os.environ.setdefault("SE_OFFLINE", "1")  # selenium-manager never looks for (or fetches) a browser
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    with tempfile.TemporaryDirectory(prefix="cosystream-chromium-") as profile:
        for flag in [*FLAGS, f"--user-data-dir={profile}", *flags]:
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
        try:
            yield driver
        finally:
            driver.quit()


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with http_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def browser(speech_wav) -> Iterator[webdriver.Chrome]:
    """A Chromium whose microphone is allowed and plays ``speech_wav``."""
    with chromium(
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={speech_wav}%noloop",
    ) as driver:
        yield driver


@pytest.fixture(scope="module")
def denying_browser() -> Iterator[webdriver.Chrome]:
    """A Chromium that refuses every permission prompt (the microphone's too)."""
    with chromium("--use-fake-device-for-media-stream", "--deny-permission-prompts") as driver:
        yield driver


class Page:
    """The captioning page, read through the DOM."""

    def __init__(self, driver: webdriver.Chrome, url: str):
        self.driver = driver
        driver.get(url)
        self.wait(lambda: driver.execute_script("return document.readyState") == "complete", 10, "the page loads")

    def element(self, element_id: str):
        return self.driver.find_element(By.ID, element_id)

    def token_asked(self) -> bool | None:
        """Whether the page asks for a token (None: it has not learnt yet whether the server needs one)."""
        asked = self.driver.execute_script("return document.getElementById('controls').dataset.token")
        return {"needed": True, "none": False}.get(asked)

    def click_start(self) -> None:
        self.element("start").click()

    def status(self) -> tuple[str, str]:
        return tuple(
            self.driver.execute_script(
                "const s = document.getElementById('status'); return [s.textContent, s.dataset.kind]"
            )
        )

    def finals(self) -> list[str]:
        return self.driver.execute_script(
            "return [...document.querySelectorAll('#finals li .text')].map((e) => e.textContent)"
        )

    def wait(self, predicate: Callable[[], object], timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if value := predicate():
                return value
            time.sleep(0.1)
        raise AssertionError(f"{what} within {timeout_s} s; the page says {self.status()!r}\n{self.console()}")

    def wait_error(self, timeout_s: float = 15.0) -> str:
        return self.wait(lambda: (s := self.status())[1] == "error" and s[0], timeout_s, "an error shown")

    def console(self) -> str:
        return "\n".join(str(entry) for entry in self.driver.get_log("browser"))

    def watch_partials(self) -> None:
        """Record every text the live line shows (the page rewrites it in place)."""
        self.driver.execute_script(
            """
            const partial = document.getElementById("partial");
            window.partials = [];
            window.partialNodes = new Set();
            new MutationObserver(() => {
              window.partials.push(partial.textContent);
              window.partialNodes.add(document.querySelectorAll("#partial").length);
            }).observe(partial, { childList: true, characterData: true, subtree: true });
            """
        )

    def download_text(self) -> str:
        return self.driver.execute_async_script(
            """
            const done = arguments[arguments.length - 1];
            fetch(document.getElementById("download").href)
              .then((response) => response.text())
              .then(done, (err) => done(`ERROR ${err}`));
            """
        )


def screenshot(driver: webdriver.Chrome, path: Path) -> None:
    driver.save_screenshot(str(path))
    shutil.copyfile(path, "/tmp/caption-page.png")


# --- the tests -----------------------------------------------------------------------------------------


@needs_espeak
def test_captions_from_the_microphone_with_latency_and_a_vtt_download(browser, server, tmp_path):
    page = Page(browser, server.http_url)
    assert page.status()[1] == "idle" and page.element("download").get_attribute("aria-disabled") == "true"
    page.wait(lambda: page.token_asked() is False, 10, "the page learning that the server needs no token")
    assert not page.element("token").is_displayed(), "no token field on a server without tokens"
    page.watch_partials()
    page.click_start()
    page.wait(lambda: page.status()[1] == "live", 15, "the session listening")
    finals = page.wait(lambda: len(f := page.finals()) >= 2 and f, WAIT_CAPTIONS_S, "two finals")
    assert len(finals) == 2 and heard(finals[0]) and heard(finals[1], OTHER), finals

    partials = browser.execute_script("return window.partials")
    texts = [t for t in partials if t]
    assert len(set(texts)) >= 3, f"the live line showed the words as they came: {partials}"
    assert partials[-1] == "", "the live line is cleared when its final arrives"
    assert browser.execute_script("return [...window.partialNodes]") == [1], "one live line, rewritten"
    times = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#finals li time")]
    assert times == ["00:00", "00:04"], times  # the sentences start 0.5 s and 4.4 s into the capture

    server_ms = page.element("latency-server").text
    delay_ms = page.element("latency-lag").text
    assert re.fullmatch(r"\d+(\.\d)? ms", server_ms) and re.fullmatch(r"\d+(\.\d)? ms", delay_ms)
    assert float(server_ms.split()[0]) < 1000 and float(delay_ms.split()[0]) < 5000, (server_ms, delay_ms)

    link = page.element("download")
    assert link.get_attribute("href").startswith("blob:") and link.get_attribute("download").endswith(".vtt")
    assert link.get_attribute("aria-disabled") is None
    vtt = page.download_text()
    cues = re.findall(r"^(\d+)\n(\d\d:\d\d:\d\d\.\d{3}) --> (\d\d:\d\d:\d\d\.\d{3})\n(.+)$", vtt, re.M)
    assert vtt.startswith("WEBVTT\n\n") and [c[0] for c in cues] == ["1", "2"], vtt
    assert "00:00:00.200" <= cues[0][1] < cues[0][2] <= cues[1][1] < cues[1][2] <= "00:00:08.000", vtt
    assert [c[3] for c in cues] == finals, vtt

    screenshot(browser, tmp_path / "caption-page.png")

    page.click_start()  # stop
    page.wait(lambda: page.status()[0].startswith("Stopped"), 10, "stopped")
    assert page.element("start").text == "Start" and page.finals() == finals
    page.wait(lambda: active_sessions(server) == 0, 10, "the server's session closed")


def speaking_through(proxy: CuttingProxy, browser: webdriver.Chrome) -> Page:
    """The page, served through ``proxy``, started and showing the first sentence's first words."""
    page = Page(browser, f"http://127.0.0.1:{proxy.port}/")
    page.click_start()
    page.wait(lambda: page.status()[1] == "live", 15, "the session listening")
    live_line = "return document.getElementById('partial').textContent"
    page.wait(lambda: browser.execute_script(live_line), 20, "the first words on the live line")
    return page


@needs_espeak
def test_a_connection_cut_mid_sentence_resumes_and_the_captions_are_whole(browser, server):
    """The page served through a TCP proxy on loopback that resets its connections (as a network dropping
    them does) while the first sentence is being spoken: the page reconnects, resumes its session and sends
    the audio the server had not taken; the captions are those of an uncut run, each once."""
    proxy = CuttingProxy(server.frontend.http_port)
    try:
        page = speaking_through(proxy, browser)
        proxy.cut()  # mid-sentence
        page.wait(lambda: "reconnected" in page.status()[0], 15, "the session resumed")
        assert "nothing was lost" in page.status()[0] and page.status()[1] == "live", page.status()
        finals = page.wait(lambda: len(f := page.finals()) >= 2 and f, WAIT_CAPTIONS_S, "two finals")
        time.sleep(1.5)  # (nothing comes twice)
        assert page.finals() == finals and len(finals) == 2, finals
        assert heard(finals[0]) and heard(finals[1], OTHER), finals
        times = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#finals li time")]
        assert times == ["00:00", "00:04"], times  # the session's clock went on through the cut
        page.click_start()  # stop
        page.wait(lambda: page.status()[0].startswith("Stopped"), 10, "stopped")
        page.wait(lambda: active_sessions(server) == 0, 10, "the server's session closed")
    finally:
        proxy.close()


@needs_espeak
def test_a_connection_down_past_the_resume_window_goes_on_in_a_new_session(browser):
    """The network stays down for longer than the server holds a session: the page says so and goes on in a
    new session, with the audio the old one had not taken, its captions on the page's clock."""
    with http_server(resume_window_s=1.0) as short:
        proxy = CuttingProxy(short.frontend.http_port)
        try:
            page = speaking_through(proxy, browser)
            proxy.cut(outage_s=1.5)  # the page's reconnections fail until the session's window has passed
            page.wait(lambda: "new session" in page.status()[0], 15, "a new session")
            status = page.status()
            # (the server refused the resume, or the page knew the window had passed before it asked)
            why = ("the server no longer held the old one", "longer than the server holds a session")
            assert status[1] == "live" and any(w in status[0] for w in why), status
            finals = page.wait(lambda: any(heard(f, OTHER) for f in page.finals()), WAIT_CAPTIONS_S, "the second")
            times = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#finals li time")]
            assert times[-1] == "00:04", (times, finals)  # the new session's times on the page's clock
            page.click_start()
            page.wait(lambda: page.status()[0].startswith("Stopped"), 10, "stopped")
            page.wait(lambda: active_sessions(short) == 0, 10, "both sessions closed")
        finally:
            proxy.close()


@needs_espeak
def test_tokens_a_wrong_one_is_refused_the_right_one_captions_and_a_server_going_away_is_shown(browser, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"carol {TOKEN}\n")
    with http_server(tokens) as secured:
        page = Page(browser, secured.http_url)
        page.wait(lambda: page.token_asked(), 10, "the page learning that the server needs a token")
        assert page.element("token").is_displayed()
        page.click_start()
        assert "needs an access token" in page.wait_error()
        page.element("token").send_keys("wrong-token-0123456789abcdef")
        page.click_start()
        refused = page.wait_error()
        assert "refused the access token" in refused and "not known" in refused, refused
        assert page.element("start").text == "Start" and active_sessions(secured, TOKEN) == 0

        page = Page(browser, secured.http_url)  # the token field is kept for the tab
        assert page.element("token").get_attribute("value") == "wrong-token-0123456789abcdef"
        page.element("token").clear()
        page.element("token").send_keys(TOKEN)
        page.click_start()
        page.wait(lambda: heard(" ".join(page.finals())), WAIT_CAPTIONS_S, "the sentence, with the token")
        assert active_sessions(secured, TOKEN) == 1
    # The server has stopped under the open page: its WebSocket closed with "going away".
    gone = page.wait_error(10)
    assert "closed the connection" in gone and "1001" in gone and "shutting down" in gone, gone
    assert page.element("start").text == "Start"
    page.click_start()
    assert "unreachable" in page.wait_error(), page.status()


def test_a_refused_microphone_is_explained(denying_browser, server):
    page = Page(denying_browser, server.http_url)
    page.click_start()
    message = page.wait_error()
    assert "Microphone access was refused" in message and "Start again" in message, message
    assert page.element("start").text == "Start" and active_sessions(server) == 0


# Interims as a beam search sends them: (text, arrival ms, stability); the last a greedy decoder's.
INTERIMS = [
    ("the", 0, 0.5),
    ("the can", 120, 0.5),
    ("the cat", 260, 0.5),
    ("the cat sat", 380, 0.5),
    ("the cat sat on", 900, 0.5),
    ("the cat sat on a", 950, 0.5),
    ("a cat", 1000, 0.5),
    ("a cat sat", 1700, 1.0),
]


def test_the_pages_interim_rule_is_the_terminal_captioners(denying_browser, server):
    """stable.js and clients/caption.py's StableInterim show the same words at the same times."""
    from clients.caption import HOLD_MS, StableInterim

    # Each interim's rule probed every 50 ms until the next interim arrives.
    ends_ms = [at_ms for _, at_ms, _ in INTERIMS[1:]] + [2500]
    probes_ms = [
        [t for t in range(0, 2500, 50) if at_ms <= t < end_ms]
        for (_, at_ms, _), end_ms in zip(INTERIMS, ends_ms, strict=True)
    ]
    python = []
    rule = StableInterim(HOLD_MS)
    for (text, at_ms, stability), probes in zip(INTERIMS, probes_ms, strict=True):
        rule.update(text, at_ms, stability)
        python.append([[rule.shown(t), rule.next_reveal_ms(t)] for t in probes])
    Page(denying_browser, server.http_url)
    page = denying_browser.execute_async_script(
        """
        const [interims, probes, done] = arguments;
        import(new URL("static/stable.js", location.href).href).then(({ HOLD_MS, StableInterim }) => {
          const rule = new StableInterim(HOLD_MS);
          const out = [];
          interims.forEach(([text, at, stability], i) => {
            rule.update(text, at, stability);
            out.push(probes[i].map((t) => [rule.shown(t), rule.nextRevealMs(t)]));
          });
          done({ hold: HOLD_MS, out });
        }, (err) => done({ error: String(err) }));
        """,
        INTERIMS,
        probes_ms,
    )
    assert "error" not in page, page
    assert page["hold"] == HOLD_MS
    assert page["out"] == python
    # What the rule does: "the" shows once it has lasted, "the cat" once "cat" has; "can" and "on" never do
    # (revised within the hold); "a cat" replaces the words on show at once, not blanking them; a greedy
    # interim shows whole at once.
    shown = {
        t: text
        for probes, row in zip(probes_ms, python, strict=True)
        for t, (text, _) in zip(probes, row, strict=True)
    }
    assert shown[350] == "" and shown[400] == "the" and shown[650] == "the" and shown[700] == "the cat"
    assert shown[900] == shown[950] == "the cat sat" and shown[1000] == "a cat" and shown[1700] == "a cat sat"
    assert not {"can", "on"} & {word for row in python for text, _ in row for word in text.split()}


def test_the_readouts_stay_put_whatever_the_status_says(denying_browser, server):
    """The Mic and latency readouts keep their place however long the status is and whatever the values."""
    Page(denying_browser, server.http_url)
    places = set()
    for status, kind, value in [
        ("Press Start and allow the microphone.", "idle", "–"),
        ("Listening: speak now.", "live", "3.2 ms"),
        ("Connecting to 127.0.0.1:8080…", "info", "87 ms"),
        ("The server reported an error: " + "a long explanation " * 6, "error", "1234 ms"),
    ]:
        places.add(
            tuple(
                denying_browser.execute_script(
                    """
                    const [text, kind, value] = arguments;
                    const status = document.getElementById("status");
                    status.textContent = text;
                    status.dataset.kind = kind;
                    document.getElementById("latency-server").textContent = value;
                    document.getElementById("latency-lag").textContent = value;
                    const box = (id) => document.getElementById(id).getBoundingClientRect();
                    return [box("level").x, box("level").y, box("latency").x, box("latency").y];
                    """,
                    status,
                    kind,
                    value,
                )
            )
        )
    assert len(places) == 1, places


def tone_gains(driver: webdriver.Chrome, from_hz: int, to_hz: int, tones_hz: list[int]) -> dict[str, list]:
    """Each tone (1 s at ``from_hz``, in 128-sample blocks as the worklet gets them) through the page's
    resampler: its amplitude at ``to_hz``, the number of samples out, and output samples 2000-2399."""
    return driver.execute_async_script(
        """
        const [fromHz, toHz, tones, done] = arguments;
        import(new URL("static/resampler.js", location.href).href).then(({ Resampler }) => {
          const result = {};
          for (const hz of tones) {
            const resampler = new Resampler(fromHz, toHz);
            const out = [];
            for (let i = 0; i < fromHz; i += 128) {
              const block = new Float32Array(128).map((_, j) => Math.sin((2 * Math.PI * hz * (i + j)) / fromHz));
              out.push(...resampler.process(block));
            }
            const tail = out.slice(Math.round(toHz / 10)); // past the filter's start-up
            const rms = Math.sqrt(tail.reduce((sum, x) => sum + x * x, 0) / tail.length);
            result[hz] = [rms * Math.SQRT2, out.length, out.slice(2000, 2400)];
          }
          done(result);
        }, (err) => done({ error: String(err) }));
        """,
        from_hz,
        to_hz,
        tones_hz,
    )


def test_the_worklets_resampler_keeps_speech_and_rejects_aliases(denying_browser, server):
    browser = denying_browser
    Page(browser, server.http_url)
    for from_hz in (48000, 44100):
        passband, stopband = [300, 1000, 3000, 6000], [8800, 12000, 15000, 20000]
        gains = tone_gains(browser, from_hz, 16000, passband + stopband)
        assert "error" not in gains, gains
        for hz in passband:
            gain, count, wave_out = gains[str(hz)]
            assert abs(20 * math.log10(gain)) < 1.0, (from_hz, hz, gain)
            assert abs(count - 16000) <= 100, count  # 1 s in, 1 s out (less the filter's half-width)
            # The same tone, in time with the input: output n is at n / 16000 s.
            samples = np.array(wave_out)
            expected = np.sin(2 * np.pi * hz * (2000 + np.arange(len(samples))) / 16000)
            assert np.abs(expected - samples).max() < 0.15, (from_hz, hz)
        for hz in stopband:
            gain = gains[str(hz)][0]
            assert 20 * math.log10(max(gain, 1e-9)) < -50, (from_hz, hz, gain)
    same = tone_gains(browser, 16000, 16000, [1000])
    assert abs(same["1000"][0] - 1) < 0.01 and same["1000"][1] == 16000


@needs_espeak
def test_words_to_expect_are_boosted_in_the_captions(server, tmp_path):
    """The page's word box goes as the session's prompt, its comma-separated terms boosted: a name the model
    misses without it is captioned with it."""
    rate_hz = 48000
    wav = tmp_path / "named.wav"
    audio = np.concatenate([silence(0.5, rate_hz), speech(NAMED, rate_hz=rate_hz), silence(1.5, rate_hz)])
    with wave.open(str(wav), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate_hz)
        out.writeframes(encode(audio, "LINEAR16"))

    def caption(words: str) -> str:
        with chromium(
            "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={wav}%noloop",
        ) as driver:
            page = Page(driver, server.http_url)
            page.wait(lambda: page.token_asked() is False, 10, "the page learning that the server needs no token")
            page.element("words").send_keys(words)
            page.click_start()
            page.wait(lambda: page.status()[1] == "live", 15, "the session listening")
            assert not page.element("words").is_enabled(), "the words are the session's while it runs"
            finals = page.wait(lambda: page.finals(), WAIT_CAPTIONS_S, "a final")
            page.click_start()
            page.wait(lambda: page.status()[0].startswith("Stopped"), 10, "stopped")
            assert page.element("words").is_enabled()
            return " ".join(finals).lower()

    # ("siobhan" itself the model hears as "sheave" through Chromium's capture, boosted or not: its acoustics)
    plain, boosted = caption(""), caption("Siobhan Nguyen, Kubernetes")
    assert "nguyen" not in plain and "nguyen is at noon" in boosted, (plain, boosted)


NAMED = "the meeting with siobhan nguyen is at noon"
