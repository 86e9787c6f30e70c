/* gloo_raw.cc - raw Gloo all-gather, the baseline that bench_comm measures
 * zerod's comm_all_gather against.
 *
 * This file owns gloo_raw_allgather (gloo_raw.h). It uses Gloo exactly as an
 * application would without zerod: a HashStore shared by the ranks of one
 * run, one TCP device and one full-mesh context per rank, and
 * gloo::allgather with separate input and output buffers. Nothing here is
 * shared with daemon/comm_gloo.cc, so that the baseline cannot inherit the
 * wrapper's costs or its bugs. */
#include "gloo_raw.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/barrier.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>

namespace {

constexpr int kWarmupCalls = 2;
constexpr std::chrono::milliseconds kTimeout(120000);

/* A page-aligned allocation, freed with its scope. */
struct PageBuffer {
  explicit PageBuffer(size_t size_bytes) {
    void *p = nullptr;
    if (posix_memalign(&p, 4096, size_bytes > 0 ? size_bytes : 1) != 0)
      throw std::bad_alloc();
    bytes = static_cast<uint8_t *>(p);
  }
  ~PageBuffer() {
    free(bytes);
  }
  PageBuffer(const PageBuffer &) = delete;
  PageBuffer &operator=(const PageBuffer &) = delete;
  uint8_t *bytes = nullptr;
};

struct RankResult {
  std::vector<double> seconds;
  std::string error;
};

void run_rank(gloo::rendezvous::Store &store, int rank, int world, size_t bytes_per_rank, int iters,
              RankResult &result) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, world);
    context->setTimeout(kTimeout);
    context->connectFullMesh(store, device);

    /* Page-aligned like bench_comm's buffers (alignment changes the speed
     * of the copies into and out of the sockets), and touched before timing
     * so that first-touch faults are not billed to the collective. */
    const size_t output_bytes = bytes_per_rank * static_cast<size_t>(world);
    PageBuffer input(bytes_per_rank), output(output_bytes);
    memset(input.bytes, rank + 1, bytes_per_rank);
    memset(output.bytes, 0, output_bytes);
    for (int call = 0; call < kWarmupCalls + iters; call++) {
      gloo::BarrierOptions barrier(context);
      gloo::barrier(barrier);
      const auto started = std::chrono::steady_clock::now();
      gloo::AllgatherOptions options(context);
      options.setInput(input.bytes, bytes_per_rank);
      options.setOutput(output.bytes, output_bytes);
      gloo::allgather(options);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
      if (call >= kWarmupCalls)
        result.seconds.push_back(took.count());
    }
    /* A last barrier keeps every rank's context alive until all are done. */
    gloo::BarrierOptions barrier(context);
    gloo::barrier(barrier);
  } catch (const std::exception &e) {
    result.error = e.what();
  }
}

} // namespace

extern "C" int gloo_raw_allgather(size_t bytes_per_rank, int world, int iters,
                                  double *median_seconds) {
  if (bytes_per_rank == 0 || world < 1 || iters < 1 || median_seconds == nullptr) {
    fprintf(stderr, "gloo_raw_allgather: bad arguments\n");
    return -1;
  }
  try {
    gloo::rendezvous::HashStore store;
    std::vector<RankResult> results(static_cast<size_t>(world));
    std::vector<std::thread> threads;
    for (int rank = 0; rank < world; rank++)
      threads.emplace_back(run_rank, std::ref(store), rank, world, bytes_per_rank, iters,
                           std::ref(results[static_cast<size_t>(rank)]));
    for (auto &thread : threads)
      thread.join();
    for (int rank = 0; rank < world; rank++)
      if (!results[static_cast<size_t>(rank)].error.empty()) {
        fprintf(stderr, "gloo_raw_allgather: rank %d: %s\n", rank,
                results[static_cast<size_t>(rank)].error.c_str());
        return -1;
      }
    std::vector<double> &seconds = results[0].seconds;
    std::sort(seconds.begin(), seconds.end());
    *median_seconds = seconds[seconds.size() / 2];
    return 0;
  } catch (const std::exception &e) {
    fprintf(stderr, "gloo_raw_allgather: %s\n", e.what());
    return -1;
  }
}
