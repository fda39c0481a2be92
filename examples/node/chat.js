#!/usr/bin/env node
// One chat turn against a pagedserve router, streamed: the router renders the conversation with
// the model's chat template (GenerateRequest.messages) and streams the answer.
//
//   npm install
//   node chat.js HOST:PORT "Name a colour." [--system TEXT] [--max-tokens N] [--temperature T]
//
// Prints the answer as it streams, then one line "[finish_reason: P prompt tokens, C generated]".
// A gRPC error prints "CODE: details" (with the offending field for INVALID_ARGUMENT) and exits 1.
'use strict';

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = process.env.PAGEDSERVE_PROTOS || path.join(__dirname, '..', '..', 'protos');

function loadGeneration() {
  const definition = protoLoader.loadSync('pagedserve/v1/generation.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto (max_tokens, add_generation_prompt)
    longs: String,
    enums: String, // finish_reason as "FINISH_REASON_STOP", ...
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).pagedserve.v1;
}

function parseArgs(argv) {
  const args = { system: null, maxTokens: 64, temperature: 0 };
  const rest = [];
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--system') args.system = argv[++i];
    else if (argv[i] === '--max-tokens') args.maxTokens = Number(argv[++i]);
    else if (argv[i] === '--temperature') args.temperature = Number(argv[++i]);
    else rest.push(argv[i]);
  }
  if (rest.length !== 2) {
    console.error('usage: node chat.js HOST:PORT QUESTION [--system TEXT] [--max-tokens N]');
    process.exit(2);
  }
  [args.address, args.question] = rest;
  return args;
}

// The field a BadRequest.FieldViolation names, read from the grpc-status-details-bin trailer
// without a google.rpc dependency: Status.details[0] (field 3) is an Any whose value (field 2)
// is a BadRequest; its field_violations (field 1) hold field (1) and description (2).
function violatedField(error) {
  const raw = error.metadata && error.metadata.get('grpc-status-details-bin')[0];
  if (!raw) return null;
  const fields = (buf) => {
    const out = [];
    let i = 0;
    const varint = () => {
      let value = 0;
      let shift = 0;
      for (;;) {
        const byte = buf[i++];
        value += (byte & 0x7f) * 2 ** shift;
        shift += 7;
        if (byte < 0x80) return value;
      }
    };
    while (i < buf.length) {
      const key = varint();
      const wire = key & 7;
      if (wire === 0) varint();
      else if (wire === 2) {
        const len = varint();
        out.push([key >>> 3, buf.subarray(i, i + len)]);
        i += len;
      } else return out; // no other wire type occurs on this path
    }
    return out;
  };
  const pick = (buf, number) => (fields(buf).find(([n]) => n === number) || [])[1];
  const detail = pick(raw, 3);
  const badRequest = detail && pick(detail, 2);
  const violation = badRequest && pick(badRequest, 1);
  const field = violation && pick(violation, 1);
  return field ? field.toString('utf8') : null;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const v1 = loadGeneration();
  const client = new v1.Generation(args.address, grpc.credentials.createInsecure());
  const messages = [];
  if (args.system) messages.push({ role: 'system', content: args.system });
  messages.push({ role: 'user', content: args.question });
  const request = {
    messages: { messages },
    add_generation_prompt: true,
    sampling: { temperature: args.temperature, max_tokens: args.maxTokens },
    stream: true,
  };
  const call = client.Generate(request);
  let last = null;
  call.on('data', (response) => {
    process.stdout.write(response.text);
    last = response;
  });
  call.on('error', (error) => {
    const field = violatedField(error);
    const code = Object.keys(grpc.status).find((name) => grpc.status[name] === error.code);
    console.error(`${code}: ${error.details}${field ? ` (field ${field})` : ''}`);
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
  // Ctrl-C aborts the request (the router cancels it on the workers).
  process.on('SIGINT', () => {
    call.cancel();
    process.exit(130);
  });
}

main();
