// Streaming sample-rate conversion and 16-bit PCM, for the microphone worklet (and nothing else: no DOM).
//
// The browser captures at the device's rate (48 kHz or 44.1 kHz, rarely what the session wants), and a
// MediaStream cannot be connected to an AudioContext of another rate in every browser, so the worklet
// converts. Each output sample is a windowed-sinc interpolation of the input (a band-limited resampler, as
// in libsamplerate's sinc converters): the kernel is a low-pass at 90% of the lower Nyquist frequency with
// a Blackman window, tabulated at PHASES points per input sample and interpolated linearly between them.
// Measured in Chromium (tests/test_browser.py checks it): 48 kHz or 44.1 kHz -> 16 kHz passes
// 0.3-6 kHz within 0.1 dB (-3 dB near 7 kHz) and keeps what would alias (8.5-20 kHz) more than 75 dB down,
// where averaging every 3 samples leaves them only 4-22 dB down and linear interpolation at an integer
// ratio (picking every 3rd sample) not at all; it costs ~0.4% of a core (211 ms per minute of 48 kHz audio).

const PASSBAND = 0.9; // the low-pass's cutoff, as a fraction of the lower of the two Nyquist frequencies
const ZERO_CROSSINGS = 16; // of the sinc, on each side: the kernel spans 2 * 16 / (2 * cutoff) inputs
const PHASES = 256; // kernel table points per input sample

function blackman(x) {
  // x in [-1, 1]
  return 0.42 + 0.5 * Math.cos(Math.PI * x) + 0.08 * Math.cos(2 * Math.PI * x);
}

export class Resampler {
  /**
   * @param {number} fromHz the input's rate
   * @param {number} toHz the output's rate
   */
  constructor(fromHz, toHz) {
    this.fromHz = fromHz;
    this.toHz = toHz;
    this.step = fromHz / toHz; // input samples per output sample
    this.passthrough = fromHz === toHz;
    const cutoff = 0.5 * Math.min(1, toHz / fromHz) * PASSBAND; // cycles per input sample
    this.halfWidth = ZERO_CROSSINGS / (2 * cutoff); // in input samples
    const size = Math.ceil(this.halfWidth * PHASES) + 2;
    this.table = new Float32Array(size);
    for (let i = 0; i < size; i++) {
      const d = i / PHASES;
      if (d >= this.halfWidth) break;
      const x = 2 * cutoff * d;
      const sinc = x === 0 ? 1 : Math.sin(Math.PI * x) / (Math.PI * x);
      this.table[i] = 2 * cutoff * sinc * blackman(d / this.halfWidth);
    }
    // The input not yet consumed, preceded by zeros so that the first output is centred on input 0.
    const lead = Math.ceil(this.halfWidth);
    this.input = new Float32Array(4096);
    this.length = lead;
    this.time = lead; // where the next output sample sits, in input samples from this.input[0]
    this.output = new Float32Array(1024);
  }

  /**
   * Converts one block (any length) and returns the output it completes: a view of an internal buffer,
   * valid until the next call.
   * @param {Float32Array} block
   * @returns {Float32Array}
   */
  process(block) {
    if (this.passthrough) return block;
    if (this.length + block.length > this.input.length) {
      const grown = new Float32Array(2 * (this.length + block.length));
      grown.set(this.input.subarray(0, this.length));
      this.input = grown;
    }
    this.input.set(block, this.length);
    this.length += block.length;
    const most = Math.ceil(block.length / this.step) + 2;
    if (most > this.output.length) this.output = new Float32Array(2 * most);
    const { input, table, halfWidth, step, output } = this;
    let n = 0;
    let t = this.time;
    while (t + halfWidth < this.length - 1) {
      const first = Math.ceil(t - halfWidth);
      const last = Math.floor(t + halfWidth);
      let sum = 0;
      for (let i = first; i <= last; i++) {
        const x = Math.abs(t - i) * PHASES;
        const k = x | 0;
        sum += input[i] * (table[k] + (x - k) * (table[k + 1] - table[k]));
      }
      output[n++] = sum;
      t += step;
    }
    // Keep only the inputs the next outputs still reach.
    const drop = Math.floor(t - halfWidth) - 1;
    if (drop > 0) {
      input.copyWithin(0, drop, this.length);
      this.length -= drop;
      t -= drop;
    }
    this.time = t;
    return output.subarray(0, n);
  }
}

/**
 * Float samples in [-1, 1] written as 16-bit signed integers into `out` from `offset` (clipped, rounded).
 * @returns {number} the offset after the last sample written
 */
export function writePcm16(samples, out, offset) {
  for (let i = 0; i < samples.length && offset < out.length; i++) {
    const x = Math.max(-1, Math.min(1, samples[i]));
    out[offset++] = Math.round(x < 0 ? x * 0x8000 : x * 0x7fff);
  }
  return offset;
}
