#!/usr/bin/env node
// One chat turn against a pagedserve router, streamed: the router renders the conversation with
// the model's chat template (GenerateRequest.messages) and streams the answer.
//
//   npm ci
//   node chat.js HOST:PORT "Name a colour." [--system TEXT] [--max-tokens N] [--temperature T]
//                                            [--seed S]
//   PAGEDSERVE_TLS_CA=ca.pem PAGEDSERVE_API_KEY=... node chat.js HOST:PORT ...   # TLS, API key
//
// Prints the answer as it streams, then one line "[finish_reason: P prompt tokens, C generated]".
// A failed call prints "CODE: message" on stderr, then one line per google.rpc detail
// ("  field F: description" for a BadRequest, "  retry after S s" for a RetryInfo), exits 1.
'use strict';

const { generationClient, printError } = require('./pagedserve');

function parseArgs(argv) {
  const args = { system: null, maxTokens: 64, temperature: 0, seed: null };
  const rest = [];
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--system') args.system = argv[++i];
    else if (argv[i] === '--max-tokens') args.maxTokens = Number(argv[++i]);
    else if (argv[i] === '--temperature') args.temperature = Number(argv[++i]);
    else if (argv[i] === '--seed') args.seed = argv[++i];
    else rest.push(argv[i]);
  }
  if (rest.length !== 2) {
    console.error('usage: node chat.js HOST:PORT QUESTION [--system TEXT] [--max-tokens N]');
    process.exit(2);
  }
  [args.address, args.question] = rest;
  return args;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const client = generationClient(args.address);
  const messages = [];
  if (args.system) messages.push({ role: 'system', content: args.system });
  messages.push({ role: 'user', content: args.question });
  const sampling = { temperature: args.temperature, max_tokens: args.maxTokens };
  // NOTE: seed is a uint64: a string keeps every digit (a Number is exact only up to 2^53)
  if (args.seed !== null) sampling.seed = args.seed;
  const call = client.Generate({
    messages: { messages }, // the `prompt` oneof: set exactly one of text, token_ids, messages
    add_generation_prompt: true,
    sampling,
    stream: true, // NOTE: false by default: one message when the whole answer is done
  });
  let last = null;
  call.on('data', (response) => {
    process.stdout.write(response.text);
    last = response;
  });
  call.on('error', (error) => {
    printError(error);
    process.exitCode = 1;
  });
  call.on('end', () => {
    if (last === null) return;
    const reason = last.finish_reason.replace('FINISH_REASON_', '').toLowerCase();
    const usage = last.usage;
    process.stdout.write(
      `\n[${reason}: ${usage.prompt_tokens} prompt tokens, ${usage.completion_tokens} generated]\n`,
    );
  });
  // Ctrl-C cancels the call: the router aborts the request and the workers free its blocks.
  process.on('SIGINT', () => {
    call.cancel();
    process.exit(130);
  });
}

main();
