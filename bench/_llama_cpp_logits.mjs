// llama.cpp's teacher-forced next-token scores on one GGUF file through node-llama-cpp's
// prebuilt CPU binary (npm), for bench/gguf_agreement.py. Reads one JSON request on stdin:
//   {"gguf": PATH, "text": TEXT, "max_tokens": N, "threads": T}
// tokenizes TEXT with the file's own tokenizer (first N tokens), evaluates them in one pass
// and prints one JSON line:
//   {"ids": [...], "top": [argmax after each of ids[0..n-2]],
//    "logprob": [log p(ids[i+1] | ids[..i])], "resident_bytes"}
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
const ids = Array.from(model.tokenize(request.text)).slice(0, request.max_tokens);
const context = await model.createContext({
  contextSize: Math.max(512, ids.length + 8),
  batchSize: 512,
  threads: { ideal: request.threads, min: request.threads },
});
const sequence = context.getSequence();
const input = ids.map((id, i) =>
  i + 1 < ids.length ? [id, { generateNext: { logits: true } }] : id,
);
const results = await sequence.controlledEvaluate(input);
const top = [];
const logprob = [];
for (let i = 0; i + 1 < ids.length; i++) {
  const logits = results[i].next.logits; // Map<token, logit>
  let best = -Infinity;
  let arg = -1;
  for (const [token, value] of logits) {
    if (value > best) {
      best = value;
      arg = token;
    }
  }
  let sum = 0;
  for (const value of logits.values()) sum += Math.exp(value - best);
  top.push(arg);
  logprob.push(logits.get(ids[i + 1]) - best - Math.log(sum));
}
process.stdout.write(
  JSON.stringify({ ids, top, logprob, resident_bytes: process.memoryUsage().rss }) + "\n",
);
await context.dispose();
await model.dispose();
await llama.dispose();
