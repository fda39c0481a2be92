// What every Node.js client of pagedserve needs: a pagedserve.v1.Generation client built from the
// .proto files at run time, and the google.rpc details a failed call carries in its trailers.
// See docs/clients.md for why each loader option is set.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

// google/rpc/{status,error_details}.proto, vendored; google/protobuf/{any,duration}.proto, which
// they import, ship inside protobufjs.
const VENDORED = path.join(__dirname, '..', 'proto');
const PROTOS = process.env.PAGEDSERVE_PROTOS || path.join(__dirname, '..', '..', 'protos');

const LOADER_OPTIONS = {
  includeDirs: [PROTOS],
  keepCase: true, // field names as in the .proto: by default `max_tokens` is silently ignored
  longs: String, // uint64/int64 fields (seed, LoadReport.queued_prefill_tokens) as strings
  enums: String, // finish_reason as 'FINISH_REASON_STOP', ...
  defaults: true, // unset response fields read as 0, '' or [] instead of undefined
  oneofs: true, // response.matched_stop names the member that is set ('stop_string', ...)
};

/** Adds `authorization: Bearer <key>` to every call: the router's API keys (--api-key-file). */
function bearer(apiKey) {
  return (options, nextCall) =>
    new grpc.InterceptingCall(nextCall(options), {
      start(metadata, listener, next) {
        metadata.set('authorization', `Bearer ${apiKey}`);
        next(metadata, listener);
      },
    });
}

/**
 * A Generation client for `address` (host:port). Plaintext unless `tlsCa` (default
 * $PAGEDSERVE_TLS_CA) names the PEM file of the CA that signed the router's certificate; with
 * `apiKey` (default $PAGEDSERVE_API_KEY) every call carries it. Without TLS the key travels in
 * clear text: use that only on loopback.
 */
function generationClient(address, options = {}) {
  const { PAGEDSERVE_TLS_CA, PAGEDSERVE_API_KEY } = process.env;
  const { tlsCa = PAGEDSERVE_TLS_CA, apiKey = PAGEDSERVE_API_KEY } = options;
  const definition = protoLoader.loadSync('pagedserve/v1/generation.proto', LOADER_OPTIONS);
  const v1 = grpc.loadPackageDefinition(definition).pagedserve.v1;
  const credentials = tlsCa
    ? grpc.credentials.createSsl(fs.readFileSync(tlsCa))
    : grpc.credentials.createInsecure();
  // NOTE: an interceptor rather than call credentials, which grpc-js sends over TLS only
  return new v1.Generation(address, credentials, { interceptors: apiKey ? [bearer(apiKey)] : [] });
}

// NOTE: proto-loader builds service stubs only and cannot decode a message on its own; the
// google.rpc types are read with protobufjs, the parser proto-loader itself runs on.
let rpcRoot = null;
function rpcTypes() {
  if (rpcRoot === null) {
    rpcRoot = new protobuf.Root();
    rpcRoot.resolvePath = (origin, target) => path.join(VENDORED, target);
    rpcRoot.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], {
      keepCase: true,
    });
  }
  return rpcRoot;
}

/** 'INVALID_ARGUMENT' for grpc.status.INVALID_ARGUMENT (3), ... */
function codeName(code) {
  return Object.keys(grpc.status).find((name) => grpc.status[name] === code) || String(code);
}

/**
 * What a failed call says: { code, message, violations: [{ field, description }], retryDelayS }.
 * violations come from a google.rpc.BadRequest detail (INVALID_ARGUMENT), retryDelayS (seconds,
 * or null) from a google.rpc.RetryInfo (RESOURCE_EXHAUSTED). Both travel in the
 * `grpc-status-details-bin` trailer: a serialized google.rpc.Status whose details are Anys.
 */
function errorDetails(error) {
  const out = {
    code: codeName(error.code),
    message: error.details,
    violations: [],
    retryDelayS: null,
  };
  const raw = error.metadata && error.metadata.get('grpc-status-details-bin')[0];
  if (!raw) return out;
  const root = rpcTypes();
  for (const any of root.lookupType('google.rpc.Status').decode(raw).details) {
    const typeName = any.type_url.slice(any.type_url.lastIndexOf('/') + 1);
    if (typeName === 'google.rpc.BadRequest') {
      const badRequest = root.lookupType(typeName).decode(any.value);
      for (const { field, description } of badRequest.field_violations) {
        out.violations.push({ field, description });
      }
    } else if (typeName === 'google.rpc.RetryInfo') {
      const type = root.lookupType(typeName);
      const delay = type.toObject(type.decode(any.value), { longs: Number, defaults: true });
      const { seconds = 0, nanos = 0 } = delay.retry_delay || {};
      out.retryDelayS = seconds + nanos / 1e9;
    }
  }
  return out;
}

/** Prints a failed call's status and details to stderr, one line each. */
function printError(error) {
  const { code, message, violations, retryDelayS } = errorDetails(error);
  console.error(`${code}: ${message}`);
  for (const { field, description } of violations) {
    console.error(`  field ${field}: ${description}`);
  }
  if (retryDelayS !== null) console.error(`  retry after ${retryDelayS} s`);
}

module.exports = { grpc, generationClient, errorDetails, printError, codeName };
