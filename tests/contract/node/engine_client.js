// An engine in another language: drives a live kvsvc server from Node's @grpc/grpc-js.
//
//   node engine_client.js ADDRESS PROTOS_DIR REFLECTION_DESCRIPTOR_SET POOL
//
// Part 1 loads protos/kvsvc/v1/*.proto and runs an engine's sequence (admit, continue,
// Step, Lookup, GetBlockTable, Free, GetUsage, WatchEvents). Part 2 has no kvsvc .proto
// file at all: it asks the server's grpc.reflection.v1 service for the descriptors and
// calls grpc.health.v1.Health/Check and AdminService/ListPools with them. It prints one
// JSON object of what it saw; the Python test (test_node_client.py) checks it.
"use strict";

const path = require("path");
const fs = require("fs");

const toolsDir = path.resolve(__dirname, "../../../tools/node/node_modules");
const grpc = require(path.join(toolsDir, "@grpc/grpc-js"));
const protoLoader = require(path.join(toolsDir, "@grpc/proto-loader"));

const [address, protosDir, reflectionSetFile, poolName] = process.argv.slice(2);
const LOADER_OPTIONS = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };

function unary(client, method, request) {
  return new Promise((resolve) => {
    client[method](request, { deadline: Date.now() + 10000 }, (error, response) =>
      resolve(error ? { error: { code: error.code, details: error.details } } : { response }),
    );
  });
}

async function engineSequence() {
  const definition = protoLoader.loadSync(
    ["kvsvc/v1/kvcache.proto", "kvsvc/v1/admin.proto"],
    { ...LOADER_OPTIONS, includeDirs: [protosDir] },
  );
  const v1 = grpc.loadPackageDefinition(definition).kvsvc.v1;
  const credentials = grpc.credentials.createInsecure();
  const kv = new v1.KVCacheService(address, credentials);
  const admin = new v1.AdminService(address, credentials);
  const out = {};
  out.pools = (await unary(admin, "ListPools", {})).response.pools.map((p) => [p.name, p.state]);
  const usage0 = (await unary(kv, "GetUsage", { pool: poolName })).response;
  out.block_size = usage0.block_size;
  const prompt = Array.from({ length: 40 }, (_, i) => i + 1);
  out.admit = (
    await unary(kv, "Allocate", {
      pool: poolName,
      request_id: "node-1",
      new_token_ids: prompt,
      num_new_tokens: prompt.length,
      start: {},
    })
  ).response;
  out.continue = (
    await unary(kv, "Allocate", {
      pool: poolName,
      request_id: "node-1",
      new_token_ids: [41],
      num_new_tokens: 1,
    })
  ).response;
  out.no_start = await unary(kv, "Allocate", {
    pool: poolName,
    request_id: "node-2",
    new_token_ids: [1, 2, 3],
    num_new_tokens: 3,
  });
  out.step = (
    await unary(kv, "Step", {
      pool: poolName,
      types: ["STEP_OPERATION_TYPE_ALLOCATE"],
      request_ids: ["node-1"],
      num_token_ids: [1],
      token_ids: [42],
      num_new_tokens: [1],
    })
  ).response;
  out.lookup = (await unary(kv, "Lookup", { pool: poolName, token_ids: prompt })).response;
  out.table = (await unary(kv, "GetBlockTable", { pool: poolName, request_id: "node-1" }))
    .response;
  out.free = (await unary(kv, "Free", { pool: poolName, request_ids: ["node-1"] })).response;
  out.usage = (await unary(kv, "GetUsage", { pool: poolName })).response;
  out.events = await new Promise((resolve) => {
    const stream = kv.WatchEvents({ pool: poolName, from_sequence: 1 });
    stream.on("data", (batch) => {
      stream.cancel();
      resolve({ sequence: batch.sequence, kinds: batch.events.map((e) => e.event) });
    });
    stream.on("error", (error) => {
      if (error.code !== grpc.status.CANCELLED) resolve({ error: error.details });
    });
  });
  kv.close();
  admin.close();
  return out;
}

// A FileDescriptorSet is `repeated FileDescriptorProto file = 1`: tag 0x0a, length, bytes.
function varint(n) {
  const bytes = [];
  while (n > 0x7f) {
    bytes.push((n & 0x7f) | 0x80);
    n = Math.floor(n / 128);
  }
  bytes.push(n);
  return Buffer.from(bytes);
}

function descriptorSet(files) {
  return Buffer.concat(files.flatMap((f) => [Buffer.from([0x0a]), varint(f.length), f]));
}

function reflect(stub, request) {
  return new Promise((resolve, reject) => {
    const call = stub.ServerReflectionInfo();
    call.on("data", (response) => {
      call.end();
      resolve(response);
    });
    call.on("error", reject);
    call.write(request);
  });
}

async function reflectionOnly() {
  const reflectionDefinition = protoLoader.loadFileDescriptorSetFromBuffer(
    fs.readFileSync(reflectionSetFile),
    LOADER_OPTIONS,
  );
  const Reflection = grpc.loadPackageDefinition(reflectionDefinition).grpc.reflection.v1
    .ServerReflection;
  const stub = new Reflection(address, grpc.credentials.createInsecure());
  const listed = await reflect(stub, { list_services: "" });
  const services = listed.list_services_response.service.map((s) => s.name);
  const files = new Map();
  for (const symbol of ["grpc.health.v1.Health", "kvsvc.v1.AdminService"]) {
    const reply = await reflect(stub, { file_containing_symbol: symbol });
    for (const file of reply.file_descriptor_response.file_descriptor_proto) {
      files.set(file.toString("base64"), Buffer.from(file));
    }
  }
  stub.close();
  const definition = protoLoader.loadFileDescriptorSetFromBuffer(
    descriptorSet([...files.values()]),
    LOADER_OPTIONS,
  );
  const loaded = grpc.loadPackageDefinition(definition);
  const credentials = grpc.credentials.createInsecure();
  const health = new loaded.grpc.health.v1.Health(address, credentials);
  const admin = new loaded.kvsvc.v1.AdminService(address, credentials);
  const out = {
    services,
    health: (await unary(health, "Check", { service: "" })).response,
    pools: (await unary(admin, "ListPools", {})).response.pools.map((p) => p.name),
  };
  health.close();
  admin.close();
  return out;
}

(async () => {
  const result = { engine: await engineSequence(), reflection: await reflectionOnly() };
  process.stdout.write(JSON.stringify(result));
})().catch((error) => {
  process.stderr.write(`${error.stack || error}\n`);
  process.exit(1);
});
