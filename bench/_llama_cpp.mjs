// llama.cpp on one GGUF file through node-llama-cpp's prebuilt CPU binary (npm), for
// bench/_llama_cpp.py. Reads one JSON request on stdin:
//   {"gguf": PATH, "ids": [token ids], "tokens": N, "threads": T}
// greedy-decodes N tokens after the prompt and prints one JSON line:
//   {"ttft_s", "tokens", "decode_tps", "wall_s", "resident_bytes", "ids"}
import { getLlama, LlamaLogLevel } from "node-llama-cpp";

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const request = JSON.parse(Buffer.concat(chunks).toString("utf8"));

const llama = await getLlama({
  gpu: false,
  build: "never",
  usePrebuiltBinaries: true,
  skipDownload: true,
  logLevel: LlamaLogLevel.error,
  maxThreads: request.threads,
});
const model = await llama.loadModel({ modelPath: request.gguf, gpuLayers: 0 });
const context = await model.createContext({
  contextSize: Math.max(512, request.ids.length + request.tokens + 8),
  batchSize: 512,
  threads: { ideal: request.threads, min: request.threads },
});

async function generate(ids, count) {
  const sequence = context.getSequence();
  const out = [];
  let first = null;
  const start = performance.now();
  for await (const token of sequence.evaluate(ids, { temperature: 0 })) {
    if (first === null) first = performance.now();
    out.push(token);
    if (out.length >= count) break;
  }
  const end = performance.now();
  sequence.dispose();
  return { out, start, first, end };
}

await generate(request.ids.slice(0, 4), 2); // warm up
const run = await generate(request.ids, request.tokens);
const ttft = (run.first - run.start) / 1000;
const decode = (run.end - run.first) / 1000;
process.stdout.write(
  JSON.stringify({
    ttft_s: ttft,
    tokens: run.out.length,
    decode_tps: (run.out.length - 1) / decode,
    wall_s: (run.end - run.start) / 1000,
    resident_bytes: process.memoryUsage().rss,
    ids: run.out,
  }) + "\n",
);
await context.dispose();
await model.dispose();
await llama.dispose();
