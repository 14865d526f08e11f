// llama.cpp on one GGUF file through node-llama-cpp's prebuilt CPU binary (npm), for
// bench/_llama_cpp.py. Reads one JSON request on stdin and prints one JSON line.
//
// Common fields: {"gguf": PATH, "threads": T, "mode": "generate" | "score",
//   "flash_attention": true | false | "auto" (default "auto", node-llama-cpp's own default),
//   "batch_size": B (default 512: the prompt in one pass)}
//
// "generate" (default): {"ids": [token ids], "tokens": N} greedy-decodes N tokens after the
//   prompt (after a short warm-up run) and prints
//   {"ttft_s", "tokens", "decode_tps", "wall_s", "resident_bytes", "ids"}.
// "score": {"ids": [...]} or {"text": TEXT, "max_tokens": N} (TEXT tokenized with the file's own
//   tokenizer, first N tokens) evaluates the ids teacher-forced and prints
//   {"ids", "top": [argmax after each of ids[0..n-2]],
//    "logprob": [log p(ids[i+1] | ids[..i])], "resident_bytes"}
//   and, with "logits_path" and "vocab", writes every position's logits there (float32,
//   [n - 1, vocab], row-major).
import { writeFileSync } from "node:fs";
import { getLlama, LlamaLogLevel } from "node-llama-cpp";

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const request = JSON.parse(Buffer.concat(chunks).toString("utf8"));
const mode = request.mode ?? "generate";

const llama = await getLlama({
  gpu: false,
  build: "never",
  usePrebuiltBinaries: true,
  skipDownload: true,
  logLevel: LlamaLogLevel.error,
  maxThreads: request.threads,
});
const model = await llama.loadModel({ modelPath: request.gguf, gpuLayers: 0 });
const ids =
  request.ids ?? Array.from(model.tokenize(request.text)).slice(0, request.max_tokens);
const context = await model.createContext({
  contextSize: Math.max(512, ids.length + (request.tokens ?? 0) + 8),
  batchSize: request.batch_size ?? 512,
  flashAttention: request.flash_attention ?? "auto",
  threads: { ideal: request.threads, min: request.threads },
});

async function generate(prompt, count) {
  const sequence = context.getSequence();
  const out = [];
  let first = null;
  const start = performance.now();
  for await (const token of sequence.evaluate(prompt, { temperature: 0 })) {
    if (first === null) first = performance.now();
    out.push(token);
    if (out.length >= count) break;
  }
  const end = performance.now();
  sequence.dispose();
  return { out, start, first, end };
}

async function score() {
  const sequence = context.getSequence();
  const input = ids.map((id, i) =>
    i + 1 < ids.length ? [id, { generateNext: { logits: true } }] : id,
  );
  const results = await sequence.controlledEvaluate(input);
  const top = [];
  const logprob = [];
  const full = request.logits_path ? new Float32Array((ids.length - 1) * request.vocab) : null;
  for (let i = 0; i + 1 < ids.length; i++) {
    const logits = results[i].next.logits; // Map<token, logit>
    let best = -Infinity;
    let arg = -1;
    for (const [token, value] of logits) {
      if (value > best) {
        best = value;
        arg = token;
      }
      if (full) full[i * request.vocab + token] = value;
    }
    let sum = 0;
    for (const value of logits.values()) sum += Math.exp(value - best);
    top.push(arg);
    logprob.push(logits.get(ids[i + 1]) - best - Math.log(sum));
  }
  if (full) writeFileSync(request.logits_path, Buffer.from(full.buffer));
  sequence.dispose();
  return { ids, top, logprob, resident_bytes: process.memoryUsage().rss };
}

let reply;
if (mode === "score") {
  reply = await score();
} else {
  await generate(ids.slice(0, 4), 2); // warm up
  const run = await generate(ids, request.tokens);
  const decode = (run.end - run.first) / 1000;
  reply = {
    ttft_s: (run.first - run.start) / 1000,
    tokens: run.out.length,
    decode_tps: (run.out.length - 1) / decode,
    wall_s: (run.end - run.start) / 1000,
    resident_bytes: process.memoryUsage().rss,
    ids: run.out,
  };
}
process.stdout.write(JSON.stringify(reply) + "\n");
await context.dispose();
await model.dispose();
await llama.dispose();
