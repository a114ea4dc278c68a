// Runs the <script> of sharpi serve's page (fetched from the live server) under node with a small
// DOM stand-in: node's own fetch, streams and timers talk to the server exactly as a browser's
// would. Types MESSAGE into the page, submits it, waits for the answer and for the expert-cache
// plots, and prints what the page showed as JSON (test_serve.py::test_page_chats_and_plots).
//
//   node web_page_harness.js http://127.0.0.1:PORT MESSAGE TEMPERATURE MAX_TOKENS [completion]
// ("completion" ticks the page's completion mode before sending)
"use strict";
const vm = require("vm");

const [base, message, temperature, maxTokens, mode] = process.argv.slice(2);

class Element {
  constructor(id) {
    this.id = id;
    this.children = [];
    this.listeners = {};
    this.dataset = {};
    this.disabled = false;
    this.value = "";
    this.checked = false;
    this.scrollTop = 0;
    this.scrollHeight = 0;
    this.clientWidth = 300;
    this.clientHeight = 110;
    this.className = "";
    this.updates = []; // every textContent written, in order
    this.draws = []; // canvas calls: [name, ...args]
  }
  set textContent(text) {
    this.updates.push(text);
    this.children = [];
  }
  get textContent() {
    return this.updates.length ? this.updates[this.updates.length - 1] : "";
  }
  appendChild(child) {
    this.children.push(child);
    return child;
  }
  addEventListener(kind, fn) {
    this.listeners[kind] = fn;
  }
  requestSubmit() {
    this.listeners.submit({ preventDefault() {} });
  }
  getContext() {
    const draws = this.draws;
    const record = (name) => (...args) => draws.push([name, ...args]);
    return {
      // A redraw starts over: draws holds the latest plot only.
      scale: record("scale"), clearRect: () => draws.splice(0, draws.length), fillText: record("fillText"),
      fillRect: record("fillRect"), beginPath: record("beginPath"), moveTo: record("moveTo"),
      lineTo: record("lineTo"), stroke: record("stroke"), set fillStyle(_) {}, set strokeStyle(_) {},
      set font(_) {},
    };
  }
}

const elements = {};
const document = {
  getElementById: (id) => (elements[id] = elements[id] || new Element(id)),
  createElement: () => new Element(null),
  body: new Element("body"),
};
const page = (url, options) => fetch(new URL(url, base), options);

async function main() {
  const html = await (await fetch(base + "/")).text();
  const script = html.match(/<script>([\s\S]*)<\/script>/)[1];
  const context = vm.createContext({
    document, window: { devicePixelRatio: 1 }, fetch: page, setTimeout, console, TextDecoder, Number, Math,
    JSON, String, Error, AbortController,
  });
  vm.runInContext(script, context);
  const $ = document.getElementById;
  const until = async (what, ok, seconds) => {
    const end = Date.now() + seconds * 1000;
    while (!ok()) {
      if (Date.now() > end) throw new Error("timed out waiting for " + what);
      await new Promise((r) => setTimeout(r, 50));
    }
  };
  await until("the model name", () => $("model").textContent !== "", 30);
  // /props answers soon after /v1/models; a notice, if the page shows one, is written by then.
  await new Promise((r) => setTimeout(r, 500));
  $("completion").checked = mode === "completion";
  $("temperature").value = temperature;
  $("max-tokens").value = maxTokens;
  $("input").value = message;
  $("form").requestSubmit();
  await until("the answer", () => $("send").disabled === false && $("status").textContent !== "", 300);
  const samplesAfterAnswer = Number(document.body.dataset.samples || 0);
  // A poll after the answer ended: the plots and the cache line show the finished request.
  await until("the plots", () => Number(document.body.dataset.samples || 0) > 0 &&
    !$("cache").textContent.includes("generating") && $("cache").textContent.includes("requests"), 30);
  const log = $("log").children;
  const answer = log[log.length - 1];
  const bars = (id) => $(id).draws.filter((d) => d[0] === "fillRect").length;
  const lines = (id) => $(id).draws.filter((d) => d[0] === "lineTo").length;
  console.log(JSON.stringify({
    user: log[0].textContent, answer: answer.textContent, answer_updates: answer.updates.length,
    notice: $("notice").textContent, status: $("status").textContent, cache: $("cache").textContent, samples_after_answer: samplesAfterAnswer,
    hit_bars: bars("plot-hit"), recall_bars: bars("plot-recall"), stall_lines: lines("plot-stall"),
    bytes_lines: lines("plot-bytes"), tps_lines: lines("plot-tps"),
  }));
  process.exit(0);
}

main().catch((e) => {
  console.error(e.stack || String(e));
  process.exit(1);
});
