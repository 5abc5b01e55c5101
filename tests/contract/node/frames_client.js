// An engine in another language on kvsvc's framed transport: plain Node sockets and
// protobufjs, no gRPC, nothing but what protos/kvsvc/v1/frames.proto describes.
//
//   node frames_client.js SOCKET_PATH PROTOS_DIR POOL [TOKEN]
//
// It opens the connection (magic, hello with the token), then calls ListPools, GetUsage,
// Allocate (admission and continuation), Step, GetBlockTable, Free and an Allocate of an
// unknown pool, one frame each, and prints one JSON object of what it saw; the Python
// test (test_frames_node_client.py) checks it against the server.
"use strict";

const net = require("net");
const path = require("path");

const toolsDir = path.resolve(__dirname, "../../../tools/node/node_modules");
const protobuf = require(path.join(toolsDir, "protobufjs"));

const [socketPath, protosDir, poolName, token] = process.argv.slice(2);
const MAGIC = Buffer.from("kvsvcF1\n", "latin1");

function loadTypes() {
  const root = new protobuf.Root();
  root.resolvePath = (_origin, target) => path.join(protosDir, target);
  root.loadSync(["kvsvc/v1/kvcache.proto", "kvsvc/v1/admin.proto", "kvsvc/v1/frames.proto"], {
    keepCase: true,
  });
  return (name) => root.lookupType(`kvsvc.v1.${name}`);
}

// A frame: two little-endian uint32 (header length, body length), the header, the body.
function frame(header, body = Buffer.alloc(0)) {
  const prefix = Buffer.alloc(8);
  prefix.writeUInt32LE(header.length, 0);
  prefix.writeUInt32LE(body.length, 4);
  return Buffer.concat([prefix, header, body]);
}

// Reads whole frames off the socket, one reply per call, in order.
class FrameReader {
  constructor(socket) {
    this.buffer = Buffer.alloc(0);
    this.waiting = [];
    this.frames = [];
    socket.on("data", (chunk) => {
      this.buffer = Buffer.concat([this.buffer, chunk]);
      this.drain();
    });
  }

  drain() {
    while (this.buffer.length >= 8) {
      const headerLength = this.buffer.readUInt32LE(0);
      const bodyLength = this.buffer.readUInt32LE(4);
      if (this.buffer.length < 8 + headerLength + bodyLength) return;
      const header = this.buffer.subarray(8, 8 + headerLength);
      const body = this.buffer.subarray(8 + headerLength, 8 + headerLength + bodyLength);
      this.buffer = this.buffer.subarray(8 + headerLength + bodyLength);
      const next = { header: Buffer.from(header), body: Buffer.from(body) };
      const waiter = this.waiting.shift();
      if (waiter) waiter(next);
      else this.frames.push(next);
    }
  }

  next() {
    const ready = this.frames.shift();
    return ready ? Promise.resolve(ready) : new Promise((resolve) => this.waiting.push(resolve));
  }
}

async function main() {
  const type = loadTypes();
  const FrameHeader = type("FrameHeader");
  const socket = net.createConnection(socketPath);
  await new Promise((resolve, reject) => {
    socket.once("connect", resolve);
    socket.once("error", reject);
  });
  const reader = new FrameReader(socket);
  // Listened for from the start: a refusing server may close before we ask.
  const closed = new Promise((resolve) => socket.once("close", () => resolve(true)));
  const metadata = token ? [{ key: "authorization", value: `Bearer ${token}` }] : [];
  socket.write(MAGIC);
  socket.write(frame(Buffer.from(FrameHeader.encode({ version: 1, metadata }).finish())));
  const hello = FrameHeader.toObject(FrameHeader.decode((await reader.next()).header), {
    defaults: true,
  });

  // One unary call: the method's gRPC path in the header, the request as the body.
  async function call(service, method, requestType, responseType, request) {
    const Request = type(requestType);
    const header = FrameHeader.encode({ method: `/kvsvc.v1.${service}/${method}` }).finish();
    const body = Request.encode(Request.fromObject(request)).finish();
    socket.write(frame(Buffer.from(header), Buffer.from(body)));
    const reply = await reader.next();
    const status = FrameHeader.decode(reply.header);
    const trailing = Object.fromEntries(status.metadata.map((m) => [m.key, m.value]));
    if (status.code) return { error: { code: status.code, details: status.details }, trailing };
    const Response = type(responseType);
    const response = Response.toObject(Response.decode(reply.body), {
      defaults: true,
      enums: String,
      longs: Number,
    });
    return { response, trailing };
  }
  const kv = (method, request) =>
    call("KVCacheService", method, `${method}Request`, `${method}Response`, request);

  const out = { hello: { version: hello.version, code: hello.code } };
  if (hello.code) {
    // A server with tokens refuses an unknown or missing credential at the hello, says
    // why, and closes the connection.
    out.refused = { code: hello.code, details: hello.details };
    out.closed = await closed;
    process.stdout.write(JSON.stringify(out));
    return;
  }
  const pools = await call("AdminService", "ListPools", "ListPoolsRequest", "ListPoolsResponse", {});
  if (pools.error) {
    // Refused (no or a wrong token): the server closes the connection after saying why.
    out.refused = pools.error;
    out.closed = await closed;
    process.stdout.write(JSON.stringify(out));
    return;
  }
  out.pools = pools.response.pools.map((p) => [p.name, p.state]);
  const usage = await kv("GetUsage", { pool: poolName });
  out.block_size = usage.response.block_size;
  out.epoch = usage.trailing["kvsvc-epoch"];
  const prompt = Array.from({ length: 40 }, (_, i) => i + 1);
  const admit = await kv("Allocate", {
    pool: poolName,
    request_id: "node-frames-1",
    new_token_ids: prompt,
    num_new_tokens: prompt.length,
    start: {},
  });
  out.admit = admit.response;
  out.admit_epoch = admit.trailing["kvsvc-epoch"];
  out.continue = (
    await kv("Allocate", {
      pool: poolName,
      request_id: "node-frames-1",
      new_token_ids: [41],
      num_new_tokens: 1,
    })
  ).response;
  out.step = (
    await kv("Step", {
      pool: poolName,
      types: ["STEP_OPERATION_TYPE_ALLOCATE"],
      request_ids: ["node-frames-1"],
      num_token_ids: [1],
      token_ids: [42],
      num_new_tokens: [1],
    })
  ).response;
  out.table = (await kv("GetBlockTable", { pool: poolName, request_id: "node-frames-1" }))
    .response;
  out.unknown_pool = await kv("Allocate", {
    pool: "no-such-pool",
    request_id: "x",
    new_token_ids: [1],
    num_new_tokens: 1,
    start: {},
  });
  out.free = (await kv("Free", { pool: poolName, request_ids: ["node-frames-1"] })).response;
  out.usage = (await kv("GetUsage", { pool: poolName })).response;
  socket.end();
  process.stdout.write(JSON.stringify(out));
}

main().catch((error) => {
  process.stderr.write(`${error.stack || error}\n`);
  process.exit(1);
});
