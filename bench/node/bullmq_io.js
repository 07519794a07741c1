// BullMQ side of bench.io_concurrency: the same webhook job as the pipeline's, on one BullMQ queue.
//
//   node bullmq_io.js work CONCURRENCY        a Worker POSTing each job with global fetch (undici); prints "ready"
//   node bullmq_io.js produce N ENDPOINT      N jobs by Queue.addBulk in chunks of 1,000; prints {"jobs", "seconds"}
//
// Redis from BENCH_REDIS_URL; bullmq and ioredis from NODE_PATH (the benchmark installs them outside the repo).
"use strict";

const crypto = require("node:crypto");
const { Queue, Worker } = require("bullmq");

const QUEUE = "bench-io";
const redis = new URL(process.env.BENCH_REDIS_URL);
const connection = { host: redis.hostname, port: Number(redis.port || 6379), db: Number(redis.pathname.slice(1) || 0) };
const secret = process.env.BENCH_WEBHOOK_SECRET || "bench";

async function deliver(job) {
  const body = JSON.stringify({ event: job.data.event, payload: job.data.payload });
  const stamp = Math.floor(Date.now() / 1000);
  const digest = crypto.createHmac("sha256", secret).update(`${stamp}.`).update(body).digest("hex");
  const response = await fetch(job.data.url, {
    method: "POST",
    body,
    headers: {
      "Content-Type": "application/json",
      "X-Pipeline-Signature": `t=${stamp},v1=${digest}`,
      "Idempotency-Key": String(job.id),
      "X-Pipeline-Event": job.data.event,
    },
    signal: AbortSignal.timeout(60000),
  });
  await response.arrayBuffer();
  if (!response.ok) throw new Error(`${job.data.url} answered ${response.status}`);
  return response.status;
}

async function work(concurrency) {
  const worker = new Worker(QUEUE, deliver, { connection, concurrency });
  worker.on("failed", (job, err) => console.error(`job ${job && job.id} failed: ${err.message}`));
  const stop = async () => {
    await worker.close();
    process.exit(0);
  };
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
  await worker.waitUntilReady();
  console.log("ready");
}

async function produce(n, endpoint) {
  const queue = new Queue(QUEUE, { connection });
  const jobs = [];
  for (let i = 0; i < n; i++) {
    const data = { url: `${endpoint}/hooks/${i}`, event: "record.synced", payload: { id: i, status: "synced" } };
    jobs.push({ name: "webhook", data });
  }
  const started = performance.now();
  for (let i = 0; i < n; i += 1000) await queue.addBulk(jobs.slice(i, i + 1000));
  const seconds = (performance.now() - started) / 1000;
  await queue.close();
  console.log(JSON.stringify({ jobs: n, seconds }));
}

const [mode, ...args] = process.argv.slice(2);
if (mode === "work") work(Number(args[0] || 50));
else if (mode === "produce") produce(Number(args[0]), args[1]).then(() => process.exit(0));
else {
  console.error("usage: node bullmq_io.js work CONCURRENCY | produce N ENDPOINT");
  process.exit(2);
}
