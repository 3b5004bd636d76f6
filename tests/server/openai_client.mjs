// The official OpenAI client library (the `openai` npm package, installed by .ci/setup) calling
// efim-server's /v1/completions with `suffix`, streaming and not, as Continue, Tabby and other
// editors' OpenAI-compatible back ends do.
//
//   node openai_client.mjs NODE_MODULES      (EFIM_URL: the server's address)
import { createRequire } from "node:module";
import assert from "node:assert/strict";
import path from "node:path";

const nodeModules = process.argv[2];
const url = process.env.EFIM_URL;
if (!nodeModules || !url) {
  console.error("usage: EFIM_URL=http://HOST:PORT node openai_client.mjs NODE_MODULES");
  process.exit(2);
}
const { OpenAI } = createRequire(path.resolve(nodeModules) + "/")("openai");
const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: "none", maxRetries: 0 });

const models = await client.models.list();
assert.equal(models.data.length, 1);
const model = models.data[0].id;

const prefix = "import math\n\n\ndef circle_area(radius):\n    \"\"\"The area of a circle.\"\"\"\n    return ";
const suffix = "\n\n\ndef circle_circumference(radius):\n    return 2 * math.pi * radius\n";
const request = { model, prompt: prefix, suffix, max_tokens: 12, temperature: 0, user: "openai-test" };

const first = await client.completions.create(request);
assert.equal(first.object, "text_completion");
assert.equal(first.choices.length, 1);
assert.equal(typeof first.choices[0].text, "string");
assert.ok(["stop", "length"].includes(first.choices[0].finish_reason));
assert.ok(first.usage.prompt_tokens > 20);
assert.equal(first.usage.completion_tokens + first.usage.prompt_tokens, first.usage.total_tokens);

// Streaming, the same request: the same text, then usage with the prompt served from the cache.
const stream = await client.completions.create({ ...request, stream: true, stream_options: { include_usage: true } });
let text = "";
let usage = null;
let finish = null;
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  for (const choice of chunk.choices) {
    text += choice.text;
    if (choice.finish_reason) finish = choice.finish_reason;
  }
}
assert.equal(text, first.choices[0].text);
assert.equal(finish, first.choices[0].finish_reason);
assert.ok(usage.prompt_tokens_details.cached_tokens > 0, "the repeated prompt is served from the cache");

// Typing on at the cursor: the session's prompt is extended, not recomputed.
const typed = await client.completions.create({ ...request, prompt: prefix + "math.pi" });
assert.ok(typed.usage.prompt_tokens_details.cached_tokens >= typed.usage.prompt_tokens - 20);

// Errors come back as the client's APIError with the status and OpenAI's error shape.
await assert.rejects(client.completions.create({ ...request, temperature: 7 }), (e) => {
  assert.equal(e.status, 400);
  assert.equal(e.type, "invalid_request_error");
  return true;
});
console.log(`openai_client: ${model}: ${JSON.stringify(text)}; cached ${usage.prompt_tokens_details.cached_tokens} of ${usage.prompt_tokens}`);
