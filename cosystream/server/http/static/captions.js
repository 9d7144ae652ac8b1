// Live captions from the microphone over the server's Realtime transcription WebSocket.
//
// Start: the microphone (getUserMedia) -> an AudioWorklet (mic-worklet.js: resampled to the session's
// rate, 16-bit PCM, batches of BATCH_MS) -> `input_audio_buffer.append` events. With a token, the page
// first trades it for a one-time client secret (POST /v1/realtime/client_secrets) and opens the socket
// with it. The server's events: deltas rewrite the live line, `completed` appends a final with its time;
// the finals download as WebVTT. Stop: the utterance in progress is committed and its final awaited.
// The live line shows an interim's words once they have stood unchanged for HOLD_MS (stable.js), so a beam
// search's revisions of its newest words are rarely seen. The token field shows only on a server that
// asks for a token (GET v1/models answers 401 without one).
//
// The session is resumable (`resumable=true`): the page keeps every event it sends until the server says
// it took it (`cosystream.session.received`; at most RESUME_KEPT), and when the connection drops without a
// close (code 1006: Wi-Fi, a proxy, a laptop lid) it reconnects with the session's token, the oldest event
// it kept and the last event it received (`cosystream.session.resumed`): the server sends again what was
// lost, the page sends again what the server did not take, and the captions go on whole. The microphone
// runs on meanwhile. Past the server's resume window, or when the server no longer holds the session, the
// page opens a new session with the audio it kept and says so.

import { StableInterim } from "./stable.js";

const SESSION_RATE_HZ = 16000;
const BATCH_MS = 20;
const SILENCE_MS = 500; // the pause that ends an utterance
const STOP_WAIT_MS = 3000; // for the last final after a commit
const CONNECT_TIMEOUT_MS = 15000; // from opening the socket to the session being set up
const MARKS_KEPT = 1500; // batches (30 s) remembered for the delay readout
const TOKEN_KEY = "cosystream.token";
const RESUME_KEPT = 3000; // events (a minute of BATCH_MS batches) kept to send again after a resume
const RESUME_BACKOFF_MS = [250, 500, 1000, 2000]; // between reconnection attempts (the last repeats)
const ROOT = new URL("../", import.meta.url); // the server's root, wherever the page is mounted

const ui = {
  controls: document.getElementById("controls"),
  start: document.getElementById("start"),
  token: document.getElementById("token"),
  tokenField: document.getElementById("token-field"),
  words: document.getElementById("words"),
  status: document.getElementById("status"),
  level: document.getElementById("level"),
  latencyServer: document.getElementById("latency-server"),
  latencyLag: document.getElementById("latency-lag"),
  finals: document.getElementById("finals"),
  partial: document.getElementById("partial"),
  empty: document.getElementById("empty"),
  download: document.getElementById("download"),
};

/** A failure to show as is. */
class PageError extends Error {}

function setStatus(text, kind = "info") {
  ui.status.textContent = text;
  ui.status.dataset.kind = kind;
}

function clock(ms) {
  const total = Math.max(0, Math.floor(ms / 1000));
  const h = Math.floor(total / 3600);
  const mm = String(Math.floor(total / 60) % 60).padStart(2, "0");
  const ss = String(total % 60).padStart(2, "0");
  return h ? `${h}:${mm}:${ss}` : `${mm}:${ss}`;
}

function vttTime(ms) {
  const t = Math.max(0, Math.round(ms));
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  const h = Math.floor(t / 3600000);
  const m = Math.floor(t / 60000) % 60;
  const s = Math.floor(t / 1000) % 60;
  return `${pad(h)}:${pad(m)}:${pad(s)}.${pad(t % 1000, 3)}`;
}

function ms(value) {
  return value < 10 ? `${value.toFixed(1)} ms` : `${Math.round(value)} ms`;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body?.error?.message || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status} ${response.statusText}`.trim();
  }
}

function microphoneError(err) {
  switch (err?.name) {
    case "NotAllowedError":
    case "SecurityError":
      return (
        "Microphone access was refused. Allow the microphone for this site (the icon in the address bar " +
        "or the browser's site settings), then press Start again."
      );
    case "NotFoundError":
    case "OverconstrainedError":
      return "No microphone was found. Connect one, then press Start again.";
    case "NotReadableError":
    case "AbortError":
      return "The microphone could not be opened: another application may be using it.";
    default:
      return `The microphone could not be started: ${err?.message || err}`;
  }
}

/** The finals so far: the list on the page and the WebVTT download. */
class Transcript {
  constructor() {
    this.cues = [];
    this.url = null;
  }

  add(startMs, endMs, text) {
    this.cues.push({ startMs, endMs: Math.max(endMs, startMs + 1), text });
    const item = document.createElement("li");
    const time = document.createElement("time");
    time.dateTime = `PT${(startMs / 1000).toFixed(1)}S`;
    time.textContent = clock(startMs);
    const words = document.createElement("span");
    words.className = "text";
    words.textContent = text;
    item.append(time, words);
    ui.finals.append(item);
    ui.empty.hidden = true;
    this.refreshDownload();
  }

  vtt() {
    const escape = (text) =>
      text.replaceAll("&", "&amp;").replaceAll("<", "&lt;").replaceAll(">", "&gt;").replaceAll("\n", " ");
    const cues = this.cues.map(
      (cue, i) => `${i + 1}\n${vttTime(cue.startMs)} --> ${vttTime(cue.endMs)}\n${escape(cue.text)}\n`,
    );
    return ["WEBVTT\n", ...cues].join("\n");
  }

  refreshDownload() {
    if (this.url) URL.revokeObjectURL(this.url);
    this.url = URL.createObjectURL(new Blob([this.vtt()], { type: "text/vtt" }));
    const stamp = new Date().toISOString().slice(0, 16).replace("T", "-").replace(":", "");
    ui.download.href = this.url;
    ui.download.download = `captions-${stamp}.vtt`;
    ui.download.removeAttribute("aria-disabled");
  }
}

/** Shows the token field (the server asks for a token) or hides it; the tests read `data-token`. */
function askForToken(needed) {
  ui.tokenField.hidden = !needed;
  ui.controls.dataset.token = needed ? "needed" : "none";
}

/** Learns whether the server needs a token: its API answers 401 to a request without one. */
async function probeToken() {
  try {
    const response = await fetch(new URL("v1/models", ROOT), { cache: "no-store" });
    askForToken(response.status === 401);
  } catch {
    askForToken(false); // unreachable: Start will say so
  }
}

function tokenValue() {
  return ui.tokenField.hidden ? "" : ui.token.value.trim();
}

function unreachable() {
  return `The server at ${ROOT.host} is unreachable. Check that it is running, then press Start again.`;
}

/** Keeps the newest caption in view, unless the reader has scrolled up. */
function follow(update) {
  const box = ui.finals.parentElement;
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 48;
  update();
  if (atBottom) box.scrollTop = box.scrollHeight;
}

/** An `input_audio_buffer.append` event of 16-bit PCM. */
function appendEvent(pcm) {
  const bytes = new Uint8Array(pcm);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x2000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x2000));
  }
  return { type: "input_audio_buffer.append", audio: btoa(binary) };
}

/** One start-to-stop run: the microphone, the worklet and the socket. */
class Session {
  constructor(transcript, onEnd) {
    this.transcript = transcript;
    this.onEnd = onEnd; // called once, when the session is over (stopped or failed)
    this.rateHz = SESSION_RATE_HZ;
    this.stopping = false;
    this.ended = false;
    this.ready = false; // the server has our settings: audio may go
    this.queued = [];
    this.capturedMs = 0; // the audio the worklet has handed over (all of it is sent, in order)
    this.marks = []; // {endMs, at}: when each batch reached the page, for the delay readout
    this.markHead = 0;
    this.item = null; // the utterance in progress
    this.interim = new StableInterim();
    this.revealTimer = null;
    this.lastError = null;
    this.completedWaiter = null;
    // Resume: the session's token and window, the events sent that the server has not said it took (the
    // first of them is event number outboxFirst of the session), the last event received, and while the
    // connection is down, when it dropped.
    this.resume = null;
    this.outbox = [];
    this.outboxFirst = 0;
    this.lastEventId = null;
    this.lostAt = null;
    this.attempts = 0;
    this.resumeRefused = null; // why the server would not resume (its error message)
    this.takenAudioMs = 0; // the session's audio the server said it took, with the first of the outbox
    this.timeOffsetMs = 0; // where the current server session's times start on the page's clock
  }

  async start() {
    if (!window.isSecureContext || !navigator.mediaDevices?.getUserMedia) {
      throw new PageError(
        "The microphone is only available to pages served over https:// (or from localhost). " +
          "Open this page over HTTPS.",
      );
    }
    setStatus("Opening the microphone…");
    try {
      this.stream = await navigator.mediaDevices.getUserMedia({
        audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
      });
    } catch (err) {
      throw new PageError(microphoneError(err));
    }
    if (this.ended) return this.release(); // stopped while the browser asked for the microphone
    const [track] = this.stream.getAudioTracks();
    track.addEventListener("ended", () => this.fail("The microphone was disconnected."));
    await this.startWorklet();
    if (this.ended) return this.release();
    setStatus(`Connecting to ${ROOT.host}…`);
    const secret = await this.clientSecret();
    if (this.ended) return this.release();
    this.connect(secret);
  }

  async startWorklet() {
    this.context = new AudioContext({ latencyHint: "interactive" });
    const module = new URL("mic-worklet.js", import.meta.url);
    try {
      await this.context.audioWorklet.addModule(module);
    } catch (err) {
      const reachable = await fetch(module, { method: "HEAD", cache: "no-store" }).then(
        () => true,
        () => false,
      );
      if (!reachable) throw new PageError(unreachable());
      throw new PageError(`The audio worklet did not start: ${err?.message || err}`);
    }
    await this.context.resume();
    const source = this.context.createMediaStreamSource(this.stream);
    this.node = new AudioWorkletNode(this.context, "pcm16-capture", {
      numberOfInputs: 1,
      numberOfOutputs: 1,
      channelCount: 1,
      channelCountMode: "explicit",
      channelInterpretation: "speakers",
      processorOptions: { rateHz: this.rateHz, batchMs: BATCH_MS },
    });
    this.node.port.onmessage = ({ data }) => this.fromWorklet(data);
    source.connect(this.node);
    this.node.connect(this.context.destination); // (silent: the worklet writes no output)
  }

  async clientSecret() {
    const token = tokenValue();
    const headers = { "Content-Type": "application/json" };
    if (token) headers.Authorization = `Bearer ${token}`;
    let response;
    try {
      response = await fetch(new URL("v1/realtime/client_secrets", ROOT), {
        method: "POST",
        headers,
        body: JSON.stringify({ session: { type: "transcription" } }),
        cache: "no-store",
      });
    } catch {
      throw new PageError(unreachable());
    }
    if (response.ok) return (await response.json()).value;
    const message = await errorMessage(response);
    if (response.status === 401) {
      // The server's first clause says why; the rest tells API clients how to send a token.
      const why = message.split(": ")[0];
      askForToken(true);
      throw new PageError(
        token
          ? `The server refused the access token: ${why}. Check it, then press Start again.`
          : "This server needs an access token: enter it above, then press Start.",
      );
    }
    if (response.status === 404) return null; // a server without client secrets: connect as is
    throw new PageError(`The server refused to open a session: ${message}`);
  }

  connect(secret, resuming = false) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const query = new URLSearchParams({ intent: "transcription" });
    if (resuming) {
      query.set("resume_token", this.resume.token);
      query.set("resume_offset_events", String(this.outboxFirst));
      query.set("resume_after_event", this.lastEventId);
    } else {
      query.set("resumable", "true");
    }
    const url = `${scheme}//${ROOT.host}${ROOT.pathname}v1/realtime?${query}`;
    const protocols = ["realtime"];
    if (secret) protocols.push(`openai-insecure-api-key.${secret}`);
    this.ws = new WebSocket(url, protocols);
    this.opened = false;
    this.ws.onopen = () => {
      this.opened = true;
      if (resuming) {
        for (const text of this.outbox) this.ws.send(text); // (those the server has it skips)
      } else {
        setStatus("Connected: setting up the session…");
      }
    };
    this.ws.onmessage = (message) => this.fromServer(message.data);
    this.ws.onclose = (event) => this.closed(event);
    setTimeout(() => {
      if (!this.ready && !this.ended && !this.stopping) {
        this.fail(`The server at ${ROOT.host} did not set up the session within ${CONNECT_TIMEOUT_MS / 1000} s.`);
      }
    }, CONNECT_TIMEOUT_MS);
  }

  /** Sends `event` now, or after a reconnection (every event is kept until the server says it took it). */
  send(event) {
    const text = JSON.stringify(event);
    this.outbox.push(text);
    if (this.outbox.length > RESUME_KEPT) {
      this.outbox.shift(); // (a resume is then refused: the page starts a new session)
      this.outboxFirst++;
    }
    if (this.ws?.readyState === WebSocket.OPEN) this.ws.send(text); // (else: sent on the next open)
  }

  /** The server took the session's first `events` events, `audioMs` of audio. */
  taken(events, audioMs) {
    const done = events - this.outboxFirst;
    if (done <= 0) return;
    this.outbox.splice(0, done);
    this.outboxFirst = events;
    this.takenAudioMs = audioMs;
  }

  sendAudio(pcm) {
    this.send(appendEvent(pcm));
  }

  fromWorklet(data) {
    if (data.type === "flushed") {
      this.flushed?.();
      return;
    }
    if (data.type !== "audio") return;
    ui.level.value = Math.min(1, data.peak);
    this.capturedMs += ((data.pcm.byteLength / 2) * 1000) / this.rateHz;
    this.marks.push({ endMs: this.capturedMs, at: performance.now() });
    if (this.marks.length > MARKS_KEPT) {
      // Those before the head are done with; with no text for a while, keep the newest.
      this.marks = this.marks.slice(Math.max(this.markHead, this.marks.length - MARKS_KEPT / 2));
      this.markHead = 0;
    }
    if (this.ready) this.sendAudio(data.pcm);
    else if (!this.ended) this.queued.push(appendEvent(data.pcm)); // until the session has our settings
  }

  fromServer(text) {
    let event;
    try {
      event = JSON.parse(text);
    } catch {
      return;
    }
    if (event.event_id) this.lastEventId = event.event_id;
    switch (event.type) {
      case "cosystream.session.resumable":
        this.resume = { token: event.resume_token, windowMs: (event.resume_window_s ?? 30) * 1000 };
        break;
      case "cosystream.session.received":
        this.taken(event.client_events, event.audio_ms);
        break;
      case "cosystream.session.resumed":
        this.taken(event.client_events, event.audio_ms);
        this.lostAt = null;
        this.attempts = 0;
        if (!this.stopping) setStatus("Listening: reconnected, nothing was lost.", "live");
        break;
      case "session.created": {
        const input = {
          format: { type: "audio/pcm", rate: this.rateHz },
          turn_detection: { type: "server_vad", silence_duration_ms: SILENCE_MS },
        };
        // The words to expect go as OpenAI's transcription prompt: the server boosts them.
        const words = ui.words.value.trim();
        if (words) input.transcription = { prompt: words };
        this.send({ type: "session.update", session: { type: "transcription", audio: { input } } });
        break;
      }
      case "session.updated": {
        const rate = event.session?.audio?.input?.format?.rate;
        if (rate && rate !== this.rateHz) {
          this.rateHz = rate;
          this.node.port.postMessage({ type: "configure", rateHz: rate });
        }
        if (!this.ready) {
          this.ready = true;
          for (const append of this.queued) this.send(append);
          this.queued = [];
          if (this.stopping) break;
          if (this.freshBecause) {
            setStatus(`Listening in a new session: ${this.freshBecause}`, "live");
            this.freshBecause = null;
          } else {
            setStatus("Listening: speak now.", "live");
          }
        }
        break;
      }
      case "input_audio_buffer.speech_started":
        this.item = event.item_id;
        ui.partial.dataset.speaking = "true";
        break;
      case "input_audio_buffer.speech_stopped":
        delete ui.partial.dataset.speaking;
        break;
      case "conversation.item.input_audio_transcription.delta": {
        let text = event.transcript;
        if (typeof text !== "string") text = event.replace ? event.delta : this.interim.words.join(" ") + event.delta;
        this.interim.update(text, performance.now(), event.stability ?? 0);
        this.showInterim();
        this.showLatency(event.latency);
        break;
      }
      case "conversation.item.input_audio_transcription.completed": {
        const text = (event.transcript || "").trim();
        this.dropInterim();
        follow(() => {
          ui.partial.textContent = "";
          delete ui.partial.dataset.speaking;
          const startMs = this.timeOffsetMs + (event.start_ms ?? 0);
          if (text) this.transcript.add(startMs, this.timeOffsetMs + (event.end_ms ?? event.start_ms ?? 0), text);
        });
        this.showLatency(event.latency);
        if (event.item_id === this.item) this.item = null;
        this.completedWaiter?.();
        break;
      }
      case "error": {
        const error = event.error || {};
        if (this.stopping && error.code === "input_audio_buffer_commit_empty") break;
        if (this.lostAt !== null && error.code?.startsWith("resume_")) {
          this.resumeRefused = error.message || error.code; // (the close that follows starts a new session)
          break;
        }
        this.lastError = error.message || error.code || "unknown error";
        setStatus(`The server reported an error: ${this.lastError}`, "error");
        break;
      }
      default:
        break;
    }
  }

  /** The live line: the interim's settled words; a timer shows held words as they come due. */
  showInterim() {
    clearTimeout(this.revealTimer);
    this.revealTimer = null;
    const now = performance.now();
    const text = this.interim.shown(now);
    if (text !== ui.partial.textContent) {
      follow(() => {
        ui.partial.textContent = text;
        if (text) ui.empty.hidden = true;
      });
    }
    const due = this.interim.nextRevealMs(now);
    if (due !== null) this.revealTimer = setTimeout(() => this.showInterim(), Math.max(0, due - now));
  }

  dropInterim() {
    clearTimeout(this.revealTimer);
    this.revealTimer = null;
    this.interim.reset();
  }

  showLatency(latency) {
    if (!latency) return;
    if (typeof latency.receive_to_send_ms === "number") {
      ui.latencyServer.textContent = ms(latency.receive_to_send_ms);
    }
    const heardMs = this.timeOffsetMs + latency.audio_processed_ms;
    if (typeof heardMs !== "number" || heardMs <= 0) return;
    // The delay: from when the page got the audio that the text reaches to now.
    const marks = this.marks;
    while (this.markHead < marks.length - 1 && marks[this.markHead].endMs < heardMs) this.markHead++;
    const mark = marks[this.markHead];
    if (mark && mark.endMs >= heardMs) ui.latencyLag.textContent = ms(performance.now() - mark.at);
  }

  closed(event) {
    if (this.stopping || this.ended) {
      this.end();
      return;
    }
    if (this.resumeRefused !== null) {
      const why = this.resumeRefused;
      this.resumeRefused = null;
      this.startFresh(`the server no longer held the old one (${why.split(":")[0]})`);
      return;
    }
    // A drop (no close frame), or a reconnection that did not get through: reconnect.
    if (this.resume && event.code === 1006 && (this.opened || this.lostAt !== null)) {
      this.reconnect();
      return;
    }
    let message;
    if (!this.opened) {
      message = `Could not connect to the server at ${ROOT.host} (WebSocket closed, code ${event.code}).`;
    } else {
      const why = event.reason || this.lastError;
      message = `The server closed the connection (code ${event.code}${why ? `: ${why}` : ""}).`;
    }
    this.fail(message);
  }

  /** Reconnects after a backoff and resumes the session; past its window, opens a new one. */
  async reconnect() {
    if (this.lostAt === null) this.lostAt = performance.now();
    if (performance.now() - this.lostAt > this.resume.windowMs) {
      this.startFresh("the connection was down for longer than the server holds a session");
      return;
    }
    setStatus("The connection dropped: reconnecting… (the microphone is still on)");
    const delayMs = RESUME_BACKOFF_MS[Math.min(this.attempts, RESUME_BACKOFF_MS.length - 1)];
    this.attempts++;
    await new Promise((resolve) => setTimeout(resolve, delayMs));
    if (this.ended || this.stopping) return;
    let secret;
    try {
      secret = await this.clientSecret();
    } catch {
      this.reconnect(); // (unreachable for now: try again, within the window)
      return;
    }
    if (!this.ended && !this.stopping) this.connect(secret, true);
  }

  /** Opens a new session (the old one cannot be resumed), with the audio the server had not taken. */
  async startFresh(why) {
    this.timeOffsetMs += this.takenAudioMs;
    this.queued = this.outbox.map((text) => JSON.parse(text)).filter((e) => e.type === "input_audio_buffer.append");
    Object.assign(this, { resume: null, outbox: [], outboxFirst: 0, lastEventId: null, lostAt: null });
    Object.assign(this, { attempts: 0, takenAudioMs: 0, ready: false, item: null, freshBecause: why });
    this.dropInterim();
    setStatus(`Reconnecting in a new session: ${why}…`);
    try {
      const secret = await this.clientSecret();
      if (!this.ended && !this.stopping) this.connect(secret);
    } catch (err) {
      this.fail(err instanceof PageError ? err.message : `Could not reconnect: ${err?.message || err}`);
    }
  }

  /** Ends the session with `message` shown as an error. */
  fail(message) {
    if (this.ended) return;
    setStatus(message, "error");
    this.release();
    this.ws?.close();
    this.end();
  }

  /** Commits the utterance in progress, waits for its final, then closes. */
  async stop() {
    if (this.stopping || this.ended) return;
    this.stopping = true;
    setStatus("Stopping: finishing the last sentence…");
    if (this.node) {
      await new Promise((resolve) => {
        this.flushed = resolve;
        this.node.port.postMessage({ type: "flush" });
        setTimeout(resolve, 300);
      });
    }
    this.release();
    if (this.ws?.readyState === WebSocket.OPEN && this.ready && this.item) {
      await new Promise((resolve) => {
        this.completedWaiter = resolve;
        this.send({ type: "input_audio_buffer.commit" });
        setTimeout(resolve, STOP_WAIT_MS);
      });
    }
    if (!this.ended) setStatus("Stopped. Press Start to caption again.", "idle");
    this.ws?.close(1000);
    this.end();
  }

  release() {
    this.stream?.getTracks().forEach((track) => track.stop());
    this.context?.close().catch(() => {});
    this.node = null;
    this.context = null;
    ui.level.value = 0;
  }

  end() {
    if (this.ended) return;
    this.ended = true;
    this.queued = [];
    this.dropInterim();
    ui.partial.textContent = "";
    delete ui.partial.dataset.speaking;
    this.onEnd(this);
  }
}

const transcript = new Transcript();
let session = null;

function showRunning(running) {
  ui.start.textContent = running ? "Stop" : "Start";
  ui.start.classList.toggle("running", running);
  ui.token.disabled = running;
  ui.words.disabled = running; // (the words go with the session: a change applies from the next Start)
}

probeToken();

document.getElementById("controls").addEventListener("submit", async (event) => {
  event.preventDefault();
  if (session) {
    ui.start.disabled = true;
    await session.stop();
    ui.start.disabled = false;
    return;
  }
  if (!ui.tokenField.hidden) {
    const token = tokenValue();
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    else sessionStorage.removeItem(TOKEN_KEY);
  }
  const current = new Session(transcript, (ended) => {
    if (session === ended) session = null;
    showRunning(false);
  });
  session = current;
  showRunning(true);
  try {
    await current.start();
  } catch (err) {
    current.fail(err instanceof PageError ? err.message : `Could not start: ${err?.message || err}`);
  }
});

ui.download.addEventListener("click", (event) => {
  if (ui.download.hasAttribute("aria-disabled")) event.preventDefault();
});

ui.token.value = sessionStorage.getItem(TOKEN_KEY) || "";
