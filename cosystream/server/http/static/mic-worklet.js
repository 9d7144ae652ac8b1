// The microphone's AudioWorklet: mono float blocks at the AudioContext's rate in; 16-bit little-endian
// PCM at the session's rate out, posted to the page in batches of `batchMs`, each with its peak level.
//
// The audio thread only converts and hands over (the buffer is transferred, not copied); encoding and
// sending happen on the page's thread.
//
// Messages from the page: {type: "configure", rateHz, batchMs} (a new output rate: the session's),
// {type: "flush"} (post what is batched now; answered {type: "flushed"}).
// Messages to the page: {type: "audio", pcm: ArrayBuffer, peak: number in [0, 1]}, {type: "flushed"}.

import { Resampler, writePcm16 } from "./resampler.js";

class Pcm16Capture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { rateHz, batchMs } = options.processorOptions;
    this.configure(rateHz, batchMs);
    this.port.onmessage = ({ data }) => {
      if (data.type === "configure") {
        this.post();
        this.configure(data.rateHz, data.batchMs ?? this.batchMs);
      } else if (data.type === "flush") {
        this.post();
        this.port.postMessage({ type: "flushed" });
      }
    };
  }

  configure(rateHz, batchMs) {
    this.rateHz = rateHz;
    this.batchMs = batchMs;
    this.resampler = new Resampler(sampleRate, rateHz); // sampleRate: the AudioContext's (a worklet global)
    this.batch = new Int16Array(Math.max(1, Math.round((rateHz * batchMs) / 1000)));
    this.filled = 0;
    this.peak = 0;
  }

  post() {
    if (this.filled === 0) return;
    const pcm = this.batch.slice(0, this.filled).buffer;
    this.port.postMessage({ type: "audio", pcm, peak: this.peak }, [pcm]);
    this.filled = 0;
    this.peak = 0;
  }

  process(inputs) {
    const channels = inputs[0];
    if (channels.length === 0) return true; // not connected yet (or the track ended): nothing to do
    const mono = channels[0]; // the node is created with channelCount 1: the browser downmixes
    for (let i = 0; i < mono.length; i++) {
      const level = Math.abs(mono[i]);
      if (level > this.peak) this.peak = level;
    }
    const samples = this.resampler.process(mono);
    let done = 0;
    while (done < samples.length) {
      const end = writePcm16(samples.subarray(done), this.batch, this.filled);
      done += end - this.filled;
      this.filled = end;
      if (this.filled === this.batch.length) this.post();
    }
    return true;
  }
}

registerProcessor("pcm16-capture", Pcm16Capture);
