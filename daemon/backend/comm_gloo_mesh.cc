/* comm_gloo_mesh.cc - a Gloo communicator's rendezvous and connections
 * (comm_gloo_mesh.h).
 *
 * Gloo's rendezvous::Context::connectFullMesh does this too, but blocks
 * where nothing from outside can end it: a pair waiting for a peer that
 * published its address and then died waits out its timeout. This is the
 * same exchange (every rank writes the addresses of its pairs, one per
 * peer, under its rank; each pair connects to the address its peer wrote
 * for it), less Gloo's exchange of host names (which only sets the pairs'
 * local ranks, unused by the TCP transport), and it can be cancelled:
 *  - store waits are cut into slices, with comm_cancel_fired between them;
 *  - a fire closes every pair (Gloo 2022-05: Pair::close moves the pair to
 *    CLOSED and wakes its connect, which then returns), and the loop then
 *    throws Cancelled. */
#include "comm_gloo_mesh.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <gloo/transport/pair.h>

namespace zerod_gloo {
namespace {

using std::chrono::milliseconds;
using steady_clock = std::chrono::steady_clock;

/* A wait in the store is asked for in slices of at most this, so that a
 * fired cancel is seen between them. */
constexpr int kStoreSliceMs = 500;

/* Keys under "<prefix>/"; every wait bounded by one deadline for the whole
 * rendezvous and cut short by a cancel. */
class RendezvousStore {
public:
  RendezvousStore(store *st, const std::string &prefix, steady_clock::time_point deadline,
                  comm_cancel *cancel)
      : st_(st), prefix_(prefix + "/"), deadline_(deadline), cancel_(cancel) {}

  void set(const std::string &key, const std::vector<char> &data) {
    const std::string full_key = prefix_ + key;
    int rc = st_->ops->set(st_, full_key.c_str(), data.data(), data.size());
    if (rc < 0)
      throw StoreFailure(rc, key, "store set of '" + full_key + "' failed: " + strerror(-rc));
  }

  std::vector<char> get(const std::string &key) {
    const std::string full_key = prefix_ + key;
    void *value = nullptr;
    size_t value_bytes = 0;
    int rc;
    for (;;) {
      if (comm_cancel_fired(cancel_))
        throw Cancelled();
      int left = remaining_ms();
      int slice = std::min(left, kStoreSliceMs);
      /* A slice of zero makes the C store only look, never wait. */
      rc = st_->ops->get(st_, full_key.c_str(), &value, &value_bytes, slice);
      if (rc != -ETIMEDOUT || slice == left)
        break;
    }
    if (rc < 0)
      throw StoreFailure(rc, key, "store get of '" + full_key + "' failed: " + strerror(-rc));
    const char *bytes = static_cast<const char *>(value);
    std::vector<char> data;
    try {
      data.assign(bytes, bytes + value_bytes);
    } catch (...) {
      free(value);
      throw;
    }
    free(value);
    return data;
  }

private:
  int remaining_ms() const {
    auto left = std::chrono::duration_cast<milliseconds>(deadline_ - steady_clock::now()).count();
    return static_cast<int>(std::max<long long>(left, 0));
  }

  store *st_;
  std::string prefix_;
  steady_clock::time_point deadline_;
  comm_cancel *cancel_;
};

/* The cancel hook while pairs connect: closes every pair of the context
 * (arg), which wakes a connect waiting for its peer. Under the cancel's
 * lock; Pair::close only takes the pair's own lock briefly. */
void close_pairs(void *arg) {
  auto *tc = static_cast<gloo::transport::Context *>(arg);
  for (int peer = 0; peer < tc->size; peer++) {
    if (peer == tc->rank)
      continue;
    try {
      auto &pair = tc->getPair(peer);
      if (pair)
        pair->close();
    } catch (...) {
      /* A pair that cannot close is ended by its timeout. */
    }
  }
}

/* The address that peer published for its pair with rank: peers list one
 * address of equal size per rank but themselves, in rank order. */
std::vector<char> address_for(const std::vector<char> &all, int rank, int peer, int world_size) {
  const size_t n = static_cast<size_t>(world_size - 1);
  if (all.empty() || all.size() % n != 0)
    throw std::runtime_error("rank " + std::to_string(peer) +
                             " published a malformed address list");
  const size_t each = all.size() / n;
  const size_t slot = static_cast<size_t>(rank > peer ? rank - 1 : rank);
  return std::vector<char>(all.begin() + static_cast<long>(slot * each),
                           all.begin() + static_cast<long>((slot + 1) * each));
}

} // namespace

std::shared_ptr<gloo::transport::Context>
connect_pairs(const std::shared_ptr<gloo::transport::Device> &dev, const comm_options *options,
              store *st, milliseconds pair_timeout, steady_clock::time_point deadline) {
  const int rank = options->rank, world_size = options->world_size;
  auto tc = dev->createContext(rank, world_size);
  tc->setTimeout(pair_timeout);
  std::vector<char> addresses;
  for (int peer = 0; peer < world_size; peer++) {
    if (peer == rank)
      continue;
    auto bytes = tc->createPair(peer)->address().bytes();
    addresses.insert(addresses.end(), bytes.begin(), bytes.end());
  }
  CancelHook unhook(options->cancel);
  if (comm_cancel_hook(options->cancel, close_pairs, tc.get()))
    throw Cancelled();
  RendezvousStore rendezvous(st, options->prefix, deadline, options->cancel);
  rendezvous.set(std::to_string(rank), addresses);
  for (int peer = 0; peer < world_size; peer++) {
    if (peer == rank)
      continue;
    auto all = rendezvous.get(std::to_string(peer));
    auto address = address_for(all, rank, peer, world_size);
    if (comm_cancel_fired(options->cancel))
      throw Cancelled();
    tc->getPair(peer)->connect(address);
  }
  /* A pair closed by a fire returns from connect as if connected. */
  if (comm_cancel_fired(options->cancel))
    throw Cancelled();
  return tc;
}

int rank_of_store_key(const std::string &key) {
  const char *digits = key.c_str();
  if (*digits == '\0')
    return -1;
  char *end = nullptr;
  long rank = strtol(digits, &end, 10);
  if (*end != '\0' || rank < 0 || rank > COMM_MAX_WORLD_SIZE)
    return -1;
  return static_cast<int>(rank);
}

} // namespace zerod_gloo
