/* comm_gloo.cc - the Gloo backend of comm.h: collectives between the CPU
 * ranks of a job, over TCP.
 *
 * This file and comm_gloo_mesh.cc own the only C++ in zerod. This one
 * builds one Gloo TCP device and one full-mesh context per communicator
 * (its pairs connected through our rendezvous store by comm_gloo_mesh.cc),
 * ends the rendezvous with a barrier, and runs the collectives: Gloo's own
 * all-gather, all-reduce, broadcast and barrier, and a reduce-scatter of
 * ours written on Gloo's unbound buffers (this Gloo has no options-based
 * reduce-scatter) that sums in rank order. comm.c checks the arguments and
 * calls these through the backend's table (comm_impl.h). Every C++
 * exception is caught before it can reach C and turned into a negative
 * errno and a message kept in the communicator; after the first failure the
 * communicator is broken and its connections are closed (the abort
 * operation), so that peers fail fast instead of waiting out their timeouts
 * and no late transfer can write into a buffer the caller has taken back.
 *
 * Gloo's behaviour this code relies on (Gloo 2022-05, TCP transport):
 *  - A wait that times out throws gloo::IoException ("Timed out waiting ...")
 *    and first closes every pair of the context, so a timed-out context is
 *    dead but can be destroyed without blocking.
 *  - A send is only put on the wire once the peer has posted the matching
 *    receive, so a peer that stops calling shows up as a timeout on our side.
 *  - Gloo writes with writev(2) without MSG_NOSIGNAL: the process must ignore
 *    SIGPIPE, or a peer that dies mid-transfer kills the daemon.
 *  - An unbound buffer's abortWaitRecv/abortWaitSend make its wait in
 *    progress (or its next) return false, from any thread; a buffer
 *    destroyed with operations pending cuts the pairs' references to it
 *    first, so a collective may throw out of any of its waits (comm_abort). */
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <unordered_set>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

/* The C headers have no extern "C" guards of their own (the rest of zerod is
 * C), so the linkage is given here. */
#include "comm_gloo_mesh.h"
#include "comm_impl.h"
extern "C" {
#include "store.h"
}

namespace {

using std::chrono::milliseconds;
using steady_clock = std::chrono::steady_clock;

/* Our slots live under a prefix byte that Gloo's algorithms do not use
 * (gloo/types.h takes 0x01..0x08). Reusing the
 * same slots call after call is safe because calls on a communicator are
 * sequential and Gloo matches sends to receives in order within a slot. */
constexpr uint64_t kReduceScatterSlotBase = uint64_t{0x40} << 56;
constexpr uint64_t kAllToAllSlot = uint64_t{0x41} << 56;
constexpr uint64_t kAllGatherSlot = uint64_t{0x42} << 56;

/* Pairs connect one after another, each waiting up to the timeout divided
 * by this for its peer, so that a few peers that never come still end the
 * creation within about timeout_ms (the barrier after them waits the
 * rest). */
constexpr int kConnectTimeoutDivisor = 5;

/* ---- abort ------------------------------------------------------------- */

/* The message of the exception that makes a collective fail on comm_abort. */
constexpr const char kAbortedMessage[] = "communicator aborted";

class AbortableBuffer;

/* comm_abort must wake the owner's waits from another thread. Gloo's own
 * way (an exception on every pair, as after a timeout) is protected and in
 * headers Debian does not ship whole (tcp/pair.h includes a missing
 * gloo/common/memory.h), so the transport context is wrapped in this
 * decorator once the mesh is connected: every unbound buffer (Gloo's
 * algorithms and ours make all their transfers through them) is created
 * through it and kept in a list while it lives, and abort() sets a flag
 * and makes their waits return (abortWaitRecv, abortWaitSend), which then
 * throw, as does every later wait. After the throw the algorithm unwinds
 * as it does after a timeout: its buffers cut off the references the pairs
 * still hold when they are destroyed, and comm_break closes the
 * connections. */
class AbortableContext final : public gloo::transport::Context {
public:
  explicit AbortableContext(std::shared_ptr<gloo::transport::Context> inner)
      : gloo::transport::Context(inner->rank, inner->size), inner_(std::move(inner)) {
    setTimeout(inner_->getTimeout());
  }

  std::unique_ptr<gloo::transport::Pair> &getPair(int peer) override {
    return inner_->getPair(peer);
  }
  std::unique_ptr<gloo::transport::Pair> &createPair(int peer) override {
    return inner_->createPair(peer);
  }
  std::unique_ptr<gloo::transport::UnboundBuffer> createUnboundBuffer(void *ptr,
                                                                      size_t bytes) override;

  /* From any thread. */
  void abort() noexcept;

  void throw_if_aborted() const {
    if (aborted_.load())
      throw gloo::IoException(kAbortedMessage);
  }
  void add(AbortableBuffer *buffer) {
    std::lock_guard<std::mutex> lock(live_mutex_);
    live_.insert(buffer);
  }
  void remove(AbortableBuffer *buffer) {
    std::lock_guard<std::mutex> lock(live_mutex_);
    live_.erase(buffer);
  }

private:
  std::shared_ptr<gloo::transport::Context> inner_;
  std::atomic<bool> aborted_{false};
  std::mutex live_mutex_; /* held by abort() while it wakes the buffers */
  std::unordered_set<AbortableBuffer *> live_;
};

/* A transport's unbound buffer, forwarded to, whose waits throw once the
 * context is aborted. */
class AbortableBuffer final : public gloo::transport::UnboundBuffer {
public:
  AbortableBuffer(AbortableContext *owner, std::unique_ptr<gloo::transport::UnboundBuffer> inner)
      : gloo::transport::UnboundBuffer(inner->ptr, inner->size), owner_(owner),
        inner_(std::move(inner)) {
    owner_->add(this);
  }
  /* Waits for an abort() that is waking this buffer, before inner_ goes. */
  ~AbortableBuffer() override {
    owner_->remove(this);
  }

  bool waitRecv(int *rank, std::chrono::milliseconds timeout) override {
    owner_->throw_if_aborted();
    bool done = inner_->waitRecv(rank, timeout);
    owner_->throw_if_aborted();
    return done;
  }
  bool waitSend(int *rank, std::chrono::milliseconds timeout) override {
    owner_->throw_if_aborted();
    bool done = inner_->waitSend(rank, timeout);
    owner_->throw_if_aborted();
    return done;
  }
  void abortWaitRecv() override {
    inner_->abortWaitRecv();
  }
  void abortWaitSend() override {
    inner_->abortWaitSend();
  }
  void send(int dstRank, uint64_t slot, size_t offset, size_t nbytes) override {
    inner_->send(dstRank, slot, offset, nbytes);
  }
  void recv(int srcRank, uint64_t slot, size_t offset, size_t nbytes) override {
    inner_->recv(srcRank, slot, offset, nbytes);
  }
  void recv(std::vector<int> srcRanks, uint64_t slot, size_t offset, size_t nbytes) override {
    inner_->recv(std::move(srcRanks), slot, offset, nbytes);
  }

private:
  AbortableContext *owner_;
  std::unique_ptr<gloo::transport::UnboundBuffer> inner_;
};

std::unique_ptr<gloo::transport::UnboundBuffer>
AbortableContext::createUnboundBuffer(void *ptr, size_t bytes) {
  return std::unique_ptr<gloo::transport::UnboundBuffer>(
      new AbortableBuffer(this, inner_->createUnboundBuffer(ptr, bytes)));
}

void AbortableContext::abort() noexcept {
  aborted_.store(true);
  std::lock_guard<std::mutex> lock(live_mutex_);
  for (AbortableBuffer *buffer : live_) {
    try {
      buffer->abortWaitRecv();
      buffer->abortWaitSend();
    } catch (...) {
      /* Gloo's aborts only set a flag under a lock. */
    }
  }
}

/* A Gloo context over pairs that connect_pairs connected (instead of
 * Gloo's rendezvous::Context, whose connectFullMesh cannot be cancelled). */
class ZerodContext : public gloo::Context {
public:
  using gloo::Context::Context;

  void adopt(std::shared_ptr<gloo::transport::Device> device,
             std::shared_ptr<gloo::transport::Context> pairs) {
    device_ = std::move(device);
    transportContext_ = std::move(pairs);
  }

  /* The transport context's timeout, which it copied from its own when its
   * pairs were made. */
  void set_transport_timeout(milliseconds timeout) {
    if (transportContext_)
      transportContext_->setTimeout(timeout);
  }

  /* Puts the connected transport behind an AbortableContext (comm_abort);
   * after set_transport_timeout, which it copies. */
  AbortableContext *make_abortable() {
    auto abortable = std::make_shared<AbortableContext>(transportContext_);
    transportContext_ = abortable;
    return abortable.get();
  }
};

/* The communicator: the common part (comm_impl.h) as its base, so that the
 * C side's comm * is a GlooComm * after a static_cast. Allocated with new,
 * freed by the destroy operation. The device is declared before the context
 * so that the context (whose pairs point into the device) is destroyed
 * first. */
struct GlooComm : comm {
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<ZerodContext> context;
  AbortableContext *abortable = nullptr; /* the context's transport, once connected */
  /* Landing buffers of the reduce-scatter, grown on demand. */
  std::unique_ptr<float[]> scratch;
  size_t scratch_numel = 0;
};

GlooComm *gloo_of(comm *c) {
  return static_cast<GlooComm *>(c);
}

/* ---- errors ------------------------------------------------------------- */

/* The rank a failed wait was waiting for, when the algorithm tells us:
 * Gloo's timeout messages say whether a send or a receive timed out, and in
 * a ring those have one peer each. -1: not known. */
struct PeerHint {
  int recv_rank = -1;
  int send_rank = -1;
};

/* The abort operation: closes every connection of a communicator that has
 * failed (comm_break calls it). After a timeout Gloo has already done so;
 * after any other failure this tells the peers at once (they see
 * "connection closed") instead of letting them wait out their timeouts, and
 * it guarantees that no transfer still queued can touch the caller's
 * buffers once we have returned. */
void close_connections(comm *base) noexcept {
  GlooComm *c = gloo_of(base);
  try {
    if (c->context)
      c->context->closeConnections();
  } catch (...) {
    /* A context whose transport never came up has nothing to close. */
  }
}

bool contains(const std::string &haystack, const char *needle) {
  return haystack.find(needle) != std::string::npos;
}

bool is_timeout_message(const std::string &what) {
  return contains(what, "Timed out") || contains(what, "timeout") || contains(what, "Timeout");
}

/* Gloo's messages start with "[file:line] "; the caller does not need the
 * source position of a library it did not write. */
std::string strip_gloo_location(const std::string &what) {
  if (!what.empty() && what[0] == '[') {
    size_t end = what.find("] ");
    if (end != std::string::npos)
      return what.substr(end + 2);
  }
  return what;
}

/* Classifies a Gloo failure during a collective and breaks the communicator
 * with a message that names the peer where the algorithm lets us. */
int fail_from_gloo(GlooComm *c, const char *op_name, const std::string &what, const PeerHint &hint,
                   steady_clock::time_point started) {
  if (contains(what, kAbortedMessage))
    return comm_break(c, -ECANCELED, "%s: communicator aborted", op_name);
  const auto elapsed_ms =
      std::chrono::duration_cast<milliseconds>(steady_clock::now() - started).count();
  if (is_timeout_message(what) || elapsed_ms >= c->timeout_ms) {
    int peer = -1;
    if (contains(what, "recv operation"))
      peer = hint.recv_rank;
    else if (contains(what, "send operation"))
      peer = hint.send_rank;
    else if (hint.recv_rank == hint.send_rank)
      peer = hint.recv_rank;
    if (peer >= 0)
      return comm_break(c, -ETIMEDOUT,
                        "%s: timed out after %d ms waiting for rank %d (peer dead or not calling)",
                        op_name, c->timeout_ms, peer);
    return comm_break(c, -ETIMEDOUT,
                      "%s: timed out after %d ms waiting for a peer (a rank is dead or not "
                      "calling)",
                      op_name, c->timeout_ms);
  }
  const std::string detail = strip_gloo_location(what);
  if (contains(what, "closed") || contains(what, "reset"))
    return comm_break(c, -ECONNRESET, "%s: connection to a peer lost (%s)", op_name,
                      detail.c_str());
  return comm_break(c, -EIO, "%s: transport error (%s)", op_name, detail.c_str());
}

/* Runs one collective: fails fast on a broken communicator, and turns every
 * exception into an errno, so that none crosses into C. */
template <typename Body>
int run_collective(GlooComm *c, const char *op_name, Body &&body) noexcept {
  if (c->broken_error != 0)
    return c->broken_error;
  const auto started = steady_clock::now();
  PeerHint hint;
  try {
    body(hint);
    return 0;
  } catch (const gloo::IoException &e) {
    return fail_from_gloo(c, op_name, e.what(), hint, started);
  } catch (const gloo::EnforceNotMet &e) {
    /* Gloo's internal checks: a broken invariant, or an operation on a pair
     * whose connection has already failed. */
    return fail_from_gloo(c, op_name, e.what(), hint, started);
  } catch (const std::bad_alloc &) {
    return comm_break(c, -ENOMEM, "%s: out of memory", op_name);
  } catch (const std::system_error &e) {
    int error = e.code().value() > 0 ? -e.code().value() : -EIO;
    return comm_break(c, error, "%s: %s", op_name, e.what());
  } catch (const std::exception &e) {
    return fail_from_gloo(c, op_name, e.what(), hint, started);
  } catch (...) {
    return comm_break(c, -EIO, "%s: unknown C++ exception", op_name);
  }
}

/* The cancel hook during the barrier that ends the rendezvous. */
void abort_barrier(void *arg) {
  static_cast<AbortableContext *>(arg)->abort();
}

/* Connects the full mesh, then (after a barrier, when every rank has read
 * every key) lets rank 0 delete the rendezvous keys so that a long-lived
 * store does not grow by a few keys per job and epoch. */
void connect_mesh(GlooComm *c, const comm_options *options, store *st, const char *hostname) {
  const auto deadline = steady_clock::now() + milliseconds(options->timeout_ms);
  gloo::transport::tcp::attr attr;
  attr.hostname = hostname;
  try {
    c->device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception &e) {
    throw std::system_error(EADDRNOTAVAIL, std::generic_category(),
                            std::string("cannot listen on ") + hostname + ": " +
                                strip_gloo_location(e.what()));
  }

  auto context = std::make_shared<ZerodContext>(options->rank, options->world_size);
  c->context = context;
  const milliseconds timeout(options->timeout_ms);
  context->adopt(c->device,
                 zerod_gloo::connect_pairs(
                     c->device, options, st,
                     std::max(milliseconds(1), timeout / kConnectTimeoutDivisor), deadline));
  context->setTimeout(timeout);
  context->set_transport_timeout(timeout);
  c->abortable = context->make_abortable();

  if (options->world_size > 1) {
    zerod_gloo::CancelHook unhook(options->cancel);
    if (comm_cancel_hook(options->cancel, abort_barrier, c->abortable))
      throw zerod_gloo::Cancelled();
    gloo::BarrierOptions barrier_options(c->context);
    barrier_options.setTimeout(timeout);
    gloo::barrier(barrier_options);
  }
  if (options->rank == 0) {
    /* Best effort: a failure only leaves a few stale keys behind. */
    const std::string key_prefix = std::string(options->prefix) + "/";
    (void)st->ops->delete_prefix(st, key_prefix.c_str());
  }
}

/* ---- reduce-scatter ------------------------------------------------------- */

void add_f32(float *dst, const float *a, const float *b, size_t numel) {
  for (size_t i = 0; i < numel; i++)
    dst[i] = a[i] + b[i];
}

milliseconds remaining_until(steady_clock::time_point deadline) {
  auto left = std::chrono::duration_cast<milliseconds>(deadline - steady_clock::now());
  /* Never negative: -1 means "the context's default" to Gloo. */
  return std::max(left, milliseconds(0));
}

/* Gloo's TCP pair sends a message to an unbound buffer only once the peer
 * has said it is ready to receive it, and that notice (NOTIFY_RECV_READY)
 * waits behind whatever the pair is already sending. A rank that posts its
 * send to a peer whose notice has arrived, and only then its own receive,
 * holds its notice back until its whole send has left: the two directions
 * of the pair run one after the other, and a collective takes twice the
 * link time. So on every pair below the receive is posted before the send. */

/* A reduce-scatter whose sums are taken in rank order: chunk r of the
 * result is ((g0 + g1) + g2) + ... in fp32 on every run, for every world
 * size, exactly as a single process adding the ranks' gradients in order
 * would (the training tests compare against such a reference bit for bit).
 * A ring would add each chunk starting at a different rank.
 *
 * Every rank receives chunk `rank` from the ranks in order 0, 1, ...,
 * two transfers in flight (double buffering), and adds each into the
 * running sum as it lands. Its chunk j goes to rank j when the receive from
 * j is posted (receive first, above). Each rank sends and receives (W-1)/W
 * of the buffer, the same volume as a ring. No deadlock: a rank waits for
 * the lowest peer it has not heard from; that peer's send is posted unless
 * the peer itself waits for a lower rank, and ranks cannot descend forever. */
void ordered_reduce_scatter_f32(GlooComm *c, float *send, float *scratch, float *recv,
                                size_t shard_numel, PeerHint &hint) {
  const auto &context = c->context;
  const int world = c->world_size;
  const int rank = c->rank;
  const auto deadline = steady_clock::now() + milliseconds(c->timeout_ms);
  const size_t shard_bytes = shard_numel * sizeof(float);

  auto send_buffer = context->createUnboundBuffer(send, shard_bytes * static_cast<size_t>(world));
  std::unique_ptr<gloo::transport::UnboundBuffer> landing[2] = {
      context->createUnboundBuffer(scratch, shard_bytes),
      context->createUnboundBuffer(scratch + shard_numel, shard_bytes)};
  /* The remote ranks in the order their chunks are added. */
  std::vector<int> peers;
  for (int j = 0; j < world; j++)
    if (j != rank)
      peers.push_back(j);
  size_t posted = 0;
  auto post_next = [&]() {
    if (posted < peers.size()) {
      const int peer = peers[posted];
      landing[posted % 2]->recv(peer, kReduceScatterSlotBase);
      send_buffer->send(peer, kReduceScatterSlotBase, static_cast<size_t>(peer) * shard_bytes,
                        shard_bytes);
      posted++;
    }
  };
  post_next();
  post_next();

  const float *own = send + static_cast<size_t>(rank) * shard_numel;
  size_t received = 0;
  for (int j = 0; j < world; j++) {
    const float *chunk = own;
    if (j != rank) {
      hint.recv_rank = j;
      landing[received % 2]->waitRecv(remaining_until(deadline));
      chunk = scratch + (received % 2) * shard_numel;
    }
    if (j == 0)
      memcpy(recv, chunk, shard_bytes);
    else
      add_f32(recv, recv, chunk, shard_numel);
    if (j != rank) {
      /* That landing buffer is free again: the next transfer may use it. */
      received++;
      post_next();
    }
  }
  hint.recv_rank = -1;
  for (size_t i = 0; i < peers.size(); i++)
    send_buffer->waitSend(remaining_until(deadline));
}

/* ---- all-gather -------------------------------------------------------------- */

/* Every rank's slice straight to every other rank: all receives posted
 * (into their places in the output) before any send, then this rank's
 * slice sent to each peer. Each rank sends and receives (W-1) slices, as
 * in a ring, with no step waiting for the one before. Gloo's ring for two
 * ranks posts its send before its receive on the one pair (see above). */
void direct_all_gather(GlooComm *c, uint8_t *gathered, size_t bytes, PeerHint &hint) {
  const auto &context = c->context;
  const int world = c->world_size;
  const int rank = c->rank;
  const auto deadline = steady_clock::now() + milliseconds(c->timeout_ms);
  auto buffer = context->createUnboundBuffer(gathered, bytes * static_cast<size_t>(world));
  for (int j = 0; j < world; j++)
    if (j != rank)
      buffer->recv(j, kAllGatherSlot, static_cast<size_t>(j) * bytes, bytes);
  for (int k = 1; k < world; k++)
    buffer->send((rank + k) % world, kAllGatherSlot, static_cast<size_t>(rank) * bytes, bytes);
  /* Slices land in any order; a peer that fails us is named as the lowest
   * one not yet heard from. */
  std::vector<bool> landed(static_cast<size_t>(world), false);
  landed[static_cast<size_t>(rank)] = true;
  for (int k = 1; k < world; k++) {
    hint.recv_rank =
        static_cast<int>(std::find(landed.begin(), landed.end(), false) - landed.begin());
    int from = -1;
    buffer->waitRecv(&from, remaining_until(deadline));
    if (from >= 0 && from < world)
      landed[static_cast<size_t>(from)] = true;
  }
  hint.recv_rank = -1;
  for (int k = 1; k < world; k++)
    buffer->waitSend(remaining_until(deadline));
}

/* ---- all-to-all -------------------------------------------------------------- */

/* Chunk j of send goes to rank j, chunk j of recv comes from rank j: every
 * send and every receive posted at once on two unbound buffers, then
 * waited for. No deadlock: nothing is waited for before everything is
 * posted. */
void all_to_all_bytes(GlooComm *c, const void *send, void *recv, size_t bytes, PeerHint &hint) {
  const auto &context = c->context;
  const int world = c->world_size;
  const int rank = c->rank;
  const auto deadline = steady_clock::now() + milliseconds(c->timeout_ms);
  const size_t total = bytes * static_cast<size_t>(world);
  memcpy(static_cast<uint8_t *>(recv) + static_cast<size_t>(rank) * bytes,
         static_cast<const uint8_t *>(send) + static_cast<size_t>(rank) * bytes, bytes);
  if (world == 1)
    return;
  auto send_buffer = context->createUnboundBuffer(const_cast<void *>(send), total);
  auto recv_buffer = context->createUnboundBuffer(recv, total);
  for (int j = 0; j < world; j++)
    if (j != rank) {
      recv_buffer->recv(j, kAllToAllSlot, static_cast<size_t>(j) * bytes, bytes);
      send_buffer->send(j, kAllToAllSlot, static_cast<size_t>(j) * bytes, bytes);
    }
  for (int k = 0; k < world - 1; k++) {
    hint.recv_rank = (rank + 1 + k) % world;
    recv_buffer->waitRecv(remaining_until(deadline));
  }
  hint.recv_rank = -1;
  for (int k = 0; k < world - 1; k++)
    send_buffer->waitSend(remaining_until(deadline));
}

/* ---- all-reduce ------------------------------------------------------------ */

using ReduceFn = void (*)(void *, const void *, const void *, size_t);

template <typename T> ReduceFn reduce_fn(comm_op op) {
  switch (op) {
  case COMM_SUM:
    return static_cast<ReduceFn>(&gloo::sum<T>);
  case COMM_MAX:
    return static_cast<ReduceFn>(&gloo::max<T>);
  case COMM_MIN:
    return static_cast<ReduceFn>(&gloo::min<T>);
  }
  return nullptr;
}

template <typename T> void all_reduce_typed(GlooComm *c, void *buf, size_t count, comm_op op) {
  gloo::AllreduceOptions options(c->context);
  options.setOutput(static_cast<T *>(buf), count);
  options.setReduceFunction(reduce_fn<T>(op));
  options.setTimeout(milliseconds(c->timeout_ms));
  gloo::allreduce(options);
}

/* ---- the operations ---------------------------------------------------------- */

/* comm.c has checked the arguments (comm_impl.h); what is left is Gloo. */

int gloo_all_gather(comm *base, const void *send, void *recv, size_t bytes_per_rank) {
  GlooComm *c = gloo_of(base);
  uint8_t *gathered = static_cast<uint8_t *>(recv);
  uint8_t *own_slice = gathered + static_cast<size_t>(c->rank) * bytes_per_rank;
  const bool in_place = send == own_slice;

  return run_collective(c, "all_gather", [&](PeerHint &hint) {
    if (!in_place)
      memcpy(own_slice, send, bytes_per_rank);
    if (c->world_size > 1)
      direct_all_gather(c, gathered, bytes_per_rank, hint);
  });
}

int gloo_reduce_scatter_f32(comm *base, float *send, float *recv, size_t shard_numel) {
  GlooComm *c = gloo_of(base);
  const size_t shard_bytes = shard_numel * sizeof(float);
  /* recv doubles as the receive scratch. A recv that is this rank's own
   * shard of send (in place) cannot, since that shard is still an input
   * until the last step, so it gets a scratch of its own. */
  float *own_shard = send + static_cast<size_t>(c->rank) * shard_numel;
  const bool in_place = recv == own_shard;

  return run_collective(c, "reduce_scatter", [&](PeerHint &hint) {
    if (c->world_size == 1) {
      if (!in_place)
        memcpy(recv, send, shard_bytes);
      return;
    }
    /* Two landing buffers, kept between calls (a reduce runs per unit per
     * step); an in-place call sums into a third and copies at the end,
     * since its own chunk is still an input while the sum is built. */
    const size_t need = shard_numel * (in_place ? 3 : 2);
    if (c->scratch_numel < need) {
      c->scratch.reset(new float[need]);
      c->scratch_numel = need;
    }
    float *scratch = c->scratch.get();
    if (in_place) {
      float *sum = scratch + 2 * shard_numel;
      ordered_reduce_scatter_f32(c, send, scratch, sum, shard_numel, hint);
      memcpy(recv, sum, shard_bytes);
    } else {
      ordered_reduce_scatter_f32(c, send, scratch, recv, shard_numel, hint);
    }
  });
}

int gloo_all_to_all(comm *base, const void *send, void *recv, size_t bytes_per_rank) {
  GlooComm *c = gloo_of(base);
  return run_collective(c, "all_to_all", [&](PeerHint &hint) {
    all_to_all_bytes(c, send, recv, bytes_per_rank, hint);
  });
}

int gloo_all_reduce(comm *base, void *buf, size_t count, comm_dtype dtype, comm_op op) {
  GlooComm *c = gloo_of(base);
  return run_collective(c, "all_reduce", [&](PeerHint &) {
    if (c->world_size == 1)
      return;
    switch (dtype) {
    case COMM_F32:
      all_reduce_typed<float>(c, buf, count, op);
      break;
    case COMM_F64:
      all_reduce_typed<double>(c, buf, count, op);
      break;
    case COMM_U8:
      all_reduce_typed<uint8_t>(c, buf, count, op);
      break;
    case COMM_I64:
      all_reduce_typed<int64_t>(c, buf, count, op);
      break;
    }
  });
}

int gloo_broadcast(comm *base, void *buf, size_t bytes, int root) {
  GlooComm *c = gloo_of(base);
  return run_collective(c, "broadcast", [&](PeerHint &hint) {
    if (c->world_size == 1)
      return;
    /* Gloo broadcasts along a binomial tree; with two ranks the only peer
     * is the other one. */
    if (c->world_size == 2)
      hint.recv_rank = hint.send_rank = 1 - c->rank;
    gloo::BroadcastOptions options(c->context);
    options.setOutput(static_cast<uint8_t *>(buf), bytes);
    options.setRoot(root);
    options.setTimeout(milliseconds(c->timeout_ms));
    gloo::broadcast(options);
  });
}

int gloo_barrier(comm *base) {
  GlooComm *c = gloo_of(base);
  return run_collective(c, "barrier", [&](PeerHint &hint) {
    if (c->world_size == 1)
      return;
    if (c->world_size == 2)
      hint.recv_rank = hint.send_rank = 1 - c->rank;
    gloo::BarrierOptions options(c->context);
    options.setTimeout(milliseconds(c->timeout_ms));
    gloo::barrier(options);
  });
}

/* The cancel operation (comm_abort), from another thread: the owner's
 * waits throw, and run_collective breaks the communicator. */
void cancel_calls(comm *base) noexcept {
  GlooComm *c = gloo_of(base);
  if (c->abortable != nullptr)
    c->abortable->abort();
}

/* Gloo's destructors close the sockets and join the device's event-loop
 * thread (which wakes every 10 ms); none of them waits for a peer, so this
 * returns promptly even after a timeout or a peer's death. */
void gloo_destroy(comm *base) {
  GlooComm *c = gloo_of(base);
  try {
    c->context.reset();
    c->device.reset();
  } catch (...) {
    /* Destructors should not throw; if Gloo's does, the memory is lost
     * rather than the process. */
  }
  delete c;
}

/* Filled field by field (C++17 has no designated initialisers, and
 * positional ones would shift silently if comm_ops gained a field), at
 * compile time, so the table exists before any constructor runs. */
constexpr comm_ops make_gloo_ops() {
  comm_ops ops{};
  ops.name = "gloo";
  ops.all_gather = gloo_all_gather;
  ops.reduce_scatter_f32 = gloo_reduce_scatter_f32;
  ops.all_reduce = gloo_all_reduce;
  ops.all_to_all = gloo_all_to_all;
  ops.broadcast = gloo_broadcast;
  ops.barrier = gloo_barrier;
  ops.abort = close_connections;
  ops.destroy = gloo_destroy;
  ops.cancel = cancel_calls;
  return ops;
}

constexpr comm_ops kGlooOps = make_gloo_ops();

} // namespace

/* ---- the C interface -------------------------------------------------------- */

extern "C" int comm_gloo_create(const comm_options *options, store *st, comm **out, char *err,
                                size_t err_bytes) {
  if (err != nullptr && err_bytes > 0)
    err[0] = '\0';
  int rc = comm_check_options(options, st, out, err, err_bytes);
  if (rc != 0)
    return rc;
  *out = nullptr;

  GlooComm *c = new (std::nothrow) GlooComm();
  if (c == nullptr) {
    comm_format_error(err, err_bytes, "create: out of memory");
    return -ENOMEM;
  }
  comm_init_base(c, &kGlooOps, options);
  const char *hostname = options->hostname != nullptr ? options->hostname : "127.0.0.1";

  rc = 0;
  try {
    connect_mesh(c, options, st, hostname);
  } catch (const zerod_gloo::StoreFailure &e) {
    int peer = zerod_gloo::rank_of_store_key(e.key);
    if (e.error == -ETIMEDOUT && peer >= 0)
      comm_format_error(err, err_bytes, "rendezvous: timed out after %d ms waiting for rank %d",
                        options->timeout_ms, peer);
    else if (e.error == -ETIMEDOUT)
      comm_format_error(err, err_bytes, "rendezvous: timed out after %d ms waiting for key '%s'",
                        options->timeout_ms, e.key.c_str());
    else
      comm_format_error(err, err_bytes, "rendezvous: %s", e.what());
    rc = e.error;
  } catch (const std::bad_alloc &) {
    comm_format_error(err, err_bytes, "create: out of memory");
    rc = -ENOMEM;
  } catch (const std::system_error &e) {
    comm_format_error(err, err_bytes, "create: %s", e.what());
    rc = e.code().value() > 0 ? -e.code().value() : -EIO;
  } catch (const std::exception &e) {
    const std::string detail = strip_gloo_location(e.what());
    if (is_timeout_message(e.what())) {
      comm_format_error(err, err_bytes,
                        "rendezvous: timed out after %d ms connecting to peers (%s)",
                        options->timeout_ms, detail.c_str());
      rc = -ETIMEDOUT;
    } else {
      comm_format_error(err, err_bytes, "rendezvous: %s", detail.c_str());
      rc = -EIO;
    }
  } catch (...) {
    comm_format_error(err, err_bytes, "create: unknown C++ exception");
    rc = -EIO;
  }
  if (rc != 0 && comm_cancel_fired(options->cancel)) {
    /* Whatever the fire made fail (a closed pair, an aborted barrier). */
    comm_format_error(err, err_bytes, "rendezvous: cancelled");
    rc = -ECANCELED;
  }
  if (rc != 0) {
    comm_destroy(c);
    return rc;
  }
  *out = c;
  return 0;
}
