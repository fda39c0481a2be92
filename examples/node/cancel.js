#!/usr/bin/env node
// Stops a running generation, the two ways the API offers, and shows that the server ended it.
//
//   node cancel.js HOST:PORT [PROMPT] [--after N] [--abort]
//
// Streams a long greedy generation (ignore_eos, as many tokens as the model allows) and, after N
// responses (default 3):
// - default: cancels the call. The client sees CANCELLED at once; the router aborts the request
//   on the workers, which free its KV blocks. The script then polls GetClusterStatus until the
//   decode workers run nothing and hold no KV blocks (so run it on an otherwise idle cluster).
// - --abort: calls Abort(request_id) on a second call. The server ends the same stream with a
//   last message whose finish_reason is FINISH_REASON_ABORT, and status OK.
// Prints the streamed text, then one line per event in brackets; exits 1 if the server did not
// end the request.
'use strict';

const { grpc, generationClient, printError } = require('./pagedserve');

function parseArgs(argv) {
  const args = { prompt: 'Count from one to one thousand:', after: 3, abort: false };
  const rest = [];
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--after') args.after = Number(argv[++i]);
    else if (argv[i] === '--abort') args.abort = true;
    else rest.push(argv[i]);
  }
  if (rest.length < 1 || rest.length > 2) {
    console.error('usage: node cancel.js HOST:PORT [PROMPT] [--after N] [--abort]');
    process.exit(2);
  }
  [args.address, args.prompt = args.prompt] = rest;
  return args;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Polls until every decode worker runs, queues and holds nothing; false after `timeoutMs`. */
async function decodeWorkersIdle(client, timeoutMs = 10000) {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    const status = await new Promise((resolve, reject) =>
      client.GetClusterStatus({}, (error, reply) => (error ? reject(error) : resolve(reply))),
    );
    const loads = status.workers
      .filter((w) => w.role === 'WORKER_ROLE_DECODE' && w.load)
      .map((w) => w.load);
    const busy = loads.some(
      (l) => l.num_requests_running + l.num_requests_waiting + l.num_requests_swapped > 0,
    );
    if (!busy && loads.every((l) => l.kv_cache_usage === 0)) return true;
    await sleep(100);
  }
  return false;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const client = generationClient(args.address);
  const requestId = `cancel-example-${process.pid}-${Date.now()}`;
  const call = client.Generate({
    request_id: requestId, // chosen here so that Abort can name it
    text: args.prompt,
    sampling: { temperature: 0, ignore_eos: true },
    max_tokens_to_fit: true, // no max_tokens: generate until the context is full
    stream: true,
  });
  let responses = 0;
  call.on('data', (response) => {
    process.stdout.write(response.text);
    if (response.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
      const reason = response.finish_reason.replace('FINISH_REASON_', '').toLowerCase();
      const tokens = response.usage.completion_tokens;
      console.log(`\n[${reason}: the server ended the stream after ${tokens} tokens]`);
      if (response.finish_reason !== 'FINISH_REASON_ABORT') process.exitCode = 1;
      return;
    }
    if (++responses !== args.after) return;
    if (args.abort) {
      client.Abort({ request_id: requestId }, (error, reply) => {
        if (error) printError(error);
        else console.log(`\n[Abort(${requestId}): found=${reply.found}]`);
      });
    } else {
      call.cancel();
    }
  });
  call.on('error', async (error) => {
    if (error.code !== grpc.status.CANCELLED || args.abort) {
      printError(error);
      process.exitCode = 1;
      return;
    }
    console.log(`\n[cancelled by the client after ${responses} responses]`);
    const idle = await decodeWorkersIdle(client);
    console.log(
      idle
        ? '[server: the request ended; decode workers idle, KV cache usage 0]'
        : '[server: decode workers still busy after 10 s]',
    );
    if (!idle) process.exitCode = 1;
  });
}

main();
